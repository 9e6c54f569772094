"""The event objects the event manager makes are the public event types,
whatever it defers.

A stored event's ``blocks`` and a stored block's ``tokens`` are made when
first read (gpukv/event_types.py); the objects must read, compare, hash,
print, copy and pickle exactly as the same events built with the public
constructors, and the fast makers must make what the constructors make.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from gpukv.event_types import (
    KVCacheEvent,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    UniqueToken,
    make_event,
    make_stored_block,
    make_stored_data,
    stored_columns,
    token_ids,
)
from gpukv import sequence_to_blockchain_keys
from tests.support.backends import make_manager

T = 4


def stored_events(tokens):
    """The stored event of committing ``tokens`` (whole blocks) in a fresh manager."""
    mgr = make_manager("cpu", tokens_per_block=T, max_kv_event_entries=1000)
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(len(tokens))
    kv.commit(tokens)
    kv.close()
    return [e for e in mgr.get_latest_events() if isinstance(e.data, KVCacheStoredData)]


def as_built(event: KVCacheEvent, tokens) -> KVCacheEvent:
    """The same event built with the public constructors, from the tokens committed."""
    keys = [k for _, k in sequence_to_blockchain_keys(T, None, tokens)][1:]
    blocks = tuple(KVCacheStoredBlockData(k.hex(), tuple(UniqueToken(t) for t in tokens[i * T:(i + 1) * T]),
                                          0, b.priority)
                   for i, (k, b) in enumerate(zip(keys, event.data.blocks)))
    return KVCacheEvent(event.event_id, KVCacheStoredData(None, blocks), event.window_size, event.hash_algo,
                        0, event.layer_group_id)


def test_blocks_and_tokens_are_made_when_first_read_and_kept():
    tokens = list(range(100, 112))
    (event,) = stored_events(tokens)
    assert "blocks" not in vars(event.data)
    blocks = event.data.blocks
    assert vars(event.data)["blocks"] is blocks is event.data.blocks
    assert len(blocks) == 3 and all("tokens" not in vars(b) for b in blocks)
    assert [token_ids(b) for b in blocks] == [tuple(tokens[i:i + T]) for i in range(0, 12, T)]
    assert all("tokens" not in vars(b) for b in blocks)  # reading the ids makes no token objects
    first = blocks[0].tokens
    assert first == tuple(UniqueToken(t) for t in tokens[:T]) and blocks[0].tokens is first
    assert token_ids(blocks[0]) == tuple(tokens[:T])


def test_a_stored_events_columns_are_its_blocks_read_without_making_them():
    tokens = list(range(30, 42))
    (event,) = stored_events(tokens)
    hashes, ids, levels = stored_columns(event.data)
    assert "blocks" not in vars(event.data)
    blocks = event.data.blocks
    assert hashes == [b.block_hash for b in blocks]
    assert ids == [tuple(t.token_id for t in b.tokens) for b in blocks] == [tuple(tokens[i:i + T]) for i in range(0, 12, T)]
    assert levels == [b.cache_level for b in blocks]
    assert stored_columns(event.data) is None  # made now: read the blocks


@pytest.mark.parametrize("read_first", [False, True], ids=["unread", "read"])
def test_a_deferred_event_is_the_event_the_constructors_build(read_first):
    tokens = list(range(7, 19))
    (event,) = stored_events(tokens)
    if read_first:
        _ = [b.tokens for b in event.data.blocks]
    want = as_built(event, tokens)
    assert event == want and want == event
    assert hash(event) == hash(want)
    assert repr(event) == repr(want)
    assert dataclasses.asdict(event) == dataclasses.asdict(want)
    assert dataclasses.replace(event.data, scope=None) == want.data
    for copied in (pickle.loads(pickle.dumps(event)), copy.copy(event), copy.deepcopy(event)):
        assert copied == want
    unpickled = pickle.loads(pickle.dumps(event.data.blocks[0]))
    assert sorted(vars(unpickled)) == sorted(f.name for f in dataclasses.fields(KVCacheStoredBlockData))


def test_deferred_events_stay_frozen_and_name_missing_attributes():
    (event,) = stored_events(list(range(8)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.data.blocks = ()
    block = event.data.blocks[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        block.tokens = ()
    with pytest.raises(AttributeError, match="'KVCacheStoredBlockData' object has no attribute 'nope'"):
        _ = block.nope
    with pytest.raises(AttributeError, match="'KVCacheStoredData' object has no attribute 'nope'"):
        _ = event.data.nope


def test_the_makers_make_what_the_constructors_make():
    tokens = (UniqueToken(3), UniqueToken("ab" * 32))
    block = make_stored_block("h", tokens, 1, 35, ("ab" * 32,))
    assert block == KVCacheStoredBlockData("h", tokens, 1, 35, ("ab" * 32,))
    assert vars(block) == vars(KVCacheStoredBlockData("h", tokens, 1, 35, ("ab" * 32,)))
    data = make_stored_data(7, (block,), None)
    assert vars(data) == vars(KVCacheStoredData(7, (block,), None))
    event = make_event(4, data, 16, "v2_sha256_64", 1)
    assert vars(event) == vars(KVCacheEvent(4, data, 16, "v2_sha256_64", 0, 1))
    assert token_ids(block) == (3, "ab" * 32)

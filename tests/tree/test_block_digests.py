"""``CacheConfig.block_digests``: with it off the tree computes no SHA-256
chain digests, and nothing an engine sees changes but the events it may no
longer ask for.

Matching and reuse key on the 64-bit chain key and compare tokens, so the
same calls on two managers, one with digests and one without, must give the
same reuse, the same pages and the same match results; only the digest
table differs (one row per block row with them, none without).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

import gpukv
from gpukv import introspect
from gpukv.core.errors import ConfigError
from gpukv.core.hashing import sequence_to_blockchain_keys
from gpukv.core.layout import FLAG_ATTACHED, FLAG_IN_USE, FLAG_ROOT, NULL

from tests.support.backends import make_manager

T = 4


def test_events_need_block_digests():
    with pytest.raises(ConfigError, match="block_digests"):
        gpukv.CacheConfig(max_kv_event_entries=16, block_digests=False)
    with pytest.raises(ConfigError, match="block_digests must be a bool"):
        gpukv.CacheConfig(block_digests=1)
    assert gpukv.CacheConfig().block_digests  # on unless asked: the tree's keys are the reference's


def _drive(mgr, seed: int) -> list:
    """A small serving run with shared prefixes, partial tails, evictions
    and closes; returns everything an engine reads back from it."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(1, 3 * T))] for _ in range(3)]
    seen, running = [], []
    for step in range(24):
        prompt = rng.choice(prefixes) + [rng.randrange(1, 50) for _ in range(rng.randrange(0, 2 * T))]
        if len(prompt) < 2:
            prompt.append(7)
        kv = mgr.create_kv_cache(input_tokens=prompt[:-1])
        reused = kv.num_committed_tokens
        if kv.resume() and kv.resize(len(prompt)):
            kv.commit(prompt[reused:])
            running.append(kv)
            seen.append(("admit", reused, kv.page_indices(0).tolist()))
        else:
            kv.close()
            seen.append(("refused", reused))
        if len(running) > 3 or rng.random() < 0.3:
            done = running.pop(rng.randrange(len(running)))
            seen.append(("close", done.num_committed_tokens))
            done.close()
        m = mgr.match_batch([p + [99] for p in prefixes]).to_host()
        seen.append(("match", m.num_tokens.tolist(), m.block_offsets.tolist()))
    for kv in running:
        kv.close()
    introspect.check_sanity(mgr)
    return seen


@pytest.mark.parametrize("seed", [0, 1])
def test_without_digests_everything_an_engine_reads_is_the_same(backend, seed):
    kw = dict(tokens_per_block=T, pages_per_life_cycle=24, enable_partial_reuse=True)
    on, off = make_manager(backend, **kw), make_manager(backend, block_digests=False, **kw)
    assert _drive(on, seed) == _drive(off, seed)
    t = introspect.tables(on)
    flags = t["blocks"]["flags"]
    live = np.nonzero((flags & (FLAG_IN_USE | FLAG_ATTACHED | FLAG_ROOT)) == (FLAG_IN_USE | FLAG_ATTACHED))[0]
    assert live.size > 0 and (t["digests"][live] != NULL).any(axis=1).all()
    assert t["digests"].shape == (t["blocks"].shape[0], 4)
    assert introspect.tables(off)["digests"].shape == (0, 4)
    assert gpukv.index_memory(off.config).tables["digests"] == 0
    assert gpukv.index_memory(on.config).tables["digests"] == 32 * t["blocks"].shape[0]


def test_without_digests_the_digests_are_the_reference_keys_with_them(backend):
    """The digests a manager with them computes are the reference chain
    keys (the ones the manager without them leaves out)."""
    mgr = make_manager(backend, tokens_per_block=T, pages_per_life_cycle=8)
    tokens = list(range(1, 2 * T + 2))
    introspect.insert_sequence(mgr, tokens)
    keys = [k for _, k in sequence_to_blockchain_keys(T, None, tokens)][1:]
    t = introspect.tables(mgr)
    got = {np.ascontiguousarray(t["digests"][r]).astype("<i8").tobytes()
           for r in np.nonzero(t["blocks"]["flags"] & FLAG_IN_USE)[0] if not t["blocks"]["flags"][r] & FLAG_ROOT}
    assert got == set(keys)


def test_block_handles_without_digests_still_detect_a_reused_row(backend):
    mgr = make_manager(backend, tokens_per_block=T, pages_per_life_cycle=8, block_digests=False)
    a = introspect.make_test_block(mgr, [1, 2, 3, 4], [T])
    assert mgr._tree.resolve(a) == a.row and len(a.key) == 8  # the serial stands for the digest
    mgr._tree.remove_subtree(a)
    b = introspect.make_test_block(mgr, [5, 6, 7, 8], [T])
    assert b.row == a.row and b.key != a.key  # the row went to a new block
    with pytest.raises(ValueError, match="stale"):
        mgr._tree.resolve(a)
    assert mgr._tree.resolve(b) == b.row
    introspect.check_sanity(mgr)

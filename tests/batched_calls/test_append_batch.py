"""``append_batch``: what a step ends with, in one launch, against the
per-cache calls it stands for (``commit``, then ``resize`` to room for more
tokens), on a twin manager, on every backend.

The random batched lockstep (``tests/support/batch_lockstep.py``) also ends
some steps in ``append_batch``, against the oracle; these pin down the
rules one by one: a refused room keeps the commit, an ended cache asks for
no room, a cache with nothing to commit only grows, room is per cache.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpukv import Attention, LogicError, introspect

from tests.support.backends import backend_params, make_manager

T = 4
LAYERS = [Attention(), Attention(window=6)]  # the window's stale pages follow the history the commit leaves


@pytest.fixture(params=backend_params())
def twins(request):
    """A manager on the backend and a cpu twin driven per cache."""
    def manager(backend):
        return make_manager(backend, tokens_per_block=T, layers=LAYERS, pages_per_life_cycle=24)
    return manager(request.param), manager("cpu")


def admit(mgr, prompts) -> list:
    kvs = mgr.create_kv_caches(prompts)
    assert mgr.resume_batch(kvs).all()
    assert mgr.resize_batch(kvs, [len(p) for p in prompts], [0] * len(prompts)).all()
    mgr.commit_batch(kvs, prompts)
    return kvs


def per_cache(kvs, tokens, rooms, ends) -> list:
    """The calls ``append_batch`` stands for, one cache at a time."""
    out = []
    for kv, x, room, end in zip(kvs, tokens, rooms, ends):
        kv.commit(x, is_end=end)
        need = kv.num_committed_tokens + room
        out.append(end or need <= kv.capacity or kv.resize(-(-need // T) * T))
    return out


def stopped(kv) -> bool:
    """Whether ``kv`` ended: a commit is refused (changing nothing). Asked
    only where it ended (else the token would be committed)."""
    try:
        kv.commit([1])
    except LogicError:
        return True
    return False


def same(a, b):
    """Every cache of ``a`` as its twin in ``b``, and both tables sane."""
    for x, y in zip(a, b):
        assert (x.num_committed_tokens, x.history_length, x.capacity, x.status) == (
            y.num_committed_tokens, y.history_length, y.capacity, y.status)
        for lc in range(len(LAYERS)):
            assert list(x.page_indices(lc)) == list(y.page_indices(lc)), f"life cycle {lc}"
    introspect.check_sanity(a[0]._mgr)
    introspect.check_sanity(b[0]._mgr)


def test_decode_steps_equal_commit_then_resize(twins):
    """Decode steps of one token each, room for the next: a block at a time,
    the window's pages released as the history moves, one cache ending and
    one with no token only growing."""
    mgr, twin = twins
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 9], [7, 7], [5, 6, 7, 8, 9, 10]]
    kvs, ws = admit(mgr, prompts), admit(twin, prompts)
    rng = np.random.default_rng(0)
    grew, ended = 0, set()
    for step in range(9):
        live = [i for i in range(len(kvs)) if i not in ended]
        tokens = [[] if i == 2 and step % 3 else ([int(rng.integers(1, 50))] if kvs[i].capacity > kvs[i].num_committed_tokens else [])
                  for i in live]
        ends = [step == 6 and i == 3 for i in live]
        ended.update(i for i, e in zip(live, ends) if e)
        caps = [kvs[i].capacity for i in live]
        got = mgr.append_batch([kvs[i] for i in live], tokens, room=1, is_end=ends)
        want = per_cache([ws[i] for i in live], tokens, [1] * len(live), ends)
        assert got.tolist() == want and all(want)
        grew += sum(kvs[i].capacity > c for i, c in zip(live, caps))
        same(kvs, ws)
    assert grew >= 4
    assert ended == {3} and stopped(kvs[3]) and stopped(ws[3]) and kvs[3].capacity == ws[3].capacity


def test_a_refused_room_keeps_the_commit_and_the_capacity(twins):
    """A pool short for the room refuses only the room: the tokens are
    committed and reusable, the capacity is as it was; the caches after it
    in the batch still get theirs, as per-cache calls in order would."""
    mgr, twin = twins
    prompts = [[i + 1] * 8 for i in range(4)]
    kvs, ws = admit(mgr, prompts), admit(twin, prompts)  # 8 of 24 pages per life cycle left
    rooms = [3 * T + 1, 40 * T, 10 * T, 1]  # the second more than the pool has, the third more than is left
    kvs_cap = [kv.capacity for kv in kvs]
    for batch in (kvs, ws):  # room for the tokens to commit
        assert batch[0]._mgr.resize_batch(batch, [c + 1 for c in kvs_cap]).all()
    tokens = [[20 + i] for i in range(4)]
    got = mgr.append_batch(kvs, tokens, room=rooms)
    want = per_cache(ws, tokens, rooms, [False] * 4)
    assert got.tolist() == want == [True, False, False, True]
    assert kvs[1].num_committed_tokens == 9 and kvs[1].capacity == kvs_cap[1] + 1
    assert list(kvs[1].committed_tokens) == prompts[1] + [21]  # the refused room's cache has its tokens
    same(kvs, ws)


def test_room_zero_only_commits_and_ended_caches_ask_no_room(twins):
    mgr, twin = twins
    prompts = [[1, 2, 3, 4, 5, 6], [9, 8, 7]]
    kvs, ws = admit(mgr, prompts), admit(twin, prompts)
    for batch in (kvs, ws):
        assert batch[0]._mgr.resize_batch(batch, [8, 8]).all()
    caps = [kv.capacity for kv in kvs]
    got = mgr.append_batch(kvs, [[7, 8], [6]], room=[0, 5], is_end=[False, True])
    want = per_cache(ws, [[7, 8], [6]], [0, 5], [False, True])
    assert got.tolist() == want == [True, True]
    assert [kv.capacity for kv in kvs] == caps  # room 0 fits already; an ended cache grows no more
    assert stopped(kvs[1]) and stopped(ws[1])
    same(kvs, ws)


def test_a_cache_batch_is_taken_where_a_list_is(twins):
    """``mgr.cache_batch``: the caches checked once, then taken by every
    batched call as the list would be; what the list is refused for, the
    batch is refused for when made; its states are still checked per call."""
    mgr, twin = twins
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8]]
    kvs, ws = admit(mgr, prompts), admit(twin, prompts)
    batch = mgr.cache_batch(kvs)
    assert batch == tuple(kvs) and not batch.slots.flags.writeable
    for step in range(6):
        tokens = [[step + 1]] * 3
        got = mgr.append_batch(batch, tokens, room=1) if step else mgr.append_batch(batch, [[]] * 3, room=1)
        want = twin.append_batch(ws, tokens, room=1) if step else twin.append_batch(ws, [[]] * 3, room=1)
        assert got.tolist() == want.tolist() == [True] * 3
        same(kvs, ws)
    with pytest.raises(ValueError, match=r"cache_batch\(\): caches\[1\] is caches\[0\] again"):
        mgr.cache_batch([kvs[0], kvs[0]])
    with pytest.raises(ValueError, match=r"cache_batch\(\): caches\[0\] belongs to another manager"):
        mgr.cache_batch(ws[:1])
    with pytest.raises(ValueError, match=r"commit_batch\(\): the cache batch belongs to another manager"):
        twin.commit_batch(batch, [[1]] * 3)
    kvs[1].close()
    with pytest.raises(LogicError, match=r"append_batch\(\): caches\[1\] is CLOSED"):
        mgr.append_batch(batch, [[1]] * 3)
    mgr.close_batch(batch)
    assert [kv.status.name for kv in kvs] == ["CLOSED"] * 3


def test_the_per_cache_append_is_a_batch_of_one(twins):
    """``kv.append`` is ``append_batch([kv])``: chunks of a prefill, each
    committed with room for the next, the last with none; its bad input is
    refused naming the call, nothing changed."""
    mgr, twin = twins
    prompt = list(range(1, 23))
    (kv,), (w,) = admit(mgr, [prompt[:2]]), admit(twin, [prompt[:2]])
    assert kv.resize(5) and w.resize(5)
    chunks = [(2, 5), (5, 14), (14, 22)]
    for k, (start, end) in enumerate(chunks):
        room = chunks[k + 1][1] - end if k + 1 < len(chunks) else 0  # the next chunk's tokens
        got = kv.append(prompt[start:end], room=room)
        want = twin.append_batch([w], [prompt[start:end]], room=room)
        assert got is True and want.tolist() == [True]
        same([kv], [w])
    assert list(kv.committed_tokens) == prompt and kv.capacity == 24  # the room for 22 tokens, in whole blocks
    with pytest.raises(ValueError, match=r"room must be a non-negative int, got -1"):
        kv.append([], room=-1)
    with pytest.raises(TypeError, match=r"is_end must be a bool"):
        kv.append([], is_end=1)
    with pytest.raises(ValueError, match=r"committing 3 tokens would pass the capacity"):
        kv.append([1, 2, 3])
    same([kv], [w])
    kv.close()
    with pytest.raises(LogicError, match=r"append\(\) needs an ACTIVE KV cache; this one is CLOSED"):
        kv.append([1])

"""How a cache's rows grow in the manager's cache pool (``CachePool``).

A cache owns a segment of the pool's block rows, sized at creation for
the input it was created for. A segment that must grow
takes half as much room again as asked, so a cache sized to its prompt
decodes for a while without moving; the segment at the top of the pool grows
where it is; any other moves to the top, its rows copied along. Whatever
moves, what the cache holds and has committed stays exactly as it was.
A resize is bounded by the pools' pages, a refused one keeps no room it
reserved, and the pool shrinks again once a burst of long caches is gone.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

import gpukv
from gpukv import Attention, Ssm, introspect
from gpukv.cache_pool import MAX_BLOCKS_FLOOR

from tests.support.backends import make_manager

T = 4


def manager(backend):
    return gpukv.KVCacheManager(gpukv.CacheConfig(tokens_per_block=T, pages_per_life_cycle=1024, backend=backend,
                                                  layers=[gpukv.Attention(), gpukv.Attention(window=8)]))


def prefill(kv, tokens):
    assert kv.resume()
    assert kv.resize(len(tokens), 0)
    kv.commit(tokens)


def state(kv):
    return (kv.num_committed_tokens, kv.committed_tokens.tolist(), kv.page_indices(0).tolist(),
            kv.page_indices(1).tolist())


def test_a_cache_sized_to_its_prompt_decodes_without_moving(backend):
    mgr = manager(backend)
    kv = mgr.create_kv_cache()
    other = mgr.create_kv_cache()  # above kv in the pool: kv's segment is not the last one
    prefill(other, list(range(1000, 1000 + 2 * T)))
    prefill(kv, list(range(1, 1 + 40 * T)))
    base, rows = introspect.cache_segment(kv)
    assert rows >= 60  # 40 blocks asked, half as much again given
    for n in range(40 * T, 55 * T):  # 15 more blocks, one token at a time
        if n + 1 > kv.capacity:
            assert kv.resize(-(-(n + 1) // T) * T)
        kv.commit([n + 1])
    assert introspect.cache_segment(kv) == (base, rows)
    assert kv.committed_tokens.tolist() == list(range(1, 1 + 55 * T))
    introspect.check_sanity(mgr)


def test_the_last_segment_grows_in_place(backend):
    mgr = manager(backend)
    kv = mgr.create_kv_cache()
    assert kv.resume()
    tokens = list(range(1, 1 + 64 * T))
    seen = set()
    for n0 in range(0, len(tokens), 4 * T):  # a prompt prefilled in chunks right after the cache was created
        assert kv.resize(n0 + 4 * T, n0)
        kv.commit(tokens[n0:n0 + 4 * T])
        seen.add(introspect.cache_segment(kv)[0])
    base, rows = introspect.cache_segment(kv)
    assert len(seen) == 1 and rows >= 64
    assert kv.committed_tokens.tolist() == tokens
    introspect.check_sanity(mgr)


def test_a_cache_created_for_its_input_prefills_it_in_chunks_without_growing(backend):
    """Its segment is sized for the whole input at creation, not for the
    blocks it reuses: interleaved chunked prefills move nothing."""
    mgr = manager(backend)
    shared = list(range(1, 1 + 8 * T))
    prefill(mgr.create_kv_cache(), shared)  # a prefix the others reuse
    prompts = [shared + list(range(100 * i, 100 * i + 40 * T)) for i in (1, 2)]
    kvs = [mgr.create_kv_cache(input_tokens=p[:-1]) for p in prompts]
    assert [kv.num_committed_tokens for kv in kvs] == [8 * T, 8 * T]
    segments = [introspect.cache_segment(kv) for kv in kvs]
    assert all(rows >= len(p) // T + 1 for (_, rows), p in zip(segments, prompts))
    for kv in kvs:
        assert kv.resume()
    for n0 in range(8 * T, len(prompts[0]), 4 * T):  # the two prompts' chunks alternate: neither segment is last for long
        for kv, p in zip(kvs, prompts):
            n1 = min(n0 + 4 * T, len(p))
            assert kv.resize(n1, n0)
            kv.commit(p[n0:n1])
    assert [introspect.cache_segment(kv) for kv in kvs] == segments
    assert [kv.committed_tokens.tolist() for kv in kvs] == prompts
    introspect.check_sanity(mgr)


def test_initial_blocks_gives_the_pool_its_rows_from_the_start(backend):
    """An index started at its steady state starts the caches' rows there
    too: filling it with caches replaces no pool array."""
    mgr = make_manager(backend, tokens_per_block=T, pages_per_life_cycle=256, initial_blocks=256)
    assert introspect.cache_pool_rows(mgr) >= 2 * 256
    tokens_array = mgr._calls.pool.arrays.tokens
    kvs = []
    for i in range(16):  # 16 caches of 12 blocks each: 192 of the 256 pages
        kv = mgr.create_kv_cache(input_tokens=list(range(1000 * i + 1, 1000 * i + 1 + 12 * T)))
        prefill(kv, list(range(1000 * i + 1, 1000 * i + 1 + 12 * T)))
        kvs.append(kv)
    assert mgr._calls.pool.arrays.tokens is tokens_array
    assert all(kv.committed_tokens.tolist() == list(range(1000 * i + 1, 1000 * i + 1 + 12 * T)) for i, kv in enumerate(kvs))
    introspect.check_sanity(mgr)


@pytest.mark.parametrize("caches", [2, 12])  # a move of one segment, and a batch of moves past the pool's end
def test_a_moved_segment_keeps_everything_it_held(backend, caches):
    mgr = manager(backend)
    kvs = [mgr.create_kv_cache() for _ in range(caches)]
    for i, kv in enumerate(kvs):
        prefill(kv, list(range(100 * i + 1, 100 * i + 1 + 3 * T + 1)))
    before = [state(kv) for kv in kvs]
    bases = [introspect.cache_segment(kv)[0] for kv in kvs]
    rows = introspect.cache_pool_rows(mgr)
    # Every cache grows past its room in one batched call: all but the last
    # segment must move (the pool itself grows when the top is reached).
    ok = mgr.resize_batch(kvs, [40 * T] * caches)
    assert ok.all()
    moved = [introspect.cache_segment(kv)[0] != b for kv, b in zip(kvs, bases)]
    assert sum(moved) >= caches - 1
    assert caches < 12 or introspect.cache_pool_rows(mgr) > rows
    for kv, (n, toks, p0, p1) in zip(kvs, before):
        assert kv.num_committed_tokens == n and kv.committed_tokens.tolist() == toks
        assert kv.page_indices(0)[:len(p0)].tolist() == p0  # the new blocks have pages of their own after these
        assert kv.page_indices(1)[:len(p1)].tolist() == p1
        assert kv.capacity == 40 * T
    for kv in kvs:  # and the moved caches work on: commit into their new room
        kv.commit(list(range(7, 7 + 2 * T)))
    introspect.check_sanity(mgr)


def test_the_cpu_kernels_are_called_past_the_dispatcher_while_their_tables_stay():
    """On ``cpu`` a sequence kernel is called as its compiled code while the
    tables and the pool's arrays are the very ones of its last dispatched
    launch (the segment table, replaced by the pool itself, excepted); after
    a table grows the next launch goes through Numba's dispatcher again, and
    input Numba would type apart (read-only, unaligned) is copied first, so
    each kernel keeps its one signature."""
    mgr = manager("cpu")
    pool = mgr._pool
    commit = pool.kernels.commit
    kv = mgr.create_kv_cache()
    prefill(kv, list(range(1, 9)))
    assert kv.resize(2048, 8)
    kv.commit([9])
    tables, arrays, code = pool._compiled[commit]
    assert tables is mgr._tables.device and arrays is pool.arrays
    assert code is next(iter(commit.overloads.values())).entry_point
    other = mgr.create_kv_cache()
    assert other.resume()  # a launch over changed segments: only seg was replaced, the code still serves
    assert pool._compiled[commit][1] is pool.arrays is not arrays
    other.close()
    readonly = np.arange(10, 14, dtype=np.int32)
    readonly.setflags(write=False)
    unaligned = np.frombuffer(b"\0" + np.arange(14, 18, dtype=np.int32).tobytes(), dtype=np.int32, offset=1)
    assert not unaligned.flags.aligned
    kv.commit(readonly)
    kv.commit(unaligned)
    before = mgr._tables.device
    kv.commit(list(range(18, 18 + 300 * T)))  # more blocks than the tables have rows: they grow
    assert mgr._tables.device is not before
    kv.commit([5])  # dispatched again, with the grown tables
    assert pool._compiled[commit][0] is mgr._tables.device
    assert len(commit.overloads) == 1 and len(pool.kernels.size.overloads) == 1
    want = list(range(1, 18 + 300 * T)) + [5]
    assert kv.committed_tokens.tolist() == want
    kv.close()
    assert mgr.probe_reuse(want) >= len(want) // T * T
    introspect.check_sanity(mgr)


# -- what a resize may reserve, and what a burst leaves ---------------------------------------------
@pytest.mark.parametrize("layers", [[Ssm()], [Attention(window=8)], [Attention(window=8), Ssm()]],
                         ids=["ssm", "window", "window+ssm"])
def test_a_resize_past_what_a_cache_may_have_is_refused_without_full_attention(layers):
    """Without full attention no pool bounds a cache's blocks by itself; a
    resize to more blocks than a cache may have (every page of the GPU pools,
    at least ``MAX_BLOCKS_FLOOR``) is refused (False, nothing changed,
    nothing reserved) instead of growing the cache pool to its size or
    raising MemoryError. Below it, more blocks than pages are fine (an SSM
    state is one page whatever the length)."""
    mgr = make_manager("cpu", tokens_per_block=T, layers=layers, pages_per_life_cycle=64,
                       commit_min_snapshot=True)
    kv = mgr.create_kv_cache()
    assert kv.resume()
    pool = mgr._pool
    assert pool.max_blocks == MAX_BLOCKS_FLOOR
    assert kv.resize(200 * T, 200 * T)  # more blocks than the pools have pages
    rows = pool.num_rows
    for capacity in (pool.max_blocks * T + 1, 10**8, 10**15):
        assert kv.resize(capacity, capacity) is False
        assert mgr.resize_batch([kv], [capacity], [capacity]).tolist() == [False]
        assert (kv.capacity, kv.history_length) == (200 * T, 200 * T) and pool.num_rows == rows
    kv.close()


def test_a_refused_resize_gives_back_the_segment_it_reserved():
    mgr = make_manager("cpu", tokens_per_block=T, pages_per_life_cycle=16)
    hog = mgr.create_kv_cache()
    assert hog.resume() and hog.resize(12 * T)
    caches = mgr.create_kv_caches([[]] * 8)
    assert mgr.resume_batch(caches).all()
    pool = mgr._pool
    before = pool.seg[[kv._slot for kv in caches], 1].copy()
    # Each asks for more pages than are left (but fewer than the pool): refused by the kernel.
    assert not mgr.resize_batch(caches, [10 * T] * 8).any()
    assert not caches[0].resize(10 * T)
    assert pool.seg[[kv._slot for kv in caches], 1].tolist() == before.tolist()
    assert all(kv.capacity == 0 for kv in caches)
    assert mgr.resize_batch(caches[:1], [4 * T]).all()  # still sized as asked when it fits
    mgr.close_batch(caches + [hog])
    introspect.check_sanity(mgr)


def test_the_pool_gives_rows_back_after_a_burst():
    """A burst of long caches grows the pool; once they are gone it packs into
    a small one again, and a steady state afterwards does not repack."""
    mgr = make_manager("cpu", tokens_per_block=T, pages_per_life_cycle=4096)
    pool = mgr._pool
    idle = pool.num_rows
    burst = mgr.create_kv_caches([[]] * 64)
    assert mgr.resume_batch(burst).all()
    assert mgr.resize_batch(burst, [60 * T] * 64).all()
    grown = pool.num_rows
    assert grown > 4096
    mgr.close_batch(burst)
    del burst
    gc.collect()
    steady = mgr.create_kv_caches([[1, 2, 3]] * 2)  # the next allocation takes the slots back
    assert pool.num_rows <= max(idle, 1024), (idle, grown, pool.num_rows)
    sizes = set()
    for _ in range(40):  # a steady state: caches come and go, the pool's size stays
        kv = mgr.create_kv_cache(input_tokens=[1, 2, 3])
        assert kv.resume() and kv.resize(8 * T)
        kv.close()
        del kv
        gc.collect()
        sizes.add(pool.num_rows)
    assert len(sizes) == 1 and max(sizes) <= 1024, sizes
    mgr.close_batch(steady)


def test_a_presized_pool_keeps_its_rows_through_a_lull():
    """``initial_blocks`` sizes the pool for the steady state: when load falls
    the pool gives back only what it grew beyond that, so the next burst
    finds its rows (the same arrays) instead of packing into fresh memory."""
    mgr = make_manager("cpu", tokens_per_block=T, pages_per_life_cycle=8192, initial_blocks=4096)
    pool = mgr._pool
    presized = pool.num_rows
    assert presized >= 2 * 4096
    tokens_array = pool.arrays.tokens
    for _ in range(3):  # a lull: one short cache at a time, each collected before the next comes
        kv = mgr.create_kv_cache(input_tokens=[1, 2, 3])
        assert kv.resume() and kv.resize(8 * T)
        kv.close()
        del kv
        gc.collect()
    mgr.create_kv_cache().close()  # the allocation that takes the slots back
    assert pool.num_rows == presized and pool.arrays.tokens is tokens_array
    burst = mgr.create_kv_caches([[]] * 64)  # past the presized rows: the pool grows ...
    assert mgr.resume_batch(burst).all() and mgr.resize_batch(burst, [120 * T] * 64).all()
    assert pool.num_rows > presized
    mgr.close_batch(burst)
    del burst
    gc.collect()
    mgr.create_kv_cache().close()
    assert pool.num_rows == presized  # ... and shrinks back to its presized rows, not below


def test_new_caches_take_the_lowest_free_slots_and_lose_none():
    """A new cache takes the lowest free slot: those of collected caches come
    back, and the slot list grows only when every slot is taken. A slot an
    interrupted allocation took off the free list before taking it is still
    free, and a later allocation finds it."""
    mgr = make_manager("cpu", tokens_per_block=T, pages_per_life_cycle=256)
    pool = mgr._pool
    slots_before = pool.serial.shape[0]
    caches = mgr.create_kv_caches([[]] * 8)
    assert sorted(kv._slot for kv in caches) == list(range(8))
    gone = {caches[2]._slot, caches[5]._slot}
    mgr.close_batch([caches[2], caches[5]])
    del caches[5], caches[2]
    gc.collect()
    again = mgr.create_kv_caches([[]] * 2)
    assert {kv._slot for kv in again} == gone
    # An allocation cut short between choosing its slot and taking it.
    (lost,) = pool._free_slots(1)
    assert pool.serial[lost] < 0
    rest = mgr.create_kv_caches([[]] * (slots_before - 8))
    assert pool.serial.shape[0] == slots_before  # the lost slot was found: no growth
    assert lost in {kv._slot for kv in rest}
    more = mgr.create_kv_cache()  # every slot taken: now the list grows
    assert pool.serial.shape[0] > slots_before and more._slot == slots_before
    held = [kv._slot for kv in caches + again + rest + [more]]
    assert len(set(held)) == len(held)

"""Eviction throughput and the cost of an allocation under pressure, on the
Mooncake trace (docs/semantics.md §2.11).

The GPU pool (``POOL`` pages of one full-attention life cycle, T = 32) is
filled with the cached prompts of trace requests (each hash id expanded to 512
deterministic tokens), every page droppable, as after a busy period. Every
round starts from such a full pool (rebuilt untimed).

* ``evict_pool``: free the whole pool in one call (``OP_EVICT``: the serial
  kernel takes the victims from the heads of its candidate lists, least
  recently used first, each page death running the tree cleanup); pages freed per second
  (pages that die with an evicted ancestor's subtree count as freed too).
* ``python_lru``: the plain-Python reference of the same work, an
  ``OrderedDict`` LRU popping the same number of entries and deleting their
  blocks from a dict index (no tree cleanup, no priorities).
* ``alloc_pressure`` vs ``alloc_free``: the end-to-end allocation a scheduler
  makes for a new request, ``create_kv_cache`` + ``resume`` + ``resize`` to its
  prompt length + ``commit`` (prefill done) + ``close``, for ``ALLOC_REQUESTS`` trace requests not in the
  tree, once with the pool full (every page allocated evicts one) and once with
  enough free pages; tokens/s = prompt tokens / round time. Their ratio is the
  price of eviction on the allocation path.

``bench/tools/report.py`` prints pages/s and tokens/s.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest

import gpukv
from gpukv import introspect
from gpukv.sim.workload import find_mooncake_trace, load_mooncake_trace
from . import knobs

T = 32
POOL = knobs.integer("evict-pool")
ALLOC_REQUESTS = 32


@pytest.fixture(scope="module")
def trace():
    path = find_mooncake_trace()
    if path is None:
        pytest.skip("the Mooncake trace is not in shared/data (set GPUKV_TRACE)")
    requests = [r.tokens() for r in load_mooncake_trace(path, limit=3000)]
    return requests[:-ALLOC_REQUESTS], requests[-ALLOC_REQUESTS:]


def full_manager(cached, extra_pages: int = 0) -> gpukv.KVCacheManager:
    """A manager whose GPU pool is full of droppable cached prompt pages."""
    mgr = gpukv.KVCacheManager(gpukv.CacheConfig(
        tokens_per_block=T, layers=[gpukv.Attention()], pages_per_life_cycle=POOL + extra_pages, backend="cpu"))
    used = 0
    for tokens in cached:
        used += introspect.insert_sequence(mgr, tokens)
        if used >= POOL:
            break
    assert used >= POOL, "the trace prefix is too short to fill the pool"
    return mgr


def test_evict_pool(benchmark, trace):
    cached, _ = trace
    state = {}

    def setup():
        state["mgr"] = full_manager(cached)
        return (), {}

    def run():
        assert state["mgr"]._tree.evict(0, 0, POOL)

    benchmark.pedantic(run, setup=setup, rounds=5, warmup_rounds=1)
    mgr = state["mgr"]
    assert int(mgr._backend.to_host(mgr._tables.pool_top)[0]) == POOL  # all free
    # Most pages are evicted; the rest die with an evicted ancestor's subtree.
    evicted = mgr.get_and_reset_eviction_stats()["evicted"]
    assert evicted > POOL // 2
    benchmark.extra_info.update(suite="evict", case="evict_pool", pages=POOL, evicted=evicted)


def test_python_lru(benchmark, trace):
    cached, _ = trace
    state = {}

    def setup():
        lru: OrderedDict = OrderedDict()
        index: dict = {}
        for i, tokens in enumerate(cached):
            parent = -1
            for j in range(0, tokens.size, T):
                key = hash((parent, tuple(tokens[j:j + T].tolist())))
                index[key] = parent
                lru[key] = None
                lru.move_to_end(key)
                parent = key
            if len(lru) >= POOL:
                break
        state["lru"], state["index"] = lru, index
        return (), {}

    def run():
        lru, index = state["lru"], state["index"]
        for _ in range(POOL):
            key, _ = lru.popitem(last=False)
            index.pop(key, None)

    benchmark.pedantic(run, setup=setup, rounds=5, warmup_rounds=1)
    benchmark.extra_info.update(suite="evict", case="python_lru", pages=POOL)


@pytest.mark.parametrize("case", ["alloc_pressure", "alloc_free"])
def test_allocation(benchmark, trace, case):
    cached, fresh = trace
    state = {}
    tokens = sum(int(t.size) for t in fresh)

    def setup():
        extra = 0 if case == "alloc_pressure" else sum(-(-t.size // T) for t in fresh)
        state["mgr"] = full_manager(cached, extra)
        return (), {}

    def run():
        mgr = state["mgr"]
        for prompt in fresh:  # one scheduler admission each
            kv = mgr.create_kv_cache(prompt)
            assert kv.resume() and kv.resize(int(prompt.size))
            kv.commit(prompt[kv.num_committed_tokens:])  # cached: the next admission must evict again
            kv.close()

    benchmark.pedantic(run, setup=setup, rounds=5, warmup_rounds=1)
    evicted = state["mgr"].get_and_reset_eviction_stats()["evicted"]
    assert (evicted > 0) == (case == "alloc_pressure")
    benchmark.extra_info.update(suite="evict", case=case, tokens=tokens, requests=len(fresh), evicted_last_round=evicted)

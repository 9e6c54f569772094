"""``mgr.obtainable_pages(life_cycle_id, level)``: free plus evictable pages,
from the counts the eviction lists keep (no pass over the pool).

Each test checks the count against a count made from the page table by hand
and against what an allocation can really get.
"""

from __future__ import annotations

import pytest

from gpukv import Attention, introspect
from gpukv.core.layout import PAGE_FREE, PAGE_COMMITTED
from gpukv.introspect import page_life_cycles

from tests.support.backends import make_manager

T = 4


def counted_by_hand(mgr, lc, level):
    """Pages of the pool no allocation may take are the locked ones, and the
    held ones where they cannot move down a level; the rest are obtainable."""
    rows = introspect.tables(mgr)["pages"]
    mine = rows[page_life_cycles(mgr._tables) == lc]
    size = int(mgr.config.pages_per_life_cycle_list(host=level == 1)[lc])
    live = mine[(mine["state"] != PAGE_FREE) & (mine["level"] == level)]
    unheld = (live["holders"] == 0) & (live["state"] == PAGE_COMMITTED)
    held = (live["holders"] > 0) & (live["locks"] == 0)
    n = size - len(live) + int(unheld.sum())
    if level == 0 and mgr.config.pages_per_life_cycle_list(host=True)[lc] > 0:
        n += min(int(held.sum()), counted_by_hand(mgr, lc, 1))
    return n


def check(mgr, want_gpu, want_host=None):
    assert mgr.obtainable_pages() == want_gpu == counted_by_hand(mgr, 0, 0)
    if want_host is not None:
        assert mgr.obtainable_pages(0, 1) == want_host == counted_by_hand(mgr, 0, 1)


def test_locked_pages_are_not_obtainable_cached_ones_are(backend):
    mgr = make_manager(backend, tokens_per_block=T, layers=[Attention()], pages_per_life_cycle=8)
    check(mgr, 8)
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(3 * T)
    check(mgr, 5)
    kv.commit(list(range(3 * T)))
    check(mgr, 5)  # committed, still locked by the cache
    kv.close()
    check(mgr, 8)  # cached: evictable
    assert mgr.probe_reuse(list(range(3 * T))) == 3 * T
    # An allocation gets exactly what the count promises, evicting the cache.
    kv = mgr.create_kv_cache()
    assert kv.resume()
    assert not kv.resize((mgr.obtainable_pages() + 1) * T)
    assert kv.resize(mgr.obtainable_pages() * T)
    check(mgr, 0)
    assert mgr.probe_reuse(list(range(3 * T))) == 0
    introspect.check_sanity(mgr)


def test_suspended_pages_count_on_the_gpu_while_the_host_tier_has_room(backend):
    mgr = make_manager(backend, tokens_per_block=T, layers=[Attention()], pages_per_life_cycle=6,
                       host_pages_per_life_cycle=2)
    kvs = [mgr.create_kv_cache() for _ in range(2)]
    for kv in kvs:
        assert kv.resume() and kv.resize(3 * T)
    check(mgr, 0, 2)
    kvs[0].suspend()  # 3 held pages, 2 of them could move to the host
    check(mgr, 2, 2)
    assert kvs[1].resize(5 * T)  # two of the suspended cache's pages migrate
    check(mgr, 0, 0)
    introspect.check_sanity(mgr)


def test_counts_are_per_life_cycle_and_the_arguments_are_checked():
    mgr = make_manager("cpu", tokens_per_block=T, layers=[Attention(), Attention(window=2 * T)],
                       pages_per_life_cycle=[8, 5])
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(2 * T)
    assert (mgr.obtainable_pages(0), mgr.obtainable_pages(1)) == (6, 3)
    assert mgr.obtainable_pages(1, 1) == 0  # no host tier
    for bad in (2, -1, True, "0"):
        with pytest.raises(ValueError, match="life_cycle_id"):
            mgr.obtainable_pages(bad)
    with pytest.raises(ValueError, match="level"):
        mgr.obtainable_pages(0, 2)
    assert [[mgr._tables.obtainable_pages(lc, level) for level in (0, 1)] for lc in (0, 1)] == [[6, 0], [3, 0]]

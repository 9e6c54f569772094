"""Eviction under memory pressure: recency, priorities, what a page death
takes, and the eviction lists (docs/semantics.md §2.7, §2.8).

Scenario tests with small pools whose outcome is worked out by hand; the
randomised lockstep runs against the oracle's LRU controller are in
``tests/caches/test_conversations_vs_oracle.py`` (the pressure tests), and the
host tier is in ``test_host_tier.py`` here.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from gpukv import Attention, introspect
from gpukv.core.layout import (
    INFO_HELD_SHIFT, LG_COUNT, LG_LOWEST, NULL, PAGE_HOLDS, PAGE_INFO, PAGE_LRU_PREV, PAGE_LRU_TICK,
    page_holds,
)

from tests.support.backends import make_manager
from tests.support.turns import finished, seq

T = 4


def full(pages: int, host: int = 0, **kw):
    return make_manager(tokens_per_block=T, layers=[Attention()], pages_per_life_cycle=pages,
                        host_pages_per_life_cycle=host, **kw)


# -- LRU and priorities -------------------------------------------------------------------------
def test_the_least_recently_released_pages_go_first_leaves_before_their_ancestors():
    mgr = full(6)
    for i in range(3):  # 3 turns of 2 blocks fill the pool
        finished(mgr, seq(i))
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(T)  # one page: the oldest turn's leaf goes
    assert mgr.get_and_reset_eviction_stats() == {"evicted": 1, "migrated": 0, "dropped": 1}
    assert mgr.probe_reuse(seq(0)) == T  # its first block is still there
    assert mgr.probe_reuse(seq(1)) == mgr.probe_reuse(seq(2)) == 2 * T
    assert kv.resize(2 * T)  # the next victim is that first block
    assert mgr.probe_reuse(seq(0)) == 0 and mgr.probe_reuse(seq(1)) == 2 * T
    introspect.check_sanity(mgr)


def test_reusing_a_prefix_makes_it_recent():
    mgr = full(6)
    for i in range(3):
        finished(mgr, seq(i))
    mgr.create_kv_cache(seq(0)).close()  # touched: its pages go to the tail
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(2 * T)
    assert mgr.probe_reuse(seq(1)) == 0  # now the least recently used turn
    assert mgr.probe_reuse(seq(0)) == mgr.probe_reuse(seq(2)) == 2 * T


def test_lower_priority_pages_are_evicted_first_whatever_their_age():
    mgr = full(6)
    finished(mgr, seq(0), priority_callback=lambda o, lc: 80)  # oldest, but precious
    finished(mgr, seq(1), priority_callback=lambda o, lc: 10 if o == 1 else 50)
    finished(mgr, seq(2))  # default 35
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(2 * T)
    # Victims: seq(1)'s block 1 (10), then seq(2)'s leaf (35, older than its root).
    assert mgr.probe_reuse(seq(1)) == T and mgr.probe_reuse(seq(2)) == T
    assert mgr.probe_reuse(seq(0)) == 2 * T
    pages = introspect.tables(mgr)["pages"]
    live = pages[pages["state"] != 0]
    assert sorted(set(live["priority"].tolist())) == [35, 50, 80]


def test_close_with_evict_first_puts_the_turn_at_the_head():
    mgr = full(6)
    finished(mgr, seq(0))
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(2 * T)
    kv.commit(seq(1))
    kv.close(evict_first=True)
    finished(mgr, seq(2))
    new = mgr.create_kv_cache()
    assert new.resume() and new.resize(2 * T)
    assert mgr.probe_reuse(seq(1)) == 0  # the youngest but pushed first
    assert mgr.probe_reuse(seq(0)) == mgr.probe_reuse(seq(2)) == 2 * T


def test_locked_and_held_pages_are_never_evicted():
    mgr = full(4)
    active = mgr.create_kv_cache()
    assert active.resume() and active.resize(2 * T)
    active.commit(seq(0))
    held = mgr.create_kv_cache(seq(0))  # SUSPENDED, holding the same pages
    other = mgr.create_kv_cache()
    assert other.resume()
    before = introspect.tables(mgr)["pages"].copy()
    assert not other.resize(3 * T)  # needs 3 pages, only 2 are free: refused, nothing evicted
    assert (introspect.tables(mgr)["pages"] == before).all()
    assert other.resize(2 * T)
    assert mgr.get_and_reset_eviction_stats()["evicted"] == 0
    assert held.num_committed_tokens == 2 * T and mgr.probe_reuse(seq(0)) == 2 * T
    for kv in (active, held, other):
        kv.close()
    introspect.check_sanity(mgr)


def test_full_attention_page_death_takes_the_subtree_so_nothing_below_stays_reachable():
    mgr = full(5)
    finished(mgr, seq(0, 3 * T), priority_callback=lambda o, lc: 5 if o == 0 else 90)
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(3 * T)  # 2 free; the root block (priority 5) goes first
    assert mgr.probe_reuse(seq(0, 3 * T)) == 0
    blocks = introspect.tables(mgr)["blocks"]
    attached = (blocks["flags"] & 2) != 0
    assert int((attached & (blocks["ordinal"] >= 0)).sum()) == 0  # descendants were removed with it
    introspect.check_sanity(mgr)


def test_swa_page_eviction_removes_only_that_life_cycle():
    mgr = make_manager(tokens_per_block=T, layers=[Attention(), Attention(window=T)], pages_per_life_cycle=[8, 2])
    finished(mgr, seq(0))  # block 0's SWA page went stale at the commit (released first), block 1's at close
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(T)  # one SWA page: block 0's goes, block 0 itself stays
    assert mgr.get_and_reset_eviction_stats()["evicted"] == 1
    assert all(p is not None for p in introspect.reuse_match_pages(mgr, seq(0), 0)[1])  # full attention intact
    n, swa = introspect.reuse_match_pages(mgr, seq(0), 1)
    assert n == 2 * T and swa[0] is None and swa[1] is not None  # the window at 8 needs only block 1
    assert mgr.probe_reuse(seq(0)) == 2 * T
    introspect.check_sanity(mgr)


@pytest.mark.parametrize("seed", range(4))
def test_victims_follow_priority_then_recency_with_pushes_and_touches(seed):
    """One-block turns (a death never takes another turn with it) released
    with mixed priorities, some pushed to the head, some touched again
    later; then the pool is taken one page at a time and each victim must be
    the turn a plain model of (priority, tick) names."""
    rng = random.Random(seed)
    n = 12
    mgr = full(n)
    ticks = {}  # turn -> (priority, tick) as the controller should see it
    clock, pushes = 0, 0

    def release(i, first):
        nonlocal clock, pushes
        if first:
            pushes += 1
            ticks[i] = (ticks[i][0], -1 - pushes)
        else:
            ticks[i] = (ticks[i][0], clock)
            clock += 1

    for i in range(n):
        priority = rng.choice([0, 10, 35, 35, 100])
        kv = mgr.create_kv_cache(priority_callback=lambda o, lc, p=priority: p)
        assert kv.resume() and kv.resize(T)
        kv.commit(seq(i, T))
        first = rng.random() < 0.3
        kv.close(evict_first=first)
        ticks[i] = (priority, None)
        release(i, first)
        if i and rng.random() < 0.4:  # a request reuses an older turn and finishes
            j = rng.randrange(i)
            again = mgr.create_kv_cache(seq(j, T))
            assert again.num_committed_tokens == T
            first = rng.random() < 0.3
            again.close(evict_first=first)
            release(j, first)
    introspect.check_sanity(mgr)
    want = sorted(ticks, key=lambda i: ticks[i])
    pages = {i: introspect.reuse_match_pages(mgr, seq(i, T), 0)[1][0][0] for i in range(n)}
    assert introspect.eviction_order(mgr, 0) == [pages[i] for i in want]
    assert mgr.eviction_order(n).tolist() == pool_indices(mgr, [pages[i] for i in want])
    taker = mgr.create_kv_cache()
    assert taker.resume()
    for k, victim in enumerate(want, start=1):
        assert taker.resize(k * T)
        gone = [i for i in range(n) if mgr.probe_reuse(seq(i, T)) == 0]
        assert gone == sorted(want[:k]), f"victim {k} should be turn {victim} {ticks[victim]}"
        introspect.check_sanity(mgr)
    taker.close()


def pool_indices(mgr, page_rows) -> list:
    return [int(introspect.tables(mgr)["pages"][p]["pool_index"]) for p in page_rows]


def test_mgr_eviction_order_names_the_pages_allocations_then_evict_in_turn(backend):
    """``mgr.eviction_order(k)`` (a read on the device) is the first ``k`` of
    the unheld candidates as the page table's lists order them, and an
    allocation that must evict ``k`` pages takes exactly those: blocks of
    other turns stay, held pages are never listed."""
    mgr = make_manager(backend, tokens_per_block=T, layers=[Attention()], pages_per_life_cycle=10)
    for i in range(3):  # 3 turns of 2 blocks, the middle one at a lower priority
        finished(mgr, seq(i), priority_callback=lambda o, lc, i=i: 10 if i == 1 else 35)
    held = mgr.create_kv_cache(seq(2)[:T])  # holds turn 2's first block: not a candidate
    assert held.num_committed_tokens == T
    everything = pool_indices(mgr, introspect.eviction_order(mgr, 0))
    assert len(everything) == 5
    order = mgr.eviction_order(10)
    assert order.dtype == np.int32 and order.tolist() == everything
    assert mgr.eviction_order(2).tolist() == everything[:2] and mgr.eviction_order(0).tolist() == []
    held_page = int(held.page_indices(0)[0])
    assert held_page not in everything
    # Turn 1 (lower priority) goes first, its leaf before its first block, then turn 0's.
    pages = {i: [page for page, _ in introspect.reuse_match_pages(mgr, seq(i), 0)[1]] for i in range(3)}
    assert everything == pool_indices(mgr, [pages[1][1], pages[1][0], pages[0][1], pages[0][0], pages[2][1]])
    taker = mgr.create_kv_cache()
    assert taker.resume() and taker.resize(4 * T)  # the 4 free pages: nothing evicted
    assert mgr.eviction_order(10).tolist() == everything
    for k in range(1, 4):
        assert taker.resize((4 + k) * T)  # one eviction each
        assert mgr.eviction_order(10).tolist() == everything[k:]
        assert everything[k - 1] in taker.page_indices(0).tolist()  # the victim's slot is the taker's now
    assert mgr.probe_reuse(seq(1)) == 0 and mgr.probe_reuse(seq(0)) == T and mgr.probe_reuse(seq(2)) == 2 * T
    introspect.check_sanity(mgr)
    with pytest.raises(ValueError, match="count must be an int >= 0"):
        mgr.eviction_order(-1)
    with pytest.raises(ValueError, match="count must be an int >= 0"):
        mgr.eviction_order(True)
    with pytest.raises(ValueError, match="life_cycle_id must be in 0..0"):
        mgr.eviction_order(1, life_cycle_id=1)


# -- bad input ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [101, -1, 3.5, True, "high"])
def test_a_priority_outside_0_to_100_is_refused_and_changes_nothing(bad):
    mgr = full(8)
    kv = mgr.create_kv_cache(priority_callback=lambda o, lc: bad)
    assert kv.resume()
    before = introspect.tables(mgr)["pages"].copy()
    with pytest.raises(ValueError, match=r"priority_callback\(0, 0\) must be an int in 0..100"):
        kv.resize(T)
    assert kv.capacity == 0 and (introspect.tables(mgr)["pages"] == before).all()


def test_a_raising_priority_callback_is_reported_and_changes_nothing():
    def callback(ordinal, lc):
        if ordinal == 1:
            raise KeyError("no priority for ordinal 1")
        return 50

    mgr = full(8)
    kv = mgr.create_kv_cache(priority_callback=callback)
    assert kv.resume()
    with pytest.raises(ValueError, match=r"priority_callback\(1, 0\) raised KeyError"):
        kv.resize(2 * T)
    assert kv.capacity == 0
    assert kv.resize(T) and kv.page_indices(0).tolist() != [-1]  # ordinal 0 alone is fine
    with pytest.raises(TypeError, match="priority_callback must be callable"):
        mgr.create_kv_cache(priority_callback=7)


# -- the lists checked ---------------------------------------------------------------------------
def _cached_pool():
    """Three priorities of cached pages in one pool, one pushed to the head."""
    mgr = full(8)
    finished(mgr, seq(0), priority_callback=lambda o, lc: 50)
    finished(mgr, seq(1))
    finished(mgr, seq(2), priority_callback=lambda o, lc: 50)
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(T)
    kv.commit(seq(3, T))
    kv.close(evict_first=True)
    introspect.check_sanity(mgr)
    return mgr


def _corrupt_order(mgr):
    order = introspect.eviction_order(mgr, 0)
    pages = mgr._tables.pages
    a, b = order[-2], order[-1]  # seq(2)'s two pages, one list
    pages[a, PAGE_LRU_TICK], pages[b, PAGE_LRU_TICK] = pages[b, PAGE_LRU_TICK], pages[a, PAGE_LRU_TICK]


def _corrupt_unlink(mgr):
    p = introspect.eviction_order(mgr, 0)[0]  # the pushed page: the list of priority 35 lost
    lst = introspect.tables(mgr)["pages"]["lru_list"][p]
    mgr._tables.lru_lists[lst] = NULL


def _corrupt_list(mgr):
    p = introspect.eviction_order(mgr, 0)[0]
    mgr._tables.pages[p, PAGE_INFO] ^= 1 << INFO_HELD_SHIFT  # names the held pages' list of its group


def _corrupt_count(mgr):
    mgr._tables.lru_groups[introspect.lru_group_row(0, 0, False), LG_COUNT] += 1


def _corrupt_bound(mgr):
    mgr._tables.lru_groups[introspect.lru_group_row(0, 0, False), LG_LOWEST] = 40  # above the 35s


def _corrupt_candidate(mgr):
    p = introspect.eviction_order(mgr, 0)[0]
    mgr._tables.pages[p, PAGE_HOLDS] = page_holds(1, 1)  # a locked page left listed


def _corrupt_link(mgr):
    order = introspect.eviction_order(mgr, 0)
    mgr._tables.pages[order[-1], PAGE_LRU_PREV] = order[0]


@pytest.mark.parametrize("corrupt, message", [
    (_corrupt_order, "not sorted by tick"),
    (_corrupt_unlink, "not reachable"),
    (_corrupt_list, "belongs in"),
    (_corrupt_count, "counts"),
    (_corrupt_bound, "below its bound"),
    (_corrupt_candidate, "no candidate"),
    (_corrupt_link, "predecessor"),
])
def test_check_sanity_catches_a_wrong_eviction_list(corrupt, message):
    mgr = _cached_pool()
    assert [int(introspect.tables(mgr)["pages"]["priority"][p]) for p in introspect.eviction_order(mgr, 0)] == [
        35, 35, 35, 50, 50, 50, 50]
    corrupt(mgr)
    with pytest.raises(AssertionError, match=f"invariant 9 broken: .*{message}"):
        introspect.check_sanity(mgr)

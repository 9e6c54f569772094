"""Eviction under memory pressure, priorities and the host tier (docs/semantics.md
§2.7, §2.8, §2.11).

Scenario tests with small pools whose outcome is worked out by hand; the
randomised lockstep runs against the oracle's LRU controller are in
``test_kvcache_differential.py`` (the pressure tests), and a randomised run
with a host tier is at the end of this module.
"""

from __future__ import annotations

import random

import pytest

import gpukv
from gpukv import Attention, introspect
from gpukv.core.layout import LG_COUNT, LG_LOWEST, NULL, PAGE_HOLDERS, PAGE_LOCKS, PAGE_LRU_LIST, PAGE_LRU_PREV, PAGE_LRU_TICK

from tests.support.backends import make_manager
from tests.support.engine import Engine

T = 4


def finished(mgr, tokens, **create):
    """A turn that commits ``tokens`` and closes: its pages stay cached."""
    kv = mgr.create_kv_cache(**create)
    assert kv.resume() and kv.resize(len(tokens))
    kv.commit(tokens)
    kv.close()


def seq(i: int, n: int = 2 * T) -> list[int]:
    return [100 * i + j for j in range(n)]


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
    taker = mgr.create_kv_cache()
    assert taker.resume()
    for k, victim in enumerate(want, start=1):
        assert taker.resize(k * T)
        gone = [i for i in range(n) if mgr.probe_reuse(seq(i, T)) == 0]
        assert gone == sorted(want[:k]), f"victim {k} should be turn {victim} {ticks[victim]}"
        introspect.check_sanity(mgr)
    taker.close()


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


# -- the host tier ---------------------------------------------------------------------------------
def tiered(gpu: int, host: int):
    return make_manager(tokens_per_block=T, layers=[Attention()], pages_per_life_cycle=gpu,
                        host_pages_per_life_cycle=host, page_bytes=8 * T)


def test_evicted_gpu_pages_migrate_to_the_host_and_come_back_on_lock_with_their_data():
    mgr = tiered(4, 4)
    engine = Engine(mgr)
    first = mgr.create_kv_cache()
    assert first.resume() and first.resize(2 * T)
    engine.run(first, seq(0), 0, 2 * T)
    first.commit(seq(0))
    first.close()
    other = mgr.create_kv_cache()
    assert other.resume() and other.resize(4 * T)  # all 4 GPU pages: seq(0)'s two go to the host
    assert mgr.get_and_reset_eviction_stats() == {"evicted": 2, "migrated": 2, "dropped": 0}
    levels = introspect.tables(mgr)["pages"]["level"]
    _, pages = introspect.reuse_match_pages(mgr, seq(0), 0)
    assert [int(levels[p]) for p, _ in pages] == [1, 1]  # still in the tree, on the host
    engine.verify_tree()
    other.close()
    again = mgr.create_kv_cache(seq(0) + [7])
    assert again.num_committed_tokens == 2 * T
    assert again.resume()  # locking brings them back onto the GPU
    assert [int(introspect.tables(mgr)["pages"]["level"][p]) for p, _ in pages] == [0, 0]
    assert (again.page_indices(0) >= 0).all()
    engine.verify_reuse(again, seq(0))
    engine.verify_tree()
    introspect.check_sanity(mgr)


def test_a_suspended_cache_is_swapped_out_and_back_in():
    mgr = tiered(4, 4)
    engine = Engine(mgr)
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(2 * T)
    engine.run(kv, seq(0), 0, 2 * T)
    kv.commit(seq(0))
    kv.suspend()  # held, not locked: may migrate
    other = mgr.create_kv_cache()
    assert other.resume() and other.resize(4 * T)
    assert mgr.get_and_reset_eviction_stats()["migrated"] == 2
    assert (kv.page_indices(0) == -1).all()  # its pages are on the host now
    other.close()
    assert kv.resume()
    assert (kv.page_indices(0) >= 0).all()
    engine.verify_reuse(kv, seq(0))
    kv.close()
    introspect.check_sanity(mgr)


def test_pages_evicted_from_the_last_level_die():
    mgr = tiered(2, 2)
    for i in range(3):  # 6 pages of cached turns, 4 slots in all
        finished(mgr, seq(i))
    stats = mgr.get_and_reset_eviction_stats()
    assert stats["evicted"] == 4 and stats["migrated"] == 4 and stats["dropped"] == 2
    assert mgr.probe_reuse(seq(0)) == 0  # dropped from the host
    assert mgr.probe_reuse(seq(1)) == mgr.probe_reuse(seq(2)) == 2 * T
    introspect.check_sanity(mgr)


def test_a_resume_that_cannot_bring_its_pages_back_is_refused_and_changes_nothing():
    mgr = tiered(2, 2)
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(2 * T)
    kv.commit(seq(0))
    kv.suspend()
    hog = mgr.create_kv_cache()
    assert hog.resume() and hog.resize(2 * T)  # kv's pages migrate; hog locks both GPU pages
    before = introspect.tables(mgr)["pages"].copy()
    assert not kv.resume()
    assert kv.status is gpukv.KVCacheStatus.SUSPENDED
    assert (introspect.tables(mgr)["pages"] == before).all()
    hog.close()
    assert kv.resume()
    kv.close()
    introspect.check_sanity(mgr)


@pytest.mark.parametrize("seed", range(3))
def test_random_turns_with_a_host_tier_never_reuse_lost_data(seed):
    """Random multi-turn traffic through small GPU and host pools: after every
    step the tables are sane, every page in the tree (either level) holds the
    right data, a created cache reuses exactly what probe_reuse promised and
    its reused KV verifies, and a refused resize changed nothing."""
    rng = random.Random(seed)
    mgr = make_manager(tokens_per_block=T, layers=[Attention(), Attention(window=2 * T)],
                       pages_per_life_cycle=12, host_pages_per_life_cycle=8, page_bytes=8 * T)
    engine = Engine(mgr)
    convs: list[list[int]] = []
    open_: list = []
    refused = 0
    for _ in range(60):
        if convs and rng.random() < 0.7:
            base = rng.choice(convs)
            prompt = base[: rng.randint(0, len(base))] + [rng.randrange(3) for _ in range(rng.randint(1, 6))]
        else:
            prompt = [rng.randrange(3) for _ in range(rng.randint(1, 12))]
        promised = mgr.probe_reuse(prompt)
        kv = mgr.create_kv_cache(prompt)
        assert kv.num_committed_tokens == promised
        if not kv.resume():
            kv.close()
            continue
        engine.verify_reuse(kv, prompt[:promised])
        before = introspect.tables(mgr)["pages"].copy()
        if not kv.resize(len(prompt)):
            refused += 1
            assert (introspect.tables(mgr)["pages"] == before).all()
            kv.close()
            continue
        engine.run(kv, prompt, kv.num_committed_tokens, len(prompt))
        kv.commit(prompt[kv.num_committed_tokens:])
        convs.append(prompt)
        if rng.random() < 0.4:
            kv.suspend()
            open_.append(kv)
        else:
            kv.close()
        while len(open_) > 2 or (open_ and rng.random() < 0.3):
            old = open_.pop(0)
            if old.resume():
                engine.verify_reuse(old, old.committed_tokens.tolist())
            old.close()
        introspect.check_sanity(mgr)
        engine.verify_tree()
    stats = mgr.get_and_reset_eviction_stats()
    assert stats["migrated"] > 0 and stats["dropped"] > 0, stats
    for kv in open_:
        kv.close()
    introspect.check_sanity(mgr)


def test_held_pages_stay_when_the_host_tier_is_full_of_held_pages():
    """The oldest candidates are a suspended cache's held pages, but the host
    tier is full of another suspended cache's held pages: the held ones cannot
    migrate, so the younger unheld pages are dropped instead, and the held
    pages keep their place for a later launch."""
    mgr = tiered(4, 2)
    swapped = mgr.create_kv_cache()
    assert swapped.resume() and swapped.resize(2 * T)
    swapped.commit(seq(0))
    swapped.suspend()
    waiting = mgr.create_kv_cache()
    assert waiting.resume() and waiting.resize(2 * T)
    waiting.commit(seq(1))
    waiting.suspend()
    finished(mgr, seq(2))  # its two pages push swapped's two to the host: full of held pages
    assert mgr.get_and_reset_eviction_stats() == {"evicted": 2, "migrated": 2, "dropped": 0}
    levels = introspect.tables(mgr)["pages"]["level"]
    held = [p for p, _ in introspect.reuse_match_pages(mgr, seq(1), 0)[1]]
    cached = [p for p, _ in introspect.reuse_match_pages(mgr, seq(2), 0)[1]]
    assert [int(levels[p]) for p, _ in introspect.reuse_match_pages(mgr, seq(0), 0)[1]] == [1, 1]
    assert introspect.eviction_order(mgr, 0, held=True) == held  # suspended root first, as scheduled
    assert introspect.eviction_order(mgr, 0) == cached[::-1]  # released leaf first
    assert introspect.eviction_order(mgr, 0, level=1) == introspect.eviction_order(mgr, 0, level=1, held=True) == []
    introspect.check_sanity(mgr)
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(2 * T)
    assert mgr.get_and_reset_eviction_stats() == {"evicted": 2, "migrated": 0, "dropped": 2}
    assert mgr.probe_reuse(seq(2)) == 0 and waiting.num_committed_tokens == 2 * T
    assert introspect.eviction_order(mgr, 0, held=True) == held
    introspect.check_sanity(mgr)
    swapped.close()  # room on the host again: the next launch may migrate held pages
    kv.close()
    taker = mgr.create_kv_cache()
    assert taker.resume() and taker.resize(4 * T)
    assert mgr.get_and_reset_eviction_stats()["migrated"] >= 2
    assert [int(introspect.tables(mgr)["pages"]["level"][p]) for p in held] == [1, 1]
    assert waiting.resume() is False  # its pages are on the host, the GPU is taken
    taker.close()
    assert waiting.resume()
    waiting.close()
    introspect.check_sanity(mgr)


def test_a_cached_page_a_new_cache_holds_keeps_its_age_among_the_held():
    """A cache created on cached pages holds them without rescheduling: with a
    host tier they become held candidates with their old ticks, between the
    pages of caches suspended before and after they were cached."""
    mgr = tiered(8, 8)
    early = mgr.create_kv_cache()
    assert early.resume() and early.resize(2 * T)
    early.commit(seq(0))
    early.suspend()
    finished(mgr, seq(1))
    late = mgr.create_kv_cache()
    assert late.resume() and late.resize(2 * T)
    late.commit(seq(2))
    late.suspend()
    rows = {i: [p for p, _ in introspect.reuse_match_pages(mgr, seq(i), 0)[1]] for i in range(3)}
    assert introspect.eviction_order(mgr, 0) == rows[1][::-1]
    reuser = mgr.create_kv_cache(seq(1))  # SUSPENDED, holding seq(1)'s pages
    assert reuser.num_committed_tokens == 2 * T
    ticks = introspect.tables(mgr)["pages"]["lru_tick"]
    order = introspect.eviction_order(mgr, 0, held=True)
    assert order == sorted(rows[0] + rows[1] + rows[2], key=lambda p: ticks[p])
    assert order[:2] == sorted(rows[0], key=lambda p: ticks[p]) and order[4:] == sorted(rows[2], key=lambda p: ticks[p])
    assert introspect.eviction_order(mgr, 0) == []
    introspect.check_sanity(mgr)
    taker = mgr.create_kv_cache()
    assert taker.resume() and taker.resize(3 * T)  # 2 free: the third page takes the oldest held one
    assert mgr.get_and_reset_eviction_stats() == {"evicted": 1, "migrated": 1, "dropped": 0}
    assert int(introspect.tables(mgr)["pages"]["level"][order[0]]) == 1
    for kv in (taker, reuser, early, late):
        kv.close()
    introspect.check_sanity(mgr)


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
    lst = mgr._tables.pages[p, PAGE_LRU_LIST]
    mgr._tables.lru_lists[lst] = NULL


def _corrupt_list(mgr):
    p = introspect.eviction_order(mgr, 0)[0]
    mgr._tables.pages[p, PAGE_LRU_LIST] += 1


def _corrupt_count(mgr):
    mgr._tables.lru_groups[introspect.lru_group_row(0, 0, False), LG_COUNT] += 1


def _corrupt_bound(mgr):
    mgr._tables.lru_groups[introspect.lru_group_row(0, 0, False), LG_LOWEST] = 40  # above the 35s


def _corrupt_candidate(mgr):
    p = introspect.eviction_order(mgr, 0)[0]
    mgr._tables.pages[p, PAGE_LOCKS] = 1  # a locked page left listed
    mgr._tables.pages[p, PAGE_HOLDERS] = 1


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

"""The host tier (docs/semantics.md §2.11): evicted GPU pages migrate to host
memory and come back, with their data, when a cache locks them again; a
suspended cache is swapped out and back in; pages evicted from the last level
die. Scenario tests with small pools whose outcome is worked out by hand, and
random multi-turn traffic through small GPU and host pools.
"""

from __future__ import annotations

import random

import pytest

import gpukv
from gpukv import Attention, introspect

from tests.support.backends import make_manager
from tests.support.engine import Engine
from tests.support.turns import finished, seq

T = 4


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

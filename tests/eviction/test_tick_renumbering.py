"""The pages' LRU ticks are 32 bits wide and the manager's clocks never stop:
between launches the host renumbers the ticks, keeping their order, once a
clock passes ``layout.TICK_RENUMBER_AT`` (``Tables.renumber_ticks``), and
eviction goes on exactly as it would have (docs/semantics.md §2.11)."""

from __future__ import annotations

import random

import numpy as np

from gpukv import Attention, introspect
from gpukv.core.layout import CNT_EVICT_FIRST, CNT_TICK, NULL, PAGE_FREE, TICK_RENUMBER_AT

from tests.support.backends import make_manager
from tests.support.turns import seq

T = 4


def _manager():
    return make_manager(tokens_per_block=T, layers=[Attention()], pages_per_life_cycle=10, host_pages_per_life_cycle=6)


def _turns(seed: int, n: int):
    """Turns of random requests (some sharing a prefix, some pushed to the
    head on close, some suspended with their pages held) that keep both
    pools under pressure."""
    rng = random.Random(seed)
    for _ in range(n):
        tokens = seq(rng.randrange(6), 4 * rng.randrange(1, 4)) + [rng.randrange(5)] * rng.randrange(3)
        yield tokens, rng.random() < 0.3, rng.random() < 0.2, rng.choice([10, 35, 35, 60])


def _play(mgr, turn, suspended: list):
    tokens, evict_first, suspend, priority = turn
    kv = mgr.create_kv_cache(tokens, priority_callback=lambda o, lc: priority)
    if kv.resume() and kv.resize(len(tokens)):
        kv.commit(tokens[kv.num_committed_tokens:])  # past the reused prefix
    if suspend:
        kv.suspend()
        suspended.append(kv)
    else:
        kv.close(evict_first=evict_first)
    if len(suspended) > 2:
        suspended.pop(0).close()


def _state(mgr):
    orders = [introspect.eviction_order(mgr, 0, level, held) for level in (0, 1) for held in (False, True)]
    return orders, [mgr.probe_reuse(seq(i, 12)) for i in range(6)]


def test_clocks_past_the_limit_are_renumbered_and_eviction_goes_on_as_before():
    twin, mgr = _manager(), _manager()
    # Both clocks a few schedules short of the limit: the first launches pass it.
    mgr._tables.counters[CNT_TICK] = TICK_RENUMBER_AT - 5
    mgr._tables.counters[CNT_EVICT_FIRST] = TICK_RENUMBER_AT - 2
    held_twin, held = [], []
    for turn in _turns(7, 60):
        _play(twin, turn, held_twin)
        _play(mgr, turn, held)
        assert _state(mgr) == _state(twin)
        introspect.check_sanity(mgr)  # every list sorted by tick
    counters = mgr._tables.counters_host()
    assert counters[CNT_TICK] < 1000 and counters[CNT_EVICT_FIRST] < 1000  # both renumbered
    assert mgr.get_and_reset_eviction_stats() == twin.get_and_reset_eviction_stats()


def test_renumbering_keeps_every_order_and_tie_and_leaves_the_least_values():
    mgr = _manager()
    held = []
    for turn in _turns(3, 40):
        _play(mgr, turn, held)
    for i in range(2):  # the last two turns pushed to the head
        _play(mgr, (seq(10 + i), True, False, 35), held)
    pages = introspect.tables(mgr)["pages"]
    live = pages["state"] != PAGE_FREE
    before = pages["lru_tick"][live].astype(np.int64)
    assert (before > NULL).any() and (before < NULL).any()  # clock ticks and evict-first pushes
    mgr._tables.renumber_ticks()
    after = introspect.tables(mgr)["pages"]["lru_tick"][live].astype(np.int64)
    assert np.array_equal(np.sign(before[:, None] - before[None, :]), np.sign(after[:, None] - after[None, :]))
    assert np.array_equal(after == NULL, before == NULL)
    later, pushes = np.unique(after[after > NULL]), np.unique(after[after < NULL])
    assert later.tolist() == list(range(later.size))
    assert pushes.tolist() == list(range(NULL - pushes.size, NULL))
    counters = mgr._tables.counters_host()
    assert (counters[CNT_TICK], counters[CNT_EVICT_FIRST]) == (later.size, pushes.size)
    introspect.check_sanity(mgr)

"""Differential tests of the sequence layer: random multi-turn conversations with
rewinds (``tests/support/conversations.py``), replayed in lockstep on the
plain-Python model ``KVOracle`` (``tests/support/oracle_kv.py``, docs/semantics.md
to the letter) and on gpukv (``cpu``): ``tests/support/lockstep.py`` lists what
the two must agree on after every step.

The default runs give both sides pools big enough that nothing is evicted;
the pressure runs give them a few dozen pages per life cycle, so allocations
evict least recently released pages all the time, and the two eviction
controllers must pick the same victims (default priority, a single cache
level: plain LRU).

The default runs take about 30 s in all; ``-m slow`` runs ten more seeds of
longer workloads per configuration (about 20 min). A short hypothesis-driven
variant shrinks a failing workload to a small one.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import oracle as O
from tests.support.lockstep import CONFIG_IDS, CONFIGS, POOL, PRESSURE_POOL, TIGHT_POOL, Lockstep, run_workload


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_conversations_agree_with_the_oracle(config, seed):
    stats = run_workload(seed, config, 300)
    assert stats.get("turns", 0) >= 10, stats
    assert stats.get("reused_tokens", 0) > 0 and stats.get("partial_reuse", 0) > 0, stats


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=25, **SETTINGS)
@given(config=st.sampled_from(CONFIGS), rng=st.randoms(use_true_random=False))
def test_short_conversations_agree_with_the_oracle(config, rng):
    """Short workloads whose random choices hypothesis can shrink. (Hypothesis's
    bookkeeping of thousands of draws per example grows fast, so the longer
    runs are seeded.)"""
    Lockstep(rng, config).run_steps(30)


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("seed", range(1, 11))
def test_conversations_agree_with_the_oracle_long(config, seed):
    run_workload(seed, config, 1200)


@pytest.mark.parametrize("pool", [PRESSURE_POOL, TIGHT_POOL])
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_conversations_under_memory_pressure_agree_with_the_oracle(config, pool):
    """Small pools: both sides evict the same victims and refuse the same
    resizes (a refused call changes nothing), and every reused token is still
    verified by the test engine."""
    lock = Lockstep(random.Random(0), config, pool)
    stats = lock.run_steps(300 if pool == PRESSURE_POOL else 150)
    evicted = lock.mgr.get_and_reset_eviction_stats()
    assert evicted["evicted"] == lock.o.counters["evicted"] > 0, (evicted, lock.o.counters)
    assert stats.get("reused_tokens", 0) > 0, stats
    if pool == TIGHT_POOL and any(lc.kind == O.FULL for lc in config[3]):  # windowed configs need few pages
        assert stats.get("resize_failed", 0) > 0, stats


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("seed", range(1, 11))
def test_conversations_under_memory_pressure_agree_with_the_oracle_long(config, seed):
    run_workload(seed, config, 1200, PRESSURE_POOL)


STABLE_CONFIGS = [c for c in CONFIGS if c[0] in ("F", "F-nopartial-backoff", "F+S", "F+S+M-partial")]


@pytest.mark.parametrize("pool", [POOL, PRESSURE_POOL])
@pytest.mark.parametrize("config", STABLE_CONFIGS, ids=[c[0] for c in STABLE_CONFIGS])
def test_stable_pages_never_move_and_agree_with_the_oracle(config, pool):
    """``stable_pages``: a committed full block the tree holds already keeps
    the cache's own page (no rebase onto the tree's), so every page an ACTIVE
    cache reported stays its own (``Lockstep.observe``), and oracle and gpukv
    still agree on everything else, eviction included."""
    lock = Lockstep(random.Random(3), config, pool, stable_pages=True)
    stats = lock.run_steps(300)
    assert lock.o.counters["kept_own_page"] > 0 and stats.get("pages_observed", 0) > 0, (lock.o.counters, stats)
    assert lock.o.counters["rebased"] > 0, lock.o.counters


def test_without_stable_pages_a_duplicate_block_moves_onto_the_tree_page():
    """The check above can fail: by default a duplicate full block rebases
    onto the tree's page, which the page ledger reports as a move."""
    lock = Lockstep(random.Random(3), CONFIGS[0], POOL)
    lock.stable_pages = lock.twins = True  # observe (and send twin requests) as if stable, while the manager rebases
    with pytest.raises(AssertionError, match="was reported on page"):
        lock.run_steps(300)

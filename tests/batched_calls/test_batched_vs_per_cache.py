"""The batched engine-step calls (``create_kv_caches``, ``resume_batch``,
``resize_batch``, ``commit_batch``, ``append_batch``, ``close_batch``) against the per-cache
calls issued one by one in the same order: random workloads in the batched
lockstep (``tests/support/batch_lockstep.py``), three ways at once: the
plain-Python model with per-cache calls, a gpukv manager with the batched
calls, and a second gpukv manager with the per-cache calls. Small pools add
eviction pressure and refusals in the middle of a batch; caches share
prefixes through a tiny vocabulary.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.backends import GPU_BACKEND
from tests.support.batch_lockstep import BatchLockstep
from tests.support.lockstep import CONFIG_IDS, CONFIGS, POOL, PRESSURE_POOL

TIGHT_POOL = 9  # pages per life cycle: so small that batched allocations are refused too


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_batched_calls_equal_the_per_cache_calls(config):
    stats = BatchLockstep(random.Random(0), config).run_steps(40)
    assert stats.get("commits", 0) > 20 and stats.get("reused_tokens", 0) > 0, stats
    assert stats.get("admitted_matched", 0) > 0 and stats.get("allocated_together", 0) > 0, stats


@pytest.mark.parametrize("pool", [POOL, TIGHT_POOL])
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_steps_ending_in_append_batch(config, pool):
    """Some steps end in ``append_batch`` (their tokens, then room for the
    next), against ``commit`` then ``resize`` on the oracle and the twin; a
    tight pool refuses rooms."""
    stats = BatchLockstep(random.Random(2), config, pool, appends=True).run_steps(40)
    assert stats.get("appended", 0) > 20 and stats.get("commits", 0) > 5, stats
    if pool == TIGHT_POOL and config[0] == "F":
        assert stats.get("append_refused", 0) > 0, stats


@pytest.mark.parametrize("pool", [PRESSURE_POOL, TIGHT_POOL])
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_batched_calls_under_memory_pressure(config, pool):
    lock = BatchLockstep(random.Random(1), config, pool)
    stats = lock.run_steps(40)
    assert lock.o.counters["evicted"] > 0, (lock.o.counters, stats)
    if pool == TIGHT_POOL and config[0] == "F":
        assert stats.get("resize_failed", 0) > 0, stats


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(config=st.sampled_from(CONFIGS), pool=st.sampled_from([POOL, PRESSURE_POOL, TIGHT_POOL]),
       rng=st.randoms(use_true_random=False))
def test_short_batched_workloads(config, pool, rng):
    BatchLockstep(rng, config, pool).run_steps(12)


@pytest.mark.cudasim
@pytest.mark.parametrize("pool", [POOL, PRESSURE_POOL])
@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[8]], ids=[CONFIG_IDS[0], CONFIG_IDS[8]])
def test_batched_calls_on_the_cuda_kernels(config, pool):
    """The same lockstep, the batched side on the CUDA kernels (simulated
    unless GPUKV_TEST_CUDA=1), at small sizes."""
    stats = BatchLockstep(random.Random(4), config, pool, backend=GPU_BACKEND).run_steps(10)
    assert stats.get("commits", 0) > 5 and stats.get("allocated_together", 0) > 0, stats
    stats = BatchLockstep(random.Random(7), config, pool, backend=GPU_BACKEND, appends=True).run_steps(14)
    assert stats.get("appended", 0) > 8, stats

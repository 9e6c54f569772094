"""Differential tests: random operation sequences on the oracle and on gpukv.

Hypothesis draws a model (tokens per block, life cycles) and a sequence of tree
operations (``tests/support/tree_lockstep.py``): add blocks (full and partial)
under random parents with random per-life-cycle coverage, kill pages, remove
subtrees, clear, and match random queries (partial on or off, with backoff).
Every operation is applied to the plain-Python oracle
(``tests/support/oracle.py``, docs/semantics.md to the letter) and to a
``KVCacheManager`` on each backend; after each step the attached blocks with
their per-life-cycle coverage, every match result and the removal records
must be identical, and both sanity checkers must pass.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from tests.support.backends import GPU_BACKEND
from tests.support.tree_lockstep import Pair, run_ops, scenario


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=150, **SETTINGS)
@given(scenario())
def test_cpu_agrees_with_oracle(case):
    model, T, ops = case
    run_ops(Pair("cpu", model, T), ops)


@pytest.mark.cudasim
@settings(max_examples=40, **SETTINGS)
@given(scenario())
def test_cuda_kernels_agree_with_oracle(case):
    model, T, ops = case
    run_ops(Pair(GPU_BACKEND, model, T), ops[:12])


@pytest.mark.slow
@settings(max_examples=2000, **SETTINGS)
@given(scenario())
def test_cpu_agrees_with_oracle_long(case):
    model, T, ops = case
    run_ops(Pair("cpu", model, T), ops)

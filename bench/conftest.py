"""Fixtures of the match benchmarks (see README.md here and matchbench.py).

Knobs (environment): ``GPUKV_BENCH_INSERT`` (trace requests inserted into the
tree, default 4000), ``GPUKV_BENCH_QUERIES`` (query requests: the ones right
after the inserted ones; default 1024 = the largest batch), ``GPUKV_TRACE``
(the trace file; default ``shared/data/mooncake_conversation_trace.jsonl`` in
or next to the checkout).
"""

from __future__ import annotations

import os

import pytest

from gpukv.sim.workload import find_mooncake_trace

from .matchbench import BATCHES, MatchWorkload, build_workload


def _env_int(name, default):
    v = os.environ.get(name)
    return default if v is None else int(v)


@pytest.fixture(scope="module")
def workload() -> MatchWorkload:
    path = find_mooncake_trace()
    if path is None:
        pytest.skip("the Mooncake trace is not in shared/data (set GPUKV_TRACE)")
    n_ins = _env_int("GPUKV_BENCH_INSERT", 4000)
    n_q = _env_int("GPUKV_BENCH_QUERIES", max(BATCHES))
    w = build_workload(path, n_ins, n_q)
    print(f"\nbench workload: {n_ins} requests inserted ({w.inserted_tokens} tokens, "
          f"{len(w.baseline.blocks)} distinct full blocks), {n_q} queries; build times (s) "
          + ", ".join(f"{k} {v:.1f}" for k, v in w.build_s.items()))
    return w

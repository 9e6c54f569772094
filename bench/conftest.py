"""Fixtures of the match benchmarks (see README.md here and matchbench.py).

Knobs (environment): ``GPUKV_BENCH_INSERT`` (trace requests inserted into the
tree, default 4000), ``GPUKV_BENCH_QUERIES`` (query requests: the ones right
after the inserted ones; default 1024 = the largest batch), ``GPUKV_TRACE``
(the trace file; default ``shared/data/mooncake_conversation_trace.jsonl`` in
or next to the checkout).
"""

from __future__ import annotations


import pytest

from gpukv.sim.workload import find_mooncake_trace

from . import knobs
from .matchbench import MatchWorkload, build_workload
from .sglangmatch import SglangTree, build_sglang_tree, sglang_unavailable


def pytest_addoption(parser):
    knobs.add_options(parser)


def pytest_configure(config):
    knobs.configure(config)


TRACE_SKIP = "the Mooncake trace is not in shared/data (set GPUKV_TRACE)"  # the start of every such skip reason


def pytest_terminal_summary(terminalreporter):
    """Say once, after the run, why the trace benchmarks were skipped (a quiet
    run otherwise shows nothing but ``s``)."""
    missing = [r for r in terminalreporter.stats.get("skipped", []) if TRACE_SKIP in str(r.longrepr)]
    if not missing:
        return
    terminalreporter.write_sep("-", "Mooncake trace not found")
    terminalreporter.write_line(
        f"{len(missing)} benchmark(s) skipped: they replay the Mooncake conversation trace (the conversation "
        "trace of Mooncake's FAST'25 trace release, github.com/kvcache-ai/Mooncake, FAST25-release/traces). "
        "Set GPUKV_TRACE to its path, or put it at shared/data/mooncake_conversation_trace.jsonl in or "
        "beside the checkout.")


@pytest.fixture(scope="module")
def workload() -> MatchWorkload:
    path = find_mooncake_trace()
    if path is None:
        pytest.skip(TRACE_SKIP)
    n_ins = knobs.integer("insert")
    n_q = knobs.integer("queries")
    w = build_workload(path, n_ins, n_q)
    print(f"\nbench workload: {n_ins} requests inserted ({w.inserted_tokens} tokens, "
          f"{len(w.baseline.blocks)} distinct full blocks), {n_q} queries; build times (s) "
          + ", ".join(f"{k} {v:.1f}" for k, v in w.build_s.items()))
    return w


@pytest.fixture(scope="module")
def sglang_tree(request) -> SglangTree:
    """SGLang's radix tree (Rust core) holding the workload's inserted
    requests; the peer cases are skipped, saying why, without SGLang."""
    why = sglang_unavailable()
    if why:
        pytest.skip(why)
    w = request.getfixturevalue("workload")
    tree = build_sglang_tree(w.inserted_seqs)
    print(f"\nSGLang {tree.version} tree ({type(tree.cache.tree_core).__name__}): "
          f"{len(w.inserted_seqs)} requests inserted in {tree.build_s:.1f} s")
    return tree

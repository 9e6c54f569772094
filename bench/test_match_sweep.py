"""``match_batch`` sweeps: batch size and tree size, each against the Python baseline.

* **Batch size** (group ``match sweep batch``): the tree and queries of
  ``test_match.py`` (the ``workload`` fixture: ``GPUKV_BENCH_INSERT`` trace
  requests inserted, the following requests as queries), matched as
  registered ``TokenSequence``s in batches of ``SWEEP_BATCHES`` requests.
* **Tree size** (group ``match sweep tree``): one tree grown in stages to
  ``GPUKV_BENCH_TREE_SIZES`` (default 500, 2000, 6000) inserted trace
  requests; at each stage the same ``TREE_SWEEP_BATCH`` queries (the requests
  after the largest tree) are matched. Parameters run in ascending order, so
  each stage only inserts the requests it adds.

Both time gpukv on registered sequences (``registered``) and the plain-Python
hash-chain walk (``baseline``, see ``matchbench.HashChainIndex``) on the same
queries, and check gpukv's answers against the baseline on full blocks.
``bench/tools/report.py`` prints query tokens/s per size.
"""

from __future__ import annotations


import numpy as np
import pytest

import gpukv
from gpukv import introspect
from gpukv.sim.workload import find_mooncake_trace, load_mooncake_trace

from .matchbench import BACKEND, HashChainIndex, T, finished_match
from . import knobs

SWEEP_BATCHES = (1, 4, 16, 64, 256, 1024)
TREE_SWEEP_BATCH = 256


def _tree_sizes() -> tuple:
    return tuple(sorted(knobs.integers("tree-sizes")))


# -- batch size ----------------------------------------------------------------------------------------
def batch_params():
    return [pytest.param(B, id=f"B{B}", marks=pytest.mark.benchmark(group="match sweep batch")) for B in SWEEP_BATCHES]


def sweep_info(w_queries, B, case, sweep, tree_requests, reused):
    toks = int(sum(q.size for q in w_queries[:B]))
    return {"suite": "match-sweep", "sweep": sweep, "case": case, "batch": B, "tree_requests": tree_requests,
            "query_tokens": toks, "reuse_fraction": float(reused / max(toks, 1)),
            "backend": "python" if case == "baseline" else BACKEND}


@pytest.mark.parametrize("B", batch_params())
def test_sweep_batch_gpukv(benchmark, workload, B):
    w = workload
    w.require(B)
    seqs = w.registered[:B]
    benchmark.extra_info.update(sweep_info(w.queries, B, "registered", "batch", w.inserted, w.expected[:B].sum()))
    m = benchmark(w.match, seqs)
    got = np.asarray(m.to_host().num_tokens)
    assert np.array_equal(got, w.expected[:B])


@pytest.mark.parametrize("B", batch_params())
def test_sweep_batch_baseline(benchmark, workload, B):
    w = workload
    w.require(B)
    lists = w.lists[:B]
    benchmark.extra_info.update(sweep_info(w.queries, B, "baseline", "batch", w.inserted, w.expected_full[:B].sum()))
    got = benchmark(w.baseline.match, lists)
    assert np.array_equal(np.array(got, dtype=np.int64), w.expected_full[:B])


# -- tree size -----------------------------------------------------------------------------------------
class GrowingTree:
    """gpukv and the baseline over the first ``size`` trace requests, grown on demand."""

    def __init__(self, path, sizes):
        reqs = load_mooncake_trace(path, limit=max(sizes) + TREE_SWEEP_BATCH)
        if len(reqs) < max(sizes) + TREE_SWEEP_BATCH:
            pytest.skip(f"the trace has fewer than {max(sizes) + TREE_SWEEP_BATCH} requests")
        self.reqs = reqs
        self.size = 0
        pages = sum(-(-r.input_length // T) for r in reqs[: max(sizes)])  # every block keeps its page
        self.mgr = gpukv.KVCacheManager(gpukv.CacheConfig(tokens_per_block=T, layers=[gpukv.Attention()],
                                                          pages_per_life_cycle=pages, backend=BACKEND))
        self.baseline = HashChainIndex(T)
        self.queries = [r.tokens() for r in reqs[max(sizes):]]
        self.lists = [q.tolist() for q in self.queries]
        self.registered = [self.mgr.token_sequence(q) for q in self.queries]

    def grow(self, size: int):
        for r in self.reqs[self.size:size]:
            toks = r.tokens()
            introspect.insert_sequence(self.mgr, toks)
            self.baseline.insert(toks)
        self.size = max(self.size, size)
        self.mgr.match_batch(self.registered)  # hash (and memoize) outside timing

    def match(self, requests) -> gpukv.BatchMatch:
        return finished_match(self.mgr, requests)


@pytest.fixture(scope="module")
def growing_tree():
    path = find_mooncake_trace()
    if path is None:
        pytest.skip("the Mooncake trace is not in shared/data (set GPUKV_TRACE)")
    return GrowingTree(path, _tree_sizes())


def tree_params():
    """(size, case) in the order the stages must run: the tree only grows."""
    return [pytest.param(n, case, id=f"tree{n}-{case}", marks=pytest.mark.benchmark(group="match sweep tree"))
            for n in _tree_sizes() for case in ("registered", "baseline")]


@pytest.mark.parametrize(("size", "case"), tree_params())
def test_sweep_tree(benchmark, growing_tree, size, case):
    g = growing_tree
    g.grow(size)
    assert g.size == size
    expected = np.array(g.baseline.match(g.lists), dtype=np.int64)
    if case == "baseline":
        got = np.array(benchmark(g.baseline.match, g.lists), dtype=np.int64)
        assert np.array_equal(got, expected)
    else:
        got = np.asarray(benchmark(g.match, g.registered).to_host().num_tokens)
        assert np.array_equal(got // T * T, expected), "full-block reuse differs from the Python baseline"
    benchmark.extra_info.update(sweep_info(g.queries, TREE_SWEEP_BATCH, case, "tree", size, got.sum()))

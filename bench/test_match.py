"""Batched reuse matching on a Mooncake-trace tree, against a Python baseline.

Per batch size (one benchmark group each), the same queries (the trace
requests right after the inserted ones) as:

* ``lists``: Python lists of ints, converted inside ``match_batch``;
* ``flat``: one int32 array with int64 offsets (on ``cuda`` already on the GPU);
* ``registered``: ``TokenSequence``s created (and hashed by one match) before
  timing, as a scheduler re-matching its waiting queue keeps them;
* ``registered_cold``: fresh ``TokenSequence``s, so the timed match also
  hashes every full block (creation itself is not timed);
* ``baseline``: the plain-Python hash-chain walk (``HashChainIndex.match``);
* ``convert``: merely turning the Python lists into one NumPy array;
* ``sglang_full_device``, ``sglang_match_prefix`` (B=64 and B=1024): the
  peer, SGLang's radix tree on its Rust core holding the same requests, each
  query prepared in SGLang's form before timing (``sglangmatch.py``).

Every gpukv case asserts its answers equal the baseline's on full blocks and
the independently computed partial-reuse answer exactly; the SGLang cases,
that their reuse lengths equal gpukv's flat answers in whole pages. Nothing
asserts a timing: ``bench/tools/report.py`` derives tokens/s and the goal
ratios.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from .matchbench import BATCHES, T, check_match
from .sglangmatch import PATHS

PEER_BATCHES = (64, 1024)  # the batch sizes of the SGLang cases


def batches(sizes=BATCHES):
    return [pytest.param(B, id=f"B{B}", marks=pytest.mark.benchmark(group=f"match B={B}")) for B in sizes]


@pytest.mark.parametrize("B", batches())
def test_gpukv_lists(benchmark, workload, B):
    w = workload
    w.require(B)
    lists = w.lists[:B]
    benchmark.extra_info.update(w.info(B, "lists"))
    m = benchmark(w.match, lists)
    check_match(w, B, m)


@pytest.mark.parametrize("B", batches())
def test_gpukv_flat(benchmark, workload, B):
    w = workload
    w.require(B)
    flat, offsets = w.flat(B, device=True)
    benchmark.extra_info.update(w.info(B, "flat"))
    m = benchmark(w.match, (flat, offsets))
    check_match(w, B, m)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("B", batches(PEER_BATCHES))
def test_sglang_walk(benchmark, workload, sglang_tree, B, path):
    """SGLang's lookup of the same queries in its own tree; its reuse must be
    gpukv's flat answer in whole pages, request by request."""
    w = workload
    w.require(B)
    prepared = sglang_tree.prepare(path, w.queries[:B])  # SGLang's form, untimed
    benchmark.extra_info.update(w.info(B, f"sglang_{path}"), **sglang_tree.info(path))
    got = np.array(benchmark(sglang_tree.lookup(path), prepared), dtype=np.int64)
    gpukv = np.asarray(w.match(w.flat(B, device=True)).to_host().num_tokens) // T * T
    assert np.array_equal(got, gpukv), "SGLang's reuse differs from gpukv's flat answer in whole pages"
    assert np.array_equal(got, w.expected_full[:B])


@pytest.mark.parametrize("B", batches())
def test_gpukv_registered(benchmark, workload, B):
    w = workload
    w.require(B)
    seqs = w.registered[:B]  # created and hashed in the fixture, outside timing
    benchmark.extra_info.update(w.info(B, "registered"))
    m = benchmark(w.match, seqs)
    check_match(w, B, m)


@pytest.mark.parametrize("B", batches())
def test_gpukv_registered_cold(benchmark, workload, B):
    w = workload
    w.require(B)
    made = []

    def fresh():
        for s in made:  # give the previous round's arena space back (untimed)
            s.release()
        made[:] = [w.mgr.token_sequence(q) for q in w.queries[:B]]
        return (list(made),), {}

    benchmark.extra_info.update(w.info(B, "registered_cold"))
    rounds = 5 if B >= 64 else 50
    m = benchmark.pedantic(w.match, setup=fresh, rounds=rounds, iterations=1)
    check_match(w, B, m)
    for s in made:
        s.release()


@pytest.mark.parametrize("B", batches())
def test_baseline_python_hash_chain(benchmark, workload, B):
    w = workload
    w.require(B)
    lists = w.lists[:B]
    benchmark.extra_info.update(w.info(B, "baseline"))
    got = benchmark(w.baseline.match, lists)
    assert np.array_equal(np.array(got, dtype=np.int64), w.expected_full[:B])


@pytest.mark.parametrize("B", batches())
def test_convert_lists_to_numpy(benchmark, workload, B):
    w = workload
    w.require(B)
    lists = w.lists[:B]
    total = sum(map(len, lists))
    benchmark.extra_info.update(w.info(B, "convert"))

    def convert():
        return np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int32, count=total)

    flat = benchmark(convert)
    assert np.array_equal(flat, w.flat(B)[0])


@pytest.mark.benchmark(group="match rewound B=64")
def test_partial_reuse_on_rewound_queries(benchmark, workload):
    """A correctness check more than a benchmark (timed only so that
    ``--benchmark-only`` runs it): the trace's divergent blocks differ from
    their first token, so the timed queries barely exercise partial reuse.
    Here inserted requests are rewound to non-block-aligned points and
    continued with new tokens (an edit); gpukv must reuse at least up to the
    rewind point (mid-block) and agree with the reference on every answer."""
    w = workload
    rng = np.random.default_rng(0)
    picks = rng.choice(len(w.inserted_seqs), size=64, replace=False)
    queries, cuts = [], []
    for i in picks:
        src = w.inserted_seqs[int(i)]
        cut = int(rng.integers(1, src.size))
        cut -= cut % 32 == 0  # never on a block boundary
        new = (src[cut:cut + 50].astype(np.int64) + 1) % 2**31  # differs from src at every position
        queries.append(np.concatenate([src[:cut], new.astype(np.int32)]))
        cuts.append(cut)
    base = w.baseline
    full = base.match([q.tolist() for q in queries])
    expected = [base.expected_partial(q, n) for q, n in zip(queries, full)]
    benchmark.extra_info.update(query_tokens=int(sum(q.size for q in queries)), reused_tokens=int(sum(expected)))
    got = benchmark(w.match, queries).to_host().num_tokens
    assert got.tolist() == expected
    assert all(e >= c for e, c in zip(expected, cuts))  # at least the rewind point is reused
    assert sum(e % 32 != 0 for e in expected) >= 32  # and mostly mid-block

"""The match-benchmark workload, importable outside pytest (for profiling):
a reuse tree built from the Mooncake conversation trace, the query batches in
every input shape, and the plain-Python hash-chain baseline built from the
same requests.

    from bench.matchbench import build_workload   # with the repository root on sys.path
    from gpukv.sim.workload import find_mooncake_trace
    w = build_workload(find_mooncake_trace(), 4000, 1024)

``GPUKV_BENCH_BACKEND`` picks gpukv's backend (default ``cpu``; ``cuda`` on a
machine with a GPU, where flat queries are handed over as device arrays and
every timed call ends with a device synchronize).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np

import gpukv
from gpukv import introspect
from gpukv.core.layout import BLK_INFO, FLAG_IN_USE, FLAG_ROOT
from gpukv.sim.workload import as_flat, load_mooncake_trace
from . import knobs

T = 32  # tokens per block, for gpukv and the baseline alike
BATCHES = (1, 64, 1024)
BACKEND = knobs.get("backend")


# -- the Python baseline ---------------------------------------------------------------------
class HashChainIndex:
    """What engines that keep the prefix index in Python do: a dict from
    ``hash((parent block id, tuple(block tokens)))`` to a block id, walked one
    full block at a time. Partial blocks are never indexed nor matched.

    ``children`` is not part of the baseline: it records, per parent id, where
    each child block's tokens (full or a request's partial tail) came from, so
    the fixture can compute the exact partial-reuse answer independently of
    gpukv (see ``expected_partial``)."""

    def __init__(self, T: int):
        self.T = T
        self.blocks: dict[int, int] = {}
        self.children: dict[int, list] = {}
        self._tails: set[int] = set()

    def insert(self, tokens: np.ndarray):
        T = self.T
        n = tokens.size // T
        parent = -1
        for j, blk in enumerate(tokens[: n * T].reshape(n, T).tolist()):
            key = hash((parent, tuple(blk)))
            b = self.blocks.get(key)
            if b is None:
                b = self.blocks[key] = len(self.blocks)
                self.children.setdefault(parent, []).append(tokens[j * T:(j + 1) * T])
            parent = b
        tail = tokens[n * T:]
        if tail.size:
            key = hash((parent, tuple(tail.tolist())))
            if key not in self._tails:
                self._tails.add(key)
                self.children.setdefault(parent, []).append(tail)

    def match(self, queries) -> list[int]:
        """Reusable full-block prefix length of each query (Python lists)."""
        T = self.T
        index = self.blocks
        out = []
        for q in queries:
            parent = -1
            n = 0
            for j in range(0, len(q) - T + 1, T):
                b = index.get(hash((parent, tuple(q[j:j + T]))))
                if b is None:
                    break
                parent = b
                n += T
            out.append(n)
        return out

    def last_block(self, q, n_full: int) -> int:
        """The block id reached after ``n_full`` matched tokens (re-walk)."""
        parent = -1
        for j in range(0, n_full, self.T):
            parent = self.blocks[hash((parent, tuple(q[j:j + self.T])))]
        return parent

    def expected_partial(self, q: np.ndarray, n_full: int) -> int:
        """gpukv's answer with partial reuse on (docs/semantics.md §2.3, every block
        fully covered): the full-block prefix plus the longest common prefix
        of the next query block with any child of the last matched block."""
        rest = q[n_full:n_full + self.T]
        if rest.size == 0:
            return n_full
        best = 0
        for c in self.children.get(self.last_block(q.tolist()[:n_full], n_full), ()):
            m = min(c.size, rest.size)
            diff = np.nonzero(c[:m] != rest[:m])[0]
            best = max(best, int(diff[0]) if diff.size else m)
        return n_full + best


def finished_match(mgr: gpukv.KVCacheManager, requests) -> gpukv.BatchMatch:
    """``match_batch``, finished: on a GPU the kernels run asynchronously, so
    a timed call waits for them."""
    m = mgr.match_batch(requests)
    mgr._backend.synchronize()
    return m


# -- the workload ------------------------------------------------------------------------------
@dataclass
class MatchWorkload:
    mgr: gpukv.KVCacheManager
    baseline: HashChainIndex
    inserted: int
    inserted_tokens: int
    tree_blocks: int
    inserted_seqs: list  # int32 arrays, the inserted trace requests
    queries: list  # int32 arrays, the requests right after the inserted ones
    lists: list  # the same as Python lists of ints
    registered: list  # the same as TokenSequences of mgr
    expected_full: np.ndarray  # baseline answer per query
    expected: np.ndarray  # exact gpukv answer (partial reuse on) per query
    build_s: dict = field(default_factory=dict)

    def require(self, B: int):
        if B > len(self.queries):
            import pytest

            pytest.skip(f"batch {B} needs more than the {len(self.queries)} queries (GPUKV_BENCH_QUERIES)")

    def flat(self, B: int, device: bool = False):
        """The first ``B`` queries as ``(int32 tokens, int64 offsets)``; with
        ``device``, already on the manager's device (as a scheduler on
        ``cuda`` keeps them)."""
        flat, offsets = as_flat(self.queries[:B])
        if device:
            b = self.mgr._backend
            flat, offsets = b.to_device(flat), b.to_device(offsets)
        return flat, offsets

    def match(self, requests) -> gpukv.BatchMatch:
        return finished_match(self.mgr, requests)

    def info(self, B: int, case: str) -> dict:
        toks = int(sum(q.size for q in self.queries[:B]))
        return {
            "case": case,
            "batch": B,
            "backend": self.mgr._backend.name,
            "query_tokens": toks,
            "inserted_requests": self.inserted,
            "inserted_tokens": self.inserted_tokens,
            "tree_blocks": self.tree_blocks,
            "tokens_per_block": T,
            "reused_tokens": int(self.expected[:B].sum()),
            "reuse_fraction": float(self.expected[:B].sum() / max(toks, 1)),
            "full_block_reuse_fraction": float(self.expected_full[:B].sum() / max(toks, 1)),
            **threads(),
        }


def threads() -> dict:
    """The thread settings of the run, and how busy the machine was."""
    from numba import config

    return {"NUMBA_NUM_THREADS": int(config.NUMBA_NUM_THREADS),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "unset"),
            "load_average": round(os.getloadavg()[0], 2)}


def build_workload(path, n_ins: int, n_q: int) -> MatchWorkload:
    """The tree, the baseline and the queries (also usable outside pytest,
    e.g. to profile: ``build_workload(find_mooncake_trace(), 4000, 1024)``)."""
    times = {}
    t0 = time.perf_counter()
    reqs = load_mooncake_trace(path, limit=n_ins + n_q)
    if len(reqs) < n_ins + n_q:
        raise ValueError(f"the trace has {len(reqs)} requests, fewer than {n_ins} + {n_q}")
    inserted = [r.tokens() for r in reqs[:n_ins]]
    queries = [r.tokens() for r in reqs[n_ins:]]
    times["expand"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    pages = sum(-(-t.size // T) for t in inserted)  # every block gets a page: no pruning
    mgr = gpukv.KVCacheManager(
        gpukv.CacheConfig(tokens_per_block=T, layers=[gpukv.Attention()], pages_per_life_cycle=pages, backend=BACKEND)
    )
    for toks in inserted:
        introspect.insert_sequence(mgr, toks)
    times["gpukv_insert"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    base = HashChainIndex(T)
    for toks in inserted:
        base.insert(toks)
    times["baseline_insert"] = time.perf_counter() - t0

    lists = [q.tolist() for q in queries]
    expected_full = np.array(base.match(lists), dtype=np.int64)
    expected = np.array([base.expected_partial(q, int(n)) for q, n in zip(queries, expected_full)], dtype=np.int64)
    registered = [mgr.token_sequence(q) for q in queries]
    mgr.match_batch(registered)  # hash the registered blocks once (cached per sequence)
    flags = mgr._backend.to_host(mgr._tables.blocks)[:, BLK_INFO]
    tree_blocks = int(((flags & FLAG_IN_USE) != 0).sum() - ((flags & FLAG_ROOT) != 0).sum())
    return MatchWorkload(mgr, base, n_ins, int(sum(t.size for t in inserted)), tree_blocks, inserted, queries, lists,
                         registered, expected_full, expected, times)


def check_match(w: MatchWorkload, B: int, m: gpukv.BatchMatch):
    """gpukv's answers are exactly the baseline's on full blocks, and exactly
    the independently computed partial-reuse answer overall."""
    got = np.asarray(m.to_host().num_tokens)
    assert got.shape == (B,)
    assert np.array_equal(got // T * T, w.expected_full[:B]), "full-block reuse differs from the Python baseline"
    assert np.array_equal(got, w.expected[:B]), "partial reuse differs from the reference"

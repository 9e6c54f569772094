"""Commit throughput on the Mooncake trace: prefill chunks and decode steps.

What a serving engine does after each forward pass: ``kv.resize(capacity,
history)`` for the step's tokens, then ``kv.commit(tokens)`` to make them
reusable. Timed per round, over ``GPUKV_BENCH_COMMIT_REQUESTS`` (default 64)
trace requests (each hash id expanded to 512 deterministic tokens):

* ``prefill``: each request's prompt in chunks of ``CHUNK`` tokens, one
  resize and one commit per chunk; tokens/s = prompt tokens / round time.
* ``decode``: ``DECODE_STEPS`` steps after the prompt, every request adding one
  token per step and committing it (a resize, to the end of the next block,
  only when the token starts a block); tokens/s = requests x steps / round
  time.

Each runs on two models: ``attention`` (full attention) and ``hybrid`` (full
attention + a 1024-token sliding window + SSM, ``commit_min_snapshot``, so an
unaligned commit also snapshots its partial block and the SSM state). Every
round starts from a fresh manager (untimed), so rounds do the same work.

``baseline`` (one per phase; it has no model) is the plain-Python reference of the same step: what an engine
keeping its prefix index in Python does on commit, hashing every newly
completed full block with its parent into a dict (partial blocks are never
indexed; no pages, no coverage). ``bench/tools/report.py`` prints the tokens/s.
"""

from __future__ import annotations


import numpy as np
import pytest

import gpukv
from gpukv.sim.workload import find_mooncake_trace, load_mooncake_trace
from . import knobs

T = 32
CHUNK = 512
DECODE_STEPS = 32
MODELS = {
    "attention": {"layers": [gpukv.Attention()]},
    "hybrid": {"layers": [gpukv.Attention(), gpukv.Attention(window=1024), gpukv.Ssm()], "commit_min_snapshot": True},
}


class PyCommitIndex:
    """The baseline: a dict ``hash((parent id, block tokens)) -> block id``,
    fed one committed chunk at a time per request (Python lists)."""

    def __init__(self, T: int):
        self.T = T
        self.blocks: dict[int, int] = {}

    def open(self):
        return [-1, []]  # (last full block id, pending partial tail)

    def commit(self, state, tokens: list):
        T = self.T
        tail = state[1]
        tail.extend(tokens)
        if len(tail) < T:
            return
        parent, blocks = state[0], self.blocks
        n = len(tail) // T * T
        for j in range(0, n, T):
            parent = blocks.setdefault(hash((parent, tuple(tail[j:j + T]))), len(blocks))
        state[0] = parent
        del tail[:n]


@pytest.fixture(scope="module")
def prompts():
    path = find_mooncake_trace()
    if path is None:
        pytest.skip("the Mooncake trace is not in shared/data (set GPUKV_TRACE)")
    n = knobs.integer("commit-requests")
    return [r.tokens() for r in load_mooncake_trace(path, limit=n)]


def new_manager(model: str, prompts) -> gpukv.KVCacheManager:
    pages = sum(-(-(p.size + DECODE_STEPS) // T) for p in prompts) + 64  # room for everything: no eviction
    return gpukv.KVCacheManager(gpukv.CacheConfig(tokens_per_block=T, pages_per_life_cycle=pages, backend="cpu",
                                                  **MODELS[model]))


def warm(model, prompts):
    """Compile (or load) the kernels outside any timing."""
    mgr = new_manager(model, prompts[:1])
    kv = mgr.create_kv_cache()
    kv.resume()
    kv.resize(T + 1, 0)
    kv.commit(prompts[0][: T + 1])
    kv.close()


def info(phase, case, model, tokens, requests):
    return {"suite": "commit", "phase": phase, "case": case, "model": model, "tokens": int(tokens),
            "requests": requests, "tokens_per_block": T, "chunk": CHUNK if phase == "prefill" else 1}


def params(phase):
    return [pytest.param(m, id=m, marks=pytest.mark.benchmark(group=f"commit {phase}")) for m in MODELS]


def baseline_group(phase):
    return pytest.mark.benchmark(group=f"commit {phase}")


# -- prefill -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", params("prefill"))
def test_gpukv_prefill_commit(benchmark, prompts, model):
    warm(model, prompts)
    state = {}

    def setup():
        mgr = new_manager(model, prompts)
        kvs = [mgr.create_kv_cache() for _ in prompts]
        for kv in kvs:
            kv.resume()
        state["mgr"], state["kvs"] = mgr, kvs
        return (kvs,), {}

    def prefill(kvs):
        for kv, p in zip(kvs, prompts):
            for n0 in range(0, p.size, CHUNK):
                n1 = min(p.size, n0 + CHUNK)
                kv.resize(n1, n0)
                kv.commit(p[n0:n1])

    benchmark.extra_info.update(info("prefill", "gpukv", model, sum(p.size for p in prompts), len(prompts)))
    benchmark.pedantic(prefill, setup=setup, rounds=3, iterations=1)
    kvs = state["kvs"]
    assert [kv.num_committed_tokens for kv in kvs] == [p.size for p in prompts]
    for kv in kvs:
        kv.close()
    # Everything committed is reusable now (hybrid: at the chunk endpoints).
    assert state["mgr"].probe_reuse(prompts[0]) == prompts[0].size


@baseline_group("prefill")
def test_baseline_python_prefill_commit(benchmark, prompts):
    lists = [p.tolist() for p in prompts]

    def setup():
        index = PyCommitIndex(T)
        return (index, [index.open() for _ in lists]), {}

    def prefill(index, states):
        for st, p in zip(states, lists):
            for n0 in range(0, len(p), CHUNK):
                index.commit(st, p[n0:n0 + CHUNK])

    benchmark.extra_info.update(info("prefill", "baseline", "any", sum(len(p) for p in lists), len(lists)))
    benchmark.pedantic(prefill, setup=setup, rounds=3, iterations=1)


# -- decode ------------------------------------------------------------------------------------------
def decode_tokens(prompts):
    rng = np.random.default_rng(0)
    return [rng.integers(0, 2**31 - 1, size=DECODE_STEPS, dtype=np.int32) for _ in prompts]


@pytest.mark.parametrize("model", params("decode"))
def test_gpukv_decode_commit(benchmark, prompts, model):
    warm(model, prompts)
    outs = decode_tokens(prompts)
    state = {}

    def setup():
        mgr = new_manager(model, prompts)
        kvs = []
        for p in prompts:  # the prompt, untimed
            kv = mgr.create_kv_cache()
            kv.resume()
            kv.resize(p.size, 0)
            kv.commit(p)
            kvs.append(kv)
        state["kvs"] = kvs
        return (kvs,), {}

    def decode(kvs):
        for step in range(DECODE_STEPS):  # one scheduler step: every request adds one token
            for kv, p, out in zip(kvs, prompts, outs):
                n = p.size + step
                if n + 1 > kv.capacity:  # pages a block at a time
                    kv.resize(-(-(n + 1) // T) * T)
                kv.commit(out[step:step + 1])

    benchmark.extra_info.update(info("decode", "gpukv", model, DECODE_STEPS * len(prompts), len(prompts)))
    benchmark.pedantic(decode, setup=setup, rounds=3, iterations=1)
    assert [kv.num_committed_tokens for kv in state["kvs"]] == [p.size + DECODE_STEPS for p in prompts]
    for kv in state["kvs"]:
        kv.close()


@baseline_group("decode")
def test_baseline_python_decode_commit(benchmark, prompts):
    lists = [p.tolist() for p in prompts]
    outs = [o.tolist() for o in decode_tokens(prompts)]

    def setup():
        index = PyCommitIndex(T)
        states = [index.open() for _ in lists]
        for st, p in zip(states, lists):
            index.commit(st, p)
        return (index, states), {}

    def decode(index, states):
        for step in range(DECODE_STEPS):
            for st, out in zip(states, outs):
                index.commit(st, out[step:step + 1])

    benchmark.extra_info.update(info("decode", "baseline", "any", DECODE_STEPS * len(lists), len(lists)))
    benchmark.pedantic(decode, setup=setup, rounds=3, iterations=1)

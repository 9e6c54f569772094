"""One per-cache call on a busy manager: what an engine's scheduler pays per request.

vLLM's scheduler calls its KV-cache manager once per request and step
(``allocate_slots``); an engine driving gpukv the same way makes one
``kv.resize`` or ``kv.commit`` per request, hundreds per step, so the cost of
a single call (its checks, the table room, one kernel launch, the results)
is what matters, not a batch's throughput. Timed, one call per round, on a
``cpu`` manager with ``GPUKV_BENCH_CALL_CACHES`` (default 256) running caches
of a 300-token prompt each (full attention, T = 32, pages for everything: no
eviction), taking the caches in turn:

* ``resize``: ``kv.resize(capacity + T)``, one block more (a decode step
  starting a block);
* ``commit token``: ``kv.commit([token])``, a decode step's token (completes
  no block, mostly);
* ``commit block``: ``kv.commit(T tokens)``, a prefill chunk of one block
  (completes one block);
* ``dict update``: ``d[key] = value``, the scale of a plain Python call.

What a round leaves for the next (a cache grown past its room, filled up) is
undone in the untimed setup. ``bench/tools/report.py`` prints µs per call.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import gpukv
from . import knobs

T = 32
PROMPT = 300
CACHES = knobs.integer("call-caches")
ROUNDS = 2000
GROUP = pytest.mark.benchmark(group="per-cache call")


@pytest.fixture(scope="module")
def running():
    """A manager and its running caches, each with its prompt committed."""
    mgr = gpukv.KVCacheManager(gpukv.CacheConfig(tokens_per_block=T, layers=[gpukv.Attention()],
                                                  pages_per_life_cycle=CACHES * 64 + 1024, backend="cpu"))
    rng = np.random.default_rng(0)
    kvs = mgr.create_kv_caches([[] for _ in range(CACHES)])
    assert mgr.resume_batch(kvs).all()
    assert mgr.resize_batch(kvs, [PROMPT + T] * CACHES, [0] * CACHES).all()
    mgr.commit_batch(kvs, [rng.integers(0, 2**31 - 1, PROMPT, dtype=np.int32) for _ in kvs])
    yield mgr, kvs, rng
    mgr.close_batch(kvs)


def info(call: str) -> dict:
    return {"suite": "call", "call": call, "caches": CACHES, "tokens_per_block": T}


@GROUP
def test_resize_by_one_block(benchmark, running):
    mgr, kvs, _ = running
    turn = itertools.cycle(kvs)

    def setup():
        kv = next(turn)
        base = -(-kv.history_length // T) * T
        if kv.capacity >= base + 16 * T:  # pages for every cache's growth, never short
            assert kv.resize(base)
        return (kv, kv.capacity + T), {}

    benchmark.extra_info.update(info("resize"))
    benchmark.pedantic(lambda kv, cap: kv.resize(cap), setup=setup, rounds=ROUNDS, iterations=1, warmup_rounds=50)


@pytest.mark.parametrize("tokens", [1, T], ids=["token", "block"])
@GROUP
def test_commit(benchmark, running, tokens):
    mgr, kvs, rng = running
    turn = itertools.cycle(kvs)
    chunks = [rng.integers(0, 2**31 - 1, tokens, dtype=np.int32).tolist() for _ in range(64)]
    pick = itertools.cycle(chunks)

    def setup():
        kv = next(turn)
        n = kv.num_committed_tokens + tokens
        if n > kv.capacity:
            assert kv.resize(-(-n // T) * T + 4 * T, kv.num_committed_tokens)
        return (kv, next(pick)), {}

    benchmark.extra_info.update(info(f"commit {'token' if tokens == 1 else 'block'}"))
    benchmark.pedantic(lambda kv, chunk: kv.commit(chunk), setup=setup, rounds=ROUNDS, iterations=1,
                       warmup_rounds=50)


@GROUP
def test_baseline_dict_update(benchmark):
    d: dict = {}
    keys = itertools.count()
    benchmark.extra_info.update(info("dict update"))
    benchmark.pedantic(lambda k: d.__setitem__(k, k), setup=lambda: ((next(keys),), {}), rounds=ROUNDS,
                       iterations=1)

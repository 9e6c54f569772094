"""The fixed host cost of the batched cache calls, per call.

A manager with 256 running caches and 4 more (full attention, T = 32,
``cpu`` backend, a pool with room for everything), then per call the median over many calls
of:

* ``append_batch`` of the 256 caches (a ``CacheBatch``), one token each,
  room for one more: the decode step;
* ``commit_batch`` of 16 caches, one token each (a flat token array and
  offsets, as vLLM's scheduler adapter commits);
* ``resize_batch`` of 16 caches, one block more each (each call timed
  alone, from capacities put back untimed);
* a close and create cycle of the 4 other caches: ``close_batch`` of 4, then
  ``create_kv_caches`` of 4 new requests (``resume_batch`` and
  ``resize_batch`` of them to their prompt, then ``commit_batch`` of it,
  as a scheduler admits), the cycle timed as one.

Run from the repository root, one thread::

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python bench/tools/batch_call_cost.py [--calls N] [--rounds R]

``--where`` prints instead how each call's time splits between the
sequence kernels and the host code around them, then a line profile
(``line_profiler``) of ``append_batch`` and ``commit_batch``: ``CacheCalls``'
steps, the pool's launch and the launcher's aftermath, the kernel as one line. Each
figure is the median of ``--rounds`` rounds of ``--calls`` calls (µs per
call); rounds interleave the four measurements, so that a loaded machine
spreads its noise over all of them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

T = 32
B = 256
PROMPT = 4 * T + 5  # tokens the first running cache holds to start with (each next one a token more, mod T)


def build(n_running: int = B):
    import gpukv

    pages = 1 << 16
    mgr = gpukv.KVCacheManager(gpukv.CacheConfig(
        tokens_per_block=T, layers=[gpukv.Attention()], pages_per_life_cycle=pages,
        enable_partial_reuse=False, initial_blocks=pages, backend="cpu"))
    rng = np.random.default_rng(0)
    # Lengths a token apart, so that a step completes a block in a few caches, not in all at once.
    prompts = [rng.integers(1, 50_000, PROMPT + i % T).tolist() for i in range(n_running)]
    kvs = admit(mgr, prompts)
    return mgr, kvs, rng


def admit(mgr, prompts):
    """New running caches holding ``prompts``, with room for one more token each."""
    kvs = mgr.create_kv_caches(prompts)
    assert mgr.resume_batch(kvs).all()
    assert mgr.resize_batch(kvs, [len(p) + 1 for p in prompts]).all()
    mgr.commit_batch(kvs, prompts)
    return kvs


_KERNEL_TIME = [0.0]  # --where: seconds in the sequence kernels so far


class Calls:
    """The measured calls on one manager, each callable once per timed call."""

    def __init__(self):
        self.mgr, kvs, self.rng = build(B + 4)
        self.batch = self.mgr.cache_batch(kvs[:B])
        self.offsets = np.arange(B + 1, dtype=np.int64)
        self.step = 0
        self.small = list(kvs[:16])  # commit_batch's and resize_batch's caches
        self.small_tokens = np.full(16, 5, dtype=np.int32)
        self.small_offsets = np.arange(17, dtype=np.int64)
        self.churn = list(kvs[B:])  # closed and created again

    def append(self):
        tokens = np.full(B, 7 + self.step % 1000, dtype=np.int32)
        self.step += 1
        ok = self.mgr.append_batch(self.batch, (tokens, self.offsets), room=1)
        assert ok.all()

    def commit(self):
        # One flat array, as vLLM's step commits (gpukv/vllm/step.py); room made untimed.
        self.mgr.commit_batch(self.small, (self.small_tokens, self.small_offsets))

    def resize(self) -> float:
        """µs of one ``resize_batch`` a block up, from capacities put back
        (untimed) to a block past the committed tokens: the caches keep the
        length a running batch has, not one that grows with every call."""
        kvs = self.small
        base = [-(-(kv.num_committed_tokens + 1) // T) * T for kv in kvs]
        kernels = _KERNEL_TIME[0]
        self.mgr.resize_batch(kvs, base)
        _KERNEL_TIME[0] = kernels  # --where: the untimed call's kernel left out
        want = [c + T for c in base]
        t0 = time.perf_counter()
        self.mgr.resize_batch(kvs, want)
        return (time.perf_counter() - t0) * 1e6

    def cycle(self):
        self.mgr.close_batch(self.churn)
        prompts = [self.rng.integers(1, 50_000, PROMPT).tolist() for _ in range(4)]
        self.churn = admit(self.mgr, prompts)


def timed(fn, calls: int) -> float:
    """µs per call of ``calls`` calls of ``fn`` (one that times itself: the
    sum of the µs it returns)."""
    if fn.__name__ == "resize":
        return sum(fn() for _ in range(calls)) / calls
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def measure(c: Calls, calls: int, rounds: int) -> dict:
    # append_batch leaves every cache room for its next token; commit_batch
    # needs that room too, so resize_batch runs before it each round.
    plan = [("append_batch B=256", c.append, calls), ("resize_batch 16", c.resize, calls),
            ("commit_batch 16", c.commit, calls), ("close+create 4", c.cycle, max(1, calls // 4))]
    out = {name: [] for name, _, _ in plan}
    for _ in range(rounds):
        for name, fn, k in plan:
            if name == "commit_batch 16":  # room for k tokens each and the next append, untimed
                c.mgr.resize_batch(c.small, [kv.num_committed_tokens + k + 1 for kv in c.small])
            out[name].append(timed(fn, k))
    return {name: statistics.median(v) for name, v in out.items()}


def split(c: Calls, calls: int, rounds: int) -> None:
    """Per call: the median time, and of it the kernels' (timed around
    ``launcher.call_kernel``) and the rest, the host's."""
    from gpukv import launcher

    kernel_time = _KERNEL_TIME
    call_kernel = launcher.call_kernel

    def timed_kernel(*args):
        t0 = time.perf_counter()
        try:
            call_kernel(*args)
        finally:
            kernel_time[0] += time.perf_counter() - t0

    launcher.call_kernel = timed_kernel
    try:
        plan = [("append_batch B=256", c.append, calls), ("resize_batch 16", c.resize, calls),
                ("commit_batch 16", c.commit, calls), ("close+create 4", c.cycle, max(1, calls // 4))]
        out = {name: [] for name, _, _ in plan}
        for _ in range(rounds):
            for name, fn, k in plan:
                if name == "commit_batch 16":
                    c.mgr.resize_batch(c.small, [kv.num_committed_tokens + k + 1 for kv in c.small])
                kernel_time[0] = 0.0
                total = timed(fn, k)
                out[name].append((total, kernel_time[0] / k * 1e6))
    finally:
        launcher.call_kernel = call_kernel
    print(f"{'':20s} {'call':>8s} {'kernels':>8s} {'host':>8s}  (µs, medians)")
    for name, v in out.items():
        total = statistics.median(t for t, _ in v)
        kern = statistics.median(k for _, k in v)
        print(f"{name:20s} {total:8.1f} {kern:8.1f} {total - kern:8.1f}")


def where(c: Calls, calls: int):
    from line_profiler import LineProfiler

    from gpukv import batch, cache_pool, inputs, launcher

    lp = LineProfiler()
    for f in (batch.CacheCalls.append, batch.CacheCalls._append, batch.CacheCalls.commit, batch.CacheCalls._commit,
              batch.CacheCalls._reserve_and_launch, batch.CacheCalls._launch_part, batch.CacheCalls._tokens,
              batch.CacheCalls._scalars, batch.CacheCalls._ask_priorities,
              cache_pool.CachePool.launch_calls, cache_pool.CachePool._launch_work, cache_pool.CachePool.reserve,
              launcher.Launcher.launch, launcher.Launcher.settle, inputs.cache_slots, inputs.token_batch,
              inputs.flags, inputs.ints_or_one):
        lp.add_function(f)
    c.mgr.resize_batch(c.small, [kv.num_committed_tokens + 2 * calls + 1 for kv in c.small])
    lp.enable_by_count()
    for _ in range(calls):
        c.append()
        c.commit()
    lp.disable_by_count()
    lp.print_stats(output_unit=1e-6, stripzeros=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=200, help="calls per round (close+create: a quarter)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--where", action="store_true", help="a line profile of append_batch and commit_batch")
    args = ap.parse_args(argv)
    import gpukv

    c = Calls()
    measure(c, 20, 1)  # warm: the kernels loaded, the dispatch learnt
    print(f"gpukv {os.path.dirname(gpukv.__file__)}, {B} running caches, T={T}, cpu, "
          f"load {os.getloadavg()[0]:.2f}", file=sys.stderr)
    if args.where:
        split(c, args.calls, args.rounds)
        where(c, args.calls)
        return 0
    for name, us in measure(c, args.calls, args.rounds).items():
        per = f"  ({us / B:.2f} µs per sequence)" if name.startswith("append") else ""
        print(f"{name:20s} {us:8.1f} µs per call{per}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

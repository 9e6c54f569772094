"""The cost of KV cache events in a batched engine step.

    NUMBA_NUM_THREADS=1 python bench/tools/eventbench.py [--requests 400] [--batch 64] [--profile]

Drives one manager through the batched calls (``create_kv_caches``,
``resume_batch``, ``resize_batch``, ``commit_batch``, ``close_batch``) with
requests that share prefixes, in a pool small enough to evict, once with
events off and once on (every step drains ``get_latest_events``), and prints
the time per step of each. ``--profile`` adds cProfile's top functions of the
run with events on.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np

import gpukv

T = 32


def workload(n: int, seed: int = 0) -> list:
    """``n`` prompts: one of 8 shared prefixes (4-24 blocks) + a private tail."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 50_000, size=T * int(rng.integers(4, 25))) for _ in range(8)]
    return [np.concatenate([prefixes[int(rng.integers(8))], rng.integers(0, 50_000, size=int(rng.integers(T, 12 * T)))])
            .astype(np.int32) for _ in range(n)]


def run(prompts: list, batch: int, events: bool, decode_steps: int = 8) -> tuple:
    """(seconds, steps, events seen) for the whole workload."""
    mgr = gpukv.KVCacheManager(gpukv.CacheConfig(
        tokens_per_block=T, layers=[gpukv.Attention()], pages_per_life_cycle=4000,
        max_kv_event_entries=10**6 if events else 0, backend="cpu"))
    mgr.get_latest_events()
    steps = seen = 0
    t0 = time.perf_counter()
    for at in range(0, len(prompts), batch):
        group = prompts[at:at + batch]
        kvs = mgr.create_kv_caches([p[:-1] for p in group])
        mgr.resume_batch(kvs)
        reused = [kv.num_committed_tokens for kv in kvs]
        sizes = [len(p) + decode_steps for p in group]
        ok = mgr.resize_batch(kvs, sizes, reused)
        live = [kv for kv, good in zip(kvs, ok) if good]
        mgr.commit_batch(live, [p[r:] for p, r, good in zip(group, reused, ok) if good])
        seen += len(mgr.get_latest_events())
        steps += 1
        offsets = np.arange(len(live) + 1, dtype=np.int64)
        for s in range(decode_steps):
            mgr.commit_batch(live, (np.full(len(live), s, dtype=np.int32), offsets))
            seen += len(mgr.get_latest_events())
            steps += 1
        mgr.close_batch(kvs)
        seen += len(mgr.get_latest_events())
        steps += 1
    return time.perf_counter() - t0, steps, seen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    prompts = workload(a.requests)
    run(prompts[: a.batch], a.batch, True)  # warm up: kernel loads
    for events in (False, True):
        dt, steps, seen = run(prompts, a.batch, events)
        print(f"events {'on ' if events else 'off'}: {dt:.3f} s, {steps} steps, {1e3 * dt / steps:.2f} ms/step, {seen} events")
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        run(prompts, a.batch, True)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()

"""vLLM's scheduler step on each manager, the managers alternated round by round.

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python bench/tools/vllm_step_ab.py [--phase churn] [--rounds 15]

The workload and the step of ``bench/test_vllm_step.py`` (vLLM's own
``Scheduler``: ``schedule()`` + ``update_from_output()``, B running requests,
``--phase decode`` or ``churn``), on stock vLLM's manager and gpukv's in both
modes, but one round of each in turn, ``--rounds`` times, in one process:
the pytest-benchmark suite times all of one manager's rounds before the
next's, so a drift in the machine's load lands on one of them, while here
it spreads over all. Prints µs per step per manager (median, min-max) and
each gpukv mode's ratio to stock, round by round paired (median, min-max).
The knobs are the suite's (``GPUKV_BENCH_VLLM_BATCH``, ``..._STEPS``,
``..._CHURN``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's bench package
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase", choices=("decode", "churn"), default="churn")
    ap.add_argument("--rounds", type=int, default=15, help="timed rounds of each manager (after one warm-up round)")
    ap.add_argument("--managers", default="stock,parity,partial", help="comma-separated, of stock, parity, partial")
    args = ap.parse_args(argv)
    # The suite's arrivals are sized by its round count: enough for these.
    os.environ["GPUKV_BENCH_VLLM_ROUNDS"] = str(args.rounds + 1)
    from bench import test_vllm_step as bench

    churn = bench.CHURN if args.phase == "churn" else 0
    managers = args.managers.split(",")
    runs = {m: bench.Run(m, churn) for m in managers}
    for run in runs.values():
        run.round()  # warm: every path of a step once
    per_step = {m: [] for m in managers}
    for _ in range(args.rounds):
        for m, run in runs.items():
            t = time.perf_counter()
            run.round()
            per_step[m].append((time.perf_counter() - t) / bench.STEPS * 1e6)
    print(f"vLLM step, {args.phase}, B={bench.BATCH}, {bench.STEPS} steps a round, {args.rounds} rounds alternated; "
          f"load average {os.getloadavg()[0]:.1f}")
    for m in managers:
        v = per_step[m]
        print(f"  {m:8s} {statistics.median(v):8.0f} µs per step ({min(v):.0f}-{max(v):.0f})")
    if "stock" in per_step:
        for m in managers:
            if m != "stock":
                r = [a / b for a, b in zip(per_step[m], per_step["stock"])]
                print(f"  {m} / stock, paired by round: {statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f})")


if __name__ == "__main__":
    main()

"""The admission of ``bench/test_step.py``, gpukv and vLLM alternated round by round.

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python bench/tools/admission_ab.py [--batch 256] [--rounds 9]

The workload, pool and drivers of ``test_step.py``'s admission (``stepbench``:
from an empty pool, the first B trace requests admitted one after the other,
each prefilled in 512-token chunks), but one round of each system in turn,
``--rounds`` times, in one process: the pytest-benchmark suite times all of
one system's rounds before the other's, so a drift in the machine's load
lands on one of them, while here it spreads over both. Every round's reuse
is checked against ``stepbench.reference_reuse``. Prints prompt tokens per
second per system (median, min-max) and gpukv's ratio to vLLM, round by
round paired (median, min-max).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's bench package

SYSTEMS = ("gpukv", "vllm")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256, help="requests admitted per round")
    ap.add_argument("--rounds", type=int, default=9, help="timed rounds of each system (after one warm-up round)")
    args = ap.parse_args(argv)
    from bench import knobs
    from bench import stepbench as sb

    for system in SYSTEMS:
        why = sb.peer_unavailable(system) if system != "gpukv" else None
        if why:
            raise SystemExit(why)
    if sb.trace_path() is None:
        raise SystemExit("the Mooncake trace is not in shared/data (set GPUKV_TRACE)")
    w = sb.load_workload(max(knobs.integer("step-requests"), args.batch + 1), knobs.integer("step-decode"), args.rounds)
    order = list(range(args.batch))
    w.prepare(order)
    expected = sb.reference_reuse(w, order)
    pages = sb.roomy_pages(w, order, knobs.integer("step-decode") * args.rounds + 1)
    tokens = sum(int(w.prompts[i].size) for i in order)
    seconds = {s: [] for s in SYSTEMS}
    for r in range(args.rounds + 1):  # the first round of each warms its code paths
        for system in SYSTEMS:
            d = sb.make_driver(system, w, pages, args.batch)
            t = time.perf_counter()
            _, reused = sb.admit_all(d, order)
            dt = time.perf_counter() - t
            if reused != expected:
                raise SystemExit(f"{system} reused other token counts than the reference in round {r}")
            if r:
                seconds[system].append(dt)
    print(f"admission, B={args.batch} ({tokens:,} prompt tokens), {args.rounds} rounds alternated; "
          f"load average {os.getloadavg()[0]:.1f}")
    for system in SYSTEMS:
        rate = [tokens / s / 1e6 for s in seconds[system]]
        print(f"  {system:6s} {statistics.median(rate):6.2f} M prompt tok/s ({min(rate):.2f}-{max(rate):.2f})")
    ratio = [v / g for g, v in zip(seconds["gpukv"], seconds["vllm"])]
    print(f"  gpukv / vLLM, paired by round: {statistics.median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f})")


if __name__ == "__main__":
    main()

"""gpukv's flat match and SGLang's radix-tree lookup, alternated call by call.

    python bench/tools/flat_vs_sglang.py [--rounds 30] [--batches 64,1024]
    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python bench/tools/flat_vs_sglang.py    # both sides on one thread

The tree, queries and both sides of ``bench/test_match.py``'s
``test_gpukv_flat`` and ``test_sglang_walk`` (``matchbench.py``,
``sglangmatch.py``: each side's queries prepared in its own form before
timing), but one call of each side in turn, ``--rounds`` times, in one
process: the pytest-benchmark suite times all rounds of one case before the
next's, so a change in the machine's load lands on one side, while here it
spreads over both. Prints, per batch size, ms per call of each side (median,
min-max), gpukv's speedup over each SGLang lookup paired round by round
(median, min-max), and the load average. Every round's answers are checked:
SGLang's reuse equals gpukv's in whole pages. The knobs are the suite's
(``GPUKV_BENCH_INSERT``, ``GPUKV_BENCH_QUERIES``, ``GPUKV_TRACE``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's bench package


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=30, help="timed calls of each side per batch size (after one warm-up)")
    ap.add_argument("--batches", default="64,1024", help="comma-separated batch sizes")
    ap.add_argument("--paths", default="full_device,match_prefix", help="SGLang lookups, of full_device, match_prefix")
    args = ap.parse_args(argv)
    import numpy as np
    from numba import config

    from bench import knobs
    from bench.matchbench import T, build_workload
    from bench.sglangmatch import build_sglang_tree, sglang_unavailable
    from gpukv.sim.workload import find_mooncake_trace

    why = sglang_unavailable()
    if why:
        raise SystemExit(why)
    path = find_mooncake_trace()
    if path is None:
        raise SystemExit("the Mooncake trace is not in shared/data (set GPUKV_TRACE)")
    batches = [int(b) for b in args.batches.split(",")]
    paths = args.paths.split(",")
    w = build_workload(path, knobs.integer("insert"), max(batches))
    tree = build_sglang_tree(w.inserted_seqs)
    print(f"gpukv flat (NUMBA_NUM_THREADS={config.NUMBA_NUM_THREADS}, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}) against SGLang {tree.version} "
          f"({type(tree.cache.tree_core).__name__}); tree of {w.inserted} trace requests, {w.tree_blocks:,} blocks; "
          f"{args.rounds} rounds alternated")
    for B in batches:
        flat = w.flat(B, device=True)
        # per side: the timed call, its prepared queries, its answer as reused tokens in whole pages (untimed)
        sides = {"gpukv flat": (w.match, flat, lambda m: np.asarray(m.to_host().num_tokens) // T * T)}
        for p in paths:
            sides[f"SGLang {p}"] = (tree.lookup(p), tree.prepare(p, w.queries[:B]), lambda got: np.asarray(got))
        ms = {name: [] for name in sides}
        load0 = os.getloadavg()[0]
        for r in range(args.rounds + 1):
            answers = []
            for name, (call, queries, answer) in sides.items():
                t = time.perf_counter()
                got = call(queries)
                dt = time.perf_counter() - t
                answers.append(answer(got).astype(np.int64))
                if r:  # the first round warms up
                    ms[name].append(dt * 1e3)
            for a in answers[1:]:
                if not np.array_equal(a, answers[0]):
                    raise SystemExit(f"B={B}: SGLang's reuse differs from gpukv's in whole pages")
        tokens = sum(q.size for q in w.queries[:B])
        print(f"\nB={B} ({tokens:,} query tokens; load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after)")
        for name, v in ms.items():
            print(f"  {name:22s} {statistics.median(v):8.3f} ms per call ({min(v):.3f}-{max(v):.3f})")
        for p in paths:
            r = [s / g for s, g in zip(ms[f"SGLang {p}"], ms["gpukv flat"])]
            print(f"  gpukv speedup over SGLang {p}, paired by round: {statistics.median(r):.2f}x "
                  f"({min(r):.2f}-{max(r):.2f})")


if __name__ == "__main__":
    main()

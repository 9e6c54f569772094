"""Summarize a pytest-benchmark JSON of ``bench/test_match.py``.

    python bench/report.py /tmp/bench.json [--stat median|mean|min]

Prints (as Markdown) query tokens/s per case and batch size, then the goal
ratios per batch size:

* registered / baseline: gpukv on registered ``TokenSequence``s vs the Python
  hash-chain walk, as a throughput ratio (goal >= 20x);
* flat / baseline: gpukv on ``(flat, offsets)`` vs the same (goal >= 10x);
* lists / convert: time of gpukv on Python lists over the time of merely
  converting those lists to one NumPy array (goal <= 1.25x).

Only the standard library is needed.
"""

from __future__ import annotations

import argparse
import json
import sys

CASES = ("registered", "registered_cold", "flat", "lists", "baseline", "convert")
LABELS = {
    "registered": "gpukv, registered TokenSequences",
    "registered_cold": "gpukv, fresh TokenSequences (hashing timed)",
    "flat": "gpukv, (flat int32, offsets)",
    "lists": "gpukv, Python lists",
    "baseline": "Python hash-chain baseline",
    "convert": "lists -> NumPy conversion only",
}
GOALS = (
    # (label, numerator case, denominator case, as "speedup" (den/num time) or "time ratio", goal, >= or <=)
    ("registered vs baseline (speedup)", "baseline", "registered", 20.0, ">="),
    ("flat vs baseline (speedup)", "baseline", "flat", 10.0, ">="),
    ("lists time / conversion time", "lists", "convert", 1.25, "<="),
)


def load(path: str, stat: str) -> dict:
    with open(path) as f:
        data = json.load(f)
    out = {}
    for b in data["benchmarks"]:
        info = b.get("extra_info", {})
        if "case" not in info:
            continue
        out[(info["case"], int(info["batch"]))] = (float(b["stats"][stat]), info)
    return {"results": out, "machine": data.get("machine_info", {}), "when": data.get("datetime", "")}


def rate(tokens: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if tokens >= scale:
            return f"{tokens / scale:.3g} {unit}"
    return f"{tokens:.3g} "


def report(path: str, stat: str = "median", out=sys.stdout):
    d = load(path, stat)
    res = d["results"]
    if not res:
        raise SystemExit(f"{path}: no benchmarks with extra_info['case'] (is it a bench/test_match.py run?)")
    batches = sorted({b for _, b in res})
    cases = [c for c in CASES if any((c, b) in res for b in batches)]
    m = d["machine"]
    print(f"{path} ({d['when']}; {m.get('cpu', {}).get('brand_raw', '?')}, "
          f"{m.get('cpu', {}).get('count', '?')} CPUs; stat: {stat} time per call)\n", file=out)
    print("Query tokens/s (total query tokens / time per match call):\n", file=out)
    print("| case | " + " | ".join(f"B={b}" for b in batches) + " |", file=out)
    print("|---|" + "---:|" * len(batches), file=out)
    for c in cases:
        cells = []
        for b in batches:
            if (c, b) in res:
                t, info = res[(c, b)]
                cells.append(f"{rate(info['query_tokens'] / t)}tok/s ({t * 1e3:.3g} ms)")
            else:
                cells.append("-")
        print(f"| {LABELS[c]} | " + " | ".join(cells) + " |", file=out)
    print("\nWorkload per batch:\n", file=out)
    print("| | " + " | ".join(f"B={b}" for b in batches) + " |", file=out)
    print("|---|" + "---:|" * len(batches), file=out)
    any_info = {b: next(info for (c, bb), (_, info) in res.items() if bb == b) for b in batches}
    for key, fmt in (("query_tokens", "{:,}"), ("reuse_fraction", "{:.1%}"), ("full_block_reuse_fraction", "{:.1%}")):
        print(f"| {key} | " + " | ".join(fmt.format(any_info[b][key]) for b in batches) + " |", file=out)
    first = next(iter(any_info.values()))
    print(f"\nTree: {first['inserted_requests']} trace requests inserted, {first['tree_blocks']:,} blocks "
          f"of {first['tokens_per_block']} tokens.\n", file=out)
    print("Goals:\n", file=out)
    print("| ratio | goal | " + " | ".join(f"B={b}" for b in batches) + " |", file=out)
    print("|---|---|" + "---:|" * len(batches), file=out)
    for label, num, den, goal, op in GOALS:
        cells = []
        for b in batches:
            if (num, b) not in res or (den, b) not in res:
                cells.append("-")
                continue
            r = res[(num, b)][0] / res[(den, b)][0]
            ok = r >= goal if op == ">=" else r <= goal
            cells.append(f"{r:.2f}x {'met' if ok else 'MISSED'}")
        print(f"| {label} | {op} {goal:g}x | " + " | ".join(cells) + " |", file=out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", help="a pytest-benchmark --benchmark-json file of bench/test_match.py")
    p.add_argument("--stat", default="median", choices=("median", "mean", "min"))
    a = p.parse_args(argv)
    report(a.json, a.stat)


if __name__ == "__main__":
    main()

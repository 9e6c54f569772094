"""Summarize a pytest-benchmark JSON of the ``bench/`` suites.

    python bench/tools/report.py /tmp/bench.json [--stat median|mean|min]

Prints (as Markdown), for whichever suites the run contains:

* ``test_match.py``: query tokens/s per case and batch size, then the goal
  ratios per batch size:

  * registered / baseline: gpukv on registered ``TokenSequence``s vs the Python
    hash-chain walk, as a throughput ratio (goal >= 20x);
  * flat / baseline: gpukv on ``(flat, offsets)`` vs the same (goal >= 10x);
  * lists / convert: time of gpukv on Python lists over the time of merely
    converting those lists to one NumPy array (goal <= 1.25x);
  * flat / SGLang: gpukv on ``(flat, offsets)`` vs SGLang's radix-tree
    lookup (its Rust tree core) on the same tree and queries, the faster of
    its two lookups, as a throughput ratio (goal >= 4x); then a table of
    both sides per batch size, median (min-max), with the thread settings
    and the load average of the run;

* ``test_match_sweep.py``: query tokens/s of gpukv (registered sequences) and
  of the baseline per batch size and per tree size, with the speedup;
* ``test_commit.py``: committed tokens/s for prefill chunks and decode steps,
  gpukv per model and the Python baseline;
* ``test_call.py``: µs per single per-cache call (a resize by one block, a
  commit of a token and of a block) on a manager with running caches, beside
  a Python dict update;
* ``test_step.py``: the serving step side by side with vLLM and SGLang, per
  batch size: µs per running sequence per decode step (roomy and evicting
  pools) and admission prompt tokens/s per system, as median (min-max) over
  the rounds, with gpukv's speedup over each peer and the goals, all from
  the same run.

Only the standard library is needed.
"""

from __future__ import annotations

import argparse
import json
import sys

SGLANG_CASES = ("sglang_full_device", "sglang_match_prefix")
CASES = ("registered", "registered_cold", "flat", "lists", "baseline", "convert") + SGLANG_CASES
LABELS = {
    "registered": "gpukv, registered TokenSequences",
    "registered_cold": "gpukv, fresh TokenSequences (hashing timed)",
    "flat": "gpukv, (flat int32, offsets)",
    "lists": "gpukv, Python lists",
    "baseline": "Python hash-chain baseline",
    "convert": "lists -> NumPy conversion only",
    "sglang_full_device": "SGLang, Rust match_full_device_prefix",
    "sglang_match_prefix": "SGLang, UnifiedRadixCache.match_prefix",
}
SGLANG = "sglang"  # in GOALS: the fastest of SGLANG_CASES at that batch size
GOALS = (
    # (label, numerator case, denominator case, as "speedup" (den/num time) or "time ratio", goal, >= or <=)
    ("registered vs baseline (speedup)", "baseline", "registered", 20.0, ">="),
    ("flat vs baseline (speedup)", "baseline", "flat", 10.0, ">="),
    ("lists time / conversion time", "lists", "convert", 1.25, "<="),
    ("flat vs SGLang's Rust walk (speedup)", SGLANG, "flat", 4.0, ">="),
)


def load(path: str, stat: str) -> dict:
    """``results``: test_match.py's, keyed by (case, batch); ``sweep`` and
    ``commit``: the other suites' (time, extra_info) pairs."""
    with open(path) as f:
        data = json.load(f)
    out, sweep, commit, evict, step, call, ranges = {}, [], [], [], [], [], {}
    for b in data["benchmarks"]:
        info = b.get("extra_info", {})
        t = float(b["stats"][stat])
        suite = info.get("suite", "match")
        if suite == "step":
            step.append(({k: float(b["stats"][k]) for k in ("min", "max", stat)}, stat, info))
        elif suite == "match-sweep":
            sweep.append((t, info))
        elif suite == "commit":
            commit.append((t, info))
        elif suite == "evict":
            evict.append((t, info))
        elif suite == "call":
            call.append((t, info))
        elif "case" in info:
            out[(info["case"], int(info["batch"]))] = (t, info)
            ranges[(info["case"], int(info["batch"]))] = (float(b["stats"]["min"]), float(b["stats"]["max"]))
    return {"results": out, "ranges": ranges, "sweep": sweep, "commit": commit, "evict": evict, "step": step, "call": call,
            "machine": data.get("machine_info", {}),
            "when": data.get("datetime", "")}


def rate(tokens: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if tokens >= scale:
            return f"{tokens / scale:.3g} {unit}"
    return f"{tokens:.3g} "


def dur(t: float) -> str:
    return f"{t:.3g} s" if t >= 1 else f"{t * 1e3:.3g} ms"


def report(path: str, stat: str = "median", out=sys.stdout):
    d = load(path, stat)
    if not (d["results"] or d["sweep"] or d["commit"] or d["evict"] or d["step"] or d["call"]):
        raise SystemExit(f"{path}: no benchmarks of bench/ (extra_info without 'case' or 'suite')")
    m = d["machine"]
    infos = [i for _, i in d["results"].values()] + [i for _, i in d["sweep"]]
    backends = sorted({i["backend"] for i in infos if i.get("backend", "python") != "python"}) or ["cpu"]
    print(f"{path} ({d['when']}; {m.get('cpu', {}).get('brand_raw', '?')}, "
          f"{m.get('cpu', {}).get('count', '?')} CPUs; gpukv backend: {', '.join(backends)}; "
          f"stat: {stat} time per call)\n", file=out)
    if d["results"]:
        report_match(d, out)
    if d["sweep"]:
        report_sweeps(d["sweep"], out)
    if d["commit"]:
        report_commit(d["commit"], out)
    if d["evict"]:
        report_evict(d["evict"], out)
    if d["step"]:
        report_step(d["step"], out)
    if d["call"]:
        report_call(d["call"], out)


def report_match(d: dict, out):
    res = d["results"]
    batches = sorted({b for _, b in res})
    cases = [c for c in CASES if any((c, b) in res for b in batches)]
    print("Query tokens/s (total query tokens / time per match call):\n", file=out)
    print("| case | " + " | ".join(f"B={b}" for b in batches) + " |", file=out)
    print("|---|" + "---:|" * len(batches), file=out)
    for c in cases:
        cells = []
        for b in batches:
            if (c, b) in res:
                t, info = res[(c, b)]
                cells.append(f"{rate(info['query_tokens'] / t)}tok/s ({dur(t)})")
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
            tn, td = _time(res, num, b), _time(res, den, b)
            if tn is None or td is None:
                cells.append("-")
                continue
            r = tn / td
            ok = r >= goal if op == ">=" else r <= goal
            cells.append(f"{r:.2f}x {'met' if ok else 'MISSED'}")
        print(f"| {label} | {op} {goal:g}x | " + " | ".join(cells) + " |", file=out)
    print(file=out)
    if any(c in SGLANG_CASES for c, _ in res):
        report_peer(d, out)


def _time(res: dict, case: str, b: int):
    """The case's time at batch ``b`` (``SGLANG``: the fastest SGLang lookup), or None."""
    if case == SGLANG:
        times = [res[(c, b)][0] for c in SGLANG_CASES if (c, b) in res]
        return min(times) if times else None
    return res[(case, b)][0] if (case, b) in res else None


def report_peer(d: dict, out):
    """gpukv's flat match beside SGLang's lookups: per batch size, each
    case's time per call, the statistic and the range over the rounds, and
    gpukv's speedup over the faster SGLang lookup (its statistic over
    gpukv's, and its best round over gpukv's best round)."""
    res, ranges = d["results"], d["ranges"]
    cases = ["flat"] + [c for c in SGLANG_CASES if any(k[0] == c for k in res)]
    batches = sorted({b for c, b in res if c in SGLANG_CASES})
    infos = [res[(c, b)][1] for c in cases for b in batches if (c, b) in res]
    first = infos[0]
    loads = [i["load_average"] for i in infos if "load_average" in i]
    peer = next((i for i in infos if i.get("peer") == "sglang"), {})
    print(f"Flat match against SGLang {peer.get('version', '?')}'s radix tree ({peer.get('tree_core', '?')}), "
          f"time per call, median (min-max) over the rounds; NUMBA_NUM_THREADS={first.get('NUMBA_NUM_THREADS', '?')}, "
          f"OMP_NUM_THREADS={first.get('OMP_NUM_THREADS', '?')}"
          + (f"; load average {min(loads):.1f} to {max(loads):.1f} during the cases" if loads else "") + ":\n",
          file=out)
    print("| B | " + " | ".join(LABELS[c] for c in cases) + " | gpukv speedup (median) | (best rounds) |", file=out)
    print("|---|" + "---:|" * (len(cases) + 2), file=out)
    for b in batches:
        cells = []
        for c in cases:
            if (c, b) in res:
                lo, hi = ranges[(c, b)]
                cells.append(f"{dur(res[(c, b)][0])} ({dur(lo)}-{dur(hi)})")
            else:
                cells.append("-")
        fastest = min((c for c in SGLANG_CASES if (c, b) in res), key=lambda c: res[(c, b)][0], default=None)
        if fastest is None or ("flat", b) not in res:
            cells += ["-", "-"]
        else:
            cells.append(f"{res[(fastest, b)][0] / res[('flat', b)][0]:.2f}x vs {fastest.removeprefix('sglang_')}")
            cells.append(f"{ranges[(fastest, b)][0] / ranges[('flat', b)][0]:.2f}x")
        print(f"| {b} | " + " | ".join(cells) + " |", file=out)
    print(file=out)


def _cell(t: float, tokens: float) -> str:
    return f"{rate(tokens / t)}tok/s ({dur(t)})"


def report_evict(rows: list, out):
    """test_evict.py: pages freed per second (gpukv vs the Python LRU) and
    admissions under pressure vs with free pages."""
    got = {info["case"]: (t, info) for t, info in rows}
    print("\n## Eviction (test_evict.py)\n", file=out)
    print("| case | time | rate |\n|---|---:|---:|", file=out)
    for case in ("evict_pool", "python_lru"):
        if case in got:
            t, info = got[case]
            print(f"| {case} | {t * 1e3:.1f} ms | {info['pages'] / t / 1e3:.0f} K pages/s |", file=out)
    for case in ("alloc_pressure", "alloc_free"):
        if case in got:
            t, info = got[case]
            print(f"| {case} ({info['requests']} admissions) | {t * 1e3:.1f} ms | {info['tokens'] / t / 1e6:.2f} M tokens/s |",
                  file=out)
    if "alloc_pressure" in got and "alloc_free" in got:
        print(f"\nadmission time under pressure / with free pages: {got['alloc_pressure'][0] / got['alloc_free'][0]:.2f}x",
              file=out)


def report_sweeps(rows: list, out):
    titles = {"batch": ("match_batch by batch size", "batch", "B={}"),
              "tree": ("match_batch by tree size (trace requests inserted)", "tree_requests", "{:,}")}
    for sweep, (title, key, fmt) in titles.items():
        got = {(info["case"], info[key]): (t, info) for t, info in rows if info["sweep"] == sweep}
        if not got:
            continue
        sizes = sorted({k for _, k in got})
        print(f"{title}, query tokens/s:\n", file=out)
        print("| | " + " | ".join(fmt.format(k) for k in sizes) + " |", file=out)
        print("|---|" + "---:|" * len(sizes), file=out)
        for case, label in (("registered", "gpukv, registered TokenSequences"), ("baseline", "Python hash-chain baseline")):
            cells = [_cell(*_time_tokens(got[(case, k)])) if (case, k) in got else "-" for k in sizes]
            print(f"| {label} | " + " | ".join(cells) + " |", file=out)
        speed = [f"{got[('baseline', k)][0] / got[('registered', k)][0]:.3g}x"
                 if ("baseline", k) in got and ("registered", k) in got else "-" for k in sizes]
        print("| speedup | " + " | ".join(speed) + " |", file=out)
        reuse = [f"{got[('registered', k)][1]['reuse_fraction']:.1%}" if ("registered", k) in got else "-" for k in sizes]
        print("| reused fraction of the queries | " + " | ".join(reuse) + " |", file=out)
        if sweep == "tree":
            b = next(info["batch"] for _, info in got.values())
            print(f"\n(the same {b} queries at every size)", file=out)
        print(file=out)


def _time_tokens(entry):
    t, info = entry
    return t, info["query_tokens"]


def report_commit(rows: list, out):
    cols = sorted({(info["case"], info["model"]) for _, info in rows}, key=lambda c: (c[0] == "baseline", c[1]))
    print("Commit throughput, committed tokens/s (resize + commit per step):\n", file=out)
    print("| phase | " + " | ".join(f"gpukv, {m}" if c == "gpukv" else "Python baseline" for c, m in cols) + " |",
          file=out)
    print("|---|" + "---:|" * len(cols), file=out)
    for phase in ("prefill", "decode"):
        got = {(info["case"], info["model"]): (t, info) for t, info in rows if info["phase"] == phase}
        if not got:
            continue
        first = next(iter(got.values()))[1]
        what = (f"prefill, {first['chunk']}-token chunks" if phase == "prefill"
                else "decode, 1 token per step")
        cells = [_cell(got[c][0], got[c][1]["tokens"]) if c in got else "-" for c in cols]
        print(f"| {what} ({first['requests']} requests) | " + " | ".join(cells) + " |", file=out)
    print(file=out)


CALLS = ("resize", "commit token", "commit block", "dict update")


def report_call(rows: list, out):
    got = {info["call"]: (t, info) for t, info in rows}
    caches = next(iter(got.values()))[1]["caches"]
    print(f"One per-cache call on a manager with {caches} running caches, µs per call:\n", file=out)
    print("| call | µs |", file=out)
    print("|---|---:|", file=out)
    for c in sorted(got, key=lambda c: CALLS.index(c) if c in CALLS else len(CALLS)):
        print(f"| {c} | {_us(got[c][0] * 1e6)} |", file=out)
    print(file=out)


STEP_SYSTEMS = (("vllm", "vLLM"), ("sglang", "SGLang"), ("gpukv", "gpukv"))
STEP_ROWS = (
    # (label, phase, pool, unit)
    ("decode, µs per running sequence per step, roomy pool", "decode", "roomy", "us"),
    ("decode, µs per running sequence per step, pool 1.5x the batch (evicting)", "decode", "evicting", "us"),
    ("admission (match + allocate + chunked prefill), prompt tokens/s", "admission", "roomy", "tok/s"),
)


def _step_value(stats: dict, stat: str, info: dict, unit: str) -> tuple:
    """(the statistic, the best, the worst) in the row's unit."""
    if unit == "us":
        per = 1e6 / info["seq_steps"]
        return stats[stat] * per, stats["min"] * per, stats["max"] * per
    tokens = info["prompt_tokens"]
    return tokens / stats[stat], tokens / stats["min"], tokens / stats["max"]


def _us(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def _step_cell(v: tuple, unit: str) -> str:
    """The statistic, then the range over the rounds (low to high)."""
    if unit == "us":
        return f"{_us(v[0])} ({_us(v[1])}-{_us(v[2])})"
    return f"{v[0] / 1e6:.3g} M ({v[2] / 1e6:.3g}-{v[1] / 1e6:.3g})"


def report_step(rows: list, out):
    """test_step.py: per batch size, the systems side by side, gpukv's
    speedup over each peer (a peer's time over gpukv's for decode, gpukv's
    tokens/s over the peer's for admission: above 1, gpukv is faster), the
    reuse check and the goals."""
    got = {(info["system"], info["phase"], info["pool"], int(info["batch"])): (stats, stat, info)
           for stats, stat, info in rows}
    batches = sorted({k[3] for k in got})
    present = [(s, label) for s, label in STEP_SYSTEMS if any(k[0] == s for k in got)]
    first = next(iter(got.values()))[2]
    print("\n## The serving step against vLLM and SGLang (test_step.py)\n", file=out)
    print(f"T = {first['tokens_per_block']}, {first['chunk']}-token prefill chunks, {first['decode_steps']} decode steps "
          f"a round; OMP_NUM_THREADS={first['OMP_NUM_THREADS']}, NUMBA_NUM_THREADS={first['NUMBA_NUM_THREADS']}; "
          "median (min-max) over the rounds; speedup above 1: gpukv is faster.\n", file=out)
    for b in batches:
        heads = []
        for s, label in present:
            info = next(i for (sy, _, _, bb), (_, _, i) in got.items() if sy == s and bb == b)
            calls = f", {info['calls']} calls" if s == "gpukv" else ""
            heads.append(f"{label} {info['version']}{calls}")
        peers = [(s, label) for s, label in present if s != "gpukv"]
        ratio_heads = [f"gpukv speedup vs {label}" for _, label in peers] if any(s == "gpukv" for s, _ in present) else []
        print(f"| B={b} | " + " | ".join(heads + ratio_heads) + " |", file=out)
        print("|---|" + "---:|" * (len(heads) + len(ratio_heads)), file=out)
        values = {}
        for label, phase, pool, unit in STEP_ROWS:
            cells = []
            for s, _ in present:
                key = (s, phase, pool, b)
                if key in got:
                    stats, stat, info = got[key]
                    values[(s, phase, pool)] = _step_value(stats, stat, info, unit)[0]
                    cells.append(_step_cell(_step_value(stats, stat, info, unit), unit))
                else:
                    cells.append("-")
            for s, _ in peers if ratio_heads else ():
                g, p = values.get(("gpukv", phase, pool)), values.get((s, phase, pool))
                if g is None or p is None:
                    cells.append("-")
                else:
                    cells.append(f"{(p / g if unit == 'us' else g / p):.3g}x")
            print(f"| {label} | " + " | ".join(cells) + " |", file=out)
        reuse = {got[k][2]["reused_tokens"] for k in got if k[1] == "admission" and k[3] == b}
        if reuse:
            tokens = next(got[k][2]["prompt_tokens"] for k in got if k[1] == "admission" and k[3] == b)
            agree = "every system the same, request by request" if len(reuse) == 1 else f"DIFFERENT totals {sorted(reuse)}"
            print(f"\nB={b}: {tokens:,} prompt tokens, {min(reuse):,} reused ({agree}).", file=out)
        evict = [got[k][2] for k in got if k[1] == "decode" and k[2] == "evicting" and k[3] == b]
        if evict:
            print(f"Evicting pool: {evict[0]['pages']:,} pages for a running batch needing {evict[0]['running_need_pages']:,}; "
                  f"{evict[0]['fillers']} more requests admitted and finished to fill it; free pages after the fill: "
                  + ", ".join(f"{i['system']} {i['free_pages_after_fill']}" for i in evict) + ".", file=out)
        goals = []
        if ("gpukv", "decode", "roomy") in values:
            r = values[("gpukv", "decode", "roomy")]
            goals.append(f"decode under 1 µs per running sequence per step: {r:.3g} µs "
                         + ("(met)" if r < 1 else f"(MISSED, {r:.3g}x over)"))
            if ("gpukv", "decode", "evicting") in values:
                e = values[("gpukv", "decode", "evicting")] / r
                goals.append(f"evicting within 1.5x of roomy: {e:.3g}x " + ("(met)" if e <= 1.5 else "(MISSED)"))
        if ("gpukv", "admission", "roomy") in values and ("vllm", "admission", "roomy") in values:
            a = values[("gpukv", "admission", "roomy")] / values[("vllm", "admission", "roomy")]
            goals.append(f"admission at least 2x vLLM's tokens/s: {a:.3g}x " + ("(met)" if a >= 2 else "(MISSED)"))
        if goals:
            print(f"Goals at B={b}: " + "; ".join(goals) + ".", file=out)
        print(file=out)
    notes = {i.get("note") for _, _, i in rows if i.get("note")}
    for n in sorted(notes):
        print(f"Note: {n}.", file=out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", help="a pytest-benchmark --benchmark-json file of the bench/ suites")
    p.add_argument("--stat", default="median", choices=("median", "mean", "min"))
    a = p.parse_args(argv)
    report(a.json, a.stat)


if __name__ == "__main__":
    main()

"""What ``gpukv simulate`` shows of a run: the progress bar, the summary (a
dict, and the side-by-side table of one or more runs) and the ``--plot`` figure.

It reads a ``simulate.Simulator`` (named ``sim`` below) and does not import
that module: the simulator imports this one.
"""

from __future__ import annotations

import sys
import time

import numpy as np

# The running totals a step records in ``Stats.timeline`` after its simulated
# time, which the figure draws.
TIMELINE_FIELDS = ("admitted_input_tokens", "reused_tokens", "computed_tokens", "ssm_hits", "partial_reuses")


class ProgressBar:
    """A plain-text progress bar on stderr, redrawn at most 10 times a second."""

    def __init__(self, total: int, width: int = 30, out=None):
        self.total = max(total, 1)
        self.width = width
        self.out = out or sys.stderr
        self.last = 0.0

    def __call__(self, sim):
        now = time.perf_counter()
        if now - self.last < 0.1:
            return
        self.last = now
        s = sim.stats
        done = s.finished + s.rejected
        fill = int(self.width * done / self.total)
        hit = s.reused_tokens / max(s.admitted_input_tokens, 1)
        self.out.write(f"\r[{'#' * fill}{'.' * (self.width - fill)}] {done}/{self.total} requests  "
                       f"hit {hit:6.1%}  running {len(sim.running):3d}  waiting {len(sim.waiting):4d} ")
        self.out.flush()

    def close(self):
        self.out.write("\r" + " " * (self.width + 70) + "\r")
        self.out.flush()


def _pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs), q)) if len(xs) else 0.0


def summarize(sim, wall_s: float, whole_s: float | None = None) -> dict:
    """The run's figures. ``wall_s``: the simulation's own wall time;
    ``whole_s``: the whole run's, start-up, kernel loading and warm-up
    included (the simulation's when not given)."""
    s, o = sim.stats, sim.options
    lat = np.asarray(s.match_latency_s)
    lifecycles = ", ".join(type(x).__name__ + (f"(window={x.window})" if getattr(x, "window", None) else "")
                           for x in sim.mgr.life_cycles)
    return {
        "workload": sim.workload.description,
        "policy": o.policy,
        "model": f"{o.model}: {lifecycles}",
        "backend": sim.mgr.backend,
        "tokens_per_block": o.tokens_per_block,
        "gpu_pages_per_life_cycle": sim.pages,
        "host_pages_per_life_cycle": o.host_pages,
        "requests": s.requests,
        "finished": s.finished,
        "rejected": s.rejected,
        "input_tokens": s.input_tokens,
        "hit_rate": s.reused_tokens / max(s.input_tokens, 1),
        "reused_tokens": s.reused_tokens,
        "reused_tokens_from_partial_endpoints": s.partial_reused_tokens,
        "reuses": s.reuses,
        "reuses_ending_mid_block": s.partial_reuses,
        "ssm_snapshot_hits": s.ssm_hits if sim.has_ssm else None,
        "ssm_snapshot_hit_rate": (s.ssm_hits / max(s.requests, 1)) if sim.has_ssm else None,
        "computed_tokens": s.computed_tokens,
        "committed_tokens": s.committed_tokens,
        "commit_calls": s.commit_calls,
        "evicted_pages": s.evicted,
        "migrated_pages": s.migrated,
        "dropped_pages": s.dropped,
        "preemptions": s.preemptions,
        "readmissions": s.readmissions,
        "steps": s.steps,
        "simulated_s": sim.now / 1e3,
        "peak_running": s.peak_running,
        "peak_waiting": s.peak_waiting,
        "match_batch_calls": len(lat),
        "match_batch_mean_requests": float(np.mean(s.match_batch)) if s.match_batch else 0.0,
        "match_latency_p50_ms": _pct(lat, 50) * 1e3,
        "match_latency_p99_ms": _pct(lat, 99) * 1e3,
        "match_query_tokens_per_s": float(sum(s.match_tokens) / max(lat.sum(), 1e-12)),
        "kv_cache_calls_s": s.kv_call_s,
        "wall_s": wall_s if whole_s is None else whole_s,
        "simulation_wall_s": wall_s,
        "manager_reuse_stats": dict(s.manager_reuse),
    }


_LABELS = {
    "hit_rate": "hit rate (reused / input tokens)",
    "reused_tokens_from_partial_endpoints": "  of which from partial endpoints",
    "reuses": "requests reusing anything",
    "reuses_ending_mid_block": "  of which ending inside a block",
    "ssm_snapshot_hits": "SSM snapshot hits (requests)",
    "ssm_snapshot_hit_rate": "SSM snapshot hit rate (of requests)",
    "computed_tokens": "tokens computed (prefill not reused, decode)",
    "match_batch_calls": "match_batch calls",
    "match_batch_mean_requests": "match_batch mean requests",
    "evicted_pages": "pages evicted from the GPU",
    "migrated_pages": "  of which migrated to host",
    "dropped_pages": "pages dropped",
    "match_latency_p50_ms": "match_batch latency p50 (ms)",
    "match_latency_p99_ms": "match_batch latency p99 (ms)",
    "match_query_tokens_per_s": "match_batch query tokens/s",
    "kv_cache_calls_s": "time in KVCache calls (s)",
    "wall_s": "wall time, the whole run (s)",
    "simulation_wall_s": "  of which the simulation (s)",
}


def _cell(summary: dict, k: str):
    """One summary value as table text; None to leave the row out."""
    v = summary[k]
    if k == "manager_reuse_stats" or v is None:
        return None
    if k == "migrated_pages" and not summary.get("host_pages_per_life_cycle"):
        return None  # without a host tier nothing can migrate
    if k in ("hit_rate", "ssm_snapshot_hit_rate"):
        return f"{v:.2%}"
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def format_summary(*summaries: dict) -> str:
    """Summaries as an aligned table, one value column per run. Rows whose
    values are equal in every run are shown once, before the others; an
    "of which" row stays under the row it breaks down (the two move together)."""
    keys = [k for k in summaries[0] if _cell(summaries[0], k) is not None]
    cells = {k: [_cell(s, k) for s in summaries] for k in keys}
    label = {k: _LABELS.get(k, k.replace("_", " ")) for k in keys}
    groups: list[list[str]] = []  # a row and the indented rows under it
    for k in keys:
        if label[k].startswith(" ") and groups:
            groups[-1].append(k)
        else:
            groups.append([k])
    if len(summaries) > 1:
        same = [all(len(set(cells[k])) == 1 for k in g) for g in groups]
        shared = [k for g, y in zip(groups, same) if y for k in g]
        differ = [k for g, y in zip(groups, same) if not y for k in g]
    else:
        shared, differ = keys, []
    width = max(len(label[k]) for k in keys)
    lines = [f"{label[k]:<{width}}  {cells[k][0]}" for k in shared]
    if differ:
        cols = [max(len(c) for c in col) for col in zip(*(cells[k] for k in differ))]
        lines.append("")
        for k in differ:
            lines.append(f"{label[k]:<{width}}  " + "  ".join(f"{c:>{w}}" for c, w in zip(cells[k], cols)))
    return "\n".join(lines)


def require_matplotlib():
    """Fail early, before a long run, when --plot cannot work."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MissingDependency("--plot needs matplotlib: pip install -e '.[plot]' in a gpukv checkout "
                                "(or pip install matplotlib)") from None


class MissingDependency(RuntimeError):
    """An optional dependency a requested feature needs is not installed."""


def _at(t, y, grid):
    """The running total ``y`` (recorded at times ``t``) at each time of
    ``grid``: its last value at or before it, 0 before the first."""
    if not len(t):
        return np.zeros(len(grid))
    i = np.searchsorted(t, grid, side="right") - 1
    return np.where(i >= 0, y[np.maximum(i, 0)], 0.0)


def plot_series(sims: list) -> dict:
    """What ``plot`` draws, as arrays: per run (``runs``, in order) its label,
    the simulated time of each step (s) and the running totals then of the
    tokens computed (prompt tokens not reused, decode tokens, and whatever a
    preemption made computed again) and of SSM snapshot hits, split by where
    the snapshot lies: ``ssm_hits_inside`` inside a block (an endpoint only
    per-page coverage keeps), ``ssm_hits_boundary`` on a block boundary. Both
    policies hit a snapshot for nearly the same requests; where the hit lies
    is what differs, so that is what the figure tells apart. With a per-page
    and a full-blocks run, ``saved``: the recomputation per-page coverage
    saves, full-blocks' tokens computed minus per-page's at each time either
    run recorded (the decode tokens are the same in both)."""

    runs = []
    for sim in sims:
        tl = np.asarray(sim.stats.timeline, dtype=np.float64).reshape(-1, 1 + len(TIMELINE_FIELDS))
        col = {f: tl[:, 1 + i] for i, f in enumerate(TIMELINE_FIELDS)}
        runs.append({
            "label": sim.options.policy, "t_s": tl[:, 0] / 1e3,
            "computed": col["computed_tokens"], "ssm_hits": col["ssm_hits"],
            # on a hybrid model every reuse ends on an SSM snapshot, so the
            # reuses ending inside a block are the hits on a snapshot there
            "ssm_hits_inside": col["partial_reuses"] if sim.has_ssm else np.zeros_like(col["ssm_hits"]),
            "ssm_hits_boundary": col["ssm_hits"] - (col["partial_reuses"] if sim.has_ssm else 0),
            "admitted": col["admitted_input_tokens"], "reused": col["reused_tokens"],
            "total_computed": int(sim.stats.computed_tokens), "total_ssm_hits": int(sim.stats.ssm_hits),
            "total_ssm_hits_inside": int(sim.stats.partial_reuses) if sim.has_ssm else 0,
            "has_ssm": bool(sim.has_ssm), "requests": int(sim.stats.requests),
        })
    by = {r["label"]: r for r in runs}
    saved = None
    if "per-page" in by and "full-blocks" in by:
        pp, fb = by["per-page"], by["full-blocks"]
        grid = np.union1d(pp["t_s"], fb["t_s"])
        saved = {"t_s": grid, "tokens": _at(fb["t_s"], fb["computed"], grid) - _at(pp["t_s"], pp["computed"], grid),
                 "total": fb["total_computed"] - pp["total_computed"], "of": fb["total_computed"]}
    return {"runs": runs, "saved": saved}


def plot(sims: list, path: str):
    """Save a figure of one or more runs (``plot_series``): tokens computed
    over simulated time, what per-page coverage saves against full blocks
    (with both policies; else the hit rate), SSM snapshot hits over time, and
    match_batch latency against batch size. Needs matplotlib."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, FuncFormatter, NullFormatter

    data = plot_series(sims)
    thousands = FuncFormatter(lambda v, _: f"{v:,.0f}")
    fig, ((a, b), (c, d)) = plt.subplots(2, 2, figsize=(12, 8))
    for k, (sim, r) in enumerate(zip(sims, data["runs"])):
        color, dashes = f"C{k}", "-" if k == 0 else "--"  # dashed: a line another run's may cover
        a.plot(r["t_s"], r["computed"], dashes, color=color, label=f"{r['label']}: {r['total_computed']:,} in total")
        if r["has_ssm"]:
            inside = r["total_ssm_hits_inside"]
            c.plot(r["t_s"], r["ssm_hits_boundary"], "-", color=color,
                   label=f"{r['label']}, on a block boundary: {r['total_ssm_hits'] - inside:,}")
            c.plot(r["t_s"], r["ssm_hits_inside"], ":", color=color, lw=2,
                   label=f"{r['label']}, inside a block: {inside:,}")
        lat = np.asarray(sim.stats.match_latency_s) * 1e3
        d.scatter(sim.stats.match_batch, lat, s=5, alpha=0.4, color=color, label=r["label"])
    a.set_title("tokens computed (running total)")
    a.set_ylabel("prompt tokens not reused + decode tokens")
    a.yaxis.set_major_formatter(thousands)
    a.legend(fontsize=9)

    saved = data["saved"]
    if saved is not None:
        b.plot(saved["t_s"], saved["tokens"], color="C2")
        b.fill_between(saved["t_s"], 0, saved["tokens"], color="C2", alpha=0.2)
        b.axhline(0, color="0.3", lw=0.8)
        b.set_ylim(top=max(1.0, 1.3 * float(saved["tokens"].max(initial=0))))  # room for the total above the curve
        b.set_title("recomputation per-page coverage saves")
        b.set_ylabel("tokens computed: full-blocks minus per-page")
        b.yaxis.set_major_formatter(thousands)
        share = saved["total"] / max(saved["of"], 1)
        b.text(0.03, 0.95, f"{saved['total']:,} tokens in total\n({share:.1%} of full-blocks' tokens computed)",
               transform=b.transAxes, ha="left", va="top", fontsize=9)
    else:  # one policy: its hit rate over time
        for k, r in enumerate(data["runs"]):
            b.plot(r["t_s"], 100 * r["reused"] / np.maximum(r["admitted"], 1), "-" if k == 0 else "--",
                   color=f"C{k}", label=r["label"])
        b.set_title("hit rate (running; --compare shows what per-page coverage saves)")
        b.set_ylabel("reused / input tokens (%)")
        b.legend(fontsize=9)

    if any(r["has_ssm"] for r in data["runs"]):
        c.set_title("SSM snapshot hits (running total), by where the snapshot lies")
        c.set_ylabel("requests resuming from an SSM snapshot")
        c.legend(fontsize=9)
    else:
        c.set_title("SSM snapshot hits")
        c.text(0.5, 0.5, "no SSM layer in this model", ha="center", va="center", transform=c.transAxes)
    for ax in (a, b, c):
        ax.set_xlabel("simulated time (s)")
        ax.grid(alpha=0.3)

    if any(len(sim.stats.match_latency_s) for sim in sims):  # a log axis needs data
        d.set_xscale("log")
        d.set_yscale("log")
        d.xaxis.set_major_formatter(FormatStrFormatter("%g"))
        d.xaxis.set_minor_formatter(NullFormatter())
        d.legend(fontsize=9)
    else:
        d.text(0.5, 0.5, "no match_batch calls", ha="center", va="center", transform=d.transAxes)
    d.set_xlabel("requests in the match_batch call (waiting queue)")
    d.set_ylabel("latency (ms)")
    d.set_title(f"match_batch latency ({sims[0].mgr.backend})")
    d.grid(alpha=0.3, which="both")
    fig.suptitle(sims[0].workload.description, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

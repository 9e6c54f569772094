"""Where gpukv's decode step goes, at one batch size, roomy and evicting.

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python bench/profile_step.py [--batch 256] [--steps 16] [--pool both]

The running batch and the pools are those of ``test_step.py``
(``stepbench.start_running``). Three passes over ``--steps`` decode steps each:

1. plain: the time per running sequence per step, nothing attached;
2. timed: the same with a ``perf_counter`` pair around each part of the
   per-cache call path, attached to the manager's objects from outside:
   the kernel launch (the Numba dispatcher call: dispatch + kernel), the
   evictor's victim pass (``Evictor.prepare``), token conversion
   (``token_array``), the table capacity checks (``ensure_free_blocks``,
   ``ensure_log_tokens``), the work after each launch (``after_kernel``:
   draining page copies and the change log) and the host/device transfers
   of the backend; the rest of the facade (argument and state checks,
   small arrays, Python) is the remainder. The dispatch part of a launch is
   estimated by calling a no-op Numba function with the same arguments;
3. cProfile, for the functions with the most own time.

Prints Markdown: the parts in µs per running sequence per step and as shares.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import stepbench as sb  # noqa: E402


class Timers:
    def __init__(self):
        self.total: dict = {}
        self.calls: dict = {}

    def wrap(self, name: str, fn):
        total, calls, clock = self.total, self.calls, time.perf_counter
        total.setdefault(name, 0.0)
        calls.setdefault(name, 0)

        def timed(*args, **kwargs):
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                total[name] += clock() - t0
                calls[name] += 1

        return timed


def run_steps(d, batch, w, B, first_step, steps):
    t0 = time.perf_counter()
    for s in range(first_step, first_step + steps):
        d.decode(batch, w.step_tokens(B, s))
    return time.perf_counter() - t0


def dispatch_cost(mgr, kv, calls: int = 20000) -> float:
    """Seconds per call of a no-op Numba function taking the sequence kernel's arguments."""
    import numba

    @numba.njit
    def noop(S, Q, op):
        return op

    S, Q = mgr._tables.device, kv._q
    noop(S, Q, 0)  # compile
    t0 = time.perf_counter()
    for _ in range(calls):
        noop(S, Q, 0)
    return (time.perf_counter() - t0) / calls


def profile(pool: str, B: int, steps: int, top: int, out=sys.stdout):
    import gpukv.cache

    w = sb.load_workload(max(B, 256) + 700, steps, 3)
    w.prepare(range(B))
    order = list(range(B))
    d, handles, _, facts = sb.start_running("gpukv", w, order, pool, 3 * steps + 1, max(B, 256))
    if not isinstance(d, sb.GpukvPerCache) or d.calls != "per-cache":
        raise SystemExit("profile_step.py profiles the per-cache calls: run with GPUKV_BENCH_STEP_CALLS=per-cache")
    batch = d.running(handles)
    mgr = d.mgr
    seq_steps = B * steps
    run_steps(d, batch, w, B, 0, 1)  # touch every path once
    plain = run_steps(d, batch, w, B, 1, steps) / seq_steps

    timers = Timers()
    kvs = list(batch)
    launches = "kernel launch (dispatch + kernel)"
    for kv in kvs:
        kv._run = timers.wrap(launches, kv._run)
    mgr._evictor.prepare = timers.wrap("evictor victim pass", mgr._evictor.prepare)
    mgr._tree.after_kernel = timers.wrap("after each launch (page copies, change log)", mgr._tree.after_kernel)
    mgr._tables.ensure_free_blocks = timers.wrap("table capacity checks", mgr._tables.ensure_free_blocks)
    mgr._tables.ensure_log_tokens = timers.wrap("table capacity checks", mgr._tables.ensure_log_tokens)
    backend = mgr._backend
    backend.to_host = timers.wrap("host/device transfers", backend.to_host)
    backend.to_device = timers.wrap("host/device transfers", backend.to_device)
    original_token_array = gpukv.cache.token_array
    gpukv.cache.token_array = timers.wrap("token conversion (token_array)", original_token_array)
    overhead = Timers()
    probe = overhead.wrap("probe", lambda: None)
    for _ in range(20000):
        probe()
    per_wrap = overhead.total["probe"] / 20000
    try:
        timed = run_steps(d, batch, w, B, 1 + steps, steps) / seq_steps
    finally:
        gpukv.cache.token_array = original_token_array
    per_launch_dispatch = dispatch_cost(mgr, kvs[0])
    n_launch = timers.calls[launches]
    parts = {k: v / seq_steps for k, v in timers.total.items()}
    dispatch = per_launch_dispatch * n_launch / seq_steps
    parts["Numba dispatch (estimated)"] = dispatch
    parts["kernel (launch minus dispatch)"] = parts.pop(launches) - dispatch
    wrapped_calls = sum(timers.calls.values())
    instrumentation = per_wrap * wrapped_calls / seq_steps
    parts["facade: checks, small arrays, Python (the rest)"] = timed - sum(parts.values()) - instrumentation
    parts["timing wrappers themselves"] = instrumentation

    prof = cProfile.Profile()
    prof.enable()
    run_steps(d, batch, w, B, 1 + 2 * steps, steps)
    prof.disable()
    d.finish(batch)

    print(f"\n### gpukv decode, B={B}, {pool} pool ({facts['pages']:,} pages), {steps} steps\n", file=out)
    print(f"plain: {plain * 1e6:.3g} µs per running sequence per step; with the timers: {timed * 1e6:.3g} µs; "
          f"{n_launch / seq_steps:.3g} kernel launches and {timers.calls['evictor victim pass'] / seq_steps:.3g} "
          f"evictor passes per sequence step; a launch's dispatch alone {per_launch_dispatch * 1e6:.3g} µs.\n", file=out)
    if pool == "evicting":
        print(f"free pages after the fill: {facts['free_pages_after_fill']}, after the steps: {d.free_pages()}\n",
              file=out)
    print("| part | µs per running sequence per step | share |\n|---|---:|---:|", file=out)
    for k, v in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {v * 1e6:.3g} | {v / timed:.1%} |", file=out)
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    lines = [ln for ln in s.getvalue().splitlines() if ln.strip()]
    start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
    print(f"\ncProfile, the {top} functions with the most own time:\n\n```", file=out)
    print("\n".join(lines[start:]), file=out)
    print("```", file=out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--pool", choices=("roomy", "evicting", "both"), default="both")
    p.add_argument("--top", type=int, default=20)
    a = p.parse_args(argv)
    for pool in ("roomy", "evicting") if a.pool == "both" else (a.pool,):
        profile(pool, a.batch, a.steps, a.top)


if __name__ == "__main__":
    main()

"""Where gpukv's decode step goes, at one batch size, roomy and evicting.

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python bench/tools/profile_step.py [--batch 256] [--steps 16] [--pool both]

The running batch and the pools are those of ``test_step.py``
(``stepbench.start_running``). Passes of ``--steps`` decode steps each,
``--repeats`` times alternating 1 and 2 (the least disturbed pass of each
counts: a shared machine's load comes and goes), then 3:

1. plain: the time per running sequence per step, nothing attached;
2. timed: the same with a ``perf_counter`` pair around each part of the
   call path, attached to the manager's objects from outside: the kernel
   (``launcher.call_kernel``: the compiled code, called directly while the
   tables stay, else through Numba's dispatcher), the token checks
   (``inputs.check_flat``, ``flatten``, ``token_array``), the table
   capacity checks (``ensure_free_blocks``, ``ensure_log_tokens``,
   ``ensure_log``), the work after each launch (``Launcher.settle``:
   draining page copies and the change log) and the host/device transfers
   of the backend, each part's own time (a timed call inside another is
   taken out of the outer one); the rest of the facade (argument and state
   checks, small arrays, Python) is the remainder;
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout (bench is a package there)

from bench import stepbench as sb  # noqa: E402


class Timers:
    """Exclusive time per name: a timed call inside another timed call is
    taken out of the outer one's time, so the parts add up."""

    def __init__(self):
        self.total: dict = {}
        self.calls: dict = {}
        self._inner = [0.0]  # time of timed calls inside the current one, per nesting level
        self._attached = []

    def wrap(self, name: str, fn):
        total, calls, inner, clock = self.total, self.calls, self._inner, time.perf_counter
        total.setdefault(name, 0.0)
        calls.setdefault(name, 0)

        def timed(*args, **kwargs):
            inner.append(0.0)
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = clock() - t0
                total[name] += elapsed - inner.pop()
                inner[-1] += elapsed
                calls[name] += 1

        return timed

    def attach(self, obj, attr: str, name: str):
        """Time ``obj.attr`` under ``name`` (also on frozen dataclasses: this is a measurement, from outside)."""
        had = attr in getattr(obj, "__dict__", {})
        self._attached.append((obj, attr, had, getattr(obj, attr)))
        object.__setattr__(obj, attr, self.wrap(name, getattr(obj, attr)))

    def detach(self):
        for obj, attr, had, original in reversed(self._attached):
            if had:
                object.__setattr__(obj, attr, original)
            else:
                object.__delattr__(obj, attr)
        self._attached.clear()


def us(seconds: float) -> str:
    v = seconds * 1e6
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def run_steps(d, batch, w, B, first_step, steps):
    t0 = time.perf_counter()
    for s in range(first_step, first_step + steps):
        d.decode(batch, w.step_tokens(B, s))
    return time.perf_counter() - t0


def least_per_call(fn, calls: int = 5000, tries: int = 5) -> float:
    """Seconds per call of ``fn()``, the least disturbed of ``tries`` loops."""
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def wrapper_cost() -> float:
    """Seconds a timer adds to a call (a timed no-op minus a bare one)."""
    def nothing():
        return None

    timed = Timers().wrap("probe", nothing)
    return max(0.0, least_per_call(timed) - least_per_call(nothing))


KERNEL = "kernel (the compiled code's call)"


def attach_timers(mgr) -> Timers:
    """Timers on each part of the call path (see the module docstring)."""
    import gpukv.inputs
    import gpukv.launcher

    timers = Timers()
    timers.attach(gpukv.launcher, "call_kernel", KERNEL)
    timers.attach(mgr._launcher, "settle", "after each launch (page copies, change log)")
    for name in ("ensure_free_blocks", "ensure_log_tokens", "ensure_log"):
        timers.attach(mgr._tables, name, "table capacity checks")
    timers.attach(mgr._backend, "to_host", "host/device transfers")
    timers.attach(mgr._backend, "to_device", "host/device transfers")
    for name in ("check_flat", "flatten", "token_array"):
        timers.attach(gpukv.inputs, name, "token checks")
    return timers


def profile(pool: str, B: int, steps: int, repeats: int, top: int, out=sys.stdout):
    w = sb.load_workload(max(B, 256) + 700, steps, 2 * repeats + 1)
    w.prepare(range(B))
    order = list(range(B))
    d, handles, _, facts = sb.start_running("gpukv", w, order, pool, (2 * repeats + 1) * steps + 1, max(B, 256))
    if not isinstance(d, sb.GpukvPerCache):
        raise SystemExit("profile_step.py profiles gpukv")
    batch = d.running(handles)
    mgr = d.mgr
    seq_steps = B * steps
    run_steps(d, batch, w, B, 0, 1)  # touch every path once
    plain = float("inf")

    per_wrap = wrapper_cost()
    best = None
    for r in range(repeats):  # plain and timed passes alternate; the least disturbed of each counts
        first = 1 + 2 * r * steps
        plain = min(plain, run_steps(d, batch, w, B, first, steps) / seq_steps)
        timers = attach_timers(mgr)
        try:
            timed = run_steps(d, batch, w, B, first + steps, steps) / seq_steps
        finally:
            timers.detach()
        if best is None or timed < best[0]:
            best = (timed, timers)
    timed, timers = best
    n_launch = timers.calls[KERNEL]
    parts = {k: v / seq_steps for k, v in timers.total.items()}
    instrumentation = per_wrap * sum(timers.calls.values()) / seq_steps
    parts["facade: checks, small arrays, Python (the rest)"] = timed - sum(parts.values()) - instrumentation
    parts["the timers themselves (estimated)"] = instrumentation

    prof = cProfile.Profile()
    prof.enable()
    run_steps(d, batch, w, B, 1 + 2 * repeats * steps, steps)
    prof.disable()
    free_after = d.free_pages()
    d.finish(batch)

    print(f"\n### gpukv decode ({d.calls} calls), B={B}, {pool} pool ({facts['pages']:,} pages), {steps} steps\n", file=out)
    print(f"plain: {us(plain)} µs per running sequence per step; with the timers: {us(timed)} µs; "
          f"{n_launch / seq_steps:.3g} kernel launches per sequence step.\n", file=out)
    if pool == "evicting":
        print(f"free pages after the fill: {facts['free_pages_after_fill']}, after the steps: {free_after}\n",
              file=out)
    print("| part | µs per running sequence per step | share |\n|---|---:|---:|", file=out)
    for k, v in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {us(v)} | {v / timed:.1%} |", file=out)
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
    p.add_argument("--repeats", type=int, default=3, help="plain and timed passes, alternated")
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args(argv)
    for pool in ("roomy", "evicting") if a.pool == "both" else (a.pool,):
        profile(pool, a.batch, a.steps, a.repeats, a.top)


if __name__ == "__main__":
    main()

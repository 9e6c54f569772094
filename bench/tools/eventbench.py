"""The cost of KV cache events in a batched engine step.

    NUMBA_NUM_THREADS=1 python bench/tools/eventbench.py [--requests 400] [--batch 64] [--profile]
    NUMBA_NUM_THREADS=1 python bench/tools/eventbench.py --requests 1600 --against HEAD~1 [--rounds 5] [--clock thread]
        [--publish]
    valgrind --tool=callgrind --instr-atstart=no python bench/tools/eventbench.py --requests 1600 --against HEAD~1 \
        --instructions

Drives one manager through the batched calls (``create_kv_caches``,
``resume_batch``, ``resize_batch``, ``commit_batch``, ``close_batch``) with
requests that share prefixes, in a pool small enough to evict, once with
events off and once on (every step drains ``get_latest_events``), and prints
the time per step of each, and of ``on_records`` (the event translation)
alone. ``--profile`` adds cProfile's top functions of the run with events on.

``--against REV`` also runs the event manager of ``gpukv/events.py`` at git
revision REV (the rest of gpukv as it is), alternating events off, REV's
manager and this one for ``--rounds`` rounds in one process (the machine's
load drifts; alternating spreads it over all three), prints each one's first
round (every token new to the process) and the range of the others, the
ratio of each step with events on to the step without them in the same round
(median and range over the rounds after the first), and checks, in one more
run of each, that both managers emit the same events (read whole: every
block and token of theirs made).

``--publish`` drains the events with a ``ZmqEventPublisher`` (the ``events``
extra; an ``inproc`` endpoint, no subscriber) instead of
``get_latest_events``: every step then also translates its events into
vLLM's format, reading every stored block and its token ids, as a routed
engine does. With ``--against``, REV's publisher translation
(``zmq_events._Translator``) goes with REV's event manager.

``--instructions`` counts, instead of timing, the instructions each variant's
run executes (after one run of each to warm up), under valgrind's callgrind
tool started with instrumentation off, as above: a count that the machine's
other work does not change, though it leaves out what memory costs.

``--clock thread`` times the process's own thread (``time.thread_time``)
instead of the wall clock: on a machine shared with other work, the time the
step waits for a core is not its cost.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import importlib.util
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import gpukv

T = 32


def workload(n: int, seed: int = 0) -> list:
    """``n`` prompts: one of 8 shared prefixes (4-24 blocks) + a private tail."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 50_000, size=T * int(rng.integers(4, 25))) for _ in range(8)]
    return [np.concatenate([prefixes[int(rng.integers(8))], rng.integers(0, 50_000, size=int(rng.integers(T, 12 * T)))])
            .astype(np.int32) for _ in range(n)]


clock = time.perf_counter  # --clock thread: time.thread_time


class _Timed:
    """Wraps an event manager's ``on_records`` to add up the time it takes."""

    def __init__(self, em):
        self.seconds = 0.0
        inner = em.on_records

        def on_records(*args, **kwargs):
            t0 = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += clock() - t0

        em.on_records = on_records


def run(prompts: list, batch: int, events: bool, decode_steps: int = 8, manager_class=None, keep=False,
        publish=False, translator_class=None) -> tuple:
    """(seconds, steps, events, seconds in on_records) for the whole workload:
    the events themselves with ``keep``, else their count (holding every
    event would make the garbage collector's passes, and so the step, slower
    than an engine that publishes and drops them); with ``publish``, the
    batches published. ``manager_class`` replaces the event manager and
    ``translator_class`` the publisher's translation (older ones)."""
    mgr = gpukv.KVCacheManager(gpukv.CacheConfig(
        tokens_per_block=T, layers=[gpukv.Attention()], pages_per_life_cycle=4000,
        max_kv_event_entries=10**6 if events else 0, backend="cpu"))
    if events and manager_class is not None:
        em = mgr._events
        swapped = manager_class(em.max_entries, em.event_hash, em.window_sizes, em._digest_of_token, em._scope_of_root)
        swapped._pending, swapped._next_event_id = list(em._pending), em._next_event_id  # its created event
        mgr._events = mgr._launcher.events = swapped
    timer = _Timed(mgr._events) if events else None
    kept, seen = [], 0
    if publish:
        from gpukv.zmq_events import ZmqEventPublisher

        publisher = ZmqEventPublisher(mgr, endpoint=f"inproc://eventbench-{id(mgr)}")
        if translator_class is not None:
            publisher._translator = translator_class(mgr.tokens_per_block, mgr.life_cycles, None)

    def drain():
        nonlocal seen
        if publish:
            seen += publisher.publish() is not None
            return
        got = mgr.get_latest_events()
        seen += len(got)
        if keep:
            kept.extend(got)

    drain()
    steps = 0
    t0 = clock()
    for at in range(0, len(prompts), batch):
        group = prompts[at:at + batch]
        kvs = mgr.create_kv_caches([p[:-1] for p in group])
        mgr.resume_batch(kvs)
        reused = [kv.num_committed_tokens for kv in kvs]
        sizes = [len(p) + decode_steps for p in group]
        ok = mgr.resize_batch(kvs, sizes, reused)
        live = [kv for kv, good in zip(kvs, ok) if good]
        mgr.commit_batch(live, [p[r:] for p, r, good in zip(group, reused, ok) if good])
        drain()
        steps += 1
        offsets = np.arange(len(live) + 1, dtype=np.int64)
        for s in range(decode_steps):
            mgr.commit_batch(live, (np.full(len(live), s, dtype=np.int32), offsets))
            drain()
            steps += 1
        mgr.close_batch(kvs)
        drain()
        steps += 1
    seconds = clock() - t0
    if publish:
        publisher.close()
    return seconds, steps, kept if keep else seen, timer.seconds if timer else 0.0


def _callgrind(*args: str) -> str:
    """``callgrind_control`` on this process (run under callgrind)."""
    done = subprocess.run(["callgrind_control", *args, str(os.getpid())], capture_output=True, text=True)
    if done.returncode or "not detected" in done.stdout + done.stderr:
        raise SystemExit("--instructions: run under valgrind --tool=callgrind --instr-atstart=no")
    return done.stdout


def instructions(fn) -> int:
    """Instructions executed by ``fn()`` (callgrind's counters, zeroed first)."""
    _callgrind("-z")
    _callgrind("-i", "on")
    fn()
    counters = _callgrind("-e", "Ir")  # read while counting: callgrind shows nothing once off
    _callgrind("-i", "off")
    return sum(int(line.split()[-1].replace(",", "")) for line in counters.splitlines() if line.strip().startswith("Th "))


def module_at(rev: str, path: str):
    """The gpukv module at ``path`` as it is at git revision ``rev``,
    imported as a module of the installed gpukv package (the rest of gpukv
    as it is)."""
    root = Path(gpukv.__file__).resolve().parent.parent
    source = subprocess.run(["git", "-C", str(root), "show", f"{rev}:{path}"],
                            check=True, capture_output=True, text=True).stdout
    name = f"gpukv._{Path(path).stem}_at_" + "".join(c if c.isalnum() else "_" for c in rev)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    module.__package__ = "gpukv"
    sys.modules[name] = module
    exec(compile(source, f"{rev}:{path}", "exec"), module.__dict__)
    return module


def manager_at(rev: str):
    """``KVCacheEventManager`` of gpukv/events.py at git revision ``rev``."""
    return module_at(rev, "gpukv/events.py").KVCacheEventManager


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--against", metavar="REV", help="alternate with the event manager of git revision REV")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the alternation (--against)")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall")
    ap.add_argument("--publish", action="store_true", help="drain with a ZmqEventPublisher")
    ap.add_argument("--instructions", action="store_true", help="count instructions (under callgrind), with --against")
    a = ap.parse_args()
    global clock
    clock = time.thread_time if a.clock == "thread" else time.perf_counter
    prompts = workload(a.requests)
    run(prompts[: a.batch], a.batch, True, publish=a.publish)  # warm up: kernel loads
    on = "published" if a.publish else "events on"
    if a.against:
        before = manager_at(a.against), module_at(a.against, "gpukv/zmq_events.py")._Translator if a.publish else None
        variants = {"events off": (False, (None, None)), f"{on}, {a.against}": (True, before), f"{on}, now": (True, (None, None))}
        if a.instructions:
            runs = {label: functools.partial(run, prompts, a.batch, events, manager_class=manager,
                                             publish=a.publish and events, translator_class=translator)
                    for label, (events, (manager, translator)) in variants.items()}
            steps = [warm() for warm in runs.values()][0][1]
            counted = {label: instructions(fn) / steps for label, fn in runs.items()}
            for label, n in counted.items():
                print(f"{label:>{max(map(len, variants))}}: {n / 1e6:.2f} M instructions per step, "
                      f"x events off: {n / counted['events off']:.2f}")
            return
        per_step, in_events, counts = {k: [] for k in variants}, {k: [] for k in variants}, {}
        for _ in range(a.rounds):
            for label, (events, (manager, translator)) in variants.items():
                dt, steps, counts[label], translating = run(prompts, a.batch, events, manager_class=manager,
                                                            publish=a.publish and events, translator_class=translator)
                per_step[label].append(1e3 * dt / steps)
                in_events[label].append(1e3 * translating / steps)
        # The first round apart: its event managers meet every token for the first time.
        spread = (lambda x: f"{x[0]:.2f} then {min(x[1:]):.2f}-{max(x[1:]):.2f}") if a.rounds > 1 else (lambda x: f"{x[0]:.2f}")
        off = per_step["events off"]
        for label in variants:
            s, e = per_step[label], in_events[label]
            line = f"{label:>{max(map(len, variants))}}: step {spread(s)} ms"
            if variants[label][0]:
                ratios = [on / o for on, o in zip(s, off)][1:] or [s[0] / off[0]]
                line += (f", on_records {spread(e)} ms/step, {counts[label]} {'batches' if a.publish else 'events'}; "
                         f"x events off: {np.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
            print(line)
        if not a.publish:
            old, new = (run(prompts, a.batch, True, manager_class=cls, keep=True)[2] for cls in (before[0], None))
            print("same events" if old == new else f"DIFFERENT EVENTS: {len(old)} vs {len(new)}")
            if old != new:
                sys.exit(1)
        return
    for events in (False, True):
        dt, steps, seen, translating = run(prompts, a.batch, events, publish=a.publish and events)
        print(f"{on if events else 'events off'}: {dt:.3f} s, {steps} steps, {1e3 * dt / steps:.2f} ms/step, "
              f"{seen} {'batches' if a.publish else 'events'}"
              + (f", on_records {1e3 * translating / steps:.2f} ms/step" if events else ""))
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        run(prompts, a.batch, True, publish=a.publish)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()

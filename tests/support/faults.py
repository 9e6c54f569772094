"""The fault harness: a randomised workload on real page memory in which calls
fail at random points (``FaultyWorkload``), checked after every step.

A workload drives a few requests through admission, resume, model steps
(``resize``, the engine writes the KV, ``commit``), suspend, stop/plan/drop,
close, read-only matching and tree clears. Before a call, ``Faults`` may arm
one fault for it:

- ``line``: a ``KeyboardInterrupt`` before a random line of gpukv's host code
  in that call (``sys.settrace``), as a signal handler would raise it;
- ``signal``: a real ``SIGALRM`` after a random delay whose handler raises
  ``KeyboardInterrupt`` when gpukv's host code is running;
- ``hook``: one step of the launch protocol raises (the copy executor, the
  event feed, the eviction listing, the log and copy reads);
- ``callback``: the cache's ``priority_callback`` raises, returns a bad value,
  or calls back into the manager.

After every step (``FaultyWorkload.verify``) the tables pass
``introspect.check_sanity``; every page in the tree holds the data written for
exactly its block's prefix (``Engine.verify_tree``); every live cache's reused
and written positions hold their own prefix's data (``verify_reuse``,
``verify_written``); its committed tokens are its own; the event stream is
consistent with the tree (``EventTracker``); and every open cache belongs to
the workload. A call whose only fault was a callback changed nothing.
"""

from __future__ import annotations

import random
import signal
import sys
import threading
import traceback

import gpukv
from gpukv import Attention, Ssm, introspect

from tests.support.backends import make_manager
from tests.support.engine import Engine
from tests.support.event_checks import EventTracker
from tests.support.interrupts import interruptible

T = 4
ACTIVE = gpukv.KVCacheStatus.ACTIVE
SUSPENDED = gpukv.KVCacheStatus.SUSPENDED
CLOSED = gpukv.KVCacheStatus.CLOSED


class InjectedFault(RuntimeError):
    """An exception the harness raised on purpose."""


# ---------------------------------------------------------------------------
# the faults
# ---------------------------------------------------------------------------

# Steps of the launch protocol a hook fault may break: (owner, method).
HOOKS = (
    ("copier", "carry_out"),
    ("copier", "rewind"),
    ("events", "on_records"),
    ("tables", "read_copies"),
    ("tables", "read_log"),
    ("tables", "counters_host"),
)


class Faults:
    """Arms at most one fault per call, seeded; counts what fired."""

    def __init__(self, mgr, rng: random.Random, rate: float, kinds=("line", "signal", "hook", "callback")):
        self.mgr = mgr
        self.rng = rng
        self.rate = rate
        self.kinds = tuple(k for k in kinds if k != "signal" or _signals_usable())
        self.fired: dict = {k: 0 for k in ("line", "signal", "hook", "callback")}
        self._line_left = 0
        self._signal_armed = False
        self._hook_left: dict = {}  # (owner, method) -> calls before it raises
        self.callback_fault: str | None = None  # what the next priority_callback call does
        self._install_hooks()

    # -- hooks --------------------------------------------------------------------
    def _install_hooks(self):
        launcher = self.mgr._launcher
        owners = {"copier": launcher.copier, "events": launcher.events, "tables": launcher.tables}
        self.hooks = []
        for owner_name, method in HOOKS:
            owner = owners[owner_name]
            if owner is None:
                continue
            original = getattr(owner, method)
            key = (owner_name, method)
            setattr(owner, method, self._hooked(key, original))
            self.hooks.append(key)

    def _hooked(self, key, original):
        def hook(*args, **kwargs):
            left = self._hook_left.get(key)
            if left is not None:
                if left == 0:
                    del self._hook_left[key]
                    self.fired["hook"] += 1
                    raise self.rng.choice((KeyboardInterrupt, InjectedFault))(f"injected in {key[0]}.{key[1]}")
                self._hook_left[key] = left - 1
            return original(*args, **kwargs)

        return hook

    # -- line interrupts --------------------------------------------------------------
    def _global_trace(self, frame, event, arg):
        return self._local_trace if interruptible(frame.f_code) else None

    def _local_trace(self, frame, event, arg):
        if event == "line" and self._line_left:
            self._line_left -= 1
            if self._line_left == 0:
                self.fired["line"] += 1
                raise KeyboardInterrupt("injected before a line of gpukv")
        return self._local_trace

    # -- signals --------------------------------------------------------------------------
    def _on_alarm(self, sig, frame):
        if not self._signal_armed:
            return
        if frame is None or not interruptible(frame.f_code):
            signal.setitimer(signal.ITIMER_REAL, 20e-6)  # try again a little later
            return
        self._signal_armed = False
        self.fired["signal"] += 1
        self.last_signal_frame = traceback.format_stack(frame)[-4:]
        raise KeyboardInterrupt("injected by SIGALRM")

    # -- one call -------------------------------------------------------------------------
    def call(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` with at most one fault armed.

        Returns ``(kind, value, exc)``: the fault armed (None), the call's
        value (None when it raised), and what it raised (None)."""
        kind = self.rng.choice(self.kinds) if self.rng.random() < self.rate else None
        rng = self.rng
        old_handler = None
        if kind == "line":
            self._line_left = rng.randint(1, 120)
            sys.settrace(self._global_trace)
        elif kind == "signal":
            old_handler = signal.signal(signal.SIGALRM, self._on_alarm)
            self._signal_armed = True
            signal.setitimer(signal.ITIMER_REAL, rng.uniform(10e-6, 1.5e-3))
        elif kind == "hook" and self.hooks:
            self._hook_left = {rng.choice(self.hooks): rng.randrange(2)}  # it raises on its first or second call
        elif kind == "callback":
            self.callback_fault = rng.choice(("raise", "interrupt", "bad-value", "re-enter"))
        try:
            return kind, fn(*args, **kwargs), None
        except (KeyboardInterrupt, InjectedFault, gpukv.BusyError, ValueError) as e:
            if isinstance(e, ValueError) and "priority_callback" not in str(e):
                raise  # the workload makes valid calls: only a callback's fault may come back as ValueError
            if isinstance(e, gpukv.BusyError) and self.callback_fault != "re-enter" and kind != "callback":
                raise
            return kind, None, e
        finally:
            if kind == "line":
                sys.settrace(None)
                self._line_left = 0
            elif kind == "signal":
                self._signal_armed = False
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, old_handler)
            self._hook_left = {}
            self.callback_fault = None

    def priority_callback(self, ordinal, lc):
        """The callback every cache of the workload gets: 35, unless a fault says otherwise."""
        what = self.callback_fault
        if what is None:
            return 35 + (ordinal % 3)
        self.callback_fault = None
        self.fired["callback"] += 1
        if what == "raise":
            raise InjectedFault("injected in priority_callback")
        if what == "interrupt":
            raise KeyboardInterrupt("injected in priority_callback")
        if what == "bad-value":
            return 101
        self.mgr.probe_reuse([1, 2, 3])  # refused: calls do not nest
        raise AssertionError("a call from inside a callback was not refused")


def _signals_usable() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


# ---------------------------------------------------------------------------
# the workload
# ---------------------------------------------------------------------------


class Request:
    """One request: its token stream, its cache, and how far the engine wrote."""

    def __init__(self, tokens, kv):
        self.tokens = list(tokens)
        self.kv = kv
        self.written = int(kv.num_committed_tokens)  # reused positions count as written
        self.stopping = False  # stop_committing() was called (it may have happened even if it raised)


def _state(kv):
    return (kv.status, kv.num_committed_tokens, kv.history_length, kv.capacity)


class FaultyWorkload:
    CONFIGS = {
        "full": dict(layers=(Attention(),), pages=24, host=0),
        "hybrid": dict(layers=(Attention(), Attention(window=8), Ssm()), pages=28, host=8, commit_min_snapshot=True),
        "swa-host": dict(layers=(Attention(), Attention(window=6)), pages=20, host=12),
    }

    def __init__(self, seed: int, config: str, rate: float = 0.35, backend="cpu", kinds=None, index_only=False,
                 max_blocks=None):
        """``index_only``: ``page_bytes=0``, and the engine keeps the KV in its
        own arrays, carrying out the copies it takes from the manager.
        ``max_blocks``: the tables preallocated (``CacheConfig.max_blocks``)."""
        self.rng = rng = random.Random(seed)
        c = dict(self.CONFIGS[config])
        extra = {k: v for k, v in c.items() if k not in ("layers", "pages", "host")}
        self.mgr = make_manager(
            backend, tokens_per_block=T, layers=list(c["layers"]), pages_per_life_cycle=c["pages"],
            host_pages_per_life_cycle=c["host"], page_bytes=0 if index_only else 8 * T,
            enable_partial_reuse=rng.random() < 0.7, max_kv_event_entries=10**6, max_blocks=max_blocks, **extra,
        )
        self.engine = Engine(self.mgr)
        self.events = EventTracker(self.mgr)
        self.faults = Faults(self.mgr, rng, rate, **({} if kinds is None else {"kinds": kinds}))
        self.stems = [[rng.randrange(1, 500) for _ in range(rng.randrange(2, 14))] for _ in range(4)]
        self.live: list[Request] = []
        self.plans: list = []
        self.steps = 0
        self.committed_turns = 0
        self.unchanged_checks = 0

    def prompt(self):
        rng = self.rng
        return rng.choice(self.stems)[: rng.randrange(1, 15)] + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 7))]

    # -- operations ----------------------------------------------------------------
    def admit(self):
        prompt = self.prompt()
        kind, kv, _ = self.faults.call(self.mgr.create_kv_cache, input_tokens=prompt,
                                       priority_callback=self.faults.priority_callback)
        if kv is not None:
            assert kv.status is SUSPENDED
            self.live.append(Request(prompt, kv))

    def resume(self, r):
        before = _state(r.kv)
        kind, _, exc = self.faults.call(r.kv.resume)
        self._unchanged_after_callback(kind, exc, r, before)

    def advance(self, r):
        """One model step: room for a few more tokens, the engine writes them, a commit."""
        rng, kv = self.rng, r.kv
        start = max(r.written, kv.history_length)
        target = start + rng.randrange(1, 2 * T + 2)
        while len(r.tokens) < target:
            r.tokens.append(rng.randrange(1, 500))
        before = _state(kv)
        kind, ok, exc = self.faults.call(kv.resize, target, target)
        self._unchanged_after_callback(kind, exc, r, before)
        if kv.status is not ACTIVE or kv.capacity < target or kv.history_length != target:
            return
        self.engine.run(kv, r.tokens, r.written, target)
        r.written = target
        if rng.random() < 0.85 and kv.num_committed_tokens < target and not r.stopping:
            self.faults.call(kv.commit, r.tokens[kv.num_committed_tokens:target])

    def suspend(self, r):
        self.faults.call(r.kv.suspend)

    def finish(self, r):
        """End of a turn: stop committing, maybe plan a drop, close."""
        kv = r.kv
        r.stopping = True
        _, _, stop_failed = self.faults.call(kv.stop_committing)
        if self.rng.random() < 0.5 and stop_failed is None:
            _, plan, exc = self.faults.call(kv.plan_committed_block_drop)
            if plan is not None:
                self.plans.append(plan)
        self.close(r)

    def close(self, r):
        self.faults.call(r.kv.close, evict_first=self.rng.random() < 0.3)
        if r.kv.status is CLOSED:
            self.committed_turns += r.kv.num_committed_tokens > 0
            self.live.remove(r)

    def drop_a_plan(self):
        plan = self.plans.pop(self.rng.randrange(len(self.plans)))
        self.faults.call(plan.drop)

    def match(self):
        prompts = [self.prompt() for _ in range(self.rng.randrange(1, 4))]
        _, m, _ = self.faults.call(self.mgr.match_batch, prompts)
        if m is not None:
            got = m.to_host().num_tokens.tolist()
            assert got == [self.mgr.probe_reuse(p) for p in prompts]  # the same index, no fault in between

    def clear(self):
        if not self.live:
            self.faults.call(self.mgr.clear_reusable_blocks)

    def step(self):
        rng = self.rng
        self.steps += 1
        live = self.live
        x = rng.random()
        if not live or (x < 0.15 and len(live) < 4):
            self.admit()
        else:
            r = rng.choice(live)
            status = r.kv.status
            if r.stopping:  # a turn that failed to close: close it
                self.close(r)
            elif status is SUSPENDED:
                if x < 0.8:
                    self.resume(r)
                else:
                    self.close(r)
            elif x < 0.6:
                self.advance(r)
            elif x < 0.7:
                self.suspend(r)
            elif x < 0.8 or r.written >= 40:
                self.finish(r)
            elif x < 0.9:
                self.match()
            elif self.plans:
                self.drop_a_plan()
            else:
                self.clear()
        if self.engine.owns_memory and self.faults.rate > 0:
            # The engine takes the step's copies, and that call may fail too
            # (then they come with the next take); carrying them out is its own.
            _, copies, _ = self.faults.call(self.mgr.take_page_copies)
            if copies is not None:
                self.engine.apply(copies)
        self.verify()

    # -- checks ------------------------------------------------------------------------------
    def _unchanged_after_callback(self, kind, exc, r, before):
        """A call that failed in its priority callback, before any launch, changed nothing."""
        if kind == "callback" and exc is not None:
            assert _state(r.kv) == before, f"{type(exc).__name__} from the callback, yet {before} -> {_state(r.kv)}"
            self.unchanged_checks += 1

    def verify(self):
        mgr, engine = self.mgr, self.engine
        introspect.check_sanity(mgr)
        engine.verify_tree()
        for r in self.live:
            kv = r.kv
            n = kv.num_committed_tokens
            assert kv.committed_tokens.tolist() == r.tokens[:n], "a cache's committed tokens are not its own"
            if kv.status is ACTIVE:
                engine.verify_reuse(kv, r.tokens)
                engine.verify_written(kv, r.tokens, r.written)
        self.events.step()
        open_caches = set(map(id, mgr._open_caches))
        mine = {id(r.kv) for r in self.live}
        assert open_caches == mine, (
            f"{len(open_caches - mine)} open caches the workload never received, "
            f"{len(mine - open_caches)} of its caches not open"
        )

    def wind_down(self):
        """Close everything, then every prompt that is reusable reads back right."""
        for r in list(self.live):
            r.kv.close()
            self.live.remove(r)
        for plan in self.plans:
            plan.drop()
        self.plans.clear()
        self.verify()
        for stem in self.stems:
            kv = self.mgr.create_kv_cache(input_tokens=stem)
            assert kv.resume()
            self.engine.verify_reuse(kv, stem)
            kv.close()
        pages = introspect.tables(self.mgr)["pages"]
        assert not ((pages["locks"] > 0) | (pages["holders"] > 0)).any(), "a page is still locked or held"
        self.mgr.shutdown()

    def run(self, steps: int):
        for _ in range(steps):
            self.step()
        self.wind_down()
        return self

"""The launch protocol: one kernel launch and everything that must follow it.

Every kernel that changes the tables runs through ``Launcher.launch``, which
serves the tree (``tree.py``), the caches (``cache.py``) and, for the matching
kernels that only read, the matcher (``matching.py``):

    settle      finish what an earlier launch left undone (see below)
    launch      run the kernel on the tables (eviction needs no preparation:
                the kernels keep their candidates listed, ``kernels/lru.py``)
    aftermath   1. results: the caller's host copies of what it changed (a
                   cache's scalars; for a launch over many caches, all of
                   theirs in one transfer)
                2. copies: the page data copies the kernel recorded, carried
                   out in order by the copy executor (``PageMemory``)
                3. log: the change records, to the event manager (and to a
                   test's ``log_sink``), with the removals the kernel
                   retired rows for put in their places (``with_removals``);
                   then the freed rows go back on the free stack
                4. errors: a kernel that had to stop raises ``TreeError``

The aftermath is resumable. A device counter (copies, log) is reset only after
what it counts has been done, and the host keeps how far it got, so an
exception anywhere after the launch (a raising sink, a ``KeyboardInterrupt``
from a signal handler) forgets nothing: the next settle carries on from where
the last one stopped, and never repeats a copy that overwrote something.
Every public call settles again on its way out with an exception
(``CallGuard``), so an engine that catches the exception finds the page data
already in place.

``CallGuard`` is the other half of the protocol: a manager serves one call at
a time. A call made while another one is in progress, from a callback inside
it or from a second thread, is refused with ``BusyError`` before it changes
anything.

A kernel's first call in a process imports and loads compiled code (Numba,
its disk cache). An exception in the middle of an import leaves modules half
initialised that no retry repairs, so signals are held during a first load
(``first_load``) and delivered right after it; a second signal goes through
at once, for a user who insists.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading

import numpy as np

from . import kernel_cache
from .core.errors import BusyError, TreeError
from .core.layout import (
    CNT_DETACHES,
    CNT_ERROR,
    CNT_EVICT_FIRST,
    CNT_HELD_DETACHES,
    CNT_LOG_LEN,
    CNT_LOG_TOKENS_LEN,
    CNT_NUM_COPIES,
    CNT_RETIRED,
    CNT_TICK,
    CNT_UNLINKS,
    ERR_NONE,
    EV_REMOVED,
    EV_ROOT_REMOVED,
    LOG,
    LOG_BLOCK,
    LOG_DIGEST,
    LOG_KIND,
    LOG_LIFE_CYCLE,
    NULL,
    RETIRED_FREED,
    RETIRED_REMOVED,
    RETIRED_ROOT_REMOVED,
    TICK_RENUMBER_AT,
)


class _Call:
    """One call on a manager: who made it and what it is (identity compared)."""

    __slots__ = ("thread", "what")

    def __init__(self, what: str):
        self.thread = threading.get_ident()
        self.what = what


class CallGuard:
    """One call at a time per manager.

    The calls under way are the keys of an insertion-ordered dict: a call
    enters with one store, owns the manager when it is the first key, and
    leaves with one ``pop`` of its own key. Each is a single step for the
    interpreter, so one asynchronous exception (a ``KeyboardInterrupt`` from a
    signal handler), wherever it lands, leaves no call registered that has
    left; and two threads cannot both own the manager."""

    def __init__(self, launcher: "Launcher"):
        self._launcher = launcher
        self._calls: dict[_Call, None] = {}

    @property
    def busy(self) -> bool:
        return bool(self._calls)

    def run(self, what: str, method, args, kwargs):
        calls = self._calls
        launcher = self._launcher
        call = _Call(what)
        try:
            calls[call] = None
            first = next(iter(calls))
            if first is not call:
                raise _refusal(call, first)
            # The manager's stream, if it has one, for everything the call
            # queues on the device (a CuPy context: no gpukv code runs on the
            # way out, after the method's last line).
            with launcher.stream_scope:
                if launcher.pending:  # an earlier call's aftermath was cut short
                    launcher.settle()
                return method(*args, **kwargs)
        except BaseException:
            if launcher.pending and calls and next(iter(calls)) is call:
                # Finish the aftermath of a launch that was cut short, so the
                # caller that catches this finds the page data and the events
                # complete; if that fails too, the next call finishes it.
                try:
                    with launcher.stream_scope:
                        launcher.settle()
                except BaseException:
                    pass  # the exception on its way out is the one to report
            raise
        finally:
            calls.pop(call, None)


def _refusal(call: _Call, running: _Call) -> BusyError:
    if running.thread == call.thread:
        return BusyError(
            f"{call.what} was called while {running.what} is in progress on the same manager "
            "(from a callback?); calls on a manager do not nest"
        )
    return BusyError(
        f"{call.what} was called from thread {call.thread} while {running.what} is in progress in thread "
        f"{running.thread}; a KVCacheManager is single-threaded: drive it and its caches from one thread"
    )


def serialized(what: str):
    """Run a public method of an object with a ``_launcher`` under its
    manager's ``CallGuard``; ``what`` names the call in refusals."""

    def wrap(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            return self._launcher.guard.run(what, method, (self, *args), kwargs)

        return call

    return wrap


@contextlib.contextmanager
def first_load():
    """Hold the signals that have Python handlers (SIGINT, a SIGALRM timer, ...)
    until the block is over, then deliver them in order. Handlers run on the
    main thread only, so elsewhere there is nothing to hold."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {}
    held = []

    def restore():
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        saved.clear()

    def hold(sig, frame):
        if held:  # the second signal: stop holding and deliver it now
            original = saved.get(sig)
            restore()
            if callable(original):
                original(sig, frame)
            return
        held.append((sig, frame))

    try:
        for sig in signal.valid_signals():
            try:
                handler = signal.getsignal(sig)
            except (OSError, ValueError):
                continue
            if callable(handler):
                saved[sig] = handler
                signal.signal(sig, hold)
        yield
    finally:
        originals = dict(saved)
        restore()
        for sig, frame in held:
            original = originals.get(sig)
            if callable(original):
                original(sig, frame)


_LOADED: set = set()  # kernels whose first call completed in this process


def call_kernel(kernel, *args) -> None:
    """``kernel(*args)``; its first call in the process under ``first_load``
    (and announced when it compiles: ``kernel_cache.first_call``)."""
    if kernel in _LOADED:
        kernel(*args)
        return
    with first_load(), kernel_cache.first_call(kernel):
        kernel(*args)
        _LOADED.add(kernel)


class Launcher:
    """Runs kernels on one manager's tables and does their aftermath.

    ``copier``: carries out recorded
    page data copies (``PageMemory``). ``events``: the event manager fed from
    the change log (None when events are off). ``stream_scope``: the context
    every public call runs in (``backend.stream_scope``: the manager's CUDA
    stream; nothing by default). ``log_sink``: a list that collects every
    drained log record (tests)."""

    def __init__(self, tables, copier=None, events=None, stream_scope=None):
        self.tables = tables
        self.stream_scope = contextlib.nullcontext() if stream_scope is None else stream_scope
        self.backend = tables.backend
        self.copier = copier
        self.events = events
        self._log_sink: list | None = None
        self._read_by_events_or_sink()
        self.guard = CallGuard(self)
        self.pending = False  # a launch whose aftermath is not finished
        self.launches = 0  # kernels run that may have changed the tables (host copies key on it)
        # Blocks detached and pages unlinked so far, as of the last settled
        # launch: a match's block rows still hold what it found while this
        # stays the same (blocks and pages added since only lengthen a match).
        self.removals = 0
        self.held_detaches = 0  # detached blocks a cache referred to (CNT_HELD_DETACHES), as of the last launch
        self._results = None  # the pending launch's results step
        self._log_fed = np.zeros(1, dtype=np.int64)  # records the event manager consumed
        # The pending launch's records, token rows, freed rows and where its
        # records start in the log sink: read once, kept until the aftermath is done.
        self._drained = None
        self._log_counters = tables.backend.to_device(np.array([CNT_LOG_LEN, CNT_LOG_TOKENS_LEN]))

    @property
    def log_sink(self) -> list | None:
        return self._log_sink

    @log_sink.setter
    def log_sink(self, sink: list | None) -> None:
        self._log_sink = sink
        self._read_by_events_or_sink()

    def _read_by_events_or_sink(self) -> None:
        """The kernels write change-log records only while someone reads
        them: the event manager, or a test's sink."""
        self.tables.read_log_records(self.events is not None or self._log_sink is not None)

    def launch(self, kernel, *args, results=None) -> None:
        """``kernel(tables, *args)``, then its aftermath (the kernels find
        eviction victims themselves: nothing to prepare).

        ``results()`` refreshes the caller's host copies of what the launch
        changed; it runs first in the aftermath, and again if the aftermath is
        resumed, so it must be idempotent (a read of device state)."""
        if self.pending:
            self.settle()
        self._results = results
        self.pending = True
        self.launches += 1
        call_kernel(kernel, self.tables.device, *args)
        self.settle()

    def read(self, kernel, *args) -> None:
        """A kernel that changes no table (matching): it only needs what an
        earlier launch left undone to be finished first."""
        if self.pending:
            self.settle()
        call_kernel(kernel, *args)

    def settle(self) -> None:
        """The aftermath of the last launch, from where it stopped; nothing
        when it is complete."""
        if not self.pending:
            return
        if self._results is not None:
            self._results()
        t = self.tables
        counters = t.counters_host().tolist()  # plain ints: one conversion for all
        self.held_detaches = counters[CNT_HELD_DETACHES]
        self.removals = counters[CNT_DETACHES] + counters[CNT_UNLINKS]
        n = counters[CNT_NUM_COPIES]
        if n:
            copies = t.read_copies(n)
            if self.copier is not None:
                self.copier.carry_out(copies)
            t.counters[CNT_NUM_COPIES] = 0
        if self.copier is not None:
            self.copier.rewind()  # after the reset: a reset count with a stale cursor reads as done
        n = counters[CNT_LOG_LEN]
        retired = counters[CNT_RETIRED]
        if n or retired:
            if self._drained is None:
                # Read once: returning the freed rows may overwrite the
                # retired list, so a resumed aftermath uses this copy. The
                # records leave the device only for someone who reads them
                # (events on, or a test's sink); the freed rows always.
                read = t.log_read
                records, tokens = t.read_log(n, counters[CNT_LOG_TOKENS_LEN]) if read else (_NO_RECORDS, None)
                freed = None
                if retired:  # most launches free no row: nothing to merge or give back
                    rows, kinds, at = t.read_retired(retired)
                    freed = rows[kinds != RETIRED_REMOVED]
                    if read:
                        records = with_removals(records, rows, kinds, at, t.digests_of)
                sink_at = 0 if self.log_sink is None else len(self.log_sink)
                self._drained = (records, tokens, freed, sink_at)
            records, tokens, freed, sink_at = self._drained
            if self.log_sink is not None:
                self.log_sink[sink_at:] = records  # one store: a repeat replaces what an interrupted one added
            if self.events is not None and len(records):
                self.events.on_records(records, tokens, progress=self._log_fed)
            t.counters[self._log_counters] = 0  # both in one store
            if freed is not None:
                t.return_rows(freed)
        if max(counters[CNT_TICK], counters[CNT_EVICT_FIRST]) >= TICK_RENUMBER_AT:
            t.renumber_ticks()  # a page's LRU tick is 32 bits wide; the clocks never stop
        self._drained = None
        self._log_fed[0] = 0
        err = counters[CNT_ERROR]
        self._results = None
        self.pending = False
        if err != ERR_NONE:
            raise TreeError(f"tree kernel stopped with error code {err}")


_NO_RECORDS = np.zeros((0, 0), dtype=np.int64)  # a drain nobody reads


def with_removals(records: np.ndarray, rows, kinds, at, digests_of) -> np.ndarray:
    """The launch's log ``records`` with a removal record for each retired row
    that reports one (``layout.RETIRED_*``), each before the record that was
    ``at`` its log position, in the order they were retired: the records a
    log that held removals too would have. ``digests_of(rows)``: the rows'
    chain digests (``Tables.digests_of``)."""
    report = kinds != RETIRED_FREED
    if not report.any():
        return records
    rows, kinds, at = rows[report], kinds[report], at[report]
    digests = digests_of(rows)
    removed = np.zeros((rows.size, LOG.width), dtype=np.int64)
    removed[:, LOG_KIND] = np.where(kinds == RETIRED_ROOT_REMOVED, EV_ROOT_REMOVED, EV_REMOVED)
    removed[:, LOG_LIFE_CYCLE] = NULL
    removed[:, LOG_BLOCK] = rows
    removed[:, LOG_DIGEST:LOG_DIGEST + 4] = digests
    return np.insert(records.reshape(-1, LOG.width), at, removed, axis=0)  # ties keep their order

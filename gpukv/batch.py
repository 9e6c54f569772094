"""Every call on KV caches, for one cache or a batch: checks, table room, one launch.

A call on caches (creation with reuse, resume, suspend, resize, commit,
stop, close) is one launch of a sequence kernel (``kernels/seq.py``) over a
list of slots of the manager's ``CachePool``, and this module is the only
host code that makes one. ``KVCache``'s methods are batches of one; the
manager's batched calls (``create_kv_caches``, ``resume_batch``,
``resize_batch``, ``commit_batch``, ``close_batch``) batches of many. Both go
through the same steps, each written once:

    parse    the call's input in its own form, by the checks every entry point
             shares (``inputs.py``): a per-cache call's ints and token
             sequence, a batched call's lists or flat arrays
    check    the rules, over every entry's values, before anything changes;
             an error names the call (``resize()``) or the entry
             (``resize_batch(): caches[2]: ...``) as ``OneCache`` / ``Entries`` say
    launch   ask the priority callbacks, reserve room (the segments, free
             block rows, the change log), set the kernel arguments, launch,
             read the caches' scalars back: ``CacheCalls._reserve_and_launch``,
             the one place that reserves table room (a per-cache append
             that finds the rest there already makes the change log's on
             its flat way: ``_append_one``)

A call's values are ints for one cache and int64 arrays for many, and one
expression serves both (the helpers below, ``_any`` to ``_select``, are the
few steps that differ). A commit's and an append's checks and room, the
rules a decode step runs over every running cache, are functions of one
cache's ints (``core/call_room.py``): Python for one cache, one compiled
loop over the caches' scalars for many. A per-cache call, which an engine's
scheduler makes hundreds of times per step, thus costs its checks in plain
Python and one launch, with no array built for it; a batched call of one
cache takes the same fast path. A per-cache append or commit (a prefill's
chunk, a decode step) that needs no room made but the change log's skips the
general launch's steps altogether: the rules, the checks that each step
would do nothing, the compiled call and its aftermath in one short way.

The result of a batched call equals issuing the per-cache calls one by one in
the order given: the kernel runs the same per-cache code on each cache in
turn. Input that is wrong for any entry (a cache twice, a closed or foreign
cache, lengths that disagree, a bad token) is refused with an error naming
the entry, before anything changes.

A cache is known here by its pool slot and the serial the pool gave it
(``KVCache._slot`` and ``_serial``, its handle); everything else a call needs
of it (scalars, segment, priority callback) is the pool's.

It is longer than most modules because it is the whole of the calls on
caches, both input forms and every call's rules and table room, each once.
"""

from __future__ import annotations


import numpy as np

from . import inputs
from .cache import KVCache
from .cache_pool import is_batch, ranges, with_room
from .core.call_room import (
    COMMIT_NOT_AT_SNAPSHOT,
    COMMIT_PAST_CAPACITY,
    COMMIT_STOPPED,
    PLAN_ALLOCATED,
    PLAN_ANNOUNCED,
    PLAN_BLOCKS,
    PLAN_DONE,
    PLAN_ERROR,
    PLAN_RUN,
    PLAN_SPAN,
    PLAN_WIDTH,
    STOP_ROWS,
    TOTALS_WIDTH,
    append_rules,
    appended,
    can_hold,
    can_hold_each,
    log_blocks,
    plan_appends,
    stop_announced,
)
from .core.config import DEFAULT_PRIORITY, check_priority
from .core.errors import BusyError, LogicError, StaleMatchError
from .core.layout import (
    ACTIVE,
    BATCH_ARGS,
    BATCH_TOKENS,
    BATCH_WIDTH,
    CLOSED,
    CNT_BLOCK_FREE_TOP,
    Q_CAPACITY,
    Q_COMMIT_STATE,
    Q_COMMITTED,
    Q_COMMITTED_BLOCKS,
    Q_HISTORY,
    Q_NUM_BLOCKS,
    Q_RESULT,
    Q_STATUS,
    SEQ_ADMIT,
    SEQ_APPEND,
    SEQ_CLOSE,
    SEQ_RESIZE,
    SEQ_RESUME,
    SEQ_SETUP_MATCHED,
    SEQ_SETUP_REUSE,
    SEQ_STOP,
    SEQ_SUSPEND,
    SUSPENDED,
)
from .core.scope import as_scope
from .kernels.sha256 import digest_to_int64x4
from .matching import BatchMatch
from .table_sizes import (
    COPY_SLACK,
    LOG_MIN_ROWS,
    copy_rows_for,
    copy_rows_per_block,
    log_rows_for,
    log_rows_per_block,
)
from .tokens import least, token_array, tokens_and_digests

_STATUS_NAMES = {SUSPENDED: "SUSPENDED", ACTIVE: "ACTIVE", CLOSED: "CLOSED"}


# -- a call's values: an int for one cache, an array for many ----------------------------------
# (``type(x) is _ARRAY`` is ``cache_pool.is_batch`` without the call: these
# run several times in every per-cache call)
_ARRAY = np.ndarray


def _any(bad) -> bool:
    return bool(bad.any()) if type(bad) is _ARRAY else bool(bad)


def _all(good) -> bool:
    return bool(good.all()) if type(good) is _ARRAY else bool(good)


def _first(bad) -> int:
    """The first entry where ``bad`` holds (0 for one cache)."""
    return int(np.argmax(bad)) if type(bad) is _ARRAY else 0


def _at(value, i: int):
    return value[i] if type(value) is _ARRAY else value


def _total(value) -> int:
    return int(value.sum()) if type(value) is _ARRAY else int(value)


def _max(a, b):
    return np.maximum(a, b) if type(a) is _ARRAY or type(b) is _ARRAY else max(a, b)


def _count(slots) -> int:
    return len(slots) if type(slots) is _ARRAY else 1


def _select(ok, columns: list):
    """``columns`` (one value each per entry) at the entries where ``ok``
    holds, and those entries' positions (None: all of them); ``(None, ...)``
    when none does."""
    if type(ok) is not _ARRAY:
        return (columns, None) if ok else (None, None)
    if ok.size and ok.all():  # the common case, without a list of positions
        return columns, None
    go = np.flatnonzero(ok)
    if not go.size:
        return None, go
    if go.size == len(ok):
        return columns, None
    return [c[go] if type(c) is _ARRAY else c for c in columns], go


def _flag(value, n: int, name: str, what: str):
    """A batched call's bool for all (kept a bool) or one per cache (an array)."""
    if type(value) is bool:
        return value
    return inputs.flags(value, n, name, what)


def _offsets(counts) -> np.ndarray:
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _int64s(value, n: int) -> np.ndarray:
    """A batched call's int (or bool) for all, or one per cache, as int64
    ``[n]``, contiguous (the compiled rules take that one type,
    ``call_room.compile_ahead``)."""
    if type(value) is _ARRAY:
        return np.ascontiguousarray(value, dtype=np.int64)
    return np.full(n, value, dtype=np.int64)


# -- how a call's errors read ------------------------------------------------------------------
class OneCache:
    """A per-cache call's errors: the call's own sentences."""

    __slots__ = ("call",)

    def __init__(self, call: str):
        self.call = call

    def require(self, got, status: int):
        if got != status:
            article = "an" if status == ACTIVE else "a"
            raise LogicError(f"{self.call} needs {article} {_STATUS_NAMES[status]} KV cache; "
                             f"this one is {_STATUS_NAMES[int(got)]}")

    def check(self, bad, error, text: str, *values):
        """Raise ``error(text with values)`` if ``bad`` holds."""
        if bad:
            raise error(text.format(*values))

    def where(self, i: int) -> str:
        return ""


class Entries:
    """A batched call's errors: each names the entry it is about, the
    per-cache sentence following (``commit_batch(): caches[2]: committing ...``)."""

    __slots__ = ("call",)

    def __init__(self, call: str):
        self.call = call

    def require(self, got, status: int):
        bad = got != status
        if _any(bad):
            i = _first(bad)
            raise LogicError(f"{self.call}: caches[{i}] is {_STATUS_NAMES[int(_at(got, i))]}; "
                             f"the call needs {_STATUS_NAMES[status]} KV caches")

    def check(self, bad, error, text: str, *values):
        """Raise ``error(text with the entry's values)`` for the first entry where ``bad`` holds."""
        if _any(bad):
            i = _first(bad)
            sentence = text.format(*(_at(v, i) for v in values))
            raise error(f"{self.call}: {self.where(i)}{sentence[:1].lower()}{sentence[1:]}")

    def where(self, i: int) -> str:
        return f"caches[{i}]: "


class Admissions(Entries):
    """``admit_batch``'s errors: each names the admission (its index in the
    call's capacities and entries)."""

    __slots__ = ()

    def where(self, i: int) -> str:
        return f"admission {i}: "


_RESUME = OneCache("resume()")
_SUSPEND = OneCache("suspend()")
_RESIZE = OneCache("resize()")
_COMMIT = OneCache("commit()")
_APPEND = OneCache("append()")


class CacheCalls:
    """The calls on the caches of one manager: ``*_one`` for ``KVCache``'s
    methods, the others for the manager's batched calls."""

    def __init__(self, ctx, stats):
        self.ctx = ctx
        self.config = ctx.config
        self.pool = ctx.pool
        self.tables = ctx.tables
        self.tree = ctx.tree
        self.matcher = ctx.matcher
        self.launcher = ctx.launcher
        self.open_caches = ctx.open_caches
        self.backend = ctx.tables.backend
        self.T = ctx.config.tokens_per_block
        self.L = len(ctx.config.life_cycles)
        self._stats = stats  # callable: the manager's current ReuseStats
        self._min_snapshot = bool(ctx.config.commit_min_snapshot)
        self._on_gpu = ctx.tables.backend.on_gpu

    def _scalars(self, slots, *columns) -> list:
        """The caches' scalars ``columns`` (``Q_*``): arrays for many caches,
        Python ints for one (one conversion of its row, then every rule is
        Python arithmetic, not NumPy's slower scalars)."""
        S = self.pool.host_scalars
        if type(slots) is _ARRAY:
            rows = S[slots]  # one gather, then a view per column
            return [rows[:, c] for c in columns]
        return list(map(S[slots].tolist().__getitem__, columns))  # one row: its Python ints

    # -- one cache: KVCache's methods (and create_kv_cache) ---------------------------------
    def create_one(self, input_tokens, scope, priority_callback, made: list) -> KVCache:
        scope = as_scope(scope)
        # Digests only looked up: a matched prefix holds interned ones only,
        # and a digest no block holds need not be kept.
        tokens = None if input_tokens is None else inputs.one_request(input_tokens, self.tables.lookup_digest,
                                                                      self.matcher.arena)
        return self._create(tokens, scope, [scope], [inputs.callback(priority_callback)], made)[0]

    def resume_one(self, slot: int) -> bool:
        _RESUME.require(self.pool.host_scalars[slot, Q_STATUS], SUSPENDED)
        return bool(self._resume(_RESUME, slot))

    def suspend_one(self, slot: int):
        status, nb = self._scalars(slot, Q_STATUS, Q_NUM_BLOCKS)
        _SUSPEND.require(status, ACTIVE)
        self._reserve_and_launch(_SUSPEND, slot, SEQ_SUSPEND, span=nb)

    def resize_one(self, slot: int, capacity, history_length) -> bool:
        status, cap, hist = self._scalars(slot, Q_STATUS, Q_CAPACITY, Q_HISTORY)
        _RESIZE.require(status, ACTIVE)
        cap = cap if capacity is None else inputs.non_negative_int("capacity", capacity)
        hist = hist if history_length is None else inputs.non_negative_int("history_length", history_length)
        return bool(self._resize(_RESIZE, slot, cap, hist))

    def commit_one(self, slot: int, tokens, is_end):
        q = self.pool.host_scalars[slot].tolist()  # the cache's scalars, Python ints (``_append_one``'s rules)
        _COMMIT.require(q[Q_STATUS], ACTIVE)
        if not isinstance(is_end, (bool, np.bool_)):
            raise TypeError(f"is_end must be a bool, got {is_end!r}")
        # Digests are only looked up until every check has passed, so a
        # rejected commit interns nothing.
        arr, digests = tokens_and_digests(tokens, self.tables.lookup_digest)
        interned = (lambda: token_array(tokens, self.tables.intern_digest)) if digests else None
        self._append_one(_COMMIT, slot, q, arr, len(arr), bool(is_end), 0, interned)

    def append_one(self, slot: int, tokens, room, is_end) -> bool:
        q = self.pool.host_scalars[slot].tolist()
        _APPEND.require(q[Q_STATUS], ACTIVE)
        room = inputs.non_negative_int("room", room)
        if not isinstance(is_end, (bool, np.bool_)):
            raise TypeError(f"is_end must be a bool, got {is_end!r}")
        arr, digests = tokens_and_digests(tokens, self.tables.lookup_digest)
        interned = (lambda: token_array(tokens, self.tables.intern_digest)) if digests else None
        return self._append_one(_APPEND, slot, q, arr, len(arr), bool(is_end), room, interned)

    def stop_one(self, slot: int):
        status, nb = self._scalars(slot, Q_STATUS, Q_NUM_BLOCKS)
        if status == CLOSED:
            raise LogicError("stop_committing() on a closed KV cache")
        self._reserve_and_launch(None, slot, SEQ_STOP, rows=STOP_ROWS, announced=stop_announced(nb), span=nb)

    def close_one(self, kv: KVCache, evict_first):
        if not isinstance(evict_first, bool):
            raise TypeError(f"evict_first must be a bool, got {evict_first!r}")
        slot = kv._slot
        if self.pool.host_scalars[slot, Q_STATUS] != CLOSED:  # closing twice is a no-op
            self._close(slot, int(evict_first), kv)

    # -- many caches: the manager's batched calls -------------------------------------------
    def create(self, requests, scopes, priority_callbacks, made: list) -> list:
        """New SUSPENDED caches, each holding what ``create_kv_cache`` would:
        one match launch for all, then one launch holding their reused pages
        (``made``: as ``_create`` takes it)."""
        what = "create_kv_caches()"
        tokens = inputs.token_batch(requests, self.tables.lookup_digest, self.matcher.arena, what)
        n = len(tokens)
        callbacks = inputs.callbacks(priority_callbacks, n, what)
        scope_list = inputs.scope_list(scopes, n, what)
        return self._create(tokens, as_scope(scopes) if inputs.one_scope(scopes) else scope_list, scope_list,
                            callbacks, made)

    def admit(self, match, capacities, entries, priority_callbacks, made: list, grow=None) -> tuple:
        """New caches for requests of ``match`` (``entries``: which, None: all),
        each set up on what the match found, then each resumed and resized to
        ``capacities[i]``, in one launch; with ``grow`` (``(caches,
        capacities)``) those ACTIVE caches are resized in the same launch,
        after the setups and before the admissions allocate. ``(grown, ok)``:
        a bool per grown cache (None without ``grow``) and per admission,
        False where pages were short. ``made`` as ``_create`` takes it."""
        what = "admit_batch()" if grow is None else "allocate_batch()"
        naming = Admissions(what)
        stamp = match.stamp if isinstance(match, BatchMatch) else None
        if stamp is None:
            raise TypeError(f"{what}: match must be what match_batch() returned, got {type(match).__name__}")
        if stamp.launcher is not self.launcher:
            raise ValueError(f"{what}: match was made by another manager")
        if stamp.removals != self.launcher.removals:
            raise StaleMatchError(
                f"{what}: blocks or pages left the tree since this match was made (a call in between evicted or "
                "removed them), so its rows may no longer hold what it found: match again"
            )
        B = len(match)
        if entries is None:
            idx = np.arange(B, dtype=np.int64)
        else:
            if not inputs.is_entry_list(entries):
                raise TypeError(f"{what}: entries must be None or a list of the match's request indices, "
                                f"got {type(entries).__name__}")
            idx = inputs.ints(entries, len(entries), "entries", what)
            naming.check(idx >= B, ValueError, "entries names request {} of a match of {}", idx, B)
        n = len(idx)
        cap = inputs.ints(capacities, n, "capacities" if grow is None else "admit_capacities", what)
        callbacks = inputs.callbacks(priority_callbacks, n, what)
        m = match if isinstance(match.num_tokens, np.ndarray) else match.to_host()
        matched = np.asarray(m.num_tokens, dtype=np.int64)[idx]
        offsets = np.asarray(m.block_offsets, dtype=np.int64)
        nblocks = offsets[idx + 1] - offsets[idx]
        naming.check(cap < matched, ValueError, "capacity {} is below the {} tokens it reuses", cap, matched)
        blocks = -(-cap // self.T)
        # Sizes no pool could ever give are refused before the launch: those
        # caches are only resumed (capacity -1), as a refused resize leaves them.
        sized = self._can_hold(nblocks, blocks, matched)
        rows = np.maximum(nblocks, blocks)
        growth = grown = None
        if grow is not None:
            growth, grown = self._plan_growth(grow, what)
        if not n and growth is None:
            return grown, np.zeros(0, dtype=bool)
        scope_list = inputs.scope_list(stamp.scopes, B, what)
        taken = []
        try:
            if growth is not None:  # asked first: a raising callback changes nothing
                g_naming, go_g, gs, gc, gh, g_have, g_blocks = growth
                g_asked = self._ask_priorities(g_naming, gs, g_blocks)
            slots = self._new_caches([scope_list[i] for i in idx.tolist()], with_room(rows), callbacks, made, taken) \
                if n else np.zeros(0, dtype=np.int64)
            asked = self._ask_priorities(naming, slots, rows) if n else []
            if growth is not None:
                reserved = self.pool.seg[gs, 1].copy()
                self.pool.reserve(gs, g_blocks)
                asked = g_asked + asked
            for slot, values in asked:  # every segment has room now
                self.pool.store_priorities(slot, values)
            # One launch, the setups first: every cache holds its prefix before
            # any allocates, so an eviction for one cannot take a block another's
            # match found (a launch split for the change log keeps that order).
            go = np.flatnonzero(nblocks > 0)
            k = self.pool.scratch_width
            none = np.zeros(go.size, dtype=np.int64)
            parts = [  # (slots, op, args, span, allocated, matched blocks)
                (slots[go], SEQ_SETUP_MATCHED, (matched[go], nblocks[go], none), nblocks[go], none, nblocks[go]),
            ]
            if growth is not None:
                zeros = np.zeros(len(gs), dtype=np.int64)
                # span: the old blocks (stale ones, a shrink) and the new
                parts.append((gs, SEQ_RESIZE, (gc, gh, zeros), np.maximum(g_have, g_blocks),
                              np.maximum(0, g_blocks - g_have) + k + 1, zeros))
            # allocated: a resume's (hit pages back, its copies) and a resize's
            parts.append((slots, SEQ_ADMIT, (matched, nblocks, np.where(sized, cap, -1)), rows, rows + k + 3,
                          np.zeros(n, dtype=np.int64)))
            column = lambda j: np.concatenate([p[j] for p in parts])  # noqa: E731 (one column of the launch's items)
            items = column(0)
            ops = np.concatenate([np.full(len(p[0]), p[1]) for p in parts])
            args = tuple(np.concatenate([p[2][c] for p in parts]) for c in range(3))
            self._reserve_and_launch(naming, items, ops, args, span=column(3), allocated=column(4),
                                     path=np.asarray(m.block_ids, dtype=np.int64)[ranges(offsets[idx[go]], nblocks[go])],
                                     path_off=_offsets(column(5)))
            if growth is not None:
                grown = self._resized(gs, reserved, go_g, len(grow[0]))
            ok = self.pool.host_scalars[slots, Q_RESULT] != 0
            refused = np.flatnonzero(~ok)
            if refused.size:  # a cache left SUSPENDED keeps no room it could not use
                self.pool.trim(slots[refused], nblocks[refused])
            self._record_lookups(np.asarray(m.num_lookup_tokens, dtype=np.int64)[idx], matched)
            return grown, ok
        except BaseException:
            self._undo_create(made, taken)
            raise

    def _plan_growth(self, grow, what: str) -> tuple:
        """``allocate_batch``'s resizes, checked as ``resize_batch`` checks
        them: ``(plan, grown)``, ``plan`` None when none goes ahead (then
        ``grown`` is their all-False result), else ``(naming, go, slots, cap,
        hist, have, blocks)`` (``_plan_resize``'s)."""
        if not (isinstance(grow, tuple) and len(grow) == 2):
            raise TypeError(f"{what}: grow must be a pair (caches, capacities)")
        caches, capacities = grow
        naming = Entries(what)
        slots = inputs.cache_slots(caches, self.pool, what)
        S = self.pool.host_scalars
        naming.require(S[slots, Q_STATUS], ACTIVE)
        cap = inputs.ints(capacities, len(slots), "capacities", what)
        planned = self._plan_resize(naming, slots, cap, S[slots, Q_HISTORY]) if len(slots) else None
        if planned is None:
            return None, np.zeros(len(slots), dtype=bool)
        return (naming, *planned), None

    def resume(self, caches) -> np.ndarray:
        naming = Entries("resume_batch()")
        slots = inputs.cache_slots(caches, self.pool, naming.call)
        naming.require(self.pool.host_scalars[slots, Q_STATUS], SUSPENDED)
        if len(slots) == 1:
            return np.array([self._resume(naming, int(slots[0]))])
        return self._resume(naming, slots) if len(slots) else np.zeros(0, dtype=bool)

    def resize(self, caches, capacities, history_lengths=None) -> np.ndarray:
        naming = Entries("resize_batch()")
        slots = inputs.cache_slots(caches, self.pool, naming.call)
        n = len(slots)
        S = self.pool.host_scalars
        naming.require(S[slots, Q_STATUS], ACTIVE)
        cap = inputs.ints(capacities, n, "capacities", naming.call)
        if history_lengths is None:
            hist = S[slots, Q_HISTORY]
        else:
            hist = inputs.ints(history_lengths, n, "history_lengths", naming.call)
        if not n:
            return np.zeros(0, dtype=bool)
        if n == 1:
            return np.array([self._resize(naming, int(slots[0]), int(cap[0]), int(hist[0]))])
        return self._resize(naming, slots, cap, hist)

    def commit(self, caches, tokens, is_end=False) -> None:
        naming = Entries("commit_batch()")
        slots = inputs.cache_slots(caches, self.pool, naming.call)
        n = len(slots)
        naming.require(self.pool.host_scalars[slots, Q_STATUS], ACTIVE)
        end = _flag(is_end, n, "is_end", naming.call)
        flat, offsets, interned = self._tokens(tokens, n, naming.call)
        if n == 1:
            s = int(slots[0])
            self._append_one(naming, s, self.pool.host_scalars[s].tolist(), flat, int(offsets[1]), bool(_at(end, 0)),
                             0, interned)
        elif n:
            self._append_many(naming, slots, flat, offsets, end, 0, interned)

    def append(self, caches, tokens, room, is_end=False) -> np.ndarray:
        naming = Entries("append_batch()")
        slots = inputs.cache_slots(caches, self.pool, naming.call)
        n = len(slots)
        naming.require(self.pool.host_scalars[slots, Q_STATUS], ACTIVE)
        # One value for all stays an int or a bool: one cache's path takes
        # it as it is, and many caches' plan makes its one int64 column of
        # it (``_int64s``).
        room = inputs.ints_or_one(room, n, "room", naming.call)
        end = _flag(is_end, n, "is_end", naming.call)
        flat, offsets, interned = self._tokens(tokens, n, naming.call)
        if n == 1:  # a prefill chunk's: the per-cache path
            s = int(slots[0])
            return np.array([self._append_one(naming, s, self.pool.host_scalars[s].tolist(), flat, int(offsets[1]),
                                              bool(_at(end, 0)), int(_at(room, 0)), interned)])
        if not n:
            return np.zeros(0, dtype=bool)
        return self._append_many(naming, slots, flat, offsets, end, room, interned)

    def close(self, caches, evict_first=False) -> None:
        naming = Entries("close_batch()")
        slots = inputs.cache_slots(caches, self.pool, naming.call)
        n = len(slots)
        first = inputs.flags(evict_first, n, "evict_first", naming.call).astype(np.int64)
        go = np.flatnonzero(self.pool.host_scalars[slots, Q_STATUS] != CLOSED)  # closing twice is a no-op
        if go.size == 1:
            self._close(int(slots[go[0]]), int(first[go[0]]), caches[int(go[0])])
        elif go.size:
            self._close(slots[go], first[go], caches if go.size == n else [caches[i] for i in go.tolist()])

    # -- the calls, over a slot or slots ----------------------------------------------------
    def _create(self, tokens, match_scopes, scope_list, callbacks, made: list) -> list:
        """Caches for ``callbacks`` (one per cache) in the scopes of
        ``scope_list``, holding what ``tokens`` (a ``TokenBatch``; None:
        nothing looked up) match; ``made``: an empty list the
        caches are appended to as they are made (and returned), so that a
        caller whose call fails after this returned can close them again."""
        n = len(callbacks)
        if not n:
            return []
        matched = nblocks = rows = np.zeros(n, dtype=np.int64)
        if tokens is not None:
            m = self.matcher.match(tokens, match_scopes).to_host()
            matched = np.asarray(m.num_tokens, dtype=np.int64)
            nblocks = np.diff(np.asarray(m.block_offsets, dtype=np.int64))
            # Segments with room for the whole input and the token after it,
            # not only the blocks it reuses (which reuse setup writes): the
            # caller goes on to commit the rest, chunk by chunk, and a
            # segment sized for it then never grows (each growth fills its
            # new rows, and one not at the pool's top moves).
            lengths = tokens.lengths()
            rows = with_room(np.maximum(nblocks, (lengths + self.T) // self.T))
        taken = []
        try:
            slots = self._new_caches(scope_list, rows, callbacks, made, taken)
            go = np.flatnonzero(matched > 0)
            if go.size:
                flat, offsets = tokens.arrays()
                flat = self.backend.to_host(flat)
            if go.size == 1:
                i = int(go[0])
                start = int(offsets[i])
                self._reserve_and_launch(
                    None, int(slots[i]), SEQ_SETUP_REUSE, (int(matched[i]), int(nblocks[i])), span=int(nblocks[i]),
                    tokens=flat[start:start + int(matched[i])],
                    path=np.asarray(m.block_ids, dtype=np.int64)[m.block_offsets[i]:m.block_offsets[i + 1]])
            elif go.size:
                flat = flat[ranges(offsets[:-1][go], matched[go])]
                path = np.asarray(m.block_ids, dtype=np.int64)[ranges(np.asarray(m.block_offsets)[go], nblocks[go])]
                self._reserve_and_launch(None, slots[go], SEQ_SETUP_REUSE, (matched[go], nblocks[go]), span=nblocks[go],
                                         tokens=flat, tokens_off=_offsets(matched[go]), path=path,
                                         path_off=_offsets(nblocks[go]))
            if tokens is not None:
                self._record_lookups(lengths, matched)
            return made
        except BaseException:
            self._undo_create(made, taken)
            raise

    def _new_caches(self, scope_list, blocks, callbacks, made: list, taken: list) -> np.ndarray:
        """Slots for new SUSPENDED caches in the scopes of ``scope_list``, with
        room for ``blocks`` blocks each: their KVCaches appended to ``made``
        (and open), the slots' record to ``taken`` (``CachePool.allocate``).
        From here to the creating call's return, an exception (an interrupt
        included) means the caller never gets these caches: ``_undo_create``."""
        n = len(callbacks)
        tree = self.tree
        sids = np.empty(n, dtype=np.int64)
        keys = np.empty(n, dtype=np.int64)
        digests = np.empty((n, 4), dtype=np.int64)
        known = {}
        for i, s in enumerate(scope_list):  # the distinct scopes, once each
            k = id(s)
            if k not in known:
                sid = tree.scope_id(s, create=True)
                known[k] = (sid, tree.scope_key(sid), digest_to_int64x4(tree.scope_digest(sid)))
            sids[i], keys[i], digests[i] = known[k]
        slots = self.pool.allocate(n, sids, keys, digests, blocks, callbacks, taken)
        for s in slots.tolist():
            made.append(KVCache(self.ctx, self, s))
        self.open_caches.update(made)
        return slots

    def _undo_create(self, made: list, taken: list) -> None:
        """A creating call failed after ``_new_caches``: its caches must not
        stay open, holding their reused pages and keeping shutdown() refused,
        nor their slots stay taken."""
        try:
            self.close(made)
        except BaseException:
            pass  # the first exception is the one to report
        self.pool.give_back(taken, made)

    def _record_lookups(self, looked_up: np.ndarray, reused: np.ndarray) -> None:
        """The reuse statistics of the lookups a creating call made."""
        stats = self._stats()
        has_ssm = self.config.ssm_life_cycle_id is not None
        for a, r in zip(looked_up.tolist(), reused.tolist()):
            stats.record(a, r, self.T, has_ssm)

    def _resume(self, naming, slots):
        (nb,) = self._scalars(slots, Q_NUM_BLOCKS)
        self._reserve_and_launch(naming, slots, SEQ_RESUME, priorities=nb, span=nb, allocated=nb + 2)
        return self.pool.host_scalars[slots, Q_RESULT] != 0

    def _resize(self, naming, slots, cap, hist):
        """``resize(cap, hist)`` of each cache: True where done, False where a
        page pool is short (that cache unchanged)."""
        planned = self._plan_resize(naming, slots, cap, hist)
        if planned is None:
            return False if type(slots) is not _ARRAY else np.zeros(len(slots), dtype=bool)
        go, s, c, h, have, blocks = planned
        k = self.pool.scratch_width
        reserved = self.pool.seg[s, 1].copy() if type(s) is _ARRAY else int(self.pool.seg[s, 1])
        self._reserve_and_launch(naming, s, SEQ_RESIZE, (c, h), segment=blocks, priorities=blocks,
                                 span=_max(have, blocks),  # the old blocks (stale ones, a shrink) and the new
                                 allocated=_max(0, blocks - have) + k + 1)
        return self._resized(s, reserved, go, len(slots) if type(slots) is _ARRAY else None)

    def _resized(self, s, reserved, go, n):
        """The results of a launch's resizes of ``s`` (``_plan_resize``'s
        picks; ``reserved``: their segments before it): a refused one keeps
        no segment it reserved. For ``n`` caches of which ``go`` went (None:
        one cache, or all)."""
        done = self.pool.host_scalars[s, Q_RESULT] != 0
        if not _all(done):
            self.pool.trim(s[~done] if type(s) is _ARRAY else s, reserved[~done] if type(s) is _ARRAY else reserved)
        if go is None:
            return done
        out = np.zeros(n, dtype=bool)
        out[go] = done
        return out

    def _plan_resize(self, naming, slots, cap, hist):
        """The checks of ``resize(cap, hist)`` for each cache (raising for bad
        input), and those the host refuses before anything is allocated:
        ``(go, slots, cap, hist, have, blocks)`` of the rest (``go``: their
        positions, None: all), or None when none is left."""
        old_cap, old_hist, have = self._scalars(slots, Q_CAPACITY, Q_HISTORY, Q_NUM_BLOCKS)
        if _any((hist < old_hist) | (cap < hist)):  # one test; the first rule broken is named
            naming.check(hist < old_hist, ValueError, "history_length cannot decrease ({} < {})", hist, old_hist)
            naming.check(cap < hist, ValueError, "capacity {} is below history_length {}", cap, hist)
        scratch = self.config.swa_scratch_reuse
        if scratch is not None:
            naming.check((cap != old_cap) & ((hist < old_cap - scratch.max_rewind_len) | (hist > old_cap)), ValueError,
                         "with swa_scratch_reuse a capacity change needs capacity - max_rewind_len <= history_length "
                         "<= capacity (the old capacity {}), got history_length {}", old_cap, hist)
            shrink = cap < old_cap
            if _any(shrink):  # the scratch counts live on the device: read only when needed
                held = self.pool.rows(self.pool.arrays.scratch_count, slots).any(axis=-1)
                naming.check(shrink & held, ValueError,
                             "cannot shrink the capacity while scratch slots are held (suspend first)")
        blocks = -(-cap // self.T)
        # Refused before anything is allocated for the new blocks: more than a
        # whole pool, or more blocks than all the pools have pages.
        ok = self._can_hold(have, blocks, hist)
        picked, go = _select(ok, [slots, cap, hist, have, blocks])
        if picked is None:
            return None
        return (go, *picked)

    def _can_hold(self, have, blocks, history):
        """``call_room.can_hold`` for each cache (arrays) or the one (ints):
        False where the pools could never give ``blocks`` blocks to a cache
        holding ``have`` at ``history``."""
        pool = self.pool
        if type(blocks) is not _ARRAY:
            return can_hold(pool.hold_rules, self.T, have, blocks, history, pool.max_blocks)
        n = len(blocks)
        out = np.empty(n, dtype=bool)
        can_hold_each(pool.hold_table, self.T, _int64s(have, n), _int64s(blocks, n), _int64s(history, n),
                      pool.max_blocks, out)
        return out

    def _append_one(self, naming, slot: int, q: list, flat, count: int, end: bool, room: int, interned) -> bool:
        """``append`` of the ``count`` tokens ``flat`` to the cache in
        ``slot`` (``q``: its scalars, as a list of ints), ``end`` its
        ``is_end``: the commit, then, unless it ends, a resize to whole
        blocks past ``room`` more tokens where the capacity is short, the
        history as the commit leaves it; in one launch (a commit is an append
        of room 0). True where the room is there, False where a pool was
        short for it: the commit stays and the capacity is as it was, as
        ``commit`` then ``resize`` one by one leave them. ``interned()``:
        ``flat`` again with its digests interned (None: it holds none). The
        checks and the room are ``call_room.append_rules``, on the cache's
        ints.

        The launch takes a flat way when it needs nothing made ready (a
        prefill's chunk and a decode step, off the GPU, mostly do): no
        digests to intern, no aftermath pending, the segment and the known
        priorities reach the blocks, and the free block rows are there. Then
        of ``_reserve_and_launch``'s steps only the change log's room is left
        (``Tables.ensure_log``), and the launch is
        ``CachePool.launch_commit_one``'s. Else the general way. Each step of
        the general way that the flat one leaves out would have had nothing
        to do, so both change the same tables."""
        pool = self.pool
        launcher = self.launcher
        error, run, done, resizing, blocks, grows, rows, announced, span, allocated, room, n0 = append_rules(
            q[Q_COMMITTED], q[Q_COMMIT_STATE], q[Q_CAPACITY], q[Q_HISTORY], q[Q_COMMITTED_BLOCKS], q[Q_NUM_BLOCKS],
            int(pool.attached_at[slot]), count, end, room, launcher.held_detaches, self.T, self.L,
            self._min_snapshot, pool.hold_rules, pool.max_blocks, pool.scratch_width)
        if error:
            self._refuse_commit(naming, slot, error, count)
        if not run:
            return done
        seg = pool.seg
        if (interned is None and not launcher.pending and not self._on_gpu
                and (not resizing or blocks <= seg[slot, 1] and blocks <= pool.priorities_known[slot])
                and (not rows or self.tables.counters[CNT_BLOCK_FREE_TOP] >= rows)):
            before = launcher.held_detaches
            self.tables.ensure_log(log_blocks(span, pool.scratch_width, allocated), announced, settled=True)
            pool.launch_commit_one(launcher, slot, SEQ_APPEND, (n0, count, end, room), flat)
            # No segment rows were reserved: a refused room has none to trim.
            ok = pool.host_scalars[slot, Q_RESULT] != 0
            if grows and self._seen_whole(before) >= 0:
                pool.attached_at[slot] = before
            return bool(done and ok)
        if interned is not None:
            flat = interned()
        reserved = int(seg[slot, 1])
        before = self._detaches()
        blocks = blocks if resizing else None  # else it holds its blocks already: no segment rows or priorities
        self._reserve_and_launch(naming, slot, SEQ_APPEND, (n0, count, end, room), segment=blocks, priorities=blocks,
                                 rows=rows, announced=announced, span=span, allocated=allocated, tokens=flat)
        ok = pool.host_scalars[slot, Q_RESULT] != 0
        if grows and self._seen_whole(before) >= 0:
            pool.attached_at[slot] = before
        if not ok:  # a refused room keeps no segment rows it reserved
            pool.trim(slot, reserved)
        return bool(done and ok)

    def _append_many(self, naming, slots, flat, offsets, end, room, interned) -> np.ndarray:
        """``_append_one`` for each cache of ``slots`` (in order), its tokens
        ``flat[offsets[i]:offsets[i + 1]]``, ``end`` and ``room`` one for all
        or one per cache: the rules compiled over the caches' scalars, which
        also write the launch's work list and add up its room
        (``call_room.plan_appends``)."""
        pool = self.pool
        n = len(slots)
        plan = np.empty((n, PLAN_WIDTH), dtype=np.int64)
        work = np.zeros((n + 1, BATCH_WIDTH), dtype=np.int64)
        totals = np.empty(TOTALS_WIDTH, dtype=np.int64)
        plan_appends(pool.host_scalars, pool.attached_at, pool.seg, pool.priorities_known, slots, offsets,
                     _int64s(end, n), _int64s(room, n), self.launcher.held_detaches, self.T, self.L, self._min_snapshot,
                     pool.hold_table, pool.max_blocks, pool.scratch_width, plan, work, totals)
        calls, rows, blocks, announced, errors, resizing, short, unknown = totals.tolist()
        if errors:
            self._refuse_commit(naming, slots, plan[:, PLAN_ERROR], offsets[1:] - offsets[:-1])
        if not calls:
            return plan[:, PLAN_DONE] != 0
        if interned is not None:
            flat = interned()
        go = None if calls == n else np.flatnonzero(plan[:, PLAN_RUN])
        s, p, work = (slots, plan, work) if go is None else (slots[go], plan[go], work[:calls + 1])
        reserved = pool.seg[s, 1]  # a copy
        grow = p[:, PLAN_BLOCKS]
        before = self._detaches()
        self._reserve_and_launch(naming, s, SEQ_APPEND, tuple(work[:-1, BATCH_ARGS:BATCH_ARGS + 4].T),
                                 segment=grow if short else None, priorities=grow if unknown else None, rows=rows,
                                 announced=p[:, PLAN_ANNOUNCED], span=p[:, PLAN_SPAN], allocated=p[:, PLAN_ALLOCATED],
                                 tokens=flat, tokens_off=work[:, BATCH_TOKENS], work=work, totals=(blocks, announced))
        done = np.empty(calls, dtype=bool)
        if appended(pool.host_scalars, s, p, pool.attached_at, self._seen_whole(before), done):
            ok = pool.host_scalars[s, Q_RESULT] != 0  # a refused room keeps no segment rows it reserved
            pool.trim(s[~ok], reserved[~ok])
        if go is None:
            return done
        out = plan[:, PLAN_DONE] != 0
        out[go] = done
        return out

    def _refuse_commit(self, naming, slots, error, count):
        """Raise for the first rule ``error`` (``append_rules``' codes, one
        per cache) says is broken, naming the first cache that breaks it."""
        n0, cap, h = self._scalars(slots, Q_COMMITTED, Q_CAPACITY, Q_HISTORY)
        n1 = n0 + count
        naming.check(error == COMMIT_STOPPED, LogicError, "Cannot commit tokens after stop_committing()")
        naming.check(error == COMMIT_PAST_CAPACITY, ValueError,
                     "committing {} tokens would pass the capacity ({} > {})", count, n1, cap)
        naming.check(error == COMMIT_NOT_AT_SNAPSHOT, ValueError,
                     "commit_min_snapshot: history_length ({}) must equal the committed length before ({}) or after "
                     "({}) the commit of {} tokens", h, n0, n1, count)
        raise AssertionError(f"unknown commit error {error!r}")

    def _detaches(self):
        """The tree's count of detached blocks that caches refer to, before a
        launch (None: not known, an earlier launch's aftermath is unfinished)."""
        return None if self.launcher.pending else self.launcher.held_detaches

    def _seen_whole(self, before) -> int:
        """After a commit's launch: the count at which the chains of the
        caches whose commit added to the tree are whole in it, as the commit
        re-attached them (``CachePool.attached_at``); -1 where a block some
        cache refers to was detached in the launch (``before``: the count
        before it), perhaps after that cache's commit, or it is not known."""
        if before is None or self.launcher.pending or self.launcher.held_detaches != before:
            return -1
        return before

    def _close(self, slots, evict_first, caches):
        """``close(evict_first)`` of caches not closed yet (``caches``: the
        KVCache of each slot, which leaves the open set)."""
        (nb,) = self._scalars(slots, Q_NUM_BLOCKS)
        self._reserve_and_launch(None, slots, SEQ_CLOSE, (evict_first,), rows=STOP_ROWS * _count(slots),
                                 announced=stop_announced(nb), span=nb, closing=caches)

    # -- the launch ---------------------------------------------------------------------------
    def _reserve_and_launch(self, naming, slots, op, args=(), *, segment=None, priorities=None, rows=0, announced=0,
                            span=0, allocated=0, tokens=None, tokens_off=None, path=None, path_off=None, closing=None,
                            work=None, totals=None):
        """One launch of ``op`` (or ``op[i]``) on ``slots`` with kernel
        arguments ``args``, after making room for it, the one place that does:

        ``segment``: block rows each cache's segment needs; ``priorities``:
        the ordinals each may create pages for (its callback is asked first of
        all, so a raising callback or a bad value changes nothing); ``rows``:
        free block rows the tree may take, in all; and for each cache (an int
        for one, an int or an array for many) ``announced``: change-log token
        rows (blocks announced); ``span``: the blocks of its own the call may
        touch, and ``allocated``: the GPU pages it may allocate per life cycle
        (each may evict a victim), which with its scratch size the change log
        (not the caches' whole segments: a decode step touches a block or two
        of each, and sizing the log for every segment made it grow with the
        batch's total length). ``tokens`` / ``path``: the kernel's input
        (``CachePool.launch_calls``); ``closing``: the caches that close, leaving
        the open set. ``work``: the launch's work list when the caller made it
        (``call_room.plan_appends``), and ``totals``: ``(blocks, announced)``
        added up over the caches, when it did (the change log's blocks as
        ``call_room.log_blocks`` counts them).

        A batch whose change log would not fit the budget
        (``table_sizes.CHANGE_LOG_BUDGET``; only while someone reads the
        records, ``Tables.read_log_records``), or whose page copies would not
        fit the copy list, runs as consecutive launches over consecutive
        caches, each within it: the kernel runs the calls in
        order, so the tables, the events and the results are those of one
        launch. A single cache beyond the budget gets its own launch, with a
        log sized for it."""
        pool = self.pool
        asked = () if priorities is None else self._ask_priorities(naming, slots, priorities)
        if segment is not None:
            pool.reserve(slots, segment)
        for slot, values in asked:
            pool.store_priorities(slot, values)
        tables = self.tables
        if rows:
            tables.ensure_free_blocks(rows)
        blocks = None  # per cache, when needed
        n = _count(slots)
        if totals is None:
            blocks = log_blocks(span, pool.scratch_width, allocated)
            total = _total(blocks) if type(blocks) is _ARRAY else blocks * n
            total_announced = _total(announced) if type(announced) is _ARRAY else announced * n
        else:
            total, total_announced = totals
        if n > 1:
            # None: no limit (an unread log takes no records; the copy list holds any launch's copies).
            log_rows, token_rows = tables.log_budget if tables.log_read else (None, None)
            copy_rows = tables.copy_room
            if ((log_rows is not None and (total_announced > token_rows
                                           or log_rows_for(total, total_announced, self.L) > log_rows))
                    or (copy_rows is not None and copy_rows_for(total, self.L) > copy_rows)):
                if blocks is None:
                    blocks = log_blocks(span, pool.scratch_width, allocated)
                blocks, announced = np.broadcast_to(blocks, slots.shape), np.broadcast_to(announced, slots.shape)
                ends = self._split_points(blocks, announced, log_rows, token_rows, copy_rows)
                for i, j in zip(ends[:-1].tolist(), ends[1:].tolist()):
                    part = lambda v: v[i:j] if type(v) is _ARRAY else v  # noqa: E731 (one column of the launch's caches)
                    t_part = t_off = p_part = p_off = None
                    if tokens is not None:
                        t_part, t_off = tokens[tokens_off[i]:tokens_off[j]], tokens_off[i:j + 1] - tokens_off[i]
                    if path is not None:
                        p_part, p_off = path[path_off[i]:path_off[j]], path_off[i:j + 1] - path_off[i]
                    self._launch_part(slots[i:j], part(op), tuple(map(part, args)), _total(part(blocks)),
                                      _total(part(announced)), t_part, t_off, p_part, p_off,
                                      None if closing is None else closing[i:j])
                return
        self._launch_part(slots, op, args, total, total_announced, tokens, tokens_off, path, path_off, closing, work)

    def _split_points(self, blocks, announced, log_rows, token_rows, copy_rows) -> np.ndarray:
        """Where consecutive launches over the caches start (and the last
        ends): as many caches each as fit ``log_rows`` change-log rows,
        ``token_rows`` token rows and ``copy_rows`` page copies (None: any
        number), at least one (``log_rows_for`` and ``copy_rows_for`` per
        cache, their constants once per launch)."""
        per_block = log_rows_per_block(self.L)
        per_copy = copy_rows_per_block(self.L)
        limits = []  # (cumulative cost per cache, room per launch)
        if log_rows is not None:
            limits.append((_offsets(per_block * blocks + (self.L + 1) * announced),
                           log_rows - (per_block * 2 + LOG_MIN_ROWS)))
            limits.append((_offsets(announced), token_rows))
        if copy_rows is not None:
            limits.append((_offsets(per_copy * blocks), copy_rows - (per_copy * 2 + COPY_SLACK)))
        n = len(blocks)
        ends = [0]
        while ends[-1] < n:
            i = ends[-1]
            j = min(int(np.searchsorted(cost, cost[i] + room, "right")) for cost, room in limits) - 1
            ends.append(min(n, max(j, i + 1)))
        return np.array(ends)

    def _launch_part(self, slots, op, args, blocks: int, announced: int, tokens, tokens_off, path, path_off, closing,
                     work=None):
        """One launch: the change log's room (``blocks`` in all, ``announced``
        blocks), the kernel arguments (``work``: their work list, made
        already), the kernel, the caches' scalars back."""
        pool = self.pool
        tables = self.tables
        tables.ensure_log(blocks, announced, settled=not self.launcher.pending)
        open_caches = self.open_caches

        def results():  # idempotent: run again when the aftermath is resumed
            pool.refresh(slots)
            if closing is not None:
                # Only the caches the kernel closed: a launch cut short before
                # its kernel ran (an interrupt) leaves them open.
                closed = np.atleast_1d(pool.host_scalars[slots, Q_STATUS] == CLOSED).tolist()
                caches = closing if is_batch(slots) else (closing,)
                open_caches.difference_update([kv for kv, c in zip(caches, closed) if c])
                pool.forget_callbacks(slots)

        # Off the GPU the host reads the scalars in place: unless caches close
        # there is nothing to do after the kernel.
        needed = closing is not None or pool.scalars_on_device
        pool.launch_calls(self.launcher, slots, op, args, tokens, tokens_off, path, path_off,
                          results=results if needed else None, work=work)

    def _ask_priorities(self, naming, slots, blocks) -> list:
        """``[(slot, rows)]``: the callbacks' page priorities for the ordinals
        from those known up to ``blocks``, checked, written nowhere yet."""
        pool = self.pool
        want = blocks > pool.priorities_known[slots]
        if not _any(want):  # only caches with a callback are ever short
            return []
        picked = np.flatnonzero(want).tolist() if is_batch(want) else [0]
        asked = []
        for i in picked:
            s = int(_at(slots, i))
            rows = self._priorities(pool.callbacks[s], int(pool.priorities_known[s]), int(_at(blocks, i)),
                                    naming.where(i))
            asked.append((s, rows))
        return asked

    def _priorities(self, callback, known: int, blocks: int, where: str) -> np.ndarray:
        """``callback``'s priorities for ordinals ``known..blocks - 1``, int64
        ``[n, max(L, 1)]``; ``where`` starts the error messages."""
        L = self.L
        rows = np.full((blocks - known, max(L, 1)), DEFAULT_PRIORITY, dtype=np.int64)
        for i, o in enumerate(range(known, blocks)):  # the callback is per (ordinal, life cycle) by contract
            for lc in range(L):
                try:
                    v = callback(o, lc)
                except BusyError:
                    raise  # the callback called back into the manager: say so, unwrapped
                except Exception as e:
                    raise ValueError(f"{where}priority_callback({o}, {lc}) raised {type(e).__name__}: {e}") from e
                rows[i, lc] = check_priority(v, f"{where}priority_callback({o}, {lc})")
        return rows

    # -- a batched call's tokens -------------------------------------------------------------
    def _tokens(self, tokens, n: int, what: str):
        """``(flat int32 tokens, int64 offsets of n + 1, interned)``, digests
        only looked up; ``interned()``: the flat tokens converted anew with
        digests interned (None: they hold none)."""
        arena = self.matcher.arena
        batch = inputs.token_batch(tokens, self.tables.lookup_digest, arena, what, name="tokens", n=n)
        flat, offsets = batch.arrays()
        if not (batch.converted and _holds_digests(flat)):
            return flat, offsets, None
        return flat, offsets, lambda: inputs.token_batch(tokens, self.tables.intern_digest, arena, what,
                                                         name="tokens", n=n).flat


def _holds_digests(tokens: np.ndarray) -> bool:
    """Whether converted tokens hold digests (negative ids, interned or looked up)."""
    return bool(tokens.size) and least(tokens) < 0

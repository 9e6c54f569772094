"""The engine step's batched calls: many caches, one launch.

A serving engine touches every running cache each step (a resize for the
step's tokens, a commit of what was computed, a close of what finished).
``BatchCalls`` does each of these for a whole list of caches as one launch
of the sequence kernel over the manager's ``CachePool``: every check is an
array operation over the batch, the kernel's input goes over in one piece
per call, and the caches' scalars come back in one transfer. A resize or a
commit of a single cache (a scheduler admitting one request at a time) is
the per-cache call itself, which checks one cache faster than arrays do.

The result of a batched call equals issuing the per-cache calls one by one in
the order given: the kernel runs the same per-cache code on each cache in
turn. Input that is wrong for any entry (a cache twice, a closed or foreign
cache, lengths that disagree, a bad token) is refused with an error naming
the entry, before anything changes.

It is longer than most modules because it is one public surface, the
batched half of ``KVCache``'s calls: each call is its checks over the batch
and one launch, and the checks are what the per-cache methods check, per
entry.
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np

from .arena import TokenSequence
from .core.layout import (
    ACTIVE,
    CLOSED,
    Q_CAPACITY,
    Q_COMMIT_STATE,
    Q_COMMITTED,
    Q_COMMITTED_BLOCKS,
    Q_HISTORY,
    Q_NUM_BLOCKS,
    Q_RESULT,
    Q_STATUS,
    SUSPENDED,
    USER_STOP,
)
from .core.scope import as_scope
from .kernels.seq import SEQ_CLOSE, SEQ_COMMIT, SEQ_RESIZE, SEQ_RESUME, SEQ_SETUP_REUSE, SEQ_STOP
from .kernels.sha256 import digest_to_int64x4
from .launcher import BusyError, LogicError
from .cache_pool import pools_can_hold, ranges
from .tokens import ValidTokens, check_flat, flatten, token_array

_slot_of = attrgetter("_slot")
_serial_of = attrgetter("_serial")
_STATUS_NAMES = {SUSPENDED: "SUSPENDED", ACTIVE: "ACTIVE", CLOSED: "CLOSED"}


class BatchCalls:
    """The batched calls of one manager (``KVCacheManager`` delegates here)."""

    def __init__(self, ctx, stats):
        self.ctx = ctx
        self.config = ctx.config
        self.pool = ctx.pool
        self.tables = ctx.tables
        self.launcher = ctx.launcher
        self.backend = ctx.tables.backend
        self.T = ctx.config.tokens_per_block
        self.L = len(ctx.config.life_cycles)
        self._stats = stats  # callable: the manager's current ReuseStats

    # -- checks -----------------------------------------------------------------------
    def slots(self, caches, what: str) -> np.ndarray:
        """The pool slots of ``caches``: a list of this manager's caches, each once."""
        if isinstance(caches, (str, bytes)) or not hasattr(caches, "__len__"):
            raise TypeError(f"{what}: caches must be a list of KVCache")
        n = len(caches)
        pool = self.pool
        if n == 1:  # admission chunks: one cache per call, checked without arrays
            s, serial = getattr(caches[0], "_slot", None), getattr(caches[0], "_serial", None)
            if type(s) is int and 0 <= s < pool.serial.shape[0] and pool.serial[s] == serial:
                return np.array([s], dtype=np.int64)
        try:
            slots = np.fromiter(map(_slot_of, caches), dtype=np.int64, count=n)
            serials = np.fromiter(map(_serial_of, caches), dtype=np.int64, count=n)
        except (AttributeError, TypeError):
            from .cache import KVCache

            i = next(i for i, kv in enumerate(caches) if not isinstance(kv, KVCache))
            raise TypeError(f"{what}: caches[{i}] is not a KVCache, got {type(caches[i]).__name__}") from None
        ours = (slots >= 0) & (slots < pool.serial.shape[0])
        ours[ours] = pool.serial[slots[ours]] == serials[ours]
        if not ours.all():
            i = int(np.argmin(ours))
            raise ValueError(f"{what}: caches[{i}] belongs to another manager")
        if n > 1:
            order = np.argsort(slots, kind="stable")
            twice = slots[order[1:]] == slots[order[:-1]]
            if twice.any():
                k = int(np.argmax(twice))
                first, again = sorted((int(order[k]), int(order[k + 1])))
                raise ValueError(f"{what}: caches[{again}] is caches[{first}] again; list each cache once")
        return slots

    def require(self, slots, status: int, what: str):
        got = self.pool.host_scalars[slots, Q_STATUS]
        bad = got != status
        if bad.any():
            i = int(np.argmax(bad))
            raise LogicError(
                f"{what}: caches[{i}] is {_STATUS_NAMES[int(got[i])]}; the call needs {_STATUS_NAMES[status]} KV caches"
            )

    @staticmethod
    def ints(values, n: int, name: str, what: str) -> np.ndarray:
        """One non-negative int per cache."""
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
            raise TypeError(f"{what}: {name} must be one non-negative int per cache")
        if len(values) != n:
            raise ValueError(f"{what}: {name} has {len(values)} entries for {n} caches")
        a = np.asarray(values)
        if n and (a.ndim != 1 or a.dtype.kind not in "iu"):
            for i, v in enumerate(values):
                if not isinstance(v, (int, np.integer)) or isinstance(v, (bool, np.bool_)):
                    raise TypeError(f"{what}: {name}[{i}] must be a non-negative int, got {v!r}")
            raise TypeError(f"{what}: {name} must be one non-negative int per cache")
        a = a.astype(np.int64, copy=False).reshape(n)
        if n and int(a.min()) < 0:
            i = int(np.argmax(a < 0))
            raise ValueError(f"{what}: {name}[{i}] must be a non-negative int, got {int(a[i])}")
        return a

    @staticmethod
    def flags(values, n: int, name: str, what: str) -> np.ndarray:
        """A bool for all, or one per cache."""
        if isinstance(values, (bool, np.bool_)):
            return np.full(n, bool(values))
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
            raise TypeError(f"{what}: {name} must be a bool or one bool per cache, got {values!r}")
        if len(values) != n:
            raise ValueError(f"{what}: {name} has {len(values)} entries for {n} caches")
        a = np.asarray(values)
        if n and a.dtype != np.bool_:
            i = next((i for i, v in enumerate(values) if not isinstance(v, (bool, np.bool_))), 0)
            raise TypeError(f"{what}: {name}[{i}] must be a bool, got {values[i]!r}")
        return a.reshape(n)

    # -- shared steps -------------------------------------------------------------------
    def fill_priorities(self, caches, slots, blocks):
        """Page priorities from the caches' callbacks for the ordinals the call
        may create pages for, all asked before any is written (so a raising
        callback or a bad value changes nothing)."""
        want = blocks > self.pool.priorities_known[slots]
        if not want.any():
            return
        # Only caches with a callback are ever short.
        asked = [(caches[i], caches[i]._asked_priorities(int(blocks[i]), f"caches[{i}]: "))
                 for i in np.flatnonzero(want).tolist()]
        for kv, rows in asked:
            kv._store_priorities(rows)

    def set_args(self, slots, *columns):
        """The kernel arguments of each slot (columns of per-cache values; the rest 0)."""
        a = np.zeros((len(slots), self.pool.arrays.args.shape[1]), dtype=np.int64)
        for c, v in enumerate(columns):
            a[:, c] = v
        b = self.backend
        self.pool.arrays.args[b.to_device(slots)] = b.to_device(a)

    def launch(self, slots, ops, span: int, *, need=0, tokens=None, tokens_off=None, path=None, path_off=None,
               closing=None):
        """One launch over ``slots``; the change log gets room for ``span``
        (the blocks of theirs the calls may touch, in all), ``need`` (GPU
        pages all of them may allocate per life cycle, each of which may
        evict a victim) and each cache's scratch. Not the caches' whole
        segments: a decode step over a large batch touches a block or two of
        each, and sizing the log for every segment made it grow with the
        batch's total length."""
        pool = self.pool
        k = pool.scratch_width
        self.tables.ensure_log(int(span) + len(slots) * (k + 8) + need)
        open_caches = self.ctx.open_caches

        def results():
            pool.refresh(slots)
            if closing is not None:
                open_caches.difference_update(closing)

        pool.launch(self.launcher, slots, ops, tokens, tokens_off, path, path_off, results=results)

    # -- calls --------------------------------------------------------------------------
    def resize(self, caches, capacities, history_lengths=None) -> np.ndarray:
        what = "resize_batch()"
        slots = self.slots(caches, what)
        n = len(slots)
        if n == 1 and _one_each(capacities, history_lengths):  # an admission chunk: the per-cache call
            h = None if history_lengths is None else history_lengths[0]
            return np.array([_as_entry(what, lambda: _per_cache(caches[0].resize)(caches[0], capacities[0], h))])
        self.require(slots, ACTIVE, what)
        S = self.pool.host_scalars
        old_cap, old_hist = S[slots, Q_CAPACITY], S[slots, Q_HISTORY]
        cap = self.ints(capacities, n, "capacities", what)
        hist = old_hist.copy() if history_lengths is None else self.ints(history_lengths, n, "history_lengths", what)
        _first(hist < old_hist, lambda i: ValueError(
            f"{what}: caches[{i}]: history_length cannot decrease ({hist[i]} < {old_hist[i]})"))
        _first(cap < hist, lambda i: ValueError(f"{what}: caches[{i}]: capacity {cap[i]} is below history_length {hist[i]}"))
        scratch = self.config.swa_scratch_reuse
        if scratch is not None:
            change = cap != old_cap
            _first(change & ~((old_cap - scratch.max_rewind_len <= hist) & (hist <= old_cap)), lambda i: ValueError(
                f"{what}: caches[{i}]: with swa_scratch_reuse a capacity change needs capacity - max_rewind_len <= "
                f"history_length <= capacity (the old capacity {old_cap[i]}), got history_length {hist[i]}"))
            held = self.backend.to_host(self.pool.arrays.scratch_count[self.backend.to_device(slots)]).any(axis=1)
            _first((cap < old_cap) & held, lambda i: ValueError(
                f"{what}: caches[{i}]: cannot shrink the capacity while scratch slots are held (suspend first)"))
        blocks = -(-cap // self.T)
        have = S[slots, Q_NUM_BLOCKS]
        ok = np.broadcast_to(pools_can_hold(self.pool.hold_rules, self.T, have, blocks, hist), (n,))
        out = np.zeros(n, dtype=bool)
        go = np.flatnonzero(ok)
        if not go.size:
            return out
        slots_go = slots[go]
        picked = caches if go.size == n else [caches[i] for i in go.tolist()]
        self.pool.reserve(slots_go, blocks[go])
        self.fill_priorities(picked, slots_go, blocks[go])
        self.set_args(slots_go, cap[go], hist[go])
        new = np.maximum(0, blocks[go] - have[go])
        need = int(new.sum()) + go.size * (self.pool.scratch_width + 1)
        span = np.maximum(have[go], blocks[go]).sum()  # the old blocks (stale ones, a shrink) and the new
        self.launch(slots_go, np.full(go.size, SEQ_RESIZE, dtype=np.int64), span, need=need)
        out[go] = S[slots_go, Q_RESULT] != 0
        return out

    def commit(self, caches, tokens, is_end=False) -> None:
        what = "commit_batch()"
        slots = self.slots(caches, what)
        n = len(slots)
        if n == 1 and type(tokens) is list and len(tokens) == 1 and isinstance(is_end, (bool, np.bool_)):
            kv = caches[0]  # an admission chunk: the per-cache call
            _as_entry(what, lambda: _per_cache(kv.commit)(kv, tokens[0], bool(is_end)))
            return
        self.require(slots, ACTIVE, what)
        end = self.flags(is_end, n, "is_end", what)
        flat, offsets, digests = self._tokens(tokens, n, what)
        count = offsets[1:] - offsets[:-1]
        S = self.pool.host_scalars
        n0 = S[slots, Q_COMMITTED]
        n1 = n0 + count
        some = count > 0
        _first(some & (S[slots, Q_COMMIT_STATE] == USER_STOP), lambda i: LogicError(
            f"{what}: caches[{i}]: cannot commit tokens after stop_committing()"))
        cap = S[slots, Q_CAPACITY]
        _first(some & (n1 > cap), lambda i: ValueError(
            f"{what}: caches[{i}]: committing {count[i]} tokens would pass the capacity ({n1[i]} > {cap[i]})"))
        if self.config.commit_min_snapshot:
            h = S[slots, Q_HISTORY]
            _first(some & (h != n0) & (h != n1), lambda i: ValueError(
                f"{what}: caches[{i}]: commit_min_snapshot: history_length ({h[i]}) must equal the committed length "
                f"before ({n0[i]}) or after ({n1[i]}) the commit of {count[i]} tokens"))
        if digests is not None:
            flat, offsets, _ = self._tokens(digests, n, what, intern=True)
        run = some | end
        if not run.any():
            return
        go = np.flatnonzero(run)
        slots_go = slots[go]
        ops = np.where(some[go], SEQ_COMMIT, SEQ_STOP).astype(np.int64)
        self.set_args(slots_go, n0[go], count[go], end[go].astype(np.int64))
        blocks = np.where(some[go], -(-n1[go] // self.T), S[slots_go, Q_NUM_BLOCKS])
        L = self.L
        commits = int(some.sum())
        # Only a commit that completes a block, snapshots a partial one or
        # ends the sequence adds to the tree; for those, as the per-cache
        # calls: a commit's new blocks and a re-attached chain (the whole
        # committed chain, in case it was detached meanwhile), announcements
        # per life cycle; a stop's pending tail. Most decode commits complete
        # no block and need nothing: counting their chains too made the
        # first decode step of a large batch double the block table and
        # grow the change log's tokens forty-fold.
        T = self.T
        grows = (n1[go] // T > S[slots_go, Q_COMMITTED_BLOCKS]) | end[go]
        if self.config.commit_min_snapshot:
            grows |= n1[go] % T != 0
        k = int(grows.sum())
        self.tables.ensure_free_blocks(int(blocks[grows].sum()) + 2 * k)
        self.tables.ensure_log_tokens(int(np.where(some[go], (L + 2) * blocks, 2 * blocks)[grows].sum()) + 2 * k)
        tokens_off = offsets if go.size == n else np.append(offsets[go], offsets[-1])
        # The rest only raise their history: per life cycle at most the
        # blocks that many tokens make stale.
        span = np.where(grows, blocks, count[go] // T + 2).sum()
        self.launch(slots_go, ops, span, need=2 * commits, tokens=flat, tokens_off=tokens_off)

    def _tokens(self, tokens, n: int, what: str, intern: bool = False):
        """``(flat int32 tokens, int64 offsets of n + 1, digests)``; ``digests``
        is the input to convert again with digests interned (None: none)."""
        t = self.tables
        if isinstance(tokens, tuple) and len(tokens) == 2 and hasattr(tokens[0], "dtype"):
            flat, offsets = check_flat(tokens[0], tokens[1], self.backend.xp)
            if offsets.shape[0] != n + 1:
                raise ValueError(f"{what}: offsets has {offsets.shape[0]} entries for {n} caches (needs {n + 1})")
            return flat, self.backend.to_host(offsets), None
        if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__"):
            raise TypeError(f"{what}: tokens must be a list of token sequences or a (flat_tokens, offsets) pair")
        if len(tokens) != n:
            raise ValueError(f"{what}: tokens has {len(tokens)} entries for {n} caches")
        flat, offsets = flatten(tokens, t.intern_digest if intern else t.lookup_digest)
        has_digests = not intern and flat.size and int(flat.min()) < 0
        return flat, offsets, tokens if has_digests else None

    def close(self, caches, evict_first=False) -> None:
        what = "close_batch()"
        slots = self.slots(caches, what)
        n = len(slots)
        first = self.flags(evict_first, n, "evict_first", what)
        S = self.pool.host_scalars
        go = np.flatnonzero(S[slots, Q_STATUS] != CLOSED)  # closing twice is a no-op
        if not go.size:
            return
        slots_go = slots[go]
        picked = caches if go.size == n else [caches[i] for i in go.tolist()]
        self.set_args(slots_go, first[go].astype(np.int64))
        nb = S[slots_go, Q_NUM_BLOCKS]
        self.tables.ensure_free_blocks(2 * go.size)
        self.tables.ensure_log_tokens(int(2 * nb.sum()) + 2 * go.size)
        self.launch(slots_go, np.full(go.size, SEQ_CLOSE, dtype=np.int64), nb.sum(), closing=picked)

    def resume(self, caches) -> np.ndarray:
        what = "resume_batch()"
        slots = self.slots(caches, what)
        self.require(slots, SUSPENDED, what)
        n = len(slots)
        if not n:
            return np.zeros(0, dtype=bool)
        S = self.pool.host_scalars
        blocks = S[slots, Q_NUM_BLOCKS].copy()
        self.fill_priorities(caches, slots, blocks)
        self.launch(slots, np.full(n, SEQ_RESUME, dtype=np.int64), blocks.sum(), need=int(blocks.sum()) + 2 * n)
        return S[slots, Q_RESULT] != 0

    # -- admission ----------------------------------------------------------------------
    def create(self, requests, scopes=None, priority_callbacks=None) -> list:
        """New SUSPENDED caches, each holding what ``create_kv_cache`` would:
        one match launch for all, then one launch holding their reused pages."""
        from .cache import KVCache

        what = "create_kv_caches()"
        if isinstance(requests, (str, bytes)) or not hasattr(requests, "__len__"):
            raise TypeError(f"{what}: requests must be a list of token sequences")
        n = len(requests)
        callbacks = [None] * n if priority_callbacks is None else list(priority_callbacks)
        if len(callbacks) != n:
            raise ValueError(f"{what}: priority_callbacks has {len(callbacks)} entries for {n} requests")
        for i, cb in enumerate(callbacks):
            if cb is not None and not callable(cb):
                raise TypeError(f"{what}: priority_callbacks[{i}] must be callable(ordinal, life_cycle_id) -> int, got {cb!r}")
        scope_list = self._scope_list(scopes, n, what)
        matcher = self.ctx.matcher
        b = self.backend
        queries, arrays = [], []
        for i, r in enumerate(requests):  # one conversion per request, as create_kv_cache does
            if type(r) is TokenSequence:
                matcher._check_sequence(i, r)
                a = np.asarray(b.to_host(r.tokens))
                queries.append(r)
            else:
                a = token_array(r, self.tables.lookup_digest, request=i)
                queries.append(ValidTokens(a))
            arrays.append(a)
        lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=n)
        if not n:
            return []
        m = matcher.match(queries, as_scope(scopes) if _one_scope(scopes) else scope_list).to_host()
        tree = self.ctx.tree
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
        matched = np.asarray(m.num_tokens, dtype=np.int64)
        nblocks = np.diff(np.asarray(m.block_offsets, dtype=np.int64))
        slots = self.pool.allocate(n, sids, keys, digests, nblocks)
        caches = [KVCache._adopt(self.ctx, int(s), cb) for s, cb in zip(slots.tolist(), callbacks)]
        mgr = self.ctx.manager
        for kv in caches:
            mgr._caches.add(kv)
        open_caches = self.ctx.open_caches
        try:
            open_caches.update(caches)
            go = np.flatnonzero(matched > 0)
            if go.size:
                starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
                flat_all = np.concatenate(arrays).astype(np.int32, copy=False)
                flat = flat_all[ranges(starts[go], matched[go])]
                toff = np.concatenate([[0], np.cumsum(matched[go])]).astype(np.int64)
                poff = np.concatenate([[0], np.cumsum(nblocks[go])]).astype(np.int64)
                path = np.asarray(m.block_ids, dtype=np.int64)[ranges(np.asarray(m.block_offsets)[go], nblocks[go])]
                self.set_args(slots[go], matched[go], nblocks[go])
                self.launch(slots[go], np.full(go.size, SEQ_SETUP_REUSE, dtype=np.int64), nblocks[go].sum(),
                            tokens=flat, tokens_off=toff, path=path, path_off=poff)
            stats = self._stats()
            has_ssm = self.config.ssm_life_cycle_id is not None
            for looked, reused in zip(lengths.tolist(), matched.tolist()):
                stats.record(looked, reused, self.T, has_ssm)
            return caches
        except BaseException:
            try:
                self.close(caches)
            except BaseException:
                pass  # the first exception is the one to report
            raise

    @staticmethod
    def _scope_list(scopes, n: int, what: str) -> list:
        if _one_scope(scopes):
            return [as_scope(scopes)] * n
        if isinstance(scopes, (str, bytes)) or not hasattr(scopes, "__len__"):
            raise TypeError(f"{what}: scopes must be None, one gpukv.ReuseScope, or one per request")
        if len(scopes) != n:
            raise ValueError(f"{what}: scopes has {len(scopes)} entries for {n} requests")
        out = []
        for i, s in enumerate(scopes):
            try:
                out.append(as_scope(s))
            except TypeError as e:
                raise TypeError(f"{what}: scopes[{i}]: {e}") from None
        return out


def _per_cache(method):
    """A cache's public method without its call guard (the batched call holds it)."""
    return method.__func__.__wrapped__


def _one_each(*columns) -> bool:
    return all(c is None or (type(c) in (list, tuple) or isinstance(c, np.ndarray)) and len(c) == 1 for c in columns)


def _as_entry(what: str, call):
    """``call()``, its errors naming the batch's only entry."""
    try:
        return call()
    except BusyError:
        raise
    except (LogicError, ValueError, TypeError) as e:
        raise type(e)(f"{what}: caches[0]: {e}") from e


def _one_scope(scopes) -> bool:
    from .core.scope import ReuseScope

    return scopes is None or isinstance(scopes, ReuseScope)


def _first(bad: np.ndarray, error):
    """Raise ``error(i)`` for the first entry where ``bad`` holds."""
    if bad.any():
        raise error(int(np.argmax(bad)))


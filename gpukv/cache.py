"""``KVCache``: one sequence's KV cache, as a serving engine drives it.

The host side validates each call and launches the serial sequence kernel
(``kernels/seq.py``) once; that kernel does the per-block work of docs/semantics.md
§2.5-§2.10 on the device tables. Afterwards the host carries out the page data
copies the kernel recorded and drains the tree's change log.

It is longer than most modules because ``KVCache`` is one public class (the
KV-cache half of the API guide): each method is argument checks and one launch,
and splitting the class would split that surface, not simplify it.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass

import numpy as np

from .kernels.sha256 import digest_to_int64x4
from .kernels.seq import (
    ACTIVE,
    CLOSED,
    Q_CAPACITY,
    Q_COMMIT_STATE,
    Q_COMMITTED,
    Q_HISTORY,
    Q_NUM_BLOCKS,
    Q_RESULT,
    Q_SCOPE_ID,
    Q_SSM_PAGE,
    Q_STATUS,
    SEQ_CLOSE,
    SEQ_COMMIT,
    SEQ_RESIZE,
    SEQ_RESUME,
    SEQ_SETUP_REUSE,
    SEQ_STOP,
    SEQ_SUSPEND,
    SCRATCH,
    SUSPENDED,
    USER_STOP,
)
from .core.config import DEFAULT_PRIORITY, check_priority
from .core.kinds import NO_DROP, planned_drop_start
from .core.layout import (
    NULL,
    PAGE_LEVEL,
    PAGE_POOL_INDEX,
    PAGE_SERIAL,
    SLOT_PAGE,
    slot_row,
)
from .cache_pool import FIRST_BLOCKS, CachePool, pools_can_hold
from .launcher import BusyError, Launcher, LogicError, serialized
from .matching import Matcher
from .tables import Tables, scratch_width
from .tokens import ValidTokens, token_array
from .tree import BlockTree


@dataclass(frozen=True, eq=False)
class CacheContext:
    """What a manager hands each of its caches: the collaborators a cache
    works through, named, so a cache never reaches into its manager."""

    manager: object  # the owner: identity checks and introspection only
    config: object  # the manager's CacheConfig
    tables: Tables
    tree: BlockTree
    matcher: Matcher
    launcher: Launcher
    open_caches: set  # the manager's open caches; a cache leaves it when CLOSED
    pool: CachePool  # every cache's sequence state


class KVCacheStatus(enum.Enum):
    SUSPENDED = SUSPENDED
    ACTIVE = ACTIVE
    CLOSED = CLOSED


class KVCache:
    """A sequence's pages and its commits into the reuse tree.

    Created by ``KVCacheManager.create_kv_cache``; starts SUSPENDED holding the
    reused pages. ``num_committed_tokens <= history_length <= capacity``."""

    def __init__(self, ctx: CacheContext, scope, priority_callback=None, *, slot=None):
        if priority_callback is not None and not callable(priority_callback):
            raise TypeError(f"priority_callback must be callable(ordinal, life_cycle_id) -> int, got {priority_callback!r}")
        tree = ctx.tree
        if slot is None:
            sid = tree.scope_id(scope, create=True)
            slot = int(ctx.pool.allocate(
                1, [sid], [tree.scope_key(sid)], digest_to_int64x4(tree.scope_digest(sid)), [FIRST_BLOCKS]
            )[0])
        else:
            sid = int(ctx.pool.host_scalars[slot, Q_SCOPE_ID])
        self._scope = tree.scope_of(sid)  # kept: a closed cache's scope id may be reclaimed
        self._bind(ctx, slot, priority_callback)

    @classmethod
    def _adopt(cls, ctx: CacheContext, slot: int, priority_callback) -> "KVCache":
        """The cache of a slot the batched constructor set up (scope included)."""
        kv = cls.__new__(cls)
        kv._scope = ctx.tree.scope_of(int(ctx.pool.host_scalars[slot, Q_SCOPE_ID]))
        kv._bind(ctx, slot, priority_callback)
        return kv

    def _bind(self, ctx: CacheContext, slot: int, priority_callback):
        """Everything but the scope: shared with the batched constructor."""
        self._mgr = ctx.manager
        self._config = ctx.config
        self._tables = ctx.tables
        self._tree = ctx.tree
        self._matcher = ctx.matcher
        self._launcher = ctx.launcher
        self._open_caches = ctx.open_caches
        self._pool = ctx.pool
        self._slot = slot
        # The host copy of the cache's scalars, refreshed after every launch: a
        # row of the pool's, re-pointed by the pool when that grows.
        self._scalar_row = (-1, None)
        self._slot_array = np.array([slot], dtype=np.int64)
        self._views = None  # (pool generation, SeqTables views)
        self._serial = int(ctx.pool.serial[slot])
        self._priority_callback = priority_callback
        if priority_callback is not None:
            ctx.pool.priorities_known[slot] = 0
        self._backend = ctx.tables.backend
        self._T = ctx.config.tokens_per_block
        self._num_life_cycles = len(ctx.config.life_cycles)
        weakref.finalize(self, ctx.pool.release, slot)

    @property
    def _q(self):
        """This cache's SeqTables: views of its rows of the manager's pool."""
        v = self._views
        pool = self._pool
        if v is None or v[0] != pool.gen:
            v = self._views = (pool.gen, pool.view(self._slot))
        return v[1]

    @property
    def _scalars(self) -> np.ndarray:
        """This cache's row of the pool's host scalars (refreshed by every
        launch); re-taken when the pool has replaced its arrays."""
        r = self._scalar_row
        pool = self._pool
        if r[0] != pool.gen:
            r = self._scalar_row = (pool.gen, pool.host_scalars[self._slot])
        return r[1]

    @property
    def _priorities_known(self) -> int:
        """Ordinals whose page priorities are in the device table."""
        return int(self._pool.priorities_known[self._slot])

    def _set_priorities_known(self, n: int):
        self._pool.priorities_known[self._slot] = n

    # -- state ------------------------------------------------------------------------
    @property
    def num_committed_tokens(self) -> int:
        return int(self._scalars[Q_COMMITTED])

    @property
    def history_length(self) -> int:
        return int(self._scalars[Q_HISTORY])

    @property
    def capacity(self) -> int:
        return int(self._scalars[Q_CAPACITY])

    @property
    def scope_id(self) -> int:
        return int(self._scalars[Q_SCOPE_ID])

    @property
    def status(self) -> KVCacheStatus:
        return KVCacheStatus(int(self._scalars[Q_STATUS]))

    @property
    def committed_tokens(self):
        """The committed tokens as committed: an int32 array, or a list of ints
        and 32-byte digests when a multimodal digest is among them (a slice of
        either can be fed back to ``create_kv_cache``)."""
        ids = self._committed_ids()
        if not ids.size or int(ids.min()) >= 0:
            return ids
        digest_of = self._tables.digest_of_token
        return [digest_of(t) if t < 0 else t for t in ids.tolist()]

    def _committed_ids(self) -> np.ndarray:
        """The committed tokens as stored: digests as their interned ids."""
        return np.array(self._backend.to_host(self._q.tokens[: self.num_committed_tokens]))

    @serialized("kv.page_indices()")
    def page_indices(self, life_cycle_id: int) -> np.ndarray:
        """One page index (inside the life cycle's GPU pool) per block; -1 = none,
        or a page that is on the host tier (an ACTIVE cache has all its pages on
        the GPU)."""
        self._check_lc(life_cycle_id)
        rows = self._backend.to_host(self._q.pages[: int(self._scalars[Q_NUM_BLOCKS]), life_cycle_id])
        return self._pool_index(rows)

    @serialized("kv.scratch_blocks()")
    def scratch_blocks(self, life_cycle_id: int) -> np.ndarray:
        """Ordinals whose pages are SWA scratch (shared slots, no page of their own)."""
        self._check_lc(life_cycle_id)
        kinds = self._backend.to_host(self._q.kinds[: int(self._scalars[Q_NUM_BLOCKS]), life_cycle_id])
        return np.nonzero(kinds == SCRATCH)[0]

    @serialized("kv.scratch_page_indices()")
    def scratch_page_indices(self, life_cycle_id: int) -> np.ndarray:
        """Pool indices of the scratch slots held for this step; scratch block
        ``o`` uses slot ``o % len(slots)``."""
        self._check_lc(life_cycle_id)
        n = int(self._backend.to_host(self._q.scratch_count)[life_cycle_id])
        return self._pool_index(self._backend.to_host(self._q.scratch[life_cycle_id, :n]))

    @serialized("kv.ssm_page_index()")
    def ssm_page_index(self) -> int:
        """The live SSM page's pool index, -1 for none."""
        return int(self._pool_index(np.array([self._scalars[Q_SSM_PAGE]]))[0])

    def _pool_index(self, rows) -> np.ndarray:
        out = np.full(len(rows), -1, dtype=np.int32)
        have = np.nonzero(rows != NULL)[0]
        tables = self._tables
        on_gpu = tables.page_fields(rows[have], PAGE_LEVEL) == 0
        out[have[on_gpu]] = tables.page_fields(rows[have[on_gpu]], PAGE_POOL_INDEX)
        return out

    # -- calls --------------------------------------------------------------------------
    @serialized("kv.resume()")
    def resume(self) -> bool:
        """SUSPENDED -> ACTIVE (False, and no change, when pages run out)."""
        self._require(KVCacheStatus.SUSPENDED, "resume()")
        blocks = int(self._scalars[Q_NUM_BLOCKS])
        self._fill_priorities(blocks)
        return self._launch(SEQ_RESUME, need=blocks + 2)

    @serialized("kv.suspend()")
    def suspend(self):
        self._require(KVCacheStatus.ACTIVE, "suspend()")
        self._launch(SEQ_SUSPEND)

    @serialized("kv.resize()")
    def resize(self, capacity: int | None = None, history_length: int | None = None) -> bool:
        """Set capacity (blocks to hold) and history (tokens before the next
        input). False, with nothing changed, when a page pool is short."""
        self._require(KVCacheStatus.ACTIVE, "resize()")
        cap = self.capacity if capacity is None else _int("capacity", capacity)
        hist = self.history_length if history_length is None else _int("history_length", history_length)
        if hist < self.history_length:
            raise ValueError(f"history_length cannot decrease ({hist} < {self.history_length})")
        if cap < hist:
            raise ValueError(f"capacity {cap} is below history_length {hist}")
        scratch = self._config.swa_scratch_reuse
        if scratch is not None and cap != self.capacity:
            if not self.capacity - scratch.max_rewind_len <= hist <= self.capacity:
                raise ValueError(
                    f"with swa_scratch_reuse a capacity change needs capacity - max_rewind_len <= history_length "
                    f"<= capacity (the old capacity {self.capacity}), got history_length {hist}"
                )
            if cap < self.capacity and self._backend.to_host(self._q.scratch_count).any():
                raise ValueError("cannot shrink the capacity while scratch slots are held (suspend first)")
        blocks = -(-cap // self._T)
        if not pools_can_hold(self._pool.hold_rules, self._T, int(self._scalars[Q_NUM_BLOCKS]), blocks, hist):
            return False  # before anything is allocated for the new blocks
        self._reserve(blocks)
        self._fill_priorities(blocks)
        new = max(0, blocks - int(self._scalars[Q_NUM_BLOCKS]))
        return self._launch(SEQ_RESIZE, cap, hist, need=new + scratch_width(self._config) + 1)

    @serialized("kv.commit()")
    def commit(self, tokens, is_end: bool = False):
        """Commit the next tokens of the sequence into the reuse tree (§2.5)."""
        self._require(KVCacheStatus.ACTIVE, "commit()")
        if not isinstance(is_end, (bool, np.bool_)):
            raise TypeError(f"is_end must be a bool, got {is_end!r}")
        tables = self._tables
        # Digests are only looked up until every check has passed, so a
        # rejected commit interns nothing.
        arr = token_array(tokens, tables.lookup_digest)
        if arr.size == 0:
            if is_end:
                self._stop_committing()
            return
        if int(self._scalars[Q_COMMIT_STATE]) == USER_STOP:
            raise LogicError("Cannot commit tokens after stop_committing()")
        n0 = self.num_committed_tokens
        n1 = n0 + arr.size
        if n1 > self.capacity:
            raise ValueError(f"committing {arr.size} tokens would pass the capacity ({n1} > {self.capacity})")
        if self._config.commit_min_snapshot and self.history_length not in (n0, n1):
            raise ValueError(
                f"commit_min_snapshot: history_length ({self.history_length}) must equal the committed length "
                f"before ({n0}) or after ({n1}) the commit of {arr.size} tokens"
            )
        if int(arr.min()) < 0:
            arr = token_array(tokens, tables.intern_digest)
        blocks = -(-n1 // self._T)
        self._tables.ensure_free_blocks(blocks + 2)
        # New blocks, a re-attached chain, and a rebase announcing each life cycle.
        self._tables.ensure_log_tokens((self._num_life_cycles + 2) * blocks + 2)
        self._launch(SEQ_COMMIT, n0, arr.size, int(bool(is_end)), need=2, tokens=arr)

    @serialized("kv.stop_committing()")
    def stop_committing(self):
        self._stop_committing()

    def _stop_committing(self):
        if self.status is KVCacheStatus.CLOSED:
            raise LogicError("stop_committing() on a closed KV cache")
        self._tables.ensure_free_blocks(2)
        self._tables.ensure_log_tokens(2 * int(self._scalars[Q_NUM_BLOCKS]) + 2)
        self._launch(SEQ_STOP)

    @serialized("kv.close()")
    def close(self, evict_first: bool = False):
        """Stop committing (a pending partial tail is committed) and release
        every page; closing twice is a no-op. With ``evict_first`` the pages
        that stay cached go to the head of their eviction queue (a turn the
        scheduler knows will not be continued)."""
        if not isinstance(evict_first, bool):
            raise TypeError(f"evict_first must be a bool, got {evict_first!r}")
        self._close(evict_first)

    def _close(self, evict_first: bool = False):
        if self.status is KVCacheStatus.CLOSED:
            return
        self._tables.ensure_free_blocks(2)
        self._tables.ensure_log_tokens(2 * int(self._scalars[Q_NUM_BLOCKS]) + 2)
        self._launch(SEQ_CLOSE, int(evict_first))  # leaves the open set in _after_launch

    @serialized("kv.plan_committed_block_drop()")
    def plan_committed_block_drop(self) -> "PlannedDrop | None":
        """Plan dropping this turn's pages that a later turn will not need
        (§2.9): the SWA window at the endpoint and the last SSM checkpoint, never
        full attention. None when nothing was committed or the committed tokens
        no longer match back to their full length. Needs stop_committing()."""
        if int(self._scalars[Q_COMMIT_STATE]) != USER_STOP:  # a closed cache has stopped too
            raise LogicError("plan_committed_block_drop() needs stop_committing() first")
        N = self.num_committed_tokens
        if N == 0:
            return None
        scope = self._scope
        m = self._matcher.match([ValidTokens(self._committed_ids())], scope, backoff=0).to_host()  # never backed off
        blocks = m.blocks(0)
        if int(m.num_tokens[0]) != N or not len(blocks):
            return None
        E = len(blocks)
        L = len(self._config.life_cycles)
        b = self._backend
        picked = []
        for lc, life in enumerate(self._config.life_cycles):
            start = planned_drop_start(life.kind, life.stale_range(N, self._T)[1], E)
            if start == NO_DROP:
                continue  # later turns may still need these blocks
            pages = b.to_host(self._tables.slots[b.to_device(slot_row(blocks[start:], lc, L)), SLOT_PAGE])
            if (pages == NULL).any():
                return None
            picked.extend(int(p) for p in pages)
        return PlannedDrop(self._tables, self._tree, self._launcher, sorted(set(picked)))

    # -- plumbing ---------------------------------------------------------------------------
    def _setup_reuse(self, tokens: np.ndarray, num_tokens: int, blocks: np.ndarray):
        self._reserve(len(blocks))
        self._launch(SEQ_SETUP_REUSE, num_tokens, len(blocks), tokens=tokens[:num_tokens], path=blocks)

    def _reserve(self, blocks: int):
        """Room for ``blocks`` blocks in this cache's segment of the pool."""
        if blocks > self._pool.seg[self._slot, 1]:
            self._pool.reserve(self._slot_array, np.array([blocks], dtype=np.int64))

    def _fill_priorities(self, blocks: int):
        """Page priorities for ordinals up to ``blocks`` from the callback, asked
        once per (ordinal, life cycle) before the launch that may create such
        pages, so a bad value or a raising callback changes nothing."""
        rows = self._asked_priorities(blocks)
        if rows is not None:
            self._store_priorities(rows)

    def _asked_priorities(self, blocks: int, where: str = ""):
        """The callback's priorities for the ordinals from the known ones up to
        ``blocks`` (int64 ``[n, max(L, 1)]``), checked, written nowhere yet;
        None when there is nothing to ask. ``where`` starts the error messages
        (the batched calls name the cache's entry)."""
        cb = self._priority_callback
        known = self._priorities_known
        if cb is None or blocks <= known:
            return None
        L = len(self._config.life_cycles)
        rows = np.empty((blocks - known, max(L, 1)), dtype=np.int64)
        rows[:] = DEFAULT_PRIORITY
        for i, o in enumerate(range(known, blocks)):  # the callback is per (ordinal, life cycle) by contract
            for lc in range(L):
                try:
                    v = cb(o, lc)
                except BusyError:
                    raise  # the callback called back into the manager: say so, unwrapped
                except Exception as e:
                    raise ValueError(f"{where}priority_callback({o}, {lc}) raised {type(e).__name__}: {e}") from e
                rows[i, lc] = check_priority(v, f"{where}priority_callback({o}, {lc})")
        return rows

    def _store_priorities(self, rows):
        """``rows`` (``_asked_priorities``) into the cache's priority table."""
        known = self._priorities_known
        self._q.priority[known:known + len(rows)] = self._backend.to_device(rows)
        self._set_priorities_known(known + len(rows))

    def _launch(self, op, *args, need: int = 0, tokens=None, path=None) -> bool:
        """One launch of the sequence kernel for this cache alone (a batch of
        one); ``need`` bounds the GPU pages it allocates per life cycle (room
        in the change log for their victims). ``tokens`` and ``path`` are
        the kernel's input copied into the cache's rows (commit, reuse setup)."""
        pool = self._pool
        slot = self._slot
        a = np.zeros(4, dtype=np.int64)
        a[: len(args)] = args
        pool.arrays.args[slot] = self._backend.to_device(a) if pool._on_gpu else a
        # Every block this cache may touch, the pages it may allocate, scratch.
        self._tables.ensure_log(int(pool.seg[slot, 1]) + need + pool.scratch_width + 8)
        pool.launch_one(self._launcher, slot, op, tokens, path, results=self._after_launch)
        return bool(self._scalars[Q_RESULT])

    def _after_launch(self):
        """The host copy of the cache's scalars, read back after each launch
        (again if the aftermath is resumed); a closed cache leaves the open set."""
        self._pool.refresh(self._slot_array)
        if int(self._scalars[Q_STATUS]) == CLOSED:
            self._open_caches.discard(self)

    def _require(self, status: KVCacheStatus, what: str):
        if self.status is not status:
            raise LogicError(f"{what} needs a {status.name} KV cache; this one is {self.status.name}")

    def _check_lc(self, lc):
        L = len(self._config.life_cycles)
        if not isinstance(lc, (int, np.integer)) or isinstance(lc, bool) or not 0 <= lc < L:
            raise ValueError(f"life_cycle_id must be in 0..{L - 1}, got {lc!r}")

    def __repr__(self):
        return (f"KVCache({self.status.name}, committed={self.num_committed_tokens}, "
                f"history={self.history_length}, capacity={self.capacity})")


class PlannedDrop:
    """Pages one turn planned to drop; ``drop()`` applies the plan once.

    Plans are reference counts on pages: a page dies when the last plan naming
    it is dropped, if nobody holds it then."""

    def __init__(self, tables: Tables, tree: BlockTree, launcher: Launcher, pages: list[int]):
        self._tables = tables
        self._tree = tree
        self._launcher = launcher
        self._pages = list(zip(pages, tables.page_fields(pages, PAGE_SERIAL).tolist()))
        tree.plan_drops(pages)
        self.dropped = False

    @serialized("PlannedDrop.drop()")
    def drop(self):
        if self.dropped:
            raise RuntimeError("This planned drop has already been dropped")
        self.dropped = True
        self._tree.drop_planned(self._pages)


def _int(name, v) -> int:
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
        raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    return int(v)

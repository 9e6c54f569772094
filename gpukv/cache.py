"""``KVCache``: one sequence's KV cache, as a serving engine drives it.

A cache is a handle on its slot of the manager's ``CachePool``: its state
(the scalars the properties read, its pages and committed tokens) lives
there, and each call is a batch of one of the manager's calls on caches
(``batch.py``), which checks it and launches the sequence kernel
(``kernels/seq.py``) once. What is left here is the public surface: the
state, the page indices an engine reads, and the planned drop of a turn.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass

import numpy as np

from .cache_pool import CachePool
from .core.errors import LogicError
from .core.kinds import NO_DROP, planned_drop_start
from .core.layout import (
    ACTIVE,
    CLOSED,
    NULL,
    Q_CAPACITY,
    Q_COMMIT_STATE,
    Q_COMMITTED,
    Q_HISTORY,
    Q_NUM_BLOCKS,
    Q_SCOPE_ID,
    Q_SSM_PAGE,
    Q_STATUS,
    SCRATCH,
    SLOT_WORD,
    SUSPENDED,
    USER_STOP,
    slot_page,
    slot_row,
)
from .launcher import Launcher, serialized
from .page_reads import pool_indices
from .matching import Matcher
from .tables import Tables
from .tokens import ValidTokens
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
    reused pages. ``num_committed_tokens <= history_length <= capacity``.

    Its calls are batches of one of the manager's calls on caches
    (``batch.CacheCalls``), which know a cache by its handle: its pool slot
    and the slot's serial (``_slot``, ``_serial``)."""

    def __init__(self, ctx: CacheContext, calls, slot: int):
        """The cache of pool slot ``slot``, which ``calls`` set up."""
        self._calls = calls
        self._mgr = ctx.manager
        self._config = ctx.config
        self._tables = ctx.tables
        self._tree = ctx.tree
        self._matcher = ctx.matcher
        self._launcher = ctx.launcher  # the call guard of ``serialized``
        self._pool = ctx.pool
        self._slot = slot
        self._serial = int(ctx.pool.serial[slot])
        # Kept: a closed cache's scope id may be reclaimed.
        self._scope = ctx.tree.scope_of(int(ctx.pool.host_scalars[slot, Q_SCOPE_ID]))
        # The host copy of the cache's scalars, refreshed after every launch: a
        # row of the pool's, re-pointed by the pool when that grows.
        self._scalar_row = (-1, None)
        self._views = None  # (pool generation, SeqTables views)
        self._backend = ctx.tables.backend
        self._T = ctx.config.tokens_per_block
        ctx.pool.finalizers[slot] = weakref.finalize(self, ctx.pool.release, slot, self._serial)

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
        return pool_indices(self._tables, np.asarray(rows, dtype=np.int64))

    # -- calls (batches of one: batch.CacheCalls) ------------------------------------------
    @serialized("kv.resume()")
    def resume(self) -> bool:
        """SUSPENDED -> ACTIVE (False, and no change, when pages run out)."""
        return self._calls.resume_one(self._slot)

    @serialized("kv.suspend()")
    def suspend(self):
        self._calls.suspend_one(self._slot)

    @serialized("kv.resize()")
    def resize(self, capacity: int | None = None, history_length: int | None = None) -> bool:
        """Set capacity (blocks to hold) and history (tokens before the next
        input). False, with nothing changed, when a page pool is short."""
        return self._calls.resize_one(self._slot, capacity, history_length)

    @serialized("kv.commit()")
    def commit(self, tokens, is_end: bool = False):
        """Commit the next tokens of the sequence into the reuse tree (§2.5)."""
        self._calls.commit_one(self._slot, tokens, is_end)

    @serialized("kv.append()")
    def append(self, tokens, room: int = 1, is_end: bool = False) -> bool:
        """``commit(tokens, is_end)``, then, unless it ended, room for
        ``room`` more tokens (``resize`` to whole blocks past them, the
        history as the commit leaves it) where the capacity is short, in one
        launch: what a step ends with. False where a pool is short for the
        room: the tokens are committed and the capacity is as it was."""
        return self._calls.append_one(self._slot, tokens, room, is_end)

    @serialized("kv.stop_committing()")
    def stop_committing(self):
        self._calls.stop_one(self._slot)

    @serialized("kv.close()")
    def close(self, evict_first: bool = False):
        """Stop committing (a pending partial tail is committed) and release
        every page; closing twice is a no-op. With ``evict_first`` the pages
        that stay cached go to the head of their eviction queue (a turn the
        scheduler knows will not be continued)."""
        self._calls.close_one(self, evict_first)

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
            pages = slot_page(b.to_host(self._tables.slots[b.to_device(slot_row(blocks[start:], lc, L)), SLOT_WORD]))
            if (pages == NULL).any():
                return None
            picked.extend(int(p) for p in pages)
        return PlannedDrop(self._tables, self._tree, self._launcher, sorted(set(picked)))

    # -- plumbing ---------------------------------------------------------------------------
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
        self._pages = list(zip(pages, tables.page_serials(pages).tolist()))
        tree.plan_drops(self._pages)
        self.dropped = False

    @serialized("PlannedDrop.drop()")
    def drop(self):
        if self.dropped:
            raise RuntimeError("This planned drop has already been dropped")
        self.dropped = True
        self._tree.drop_planned(self._pages)


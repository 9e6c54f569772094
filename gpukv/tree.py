"""The block radix tree, as the host drives it (docs/semantics.md §2.1, §2.2, §2.7).

``BlockTree`` validates each request, stocks the free lists, and launches the
serial tree kernel (``kernels/tree.py``) for one operation. It also owns the
reuse-scope registry: each scope gets an id, a fast root key and the root's
SHA-256 digest, and one root per scope lives in the tables.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from .kernels.keys import root_key64
from .kernels.sha256 import digest_to_int64x4, int64x4_to_digest
from .kernels.tree import (
    OP_ADD,
    OP_ADD_PAGE,
    OP_CLEAR,
    OP_CLEAR_STALE,
    OP_INSERT,
    OP_PAGE_DEATH,
    OP_REMOVE_SUBTREE,
    OP_UNLINK_PAGE,
    OP_ANNOUNCE,
    OP_EVICT,
    OP_DROP_PLANNED,
    build_tree_kernel,
)
from .core.layout import (
    BLK_INFO,
    BLK_PARENT,
    BLK_SERIAL,
    FLAG_ATTACHED,
    FLAG_IN_USE,
    FLAG_ROOT,
    NULL,
    PAGE_BLOCK,
    PAGE_INFO,
    PAGE_COMMITTED,
    ROOT_SCOPE,
    info_num_tokens,
    info_state,
)
from .core.config import DEFAULT_PRIORITY, check_priority
from .core.scope import ReuseScope, as_scope
from .launcher import Launcher
from .tables import Tables
from .tokens import token_array


@dataclass(frozen=True)
class BlockRef:
    """A handle on one tree block: its row and its SHA-256 key (with
    ``block_digests`` off, its 8-byte serial: no digest is computed).

    Rows are recycled, so every use checks that the row still holds the block
    with this key; a stale handle raises instead of touching another block."""

    row: int
    key: bytes


@dataclass(frozen=True, eq=False)
class _Scope:
    """A registered reuse scope: what its root needs, computed once."""

    scope: ReuseScope
    key: int  # the root's fast chain key
    digest: np.ndarray  # the root's SHA-256 digest as int64x4


class BlockTree:
    """The tree's host side; every launch goes through ``launcher``."""

    def __init__(self, tables: Tables, launcher: Launcher):
        self.tables = tables
        self.backend = tables.backend
        self.launcher = launcher
        self._kernel = build_tree_kernel(self.backend.target)
        # The scope registry, by id. Ids are never reused (a reclaimed scope
        # that comes back gets a new one), so nothing that remembers an id,
        # like the arena's memo, can mistake one scope for another.
        self._scope_ids: dict[ReuseScope, int] = {}
        self._scopes: dict[int, _Scope] = {}
        self._scope_by_digest: dict[bytes, ReuseScope] = {}  # root digest -> scope
        self._next_scope_id = 0
        self._scope_collect_at = 64
        # Planned drops not carried out yet, by (page row, serial): counted
        # here, not in the page record, so a plan costs no launch and no
        # device memory. Entries of pages that died are forgotten whenever
        # the table doubles (``_forget_stale_plans``).
        self._plans: dict[tuple[int, int], int] = {}
        self._plans_checked_at = 64
        self.scopes_in_use = lambda: ()  # scope ids that open caches refer to; the manager sets it

    @property
    def log_sink(self) -> list | None:
        """A list that collects every change-log record (tests)."""
        return self.launcher.log_sink

    @log_sink.setter
    def log_sink(self, sink: list | None):
        self.launcher.log_sink = sink

    # -- scopes -------------------------------------------------------------------
    def scope_id(self, scope, create: bool = False) -> int:
        """The interned id of ``scope``; -1 if it was never used and not created.

        Registration is one append of a complete record, then the lookup
        entry: an exception between the two leaves an unused record behind,
        never a registry whose parts disagree."""
        scope = as_scope(scope)
        sid = self._scope_ids.get(scope)
        if sid is None and create:
            if len(self._scope_ids) >= self._scope_collect_at:
                self._collect_scopes()
            sid = self._next_scope_id
            raw = scope.to_bytes()
            digest = hashlib.sha256(raw).digest()
            # One record, computed whole and stored before the entries that
            # point to it, so an interrupt leaves no half-registered scope.
            self._scopes[sid] = _Scope(scope, root_key64(raw), digest_to_int64x4(digest))
            self._next_scope_id = sid + 1
            self._scope_by_digest[digest] = scope
            self._scope_ids[scope] = sid
        return -1 if sid is None else sid

    def _collect_scopes(self):
        """Forget the scopes nothing refers to: no root in the tables (a root
        lives while its scope has blocks) and no open cache."""
        info = self.backend.to_host(self.tables.blocks[:, BLK_INFO])  # the FLAG_* bits are its low ones
        roots = np.nonzero((info & (FLAG_ROOT | FLAG_IN_USE)) == (FLAG_ROOT | FLAG_IN_USE))[0]
        live = set(self.backend.to_host(self.tables.blocks[:, ROOT_SCOPE])[roots].tolist())
        live.update(self.scopes_in_use())
        for scope, sid in list(self._scope_ids.items()):
            if sid not in live:
                entry = self._scopes.pop(sid)
                del self._scope_ids[scope]
                self._scope_by_digest.pop(int64x4_to_digest(entry.digest), None)
        self._scope_collect_at = max(64, 2 * len(self._scope_ids))

    def scope_key(self, sid: int) -> int:
        return self._scopes[sid].key

    def scope_of(self, sid: int) -> ReuseScope:
        return self._scopes[sid].scope

    def scope_of_root_digest(self, digest: bytes) -> ReuseScope | None:
        """The scope whose root has this SHA-256 digest; None if no such root was made."""
        return self._scope_by_digest.get(bytes(digest))

    def scope_digest(self, sid: int) -> bytes:
        return int64x4_to_digest(self._scopes[sid].digest)

    @property
    def _scope_digests(self) -> dict[int, np.ndarray]:
        return {sid: entry.digest for sid, entry in self._scopes.items()}

    # -- kernel launch --------------------------------------------------------------
    def _op(self, op: int, args=(), toks=None, pages: int = 0, announced: int = 0) -> np.ndarray:
        """One tree kernel launch; ``pages`` bounds the pages per life cycle
        it may allocate or free besides those of the blocks in ``toks``,
        ``announced`` the blocks it may announce."""
        b = self.backend
        blocks = 0 if toks is None else -(-len(toks) // max(1, self.tables.tokens_per_block))
        self.tables.ensure_log(blocks + pages, announced)
        a = np.zeros(8, dtype=np.int64)
        a[: len(args)] = args
        t = np.zeros(max(1, self.tables.tokens_per_block), dtype=np.int32) if toks is None else toks
        out = np.full(4, NULL, dtype=np.int64)
        d_a, d_t, d_out = b.to_device(a), b.to_device(t), b.to_device(out)
        self.launcher.launch(self._kernel, op, d_a, d_t, d_out)
        return b.to_host(d_out)

    # -- reading rows -------------------------------------------------------------
    def row(self, r: int) -> np.ndarray:
        return self.backend.to_host(self.tables.blocks[r])

    def _scope_id_of(self, r: int) -> int:
        """The scope of attached block ``r``: its root's (only a root's row
        names one). One read of the parent column, then the walk up."""
        parent = self.backend.to_host(self.tables.blocks[:, BLK_PARENT])
        while parent[r] != NULL:
            r = parent[r]
        return int(self.backend.to_host(self.tables.blocks[r, ROOT_SCOPE]))

    def key_of(self, r: int) -> bytes:
        if not self.tables.config.block_digests:  # the serial tells a block from a later one in its row
            return int(self.backend.to_host(self.tables.blocks[r, BLK_SERIAL])).to_bytes(8, "little", signed=True)
        return int64x4_to_digest(self.backend.to_host(self.tables.digests[r]))

    def resolve(self, ref: BlockRef, what: str = "block") -> int:
        if not isinstance(ref, BlockRef):
            raise TypeError(f"{what} must be a gpukv BlockRef, got {type(ref).__name__}")
        if not 0 <= ref.row < self.tables.num_rows:
            raise ValueError(f"{what} refers to row {ref.row}, outside the table")
        row = self.row(ref.row)
        if not row[BLK_INFO] & FLAG_IN_USE or self.key_of(ref.row) != ref.key:
            raise ValueError(f"{what} is stale: its block no longer exists")
        return ref.row

    def ref(self, r: int) -> BlockRef:
        return BlockRef(int(r), self.key_of(r))

    # -- operations -----------------------------------------------------------------
    def add(self, tokens, parent: BlockRef | None = None, scope=None) -> tuple[BlockRef, bool]:
        """``add_or_get`` (§2.2) under ``parent`` or under the scope's root."""
        T = self.tables.tokens_per_block
        arr = token_array(tokens, self.tables.lookup_digest)  # digests interned once every check passed
        if not 1 <= arr.size <= T:
            raise ValueError(f"a block holds 1..{T} tokens, got {arr.size}")
        p = NULL
        if parent is None:
            sid = self.scope_id(scope, create=True)
        else:
            # A child lives in its parent's scope; a different explicit scope is a mistake.
            p = self.resolve(parent, "parent")
            row = self.row(p)
            if not row[BLK_INFO] & FLAG_ATTACHED:
                raise ValueError("parent is detached from the tree (an orphan)")
            n = info_num_tokens(row[BLK_INFO])
            if not row[BLK_INFO] & FLAG_ROOT and n != T:
                raise ValueError(f"parent is a partial block ({n} of {T} tokens); only full blocks have children")
            sid = self._scope_id_of(p)
            if scope is not None and self.scope_id(scope) != sid:
                raise ValueError("scope differs from the parent's scope")
        arr = self._interned(tokens, arr)
        toks = np.zeros(T, dtype=np.int32)
        toks[: arr.size] = arr
        self.tables.ensure_free_blocks(2)
        entry = self._scopes[sid]
        out = self._op(OP_ADD, (sid, entry.key, p, arr.size, *entry.digest), toks)
        return self.ref(out[0]), bool(out[1])

    def insert(self, tokens, scope=None) -> int:
        """Add every block of a token sequence (one launch), each with a fresh
        page of full coverage per life cycle where strictly wider. Returns the
        number of blocks that got their pages (fewer when a pool runs dry)."""
        T = self.tables.tokens_per_block
        arr = token_array(tokens, self.tables.lookup_digest)
        if arr.size == 0:
            return 0
        sid = self.scope_id(scope, create=True)
        arr = self._interned(tokens, arr)
        self.tables.ensure_free_blocks(-(-arr.size // T) + 1)
        entry = self._scopes[sid]
        out = self._op(OP_INSERT, (sid, entry.key, arr.size, 0, *entry.digest), arr, announced=-(-arr.size // T) + 1)
        return int(out[3])

    def _interned(self, tokens, arr: np.ndarray) -> np.ndarray:
        """``arr``, converted with digests only looked up, converted again with
        them interned when it holds any: the call has passed its checks."""
        return token_array(tokens, self.tables.intern_digest) if arr.size and int(arr.min()) < 0 else arr

    def add_page(self, block: BlockRef, lc: int, coverage: int, priority: int = DEFAULT_PRIORITY) -> int:
        """A fresh committed page of ``coverage`` tokens installed in ``block``'s
        slot when strictly wider than the incumbent; returns it, or NULL."""
        r = self.resolve(block)
        self._check_lc(lc)
        n = int(info_num_tokens(self.row(r)[BLK_INFO]))
        if not isinstance(coverage, (int, np.integer)) or isinstance(coverage, bool):
            raise TypeError(f"coverage must be an int, got {coverage!r}")
        if not 1 <= coverage <= n:
            raise ValueError(f"coverage must be in 1..{n} (the block's tokens), got {coverage}")
        priority = check_priority(priority, "priority")
        return int(self._op(OP_ADD_PAGE, (r, lc, coverage, priority), pages=1)[0])

    def announce(self, block: BlockRef, kind: int, lc: int = NULL):
        """Feed a block to the event manager's stored paths (EV_STORED_BLOCK or
        EV_STORED_LIFE_CYCLE), as a commit would."""
        r = self.resolve(block)
        if lc != NULL:
            self._check_lc(lc)
        self._op(OP_ANNOUNCE, (r, kind, lc), announced=1)

    def evict(self, lc: int, level: int, free: int) -> bool:
        """Evict from (lc, level) until it has ``free`` free slots (§2.11)."""
        self._check_lc(lc)
        # Each slot freed on the GPU may also drop a host page to make room.
        return bool(self._op(OP_EVICT, (lc, level, free), pages=2 * int(free))[0])

    def unlink_page(self, block: BlockRef, lc: int, expected: int = NULL) -> int:
        r = self.resolve(block)
        self._check_lc(lc)
        return int(self._op(OP_UNLINK_PAGE, (r, lc, expected))[0])

    def page_death(self, page: int):
        """A committed page lost its last owner (§2.7)."""
        pages = self.tables.pages
        if not isinstance(page, (int, np.integer)) or isinstance(page, bool):
            raise TypeError(f"page must be an int page id, got {page!r}")
        if not 0 <= page < pages.shape[0]:
            raise ValueError(f"page {page} does not exist")
        if info_state(int(self.backend.to_host(pages[page, PAGE_INFO]))) != PAGE_COMMITTED:
            raise ValueError(f"page {page} is not a committed page")
        self._op(OP_PAGE_DEATH, (page,))

    def plan_drops(self, pages_and_serials):
        """Count a planned drop on each ``(page, serial)`` (§2.9)."""
        plans = self._plans
        for key in pages_and_serials:  # a handful: the window's blocks and one checkpoint
            plans[key] = plans.get(key, 0) + 1
        if len(plans) >= self._plans_checked_at:
            self._forget_stale_plans()

    def drop_planned(self, pages_and_serials):
        """Carry out a planned drop on each ``(page, serial)``; the page dies
        with its last plan when it is still that page and nobody holds it."""
        plans = self._plans
        for key in pages_and_serials:
            left = plans.pop(key, 1) - 1  # a forgotten entry's page died: its drop changes nothing
            if left:
                plans[key] = left
            else:
                self._op(OP_DROP_PLANNED, key)

    def _forget_stale_plans(self):
        """Drop the entries of pages that died (their rows free, or holding
        later pages): a plan never carried out would keep its entry forever.
        One read of the rows, when the table has doubled."""
        keys = list(self._plans)
        alive = self.tables.still_committed([p for p, _ in keys], [s for _, s in keys])
        for key, ok in zip(keys, alive.tolist()):
            if not ok:
                del self._plans[key]
        self._plans_checked_at = max(64, 2 * len(self._plans))

    def page_block(self, page: int) -> int:
        return int(self.backend.to_host(self.tables.pages[page, PAGE_BLOCK]))

    def remove_subtree(self, block: BlockRef):
        self._op(OP_REMOVE_SUBTREE, (self.resolve(block),))

    def clear_stale_blocks_after_page_unlink(self, block: BlockRef, lc: int):
        self._check_lc(lc)
        self._op(OP_CLEAR_STALE, (self.resolve(block), lc))

    def clear(self):
        self._op(OP_CLEAR)

    def _check_lc(self, lc):
        L = self.tables.num_life_cycles
        if not isinstance(lc, (int, np.integer)) or isinstance(lc, bool) or not 0 <= lc < L:
            raise ValueError(f"life_cycle_id must be in 0..{L - 1}, got {lc!r}")

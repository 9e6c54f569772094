"""The device tables: allocation, growth by doubling, free lists (how big
each one is, the sizing rules and budgets: ``table_sizes.py``).

``Tables`` owns every array of the index on the backend's device and hands the
kernels a ``DeviceTables`` named tuple of them. Block rows come from a free-list
stack and go back to it when a block is destroyed, so a long run with churn
reuses rows instead of growing. The host keeps the stack stocked before each
operation (``ensure_free_blocks``); when it runs low every block-indexed table
doubles and the child index is rebuilt for the new size.

Pages are records with a stable row (what sequences and tree slots refer to)
and a storage slot in one of the fixed pools, one pool per (life cycle, cache
level). A page migrating between levels keeps its row and changes its storage
slot. Each life cycle owns a contiguous stretch of page rows (as many as its
pools have slots together), its free ones linked through the rows themselves;
each pool has a stack of free storage indices. The eviction controller's lists of candidates live here too
(their links are columns of the page rows); only the kernels change them.

Just over 500 lines because one class owns every array and so every rule
that replaces or rewrites one (allocation, doubling, the log's and copy
list's sizing, the interned multimodal digests, the LRU ticks' renumbering): the kernels' table tuple is rebuilt in
one place when any of them changes (``device``).
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np

from .core.backend import Backend
from .core.config import PRIORITY_MIN, CacheConfig
from .core.errors import IndexFullError
from .kernels.keys import sibling_hash_np
from .table_sizes import (
    COPY_SLACK, copy_budget, copy_rows_for, index_buckets, log_budget, log_rows_for, preallocated_sizes,
)
from .core.layout import (
    NUM_HELD,
    NUM_LEVELS,
    NUM_PRIORITIES,
    SHA256_WORK_WORDS,
    BID_KEY,
    BLK_FIRST_NEXT,
    BLK_HASH_NEXT,
    BLK_INFO,
    BLK_PARENT,
    BLOCK_IDS,
    BLOCKS,
    CNT_BLOCK_FREE_TOP,
    CNT_EVICT_FIRST,
    CNT_LOG_LEN,
    CNT_LOG_TOKENS_LEN,
    CNT_NUM_COPIES,
    CNT_RETIRED,
    CNT_TICK,
    COPY_RECORDS,
    COUNTERS,
    EMPTY_SLOT,
    FLAG_ATTACHED,
    FLAG_IN_USE,
    FLAG_ROOT,
    LG_COUNT,
    LG_LOWEST,
    LOG,
    LRU_GROUPS,
    LRU_LISTS,
    FREE_ROW_NEXT,
    NULL,
    PAGE_COMMITTED,
    PAGE_HOLDS,
    PAGE_INFO,
    PAGE_FREE,
    PAGE_LRU_TICK,
    PAGES,
    POLICY_COMMIT_MIN_SNAPSHOT,
    POLICY_SCRATCH_REWIND,
    POLICY_BLOCK_DIGESTS,
    POLICY_LOG_RECORDS,
    POLICY_STABLE_PAGES,
    POLICY_WIDTH,
    RETIRED_TAG,
    ROW_DTYPE,
    SLOTS,
    PAGE_SERIAL,
    copies_table,
    info_state,
    page_info,
)

DeviceTables = namedtuple(
    "DeviceTables",
    [
        "blocks",  # int32 [rows, BLOCKS.width]
        "block_ids",  # int64 [rows, BLOCK_IDS.width]: the blocks' chain keys
        "digests",  # int64 [rows, 4]: their SHA-256 chain keys ([0, 4] without block_digests)
        "tokens",  # int32 [rows, T]
        "slots",  # int32 [rows * L, SLOTS.width]
        "pages",  # int32 [pages, PAGES.width]
        "buckets",  # int32 [power of two]: child-index bucket heads (by key)
        "sibling_buckets",  # int32 [power of two]: heads by (parent row, first token)
        "block_free",  # int32 [rows]: free-row stack, and a launch's retired rows at its end
        "pool_start",  # int64 [L * levels]: where each pool's stack starts in page_free
        "pool_top",  # int64 [L * levels]: free storage slots of each pool
        "pool_size",  # int64 [L * levels]
        "page_free",  # int32 [pages]: per-pool stacks of free storage indices
        "row_start",  # int64 [L]: each life cycle's first page row
        "row_top",  # int64 [L]: free page rows of each life cycle
        "row_head",  # int64 [L]: the first of them, NULL for none (layout.FREE_ROW_NEXT links the rest)
        "copies",  # int32 [k, COPY_RECORDS.width]: page data copies of the current launch
        "lru_lists",  # int64 [L * levels * 2 * priorities, LRU_LISTS.width]: eviction candidates' lists
        "lru_groups",  # int64 [L * levels * 2, LRU_GROUPS.width]: their counts (kernels/lru.py)
        "no_host_room",  # int64 [L]: set when the host tier could not take a held page
        "counters",  # int64 [COUNTERS.width]
        "log",  # int64 [entries, LOG.width]
        "log_tokens",  # int32 [k, T]: tokens of blocks announced by EV_STORED_* records
        "lc_kind",  # int64 [L]
        "lc_window",  # int64 [L]
        "lc_sinks",  # int64 [L]: sink blocks
        "mm_digests",  # uint8 [k, 32]: interned multimodal digests (token -1-i)
        "work",  # uint32 [SHA256_WORK_WORDS]: scratch of the serial tree kernel
        "policy",  # int64 [POLICY_WIDTH]: config switches (commit_min_snapshot)
    ],
)

_DEVICE_FIELDS = frozenset(DeviceTables._fields)
UNKNOWN_DIGEST = -(2**31)  # stands for any digest no block holds
_SERIAL_AND_INFO = np.array([PAGE_SERIAL, PAGE_INFO])  # what tells whether a row still holds a given page


def _holds(table, rows: int, budget: int) -> bool:
    """Whether ``table`` stays as it is for a launch that needs ``rows`` of
    its rows: it has them, and it is within ``budget`` (or the launch alone
    needs more)."""
    have = table.shape[0]
    return have >= rows and (have <= budget or rows > budget)


class Tables:
    """Every array of one manager's index, on the backend's device."""

    def __init__(self, config: CacheConfig, backend: Backend):
        self.backend = backend
        self.config = config
        xp = backend.xp
        self.xp = xp
        T = config.tokens_per_block
        L = len(config.life_cycles)
        self.num_life_cycles = L
        self.tokens_per_block = T
        self.max_blocks = config.max_blocks  # None: grow by doubling
        self.log_budget = log_budget(T)  # (log rows, log_tokens rows) the change log is kept within
        sizes0 = preallocated_sizes(config)
        rows = sizes0["blocks"]
        self.blocks = xp.full((rows, BLOCKS.width), NULL, dtype=BLOCKS.dtype)
        self.blocks[:, BLK_INFO] = 0
        self.block_ids = xp.full((rows, BLOCK_IDS.width), NULL, dtype=BLOCK_IDS.dtype)
        self.digests = xp.full((self._digest_rows(rows), 4), NULL, dtype=np.int64)
        self.tokens = xp.zeros((rows, T), dtype=np.int32)
        self.slots = xp.full((rows * L, SLOTS.width), EMPTY_SLOT, dtype=SLOTS.dtype)
        # Rows and page indices fit 32 bits (``ROW_DTYPE``): the bucket heads
        # and free lists hold nothing else.
        self.buckets = xp.full(index_buckets(rows), NULL, dtype=ROW_DTYPE)
        self.sibling_buckets = xp.full(index_buckets(rows), NULL, dtype=ROW_DTYPE)
        # Pop order: row 0 first, so a young table is easy to read.
        self.block_free = xp.arange(rows - 1, -1, -1, dtype=ROW_DTYPE)
        self.counters = xp.zeros(COUNTERS.width, dtype=np.int64)
        self.counters[CNT_BLOCK_FREE_TOP] = rows

        gpu = config.pages_per_life_cycle_list()
        host = config.pages_per_life_cycle_list(host=True)
        assert NUM_LEVELS == 2
        sizes = np.array([n for lc in range(L) for n in (gpu[lc], host[lc])], dtype=np.int64)  # lc-major
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        per_lc = sizes.reshape(L, NUM_LEVELS).sum(axis=1) if L else np.zeros(0, dtype=np.int64)
        row_starts = np.concatenate([[0], np.cumsum(per_lc)[:-1]]).astype(np.int64)
        total = int(sizes.sum())
        pages = np.full((total, PAGES.width), NULL, dtype=PAGES.dtype)
        pages[:, PAGE_INFO] = page_info(PAGE_FREE, 0, PRIORITY_MIN)
        pages[:, PAGE_HOLDS] = 0  # nobody holds a free row (its two counts share the word)
        page_free = np.empty(total, dtype=ROW_DTYPE)
        for pool, (start, size) in enumerate(zip(starts, sizes)):
            page_free[start:start + size] = np.arange(size - 1, -1, -1)  # pop index 0 first
        # Each life cycle's free rows, linked through the rows themselves in
        # ascending order: the lowest row is taken first.
        pages[:, FREE_ROW_NEXT] = np.arange(1, total + 1)
        row_ends = row_starts + per_lc
        pages[row_ends[per_lc > 0] - 1, FREE_ROW_NEXT] = NULL
        row_head = np.where(per_lc > 0, row_starts, NULL).astype(np.int64)
        self.num_pages = total
        # Not zeroed: the kernels clear each record as they append it. Sized
        # per launch (``ensure_log``), never for the whole pool.
        self.log = xp.empty((sizes0["log"], LOG.width), dtype=np.int64)
        self.pages = backend.to_device(pages)
        self.page_free = backend.to_device(page_free)
        self.pool_start = backend.to_device(starts)
        self.pool_top = backend.to_device(sizes.copy())
        self.pool_size = backend.to_device(sizes.copy())
        self.row_start = backend.to_device(row_starts)
        self.row_top = backend.to_device(per_lc.astype(np.int64).copy())
        self.row_head = backend.to_device(row_head)
        # A page moves at most twice per launch (down to the host, back up on a
        # lock) and every allocation copies at most once: 3P + 16 copies, or
        # the budget when that is fewer (launches are split to fit it).
        self.copy_budget = copy_budget(total)
        # Launches are split to fit it only when it holds fewer than any launch may record.
        self.copy_room = self.copy_budget if self.copy_budget < 3 * total + COPY_SLACK else None
        self.copies = xp.zeros((self.copy_budget, COPY_RECORDS.width), dtype=COPY_RECORDS.dtype)
        groups = max(1, L) * NUM_LEVELS * NUM_HELD
        self.lru_lists = xp.full((groups * NUM_PRIORITIES, LRU_LISTS.width), NULL, dtype=np.int64)
        lru_groups = np.zeros((groups, LRU_GROUPS.width), dtype=np.int64)
        lru_groups[:, LG_LOWEST] = PRIORITY_MIN + NUM_PRIORITIES  # empty: no priority below it holds a page
        self.lru_groups = backend.to_device(lru_groups)
        self.no_host_room = xp.zeros(max(1, L), dtype=np.int64)
        self.log_tokens = xp.zeros((sizes0["log_tokens"], max(1, T)), dtype=np.int32)

        kind, window, sinks = config.life_cycle_arrays()
        self.lc_kind = backend.to_device(kind)
        self.lc_window = backend.to_device(window)
        self.lc_sinks = backend.to_device(sinks)
        self.mm_digests = xp.zeros((1, 32), dtype=np.uint8)
        self.num_mm_digests = 0  # rows of mm_digests ever used (freed rows are reused)
        self._mm_index: dict[bytes, int] = {}
        self._mm_free: list[int] = []  # reclaimed rows
        self._mm_young: set[int] = set()  # interned since the last collection: kept
        self._mm_collect_at = 64
        # Token arrays outside these tables that may hold digest ids (the arena,
        # the caches' committed tokens); the manager sets it.
        self.digest_references = lambda: ()
        self.work = xp.zeros(SHA256_WORK_WORDS, dtype=np.uint32)
        policy = np.zeros(POLICY_WIDTH, dtype=np.int64)
        policy[POLICY_COMMIT_MIN_SNAPSHOT] = int(config.commit_min_snapshot)
        scratch = config.swa_scratch_reuse
        policy[POLICY_SCRATCH_REWIND] = -1 if scratch is None else scratch.max_rewind_len
        policy[POLICY_STABLE_PAGES] = int(config.stable_pages)
        policy[POLICY_BLOCK_DIGESTS] = int(config.block_digests)
        self.policy = backend.to_device(policy)
        self.read_log_records(config.max_kv_event_entries > 0)

    def read_log_records(self, wanted: bool) -> None:
        """Whether the kernels write change-log records (someone reads them:
        the event manager, or a test's sink). Unread, the log needs no room
        and stays as small as it is."""
        self.log_read = bool(wanted)
        self.policy[POLICY_LOG_RECORDS] = int(wanted)

    # -- views ------------------------------------------------------------------
    @property
    def device(self) -> DeviceTables:
        """The arrays the kernels take, as one tuple; built again only after
        one of them was replaced (a table grew)."""
        d = self.__dict__.get("_device")
        if d is None:
            d = self._device = DeviceTables(*(getattr(self, f) for f in DeviceTables._fields))
        return d

    def __setattr__(self, name, value):
        if name in _DEVICE_FIELDS:
            self.__dict__.pop("_device", None)
        object.__setattr__(self, name, value)

    @property
    def num_rows(self) -> int:
        return int(self.blocks.shape[0])

    def counters_host(self) -> np.ndarray:
        return self.backend.to_host(self.counters)

    def renumber_ticks(self) -> None:
        """Give the pages' LRU ticks the smallest values that keep their order
        (ties stay ties), and the clocks the counts: a page's tick is 32 bits
        wide, the manager's clock never stops. Between launches, once either
        clock passes ``layout.TICK_RENUMBER_AT``: a few sorts over the pool,
        once per billion schedules. NULL (never scheduled) stays NULL,
        between the evict-first pushes below it and the clock's ticks."""
        xp = self.xp
        tick = self.pages[:, PAGE_LRU_TICK].astype(np.int64)
        live = info_state(self.pages[:, PAGE_INFO]) != PAGE_FREE  # a free row's tick is rewritten when taken
        later, first = live & (tick > NULL), live & (tick < NULL)
        ticks, rank = xp.unique(tick[later], return_inverse=True)
        pushes, push_rank = xp.unique(tick[first], return_inverse=True)  # the newest push is the lowest
        tick[later] = rank.reshape(-1)
        tick[first] = NULL - pushes.size + push_rank.reshape(-1)
        self.pages[:, PAGE_LRU_TICK] = tick.astype(PAGES.dtype)
        self.counters[CNT_TICK] = ticks.size
        self.counters[CNT_EVICT_FIRST] = pushes.size

    def obtainable_pages(self, lc: int, level: int) -> int:
        """The pages an allocation at ``level`` of life cycle ``lc`` could
        have now without touching a locked page: the free slots, the unheld
        candidates eviction may drop, and on the GPU the held (suspended)
        candidates while the host tier has room for them. The kernels' own
        ``available`` (kernels/evict.py) with nothing of the caller's; from the
        counts the eviction lists keep, so it costs the same for any pool:
        three small reads, then plain ints."""
        to_host = self.backend.to_host
        pool = lc * NUM_LEVELS  # the GPU pool; the host tier's is the next
        free = to_host(self.pool_top[pool:pool + NUM_LEVELS]).tolist()
        # The groups of the life cycle's pools, (level, held) in order.
        counts = to_host(self.lru_groups[pool * NUM_HELD:(pool + NUM_LEVELS) * NUM_HELD, LG_COUNT]).tolist()
        out = free[level] + counts[level * NUM_HELD]
        if level == 0 and int(to_host(self.pool_size[pool + 1:pool + 2])[0]) > 0:
            out += min(counts[1], free[1] + counts[NUM_HELD])  # held GPU pages the host tier has room for
        return out

    # -- growth -----------------------------------------------------------------
    def ensure_free_blocks(self, needed: int):
        """Make sure ``needed`` block rows can be allocated without growing."""
        free = int(self.counters_host()[CNT_BLOCK_FREE_TOP])
        if free >= needed:
            return
        if self.max_blocks is not None:
            raise IndexFullError(
                f"the index is full: this call needs {needed} free block rows, {free} of max_blocks={self.max_blocks} "
                "are free (blocks leave the tree when eviction drops their pages; raise CacheConfig.max_blocks, "
                "or leave it None to let the tables grow)"
            )
        old = self.num_rows
        live = old - free
        new = old
        while new - live < needed:
            new *= 2
        self._grow_blocks(old, new, free)

    def _grow_blocks(self, old: int, new: int, free: int):
        xp = self.xp
        L = self.num_life_cycles
        extra = new - old
        blocks = xp.full((new, BLOCKS.width), NULL, dtype=BLOCKS.dtype)
        blocks[:old] = self.blocks
        blocks[old:, BLK_INFO] = 0
        block_ids = xp.full((new, BLOCK_IDS.width), NULL, dtype=BLOCK_IDS.dtype)
        block_ids[:old] = self.block_ids
        digests = xp.full((self._digest_rows(new), 4), NULL, dtype=np.int64)
        digests[:self.digests.shape[0]] = self.digests
        tokens = xp.zeros((new, self.tokens_per_block), dtype=np.int32)
        tokens[:old] = self.tokens
        slots = xp.full((new * L, SLOTS.width), EMPTY_SLOT, dtype=SLOTS.dtype)
        slots[: old * L] = self.slots
        block_free = xp.empty(new, dtype=ROW_DTYPE)
        # New rows go under the existing free entries, lowest popped first.
        block_free[:extra] = xp.arange(new - 1, old - 1, -1, dtype=ROW_DTYPE)
        block_free[extra:extra + free] = self.block_free[:free]
        # A launch whose aftermath is pending keeps its retired rows' entries at the end.
        retired = int(self.counters_host()[CNT_RETIRED])
        if retired:
            block_free[new - retired:] = self.block_free[old - retired:]
        self.blocks, self.block_ids, self.digests, self.tokens, self.slots = blocks, block_ids, digests, tokens, slots
        self.block_free = block_free
        self.counters[CNT_BLOCK_FREE_TOP] = free + extra
        self._rebuild_index(index_buckets(new))

    def _digest_rows(self, rows: int) -> int:
        """Rows of the digest table: one per block row, or none when the
        tree keeps no digests (the kernels then never touch it)."""
        return rows if self.config.block_digests else 0

    def _rebuild_index(self, num_buckets: int):
        """Re-chain every indexed row into new buckets: attached blocks and roots
        by key, attached non-root blocks by (parent row, first token)."""
        xp = self.xp
        info = self.blocks[:, BLK_INFO]  # the FLAG_* bits are its low ones
        attached = (info & (FLAG_IN_USE | FLAG_ATTACHED)) == (FLAG_IN_USE | FLAG_ATTACHED)
        rows = xp.nonzero(attached)[0]
        mask = num_buckets - 1
        self.buckets = self._chain(rows, self.block_ids[rows, BID_KEY] & mask, BLK_HASH_NEXT, num_buckets)
        rows = xp.nonzero(attached & ((info & FLAG_ROOT) == 0))[0]
        h = sibling_hash_np(self.backend.to_host(self.blocks[rows, BLK_PARENT]), self.backend.to_host(self.tokens[rows, 0]))
        b = self.backend.to_device((h & np.uint64(mask)).astype(np.int64))
        self.sibling_buckets = self._chain(rows, b, BLK_FIRST_NEXT, num_buckets)

    def _chain(self, rows, bucket_of_row, next_col: int, num_buckets: int):
        """Bucket heads for ``rows`` and their chain links, written vectorized."""
        xp = self.xp
        heads = xp.full(num_buckets, NULL, dtype=ROW_DTYPE)
        self.blocks[:, next_col] = NULL
        if rows.size:
            order = xp.argsort(bucket_of_row, kind="stable") if xp is np else xp.argsort(bucket_of_row)
            rows, b = rows[order], bucket_of_row[order]
            nxt = xp.full(rows.size, NULL, dtype=BLOCKS.dtype)
            nxt[:-1] = xp.where(b[1:] == b[:-1], rows[1:], NULL)
            self.blocks[rows, next_col] = nxt
            first = xp.ones(rows.size, dtype=bool)
            first[1:] = b[1:] != b[:-1]
            heads[b[first]] = rows[first]
        return heads

    def still_committed(self, rows, serials) -> np.ndarray:
        """Whether each page row of ``rows`` still holds the committed page of
        that serial (the page a planned drop named), as a bool host array;
        only those rows leave the device."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size == 0:
            return np.zeros(0, dtype=bool)
        b = self.backend
        now = b.to_host(self.pages[b.to_device(rows[:, None]), _SERIAL_AND_INFO])
        return (now[:, 0] == np.asarray(serials)) & (info_state(now[:, 1]) == PAGE_COMMITTED)

    def page_serials(self, rows) -> np.ndarray:
        """The serials (``PAGE_SERIAL``, as int64) of the given page rows, as
        a host array; only those rows leave the device."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size == 0:
            return np.zeros(0, dtype=np.int64)
        return np.array(self.backend.to_host(self.pages[self.backend.to_device(rows), PAGE_SERIAL]), dtype=np.int64)

    # -- multimodal digests -----------------------------------------------------
    def intern_digest(self, digest: bytes) -> int:
        """The token id standing for a 32-byte multimodal digest (negative).

        A digest stays interned while a block, a cache or a registered
        sequence holds its id; the others are reclaimed now and then (see
        ``_collect_digests``), so a stream of distinct images does not grow
        the table for ever."""
        i = self._mm_index.get(digest)
        if i is None:
            if len(self._mm_index) >= self._mm_collect_at:
                self._collect_digests()
            if self._mm_free:
                i = self._mm_free.pop()
            else:
                i = self.num_mm_digests
                if i >= self.mm_digests.shape[0]:
                    grown = self.xp.zeros((2 * self.mm_digests.shape[0], 32), dtype=np.uint8)
                    grown[:i] = self.mm_digests
                    self.mm_digests = grown
                self.num_mm_digests = i + 1
            self.mm_digests[i] = self.xp.asarray(np.frombuffer(digest, dtype=np.uint8))
            self._mm_index[digest] = i
            self._mm_young.add(i)
        return -1 - i

    def _collect_digests(self):
        """Free the rows of digests no token array refers to: not a block of
        these tables, not the arrays ``digest_references`` names. Digests
        interned since the last collection are kept (a call interning several
        may not have stored the first ones yet); the next one frees them."""
        xp = self.xp
        in_use = xp.nonzero(self.blocks[:, BLK_INFO] & FLAG_IN_USE)[0]
        held = [self.tokens[in_use].reshape(-1), *self.digest_references()]
        ids = [np.asarray(self.backend.to_host(a[a < 0])) for a in held if a.shape[0]]
        live = np.unique(np.concatenate(ids)) if ids else np.zeros(0, dtype=np.int32)
        live_rows = set((-1 - live[live > UNKNOWN_DIGEST].astype(np.int64)).tolist()) | self._mm_young
        for digest, i in list(self._mm_index.items()):
            if i not in live_rows:
                del self._mm_index[digest]
                self._mm_free.append(i)
        self._mm_young = set()
        self._mm_collect_at = max(64, 2 * len(self._mm_index))

    def lookup_digest(self, digest: bytes) -> int:
        """The token id of a digest for a lookup: its interned id, or an id no
        block ever holds when the digest was never stored (so lookups do not
        grow the table)."""
        i = self._mm_index.get(digest)
        return UNKNOWN_DIGEST if i is None else -1 - i

    def digest_of_token(self, token: int) -> bytes:
        return bytes(self.backend.to_host(self.mm_digests[-1 - token]))

    # -- the change log ----------------------------------------------------------
    def ensure_log_tokens(self, blocks: int, kept: int | None = None):
        """Room for the tokens of ``blocks`` announced blocks in one launch
        (keeping the ``kept`` rows of records not consumed yet; None: read
        from the counters)."""
        k = int(self.counters_host()[CNT_LOG_TOKENS_LEN]) if kept is None else kept
        table = self._sized(self.log_tokens, k + blocks, k, self.log_budget[1], np.int32, zero=True)
        if table is not self.log_tokens:  # a store would make the kernels' table tuple anew
            self.log_tokens = table

    def ensure_log(self, blocks: int, announced: int = 0, settled: bool = False):
        """Room in the change log, and in ``log_tokens``, for one launch of an
        operation on up to ``blocks`` blocks (those it may create, and per
        life cycle the pages it may allocate, release or move, with their
        eviction victims) that announces up to ``announced`` blocks.

        What one launch logs: per block it creates a creation (its root's
        too); per page it touches a death, or up to two migrations (an
        allocation evicts a victim, and moving it to the host tier may drop a
        host page); and an announcement with one page info per life cycle
        for every announced block. Removals are not logged but retired
        (``layout.RETIRED_*``), so a page death that takes a whole subtree
        needs no room here. Records an earlier launch left unconsumed (its
        aftermath was interrupted) stay in front and count against the room.

        Within the budget the log grows on demand; a launch that alone needs
        more (one cache's call over more blocks than the budget covers) gets
        it for that launch, and the next launch that needs less than the
        budget gives it back. While nobody reads the records
        (``read_log_records``) the kernels write none, and the log and
        ``log_tokens`` are left as they are.

        ``settled``: the last launch's aftermath is complete, so it left no
        record, token row or copy behind (its counters were reset) and the
        counters need no read (on ``cuda``, a transfer)."""
        read = self.log_read
        rows = log_rows_for(blocks, announced, self.num_life_cycles) if read else 0
        # The copy list: counted from 0 at the kernel (a pending launch's
        # copies are carried out first), never more than the pool's bound.
        need = min(copy_rows_for(blocks, self.num_life_cycles), 3 * self.num_pages + COPY_SLACK)
        if settled:
            if _holds(self.copies, need, self.copy_budget) and (not read or (
                    _holds(self.log, rows, self.log_budget[0]) and _holds(self.log_tokens, announced, self.log_budget[1]))):
                return  # the usual case: every table holds the launch as it is
            kept = kept_tokens = copies = 0
        else:
            counters = self.counters_host()
            kept, kept_tokens = int(counters[CNT_LOG_LEN]), int(counters[CNT_LOG_TOKENS_LEN])
            copies = int(counters[CNT_NUM_COPIES])
        if read:  # unread, the kernels write no record: the log needs no room
            self.ensure_log_tokens(announced, kept_tokens)
            table = self._sized(self.log, kept + rows, kept, self.log_budget[0], np.int64)
            if table is not self.log:
                self.log = table
        need = max(copies, need)
        table = self._sized(self.copies, need, copies, self.copy_budget, COPY_RECORDS.dtype, zero=True, fixed=True)
        if table is not self.copies:
            self.copies = table

    def _sized(self, table, rows: int, kept: int, budget: int, dtype, zero: bool = False, fixed: bool = False):
        """``table`` with room for ``rows`` rows, its first ``kept`` kept:
        grown on demand (doubling, up to ``budget`` while that is enough;
        ``fixed``: it starts at the budget), and back to ``budget`` once a
        launch needs no more than it."""
        if _holds(table, rows, budget):
            return table
        have = table.shape[0]
        if rows > budget:
            new = rows  # one launch beyond the budget: just what it needs
        elif self.max_blocks is not None or fixed or have > budget:
            new = budget
        else:
            new = min(budget, max(rows, 2 * have))
        make = self.xp.zeros if zero else self.xp.empty  # the kernels clear each record as they append it
        grown = make((new,) + tuple(table.shape[1:]), dtype=dtype)
        grown[:kept] = table[:kept]
        return grown

    def read_log(self, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The first ``n`` log records and ``k`` announced token rows, as host
        copies; the log keeps them until the launcher resets its counters."""
        records = np.array(self.backend.to_host(self.log[:n]))
        return records, np.array(self.backend.to_host(self.log_tokens[:k]))

    def read_retired(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The launch's first ``n`` retired rows (``layout.RETIRED_*``), in
        order: ``(rows, kinds, log positions)``, host copies."""
        if n == 0:
            z = np.zeros(0, dtype=np.int64)
            return z, z, z
        size = self.block_free.shape[0]
        rows = self.block_free[size - n:][::-1]
        tag = np.array(self.backend.to_host(self.blocks[rows, RETIRED_TAG]), dtype=np.int64)
        return np.array(self.backend.to_host(rows), dtype=np.int64), tag & 3, tag >> 2

    def digests_of(self, rows: np.ndarray) -> np.ndarray:
        """The chain digests ([n, 4] int64) of block rows, a host copy: read
        for retired rows before they are returned (nothing reused them yet)."""
        d = self.backend.to_host(self.digests[self.backend.to_device(rows)])
        return np.array(d).reshape(len(rows), 4)

    def return_rows(self, rows: np.ndarray) -> None:
        """Push retired rows that were freed on the free stack, in the order
        they were freed, and empty the retired list (the log counters are
        the caller's). Repeatable: the stack top moves in the same store."""
        top = int(self.counters_host()[CNT_BLOCK_FREE_TOP])
        if rows.size:
            self.block_free[top:top + rows.size] = self.backend.to_device(rows.astype(ROW_DTYPE))
        self.counters[self.backend.to_device(np.array([CNT_BLOCK_FREE_TOP, CNT_RETIRED]))] = self.backend.to_device(
            np.array([top + rows.size, 0], dtype=np.int64))

    def read_copies(self, n: int) -> np.ndarray:
        """The first ``n`` recorded page data copies, as an int64 host copy."""
        return copies_table(self.backend.to_host(self.copies[:n]))

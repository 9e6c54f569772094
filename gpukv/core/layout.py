"""Record layouts of the device tables, declared once.

Every table is a 2-D integer array on the backend's device, one row per record
and one column per field (CuPy has no structured dtypes). Kernels index columns
with the constants declared here (``BLK_PARENT``, ``PAGE_COVERAGE``...); the
host views the same memory as a NumPy structured array with named fields
(``introspect.tables``). Outside this module no code uses bare column numbers.

The kernels' argument blocks (what ``args`` and ``out`` of a launch hold, per
operation) and the small records (the eviction lists and their groups,
sequence scalars, match results, walk lanes) are layouts too. Each field gets
a plain-assignment constant (``BLK_PARENT = 1``) so grep and IDEs find it;
``_check_columns`` fails at import when one disagrees with its layout.

Longer than the other modules on purpose: it is nothing but declarations, and
one place for all of them is the point.
"""

from __future__ import annotations

import numpy as np

from .config import PRIORITY_MAX, PRIORITY_MIN

NULL = -1  # "no row": an empty slot, a missing parent, the end of a list
# Block rows, page rows and pool indices are below 2**31: tables that hold
# nothing else (block and page records, bucket heads, free lists, copies,
# slots) are this narrow. Keys, digests and counters stay 64-bit, in tables
# of their own beside the records (BLOCK_IDS, digests, COUNTERS).
ROW_DTYPE = np.int32


class Layout:
    """A record layout: ordered field names (with optional widths) over one dtype."""

    def __init__(self, name: str, dtype, fields: list[tuple[str, int]]):
        self.name = name
        self.dtype = np.dtype(dtype)
        self.fields = fields
        self.columns: dict[str, int] = {}
        col = 0
        for field, width in fields:
            self.columns[field] = col
            col += width
        self.width = col
        self.record = np.dtype(
            [(f, self.dtype, (w,)) if w > 1 else (f, self.dtype) for f, w in fields]
        )

    def col(self, field: str) -> int:
        return self.columns[field]

    def view(self, host_table: np.ndarray) -> np.ndarray:
        """The table as a structured array (one record per row, named fields)."""
        t = np.ascontiguousarray(host_table)
        return t.view(self.record).reshape(t.shape[0])


# One row per tree block; roots are blocks too (no tokens, no parent).
BLOCKS = Layout(
    "blocks",
    np.int32,
    [
        # The fields a walk reads per hop come first, so they share a cache line.
        ("parent", 1),  # parent row; NULL for a root and for an orphan
        # Its token count (1..T, T for a full block; 0 for a root) and its
        # FLAG_* bits, packed (``block_info`` below).
        ("info", 1),
        ("hash_next", 1),  # next row in this key's child-index bucket
        ("first_next", 1),  # next row in this (parent, first token) bucket
        # Children in insertion order: a list linked both ways whose first
        # member's ``prev_sibling`` names the last (``kernels/blocks.py``),
        # so a parent keeps one end and still appends in O(1). A root has
        # no siblings: its ``prev_sibling`` holds its reuse scope's interned
        # id instead (``ROOT_SCOPE``); every other block is in its root's
        # scope. A block's ordinal is its depth below its root, which the
        # kernels that need it know from the sequence they walk.
        ("first_child", 1),
        ("next_sibling", 1),
        ("prev_sibling", 1),
        ("refs", 1),  # sequences referring to this row (keeps an orphan's row alive)
        # Creation order (siblings' insertion order), and what tells a block
        # from a later one in its row. 32 bits that wrap: blocks compare by
        # the sign of their serials' 32-bit difference (``index.created_before``),
        # right for any two created fewer than 2**31 creations apart, as
        # siblings that tie on a match are in any tree an engine keeps.
        ("serial", 1),
    ],
)
# The 64-bit field of each block row, beside BLOCKS (same row numbers): its
# key, kept apart so every other field is 32 bits wide. The reference
# SHA-256 chain key of each row, when the tree keeps one
# (``CacheConfig.block_digests``), is a table of its own too (``digests``,
# 4 int64 per row, 32 bytes in memory order).
BLOCK_IDS = Layout(
    "block_ids",
    np.int64,
    [
        ("key", 1),  # fast 64-bit chain key: mix(parent key, content hash)
    ],
)
FLAG_IN_USE = 1  # the row holds a block (attached or orphan)
FLAG_ATTACHED = 2  # reachable from a root
FLAG_ROOT = 4
# A block's ``info``: its FLAG_* bits low, its token count above them, so a
# walk reads both in one load. Kernels compile these functions
# (``kernels/index.py``); the host applies them to whole columns.
BLOCK_FLAG_BITS = 3
FLAG_MASK = (1 << BLOCK_FLAG_BITS) - 1


def block_info(num_tokens, flags):
    return (num_tokens << BLOCK_FLAG_BITS) | flags


def info_num_tokens(info):
    return info >> BLOCK_FLAG_BITS


def info_flags(info):
    return info & FLAG_MASK


# One row per (block, life cycle): row = block * num_life_cycles + life_cycle.
# A slot's one int32 word holds its page's row and, in the low bit, whether
# that page covers all T tokens: the slot's coverage is its page's
# (``kernels/pages.coverage``), and pruning reads a whole page's without
# loading the page. An empty slot holds ``EMPTY_SLOT`` (page NULL, not whole).
SLOTS = Layout("slots", np.int32, [("word", 1)])


def slot_word(page, whole):
    return (page << 1) | whole


def slot_page(word):
    return word >> 1  # arithmetic: NULL stays NULL


def slot_whole(word):
    return word & 1


EMPTY_SLOT = slot_word(NULL, 0)

# One row per page of every life cycle's pool (all cache levels).
PAGES = Layout(
    "pages",
    np.int32,
    [
        # Its life cycle is not a field: each owns a run of rows (``row_start``).
        ("block", 1),  # the block whose slot links this page; NULL = unlinked
        # Its state (PAGE_* below), cache level (0 = GPU, 1 = host),
        # eviction priority and eviction list, and its coverage (the leading
        # tokens of its block it holds valid data for), packed (``page_info``
        # below).
        ("info", 1),
        # The sequences holding the page, and those of them holding it
        # locked on the GPU, packed (``page_holds`` below).
        ("holds", 1),
        ("pool_index", 1),  # its index in the life cycle's pool of its level
        # Its neighbours in its eviction list (kernels/lru.py), oldest
        # first; NULL when it is no candidate. A free row's ``lru_next``
        # links it into its life cycle's free rows (``FREE_ROW_NEXT``).
        ("lru_prev", 1),
        ("lru_next", 1),
        # The row's allocations so far: tells a page from a later one in the
        # same row (a planned drop, which the host counts by page and serial;
        # a cache's page list). Only ever compared
        # for equality, so 32 bits wrap harmlessly: a stale handle would need
        # 2**32 allocations of its row to pass for the page it named.
        ("serial", 1),
        # When it last became evictable (LRU order): the manager's clock
        # (``CNT_TICK``), or below every tick for an evict-first push
        # (``CNT_EVICT_FIRST``), NULL before it ever was. A clock that never
        # stops would outgrow 32 bits, so the host renumbers the ticks, keeping
        # their order, before either count reaches ``TICK_RENUMBER_AT``
        # (``Tables.renumber_ticks``).
        ("lru_tick", 1),
    ],
)
TICK_RENUMBER_AT = 1 << 30  # far below 2**31: no launch schedules that many pages
PAGE_FREE = 0
PAGE_UNCOMMITTED = 1
PAGE_COMMITTED = 2
# A page's ``info``: its state in the low two bits, its cache level in the
# next, then whether it is an eviction candidate and whether in its group's
# list of held pages (its list is that of its life cycle, level and priority
# in that group: ``kernels/lru.py``), its priority above (less PRIORITY_MIN:
# 7 bits), and its coverage at the top (0..T, T at most 4096: 13 bits). Read
# and written only through these functions, which the kernels compile
# (``kernels/lru.py``) and the host applies to whole columns.
INFO_LEVEL_SHIFT = 2
INFO_LISTED_SHIFT = 3
INFO_HELD_SHIFT = 4
INFO_PRIORITY_SHIFT = 5
INFO_COVERAGE_SHIFT = 12


def page_info(state, level, priority):
    """The ``info`` word of a page in ``state`` at ``level`` of ``priority``,
    in no eviction list, covering nothing."""
    return state | (level << INFO_LEVEL_SHIFT) | ((priority - PRIORITY_MIN) << INFO_PRIORITY_SHIFT)


def info_state(info):
    return info & ((1 << INFO_LEVEL_SHIFT) - 1)


def info_level(info):
    return (info >> INFO_LEVEL_SHIFT) & 1


def info_priority(info):
    return ((info >> INFO_PRIORITY_SHIFT) & ((1 << (INFO_COVERAGE_SHIFT - INFO_PRIORITY_SHIFT)) - 1)) + PRIORITY_MIN


# A page's ``holds``: its holders times ``ONE_HOLDER`` plus its locks, so
# taking or dropping a hold is one addition and "nobody holds it" one
# comparison with 0. Each count is at most the caches alive at once, which a
# manager keeps at or below ``MAX_CACHES`` (``CachePool``): the word stays
# below 2**31.
HOLDS_LOCK_BITS = 16
ONE_LOCK = 1
ONE_HOLDER = 1 << HOLDS_LOCK_BITS
MAX_CACHES = (1 << (31 - HOLDS_LOCK_BITS)) - 1


def page_holds(holders, locks):
    return holders * ONE_HOLDER + locks * ONE_LOCK


def holds_holders(holds):
    return holds >> HOLDS_LOCK_BITS


def holds_locks(holds):
    return holds & (ONE_HOLDER - 1)


def info_coverage(info):
    return info >> INFO_COVERAGE_SHIFT


def with_coverage(info, coverage):
    return (info & ((1 << INFO_COVERAGE_SHIFT) - 1)) | (coverage << INFO_COVERAGE_SHIFT)


def info_listed(info):
    """1 when the page is an eviction candidate (in a list), else 0."""
    return (info >> INFO_LISTED_SHIFT) & 1


def info_held(info):
    """Of a listed page: 1 when its list is its group's of held pages."""
    return (info >> INFO_HELD_SHIFT) & 1


def with_listing(info, listed, held):
    keep = ~((1 << INFO_LISTED_SHIFT) | (1 << INFO_HELD_SHIFT))
    return (info & keep) | (listed << INFO_LISTED_SHIFT) | (held << INFO_HELD_SHIFT)


def with_state(info, state):
    return (info & ~((1 << INFO_LEVEL_SHIFT) - 1)) | state


def with_level(info, level):
    return (info & ~(1 << INFO_LEVEL_SHIFT)) | (level << INFO_LEVEL_SHIFT)


# The tree's change log, drained by the host after each launch: the raw
# material of KV cache events (``events.py``) and of tests that watch the tree.
# Digests are copied in so a record outlives its row.
LOG = Layout(
    "log",
    np.int64,
    [
        ("kind", 1),  # EV_* below
        ("life_cycle", 1),
        ("block", 1),
        ("digest", 4),  # the block's SHA-256 chain key
        ("parent_digest", 4),  # EV_STORED_*: the parent's key ...
        ("parent_is_root", 1),  # ... and whether the parent is a scope root
        ("num_tokens", 1),  # EV_STORED_*: the block's token count
        ("tokens_at", 1),  # EV_STORED_*: the row of ``log_tokens`` holding its tokens
        ("covers", 1),  # EV_PAGE_INFO: 1 when the page covers the whole block
        ("level", 1),  # EV_PAGE_INFO, EV_UPDATED: the page's cache level (new level)
        ("old_level", 1),  # EV_UPDATED: the level it left
        ("priority", 1),  # EV_PAGE_INFO, EV_UPDATED
    ],
)
EV_REMOVED = 1  # a block left the tree (detached)
EV_REMOVED_LIFE_CYCLE = 2  # one life cycle's page of a block died
EV_CREATED = 3  # a block was created
EV_ROOT_REMOVED = 4  # a root lost its last child and was freed
# Announcements for KV cache events (docs/semantics.md §4). A header is followed by
# one EV_PAGE_INFO record per life cycle whose slot holds a page, ascending.
EV_STORED_BLOCK = 5  # stored_block(b): announce every life cycle that covers b
EV_STORED_LIFE_CYCLE = 6  # stored_life_cycle(b, lc)
EV_PAGE_INFO = 7
EV_UPDATED = 8  # a linked page moved between cache levels

# Scalars the kernels update, one int64 each.
COUNTERS = Layout(
    "counters",
    np.int64,
    [
        ("block_free_top", 1),  # entries on the block free-list stack
        ("log_len", 1),
        ("tick", 1),  # logical clock for LRU order
        ("error", 1),  # ERR_* set by a kernel that had to stop
        ("live_blocks", 1),
        ("serial", 1),  # the next block serial
        ("detaches", 1),  # blocks detached so far: memoized matches older than this re-check
        ("log_tokens_len", 1),  # rows of ``log_tokens`` in use (drained with the log)
        ("num_copies", 1),  # page data copies recorded by the current launch
        ("evicted", 1),  # pages evicted from the GPU so far (migrated or dropped)
        ("migrated", 1),  # ... of which moved to the host tier
        ("dropped", 1),  # pages dropped from their last cache level (they died)
        ("evict_first", 1),  # evict-first pushes so far (they take ticks below zero)
        ("retired", 1),  # entries of the retired-row list of the current launch (below)
        ("unlinks", 1),  # pages severed from their blocks so far: with detaches, what ages a match (Launcher.removals)
        # Detaches of blocks a cache refers to (``BLK_REFS > 0``): every block
        # of an open cache's committed chain is referred to by it, so while
        # this count stays the same, every such chain stays whole in the tree
        # (eviction's victims, held by no cache, do not move it).
        ("held_detaches", 1),
    ],
)
# Block rows a launch detaches or frees are retired, not reused in that launch:
# each gets one entry at the end of ``block_free`` (the n-th at index
# ``rows - 1 - n``), its row, and the row records ``log position * 4 + kind``
# in its ``RETIRED_TAG`` field, the log position being the log's length when
# it happened (a row is retired at most once a launch). The row keeps its
# digest until the host has drained the launch, so a removal costs no
# change-log row (a page death may remove a whole subtree: a log sized for it
# would be sized for every row). The host turns the entries into EV_REMOVED /
# EV_ROOT_REMOVED records in their place among the log's, then pushes the
# freed rows on the free stack. Between launches the list is empty.
RETIRED_FREED = 0  # freed, nothing to report (an orphan whose last reference went, a childless root)
RETIRED_REMOVED = 1  # detached, still referenced (an orphan): EV_REMOVED, not freed
RETIRED_REMOVED_FREED = 2  # detached and freed: EV_REMOVED
RETIRED_ROOT_REMOVED = 3  # a root that lost its last child, freed: EV_ROOT_REMOVED
ERR_NONE = 0
ERR_OUT_OF_BLOCKS = 1
ERR_LOG_FULL = 2
ERR_NON_FULL_PARENT = 3
ERR_COPIES_FULL = 4
ERR_NO_PAGE = 5  # an allocation the all-or-nothing check had promised found no page


# Manager-wide switches the kernels read (DeviceTables.policy).
POLICY = Layout(
    "policy",
    np.int64,
    [
        ("commit_min_snapshot", 1),
        ("scratch_rewind", 1),  # swa_scratch_reuse.max_rewind_len, -1 when off
        ("stable_pages", 1),  # 1: a cache's pages stay its own until it closes (no rebase)
        ("block_digests", 1),  # 1: a created block gets its SHA-256 chain digest
        ("log_records", 1),  # 1: someone reads the change log (events, a test's sink); 0: no record is written
    ],
)

# Page data copies a launch decided on, carried out by the host in order:
# storage addresses, so a migration is a copy too. The host reads them as
# COPIES (``Tables.read_copies``, ``page_memory.PageCopies``); the device's
# list (DeviceTables.copies) holds COPY_RECORDS, with the life cycle and the
# two levels packed in one word (``copy_route``).
COPIES = Layout(
    "copies",
    np.int64,
    [("life_cycle", 1), ("src_level", 1), ("src_index", 1), ("dst_level", 1), ("dst_index", 1)],
)
COPY_RECORDS = Layout("copy_records", ROW_DTYPE, [("route", 1), ("src_index", 1), ("dst_index", 1)])


def copy_route(life_cycle, src_level, dst_level):
    return (life_cycle << 2) | (src_level << 1) | dst_level


def copies_table(records: np.ndarray) -> np.ndarray:
    """COPY_RECORDS rows (a host copy) as COPIES rows, int64."""
    route = records[:, CREC_ROUTE].astype(np.int64)
    out = np.empty((records.shape[0], COPIES.width), dtype=np.int64)
    out[:, COPY_LIFE_CYCLE] = route >> 2
    out[:, COPY_SRC_LEVEL] = (route >> 1) & 1
    out[:, COPY_DST_LEVEL] = route & 1
    out[:, COPY_SRC_INDEX] = records[:, CREC_SRC_INDEX]
    out[:, COPY_DST_INDEX] = records[:, CREC_DST_INDEX]
    return out

# The eviction candidates' lists (DeviceTables.lru_lists, kernels/lru.py):
# one row per (life cycle, cache level, held or not, priority), the ends of a
# doubly linked list of page rows sorted by lru_tick, oldest first.
LRU_LISTS = Layout("lru_lists", np.int64, [("head", 1), ("tail", 1)])

# One row per group of those lists, (life cycle, cache level, held or not)
# (DeviceTables.lru_groups): its candidates, which are what eviction could
# free without a scan, and a lower bound of its lowest non-empty priority.
LRU_GROUPS = Layout("lru_groups", np.int64, [("count", 1), ("lowest", 1)])

# The scalars of one sequence (SeqTables.scalars).
SEQ_SCALARS = Layout(
    "seq_scalars",
    np.int64,
    [
        ("num_blocks", 1),  # len(_blocks) = ceil(capacity / T)
        ("committed", 1),  # num_committed_tokens
        ("committed_blocks", 1),
        ("history", 1),
        ("capacity", 1),
        ("commit_state", 1),  # ALLOWED, VIRTUAL_STOP or USER_STOP
        ("status", 1),  # SUSPENDED, ACTIVE or CLOSED
        ("never_resumed", 1),
        ("ssm_page", 1),  # the live (or reused) SSM page; NULL for none
        ("ssm_kind", 1),  # how the sequence refers to it (HOLD or LOCK)
        ("scope_id", 1),
        ("scope_key", 1),
        ("result", 1),  # 1 = done, 0 = refused (out of pages)
        ("virtual_stopped", 1),
        ("evict_first", 1),  # pages released now go to the head of their LRU (close(evict_first=True))
    ],
)
# How a sequence refers to a page (SeqTables.kinds); negative while a release is pending.
HOLD = 1
LOCK = 2
SCRATCH = 3  # an SWA scratch block: no page of its own (the page column stays NULL)
# Sequence statuses (SEQ_SCALARS.status) and commit states (.commit_state).
SUSPENDED = 0
ACTIVE = 1
CLOSED = 2
ALLOWED = 0
VIRTUAL_STOP = 1
USER_STOP = 2

# One request's result row of a batched match (MatchBatch.res).
MATCH_RESULT = Layout(
    "match_result",
    np.int64,
    [
        ("num_tokens", 1),
        ("num_lookup_tokens", 1),
        ("before_pruning", 1),
        ("before_hybrid_pruning", 1),
        ("num_blocks", 1),
    ],
)

# One lane of the cpu walk: a request in flight (kernels/walk.py).
LANE = Layout(
    "lane",
    np.int64,
    [
        ("request", 1),  # the request; -1 when the lane is idle
        ("block", 1),  # the block being looked up (its ordinal in the request)
        ("num_full", 1),  # full blocks of the request
        ("node", 1),  # the last matched row (the parent of ``block``)
        ("key", 1),  # ``block``'s chain key, once a run broke at it
        ("row", 1),  # the bucket chain row to test next; HEAD_PENDING before the head was read
        ("count", 1),  # blocks matched so far
    ],
)
HEAD_PENDING = -2

# Argument blocks of the serial tree kernel (``args``: int64[TREE_ARGS_WIDTH]),
# one layout per operation, and what it writes back (``out``).
TREE_ARGS_WIDTH = 8
ADD_ARGS = Layout(
    "add_args",
    np.int64,
    [
        ("scope_id", 1),
        ("scope_key", 1),
        ("parent", 1),  # NULL: the scope's root, created if missing
        ("num_tokens", 1),
        ("root_digest", 4),
    ],
)
INSERT_ARGS = Layout(
    "insert_args",
    np.int64,
    [
        ("scope_id", 1),
        ("scope_key", 1),
        ("num_tokens", 1),  # the sequence's tokens (``toks``)
        ("unused", 1),  # the root digest sits where OP_ADD has it
        ("root_digest", 4),
    ],
)
ADD_PAGE_ARGS = Layout(
    "add_page_args", np.int64, [("block", 1), ("life_cycle", 1), ("coverage", 1), ("priority", 1)]
)
UNLINK_ARGS = Layout("unlink_args", np.int64, [("block", 1), ("life_cycle", 1), ("expected", 1)])
PAGE_ARGS = Layout("page_args", np.int64, [("page", 1)])  # OP_PAGE_DEATH
DROP_ARGS = Layout("drop_args", np.int64, [("page", 1), ("serial", 1)])  # OP_DROP_PLANNED: the page as planned
BLOCK_ARGS = Layout("block_args", np.int64, [("block", 1), ("life_cycle", 1)])  # OP_REMOVE_SUBTREE, OP_CLEAR_STALE, OP_RELEASE_REF
ANNOUNCE_ARGS = Layout("announce_args", np.int64, [("block", 1), ("kind", 1), ("life_cycle", 1)])
EVICT_ARGS = Layout("evict_args", np.int64, [("life_cycle", 1), ("level", 1), ("need", 1)])
TREE_OUT = Layout(
    "tree_out",
    np.int64,
    [
        ("block", 1),  # the block added or got; OP_ADD_PAGE: the page; OP_EVICT: 1 when there is room
        ("is_new", 1),  # 1 when that block was created
        ("root", 1),  # OP_ADD: the scope's root
        ("inserted", 1),  # OP_INSERT: blocks inserted
    ],
)

# Argument blocks of the serial sequence kernel (SeqTables.args: int64[SEQ_ARGS_WIDTH],
# an item's columns of the work list).
SEQ_ARGS_WIDTH = 4
SETUP_ARGS = Layout("setup_args", np.int64, [("num_tokens", 1), ("num_blocks", 1)])  # blocks in SeqTables.path
RESIZE_ARGS = Layout("resize_args", np.int64, [("capacity", 1), ("history", 1)])
CLOSE_ARGS = Layout("close_args", np.int64, [("evict_first", 1)])
# An admission's arguments, for its setup (SEQ_SETUP_MATCHED reads the first
# two as SETUP_ARGS) and its sizing: a capacity below zero resumes only (the
# host refused the sizing).
ADMIT_ARGS = Layout("admit_args", np.int64, [("num_tokens", 1), ("num_blocks", 1), ("capacity", 1)])
# An append's (a commit is an append of room 0): the committed length before
# it, the tokens committed, whether the sequence ends, then the room to make
# for more tokens.
APPEND_ARGS = Layout("append_args", np.int64, [("first", 1), ("count", 1), ("is_end", 1), ("room", 1)])


def as_int32(x):
    """``x`` modulo 2**32 as a signed 32-bit value: what a wrapping 32-bit
    field (a block's or a page's serial) stores of a count."""
    return ((np.int64(x) + 0x80000000) & 0xFFFFFFFF) - 0x80000000  # widened first: an int32 would overflow


def slot_row(block, life_cycle, num_life_cycles):
    """The ``slots`` row of (block, life cycle); blocks may be an array (host)
    or a row number (kernels, where it is compiled as a helper)."""
    return block * num_life_cycles + life_cycle


# Table dimensions.
NUM_LEVELS = 2  # cache levels: 0 = GPU, 1 = host
NUM_HELD = 2  # eviction lists per pool: 0, pages nobody holds; 1, held ones (candidates only while the host tier has room)
NUM_PRIORITIES = PRIORITY_MAX - PRIORITY_MIN + 1  # one eviction list per priority
SHA256_WORK_WORDS = 24  # SHA-256 scratch per digest: 8 state words + 16 message/schedule words

# The sequence kernels' operations (kernels/seq.py). The sizing kernel runs
# the first six (what pages a cache holds), the commit kernel the other
# four (what the tree gets); a launch runs one of them, and no call needs
# both. Two kernels, not one, because a cold compile of each is about half
# as long, and both compile at once.
SEQ_SETUP_REUSE = 1  # SETUP_ARGS: matched tokens N, blocks in Q.path[:count]
SEQ_RESUME = 2
SEQ_SUSPEND = 3
SEQ_RESIZE = 4  # RESIZE_ARGS
SEQ_SETUP_MATCHED = 5  # SETUP_ARGS: SEQ_SETUP_REUSE with the matched blocks' own tokens
SEQ_ADMIT = 6  # ADMIT_ARGS: the first resume, then the resize to the capacity
SEQ_STOP = 7
SEQ_CLOSE = 8  # CLOSE_ARGS
SEQ_APPEND = 9  # APPEND_ARGS: the commit, then a resize to room for more tokens when the capacity is short
FIRST_COMMIT_OP = SEQ_STOP  # ops from here on are the commit kernel's

# The work list of one sequence launch (``work``: int64 [n + 1, BATCH_WIDTH]),
# the one channel of every per-item input: row i names item i's slot and op,
# where its input starts in the flat token and path arrays, and its op's
# arguments; row n only ends the last item's input.
BATCH_SLOT = 0
BATCH_OP = 1
BATCH_TOKENS = 2
BATCH_PATH = 3
BATCH_ARGS = 4  # SEQ_ARGS_WIDTH columns
BATCH_WIDTH = BATCH_ARGS + SEQ_ARGS_WIDTH


# Column constants, one per field: plain assignments so grep and IDEs find
# them; _check_columns below fails at import if one is missing or wrong.

BLK_PARENT = 0
BLK_INFO = 1
BLK_HASH_NEXT = 2
BLK_FIRST_NEXT = 3
BLK_FIRST_CHILD = 4
BLK_NEXT_SIBLING = 5
BLK_PREV_SIBLING = 6
BLK_REFS = 7
BLK_SERIAL = 8
ROOT_SCOPE = BLK_PREV_SIBLING  # a root's scope id (a root has no siblings)
# A retired row's tag (RETIRED_* above) is kept in its next-sibling link:
# leaving its parent's child list set that link to NULL, and nothing reads
# it again (a detached row is a leaf, a root has no siblings). Unlike the
# index chains, the tables' growth copies the column, as a pending drain
# needs.
RETIRED_TAG = BLK_NEXT_SIBLING

BID_KEY = 0

SLOT_WORD = 0

PAGE_BLOCK = 0
PAGE_INFO = 1
PAGE_HOLDS = 2
PAGE_POOL_INDEX = 3
PAGE_LRU_PREV = 4
PAGE_LRU_NEXT = 5
PAGE_SERIAL = 6
PAGE_LRU_TICK = 7
FREE_ROW_NEXT = PAGE_LRU_NEXT  # a free row is no eviction candidate


LOG_KIND = 0
LOG_LIFE_CYCLE = 1
LOG_BLOCK = 2
LOG_DIGEST = 3
LOG_PARENT_DIGEST = 7
LOG_PARENT_IS_ROOT = 11
LOG_NUM_TOKENS = 12
LOG_TOKENS_AT = 13
LOG_COVERS = 14
LOG_LEVEL = 15
LOG_OLD_LEVEL = 16
LOG_PRIORITY = 17

CNT_BLOCK_FREE_TOP = 0
CNT_LOG_LEN = 1
CNT_TICK = 2
CNT_ERROR = 3
CNT_LIVE_BLOCKS = 4
CNT_SERIAL = 5
CNT_DETACHES = 6
CNT_LOG_TOKENS_LEN = 7
CNT_NUM_COPIES = 8
CNT_EVICTED = 9
CNT_MIGRATED = 10
CNT_DROPPED = 11
CNT_EVICT_FIRST = 12
CNT_RETIRED = 13
CNT_UNLINKS = 14
CNT_HELD_DETACHES = 15

POLICY_COMMIT_MIN_SNAPSHOT = 0
POLICY_SCRATCH_REWIND = 1
POLICY_STABLE_PAGES = 2
POLICY_BLOCK_DIGESTS = 3
POLICY_LOG_RECORDS = 4

COPY_LIFE_CYCLE = 0
COPY_SRC_LEVEL = 1
COPY_SRC_INDEX = 2
COPY_DST_LEVEL = 3
COPY_DST_INDEX = 4

CREC_ROUTE = 0
CREC_SRC_INDEX = 1
CREC_DST_INDEX = 2

LRU_HEAD = 0
LRU_TAIL = 1

LG_COUNT = 0
LG_LOWEST = 1

Q_NUM_BLOCKS = 0
Q_COMMITTED = 1
Q_COMMITTED_BLOCKS = 2
Q_HISTORY = 3
Q_CAPACITY = 4
Q_COMMIT_STATE = 5
Q_STATUS = 6
Q_NEVER_RESUMED = 7
Q_SSM_PAGE = 8
Q_SSM_KIND = 9
Q_SCOPE_ID = 10
Q_SCOPE_KEY = 11
Q_RESULT = 12
Q_VIRTUAL_STOPPED = 13
Q_EVICT_FIRST = 14

RES_NUM_TOKENS = 0
RES_NUM_LOOKUP_TOKENS = 1
RES_BEFORE_PRUNING = 2
RES_BEFORE_HYBRID_PRUNING = 3
RES_NUM_BLOCKS = 4

LN_REQUEST = 0
LN_BLOCK = 1
LN_NUM_FULL = 2
LN_NODE = 3
LN_KEY = 4
LN_ROW = 5
LN_COUNT = 6

ADD_SCOPE_ID = 0
ADD_SCOPE_KEY = 1
ADD_PARENT = 2
ADD_NUM_TOKENS = 3
ADD_ROOT_DIGEST = 4

INSERT_SCOPE_ID = 0
INSERT_SCOPE_KEY = 1
INSERT_NUM_TOKENS = 2
INSERT_UNUSED = 3
INSERT_ROOT_DIGEST = 4

ADD_PAGE_BLOCK = 0
ADD_PAGE_LIFE_CYCLE = 1
ADD_PAGE_COVERAGE = 2
ADD_PAGE_PRIORITY = 3

UNLINK_BLOCK = 0
UNLINK_LIFE_CYCLE = 1
UNLINK_EXPECTED = 2

PAGE_ARG_PAGE = 0

DROP_PAGE = 0
DROP_SERIAL = 1

BLOCK_ARG_BLOCK = 0
BLOCK_ARG_LIFE_CYCLE = 1

ANNOUNCE_BLOCK = 0
ANNOUNCE_KIND = 1
ANNOUNCE_LIFE_CYCLE = 2

EVICT_LIFE_CYCLE = 0
EVICT_LEVEL = 1
EVICT_NEED = 2

OUT_BLOCK = 0
OUT_IS_NEW = 1
OUT_ROOT = 2
OUT_INSERTED = 3

SETUP_NUM_TOKENS = 0
SETUP_NUM_BLOCKS = 1

RESIZE_CAPACITY = 0
RESIZE_HISTORY = 1


CLOSE_EVICT_FIRST = 0

ADMIT_NUM_TOKENS = 0
ADMIT_NUM_BLOCKS = 1
ADMIT_CAPACITY = 2

APPEND_FIRST = 0
APPEND_COUNT = 1
APPEND_IS_END = 2
APPEND_ROOM = 3

BLK_WIDTH = BLOCKS.width
BID_WIDTH = BLOCK_IDS.width
PAGE_WIDTH = PAGES.width
LOG_WIDTH = LOG.width
POLICY_WIDTH = POLICY.width
COPY_WIDTH = COPIES.width
Q_WIDTH = SEQ_SCALARS.width
RES_WIDTH = MATCH_RESULT.width
LN_WIDTH = LANE.width


def _check_columns(layout: Layout, prefix: str):
    g = globals()
    for field, _ in layout.fields:
        name = f"{prefix}_{field.upper()}"
        if g.get(name) != layout.columns[field]:
            raise AssertionError(f"layout {layout.name}: {name} must be {layout.columns[field]}")


for _layout, _prefix in (
    (BLOCKS, "BLK"), (BLOCK_IDS, "BID"), (SLOTS, "SLOT"), (PAGES, "PAGE"), (LOG, "LOG"),
    (COUNTERS, "CNT"), (POLICY, "POLICY"),
    (COPIES, "COPY"), (COPY_RECORDS, "CREC"), (LRU_LISTS, "LRU"), (LRU_GROUPS, "LG"), (SEQ_SCALARS, "Q"),
    (MATCH_RESULT, "RES"),
    (LANE, "LN"), (ADD_ARGS, "ADD"), (INSERT_ARGS, "INSERT"), (ADD_PAGE_ARGS, "ADD_PAGE"), (UNLINK_ARGS, "UNLINK"),
    (PAGE_ARGS, "PAGE_ARG"), (DROP_ARGS, "DROP"), (BLOCK_ARGS, "BLOCK_ARG"), (ANNOUNCE_ARGS, "ANNOUNCE"), (EVICT_ARGS, "EVICT"),
    (TREE_OUT, "OUT"), (SETUP_ARGS, "SETUP"), (RESIZE_ARGS, "RESIZE"), (CLOSE_ARGS, "CLOSE"),
    (ADMIT_ARGS, "ADMIT"), (APPEND_ARGS, "APPEND"),
):
    _check_columns(_layout, _prefix)
assert ADD_ARGS.width <= TREE_ARGS_WIDTH and INSERT_ARGS.width <= TREE_ARGS_WIDTH
assert max(a.width for a in (SETUP_ARGS, RESIZE_ARGS, CLOSE_ARGS, ADMIT_ARGS, APPEND_ARGS)) <= SEQ_ARGS_WIDTH
assert INSERT_ROOT_DIGEST == ADD_ROOT_DIGEST
assert (ADMIT_NUM_TOKENS, ADMIT_NUM_BLOCKS) == (SETUP_NUM_TOKENS, SETUP_NUM_BLOCKS)

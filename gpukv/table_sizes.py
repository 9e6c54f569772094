"""How big each table of the index is: the sizing rules and the budgets.

``tables.Tables`` allocates and grows the tables; the rules here say to what
size, and ``memory.index_memory`` adds up the same sizes without allocating.
Block-indexed tables start at ``INITIAL_BLOCK_ROWS`` (or
``CacheConfig.initial_blocks``) and double, or with
``CacheConfig.max_blocks`` are allocated at that size once. The change log
and the page-copy list are kept within fixed byte budgets whatever the tree's
size (``CHANGE_LOG_BUDGET``, ``COPY_LIST_BUDGET``); what one launch needs of
them is ``log_rows_for`` / ``copy_rows_for`` (and the announced-token rows of a
commit, ``core.call_room.log_tokens_rows_for``), and a
batch that needs more runs as consecutive launches (``batch.CacheCalls._reserve_and_launch``).
"""

from __future__ import annotations

import numpy as np

from .core.config import CacheConfig
from .core.kinds import has_window
from .core.layout import COPY_RECORDS, LOG

INITIAL_BLOCK_ROWS = 256
LOG_MIN_ROWS = 256  # slack of every launch's change-log room, and where the log starts without max_blocks
LOG_TOKENS_MIN_ROWS = 64

# Bytes the change log (``log`` and ``log_tokens``) is kept within, whatever
# ``max_blocks`` is: a call whose worst case needs more runs as consecutive
# launches that each fit (``batch.CacheCalls._reserve_and_launch``), which is exact since
# the calls of a batch run in order. A quarter goes to the announced tokens.
CHANGE_LOG_BUDGET = 4 << 20
LOG_BUDGET_MIN_ROWS = 4 * LOG_MIN_ROWS  # the least any budget gives: the slack and some room
# Bytes the page-copy list of one launch is kept within, split likewise
# (it needs at most three copies per page of the pool, its size when smaller).
COPY_LIST_BUDGET = 3 << 17  # 32,768 copies of 12 bytes
COPY_SLACK = 16
COPY_BUDGET_MIN_ROWS = 256


def log_budget(tokens_per_block: int) -> tuple[int, int]:
    """``(log rows, log_tokens rows)`` that ``CHANGE_LOG_BUDGET`` buys."""
    row = max(1, tokens_per_block) * np.dtype(np.int32).itemsize
    tokens_rows = max(LOG_TOKENS_MIN_ROWS, CHANGE_LOG_BUDGET // 4 // row)
    log_rows = max(LOG_BUDGET_MIN_ROWS, (CHANGE_LOG_BUDGET - tokens_rows * row) // (LOG.width * LOG.dtype.itemsize))
    return int(log_rows), int(tokens_rows)


def copy_budget(num_pages: int) -> int:
    """Rows of the page-copy list: what ``COPY_LIST_BUDGET`` buys, or the
    most any launch records (``3P + 16``) when that is fewer."""
    record = COPY_RECORDS.width * COPY_RECORDS.dtype.itemsize
    return int(min(3 * num_pages + COPY_SLACK, max(COPY_BUDGET_MIN_ROWS, COPY_LIST_BUDGET // record)))


def copy_rows_for(blocks: int, num_life_cycles: int) -> int:
    """Page data copies one launch over up to ``blocks`` blocks may record
    (``log_rows_for``'s blocks): per life cycle and block, up to two
    migrations of its page or of an eviction victim and one copy of data
    into a page it allocates."""
    return copy_rows_per_block(num_life_cycles) * (blocks + 2) + COPY_SLACK


def copy_rows_per_block(num_life_cycles: int) -> int:
    return 3 * max(1, num_life_cycles)


def log_rows_for(blocks: int, announced: int, num_life_cycles: int) -> int:
    """Change-log rows one launch may need (``Tables.ensure_log``): an
    operation on up to ``blocks`` blocks announcing up to ``announced``
    blocks. Removals take none (they are retired rows, ``layout.RETIRED_*``)."""
    L = num_life_cycles
    return (1 + 4 * L) * (blocks + 2) + (L + 1) * announced + LOG_MIN_ROWS


def log_rows_per_block(num_life_cycles: int) -> int:
    """What each block of ``log_rows_for`` adds (the rest is a launch's constant)."""
    return 1 + 4 * num_life_cycles


def scratch_width(config: CacheConfig) -> int:
    """SWA scratch slots a cache may hold per life cycle at once: one window of blocks."""
    T = config.tokens_per_block
    return max([1] + [-(-(lc.window - 1) // T) for lc in config.life_cycles if has_window(lc.kind)])


def preallocated_sizes(config: CacheConfig) -> dict:
    """The row counts the tables start with: with ``max_blocks`` the block
    tables at the size they may ever need, so none grows (``index_memory``
    reports the bytes). ``blocks``: block rows; ``log`` and ``log_tokens``:
    the change log, at its budget (``log_budget``) with ``max_blocks`` when
    the manager publishes KV cache events, else small. Kernels write log
    records only while someone reads them (the events, or a test's sink):
    an unread log never grows, and one read by a sink attached later grows on
    demand up to the budget."""
    small = {"log": LOG_MIN_ROWS, "log_tokens": LOG_TOKENS_MIN_ROWS}
    if config.max_blocks is None:
        blocks = INITIAL_BLOCK_ROWS if config.initial_blocks is None else max(INITIAL_BLOCK_ROWS, pow2_at_least(config.initial_blocks))
        return {"blocks": blocks, **small}
    if config.max_kv_event_entries <= 0:
        return {"blocks": config.max_blocks, **small}
    log_rows, tokens_rows = log_budget(config.tokens_per_block)
    return {"blocks": config.max_blocks, "log": log_rows, "log_tokens": tokens_rows}


def index_buckets(rows: int) -> int:
    """Bucket heads of each child index (by key, by parent and first token)
    for ``rows`` block rows: a power of two (a bucket is a mask of the key),
    the one at least ``rows / 2``. A full tree's chains then average at
    most two rows; a lookup rarely walks one, since a match follows runs
    of consecutive rows and looks a block up by key only where a run
    breaks (``kernels/walk.py``). Half an int32 head per row in each index."""
    return max(1, pow2_at_least(rows) // 2)


def pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p

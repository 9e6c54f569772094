"""How much device memory the index takes: the sum of its tables' sizes.

``index_memory(config)`` computes, for a configuration, the bytes of every
device table ``Tables`` allocates (``tables.DeviceTables``), from the record
widths and dtypes declared in ``core/layout.py`` and the sizing rules of
``tables.py``; nothing is allocated. A test checks it against the ``nbytes``
of a manager's actual arrays, table by table.

With ``CacheConfig.max_blocks`` set, the tables are allocated at these sizes
at construction and never grow, so the figure is the index's whole footprint
for the manager's life. With ``max_blocks=None`` the block-indexed tables
start at 256 rows and double as the tree grows; pass ``blocks=`` for the
size at a given row count. The change log holds records only for KV cache
events (or a test's sink): without events it stays at its least. With
them it is preallocated at its budget under ``max_blocks`` and grows on
demand up to it otherwise; either way it is kept within
``table_sizes.CHANGE_LOG_BUDGET`` bytes, whatever the number of blocks, and
only one cache's call beyond it (a commit over more blocks than the budget
covers) takes more, for its launch.

Not counted here: page memory (``page_bytes > 0``: one ``[pages,
page_bytes]`` array per life cycle and cache level), the token arena of
registered ``TokenSequence``s, each open cache's own small arrays, match
results, and the table of interned multimodal digests beyond its first row
(32 bytes per distinct digest held).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .core.config import CacheConfig
from .core.layout import (
    BLOCK_IDS, BLOCKS, COPY_RECORDS, COUNTERS, LOG, LRU_GROUPS, LRU_LISTS, NUM_HELD, NUM_LEVELS, NUM_PRIORITIES, PAGES,
    POLICY, ROW_DTYPE, SHA256_WORK_WORDS, SLOTS,
)
from .table_sizes import copy_budget, index_buckets, preallocated_sizes
from .tables import DeviceTables

INT64 = np.dtype(np.int64).itemsize
INT32 = np.dtype(np.int32).itemsize
ROW = np.dtype(ROW_DTYPE).itemsize  # bucket heads, free lists of pages


@dataclass(frozen=True)
class IndexMemory:
    """Bytes of each device table (``tables``, by ``DeviceTables`` field) and
    their sum (``total``), at ``blocks`` block rows."""

    blocks: int
    tables: dict

    @property
    def total(self) -> int:
        return sum(self.tables.values())

    def __int__(self) -> int:
        return self.total


def index_memory(config: CacheConfig, blocks: int | None = None) -> IndexMemory:
    """The device memory of a manager's index tables for ``config``, in bytes.

    ``blocks``: block rows to count (default: ``config.max_blocks``, or the
    256 rows the tables start with when it is None). Per-table sizes:

    - per block row ``r``: ``blocks`` (its layout width, int32), ``block_ids``
      (the 64-bit chain key), ``digests`` (the 32-byte SHA-256 chain key,
      none without ``block_digests``), ``tokens``
      (``T`` int32), ``slots`` (one row per life cycle, int32), ``block_free``
      (int32: it also holds a launch's retired rows), and two child-index
      bucket arrays of half a head per row, a power of two (int32:
      ``table_sizes.index_buckets``);
    - per page ``P`` (GPU and host pages of every life cycle): ``pages``
      (its layout width, int32: the LRU tick among its fields),
      ``page_free`` (int32) and
      the copy list (``3P + 16`` records, int32, or ``table_sizes.COPY_LIST_BUDGET``
      bytes when that is less);
    - the change log (``log``, ``log_tokens``), at the sizes
      ``table_sizes.preallocated_sizes`` gives (with ``max_blocks`` and KV
      cache events: its budget, ``table_sizes.log_budget``; else the rows it
      starts with);
    - the eviction lists: one per (life cycle, level, held or not,
      priority), and a count row per (life cycle, level, held or not);
    - small per-life-cycle and per-pool arrays, the counters, the policy
      switches, the SHA-256 scratch, one row of multimodal digests.
    """
    if not isinstance(config, CacheConfig):
        raise TypeError(f"config must be a gpukv.CacheConfig, got {type(config).__name__}")
    sizes = preallocated_sizes(config)
    if blocks is None:
        rows = sizes["blocks"]
    elif isinstance(blocks, (int, np.integer)) and not isinstance(blocks, bool) and blocks >= 1:
        rows = int(blocks)
    else:
        raise ValueError(f"blocks must be a positive int or None, got {blocks!r}")
    T = config.tokens_per_block
    L = len(config.life_cycles)
    P = sum(config.pages_per_life_cycle_list()) + sum(config.pages_per_life_cycle_list(host=True))
    groups = max(1, L) * NUM_LEVELS * NUM_HELD  # eviction list groups: (life cycle, level, held or not)
    buckets = index_buckets(rows)

    def record(layout, n: int) -> int:
        return n * layout.width * layout.dtype.itemsize

    tables = {
        "blocks": record(BLOCKS, rows),
        "block_ids": record(BLOCK_IDS, rows),
        "digests": rows * 4 * INT64 if config.block_digests else 0,
        "tokens": rows * T * INT32,
        "slots": record(SLOTS, rows * L),
        "pages": record(PAGES, P),
        "buckets": buckets * ROW,
        "sibling_buckets": buckets * ROW,
        "block_free": rows * ROW,
        "pool_start": L * NUM_LEVELS * INT64,
        "pool_top": L * NUM_LEVELS * INT64,
        "pool_size": L * NUM_LEVELS * INT64,
        "page_free": P * ROW,
        "row_start": L * INT64,
        "row_top": L * INT64,
        "row_head": L * INT64,
        "copies": record(COPY_RECORDS, copy_budget(P)),
        "lru_lists": record(LRU_LISTS, groups * NUM_PRIORITIES),
        "lru_groups": record(LRU_GROUPS, groups),
        "no_host_room": max(1, L) * INT64,
        "counters": record(COUNTERS, 1),
        "log": record(LOG, sizes["log"]),
        "log_tokens": sizes["log_tokens"] * max(1, T) * INT32,
        "lc_kind": L * INT64,
        "lc_window": L * INT64,
        "lc_sinks": L * INT64,
        "mm_digests": 32,
        "work": SHA256_WORK_WORDS * np.dtype(np.uint32).itemsize,
        "policy": record(POLICY, 1),
    }
    missing = set(DeviceTables._fields) ^ set(tables)
    if missing:  # a table added to Tables must be counted here too
        raise AssertionError(f"index_memory does not match the device tables: {sorted(missing)}")
    return IndexMemory(rows, tables)

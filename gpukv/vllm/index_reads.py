"""Two facts the adapter reads from gpukv's index tables, which gpukv's
public API does not return yet.

1. **The pages of a match, and whether a cache holds them.** vLLM's admission
   check (``SingleTypeKVCacheManager.get_num_blocks_to_allocate``) counts,
   besides the new blocks, every hit block that is an eviction candidate now:
   touching it takes it off the free queue. To make exactly that decision
   *before* holding anything (a refused admission must leave every page where
   it was in the LRU), the adapter needs the matched tree blocks' pages and
   their holders. ``BatchMatch.blocks`` gives the blocks, not the pages.
2. **The free pages of the pool** (never used or released, not merely
   evictable). A queued allocation that fits in them evicts nothing, so a
   lookup need not wait for it to be issued: that is what lets the adapter
   batch a step's admissions. ``obtainable_pages`` gives free plus evictable.

Both read a few named columns (gpukv's layout constants) with one small
transfer. This is the only module that reads gpukv's tables, a stand-in for
public calls gpukv should offer (``BatchMatch.pages(i, life_cycle_id)`` with
a held flag, and ``KVCacheManager.free_pages(life_cycle_id, level)``).
"""

from __future__ import annotations

import numpy as np

from ..core.layout import NULL, PAGE_HOLDERS, PAGE_LOCKS, PAGE_POOL_INDEX, SLOT_PAGE, slot_row


def match_pages(mgr, block_rows: np.ndarray, life_cycle_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(pool_index, held)`` for each tree block row of a match, in order:
    the life cycle's GPU page of the block (-1 for none) and whether a cache
    holds or locks it (False: an eviction candidate, or no page)."""
    n = len(block_rows)
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
    tables = mgr._tables
    backend = mgr._backend
    L = tables.num_life_cycles
    rows = backend.to_device(slot_row(np.asarray(block_rows, dtype=np.int64), life_cycle_id, L))
    page_rows = tables.slots[rows, SLOT_PAGE].astype(np.int64)
    # Gather the page records on the device, then one transfer: [n, 3].
    safe = backend.xp.where(page_rows == NULL, 0, page_rows)
    fields = backend.to_host(tables.pages[safe][:, [PAGE_POOL_INDEX, PAGE_HOLDERS, PAGE_LOCKS]])
    has_page = backend.to_host(page_rows) != NULL
    pool_index = np.where(has_page, fields[:, 0], -1)
    held = has_page & ((fields[:, 1] > 0) | (fields[:, 2] > 0))
    return pool_index, held


def free_pages(mgr, life_cycle_id: int = 0) -> int:
    """The GPU pool's free storage slots (``pool_top``: the free stack's height;
    one entry per life cycle and cache level, lc-major, level 0 the GPU)."""
    tables = mgr._tables
    tops = mgr._backend.to_host(tables.pool_top)
    return int(tops[life_cycle_id * (len(tops) // tables.num_life_cycles)])

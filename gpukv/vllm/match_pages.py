"""The pages a match found, and which of them an admission would take out
of the obtainable count.

vLLM's admission check (``SingleTypeKVCacheManager.get_num_blocks_to_allocate``)
counts, besides the new blocks, every hit block that is an eviction candidate
now: touching it takes it off the free queue. To make exactly that decision
*before* holding anything (a refused admission must leave every page where
it was in the LRU), the adapter needs, for the tree blocks of a match, their
pages' pool indices and whether any cache holds them.

gpukv's public API returns the matched tree blocks (``BatchMatch.blocks``)
but not their pages; this module reads the two columns it needs from the
index tables, with gpukv's named layout constants. It is the only place the
adapter reads gpukv's tables, and a stand-in for a public call
(``BatchMatch.pages(i, life_cycle_id)`` with a held flag) that gpukv should
offer.
"""

from __future__ import annotations

import numpy as np

from ..core.layout import NULL, PAGE_HOLDERS, PAGE_LOCKS, PAGE_POOL_INDEX, SLOT_PAGE, slot_row


def match_pages(mgr, block_rows: np.ndarray, life_cycle_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(pool_index, held)`` for each tree block row of a match, in order:
    the life cycle's GPU page of the block (-1 for none) and whether a cache
    holds or locks it (False: an eviction candidate, or no page).

    One gather on the device and one small read back, whatever the tree's size."""
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

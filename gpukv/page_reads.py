"""What an engine reads of pages every step, for many at once, in one transfer each.

An engine's scheduler keeps a block table per request and decides admissions
from counts. Three reads serve it, each a gather on the device and one copy
to the host, whatever the batch:

- ``page_indices_batch``: the pages of many caches from a given block on
  (the blocks each request gained this step), instead of one
  ``KVCache.page_indices`` read per cache;
- ``match_pages``: the pages of a match's tree blocks and whether a cache
  holds them, so an admission can count the hit pages it would take off the
  eviction lists before it holds anything (vLLM's fit rule);
- ``free_pages``: the free storage slots of a pool (never used or released,
  not merely evictable): an allocation that fits in them evicts nothing;
- ``eviction_order``: the pages eviction would drop next, so a scheduler
  that queues its allocations knows whether a prefix it found survives them.

A page index is the page's position in its life cycle's GPU pool, -1 where
there is none or the page is on the host tier, as ``KVCache.page_indices``.
"""

from __future__ import annotations

import numpy as np

from . import inputs
from .cache_pool import ranges
from .core.layout import (
    NULL, NUM_LEVELS, PAGE_HOLDS, PAGE_INFO, PAGE_POOL_INDEX, Q_NUM_BLOCKS, SLOT_WORD, info_level, slot_page,
    slot_row,
)

# The page table columns each read gathers (one gather of just those columns;
# a page's level is in its ``info``).
_LEVEL_AND_INDEX = np.array([PAGE_INFO, PAGE_POOL_INDEX])
_LEVEL_INDEX_HOLDS = np.array([PAGE_INFO, PAGE_POOL_INDEX, PAGE_HOLDS])


def pool_indices(tables, page_rows: np.ndarray) -> np.ndarray:
    """GPU pool indices (int32) of page table rows; -1 for NULL or a host-tier page."""
    out = np.full(len(page_rows), -1, dtype=np.int32)
    have = np.nonzero(page_rows != NULL)[0]
    if have.size:
        b = tables.backend
        fields = b.to_host(tables.pages[b.to_device(page_rows[have, None]), _LEVEL_AND_INDEX])
        on_gpu = info_level(fields[:, 0]) == 0
        out[have[on_gpu]] = fields[on_gpu, 1]
    return out


def page_indices_batch(calls, caches, life_cycle_id: int, first_blocks) -> tuple[np.ndarray, np.ndarray]:
    """``(indices, offsets)``: cache ``i``'s pages from block ``first_blocks[i]``
    on are ``indices[offsets[i]:offsets[i + 1]]`` (``first_blocks`` None: from 0)."""
    what = "page_indices_batch()"
    slots = inputs.cache_slots(caches, calls.pool, what)
    n = len(slots)
    pool = calls.pool
    stop = pool.host_scalars[slots, Q_NUM_BLOCKS].astype(np.int64)
    first = np.zeros(n, dtype=np.int64) if first_blocks is None else inputs.ints(first_blocks, n, "first_blocks", what)
    counts = np.maximum(stop - np.minimum(first, stop), 0)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    if not offsets[-1]:
        return np.zeros(0, dtype=np.int32), offsets
    b = calls.backend
    rows = ranges(pool.seg[slots, 0] + first, counts)
    page_rows = np.asarray(b.to_host(pool.arrays.pages[b.to_device(rows), life_cycle_id]), dtype=np.int64)
    return pool_indices(calls.tables, page_rows), offsets


def match_pages(tables, block_rows: np.ndarray, life_cycle_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``(indices, held)`` for tree block rows (a match's ``blocks(i)``), in
    order: the life cycle's GPU page index of each block (-1: none, or on the
    host tier) and whether a cache holds or locks that page (False: an eviction
    candidate, or no page)."""
    rows = np.asarray(block_rows, dtype=np.int64)
    n = len(rows)
    if n == 0:
        return np.zeros(0, dtype=np.int32), np.zeros(0, dtype=bool)
    b = tables.backend
    words = b.to_host(tables.slots[b.to_device(slot_row(rows, life_cycle_id, tables.num_life_cycles)), SLOT_WORD])
    page_rows = slot_page(np.asarray(words, dtype=np.int64))
    out = np.full(n, -1, dtype=np.int32)
    held = np.zeros(n, dtype=bool)
    have = np.nonzero(page_rows != NULL)[0]
    if have.size:
        fields = b.to_host(tables.pages[b.to_device(page_rows[have, None]), _LEVEL_INDEX_HOLDS])
        on_gpu = info_level(fields[:, 0]) == 0
        out[have[on_gpu]] = fields[on_gpu, 1]
        held[have] = fields[:, 2] != 0  # held or locked
    return out, held


def free_pages(tables, life_cycle_id: int, level: int) -> int:
    """The pool's free storage slots: the free stack's height."""
    i = life_cycle_id * NUM_LEVELS + level  # one entry per (life cycle, level), life cycle major
    return int(tables.backend.to_host(tables.pool_top[i:i + 1])[0])


def eviction_order(launcher, kernel, life_cycle_id: int, level: int, count: int) -> np.ndarray:
    """The storage slots (int32) of the first ``count`` unheld eviction
    candidates of the pool, in eviction order (fewer when it has fewer):
    one serial read on the device (``kernels/victims.py``), one copy back."""
    tables = launcher.tables
    b = tables.backend
    out = b.to_device(np.zeros(count + 1, dtype=np.int64))
    launcher.read(kernel, tables.device, life_cycle_id * NUM_LEVELS + level, count, out)
    out = b.to_host(out)
    return out[1:1 + int(out[0])].astype(np.int32)

"""Choosing eviction victims: a batched pass over the page table (docs/semantics.md §2.11).

Before a launch that may allocate more GPU pages than are free, ``Evictor``
lists, for each life cycle's GPU and host pools, the best eviction candidates
in order (lowest priority first, then least recently scheduled) and counts
what eviction could free. The pass is a handful of array operations over the
page table, on the backend's device; no loop over pages runs in Python. The
serial kernels then take victims from these lists in order, checking each one
is still a candidate (the launch itself may have locked, rescheduled or freed
it), and merge in the pages scheduled during the launch (``kernels/evict.py``).
Which pages are candidates at all is the kernels' own ``evictable`` test,
run as one kernel over the life cycle's rows; this pass orders and counts them.
"""

from __future__ import annotations

import numpy as np

from .kernels.evict import build_evictable_kernel
from .launcher import call_kernel
from .kernels.tree import NUM_LEVELS
from .core.layout import (
    EC_DROPPABLE,
    EC_HELD,
    EC_HOST_DROPPABLE,
    EVICT_COUNTS,
    PAGE_HOLDERS,
    PAGE_LEVEL,
    PAGE_LRU_TICK,
    PAGE_PRIORITY,
)
from .tables import Tables

TICK_BIAS = 1 << 41  # ticks (negative for evict-first pushes) shifted to sort as unsigned
SLACK = 16  # extra candidates listed, for victims the launch itself takes away


class Evictor:
    def __init__(self, tables: Tables):
        self.tables = tables
        self.backend = tables.backend
        config = tables.config
        self._gpu = np.array(config.pages_per_life_cycle_list(), dtype=np.int64)
        self._host = np.array(config.pages_per_life_cycle_list(host=True), dtype=np.int64)
        self._row_start = np.concatenate([[0], np.cumsum(self._gpu + self._host)[:-1]]).astype(np.int64)
        self._mask_kernel = build_evictable_kernel(self.backend.target)
        self._mask = tables.xp.zeros(int((self._gpu + self._host).max(initial=0)), dtype=np.int8)

    def prepare(self, need) -> None:
        """Make victim lists for every life cycle whose free GPU slots are fewer
        than ``need[lc]`` (an upper bound on what the next launch allocates)."""
        t = self.tables
        if not len(need):
            return
        free = self.backend.to_host(t.pool_top).reshape(-1, NUM_LEVELS)[:, 0]
        short = [lc for lc, n in enumerate(need) if n > free[lc]]
        for lc in short:
            self._list(lc, int(need[lc] - free[lc]) + SLACK)

    def forget(self) -> None:
        """Drop every list, as the end of a launch does: a pass cut short by an
        exception must not leave half-written lists or counts to the next launch."""
        t = self.tables
        t.victim_count[:] = 0
        t.victim_next[:] = 0
        t.victim_total[:] = -1

    def _list(self, lc: int, k: int) -> None:
        t = self.tables
        xp = t.xp
        start = int(self._row_start[lc])
        n = int(self._gpu[lc] + self._host[lc])
        rows = t.pages[start:start + n]
        host_tier = self._host[lc] > 0
        # The candidates are what the kernels' own ``evictable`` says (one
        # definition); the pass only orders and counts them.
        call_kernel(self._mask_kernel, t.device, start, n, self._mask)
        evictable = self._mask[:n].astype(bool)
        level = rows[:, PAGE_LEVEL]
        unheld = rows[:, PAGE_HOLDERS] == 0
        key = (rows[:, PAGE_PRIORITY] << 42) + (rows[:, PAGE_LRU_TICK] + TICK_BIAS)
        gpu = evictable & (level == 0)
        host = evictable & (level == 1)
        counts = np.zeros(EVICT_COUNTS.width, dtype=np.int64)
        counts[EC_DROPPABLE] = int(xp.count_nonzero(gpu & unheld))
        counts[EC_HELD] = int(xp.count_nonzero(gpu & ~unheld))
        counts[EC_HOST_DROPPABLE] = int(xp.count_nonzero(host))
        t.evict_counts[lc] = self.backend.to_device(counts)
        self._write(lc * NUM_LEVELS, start, rows, xp.nonzero(gpu)[0], key, k)
        if host_tier:
            self._write(lc * NUM_LEVELS + 1, start, rows, xp.nonzero(host)[0], key, k)

    def _write(self, pool: int, start: int, rows, candidates, key, k: int) -> None:
        """The ``k`` best candidates of one pool, best first, into its list."""
        t = self.tables
        xp = t.xp
        total = int(candidates.size)
        keys = key[candidates]
        if total > k:
            part = xp.argpartition(keys, k - 1)[:k]
            candidates, keys = candidates[part], keys[part]
        order = xp.argsort(keys)
        best = candidates[order]
        n = int(best.size)
        # Grow, keeping the lists already made for this launch. Each array is
        # grown on its own width: an exception between the two growths leaves
        # them at different widths, and the next pass evens them out.
        width = max(n, 2 * min(t.victims.shape[1], t.victim_ticks.shape[1]))
        for name in ("victims", "victim_ticks"):
            old = getattr(t, name)
            if old.shape[1] < n:
                grown = xp.zeros((old.shape[0], width), dtype=np.int64)
                grown[:, : old.shape[1]] = old
                setattr(t, name, grown)
        t.victims[pool, :n] = best + start
        t.victim_ticks[pool, :n] = rows[best, PAGE_LRU_TICK]
        t.victim_count[pool] = n
        t.victim_next[pool] = 0
        t.victim_total[pool] = total

"""vLLM's block id space over gpukv's page pool, and the ``KVCacheBlocks``
the adapter hands to vLLM's scheduler.

vLLM numbers its blocks ``0 .. num_gpu_blocks - 1`` and reserves block 0 as
the null block (padding; never allocated). gpukv's pool has one page per
other block: **vLLM block id = 1 + gpukv page index**, and gpukv's -1 (no
page) maps to the null block 0. One ``KVCacheBlock`` object exists per block
id for the manager's life, as in vLLM's ``BlockPool.blocks``; the adapter does
not maintain their ``ref_cnt`` or hash fields (gpukv's tables are the truth).

The scheduler reads a ``KVCacheBlocks`` only through ``get_block_ids()``
(building the step's output) after its allocation loops. The adapter defers
its gpukv calls to batch them per step, so the blocks it returns resolve on
first read: ``PendingBlocks.blocks`` and ``get_block_ids()`` first issue the
manager's pending calls.
"""

from __future__ import annotations

from functools import cache
from typing import Callable

import numpy as np


class BlockIds:
    """The ``KVCacheBlock`` object of every vLLM block id."""

    def __init__(self, num_blocks: int):
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        # Indexed by gpukv page index; -1 wraps to the last entry, the null block.
        self._by_page = np.empty(num_blocks, dtype=object)
        self._by_page[:-1] = self.blocks[1:]
        self._by_page[-1] = self.null_block

    def of_pages(self, pages: np.ndarray) -> list:
        """The block objects of gpukv page indices (-1: the null block), one
        C-level gather."""
        return self._by_page[pages].tolist()


def ids_of_pages(pages: np.ndarray) -> list[int]:
    """vLLM block ids of gpukv page indices: ``1 + page``, -1 -> 0."""
    return (np.asarray(pages, dtype=np.int64) + 1).tolist()


def pages_of_ids(ids: list[int]) -> np.ndarray:
    """gpukv page indices of vLLM block ids (the inverse of ``ids_of_pages``)."""
    return np.asarray(ids, dtype=np.int64) - 1


@cache
def kv_cache_blocks_types():
    """``(PendingBlocks, HitBlocks)``, subclasses of vLLM's ``KVCacheBlocks``
    (built on first use: importing this module needs no vLLM)."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    class PendingBlocks(KVCacheBlocks):
        """A slice of a request's live block list, read after the manager's
        pending gpukv calls have been issued.

        ``stop=None`` is the whole list as it is when read (``get_blocks``:
        vLLM's manager also hands out its live list)."""

        def __init__(self, flush: Callable[[], None], state, start: int, stop: int | None):
            # No super().__init__(): ``blocks`` is a property here.
            self._flush = flush
            self._state = state
            self._start = start
            self._stop = stop

        @property
        def blocks(self):
            self._flush()
            return (self._state.blocks[self._start:self._stop],)

        def get_block_ids(self, allow_none: bool = False, *, group_ids=None):
            self._flush()
            if group_ids is not None and tuple(group_ids) != (0,):
                return super().get_block_ids(allow_none, group_ids=group_ids)
            ids = self._state.ids[self._start:self._stop]  # a copy, as vLLM returns
            if allow_none and not ids:
                return None
            return (ids,)

    class HitBlocks(KVCacheBlocks):
        """``get_computed_blocks``' answer: the hit, as the tree blocks it
        matched. The scheduler only hands it back to ``allocate_slots``, so
        the blocks' pages are read from gpukv only when something reads them
        (``blocks``, ``get_block_ids()``, ``held``)."""

        def __init__(self, resolve: Callable, rows: np.ndarray, num_tokens: int, tokens: np.ndarray):
            # No super().__init__(): ``blocks`` is a property here.
            self._resolve = resolve  # rows -> (block objects, held flags)
            self._resolved = None
            self.rows = rows  # the matched tree blocks, one per hit block (the last may be partial)
            self.num_tokens = num_tokens  # the hit, in tokens
            self.tokens = tokens  # the hit's tokens (int32), to create the cache from

        def _pages(self):
            if self._resolved is None:
                self._resolved = self._resolve(self.rows)
            return self._resolved

        @property
        def blocks(self):
            return (self._pages()[0],)

        @property
        def held(self) -> np.ndarray:
            """Per hit block: a cache holds its page (it is no eviction candidate)."""
            return self._pages()[1]

    return PendingBlocks, HitBlocks

"""vLLM's own KV cache events, with vLLM's block hashes, from what the
adapter commits and allocates.

A router that consumes vLLM's events hashes queries with vLLM's block hasher
(``request.block_hashes``), not with gpukv's SHA-256 chain, so the adapter
builds the events itself, the way vLLM's ``BlockPool`` does:

- ``BlockStored`` when a request's blocks become full and cached
  (``cache_full_blocks``): one event per commit, the request's hashes, its
  tokens, LoRA and extra keys. A block that duplicates a cached one is stored
  again, as in vLLM (whose cache keeps both blocks).
- ``BlockRemoved`` when a cached block's page is handed out again (vLLM evicts
  a cached block lazily, when ``get_new_blocks`` pops it): the adapter keeps
  the hash of the block each page holds, and a page that comes back from an
  allocation with a hash announces its removal.
- ``AllBlocksCleared`` on ``reset_prefix_cache``.

The per-block work (hash conversion, extra keys) runs only with events on,
as in vLLM.
"""

from __future__ import annotations

import numpy as np


class EventLog:
    def __init__(self, num_pages: int, block_size: int, spec_kind: str, sliding_window: int | None):
        self.block_size = block_size
        self.spec_kind = spec_kind
        self.sliding_window = sliding_window
        self._events: list = []
        self._page_hash: list = [None] * num_pages  # the vLLM hash of the cached block on each page
        self._has_hash = np.zeros(num_pages, dtype=bool)

    def stored(self, request, first: int, stop: int, pages: np.ndarray) -> None:
        """Blocks ``first .. stop-1`` of ``request`` were cached, on ``pages``."""
        hashes = request.block_hashes[first:stop]
        for p, h in zip(pages.tolist(), hashes):
            self._page_hash[p] = h
        self._has_hash[pages] = True
        self._events.append(self._block_stored(request, first, stop))

    def reused(self, request, num_blocks: int) -> None:
        """A request reused its first ``num_blocks`` cached blocks; announced
        only for ``kv_cache_report_mode == "full"`` (vLLM's
        ``emit_cached_block_events``), the blocks' state unchanged."""
        if num_blocks:
            self._events.append(self._block_stored(request, 0, num_blocks))

    def _block_stored(self, request, first: int, stop: int):
        from vllm.distributed.kv_events import MEDIUM_GPU, BlockStored
        from vllm.v1.core.kv_cache_utils import (
            generate_block_hash_extra_keys,
            maybe_convert_block_hash,
            to_event_extra_keys,
        )

        T = self.block_size
        if request.lora_request is not None or request.cache_salt:
            keys = [generate_block_hash_extra_keys(request, b * T, b * T + T, 0)[0] for b in range(first, stop)]
        else:
            keys = [None] * (stop - first)  # no extra keys (multimodal requests are refused)
        extra = to_event_extra_keys(keys)
        lora = request.lora_request
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in request.block_hashes[first:stop]],
            parent_block_hash=None if first == 0 else maybe_convert_block_hash(request.block_hashes[first - 1]),
            token_ids=request.all_token_ids[first * T:stop * T],
            block_size=T,
            lora_id=None if lora is None else lora.adapter_id,
            medium=MEDIUM_GPU,
            lora_name=None if lora is None else lora.name,
            extra_keys=extra,
            group_idx=0,
            kv_cache_spec_kind=self.spec_kind,
            kv_cache_spec_sliding_window=self.sliding_window,
            session_id=request.session_id,
        )

    def reallocated(self, pages: np.ndarray) -> None:
        """``pages`` were handed out anew: the blocks cached on them are gone."""
        if not len(pages):
            return
        gone = pages[self._has_hash[pages]]
        if not len(gone):
            return
        from vllm.distributed.kv_events import MEDIUM_GPU, BlockRemoved
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        self._has_hash[gone] = False
        for p in gone.tolist():
            h, self._page_hash[p] = self._page_hash[p], None
            self._events.append(BlockRemoved(block_hashes=[maybe_convert_block_hash(h)], medium=MEDIUM_GPU, group_idx=0))

    def cleared(self) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared

        self._page_hash = [None] * len(self._page_hash)
        self._has_hash[:] = False
        self._events.append(AllBlocksCleared())

    def take(self) -> list:
        events, self._events = self._events, []
        return events

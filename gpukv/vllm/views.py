"""The parts of vLLM's manager internals that its scheduler and tests read,
as views of the adapter's state.

vLLM's ``Scheduler`` reaches past ``KVCacheManager`` in a few places:
``coordinator.single_type_managers`` (each manager's ``block_size`` and
``kv_cache_spec``), ``block_pool.free_blocks`` (returning copy-on-write
retentions) and, in its tests, ``single_type_managers[0].req_to_blocks`` /
``num_cached_block`` and ``block_pool.get_num_free_blocks()``. These classes
answer those reads from the adapter; they own nothing.
"""

from __future__ import annotations

from collections import defaultdict


class SingleTypeView:
    """``coordinator.single_type_managers[0]``: the one full-attention group."""

    def __init__(self, kv_cache_spec, block_size: int, block_pool, enable_caching: bool):
        self.kv_cache_spec = kv_cache_spec
        self.block_size = block_size
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        self.kv_cache_group_id = 0
        # request id -> its blocks (the adapter's live lists) / its cached full blocks.
        self.req_to_blocks: defaultdict[str, list] = defaultdict(list)
        self.num_cached_block: dict[str, int] = {}


class FreeQueueView:
    """``block_pool.free_block_queue``: only its length is read."""

    def __init__(self, pool: "BlockPoolView"):
        self._pool = pool

    @property
    def num_free_blocks(self) -> int:
        return self._pool.get_num_free_blocks()


class BlockPoolView:
    """``block_pool``: free-block counts and usage from gpukv's obtainable
    pages (free plus evictable, as vLLM's free queue holds both), and the
    scheduler's ``free_blocks`` of copy-on-write retentions, which gpukv does
    not need: a copy's source stays valid until the next forward
    (docs/integration.md, "Page copies")."""

    def __init__(self, blocks, num_gpu_blocks: int, hash_block_size: int, enable_caching: bool, free_pages):
        self.blocks = blocks.blocks
        self.null_block = blocks.null_block
        self.num_gpu_blocks = num_gpu_blocks
        self.hash_block_size = hash_block_size
        self.enable_caching = enable_caching
        self._free_pages = free_pages  # () -> int, after the adapter's pending calls
        self.free_block_queue = FreeQueueView(self)

    def get_num_free_blocks(self) -> int:
        return self._free_pages()

    def get_usage(self) -> float:
        total = self.num_gpu_blocks - 1
        return 0.0 if not total else 1.0 - self.get_num_free_blocks() / total

    def free_blocks(self, ordered_blocks) -> None:
        for block in ordered_blocks:
            raise NotImplementedError(
                f"gpukv's vLLM KV cache manager holds no block retentions to free (got block {block.block_id}); "
                "blocks are freed through KVCacheManager.free(request)"
            )


class CoordinatorView:
    """``coordinator``: the single-type managers, and the flags vLLM's
    scheduler reads for hybrid models (always off here)."""

    enable_partial_hash_hits = False

    def __init__(self, manager: SingleTypeView, block_pool: BlockPoolView, get_blocks_to_allocate):
        self.single_type_managers = (manager,)
        self.block_pool = block_pool
        self.eagle_group_ids: set[int] = set()
        self.num_reprefillable_tokens = 0
        self._blocks_to_allocate = get_blocks_to_allocate

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks, **_) -> int:
        """Blocks a request needs for ``num_tokens`` slots beyond what it holds
        (the scheduler's remaining-blocks estimate for in-flight prefills)."""
        return self._blocks_to_allocate(request_id, num_tokens)

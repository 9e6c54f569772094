"""``KVCacheManager``: the scheduler-facing facade.

It validates input, owns the device tables, the tree and the token arena, and
answers reuse queries for whole batches with one kernel launch per stage.
"""

from __future__ import annotations

import numpy as np

from .arena import TokenArena, TokenSequence
from .backend import get_backend, quiet_simulator
from .cache import KVCache, LogicError
from .config import CacheConfig
from .layout import PAGE_POOL_INDEX
from .matching import BatchMatch, Matcher
from .scope import as_scope
from .stats import ReuseStats
from .tables import Tables
from .tokens import token_array
from .tree import BlockTree


class KVCacheManager:
    def __init__(self, config: CacheConfig):
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config must be a gpukv.CacheConfig, got {type(config).__name__}")
        self.config = config
        self._backend = get_backend(config.backend)
        quiet_simulator()
        self._tables = Tables(config, self._backend)
        self._tree = BlockTree(self._tables)
        self._arena = TokenArena(self._backend, config.tokens_per_block, self._tables.intern_digest)
        self._matcher = Matcher(self._tables, self._tree, self._arena, config)
        self._open_caches: set[KVCache] = set()
        self._stats = ReuseStats()
        self._copies = [0] * len(config.life_cycles)
        # Real page memory: one [pages, page_bytes] byte array per life cycle's GPU pool.
        self._page_memory = [
            self._backend.xp.zeros((n, config.page_bytes), dtype=np.uint8) if config.page_bytes else None
            for n in config.pages_per_life_cycle_list()
        ]

    # -- facts ------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        return self._backend.name

    @property
    def life_cycles(self) -> tuple:
        """The distinct layer specs; index = life-cycle id."""
        return self.config.life_cycle_specs

    @property
    def ssm_life_cycle_id(self) -> int | None:
        return self.config.ssm_life_cycle_id

    @property
    def tokens_per_block(self) -> int:
        return self.config.tokens_per_block

    # -- reuse queries -------------------------------------------------------------------
    def match_batch(self, requests, scopes=None) -> BatchMatch:
        """Reuse results for a whole scheduling batch (semantics.md §2.3-2.4).

        ``requests``: token sequences (lists, 1-D integer arrays or registered
        ``TokenSequence``s), or a pair ``(flat_tokens, offsets)`` with offsets of
        length B+1 (device arrays accepted). ``scopes``: None, one ``ReuseScope``
        for all, or one per request. Holds nothing: the result is volatile.
        """
        return self._matcher.match(requests, scopes)

    def probe_reuse(self, tokens, scope=None) -> int:
        """The reusable prefix length of one token sequence; holds nothing."""
        m = self._matcher.match([tokens], as_scope(scope))
        return int(self._backend.to_host(m.num_tokens)[0])

    def token_sequence(self, tokens=None) -> TokenSequence:
        """A sequence registered in the device arena (see ``TokenSequence``)."""
        seq = TokenSequence(self._arena)
        if tokens is not None:
            seq.extend(tokens)
        return seq

    # -- sequences -------------------------------------------------------------------------
    def create_kv_cache(self, input_tokens=None, scope=None) -> KVCache:
        """A new, SUSPENDED cache. With ``input_tokens`` it runs the same match as
        ``probe_reuse`` and holds the matched pages at once;
        ``num_committed_tokens`` is the reused length."""
        kv = KVCache(self, scope)
        if input_tokens is not None:
            tokens = token_array(input_tokens, self._tables.intern_digest)
            m = self._matcher.match([tokens], scope).to_host()
            n = int(m.num_tokens[0])
            if n:
                kv._setup_reuse(tokens, n, m.blocks(0))
            self._stats.record(len(tokens), n, self.tokens_per_block, self.ssm_life_cycle_id is not None)
        self._open_caches.add(kv)
        return kv

    def get_and_reset_reuse_stats(self) -> dict:
        """Reuse counters since the last call (per scheduler iteration):
        lookups, looked-up and reused tokens, full-block vs partial-block reuse,
        and, with an SSM layer, snapshot lookups, hits, misses, reused and
        unreused tokens, aligned and unaligned hits."""
        out = self._stats.as_dict()
        self._stats = ReuseStats()
        return out

    def get_and_reset_ssm_snapshot_iteration_stats(self) -> dict:
        """The SSM part of the reuse counters ({} without an SSM layer or when
        nothing was looked up since the last call)."""
        stats = self._stats
        self._stats = ReuseStats(**{k: v for k, v in stats.__dict__.items() if not k.startswith("ssm_")})
        return stats.ssm_dict()

    def page_memory(self, life_cycle_id: int):
        """The life cycle's GPU page pool as a [pages, page_bytes] uint8 array
        (None when ``page_bytes`` is 0); ``KVCache.page_indices`` index it."""
        return self._page_memory[life_cycle_id]

    def _copy_pages(self, copies):
        """Carry out the page copies a kernel recorded, in order: (life cycle,
        source page row, destination page row)."""
        if not len(copies):
            return
        for lc in copies[:, 0]:
            self._copies[int(lc)] += 1
        if not self.config.page_bytes:
            return
        src = self._tables.page_fields(copies[:, 1], PAGE_POOL_INDEX)
        dst = self._tables.page_fields(copies[:, 2], PAGE_POOL_INDEX)
        for k, lc in enumerate(copies[:, 0]):  # at most a few per call, one device copy each
            mem = self._page_memory[lc]
            mem[dst[k]] = mem[src[k]]

    def get_and_reset_iteration_stats(self) -> dict:
        """Per life cycle, the page copies made on the device since the last
        call (private tail copies, snapshots): ``{lc: {"iter_intra_device_copy_blocks",
        "iter_intra_device_copy_bytes"}}`` for life cycles that copied."""
        out = {
            lc: {"iter_intra_device_copy_blocks": n, "iter_intra_device_copy_bytes": n * self.config.page_bytes}
            for lc, n in enumerate(self._copies) if n
        }
        self._copies = [0] * len(self._copies)
        return out

    # -- maintenance -----------------------------------------------------------------------
    def _refuse_while_open(self, what: str):
        if self._open_caches:
            raise LogicError(f"{what}: {len(self._open_caches)} KV cache(s) still open")

    def clear_reusable_blocks(self):
        """Drop every block of the reuse tree; refused while caches are open."""
        self._refuse_while_open("clear_reusable_blocks()")
        self._tree.clear()

    def shutdown(self):
        self._refuse_while_open("shutdown()")
        self._tree.clear()

"""``KVCacheManager``: the scheduler-facing facade.

It validates input, owns the device tables, the tree and the token arena, and
answers reuse queries for whole batches with one kernel launch per stage.
"""

from __future__ import annotations

import weakref

import numpy as np

from .arena import TokenArena, TokenSequence
from .core.backend import get_backend, quiet_simulator
from .cache import KVCache, KVCacheStatus, LogicError
from .core.config import CacheConfig
from .core.kinds import has_window
from .evict import Evictor
from .core.layout import (
    CNT_DROPPED,
    CNT_EVICTED,
    CNT_MIGRATED,
    COPY_DST_INDEX,
    COPY_DST_LEVEL,
    COPY_LIFE_CYCLE,
    COPY_SRC_INDEX,
    COPY_SRC_LEVEL,
)
from .matching import BatchMatch, Matcher
from .core.scope import as_scope
from .stats import ReuseStats
from .tables import Tables
from .tokens import ValidTokens, token_array
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
        self._caches = weakref.WeakSet()  # every cache still referenced, closed ones too
        # What keeps a digest id or a scope id alive besides the tree itself.
        self._tables.digest_references = self._digest_references
        self._tree.scopes_in_use = self._scopes_in_use
        self._stats = ReuseStats()
        self._copies = np.zeros(len(config.life_cycles), dtype=np.int64)  # intra-device copies per life cycle
        # Real page memory: one [pages, page_bytes] byte array per life cycle
        # and cache level (GPU pools on the device, host pools in host memory).
        nbytes = config.page_bytes
        self._page_memory = [
            [self._backend.xp.zeros((n, nbytes), dtype=np.uint8) if nbytes else None
             for n in config.pages_per_life_cycle_list()],
            [np.zeros((n, nbytes), dtype=np.uint8) if nbytes and n else None
             for n in config.pages_per_life_cycle_list(host=True)],
        ]
        self._evictor = Evictor(self._tables)
        self._tree.evictor = self._evictor
        self._tree.copy_sink = self._copy_pages
        self._eviction_seen = np.zeros(3, dtype=np.int64)
        self._events = None
        if config.max_kv_event_entries > 0:
            from .events import KVCacheEventManager

            windows = [lc.window if has_window(lc.kind) else 0 for lc in config.life_cycles]
            self._events = KVCacheEventManager(
                config.max_kv_event_entries, config.event_hash, windows, self._tables.digest_of_token,
                scope_of_root=self._tree.scope_of_root_digest,
            )
            self._tree.event_sink = self._events.on_records
            self._events.created([sum(config.pages_per_life_cycle_list()), sum(config.pages_per_life_cycle_list(host=True))])

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
        # Validated before the sequence takes an arena slot, so a rejected
        # call holds nothing.
        arr = None if tokens is None else token_array(tokens, self._tables.intern_digest)
        seq = TokenSequence(self._arena)
        if arr is not None:
            seq.extend(ValidTokens(arr))
        return seq

    # -- sequences -------------------------------------------------------------------------
    def create_kv_cache(self, input_tokens=None, scope=None, priority_callback=None) -> KVCache:
        """A new, SUSPENDED cache. With ``input_tokens`` it runs the same match as
        ``probe_reuse`` and holds the matched pages at once;
        ``num_committed_tokens`` is the reused length. ``priority_callback(ordinal,
        life_cycle_id) -> 0..100`` gives the eviction priority of the pages this
        cache creates (default 35; lower values are evicted first)."""
        scope = as_scope(scope)
        m = None
        if input_tokens is not None:
            if type(input_tokens) is TokenSequence:  # the scheduler's registered request
                self._matcher._check_sequence(0, input_tokens)
                tokens = np.array(self._backend.to_host(input_tokens.tokens))
                query = input_tokens
            else:
                # Digests only looked up: a matched prefix holds interned ones
                # only, and a digest no block holds need not be kept.
                tokens = token_array(input_tokens, self._tables.lookup_digest)
                query = ValidTokens(tokens)
            m = self._matcher.match([query], scope).to_host()
        kv = KVCache(self, scope, priority_callback)
        self._caches.add(kv)
        if m is not None:
            n = int(m.num_tokens[0])
            if n:
                kv._setup_reuse(tokens, n, m.blocks(0))
            self._stats.record(len(tokens), n, self.tokens_per_block, self.ssm_life_cycle_id is not None)
        self._open_caches.add(kv)
        return kv

    def _digest_references(self):
        """Token arrays that may hold interned digest ids: the arena's, and the
        committed tokens of every cache still referenced (a closed one can
        still be asked for them)."""
        arena = self._arena
        yield arena.tokens[: arena.top_blocks * arena.T]
        for kv in list(self._caches):
            yield kv._q.tokens[: kv.num_committed_tokens]

    def _scopes_in_use(self):
        """Scope ids that caches still refer to (open ones create blocks in it)."""
        return [kv.scope_id for kv in list(self._caches) if kv.status is not KVCacheStatus.CLOSED]

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

    def page_memory(self, life_cycle_id: int, level: int = 0):
        """The life cycle's page pool at a cache level (0 = GPU, 1 = host) as a
        [pages, page_bytes] uint8 array (None when ``page_bytes`` is 0 or the
        level has no pages); ``KVCache.page_indices`` index the GPU pool."""
        L = len(self.config.life_cycles)
        if not isinstance(life_cycle_id, (int, np.integer)) or isinstance(life_cycle_id, bool) or not 0 <= life_cycle_id < L:
            raise ValueError(f"life_cycle_id must be in 0..{L - 1}, got {life_cycle_id!r}")
        if level not in (0, 1) or isinstance(level, bool) or not isinstance(level, (int, np.integer)):
            raise ValueError(f"level must be 0 (GPU) or 1 (host), got {level!r}")
        return self._page_memory[level][life_cycle_id]

    def _copy_pages(self, copies: np.ndarray):
        """Carry out the page data copies a launch recorded, in order. Runs of
        copies between the same two pools go as one gather/scatter when no copy
        in the run reads or overwrites a slot another one writes."""
        intra = (copies[:, COPY_SRC_LEVEL] == 0) & (copies[:, COPY_DST_LEVEL] == 0)
        self._copies += np.bincount(copies[intra, COPY_LIFE_CYCLE], minlength=len(self._copies))
        if not self.config.page_bytes:
            return
        key = copies[:, [COPY_LIFE_CYCLE, COPY_SRC_LEVEL, COPY_DST_LEVEL]]
        breaks = np.nonzero((key[1:] != key[:-1]).any(axis=1))[0] + 1
        for run in np.split(np.arange(len(copies)), breaks):
            lc, src_level, dst_level = (int(x) for x in key[run[0]])
            src, dst = copies[run, COPY_SRC_INDEX], copies[run, COPY_DST_INDEX]
            src_mem = self._page_memory[src_level][lc]
            dst_mem = self._page_memory[dst_level][lc]
            same_pool = src_level == dst_level
            if len(np.unique(dst)) == len(dst) and not (same_pool and np.intersect1d(src, dst).size):
                dst_mem[self._on(dst_level, dst)] = self._to(dst_level, src_mem[self._on(src_level, src)])
            else:
                for s_, d_ in zip(src.tolist(), dst.tolist()):  # rare: a slot reused within the run
                    dst_mem[d_] = self._to(dst_level, src_mem[s_])

    def _on(self, level: int, index: np.ndarray):
        return self._backend.to_device(index) if level == 0 else index

    def _to(self, level: int, data):
        """Page bytes moved into the memory of ``level`` (device or host)."""
        return self._backend.to_device(data) if level == 0 else np.asarray(self._backend.to_host(data))

    def get_and_reset_eviction_stats(self) -> dict:
        """Pages evicted from the GPU since the last call (``evicted``), of which
        moved to the host tier (``migrated``), and pages that died on eviction
        from their last level (``dropped``)."""
        c = self._tables.counters_host()
        now = np.array([c[CNT_EVICTED], c[CNT_MIGRATED], c[CNT_DROPPED]], dtype=np.int64)
        diff = now - self._eviction_seen
        self._eviction_seen = now
        return {"evicted": int(diff[0]), "migrated": int(diff[1]), "dropped": int(diff[2])}

    def get_latest_events(self) -> list:
        """KV cache events since the last call, oldest first ([] when events are
        off: ``max_kv_event_entries`` is 0)."""
        if self._events is None:
            return []
        self._events.flush_iteration_events()
        return self._events.get_latest_events()

    def get_and_reset_iteration_stats(self) -> dict:
        """Per life cycle, the page copies made on the device since the last
        call (private tail copies, snapshots): ``{lc: {"iter_intra_device_copy_blocks",
        "iter_intra_device_copy_bytes"}}`` for life cycles that copied."""
        out = {
            lc: {"iter_intra_device_copy_blocks": n, "iter_intra_device_copy_bytes": n * self.config.page_bytes}
            for lc, n in enumerate(self._copies.tolist()) if n
        }
        self._copies[:] = 0
        return out

    # -- maintenance -----------------------------------------------------------------------
    def _refuse_while_open(self, what: str):
        if self._open_caches:
            raise LogicError(f"{what}: {len(self._open_caches)} KV cache(s) still open")

    def clear_reusable_blocks(self):
        """Drop every block of the reuse tree; refused while caches are open."""
        self._refuse_while_open("clear_reusable_blocks()")
        if self._events is not None:
            self._events.mark_clear()
        self._tree.clear()

    def shutdown(self):
        self._refuse_while_open("shutdown()")
        if self._events is not None:
            self._events.mark_clear()
        self._tree.clear()

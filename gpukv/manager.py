"""``KVCacheManager``: the scheduler-facing facade.

It validates input, owns the device tables, the tree and the token arena, and
answers reuse queries for whole batches with one kernel launch per stage.
"""

from __future__ import annotations

import sys
import weakref

import numpy as np

from .arena import TokenArena, TokenSequence
from .core.backend import get_backend, quiet_simulator
from .cache import CacheContext, KVCache, KVCacheStatus, LogicError
from .core.config import CacheConfig
from .core.kinds import has_window
from .core.layout import CNT_DROPPED, CNT_EVICTED, CNT_MIGRATED
from .launcher import Launcher, first_load, serialized
from .matching import BatchMatch, Matcher
from .core.scope import as_scope
from .page_memory import PageMemory
from .stats import ReuseStats
from .tables import Tables
from .tokens import ValidTokens, token_array
from .tree import BlockTree


class KVCacheManager:
    """Layering, bottom up: ``Tables`` (the device arrays); the ``Launcher``
    that runs every kernel on them with its aftermath (``PageMemory`` and
    the event manager after it); the ``BlockTree``,
    ``Matcher`` and ``KVCache``s that validate calls and launch through it.
    Each part gets what it uses when it is built; nothing is patched in later.
    Public calls run one at a time (``launcher.CallGuard``)."""

    def __init__(self, config: CacheConfig):
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config must be a gpukv.CacheConfig, got {type(config).__name__}")
        if "numba" in sys.modules:
            self._build(config)
            return
        with first_load():  # the first manager of the process imports Numba
            self._build(config)

    def _build(self, config: CacheConfig):
        self.config = config
        self._backend = get_backend(config.backend)
        quiet_simulator()
        self._tables = Tables(config, self._backend)
        # Real page memory: one [pages, page_bytes] byte array per life cycle
        # and cache level (GPU pools on the device, host pools in host memory).
        self._pages = PageMemory(config, self._backend)
        self._events = None
        if config.max_kv_event_entries > 0:
            from .events import KVCacheEventManager

            windows = [lc.window if has_window(lc.kind) else 0 for lc in config.life_cycles]
            self._events = KVCacheEventManager(
                config.max_kv_event_entries, config.event_hash, windows, self._tables.digest_of_token,
                # The tree is built after the launcher that feeds these events.
                scope_of_root=lambda digest: self._tree.scope_of_root_digest(digest),
            )
            self._events.created([sum(config.pages_per_life_cycle_list()), sum(config.pages_per_life_cycle_list(host=True))])
        self._launcher = Launcher(self._tables, copier=self._pages, events=self._events)
        self._tree = BlockTree(self._tables, self._launcher)
        self._arena = TokenArena(self._backend, config.tokens_per_block, self._tables.intern_digest)
        self._matcher = Matcher(self._tables, self._tree, self._arena, config, self._launcher)
        self._open_caches: set[KVCache] = set()
        self._caches = weakref.WeakSet()  # every cache still referenced, closed ones too
        # What keeps a digest id or a scope id alive besides the tree itself.
        self._tables.digest_references = self._digest_references
        self._tree.scopes_in_use = self._scopes_in_use
        self._cache_context = CacheContext(
            manager=self, config=config, tables=self._tables, tree=self._tree, matcher=self._matcher,
            launcher=self._launcher, open_caches=self._open_caches,
        )
        self._stats = ReuseStats()
        self._eviction_seen = np.zeros(3, dtype=np.int64)

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
    @serialized("mgr.match_batch()")
    def match_batch(self, requests, scopes=None) -> BatchMatch:
        """Reuse results for a whole scheduling batch (docs/semantics.md §2.3-2.4).

        ``requests``: token sequences (lists, 1-D integer arrays or registered
        ``TokenSequence``s), or a pair ``(flat_tokens, offsets)`` with offsets of
        length B+1 (device arrays accepted). ``scopes``: None, one ``ReuseScope``
        for all, or one per request. Holds nothing: the result is volatile.
        """
        return self._matcher.match(requests, scopes)

    @serialized("mgr.probe_reuse()")
    def probe_reuse(self, tokens, scope=None) -> int:
        """The reusable prefix length of one token sequence; holds nothing."""
        m = self._matcher.match([tokens], as_scope(scope))
        return int(self._backend.to_host(m.num_tokens)[0])

    @serialized("mgr.token_sequence()")
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
    @serialized("mgr.create_kv_cache()")
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
        kv = KVCache(self._cache_context, scope, priority_callback)
        self._caches.add(kv)
        n = 0 if m is None else int(m.num_tokens[0])
        # From here to the return, an exception (an interrupt included) means
        # the caller never gets this cache: it must not stay open, holding its
        # reused pages and keeping shutdown() refused.
        try:
            self._open_caches.add(kv)
            if n:
                kv._setup_reuse(tokens, n, m.blocks(0))
            if m is not None:
                self._stats.record(len(tokens), n, self.tokens_per_block, self.ssm_life_cycle_id is not None)
            return kv
        except BaseException:
            try:
                kv._close()
            except BaseException:
                pass  # the first exception is the one to report
            raise

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

    @serialized("mgr.get_and_reset_reuse_stats()")
    def get_and_reset_reuse_stats(self) -> dict:
        """Reuse counters since the last call (per scheduler iteration):
        lookups, looked-up and reused tokens, full-block vs partial-block reuse,
        and, with an SSM layer, snapshot lookups, hits, misses, reused and
        unreused tokens, aligned and unaligned hits."""
        out = self._stats.as_dict()
        self._stats = ReuseStats()
        return out

    @serialized("mgr.get_and_reset_ssm_snapshot_iteration_stats()")
    def get_and_reset_ssm_snapshot_iteration_stats(self) -> dict:
        """The SSM part of the reuse counters ({} without an SSM layer or when
        nothing was looked up since the last call)."""
        stats = self._stats
        self._stats = ReuseStats(**{k: v for k, v in stats.__dict__.items() if not k.startswith("ssm_")})
        return stats.ssm_dict()

    @serialized("mgr.page_memory()")
    def page_memory(self, life_cycle_id: int, level: int = 0):
        """The life cycle's page pool at a cache level (0 = GPU, 1 = host) as a
        [pages, page_bytes] uint8 array (None when ``page_bytes`` is 0 or the
        level has no pages); ``KVCache.page_indices`` index the GPU pool."""
        L = len(self.config.life_cycles)
        if not isinstance(life_cycle_id, (int, np.integer)) or isinstance(life_cycle_id, bool) or not 0 <= life_cycle_id < L:
            raise ValueError(f"life_cycle_id must be in 0..{L - 1}, got {life_cycle_id!r}")
        if level not in (0, 1) or isinstance(level, bool) or not isinstance(level, (int, np.integer)):
            raise ValueError(f"level must be 0 (GPU) or 1 (host), got {level!r}")
        return self._pages.pool(life_cycle_id, level)

    @serialized("mgr.get_and_reset_eviction_stats()")
    def get_and_reset_eviction_stats(self) -> dict:
        """Pages evicted from the GPU since the last call (``evicted``), of which
        moved to the host tier (``migrated``), and pages that died on eviction
        from their last level (``dropped``)."""
        c = self._tables.counters_host()
        now = np.array([c[CNT_EVICTED], c[CNT_MIGRATED], c[CNT_DROPPED]], dtype=np.int64)
        diff = now - self._eviction_seen
        self._eviction_seen = now
        return {"evicted": int(diff[0]), "migrated": int(diff[1]), "dropped": int(diff[2])}

    @serialized("mgr.get_latest_events()")
    def get_latest_events(self) -> list:
        """KV cache events since the last call, oldest first ([] when events are
        off: ``max_kv_event_entries`` is 0)."""
        if self._events is None:
            return []
        self._events.flush_iteration_events()
        return self._events.get_latest_events()

    @serialized("mgr.get_and_reset_iteration_stats()")
    def get_and_reset_iteration_stats(self) -> dict:
        """Per life cycle, the page copies made on the device since the last
        call (private tail copies, snapshots): ``{lc: {"iter_intra_device_copy_blocks",
        "iter_intra_device_copy_bytes"}}`` for life cycles that copied."""
        return {
            lc: {"iter_intra_device_copy_blocks": n, "iter_intra_device_copy_bytes": n * self.config.page_bytes}
            for lc, n in enumerate(self._pages.take_intra_device_copies().tolist()) if n
        }

    # -- maintenance -----------------------------------------------------------------------
    def _refuse_while_open(self, what: str):
        if self._open_caches:
            raise LogicError(f"{what}: {len(self._open_caches)} KV cache(s) still open")

    @serialized("mgr.clear_reusable_blocks()")
    def clear_reusable_blocks(self):
        """Drop every block of the reuse tree; refused while caches are open."""
        self._refuse_while_open("clear_reusable_blocks()")
        if self._events is not None:
            self._events.mark_clear()
        self._tree.clear()

    @serialized("mgr.shutdown()")
    def shutdown(self):
        self._refuse_while_open("shutdown()")
        if self._events is not None:
            self._events.mark_clear()
        self._tree.clear()

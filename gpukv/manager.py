"""``KVCacheManager``: the scheduler-facing facade.

It validates input, owns the device tables, the tree and the token arena, and
answers reuse queries for whole batches with one kernel launch per stage.

About 500 lines because it is the whole public surface of one class: each
method is a short validated entry into the parts below (``batch``,
``matching``, ``page_reads``, ``tree``) with its docstring, which is the
API reference; the work itself lives in those modules.
"""

from __future__ import annotations

import sys

import numpy as np

from . import inputs, kernel_cache, page_reads
from .arena import TokenArena, TokenSequence
from .core.backend import get_backend, quiet_simulator
from .cache import CacheContext, KVCache
from .batch import CacheCalls
from .cache_pool import CachePool
from .core.config import CacheConfig
from .core.errors import LogicError
from .core.kinds import has_window
from .core.layout import CNT_DROPPED, CNT_EVICTED, CNT_MIGRATED
from .kernels.victims import build_victims_kernel
from .launcher import Launcher, first_load, serialized
from .matching import BatchMatch, Matcher
from .core.scope import as_scope
from .page_memory import PageCopies, PageMemory
from .stats import ReuseStats
from .streams import stream_scope
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

    def __init__(self, config: CacheConfig, stream=None):
        """``stream``: the CUDA stream every call of this manager queues its
        device work on (kernels, copies, reads), given as a handle or a CuPy,
        PyTorch or Numba stream; None: whatever stream CuPy uses at the call
        (by default the legacy default stream). See docs/integration.md."""
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config must be a gpukv.CacheConfig, got {type(config).__name__}")
        if "numba" in sys.modules:
            self._build(config, stream)
            return
        with first_load():  # the first manager of the process imports Numba
            self._build(config, stream)

    def _build(self, config: CacheConfig, stream):
        self.config = config
        self._backend = get_backend(config.backend)
        quiet_simulator()
        self._stream = stream
        scope = stream_scope(self._backend, stream)
        with scope:  # the tables are filled on the manager's stream too
            self._build_parts(config, scope)

    def _build_parts(self, config: CacheConfig, scope):
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
        self._launcher = Launcher(self._tables, copier=self._pages, events=self._events, stream_scope=scope)
        self._tree = BlockTree(self._tables, self._launcher)
        self._arena = TokenArena(self._backend, config.tokens_per_block, self._tables.intern_digest)
        self._matcher = Matcher(self._tables, self._tree, self._arena, config, self._launcher)
        self._pool = CachePool(config, self._backend)
        self._open_caches: set[KVCache] = set()
        # What keeps a digest id or a scope id alive besides the tree itself.
        self._tables.digest_references = self._digest_references
        self._tree.scopes_in_use = self._scopes_in_use
        self._cache_context = CacheContext(
            manager=self, config=config, tables=self._tables, tree=self._tree, matcher=self._matcher,
            launcher=self._launcher, open_caches=self._open_caches, pool=self._pool,
        )
        self._stats = ReuseStats()
        # Every call on caches, for one (KVCache's methods) or a batch.
        self._calls = CacheCalls(self._cache_context, lambda: self._stats)
        self._eviction_seen = np.zeros(3, dtype=np.int64)
        self._obtainable: dict = {}  # (life cycle, level) -> (launches, Tables.obtainable_pages()) as last read
        self._victims = build_victims_kernel(self._backend.target)
        kernel_cache.announce(self._backend.target)  # once per process: kernels a first call would compile

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
    def stream(self):
        """The stream given at construction (None: CuPy's current stream at each call)."""
        return self._stream

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
        m = self._matcher.match(requests, scopes)
        if self._stream is not None:
            # The last kernels may still run on the manager's stream; the
            # caller may read the result on another one.
            self._backend.synchronize()
        return m

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
        seq = TokenSequence(self._arena, self._launcher)
        if arr is not None:
            self._arena.extend(seq._slot, ValidTokens(arr))  # under this call's guard already
        return seq

    # -- sequences -------------------------------------------------------------------------
    def create_kv_cache(self, input_tokens=None, scope=None, priority_callback=None) -> KVCache:
        """A new, SUSPENDED cache. With ``input_tokens`` it runs the same match as
        ``probe_reuse`` and holds the matched pages at once;
        ``num_committed_tokens`` is the reused length. ``priority_callback(ordinal,
        life_cycle_id) -> 0..100`` gives the eviction priority of the pages this
        cache creates (default 35; lower values are evicted first)."""
        made = []  # closed again if the call raises after making the cache (_close_unreturned)
        try:
            return self._launcher.guard.run("mgr.create_kv_cache()", self._calls.create_one,
                                            (input_tokens, scope, priority_callback, made), {})
        except BaseException:
            self._close_unreturned("mgr.create_kv_cache()", made)
            raise

    # -- the engine step: many caches per call ---------------------------------------------
    def create_kv_caches(self, requests, scopes=None, priority_callbacks=None) -> list:
        """``[create_kv_cache(r, scope, cb) for ...]`` in two launches: one match
        for all requests (as ``match_batch``), then one holding every cache's
        reused pages. ``requests``: token sequences or registered
        ``TokenSequence``s; ``scopes``: None, one ``ReuseScope`` or one per
        request; ``priority_callbacks``: None or one (callable or None) per
        request. The caches are SUSPENDED: ``resume_batch`` next."""
        made = []  # closed again if the call raises after making them (_close_unreturned)
        try:
            return self._launcher.guard.run("mgr.create_kv_caches()", self._calls.create,
                                            (requests, scopes, priority_callbacks, made), {})
        except BaseException:
            self._close_unreturned("mgr.create_kv_caches()", made)
            raise

    def admit_batch(self, match, capacities, entries=None, priority_callbacks=None) -> tuple:
        """``(caches, ok)``: requests of an earlier ``match_batch`` as new
        caches, each holding what the match found for it, resumed and resized
        to ``capacities[i]``, in one launch and no second match: what
        ``create_kv_caches`` of the same requests does, then per cache in
        order ``kv.resume() and kv.resize(capacities[i])``. ``entries``:
        which of the match's requests, in order (None: all; one may come
        twice); ``priority_callbacks`` as for ``create_kv_caches``.
        ``ok[i]`` False: pages were short, and cache ``i`` is SUSPENDED (its
        resume was refused) or ACTIVE at its reused length (its resize was).

        The match must be current: a call that removed blocks or pages from
        the tree since it was made (an eviction, a close that freed a block)
        makes it stale, and the call raises ``StaleMatchError``, changing
        nothing (``is_current`` tells ahead). Blocks added since do not: the
        prefix the match found is still there."""
        made = []  # closed again if the call raises after making them (_close_unreturned)
        try:
            _, ok = self._launcher.guard.run("mgr.admit_batch()", self._calls.admit,
                                             (match, capacities, entries, priority_callbacks, made), {})
            return made, ok
        except BaseException:
            self._close_unreturned("mgr.admit_batch()", made)
            raise

    def allocate_batch(self, caches, capacities, match, admit_capacities, entries=None, priority_callbacks=None) -> tuple:
        """``(resized, new_caches, admitted)``: a scheduler step's allocations
        in one launch, ``resize_batch(caches, capacities)`` for the running
        caches and ``admit_batch(match, admit_capacities, entries,
        priority_callbacks)`` for the admissions. What the launch does: the
        admissions hold their prefixes, then the running caches are resized
        in order, then each admission is resumed and sized; bad input in
        either part is refused before anything changes."""
        made = []  # closed again if the call raises after making them (_close_unreturned)
        try:
            resized, ok = self._launcher.guard.run(
                "mgr.allocate_batch()", self._calls.admit,
                (match, admit_capacities, entries, priority_callbacks, made), {"grow": (caches, capacities)})
            return resized, made, ok
        except BaseException:
            self._close_unreturned("mgr.allocate_batch()", made)
            raise

    def is_current(self, match) -> bool:
        """Whether ``admit_batch`` takes ``match`` (a ``match_batch`` result of
        this manager, with nothing removed from the tree since)."""
        stamp = getattr(match, "stamp", None)
        return stamp is not None and stamp.launcher is self._launcher and stamp.removals == self._launcher.removals

    def _close_unreturned(self, what: str, made: list):
        """The caches a creating call made, closed again: it raised after
        making them (an interrupt included, on the call guard's way out too),
        so its caller never got them, and open they would hold their reused
        pages and keep ``shutdown()`` refused. The creating methods call this
        from their own frame, outside the guard: the one that sees every way
        out of the call."""
        if made:
            try:
                self._launcher.guard.run(what, self._calls.close, (made,), {})
            except BaseException:
                pass  # the exception on its way out is the one to report

    @serialized("mgr.resume_batch()")
    def resume_batch(self, caches) -> np.ndarray:
        """``kv.resume()`` for each SUSPENDED cache, in order, in one launch:
        one bool per cache (False: refused, that cache unchanged)."""
        return self._calls.resume(caches)

    @serialized("mgr.resize_batch()")
    def resize_batch(self, caches, capacities, history_lengths=None) -> np.ndarray:
        """``kv.resize(capacities[i], history_lengths[i])`` for each ACTIVE
        cache, in order, in one launch: one bool per cache (False: refused,
        that cache unchanged, the rest proceed). ``history_lengths`` None
        keeps each cache's history."""
        return self._calls.resize(caches, capacities, history_lengths)

    @serialized("mgr.commit_batch()")
    def commit_batch(self, caches, tokens, is_end=False) -> None:
        """``kv.commit(tokens[i], is_end[i])`` for each ACTIVE cache, in order,
        in one launch. ``tokens``: one token sequence per cache, or a pair
        ``(flat_tokens, offsets)`` with offsets of length len(caches) + 1
        (device arrays accepted on ``cuda``); ``is_end``: a bool or one per cache."""
        self._calls.commit(caches, tokens, is_end)

    def cache_batch(self, caches) -> inputs.CacheBatch:
        """``caches`` (this manager's, each once) checked once, as a tuple
        that every batched call takes where it takes a list of caches, without
        checking it again: an engine's running batch, made when it changes and
        passed to each step's calls (``append_batch``, ``commit_batch``, ...)."""
        return inputs.CacheBatch(caches, inputs.cache_slots(caches, self._pool, "cache_batch()").copy(), self._pool)

    @serialized("mgr.append_batch()")
    def append_batch(self, caches, tokens, room=1, is_end=False) -> np.ndarray:
        """What an engine step ends with, in one launch: for each ACTIVE cache,
        in order, ``kv.commit(tokens[i], is_end[i])`` (the tokens whose KV the
        step wrote), then, unless it ended, room for ``room`` (an int, or one
        per cache) more tokens: ``kv.resize`` to whole blocks past them, the
        history as the commit leaves it, where the capacity is short. A bool
        per cache: False where a pool was short for the room; its tokens are
        committed and its capacity is as it was (preempt it, or retry).
        ``tokens`` and ``is_end`` as ``commit_batch`` takes them."""
        return self._calls.append(caches, tokens, room, is_end)

    @serialized("mgr.close_batch()")
    def close_batch(self, caches, evict_first=False) -> None:
        """``kv.close(evict_first)`` for each cache, in order, in one launch
        (closed ones are skipped, as closing twice is a no-op); ``evict_first``:
        a bool or one per cache."""
        self._calls.close(caches, evict_first)

    def _digest_references(self):
        """Token arrays that may hold interned digest ids: the arena's, and the
        committed tokens of every cache still referenced (a closed one can
        still be asked for them)."""
        arena = self._arena
        yield arena.tokens[: arena.top_blocks * arena.T]
        yield self._pool.committed_tokens()

    def _scopes_in_use(self):
        """Scope ids that caches still refer to (open ones create blocks in it)."""
        return self._pool.open_scope_ids()

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

    def _check_pool(self, life_cycle_id, level):
        L = len(self.config.life_cycles)
        if not isinstance(life_cycle_id, (int, np.integer)) or isinstance(life_cycle_id, bool) or not 0 <= life_cycle_id < L:
            raise ValueError(f"life_cycle_id must be in 0..{L - 1}, got {life_cycle_id!r}")
        if level not in (0, 1) or isinstance(level, bool) or not isinstance(level, (int, np.integer)):
            raise ValueError(f"level must be 0 (GPU) or 1 (host), got {level!r}")

    @serialized("mgr.page_memory()")
    def page_memory(self, life_cycle_id: int, level: int = 0):
        """The life cycle's page pool at a cache level (0 = GPU, 1 = host) as a
        [pages, page_bytes] uint8 array (None when ``page_bytes`` is 0 or the
        level has no pages); ``KVCache.page_indices`` index the GPU pool."""
        self._check_pool(life_cycle_id, level)
        return self._pages.pool(life_cycle_id, level)

    @serialized("mgr.obtainable_pages()")
    def obtainable_pages(self, life_cycle_id: int = 0, level: int = 0) -> int:
        """How many pages of the life cycle's pool at a cache level (0 = GPU,
        1 = host) an allocation could have now: the free ones plus what
        eviction may free (cached pages no cache holds; on the GPU also those
        of suspended caches while the host tier has room for them). A fit
        check before admitting a request, or a usage gauge. Constant time,
        whatever the pool's size; on ``cuda`` one small read after each call
        that launched a kernel, none otherwise."""
        self._check_pool(life_cycle_id, level)
        launches = self._launcher.launches
        known = self._obtainable.get((life_cycle_id, level))
        if known is None or known[0] != launches:
            known = self._obtainable[life_cycle_id, level] = (launches, self._tables.obtainable_pages(life_cycle_id, level))
        return known[1]

    @serialized("mgr.free_pages()")
    def free_pages(self, life_cycle_id: int = 0, level: int = 0) -> int:
        """Free storage slots of the life cycle's pool at a cache level: pages
        never used or released, not merely evictable (``obtainable_pages``
        adds those). An allocation that fits in them evicts nothing."""
        self._check_pool(life_cycle_id, level)
        return page_reads.free_pages(self._tables, life_cycle_id, level)

    @serialized("mgr.eviction_order()")
    def eviction_order(self, count: int, life_cycle_id: int = 0, level: int = 0) -> np.ndarray:
        """The storage slots (int32; on the GPU, ``KVCache.page_indices``'
        page indices) of the next ``count`` pages eviction would drop from the
        life cycle's pool at a cache level, in the order it drops them, while
        no call changes the pool; fewer when fewer are candidates. These are
        the cached pages no cache holds, lowest priority first, oldest first.
        Pages eviction moves to the host tier instead (those of suspended
        caches, while the host has room) are not among them: without a host
        tier, an allocation that evicts ``k`` pages takes exactly the first
        ``k``, and with them any cached descendants their blocks leave
        unreachable (a priority callback can make an ancestor go first).
        An engine that queues allocations asks it whether a prefix it found
        survives them. Costs ``count`` steps of a list walk, one read."""
        self._check_pool(life_cycle_id, level)
        if not isinstance(count, (int, np.integer)) or isinstance(count, bool) or count < 0:
            raise ValueError(f"count must be an int >= 0, got {count!r}")
        if count == 0:
            return np.zeros(0, dtype=np.int32)
        return page_reads.eviction_order(self._launcher, self._victims, life_cycle_id, level, int(count))

    @serialized("mgr.page_indices_batch()")
    def page_indices_batch(self, caches, life_cycle_id: int = 0, first_blocks=None) -> tuple:
        """The pages of many caches in one read: ``(indices, offsets)``, where
        ``indices[offsets[i]:offsets[i + 1]]`` equals
        ``caches[i].page_indices(life_cycle_id)[first_blocks[i]:]`` (int32,
        offsets int64 of length ``len(caches) + 1``; ``first_blocks`` None:
        every block). An engine reads the blocks its requests gained in a step
        this way, one transfer for the whole batch."""
        self._check_pool(life_cycle_id, 0)
        return page_reads.page_indices_batch(self._calls, caches, life_cycle_id, first_blocks)

    @serialized("mgr.match_pages()")
    def match_pages(self, block_rows, life_cycle_id: int = 0) -> tuple:
        """``(indices, held)`` of matched tree blocks (``BatchMatch.blocks(i)``,
        read while nothing changed the tree since the match): each block's GPU
        page index in the life cycle's pool (-1: none, or on the host tier)
        and whether a cache holds or locks that page (False: eviction may take
        it). An engine counts from it what holding a hit would take off the
        eviction lists before it holds anything."""
        self._check_pool(life_cycle_id, 0)
        rows = np.asarray(block_rows)
        if rows.ndim != 1 or (rows.size and rows.dtype.kind not in "iu"):
            raise TypeError(f"block_rows must be a 1-D array of tree block rows, got {rows.dtype} of shape {rows.shape}")
        if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= self._tables.num_rows):
            raise ValueError(f"block_rows must be tree block rows in 0..{self._tables.num_rows - 1}")
        return page_reads.match_pages(self._tables, rows, life_cycle_id)

    def take_page_copies(self) -> PageCopies:
        """The page data copies the engine must carry out, decided since the
        last call, in order; each is then forgotten (docs/integration.md).

        With ``page_bytes == 0`` the engine owns the KV memory: every private
        tail copy (first ``resume``), snapshot copy (``commit``) and migration
        to or from the host tier (eviction, ``resume``) is kept here until
        taken. Take them every step, after the step's calls and before the
        model reads or writes any page; nothing is dropped, so an engine that
        never takes them grows this list without bound. With ``page_bytes >
        0`` gpukv has already made every copy in its own page memory when the
        call that decided it returns, and this returns no copies.

        Each copy is handed over once: a call that raises (a ``KeyboardInterrupt``
        from a signal handler too, wherever it lands in the call) hands over
        none, and the next call returns them, ahead of the newer ones."""
        receipt = object()  # tells this take apart from every other
        # The guard's own way out runs after the copies were taken; only this
        # frame, outside it, knows whether they reached the caller.
        try:
            return self._launcher.guard.run("mgr.take_page_copies()", self._pages.take_copies, (receipt,), {})
        except BaseException:
            self._pages.give_back(receipt)
            raise

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

    def get_latest_events(self) -> list:
        """KV cache events since the last call, oldest first ([] when events are
        off: ``max_kv_event_entries`` is 0). Each event is handed over once: a
        call that raises (an interrupt included, wherever it lands in the
        call) hands over none, and the next call returns them."""
        if self._events is None:
            return []
        receipt = object()  # tells this drain apart from every other
        try:
            return self._launcher.guard.run("mgr.get_latest_events()", self._drain_events, (receipt,), {})
        except BaseException:
            # The guard's own way out runs after the drain; only this frame,
            # outside it, knows whether the events reached the caller.
            self._events.give_back(receipt)
            raise

    def _drain_events(self, receipt) -> list:
        self._events.flush_iteration_events()
        return self._events.get_latest_events(receipt)

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

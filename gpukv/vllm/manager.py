"""``GpukvKVCacheManager``: vLLM's ``KVCacheManager`` interface over gpukv.

vLLM's v1 ``Scheduler`` builds it with the same sixteen keyword arguments as
its own manager (``vllm/v1/core/sched/scheduler.py``) and calls it per
request. Every decision the scheduler waits for (how long a prefix hit is,
whether an allocation fits) is made here from counts, exactly as vLLM's
manager makes it; the gpukv calls behind it are queued and issued in batches
(``step.py``). Block ids live in vLLM's id space (``blocks.py``).

Two modes (``config.resolve_mode``):

- **parity** (default): gpukv's partial reuse off. Hits are whole blocks,
  capped at ``num_tokens - 1``, and allocation, caching and freeing happen
  at the moments vLLM's manager does them, so vLLM's scheduler makes exactly
  the decisions it makes on its own manager.
- **partial**: gpukv's per-page coverage on. A hit may end inside a block; the
  request then gets a private copy of that tree page, announced through
  ``take_kv_cache_block_copies`` (vLLM's copy-on-write channel, which its
  worker applies before the forward). A request's last, partial block is
  committed when it is freed, so a later request can resume inside it.

Not supported (each refused by name): KV connectors, speculative decoding,
multimodal inputs, prompt embeddings, encoder-decoder models, more than one
KV cache group, KV cache groups other than full attention.
"""

from __future__ import annotations

from itertools import chain, islice

import numpy as np

from .blocks import BlockIds, kv_cache_blocks_types
from .config import gpukv_config, unsupported, validate
from .events import EventLog
from .scope import scope_of
from .step import RequestState, StepCalls
from .views import BlockPoolView, CoordinatorView, SingleTypeView


_NO_TOKENS = np.zeros(0, dtype=np.int32)  # an admission without a hit matches nothing


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class GpukvKVCacheManager:
    """A drop-in for ``vllm.v1.core.kv_cache_manager.KVCacheManager``.

    Keyword arguments are vLLM's, plus ``partial_reuse`` (None: from
    ``$GPUKV_VLLM_MODE``) and ``backend`` (gpukv's backend; None: ``auto``).
    """

    def __init__(
        self,
        kv_cache_config,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector=None,
        watermark: float = 0.0,
        enable_mamba_shared_prefix_checkpoint: bool = False,
        *,
        partial_reuse: bool | None = None,
        backend: str | None = None,
    ) -> None:
        import gpukv
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.metrics.stats import PrefixCacheStats
        from vllm.v1.request import RequestStatus

        cfg = validate(
            kv_cache_config, max_model_len, scheduler_block_size, hash_block_size, max_in_flight_tokens,
            enable_caching, use_eagle, num_hash_lookahead_tokens, num_prefill_lookahead, log_stats,
            enable_kv_cache_events, dcp_world_size, pcp_world_size, metrics_collector, watermark,
            enable_mamba_shared_prefix_checkpoint, partial_reuse,
        )
        self._T = cfg.block_size
        self._gk = gpukv.KVCacheManager(gpukv_config(cfg, backend))
        self._PendingBlocks, self._HitBlocks = kv_cache_blocks_types()
        self._PrefixCacheStats = PrefixCacheStats
        self._admitting_statuses = (RequestStatus.WAITING, RequestStatus.PREEMPTED)

        # vLLM's public attributes, as its manager has them.
        self.kv_cache_config = kv_cache_config
        self.max_model_len = cfg.max_model_len
        self.enable_caching = cfg.enable_caching
        self.enable_kv_cache_events = cfg.enable_kv_cache_events
        self.use_eagle = False
        self.log_stats = cfg.log_stats
        self.metrics_collector = None
        self.prefix_cache_stats = PrefixCacheStats() if cfg.log_stats else None
        self.num_kv_cache_groups = 1
        self.watermark_blocks = cfg.watermark_blocks
        self.retained_hit_group_ids = ()
        self.mamba_shared_prefix_checkpoint = False
        self.partial_reuse = cfg.partial_reuse
        self.empty_kv_cache_blocks = KVCacheBlocks(((),))

        self._ids = BlockIds(cfg.num_blocks)
        self._events = (
            EventLog(cfg.num_pages, cfg.block_size, cfg.spec_kind, cfg.sliding_window)
            if cfg.enable_kv_cache_events else None
        )
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.block_pool = BlockPoolView(self._ids, cfg.num_blocks, cfg.block_size, cfg.enable_caching, self._free_blocks)
        self._group = SingleTypeView(spec, cfg.block_size, self.block_pool, cfg.enable_caching)
        self.coordinator = CoordinatorView(self._group, self.block_pool, self._blocks_to_allocate)
        self._requests: dict[str, RequestState] = {}
        self._waiting = None  # the scheduler's waiting queue (lookup_ahead), or None: one match per lookup
        self._lookahead_depth = 0
        self._ahead: dict = {}  # request id -> a lookup matched ahead (_lookup's tuple)
        self._entry_reads = (-1, {})  # (step version, request id -> match_pages of its entry's rows)
        # request id -> (gpukv match, entry, hit) of its last lookup: its
        # admission creates the cache from that match when it is still current
        # and the hit is the match's own (admit_batch: no second match).
        self._matched: dict = {}
        self._step = StepCalls(
            self._gk, cfg.block_size, self._ids, self._events, self._group.num_cached_block, cfg.needs_zeroing,
            track_fresh=cfg.partial_reuse,
        )

    # -- facts ---------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self._T

    @property
    def gpukv(self):
        """The gpukv ``KVCacheManager`` underneath (after the pending calls)."""
        self._flush()
        return self._gk

    @property
    def usage(self) -> float:
        """KV cache usage in 0..1: pages neither free nor evictable."""
        return self.block_pool.get_usage()

    def _free_blocks(self) -> int:
        """vLLM's free-queue length: free plus evictable pages."""
        self._flush()
        return self._step.obtainable()

    def _flush(self) -> None:
        if self._step.dirty:
            self._step.flush()

    # -- statistics ------------------------------------------------------------------
    def make_prefix_cache_stats(self):
        """Get (and reset) the prefix cache stats; None when stats are off."""
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, self._PrefixCacheStats()
        return stats

    def prefix_cache_lookup_enabled(self, request) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request, num_hits: int) -> None:
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens, num_hits=num_hits, preempted=request.num_preemptions > 0,
        )

    # -- lookup ----------------------------------------------------------------------
    def _check_request(self, request) -> None:
        if request.mm_features:
            raise unsupported("multimodal inputs", f"request {request.request_id!r} has {len(request.mm_features)} item(s)")
        if request.prompt_embeds is not None:
            raise unsupported("prompt embeddings", f"request {request.request_id!r}")

    def get_computed_blocks(self, request, max_cache_hit_length: int | None = None):
        """``(hit blocks, hit tokens, 0)``: the longest cached prefix, at most
        ``max_cache_hit_length`` tokens (default ``num_tokens - 1``: the last
        prompt token is recomputed for its logits). Holds nothing."""
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        self._check_request(request)
        limit = self._lookup_limit(request, max_cache_hit_length)
        issue = self._step.affects(request, lambda heads: self._hit_survives(request, limit, heads)) \
            if self._step.dirty and limit > 0 else None
        if issue is not None:
            issue()  # the tree as vLLM's cache is now, where it matters to this request
        if limit <= 0:
            return self.empty_kv_cache_blocks, 0, 0
        found = self._current_entry(request, limit)
        self._ahead.pop(request.request_id, None)
        if found is None:
            found = self._lookup(request, limit)
        hit, rows, tokens, match, entry = found[3:]
        own = hit
        T = self._T
        if hit % T and self._step.any_fresh and self._step.fresh[self._gk.match_pages(rows[-1:])[0][0]]:
            # The block the hit ends in was cached this step: its KV is written
            # by this step's forward, after the copy that would share it runs.
            # Reuse its whole blocks only (those are read after they are written).
            hit = hit // T * T
            rows = rows[: hit // T]
        self._matched[request.request_id] = (match if hit == own else None, entry, hit)
        if hit == 0:
            return self.empty_kv_cache_blocks, 0, 0
        if self._events is not None and getattr(request, "kv_cache_report_mode", "incremental") == "full":
            self._events.reused(request, hit // T)
        return self._HitBlocks(self._hit_pages, rows, hit, tokens[:hit]), hit, 0

    def _current_entry(self, request, limit: int):
        """The step's match entry of ``request`` at ``limit`` when it is
        current (no gpukv call issued since it was made), else None."""
        found = self._ahead.get(request.request_id)
        if found is None or found[0] is not request or found[1] != limit or found[2] != self._step.version:
            return None
        return found

    def _hit_survives(self, request, limit: int, heads: int) -> bool:
        """Whether a lookup of ``request`` at ``limit`` on the tree as it is
        (matched now, unless the step's match answers it) hits no page among
        the first ``heads`` of the eviction order: held pages (never listed)
        and candidates further down stay whatever the queued allocations
        evict. The entry stays for the lookup that follows."""
        found = self._current_entry(request, limit)
        if found is None:
            found = self._ahead[request.request_id] = self._lookup(request, limit)
        if not len(found[4]):
            return True
        pages, held = self._entry_pages(request.request_id, found)
        candidates = pages[~held]
        return not len(candidates) or not np.isin(candidates, self._step.victims(heads)).any()

    def _entry_pages(self, request_id, found) -> tuple:
        """``match_pages`` of a current entry's hit rows, read for every
        current entry of the step at once (the lookups after the first ask
        for theirs while nothing was issued)."""
        version = self._step.version
        if self._entry_reads[0] != version or request_id not in self._entry_reads[1]:
            current = [(rid, e[4]) for rid, e in self._ahead.items() if e[2] == version and len(e[4])]
            pages, held = self._gk.match_pages(np.concatenate([rows for _, rows in current]))
            reads, start = {}, 0
            for rid, rows in current:
                reads[rid] = (pages[start:start + len(rows)], held[start:start + len(rows)])
                start += len(rows)
            self._entry_reads = (version, reads)
        return self._entry_reads[1][request_id]

    def _lookup_limit(self, request, max_cache_hit_length: int | None) -> int:
        """The most tokens a lookup of ``request`` may hit."""
        limit = request.num_tokens - 1 if max_cache_hit_length is None else min(max_cache_hit_length, request.num_tokens)
        if not self.partial_reuse:
            # vLLM looks up hashed full blocks only.
            limit = min(limit, len(request.block_hashes) * self._T) // self._T * self._T
        return limit

    def lookup_ahead(self, waiting, depth: int) -> None:
        """The scheduler's waiting queue, in its scheduling order, and how many
        of its first requests the coming step could admit. The step's first
        lookup then matches all of them that need one in one gpukv match, and
        the lookups after it are answered from that match while no gpukv call
        was issued since and none queued could change their answer (the same
        rule as a lookup on its own: ``StepCalls.affects``)."""
        self._waiting = waiting
        self._lookahead_depth = max(int(depth), 0)

    def _lookup(self, request, limit: int) -> tuple:
        """Match ``request`` (and the waiting head announced by ``lookup_ahead``)
        in one gpukv match: ``(request, limit, version, hit, rows, tokens,
        match, entry)``."""
        batch = [(request, limit)]
        if self._waiting is not None and self._lookahead_depth > 1:
            for r in islice(self._waiting, self._lookahead_depth):
                if r is request or r.num_computed_tokens or not self.prefix_cache_lookup_enabled(r):
                    continue
                if r.mm_features or r.prompt_embeds is not None:
                    continue  # refused when it is looked up itself
                n = self._lookup_limit(r, None)
                if n > 0:
                    batch.append((r, n))
        counts = [n for _, n in batch]
        # One int32 array: gpukv converts a list token by token, and the
        # admission creates the cache from a slice of the same array.
        tokens = np.fromiter(
            chain.from_iterable(r.all_token_ids[:n] for r, n in batch), dtype=np.int32, count=sum(counts),
        )
        offsets = np.zeros(len(batch) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        m = self._gk.match_batch((tokens, offsets), scopes=[scope_of(r) for r, _ in batch]).to_host()
        T = self._T
        version = self._step.version
        hits = m.num_tokens.tolist()
        block_starts = m.block_offsets.tolist()
        self._ahead = {}
        for i, (r, n) in enumerate(batch):
            hit = hits[i] if self.partial_reuse else hits[i] // T * T
            start = block_starts[i]
            rows = np.asarray(m.block_ids[start:start + _cdiv(hit, T)], dtype=np.int64)
            # The match and entry only where the hit is the match's own.
            entry = (r, n, version, hit, rows, tokens[offsets[i]:offsets[i] + hit], m if hit == hits[i] else None, i)
            if i == 0:
                found = entry
            else:
                self._ahead[r.request_id] = entry
        return found

    def _hit_pages(self, rows: np.ndarray):
        """The block objects and held flags of matched tree blocks, as the tree is now."""
        pages, held = self._gk.match_pages(rows)
        return self._ids.of_pages(pages), held

    def estimate_cached_tokens(self, request) -> int:
        """Tokens of the request's longest cached prefix: its hit and the full
        blocks it cached since (vLLM: the hashed blocks it holds)."""
        state = self._requests.get(request.request_id)
        if state is None or not self.enable_caching:
            return 0
        return max(state.hit, state.target // self._T * self._T)

    # -- allocation ------------------------------------------------------------------
    def allocate_slots(
        self,
        request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks=None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ):
        """Pages for ``num_new_tokens`` more tokens (after a new request's hit
        of ``num_new_computed_tokens``): the new blocks, or None when they do
        not fit, in which case nothing changed."""
        if num_new_tokens == 0 and num_external_computed_tokens == 0 and num_new_computed_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0 when there are no computed tokens to adopt")
        if num_external_computed_tokens or delay_cache_blocks or skip_zeroing_group_ids:
            raise unsupported("KV connectors", "external computed tokens / delayed caching")
        if num_encoder_tokens:
            raise unsupported("encoder-decoder models", f"{num_encoder_tokens} encoder tokens for cross-attention")
        if num_lookahead_tokens or request.spec_token_ids:
            raise unsupported("speculative decoding", f"request {request.request_id!r} has draft or lookahead tokens")
        step = self._step
        if step.closes:
            self._flush()  # freed pages count before this decision, as in vLLM
        T = self._T
        state = self._requests.get(request.request_id)
        total_computed = min(request.num_computed_tokens + num_new_computed_tokens, self.max_model_len)
        watermark = 0
        if self.watermark_blocks and has_scheduled_reqs and request.status in self._admitting_statuses:
            watermark = self.watermark_blocks
        if state is None:
            return self._admit(
                request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, total_computed,
                step.obtainable() - step.pending_pages, reserved_blocks, watermark, full_sequence_must_fit,
            )
        if num_new_computed_tokens:
            raise ValueError(f"request {request.request_id!r} holds blocks already: it has no new prefix hit to adopt")
        # The running request's path, once per request per step: counts only.
        have = state.num_blocks
        new = max(-(-min(total_computed + num_new_tokens, self.max_model_len) // T) - have, 0)
        if new or watermark or reserved_blocks or full_sequence_must_fit:
            full_new = max(_cdiv(min(request.num_tokens, self.max_model_len), T) - have, 0)

            def fits(free: int) -> bool:
                if full_sequence_must_fit and full_new + watermark > free:
                    return False
                return new + watermark <= free - reserved_blocks

            # vLLM's free queue once the queued calls are made (a lower bound
            # while queued admissions may hold pages already held: then
            # counted exactly, without issuing them).
            if not fits(step.obtainable() - step.pending_pages):
                if not step.pending_hits or not fits(step.exact_room()[0]):
                    return None
        if new:
            state.num_blocks = have + new
            step.allocate(state, new)
        self._cache(state, min(total_computed + num_new_tokens, request.num_tokens))
        if not new:
            return self.empty_kv_cache_blocks
        return self._PendingBlocks(self._flush, state, have, have + new)

    def _admit(self, request, num_new_tokens, hit, hit_blocks, total_computed, free, reserved, watermark, full_must_fit):
        """A waiting request's first allocation: its hit, then new pages."""
        self._check_request(request)
        T = self._T
        if hit:
            if not isinstance(hit_blocks, self._HitBlocks) or hit > hit_blocks.num_tokens:
                raise ValueError(
                    f"request {request.request_id!r}: num_new_computed_tokens={hit} needs the blocks "
                    "get_computed_blocks returned for at least that many tokens"
                )
            if not self.partial_reuse and hit % T:
                raise ValueError(f"request {request.request_id!r}: a hit of {hit} tokens is not whole blocks")
        shared = hit // T  # full hit blocks: the tree's pages, shared
        held_blocks = _cdiv(hit, T)  # hit blocks whose pages it holds (a partial one until its copy is made)
        new = max(_cdiv(min(total_computed + num_new_tokens, self.max_model_len), T) - shared, 0)
        full_new = max(_cdiv(min(request.num_tokens, self.max_model_len), T) - shared, 0)

        def fits(evictable: int, free: int) -> bool:
            # vLLM's rule: the new blocks, and the hit blocks that are eviction
            # candidates now (holding them takes them off the free queue).
            if full_must_fit and full_new + evictable + watermark > free:
                return False
            return new + evictable + watermark <= free - reserved

        # First on a bound: every hit page counted as an eviction candidate,
        # here and in the queued admissions. A fit on the bound is a fit.
        evictable = held_blocks
        candidates = None  # the hit's candidate pages, when counted exactly
        if not fits(evictable, free):
            if not held_blocks and not self._step.pending_hits:
                return None  # the bound was exact
            # Undecided: count exactly, on the tree as it is and what the
            # queued calls (decided before this one) will hold and take.
            free, candidates = self._step.exact_room(hit_blocks.rows if held_blocks else None)
            evictable = len(candidates)
            if not fits(evictable, free):
                return None
        state = RequestState(
            request, scope_of(request), hit, hit_blocks.tokens[:hit] if hit else _NO_TOKENS, num_blocks=shared + new,
        )
        match, entry, looked_up = self._matched.pop(request.request_id, (None, 0, -1))
        if match is not None and looked_up == hit:
            state.match = (match, entry)
        self._requests[request.request_id] = state
        self._group.req_to_blocks[request.request_id] = state.blocks
        if shared and self.enable_caching:
            self._group.num_cached_block[request.request_id] = shared
        if held_blocks:
            state.hit_rows = np.asarray(hit_blocks.rows, dtype=np.int64)
        self._step.allocate(state, new, evictable, candidates)
        self._cache(state, min(total_computed + num_new_tokens, request.num_tokens))
        return self._PendingBlocks(self._flush, state, shared, shared + new)

    def _cache(self, state: RequestState, num_tokens: int) -> None:
        """vLLM caches the request's full blocks up to ``num_tokens`` at once
        (``cache_full_blocks``, at allocation: a later request of the same step
        may hit them, and reads them in the same forward, after they are
        written); gpukv commits them at the next flush. Whole blocks only, in
        both modes: a running request's last block is still being written."""
        if not self.enable_caching:
            return
        T = self._T
        target = min(num_tokens, state.num_blocks * T, len(state.request.block_hashes) * T) // T * T
        if target > state.target:  # most calls of a decode step complete no block
            self._step.commit(state, target)

    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        """Cache the request's full blocks up to ``num_computed_tokens``."""
        state = self._requests.get(request.request_id)
        if state is not None:
            self._cache(state, num_computed_tokens)

    def free(self, request) -> None:
        """Release the request's blocks; its cached blocks stay reusable."""
        self._matched.pop(request.request_id, None)
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return  # never allocated (aborted while waiting)
        self._group.req_to_blocks.pop(request.request_id, None)
        self._group.num_cached_block.pop(request.request_id, None)
        if self.partial_reuse and self.enable_caching:
            # Its last, partial block becomes reusable (gpukv commits a pending
            # partial tail on close), up to the tokens whose KV is computed or
            # in flight: num_computed_tokens is not yet advanced for a request
            # preempted in the step that scheduled it.
            done = min(request.num_computed_tokens, request.num_tokens, state.num_blocks * self._T)
            self._step.commit(state, done)
        self._step.close(state)

    def _blocks_to_allocate(self, request_id: str, num_tokens: int) -> int:
        state = self._requests.get(request_id)
        have = 0 if state is None else state.num_blocks
        return max(_cdiv(num_tokens, self._T) - have, 0)

    # -- block ids ---------------------------------------------------------------------
    def get_blocks(self, request_id: str):
        """The request's blocks (a live view, as vLLM's)."""
        state = self._requests.get(request_id)
        if state is None:
            return self.empty_kv_cache_blocks
        return self._PendingBlocks(self._flush, state, 0, None)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        self._flush()
        state = self._requests.get(request_id)
        return ([] if state is None else state.ids[:],)

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int) -> tuple[list[int], ...]:
        (ids,) = self.get_block_ids(request_id)
        return (ids[: _cdiv(num_computed_tokens, self._T)],)

    def create_kv_cache_blocks(self, blocks):
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks

        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Deprecated in vLLM (cascade attention is gone): 0 per group."""
        return [0]

    # -- the step ----------------------------------------------------------------------
    def new_step_starts(self) -> None:
        """Issue what the last step left queued (its frees, its async caching)."""
        self._step.step_starts()

    def take_kv_cache_block_copies(self):
        """``(copies, retained blocks)``: the copy-on-write copies of partial
        hits decided since the last take, as vLLM ``KVCacheBlockCopy`` (source
        tree page -> the request's private page). No block needs retaining:
        gpukv keeps a copy's source valid until the next forward."""
        self._flush()
        copies, self._step.copies = self._step.copies, []
        return copies, []

    def take_new_block_ids(self) -> list[int]:
        """Block ids allocated since the last take, when the worker zeroes new
        blocks (``kv_cache_config.needs_kv_cache_zeroing``); else []."""
        self._flush()
        ids, self._step.new_block_ids = self._step.new_block_ids, []
        return ids

    def take_boundary_state_offloads(self) -> dict:
        """Mamba "align" boundary states: none without Mamba groups."""
        return {}

    def finalize_partial_tail_offloads(self, request) -> list:
        return []

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int, num_prompt_tokens=None) -> None:
        """Full attention skips no blocks."""

    def take_events(self) -> list:
        """vLLM KV cache events since the last take ([] when events are off)."""
        if self._events is None:
            return []
        self._flush()
        return self._events.take()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; False (nothing changed) while any request
        holds blocks."""
        self._flush()
        if self._requests:
            return False
        self._gk.clear_reusable_blocks()
        self._step.changed()
        if self._events is not None:
            self._events.cleared()
        if self.log_stats:
            self.prefix_cache_stats.reset = True
        return True

    # -- connector-only members, refused ------------------------------------------------
    def get_computed_blocks_for_connector(self, request, max_cache_hit_length=None):
        raise unsupported("KV connectors", "get_computed_blocks_for_connector")

    def truncate_computed_blocks(self, blocks, num_computed_tokens):
        raise unsupported("KV connectors", "truncate_computed_blocks")

    def pop_blocks_for_free(self, request):
        raise unsupported("KV connectors", "deferred block frees (pop_blocks_for_free)")

    def evict_blocks(self, block_ids) -> None:
        raise unsupported("KV connectors", "evict_blocks")

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        raise unsupported("KV connectors", "record_blocks_for_zeroing after a failed load")

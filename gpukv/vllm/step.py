"""The gpukv calls of a scheduler step, deferred and issued as batched launches.

vLLM's scheduler calls its manager once per request (``allocate_slots``,
``get_computed_blocks``, ``free``), hundreds of times a step, and wants an
answer at once. The answers need only counts and lookups, so the adapter
decides in Python and queues the gpukv work, then issues it as one launch per
kind of call when something needs the result:

- **allocations** (a new request's cache: admitted from its lookup's gpukv
  match, holding its hit, resumed and sized; a running request's growth:
  resize), in the order they were decided;
- **commits** of the tokens vLLM caches at allocation time;
- **closes** of freed requests.

A flush issues them in that order. That is the order the calls were made in,
because the manager keeps two rules: a close is queued only behind
allocations already decided (it comes after them anyway), and before deciding
an allocation the manager flushes pending closes (their pages must count).
Commits commute with both: a commit turns a request's own held pages into tree
pages and never changes what is obtainable (under ``stable_pages`` a
duplicate block keeps its own page).

A prefix lookup needs the tree as vLLM's cache is at that moment, but only
where the queued calls could change its answer (``affects``): a queued commit
of a block the request would match, a queued allocation that would have to
evict (it needs more pages than are free), a queued close (it changes which
hit pages are held). Otherwise the lookup runs on the tree as it is, and a
step's admissions go out together. Where only an evicting allocation could
change the answer, only the allocations are issued: the queued commits wait
for the next flush.

Queued admissions hold hit pages that are eviction candidates now, which
vLLM's check counts. The queue counts them as an upper bound (every hit page
of an admission decided on it), so a later decision that fits on the bound
fits exactly; one that does not issues the queue and decides on exact counts.

Everything else that reads state (block ids, counts, events, copies, the
step's start) flushes first.
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from .blocks import BlockIds, ids_of_pages, pages_of_ids


class RequestState:
    """The adapter's record of one admitted request."""

    __slots__ = (
        "request", "kv", "blocks", "ids", "num_blocks", "hit", "committed", "target",
        "admit_tokens", "scope", "match", "hit_rows", "in_alloc", "in_commit", "freed",
    )

    def __init__(self, request, scope, hit: int, admit_tokens, num_blocks: int):
        self.request = request
        self.kv = None  # the gpukv KVCache, once the admission is issued
        self.blocks: list = []  # vLLM KVCacheBlock objects, append-only (the worker's block table), as issued
        self.ids: list[int] = []  # their block ids, kept beside them (get_block_ids is read every step)
        self.num_blocks = num_blocks  # blocks once the queued allocation is issued
        self.hit = hit  # tokens reused at admission
        self.committed = hit  # tokens committed into gpukv's tree (issued)
        self.target = hit  # tokens to commit (decided)
        self.admit_tokens = admit_tokens  # the hit's tokens until the cache is created, then None
        self.scope = scope
        self.match = None  # (gpukv match, entry) its hit came from, while the cache is not created
        self.hit_rows = None  # the tree rows of the hit blocks it will hold, while the cache is not created
        self.in_alloc = False
        self.in_commit = False
        self.freed = False  # vLLM freed it; its close may still be queued


class StepCalls:
    def __init__(self, gk, block_size: int, ids: BlockIds, events, cached_blocks: dict, record_new_ids: bool,
                 track_fresh: bool):
        self._gk = gk
        self._T = block_size
        self._ids = ids
        self._events = events  # EventLog or None
        self._cached_blocks = cached_blocks  # request id -> cached full blocks (vLLM's num_cached_block)
        self._record_new_ids = record_new_ids
        self.alloc: list[RequestState] = []
        self.commits: list[RequestState] = []
        self._first_queued: set = set()  # the block hash of each queued commit's first block (affects)
        self.closes: list = []
        # What the queued allocations take out of the obtainable count: new
        # pages, and hit pages that are eviction candidates now. The latter is
        # an upper bound (an admission decided on the bound counts all its hit
        # pages), so decisions made on it are exact when they say "fits"; where
        # it says no, ``exact_room`` counts exactly.
        self.pending_new = 0
        self.pending_hits = 0
        self._queued_holds = set()  # the candidate pages queued admissions will hold (None: not read yet)
        num_pages = gk.config.pages_per_life_cycle_list()[0]
        self.copies: list = []  # vLLM KVCacheBlockCopy, for take_kv_cache_block_copies
        self.new_block_ids: list[int] = []  # for take_new_block_ids (KV zeroing)
        # Pages of blocks committed since the step started: their KV is written
        # by this step's forward, after any copy this step decides (partial
        # reuse must not copy from them). None: not tracked (parity).
        self.fresh = np.zeros(num_pages, dtype=bool) if track_fresh else None
        self._fresh_pages: list[np.ndarray] = []
        self._obtainable = None
        self._free = None
        self._victims = None  # (version, eviction order, whether it was cut at its count)
        self.version = 0  # gpukv calls issued: a lookup matched at one version holds while it stays

    @property
    def any_fresh(self) -> bool:
        """Whether a block was committed since the step started (``fresh``)."""
        return bool(self._fresh_pages)

    @property
    def dirty(self) -> bool:
        return bool(self.alloc or self.commits or self.closes)

    def obtainable(self) -> int:
        """gpukv's obtainable pages as of the last issued call (read once per
        flush: the scheduler asks per request)."""
        if self._obtainable is None:
            self._obtainable = self._gk.obtainable_pages()
        return self._obtainable

    def free(self) -> int:
        """gpukv's free pages as of the last issued call (read once per flush,
        like ``obtainable``)."""
        if self._free is None:
            self._free = self._gk.free_pages()
        return self._free

    def changed(self) -> None:
        """A gpukv call outside the queue changed the pool."""
        self._obtainable = self._free = None
        self._queued_holds = None
        self.version += 1

    def exact_room(self, rows=None) -> tuple:
        """``(obtainable, candidates)``: the obtainable count once the queued
        allocations are issued, and of the hit blocks in tree ``rows`` (None:
        none) the pages that are eviction candidates then, exactly, on the
        tree as it is: nothing is issued. A queued admission takes its hit's
        candidate pages off the eviction lists (each page once, however many
        admissions hit it) and a queued allocation takes its new pages."""
        holds = self._queued_holds
        if holds is None:
            rows_held = [s.hit_rows for s in self.alloc if s.hit_rows is not None]
            holds = set(self._candidate_pages(np.concatenate(rows_held))) if rows_held else set()
            self._queued_holds = holds
        obtainable = self.obtainable() - self.pending_new - len(holds)
        if rows is None or not len(rows):
            return obtainable, []
        return obtainable, [p for p in self._candidate_pages(rows) if p not in holds]

    def _candidate_pages(self, rows) -> list:
        """The GPU pages of tree blocks ``rows`` that are eviction candidates
        now (no cache holds them)."""
        pages, held = self._gk.match_pages(rows)
        return pages[~held & (pages >= 0)].tolist()

    def affects(self, request, hit_survives=None):
        """What of the queued calls must be issued before a lookup of
        ``request``, as they could change what it finds: ``flush`` (all),
        ``issue_allocations`` (only an allocation that evicts could), or None
        (nothing). ``hit_survives(heads)``: whether none of the pages the
        lookup would hit is among the first ``heads`` of the eviction order
        (``victims``; None: not known)."""
        if self.closes:
            return self.flush  # a queued close releases pages an allocation may then evict
        # Hashes chain: a block hash names its whole prefix, so the request
        # would match a queued block exactly when its hashes hold the first
        # queued block of some commit.
        if not self._first_queued.isdisjoint(request.block_hashes):
            return self.flush
        if self.pending_new and self.pending_new > self.free():
            # A queued allocation evicts, taking eviction's list heads one by
            # one; a queued admission takes its hit's candidates out of the
            # lists first. So what the queue evicts is among the first
            # ``evictions + holds`` heads of the order as it is now, and a hit
            # with no page there stays (held pages are never listed). The
            # queued commits change nothing this lookup finds (no block it
            # would match): they wait for the next flush.
            heads = self.pending_new - self.free() + self.pending_hits
            return None if hit_survives is not None and hit_survives(heads) else self.issue_allocations
        return None

    def victims(self, heads: int) -> np.ndarray:
        """The first ``heads`` pages of gpukv's eviction order as of the last
        issued call (read again only for more, or after an issue)."""
        known = self._victims
        if known is None or known[0] != self.version or (len(known[1]) < heads and known[2]):
            # known[2]: the read was cut at its count (the order may go on)
            order = self._gk.eviction_order(heads)
            known = self._victims = (self.version, order, len(order) == heads)
        return known[1][:heads]

    # -- queueing -----------------------------------------------------------------
    @property
    def pending_pages(self) -> int:
        return self.pending_new + self.pending_hits

    def allocate(self, state: RequestState, new_pages: int, hit_pages: int = 0, candidates=None) -> None:
        """Queue ``state``'s allocation of ``new_pages`` more pages; an
        admission also holds ``hit_pages`` eviction candidates (at most; its
        ``candidates`` when they were counted exactly, ``exact_room``)."""
        self.pending_new += new_pages
        self.pending_hits += hit_pages
        if state.hit_rows is not None and self._queued_holds is not None:
            if candidates is None:
                self._queued_holds = None  # read with the others when next needed
            else:
                self._queued_holds.update(candidates)
        if not state.in_alloc:
            state.in_alloc = True
            self.alloc.append(state)

    def commit(self, state: RequestState, target: int) -> None:
        """Queue ``state``'s commit up to ``target`` tokens."""
        if target <= state.target:
            return
        state.target = target
        if not state.in_commit:
            state.in_commit = True
            self.commits.append(state)
            hashes = state.request.block_hashes
            first = state.committed // self._T
            if first < len(hashes):  # else a partial tail only, which no lookup finds by hash
                self._first_queued.add(hashes[first])

    def close(self, state: RequestState) -> None:
        state.freed = True
        self.closes.append(state)

    # -- issuing -----------------------------------------------------------------
    def issue_allocations(self) -> None:
        """Issue the queued allocations; the commits commute with them and
        wait for the next flush. A queued close goes out with everything
        (it changes which pages the allocations may evict)."""
        self._issue(everything=bool(self.closes))

    def flush(self) -> None:
        """Issue everything queued, in the order it was decided."""
        self._issue(everything=True)

    def _issue(self, everything: bool) -> None:
        self.version += 1
        try:
            if self.alloc:
                self._issue_allocations()
            if everything and self.commits:
                self._issue_commits()
            if everything and self.closes:
                closes, self.closes = self.closes, []
                self._gk.close_batch([s.kv for s in closes])
        finally:
            self._obtainable = self._free = None  # as of the calls just issued: read again when asked
            self._queued_holds = set() if not self.alloc else None

    def _issue_allocations(self) -> None:
        alloc, self.alloc = self.alloc, []
        evicts = self.pending_new > self.free()
        self.pending_new = self.pending_hits = 0
        T = self._T
        growths = []  # resized in the admissions' launch
        running = [s for s in alloc if s.kv is not None]
        admissions = [s for s in alloc if s.kv is None]
        # The growths go in the admissions' launch (allocate_batch) when those
        # are admitted from their match. It holds the admissions' hits before
        # the growths allocate. Without eviction that changes no outcome but
        # which free page goes to whom. With eviction it changes none either
        # when every growth was decided first (vLLM's scheduler decides the
        # running requests before the waiting ones): each admission's lookup
        # found its hit outside the eviction-order heads that the allocations
        # decided before it may take (``affects``), so holding it earlier
        # moves no head they take.
        decided_first = not evicts or all(s.kv is not None for s in alloc[:len(running)])
        if running and admissions and decided_first and self._current_match(admissions) is not None:
            runs, growths = [admissions], running
        elif evicts:
            # Runs of admissions and of growths, each in decision order: what
            # one allocation evicts depends on what the earlier ones hold.
            runs, start = [], 0
            while start < len(alloc):
                stop = start + 1
                while stop < len(alloc) and (alloc[stop].kv is None) == (alloc[start].kv is None):
                    stop += 1
                runs.append(alloc[start:stop])
                start = stop
        else:
            runs = [run for run in (running, admissions) if run]
        copies = False
        have = [len(s.ids) for s in alloc]  # blocks each had (their pages never move: read once, at the end)
        for run in runs:
            if run[0].kv is None:
                ok = self._admit(run, growths)
                # The one source of page copies in the adapter's configuration
                # (no host tier, no commit_min_snapshot): the first resume's
                # private copy of a hit that ends inside a block.
                copies = copies or any(s.hit % T for s in run)
                run = run + growths
            else:
                ok = self._gk.resize_batch([s.kv for s in run], [s.num_blocks * T for s in run])
            if not ok.all():
                bad = run[int(np.argmin(ok))]
                raise RuntimeError(
                    f"gpukv refused pages the adapter had counted for request {bad.request.request_id!r} "
                    f"({bad.num_blocks} blocks): the obtainable-page count and the allocations disagree"
                )
        for s in alloc:
            s.in_alloc = False
        self._take_new_blocks(alloc, have)
        if copies:
            self._take_copies()

    def _current_match(self, run: list):
        """The gpukv match every request of ``run`` was looked up in, when
        there is one and it is still current; else None."""
        match = run[0].match[0] if run[0].match is not None else None
        if match is not None and all(s.match is not None and s.match[0] is match for s in run) \
                and self._gk.is_current(match):
            return match
        return None

    def _admit(self, run: list, growths: list) -> np.ndarray:
        """The run's new caches, holding their hits, resumed and sized: from
        their lookups' gpukv match when it is one and still current (no
        second match), with ``growths`` resized in the same launch, else
        created from their hits' tokens. One bool per cache of ``run`` and
        of ``growths``, in that order."""
        gk = self._gk
        T = self._T
        capacities = [s.num_blocks * T for s in run]
        match = self._current_match(run)
        grown = np.ones(0, dtype=bool)
        if match is not None and growths:
            grown, kvs, ok = gk.allocate_batch([s.kv for s in growths], [s.num_blocks * T for s in growths], match,
                                               capacities, entries=[s.match[1] for s in run])
        elif match is not None:
            kvs, ok = gk.admit_batch(match, capacities, entries=[s.match[1] for s in run])
        else:
            kvs = gk.create_kv_caches([s.admit_tokens for s in run], scopes=[s.scope for s in run])
            ok = gk.resume_batch(kvs)
            if ok.all():
                ok = gk.resize_batch(kvs, capacities)
        for s, kv in zip(run, kvs):
            s.kv = kv
            s.admit_tokens = s.match = s.hit_rows = None
            if kv.num_committed_tokens != s.hit:
                raise RuntimeError(
                    f"request {s.request.request_id!r}: its prefix hit of {s.hit} tokens is stale "
                    f"({kv.num_committed_tokens} reusable now); allocate_slots must follow get_computed_blocks "
                    "with no allocation or free in between"
                )
        return np.concatenate([ok, grown])

    def _take_new_blocks(self, alloc: list, have: list) -> None:
        """Append the blocks the issued allocations gave their requests to
        their block lists (``have[i]``: how many request ``i`` had), read for
        all of them at once. An admission's blocks are its hit's and new
        ones; only the new pages come from the free list or eviction."""
        pages, offsets = self._gk.page_indices_batch([s.kv for s in alloc], 0, have)
        if not len(pages):
            return
        pages = pages.astype(np.int64)
        all_ids = ids_of_pages(pages)
        all_blocks = self._ids.of_pages(pages)
        T = self._T
        new_pages = []
        for s, h, a, b in zip(alloc, have, offsets[:-1].tolist(), offsets[1:].tolist()):
            if a == b:
                continue
            ids = all_ids[a:b]
            s.blocks.extend(all_blocks[a:b])
            s.ids.extend(ids)
            first_new = max((s.hit // T if h == 0 else h) - h, 0)  # an admission had none
            if first_new < b - a:
                new_pages.append(pages[a + first_new:b])
                if self._record_new_ids:
                    self.new_block_ids.extend(ids[first_new:])
        if self._events is not None and new_pages:
            self._events.reallocated(np.concatenate(new_pages))

    def _take_copies(self) -> None:
        copies = self._gk.take_page_copies()
        if not len(copies):
            return
        from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy

        if (copies.src_level != 0).any() or (copies.dst_level != 0).any():
            raise RuntimeError("gpukv decided a host-tier copy, but the adapter configures no host tier")
        self.copies.extend(
            KVCacheBlockCopy(src_block_id=s, dst_block_id=d)
            for s, d in zip(ids_of_pages(copies.src_index), ids_of_pages(copies.dst_index))
        )

    def _issue_commits(self) -> None:
        commits, self.commits = self.commits, []
        self._first_queued = set()
        live = [s for s in commits if s.target > s.committed]
        for s in commits:
            s.in_commit = False
        if not live:
            return
        counts = [s.target - s.committed for s in live]
        flat = np.fromiter(
            chain.from_iterable(s.request.all_token_ids[s.committed:s.target] for s in live),
            dtype=np.int32, count=sum(counts),
        )
        offsets = np.zeros(len(live) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        self._gk.commit_batch([s.kv for s in live], (flat, offsets))  # one flat array: no per-list conversion
        T = self._T
        for s in live:
            first, stop = s.committed // T, s.target // T
            s.committed = s.target
            if stop > first:
                if not s.freed:
                    self._cached_blocks[s.request.request_id] = stop
                pages = None
                if self._events is not None or self.fresh is not None:
                    pages = pages_of_ids(s.ids[first:stop])
                if self._events is not None:
                    self._events.stored(s.request, first, stop, pages)
                if self.fresh is not None:
                    self.fresh[pages] = True
                    self._fresh_pages.append(pages)

    def step_starts(self) -> None:
        """Everything committed so far has its KV written before the coming
        step's copies run."""
        self.flush()
        if self._fresh_pages:
            self.fresh[np.concatenate(self._fresh_pages)] = False
            self._fresh_pages = []

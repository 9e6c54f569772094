"""``gpukv simulate``: a small serving-engine scheduler driving gpukv.

The simulator replays a workload through the loop a serving engine runs around
its KV cache manager, one scheduling step at a time:

1. **Arrivals.** Requests whose arrival time has come join the waiting queue,
   each with a registered ``TokenSequence`` of its lookup tokens. The next turn
   of a conversation arrives only after the previous turn has finished.
2. **Running requests** (in admission order) get this step's tokens out of a
   token budget: a prefill chunk, or ``decode_chunk`` generated tokens. Pages
   come a block at a time: one ``resize_batch`` for every request whose step
   passes its capacity, then ``commit_batch`` makes the computed tokens
   reusable. Where a resize is refused (no room, even after eviction), the
   newest running requests are preempted until it fits; a request may preempt
   itself.
3. **Admission.** When budget and batch room are left, one ``match_batch``
   call matches the whole waiting queue (this call is what the latency
   figures time). The queue is ordered
   longest-reusable-prefix first (or kept in arrival order), and the requests
   the budget reaches are admitted together: ``create_kv_caches`` holds their
   reused pages, ``resume_batch`` activates the caches, and their first chunks
   are scheduled as in step 2. The first refusal ends admission for the step.
4. **Finished** requests leave with one ``close_batch``: their pages stay in
   the tree, evictable, for later requests to reuse.

Each step thus makes a handful of calls on the manager, each one launch for
the whole batch, as an engine's scheduler would.

A request computes its prompt and all but the last output token (the last one
is sampled and never fed back). It looks up all but the last prompt token: the
last one is always recomputed, for the logits of the first output token.

**Policies.** Both commit every block boundary a step crosses. ``per-page``
(gpukv's point) also commits the exact endpoints worth keeping, the end of a
prefill chunk and the end of the request, even inside a block; coverage makes
them reusable. ``full-blocks`` runs the same workload the way engines that only
reuse whole blocks behave: ``enable_partial_reuse=False`` and commits on block
boundaries only (the history stays at the last committed boundary, as
``commit_min_snapshot`` requires).

**Preemption.** With a host tier (``host_pages > 0``) a preempted request is
suspended (its pages may move to the host) and resumed before new admissions;
without one it is closed (its committed tokens stay cached) and re-queued at
the front, to be recomputed from whatever is still reusable. If nothing runs
and nothing can be admitted, suspended requests are closed and re-queued; if
that does not help either, the request at the head of the queue is rejected
as too large for the pool.

The simulation is deterministic for a given workload and options. Time is
simulated: a step lasts ``step_ms``; while nothing runs, time jumps to the
next arrival.

What a run shows (summary, table, plot) is in ``report.py``. This module is
still long because ``Simulator`` is the scheduler loop above, one class meant
to be read top to bottom, beside the options and workloads it runs.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

import gpukv

from .report import TIMELINE_FIELDS, ProgressBar, summarize
from .workload import Request, Workload, default_workload

POLICIES = ("per-page", "full-blocks")
ORDERS = ("longest-prefix", "arrival")
MODELS = ("hybrid", "attention")
KV_EVENT_QUEUE = 1 << 20  # the event queue cap of a simulated worker

log = logging.getLogger("gpukv.simulate")


# -- options ---------------------------------------------------------------------------------
@dataclass
class SimOptions:
    """The scheduler and the cache; see ``gpukv simulate --help`` for each."""

    policy: str = "per-page"
    model: str = "hybrid"
    tokens_per_block: int = 64
    window: int = 1024  # the SWA layers' window (hybrid model)
    pages: int | None = None  # GPU pages per life cycle; None: sized from the workload (see auto_pages)
    host_pages: int = 0
    max_batch_tokens: int = 4096  # tokens computed per step, all requests together
    prefill_chunk: int = 2048
    decode_chunk: int = 1
    max_running: int = 64
    order: str = "longest-prefix"
    step_ms: float = 25.0
    backend: str = "auto"
    kv_events: bool = False  # record KV cache events (64-bit hashes), for a publisher to drain each step

    def validate(self):
        def at_least(name, lo):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name.replace('_', '-')} must be an int >= {lo}, got {v!r}")

        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {', '.join(MODELS)}, got {self.model!r}")
        for name, lo in (("tokens_per_block", 1), ("window", 1), ("host_pages", 0), ("max_batch_tokens", 1),
                         ("prefill_chunk", 1), ("decode_chunk", 1), ("max_running", 1)):
            at_least(name, lo)
        if self.pages is not None:
            at_least("pages", 1)
        if not (isinstance(self.step_ms, (int, float)) and math.isfinite(self.step_ms) and self.step_ms > 0):
            raise ValueError(f"step-ms must be a positive number, got {self.step_ms!r}")

    def layers(self) -> list:
        if self.model == "attention":
            return [gpukv.Attention()]
        # One life cycle per distinct spec; how many layers share each does not matter to the index.
        return [gpukv.Attention(), gpukv.Attention(window=self.window), gpukv.Ssm()]

    def cache_config(self, pages: int) -> gpukv.CacheConfig:
        return gpukv.CacheConfig(
            tokens_per_block=self.tokens_per_block,
            layers=self.layers(),
            pages_per_life_cycle=pages,
            host_pages_per_life_cycle=self.host_pages,
            enable_partial_reuse=self.policy == "per-page",
            commit_min_snapshot=self.model == "hybrid",  # required with an SSM layer
            backend=self.backend,
            # Drained every step: the cap only has to hold one step's events.
            max_kv_event_entries=KV_EVENT_QUEUE if self.kv_events else 0,
            event_hash="sha256_64" if self.kv_events else "sha256",
            block_digests=self.kv_events,  # only events name blocks by digest
        )


def auto_pages(requests: list, options: SimOptions) -> int:
    """A GPU pool under real pressure: room for one and a half full running
    batches of average requests, so the running set fits but the reuse tree
    soon has to be evicted from; and at least twice the longest request, so
    every request fits alone."""
    T = options.tokens_per_block
    blocks = np.array([-(-r.compute_len // T) for r in requests] or [1])
    return int(max(2 * blocks.max() + 8, math.ceil(1.5 * options.max_running * blocks.mean())))


# -- the scheduler ---------------------------------------------------------------------------


@dataclass
class Stats:
    steps: int = 0
    requests: int = 0
    finished: int = 0
    input_tokens: int = 0
    reused_tokens: int = 0
    partial_reused_tokens: int = 0  # reused tokens past the last block boundary of a reuse
    partial_reuses: int = 0
    reuses: int = 0
    ssm_hits: int = 0
    computed_tokens: int = 0
    committed_tokens: int = 0
    commit_calls: int = 0
    preemptions: int = 0
    readmissions: int = 0
    readmission_reused_tokens: int = 0
    rejected: int = 0
    peak_running: int = 0
    peak_waiting: int = 0
    evicted: int = 0
    migrated: int = 0
    dropped: int = 0
    match_latency_s: list = field(default_factory=list)
    match_batch: list = field(default_factory=list)
    match_tokens: list = field(default_factory=list)
    kv_call_s: float = 0.0
    admitted_input_tokens: int = 0  # input tokens of the requests admitted so far (first admissions)
    # One row per step: the simulated ms, then the TIMELINE_FIELDS counters so far.
    timeline: list = field(default_factory=list)
    manager_reuse: dict = field(default_factory=dict)


class Simulator:
    def __init__(self, workload: Workload, options: SimOptions, progress=None):
        options.validate()
        self.options = options
        self.workload = workload
        self.pages = options.pages or auto_pages(workload.requests, options)
        self.mgr = gpukv.KVCacheManager(options.cache_config(self.pages))
        self.T = options.tokens_per_block
        self.full_blocks = options.policy == "full-blocks"
        self.swap = options.host_pages > 0
        self.has_ssm = self.mgr.ssm_life_cycle_id is not None
        self.min_snapshot = self.mgr.config.commit_min_snapshot
        self.stats = Stats()
        self.progress = progress
        reqs = workload.requests
        self.pending = deque(r for r in reqs if r.after is None)  # in arrival order
        self.blocked = {}  # rid of a previous turn -> requests waiting for it to finish
        for r in reqs:
            if r.after is not None:
                self.blocked.setdefault(r.after, []).append(r)
        self.released: list = []  # turns released by a finished predecessor, not yet arrived
        self.waiting: deque = deque()
        self.running: list = []
        self.swapped: deque = deque()
        self.now = 0.0
        self.total = len(reqs)
        self.refused = None  # the last request admission was refused for

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> Stats:
        while self.stats.finished + self.stats.rejected < self.total:
            if self.idle:
                nxt = self._next_arrival()
                if nxt is None:
                    raise RuntimeError("simulation stalled with no pending arrival")  # a bug, not bad input
                self.now = max(self.now, nxt)
            self.step()
            if self.progress is not None:
                self.progress(self)
        self._collect_manager_stats()
        return self.stats

    @property
    def idle(self) -> bool:
        """Nothing running, waiting or suspended: the clock may jump to the next arrival."""
        return not self.running and not self.waiting and not self.swapped

    def step(self):
        """One scheduling step at ``self.now``; the clock then advances by a step."""
        s = self.stats
        self._arrive()
        budget = self.options.max_batch_tokens
        budget = self._run_running(budget)
        admitted = self._admit(budget)
        if not self.running and not admitted and (self.waiting or self.swapped):
            self._unstick()
        s.steps += 1
        s.peak_running = max(s.peak_running, len(self.running))
        s.timeline.append((self.now, *(getattr(s, f) for f in TIMELINE_FIELDS)))
        self.now += self.options.step_ms
        self._collect_manager_stats()

    def _next_arrival(self):
        times = [r.arrival_ms for r in self.released]
        if self.pending:
            times.append(self.pending[0].arrival_ms)
        return min(times) if times else None

    def _arrive(self):
        came = []
        while self.pending and self.pending[0].arrival_ms <= self.now:
            came.append(self.pending.popleft())
        if self.released:
            came += [r for r in self.released if r.arrival_ms <= self.now]
            self.released = [r for r in self.released if r.arrival_ms > self.now]
        for r in sorted(came, key=lambda r: (r.arrival_ms, r.rid)):
            r.tokens = r.make_tokens()
            r.seq = self.mgr.token_sequence(r.tokens[: r.lookup_len()])
            self.waiting.append(r)
            self.stats.requests += 1
            self.stats.input_tokens += r.prompt_len
        self.stats.peak_waiting = max(self.stats.peak_waiting, len(self.waiting))

    # -- growing a request by a step's tokens ------------------------------------------------
    def _step_tokens(self, r: Request, budget: int) -> int:
        """Tokens ``r`` computes this step: a prefill chunk or a decode chunk.

        A prefill chunk ends on a block boundary unless it ends the prefill, and
        at ``r.checkpoint`` when it passes it: where the request's tokens
        branch off the tree (``num_tokens_before_pruning`` of its match).
        Under ``commit_min_snapshot`` only commit endpoints are reusable (SWA
        pages out of the window and SSM states between endpoints are not
        kept), so an endpoint at the branch point is what lets the next
        request sharing that prefix (say, the same system prompt) reuse it."""
        if r.done < r.prefill_end:
            n1 = min(r.prefill_end, r.done + min(self.options.prefill_chunk, budget))
            if r.done < r.checkpoint < n1:
                n1 = r.checkpoint
            elif n1 < r.prefill_end and n1 // self.T * self.T > r.done:
                n1 = n1 // self.T * self.T
            return n1 - r.done
        return min(self.options.decode_chunk, r.compute_len - r.done, budget)

    def _grow(self, r: Request, k: int) -> bool:
        """``_grow_batch`` for one request (resuming a suspended one)."""
        return bool(self._grow_batch([r], [k])[0])

    def _grow_batch(self, reqs: list, ks: list) -> np.ndarray:
        """Pages for the next ``ks[i]`` tokens of each request, then commit
        them: one ``resize_batch`` and at most two ``commit_batch`` calls for
        the whole list. Where a request's pages are refused, False and nothing
        changed for it (the others proceed)."""
        ok = self._resize_batch(reqs, ks)
        self._commit_batch([r for r, y in zip(reqs, ok) if y], [k for k, y in zip(ks, ok) if y])
        return ok

    def _resize_batch(self, reqs: list, ks: list) -> np.ndarray:
        """Pages are allocated a block at a time, as engines do: the capacity
        grows to the end of the block holding the step's last token, so a
        decode step inside a block needs no resize. The history is left
        alone: each commit moves it to the committed length (under
        full-block commits it stays at the last committed block boundary;
        commit_min_snapshot needs history == committed length at a commit)."""
        T = self.T
        ok = np.ones(len(reqs), dtype=bool)
        grow = [i for i, (r, k) in enumerate(zip(reqs, ks)) if r.done + k > r.kv.capacity]
        if grow:
            t0 = time.perf_counter()
            ok[grow] = self.mgr.resize_batch(
                [reqs[i].kv for i in grow], [-(-(reqs[i].done + ks[i]) // T) * T for i in grow]
            )
            self.stats.kv_call_s += time.perf_counter() - t0
        return ok

    def _commit_batch(self, reqs: list, ks: list):
        """Commit up to the last block boundary reached; then, per-page only,
        the rest when it is an endpoint worth keeping: the end of a prefill
        chunk (the prompt's end, a branch point) or of the request. Decode
        steps inside a block are not committed one by one: under
        commit_min_snapshot each commit's end is a snapshot (page copies),
        which no engine takes for every generated token. Both policies thus
        checkpoint every block boundary; per-page also the exact endpoints."""
        T = self.T
        edges, tails = ([], [], []), ([], [], [])  # (caches, tokens, is_end)
        for r, k in zip(reqs, ks):
            n1 = r.done + k
            c0, edge = r.kv.num_committed_tokens, n1 // T * T
            if edge > c0:
                self._queue_commit(edges, r, c0, edge)
                c0 = edge
            if not self.full_blocks and n1 > c0 and (r.done < r.prefill_end or n1 == r.compute_len):
                self._queue_commit(tails, r, c0, n1)
        t0 = time.perf_counter()
        for caches, tokens, is_end in (edges, tails):
            if caches:
                self.mgr.commit_batch(caches, tokens, is_end=is_end)
        self.stats.kv_call_s += time.perf_counter() - t0
        for r, k in zip(reqs, ks):
            r.done += k
            self.stats.computed_tokens += k

    def _queue_commit(self, batch, r: Request, c0: int, c1: int):
        caches, tokens, is_end = batch
        caches.append(r.kv)
        tokens.append(r.tokens[c0:c1])
        is_end.append(not self.full_blocks and c1 == r.compute_len)
        self.stats.committed_tokens += c1 - c0
        self.stats.commit_calls += 1

    def _run_running(self, budget: int) -> int:
        """This step's tokens for every running request, in admission order,
        while the budget lasts: one batch of resizes; where one is refused,
        the newest running requests are preempted (a request may preempt
        itself) until it fits; then one batch of commits for the rest."""
        reqs, ks = [], []
        for r in self.running:
            if budget <= 0:
                break
            k = self._step_tokens(r, budget)
            if k > 0:
                reqs.append(r)
                ks.append(k)
                budget -= k
        ok = self._resize_batch(reqs, ks)
        for i in np.flatnonzero(~ok):
            r = reqs[i]
            while r in self.running:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is not r and self._resize_batch([r], [ks[i]])[0]:
                    ok[i] = True
                    break
        running = set(self.running)
        grown = [i for i in range(len(reqs)) if ok[i] and reqs[i] in running]
        budget += sum(ks) - sum(ks[i] for i in grown)  # what the preempted did not use
        self._commit_batch([reqs[i] for i in grown], [ks[i] for i in grown])
        self._finish_batch([reqs[i] for i in grown if reqs[i].done == reqs[i].compute_len])
        return budget

    def _finish(self, r: Request):
        self._finish_batch([r])

    def _finish_batch(self, reqs: list):
        """Close the finished requests' caches in one ``close_batch``."""
        if not reqs:
            return
        t0 = time.perf_counter()
        self.mgr.close_batch([r.kv for r in reqs])
        self.stats.kv_call_s += time.perf_counter() - t0
        done = set(reqs)
        self.running = [r for r in self.running if r not in done]
        for r in reqs:
            r.kv = None
            r.tokens = None
            r.finished_ms = self.now + self.options.step_ms
            self.stats.finished += 1
            for nxt in self.blocked.pop(r.rid, ()):
                nxt.arrival_ms = max(nxt.arrival_ms, r.finished_ms)
                self.released.append(nxt)

    def _preempt(self, r: Request):
        self.running.remove(r)
        self.stats.preemptions += 1
        if self.swap:
            r.kv.suspend()
            self.swapped.append(r)
        else:
            self._requeue(r)

    def _requeue(self, r: Request):
        """Close ``r``'s cache (its committed tokens stay reusable) and put it
        first in the queue, to recompute from what is still cached."""
        r.kv.close()
        r.kv = None
        r.prefill_end = max(r.prefill_end, r.done)  # generated tokens are recomputed as a prefill
        r.seq = self.mgr.token_sequence(r.tokens[: r.lookup_len()])
        self.waiting.appendleft(r)

    # -- admission ------------------------------------------------------------------------------
    def _admit(self, budget: int) -> bool:
        admitted = False
        while self.swapped and budget > 0 and len(self.running) < self.options.max_running:
            k = self._try_resume(self.swapped[0], budget)
            if k is None:
                return admitted  # suspended requests go first: nothing new is admitted before them
            r = self.swapped.popleft()
            self.running.append(r)
            budget -= k
            admitted = True
            if r.done == r.compute_len:
                self._finish(r)
        if not self.waiting or budget <= 0 or len(self.running) >= self.options.max_running:
            return admitted
        queue = list(self.waiting)
        t0 = time.perf_counter()
        m = self.mgr.match_batch([r.seq for r in queue])
        m = m.to_host()
        reusable = m.num_tokens
        self.stats.match_latency_s.append(time.perf_counter() - t0)
        self.stats.match_batch.append(len(queue))
        self.stats.match_tokens.append(int(sum(len(r.seq) for r in queue)))
        if self.options.order == "longest-prefix":
            order = np.argsort(-reusable, kind="stable")  # ties keep arrival order
        else:
            order = range(len(queue))
        picked = []
        room = self.options.max_running - len(self.running)
        left = budget
        for i in order:  # the candidates, as far as the budget would take them with their reuse
            if left <= 0 or len(picked) >= room:
                break
            r = queue[int(i)]
            if self.min_snapshot:
                r.checkpoint = int(m.num_tokens_before_pruning[i])
            picked.append(r)
            left -= self._step_tokens_from(r, int(reusable[i]), left)
        return self._admit_batch(picked, budget) or admitted

    def _step_tokens_from(self, r: Request, done: int, budget: int) -> int:
        """``_step_tokens`` as if ``r`` had computed ``done`` tokens."""
        done_before, r.done = r.done, done
        try:
            return self._step_tokens(r, budget)
        finally:
            r.done = done_before

    def _admit_batch(self, picked: list, budget: int) -> bool:
        """Create the picked requests' caches with their reuse, resume them
        and compute their first chunks, in batched calls; the first request
        refused pages ends admission for the step (it and those after it keep
        nothing). True when any was admitted."""
        if not picked:
            return False
        t0 = time.perf_counter()
        kvs = self.mgr.create_kv_caches([r.seq for r in picked])
        ok = self.mgr.resume_batch(kvs)
        self.stats.kv_call_s += time.perf_counter() - t0
        n = int(np.argmin(ok)) if not ok.all() else len(picked)
        reused = [kv.num_committed_tokens for kv in kvs[:n]]
        ks, done_before = [], []
        for r, kv, c in zip(picked, kvs, reused):
            r.kv = kv
            done_before.append(r.done)
            r.done = c
            k = max(0, self._step_tokens(r, budget))  # 0 only if the reuse were shorter than matched
            ks.append(k)
            budget -= k
        grown = self._resize_batch(picked[:n], ks)
        if not grown.all():
            n = int(np.argmin(grown))
        if n < len(picked):
            self.refused = picked[n]
            t0 = time.perf_counter()
            self.mgr.close_batch(kvs[n:])
            self.stats.kv_call_s += time.perf_counter() - t0
            for r, d in itertools.zip_longest(picked[n:], done_before[n:]):
                r.kv = None
                if d is not None:
                    r.done = d
        self._commit_batch(picked[:n], ks[:n])
        for r, c in zip(picked[:n], reused):
            self._admitted(r, c)
        return n > 0

    def _try_resume(self, r: Request, budget: int) -> int | None:
        """Resume a suspended request and compute its next tokens; the tokens
        computed, or None (and suspended again) when pages run out."""
        t0 = time.perf_counter()
        ok = r.kv.resume()
        self.stats.kv_call_s += time.perf_counter() - t0
        if not ok:
            return None
        k = self._step_tokens(r, budget)
        if self._grow(r, k):
            return k
        r.kv.suspend()
        return None

    def _admitted(self, r: Request, reused: int):
        s = self.stats
        self.waiting.remove(r)
        r.seq.release()
        r.seq = None
        self.running.append(r)
        if r.reused is None:  # the first admission counts for the hit rate
            r.reused = reused
            s.admitted_input_tokens += r.prompt_len
            s.reused_tokens += reused
            if reused:
                s.reuses += 1
                s.ssm_hits += self.has_ssm  # on a hybrid model every reuse ends on an SSM checkpoint
                if reused % self.T:
                    s.partial_reuses += 1
                    s.partial_reused_tokens += reused % self.T
        else:
            s.readmissions += 1
            s.readmission_reused_tokens += reused
        if r.done >= r.compute_len:
            self._finish(r)

    def _unstick(self):
        """Nothing runs and nothing could be admitted."""
        if self.swapped:  # suspended requests hold pages: recompute them instead
            while self.swapped:
                self._requeue(self.swapped.pop())
            return
        r = self.refused  # it does not fit in a pool emptied by eviction
        self.waiting.remove(r)
        log.warning("request %d (%d tokens) does not fit in the pool of %d pages per life cycle; rejected",
                    r.rid, r.compute_len, self.pages)
        r.seq.release()
        r.seq = None
        r.tokens = None
        self.stats.rejected += 1
        for nxt in self.blocked.pop(r.rid, ()):
            self.released.append(nxt)

    def _collect_manager_stats(self):
        for k, v in self.mgr.get_and_reset_reuse_stats().items():
            self.stats.manager_reuse[k] = self.stats.manager_reuse.get(k, 0) + v
        ev = self.mgr.get_and_reset_eviction_stats()
        self.stats.evicted += ev["evicted"]
        self.stats.migrated += ev["migrated"]
        self.stats.dropped += ev["dropped"]
        # An engine carries these out on its KV tensors every step; the
        # simulated model has none, so they are taken and dropped here.
        self.mgr.take_page_copies()


# -- running and reporting ---------------------------------------------------------------------
def warm_up(options: SimOptions):
    """Compile (or load from Numba's disk cache) every kernel the simulation
    uses, on a tiny workload, so that nothing timed includes compilation."""
    tiny = default_workload(3, seed=1, tokens_per_block=options.tokens_per_block, duration_s=1.0)
    o = SimOptions(**{**options.__dict__, "pages": None})
    Simulator(tiny, o).run()


def run_simulation(workload: Workload, options: SimOptions, progress: bool = False):
    """Warm up, run, and return ``(simulator, summary dict)``; the summary's
    wall time covers the warm-up too, and says what the simulation took."""
    started = time.perf_counter()
    options.validate()
    warm_up(options)
    bar = ProgressBar(len(workload.requests)) if progress else None
    sim = Simulator(workload, options, progress=bar)
    t0 = time.perf_counter()
    sim.run()
    wall = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return sim, summarize(sim, wall, time.perf_counter() - started)

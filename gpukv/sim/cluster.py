"""``gpukv simulate --workers N``: a cluster of simulated engines under one clock.

Each worker is a ``Simulator`` with its own manager (its own pools and reuse
tree). The cluster routes each conversation when its first turn arrives, to
the worker that can reuse the longest prefix of it (its ``match_batch``
answer: what a KV-aware router with exact knowledge would pick), the least
loaded one on ties; the conversation's later turns follow it there, where
its history is cached. Every step all workers step at the same simulated
time, then ``on_step`` runs (``--kv-events`` publishes each worker's events
there, one batch per worker per step).
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

import numpy as np

from .report import TIMELINE_FIELDS
from .simulate import SimOptions, Simulator, Stats, auto_pages
from .workload import Workload

# Stats fields that are not plain per-worker counts to add up.
_CLUSTER_LEVEL = {"steps", "peak_running", "peak_waiting", "timeline"}


def offset_endpoint(endpoint: str, i: int) -> str:
    """Worker ``i``'s endpoint from a base: a tcp port plus ``i`` (port 0, any
    free port, stays 0), otherwise the name with ``-i`` appended; worker 0
    keeps the base."""
    if i == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint.rpartition(":")
        if sep and port.isdigit() and host != "tcp:/":
            return endpoint if int(port) == 0 else f"{host}:{int(port) + i}"
        raise ValueError(f"a tcp endpoint needs a port (tcp://host:port), got {endpoint!r}")
    return f"{endpoint}-{i}"


class Cluster:
    """``workers`` simulated engines sharing ``workload``; see the module doc."""

    def __init__(self, workload: Workload, options: SimOptions, workers: int, on_step=None, progress=None):
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ValueError(f"workers must be an int >= 1, got {workers!r}")
        options.validate()
        self.options = options
        self.workload = workload
        # One pool size for every worker, sized from the whole workload.
        self.pages = options.pages or auto_pages(workload.requests, options)
        worker_options = replace(options, pages=self.pages)
        self.workers = [Simulator(Workload([], f"worker {i}"), worker_options) for i in range(workers)]
        self.mgr = self.workers[0].mgr  # the model and backend, as summaries name them
        self.has_ssm = self.workers[0].has_ssm
        self.T = options.tokens_per_block
        reqs = workload.requests
        self.pending = deque(r for r in reqs if r.after is None)  # first turns, in arrival order
        self.follow_ups: dict[int, list] = {}
        for r in reqs:
            if r.after is not None:
                self.follow_ups.setdefault(r.after, []).append(r)
        self.total = len(reqs)
        self.routed = [0] * workers  # requests per worker
        self.worker_of: dict[int, int] = {}  # request id -> the worker it went to
        self.now = 0.0
        self.on_step = on_step
        self.progress = progress
        self._steps = 0
        self._peak_running = self._peak_waiting = 0
        self._timeline: list = []

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> Stats:
        while self._finished() < self.total:
            if all(w.idle for w in self.workers):
                nxt = self._next_arrival()
                if nxt is None:
                    raise RuntimeError("cluster simulation stalled with no pending arrival")  # a bug
                self.now = max(self.now, nxt)
            self._route_arrivals()
            for w in self.workers:
                w.now = self.now
                w.step()
            self._steps += 1
            self._peak_running = max(self._peak_running, sum(len(w.running) for w in self.workers))
            self._peak_waiting = max(self._peak_waiting, sum(len(w.waiting) for w in self.workers))
            s = [w.stats for w in self.workers]
            self._timeline.append((self.now, *(sum(getattr(x, f) for x in s) for f in TIMELINE_FIELDS)))
            if self.on_step is not None:
                self.on_step(self)
            self.now += self.options.step_ms
            if self.progress is not None:
                self.progress(self)
        for w in self.workers:
            w._collect_manager_stats()
        return self.stats

    def _finished(self) -> int:
        return sum(w.stats.finished + w.stats.rejected for w in self.workers)

    def _next_arrival(self):
        times = [t for t in (w._next_arrival() for w in self.workers) if t is not None]
        if self.pending:
            times.append(self.pending[0].arrival_ms)
        return min(times) if times else None

    # -- routing -------------------------------------------------------------------------------
    def _route_arrivals(self):
        while self.pending and self.pending[0].arrival_ms <= self.now:
            r = self.pending.popleft()
            i = self._pick(r)
            w = self.workers[i]
            w.pending.append(r)  # arrives there this step, in arrival order
            self._hand_over(r, w, i)

    def _pick(self, r) -> int:
        lookup = r.make_tokens()[: r.lookup_len()]
        reuse = np.array([int(w.mgr.probe_reuse(lookup)) for w in self.workers])
        load = np.array([len(w.running) + len(w.waiting) + len(w.swapped) + len(w.pending) for w in self.workers])
        best = np.flatnonzero(reuse == reuse.max())
        return int(best[np.argmin(load[best])])

    def _hand_over(self, r, w: Simulator, i: int):
        """``r`` and, transitively, the turns that follow it belong to worker ``i``."""
        todo = [r]
        while todo:
            x = todo.pop()
            self.worker_of[x.rid] = i
            self.routed[i] += 1
            w.total += 1
            nxt = self.follow_ups.pop(x.rid, [])
            if nxt:
                w.blocked[x.rid] = nxt
                todo.extend(nxt)

    # -- what summaries and the progress bar read ----------------------------------------------
    @property
    def running(self) -> list:
        return [r for w in self.workers for r in w.running]

    @property
    def waiting(self) -> list:
        return [r for w in self.workers for r in w.waiting]

    @property
    def stats(self) -> Stats:
        """The workers' statistics added up (steps, peaks and the timeline are the cluster's)."""
        out = Stats()
        for name, value in out.__dict__.items():
            if name in _CLUSTER_LEVEL:
                continue
            parts = [getattr(w.stats, name) for w in self.workers]
            if isinstance(value, list):
                setattr(out, name, [x for p in parts for x in p])
            elif isinstance(value, dict):
                merged: dict = {}
                for p in parts:
                    for k, v in p.items():
                        merged[k] = merged.get(k, 0) + v
                setattr(out, name, merged)
            else:
                setattr(out, name, sum(parts))
        out.steps = self._steps
        out.peak_running = self._peak_running
        out.peak_waiting = self._peak_waiting
        out.timeline = list(self._timeline)
        return out


# -- publishing --------------------------------------------------------------------------------
class ClusterPublishers:
    """One ``ZmqEventPublisher`` per worker, on ``offset_endpoint(endpoint, i)``
    (and the replay endpoint likewise); ``__call__`` publishes every worker's
    events, as ``Cluster.on_step``."""

    def __init__(self, cluster: Cluster, endpoint: str, replay_endpoint: str | None = None):
        try:
            from ..zmq_events import ZmqEventPublisher
        except ImportError as e:
            from .report import MissingDependency

            raise MissingDependency(str(e)) from None
        self.publishers = []
        try:
            for i, w in enumerate(cluster.workers):
                replay = None if replay_endpoint is None else offset_endpoint(replay_endpoint, i)
                self.publishers.append(ZmqEventPublisher(w.mgr, offset_endpoint(endpoint, i),
                                                         data_parallel_rank=0, replay_endpoint=replay))
        except BaseException:
            self.close()
            raise
        self.batches = 0

    def describe(self, block_size: int) -> str:
        """Where each worker publishes, and a Dynamo indexer command line that subscribes to all."""
        lines = [f"worker {i + 1}: KV events on {p.endpoint}" + (f", replay on {p.replay_endpoint}"
                                                                  if p.replay_endpoint else "")
                 for i, p in enumerate(self.publishers)]
        workers = ",".join(f"{i + 1}={p.endpoint}" for i, p in enumerate(self.publishers))
        lines.append(f"a router: python -m dynamo.indexer --block-size {block_size} --model-name gpukv "
                     f"--workers \"{workers}\"")
        return "\n".join(lines)

    def wait_for_subscribers(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` in all for a subscriber on every worker; how many have one."""
        import time

        deadline = time.monotonic() + timeout_s
        return sum(p.wait_for_subscriber(max(0.0, deadline - time.monotonic())) for p in self.publishers)

    def __call__(self, cluster: Cluster):
        for p in self.publishers:
            self.batches += p.publish() is not None

    def close(self):
        for p in self.publishers:
            p.close()


def run_cluster(workload: Workload, options: SimOptions, workers: int, kv_events: str | None = None,
                kv_events_replay: str | None = None, wait_s: float = 0.0, progress: bool = False, out=None):
    """Warm up, run ``workers`` engines (publishing on ``kv_events`` when
    given), and return ``(cluster, summary dict)``. Where the publishers
    listen (and how many workers found a subscriber) is written to ``out``
    when given, else logged at INFO level on the ``gpukv.simulate`` logger."""
    import logging
    import time

    from .report import ProgressBar, summarize
    from .simulate import warm_up

    def say(text):
        if out is None:
            logging.getLogger("gpukv.simulate").info("%s", text)
        else:
            out.write(f"{text}\n")

    started = time.perf_counter()
    options.validate()
    warm_up(replace(options, kv_events=False))
    bar = ProgressBar(len(workload.requests)) if progress else None
    cluster = Cluster(workload, options, workers, progress=bar)
    publishers = None
    if kv_events:
        publishers = ClusterPublishers(cluster, kv_events, kv_events_replay)
        cluster.on_step = publishers
        say(publishers.describe(options.tokens_per_block))
        if wait_s > 0:
            n = publishers.wait_for_subscribers(wait_s)
            say(f"{n} of {workers} workers have a subscriber")
    try:
        t0 = time.perf_counter()
        cluster.run()
        wall = time.perf_counter() - t0
    finally:
        if publishers is not None:
            publishers.close()
    if bar is not None:
        bar.close()
    summary = summarize(cluster, wall, time.perf_counter() - started)
    summary["workers"] = workers
    summary["requests_per_worker"] = list(cluster.routed)
    if publishers is not None:
        summary["kv_event_batches"] = publishers.batches
    return cluster, summary

"""The ``gpukv`` command.

- ``gpukv simulate`` (the default, also plain ``gpukv``): replay a workload
  through a small serving-engine scheduler that drives gpukv as an engine
  would (``match_batch`` over the waiting queue every step, KV caches created
  with their reuse, prefill and decode commits, eviction under page pressure);
  see ``gpukv.simulate``. Prints hit rates, evictions and match latency.
- ``gpukv match``: the index alone: match batches of arriving requests, then
  insert the finished prompts (no KV caches, no page pressure).
- ``gpukv info``: the backend, library versions and a default manager's config.
- ``gpukv compile``: build every kernel a configuration uses into the kernel
  cache ahead of time, one progress step per kernel (container images, CI).

The command prints the library's log messages (the ``gpukv`` logger, INFO
and above) on stderr; results go to stdout. A cold compile shows it moving (``CompileProgress``:
each kernel compiling with its elapsed time, redrawn every second on a
terminal, a line every ten seconds on a pipe). ``--quiet`` leaves stderr to
errors alone (no progress, no compile notes, no warnings); ``--verbose`` adds
the DEBUG messages (each kernel's compile time, the backend and kernel cache
a command uses).

It is one module because every command shares the argument types, the
bounds and the error handling of ``main``; most of its length is the parser.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import threading
import time

TRACE_HELP = (
    "a Mooncake-format JSONL trace (512-token hash ids) instead of the built-in multi-turn chats. "
    "Without FILE: $GPUKV_TRACE. The trace measured in gpukv's performance notes is the conversation trace "
    "of Mooncake's FAST'25 trace release (github.com/kvcache-ai/Mooncake, FAST25-release/traces)"
)


def trace_path(arg) -> str | None:
    """The trace a ``--trace [FILE]`` argument names: None when the flag was
    not given, FILE when it was, else the one ``find_mooncake_trace`` finds."""
    if arg is None or arg:
        return arg
    from .sim.workload import find_mooncake_trace

    found = find_mooncake_trace()
    if found is None:
        raise ValueError("--trace without FILE needs $GPUKV_TRACE (the path of a Mooncake-format trace); "
                         "see gpukv simulate --help for where the trace comes from")
    return str(found)


def _number(kind, minimum, strict: bool):
    """An argparse type: a finite ``kind`` (int or float) above ``minimum``
    (or at least it), so a bad value is reported with its flag and exit 2."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        if not math.isfinite(value) or (value <= minimum if strict else value < minimum):
            raise argparse.ArgumentTypeError(f"must be a finite number {'>' if strict else '>='} {minimum}, got {text!r}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _at_most(kind, maximum):
    """An argparse type: a finite ``kind`` (int or float) of at most
    ``maximum``. Sizes are bounded where a larger value could only end in
    running out of memory on any machine gpukv runs on; the lower bounds are
    the command's and the configuration's own checks, which name the flag."""
    def parse(text: str):
        value = kind(text)  # a ValueError: argparse reports an invalid int / float value
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum:,}, got {text!r}")
        return value

    parse.__name__ = kind.__name__
    return parse


POSITIVE = _number(float, 0, strict=True)
NON_NEGATIVE = _number(float, 0, strict=False)
SEED = _number(int, 0, strict=False)
PAGES = _at_most(int, 1 << 24)  # pages per life cycle: 2**24 pages of 32 tokens hold 512 M tokens of KV
COUNT = _at_most(int, 10**6)  # requests, conversations
TOKENS = _at_most(int, 1 << 24)  # per step, per chunk, a window, tokens per block
RUNNING = _at_most(int, 1 << 16)  # a running batch, a match batch
WORKERS = _at_most(int, 64)  # engines, each with a manager of its own
SECONDS = _at_most(float, 86400)


def _endpoint(text: str) -> str:
    """A ZMQ endpoint flag: an empty one is a mistake, not the flag left out."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected an endpoint such as tcp://127.0.0.1:5557, got an empty string")
    return text


def _policy(args) -> str | None:
    """``--policy`` with ``--no-partial-reuse`` folded in (None: the default)."""
    if args.no_partial_reuse:
        if args.policy not in (None, "full-blocks"):
            raise ValueError("--no-partial-reuse contradicts --policy per-page")
        return "full-blocks"
    return args.policy


def docs_folder() -> str | None:
    """Where the documentation (README.md and docs/) lies: the checkout this
    module runs from, or the install's ``share/doc/gpukv`` (a wheel ships it
    there); None when neither has it."""
    import sysconfig
    from pathlib import Path

    here = Path(__file__).resolve().parent.parent
    places = [here]
    for scheme in (sysconfig.get_default_scheme(), f"{os.name}_user"):
        try:
            places.append(Path(sysconfig.get_path("data", scheme)) / "share" / "doc" / "gpukv")
        except KeyError:  # a platform without a user scheme
            continue
    return next((str(p) for p in places if (p / "README.md").is_file() and (p / "docs").is_dir()), None)


def _package_version() -> str:
    import gpukv

    return gpukv.__version__


def _versions() -> dict:
    import numpy

    out = {"numpy": numpy.__version__}
    for name in ("numba", "numba_cuda", "cupy"):
        try:
            mod = __import__(name)
            out[name] = getattr(mod, "__version__", "?")
        except Exception as e:  # noqa: BLE001 -- a missing or broken optional GPU stack is reported, not fatal
            out[name] = f"unavailable ({type(e).__name__})"
    return out


def cmd_info(args) -> int:
    import gpukv

    config = gpukv.CacheConfig(backend=args.backend)
    mgr = gpukv.KVCacheManager(config)
    print(f"gpukv {gpukv.__version__}")
    print(f"backend: {mgr.backend}")
    if args.backend == "auto" and mgr.backend == "cpu":
        from .core.backend import cuda_unusable_reason

        forced = os.environ.get("GPUKV_BACKEND", "auto")
        why = f"GPUKV_BACKEND={forced}" if forced != "auto" else cuda_unusable_reason()
        print(f"  (auto chose cpu: {why})")
        print("  the cuda backend needs a GPU with its driver, CuPy and numba-cuda: pip install 'gpukv[cuda]'")
    for name, v in _versions().items():
        print(f"{name}: {v}")
    print("default config:")
    for field in ("tokens_per_block", "layers", "pages_per_life_cycle", "page_bytes", "enable_partial_reuse",
                  "commit_min_snapshot", "reuse_match_backoff", "max_kv_event_entries", "max_blocks"):
        print(f"  {field} = {getattr(config, field)!r}")
    print(f"life cycles: {mgr.life_cycles}")
    print(f"index memory: {gpukv.index_memory(config).total:,} bytes at start (docs/integration.md)")
    docs = docs_folder()
    if docs is None:
        print("docs: not installed here; README.md and docs/ of gpukv's source repository")
    else:
        print(f"docs: {docs} (README.md; docs/api.md the user guide, docs/integration.md the engine's side, "
              "docs/semantics.md the rules of reuse)")
    return 0


def _requests(args):
    """Token arrays in arrival order, from the trace or the built-in workload."""
    from .sim.workload import expand_tokens, load_mooncake_trace, synthetic_conversations

    args.trace = trace_path(args.trace)
    if args.trace:
        reqs = load_mooncake_trace(args.trace, limit=args.limit)
        return [expand_tokens(r.hash_ids, r.input_length) for r in reqs], f"trace {args.trace}"
    reqs = synthetic_conversations(args.conversations, seed=args.seed, tokens_per_block=args.tokens_per_block)
    if args.limit is not None:
        reqs = reqs[: args.limit]
    return [r.tokens for r in reqs], f"built-in synthetic chats ({args.conversations} conversations, seed {args.seed})"


def _warm_up(config, T):
    """Compile (or load) every kernel the replay uses before anything is timed."""
    import gpukv

    mgr = gpukv.KVCacheManager(config)
    mgr._tree.insert(list(range(2 * T + 1)))
    seqs = [mgr.token_sequence(list(range(3 * T))) for _ in range(64)]
    mgr.match_batch(seqs)
    mgr.match_batch([list(range(2 * T))])


def cmd_match(args) -> int:
    import json

    import numpy as np

    import gpukv

    if args.limit is not None and args.limit < 0:
        raise ValueError(f"--limit must be >= 0, got {args.limit}")
    if args.batch < 1:
        raise ValueError(f"--batch must be >= 1, got {args.batch}")
    tokens, source = _requests(args)
    T = args.tokens_per_block
    config = gpukv.CacheConfig(
        tokens_per_block=T, layers=[gpukv.Attention()], pages_per_life_cycle=args.pages,
        enable_partial_reuse=not args.no_partial_reuse, backend=args.backend,
    )
    _compile_kernels(config, args)
    _warm_up(config, T)
    mgr = gpukv.KVCacheManager(config)
    latencies, sizes = [], []
    reused = np.zeros(len(tokens), dtype=np.int64)
    stored_blocks = 0
    show = sys.stderr.isatty() and not args.json
    for lo in range(0, len(tokens), args.batch):
        batch = tokens[lo:lo + args.batch]
        seqs = [mgr.token_sequence(t) for t in batch]  # a scheduler registers requests on arrival
        t0 = time.perf_counter()
        m = mgr.match_batch(seqs)
        reused[lo:lo + len(batch)] = mgr._backend.to_host(m.num_tokens)
        latencies.append(time.perf_counter() - t0)
        sizes.append(int(sum(len(t) for t in batch)))
        for s, t in zip(seqs, batch):  # each finished prompt is kept for reuse
            stored_blocks += mgr._tree.insert(t)  # as a finished request would leave them
            s.release()
        if show:
            print(f"\r{min(lo + args.batch, len(tokens))}/{len(tokens)} requests", end="", file=sys.stderr)
    if show:
        print(file=sys.stderr)
    lengths = np.array([len(t) for t in tokens], dtype=np.int64)
    lat = np.array(latencies) if latencies else np.zeros(1)
    summary = {
        "workload": source,
        "backend": mgr.backend,
        "policy": "full-blocks" if args.no_partial_reuse else "per-page coverage",
        "requests": len(tokens),
        "input_tokens": int(lengths.sum()),
        "reused_tokens": int(reused.sum()),
        "hit_rate": float(reused.sum() / max(lengths.sum(), 1)),
        "reused_from_partial_endpoints": int((reused % T).sum()),
        "requests_ending_mid_block": int(((reused % T) != 0).sum()),
        "stored_blocks": stored_blocks,
        "match_batches": len(latencies),
        "match_latency_p50_ms": float(np.percentile(lat, 50) * 1e3),
        "match_latency_p99_ms": float(np.percentile(lat, 99) * 1e3),
        "match_query_tokens_per_s": float(sum(sizes) / max(sum(latencies), 1e-12)),
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        from .sim.report import format_summary

        print(format_summary(summary))
    return 0


class CompileProgress:
    """The ``progress`` of ``compile_kernels`` for a person watching: the
    kernels ready out of ``total`` and each one compiling with its elapsed
    time. On a terminal one line, redrawn every ``interval`` seconds (1 by
    default) and at each event; elsewhere a line at each kernel ready and
    every ``interval`` seconds (10 by default) while any compiles, so a log
    shows the compile is alive. Use it as a context manager: the ticks run
    in a thread between enter and exit."""

    BAR = 24

    def __init__(self, total: int, ready=(), out=None, terminal: bool | None = None,
                 interval: float | None = None, clock=time.monotonic):
        self.out = sys.stderr if out is None else out
        self.terminal = bool(self.out.isatty()) if terminal is None else terminal
        self.interval = float(interval if interval is not None else 1.0 if self.terminal else 10.0)
        self.total = total
        self.ready = list(ready)
        self.compiling: dict = {}  # name -> when it started compiling
        self.clock = clock
        self.t0 = clock()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="gpukv-compile-progress", daemon=True)

    def __call__(self, event: str, name: str) -> None:
        with self._lock:
            if event == "ready":
                self.compiling.pop(name, None)
                self.ready.append(name)
            else:
                self.compiling[name] = self.clock()
            if self.terminal:
                self._draw()
            elif event == "ready":
                self._write(f"gpukv: {len(self.ready)}/{self.total} kernels: {name} ready ({self._elapsed(self.t0)})")

    def status(self) -> str:
        """The kernels compiling, each with its elapsed time: ``seq 34 s, commit 12 s``."""
        return ", ".join(f"{name} {self._elapsed(t)}" for name, t in self.compiling.items()) or "-"

    def _elapsed(self, since: float) -> str:
        return f"{self.clock() - since:.0f} s"

    def _draw(self) -> None:
        fill = self.BAR * len(self.ready) // max(self.total, 1)
        line = (f"[{'#' * fill}{'.' * (self.BAR - fill)}] {len(self.ready)}/{self.total} kernels  "
                f"compiling: {self.status()}  {self._elapsed(self.t0)}")
        print(f"\r{line:<100}", end="", file=self.out, flush=True)

    def _write(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def _tick(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                if self.terminal:
                    self._draw()
                elif self.compiling:
                    self._write(f"gpukv: compiling {self.status()} ({len(self.ready)}/{self.total} kernels ready, "
                                f"{self._elapsed(self.t0)} in all)")

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        if self.terminal:
            print(file=self.out, flush=True)
        return False


def _compile_kernels(config, args) -> dict | None:
    """Compile the kernels of ``config`` that the kernel cache lacks, in
    parallel processes, with a progress bar (one step per kernel) or a line
    per kernel; None when nothing is compiled here (all cached, or a backend
    whose kernels are not kept on disk). ``--quiet`` prints none of it."""
    from . import compile as jobs
    from . import kernel_cache
    from .core.backend import CACHE_DIR, get_backend

    target = get_backend(config.backend).target
    todo = kernel_cache.missing(target)
    if not todo:
        return None
    names = kernel_cache.KERNEL_NAMES

    def note(text):
        if not args.quiet:
            print(text, file=sys.stderr, flush=True)

    kept = kernel_cache.where_kept(target)
    note(f"gpukv: compiling {len(todo)} of {len(names)} kernels ({', '.join(todo)}); "
         + (f"this happens once: they are kept in {kept}" if kept else
            f"they cannot be kept on disk ({CACHE_DIR} cannot be written), so every run compiles them again: "
            "set GPUKV_CACHE_DIR to a writable folder"))
    t0 = time.perf_counter()
    if args.quiet:
        result = jobs.compile_kernels(config)
    else:
        terminal = sys.stderr.isatty() and not args.no_progress  # else a line per kernel and every 10 s
        with CompileProgress(len(names), [n for n in names if n not in todo], terminal=terminal) as progress:
            result = jobs.compile_kernels(config, progress=progress)
    note(f"gpukv: kernels compiled in {time.perf_counter() - t0:.0f} s")
    return result


def cmd_compile(args) -> int:
    """Build every kernel a configuration uses into the kernel cache, one
    progress step per kernel (for container images and CI caches)."""
    from . import kernel_cache
    from .core.backend import CACHE_DIR, get_backend
    from .sim import simulate as sim

    options = sim.SimOptions(
        policy=_policy(args) or "per-page", model=args.model,
        tokens_per_block=args.tokens_per_block, window=args.window, host_pages=args.host_pages, backend=args.backend,
    )
    options.validate()
    config = options.cache_config(pages=64)
    backend = get_backend(args.backend)
    if backend.target != "cpu":
        print(f"backend {backend.name}: its kernels are compiled in each process (nothing is kept on disk); "
              "nothing to build ahead of time")
        return 0
    kept = kernel_cache.where_kept(backend.target)
    if kept != CACHE_DIR:
        # Building ahead of time is for the cache every later process reads:
        # kernels landing elsewhere (or nowhere) would look built and not be.
        print(f"gpukv compile: the kernel cache {CACHE_DIR} (GPUKV_CACHE_DIR) cannot be written; "
              + (f"Numba would keep the kernels in {kept} instead" if kept else "Numba could keep them nowhere")
              + ": set GPUKV_CACHE_DIR to a writable folder", file=sys.stderr)
        return 2
    result = _compile_kernels(config, args)
    n = len(kernel_cache.KERNEL_NAMES)
    compiled = 0 if result is None else sum(how == "compiled" for how in result.values())
    kept = kernel_cache.where_kept(backend.target) or f"nowhere: {CACHE_DIR} cannot be written"
    print(f"{n} kernels in the kernel cache ({compiled} compiled now, {n - compiled} already there): {kept}")
    return 0


def cmd_simulate(args) -> int:
    import json

    from .sim import report
    from .sim import simulate as sim
    from .sim import workload as workloads

    if args.limit is not None and args.limit < 0:
        raise ValueError(f"--limit must be >= 0, got {args.limit}")
    if args.time_scale <= 0:
        raise ValueError(f"--time-scale must be > 0, got {args.time_scale}")
    if args.conversations < 0:
        raise ValueError(f"--conversations must be >= 0, got {args.conversations}")
    args.policy = _policy(args)
    policies = list(sim.POLICIES) if args.compare else [args.policy or "per-page"]
    if args.compare and args.policy is not None:
        raise ValueError("--compare runs both policies; leave out --policy / --no-partial-reuse")
    if args.plot:
        report.require_matplotlib()
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    if args.kv_events_replay is not None and args.kv_events is None:
        raise ValueError("--kv-events-replay needs --kv-events")
    if args.kv_events_wait < 0:
        raise ValueError(f"--kv-events-wait must be >= 0, got {args.kv_events_wait}")
    if args.kv_events is not None and args.compare:
        raise ValueError("--compare runs twice and would publish twice on the same endpoints; leave out one of them")
    args.trace = trace_path(args.trace)
    first = sim.SimOptions(policy=policies[0], model=args.model, tokens_per_block=args.tokens_per_block,
                           window=args.window, host_pages=args.host_pages, backend=args.backend)
    first.validate()
    _compile_kernels(first.cache_config(pages=64), args)
    runs = []
    for policy in policies:
        options = sim.SimOptions(
            policy=policy, model=args.model, tokens_per_block=args.tokens_per_block, window=args.window,
            pages=args.pages, host_pages=args.host_pages, max_batch_tokens=args.max_batch_tokens,
            prefill_chunk=args.prefill_chunk, decode_chunk=args.decode_chunk, max_running=args.max_running,
            order=args.order, step_ms=args.step_ms, backend=args.backend, kv_events=args.kv_events is not None,
        )
        options.validate()
        if args.trace:
            workload = workloads.trace_workload(args.trace, limit=args.limit, time_scale=args.time_scale)
        else:
            workload = workloads.default_workload(args.conversations, seed=args.seed,
                                            tokens_per_block=args.tokens_per_block, duration_s=args.duration)
            if args.limit is not None and args.limit < len(workload.requests):
                workload.requests = workload.requests[: args.limit]
                workload.description += f", of which the first {args.limit} (--limit)"
        progress = sys.stderr.isatty() and not args.no_progress and not args.quiet
        if args.workers > 1 or args.kv_events is not None:
            from .sim.cluster import run_cluster

            runs.append(run_cluster(workload, options, args.workers, args.kv_events, args.kv_events_replay,
                                    args.kv_events_wait, progress=progress))
        else:
            runs.append(sim.run_simulation(workload, options, progress=progress))
    summaries = [s for _, s in runs]
    for s in summaries:  # start-up, the backend probe, loading or compiling kernels, warm-ups: all of it
        s["wall_s"] = time.perf_counter() - args.started
    if args.plot:
        report.plot([r for r, _ in runs], args.plot)
    if args.json:
        print(json.dumps(summaries[0] if len(summaries) == 1 else summaries, indent=2))
    else:
        print(report.format_summary(*summaries))
        if args.plot:
            print(f"\nfigure: {args.plot}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda", "cudasim"],
                        help="where the tables and kernels run: auto (cuda when a GPU, CuPy and numba-cuda work, "
                             "else cpu; $GPUKV_BACKEND overrides it), cpu, cuda, or cudasim (Numba's CUDA simulator)")
    said = common.add_mutually_exclusive_group()
    said.add_argument("-q", "--quiet", action="store_true",
                      help="results and errors only: no progress bar, no compile notes, no log messages below ERROR")
    said.add_argument("-v", "--verbose", action="store_true",
                      help="also the library's DEBUG log messages (each kernel's compile time, the backend and "
                           "kernel cache used)")
    import gpukv

    p = argparse.ArgumentParser(prog="gpukv", description="GPU-resident KV-cache prefix-reuse index. "
                                "Without a command, runs `gpukv simulate`.",
                                epilog="The documentation (README.md, docs/) is installed with the package; "
                                       "`gpukv info` prints where.")
    p.add_argument("--version", action="version", version=f"gpukv {gpukv.__version__}")
    sub = p.add_subparsers(dest="command")
    sub.add_parser("info", parents=[common], help="backend, versions and default config",
                   description="Print the backend gpukv would use here (and why), the versions of the libraries "
                               "it runs on, and a default manager's configuration and index memory.")

    s = sub.add_parser(
        "simulate", parents=[common], help="replay a workload through a scheduler driving gpukv (the default)",
        description="Replay a workload through a small serving-engine scheduler that uses gpukv the way an "
                    "engine does, under GPU page pressure, and report reuse, evictions and match latency.",
    )
    w = s.add_argument_group("workload")
    w.add_argument("--trace", metavar="FILE", nargs="?", const="", help=TRACE_HELP)
    w.add_argument("--limit", type=COUNT, metavar="N", help="take the first N requests")
    w.add_argument("--conversations", type=COUNT, default=200, metavar="N", help="built-in workload: conversations (default 200)")
    w.add_argument("--duration", type=NON_NEGATIVE, default=60.0, metavar="S",
                   help="built-in workload: conversations start within S simulated seconds (default 60)")
    w.add_argument("--seed", type=SEED, default=0, metavar="N", help="built-in workload: random seed (>= 0)")
    w.add_argument("--time-scale", type=POSITIVE, default=1.0, metavar="X",
                   help="trace: divide arrival times by X (2 = twice the load)")
    c = s.add_argument_group("cache")
    c.add_argument("--policy", choices=["per-page", "full-blocks"],
                   help="per-page coverage (default), or reuse of full blocks only")
    c.add_argument("--no-partial-reuse", action="store_true", help="the same as --policy full-blocks")
    c.add_argument("--compare", action="store_true", help="run both policies on the same workload, side by side")
    c.add_argument("--model", choices=["hybrid", "attention"], default="hybrid",
                   help="hybrid: full attention + sliding window + SSM layers (default); attention: full attention")
    c.add_argument("--tokens-per-block", type=TOKENS, default=64, metavar="T", help="tokens per block (default 64)")
    c.add_argument("--window", type=TOKENS, default=1024, metavar="W", help="sliding window of the hybrid model (tokens)")
    c.add_argument("--pages", type=PAGES, metavar="N", help="GPU pages per life cycle (default: sized for pressure from the workload)")
    c.add_argument("--host-pages", type=PAGES, default=0, metavar="N", help="host-tier pages per life cycle (default 0: no host tier)")
    g = s.add_argument_group("scheduler")
    g.add_argument("--max-batch-tokens", type=TOKENS, default=4096, metavar="N", help="tokens computed per step (default 4096)")
    g.add_argument("--prefill-chunk", type=TOKENS, default=2048, metavar="N", help="largest prefill chunk (default 2048)")
    g.add_argument("--decode-chunk", type=TOKENS, default=1, metavar="N", help="tokens a decoding request adds per step (default 1)")
    g.add_argument("--max-running", type=RUNNING, default=64, metavar="N", help="largest running batch (default 64)")
    g.add_argument("--order", choices=["longest-prefix", "arrival"], default="longest-prefix",
                   help="admission order of the waiting queue (default longest-prefix)")
    g.add_argument("--step-ms", type=_at_most(float, 60_000), default=25.0, metavar="MS", help="simulated duration of a step (default 25 ms)")
    k = s.add_argument_group("cluster and KV events")
    k.add_argument("--workers", type=WORKERS, default=1, metavar="N",
                   help="N engines, each with its own cache; the simulator routes each conversation to the one "
                        "that reuses most of it (default 1)")
    k.add_argument("--kv-events", type=_endpoint, metavar="ENDPOINT",
                   help="publish each worker's KV cache events over ZMQ in vLLM's format, worker i on ENDPOINT's "
                        "port + i (e.g. tcp://127.0.0.1:5557), for a KV router to subscribe to "
                        "(needs pyzmq and msgspec: pip install -e '.[events]' in a checkout)")
    k.add_argument("--kv-events-replay", type=_endpoint, metavar="ENDPOINT",
                   help="also serve replay requests, worker i on ENDPOINT's port + i")
    k.add_argument("--kv-events-wait", type=SECONDS, default=0.0, metavar="S",
                   help="before starting, wait up to S seconds for a router to subscribe to every worker (default 0)")
    o = s.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the summary as JSON")
    o.add_argument("--plot", metavar="FILE.png",
                   help="save a figure of four panels: tokens computed over time; the recomputation per-page coverage "
                        "saves (with --compare; else the hit rate over time); SSM snapshot hits over time, on a block "
                        "boundary and inside one; match_batch latency against the requests matched "
                        "(needs matplotlib: pip install -e '.[plot]' in a checkout)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    cc = sub.add_parser(
        "compile", parents=[common], help="build every kernel a configuration uses into the kernel cache",
        description="Compile every kernel a configuration uses (the cache flags are those of gpukv simulate) into "
                    "the kernel cache, so that later runs load them in a fraction of a second; for container "
                    "images and CI caches. The cache is $GPUKV_CACHE_DIR (default ~/.cache/gpukv-numba), one "
                    "folder per version of the kernel sources.",
    )
    cc.add_argument("--model", choices=["hybrid", "attention"], default="hybrid", help="as gpukv simulate --model")
    cc.add_argument("--tokens-per-block", type=TOKENS, default=64, metavar="T", help="tokens per block (default 64)")
    cc.add_argument("--window", type=TOKENS, default=1024, metavar="W", help="sliding window of the hybrid model (tokens)")
    cc.add_argument("--policy", choices=["per-page", "full-blocks"], help="as gpukv simulate --policy")
    cc.add_argument("--no-partial-reuse", action="store_true", help="the same as --policy full-blocks")
    cc.add_argument("--host-pages", type=PAGES, default=0, metavar="N", help="host-tier pages per life cycle")
    cc.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    m = sub.add_parser(
        "match", parents=[common], help="replay a workload through batched reuse matching only",
        description="Match batches of arriving requests against the reuse index, then insert each finished "
                    "prompt, with no KV caches and no page pressure; report reuse and match latency.",
    )
    m.add_argument("--trace", metavar="FILE", nargs="?", const="", help=TRACE_HELP)
    m.add_argument("--limit", type=COUNT, metavar="N", help="take the first N requests")
    m.add_argument("--conversations", type=COUNT, default=300, metavar="N", help="built-in workload: conversations (default 300)")
    m.add_argument("--seed", type=SEED, default=0, metavar="N", help="built-in workload: random seed (>= 0)")
    m.add_argument("--batch", type=RUNNING, default=64, metavar="N", help="requests matched per match_batch call (default 64)")
    m.add_argument("--tokens-per-block", type=TOKENS, default=32, metavar="T", help="tokens per block (default 32)")
    m.add_argument("--pages", type=PAGES, default=1 << 20, metavar="N", help="pages per life cycle (default 1048576)")
    m.add_argument("--no-partial-reuse", action="store_true", help="reuse full blocks only, as block-granular engines do")
    m.add_argument("--json", action="store_true", help="print the summary as JSON")
    m.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.commands = sub.choices  # name -> the command's parser
    return p


COMMANDS = {"info": cmd_info, "simulate": cmd_simulate, "match": cmd_match, "compile": cmd_compile}


def _process_age_s() -> float | None:
    """Wall seconds since this process started, the interpreter's start-up
    and imports included (Linux: from /proc); None where that is unknown."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, from field 3 on
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: the start time
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def main(argv=None) -> int:
    # The whole run's wall time starts with the process when main is the
    # program (no argv given), else with this call (main called in-process).
    age = _process_age_s() if argv is None else None
    started = time.perf_counter() - (age or 0.0)
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help", "--version")):
        argv = ["simulate", *argv]  # the main job is the default command
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # said by the command's own parser, with its usage, not the top level's
            parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as e:  # argparse has printed the usage (or the version) and what is wrong
        return int(e.code or 0)
    args.started = started
    from .core.backend import BackendError
    from .sim.report import MissingDependency

    level = logging.ERROR if args.quiet else logging.DEBUG if args.verbose else logging.INFO
    with _log_to_stderr(level):
        log = logging.getLogger("gpukv.cli")
        from .core.backend import CACHE_DIR

        log.debug("gpukv %s, command %s, --backend %s (GPUKV_BACKEND=%s), kernel cache %s",
                  _package_version(), args.command, args.backend, os.environ.get("GPUKV_BACKEND", "unset"), CACHE_DIR)
        try:
            status = COMMANDS[args.command](args)
            sys.stdout.flush()  # here, so a closed pipe is handled below and not at exit
            return status
        except BrokenPipeError:
            # The reader (``| head``) has what it wanted: stop quietly, and keep
            # the interpreter from failing again when it flushes stdout at exit.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            return 0
        except (ValueError, TypeError, OSError, BackendError, MissingDependency) as e:
            print(f"gpukv: error: {e}", file=sys.stderr)
            return 2
        except MemoryError:
            print("gpukv: error: out of memory: the run asks for more than this machine has "
                  "(fewer --pages, --host-pages, --conversations or --max-running)", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("\ngpukv: interrupted", file=sys.stderr)
            return 130


class _CommandLogFormat(logging.Formatter):
    """``gpukv simulate: message`` for a record of the ``gpukv.simulate`` logger."""

    def format(self, record):
        return f"{record.name.replace('.', ' ')}: {record.getMessage()}"


class _log_to_stderr:
    """While a command runs, the ``gpukv`` logger's messages of ``level`` and
    above go to stderr; afterwards the logger is as it was (``main`` may be
    called more than once in a process)."""

    def __init__(self, level: int = logging.INFO):
        self.wanted = level

    def __enter__(self):
        self.logger = logging.getLogger("gpukv")
        self.level = self.logger.level
        self.handler = logging.StreamHandler(sys.stderr)
        self.handler.setFormatter(_CommandLogFormat())
        self.handler.setLevel(self.wanted)
        self.logger.addHandler(self.handler)
        if self.level == logging.NOTSET or self.level > self.wanted:
            self.logger.setLevel(self.wanted)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)
        return False


if __name__ == "__main__":
    sys.exit(main())

"""The compiled kernels: which a manager uses, which are on disk, and
building them ahead of time.

On ``cpu`` Numba compiles each kernel on its first call in a process, unless
its disk cache (``core/backend.py``: ``CACHE_DIR``, one folder per digest of
the kernel sources) holds it; then it loads in a fraction of a second. A cold
compile takes minutes on a small machine, so it is announced on the
``gpukv`` logger: once per process when a manager finds kernels missing from
the cache (which, how many, where they will be kept), and again as each one
starts compiling. ``compile_kernels`` runs a small workload on a
configuration that calls every kernel once, for ``gpukv compile`` (container
images, CI caches). Whether a kernel is cached is read from Numba's own index
file of the kernel (a small pickle), not from a compile.

The ``cuda`` backend's kernels are compiled in every process (Numba's CUDA
target keeps none on disk here) and the simulator compiles nothing; only the
``cpu`` kernels are announced and built ahead of time.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

log = logging.getLogger("gpukv")

# The kernels a manager calls, in the order a workload first needs them.
KERNEL_NAMES = ("tree", "seq", "commit", "hash", "match", "compact")


def kernels(target: str) -> dict:
    """Name -> the callable the host facade launches (the builders are cached,
    so these are the very objects a manager holds)."""
    from .kernels.match import build_match_kernels
    from .kernels.seq import build_seq_kernels
    from .kernels.tree import build_tree_kernel

    m = build_match_kernels(target)
    seq = build_seq_kernels(target)
    return {
        "tree": build_tree_kernel(target),
        "seq": seq.size,
        "commit": seq.commit,
        "hash": m.hash_blocks,
        "match": m.match,
        "compact": m.compact,
    }


def _dispatchers(target: str) -> dict:
    """Name -> the Numba dispatcher whose disk cache holds the kernel (``cpu``)."""
    from .kernels.match import build_match_kernels

    named = kernels(target)
    named.update(build_match_kernels(target).dispatchers)
    return named


def is_cached(dispatcher) -> bool:
    """True when Numba's disk cache holds a compiled version of ``dispatcher``
    for the current sources (or it is compiled in this process already)."""
    if dispatcher.signatures:
        return True
    cache = getattr(dispatcher, "_cache", None)
    index = getattr(cache, "_cache_file", None)
    if index is None:
        return False
    try:
        return bool(index._load_index())  # empty when absent or stale
    except Exception:  # noqa: BLE001 -- an unreadable index means a compile
        return False


def missing(target: str) -> list[str]:
    """The names of the kernels that a first call would compile."""
    if target != "cpu":
        return []
    return [name for name, d in _dispatchers(target).items() if not is_cached(d)]


_lock = threading.Lock()
_announced: set = set()  # targets announced in this process
_names: dict = {}  # id(launched callable) -> (name, target)
_listeners: list = []  # callables (event, name) with event "compiling" or "ready"


def announce(target: str) -> None:
    """Once per process: say which kernels are not in the disk cache yet."""
    from .core.backend import CACHE_DIR

    with _lock:
        if target in _announced or target != "cpu":
            return
        _announced.add(target)
        for name, k in kernels(target).items():
            _names[id(k)] = (name, target)
    todo = missing(target)
    if todo:
        log.info(
            "%d of %d kernels are not in the kernel cache yet (%s): each is compiled once, on its first use "
            "(minutes in all on a small machine), and kept in %s for every later run; "
            "`gpukv compile` builds them ahead of time",
            len(todo), len(KERNEL_NAMES), ", ".join(todo), CACHE_DIR,
        )


@contextlib.contextmanager
def first_call(kernel):
    """Around a kernel's first call in the process: announces a compile and
    tells the listeners (``compile_kernels``' progress bar)."""
    name, target = _names.get(id(kernel), (None, None))
    if name is None:
        yield
        return
    compiling = name in missing(target)
    if compiling:
        log.info("compiling the %s kernel (once; later runs load it from the kernel cache)", name)
    for listener in list(_listeners):
        listener("compiling" if compiling else "loading", name)
    t0 = time.perf_counter()
    yield
    if compiling:
        log.debug("the %s kernel compiled in %.1f s", name, time.perf_counter() - t0)
    for listener in list(_listeners):
        listener("ready", name)


# What a compile job runs: the kernels named, each called once on a manager
# of the job's own that calls no other kernel, so jobs compile in parallel
# processes without doing each other's work. A job of several kernels
# compiles the helpers they share once: the tree kernel shares most of its
# helpers with the sequence kernels, and after the sizing kernel it costs
# about 24 s of CPU instead of 40. On two cores the commit kernel (about
# 85 s of CPU) runs beside sizing + tree (about 80 s), and match (14 s)
# follows the first to finish (docs/performance.md, "Cold start"). Listed
# longest first.
JOBS = {"commit": ("commit",), "seq": ("seq", "tree"), "match": ("hash", "match", "compact")}


def _small(config):
    """``config`` with a small pool: argument types do not depend on table
    sizes, so what compiles for it is what a manager of the full size loads."""
    import dataclasses

    return dataclasses.replace(config, pages_per_life_cycle=8, host_pages_per_life_cycle=0, max_kv_event_entries=0)


def run_job(config, job: str) -> None:
    """Call the kernels of ``job`` once on a small manager of ``config``."""
    import numpy as np

    from . import introspect
    from .kernels.match import PARALLEL_MIN_REQUESTS
    from .kernels.seq import BATCH_WIDTH
    from .manager import KVCacheManager

    if job not in JOBS:
        raise ValueError(f"unknown compile job {job!r}; one of {tuple(JOBS)}")
    names = JOBS[job]
    mgr = KVCacheManager(_small(config))
    T = mgr.tokens_per_block
    tokens = list(range(1, 2 * T + 2))
    launcher = mgr._launcher
    if "seq" in names:
        kv = mgr.create_kv_cache()
        assert kv.resume() and kv.resize(T, T)
    if "commit" in names:
        # On an empty work list: a real commit needs a cache the sizing
        # kernel resized.
        mgr._pool._run(launcher, True, np.zeros((1, BATCH_WIDTH), dtype=np.int64), None, None, None)
    if "tree" in names:
        introspect.insert_sequence(mgr, tokens)
    if "match" in names:
        # Matching an empty tree runs the hash and match kernels; compact
        # runs only on matched blocks, so it is called here on the batch the
        # match kernel read, with nothing to compact.
        seen = []
        read = launcher.read
        launcher.read = lambda kernel, *args: (seen.append(args), read(kernel, *args))
        try:
            seqs = [mgr.token_sequence(tokens) for _ in range(PARALLEL_MIN_REQUESTS)]
            mgr.match_batch(seqs)
            mgr.match_batch([tokens])
        finally:
            launcher.read = read
        batch = next(args[1] for args in seen if len(args) == 5)  # (tables, batch, partial, backoff, ssm_lc)
        B = batch.starts.shape[0]
        xp = mgr._backend.xp
        read(mgr._matcher.kernels.compact, batch, xp.zeros(B + 1, dtype=np.int64), xp.empty(1, dtype=np.int64))
        for s in seqs:
            s.release()
    # No shutdown(): it clears the tree through the tree kernel, which would
    # compile that one too in every job.


def compile_kernels(config, progress=None, processes: int | None = None) -> dict:
    """Compile every ``cpu`` kernel a manager of ``config`` uses that the
    kernel cache does not hold, in up to ``processes`` worker processes at a
    time (default: one per CPU core, as Numba compiles one kernel at a time
    in a process), the largest first. ``progress(event, name)`` is told when
    a kernel's job starts (``"compiling"``) and when it is ``"ready"``.
    Returns name -> ``"compiled"`` or ``"cached"``."""
    import os
    import pickle
    import subprocess
    import sys
    import tempfile

    from .core.backend import get_backend

    target = get_backend(config.backend).target
    before = missing(target)
    jobs = [job for job, names in JOBS.items() if any(n in before for n in names)]
    width = max(1, min(len(jobs), processes or os.cpu_count() or 1))

    def tell(event, job):
        for name in JOBS[job]:
            if name in before and progress is not None:
                progress(event, name)

    if width == 1:  # one core: in this process, where the jobs share the helpers they compile
        for job in jobs:
            tell("compiling", job)
            run_job(config, job)
            tell("ready", job)
        jobs = []
    running: list = []
    payload = pickle.dumps(_small(config))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))

    def start(job):
        tell("compiling", job)
        err = tempfile.TemporaryFile()  # a file, not a pipe: a chatty worker never blocks on it
        p = subprocess.Popen([sys.executable, "-m", "gpukv.kernel_cache", job], stdin=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, stderr=err, env=env)
        p.stdin.write(payload)
        p.stdin.close()
        running.append((job, p, err))

    try:
        while jobs or running:
            while jobs and len(running) < width:
                start(jobs.pop(0))
            done = next((r for r in running if r[1].poll() is not None), None)  # the first to finish
            if done is None:
                time.sleep(0.2)
                continue
            running.remove(done)
            job, p, err = done
            err.seek(0)
            message = err.read().decode(errors="replace").strip()
            err.close()
            if p.returncode != 0:
                raise RuntimeError(f"compiling the {job} kernels failed (exit {p.returncode}):\n{message}")
            tell("ready", job)
    finally:
        for _, p, err in running:
            p.kill()
            p.wait()
            err.close()
    left = missing(target)
    if left:
        raise RuntimeError(f"kernels still not in the kernel cache after compiling: {', '.join(left)}")
    return {name: ("compiled" if name in before else "cached") for name in KERNEL_NAMES}


def _worker_main(job: str) -> None:
    import pickle
    import sys

    run_job(pickle.load(sys.stdin.buffer), job)


if __name__ == "__main__":
    import sys

    _worker_main(sys.argv[1])

"""Building the kernels ahead of time (``gpukv compile``, CI caches,
container images).

A compile job calls some kernels once on a small manager of its own, so the
jobs compile in parallel processes, each writing into Numba's disk cache
(``kernel_cache.py`` says which kernels are there). It runs managers, so it
sits above them; the facade below only announces a cold compile.

Workers end with their parent: a ``gpukv compile`` stopped by SIGTERM
(``timeout``, ``docker stop``, a cancelled CI job) takes its compile
workers with it instead of leaving them running.
"""

from __future__ import annotations

import time

from .kernel_cache import KERNEL_NAMES, missing

# What a compile job runs: the kernels named, each called once on a manager
# of the job's own that calls no other kernel, so jobs compile in parallel
# processes without doing each other's work. A job of several kernels
# compiles the helpers they share once (a helper is compiled once per
# process, core/cpu_helpers.py): the tree kernel shares most of its helpers
# with the sequence kernels. On two cores the commit kernel (about 33 s of
# CPU) runs beside sizing + tree (about 28 s), and match (5 s) follows the
# first to finish (docs/performance.md, "Cold start"), with the small victims
# read. Listed longest first.
JOBS = {"commit": ("commit",), "seq": ("seq", "tree"), "match": ("hash", "match", "compact", "victims")}


def _small(config):
    """``config`` with a small pool: argument types do not depend on table
    sizes, so what compiles for it is what a manager of the full size loads."""
    import dataclasses

    return dataclasses.replace(config, pages_per_life_cycle=8, host_pages_per_life_cycle=0, max_kv_event_entries=0)


def run_job(config, job: str) -> None:
    """Call the kernels of ``job`` once on a small manager of ``config``."""
    import numpy as np

    from .core.call_room import compile_ahead
    from .core.layout import BATCH_WIDTH
    from .kernels.match import PARALLEL_MIN_REQUESTS
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
        compile_ahead()  # the batched calls' compiled rules (core/call_room.py)
    if "commit" in names:
        # On an empty work list: a real commit needs a cache the sizing
        # kernel resized.
        mgr._pool._launch_work(launcher, True, np.zeros((1, BATCH_WIDTH), dtype=np.int64), None, None, None)
    if "tree" in names:
        mgr._tree.insert(tokens)
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
    if "victims" in names:
        mgr.eviction_order(1)
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
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), GPUKV_COMPILE_PARENT=str(os.getpid()))

    def start(job):
        tell("compiling", job)
        err = tempfile.TemporaryFile()  # a file, not a pipe: a chatty worker never blocks on it
        p = subprocess.Popen([sys.executable, "-m", "gpukv.compile", job], stdin=subprocess.PIPE,
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


def _end_with_parent() -> None:
    """Have this process end when its parent does: the kernel's parent-death
    signal where there is one (Linux), else a thread that watches for the
    parent to change (it is then the reaper, not the one that started us)."""
    import os
    import signal
    import sys
    import threading

    # The pid the parent gave: it may have ended while this process was
    # still importing, in which case ours is already someone else.
    parent = int(os.environ.get("GPUKV_COMPILE_PARENT", os.getppid()))
    if os.getppid() != parent:
        os._exit(1)
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        try:
            if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) == 0:
                if os.getppid() != parent:  # it ended before the signal was asked for
                    os._exit(1)
                return
        except (OSError, AttributeError):
            pass

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="gpukv-compile-parent", daemon=True).start()


def _worker_main(job: str) -> None:
    import pickle
    import sys

    _end_with_parent()
    run_job(pickle.load(sys.stdin.buffer), job)


if __name__ == "__main__":
    import sys

    _worker_main(sys.argv[1])

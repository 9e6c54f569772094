"""Which kernels dominate a cold start: each compile job of
``gpukv.kernel_cache`` alone, in a fresh process with an empty kernel cache.

    python bench/tools/cold_compile.py [JOB ...]        # default: every job

Prints, per job, the wall time and the CPU time of its process. On a shared
machine only the CPU times (and their ratios) mean much: the wall time grows
with whatever else runs. Each job compiles on its own the helpers it shares
with others (the tree and sequence kernels share many), as it does when
``gpukv compile`` runs the jobs in parallel processes.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time

from gpukv.compile import JOBS

CODE = "import gpukv; from gpukv import compile as jobs; jobs.run_job(gpukv.CacheConfig(backend='cpu'), {job!r})"


def measure(job: str) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, GPUKV_CACHE_DIR=cache, GPUKV_BACKEND="cpu")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", CODE.format(job=job)], env=env, check=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(jobs) -> None:
    for job in jobs or JOBS:
        wall, cpu = measure(job)
        print(f"{job:10s} wall {wall:7.1f} s   cpu {cpu:7.1f} s   ({', '.join(JOBS[job])})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Which kernels dominate a cold start: each compile job of
``gpukv.kernel_cache`` alone, in a fresh process with an empty kernel cache.

    python bench/tools/cold_compile.py [--where] [JOB ...]     # default: every job

Prints, per job, the wall time and the CPU time of its process. On a shared
machine only the CPU times (and their ratios) mean much: the wall time grows
with whatever else runs. Each job compiles on its own the helpers it shares
with others (the tree and sequence kernels share many), as it does when
``gpukv compile`` runs the jobs in parallel processes.

``--where`` also splits the job's CPU time between LLVM (Numba's function
passes, its module passes, the JIT's machine code) and the rest (Numba's
typing and lowering, in Python), and counts the functions compiled (a
kernel, each helper once per argument types, Numba's own). It times
methods of Numba's code library, so it reads Numba's internals, as no
public interface says this.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time

from gpukv.compile import JOBS

RUN = "import gpukv; from gpukv import compile as jobs; jobs.run_job(gpukv.CacheConfig(backend='cpu'), {job!r})"

# Around RUN with --where: the CPU time of each LLVM step, summed over every
# function compiled, printed as one JSON line on stdout.
WHERE = """
import collections, json, time
from numba.core import codegen
spent = collections.Counter()
def timed(cls, method, key):
    inner = getattr(cls, method)
    def outer(self, *args, **kwargs):
        t = time.process_time()
        try:
            return inner(self, *args, **kwargs)
        finally:
            spent[key] += time.process_time() - t
            if key == 'machine code':
                spent['functions'] += 1
    setattr(cls, method, outer)
timed(codegen.CPUCodeLibrary, '_optimize_functions', 'function passes')
timed(codegen.CPUCodeLibrary, '_optimize_final_module', 'module passes')
timed(codegen.JITCodeLibrary, '_finalize_specific', 'machine code')
t0 = time.process_time()
{run}
spent['job'] = time.process_time() - t0
print(json.dumps(spent))
"""


def measure(job: str, where: bool = False) -> tuple[float, float, dict | None]:
    code = RUN.format(job=job)
    if where:
        code = WHERE.format(run=code)
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, GPUKV_CACHE_DIR=cache, GPUKV_BACKEND="cpu")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", code], env=env, check=True, stdout=subprocess.PIPE, text=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, json.loads(done.stdout.strip().splitlines()[-1]) if where else None


def main(args) -> None:
    where = "--where" in args
    jobs = [a for a in args if a != "--where"]
    for job in jobs or JOBS:
        wall, cpu, spent = measure(job, where)
        print(f"{job:10s} wall {wall:7.1f} s   cpu {cpu:7.1f} s   ({', '.join(JOBS[job])})", flush=True)
        if spent:
            llvm = spent["function passes"] + spent["module passes"] + spent["machine code"]
            print(f"{'':10s} compiling {spent['job']:.1f} s: LLVM {llvm:.1f} s (function passes "
                  f"{spent['function passes']:.1f}, module passes {spent['module passes']:.1f}, machine code "
                  f"{spent['machine code']:.1f}), the rest {spent['job'] - llvm:.1f} s; "
                  f"{spent['functions']} functions compiled", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

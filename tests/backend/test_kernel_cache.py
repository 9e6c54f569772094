"""The kernel cache as a user meets it: a cold start says what it compiles,
a manager compiles nothing it is not asked to run, and ``gpukv compile``
leaves every kernel in the cache."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import gpukv
from gpukv import kernel_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(gpukv.__file__)))


def run_cold(code: str, cache_dir) -> subprocess.CompletedProcess:
    """``code`` in a fresh process whose kernel cache is the empty ``cache_dir``."""
    env = dict(os.environ, GPUKV_CACHE_DIR=str(cache_dir), PYTHONPATH=ROOT, GPUKV_BACKEND="cpu")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=600)


def test_a_cold_start_says_what_it_will_compile_and_compiles_nothing_yet(tmp_path):
    got = run_cold("""
        import logging
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
        import gpukv
        from gpukv import kernel_cache
        for _ in range(2):  # said once per process
            gpukv.KVCacheManager(gpukv.CacheConfig(backend="cpu", tokens_per_block=4, pages_per_life_cycle=8))
        compiled = [n for n, d in kernel_cache._dispatchers("cpu").items() if d.signatures]
        print("compiled:", compiled)
        print("missing:", kernel_cache.missing("cpu"))
    """, tmp_path)
    assert got.returncode == 0, got.stderr
    lines = [line for line in got.stderr.splitlines() if "not in the kernel cache" in line]
    assert len(lines) == 1, got.stderr
    assert lines[0].startswith(f"gpukv: {len(kernel_cache.KERNEL_NAMES)} of {len(kernel_cache.KERNEL_NAMES)} kernels")
    for name in kernel_cache.KERNEL_NAMES:
        assert name in lines[0]
    assert str(tmp_path) in lines[0] and "once" in lines[0] and "gpukv compile" in lines[0]
    assert "compiled: []" in got.stdout  # building a manager compiles no kernel
    assert f"missing: {list(kernel_cache.KERNEL_NAMES)}" in got.stdout


def test_a_kernel_compiled_on_first_use_is_announced_and_then_cached(tmp_path):
    code = """
        import logging
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
        import gpukv
        from gpukv import compile as jobs, kernel_cache
        jobs.run_job(gpukv.CacheConfig(backend="cpu", tokens_per_block=4), "match")
        print("missing:", kernel_cache.missing("cpu"))
    """
    first = run_cold(code, tmp_path)
    assert first.returncode == 0, first.stderr
    announced = {name for name in kernel_cache.KERNEL_NAMES if f"compiling the {name} kernel" in first.stderr}
    assert announced == {"hash", "match", "compact", "victims"}, first.stderr
    assert first.stdout.strip().endswith("missing: ['tree', 'seq', 'commit']"), first.stdout
    second = run_cold(code, tmp_path)  # a later process loads them
    assert second.returncode == 0, second.stderr
    assert "compiling the" not in second.stderr
    assert "3 of 7 kernels" in second.stderr


def test_gpukv_compile_leaves_every_kernel_in_the_cache(capsys):
    from gpukv.cli import main

    assert main(["compile", "--backend", "cpu", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"{len(kernel_cache.KERNEL_NAMES)} kernels in the kernel cache" in out
    assert kernel_cache.missing("cpu") == []


def test_gpukv_compile_refuses_a_bad_flag_with_its_name(capsys):
    from gpukv.cli import main

    assert main(["compile", "--tokens-per-block", "0"]) == 2
    assert "tokens-per-block" in capsys.readouterr().err


@pytest.mark.slow
def test_gpukv_compile_from_cold_builds_all_kernels_in_parallel(tmp_path):
    env = dict(os.environ, GPUKV_CACHE_DIR=str(tmp_path), PYTHONPATH=ROOT)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    got = subprocess.run([sys.executable, "-m", "gpukv.cli", "compile", "--backend", "cpu", "--model", "attention"],
                         env=env, capture_output=True, text=True, timeout=1800)
    assert got.returncode == 0, got.stderr
    assert "compiling 7 of 7 kernels" in got.stderr
    assert "7 kernels in the kernel cache (7 compiled now" in got.stdout
    again = subprocess.run([sys.executable, "-m", "gpukv.cli", "compile", "--backend", "cpu"], env=env,
                           capture_output=True, text=True, timeout=600)
    assert "(0 compiled now, 7 already there)" in again.stdout, again.stdout + again.stderr


def _compile_workers(cache_dir) -> list[int]:
    """Pids of the compile workers writing into ``cache_dir`` (Linux /proc)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if b"gpukv.compile" in cmd and f"GPUKV_CACHE_DIR={cache_dir}".encode() in env:
            found.append(int(pid))
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads the process table from /proc")
def test_sigterm_during_a_cold_compile_takes_the_workers_with_it(tmp_path):
    """``timeout``, ``docker stop`` and a cancelled CI job send SIGTERM: the
    compile workers must not be left running with parent 1."""
    import signal
    import time

    env = dict(os.environ, GPUKV_CACHE_DIR=str(tmp_path), PYTHONPATH=ROOT)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    proc = subprocess.Popen([sys.executable, "-m", "gpukv.cli", "compile", "--backend", "cpu", "--no-progress"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not _compile_workers(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.2)
        workers = _compile_workers(tmp_path)
        assert workers, "no compile worker started"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while _compile_workers(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _compile_workers(tmp_path) == [], "compile workers outlived their parent"
    finally:
        proc.kill()
        for pid in _compile_workers(tmp_path):
            os.kill(pid, signal.SIGKILL)


def test_a_second_copy_of_the_same_sources_loads_what_the_first_compiled(tmp_path):
    """Another checkout, virtual environment or wheel install (another path,
    other modification times) of the same sources compiles nothing again."""
    import shutil

    cache = tmp_path / "cache"
    code = """
        import logging
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
        import gpukv
        from gpukv import compile as jobs, kernel_cache
        print("from:", gpukv.__file__)
        jobs.run_job(gpukv.CacheConfig(backend="cpu", tokens_per_block=4), "match")
        print("missing:", kernel_cache.missing("cpu"))
    """
    first = run_cold(code, cache)
    assert first.returncode == 0, first.stderr
    assert "compiling the match kernel" in first.stderr
    copy = tmp_path / "elsewhere"
    shutil.copytree(os.path.join(ROOT, "gpukv"), copy / "gpukv", ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, GPUKV_CACHE_DIR=str(cache), PYTHONPATH=str(copy), GPUKV_BACKEND="cpu")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    second = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                            timeout=600, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert f"from: {copy / 'gpukv'}" in second.stdout
    assert "compiling the" not in second.stderr, second.stderr
    assert second.stdout.strip().endswith("missing: ['tree', 'seq', 'commit']"), second.stdout

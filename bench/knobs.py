"""The benchmarks' knobs, declared once.

Each knob is a pytest option of the bench suite (``--bench-step-batches
64,256``, listed under "gpukv benchmarks" in ``python -m pytest bench
--help``) whose default is its environment variable, or else the value
below; the tools in ``bench/tools/`` that import the benchmark modules read
the environment variable. Values are strings; ``integer`` and ``integers``
parse them.
"""

from __future__ import annotations

import os

KNOBS = {  # name -> (environment variable, default, what it sets)
    "insert": ("GPUKV_BENCH_INSERT", "4000", "trace requests inserted into the match benchmarks' tree"),
    "queries": ("GPUKV_BENCH_QUERIES", "1024", "query requests of the match benchmarks (those right after the inserted)"),
    "backend": ("GPUKV_BENCH_BACKEND", "cpu", "gpukv's backend in the match benchmarks (cpu or cuda)"),
    "tree-sizes": ("GPUKV_BENCH_TREE_SIZES", "500,2000,6000", "trace requests inserted per stage of the tree-size sweep"),
    "commit-requests": ("GPUKV_BENCH_COMMIT_REQUESTS", "64", "trace requests prefilled and decoded by the commit benchmarks"),
    "call-caches": ("GPUKV_BENCH_CALL_CACHES", "256", "running caches of the per-cache call benchmarks' manager"),
    "evict-pool": ("GPUKV_BENCH_EVICT_POOL", "16384", "pages of the eviction benchmarks' pool"),
    "step-batches": ("GPUKV_BENCH_STEP_BATCHES", "64,256", "running batch sizes of the serving step benchmarks"),
    "step-decode": ("GPUKV_BENCH_STEP_DECODE", "8", "decode steps per round of the serving step benchmarks"),
    "step-rounds": ("GPUKV_BENCH_STEP_ROUNDS", "3", "rounds of the serving step benchmarks"),
    "step-requests": ("GPUKV_BENCH_STEP_REQUESTS", "900", "trace requests the serving step benchmarks read (running + fillers)"),
    "step-calls": ("GPUKV_BENCH_STEP_CALLS", "auto", "gpukv's calls in the serving step: auto, per-cache or batched"),
    "step-digests": ("GPUKV_BENCH_STEP_DIGESTS", "0",
                     "1: gpukv computes SHA-256 block digests in the serving step (what KV cache events need; 0: off)"),
    "vllm-batch": ("GPUKV_BENCH_VLLM_BATCH", "256", "running requests of vLLM's scheduler step benchmarks"),
    "vllm-steps": ("GPUKV_BENCH_VLLM_STEPS", "32", "steps per round of vLLM's scheduler step benchmarks"),
    "vllm-churn": ("GPUKV_BENCH_VLLM_CHURN", "4", "requests finishing and arriving per step in the churn group"),
    "vllm-rounds": ("GPUKV_BENCH_VLLM_ROUNDS", "5", "rounds of vLLM's scheduler step benchmarks"),
}

_given: dict[str, str] = {}  # the pytest options' values, once the run is configured


def option(name: str) -> str:
    return "--bench-" + name


def add_options(parser) -> None:
    group = parser.getgroup("gpukv benchmarks")
    for name, (env, default, what) in KNOBS.items():
        group.addoption(option(name), default=None, metavar="VALUE",
                        help=f"{what} (default: ${env}, else {default})")


def configure(config) -> None:
    for name in KNOBS:
        value = config.getoption(option(name))
        if value is not None:
            _given[name] = value


def get(name: str) -> str:
    env, default, _ = KNOBS[name]
    if name in _given:
        return _given[name]
    return os.environ.get(env, default)


def integer(name: str) -> int:
    return _parsed(name, lambda v: int(v))


def integers(name: str) -> tuple[int, ...]:
    return _parsed(name, lambda v: tuple(int(x) for x in v.split(",")))


def _parsed(name: str, parse):
    value = get(name)
    try:
        return parse(value)
    except ValueError:
        env = KNOBS[name][0]
        raise ValueError(f"{option(name)} / ${env} must be an integer{' list (a,b,...)' if ',' in KNOBS[name][1] else ''}, "
                         f"got {value!r}") from None

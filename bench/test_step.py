"""The serving step, side by side: gpukv, vLLM's ``KVCacheManager`` and SGLang's ``RadixCache``.

The same loop on all three (``stepbench.py`` has one driver per system):
admit trace requests with prefix reuse, prefill them in 512-token chunks,
decode one token per running request per step, finish. T = 32 (SGLang
page_size 32), full attention, one thread (run with ``OMP_NUM_THREADS=1
NUMBA_NUM_THREADS=1``), gpukv on the ``cpu`` backend. The running batch is the
first B requests of the Mooncake conversation trace (each hash id expanded
to 512 deterministic tokens), B in ``GPUKV_BENCH_STEP_BATCHES`` (64 and 256).

* admission (group ``step admission B=...``): from an empty pool
  with room for everything, admit the B requests one after the other: match,
  allocate, prefill chunk by chunk (each chunk allocated, then made
  reusable). Prompt tokens/s = the B prompts' tokens / round time. Every
  system must reuse, request by request, exactly the tokens
  ``stepbench.reference_reuse`` says (whole blocks of ``prompt[:-1]`` that
  earlier prompts hold); the test fails otherwise.
* decode (groups ``step decode roomy B=...``, ``step decode evicting
  B=...``): the B requests admitted (untimed), then rounds of
  ``GPUKV_BENCH_STEP_DECODE`` (8) decode steps, each giving every running
  request one token (pages a block at a time). µs per running sequence per
  step = round time / (B x steps). ``roomy``: the pool never runs short.
  ``evicting``: the pool has 1.5x the pages the running batch needs, and
  after admitting the batch, later trace requests are admitted and finished
  until the pool is full of their cached pages, so every new page evicts one.
  The admission of the batch is checked against the reference here too
  (before the fill, nothing is evicted).

vLLM and SGLang are optional: each one's tests are skipped, with the reason,
when it does not import (see README.md for their install). gpukv runs
through the per-cache calls, or the batched calls of the running batch when
``KVCacheManager`` has them (``GPUKV_BENCH_STEP_CALLS``: ``auto``,
``per-cache``, ``batched``), without SHA-256 block digests (no KV cache
events are read: ``GPUKV_BENCH_STEP_DIGESTS=1`` computes them, as an engine
publishing events would). ``bench/tools/report.py`` prints the table, with the
ratios between systems measured in the same run.
"""

from __future__ import annotations

import os

import pytest

from . import knobs
from . import stepbench as sb

T = sb.T
BATCHES = knobs.integers("step-batches")
DECODE_STEPS = knobs.integer("step-decode")
ROUNDS = knobs.integer("step-rounds")
LOADED = knobs.integer("step-requests")  # trace requests read (running + fillers)

_unavailable: dict = {}
_warm: set = set()
_roomy: dict = {}  # (system, B) -> (driver, handles, reused): the admission test's last round; decode starts there


@pytest.fixture(scope="module")
def workload() -> sb.StepWorkload:
    if sb.trace_path() is None:
        pytest.skip("the Mooncake trace is not in shared/data (set GPUKV_TRACE)")
    w = sb.load_workload(max(LOADED, max(BATCHES) + 1), DECODE_STEPS, ROUNDS)
    w.prepare(range(max(BATCHES)))
    return w


def require(system: str):
    if system not in _unavailable:
        _unavailable[system] = sb.peer_unavailable(system) if system != "gpukv" else None
    if _unavailable[system]:
        pytest.skip(_unavailable[system])


def threads() -> dict:
    from numba import config

    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "unset"),
            "NUMBA_NUM_THREADS": int(config.NUMBA_NUM_THREADS)}


def warm(system: str, w: sb.StepWorkload):
    """Compile, load and touch each system's code paths once, outside any timing."""
    if system in _warm:
        return
    order = [0, 1]
    d = sb.make_driver(system, w, sum(w.pages(i, 4 * T) for i in order) + 8, len(order))
    handles = [d.admit(i)[0] for i in order]
    batch = d.running(handles)
    for step in range(2):
        d.decode(batch, w.step_tokens(len(order), step))
    d.finish(batch)
    _warm.add(system)


def decode_tokens_total() -> int:
    return DECODE_STEPS * ROUNDS + 1


def info(benchmark, driver, w, phase: str, pool: str, order: list, reused: list, pages: int, **more):
    benchmark.extra_info.update({
        "suite": "step", "phase": phase, "pool": pool, "system": driver.name, "version": driver.version,
        "calls": driver.calls, "batch": len(order), "pages": pages, "tokens_per_block": T, "chunk": sb.CHUNK,
        "prompt_tokens": int(sum(w.prompts[i].size for i in order)), "reused_tokens": int(sum(reused)),
        "decode_steps": DECODE_STEPS, **threads(), **more})
    if driver.name == "sglang":
        benchmark.extra_info["note"] = sb.TORCHVISION_NOTE
    if driver.name == "gpukv":
        benchmark.extra_info["block_digests"] = driver.mgr.config.block_digests


PHASES = (("admission", None), ("decode", "roomy"), ("decode", "evicting"))


def params():
    """Per batch size: admission, then decode roomy (from the admission's
    state), then decode evicting; the three systems one after the other in each."""
    out = []
    for b in BATCHES:
        for phase, pool in PHASES:
            for system in sb.SYSTEMS:
                group = f"step {phase} B={b}" if pool is None else f"step {phase} {pool} B={b}"
                name = phase if pool is None else f"{phase}-{pool}"
                out.append(pytest.param(system, b, phase, pool, id=f"{name}-{system}-B{b}",
                                        marks=pytest.mark.benchmark(group=group)))
    return out


@pytest.mark.parametrize("system, batch, phase, pool", params())
def test_step(benchmark, workload, system, batch, phase, pool):
    require(system)
    warm(system, workload)
    if phase == "admission":
        admission(benchmark, workload, system, batch)
    else:
        decode(benchmark, workload, system, batch, pool)


def admission(benchmark, workload, system, batch):
    w, order = workload, list(range(batch))
    expected = sb.reference_reuse(w, order)
    pages = sb.roomy_pages(w, order, decode_tokens_total())
    state = {}

    def setup():
        state.clear()
        state["driver"] = sb.make_driver(system, w, pages, batch)
        return (state["driver"],), {}

    def admit(d):
        state["handles"], state["reused"] = sb.admit_all(d, order)

    # SGLang's admission of B=256 takes about a minute a round on 2 cores: one round.
    benchmark.pedantic(admit, setup=setup, rounds=1 if system == "sglang" else ROUNDS, iterations=1)
    d = state["driver"]
    info(benchmark, d, w, "admission", "roomy", order, state["reused"], pages)
    mismatch = [(i, got, want) for i, got, want in zip(order, state["reused"], expected) if got != want]
    assert not mismatch, f"{system} reused other token counts than the reference (request, got, want): {mismatch[:10]}"
    _roomy[(system, batch)] = (d, state["handles"], state["reused"])


def decode(benchmark, workload, system, batch, pool):
    w, order = workload, list(range(batch))
    d, handles, reused = _roomy.pop((system, batch), (None, None, None)) if pool == "roomy" else (None, None, None)
    _roomy.pop((system, batch), None)
    if d is None:  # the evicting pool, or the admission test did not run (-k)
        d, handles, reused, facts = sb.start_running(system, w, order, pool, decode_tokens_total(), max(BATCHES))
    else:
        facts = {"pages": sb.roomy_pages(w, order, decode_tokens_total())}
    pages = facts.pop("pages")
    batch_state = d.running(handles)
    step = [0]

    def decode_round():
        for _ in range(DECODE_STEPS):
            d.decode(batch_state, w.step_tokens(batch, step[0]))
            step[0] += 1

    benchmark.pedantic(decode_round, rounds=ROUNDS, iterations=1)
    info(benchmark, d, w, "decode", pool, order, reused, pages, seq_steps=batch * DECODE_STEPS, **facts)
    if pool == "evicting":
        benchmark.extra_info["free_pages_after_decode"] = d.free_pages()
    d.finish(batch_state)

"""vLLM's scheduler step on its own KV cache manager and on gpukv's, side by side.

One step is what vLLM's engine core does per iteration on the scheduler:
``schedule()``, then ``update_from_output()`` with the model runner's output
(a stand-in sampling one deterministic token per request, built the same way
for every manager). vLLM 0.33's ``Scheduler``, unmodified, builds its manager:
stock vLLM's (``stock``) or gpukv's in either mode (``parity``: whole-block
reuse, vLLM's decisions; ``partial``: per-page coverage), all on one
workload, in one run. Block size 16, full attention, one thread (run with
``OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1``), gpukv on the ``cpu`` backend.

The running batch is ``GPUKV_BENCH_VLLM_BATCH`` (256) requests, each a system
prompt shared by a quarter of them plus its own question (about 600 prompt
tokens), admitted and prefilled before timing. Groups:

* ``vllm step decode B=256``: every step decodes one token for each running
  request (a new block every 16 steps per request, a full block cached as
  often). A round is ``GPUKV_BENCH_VLLM_STEPS`` (32) steps; µs per step =
  round time / steps.
* ``vllm step churn B=256``: the same, and each step ``GPUKV_BENCH_VLLM_CHURN``
  (4) requests finish and as many new ones arrive (prefix hits on the shared
  system prompts, their prefill in the same step), so admissions, frees and
  lookups are in the step too.

Checks, not timed: the three managers schedule the same tokens per step in
the decode group (the churn group's partial manager may reuse more), and
nothing runs out of pages (the pool holds everything).
"""

from __future__ import annotations

import importlib.metadata
import os

import numpy as np
import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
try:
    VLLM_VERSION = importlib.metadata.version("vllm")  # the distribution: tests/vllm/ is no vLLM
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - depends on the environment
    pytest.skip("vllm is not installed (bash tests/vllm/install.sh)", allow_module_level=True)

from gpukv.vllm.harness import MANAGERS, make_request, make_scheduler, next_token  # noqa: E402
from . import knobs  # noqa: E402

T = 16
BATCH = knobs.integer("vllm-batch")
STEPS = knobs.integer("vllm-steps")
CHURN = knobs.integer("vllm-churn")
ROUNDS = knobs.integer("vllm-rounds")
NUM_BLOCKS = 40_000


def prompts(n: int, start: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(7)
    systems = [rng.integers(3, 30_000, 400).tolist() for _ in range(4)]
    out = []
    for i in range(start, start + n):
        r = np.random.default_rng(1000 + i)
        out.append(systems[i % 4] + r.integers(3, 30_000, int(r.integers(120, 280))).tolist())
    return out


def model_output(scheduler, out):
    """The model runner's output: one token per request whose known tokens
    are all computed (a finished prefill or a decode)."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(out.num_scheduled_tokens)
    reqs = scheduler.requests
    sampled = [[next_token(r, reqs[r].num_tokens)] if reqs[r].num_computed_tokens >= reqs[r].num_tokens else [] for r in ids]
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled,
                             logprobs=None, prompt_logprobs_dict={}, pooler_output=[])


def step(scheduler):
    out = scheduler.schedule()
    scheduler.update_from_output(out, model_output(scheduler, out))
    return out


class Run:
    """A scheduler with the batch running (prefilled) and arrivals waiting."""

    def __init__(self, manager: str, churn: int):
        self.sched = make_scheduler(manager, num_blocks=NUM_BLOCKS, block_size=T, max_num_seqs=BATCH + churn * 2,
                                    max_num_batched_tokens=16_384, max_model_len=4096)
        self.churn = churn
        self.next_id = 0
        for p in prompts(BATCH):
            self.add(p, max_tokens=10_000)
        while any(r.is_prefill_chunk or r.num_computed_tokens == 0 for r in self.sched.requests.values()):
            step(self.sched)
        self.arrivals = prompts((ROUNDS + 1) * STEPS * churn, start=BATCH)  # the warm-up round too
        self.scheduled: list = []

    def add(self, prompt, max_tokens):
        rid = f"q{self.next_id}"
        self.next_id += 1
        self.sched.add_request(make_request(rid, prompt, max_tokens, block_size=T))

    def round(self):
        from vllm.v1.request import RequestStatus

        sched = self.sched
        for _ in range(STEPS):
            if self.churn:
                running = sched.running
                done = [r.request_id for r in running[: self.churn]]
                sched.finish_requests(done, RequestStatus.FINISHED_STOPPED)
                for _ in range(self.churn):
                    self.add(self.arrivals.pop(), max_tokens=10_000)
            out = step(sched)
            self.scheduled.append(sum(out.num_scheduled_tokens.values()))


def params():
    out = []
    for phase, churn in (("decode", 0), ("churn", CHURN)):
        for manager in MANAGERS:
            out.append(pytest.param(manager, phase, churn, id=f"{phase}-{manager}-B{BATCH}",
                                    marks=pytest.mark.benchmark(group=f"vllm step {phase} B={BATCH}")))
    return out


_scheduled: dict = {}


@pytest.mark.parametrize("manager, phase, churn", params())
def test_vllm_step(benchmark, manager, phase, churn):
    run = Run(manager, churn)
    run.round()  # warm: every code path of a step once, kernels compiled
    run.scheduled.clear()
    benchmark.pedantic(run.round, rounds=ROUNDS, iterations=1)
    from numba import config

    benchmark.extra_info.update({
        "suite": "vllm step", "phase": phase, "manager": manager, "batch": BATCH, "steps": STEPS, "churn": churn,
        "tokens_per_block": T, "num_blocks": NUM_BLOCKS, "vllm": VLLM_VERSION,
        "us_per_step": benchmark.stats.stats.median / STEPS * 1e6,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "unset"), "NUMBA_NUM_THREADS": int(config.NUMBA_NUM_THREADS),
    })
    kv = run.sched.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() > 0
    if phase == "decode":
        # Same workload, same decisions: every manager schedules the same tokens.
        first = _scheduled.setdefault(phase, run.scheduled)
        assert run.scheduled == first, f"{manager} scheduled other token counts than {MANAGERS[0]}"

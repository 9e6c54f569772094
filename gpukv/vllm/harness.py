"""vLLM's scheduler on CPU without a model: what the adapter's tests and
benchmark drive.

- ``make_scheduler(manager=...)`` builds vLLM's own ``Scheduler`` (or
  ``AsyncScheduler``) on stock vLLM's manager (``"stock"``) or on gpukv's
  (``"parity"``, ``"partial"``), from vLLM's config classes and a tiny local
  model config (no hub access, no weights, no tokenizer).
- ``make_request`` builds a ``Request`` with vLLM's default block hasher.
- ``FakeWorker`` plays the model runner: it keeps the block tables vLLM's
  worker keeps (append-only, from ``SchedulerOutput``), applies the step's
  copy-on-write copies, "computes" KV by writing each token id into its slot,
  checks that every request reads exactly its own tokens, and samples a
  deterministic next token.

Everything here is the public surface of vLLM 0.33 (config classes,
``Scheduler``, ``SchedulerOutput``, ``ModelRunnerOutput``). On a machine
without a GPU, set ``VLLM_TARGET_DEVICE=cpu`` before vLLM is first imported
(vLLM infers no device otherwise); the adapter's tests and benchmark do.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

import numpy as np

MANAGERS = ("stock", "parity", "partial")
EOS = 2

_MODEL_CONFIG = {
    "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 64, "num_hidden_layers": 2,
    "ffn_dim": 128, "num_attention_heads": 4, "word_embed_proj_dim": 64, "max_position_embeddings": 1 << 16,
    "vocab_size": 32000, "dtype": "float16", "bos_token_id": 2, "eos_token_id": EOS, "pad_token_id": 1,
    "do_layer_norm_before": True, "activation_function": "relu", "enable_bias": True,
}
_model_dir = None
_hasher = None


def model_dir() -> str:
    """A folder holding a tiny OPT ``config.json`` (vLLM's ``ModelConfig``
    reads a local folder without the hub)."""
    global _model_dir
    if _model_dir is None:
        _model_dir = tempfile.mkdtemp(prefix="gpukv-vllm-model-")
        with open(os.path.join(_model_dir, "config.json"), "w") as f:
            json.dump(_MODEL_CONFIG, f)
    return _model_dir


def make_scheduler(
    manager: str = "parity",
    *,
    num_blocks: int = 10_000,
    block_size: int = 16,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    max_model_len: int = 8192,
    enable_prefix_caching: bool = True,
    enable_kv_cache_events: bool = False,
    async_scheduling: bool = False,
    long_prefill_token_threshold: int = 0,
    policy: str = "fcfs",
):
    """vLLM's scheduler for a one-group full-attention model of ``num_blocks``
    blocks (the null block included), on the named manager."""
    if manager not in MANAGERS:
        raise ValueError(f"manager must be one of {MANAGERS}, got {manager!r}")
    import torch
    from vllm.config import CacheConfig, KVEventsConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from .scheduler import GpukvAsyncPartialScheduler, GpukvAsyncScheduler, GpukvPartialScheduler, GpukvScheduler

    model_config = ModelConfig(
        model=model_dir(), skip_tokenizer_init=True, dtype="float16", seed=0, max_model_len=max_model_len,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
        enable_chunked_prefill=True, async_scheduling=async_scheduling, is_encoder_decoder=False,
        long_prefill_token_threshold=long_prefill_token_threshold, watermark=0.0, policy=policy,
    )
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    cache_config.num_gpu_blocks = num_blocks
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="null") if enable_kv_cache_events else None
    vllm_config = VllmConfig(
        model_config=model_config, scheduler_config=scheduler_config, cache_config=cache_config,
        kv_events_config=events,
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"], FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32),
            )
        ],
    )
    cls = {
        ("stock", False): Scheduler, ("stock", True): AsyncScheduler,
        ("parity", False): GpukvScheduler, ("parity", True): GpukvAsyncScheduler,
        ("partial", False): GpukvPartialScheduler, ("partial", True): GpukvAsyncPartialScheduler,
    }[manager, async_scheduling]
    if manager == "parity":
        # The parity classes read $GPUKV_VLLM_MODE; pin it for a reproducible run.
        cls = type(cls.__name__, (cls,), {"partial_reuse": False})
    return cls(
        vllm_config=vllm_config, kv_cache_config=kv_cache_config, block_size=block_size, log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
    )


def make_request(request_id: str, prompt: list[int], max_tokens: int, *, block_size: int = 16,
                 cache_salt: str | None = None, lora_request=None, priority: int = 0, arrival_time: float | None = None):
    """A vLLM ``Request`` hashed with vLLM's default block hasher (sha256)."""
    global _hasher
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    if _hasher is None or _hasher[0] != block_size:
        init_none_hash(sha256)
        _hasher = (block_size, get_request_block_hasher(block_size, sha256))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    params.update_from_generation_config({}, EOS)
    return Request(
        request_id=request_id, prompt_token_ids=list(prompt), sampling_params=params, pooling_params=None,
        block_hasher=_hasher[1], cache_salt=cache_salt, lora_request=lora_request, priority=priority,
        arrival_time=arrival_time,
    )


def next_token(request_id: str, position: int) -> int:
    """The token a fake model samples: a function of the request and position
    only, so every manager sees the same sequences."""
    d = hashlib.blake2b(f"{request_id}:{position}".encode(), digest_size=4).digest()
    return 3 + int.from_bytes(d, "little") % 31_000


class FakeWorker:
    """vLLM's worker, reduced to its block tables and a KV that records which
    token each slot holds."""

    def __init__(self, num_blocks: int, block_size: int, check_kv: bool = True, sample=next_token):
        """``check_kv=False``: keep the block tables only (async scheduling,
        where a step's last input token is sampled by the step before it and
        reaches the scheduler only after this step is scheduled).
        ``sample(request_id, position)``: the token the model samples."""
        self.T = block_size
        self.check_kv = check_kv
        self.sample = sample
        self.kv = np.full((num_blocks, block_size), -1, dtype=np.int64)  # token id per slot
        self.tables: dict[str, list[int]] = {}
        self.num_copies = 0

    def step(self, scheduler, out):
        """Apply ``out`` as the worker would, then return its ``ModelRunnerOutput``."""
        from vllm.v1.outputs import ModelRunnerOutput

        for rid in out.finished_req_ids:
            self.tables.pop(rid, None)
        for rid in out.preempted_req_ids or ():
            self.tables.pop(rid, None)
        starts: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = list(new.block_ids[0])
            starts[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                self.tables[rid] = list(ids[0]) if ids else []
            elif ids is not None:
                self.tables[rid].extend(ids[0])
            starts[rid] = cached.num_computed_tokens[i]
        # Copies run before the forward, in order.
        for copy in out.kv_cache_block_copies or ():
            self.kv[copy.dst_block_id] = self.kv[copy.src_block_id]
            self.num_copies += 1
        req_ids, sampled = [], []
        for rid, n in out.num_scheduled_tokens.items():
            request = scheduler.requests[rid]
            start, end = starts[rid], starts[rid] + n
            if self.check_kv:
                tokens = np.asarray(request.all_token_ids, dtype=np.int64)
                table = np.asarray(self.tables[rid], dtype=np.int64)
                pos = np.arange(start, end)
                self.kv[table[pos // self.T], pos % self.T] = tokens[start:end]  # this step's KV
                pos = np.arange(end)
                seen = self.kv[table[pos // self.T], pos % self.T]
                if not np.array_equal(seen, tokens[:end]):
                    bad = int(np.argmax(seen != tokens[:end]))
                    raise AssertionError(
                        f"request {rid}: position {bad} reads token {seen[bad]} from block "
                        f"{table[bad // self.T]}, expected {tokens[bad]}"
                    )
            req_ids.append(rid)
            # A request samples once its prefill is done (vLLM's worker drops
            # the token of a partial prefill chunk).
            sampled.append([] if request.is_prefill_chunk else [self.sample(rid, request.num_computed_tokens)])
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={}, pooler_output=[],
        )

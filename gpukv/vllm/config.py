"""What gpukv's vLLM adapter accepts of vLLM's manager arguments, and the
gpukv configuration it builds from them.

vLLM's ``Scheduler`` constructs its KV cache manager with sixteen keyword
arguments (``vllm/v1/core/sched/scheduler.py``, ``KVCacheManager(...)``). The
adapter takes exactly those, and refuses, by name, every feature it does not
implement, at construction: a refusal here is a clear error at engine start
instead of a wrong block table later.

Supported: one KV cache group of full attention (``FullAttentionSpec`` or
``MLAAttentionSpec``, managed by vLLM's ``FullAttentionManager``), prefix
caching on or off, KV cache events, prefix-cache statistics, a watermark.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: Environment variable choosing the reuse mode when no flag is given:
#: ``parity`` (default) or ``partial``.
MODE_ENV = "GPUKV_VLLM_MODE"
PARITY = "parity"
PARTIAL = "partial"


def resolve_mode(partial_reuse: bool | None) -> bool:
    """The reuse mode: the flag when given, else ``$GPUKV_VLLM_MODE``.

    Parity (False) reuses whole blocks only and makes exactly stock vLLM's
    scheduling decisions; partial (True) turns gpukv's per-page coverage on,
    so a hit may end inside a block (delivered as a copy-on-write copy)."""
    if partial_reuse is not None:
        if not isinstance(partial_reuse, bool):
            raise TypeError(f"partial_reuse must be a bool or None, got {type(partial_reuse).__name__}")
        return partial_reuse
    mode = os.environ.get(MODE_ENV, PARITY).strip().lower() or PARITY
    if mode not in (PARITY, PARTIAL):
        raise ValueError(f"{MODE_ENV} must be {PARITY!r} or {PARTIAL!r}, got {mode!r}")
    return mode == PARTIAL


@dataclass(frozen=True)
class AdapterConfig:
    """The facts the adapter runs on, validated once."""

    block_size: int  # tokens per block: vLLM's block size, gpukv's tokens_per_block
    num_blocks: int  # vLLM's blocks, the null block 0 included
    max_model_len: int
    enable_caching: bool
    partial_reuse: bool
    log_stats: bool
    enable_kv_cache_events: bool
    watermark_blocks: int
    needs_zeroing: bool  # the worker zeroes newly allocated blocks (take_new_block_ids)
    spec_kind: str  # vLLM's KVCacheSpecKind value of the group, for BlockStored
    sliding_window: int | None  # ... and its sliding window (a FullAttentionSpec may carry one)

    @property
    def num_pages(self) -> int:
        """gpukv's pool: every vLLM block but the null block."""
        return self.num_blocks - 1


def unsupported(feature: str, detail: str) -> NotImplementedError:
    """The error for a vLLM feature the adapter does not implement, by name."""
    return NotImplementedError(f"gpukv's vLLM KV cache manager does not support {feature} ({detail})")


def validate(
    kv_cache_config,
    max_model_len: int,
    scheduler_block_size: int,
    hash_block_size: int,
    max_in_flight_tokens: int | None,
    enable_caching: bool,
    use_eagle: bool,
    num_hash_lookahead_tokens: int,
    num_prefill_lookahead: int,
    log_stats: bool,
    enable_kv_cache_events: bool,
    dcp_world_size: int,
    pcp_world_size: int,
    metrics_collector,
    watermark: float,
    enable_mamba_shared_prefix_checkpoint: bool,
    partial_reuse: bool | None,
) -> AdapterConfig:
    """Check vLLM's constructor arguments; raise for what gpukv cannot do."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.kv_cache_interface import (
        KVCacheConfig,
        get_kv_cache_spec_kind,
        get_kv_cache_spec_sliding_window,
    )
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    if not isinstance(kv_cache_config, KVCacheConfig):
        raise TypeError(f"kv_cache_config must be a vllm KVCacheConfig, got {type(kv_cache_config).__name__}")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise unsupported("more than one KV cache group", f"this model has {len(groups)}: a hybrid model")
    group = groups[0]
    spec = group.kv_cache_spec
    manager_cls = KVCacheSpecRegistry.get_manager_class(spec, group.role)
    if manager_cls is not FullAttentionManager:
        raise unsupported(
            "non-full-attention KV cache specs",
            f"{type(spec).__name__} is managed by vLLM's {getattr(manager_cls, '__name__', manager_cls)}, "
            "not FullAttentionManager",
        )
    if group.is_eagle_group or use_eagle:
        raise unsupported("speculative decoding", "EAGLE/MTP draft groups drop the last hit block")
    if num_hash_lookahead_tokens or num_prefill_lookahead:
        raise unsupported(
            "speculative decoding",
            f"num_hash_lookahead_tokens={num_hash_lookahead_tokens}, num_prefill_lookahead={num_prefill_lookahead}",
        )
    if dcp_world_size != 1 or pcp_world_size != 1:
        raise unsupported("context parallelism", f"dcp_world_size={dcp_world_size}, pcp_world_size={pcp_world_size}")
    if metrics_collector is not None:
        raise unsupported("KV cache residency metrics", "observability_config.kv_cache_metrics must be off")
    retention = kv_cache_config.prefix_cache_retention_interval
    if retention not in (None, 0):
        # vLLM's rule: retention sparsifies sliding-window and Mamba checkpoints
        # only; on full attention a setting is a mistake to report.
        raise ValueError(
            f"prefix_cache_retention_interval ({retention}) is set but this model has no sliding-window or Mamba "
            "KV cache group, so retention has no effect. Set it to 0 (it only applies to sliding-window and Mamba "
            "attention)."
        )
    if kv_cache_config.hisparse_host_num_blocks is not None:
        raise unsupported("HiSparse host blocks", "kv_cache_config.hisparse_host_num_blocks is set")
    for name, value in (("scheduler_block_size", scheduler_block_size), ("hash_block_size", hash_block_size)):
        if value != spec.block_size:
            raise unsupported(
                "block sizes that differ",
                f"{name}={value} but the group's block_size is {spec.block_size}; gpukv hashes and allocates whole blocks",
            )
    block_size = spec.block_size
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    num_blocks = kv_cache_config.num_blocks
    if not isinstance(num_blocks, int) or num_blocks < 2:
        raise ValueError(f"kv_cache_config.num_blocks must be an int >= 2 (block 0 is vLLM's null block), got {num_blocks!r}")
    if not isinstance(max_model_len, int) or max_model_len < 1:
        raise ValueError(f"max_model_len must be a positive int, got {max_model_len!r}")
    if max_in_flight_tokens is not None and (not isinstance(max_in_flight_tokens, int) or max_in_flight_tokens < 1):
        raise ValueError(f"max_in_flight_tokens must be None or a positive int, got {max_in_flight_tokens!r}")
    if not watermark >= 0.0:
        raise ValueError(f"watermark must be non-negative, got {watermark!r}")
    # enable_mamba_shared_prefix_checkpoint concerns Mamba groups only: a no-op
    # here, accepted so that vLLM's cache config passes through unchanged.
    del enable_mamba_shared_prefix_checkpoint
    return AdapterConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        enable_caching=bool(enable_caching),
        partial_reuse=resolve_mode(partial_reuse),
        log_stats=bool(log_stats),
        enable_kv_cache_events=bool(enable_kv_cache_events),
        watermark_blocks=int(watermark * num_blocks),
        needs_zeroing=bool(kv_cache_config.needs_kv_cache_zeroing),
        spec_kind=get_kv_cache_spec_kind(spec).value,
        sliding_window=get_kv_cache_spec_sliding_window(spec),
    )


def gpukv_config(cfg: AdapterConfig, backend: str | None = None):
    """The gpukv ``CacheConfig`` for the adapter: one full-attention life
    cycle, a page per vLLM block (block 0 excepted), stable pages (vLLM's
    worker keeps append-only block tables), index only (the worker owns the
    KV tensors and runs the page copies), the index sized for the pool, no
    SHA-256 block digests (vLLM's events carry vLLM's own block hashes)."""
    import gpukv

    return gpukv.CacheConfig(
        tokens_per_block=cfg.block_size,
        layers=[gpukv.Attention()],
        pages_per_life_cycle=cfg.num_pages,
        page_bytes=0,
        enable_partial_reuse=cfg.partial_reuse,
        stable_pages=True,
        block_digests=False,
        # A full tree holds about a block per page: the index starts at that
        # size, as vLLM's block pool does, and does not double while serving.
        initial_blocks=cfg.num_pages,
        backend=backend or "auto",  # "auto" honours $GPUKV_BACKEND
    )

"""gpukv as the KV cache manager of vLLM's v1 scheduler (vLLM 0.33).

- ``GpukvKVCacheManager``: a drop-in for ``vllm.v1.core.kv_cache_manager.KVCacheManager``
  (``manager.py``).
- ``GpukvScheduler``, ``GpukvAsyncScheduler`` (and ``...PartialScheduler``):
  vLLM's schedulers building it, for ``--scheduler-cls gpukv.vllm.GpukvScheduler``
  (``scheduler.py``).
- ``pytest -p gpukv.vllm.testing``: runs vLLM's own scheduler tests on it
  (``testing.py``).

Importing this package imports no vLLM: the names above load their module on
first access, so ``import gpukv`` and ``import gpukv.vllm`` work without it.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "GpukvKVCacheManager": "manager",
    "GpukvScheduler": "scheduler",
    "GpukvAsyncScheduler": "scheduler",
    "GpukvPartialScheduler": "scheduler",
    "GpukvAsyncPartialScheduler": "scheduler",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))

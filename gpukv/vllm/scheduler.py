"""vLLM schedulers whose KV cache manager is gpukv's.

``vllm serve ... --scheduler-cls gpukv.vllm.GpukvScheduler`` (or
``GpukvAsyncScheduler`` with async scheduling; ``...PartialScheduler`` for
gpukv's partial reuse, else ``$GPUKV_VLLM_MODE`` decides). They are vLLM's own
``Scheduler`` and ``AsyncScheduler``: the only difference is the manager
object ``Scheduler.__init__`` builds.

vLLM constructs its manager by module-global name
(``vllm.v1.core.sched.scheduler.KVCacheManager(...)``), so these classes
rebind that name for the duration of their own construction, under a lock,
and restore it; a stock ``Scheduler`` built in between (another thread) waits
for the lock only if it is one of these. Configurations the adapter cannot
serve are refused before anything is built.
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager

from vllm.v1.core.sched import scheduler as _sched_module
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from .config import unsupported
from .manager import GpukvKVCacheManager

_rebind_lock = threading.Lock()


@contextmanager
def _builds_gpukv_manager(partial_reuse: bool | None):
    with _rebind_lock:
        saved = _sched_module.KVCacheManager
        _sched_module.KVCacheManager = functools.partial(GpukvKVCacheManager, partial_reuse=partial_reuse)
        try:
            yield
        finally:
            _sched_module.KVCacheManager = saved


def _refuse_unsupported(vllm_config) -> None:
    if vllm_config.kv_transfer_config is not None:
        raise unsupported("KV connectors", f"kv_transfer_config.kv_connector={vllm_config.kv_transfer_config.kv_connector!r}")
    if vllm_config.ec_transfer_config is not None:
        raise unsupported("encoder-cache connectors", "ec_transfer_config is set")
    if vllm_config.speculative_config is not None:
        raise unsupported("speculative decoding", f"method={vllm_config.speculative_config.method!r}")
    model = vllm_config.model_config
    if model.is_encoder_decoder:
        raise unsupported("encoder-decoder models", model.model)
    if model.supports_multimodal_inputs:
        raise unsupported("multimodal inputs", f"{model.model} accepts them")


class _GpukvSchedulerMixin:
    #: None: ``$GPUKV_VLLM_MODE``; True: partial reuse; False: parity.
    partial_reuse: bool | None = None

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        _refuse_unsupported(vllm_config)
        with _builds_gpukv_manager(self.partial_reuse):
            super().__init__(vllm_config, *args, **kwargs)

    def schedule(self, *args, **kwargs):
        # The step's prefix lookups in one gpukv match: the waiting requests
        # the step could admit at most (those past the running limit wait).
        free = self.max_num_active_reqs - len(self.running)
        self.kv_cache_manager.lookup_ahead(self.waiting, min(free, len(self.waiting)))
        return super().schedule(*args, **kwargs)


class GpukvScheduler(_GpukvSchedulerMixin, Scheduler):
    """vLLM's ``Scheduler`` on gpukv's KV cache manager."""


class GpukvAsyncScheduler(_GpukvSchedulerMixin, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` on gpukv's KV cache manager."""


class GpukvPartialScheduler(GpukvScheduler):
    """``GpukvScheduler`` with gpukv's partial reuse on, whatever the environment."""

    partial_reuse = True


class GpukvAsyncPartialScheduler(GpukvAsyncScheduler):
    """``GpukvAsyncScheduler`` with gpukv's partial reuse on, whatever the environment."""

    partial_reuse = True

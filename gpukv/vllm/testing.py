"""A pytest plugin that runs vLLM's own scheduler tests on gpukv's manager.

    pytest -p gpukv.vllm.testing tests/v1/core/        # from a folder holding vLLM's tests/

Before collection it rebinds the name every vLLM module and test module
builds its KV cache manager by, ``KVCacheManager`` in
``vllm.v1.core.kv_cache_manager`` and ``vllm.v1.core.sched.scheduler``, to
gpukv's manager in parity mode (whole-block reuse, stock vLLM's decisions).
Test modules that import the name (``from vllm.v1.core.kv_cache_manager
import KVCacheManager``) are imported during collection, after the rebinding,
so they get gpukv's too. The tests themselves are vLLM's, unmodified.

It then deselects every collected test whose node id is not listed in
``gpukv/vllm/selected_tests.txt`` (one node id per line, ``#`` comments):
the tests that exercise what the adapter supports (one full-attention group,
no connectors, no speculative decoding, no multimodal inputs).

Options: ``--gpukv-selected FILE`` (another list), ``--gpukv-all`` (deselect
nothing, to survey), ``--gpukv-mode parity|partial``.
"""

from __future__ import annotations

import os

import pytest

SELECTED = os.path.join(os.path.dirname(__file__), "selected_tests.txt")


def pytest_addoption(parser):
    group = parser.getgroup("gpukv", "gpukv as vLLM's KV cache manager")
    group.addoption("--gpukv-selected", default=SELECTED, help="node ids to keep, one per line (default: %(default)s)")
    group.addoption("--gpukv-all", action="store_true", help="keep every collected test")
    group.addoption("--gpukv-mode", choices=("parity", "partial"), default="parity", help="gpukv's reuse mode")


def read_selected(path: str) -> list[str]:
    """The node ids listed in ``path``: one per line, blank lines and ``#``
    comments ignored."""
    with open(path, encoding="utf-8") as f:
        return [line.split("#", 1)[0].strip() for line in f if line.split("#", 1)[0].strip()]


def manager_class(partial_reuse: bool):
    """gpukv's manager with the reuse mode fixed, named as vLLM's class (its
    tests print it in messages)."""
    from .manager import GpukvKVCacheManager

    class KVCacheManager(GpukvKVCacheManager):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("partial_reuse", partial_reuse)
            super().__init__(*args, **kwargs)

    KVCacheManager.__qualname__ = "gpukv.vllm.testing.KVCacheManager"
    return KVCacheManager


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    from vllm.v1.core import kv_cache_manager
    from vllm.v1.core.sched import scheduler

    cls = manager_class(config.getoption("--gpukv-mode") == "partial")
    config._gpukv_stock_manager = kv_cache_manager.KVCacheManager
    kv_cache_manager.KVCacheManager = cls
    scheduler.KVCacheManager = cls


def pytest_unconfigure(config):
    stock = getattr(config, "_gpukv_stock_manager", None)
    if stock is not None:
        from vllm.v1.core import kv_cache_manager
        from vllm.v1.core.sched import scheduler

        kv_cache_manager.KVCacheManager = stock
        scheduler.KVCacheManager = stock


def pytest_report_header(config):
    mode = config.getoption("--gpukv-mode")
    if config.getoption("--gpukv-all"):
        return f"gpukv.vllm.testing: KVCacheManager is gpukv's ({mode}); every test kept"
    return f"gpukv.vllm.testing: KVCacheManager is gpukv's ({mode}); tests from {config.getoption('--gpukv-selected')}"


def pytest_collection_modifyitems(config, items):
    if config.getoption("--gpukv-all"):
        return
    keep_ids = set(read_selected(config.getoption("--gpukv-selected")))
    keep, drop = [], []
    for item in items:
        (keep if item.nodeid in keep_ids else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep

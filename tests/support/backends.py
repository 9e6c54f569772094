"""Which backends the suite runs on, and a manager on one of them.

Without a GPU the CUDA kernels run in Numba's simulator, which must be chosen
before numba is imported; so this module sets ``NUMBA_ENABLE_CUDASIM=1`` first
(``tests/conftest.py`` imports it before anything else), unless
``GPUKV_TEST_CUDA=1`` asks for the real GPU: then ``cuda`` takes the place of
``cudasim``.
"""

import os

if os.environ.get("GPUKV_TEST_CUDA") != "1":
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import pytest  # noqa: E402

import gpukv  # noqa: E402

GPU_BACKEND = "cuda" if os.environ.get("GPUKV_TEST_CUDA") == "1" else "cudasim"


def backend_params():
    """``cpu`` plus the CUDA kernels (simulated, or real with GPUKV_TEST_CUDA=1)."""
    return [pytest.param("cpu"), pytest.param(GPU_BACKEND, marks=pytest.mark.cudasim)]


def make_manager(backend="cpu", **config):
    config.setdefault("backend", backend)
    return gpukv.KVCacheManager(gpukv.CacheConfig(**config))

"""Which stream gpukv's device work goes to: ``KVCacheManager(stream=...)``.

On the simulator the launches themselves are watched: every kernel a call of
a manager with a stream launches gets that stream in its launch
configuration, and a manager without one launches on 0 (the default stream,
which is where CuPy works by default). On ``cpu`` there are no streams."""

from __future__ import annotations

import numpy as np
import pytest

import gpukv
from gpukv import streams as streams_module
from gpukv.core import backend as backend_module

from tests.support.backends import GPU_BACKEND, make_manager

T = 4


def test_cpu_has_no_streams():
    with pytest.raises(ValueError, match="cuda backend"):
        gpukv.KVCacheManager(gpukv.CacheConfig(backend="cpu"), stream=7)
    mgr = gpukv.KVCacheManager(gpukv.CacheConfig(backend="cpu"), stream=None)
    assert mgr.stream is None


class _Torchish:
    cuda_stream = 1234


class _Cupyish:
    ptr = 99


class _Numbaish:
    class handle:
        value = 77


@pytest.mark.parametrize("given, handle", [(0, 0), (5, 5), (np.int64(6), 6), (_Torchish(), 1234), (_Cupyish(), 99),
                                           (_Numbaish(), 77)])
def test_stream_handles(given, handle):
    assert streams_module.stream_handle(given) == handle


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (True, TypeError), ("s", TypeError), (1.5, TypeError)])
def test_bad_stream_handles(bad, error):
    with pytest.raises(error):
        streams_module.stream_handle(bad)


def _watch_launches(monkeypatch) -> list:
    from numba.cuda.simulator import kernel as sim_kernel

    seen = []
    original = sim_kernel.FakeCUDAKernel.__getitem__

    def getitem(self, configuration):
        seen.append(configuration[2] if len(configuration) > 2 else 0)
        return original(self, configuration)

    monkeypatch.setattr(sim_kernel.FakeCUDAKernel, "__getitem__", getitem)
    return seen


def _a_few_calls(mgr):
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(3 * T, 3 * T)
    kv.commit(list(range(1, 3 * T + 1)))
    kv.close()
    m = mgr.match_batch([list(range(1, 3 * T + 1)), [5, 6]]).to_host()
    assert m.num_tokens.tolist() == [3 * T, 0]
    kv = mgr.create_kv_cache(input_tokens=list(range(1, 2 * T + 3)))
    assert kv.resume()
    kv.close()


@pytest.mark.cudasim
@pytest.mark.skipif(GPU_BACKEND != "cudasim", reason="watches the simulator's launches")
def test_every_launch_of_a_call_gets_the_managers_stream(monkeypatch):
    from numba import cuda

    stream = cuda.stream()
    seen = _watch_launches(monkeypatch)
    mgr = make_manager("cudasim", tokens_per_block=T, pages_per_life_cycle=16, page_bytes=8 * T)
    _a_few_calls(mgr)
    assert seen and all(type(s) is int and s == 0 for s in seen), "a manager without a stream launches on stream 0"
    seen.clear()
    mgr = gpukv.KVCacheManager(gpukv.CacheConfig(backend="cudasim", tokens_per_block=T, pages_per_life_cycle=16,
                                                 page_bytes=8 * T), stream=stream)
    assert mgr.stream is stream
    _a_few_calls(mgr)
    assert len(seen) >= 8 and all(s is stream for s in seen), "a launch missed the manager's stream"
    assert backend_module.launch_stream() == 0, "the stream is the call's, not left behind"


@pytest.mark.cudasim
@pytest.mark.skipif(GPU_BACKEND != "cudasim", reason="the simulator's streams")
def test_cudasim_takes_simulator_streams_only():
    with pytest.raises(TypeError, match="numba.cuda.stream"):
        gpukv.KVCacheManager(gpukv.CacheConfig(backend="cudasim"), stream=5)

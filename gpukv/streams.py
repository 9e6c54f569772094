"""The CUDA stream a manager's calls queue their device work on.

``KVCacheManager(config, stream=...)`` names a stream; every call of that
manager then runs inside ``stream_scope``: on ``cuda`` the stream becomes
CuPy's current stream, and gpukv's kernels launch on CuPy's current stream
(``core.backend.launch_stream``), so the array operations, copies, reads and
kernels of a call are queued in one order on it. Without one, a call uses
whatever stream CuPy is on when it is made (the null stream unless the caller
entered another). See docs/integration.md for what synchronises.
"""

from __future__ import annotations

import contextlib

import numpy as np

from .core.backend import Backend, swap_simulated_stream


def stream_handle(stream) -> int:
    """The ``cudaStream_t`` handle of a stream given as an int, a CuPy stream
    (``.ptr``), a PyTorch stream (``.cuda_stream``) or a Numba stream
    (``.handle``)."""
    if isinstance(stream, (int, np.integer)) and not isinstance(stream, bool):
        if stream < 0:
            raise ValueError(f"stream must be a CUDA stream or a non-negative stream handle, got {stream!r}")
        return int(stream)
    for attr in ("cuda_stream", "ptr"):
        v = getattr(stream, attr, None)
        if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
            return int(v)
    handle = getattr(stream, "handle", None)
    if handle is not None:
        v = getattr(handle, "value", handle)  # a ctypes pointer, or an object that converts to int
        try:
            return int(v or 0)
        except (TypeError, ValueError):
            pass
    raise TypeError(
        "stream must be None, a stream handle (int), or a CuPy, PyTorch or Numba CUDA stream, "
        f"got {type(stream).__name__}"
    )


class _SimulatedStreamScope:
    """cudasim: the kernels of a call launch on a simulated stream."""

    def __init__(self, stream):
        self._stream = stream
        self._saved: list = []

    def __enter__(self):
        self._saved.append(swap_simulated_stream(self._stream))
        return self

    def __exit__(self, *exc):
        swap_simulated_stream(self._saved.pop())
        return False


def stream_scope(backend: Backend, stream):
    """What each call of a manager made with ``stream=`` runs in, a reusable
    context manager.

    None: nothing (gpukv works on whatever stream CuPy currently uses). On
    ``cuda``, any form ``stream_handle`` takes, made CuPy's current stream:
    CuPy's own context manager, so entering and leaving it runs no Python
    code of gpukv's (an interrupt cannot land between a call's last step and
    its return). On ``cudasim``, a Numba simulator stream
    (``numba.cuda.stream()``), handed to the kernel launches. The ``cpu``
    backend has no streams."""
    if stream is None:
        return contextlib.nullcontext()
    if backend.name == "cpu":
        raise ValueError("stream= needs the cuda backend (or cudasim); the cpu backend has no streams")
    if backend.name == "cudasim":
        from numba import cuda

        if not isinstance(stream, cuda.stream):
            raise TypeError(f"on cudasim, stream must be a numba.cuda.stream(), got {type(stream).__name__}")
        return _SimulatedStreamScope(stream)
    import cupy

    ptr = stream_handle(stream)
    if ptr in (0, 1):
        return cupy.cuda.Stream.null
    if ptr == 2:
        return cupy.cuda.Stream.ptds
    return cupy.cuda.ExternalStream(ptr)

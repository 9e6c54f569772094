"""Backend selection: where the tables live and what the kernels compile for.

Three backends share one kernel source:

- ``cpu``: NumPy arrays; kernels compiled with ``numba.njit`` (items split over threads).
- ``cuda``: CuPy arrays on the GPU; kernels compiled with ``numba.cuda.jit``.
- ``cudasim``: NumPy arrays; the ``numba.cuda`` kernels run in Numba's CUDA
  simulator. Slow, for tests on machines without a GPU.

``auto`` picks ``cuda`` when a GPU, CuPy and Numba's CUDA target are usable and
``cpu`` otherwise; the environment variable ``GPUKV_BACKEND`` overrides ``auto``.

The simulator is chosen by ``NUMBA_ENABLE_CUDASIM=1`` when ``numba`` is first
imported, so one process runs either real CUDA or the simulator, never both.
``gpukv`` sets that variable itself when ``GPUKV_BACKEND=cudasim`` is in the
environment at import time.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import threading
import warnings
from dataclasses import dataclass

import numpy as np

from .errors import BackendError

if os.environ.get("GPUKV_BACKEND") == "cudasim":
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


def _kernel_source_digest() -> str:
    """A digest of every source file kernels are compiled from (core/ and kernels/).

    Numba invalidates a cached kernel only when the kernel's own file changes,
    not when an inlined helper or a layout constant from another module does.
    Keying the cache folder on all of them makes any such change recompile."""
    core = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    # Kernels import only core/ and kernels/; the facade above them may change
    # without invalidating compiled kernels.
    for folder in (core, os.path.join(os.path.dirname(core), "kernels")):
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py"):
                with open(os.path.join(folder, name), "rb") as f:
                    h.update(name.encode() + f.read())
    return h.hexdigest()[:16]


# Numba's on-disk cache: a second process loads compiled kernels instead of
# recompiling them. Kept out of the (possibly read-only) package folder, and
# scoped to gpukv's own kernel sources: a locator consulted before Numba's
# own sends only functions defined under this package here, so the engine's
# Numba caches (NUMBA_CACHE_DIR or its defaults) stay where they were.
_SOURCE_DIGEST = _kernel_source_digest()
CACHE_DIR = os.path.join(
    os.environ.get("GPUKV_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "gpukv-numba")),
    _SOURCE_DIGEST,
)
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _install_cache_locator():
    from numba.core import caching

    if any(getattr(c, "gpukv_locator", False) for c in caching.CacheImpl._locator_classes):
        return

    class KernelCacheLocator(caching.UserProvidedCacheLocator):
        gpukv_locator = True

        def __init__(self, py_func, py_file):
            self._py_file = py_file
            self._lineno = py_func.__code__.co_firstlineno
            self._cache_path = os.path.join(CACHE_DIR, self.get_suitable_cache_subpath(py_file))

        @classmethod
        def from_function(cls, py_func, py_file):
            if not os.path.abspath(py_file).startswith(_PACKAGE_DIR + os.sep):
                return None
            return super(caching.UserProvidedCacheLocator, cls).from_function(py_func, py_file)

        # Numba keys a cached kernel on its file's path and modification
        # time, so a second checkout, virtual environment or wheel install of
        # the same sources would compile everything again. The folder is
        # already one per digest of the sources: within it, a file is named
        # by its place in the package and is fresh while the digest is.
        def get_source_stamp(self):
            return _SOURCE_DIGEST

        @classmethod
        def get_suitable_cache_subpath(cls, py_file):
            folder = os.path.relpath(os.path.dirname(os.path.abspath(py_file)), _PACKAGE_DIR)
            return "gpukv" if folder == "." else "gpukv_" + folder.replace(os.sep, "_")

    caching.CacheImpl._locator_classes.insert(0, KernelCacheLocator)


BACKENDS = ("auto", "cpu", "cuda", "cudasim")


def simulator_enabled() -> bool:
    from numba import config

    return bool(config.ENABLE_CUDASIM)


# The CUDA driver's library, which every CUDA program loads: where it does not
# load there is no GPU to use, and the probe ends before importing CuPy and
# numba.cuda (a second or more of imports on a machine with the cuda extra).
_DRIVER_LIBRARY = {"win32": "nvcuda.dll", "darwin": None}.get(sys.platform, "libcuda.so.1")


def _installed(module: str) -> bool:
    """Whether ``module`` could be imported, without importing it."""
    import importlib.util

    return importlib.util.find_spec(module) is not None


def cuda_driver_missing() -> str | None:
    """Why the CUDA driver cannot be loaded here, or None when it can."""
    if _DRIVER_LIBRARY is None:
        return f"CUDA has no driver on this platform ({sys.platform})"
    import ctypes

    try:
        ctypes.CDLL(_DRIVER_LIBRARY)
    except OSError as e:
        return f"no CUDA driver here ({_DRIVER_LIBRARY} does not load: {e})"
    return None


@functools.lru_cache(maxsize=None)
def cuda_unusable_reason() -> str | None:
    """Why the ``cuda`` backend cannot run here, or None when it can.

    A real GPU, CuPy and Numba's CUDA target must all work; the first failure
    is named with its exception's message, so an ``auto`` that fell back to
    ``cpu`` can say why (``gpukv info``). Asked only when a backend must be
    chosen (``auto``) or ``cuda`` is asked for, and once per process; the
    cheap checks come first (is CuPy installed, does the driver load), so a
    machine without a GPU answers in milliseconds, importing neither CuPy
    nor numba.cuda."""
    if simulator_enabled():
        return "Numba's CUDA simulator is enabled in this process (NUMBA_ENABLE_CUDASIM=1)"
    if not _installed("cupy"):
        return "CuPy is not installed (pip install 'gpukv[cuda]')"
    missing_driver = cuda_driver_missing()
    if missing_driver is not None:
        return missing_driver
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 -- any import failure is the answer
        return f"CuPy does not import: {type(e).__name__}: {e}"
    try:
        from numba import cuda
    except Exception as e:  # noqa: BLE001
        return f"numba.cuda does not import: {type(e).__name__}: {e}"
    try:
        if not cuda.is_available():
            return "numba.cuda finds no usable GPU or CUDA driver"
        if cupy.cuda.runtime.getDeviceCount() <= 0:
            return "CuPy sees no GPU"
    except Exception as e:  # noqa: BLE001 -- a driver or runtime failure
        return f"no usable GPU: {type(e).__name__}: {e}"
    return None


def cuda_usable() -> bool:
    """True when a real GPU, CuPy and Numba's CUDA target all work here."""
    return cuda_unusable_reason() is None


def resolve(name: str | None) -> str:
    """Turn a backend request into ``cpu``, ``cuda`` or ``cudasim``."""
    if name is None:
        name = "auto"
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        name = os.environ.get("GPUKV_BACKEND", "auto")
        if name not in BACKENDS:
            raise ValueError(f"GPUKV_BACKEND must be one of {BACKENDS}, got {name!r}")
        if name == "auto":
            return "cuda" if cuda_usable() else "cpu"
    if name == "cudasim" and not simulator_enabled():
        raise BackendError(
            "backend 'cudasim' needs NUMBA_ENABLE_CUDASIM=1 (or GPUKV_BACKEND=cudasim) "
            "in the environment before numba is imported"
        )
    if name == "cuda" and not cuda_usable():
        raise BackendError(f"backend 'cuda' needs a GPU with CuPy and numba-cuda working: {cuda_unusable_reason()}")
    return name


@dataclass(frozen=True)
class Backend:
    """Where arrays live (``xp``) and which kernel target runs on them."""

    name: str

    @property
    def target(self) -> str:
        """Kernel target: ``cpu`` (njit) or ``cuda`` (cuda.jit, real or simulated)."""
        return "cpu" if self.name == "cpu" else "cuda"

    @property
    def on_gpu(self) -> bool:
        return self.name == "cuda"

    @property
    def xp(self):
        if self.on_gpu:
            import cupy

            return cupy
        return np

    def to_host(self, a):
        """A NumPy view or copy of a backend array."""
        if self.on_gpu and not isinstance(a, np.ndarray):
            return a.get()
        return a

    def to_device(self, a):
        """A backend array holding ``a`` (no copy when already there)."""
        if self.on_gpu:
            import cupy

            return cupy.asarray(a)
        return np.asarray(a)

    def synchronize(self):
        if self.on_gpu:
            import cupy

            cupy.cuda.get_current_stream().synchronize()


def get_backend(name: str | None = "auto") -> Backend:
    return Backend(resolve(name))


# -- streams ------------------------------------------------------------------------
class _SimulatedStream(threading.local):
    stream = None  # cudasim: the stream of the manager call in progress on this thread


_simulated = _SimulatedStream()
_NUMBA_STREAMS: dict = {}  # CUDA stream handle -> the Numba stream object for it


def launch_stream():
    """The stream gpukv's CUDA kernels launch on (the third item of a launch
    configuration): the stream CuPy currently works on, so the kernels and
    the CuPy array operations of a call are queued in one order on one
    stream. A manager made with ``stream=`` makes its stream CuPy's current
    one for each of its calls (``stream_scope``). Under the simulator it is
    that manager's simulated stream, else 0."""
    if _simulated.stream is not None:
        return _simulated.stream
    cupy = sys.modules.get("cupy")
    if cupy is None or simulator_enabled():
        return 0
    return numba_stream_for(cupy.cuda.get_current_stream().ptr)


def numba_stream_for(ptr: int):
    """The Numba stream for a CUDA stream handle: 0 (CuPy's default, the
    null stream) stays 0, Numba's default; 1 is the legacy default stream, 2
    the per-thread default stream, as the CUDA runtime numbers them."""
    if ptr == 0:
        return 0  # Numba's default stream: what a launch without a stream gets
    s = _NUMBA_STREAMS.get(ptr)
    if s is None:
        from numba import cuda

        if ptr == 1:
            s = cuda.legacy_default_stream()
        elif ptr == 2:
            s = cuda.per_thread_default_stream()
        else:
            s = cuda.external_stream(ptr)
        _NUMBA_STREAMS[ptr] = s
    return s


def swap_simulated_stream(stream):
    """cudasim: make ``stream`` the one this thread's launches get; returns
    the one it replaces (``streams.py`` restores it after the call)."""
    previous = _simulated.stream
    _simulated.stream = stream
    return previous


def device_jit(target: str, inline: bool = True):
    """The decorator that turns a plain per-item helper into target code.

    ``cpu``: a helper compiled once per process and argument types, inlined
    into its callers unless ``inline=False`` (large, rarely hot helpers stay
    calls: one copy in the kernel instead of one per call site); see
    ``cpu_helpers.py``. Only kernels are cached on disk (``bind_globals``);
    a cached kernel carries the compiled code of every helper it calls.
    ``cuda``: a ``numba.cuda.jit(device=True)`` function.
    Helpers refer to each other through the closure of the builder that
    decorates them, so one Python source serves both targets.
    """
    if target == "cpu":
        from .cpu_helpers import helper_jit

        return lambda f: helper_jit(f, inline)
    if target == "cuda":
        from numba import cuda

        return lambda f: cuda.jit(device=True)(f)
    raise ValueError(f"unknown kernel target {target!r}")


def cpu_kernel(f, nogil: bool = False):
    """``numba.njit`` for a ``cpu`` kernel entry point: cached on disk, and
    without Numba's reference counting (``_nrt=False``). Kernels allocate
    nothing, and with it every read of a table through a tuple of arrays
    costs an atomic increment and decrement of the array's count (it made
    the match walk several times slower, and commits about twice as slow).
    ``nogil`` for the match kernels, which run on worker threads; the serial
    tree and sequence kernels have no reason to release it."""
    from numba import njit

    _install_cache_locator()
    return njit(cache=True, nogil=nogil, _nrt=False)(f)


def bind_globals(f, **names):
    """A copy of the module-level kernel ``f`` that sees ``names`` as globals.

    Kernels reach their helpers as globals, not closure cells: Numba keys its
    disk cache on the pickled closure, and a pickled dispatcher carries a new
    random id in every process, so a kernel closing over helpers would never
    hit the cache. Under the simulator ``cuda`` must be a global too: the
    simulator swaps in its fake module only where a kernel's globals name it.
    """
    import types

    g = dict(f.__globals__)
    g.update(names)
    return types.FunctionType(f.__code__, g, f.__name__, f.__defaults__)


def quiet_simulator():
    """The simulator runs kernels on NumPy scalars, whose wrapping uint64
    arithmetic warns; the wrap is intended (it is what the GPU does)."""
    if simulator_enabled():
        warnings.filterwarnings("ignore", category=RuntimeWarning, message="overflow")

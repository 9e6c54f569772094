"""The compiled kernels: which a manager uses, which are on disk, and
building them ahead of time.

On ``cpu`` Numba compiles each kernel on its first call in a process, unless
its disk cache (``core/backend.py``: ``CACHE_DIR``, one folder per digest of
the kernel sources) holds it; then it loads in a fraction of a second. A cold
compile takes minutes on a small machine, so it is announced on the
``gpukv`` logger: once per process when a manager finds kernels missing from
the cache (which, how many, where they will be kept), and again as each one
starts compiling. Whether a kernel is cached is read from Numba's own index
file of the kernel (a small pickle), not from a compile. Building them ahead
of time runs managers, so it lives above the manager: ``compile.py``.

The ``cuda`` backend's kernels are compiled in every process (Numba's CUDA
target keeps none on disk here) and the simulator compiles nothing; only the
``cpu`` kernels are announced and built ahead of time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

log = logging.getLogger("gpukv")

# The kernels a manager calls, in the order a workload first needs them.
KERNEL_NAMES = ("tree", "seq", "commit", "hash", "match", "compact", "victims")


def kernels(target: str) -> dict:
    """Name -> the callable the host facade launches (the builders are cached,
    so these are the very objects a manager holds)."""
    from .kernels.match import build_match_kernels
    from .kernels.seq import build_seq_kernels
    from .kernels.tree import build_tree_kernel
    from .kernels.victims import build_victims_kernel

    m = build_match_kernels(target)
    seq = build_seq_kernels(target)
    return {
        "tree": build_tree_kernel(target),
        "seq": seq.size,
        "commit": seq.commit,
        "hash": m.hash_blocks,
        "match": m.match,
        "compact": m.compact,
        "victims": build_victims_kernel(target),
    }


def _dispatchers(target: str) -> dict:
    """Name -> the Numba dispatcher whose disk cache holds the kernel (``cpu``)."""
    from .kernels.match import build_match_kernels

    named = kernels(target)
    named.update(build_match_kernels(target).dispatchers)
    return named


def is_cached(dispatcher) -> bool:
    """True when Numba's disk cache holds a compiled version of ``dispatcher``
    for the current sources (or it is compiled in this process already)."""
    if dispatcher.signatures:
        return True
    cache = getattr(dispatcher, "_cache", None)
    index = getattr(cache, "_cache_file", None)
    if index is None:
        return False
    try:
        return bool(index._load_index())  # empty when absent or stale
    except Exception:  # noqa: BLE001 -- an unreadable index means a compile
        return False


def folders(target: str) -> dict:
    """Name -> the folder where Numba keeps the kernel (``cpu``), or None
    where it cannot keep it at all. The kernel cache (``CACHE_DIR``) when it
    can be written; else the first place Numba's own locators find writable
    (the package's ``__pycache__``, Numba's user-wide cache)."""
    if target != "cpu":
        return {}
    out = {}
    for name, d in _dispatchers(target).items():
        impl = getattr(getattr(d, "_cache", None), "_impl", None)  # a NullCache has none: nothing is kept
        out[name] = None if impl is None else impl.locator.get_cache_path()
    return out


def where_kept(target: str) -> str | None:
    """Where the kernels are kept, in words for a person: the kernel cache,
    the other folders Numba chose instead, or None when nowhere."""
    from .core.backend import CACHE_DIR

    places = set(folders(target).values())
    if not places or None in places:
        return None
    if all(p == CACHE_DIR or p.startswith(CACHE_DIR + os.sep) for p in places):
        return CACHE_DIR
    return ", ".join(sorted(places))


def missing(target: str) -> list[str]:
    """The names of the kernels that a first call would compile."""
    if target != "cpu":
        return []
    return [name for name, d in _dispatchers(target).items() if not is_cached(d)]


_lock = threading.Lock()
_announced: set = set()  # targets announced in this process
_names: dict = {}  # id(launched callable) -> (name, target)


def announce(target: str) -> None:
    """Once per process: say which kernels are not in the disk cache yet."""
    from .core.backend import CACHE_DIR

    with _lock:
        if target in _announced or target != "cpu":
            return
        _announced.add(target)
        for name, k in kernels(target).items():
            _names[id(k)] = (name, target)
    kept = where_kept(target)
    if kept is None:
        log.warning(
            "the kernels cannot be kept on disk (%s cannot be written, nor any folder Numba falls back to): "
            "every process compiles them again, minutes on a small machine; set GPUKV_CACHE_DIR to a "
            "writable folder", CACHE_DIR,
        )
    elif kept != CACHE_DIR:
        log.warning(
            "the kernel cache %s cannot be written: the kernels are kept in %s instead; set GPUKV_CACHE_DIR "
            "to a writable folder to keep them where every install of these sources finds them",
            CACHE_DIR, kept,
        )
    todo = missing(target)
    if todo:
        log.info(
            "%d of %d kernels are not in the kernel cache yet (%s): each is compiled once, on its first use "
            "(minutes in all on a small machine)%s; `gpukv compile` builds them ahead of time",
            len(todo), len(KERNEL_NAMES), ", ".join(todo),
            f", and kept in {kept} for every later run" if kept else "",
        )


@contextlib.contextmanager
def first_call(kernel):
    """Around a kernel's first call in the process: announces a compile."""
    name, target = _names.get(id(kernel), (None, None))
    if name is None or name not in missing(target):
        yield
        return
    log.info("compiling the %s kernel (once; later runs load it from the kernel cache)", name)
    t0 = time.perf_counter()
    yield
    log.debug("the %s kernel compiled in %.1f s", name, time.perf_counter() - t0)

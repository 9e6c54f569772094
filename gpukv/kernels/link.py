"""How kernel helpers are composed: plain module-level functions, linked per target.

Every kernel helper is an ordinary module-level Python function marked with
``@helper`` (inlined into its callers) or ``@helper(inline=False)`` (a call:
large helpers that are rarely hot, one copy in the kernel instead of one per
call site, which LLVM optimises and compiles faster). A helper
calls another helper of any module by its plain name, imported as usual, so
the code reads, greps and lints like ordinary Python.

``link(target)`` compiles them all for one target: each helper is copied with
a globals dict of its own module in which every name that refers to a helper
is rebound to that helper's compiled copy (``backend.device_jit``). Nothing
is a closure: Numba keys its disk cache on closure contents, and a pickled
dispatcher carries a new random id in every process, so a kernel that closed
over its helpers would never hit the cache. Kernel entry points are
module-level functions too, bound the same way (``linked.kernel``) and cached
on disk by ``backend.cpu_kernel``.

Compilation is lazy: a helper is compiled when the first kernel that calls it
is, so a target never compiles helpers only the other target uses. On
``cpu`` a helper is compiled once per process and argument types, and the
kernels of one process share it (``core/cpu_helpers.py``).
"""

from __future__ import annotations

import functools
import importlib
import types

from ..core.backend import bind_globals, device_jit

# Every module holding helpers, in import order (lower layers first). ``link``
# imports them all, so every helper is registered before anything is bound.
MODULES = (
    "keys", "sha256", "prefetch", "lifecycle", "index", "dlist", "lru", "pages", "log", "blocks", "evict", "tree",
    "seq_hold", "seq_resume", "seq_resize", "seq_commit", "seq_close", "seq",
    "reuse", "walk", "match", "victims",
)

_HELPERS: dict = {}  # plain function -> how it is compiled ({"inline": bool, target: implementation factory})


def helper(f=None, *, inline: bool = True, cpu=None, cuda=None):
    """Mark ``f`` as a kernel helper. ``cpu`` / ``cuda``: a factory returning
    that target's implementation instead of compiling ``f`` (intrinsics such
    as cache prefetch hints, which only one target has)."""

    def mark(g):
        _HELPERS[g] = {"inline": inline, "cpu": cpu, "cuda": cuda}
        return g

    return mark(f) if f is not None else mark


class Linked(types.SimpleNamespace):
    """Every helper compiled for one target, by name; ``kernel(f)`` binds a
    module-level kernel entry point to them."""

    def kernel(self, f, **extra):
        """A copy of ``f`` whose helper globals are the compiled helpers."""
        table = self._table
        names = {n: table[v] for n, v in f.__globals__.items() if _is_helper(v)}
        names.update(extra)
        return bind_globals(f, **names)


def _is_helper(v) -> bool:
    try:
        return v in _HELPERS
    except TypeError:  # unhashable globals are never helpers
        return False


@functools.lru_cache(maxsize=None)
def link(target: str) -> Linked:
    for name in MODULES:
        importlib.import_module(f"{__package__}.{name}")
    jit = device_jit(target)
    call = device_jit(target, inline=False)
    table = {}
    rebound: dict[str, dict] = {}  # module name -> the globals its compiled helpers see
    by_name = {}
    for f, how in _HELPERS.items():
        if f.__name__ in by_name:
            raise AssertionError(f"two kernel helpers named {f.__name__}: one namespace serves every kernel")
        factory = how[target]
        if factory is not None:
            compiled = factory()
        else:
            g = rebound.setdefault(f.__module__, dict(f.__globals__))
            copy = types.FunctionType(f.__code__, g, f.__name__, f.__defaults__, f.__closure__)
            copy.__doc__ = f.__doc__
            compiled = (jit if how["inline"] else call)(copy)
        table[f] = compiled
        by_name[f.__name__] = compiled
    for g in rebound.values():
        for n, v in list(g.items()):
            if _is_helper(v):
                g[n] = table[v]
    return Linked(_table=table, target=target, **by_name)

"""How kernel helpers compile on ``cpu``: each once per process and argument
types, inlined into the kernels by LLVM.

What Numba does by default made a cold compile of the kernels take minutes
(docs/performance.md, "Cold start"):

- a function Numba inlines (``njit(inline="always")``) is read again from
  its bytecode at every call site, with every helper inlined into it, and
  its IR deep-copied there: nested helpers cost their depth times their
  call sites, most of the compile;
- a constant argument has a literal type (``Literal[int](0)``), and each
  literal value compiles the callee again, with everything it calls, as
  does each integer width;
- each compiled function gets wrappers for Python and C callers.

A helper here is a function of its own, compiled once per process and
argument types, and shared by every kernel of the process that calls it.
The types are widened first: constants to their plain type, signed integers
narrower than 64 bits to int64 (unsigned ones keep their width, as their
wrap-around is meant). A helper marked ``inline`` is inlined by LLVM
(``alwaysinline``) when the kernel is optimised, where the constants reach
it again. No wrappers are made: a helper runs only inside a kernel, and says
so when called from Python.
"""

from __future__ import annotations

import functools


def helper_jit(f, inline: bool):
    """``f`` as a ``cpu`` kernel helper; ``inline``: inlined into each caller,
    else a call. Neither has reference counting, as the kernels
    (``backend.cpu_kernel``): helpers allocate nothing, and with it every
    read of a table through the tuple of arrays would cost an atomic
    increment and decrement."""
    # forceinline is given either way: a helper compiled from another one
    # would otherwise inherit its caller's.
    options = dict(nopython=True, _nrt=False, forceinline=inline, no_cpython_wrapper=True, no_cfunc_wrapper=True)
    return _dispatcher_class()(py_func=f, locals={}, targetoptions=options)


def widened(t):
    """The type a helper is compiled for when called with an argument of type ``t``."""
    from numba.core import types

    t = types.unliteral(t)
    if isinstance(t, types.Integer) and t.signed and t.bitwidth < 64:
        return types.int64
    return t


@functools.lru_cache(maxsize=None)
def _dispatcher_class():
    from numba.core.registry import CPUDispatcher

    class HelperDispatcher(CPUDispatcher):
        def get_call_template(self, args, kws):
            # Asked when a call from compiled code is typed; the caller then
            # converts its arguments to the widened types.
            return super().get_call_template([widened(a) for a in args], {k: widened(v) for k, v in kws.items()})

        def __call__(self, *args, **kwargs):
            raise TypeError(f"{self.py_func.__name__} is a kernel helper: it runs only inside a compiled kernel")

    return HelperDispatcher

"""How kernel helpers compile on ``cpu``: each once, into LLVM IR that only
the kernels calling it turn into machine code.

What Numba does by default made a cold compile of the kernels take minutes
(docs/performance.md, "Cold start"):

- a function inlined by Numba (``njit(inline="always")``) is read again
  from its bytecode at every call site, with every helper inlined into it,
  and its IR deep-copied there, so nested helpers cost their depth times
  their call sites;
- a function compiled on its own is optimised with all it calls linked in,
  turned into machine code, and the same again inside each caller, so code
  three calls down is optimised and compiled four times;
- a constant argument is a literal type (``Literal[int](0)``), and each
  literal value compiles the callee again, as does each integer width;
- each function gets wrappers for Python and C callers.

A helper here is a function of its own, compiled once per process and
argument types: the types are widened first (constants to their plain type,
signed integers narrower than 64 bits to int64; unsigned ones keep their
width, as their wrap-around is meant), no wrappers are made (a helper is
never called from Python: it says so), and its code stays LLVM IR, optimised
by each function alone: the kernel that links it optimises everything it
calls once, at Numba's level, and only the kernel becomes machine code. A
helper marked ``inline`` is inlined there by LLVM (``alwaysinline``), where
constants reach it as they did before the widening.

Numba has no public switch for the last part; it relies on its code
library's finalisation steps (the same from Numba 0.60 on). Where they are
not found, helpers compile the default way: slower, the same results.
"""

from __future__ import annotations

import functools


def helper_jit(f, inline: bool):
    """``f`` as a ``cpu`` kernel helper; ``inline``: inlined into each caller
    by LLVM, else a call. Neither has reference counting, as the kernels
    (``backend.cpu_kernel``): helpers allocate nothing, and with it every
    read of a table through the tuple of arrays would cost an atomic
    increment and decrement."""
    options = dict(nopython=True, _nrt=False, forceinline=inline, no_cpython_wrapper=True, no_cfunc_wrapper=True)
    return _dispatcher_class()(py_func=f, locals={}, targetoptions=options, pipeline_class=_compiler_class())


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
            # Asked by the typing of every call from compiled code; the
            # caller's arguments are converted to the widened types.
            return super().get_call_template([widened(a) for a in args], {k: widened(v) for k, v in kws.items()})

        def __call__(self, *args, **kwargs):
            raise TypeError(f"{self.py_func.__name__} is a kernel helper: it runs only inside a compiled kernel")

    return HelperDispatcher


def _links_only_supported() -> bool:
    from numba.core import codegen

    lib = codegen.JITCodeLibrary
    return all(hasattr(lib, n) for n in ("_optimize_final_module", "_finalize_final_module",
                                         "_finalize_dynamic_globals", "_verify_declare_only_symbols"))


@functools.lru_cache(maxsize=None)
def _compiler_class():
    from numba.core import codegen, compiler

    if not _links_only_supported():
        return compiler.Compiler

    class HelperLibrary(codegen.JITCodeLibrary):
        """A helper's code: kept as LLVM IR for the kernels that link it."""

        def _optimize_final_module(self):
            pass  # each function was optimised alone; a kernel optimises the whole of what it links

        def _finalize_final_module(self):
            # Not handed to the JIT engine, so never turned into machine code.
            self._finalize_dynamic_globals()
            self._verify_declare_only_symbols()
            self._finalized = True

        @property
        def codegen(self):
            return _WithoutEnvironment(self._codegen)

    class HelperCompiler(compiler.Compiler):
        def compile_extra(self, func):
            self.state.library = HelperLibrary(self.state.targetctx.codegen(), func.__qualname__)
            return super().compile_extra(func)

    return HelperCompiler


class _WithoutEnvironment:
    """The code generator, except that a helper's environment (the slot
    through which compiled code reaches Python objects) is not set: it is
    not in the engine, and helpers use none, as in a kernel loaded from the
    disk cache, where only the kernel's own is set."""

    def __init__(self, codegen):
        self._codegen = codegen

    def set_env(self, env_name, env):
        pass

    def __getattr__(self, name):
        return getattr(self._codegen, name)

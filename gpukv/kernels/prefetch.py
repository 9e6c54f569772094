"""Cache prefetch hints: ``llvm.prefetch`` on ``cpu``, nothing on ``cuda``.

The walk of a request is a chain of dependent lookups in tables far larger
than the caches. Its keys, though, follow from the block hashes alone, so the
walk can ask for the next blocks' bucket heads and rows before it needs them,
turning a chain of memory misses into overlapping ones. On the GPU, other
threads hide that latency instead, so the hint compiles to nothing there.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

from .link import helper


@functools.lru_cache(maxsize=None)
def _cpu_intrinsics() -> SimpleNamespace:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    def emit(context, builder, aryty, ary_value, indices):
        ary = context.make_array(aryty)(context, builder, ary_value)
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, indices, wraparound=False)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        # read, keep in all cache levels, data cache
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])

    @intrinsic
    def prefetch1(typingctx, arr, i):
        def codegen(context, builder, sig, args):
            idx = context.cast(builder, args[1], sig.args[1], types.intp)
            emit(context, builder, sig.args[0], args[0], [idx])
            return context.get_dummy_value()

        return types.void(arr, i), codegen

    @intrinsic
    def prefetch2(typingctx, arr, i, j):
        def codegen(context, builder, sig, args):
            idx = [context.cast(builder, args[k + 1], sig.args[k + 1], types.intp) for k in range(2)]
            emit(context, builder, sig.args[0], args[0], idx)
            return context.get_dummy_value()

        return types.void(arr, i, j), codegen

    return SimpleNamespace(prefetch1=prefetch1, prefetch2=prefetch2)


@helper(cpu=lambda: _cpu_intrinsics().prefetch1)
def prefetch1(arr, i):
    """Ask for the cache line of ``arr[i]``; on ``cuda`` nothing."""


@helper(cpu=lambda: _cpu_intrinsics().prefetch2)
def prefetch2(arr, i, j):
    """Ask for the cache line of ``arr[i, j]``; on ``cuda`` nothing."""

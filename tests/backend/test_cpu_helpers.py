"""Kernel helpers on ``cpu`` (``core/cpu_helpers.py``): each compiled once for
widened argument types, inlined into its kernel when marked so, and refused
when called from Python."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit, types

from gpukv.core.backend import device_jit


def _helpers(inline: bool):
    """A helper calling a helper, both fresh (a dispatcher keeps what it compiled)."""
    jit = device_jit("cpu", inline=inline)

    def scaled(a, k):
        return a[0] * k

    scaled = jit(scaled)

    def shifted(a, k):
        return scaled(a, k) + k

    return scaled, jit(shifted)


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "call"])
def test_constants_and_narrow_signed_integers_share_one_compile(inline):
    scaled, shifted = _helpers(inline)

    @njit
    def kernel(a, k32, k64):
        return shifted(a, 1) + shifted(a, 2) + shifted(a, k32) + shifted(a, k64) + shifted(a, True)

    a = np.array([10], dtype=np.int64)
    got = kernel(a, np.int32(3), np.int64(4))
    assert got == sum(10 * k + k for k in (1, 2, 3, 4, 1))
    for h in (shifted, scaled):
        assert len(h.signatures) == 2, h.signatures  # int64 for every integer, bool for True
        assert {s[1] for s in h.signatures} == {types.int64, types.boolean}


def test_unsigned_integers_keep_their_width_and_wrap_around():
    add = device_jit("cpu")(lambda x, y: x + y)

    @njit
    def kernel(x):
        return np.uint32(add(x, np.uint32(1)) & np.uint32(0xFFFFFFFF))

    assert kernel(np.uint32(0xFFFFFFFF)) == 0
    assert add.signatures == [(types.uint32, types.uint32)]


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "call"])
def test_a_helper_called_from_python_is_refused_with_its_name(inline):
    _, shifted = _helpers(inline)
    with pytest.raises(TypeError, match="shifted is a kernel helper"):
        shifted(np.zeros(1, dtype=np.int64), 1)


def test_an_inline_helper_is_marked_for_llvm_to_inline_and_a_call_is_not():
    scaled, shifted = _helpers(inline=True)
    _, called = _helpers(inline=False)

    @njit
    def kernel(a):
        return shifted(a, 3) + called(a, 1)

    assert kernel(np.array([2], dtype=np.int64)) == (2 * 3 + 3) + (2 * 1 + 1)
    for h, inlined in ((scaled, True), (shifted, True), (called, False)):
        cres = h.overloads[h.signatures[0]]
        f = cres.library.get_function(cres.fndesc.llvm_func_name)
        assert any(b"alwaysinline" in a.split() for a in f.attributes) == inlined

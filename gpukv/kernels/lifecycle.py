"""The stale range of an attention life cycle, in kernels (semantics.md §1.5).

At history ``h`` a sliding-window life cycle does not read its blocks between
the sinks and the window: ``[start, end)`` with ``start = min(ceil(h/T),
sink blocks)`` and ``end = max(start, (h + 1 - W) // T)``. The ``+ 1`` is
deliberate: attention runs for at least the token at position ``h``, so the
live window is ``[h + 1 - W, h]``. Full attention has an empty range. The
host-side twin is ``config.LifeCycle.stale_range``.
"""

from __future__ import annotations

from types import SimpleNamespace

from ..core.config import KIND_SWA


def build_lifecycle(jit) -> SimpleNamespace:
    @jit
    def stale_start(S, lc, h):
        T = S.tokens.shape[1]
        return min((h + T - 1) // T, S.lc_sinks[lc])

    @jit
    def stale_end(S, lc, h):
        """End of the stale range; equal to ``stale_start`` when nothing is stale."""
        T = S.tokens.shape[1]
        s = stale_start(S, lc, h)
        if S.lc_kind[lc] != KIND_SWA:
            return s
        first_live = h + 1 - S.lc_window[lc]
        return max(s, first_live // T) if first_live > 0 else s

    @jit
    def is_stale(S, lc, h, o):
        return stale_start(S, lc, h) <= o < stale_end(S, lc, h)

    return SimpleNamespace(stale_start=stale_start, stale_end=stale_end, is_stale=is_stale)

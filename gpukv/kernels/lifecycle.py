"""The stale range of a life cycle, in kernels (docs/semantics.md §1.5).

At history ``h`` a windowed life cycle does not read its blocks between the
sinks and the window: ``[start, end)`` with ``start = min(ceil(h/T), sink
blocks)`` and ``end = max(start, (h + 1 - W) // T)``. The ``+ 1`` is
deliberate: attention runs for at least the token at position ``h``, so the
live window is ``[h + 1 - W, h]``. Other kinds have an empty range. The
host-side twin is ``config.LifeCycle.stale_range``.

The per-kind predicates of ``core/kinds.py`` are compiled for kernels here.
"""

from __future__ import annotations

from ..core.kinds import death_removes_subtree, has_window, is_checkpoint, planned_drop_start
from .link import helper

for _rule in (is_checkpoint, has_window, death_removes_subtree, planned_drop_start):
    helper(_rule)


@helper
def stale_start(S, lc, h):
    T = S.tokens.shape[1]
    return min((h + T - 1) // T, S.lc_sinks[lc])


@helper
def stale_end(S, lc, h):
    """End of the stale range; equal to ``stale_start`` when nothing is stale."""
    T = S.tokens.shape[1]
    s = stale_start(S, lc, h)
    if not has_window(S.lc_kind[lc]):
        return s
    first_live = h + 1 - S.lc_window[lc]
    return max(s, first_live // T) if first_live > 0 else s


@helper
def is_stale(S, lc, h, o):
    return stale_start(S, lc, h) <= o < stale_end(S, lc, h)


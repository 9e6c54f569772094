"""Closing a sequence (docs/semantics.md §2.8).

Committing stops (a pending partial tail is committed), scratch slots go back,
and every page is released, last block first and descending life cycle, so
leaves are evicted before their ancestors.
"""

from __future__ import annotations

from ..core.layout import (
    CLOSED,
    NULL,
    Q_EVICT_FIRST,
    Q_NUM_BLOCKS,
    Q_SSM_KIND,
    Q_SSM_PAGE,
    Q_STATUS,
)
from .link import helper
from .seq_commit import stop_committing
from .seq_hold import release
from .seq_resize import drop_block, release_scratch


@helper(inline=False)
def close(S, Q, evict_first, out):
    """Released pages go to the head of their LRU with ``evict_first``."""
    Q.scalars[Q_EVICT_FIRST] = evict_first
    stop_committing(S, Q, out)
    release_scratch(S, Q)
    o = Q.scalars[Q_NUM_BLOCKS]
    while o > 0:
        o -= 1
        drop_block(S, Q, o)
    p = Q.scalars[Q_SSM_PAGE]
    if p != NULL:
        kind = Q.scalars[Q_SSM_KIND]
        Q.scalars[Q_SSM_PAGE] = NULL
        Q.scalars[Q_SSM_KIND] = 0
        release(S, Q, p, kind)
    Q.scalars[Q_NUM_BLOCKS] = 0
    Q.scalars[Q_STATUS] = CLOSED
    Q.scalars[Q_EVICT_FIRST] = 0

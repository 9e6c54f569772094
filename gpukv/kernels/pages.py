"""Pages, their slots and their storage (docs/semantics.md §1.4, §2.1).

A page is a row of ``pages`` (what slots and sequences refer to) plus a
storage slot in one of the fixed pools, one pool per (life cycle, cache
level). Row ``slot_row(block, lc, L)`` of ``slots`` links a block to its page
of a life cycle, with whether the page covers the whole block copied in for
matching. Linking and
unlinking go through ``link_page`` and ``unlink_page`` only; page data copies
are recorded here and carried out by the host after the launch, in order.
"""

from __future__ import annotations

import numpy as np

from ..core.layout import (
    CNT_ERROR,
    CNT_NUM_COPIES,
    CNT_UNLINKS,
    CREC_DST_INDEX,
    CREC_ROUTE,
    CREC_SRC_INDEX,
    ERR_COPIES_FULL,
    NULL,
    FREE_ROW_NEXT,
    PAGE_BLOCK,
    PAGE_COMMITTED,
    PAGE_FREE,
    PAGE_HOLDS,
    PAGE_INFO,
    PAGE_LRU_TICK,
    PAGE_POOL_INDEX,
    PAGE_SERIAL,
    SLOT_WORD,
    as_int32,
    copy_route,
    holds_holders,
    holds_locks,
    info_coverage,
    info_level,
    info_priority,
    info_state,
    page_info,
    slot_page,
    slot_row,
    slot_whole,
    slot_word,
    with_coverage,
    with_level,
    with_state,
)
from .link import helper
from .lru import lru_unlink, page_life_cycle, pool_of

# core/layout.py's slot arithmetic, slot words, hold counts and copy routes, compiled for kernels too.
for _f in (slot_row, slot_word, slot_page, slot_whole, holds_holders, holds_locks, copy_route):
    helper(_f)
del _f


@helper
def page_state(S, p):
    return info_state(S.pages[p, PAGE_INFO])


@helper
def page_level(S, p):
    return info_level(S.pages[p, PAGE_INFO])


@helper
def page_priority(S, p):
    return info_priority(S.pages[p, PAGE_INFO])


@helper
def set_page_state(S, p, state):
    S.pages[p, PAGE_INFO] = with_state(S.pages[p, PAGE_INFO], state)


@helper
def set_page_level(S, p, level):
    S.pages[p, PAGE_INFO] = with_level(S.pages[p, PAGE_INFO], level)


@helper
def page_holders(S, p):
    return holds_holders(S.pages[p, PAGE_HOLDS])


@helper
def page_locks(S, p):
    return holds_locks(S.pages[p, PAGE_HOLDS])


@helper
def page_coverage(S, p):
    return info_coverage(S.pages[p, PAGE_INFO])


@helper
def set_page_coverage(S, p, cov):
    S.pages[p, PAGE_INFO] = with_coverage(S.pages[p, PAGE_INFO], cov)


@helper
def page_of(S, r, lc):
    return slot_page(S.slots[slot_row(r, lc, S.lc_kind.shape[0]), SLOT_WORD])


@helper
def coverage(S, r, lc):
    """``cov(b, lc)``: the coverage of the slot's page, 0 when empty. A
    linked page's coverage never changes, so the slot keeps only whether it
    is all T tokens: the common case of a match's pruning, no page load."""
    w = S.slots[slot_row(r, lc, S.lc_kind.shape[0]), SLOT_WORD]
    if slot_whole(w) != 0:
        return S.tokens.shape[1]
    p = slot_page(w)
    return 0 if p == NULL else page_coverage(S, p)


@helper
def set_slot(S, r, lc, page):
    whole = 1 if page != NULL and page_coverage(S, page) == S.tokens.shape[1] else 0
    S.slots[slot_row(r, lc, S.lc_kind.shape[0]), SLOT_WORD] = slot_word(page, whole)


@helper
def last_level(S, lc):
    """The coldest cache level the life cycle has slots at."""
    return 1 if S.pool_size[pool_of(lc, 1)] > 0 else 0


@helper
def pop_storage(S, lc, level):
    pool = pool_of(lc, level)
    top = S.pool_top[pool] - 1
    S.pool_top[pool] = top
    return S.page_free[S.pool_start[pool] + top]


@helper
def push_storage(S, lc, level, index):
    pool = pool_of(lc, level)
    top = S.pool_top[pool]
    S.page_free[S.pool_start[pool] + top] = index
    S.pool_top[pool] = top + 1


@helper(inline=False)  # a call: one copy for every caller compiles faster
def alloc_page(S, lc, level, priority):
    """A fresh page with a storage slot at ``level``; NULL when the pool has
    no free slot (callers make room first, see ``make_room``)."""
    if S.pool_top[pool_of(lc, level)] == 0:
        return NULL
    S.row_top[lc] -= 1
    p = S.row_head[lc]
    S.row_head[lc] = S.pages[p, FREE_ROW_NEXT]
    S.pages[p, FREE_ROW_NEXT] = NULL
    S.pages[p, PAGE_INFO] = page_info(PAGE_COMMITTED, level, priority)
    S.pages[p, PAGE_POOL_INDEX] = pop_storage(S, lc, level)
    S.pages[p, PAGE_BLOCK] = NULL
    S.pages[p, PAGE_HOLDS] = 0
    S.pages[p, PAGE_LRU_TICK] = NULL
    S.pages[p, PAGE_SERIAL] = as_int32(np.int64(S.pages[p, PAGE_SERIAL]) + 1)  # a new page in this row
    return p


@helper(inline=False)  # a call: one copy for every caller compiles faster
def free_page(S, p):
    lc = page_life_cycle(S, p)
    lru_unlink(S, p)  # a free row is never an eviction candidate
    push_storage(S, lc, page_level(S, p), S.pages[p, PAGE_POOL_INDEX])
    S.pages[p, FREE_ROW_NEXT] = S.row_head[lc]  # unlinked above: the link is free
    S.row_head[lc] = p
    S.row_top[lc] += 1
    S.pages[p, PAGE_INFO] = page_info(PAGE_FREE, 0, page_priority(S, p))
    S.pages[p, PAGE_BLOCK] = NULL
    S.pages[p, PAGE_POOL_INDEX] = NULL


@helper
def record_copy(S, lc, src_level, src_index, dst_level, dst_index):
    """Page data the host copies after the launch, in recording order."""
    k = S.counters[CNT_NUM_COPIES]
    if k >= S.copies.shape[0]:
        S.counters[CNT_ERROR] = ERR_COPIES_FULL
        return
    S.copies[k, CREC_ROUTE] = copy_route(lc, src_level, dst_level)
    S.copies[k, CREC_SRC_INDEX] = src_index
    S.copies[k, CREC_DST_INDEX] = dst_index
    S.counters[CNT_NUM_COPIES] = k + 1


@helper
def copy_page_data(S, src, dst):
    record_copy(S, page_life_cycle(S, src), page_level(S, src), S.pages[src, PAGE_POOL_INDEX],
                page_level(S, dst), S.pages[dst, PAGE_POOL_INDEX])


@helper
def is_droppable(S, p):
    """Nobody holds the page: only the eviction controller keeps it alive."""
    return S.pages[p, PAGE_HOLDS] == 0


@helper
def can_replace_page(S, r, lc, cov):
    """Empty, or the incumbent is strictly narrower (ties keep the incumbent)."""
    return coverage(S, r, lc) < cov


@helper
def unlink_page(S, r, lc, expected):
    """Sever a block-page link: the single place that does (§2.1).

    With ``expected != NULL`` nothing happens unless the slot still holds
    that page (it may have been replaced by a wider one meanwhile)."""
    p = page_of(S, r, lc)
    if p == NULL or (expected != NULL and p != expected):
        return NULL
    S.pages[p, PAGE_BLOCK] = NULL
    set_slot(S, r, lc, NULL)
    S.counters[CNT_UNLINKS] += 1  # a match made before may name this page (Launcher.removals)
    return p


@helper
def link_page(S, r, lc, p):
    S.pages[p, PAGE_BLOCK] = r
    set_slot(S, r, lc, p)


@helper(inline=False)  # a call: inlined at every slot change, it made the sequence kernels slow to compile
def replace_page(S, r, lc, p):
    """Put ``p`` in the slot; the caller checked ``can_replace_page``.

    NOTE the order: the old page is unlinked *before* it leaves the
    eviction controller. Leaving may kill it, and a page that dies while
    still linked runs the tree cleanup on this very block (for full
    attention: removing the block's whole subtree)."""
    old = unlink_page(S, r, lc, NULL)
    if old != NULL and is_droppable(S, old):
        free_page(S, old)  # unscheduled and unowned: it dies, already unlinked
    link_page(S, r, lc, p)

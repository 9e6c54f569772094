"""How a sequence holds pages (docs/semantics.md §2.8).

A sequence refers to each of its pages by a hold or a lock (a lock keeps the
page on the GPU and out of eviction). Releasing the last reference to an
uncommitted page frees it; a committed one goes back to the eviction
controller, or dies if its block is gone. Sequences also keep a reference
count on the tree blocks they are committed as, so an orphan's row lives on.
"""

from __future__ import annotations

from ..core.layout import (
    BLK_REFS,
    CNT_ERROR,
    ERR_NO_PAGE,
    HOLD,
    LOCK,
    NULL,
    PAGE_BLOCK,
    PAGE_COMMITTED,
    ONE_HOLDER,
    ONE_LOCK,
    PAGE_HOLDS,
    PAGE_UNCOMMITTED,
    Q_EVICT_FIRST,
    Q_NUM_BLOCKS,
    Q_SSM_KIND,
    Q_SSM_PAGE,
)
from .link import helper
from .blocks import maybe_free_orphan, page_death
from .evict import lru_update, make_room, move_page, schedule, schedule_first
from .index import is_attached
from .pages import (
    alloc_page, free_page, page_holders, page_level, page_life_cycle, page_locks, page_state, set_page_coverage, set_page_state,
)


@helper
def hold(S, p, kind):
    S.pages[p, PAGE_HOLDS] += ONE_HOLDER + (ONE_LOCK if kind == LOCK else 0)
    lru_update(S, p)  # locked: no candidate; first held: among the held ones, same tick


@helper(inline=False)
def release(S, Q, p, kind):
    """A sequence drops its hold or lock on ``p``. An unowned uncommitted page
    dies at once; an unowned committed page stays cached (evictable) unless
    it was unlinked or its block is an orphan, in which case it dies."""
    S.pages[p, PAGE_HOLDS] -= ONE_HOLDER + (ONE_LOCK if kind == LOCK else 0)
    if page_holders(S, p) > 0:
        if kind == LOCK and page_locks(S, p) == 0:
            schedule(S, p)  # held, unlocked (committed or not): evictable when a colder level exists
        return  # otherwise still held (or still locked): its candidacy is unchanged
    if page_state(S, p) == PAGE_UNCOMMITTED:
        free_page(S, p)
        return
    if Q.scalars[Q_EVICT_FIRST] == 1:
        schedule_first(S, p)
    else:
        schedule(S, p)
    b = S.pages[p, PAGE_BLOCK]
    if b == NULL or not is_attached(S, b):
        page_death(S, p)


@helper
def set_entry(Q, o, lc, p, kind):
    Q.pages[o, lc] = p
    Q.kinds[o, lc] = kind if p != NULL else 0


@helper
def drop_entry(S, Q, o, lc):
    p = Q.pages[o, lc]
    if p != NULL:
        kind = Q.kinds[o, lc]
        set_entry(Q, o, lc, NULL, 0)
        release(S, Q, p, kind)


@helper
def ref_block(S, r):
    S.blocks[r, BLK_REFS] += 1


@helper
def unref_block(S, r):
    S.blocks[r, BLK_REFS] -= 1
    maybe_free_orphan(S, r)


@helper
def set_tree(S, Q, o, r):
    old = Q.tree[o]
    Q.tree[o] = r
    if r != NULL:
        ref_block(S, r)
    if old != NULL:
        unref_block(S, old)


@helper
def commit_page(S, p, cov):
    """An uncommitted page becomes a committed page (same slot, same data)."""
    set_page_state(S, p, PAGE_COMMITTED)
    set_page_coverage(S, p, cov)
    S.pages[p, PAGE_BLOCK] = NULL


@helper
def new_page(S, lc, state, priority):
    """A GPU page, evicting to make room; NULL when even that fails (callers
    of all-or-nothing allocations checked ``can_have`` first)."""
    if not make_room(S, lc, 0, 1):
        return NULL
    p = alloc_page(S, lc, 0, priority)
    if p == NULL:
        return NULL
    set_page_state(S, p, state)
    return p


@helper(inline=False)  # a call: one copy for every caller compiles faster
def promised_page(S, lc, priority):
    """A page an all-or-nothing check promised; a miss is a bug, reported
    as a kernel error instead of a write through NULL."""
    p = new_page(S, lc, PAGE_UNCOMMITTED, priority)
    if p == NULL:
        S.counters[CNT_ERROR] = ERR_NO_PAGE
        return NULL
    hold(S, p, LOCK)
    return p


@helper
def to_gpu(S, p):
    """A page about to be locked comes back from the host tier."""
    if page_level(S, p) != 0 and make_room(S, page_life_cycle(S, p), 0, 1):
        move_page(S, p, 0)


@helper
def set_all_kinds(S, Q, kind):
    L = S.lc_kind.shape[0]
    for o in range(Q.scalars[Q_NUM_BLOCKS]):
        for lc in range(L):
            p = Q.pages[o, lc]
            if p != NULL and Q.kinds[o, lc] != kind:
                if kind == LOCK:
                    S.pages[p, PAGE_HOLDS] += ONE_LOCK
                    lru_update(S, p)  # locked: no candidate
                else:
                    S.pages[p, PAGE_HOLDS] -= ONE_LOCK
                Q.kinds[o, lc] = kind
                if kind == HOLD:
                    schedule(S, p)  # committed or not: a held page may migrate
    p = Q.scalars[Q_SSM_PAGE]
    if p != NULL and Q.scalars[Q_SSM_KIND] != kind:
        S.pages[p, PAGE_HOLDS] += ONE_LOCK if kind == LOCK else -ONE_LOCK
        Q.scalars[Q_SSM_KIND] = kind
        if kind == HOLD:
            schedule(S, p)
        else:
            lru_update(S, p)  # locked: no candidate

"""The eviction controller (docs/semantics.md §2.11).

One prioritized LRU per (life cycle, cache level): a page's place is
``(priority, lru_tick)``. Every ownership change of a page goes through
``schedule`` (the tail) or ``schedule_first`` (the head), and every change of
what makes a page a candidate (its state, holders, locks, level) is followed by
``lru_update``, which moves it into the list it now belongs in
(``kernels/lru.py``) or out of all of them. Candidates are therefore always
listed, in order, and nothing else is: the next victim is the best head of at
most two groups of lists, held pages apart from unheld ones because a held page
is a candidate only while the host tier has room for it. ``make_room`` evicts:
GPU victims migrate to the host tier when there is one, others die (``drop``).
"""

from __future__ import annotations

from ..core.layout import (
    CNT_DROPPED,
    CNT_EVICTED,
    CNT_EVICT_FIRST,
    CNT_MIGRATED,
    CNT_TICK,
    EV_UPDATED,
    LG_COUNT,
    LOG_LEVEL,
    LOG_OLD_LEVEL,
    LOG_PRIORITY,
    NULL,
    PAGE_BLOCK,
    PAGE_COMMITTED,
    PAGE_FREE,
    PAGE_LRU_TICK,
    PAGE_POOL_INDEX,
)
from .link import helper
from .blocks import page_death
from .index import is_attached
from .log import log
from .lru import list_of, lru_best, lru_group, lru_insert, lru_list, lru_unlink
from .pages import (
    can_replace_page,
    free_page,
    last_level,
    page_holders,
    page_level,
    page_life_cycle,
    page_locks,
    page_priority,
    page_state,
    pool_of,
    pop_storage,
    push_storage,
    record_copy,
    replace_page,
    set_page_coverage,
    set_page_level,
)


@helper
def evictable(S, p):
    """(DROPPABLE and committed) or (HELD and not at the last level, committed
    or not: a suspended sequence's uncommitted pages migrate too); a LOCKED
    page never is, nor a free row."""
    if page_state(S, p) == PAGE_FREE or page_locks(S, p) != 0:
        return False
    if page_holders(S, p) == 0:
        return page_state(S, p) == PAGE_COMMITTED  # an unheld uncommitted page is already dead
    return page_level(S, p) < last_level(S, page_life_cycle(S, p))


@helper
def candidate_list(S, p):
    """The list ``p`` belongs in, or NULL when it is no eviction candidate."""
    if not evictable(S, p):
        return NULL
    group = lru_group(pool_of(page_life_cycle(S, p), page_level(S, p)),
                      1 if page_holders(S, p) > 0 else 0)
    return lru_list(group, page_priority(S, p))


@helper
def lru_update(S, p):
    """After a change of what ``evictable`` depends on (the tick unchanged):
    ``p`` moves to the list it belongs in now, keeping its place in time."""
    want = candidate_list(S, p)
    if want != list_of(S, p):
        lru_unlink(S, p)
        if want != NULL:
            lru_insert(S, p, want)


@helper(inline=False)  # a call: with evictable inside, many inlined copies otherwise
def enter_lru(S, p, t):
    """``p`` takes its place ``t`` in its LRU (or leaves it, if no candidate)."""
    lru_unlink(S, p)
    S.pages[p, PAGE_LRU_TICK] = t
    want = candidate_list(S, p)
    if want != NULL:
        lru_insert(S, p, want)


@helper
def schedule(S, p):
    """``p`` joins the tail of its LRU (or leaves it, if no longer evictable)."""
    t = S.counters[CNT_TICK]
    S.counters[CNT_TICK] = t + 1
    enter_lru(S, p, t)


@helper
def schedule_first(S, p):
    """An evict-first push: ``p`` goes to the head of its LRU."""
    S.counters[CNT_EVICT_FIRST] += 1
    enter_lru(S, p, -1 - S.counters[CNT_EVICT_FIRST])  # below every tick, and never NULL


@helper
def evicts_before(S, p, q):
    """Eviction order: lower priority first, then least recently scheduled."""
    if q == NULL:
        return True
    a = page_priority(S, p)
    b = page_priority(S, q)
    return a < b or (a == b and S.pages[p, PAGE_LRU_TICK] < S.pages[q, PAGE_LRU_TICK])


@helper(inline=False)
def next_victim(S, lc, level):
    """The page to evict next from (lc, level), or NULL when none may go:
    the better of the unheld pages' best and, while the host tier has room
    for them, the held pages' best."""
    pool = pool_of(lc, level)
    best = lru_best(S, lru_group(pool, 0))
    if S.no_host_room[lc] == 0:
        held = lru_best(S, lru_group(pool, 1))
        if held != NULL and evicts_before(S, held, best):
            best = held
    return best


@helper(inline=False)
def move_page(S, p, level):
    """Migrate ``p`` to a free slot at ``level``: the same page row, the same
    block link, its data copied; an updated event when it is linked."""
    lc = page_life_cycle(S, p)
    old = page_level(S, p)
    index = S.pages[p, PAGE_POOL_INDEX]
    new_index = pop_storage(S, lc, level)
    record_copy(S, lc, old, index, level, new_index)
    push_storage(S, lc, old, index)
    lru_unlink(S, p)  # out of its list while its level says which (``lru.list_of``)
    set_page_level(S, p, level)
    S.pages[p, PAGE_POOL_INDEX] = new_index
    r = S.pages[p, PAGE_BLOCK]
    if r != NULL and is_attached(S, r):
        m = log(S, EV_UPDATED, r, lc)
        if m != NULL:
            S.log[m, LOG_OLD_LEVEL] = old
            S.log[m, LOG_LEVEL] = level
            S.log[m, LOG_PRIORITY] = page_priority(S, p)
    schedule(S, p)


@helper(inline=False)
def drop(S, p):
    """Evicted from its last level: the page dies and the tree cleans up."""
    S.counters[CNT_DROPPED] += 1
    page_death(S, p)


@helper(inline=False)
def room_on_host(S, lc):
    """One free host slot for ``lc``, dropping host pages if needed."""
    host = pool_of(lc, 1)
    while S.pool_top[host] == 0:
        v = next_victim(S, lc, 1)
        if v == NULL:
            return False
        drop(S, v)
    return True


@helper(inline=False)
def make_room(S, lc, level, need):
    """Free slots first, then evict, until ``level`` has ``need`` free slots
    for ``lc``. GPU victims migrate to the host tier when there is one
    (dropping droppable pages when it is full of held ones); host victims
    die. False when nothing more may be evicted."""
    pool = pool_of(lc, level)
    while S.pool_top[pool] < need:
        v = next_victim(S, lc, level)
        if v == NULL:
            return False
        if level == 0:
            S.counters[CNT_EVICTED] += 1
        if level < last_level(S, lc):
            if room_on_host(S, lc):
                if page_state(S, v) != PAGE_FREE:  # dropping host pages may have killed it
                    S.counters[CNT_MIGRATED] += 1
                    move_page(S, v, 1)
                continue
            if page_holders(S, v) > 0:
                S.no_host_room[lc] = 1  # no held page can migrate during this launch
                if level == 0:
                    S.counters[CNT_EVICTED] -= 1
                continue
        drop(S, v)
    return True


@helper(inline=False)
def can_have(S, lc, own_held, need):
    """Could ``lc`` have ``need`` free GPU slots now: free ones plus what
    eviction may free (droppable pages; held ones too while the host tier
    has room for them)? ``own_held`` of the held ones are about to be
    locked by the caller. Every all-or-nothing allocation asks first."""
    pool = pool_of(lc, 0)
    if S.pool_top[pool] >= need:
        return True  # the common case: no counting at all
    return available(S, lc, own_held) >= need


@helper(inline=False)
def available(S, lc, own_held):
    """Free GPU slots of ``lc`` plus what eviction may free (a lower bound),
    from the candidate counts the lists keep."""
    pool = pool_of(lc, 0)
    droppable = S.lru_groups[lru_group(pool, 0), LG_COUNT]
    held = S.lru_groups[lru_group(pool, 1), LG_COUNT]
    host_droppable = S.lru_groups[lru_group(pool_of(lc, 1), 0), LG_COUNT]
    free = S.pool_top[pool] + droppable
    if last_level(S, lc) == 0:
        return free
    return free + min(max(0, held - own_held), S.pool_top[pool_of(lc, 1)] + host_droppable)


@helper
def begin_launch(S):
    """Held pages may migrate again: the host tier's room is judged afresh."""
    for lc in range(S.no_host_room.shape[0]):
        S.no_host_room[lc] = 0


@helper(inline=False)
def install_page(S, r, lc, p, cov):
    """The fresh page ``p`` with coverage ``cov`` takes block ``r``'s slot and
    joins its LRU; True when installed. Callers checked the slot was narrower
    before making room; eviction may remove the block's pages but never widens
    them, so the check here only guards, freeing ``p`` when it fails."""
    set_page_coverage(S, p, cov)
    if not can_replace_page(S, r, lc, cov):
        free_page(S, p)
        return False
    replace_page(S, r, lc, p)
    schedule(S, p)
    return True

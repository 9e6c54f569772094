"""The eviction controller (docs/semantics.md §2.11).

One prioritized LRU per (life cycle, cache level), kept implicitly: a page's
place is ``(priority, lru_tick)``. Every ownership change of a page goes
through ``schedule`` (the tail) or ``schedule_first`` (the head). The host's
batched pass (``gpukv/evict.py``, with the candidate mask of ``evictable``)
lists the best candidates of each pool before a launch that may need room;
pages scheduled during the launch go to the late list; a full scan is the
fallback when neither can answer. ``make_room`` evicts: GPU victims migrate to
the host tier when there is one, others die (``drop``).
"""

from __future__ import annotations

import functools

from ..core.layout import (
    CNT_DROPPED,
    CNT_EVICTED,
    CNT_EVICT_FIRST,
    CNT_LATE_LEN,
    CNT_MIGRATED,
    CNT_TICK,
    EC_DROPPABLE,
    EC_HELD,
    EC_HOST_DROPPABLE,
    EV_UPDATED,
    LATE_PAGE,
    LATE_TICK,
    LOG_LEVEL,
    LOG_OLD_LEVEL,
    LOG_PRIORITY,
    NULL,
    PAGE_BLOCK,
    PAGE_COMMITTED,
    PAGE_COVERAGE,
    PAGE_FREE,
    PAGE_HOLDERS,
    PAGE_LEVEL,
    PAGE_LIFE_CYCLE,
    PAGE_LOCKS,
    PAGE_LRU_TICK,
    PAGE_POOL_INDEX,
    PAGE_PRIORITY,
    PAGE_STATE,
)
from ..core.backend import cpu_kernel, launch_stream
from .link import helper, link
from .blocks import page_death
from .index import is_attached
from .log import log
from .pages import (
    can_replace_page,
    free_page,
    last_level,
    pool_of,
    pop_storage,
    push_storage,
    record_copy,
    replace_page,
)


@helper
def evictable(S, p):
    """(DROPPABLE and committed) or (HELD and not at the last level, committed
    or not: a suspended sequence's uncommitted pages migrate too); a LOCKED
    page never is, nor a free row."""
    if S.pages[p, PAGE_STATE] == PAGE_FREE or S.pages[p, PAGE_LOCKS] != 0:
        return False
    if S.pages[p, PAGE_HOLDERS] == 0:
        return S.pages[p, PAGE_STATE] == PAGE_COMMITTED  # an unheld uncommitted page is already dead
    return S.pages[p, PAGE_LEVEL] < last_level(S, S.pages[p, PAGE_LIFE_CYCLE])


@helper(inline=False)  # a call: with evictable inside, a dozen inlined copies in the seq kernel
def enter_lru(S, p, t):
    """``p`` takes its place ``t`` in its LRU; an evictable page also goes on
    the launch's late list, which the batched pass before it could not see."""
    S.pages[p, PAGE_LRU_TICK] = t
    if evictable(S, p):
        n = S.counters[CNT_LATE_LEN]
        if n < S.late.shape[0]:
            S.late[n, LATE_PAGE] = p
            S.late[n, LATE_TICK] = t
        S.counters[CNT_LATE_LEN] = n + 1  # beyond the capacity it counts an overflow


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
def is_candidate(S, p, lc, level):
    if S.pages[p, PAGE_LIFE_CYCLE] != lc or S.pages[p, PAGE_LEVEL] != level or not evictable(S, p):
        return False
    return S.pages[p, PAGE_HOLDERS] == 0 or S.no_host_room[lc] == 0


@helper
def evicts_before(S, p, q):
    """Eviction order: lower priority first, then least recently scheduled."""
    if q == NULL:
        return True
    a = S.pages[p, PAGE_PRIORITY]
    b = S.pages[q, PAGE_PRIORITY]
    return a < b or (a == b and S.pages[p, PAGE_LRU_TICK] < S.pages[q, PAGE_LRU_TICK])


@helper(inline=False)
def next_victim(S, lc, level):
    """The page to evict next from (lc, level), or NULL when none may go."""
    pool = pool_of(lc, level)
    listed = NULL
    while S.victim_next[pool] < S.victim_count[pool]:
        i = S.victim_next[pool]
        v = S.victims[pool, i]
        if S.pages[v, PAGE_LRU_TICK] == S.victim_ticks[pool, i] and is_candidate(S, v, lc, level):
            listed = v
            break
        S.victim_next[pool] = i + 1  # evicted, rescheduled or taken since it was listed
    best = listed
    n = S.counters[CNT_LATE_LEN]
    for j in range(min(n, S.late.shape[0])):
        v = S.late[j, LATE_PAGE]
        if S.pages[v, PAGE_LRU_TICK] == S.late[j, LATE_TICK] and is_candidate(S, v, lc, level) and evicts_before(S, v, best):
            best = v
    unknown = S.victim_total[pool] < 0 or S.victim_total[pool] > S.victim_count[pool] or n > S.late.shape[0]
    if best == NULL and unknown:
        start = S.row_start[lc]
        end = start + S.pool_size[pool_of(lc, 0)] + S.pool_size[pool_of(lc, 1)]
        for v in range(start, end):
            if is_candidate(S, v, lc, level) and evicts_before(S, v, best):
                best = v
    if best != NULL and best == listed:
        S.victim_next[pool] += 1
    return best


@helper(inline=False)
def move_page(S, p, level):
    """Migrate ``p`` to a free slot at ``level``: the same page row, the same
    block link, its data copied; an updated event when it is linked."""
    lc = S.pages[p, PAGE_LIFE_CYCLE]
    old = S.pages[p, PAGE_LEVEL]
    index = S.pages[p, PAGE_POOL_INDEX]
    new_index = pop_storage(S, lc, level)
    record_copy(S, lc, old, index, level, new_index)
    push_storage(S, lc, old, index)
    S.pages[p, PAGE_LEVEL] = level
    S.pages[p, PAGE_POOL_INDEX] = new_index
    r = S.pages[p, PAGE_BLOCK]
    if r != NULL and is_attached(S, r):
        m = log(S, EV_UPDATED, r, lc)
        if m != NULL:
            S.log[m, LOG_OLD_LEVEL] = old
            S.log[m, LOG_LEVEL] = level
            S.log[m, LOG_PRIORITY] = S.pages[p, PAGE_PRIORITY]
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
                if S.pages[v, PAGE_STATE] != PAGE_FREE:  # dropping host pages may have killed it
                    S.counters[CNT_MIGRATED] += 1
                    move_page(S, v, 1)
                continue
            if S.pages[v, PAGE_HOLDERS] > 0:
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
    """Free GPU slots of ``lc`` plus what eviction may free (a lower bound).
    Counted by the batched pass when it ran before the launch (it does
    whenever free slots look short), else by a scan."""
    pool = pool_of(lc, 0)
    if S.victim_total[pool] >= 0:  # counted by the batched pass before the launch
        droppable = S.evict_counts[lc, EC_DROPPABLE]
        held = S.evict_counts[lc, EC_HELD]
        host_droppable = S.evict_counts[lc, EC_HOST_DROPPABLE]
    else:
        droppable = 0
        held = 0
        host_droppable = 0
        start = S.row_start[lc]
        for p in range(start, start + S.pool_size[pool] + S.pool_size[pool_of(lc, 1)]):
            if evictable(S, p):
                if S.pages[p, PAGE_LEVEL] == 1:
                    host_droppable += 1
                elif S.pages[p, PAGE_HOLDERS] == 0:
                    droppable += 1
                else:
                    held += 1
    free = S.pool_top[pool] + droppable
    if last_level(S, lc) == 0:
        return free
    return free + min(max(0, held - own_held), S.pool_top[pool_of(lc, 1)] + host_droppable)


@helper
def begin_launch(S):
    S.counters[CNT_LATE_LEN] = 0
    for lc in range(S.no_host_room.shape[0]):
        S.no_host_room[lc] = 0


@helper
def end_launch(S):
    """Victim lists are good for one launch only."""
    for pool in range(S.victim_count.shape[0]):
        S.victim_count[pool] = 0
        S.victim_next[pool] = 0
        S.victim_total[pool] = -1


@helper(inline=False)
def install_page(S, r, lc, p, cov):
    """The fresh page ``p`` with coverage ``cov`` takes block ``r``'s slot and
    joins its LRU; True when installed. Callers checked the slot was narrower
    before making room; eviction may remove the block's pages but never widens
    them, so the check here only guards, freeing ``p`` when it fails."""
    S.pages[p, PAGE_COVERAGE] = cov
    if not can_replace_page(S, r, lc, cov):
        free_page(S, p)
        return False
    replace_page(S, r, lc, p)
    schedule(S, p)
    return True

# -- the candidate mask of the host's batched pass ------------------------------------
@helper
def mark_evictable(S, start, i, mask):
    mask[i] = 1 if evictable(S, start + i) else 0


@functools.lru_cache(maxsize=None)
def build_evictable_kernel(target: str):
    """``run(S, start, n, mask)``: ``mask[i] = evictable(page start + i)`` for
    ``i < n`` (int8). The batched pass (``gpukv/evict.py``) orders these
    candidates; the kernels' own choice between them uses the same test."""
    k = link(target)
    if target == "cpu":
        return cpu_kernel(k.kernel(_mask_cpu))

    from numba import cuda

    kernel = cuda.jit(k.kernel(_mask_cuda, cuda=cuda))
    threads = 128

    def run(S, start, n, mask):
        if n:
            kernel[(n + threads - 1) // threads, threads, launch_stream()](S, start, n, mask)

    return run


def _mask_cpu(S, start, n, mask):
    for i in range(n):
        mark_evictable(S, start, i, mask)


def _mask_cuda(S, start, n, mask):
    i = cuda.grid(1)  # noqa: F821 (bound by Linked.kernel)
    if i < n:
        mark_evictable(S, start, i, mask)

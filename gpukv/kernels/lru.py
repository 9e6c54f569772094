"""The eviction controller's ordered lists (docs/semantics.md §2.11).

Eviction candidates sit in doubly linked lists (``dlist.py``) threaded through the page rows
(``PAGE_LRU_PREV`` / ``PAGE_LRU_NEXT``), one list per (life cycle, cache
level, held or not, priority), each kept sorted by ``lru_tick``, oldest at the
head. A page is in at most one list: its ``info`` word says whether it is
listed and whether among the held pages, and its life cycle, level and
priority say the rest (``list_of``).
Lists of one (life cycle, level, held) form a group that counts its members
and remembers a lower bound of its lowest non-empty priority, so the best
candidate of a group is found without looking at every priority and the
counts of what eviction could free are read, not counted.

Which list a page belongs in is the controller's business (``evict.py``);
this module only links, unlinks and orders, so freeing a page
(``pages.free_page``) can take it out without knowing the rules.
"""

from __future__ import annotations

from ..core.config import PRIORITY_MAX, PRIORITY_MIN
from ..core.layout import (
    LG_COUNT,
    LG_LOWEST,
    LRU_HEAD,
    LRU_TAIL,
    NULL,
    NUM_HELD,
    NUM_LEVELS,
    NUM_PRIORITIES,
    PAGE_INFO,
    PAGE_LRU_NEXT,
    PAGE_LRU_PREV,
    PAGE_LRU_TICK,
    as_int32,
    info_coverage,
    info_held,
    info_level,
    info_listed,
    info_priority,
    info_state,
    page_info,
    with_coverage,
    with_level,
    with_listing,
    with_state,
)
from .dlist import dlist_insert_after, dlist_remove
from .link import helper

# core/layout.py's page-info bits and 32-bit wrap, compiled for kernels too.
for _f in (as_int32, page_info, info_state, info_level, info_listed, info_held, info_priority, info_coverage, with_state,
           with_level, with_listing, with_coverage):
    helper(_f)
del _f


@helper
def page_life_cycle(S, p):
    """The life cycle of page row ``p``: each owns the run of rows that
    starts at its ``row_start`` (the rows never change hands, so no page
    record needs to say it)."""
    lc = S.row_start.shape[0] - 1
    while S.row_start[lc] > p:
        lc -= 1
    return lc


@helper
def pool_of(lc, level):
    return lc * NUM_LEVELS + level


@helper
def lru_group(pool, held):
    """The group of ``pool`` (= ``pool_of(lc, level)``) for held or unheld pages."""
    return pool * NUM_HELD + held


@helper
def lru_list(group, priority):
    return group * NUM_PRIORITIES + priority - PRIORITY_MIN


@helper
def list_of(S, p):
    """The list ``p`` is in, or NULL. A listed page's level and priority
    stay as they were when it was linked: ``move_page`` unlinks a page before
    it changes its level, and a priority never changes."""
    info = S.pages[p, PAGE_INFO]
    if info_listed(info) == 0:
        return NULL
    group = lru_group(pool_of(page_life_cycle(S, p), info_level(info)), info_held(info))
    return lru_list(group, info_priority(info))


@helper
def lru_unlink(S, p):
    """Take ``p`` out of its list, if it is in one."""
    lst = list_of(S, p)
    if lst == NULL:
        return
    dlist_remove(S.pages, PAGE_LRU_PREV, PAGE_LRU_NEXT, S.lru_lists, lst, LRU_HEAD, LRU_TAIL, p)
    S.pages[p, PAGE_INFO] = with_listing(S.pages[p, PAGE_INFO], 0, 0)
    S.lru_groups[lst // NUM_PRIORITIES, LG_COUNT] -= 1


@helper
def lru_link_after(S, p, lst, prv):
    """Link ``p`` into ``lst`` (the list of its life cycle, level and
    priority in one group) right after ``prv`` (NULL: at the head)."""
    dlist_insert_after(S.pages, PAGE_LRU_PREV, PAGE_LRU_NEXT, S.lru_lists, lst, LRU_HEAD, LRU_TAIL, p, prv)
    g = lst // NUM_PRIORITIES
    S.pages[p, PAGE_INFO] = with_listing(S.pages[p, PAGE_INFO], 1, g % NUM_HELD)
    S.lru_groups[g, LG_COUNT] += 1
    priority = lst - g * NUM_PRIORITIES + PRIORITY_MIN
    if priority < S.lru_groups[g, LG_LOWEST]:
        S.lru_groups[g, LG_LOWEST] = priority


@helper
def lru_insert(S, p, lst):
    """Link ``p`` (in no list) into ``lst`` at its tick's place.

    A page scheduled now has the newest tick and one pushed to the head the
    oldest, so the common cases stop at the first comparison. A page that
    becomes a candidate of another list keeping its tick (a cached page a
    new sequence holds) lands anywhere: the search runs from both ends at
    once, so it costs the distance to the nearer end."""
    t = S.pages[p, PAGE_LRU_TICK]
    back = S.lru_lists[lst, LRU_TAIL]  # every page after ``back`` is newer than p
    front = S.lru_lists[lst, LRU_HEAD]  # every page before ``front`` is older than p
    while back != NULL:
        if S.pages[back, PAGE_LRU_TICK] <= t:
            lru_link_after(S, p, lst, back)
            return
        if S.pages[front, PAGE_LRU_TICK] > t:
            lru_link_after(S, p, lst, S.pages[front, PAGE_LRU_PREV])
            return
        back = S.pages[back, PAGE_LRU_PREV]
        front = S.pages[front, PAGE_LRU_NEXT]
    lru_link_after(S, p, lst, NULL)  # older than every page: the head (or an empty list)


@helper
def lru_best(S, group):
    """The head of the group's lowest non-empty priority, or NULL; raises the
    group's lower bound past the empty priorities it looked at."""
    if S.lru_groups[group, LG_COUNT] == 0:
        return NULL
    priority = S.lru_groups[group, LG_LOWEST]
    while priority <= PRIORITY_MAX:
        head = S.lru_lists[lru_list(group, priority), LRU_HEAD]
        if head != NULL:
            S.lru_groups[group, LG_LOWEST] = priority
            return head
        priority += 1
    return NULL  # unreachable while the count is right

"""Capacity and history of a sequence (docs/semantics.md §1.5, §2.10).

Growing allocates, all or nothing, a page per new block and life cycle outside
its stale range and its scratch range (whose blocks share a few scratch
slots); blocks that become stale lose their lock; shrinking drops tail
blocks. Allocation (and eviction) comes first and the stale pages are released
last, as the reference does, so the LRU order matches it exactly.
"""

from __future__ import annotations

from ..core.kinds import has_window, is_checkpoint
from ..core.layout import (
    ALLOWED,
    HOLD,
    LOCK,
    NULL,
    ONE_LOCK,
    PAGE_HOLDS,
    POLICY_COMMIT_MIN_SNAPSHOT,
    POLICY_SCRATCH_REWIND,
    Q_CAPACITY,
    Q_COMMIT_STATE,
    Q_HISTORY,
    Q_NUM_BLOCKS,
    Q_RESULT,
    SCRATCH,
)
from .link import helper
from .evict import can_have, schedule
from .lifecycle import is_stale, stale_end, stale_start
from .seq_hold import drop_entry, promised_page, release, set_entry, set_tree


@helper
def scratch_range(S, lc, cap, h):
    """§1.5 scratch range: the stale range at ``max(0, cap - R)`` within the
    input blocks ``[ceil(h/T), ceil(cap/T))``; empty unless scratch reuse
    is on and ``lc`` is SWA."""
    T = S.tokens.shape[1]
    R = S.policy[POLICY_SCRATCH_REWIND]
    if R < 0 or not has_window(S.lc_kind[lc]):
        return 0, 0
    at = max(0, cap - R)
    lo = max(stale_start(S, lc, at), (h + T - 1) // T)
    hi = min(stale_end(S, lc, at), (cap + T - 1) // T)
    return lo, max(lo, hi)


@helper
def scratch_slots_needed(S, lc, blocks):
    """Scratch blocks share slots: enough for one window of blocks."""
    T = S.tokens.shape[1]
    return min(blocks, (S.lc_window[lc] - 1 + T - 1) // T) if blocks > 0 else 0


@helper(inline=False)
def unlock_stale(S, Q, new_h, release_now):
    """SWA blocks that become stale at ``new_h`` lose their lock: kept as a
    holder only while they may still be committed (uncommitted, commits
    allowed, not commit_min_snapshot); otherwise released (when
    ``release_now``) or, on the resize path, released by ``resize`` itself;
    returns how many it left pending for that."""
    L = S.lc_kind.shape[0]
    old_h = Q.scalars[Q_HISTORY]
    pending = 0
    if new_h == old_h:
        return pending
    for lc in range(L):
        if not has_window(S.lc_kind[lc]):
            continue
        lo = max(stale_end(S, lc, old_h), stale_start(S, lc, new_h))
        hi = min(Q.scalars[Q_NUM_BLOCKS], stale_end(S, lc, new_h))
        for o in range(lo, hi):
            p = Q.pages[o, lc]
            if p == NULL:
                continue
            keep = Q.tree[o] == NULL and Q.scalars[Q_COMMIT_STATE] == ALLOWED and S.policy[POLICY_COMMIT_MIN_SNAPSHOT] == 0
            if keep:
                if Q.kinds[o, lc] == LOCK:
                    S.pages[p, PAGE_HOLDS] -= ONE_LOCK
                    Q.kinds[o, lc] = HOLD
                    schedule(S, p)  # held, unlocked: it may migrate to a colder level
            elif release_now:
                drop_entry(S, Q, o, lc)
            else:
                Q.kinds[o, lc] = -Q.kinds[o, lc]  # pending: see release_pending
                pending += 1
    return pending


@helper(inline=False)
def release_pending(S, Q, nb):
    """Release the entries ``unlock_stale`` left pending, in reverse order."""
    L = S.lc_kind.shape[0]
    for k in range(L):
        lc = L - 1 - k
        o = nb
        while o > 0:
            o -= 1
            if Q.kinds[o, lc] < 0:
                p = Q.pages[o, lc]
                kind = -Q.kinds[o, lc]
                set_entry(Q, o, lc, NULL, 0)
                release(S, Q, p, kind)


@helper(inline=False)
def drop_block(S, Q, o):
    """Tear block ``o`` down: its tree reference first, then its pages in
    descending life cycle."""
    L = S.lc_kind.shape[0]
    set_tree(S, Q, o, NULL)
    for k in range(L):
        drop_entry(S, Q, o, L - 1 - k)


@helper(inline=False)
def release_scratch_of(S, Q, lc):
    for k in range(Q.scratch_count[lc]):
        release(S, Q, Q.scratch[lc, k], LOCK)
    Q.scratch_count[lc] = 0
    for o in range(Q.scalars[Q_NUM_BLOCKS]):  # former scratch blocks are just page-less now
        if Q.kinds[o, lc] == SCRATCH:
            Q.kinds[o, lc] = 0


@helper(inline=False)
def release_scratch(S, Q):
    """Scratch slots live for one step: suspend and close give them back."""
    for lc in range(S.lc_kind.shape[0]):
        release_scratch_of(S, Q, lc)


@helper(inline=False)
def release_passed_scratch(S, Q):
    """The step that computes the scratch blocks is over once the history
    covers all of them: their slots go back then (a commit raising the
    history, or a resize that does), not only at suspend or close."""
    T = S.tokens.shape[1]
    h = Q.scalars[Q_HISTORY]
    cap = Q.scalars[Q_CAPACITY]
    for lc in range(S.lc_kind.shape[0]):
        if Q.scratch_count[lc] == 0:
            continue
        passed = True
        for o in range(Q.scalars[Q_NUM_BLOCKS]):
            if Q.kinds[o, lc] == SCRATCH and min((o + 1) * T, cap) > h:
                passed = False
                break
        if passed:
            release_scratch_of(S, Q, lc)


@helper(inline=False)
def resize(S, Q, cap, h):
    """New blocks get a fresh page per non-SSM life cycle outside its stale
    range at the new history and outside its scratch range (whose blocks
    share scratch slots instead); shrinking drops tail blocks (a rewind).
    All or nothing: refused, with no change, when a pool is short."""
    T = S.tokens.shape[1]
    L = S.lc_kind.shape[0]
    old_nb = Q.scalars[Q_NUM_BLOCKS]
    new_nb = (cap + T - 1) // T
    for lc in range(L):
        Q.counts[lc] = 0
        if is_checkpoint(S.lc_kind[lc]):
            continue
        lo, hi = scratch_range(S, lc, cap, h)
        scratch = 0
        for o in range(old_nb, new_nb):
            if lo <= o < hi:
                scratch += 1
            elif not is_stale(S, lc, h, o):
                Q.counts[lc] += 1
        Q.counts[lc] += max(0, scratch_slots_needed(S, lc, scratch) - Q.scratch_count[lc])
        if Q.counts[lc] > 0 and not can_have(S, lc, 0, Q.counts[lc]):
            Q.scalars[Q_RESULT] = 0
            return
    # As the reference does: allocate (and evict) first; the pages that
    # become stale are released only when the resize is done, last first.
    for lc in range(L):
        if is_checkpoint(S.lc_kind[lc]):
            continue
        lo, hi = scratch_range(S, lc, cap, h)
        scratch = 0
        for o in range(old_nb, new_nb):
            Q.tree[o] = NULL
            set_entry(Q, o, lc, NULL, 0)
            if lo <= o < hi:
                Q.kinds[o, lc] = SCRATCH
                scratch += 1
            elif not is_stale(S, lc, h, o):
                p = promised_page(S, lc, Q.priority[o, lc])
                if p == NULL:
                    return
                set_entry(Q, o, lc, p, LOCK)
        while Q.scratch_count[lc] < scratch_slots_needed(S, lc, scratch):
            p = promised_page(S, lc, Q.priority[lo, lc])
            if p == NULL:
                return
            Q.scratch[lc, Q.scratch_count[lc]] = p
            Q.scratch_count[lc] += 1
    pending = unlock_stale(S, Q, h, False)
    o = old_nb
    while o > new_nb:
        o -= 1
        drop_block(S, Q, o)
    if pending:  # else a walk over every block for nothing (each decode commit raises the history)
        release_pending(S, Q, min(old_nb, new_nb))
    Q.scalars[Q_NUM_BLOCKS] = new_nb
    Q.scalars[Q_CAPACITY] = cap
    Q.scalars[Q_HISTORY] = h
    release_passed_scratch(S, Q)
    Q.scalars[Q_RESULT] = 1

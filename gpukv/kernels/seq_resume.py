"""Reuse setup, resume and suspend of a sequence (docs/semantics.md §2.6, §2.8).

A new sequence holds every page the matched endpoint needs. Its first resume
locks everything (bringing host pages back to the GPU), gives it private
copies of a reused partial tail and of the checkpoint kinds' state, and makes
the partial block uncommitted: a sequence never writes a shared page. An
admission is the first resume and the sizing of a new sequence in one step.
"""

from __future__ import annotations

from ..core.config import DEFAULT_PRIORITY
from ..core.kinds import is_checkpoint
from ..core.layout import (
    ACTIVE,
    HOLD,
    LOCK,
    NULL,
    Q_CAPACITY,
    Q_COMMITTED,
    Q_COMMITTED_BLOCKS,
    Q_HISTORY,
    Q_NEVER_RESUMED,
    Q_NUM_BLOCKS,
    Q_RESULT,
    Q_SSM_KIND,
    Q_SSM_PAGE,
    Q_STATUS,
    SUSPENDED,
)
from .link import helper
from .evict import can_have, evictable
from .lifecycle import is_stale
from .pages import copy_page_data, page_level, page_life_cycle, page_of
from .seq_hold import hold, promised_page, release, set_all_kinds, set_entry, set_tree, to_gpu
from .seq_resize import release_scratch, resize


@helper(inline=False)
def setup_reuse(S, Q, N, count):
    T = S.tokens.shape[1]
    L = S.lc_kind.shape[0]
    for o in range(count):
        set_tree(S, Q, o, Q.path[o])
    for lc in range(L):
        if is_checkpoint(S.lc_kind[lc]):
            continue
        for o in range(count):
            if is_stale(S, lc, N, o):
                continue
            p = page_of(S, Q.path[o], lc)  # pruning guarantees it exists and covers enough
            hold(S, p, HOLD)
            set_entry(Q, o, lc, p, HOLD)
    for lc in range(L):
        if is_checkpoint(S.lc_kind[lc]) and count > 0:
            p = page_of(S, Q.path[count - 1], lc)  # an exact checkpoint, by pruning
            hold(S, p, HOLD)
            Q.scalars[Q_SSM_PAGE] = p
            Q.scalars[Q_SSM_KIND] = HOLD
    Q.scalars[Q_NUM_BLOCKS] = count
    Q.scalars[Q_COMMITTED] = N
    Q.scalars[Q_COMMITTED_BLOCKS] = N // T
    Q.scalars[Q_HISTORY] = N
    Q.scalars[Q_CAPACITY] = N


@helper
def pages_off_gpu(S, Q, lc):
    """The sequence's pages of ``lc`` on the host tier (a resume locks them
    back onto the GPU), and its held GPU pages eviction could take now."""
    off = 0
    held = 0
    for o in range(Q.scalars[Q_NUM_BLOCKS]):
        p = Q.pages[o, lc]
        if p != NULL:
            if page_level(S, p) != 0:
                off += 1
            elif evictable(S, p):
                held += 1
    p = Q.scalars[Q_SSM_PAGE]
    if p != NULL and page_life_cycle(S, p) == lc:
        if page_level(S, p) != 0:
            off += 1
        elif evictable(S, p):
            held += 1
    return off, held


@helper(inline=False)
def resume(S, Q):
    """SUSPENDED -> ACTIVE. The first resume gives the sequence private copies
    of a reused partial tail (every non-SSM life cycle) and of the SSM
    checkpoint (a fresh SSM page when nothing was reused), and the partial
    block becomes uncommitted: the sequence never writes a shared page."""
    T = S.tokens.shape[1]
    L = S.lc_kind.shape[0]
    N = Q.scalars[Q_COMMITTED]
    first = Q.scalars[Q_NEVER_RESUMED] == 1
    partial = first and N % T != 0
    for lc in range(L):  # all or nothing: host pages come back, fresh pages are made
        off, held = pages_off_gpu(S, Q, lc)
        need = off + (1 if first and (is_checkpoint(S.lc_kind[lc]) or partial) else 0)
        if need > 0 and not can_have(S, lc, held, need):
            Q.scalars[Q_RESULT] = 0
            return
    Q.scalars[Q_STATUS] = ACTIVE
    set_all_kinds(S, Q, LOCK)
    for o in range(Q.scalars[Q_NUM_BLOCKS]):
        for lc in range(L):
            if Q.pages[o, lc] != NULL:
                to_gpu(S, Q.pages[o, lc])
    if Q.scalars[Q_SSM_PAGE] != NULL:
        to_gpu(S, Q.scalars[Q_SSM_PAGE])
    if first:
        last = (N - 1) // T
        for lc in range(L):
            if is_checkpoint(S.lc_kind[lc]):
                p = promised_page(S, lc, DEFAULT_PRIORITY)  # the live state has no ordinal
                if p == NULL:
                    return
                src = Q.scalars[Q_SSM_PAGE]
                Q.scalars[Q_SSM_PAGE] = p
                Q.scalars[Q_SSM_KIND] = LOCK
                if src != NULL:
                    copy_page_data(S, src, p)
                    release(S, Q, src, LOCK)
            elif partial:
                p = promised_page(S, lc, Q.priority[last, lc])
                if p == NULL:
                    return
                src = Q.pages[last, lc]  # a partial tail is never stale
                copy_page_data(S, src, p)
                Q.pages[last, lc] = p
                release(S, Q, src, LOCK)
        if partial:
            set_tree(S, Q, last, NULL)
        Q.scalars[Q_NEVER_RESUMED] = 0
    Q.scalars[Q_RESULT] = 1


@helper(inline=False)
def suspend(S, Q):
    """ACTIVE -> SUSPENDED: scratch slots go back, locks become holds."""
    Q.scalars[Q_STATUS] = SUSPENDED
    release_scratch(S, Q)
    set_all_kinds(S, Q, HOLD)


@helper(inline=False)
def setup_matched(S, Q, N, count):
    """``setup_reuse`` with the committed tokens taken from the matched blocks
    themselves (a match's prefix is theirs, a partial block's included), so
    no host copy of the request's tokens is needed."""
    T = S.tokens.shape[1]
    for o in range(count):
        r = Q.path[o]
        for j in range(min(T, N - o * T)):
            Q.tokens[o * T + j] = S.tokens[r, j]
    setup_reuse(S, Q, N, count)


@helper(inline=False)
def admit(S, Q, capacity):
    """A new sequence's first resume, then its resize to ``capacity`` with
    the reused tokens as history. ``Q_RESULT`` 0: the resume was refused
    (SUSPENDED), or the resize (ACTIVE at the reused length), or
    ``capacity`` is below zero (the host refused the resize)."""
    resume(S, Q)
    if Q.scalars[Q_RESULT] == 0:
        return
    if capacity < 0:
        Q.scalars[Q_RESULT] = 0
        return
    resize(S, Q, capacity, Q.scalars[Q_HISTORY])

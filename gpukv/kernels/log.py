"""The change log: what the host learns of a launch (docs/semantics.md §4).

Removals, life-cycle removals, creations, migrations and event announcements
are appended to ``log`` with the block's digest copied in, so a record
outlives its row. The host drains the log after every launch, for KV cache
events and for tests.
"""

from __future__ import annotations

from ..core.layout import (
    BLK_PARENT,
    CNT_ERROR,
    CNT_LOG_LEN,
    CNT_LOG_TOKENS_LEN,
    ERR_LOG_FULL,
    EV_PAGE_INFO,
    LOG_BLOCK,
    LOG_COVERS,
    LOG_DIGEST,
    LOG_KIND,
    LOG_LEVEL,
    LOG_LIFE_CYCLE,
    LOG_NUM_TOKENS,
    LOG_PARENT_DIGEST,
    LOG_PARENT_IS_ROOT,
    LOG_PRIORITY,
    LOG_TOKENS_AT,
    NULL,
    POLICY_BLOCK_DIGESTS,
    POLICY_LOG_RECORDS,
)
from .link import helper
from .index import is_root, num_tokens
from .pages import coverage, page_level, page_of, page_priority


@helper
def log(S, kind, r, lc):
    """Append a change-log record; returns its index, or NULL when full or
    when nobody reads the log (then no record is written at all)."""
    if S.policy[POLICY_LOG_RECORDS] == 0:
        return NULL
    n = S.counters[CNT_LOG_LEN]
    if n >= S.log.shape[0]:
        S.counters[CNT_ERROR] = ERR_LOG_FULL
        return NULL
    for c in range(S.log.shape[1]):
        S.log[n, c] = 0
    S.log[n, LOG_KIND] = kind
    S.log[n, LOG_LIFE_CYCLE] = lc
    S.log[n, LOG_BLOCK] = r
    if S.policy[POLICY_BLOCK_DIGESTS] != 0:  # else the record's digest stays 0: no events read it
        for w in range(4):
            S.log[n, LOG_DIGEST + w] = S.digests[r, w]
    S.counters[CNT_LOG_LEN] = n + 1
    return n


@helper(inline=False)
def announce(S, r, kind, lc):
    """An EV_STORED_BLOCK or EV_STORED_LIFE_CYCLE record for block ``r`` with
    its parent, its tokens, and one EV_PAGE_INFO record per life cycle
    whose slot holds a page. Which life cycles get announced is the event
    manager's call (it knows what was announced before)."""
    n = log(S, kind, r, lc)
    if n == NULL:
        return
    parent = S.blocks[r, BLK_PARENT]
    if parent != NULL and S.policy[POLICY_BLOCK_DIGESTS] != 0:
        for w in range(4):
            S.log[n, LOG_PARENT_DIGEST + w] = S.digests[parent, w]
    S.log[n, LOG_PARENT_IS_ROOT] = 1 if parent == NULL or is_root(S, parent) else 0
    nt = num_tokens(S, r)
    S.log[n, LOG_NUM_TOKENS] = nt
    k = S.counters[CNT_LOG_TOKENS_LEN]
    if k >= S.log_tokens.shape[0]:
        S.counters[CNT_ERROR] = ERR_LOG_FULL
        return
    for i in range(nt):
        S.log_tokens[k, i] = S.tokens[r, i]
    S.log[n, LOG_TOKENS_AT] = k
    S.counters[CNT_LOG_TOKENS_LEN] = k + 1
    for l2 in range(S.lc_kind.shape[0]):
        p = page_of(S, r, l2)
        if p == NULL:
            continue
        m = log(S, EV_PAGE_INFO, r, l2)
        if m != NULL:
            S.log[m, LOG_COVERS] = 1 if coverage(S, r, l2) >= nt else 0
            S.log[m, LOG_LEVEL] = page_level(S, p)
            S.log[m, LOG_PRIORITY] = page_priority(S, p)

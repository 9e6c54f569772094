"""The tree proper: blocks and their lifetime (docs/semantics.md §2.1, §2.2, §2.7).

Creating blocks (``add_or_get`` with its duplicate, useless-partial and
adoption rules; roots), detaching them, removing subtrees, the cleanup after a
page of a block dies (what it removes is the life-cycle kind's rule,
``core/kinds.py``), and clearing the tree. Rows come from the free list the
host keeps stocked, so nothing here grows a table; a row detached or freed is
retired until the launch is drained (``layout.RETIRED_*``), so its removal is
reported from the row itself and costs no change-log row. The order of steps is what
makes these correct ("insert before detaching the covered sibling", "unlink
before the old page leaves the eviction controller"), so they run serially.
"""

from __future__ import annotations

from ..core.kinds import death_removes_subtree
from ..core.layout import (
    BID_KEY,
    BID_WIDTH,
    BLK_FIRST_CHILD,
    BLK_FIRST_NEXT,
    BLK_HASH_NEXT,
    BLK_INFO,
    BLK_NEXT_SIBLING,
    BLK_PARENT,
    BLK_PREV_SIBLING,
    BLK_REFS,
    BLK_SERIAL,
    BLK_WIDTH,
    CNT_BLOCK_FREE_TOP,
    CNT_DETACHES,
    CNT_ERROR,
    CNT_HELD_DETACHES,
    CNT_LIVE_BLOCKS,
    CNT_LOG_LEN,
    CNT_RETIRED,
    CNT_SERIAL,
    ERR_NON_FULL_PARENT,
    ERR_OUT_OF_BLOCKS,
    EV_CREATED,
    EV_REMOVED_LIFE_CYCLE,
    FLAG_ATTACHED,
    FLAG_IN_USE,
    FLAG_MASK,
    FLAG_ROOT,
    NULL,
    OUT_BLOCK,
    OUT_IS_NEW,
    PAGE_BLOCK,
    POLICY_BLOCK_DIGESTS,
    RETIRED_FREED,
    RETIRED_REMOVED,
    RETIRED_REMOVED_FREED,
    RETIRED_ROOT_REMOVED,
    RETIRED_TAG,
    ROOT_SCOPE,
    as_int32,
    block_info,
)
from .link import helper
from .index import (
    created_before,
    find_child,
    find_root,
    index_insert,
    index_remove,
    is_attached,
    is_root,
    num_tokens,
    sibling_bucket_of,
    tokens_equal,
)
from .keys import combine, content_hash
from .log import log
from .pages import (
    can_replace_page, free_page, is_droppable, page_coverage, page_life_cycle, page_of, replace_page, set_slot, unlink_page,
)
from .sha256 import chain_digest


@helper
def alloc_block(S):
    top = S.counters[CNT_BLOCK_FREE_TOP]
    if top == 0:
        S.counters[CNT_ERROR] = ERR_OUT_OF_BLOCKS
        return NULL
    r = S.block_free[top - 1]
    S.counters[CNT_BLOCK_FREE_TOP] = top - 1
    S.counters[CNT_LIVE_BLOCKS] += 1
    for c in range(BLK_WIDTH):
        S.blocks[r, c] = NULL
    for c in range(BID_WIDTH):
        S.block_ids[r, c] = NULL
    if S.policy[POLICY_BLOCK_DIGESTS] != 0:
        for w in range(4):
            S.digests[r, w] = NULL
    S.blocks[r, BLK_INFO] = block_info(0, FLAG_IN_USE)
    S.blocks[r, BLK_REFS] = 0
    S.blocks[r, BLK_SERIAL] = as_int32(S.counters[CNT_SERIAL])
    S.counters[CNT_SERIAL] += 1
    L = S.lc_kind.shape[0]
    for lc in range(L):
        set_slot(S, r, lc, NULL)
    return r


@helper
def retire(S, r, kind):
    """Row ``r`` joins the launch's retired rows (``layout.RETIRED_*``): the
    host reports and frees it after the launch, so nothing reuses it (or its
    digest) before then."""
    n = S.counters[CNT_RETIRED]
    S.block_free[S.block_free.shape[0] - 1 - n] = r
    S.blocks[r, BLK_HASH_NEXT] = n  # out of the index by now: where its entry is, for a free later in the launch
    S.blocks[r, RETIRED_TAG] = S.counters[CNT_LOG_LEN] * 4 + kind
    S.counters[CNT_RETIRED] = n + 1


@helper
def free_block_row(S, r):
    """The row is free from the next launch on (the host pushes it)."""
    S.blocks[r, BLK_INFO] &= ~FLAG_MASK  # no flags: a free row
    S.counters[CNT_LIVE_BLOCKS] -= 1
    n = S.blocks[r, BLK_HASH_NEXT]
    i = S.block_free.shape[0] - 1 - n
    if 0 <= n < S.counters[CNT_RETIRED] and S.block_free[i] == r:
        # Detached earlier in this launch: its removal entry frees it too.
        S.blocks[r, RETIRED_TAG] += RETIRED_REMOVED_FREED - RETIRED_REMOVED
    else:
        retire(S, r, RETIRED_FREED)


@helper
def append_child(S, parent, r):
    """``r`` becomes ``parent``'s last child. The first child's
    ``prev_sibling`` names the last, so appending needs no tail field."""
    first = S.blocks[parent, BLK_FIRST_CHILD]
    S.blocks[r, BLK_NEXT_SIBLING] = NULL
    if first == NULL:
        S.blocks[parent, BLK_FIRST_CHILD] = r
        S.blocks[r, BLK_PREV_SIBLING] = r
        return
    last = S.blocks[first, BLK_PREV_SIBLING]
    S.blocks[last, BLK_NEXT_SIBLING] = r
    S.blocks[r, BLK_PREV_SIBLING] = last
    S.blocks[first, BLK_PREV_SIBLING] = r


@helper
def remove_child(S, parent, r):
    """Take ``r`` out of ``parent``'s children; its links become NULL."""
    first = S.blocks[parent, BLK_FIRST_CHILD]
    prv = S.blocks[r, BLK_PREV_SIBLING]  # the last child when r is the first
    nxt = S.blocks[r, BLK_NEXT_SIBLING]
    if r == first:
        S.blocks[parent, BLK_FIRST_CHILD] = nxt
    else:
        S.blocks[prv, BLK_NEXT_SIBLING] = nxt
    if nxt != NULL:
        S.blocks[nxt, BLK_PREV_SIBLING] = prv
    elif r != first:
        S.blocks[first, BLK_PREV_SIBLING] = prv  # r was the last
    S.blocks[r, BLK_PREV_SIBLING] = NULL
    S.blocks[r, BLK_NEXT_SIBLING] = NULL


@helper(inline=False)
def release_block_pages(S, r):
    """A block row is destroyed: unlink its pages; unowned ones die (§2.1).

    They are unlinked first, so their death runs no tree cleanup."""
    for lc in range(S.lc_kind.shape[0]):
        p = unlink_page(S, r, lc, NULL)
        if p != NULL and is_droppable(S, p):
            free_page(S, p)


@helper
def maybe_free_orphan(S, r):
    """An orphan's row lives while sequences refer to it."""
    if not is_attached(S, r) and S.blocks[r, BLK_REFS] == 0:
        release_block_pages(S, r)
        free_block_row(S, r)


@helper(inline=False)
def detach(S, r):
    """Take an attached block out of its parent; a root left childless goes too.

    The row is freed at once unless a sequence still refers to it; then it
    lives on as an orphan until that reference is released."""
    if not is_attached(S, r):
        return
    parent = S.blocks[r, BLK_PARENT]
    remove_child(S, parent, r)
    index_remove(S, r)
    S.blocks[r, BLK_PARENT] = NULL
    S.blocks[r, BLK_INFO] &= ~FLAG_ATTACHED
    S.counters[CNT_DETACHES] += 1
    if S.blocks[r, BLK_REFS] > 0:  # a cache's chain loses a block (CachePool.attached_at)
        S.counters[CNT_HELD_DETACHES] += 1
    retire(S, r, RETIRED_REMOVED)  # EV_REMOVED, in its place among the log's records
    if is_root(S, parent) and S.blocks[parent, BLK_FIRST_CHILD] == NULL:
        index_remove(S, parent)
        S.blocks[parent, BLK_INFO] &= ~FLAG_MASK
        S.counters[CNT_LIVE_BLOCKS] -= 1
        retire(S, parent, RETIRED_ROOT_REMOVED)
    maybe_free_orphan(S, r)


@helper(inline=False)
def remove_subtree(S, b):
    """Detach ``b`` and all its descendants, leaves first (post order)."""
    if not is_attached(S, b):
        return
    cur = b
    while True:
        child = S.blocks[cur, BLK_FIRST_CHILD]
        if child != NULL:
            cur = child
            continue
        parent = S.blocks[cur, BLK_PARENT]
        detach(S, cur)
        if cur == b:
            return
        cur = parent


@helper
def among_first_blocks(S, r, n):
    """Whether block ``r`` is one of the first ``n`` blocks of its chain (its
    ordinal is below ``n``): at most ``n`` steps up to its root. An orphan
    is in no chain."""
    cur = r
    for _ in range(n):
        cur = S.blocks[cur, BLK_PARENT]
        if cur == NULL:
            return False
        if is_root(S, cur):
            return True
    return False


@helper(inline=False)
def clear_stale_blocks_after_page_unlink(S, start, lc):
    """Tree cleanup after a page of ``start`` died (§2.7)."""
    if death_removes_subtree(S.lc_kind[lc], among_first_blocks(S, start, S.lc_sinks[lc])):
        # Nothing below can be reused any more (full attention, a sink block).
        remove_subtree(S, start)
    elif is_attached(S, start):
        log(S, EV_REMOVED_LIFE_CYCLE, start, lc)
    # Tail pruning: detach childless blocks whose slots are all empty.
    # (All slots, not just lc's: an in-flight hybrid sequence may still
    # use this block through another life cycle.)
    cur = start
    L = S.lc_kind.shape[0]
    while cur != NULL and is_attached(S, cur) and not is_root(S, cur):
        if S.blocks[cur, BLK_FIRST_CHILD] != NULL:
            return
        for l2 in range(L):
            if page_of(S, cur, l2) != NULL:
                return
        parent = S.blocks[cur, BLK_PARENT]
        detach(S, cur)
        cur = parent


@helper(inline=False)
def page_death(S, p):
    """A committed page lost its last owner: unlink it, clean up, free it."""
    r = S.pages[p, PAGE_BLOCK]
    lc = page_life_cycle(S, p)
    linked = r != NULL and unlink_page(S, r, lc, p) != NULL
    free_page(S, p)
    if linked:
        clear_stale_blocks_after_page_unlink(S, r, lc)


@helper(inline=False)
def clear_tree(S):
    """Remove every root's subtree, roots in creation order (idempotent;
    roots go with their last child)."""
    while True:
        r = NULL
        for c in range(S.blocks.shape[0]):  # the oldest remaining root
            if (S.blocks[c, BLK_INFO] & (FLAG_ROOT | FLAG_IN_USE)) == (FLAG_ROOT | FLAG_IN_USE):
                if r == NULL or created_before(S, c, r):
                    r = c
        if r == NULL:
            return
        while (S.blocks[r, BLK_INFO] & FLAG_IN_USE) != 0 and S.blocks[r, BLK_FIRST_CHILD] != NULL:
            remove_subtree(S, S.blocks[r, BLK_FIRST_CHILD])
        if (S.blocks[r, BLK_INFO] & FLAG_IN_USE) != 0:
            # a root that never got a child
            index_remove(S, r)
            free_block_row(S, r)


@helper(inline=False)
def get_or_create_root(S, scope_id, scope_key, scope_digest):
    r = find_root(S, scope_id, scope_key)
    if r != NULL:
        return r
    r = alloc_block(S)
    if r == NULL:
        return NULL
    S.block_ids[r, BID_KEY] = scope_key
    S.blocks[r, ROOT_SCOPE] = scope_id
    S.blocks[r, BLK_INFO] = block_info(0, FLAG_IN_USE | FLAG_ATTACHED | FLAG_ROOT)
    if S.policy[POLICY_BLOCK_DIGESTS] != 0:
        for w in range(4):
            S.digests[r, w] = scope_digest[w]
    index_insert(S, r)
    return r


@helper(inline=False)  # a call: one copy for every caller compiles faster
def adopt_pages_from(S, r, other):
    """Move ``other``'s pages into ``r`` where strictly wider (§2.1).

    The source slot is emptied directly, not through unlink: unlinking
    would null the back-pointer that ``replace_page`` is about to reset."""
    for lc in range(S.lc_kind.shape[0]):
        p = page_of(S, other, lc)
        if p != NULL and can_replace_page(S, r, lc, page_coverage(S, p)):
            set_slot(S, other, lc, NULL)
            replace_page(S, r, lc, p)


@helper(inline=False)
def add_or_get(S, parent, toks, start, n, out):
    """Create the child of ``parent`` holding ``toks[start:start+n]``, or get
    the block that already serves it. Writes ``out[OUT_BLOCK]`` and ``out[OUT_IS_NEW]``.

    Rules (§2.2): an exact duplicate is returned; a partial chunk that a
    sibling already covers is "useless" and that sibling (first in
    insertion order) is returned; otherwise a new block is inserted, and a
    shorter sibling it covers is adopted (its pages move, keeping their
    coverage) and then detached."""
    T = S.tokens.shape[1]
    out[OUT_BLOCK] = NULL
    out[OUT_IS_NEW] = 0
    if not is_root(S, parent) and num_tokens(S, parent) != T:
        S.counters[CNT_ERROR] = ERR_NON_FULL_PARENT
        return
    key = combine(S.block_ids[parent, BID_KEY], content_hash(toks, start, n))
    covering = NULL
    covered = NULL
    # A childless parent (most often a block this call just created: a
    # prefill's new blocks are a chain) has no child to return or to cover,
    # so neither index is searched.
    if S.blocks[parent, BLK_FIRST_CHILD] != NULL:
        r = find_child(S, parent, key, toks, start, n)
        if r != NULL:
            out[OUT_BLOCK] = r
            return
        # Only siblings starting with the chunk's first token can cover it or
        # be covered by it; the sibling index lists exactly those.
        c = S.sibling_buckets[sibling_bucket_of(S, parent, toks[start])]
        while c != NULL:
            if S.blocks[c, BLK_PARENT] == parent and S.tokens[c, 0] == toks[start]:
                m = num_tokens(S, c)
                if n < T and m >= n and tokens_equal(S, c, toks, start, n):
                    # the useless-partial rule: the first (in insertion order) covering sibling
                    if covering == NULL or created_before(S, c, covering):
                        covering = c
                elif m < n and tokens_equal(S, c, toks, start, m):
                    covered = c  # prefixes of one chunk are nested: at most one exists
            c = S.blocks[c, BLK_FIRST_NEXT]
        if covering != NULL:
            out[OUT_BLOCK] = covering
            return
    r = alloc_block(S)
    if r == NULL:
        return
    S.block_ids[r, BID_KEY] = key
    S.blocks[r, BLK_PARENT] = parent
    S.blocks[r, BLK_INFO] = block_info(n, FLAG_IN_USE | FLAG_ATTACHED)
    for i in range(n):
        S.tokens[r, i] = toks[start + i]
    for i in range(n, T):
        S.tokens[r, i] = 0
    if S.policy[POLICY_BLOCK_DIGESTS] != 0:  # off: there is no digest table
        chain_digest(S.digests[parent], S.tokens[r], n, S.mm_digests, S.digests[r], S.work)
    # NOTE insert before detaching the covered sibling: a root whose only
    # child is that sibling would otherwise be removed in between.
    append_child(S, parent, r)
    index_insert(S, r)
    log(S, EV_CREATED, r, NULL)
    if covered != NULL:
        adopt_pages_from(S, r, covered)
        detach(S, covered)
    out[OUT_BLOCK] = r
    out[OUT_IS_NEW] = 1

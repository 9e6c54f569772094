"""Block radix tree operations on the device tables (semantics.md §2.1, §2.2, §2.7).

Every function here is a plain per-item helper compiled for the kernel target
by ``build_tree(target)``. They take ``S``, the manager's ``DeviceTables``
named tuple, and mutate it in place. Tree mutation is inherently ordered (the
rules "unlink before evict", "insert before detaching", "adopt before replace"
are what make it correct), so it runs serially: one thread on ``cuda``, one
call on ``cpu``. Batched read-only work (matching) runs in parallel elsewhere.

Rows are allocated from free lists that the host keeps stocked before each
operation (``tables.ensure_free_blocks``), so a helper never needs to grow a
table.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np

from ..core.backend import bind_globals, cpu_kernel, device_jit
from ..core.config import DEFAULT_PRIORITY, KIND_FULL, KIND_SSM
from ..core.layout import (
    BLK_DIGEST,
    BLK_FIRST_CHILD,
    BLK_FLAGS,
    BLK_HASH_NEXT,
    BLK_KEY,
    BLK_LAST_CHILD,
    BLK_NEXT_SIBLING,
    BLK_NUM_CHILDREN,
    BLK_NUM_TOKENS,
    BLK_ORDINAL,
    BLK_PARENT,
    BLK_PREV_SIBLING,
    BLK_REFS,
    BLK_SCOPE,
    BLK_SERIAL,
    BLK_FIRST_NEXT,
    BLK_WIDTH,
    CNT_BLOCK_FREE_TOP,
    CNT_DETACHES,
    CNT_ERROR,
    CNT_LIVE_BLOCKS,
    CNT_LOG_LEN,
    CNT_SERIAL,
    CNT_NUM_COPIES,
    CNT_DROPPED,
    CNT_EVICT_FIRST,
    CNT_EVICTED,
    CNT_LATE_LEN,
    CNT_LOG_TOKENS_LEN,
    CNT_MIGRATED,
    CNT_TICK,
    COPY_DST_INDEX,
    COPY_DST_LEVEL,
    COPY_LIFE_CYCLE,
    COPY_SRC_INDEX,
    COPY_SRC_LEVEL,
    ERR_COPIES_FULL,
    ERR_LOG_FULL,
    ERR_NON_FULL_PARENT,
    ERR_OUT_OF_BLOCKS,
    EV_PAGE_INFO,
    EV_REMOVED,
    EV_REMOVED_LIFE_CYCLE,
    EV_STORED_BLOCK,
    EV_UPDATED,
    EV_ROOT_REMOVED,
    EV_CREATED,
    FLAG_ATTACHED,
    FLAG_IN_USE,
    FLAG_ROOT,
    LOG_BLOCK,
    LOG_COVERS,
    LOG_DIGEST,
    LOG_KIND,
    LOG_LEVEL,
    LOG_LIFE_CYCLE,
    LOG_NUM_TOKENS,
    LOG_OLD_LEVEL,
    LOG_PARENT_DIGEST,
    LOG_PARENT_IS_ROOT,
    LOG_PRIORITY,
    LOG_TOKENS_AT,
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
    PAGE_PLANNED_DROPS,
    PAGE_POOL_INDEX,
    PAGE_PRIORITY,
    PAGE_SERIAL,
    PAGE_STATE,
    SLOT_COVERAGE,
    SLOT_PAGE,
)
from .keys import build_keys
from .sha256 import build_sha256

NUM_LEVELS = 2  # cache levels: 0 = GPU, 1 = host


def build_tree(target: str) -> SimpleNamespace:
    return _build_tree(target)


@functools.lru_cache(maxsize=None)
def _build_tree(target: str) -> SimpleNamespace:
    jit = device_jit(target)
    call = device_jit(target, inline=False)  # large helpers: calls, not inlined copies
    keys = build_keys(jit)
    sha = build_sha256(jit)
    content_hash = keys.content_hash
    combine = keys.combine
    chain_digest = sha.chain_digest
    sibling_hash = keys.sibling_hash

    # -- rows and the child index -------------------------------------------
    @jit
    def is_attached(S, r):
        return (S.blocks[r, BLK_FLAGS] & FLAG_ATTACHED) != 0

    @jit
    def is_root(S, r):
        return (S.blocks[r, BLK_FLAGS] & FLAG_ROOT) != 0

    @jit
    def bucket_of(S, key):
        return key & (S.buckets.shape[0] - 1)

    @jit
    def sibling_bucket_of(S, parent, first_token):
        return np.int64(sibling_hash(parent, first_token) & np.uint64(S.sibling_buckets.shape[0] - 1))

    @jit
    def tokens_equal(S, r, toks, start, n):
        # Branch-free, over slices indexed from 0 (no wraparound check for
        # negative indices): the compiler vectorizes this. An early exit would
        # not pay for itself, since a hash hit almost always matches in full.
        row = S.tokens[r]
        q = toks[start:start + n]
        diff = np.int32(0)
        for i in range(n):
            diff |= row[i] ^ q[i]
        return diff == 0

    @jit
    def is_child(S, r, parent, key, toks, start, n):
        """Is row ``r`` (from ``key``'s bucket chain) the child of ``parent``
        holding exactly ``toks[start:start+n]``? The 64-bit key only selects
        candidates; parent, length and every token are compared too."""
        return (
            S.blocks[r, BLK_KEY] == key
            and S.blocks[r, BLK_PARENT] == parent
            and S.blocks[r, BLK_NUM_TOKENS] == n
            and tokens_equal(S, r, toks, start, n)
        )

    @jit
    def find_child(S, parent, key, toks, start, n):
        """The child of ``parent`` holding exactly ``toks[start:start+n]``, or NULL."""
        r = S.buckets[bucket_of(S, key)]
        while r != NULL:
            if is_child(S, r, parent, key, toks, start, n):
                return r
            r = S.blocks[r, BLK_HASH_NEXT]
        return NULL

    @jit
    def find_root(S, scope_id, scope_key):
        r = S.buckets[bucket_of(S, scope_key)]
        while r != NULL:
            if (S.blocks[r, BLK_FLAGS] & FLAG_ROOT) != 0 and S.blocks[r, BLK_SCOPE] == scope_id:
                return r
            r = S.blocks[r, BLK_HASH_NEXT]
        return NULL

    @jit
    def index_insert(S, r):
        """Enter ``r`` in the child index and, unless a root, in the sibling index."""
        b = bucket_of(S, S.blocks[r, BLK_KEY])
        S.blocks[r, BLK_HASH_NEXT] = S.buckets[b]
        S.buckets[b] = r
        if not is_root(S, r):
            f = sibling_bucket_of(S, S.blocks[r, BLK_PARENT], S.tokens[r, 0])
            S.blocks[r, BLK_FIRST_NEXT] = S.sibling_buckets[f]
            S.sibling_buckets[f] = r

    @jit
    def unchain(S, heads, h, r, next_col):
        """Remove ``r`` from the singly linked chain starting at ``heads[h]``."""
        prev = NULL
        cur = heads[h]
        while cur != NULL and cur != r:
            prev = cur
            cur = S.blocks[cur, next_col]
        if cur == NULL:
            return
        nxt = S.blocks[r, next_col]
        if prev == NULL:
            heads[h] = nxt
        else:
            S.blocks[prev, next_col] = nxt
        S.blocks[r, next_col] = NULL

    @jit
    def index_remove(S, r):
        """Take ``r`` out of both indexes (while its parent is still set)."""
        unchain(S, S.buckets, bucket_of(S, S.blocks[r, BLK_KEY]), r, BLK_HASH_NEXT)
        if not is_root(S, r):
            f = sibling_bucket_of(S, S.blocks[r, BLK_PARENT], S.tokens[r, 0])
            unchain(S, S.sibling_buckets, f, r, BLK_FIRST_NEXT)

    @jit
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
        S.blocks[r, BLK_NUM_CHILDREN] = 0
        S.blocks[r, BLK_NUM_TOKENS] = 0
        S.blocks[r, BLK_FLAGS] = FLAG_IN_USE
        S.blocks[r, BLK_REFS] = 0
        S.blocks[r, BLK_SERIAL] = S.counters[CNT_SERIAL]
        S.counters[CNT_SERIAL] += 1
        L = S.lc_kind.shape[0]
        for lc in range(L):
            S.slots[r * L + lc, SLOT_PAGE] = NULL
            S.slots[r * L + lc, SLOT_COVERAGE] = 0
        return r

    @jit
    def free_block_row(S, r):
        S.blocks[r, BLK_FLAGS] = 0
        top = S.counters[CNT_BLOCK_FREE_TOP]
        S.block_free[top] = r
        S.counters[CNT_BLOCK_FREE_TOP] = top + 1
        S.counters[CNT_LIVE_BLOCKS] -= 1

    @jit
    def log(S, kind, r, lc):
        """Append a change-log record; returns its index, or NULL when full."""
        n = S.counters[CNT_LOG_LEN]
        if n >= S.log.shape[0]:
            S.counters[CNT_ERROR] = ERR_LOG_FULL
            return NULL
        for c in range(S.log.shape[1]):
            S.log[n, c] = 0
        S.log[n, LOG_KIND] = kind
        S.log[n, LOG_LIFE_CYCLE] = lc
        S.log[n, LOG_BLOCK] = r
        for w in range(4):
            S.log[n, LOG_DIGEST + w] = S.blocks[r, BLK_DIGEST + w]
        S.counters[CNT_LOG_LEN] = n + 1
        return n

    # -- pages and slots (§2.1) -----------------------------------------------
    @jit
    def page_of(S, r, lc):
        return S.slots[r * S.lc_kind.shape[0] + lc, SLOT_PAGE]

    @jit
    def coverage(S, r, lc):
        """``cov(b, lc)``: the coverage of the slot's page, 0 when empty."""
        return S.slots[r * S.lc_kind.shape[0] + lc, SLOT_COVERAGE]

    @jit
    def set_slot(S, r, lc, page, cov):
        row = r * S.lc_kind.shape[0] + lc
        S.slots[row, SLOT_PAGE] = page
        S.slots[row, SLOT_COVERAGE] = cov

    # -- page rows and storage (§1.4) ----------------------------------------------
    @jit
    def pool_of(lc, level):
        return lc * NUM_LEVELS + level

    @jit
    def last_level(S, lc):
        """The coldest cache level the life cycle has slots at."""
        return 1 if S.pool_size[pool_of(lc, 1)] > 0 else 0

    @jit
    def pop_storage(S, lc, level):
        pool = pool_of(lc, level)
        top = S.pool_top[pool] - 1
        S.pool_top[pool] = top
        return S.page_free[S.pool_start[pool] + top]

    @jit
    def push_storage(S, lc, level, index):
        pool = pool_of(lc, level)
        top = S.pool_top[pool]
        S.page_free[S.pool_start[pool] + top] = index
        S.pool_top[pool] = top + 1

    @jit
    def alloc_page(S, lc, level, priority):
        """A fresh page with a storage slot at ``level``; NULL when the pool has
        no free slot (callers make room first, see ``make_room``)."""
        if S.pool_top[pool_of(lc, level)] == 0:
            return NULL
        top = S.row_top[lc] - 1
        S.row_top[lc] = top
        p = S.row_free[S.row_start[lc] + top]
        S.pages[p, PAGE_LEVEL] = level
        S.pages[p, PAGE_POOL_INDEX] = pop_storage(S, lc, level)
        S.pages[p, PAGE_BLOCK] = NULL
        S.pages[p, PAGE_COVERAGE] = 0
        S.pages[p, PAGE_HOLDERS] = 0
        S.pages[p, PAGE_LOCKS] = 0
        S.pages[p, PAGE_PLANNED_DROPS] = 0
        S.pages[p, PAGE_PRIORITY] = priority
        S.pages[p, PAGE_STATE] = PAGE_COMMITTED
        S.pages[p, PAGE_LRU_TICK] = NULL
        S.pages[p, PAGE_SERIAL] = S.counters[CNT_SERIAL]
        S.counters[CNT_SERIAL] += 1
        return p

    @jit
    def free_page(S, p):
        lc = S.pages[p, PAGE_LIFE_CYCLE]
        push_storage(S, lc, S.pages[p, PAGE_LEVEL], S.pages[p, PAGE_POOL_INDEX])
        top = S.row_top[lc]
        S.row_free[S.row_start[lc] + top] = p
        S.row_top[lc] = top + 1
        S.pages[p, PAGE_STATE] = PAGE_FREE
        S.pages[p, PAGE_BLOCK] = NULL
        S.pages[p, PAGE_COVERAGE] = 0
        S.pages[p, PAGE_LEVEL] = NULL
        S.pages[p, PAGE_POOL_INDEX] = NULL

    @jit
    def record_copy(S, lc, src_level, src_index, dst_level, dst_index):
        """Page data the host copies after the launch, in recording order."""
        k = S.counters[CNT_NUM_COPIES]
        if k >= S.copies.shape[0]:
            S.counters[CNT_ERROR] = ERR_COPIES_FULL
            return
        S.copies[k, COPY_LIFE_CYCLE] = lc
        S.copies[k, COPY_SRC_LEVEL] = src_level
        S.copies[k, COPY_SRC_INDEX] = src_index
        S.copies[k, COPY_DST_LEVEL] = dst_level
        S.copies[k, COPY_DST_INDEX] = dst_index
        S.counters[CNT_NUM_COPIES] = k + 1

    @jit
    def copy_page_data(S, src, dst):
        record_copy(S, S.pages[src, PAGE_LIFE_CYCLE], S.pages[src, PAGE_LEVEL], S.pages[src, PAGE_POOL_INDEX],
                    S.pages[dst, PAGE_LEVEL], S.pages[dst, PAGE_POOL_INDEX])

    @jit
    def is_droppable(S, p):
        """Nobody holds the page: only the eviction controller keeps it alive."""
        return S.pages[p, PAGE_HOLDERS] == 0 and S.pages[p, PAGE_LOCKS] == 0

    @jit
    def can_replace_page(S, r, lc, cov):
        """Empty, or the incumbent is strictly narrower (ties keep the incumbent)."""
        return coverage(S, r, lc) < cov

    @jit
    def unlink_page(S, r, lc, expected):
        """Sever a block-page link: the single place that does (§2.1).

        With ``expected != NULL`` nothing happens unless the slot still holds
        that page (it may have been replaced by a wider one meanwhile)."""
        p = page_of(S, r, lc)
        if p == NULL or (expected != NULL and p != expected):
            return NULL
        S.pages[p, PAGE_BLOCK] = NULL
        set_slot(S, r, lc, NULL, 0)
        return p

    @jit
    def link_page(S, r, lc, p):
        S.pages[p, PAGE_BLOCK] = r
        set_slot(S, r, lc, p, S.pages[p, PAGE_COVERAGE])

    @jit
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

    # -- children lists ---------------------------------------------------------
    @jit
    def append_child(S, parent, r):
        last = S.blocks[parent, BLK_LAST_CHILD]
        S.blocks[r, BLK_PREV_SIBLING] = last
        S.blocks[r, BLK_NEXT_SIBLING] = NULL
        if last == NULL:
            S.blocks[parent, BLK_FIRST_CHILD] = r
        else:
            S.blocks[last, BLK_NEXT_SIBLING] = r
        S.blocks[parent, BLK_LAST_CHILD] = r
        S.blocks[parent, BLK_NUM_CHILDREN] += 1

    @jit
    def remove_child(S, parent, r):
        prv = S.blocks[r, BLK_PREV_SIBLING]
        nxt = S.blocks[r, BLK_NEXT_SIBLING]
        if prv == NULL:
            S.blocks[parent, BLK_FIRST_CHILD] = nxt
        else:
            S.blocks[prv, BLK_NEXT_SIBLING] = nxt
        if nxt == NULL:
            S.blocks[parent, BLK_LAST_CHILD] = prv
        else:
            S.blocks[nxt, BLK_PREV_SIBLING] = prv
        S.blocks[r, BLK_PREV_SIBLING] = NULL
        S.blocks[r, BLK_NEXT_SIBLING] = NULL
        S.blocks[parent, BLK_NUM_CHILDREN] -= 1

    # -- block lifetime -----------------------------------------------------------
    @call
    def release_block_pages(S, r):
        """A block row is destroyed: unlink its pages; unowned ones die (§2.1).

        They are unlinked first, so their death runs no tree cleanup."""
        for lc in range(S.lc_kind.shape[0]):
            p = unlink_page(S, r, lc, NULL)
            if p != NULL and is_droppable(S, p):
                free_page(S, p)

    @jit
    def maybe_free_orphan(S, r):
        """An orphan's row lives while sequences refer to it."""
        if not is_attached(S, r) and S.blocks[r, BLK_REFS] == 0:
            release_block_pages(S, r)
            free_block_row(S, r)

    @call
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
        S.blocks[r, BLK_FLAGS] &= ~FLAG_ATTACHED
        S.counters[CNT_DETACHES] += 1
        log(S, EV_REMOVED, r, NULL)
        if is_root(S, parent) and S.blocks[parent, BLK_NUM_CHILDREN] == 0:
            index_remove(S, parent)
            log(S, EV_ROOT_REMOVED, parent, NULL)
            free_block_row(S, parent)
        maybe_free_orphan(S, r)

    @call
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

    @call
    def clear_stale_blocks_after_page_unlink(S, start, lc):
        """Tree cleanup after a page of ``start`` died (§2.7)."""
        kind = S.lc_kind[lc]
        if kind == KIND_FULL or (kind != KIND_SSM and S.blocks[start, BLK_ORDINAL] < S.lc_sinks[lc]):
            # Full attention or a sink block: nothing below can be reused any more.
            remove_subtree(S, start)
        elif is_attached(S, start):
            log(S, EV_REMOVED_LIFE_CYCLE, start, lc)
        # Tail pruning: detach childless blocks whose slots are all empty.
        # (All slots, not just lc's: an in-flight hybrid sequence may still
        # use this block through another life cycle.)
        cur = start
        L = S.lc_kind.shape[0]
        while cur != NULL and is_attached(S, cur) and not is_root(S, cur):
            if S.blocks[cur, BLK_NUM_CHILDREN] != 0:
                return
            for l2 in range(L):
                if page_of(S, cur, l2) != NULL:
                    return
            parent = S.blocks[cur, BLK_PARENT]
            detach(S, cur)
            cur = parent

    @call
    def page_death(S, p):
        """A committed page lost its last owner: unlink it, clean up, free it."""
        r = S.pages[p, PAGE_BLOCK]
        lc = S.pages[p, PAGE_LIFE_CYCLE]
        linked = r != NULL and unlink_page(S, r, lc, p) != NULL
        free_page(S, p)
        if linked:
            clear_stale_blocks_after_page_unlink(S, r, lc)

    # -- KV cache event announcements (§4) -----------------------------------------
    @call
    def announce(S, r, kind, lc):
        """An EV_STORED_BLOCK or EV_STORED_LIFE_CYCLE record for block ``r`` with
        its parent, its tokens, and one EV_PAGE_INFO record per life cycle
        whose slot holds a page. Which life cycles get announced is the event
        manager's call (it knows what was announced before)."""
        n = log(S, kind, r, lc)
        if n == NULL:
            return
        parent = S.blocks[r, BLK_PARENT]
        if parent != NULL:
            for w in range(4):
                S.log[n, LOG_PARENT_DIGEST + w] = S.blocks[parent, BLK_DIGEST + w]
        S.log[n, LOG_PARENT_IS_ROOT] = 1 if parent == NULL or is_root(S, parent) else 0
        nt = S.blocks[r, BLK_NUM_TOKENS]
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
                S.log[m, LOG_LEVEL] = S.pages[p, PAGE_LEVEL]
                S.log[m, LOG_PRIORITY] = S.pages[p, PAGE_PRIORITY]

    # -- the eviction controller (§2.11) -------------------------------------------
    # One prioritized LRU per (life cycle, cache level), kept implicitly: a
    # page's place is (priority, lru_tick). ``evict.py`` lists the best
    # candidates of each pool with a batched pass over the page table before
    # a launch that may need room; pages scheduled during the launch go to the
    # late list; a full scan is the fallback when neither can answer.
    @jit
    def evictable(S, p):
        """(DROPPABLE and committed) or (HELD and not at the last level); a
        LOCKED page never is."""
        if S.pages[p, PAGE_STATE] != PAGE_COMMITTED or S.pages[p, PAGE_LOCKS] != 0:
            return False
        return S.pages[p, PAGE_HOLDERS] == 0 or S.pages[p, PAGE_LEVEL] < last_level(S, S.pages[p, PAGE_LIFE_CYCLE])

    @jit
    def schedule(S, p):
        """``p`` joins the tail of its LRU (or leaves it, if no longer evictable)."""
        t = S.counters[CNT_TICK]
        S.counters[CNT_TICK] = t + 1
        S.pages[p, PAGE_LRU_TICK] = t
        if evictable(S, p):
            n = S.counters[CNT_LATE_LEN]
            if n < S.late.shape[0]:
                S.late[n, 0] = p
                S.late[n, 1] = t
            S.counters[CNT_LATE_LEN] = n + 1  # beyond the capacity it counts an overflow

    @jit
    def schedule_first(S, p):
        """An evict-first push: ``p`` goes to the head of its LRU."""
        S.counters[CNT_EVICT_FIRST] += 1
        t = -1 - S.counters[CNT_EVICT_FIRST]  # below every tick, and never NULL
        S.pages[p, PAGE_LRU_TICK] = t
        if evictable(S, p):
            n = S.counters[CNT_LATE_LEN]
            if n < S.late.shape[0]:
                S.late[n, 0] = p
                S.late[n, 1] = t
            S.counters[CNT_LATE_LEN] = n + 1

    @jit
    def is_candidate(S, p, lc, level):
        if S.pages[p, PAGE_LIFE_CYCLE] != lc or S.pages[p, PAGE_LEVEL] != level or not evictable(S, p):
            return False
        return S.pages[p, PAGE_HOLDERS] == 0 or S.no_host_room[lc] == 0

    @jit
    def evicts_before(S, p, q):
        """Eviction order: lower priority first, then least recently scheduled."""
        if q == NULL:
            return True
        a = S.pages[p, PAGE_PRIORITY]
        b = S.pages[q, PAGE_PRIORITY]
        return a < b or (a == b and S.pages[p, PAGE_LRU_TICK] < S.pages[q, PAGE_LRU_TICK])

    @call
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
            v = S.late[j, 0]
            if S.pages[v, PAGE_LRU_TICK] == S.late[j, 1] and is_candidate(S, v, lc, level) and evicts_before(S, v, best):
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

    @call
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

    @call
    def drop(S, p):
        """Evicted from its last level: the page dies and the tree cleans up."""
        S.counters[CNT_DROPPED] += 1
        page_death(S, p)

    @call
    def room_on_host(S, lc):
        """One free host slot for ``lc``, dropping host pages if needed."""
        host = pool_of(lc, 1)
        while S.pool_top[host] == 0:
            v = next_victim(S, lc, 1)
            if v == NULL:
                return False
            drop(S, v)
        return True

    @call
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
                    if S.pages[v, PAGE_STATE] == PAGE_COMMITTED:  # dropping host pages may have killed it
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

    @call
    def can_have(S, lc, own_held, need):
        """Could ``lc`` have ``need`` free GPU slots now: free ones plus what
        eviction may free (droppable pages; held ones too while the host tier
        has room for them)? ``own_held`` of the held ones are about to be
        locked by the caller. Every all-or-nothing allocation asks first."""
        pool = pool_of(lc, 0)
        if S.pool_top[pool] >= need:
            return True  # the common case: no counting at all
        return available(S, lc, own_held) >= need

    @call
    def available(S, lc, own_held):
        """Free GPU slots of ``lc`` plus what eviction may free (a lower bound).
        Counted by the batched pass when it ran before the launch (it does
        whenever free slots look short), else by a scan."""
        pool = pool_of(lc, 0)
        if S.victim_total[pool] >= 0:  # counted by the batched pass before the launch
            droppable = S.evict_counts[lc, 0]
            held = S.evict_counts[lc, 1]
            host_droppable = S.evict_counts[lc, 2]
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

    @jit
    def begin_launch(S):
        S.counters[CNT_LATE_LEN] = 0
        for lc in range(S.no_host_room.shape[0]):
            S.no_host_room[lc] = 0

    @jit
    def end_launch(S):
        """Victim lists are good for one launch only."""
        for pool in range(S.victim_count.shape[0]):
            S.victim_count[pool] = 0
            S.victim_next[pool] = 0
            S.victim_total[pool] = -1

    @call
    def clear_tree(S):
        """Remove every root's subtree, roots in creation order (idempotent;
        roots go with their last child)."""
        while True:
            r = NULL
            for c in range(S.blocks.shape[0]):  # the oldest remaining root
                if (S.blocks[c, BLK_FLAGS] & (FLAG_ROOT | FLAG_IN_USE)) == (FLAG_ROOT | FLAG_IN_USE):
                    if r == NULL or S.blocks[c, BLK_SERIAL] < S.blocks[r, BLK_SERIAL]:
                        r = c
            if r == NULL:
                return
            while (S.blocks[r, BLK_FLAGS] & FLAG_IN_USE) != 0 and S.blocks[r, BLK_FIRST_CHILD] != NULL:
                remove_subtree(S, S.blocks[r, BLK_FIRST_CHILD])
            if (S.blocks[r, BLK_FLAGS] & FLAG_IN_USE) != 0:
                # a root that never got a child
                index_remove(S, r)
                free_block_row(S, r)

    # -- creating blocks (§2.2) ---------------------------------------------------
    @call
    def get_or_create_root(S, scope_id, scope_key, scope_digest):
        r = find_root(S, scope_id, scope_key)
        if r != NULL:
            return r
        r = alloc_block(S)
        if r == NULL:
            return NULL
        S.blocks[r, BLK_KEY] = scope_key
        S.blocks[r, BLK_SCOPE] = scope_id
        S.blocks[r, BLK_FLAGS] = FLAG_IN_USE | FLAG_ATTACHED | FLAG_ROOT
        for w in range(4):
            S.blocks[r, BLK_DIGEST + w] = scope_digest[w]
        index_insert(S, r)
        return r

    @jit
    def adopt_pages_from(S, r, other):
        """Move ``other``'s pages into ``r`` where strictly wider (§2.1).

        The source slot is emptied directly, not through unlink: unlinking
        would null the back-pointer that ``replace_page`` is about to reset."""
        for lc in range(S.lc_kind.shape[0]):
            p = page_of(S, other, lc)
            if p != NULL and can_replace_page(S, r, lc, S.pages[p, PAGE_COVERAGE]):
                set_slot(S, other, lc, NULL, 0)
                replace_page(S, r, lc, p)

    @call
    def add_or_get(S, parent, toks, start, n, out):
        """Create the child of ``parent`` holding ``toks[start:start+n]``, or get
        the block that already serves it. Writes ``out[0] = block, out[1] = is_new``.

        Rules (§2.2): an exact duplicate is returned; a partial chunk that a
        sibling already covers is "useless" and that sibling (first in
        insertion order) is returned; otherwise a new block is inserted, and a
        shorter sibling it covers is adopted (its pages move, keeping their
        coverage) and then detached."""
        T = S.tokens.shape[1]
        out[0] = NULL
        out[1] = 0
        if not is_root(S, parent) and S.blocks[parent, BLK_NUM_TOKENS] != T:
            S.counters[CNT_ERROR] = ERR_NON_FULL_PARENT
            return
        key = combine(S.blocks[parent, BLK_KEY], content_hash(toks, start, n))
        r = find_child(S, parent, key, toks, start, n)
        if r != NULL:
            out[0] = r
            return
        # Only siblings starting with the chunk's first token can cover it or
        # be covered by it; the sibling index lists exactly those.
        covering = NULL
        covered = NULL
        c = S.sibling_buckets[sibling_bucket_of(S, parent, toks[start])]
        while c != NULL:
            if S.blocks[c, BLK_PARENT] == parent and S.tokens[c, 0] == toks[start]:
                m = S.blocks[c, BLK_NUM_TOKENS]
                if n < T and m >= n and tokens_equal(S, c, toks, start, n):
                    # the useless-partial rule: the first (in insertion order) covering sibling
                    if covering == NULL or S.blocks[c, BLK_SERIAL] < S.blocks[covering, BLK_SERIAL]:
                        covering = c
                elif m < n and tokens_equal(S, c, toks, start, m):
                    covered = c  # prefixes of one chunk are nested: at most one exists
            c = S.blocks[c, BLK_FIRST_NEXT]
        if covering != NULL:
            out[0] = covering
            return
        r = alloc_block(S)
        if r == NULL:
            return
        S.blocks[r, BLK_KEY] = key
        S.blocks[r, BLK_PARENT] = parent
        S.blocks[r, BLK_ORDINAL] = S.blocks[parent, BLK_ORDINAL] + 1
        S.blocks[r, BLK_NUM_TOKENS] = n
        S.blocks[r, BLK_SCOPE] = S.blocks[parent, BLK_SCOPE]
        S.blocks[r, BLK_FLAGS] = FLAG_IN_USE | FLAG_ATTACHED
        for i in range(n):
            S.tokens[r, i] = toks[start + i]
        for i in range(n, T):
            S.tokens[r, i] = 0
        chain_digest(
            S.blocks[parent, BLK_DIGEST:BLK_DIGEST + 4],
            S.tokens[r],
            n,
            S.mm_digests,
            S.blocks[r, BLK_DIGEST:BLK_DIGEST + 4],
            S.work,
        )
        # NOTE insert before detaching the covered sibling: a root whose only
        # child is that sibling would otherwise be removed in between.
        append_child(S, parent, r)
        index_insert(S, r)
        log(S, EV_CREATED, r, NULL)
        if covered != NULL:
            adopt_pages_from(S, r, covered)
            detach(S, covered)
        out[0] = r
        out[1] = 1

    return SimpleNamespace(
        keys=keys,
        find_child=find_child,
        find_root=find_root,
        tokens_equal=tokens_equal,
        is_child=is_child,
        page_of=page_of,
        coverage=coverage,
        alloc_page=alloc_page,
        free_page=free_page,
        can_replace_page=can_replace_page,
        replace_page=replace_page,
        unlink_page=unlink_page,
        detach=detach,
        remove_subtree=remove_subtree,
        clear_stale_blocks_after_page_unlink=clear_stale_blocks_after_page_unlink,
        page_death=page_death,
        clear_tree=clear_tree,
        get_or_create_root=get_or_create_root,
        add_or_get=add_or_get,
        adopt_pages_from=adopt_pages_from,
        maybe_free_orphan=maybe_free_orphan,
        is_attached=is_attached,
        is_root=is_root,
        record_copy=record_copy,
        copy_page_data=copy_page_data,
        last_level=last_level,
        evictable=evictable,
        schedule=schedule,
        schedule_first=schedule_first,
        make_room=make_room,
        available=available,
        can_have=can_have,
        move_page=move_page,
        announce=announce,
        begin_launch=begin_launch,
        end_launch=end_launch,
    )


# -- the serial tree kernel: one operation per launch -----------------------------
OP_ADD = 1  # args: scope id, scope key, parent (NULL: the scope's root, created if missing), n, root digest[4]
OP_ADD_PAGE = 2  # args: block, life cycle, coverage -> out[0] = page (NULL if not wider)
OP_UNLINK_PAGE = 3  # args: block, life cycle, expected page
OP_PAGE_DEATH = 4  # args: page
OP_REMOVE_SUBTREE = 5  # args: block
OP_CLEAR = 6
OP_CLEAR_STALE = 7  # args: block, life cycle
OP_RELEASE_REF = 8  # args: block
OP_INSERT = 9  # args: scope id, scope key, tokens, root digest[4]; toks = the sequence
OP_ANNOUNCE = 10  # args: block, EV_STORED_BLOCK or EV_STORED_LIFE_CYCLE, life cycle
OP_EVICT = 11  # args: life cycle, level, free slots wanted -> out[0] = 1 when there are


@functools.lru_cache(maxsize=None)
def build_tree_kernel(target: str):
    """``run(S, op, args, toks, out)``: one tree operation, serially."""
    t = _build_tree(target)
    call = device_jit(target, inline=False)
    # Numba resolves globals and closure cells, not namespace attributes.
    get_or_create_root, add_or_get, can_replace_page = t.get_or_create_root, t.add_or_get, t.can_replace_page
    alloc_page, replace_page, unlink_page, page_death = t.alloc_page, t.replace_page, t.unlink_page, t.page_death
    free_page = t.free_page
    remove_subtree, clear_tree, clear_stale = t.remove_subtree, t.clear_tree, t.clear_stale_blocks_after_page_unlink
    maybe_free_orphan = t.maybe_free_orphan
    make_room, schedule, announce = t.make_room, t.schedule, t.announce
    page_of, is_root = t.page_of, t.is_root
    begin_launch, end_launch = t.begin_launch, t.end_launch

    @call
    def tree_step(S, op, args, toks, out):
        if op == OP_ADD:
            root = get_or_create_root(S, args[0], args[1], args[4:8])
            out[2] = root
            parent = root if args[2] == NULL else args[2]
            # The host validated the parent and stocked the free lists, so
            # neither step below can fail half way.
            if root != NULL:
                add_or_get(S, parent, toks, 0, args[3], out)
        elif op == OP_ADD_PAGE:
            r = args[0]
            lc = args[1]
            out[0] = NULL
            if can_replace_page(S, r, lc, args[2]) and make_room(S, lc, 0, 1):
                p = alloc_page(S, lc, 0, args[3])
                S.pages[p, PAGE_COVERAGE] = args[2]
                if can_replace_page(S, r, lc, args[2]):  # making room may have removed the block's pages, never widened them
                    replace_page(S, r, lc, p)
                    schedule(S, p)
                    out[0] = p
                else:
                    free_page(S, p)
        elif op == OP_UNLINK_PAGE:
            out[0] = unlink_page(S, args[0], args[1], args[2])
        elif op == OP_PAGE_DEATH:
            page_death(S, args[0])
        elif op == OP_REMOVE_SUBTREE:
            remove_subtree(S, args[0])
        elif op == OP_CLEAR:
            clear_tree(S)
        elif op == OP_CLEAR_STALE:
            clear_stale(S, args[0], args[1])
        elif op == OP_INSERT:
            # A whole sequence in one launch: each block is added (or got) and
            # given a fresh page of full coverage in every life cycle where
            # that is strictly wider. Stops early when a pool runs dry;
            # out[3] = blocks inserted.
            T = S.tokens.shape[1]
            L = S.lc_kind.shape[0]
            parent = get_or_create_root(S, args[0], args[1], args[4:8])
            n_tok = args[2]
            j = 0
            while parent != NULL and j * T < n_tok:
                n = min(T, n_tok - j * T)
                add_or_get(S, parent, toks, j * T, n, out)
                r = out[0]
                if r == NULL:
                    break
                for lc in range(L):
                    if can_replace_page(S, r, lc, n):
                        p = alloc_page(S, lc, 0, DEFAULT_PRIORITY)
                        if p == NULL:
                            r = NULL
                            break
                        S.pages[p, PAGE_COVERAGE] = n
                        replace_page(S, r, lc, p)
                if r != NULL and out[1] == 1:
                    announce(S, r, EV_STORED_BLOCK, NULL)
                out[3] = j + 1 if r != NULL else j
                if r == NULL:
                    break
                parent = r
                if n < T:
                    break
                j += 1
            # Released as a finished sequence releases them: the last block
            # first, so leaves are evicted before their ancestors.
            while parent != NULL and not is_root(S, parent):
                for k in range(L):
                    p = page_of(S, parent, L - 1 - k)
                    if p != NULL:
                        schedule(S, p)
                parent = S.blocks[parent, BLK_PARENT]
        elif op == OP_RELEASE_REF:
            S.blocks[args[0], BLK_REFS] -= 1
            maybe_free_orphan(S, args[0])
        elif op == OP_ANNOUNCE:
            announce(S, args[0], args[1], args[2])
        elif op == OP_EVICT:
            out[0] = 1 if make_room(S, args[0], args[1], args[2]) else 0

    @call
    def tree_op(S, op, args, toks, out):
        begin_launch(S)
        tree_step(S, op, args, toks, out)
        end_launch(S)

    if target == "cpu":
        return cpu_kernel(bind_globals(_run_cpu, tree_op=tree_op))

    from numba import cuda

    kernel = cuda.jit(bind_globals(_run_cuda, tree_op=tree_op, cuda=cuda))

    def run(S, op, args, toks, out):
        kernel[1, 1](S, op, args, toks, out)

    return run


def _run_cpu(S, op, args, toks, out):
    tree_op(S, op, args, toks, out)  # noqa: F821 (bound by bind_globals)


def _run_cuda(S, op, args, toks, out):
    if cuda.grid(1) == 0:  # noqa: F821
        tree_op(S, op, args, toks, out)  # noqa: F821

"""One sequence's KV cache on the device tables (semantics.md §2.5, §2.6, §2.8-§2.10).

A ``KVCache`` keeps its state in small device arrays (``SeqTables``): per
ordinal and life cycle the page it refers to and how (held or locked), per
ordinal the tree block it is committed as, its committed tokens, and a row of
scalars. Each public call (create with reuse, resume, suspend, resize, commit,
stop, close) is one launch of the serial kernel below, so no call loops over
blocks in Python. Page data copies the kernel decides on (partial snapshots,
private tail copies, SSM checkpoints) are recorded in ``copies`` and carried
out by the host right after the launch, in order (they are storage addresses,
so a slot freed and reused within the launch is copied from before it is
overwritten). Allocations make room by eviction (``kernels/tree.py``); the
all-or-nothing ones first check that enough could be freed.
"""

from __future__ import annotations

import functools
from collections import namedtuple


from ..core.backend import bind_globals, cpu_kernel, device_jit
from ..core.config import DEFAULT_PRIORITY, KIND_SSM, KIND_SWA
from ..core.layout import (
    CNT_ERROR,
    ERR_NO_PAGE,
    POLICY_COMMIT_MIN_SNAPSHOT,
    POLICY_SCRATCH_REWIND,
    BLK_NUM_TOKENS,
    BLK_ORDINAL,
    BLK_REFS,
    NULL,
    PAGE_BLOCK,
    EV_STORED_BLOCK,
    EV_STORED_LIFE_CYCLE,
    PAGE_COVERAGE,
    PAGE_HOLDERS,
    PAGE_LEVEL,
    PAGE_LIFE_CYCLE,
    PAGE_LOCKS,
    PAGE_STATE,
    PAGE_UNCOMMITTED,
    PAGE_COMMITTED,
)
from .lifecycle import build_lifecycle
from .tree import build_tree

# How a sequence refers to a page (SeqTables.kinds).
HOLD = 1
LOCK = 2
SCRATCH = 3  # an SWA scratch block: no page of its own (the page column stays NULL)

# Statuses and commit states.
SUSPENDED = 0
ACTIVE = 1
CLOSED = 2
ALLOWED = 0
VIRTUAL_STOP = 1
USER_STOP = 2

# Scalars of one sequence (SeqTables.scalars).
Q_NUM_BLOCKS = 0  # len(_blocks) = ceil(capacity / T)
Q_COMMITTED = 1  # num_committed_tokens
Q_COMMITTED_BLOCKS = 2
Q_HISTORY = 3
Q_CAPACITY = 4
Q_COMMIT_STATE = 5
Q_STATUS = 6
Q_NEVER_RESUMED = 7
Q_SSM_PAGE = 8  # the live (or reused) SSM page; NULL for none
Q_SSM_KIND = 9
Q_SCOPE_ID = 10
Q_SCOPE_KEY = 11
Q_RESULT = 13  # 1 = done, 0 = refused (out of pages)
Q_VIRTUAL_STOPPED = 14
Q_EVICT_FIRST = 15  # pages released now go to the head of their LRU (close(evict_first=True))
Q_WIDTH = 16

# Operations.
SEQ_SETUP_REUSE = 1  # args: matched tokens N, blocks in B.path[:count]
SEQ_RESUME = 2
SEQ_SUSPEND = 3
SEQ_RESIZE = 4  # args: capacity, history
SEQ_COMMIT = 5  # args: first new token index, count, is_end
SEQ_STOP = 6
SEQ_CLOSE = 7

SeqTables = namedtuple(
    "SeqTables",
    [
        "pages",  # int64 [max blocks, L]: page row per (ordinal, life cycle), NULL = none
        "kinds",  # int64 [max blocks, L]: HOLD or LOCK (0 = none)
        "tree",  # int64 [max blocks]: committed tree block row, NULL = uncommitted
        "tokens",  # int32 [max tokens]: committed tokens
        "scalars",  # int64 [Q_WIDTH]
        "priority",  # int64 [max blocks, L]: priority of the pages created for (ordinal, life cycle)
        "path",  # int64 [max blocks]: the matched blocks for SEQ_SETUP_REUSE
        "args",  # int64 [4]
        "out",  # int64 [4]: scratch for tree calls
        "counts",  # int64 [L]: scratch for all-or-nothing allocation checks
        "scope_digest",  # int64 [4]: the SHA-256 key of the sequence's root
        "scratch",  # int64 [L, k]: SWA scratch slots (locked uncommitted pages) shared by scratch blocks
        "scratch_count",  # int64 [L]
    ],
)


@functools.lru_cache(maxsize=None)
def build_seq(target: str):
    jit = device_jit(target)
    call = device_jit(target, inline=False)
    t = build_tree(target)
    add_or_get = t.add_or_get
    alloc_page = t.alloc_page
    free_page = t.free_page
    replace_page = t.replace_page
    can_replace_page = t.can_replace_page
    coverage = t.coverage
    page_of = t.page_of
    page_death = t.page_death
    is_attached = t.is_attached
    maybe_free_orphan = t.maybe_free_orphan
    get_or_create_root = t.get_or_create_root
    adopt_pages_from = t.adopt_pages_from
    copy_page_data = t.copy_page_data
    schedule = t.schedule
    schedule_first = t.schedule_first
    make_room = t.make_room
    move_page = t.move_page
    can_have = t.can_have
    evictable = t.evictable
    announce = t.announce
    begin_launch, end_launch = t.begin_launch, t.end_launch

    lifecycle = build_lifecycle(jit)  # stale ranges (§1.5)
    stale_start, stale_end, is_stale = lifecycle.stale_start, lifecycle.stale_end, lifecycle.is_stale

    @jit
    def scratch_range(S, lc, cap, h):
        """§1.5 scratch range: the stale range at ``max(0, cap - R)`` within the
        input blocks ``[ceil(h/T), ceil(cap/T))``; empty unless scratch reuse
        is on and ``lc`` is SWA."""
        T = S.tokens.shape[1]
        R = S.policy[POLICY_SCRATCH_REWIND]
        if R < 0 or S.lc_kind[lc] != KIND_SWA:
            return 0, 0
        at = max(0, cap - R)
        lo = max(stale_start(S, lc, at), (h + T - 1) // T)
        hi = min(stale_end(S, lc, at), (cap + T - 1) // T)
        return lo, max(lo, hi)

    @jit
    def scratch_slots_needed(S, lc, blocks):
        """Scratch blocks share slots: enough for one window of blocks."""
        T = S.tokens.shape[1]
        return min(blocks, (S.lc_window[lc] - 1 + T - 1) // T) if blocks > 0 else 0

    # -- holding pages (§2.8) -----------------------------------------------------------
    @jit
    def hold(S, p, kind):
        S.pages[p, PAGE_HOLDERS] += 1
        if kind == LOCK:
            S.pages[p, PAGE_LOCKS] += 1

    @call
    def release(S, Q, p, kind):
        """A sequence drops its hold or lock on ``p``. An unowned uncommitted page
        dies at once; an unowned committed page stays cached (evictable) unless
        it was unlinked or its block is an orphan, in which case it dies."""
        S.pages[p, PAGE_HOLDERS] -= 1
        if kind == LOCK:
            S.pages[p, PAGE_LOCKS] -= 1
        if S.pages[p, PAGE_HOLDERS] > 0:
            if kind == LOCK and S.pages[p, PAGE_LOCKS] == 0 and S.pages[p, PAGE_STATE] == PAGE_COMMITTED:
                schedule(S, p)  # held, unlocked: evictable when a colder level exists
            return
        if S.pages[p, PAGE_STATE] == PAGE_UNCOMMITTED:
            free_page(S, p)
            return
        if Q.scalars[Q_EVICT_FIRST] == 1:
            schedule_first(S, p)
        else:
            schedule(S, p)
        b = S.pages[p, PAGE_BLOCK]
        if b == NULL or not is_attached(S, b):
            page_death(S, p)

    @jit
    def set_entry(Q, o, lc, p, kind):
        Q.pages[o, lc] = p
        Q.kinds[o, lc] = kind if p != NULL else 0

    @jit
    def drop_entry(S, Q, o, lc):
        p = Q.pages[o, lc]
        if p != NULL:
            kind = Q.kinds[o, lc]
            set_entry(Q, o, lc, NULL, 0)
            release(S, Q, p, kind)

    @jit
    def ref_block(S, r):
        S.blocks[r, BLK_REFS] += 1

    @jit
    def unref_block(S, r):
        S.blocks[r, BLK_REFS] -= 1
        maybe_free_orphan(S, r)

    @jit
    def set_tree(S, Q, o, r):
        old = Q.tree[o]
        Q.tree[o] = r
        if r != NULL:
            ref_block(S, r)
        if old != NULL:
            unref_block(S, old)

    @jit
    def commit_page(S, p, cov):
        """An uncommitted page becomes a committed page (same slot, same data)."""
        S.pages[p, PAGE_STATE] = PAGE_COMMITTED
        S.pages[p, PAGE_COVERAGE] = cov
        S.pages[p, PAGE_BLOCK] = NULL

    @jit
    def new_page(S, lc, state, priority):
        """A GPU page, evicting to make room; NULL when even that fails (callers
        of all-or-nothing allocations checked ``can_have`` first)."""
        if not make_room(S, lc, 0, 1):
            return NULL
        p = alloc_page(S, lc, 0, priority)
        if p == NULL:
            return NULL
        S.pages[p, PAGE_STATE] = state
        return p

    @jit
    def promised_page(S, lc, priority):
        """A page an all-or-nothing check promised; a miss is a bug, reported
        as a kernel error instead of a write through NULL."""
        p = new_page(S, lc, PAGE_UNCOMMITTED, priority)
        if p == NULL:
            S.counters[CNT_ERROR] = ERR_NO_PAGE
            return NULL
        hold(S, p, LOCK)
        return p

    @jit
    def to_gpu(S, p):
        """A page about to be locked comes back from the host tier."""
        if S.pages[p, PAGE_LEVEL] != 0 and make_room(S, S.pages[p, PAGE_LIFE_CYCLE], 0, 1):
            move_page(S, p, 0)

    @jit
    def kind_now(Q):
        return LOCK if Q.scalars[Q_STATUS] == ACTIVE else HOLD

    # -- reuse setup (§2.6) -----------------------------------------------------------
    @call
    def setup_reuse(S, Q, N, count):
        T = S.tokens.shape[1]
        L = S.lc_kind.shape[0]
        for o in range(count):
            set_tree(S, Q, o, Q.path[o])
        for lc in range(L):
            if S.lc_kind[lc] == KIND_SSM:
                continue
            for o in range(count):
                if is_stale(S, lc, N, o):
                    continue
                p = page_of(S, Q.path[o], lc)  # pruning guarantees it exists and covers enough
                hold(S, p, HOLD)
                set_entry(Q, o, lc, p, HOLD)
        for lc in range(L):
            if S.lc_kind[lc] == KIND_SSM and count > 0:
                p = page_of(S, Q.path[count - 1], lc)  # an exact checkpoint, by pruning
                hold(S, p, HOLD)
                Q.scalars[Q_SSM_PAGE] = p
                Q.scalars[Q_SSM_KIND] = HOLD
        Q.scalars[Q_NUM_BLOCKS] = count
        Q.scalars[Q_COMMITTED] = N
        Q.scalars[Q_COMMITTED_BLOCKS] = N // T
        Q.scalars[Q_HISTORY] = N
        Q.scalars[Q_CAPACITY] = N

    # -- resume / suspend ----------------------------------------------------------------
    @jit
    def set_all_kinds(S, Q, kind):
        L = S.lc_kind.shape[0]
        for o in range(Q.scalars[Q_NUM_BLOCKS]):
            for lc in range(L):
                p = Q.pages[o, lc]
                if p != NULL and Q.kinds[o, lc] != kind:
                    if kind == LOCK:
                        S.pages[p, PAGE_LOCKS] += 1
                    else:
                        S.pages[p, PAGE_LOCKS] -= 1
                    Q.kinds[o, lc] = kind
                    if kind == HOLD and S.pages[p, PAGE_STATE] == PAGE_COMMITTED:
                        schedule(S, p)
        p = Q.scalars[Q_SSM_PAGE]
        if p != NULL and Q.scalars[Q_SSM_KIND] != kind:
            S.pages[p, PAGE_LOCKS] += 1 if kind == LOCK else -1
            Q.scalars[Q_SSM_KIND] = kind
            if kind == HOLD and S.pages[p, PAGE_STATE] == PAGE_COMMITTED:
                schedule(S, p)

    @jit
    def pages_off_gpu(S, Q, lc):
        """The sequence's pages of ``lc`` on the host tier (a resume locks them
        back onto the GPU), and its held GPU pages eviction could take now."""
        off = 0
        held = 0
        for o in range(Q.scalars[Q_NUM_BLOCKS]):
            p = Q.pages[o, lc]
            if p != NULL:
                if S.pages[p, PAGE_LEVEL] != 0:
                    off += 1
                elif evictable(S, p):
                    held += 1
        p = Q.scalars[Q_SSM_PAGE]
        if p != NULL and S.pages[p, PAGE_LIFE_CYCLE] == lc:
            if S.pages[p, PAGE_LEVEL] != 0:
                off += 1
            elif evictable(S, p):
                held += 1
        return off, held

    @call
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
            need = off + (1 if first and (S.lc_kind[lc] == KIND_SSM or partial) else 0)
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
                if S.lc_kind[lc] == KIND_SSM:
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

    # -- capacity and history (§2.10) -----------------------------------------------------
    @call
    def unlock_stale(S, Q, new_h, release_now):
        """SWA blocks that become stale at ``new_h`` lose their lock: kept as a
        holder only while they may still be committed (uncommitted, commits
        allowed, not commit_min_snapshot); otherwise released (when
        ``release_now``) or, on the resize path, released by ``resize`` itself."""
        L = S.lc_kind.shape[0]
        old_h = Q.scalars[Q_HISTORY]
        if new_h == old_h:
            return
        for lc in range(L):
            if S.lc_kind[lc] != KIND_SWA:
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
                        S.pages[p, PAGE_LOCKS] -= 1
                    Q.kinds[o, lc] = HOLD
                elif release_now:
                    drop_entry(S, Q, o, lc)
                else:
                    Q.kinds[o, lc] = -Q.kinds[o, lc]  # pending: see release_pending

    @call
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

    @call
    def drop_block(S, Q, o):
        """Tear block ``o`` down: its tree reference first, then its pages in
        descending life cycle."""
        L = S.lc_kind.shape[0]
        set_tree(S, Q, o, NULL)
        for k in range(L):
            drop_entry(S, Q, o, L - 1 - k)

    @call
    def release_scratch(S, Q):
        """Scratch slots live for one step: suspend and close give them back."""
        L = S.lc_kind.shape[0]
        for lc in range(L):
            for k in range(Q.scratch_count[lc]):
                release(S, Q, Q.scratch[lc, k], LOCK)
            Q.scratch_count[lc] = 0
            for o in range(Q.scalars[Q_NUM_BLOCKS]):  # former scratch blocks are just page-less now
                if Q.kinds[o, lc] == SCRATCH:
                    Q.kinds[o, lc] = 0

    @call
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
            if S.lc_kind[lc] == KIND_SSM:
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
            if S.lc_kind[lc] == KIND_SSM:
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
        unlock_stale(S, Q, h, False)
        o = old_nb
        while o > new_nb:
            o -= 1
            drop_block(S, Q, o)
        release_pending(S, Q, min(old_nb, new_nb))
        Q.scalars[Q_NUM_BLOCKS] = new_nb
        Q.scalars[Q_CAPACITY] = cap
        Q.scalars[Q_HISTORY] = h
        Q.scalars[Q_RESULT] = 1

    # -- commits (§2.5) -------------------------------------------------------------------
    @jit
    def on_stop_committing(S, Q):
        """Release held pages of uncommitted stale blocks kept only for committing."""
        L = S.lc_kind.shape[0]
        h = Q.scalars[Q_HISTORY]
        for lc in range(L):
            if S.lc_kind[lc] == KIND_SSM:
                continue
            lo = max(stale_start(S, lc, h), Q.scalars[Q_COMMITTED_BLOCKS])
            hi = min(stale_end(S, lc, h), Q.scalars[Q_NUM_BLOCKS])
            for o in range(lo, hi):
                drop_entry(S, Q, o, lc)

    @call
    def tree_parent(S, Q, o, out):
        """The tree parent of ordinal ``o``: the scope's root or committed block
        ``o - 1``. A committed ancestor chain that was detached meanwhile is
        re-attached first (as newer reference versions do), so a new block
        never lands under an orphan."""
        root = get_or_create_root(S, Q.scalars[Q_SCOPE_ID], Q.scalars[Q_SCOPE_KEY], Q.scope_digest)
        if o == 0:
            return root
        if is_attached(S, Q.tree[o - 1]):
            return Q.tree[o - 1]
        k = o - 1  # find the first detached ancestor
        while k > 0 and not is_attached(S, Q.tree[k - 1]):
            k -= 1
        parent = root if k == 0 else Q.tree[k - 1]
        T = S.tokens.shape[1]
        while k < o:
            tb = Q.tree[k]
            add_or_get(S, parent, S.tokens[tb], 0, T, out)
            nb = out[0]
            if nb != tb:
                adopt_pages_from(S, nb, tb)
                set_tree(S, Q, k, nb)
                if out[1] == 1:
                    announce(S, nb, EV_STORED_BLOCK, NULL)
            parent = nb
            k += 1
        return parent

    @call
    def copy_page_to_tree(S, Q, tb, lc, src, cov):
        """§2.5.2: a copy of ``src`` with coverage ``cov`` into ``tb``'s slot when
        strictly wider, on the GPU or else on the host tier; when no level has
        room, even by eviction, the snapshot is skipped and the older, narrower
        one stays (the replacement follows the copy). True when copied."""
        if not can_replace_page(S, tb, lc, cov):
            return False
        level = 0
        if not make_room(S, lc, 0, 1):
            level = 1
            if not make_room(S, lc, 1, 1):
                return False
        p = alloc_page(S, lc, level, Q.priority[S.blocks[tb, BLK_ORDINAL], lc])
        S.pages[p, PAGE_COVERAGE] = cov
        copy_page_data(S, src, p)
        if not can_replace_page(S, tb, lc, cov):  # eviction cannot widen a slot; kept for safety
            free_page(S, p)
            return False
        replace_page(S, tb, lc, p)
        schedule(S, p)
        return True

    @call
    def snapshot_ssm(S, Q, tb, n_total, move):
        """§2.5.3: checkpoint the live SSM state at ``n_total`` tokens on ``tb``."""
        T = S.tokens.shape[1]
        L = S.lc_kind.shape[0]
        for lc in range(L):
            if S.lc_kind[lc] != KIND_SSM:
                continue
            c = n_total - S.blocks[tb, BLK_ORDINAL] * T
            if coverage(S, tb, lc) >= c:
                return  # an equal or later checkpoint is there already
            live = Q.scalars[Q_SSM_PAGE]
            if move:  # is_end: hand the live state itself over
                Q.scalars[Q_SSM_PAGE] = NULL
                kind = Q.scalars[Q_SSM_KIND]
                Q.scalars[Q_SSM_KIND] = 0
                S.pages[live, PAGE_HOLDERS] -= 1
                if kind == LOCK:
                    S.pages[live, PAGE_LOCKS] -= 1
                commit_page(S, live, c)
                replace_page(S, tb, lc, live)
                schedule(S, live)
            else:
                copy_page_to_tree(S, Q, tb, lc, live, c)

    @call
    def commit_block(S, Q, o, last, ssm, move_ssm, out):
        """§2.5.1."""
        T = S.tokens.shape[1]
        L = S.lc_kind.shape[0]
        n = min(T, Q.scalars[Q_COMMITTED] - o * T)
        full = n == T
        parent = tree_parent(S, Q, o, out)
        add_or_get(S, parent, Q.tokens, o * T, n, out)
        tb = out[0]
        is_new = out[1] == 1
        ref_block(S, tb)  # pinned for this call, even if it becomes an orphan
        did = False
        if is_new:
            for lc in range(L):
                p = Q.pages[o, lc]
                if S.lc_kind[lc] == KIND_SSM or p == NULL or S.pages[p, PAGE_STATE] != PAGE_UNCOMMITTED:
                    continue
                commit_page(S, p, n)
                replace_page(S, tb, lc, p)  # replaces any narrower page tb adopted
            announce(S, tb, EV_STORED_BLOCK, NULL)
            did = True
        elif S.blocks[tb, BLK_NUM_TOKENS] == T and full:  # rebase
            for lc in range(L):
                p = Q.pages[o, lc]
                if S.lc_kind[lc] == KIND_SSM or p == NULL:
                    continue
                e = page_of(S, tb, lc)
                if e != NULL and coverage(S, tb, lc) < n:
                    e = NULL  # never adopt a tree page narrower than the block
                if e == NULL:
                    commit_page(S, p, n)
                    replace_page(S, tb, lc, p)
                    announce(S, tb, EV_STORED_LIFE_CYCLE, lc)
                else:
                    kind = Q.kinds[o, lc]
                    hold(S, e, kind)
                    set_entry(Q, o, lc, e, kind)
                    release(S, Q, p, kind)  # our own uncommitted page (its GPU slot is free now)
                    if kind == LOCK:
                        to_gpu(S, e)
            did = True
        else:
            Q.scalars[Q_COMMIT_STATE] = VIRTUAL_STOP  # our partial tail is covered already
            Q.scalars[Q_VIRTUAL_STOPPED] = 1
        if did:
            set_tree(S, Q, o, tb)
            Q.scalars[Q_COMMITTED_BLOCKS] += 1
            if ssm:
                snapshot_ssm(S, Q, tb, o * T + n, move_ssm)
            h = Q.scalars[Q_HISTORY]
            for lc in range(L):
                if S.lc_kind[lc] != KIND_SSM and is_stale(S, lc, h, o):
                    drop_entry(S, Q, o, lc)  # the tree keeps the page, now evictable
        unref_block(S, tb)
        if last or Q.scalars[Q_COMMIT_STATE] == VIRTUAL_STOP:
            Q.scalars[Q_COMMIT_STATE] = USER_STOP
            on_stop_committing(S, Q)

    @call
    def snapshot_partial(S, Q, o, ssm, out):
        """§2.5.2: copies of the partial block's pages go into the tree (an exact
        partial block, a longer covering sibling, or a new one); the sequence's
        block stays uncommitted."""
        T = S.tokens.shape[1]
        L = S.lc_kind.shape[0]
        n = Q.scalars[Q_COMMITTED] - o * T
        parent = tree_parent(S, Q, o, out)
        add_or_get(S, parent, Q.tokens, o * T, n, out)
        tb = out[0]
        is_new = out[1] == 1
        ref_block(S, tb)
        for lc in range(L):
            p = Q.pages[o, lc]
            Q.counts[lc] = 0
            if S.lc_kind[lc] != KIND_SSM and p != NULL and coverage(S, tb, lc) < n:
                if copy_page_to_tree(S, Q, tb, lc, p, n):
                    Q.counts[lc] = 1  # attached
        if ssm:
            snapshot_ssm(S, Q, tb, o * T + n, False)
        if not is_attached(S, tb):
            pass  # making room for a copy evicted the block's own subtree: nothing to announce
        elif is_new:
            announce(S, tb, EV_STORED_BLOCK, NULL)
        else:
            for lc in range(L):
                if Q.counts[lc] == 1:
                    announce(S, tb, EV_STORED_LIFE_CYCLE, lc)
        unref_block(S, tb)

    @call
    def stop_committing(S, Q, out):
        T = S.tokens.shape[1]
        state = Q.scalars[Q_COMMIT_STATE]
        if state == USER_STOP:
            return
        if state == VIRTUAL_STOP:
            Q.scalars[Q_COMMIT_STATE] = USER_STOP
            return
        if Q.scalars[Q_COMMITTED] > Q.scalars[Q_COMMITTED_BLOCKS] * T:
            commit_block(S, Q, Q.scalars[Q_COMMITTED_BLOCKS], True, False, False, out)  # no SSM snapshot here
        else:
            Q.scalars[Q_COMMIT_STATE] = USER_STOP
            on_stop_committing(S, Q)

    @call
    def commit(S, Q, n0, k, is_end, out):
        """§2.5 ``commit``: the host already validated, raised the history and
        appended the tokens to ``Q.tokens``."""
        T = S.tokens.shape[1]
        L = S.lc_kind.shape[0]
        has_ssm = False
        for lc in range(L):
            if S.lc_kind[lc] == KIND_SSM:
                has_ssm = True
        n1 = n0 + k
        if Q.scalars[Q_HISTORY] < n1:  # raising the history never allocates
            resize(S, Q, Q.scalars[Q_CAPACITY], n1)
        Q.scalars[Q_COMMITTED] = n1
        if Q.scalars[Q_COMMIT_STATE] == VIRTUAL_STOP:
            if is_end:
                Q.scalars[Q_COMMIT_STATE] = USER_STOP
            return
        min_snapshot = S.policy[POLICY_COMMIT_MIN_SNAPSHOT] == 1
        f0 = Q.scalars[Q_COMMITTED_BLOCKS]
        f1 = n1 // T
        partial = min_snapshot and n1 % T != 0
        if f1 > f0 or partial:
            snap = (n1 - 1) // T
            for o in range(f0, f1):
                commit_block(S, Q, o, False, min_snapshot and has_ssm and o == snap, is_end, out)
                if Q.scalars[Q_COMMIT_STATE] != ALLOWED:
                    break
            if partial and Q.scalars[Q_COMMIT_STATE] == ALLOWED:
                if is_end:
                    commit_block(S, Q, f1, True, has_ssm, has_ssm, out)
                else:
                    snapshot_partial(S, Q, f1, has_ssm, out)
        if is_end and Q.scalars[Q_COMMIT_STATE] != USER_STOP:
            stop_committing(S, Q, out)

    @call
    def close(S, Q, out):
        stop_committing(S, Q, out)
        release_scratch(S, Q)
        o = Q.scalars[Q_NUM_BLOCKS]
        while o > 0:
            o -= 1
            drop_block(S, Q, o)
        p = Q.scalars[Q_SSM_PAGE]
        if p != NULL:
            kind = Q.scalars[Q_SSM_KIND]
            Q.scalars[Q_SSM_PAGE] = NULL
            Q.scalars[Q_SSM_KIND] = 0
            release(S, Q, p, kind)
        Q.scalars[Q_NUM_BLOCKS] = 0
        Q.scalars[Q_STATUS] = CLOSED

    @call
    def seq_step(S, Q, op):
        out = Q.out
        Q.scalars[Q_RESULT] = 1
        if op == SEQ_SETUP_REUSE:
            setup_reuse(S, Q, Q.args[0], Q.args[1])
        elif op == SEQ_RESUME:
            resume(S, Q)
        elif op == SEQ_SUSPEND:
            Q.scalars[Q_STATUS] = SUSPENDED
            release_scratch(S, Q)
            set_all_kinds(S, Q, HOLD)
        elif op == SEQ_RESIZE:
            resize(S, Q, Q.args[0], Q.args[1])
        elif op == SEQ_COMMIT:
            commit(S, Q, Q.args[0], Q.args[1], Q.args[2] == 1, out)
        elif op == SEQ_STOP:
            stop_committing(S, Q, out)
        elif op == SEQ_CLOSE:
            Q.scalars[Q_EVICT_FIRST] = Q.args[0]
            close(S, Q, out)
            Q.scalars[Q_EVICT_FIRST] = 0

    @call
    def seq_op(S, Q, op):
        begin_launch(S)
        seq_step(S, Q, op)
        end_launch(S)

    return seq_op


@functools.lru_cache(maxsize=None)
def build_seq_kernel(target: str):
    """``run(S, Q, op)``: one sequence operation, serially."""
    seq_op = build_seq(target)
    if target == "cpu":
        return cpu_kernel(bind_globals(_run_cpu, seq_op=seq_op))

    from numba import cuda

    kernel = cuda.jit(bind_globals(_run_cuda, seq_op=seq_op, cuda=cuda))

    def run(S, Q, op):
        kernel[1, 1](S, Q, op)

    return run


def _run_cpu(S, Q, op):
    seq_op(S, Q, op)  # noqa: F821 (bound by bind_globals)


def _run_cuda(S, Q, op):
    if cuda.grid(1) == 0:  # noqa: F821
        seq_op(S, Q, op)  # noqa: F821

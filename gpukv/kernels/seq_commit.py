"""Commits of a sequence into the tree (docs/semantics.md §2.5).

New blocks take the sequence's pages (installed only when strictly wider
than what the block adopted); full blocks that exist already rebase, never
onto a narrower tree page, and under ``stable_pages`` not at all (the
sequence keeps its own page, private, until it closes); a covered partial tail ends in VIRTUAL_STOP. Under
``commit_min_snapshot`` a partial tail is snapshotted by copying pages into
the tree, and checkpoint kinds' state is copied (moved on ``is_end``).
"""

from __future__ import annotations

from ..core.backend import device_jit
from ..core.kinds import has_window, is_checkpoint
from ..core.layout import (
    ALLOWED,
    BID_KEY,
    CNT_BLOCK_FREE_TOP,
    EV_STORED_BLOCK,
    EV_STORED_LIFE_CYCLE,
    LOCK,
    NULL,
    ONE_HOLDER,
    ONE_LOCK,
    OUT_BLOCK,
    OUT_IS_NEW,
    PAGE_HOLDS,
    PAGE_UNCOMMITTED,
    POLICY_COMMIT_MIN_SNAPSHOT,
    POLICY_STABLE_PAGES,
    Q_CAPACITY,
    Q_COMMITTED,
    Q_COMMITTED_BLOCKS,
    Q_COMMIT_STATE,
    Q_HISTORY,
    Q_NUM_BLOCKS,
    Q_SCOPE_ID,
    Q_SCOPE_KEY,
    Q_SSM_KIND,
    Q_SSM_PAGE,
    Q_VIRTUAL_STOPPED,
    USER_STOP,
    VIRTUAL_STOP,
)
from .link import helper
from .blocks import add_or_get, adopt_pages_from, get_or_create_root
from .evict import install_page, make_room, schedule
from .index import bucket_of, is_attached, num_tokens, sibling_bucket_of
from .keys import combine, content_hash
from .prefetch import prefetch1
from .lifecycle import is_stale, stale_end, stale_start
from .log import announce
from .pages import alloc_page, can_replace_page, copy_page_data, coverage, page_of, page_state, replace_page
from .seq_hold import commit_page, drop_entry, hold, ref_block, release, set_entry, set_tree, to_gpu, unref_block
from .seq_resize import resize


@helper
def on_stop_committing(S, Q):
    """Release held pages of uncommitted stale blocks kept only for committing."""
    L = S.lc_kind.shape[0]
    h = Q.scalars[Q_HISTORY]
    for lc in range(L):
        if is_checkpoint(S.lc_kind[lc]):
            continue
        lo = max(stale_start(S, lc, h), Q.scalars[Q_COMMITTED_BLOCKS])
        hi = min(stale_end(S, lc, h), Q.scalars[Q_NUM_BLOCKS])
        for o in range(lo, hi):
            drop_entry(S, Q, o, lc)


@helper(inline=False)
def tree_parent(S, Q, o, out):
    """The tree parent of ordinal ``o``: the scope's root or committed block
    ``o - 1``. A committed ancestor chain that was detached meanwhile is
    re-attached first (as newer reference versions do), so a new block
    never lands under an orphan.

    The root is looked up only where it becomes the parent: an attached
    block's ancestors are all attached (a root goes with its last child), so
    an attached ``o - 1`` or ``k - 1`` implies the root exists and the
    lookup, a bucket walk per block, would only confirm it."""
    if o > 0 and is_attached(S, Q.tree[o - 1]):
        return Q.tree[o - 1]
    k = max(o - 1, 0)  # find the first detached ancestor (none for o == 0)
    while k > 0 and not is_attached(S, Q.tree[k - 1]):
        k -= 1
    if k == 0:
        parent = get_or_create_root(S, Q.scalars[Q_SCOPE_ID], Q.scalars[Q_SCOPE_KEY], Q.scope_digest)
    else:
        parent = Q.tree[k - 1]
    T = S.tokens.shape[1]
    while k < o:
        tb = Q.tree[k]
        add_or_get(S, parent, S.tokens[tb], 0, T, out)
        nb = out[OUT_BLOCK]
        if nb != tb:
            adopt_pages_from(S, nb, tb)
            set_tree(S, Q, k, nb)
            if out[OUT_IS_NEW] == 1:
                announce(S, nb, EV_STORED_BLOCK, NULL)
        parent = nb
        k += 1
    return parent


@helper(inline=False)
def copy_page_to_tree(S, Q, tb, o, lc, src, cov):
    """§2.5.2: a copy of ``src`` with coverage ``cov`` into the slot of
    ``tb`` (the sequence's block ``o``, whose priority the page gets) when
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
    p = alloc_page(S, lc, level, Q.priority[o, lc])
    copy_page_data(S, src, p)
    return install_page(S, tb, lc, p, cov)


@helper(inline=False)
def snapshot_ssm(S, Q, tb, o, c, move):
    """§2.5.3: checkpoint the live SSM state on ``tb``, the sequence's block
    ``o``, covering its first ``c`` tokens."""
    L = S.lc_kind.shape[0]
    for lc in range(L):
        if not is_checkpoint(S.lc_kind[lc]):
            continue
        if coverage(S, tb, lc) >= c:
            return  # an equal or later checkpoint is there already
        live = Q.scalars[Q_SSM_PAGE]
        if move:  # is_end: hand the live state itself over
            Q.scalars[Q_SSM_PAGE] = NULL
            kind = Q.scalars[Q_SSM_KIND]
            Q.scalars[Q_SSM_KIND] = 0
            S.pages[live, PAGE_HOLDS] -= ONE_HOLDER + (ONE_LOCK if kind == LOCK else 0)
            commit_page(S, live, c)
            replace_page(S, tb, lc, live)
            schedule(S, live)
        else:
            copy_page_to_tree(S, Q, tb, o, lc, live, c)


def _no_prefetch_blocks(S, Q, f0, f1):
    """``prefetch_blocks`` on ``cuda``: nothing. A GPU hides memory latency
    with other threads, and the sequence kernels' one thread would only hash
    the blocks twice."""


@helper(inline=False, cuda=lambda: device_jit("cuda")(_no_prefetch_blocks))
def prefetch_blocks(S, Q, f0, f1):
    """Ask for the index lines the inserts of full blocks ``f0..f1 - 1`` will
    read first: each block's bucket head in the child index, and in the
    sibling index the head for its parent and first token. In tables larger
    than the caches each is a miss, and one block's insert cannot start
    before the one before it is done; the keys follow from the tokens alone,
    and the parents' rows are those the free-row stack will give, so the
    misses of a chunk overlap instead. Only hints: a guess that turns out
    wrong (a block that exists already, a detached chain re-attached on the
    way) costs a useless fetch, never a wrong result."""
    T = S.tokens.shape[1]
    if f0 == 0:
        key = Q.scalars[Q_SCOPE_KEY]  # the scope root's key
        parent = NULL  # its row is found on the way
    else:
        parent = Q.tree[f0 - 1]
        if parent == NULL:
            return
        key = S.block_ids[parent, BID_KEY]
    top = S.counters[CNT_BLOCK_FREE_TOP]
    for o in range(f0, f1):
        key = combine(key, content_hash(Q.tokens, o * T, T))
        prefetch1(S.buckets, bucket_of(S, key))
        if parent != NULL:
            prefetch1(S.sibling_buckets, sibling_bucket_of(S, parent, Q.tokens[o * T]))
        k = top - 1 - (o - f0)  # the row block o takes if it is new
        parent = S.block_free[k] if k >= 0 else NULL


@helper(inline=False)
def commit_block(S, Q, o, last, ssm, move_ssm, out):
    """§2.5.1."""
    T = S.tokens.shape[1]
    L = S.lc_kind.shape[0]
    n = min(T, Q.scalars[Q_COMMITTED] - o * T)
    full = n == T
    parent = tree_parent(S, Q, o, out)
    add_or_get(S, parent, Q.tokens, o * T, n, out)
    tb = out[OUT_BLOCK]
    is_new = out[OUT_IS_NEW] == 1
    ref_block(S, tb)  # pinned for this call, even if it becomes an orphan
    did = False
    if is_new:
        for lc in range(L):
            p = Q.pages[o, lc]
            if is_checkpoint(S.lc_kind[lc]) or p == NULL or page_state(S, p) != PAGE_UNCOMMITTED:
                continue
            commit_page(S, p, n)
            replace_page(S, tb, lc, p)  # replaces any narrower page tb adopted
        announce(S, tb, EV_STORED_BLOCK, NULL)
        did = True
    elif num_tokens(S, tb) == T and full:  # rebase
        stable = S.policy[POLICY_STABLE_PAGES] == 1
        for lc in range(L):
            p = Q.pages[o, lc]
            if is_checkpoint(S.lc_kind[lc]) or p == NULL:
                continue
            e = page_of(S, tb, lc)
            if e != NULL and coverage(S, tb, lc) < n:
                e = NULL  # never adopt a tree page narrower than the block
            if e == NULL:
                commit_page(S, p, n)
                replace_page(S, tb, lc, p)
                announce(S, tb, EV_STORED_LIFE_CYCLE, lc)
            elif not stable:  # stable: the engine reads our page; it stays ours, uncommitted
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
            snapshot_ssm(S, Q, tb, o, n, move_ssm)
        h = Q.scalars[Q_HISTORY]
        for lc in range(L):
            if not is_checkpoint(S.lc_kind[lc]) and is_stale(S, lc, h, o):
                drop_entry(S, Q, o, lc)  # the tree keeps the page, now evictable
    unref_block(S, tb)
    if last or Q.scalars[Q_COMMIT_STATE] == VIRTUAL_STOP:
        Q.scalars[Q_COMMIT_STATE] = USER_STOP
        on_stop_committing(S, Q)


@helper(inline=False)
def snapshot_partial(S, Q, o, ssm, out):
    """§2.5.2: copies of the partial block's pages go into the tree (an exact
    partial block, a longer covering sibling, or a new one); the sequence's
    block stays uncommitted."""
    T = S.tokens.shape[1]
    L = S.lc_kind.shape[0]
    n = Q.scalars[Q_COMMITTED] - o * T
    parent = tree_parent(S, Q, o, out)
    add_or_get(S, parent, Q.tokens, o * T, n, out)
    tb = out[OUT_BLOCK]
    is_new = out[OUT_IS_NEW] == 1
    ref_block(S, tb)
    for lc in range(L):
        p = Q.pages[o, lc]
        Q.counts[lc] = 0
        if not is_checkpoint(S.lc_kind[lc]) and p != NULL and coverage(S, tb, lc) < n:
            if copy_page_to_tree(S, Q, tb, o, lc, p, n):
                Q.counts[lc] = 1  # attached
    if ssm:
        snapshot_ssm(S, Q, tb, o, n, False)
    if not is_attached(S, tb):
        pass  # making room for a copy evicted the block's own subtree: nothing to announce
    elif is_new:
        announce(S, tb, EV_STORED_BLOCK, NULL)
    else:
        for lc in range(L):
            if Q.counts[lc] == 1:
                announce(S, tb, EV_STORED_LIFE_CYCLE, lc)
    unref_block(S, tb)


@helper(inline=False)
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


@helper
def raise_history(S, Q, h):
    """The history raised to ``h`` as ``resize`` at the same capacity does
    it. Only a sliding window's blocks go stale, and only scratch slots are
    released as the history passes them: without either (full attention and
    recurrent state, a decode step's common case) the history is all that
    changes, and the general walk is skipped."""
    for lc in range(S.lc_kind.shape[0]):
        if has_window(S.lc_kind[lc]) or Q.scratch_count[lc] != 0:
            resize(S, Q, Q.scalars[Q_CAPACITY], h)
            return
    Q.scalars[Q_HISTORY] = h


@helper(inline=False)
def commit(S, Q, n0, k, is_end, out):
    """§2.5 ``commit``: the host already validated, raised the history and
    appended the tokens to ``Q.tokens``."""
    T = S.tokens.shape[1]
    L = S.lc_kind.shape[0]
    has_ssm = False
    for lc in range(L):
        if is_checkpoint(S.lc_kind[lc]):
            has_ssm = True
    n1 = n0 + k
    if Q.scalars[Q_HISTORY] < n1:  # raising the history never allocates
        raise_history(S, Q, n1)
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
        if f1 - f0 > 1:
            prefetch_blocks(S, Q, f0, f1)
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

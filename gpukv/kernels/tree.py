"""The serial tree kernel: one tree operation per launch (docs/semantics.md §2.1, §2.2, §2.7).

The host facade (``gpukv/tree.py``) packs an operation's arguments into
``args`` (one layout per operation in ``core/layout.py``) and launches
``run(S, op, args, toks, out)``; results come back in ``out`` (``TREE_OUT``).
Each opcode calls one helper: the algorithms live in the concern modules
(``index``, ``pages``, ``log``, ``blocks``, ``evict``) and in the two
operations defined here that compose several of them. Tree mutation runs
serially: one call on ``cpu``, one thread on ``cuda``.
"""

from __future__ import annotations

import functools

from ..core.backend import cpu_kernel, launch_stream
from ..core.config import DEFAULT_PRIORITY
from ..core.layout import (
    ADD_NUM_TOKENS,
    ADD_PAGE_BLOCK,
    ADD_PAGE_COVERAGE,
    ADD_PAGE_LIFE_CYCLE,
    ADD_PAGE_PRIORITY,
    ADD_PARENT,
    ADD_ROOT_DIGEST,
    ADD_SCOPE_ID,
    ADD_SCOPE_KEY,
    ANNOUNCE_BLOCK,
    ANNOUNCE_KIND,
    ANNOUNCE_LIFE_CYCLE,
    BLK_PARENT,
    BLK_REFS,
    BLOCK_ARG_BLOCK,
    BLOCK_ARG_LIFE_CYCLE,
    DROP_PAGE,
    DROP_SERIAL,
    EV_STORED_BLOCK,
    EVICT_LEVEL,
    EVICT_LIFE_CYCLE,
    EVICT_NEED,
    INSERT_NUM_TOKENS,
    INSERT_ROOT_DIGEST,
    INSERT_SCOPE_ID,
    INSERT_SCOPE_KEY,
    NULL,
    OUT_BLOCK,
    OUT_INSERTED,
    OUT_IS_NEW,
    OUT_ROOT,
    PAGE_ARG_PAGE,
    PAGE_COMMITTED,
    PAGE_SERIAL,
    UNLINK_BLOCK,
    UNLINK_EXPECTED,
    UNLINK_LIFE_CYCLE,
)
from .blocks import (
    add_or_get,
    clear_stale_blocks_after_page_unlink,
    clear_tree,
    get_or_create_root,
    maybe_free_orphan,
    page_death,
    remove_subtree,
)
from .evict import begin_launch, install_page, lru_update, make_room, schedule
from .index import is_root
from .link import helper, link
from .log import announce
from .pages import alloc_page, can_replace_page, page_holders, page_of, page_state, replace_page, set_page_coverage, unlink_page

__all__ = ["build_tree_kernel"]  # with the OP_* codes

OP_ADD = 1  # ADD_ARGS -> out: block, is_new, root
OP_ADD_PAGE = 2  # ADD_PAGE_ARGS -> out[OUT_BLOCK] = the page (NULL if not wider)
OP_UNLINK_PAGE = 3  # UNLINK_ARGS -> out[OUT_BLOCK] = the page unlinked, or NULL
OP_PAGE_DEATH = 4  # PAGE_ARGS
OP_REMOVE_SUBTREE = 5  # BLOCK_ARGS (block)
OP_CLEAR = 6
OP_CLEAR_STALE = 7  # BLOCK_ARGS (block, life cycle)
OP_RELEASE_REF = 8  # BLOCK_ARGS (block)
OP_INSERT = 9  # INSERT_ARGS; toks = the sequence -> out[OUT_INSERTED] = blocks inserted
OP_ANNOUNCE = 10  # ANNOUNCE_ARGS (kind: EV_STORED_BLOCK or EV_STORED_LIFE_CYCLE)
OP_EVICT = 11  # EVICT_ARGS -> out[OUT_BLOCK] = 1 when there are that many free slots
OP_DROP_PLANNED = 13  # DROP_ARGS


@helper(inline=False)
def add_block(S, args, toks, out):
    """OP_ADD: the child of ``parent`` (the scope's root when NULL, created if
    missing) holding ``toks[:n]``. The host validated the parent and stocked
    the free lists, so neither step can fail half way."""
    root = get_or_create_root(S, args[ADD_SCOPE_ID], args[ADD_SCOPE_KEY],
                              args[ADD_ROOT_DIGEST:ADD_ROOT_DIGEST + 4])
    out[OUT_ROOT] = root
    parent = root if args[ADD_PARENT] == NULL else args[ADD_PARENT]
    if root != NULL:
        add_or_get(S, parent, toks, 0, args[ADD_NUM_TOKENS], out)


@helper(inline=False)
def add_page(S, r, lc, cov, priority):
    """A fresh GPU page of coverage ``cov`` in ``r``'s slot when strictly wider
    than the incumbent (evicting to make room); the page, or NULL."""
    if not (can_replace_page(S, r, lc, cov) and make_room(S, lc, 0, 1)):
        return NULL
    p = alloc_page(S, lc, 0, priority)
    return p if install_page(S, r, lc, p, cov) else NULL


@helper(inline=False)
def insert_sequence(S, args, toks, out):
    """OP_INSERT: a whole sequence in one launch. Each block is added (or got)
    and given a fresh page of full coverage in every life cycle where that is
    strictly wider; stops early when a pool runs dry. Then the pages are
    released as a finished sequence releases them: the last block first, so
    leaves are evicted before their ancestors."""
    T = S.tokens.shape[1]
    L = S.lc_kind.shape[0]
    parent = get_or_create_root(S, args[INSERT_SCOPE_ID], args[INSERT_SCOPE_KEY],
                                args[INSERT_ROOT_DIGEST:INSERT_ROOT_DIGEST + 4])
    n_tok = args[INSERT_NUM_TOKENS]
    j = 0
    while parent != NULL and j * T < n_tok:
        n = min(T, n_tok - j * T)
        add_or_get(S, parent, toks, j * T, n, out)
        r = out[OUT_BLOCK]
        if r == NULL:
            break
        for lc in range(L):
            if can_replace_page(S, r, lc, n):
                p = alloc_page(S, lc, 0, DEFAULT_PRIORITY)
                if p == NULL:
                    for done in range(lc):  # pages put in above are never scheduled: candidates at tick NULL
                        q = page_of(S, r, done)
                        if q != NULL:
                            lru_update(S, q)
                    r = NULL
                    break
                set_page_coverage(S, p, n)
                replace_page(S, r, lc, p)
        if r != NULL and out[OUT_IS_NEW] == 1:
            announce(S, r, EV_STORED_BLOCK, NULL)
        out[OUT_INSERTED] = j + 1 if r != NULL else j
        if r == NULL:
            break
        parent = r
        if n < T:
            break
        j += 1
    while parent != NULL and not is_root(S, parent):
        for k in range(L):
            p = page_of(S, parent, L - 1 - k)
            if p != NULL:
                schedule(S, p)
        parent = S.blocks[parent, BLK_PARENT]


@helper
def release_ref(S, r):
    """A sequence's reference on block row ``r`` ends (an orphan may go)."""
    S.blocks[r, BLK_REFS] -= 1
    maybe_free_orphan(S, r)


@helper(inline=False)
def drop_planned(S, p, serial):
    """The last plan naming page ``p`` was carried out (the host counts the
    plans, ``tree.BlockTree.drop_planned``): the page dies when nobody holds
    it. Nothing happens when the row holds another page now (``serial``) or
    the page died meanwhile."""
    if S.pages[p, PAGE_SERIAL] != serial or page_state(S, p) != PAGE_COMMITTED:
        return
    if page_holders(S, p) == 0:
        page_death(S, p)


@helper(inline=False)
def tree_step(S, op, args, toks, out):
    if op == OP_ADD:
        add_block(S, args, toks, out)
    elif op == OP_ADD_PAGE:
        out[OUT_BLOCK] = add_page(S, args[ADD_PAGE_BLOCK], args[ADD_PAGE_LIFE_CYCLE], args[ADD_PAGE_COVERAGE],
                                  args[ADD_PAGE_PRIORITY])
    elif op == OP_UNLINK_PAGE:
        out[OUT_BLOCK] = unlink_page(S, args[UNLINK_BLOCK], args[UNLINK_LIFE_CYCLE], args[UNLINK_EXPECTED])
    elif op == OP_PAGE_DEATH:
        page_death(S, args[PAGE_ARG_PAGE])
    elif op == OP_REMOVE_SUBTREE:
        remove_subtree(S, args[BLOCK_ARG_BLOCK])
    elif op == OP_CLEAR:
        clear_tree(S)
    elif op == OP_CLEAR_STALE:
        clear_stale_blocks_after_page_unlink(S, args[BLOCK_ARG_BLOCK], args[BLOCK_ARG_LIFE_CYCLE])
    elif op == OP_INSERT:
        insert_sequence(S, args, toks, out)
    elif op == OP_RELEASE_REF:
        release_ref(S, args[BLOCK_ARG_BLOCK])
    elif op == OP_ANNOUNCE:
        announce(S, args[ANNOUNCE_BLOCK], args[ANNOUNCE_KIND], args[ANNOUNCE_LIFE_CYCLE])
    elif op == OP_EVICT:
        out[OUT_BLOCK] = 1 if make_room(S, args[EVICT_LIFE_CYCLE], args[EVICT_LEVEL], args[EVICT_NEED]) else 0
    elif op == OP_DROP_PLANNED:
        drop_planned(S, args[DROP_PAGE], args[DROP_SERIAL])


@helper(inline=False)
def tree_op(S, op, args, toks, out):
    begin_launch(S)
    tree_step(S, op, args, toks, out)


@functools.lru_cache(maxsize=None)
def build_tree_kernel(target: str):
    """``run(S, op, args, toks, out)``: one tree operation, serially."""
    k = link(target)
    if target == "cpu":
        return cpu_kernel(k.kernel(_run_cpu))

    from numba import cuda

    kernel = cuda.jit(k.kernel(_run_cuda, cuda=cuda))

    def run(S, op, args, toks, out):
        kernel[1, 1, launch_stream()](S, op, args, toks, out)

    return run


# Kernel entry points: module level so Numba's disk cache hits (link.py).
def _run_cpu(S, op, args, toks, out):
    tree_op(S, op, args, toks, out)


def _run_cuda(S, op, args, toks, out):
    if cuda.grid(1) == 0:  # noqa: F821 (bound by Linked.kernel)
        tree_op(S, op, args, toks, out)

"""The serial sequence kernel: a batch of ``KVCache`` calls per launch (docs/semantics.md §2.5-§2.10).

A ``KVCache`` keeps its state in small device arrays (``SeqTables``): per
ordinal and life cycle the page it refers to and how (held or locked), per
ordinal the tree block it is committed as, its committed tokens, and a row of
scalars (``SEQ_SCALARS``). Each public call (create with reuse, resume,
suspend, resize, commit, stop, close) is one launch of the kernel below, so no
call loops over blocks in Python. Each opcode calls one helper of the concern
modules: ``seq_hold`` (holding and releasing pages), ``seq_resume`` (reuse
setup, resume, suspend), ``seq_resize``, ``seq_commit`` (commits and
snapshots), ``seq_close``. Page data copies the kernel decides on are recorded
and carried out by the host right after the launch, in order. Allocations make
room by eviction (``evict.py``); the all-or-nothing ones first check that
enough could be freed.
"""

from __future__ import annotations

import functools
from collections import namedtuple

from ..core.backend import cpu_kernel, launch_stream
from ..core.layout import (  # noqa: F401 (the scalars and reference kinds are re-exported for the host)
    ACTIVE,
    ALLOWED,
    CLOSE_EVICT_FIRST,
    CLOSED,
    COMMIT_COUNT,
    COMMIT_FIRST,
    COMMIT_IS_END,
    HOLD,
    LOCK,
    Q_CAPACITY,
    Q_COMMIT_STATE,
    Q_COMMITTED,
    Q_COMMITTED_BLOCKS,
    Q_EVICT_FIRST,
    Q_HISTORY,
    Q_NEVER_RESUMED,
    Q_NUM_BLOCKS,
    Q_RESULT,
    Q_SCOPE_ID,
    Q_SCOPE_KEY,
    Q_SSM_KIND,
    Q_SSM_PAGE,
    Q_STATUS,
    Q_VIRTUAL_STOPPED,
    Q_WIDTH,
    RESIZE_CAPACITY,
    RESIZE_HISTORY,
    SCRATCH,
    SETUP_NUM_BLOCKS,
    SETUP_NUM_TOKENS,
    SUSPENDED,
    USER_STOP,
    VIRTUAL_STOP,
)
from .evict import begin_launch
from .link import helper, link
from .seq_close import close
from .seq_commit import commit, stop_committing
from .seq_resize import resize
from .seq_resume import resume, setup_reuse, suspend

# Operations.
SEQ_SETUP_REUSE = 1  # SETUP_ARGS: matched tokens N, blocks in Q.path[:count]
SEQ_RESUME = 2
SEQ_SUSPEND = 3
SEQ_RESIZE = 4  # RESIZE_ARGS
SEQ_COMMIT = 5  # COMMIT_ARGS
SEQ_STOP = 6
SEQ_CLOSE = 7  # CLOSE_ARGS

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
        "args",  # int64 [SEQ_ARGS_WIDTH]
        "out",  # int64 [TREE_OUT.width]: scratch for tree calls
        "counts",  # int64 [L]: scratch for all-or-nothing allocation checks
        "scope_digest",  # int64 [4]: the SHA-256 key of the sequence's root
        "scratch",  # int64 [L, k]: SWA scratch slots (locked uncommitted pages) shared by scratch blocks
        "scratch_count",  # int64 [L]
    ],
)


@helper(inline=False)
def seq_step(S, Q, op):
    out = Q.out
    Q.scalars[Q_RESULT] = 1
    if op == SEQ_SETUP_REUSE:
        setup_reuse(S, Q, Q.args[SETUP_NUM_TOKENS], Q.args[SETUP_NUM_BLOCKS])
    elif op == SEQ_RESUME:
        resume(S, Q)
    elif op == SEQ_SUSPEND:
        suspend(S, Q)
    elif op == SEQ_RESIZE:
        resize(S, Q, Q.args[RESIZE_CAPACITY], Q.args[RESIZE_HISTORY])
    elif op == SEQ_COMMIT:
        commit(S, Q, Q.args[COMMIT_FIRST], Q.args[COMMIT_COUNT], Q.args[COMMIT_IS_END] == 1, out)
    elif op == SEQ_STOP:
        stop_committing(S, Q, out)
    elif op == SEQ_CLOSE:
        close(S, Q, Q.args[CLOSE_EVICT_FIRST], out)


SeqPool = namedtuple(
    "SeqPool",
    [
        # Every cache of a manager has a slot (its per-cache rows) and a
        # segment of block rows, ``seg[slot] = (base, blocks)``: its SeqTables
        # are these arrays' rows ``[base, base + blocks)`` and row ``slot``.
        "pages",  # int64 [pool blocks, L]
        "kinds",  # int64 [pool blocks, L]
        "tree",  # int64 [pool blocks]
        "tokens",  # int32 [pool blocks * T]
        "priority",  # int64 [pool blocks, L]
        "path",  # int64 [pool blocks]
        "scalars",  # int64 [slots, Q_WIDTH]
        "args",  # int64 [slots, SEQ_ARGS_WIDTH]
        "out",  # int64 [slots, TREE_OUT.width]
        "counts",  # int64 [slots, L]
        "scope_digest",  # int64 [slots, 4]
        "scratch",  # int64 [slots, L, k]
        "scratch_count",  # int64 [slots, L]
        "seg",  # int64 [slots, 2]: base row and block rows of the slot's segment
    ],
)


# The work list of one launch (``work``: int64 [n + 1, BATCH_WIDTH]): row i
# names item i's slot and op, and where its input starts in the flat token
# and path arrays; row n only ends the last item's input.
BATCH_SLOT = 0
BATCH_OP = 1
BATCH_TOKENS = 2
BATCH_PATH = 3
BATCH_WIDTH = 4


@helper(inline=False)
def seq_batch(S, P, work, tokens, path):
    """The calls ``work[i, BATCH_OP]`` on the caches in slots
    ``work[i, BATCH_SLOT]``, in order, as one launch. Item ``i`` first gets
    its input copied in: tokens ``tokens[work[i, BATCH_TOKENS]:work[i + 1,
    BATCH_TOKENS]]`` (a commit's at its first position, reuse setup's from
    0) and matched blocks from ``path`` likewise."""
    T = S.tokens.shape[1]
    for i in range(work.shape[0] - 1):
        begin_launch(S)  # each item judges the host tier's room afresh, as its own launch would
        # Slot s's SeqTables: views of its rows of the pool, the arrays the
        # single-cache code was written for.
        s = work[i, BATCH_SLOT]
        a = P.seg[s, 0]
        b = a + P.seg[s, 1]
        Q = SeqTables(
            P.pages[a:b], P.kinds[a:b], P.tree[a:b], P.tokens[a * T:b * T], P.scalars[s], P.priority[a:b],
            P.path[a:b], P.args[s], P.out[s], P.counts[s], P.scope_digest[s], P.scratch[s], P.scratch_count[s],
        )
        op = work[i, BATCH_OP]
        at = Q.args[COMMIT_FIRST] if op == SEQ_COMMIT else 0
        t0 = work[i, BATCH_TOKENS]
        for j in range(work[i + 1, BATCH_TOKENS] - t0):
            Q.tokens[at + j] = tokens[t0 + j]
        p0 = work[i, BATCH_PATH]
        for j in range(work[i + 1, BATCH_PATH] - p0):
            Q.path[j] = path[p0 + j]
        seq_step(S, Q, op)


@functools.lru_cache(maxsize=None)
def build_seq_kernel(target: str):
    """``run(S, P, work, tokens, path)``: a batch of sequence calls, serially,
    in one launch (see ``seq_batch``)."""
    k = link(target)
    if target == "cpu":
        return cpu_kernel(k.kernel(_run_cpu))

    from numba import cuda

    kernel = cuda.jit(k.kernel(_run_cuda, cuda=cuda))

    def run(S, P, work, tokens, path):
        kernel[1, 1, launch_stream()](S, P, work, tokens, path)

    return run


# Kernel entry points: module level so Numba's disk cache hits (link.py).
def _run_cpu(S, P, work, tokens, path):
    seq_batch(S, P, work, tokens, path)


def _run_cuda(S, P, work, tokens, path):
    if cuda.grid(1) == 0:  # noqa: F821 (bound by Linked.kernel)
        seq_batch(S, P, work, tokens, path)

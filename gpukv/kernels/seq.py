"""The serial sequence kernel: one ``KVCache`` call per launch (docs/semantics.md §2.5-§2.10).

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

from ..core.backend import cpu_kernel
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


@helper(inline=False)
def seq_op(S, Q, op):
    begin_launch(S)
    seq_step(S, Q, op)


def build_seq(target: str):
    """The sequence kernel's body, ``seq_op(S, Q, op)``, compiled for ``target``."""
    return link(target).seq_op


@functools.lru_cache(maxsize=None)
def build_seq_kernel(target: str):
    """``run(S, Q, op)``: one sequence operation, serially."""
    k = link(target)
    if target == "cpu":
        return cpu_kernel(k.kernel(_run_cpu))

    from numba import cuda

    kernel = cuda.jit(k.kernel(_run_cuda, cuda=cuda))

    def run(S, Q, op):
        kernel[1, 1](S, Q, op)

    return run


# Kernel entry points: module level so Numba's disk cache hits (link.py).
def _run_cpu(S, Q, op):
    seq_op(S, Q, op)


def _run_cuda(S, Q, op):
    if cuda.grid(1) == 0:  # noqa: F821 (bound by Linked.kernel)
        seq_op(S, Q, op)

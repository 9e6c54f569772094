"""The serial sequence kernels: a batch of ``KVCache`` calls per launch (docs/semantics.md §2.5-§2.10).

A ``KVCache`` keeps its state in small device arrays (``SeqTables``): per
ordinal and life cycle the page it refers to and how (held or locked), per
ordinal the tree block it is committed as, its committed tokens, and a row of
scalars (``SEQ_SCALARS``). Each public call (create with reuse, resume,
suspend, resize, admission, commit, stop, close) is one launch of one of the
two kernels below, the sizing kernel (reuse setup, resume, suspend, resize,
admission) or the commit kernel (commit, stop, close), so no call loops over
blocks in Python. Each opcode calls one helper of the concern modules:
``seq_hold`` (holding and releasing pages), ``seq_resume`` (reuse setup,
resume, suspend, admission),
``seq_resize``, ``seq_commit`` (commits and snapshots), ``seq_close``. Page data copies the kernel decides on are recorded
and carried out by the host right after the launch, in order. Allocations make
room by eviction (``evict.py``); the all-or-nothing ones first check that
enough could be freed.
"""

from __future__ import annotations

import functools
from collections import namedtuple

from ..core.backend import cpu_kernel, launch_stream
from ..core.layout import (
    ADMIT_CAPACITY,
    APPEND_COUNT,
    APPEND_FIRST,
    APPEND_IS_END,
    APPEND_ROOM,
    BATCH_ARGS,
    BATCH_OP,
    BATCH_PATH,
    BATCH_SLOT,
    BATCH_TOKENS,
    CLOSE_EVICT_FIRST,
    Q_CAPACITY,
    Q_HISTORY,
    Q_RESULT,
    RESIZE_CAPACITY,
    RESIZE_HISTORY,
    SEQ_ADMIT,
    SEQ_APPEND,
    SEQ_ARGS_WIDTH,
    SEQ_CLOSE,
    SEQ_RESIZE,
    SEQ_RESUME,
    SEQ_SETUP_MATCHED,
    SEQ_SETUP_REUSE,
    SEQ_STOP,
    SEQ_SUSPEND,
    SETUP_NUM_BLOCKS,
    SETUP_NUM_TOKENS,
)
from .evict import begin_launch
from .link import helper, link
from .seq_close import close
from .seq_commit import commit, stop_committing
from .seq_resize import resize
from .seq_resume import admit, resume, setup_matched, setup_reuse, suspend

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


@helper
def size_step(S, Q, op):
    Q.scalars[Q_RESULT] = 1
    if op == SEQ_SETUP_REUSE:
        setup_reuse(S, Q, Q.args[SETUP_NUM_TOKENS], Q.args[SETUP_NUM_BLOCKS])
    elif op == SEQ_RESUME:
        resume(S, Q)
    elif op == SEQ_SUSPEND:
        suspend(S, Q)
    elif op == SEQ_RESIZE:
        resize(S, Q, Q.args[RESIZE_CAPACITY], Q.args[RESIZE_HISTORY])
    elif op == SEQ_SETUP_MATCHED:
        setup_matched(S, Q, Q.args[SETUP_NUM_TOKENS], Q.args[SETUP_NUM_BLOCKS])
    elif op == SEQ_ADMIT:
        admit(S, Q, Q.args[ADMIT_CAPACITY])


@helper
def commit_step(S, Q, op):
    out = Q.out
    Q.scalars[Q_RESULT] = 1
    if op == SEQ_STOP:
        stop_committing(S, Q, out)
    elif op == SEQ_CLOSE:
        close(S, Q, Q.args[CLOSE_EVICT_FIRST], out)
    elif op == SEQ_APPEND:
        append(S, Q, Q.args[APPEND_FIRST], Q.args[APPEND_COUNT], Q.args[APPEND_IS_END] == 1, Q.args[APPEND_ROOM], out)


@helper
def append(S, Q, n0, k, is_end, room, out):
    """What a step ends with, as one call: the commit of the ``k`` tokens
    whose KV it wrote (a stop when there are none and it ends), then, unless
    it ended, room for ``room`` more tokens (whole blocks, the history as the
    commit leaves it) when the capacity is short. A pool short for the room
    refuses only the room (``Q_RESULT`` 0): the commit stays."""
    if k > 0:
        commit(S, Q, n0, k, is_end, out)
    elif is_end:
        stop_committing(S, Q, out)
    want = n0 + k + room
    if not is_end and want > Q.scalars[Q_CAPACITY]:
        T = S.tokens.shape[1]
        resize(S, Q, (want + T - 1) // T * T, Q.scalars[Q_HISTORY])


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
        "out",  # int64 [slots, TREE_OUT.width]
        "counts",  # int64 [slots, L]
        "scope_digest",  # int64 [slots, 4]
        "scratch",  # int64 [slots, L, k]
        "scratch_count",  # int64 [slots, L]
        "seg",  # int64 [slots, 2]: base row and block rows of the slot's segment
    ],
)


@helper
def slot_tables(P, s, a, b, T, args):
    """Slot ``s``'s SeqTables: views of its rows of the pool ``P`` (a
    ``SeqPool``), its segment being block rows ``[a, b)``, and the call's
    ``args``; the one place they are built, for the kernels (``item_tables``)
    and the host (``CachePool.view``) alike."""
    return SeqTables(
        P.pages[a:b], P.kinds[a:b], P.tree[a:b], P.tokens[a * T:b * T], P.scalars[s], P.priority[a:b],
        P.path[a:b], args, P.out[s], P.counts[s], P.scope_digest[s], P.scratch[s], P.scratch_count[s],
    )


@helper
def item_tables(S, P, work, i, tokens, path):
    """Item ``i`` of the work list: its slot's SeqTables (views of the slot's
    rows of the pool, the arrays the single-cache code was written for), with
    its input copied in: tokens ``tokens[work[i, BATCH_TOKENS]:work[i + 1,
    BATCH_TOKENS]]`` (an append's at its first position, reuse setup's from
    0) and matched blocks from ``path`` likewise."""
    begin_launch(S)  # each item judges the host tier's room afresh, as its own launch would
    T = S.tokens.shape[1]
    s = work[i, BATCH_SLOT]
    a = P.seg[s, 0]
    Q = slot_tables(P, s, a, a + P.seg[s, 1], T, work[i, BATCH_ARGS:BATCH_ARGS + SEQ_ARGS_WIDTH])
    op = work[i, BATCH_OP]
    at = Q.args[APPEND_FIRST] if op == SEQ_APPEND else 0
    t0 = work[i, BATCH_TOKENS]
    for j in range(work[i + 1, BATCH_TOKENS] - t0):
        Q.tokens[at + j] = tokens[t0 + j]
    p0 = work[i, BATCH_PATH]
    for j in range(work[i + 1, BATCH_PATH] - p0):
        Q.path[j] = path[p0 + j]
    return Q


@helper
def size_batch(S, P, work, tokens, path):
    """The sizing calls ``work[i, BATCH_OP]`` on the caches in slots
    ``work[i, BATCH_SLOT]``, in order, as one launch."""
    for i in range(work.shape[0] - 1):
        size_step(S, item_tables(S, P, work, i, tokens, path), work[i, BATCH_OP])


@helper
def commit_batch(S, P, work, tokens, path):
    """The commit kernel's ``size_batch``."""
    for i in range(work.shape[0] - 1):
        commit_step(S, item_tables(S, P, work, i, tokens, path), work[i, BATCH_OP])


SeqKernels = namedtuple("SeqKernels", ["size", "commit"])


@functools.lru_cache(maxsize=None)
def build_seq_kernels(target: str) -> SeqKernels:
    """Each ``run(S, P, work, tokens, path)``: a batch of sequence calls,
    serially, in one launch (``size_batch``, ``commit_batch``)."""
    k = link(target)
    if target == "cpu":
        return SeqKernels(cpu_kernel(k.kernel(_size_cpu)), cpu_kernel(k.kernel(_commit_cpu)))

    from numba import cuda

    def launcher(entry):
        kernel = cuda.jit(k.kernel(entry, cuda=cuda))

        def run(S, P, work, tokens, path):
            kernel[1, 1, launch_stream()](S, P, work, tokens, path)

        return run

    return SeqKernels(launcher(_size_cuda), launcher(_commit_cuda))


# Kernel entry points: module level so Numba's disk cache hits (link.py).
def _size_cpu(S, P, work, tokens, path):
    size_batch(S, P, work, tokens, path)


def _commit_cpu(S, P, work, tokens, path):
    commit_batch(S, P, work, tokens, path)


def _size_cuda(S, P, work, tokens, path):
    if cuda.grid(1) == 0:  # noqa: F821 (bound by Linked.kernel)
        size_batch(S, P, work, tokens, path)


def _commit_cuda(S, P, work, tokens, path):
    if cuda.grid(1) == 0:  # noqa: F821 (bound by Linked.kernel)
        commit_batch(S, P, work, tokens, path)

"""What a call on one cache asks of the tables, written once over ints.

A commit or an append of tokens is checked and sized per cache: whether it
may commit, whether the room it asks for can ever be given, and how much of
the tables its launch may touch (block rows, change-log rows, pages). Each
rule here is a plain function of ints (``numba.extending.register_jitable``):
a per-cache call runs it as Python, and a batched call runs it compiled, once
per cache, in one loop over the caches' scalars, where dozens of NumPy
operations over the caches' columns used to make up most of a decode step's
host time: ``plan_appends`` (which also writes the launch's work list and
adds up its room), ``appended`` (the results after the launch) and
``can_hold_each``.

It lives beside the layout it reads, so the compiled loops are cached with
the kernels and compiled again whenever either changes
(``backend.CACHE_DIR``).
"""

from __future__ import annotations

import numpy as np
from numba.extending import register_jitable

from .backend import cpu_kernel
from .layout import (
    BATCH_ARGS,
    BATCH_OP,
    BATCH_SLOT,
    BATCH_TOKENS,
    BATCH_WIDTH,
    Q_CAPACITY,
    Q_COMMIT_STATE,
    Q_COMMITTED,
    Q_COMMITTED_BLOCKS,
    Q_HISTORY,
    Q_NUM_BLOCKS,
    Q_RESULT,
    Q_WIDTH,
    SEQ_APPEND,
    USER_STOP,
)

# Why a commit is refused (``append_rules``' first value), in the order the
# rules are checked.
COMMIT_OK = 0
COMMIT_STOPPED = 1  # tokens after stop_committing()
COMMIT_PAST_CAPACITY = 2  # more tokens than the capacity holds
COMMIT_NOT_AT_SNAPSHOT = 3  # commit_min_snapshot: the history is at neither end of the commit

# A stop or a close commits at most its pending partial tail: free block rows
# for it and its root.
STOP_ROWS = 2

# The columns of ``plan_appends``' output, one row per cache: ``append_rules``' values in order.
(PLAN_ERROR, PLAN_RUN, PLAN_DONE, PLAN_RESIZING, PLAN_BLOCKS, PLAN_GROWS, PLAN_ROWS, PLAN_ANNOUNCED, PLAN_SPAN,
 PLAN_ALLOCATED, PLAN_ROOM, PLAN_FIRST) = range(12)
PLAN_WIDTH = 12

# What ``plan_appends`` adds up over the caches (its ``totals``): the calls to
# launch (the caches with something to do), free block rows, change-log
# blocks (``log_blocks``) and announced blocks of the launch, the caches
# refused (an error), those that make room, and of those the ones whose
# segment is short of rows or whose priorities are not known that far.
(TOTAL_CALLS, TOTAL_ROWS, TOTAL_LOG_BLOCKS, TOTAL_ANNOUNCED, TOTAL_ERRORS, TOTAL_RESIZING, TOTAL_SHORT_SEGMENTS,
 TOTAL_UNKNOWN_PRIORITIES) = range(8)
TOTALS_WIDTH = 8


@register_jitable
def log_tokens_rows_for(blocks, num_life_cycles):
    """Announced-token rows a commit of up to ``blocks`` blocks may need:
    new blocks, a re-attached chain, and a rebase announcing each life cycle
    (close and stop need fewer: ``stop_announced``)."""
    return (num_life_cycles + 2) * blocks + 2


@register_jitable
def stop_announced(num_blocks):
    """Announced-token rows of a stop or a close of a cache of ``num_blocks`` blocks."""
    return 2 * num_blocks + 2


@register_jitable
def log_blocks(span, scratch, allocated):
    """The blocks one cache's call counts for in a launch's change-log room
    (``Tables.ensure_log``): the ``span`` of its own it may touch, its
    ``scratch`` width and a few blocks' slack, and the GPU pages it may
    allocate (each may evict a victim). Not the cache's whole segment: a
    decode step touches a block or two of each cache, and a log sized for
    every segment grew with the batch's total length."""
    return span + scratch + 8 + allocated


@register_jitable
def can_hold(hold, T, have, blocks, history, max_blocks):
    """Whether a cache of ``have`` blocks may grow to ``blocks`` at history
    ``history``: False where some life cycle would need more new pages than
    its whole GPU pool has, or ``blocks`` passes ``max_blocks``. ``hold``:
    one row ``(window, sink blocks, GPU pool pages)`` per life cycle whose
    new blocks need pages of their own (``cache_pool.hold_rules``): full
    attention (window 0) one per new block past ``have``, a sliding window
    one per new block past its stale range (``LifeCycle.stale_range``)."""
    if blocks > max_blocks:
        return False
    for k in range(len(hold)):
        window, sinks, pool = hold[k][0], hold[k][1], hold[k][2]
        first_new = have
        if window:
            start = min(-(-history // T), sinks)
            first_new = max(have, max(start, (history + 1 - window) // T))
        if blocks - first_new > pool:
            return False
    return True


@register_jitable
def append_rules(n0, state, cap, h, full, nb, seen, count, end, room, held, T, L, min_snapshot, hold, max_blocks,
                 scratch):
    """The checks and the table room of an append of ``count`` tokens, then
    room for ``room`` more unless it ends (``end``), to a cache whose
    scalars are ``n0`` committed tokens, commit state ``state``, capacity
    ``cap``, history ``h``, ``full`` committed and ``nb`` held blocks, whose
    chain was last seen whole at ``seen`` (``CachePool.attached_at``; the
    count is ``held`` now). A commit is an append of room 0. Returns, in the
    order of the ``PLAN_*`` columns:

    - ``error``: a ``COMMIT_*`` code, the first rule broken;
    - ``run``: whether there is anything to launch (tokens, an end, or room
      to make);
    - ``done``: False where the room is refused before the launch (no pool
      could ever give it; the commit goes ahead);
    - ``resizing``: whether the launch makes room;
    - ``blocks``: the blocks the cache holds once the room is made (its
      segment's rows and the priorities it needs);
    - ``grows``: whether the commit adds to the tree, then ``rows``,
      ``announced``, ``span`` and ``allocated`` as
      ``CacheCalls._reserve_and_launch`` takes them;
    - ``room``: the kernel's room argument (0 unless resizing), and ``n0``.

    Only a commit that completes a block, snapshots a partial one or ends the
    sequence adds to the tree: for it the new blocks and, unless the
    committed chain is known whole in the tree (``seen == held``), a
    re-attached chain (the whole committed chain, in case it was detached
    meanwhile), announcements per life cycle; for a stop its pending tail.
    Most decode commits complete no block and reserve nothing: a decode step
    over a large batch reserves no block rows or log tokens for the chains
    its caches already committed. The rest only raise their history: per
    life cycle at most the blocks that many tokens make stale."""
    n1 = n0 + count
    some = count > 0
    error = COMMIT_OK
    if some and state == USER_STOP:
        error = COMMIT_STOPPED
    elif some and n1 > cap:
        error = COMMIT_PAST_CAPACITY
    elif some and min_snapshot and h != n0 and h != n1:
        error = COMMIT_NOT_AT_SNAPSHOT
    want = n1 + room
    blocks = max(nb, (want + (T - 1)) // T)  # once the room is made
    # A room no pool could ever give is not asked for, as resize refuses it
    # before the launch; the commit goes ahead.
    resizing = want > cap and not end
    can_grow = resizing and can_hold(hold, T, nb, blocks, max(h, n1), max_blocks)  # asked only when it matters
    done = can_grow or not resizing
    resizing = can_grow
    grows = n1 // T > full or end or (min_snapshot and n1 % T != 0)
    committed = (n1 + (T - 1)) // T if some else nb
    whole = some and seen == held
    chain = committed - full if whole else committed  # the blocks a commit that grows may write
    span = count // T + 2  # the blocks the tokens make stale
    rows = 0
    announced = 0
    if grows:
        rows = chain + 2 if some else STOP_ROWS
        announced = log_tokens_rows_for(chain, L) if some else stop_announced(nb)
        span = chain + span if whole else committed
    new = blocks - nb
    allocated = 2 * some + (new + scratch + 1 if resizing else 0)
    return (error, some or end or resizing, done, resizing, blocks, grows, rows, announced, span + new, allocated,
            room if resizing else 0, n0)


def _plan_appends(S, attached_at, seg, known, slots, offsets, end, room, held, T, L, min_snapshot, hold, max_blocks,
                  scratch, out, work, totals):
    n = slots.shape[0]
    calls = rows = blocks = announced = errors = resizing = short = unknown = 0
    for i in range(n):
        s = slots[i]
        r = append_rules(S[s, Q_COMMITTED], S[s, Q_COMMIT_STATE], S[s, Q_CAPACITY], S[s, Q_HISTORY],
                         S[s, Q_COMMITTED_BLOCKS], S[s, Q_NUM_BLOCKS], attached_at[s], offsets[i + 1] - offsets[i],
                         end[i] != 0, room[i], held, T, L, min_snapshot, hold, max_blocks, scratch)
        (out[i, PLAN_ERROR], out[i, PLAN_RUN], out[i, PLAN_DONE], out[i, PLAN_RESIZING], out[i, PLAN_BLOCKS],
         out[i, PLAN_GROWS], out[i, PLAN_ROWS], out[i, PLAN_ANNOUNCED], out[i, PLAN_SPAN], out[i, PLAN_ALLOCATED],
         out[i, PLAN_ROOM], out[i, PLAN_FIRST]) = r
        errors += out[i, PLAN_ERROR] != 0
        if not out[i, PLAN_RUN]:
            continue
        # Its call in the work list (``CachePool.launch_calls``). A cache left
        # out commits no tokens, so the ranges of those kept stay contiguous.
        work[calls, BATCH_SLOT] = s
        work[calls, BATCH_OP] = SEQ_APPEND
        work[calls, BATCH_TOKENS] = offsets[i]
        work[calls, BATCH_ARGS] = out[i, PLAN_FIRST]
        work[calls, BATCH_ARGS + 1] = offsets[i + 1] - offsets[i]
        work[calls, BATCH_ARGS + 2] = end[i] != 0
        work[calls, BATCH_ARGS + 3] = out[i, PLAN_ROOM]
        calls += 1
        rows += out[i, PLAN_ROWS]
        blocks += log_blocks(out[i, PLAN_SPAN], scratch, out[i, PLAN_ALLOCATED])
        announced += out[i, PLAN_ANNOUNCED]
        if out[i, PLAN_RESIZING]:
            resizing += 1
            short += out[i, PLAN_BLOCKS] > seg[s, 1]
            unknown += out[i, PLAN_BLOCKS] > known[s]
    work[calls, BATCH_TOKENS] = offsets[n]
    (totals[TOTAL_CALLS], totals[TOTAL_ROWS], totals[TOTAL_LOG_BLOCKS], totals[TOTAL_ANNOUNCED], totals[TOTAL_ERRORS],
     totals[TOTAL_RESIZING], totals[TOTAL_SHORT_SEGMENTS], totals[TOTAL_UNKNOWN_PRIORITIES]) = (
        calls, rows, blocks, announced, errors, resizing, short, unknown)


def _appended(S, slots, plan, attached_at, seen, done):
    refused = 0
    for i in range(slots.shape[0]):
        s = slots[i]
        ok = S[s, Q_RESULT] != 0
        done[i] = plan[i, PLAN_DONE] != 0 and ok
        refused += plan[i, PLAN_RUN] != 0 and not ok
        if seen >= 0 and plan[i, PLAN_RUN] and plan[i, PLAN_GROWS]:
            attached_at[s] = seen
    return refused


def _can_hold_each(hold, T, have, blocks, history, max_blocks, out):
    for i in range(blocks.shape[0]):
        out[i] = can_hold(hold, T, have[i], blocks[i], history[i], max_blocks)


# ``append_rules`` for the caches in ``slots`` (a host scalars table ``S``,
# ``attached_at``, the segments ``seg`` and the priorities ``known`` of the
# pool; ``offsets``: where each cache's tokens start, and the last ends;
# ``end``, ``room``: int64, one per cache), one row of ``out`` (int64 ``[n,
# PLAN_WIDTH]``) each; the work list of the caches with something to do in
# ``work`` (int64 ``[n + 1, BATCH_WIDTH]``, zeros), as
# ``CachePool.launch_calls`` takes it, and the ``TOTAL_*`` sums in ``totals``.
plan_appends = cpu_kernel(_plan_appends)
# After the launch of a ``plan_appends`` plan ``plan``: ``done[i]`` whether
# cache ``i`` has its room (``PLAN_DONE`` and the kernel's result), the
# caches whose commit added to the tree seen whole at count ``seen`` (-1:
# not known); returns how many the kernel refused.
appended = cpu_kernel(_appended)
# ``can_hold`` per cache into ``out`` (bool), ``hold`` an int64 ``[k, 3]`` table.
can_hold_each = cpu_kernel(_can_hold_each)


def compile_ahead() -> None:
    """Compile (or load) the loops for the argument types the batched calls
    pass: every array int64 and contiguous, the caches' slots writable (a
    list of caches) or read-only (a ``CacheBatch``). A first batched call
    then compiles nothing (``gpukv compile`` runs this)."""
    n = 2
    S = np.zeros((n, Q_WIDTH), dtype=np.int64)
    per_cache = np.zeros(n, dtype=np.int64)
    hold = np.zeros((1, 3), dtype=np.int64)
    plan = np.zeros((n, PLAN_WIDTH), dtype=np.int64)
    done = np.zeros(n, dtype=bool)
    read_only = np.arange(n, dtype=np.int64)
    read_only.setflags(write=False)
    for slots in (np.arange(n, dtype=np.int64), read_only):
        plan_appends(S, per_cache, np.zeros((n, 2), dtype=np.int64), per_cache, slots, np.zeros(n + 1, dtype=np.int64),
                     per_cache, per_cache, 0, 1, 1, False, hold, 1, 1, plan, np.zeros((n + 1, BATCH_WIDTH), dtype=np.int64),
                     np.zeros(TOTALS_WIDTH, dtype=np.int64))
        appended(S, slots, plan, per_cache.copy(), -1, done)
    can_hold_each(hold, 1, per_cache, per_cache, per_cache, 1, done)

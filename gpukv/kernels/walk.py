"""The walk over full blocks: one lane stepper for both targets (§2.3).

A lane is one request in flight (a ``LANE`` row); ``lane_step`` advances it
by one step: a dependent load of a key lookup (bucket head, then row and
tokens, in exactly the chain order of ``index.find_child``), or a run. On
``cpu`` each thread interleaves ``LANES`` lanes (``lane_take``); on ``cuda``
each thread steps one lane to its end (``match_one``).

Runs: a chain's blocks are mostly created one after the other, in
consecutive rows, so the child a request needs next is usually the row after
the last matched one. A lane checks that row first (``is_next_child``), and
goes on row by row while they hold its blocks, prefetching ``RUN_AHEAD`` rows
ahead: a sequential scan, with no hashing and no bucket. On the Mooncake
trace 99% of the matched blocks are found so. Where a run breaks, the block
is looked up by key.

Key lookups: each misses every cache in a large tree, and one request at a
time the core mostly waits. Here each thread keeps ``LANES`` requests in
flight and advances them round robin, one step per round: a step uses only
lines asked for (prefetched) one round earlier, so the misses of all lanes
overlap. A lane stops at the first full block that misses (or at the last
full block) and ``finish`` does the rest on the shared path (the partial
tail, the partial match, memo, backoff, pruning).
"""

from __future__ import annotations

import functools

import numpy as np

from ..core.layout import (
    BID_KEY,
    BLK_HASH_NEXT,
    BLK_INFO,
    BLK_PARENT,
    FLAG_ATTACHED,
    FLAG_IN_USE,
    HEAD_PENDING,
    LN_BLOCK,
    LN_COUNT,
    LN_KEY,
    LN_NODE,
    LN_NUM_FULL,
    LN_REQUEST,
    LN_ROW,
    NULL,
    block_info,
)
from .link import helper
from .index import is_child, tokens_equal
from .keys import combine
from .prefetch import prefetch1, prefetch2
from .reuse import begin, block_hash, finish


LANES = 8  # requests in flight per thread (4 to 16 measure alike on 2 cores)
RUN_AHEAD = 4  # rows a run asks for ahead of the one it checks
# The counter the threads of one cpu match share: the next request to take.
# Taking work as it goes, instead of fixed shares, keeps a thread the OS
# pauses on a busy host from holding up the whole batch.
CTR_WALK = 0


@functools.lru_cache(maxsize=None)
def _cpu_fetch_add():
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def fetch_add(typingctx, arr, i, v):
        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, args[0])
            idx = context.cast(builder, args[1], sig.args[1], types.intp)
            ptr = cgutils.get_item_pointer(context, builder, sig.args[0], ary, [idx], wraparound=False)
            val = context.cast(builder, args[2], sig.args[2], types.int64)
            return builder.atomic_rmw("add", ptr, val, "seq_cst")

        return types.int64(arr, i, v), codegen

    return fetch_add


@helper(cpu=_cpu_fetch_add)
def fetch_add(a, i, v):
    """Atomically add ``v`` to the int64 ``a[i]``; returns the old value (``cpu`` only)."""
    old = a[i]
    a[i] = old + v
    return old


@helper
def prefetch_row(S, r):
    """Every cache line of row ``r`` a key lookup reads: its key, the
    parent..hash_next fields and the tokens (rows do not start on cache
    lines)."""
    prefetch2(S.block_ids, r, BID_KEY)
    prefetch2(S.blocks, r, BLK_PARENT)
    prefetch2(S.blocks, r, BLK_HASH_NEXT)
    prefetch_row_tokens(S, r)


@helper
def prefetch_run_row(S, r):
    """The cache lines of row ``r`` a run reads (``is_next_child``), if the row exists."""
    if r < S.blocks.shape[0]:
        prefetch2(S.blocks, r, BLK_PARENT)  # and its info: the next field, on the same line
        prefetch_row_tokens(S, r)


@helper
def prefetch_row_tokens(S, r):
    """Every cache line of row ``r``'s tokens (16 int32 to a line)."""
    T = S.tokens.shape[1]
    k = 0
    while k < T:
        prefetch2(S.tokens, r, k)
        k += 16
    prefetch2(S.tokens, r, T - 1)


@helper
def prefetch_query_block(B, i, j, T):
    """Request ``i``'s block ``j``, if full (with many lanes the hardware
    prefetcher no longer follows the streams)."""
    if (j + 1) * T <= B.lengths[i]:
        at = B.starts[i] + j * T
        k = 0
        while k < T:
            prefetch1(B.toks, at + k)
            k += 16
        prefetch1(B.toks, at + T - 1)


@helper
def is_next_child(S, r, parent, toks, start, T):
    """Is row ``r`` the attached child of ``parent`` holding exactly the full
    block ``toks[start:start+T]``? Then it is the row ``index.find_child``
    returns for that block: siblings never hold the same tokens, and an
    attached row is in the child index under the key of its parent and
    tokens. So no key is needed to check it."""
    return (
        r < S.blocks.shape[0]
        and S.blocks[r, BLK_PARENT] == parent
        and S.blocks[r, BLK_INFO] == block_info(T, FLAG_IN_USE | FLAG_ATTACHED)  # full, attached
        and tokens_equal(S, r, toks, start, T)
    )


@helper
def lane_run(S, B, st, g, i, T):
    """Lane ``g`` matched its last block: take the following blocks from the
    rows after it while they hold them (see the module's docstring). True
    when the request's full blocks are all matched; else the lane looks the
    block that broke the run up by key, its bucket head asked for now."""
    j = st[g, LN_BLOCK]
    nfull = st[g, LN_NUM_FULL]
    if j >= nfull:
        return True
    node = st[g, LN_NODE]
    count = st[g, LN_COUNT]
    start = B.starts[i]
    at = B.path_off[i]
    for d in range(1, RUN_AHEAD + 1):
        prefetch_run_row(S, node + d)
    r = node + 1
    while is_next_child(S, r, node, B.toks, start + j * T, T):
        B.path[at + count] = r
        count += 1
        node = r
        j += 1
        if j >= nfull:
            break
        r += 1
        prefetch_run_row(S, r + RUN_AHEAD)
    st[g, LN_BLOCK] = j
    st[g, LN_NODE] = node
    st[g, LN_COUNT] = count
    if j >= nfull:
        return True
    hash_base = B.hash_off[i] if B.hash_off.shape[0] > 0 else -1
    key = combine(S.block_ids[node, BID_KEY], block_hash(B.toks, start, B.lengths[i], B.hashes, hash_base, j, T))
    st[g, LN_KEY] = key
    st[g, LN_ROW] = HEAD_PENDING
    prefetch1(S.buckets, key & (S.buckets.shape[0] - 1))
    return False


@helper
def first_negative(toks, lo, hi):
    """Position of the first negative token of ``toks[lo:hi]``, or -1.

    Loops index slices from 0: Numba then needs no wraparound check for
    negative indices, and the OR of all tokens vectorizes (15x faster)."""
    t = toks[lo:hi]
    acc = np.int32(0)
    for k in range(t.shape[0]):
        acc |= t[k]
    if acc >= 0:
        return -1
    for k in range(t.shape[0]):
        if t[k] < 0:
            return k
    return -1


@helper
def lane_begin(S, B, st, g, i, node, count):
    """Lane ``g`` takes request ``i``, whose first ``count`` full blocks are
    matched already (ending at ``node``, see ``reuse.begin``). False when it
    has no full block left to walk: ``reuse.finish`` does the rest at once."""
    T = S.tokens.shape[1]
    nfull = B.lengths[i] // T
    if node == NULL or count >= nfull:
        return False
    hash_base = B.hash_off[i] if B.hash_off.shape[0] > 0 else -1
    key = combine(S.block_ids[node, BID_KEY], block_hash(B.toks, B.starts[i], B.lengths[i], B.hashes, hash_base, count, T))
    st[g, LN_REQUEST] = i
    st[g, LN_BLOCK] = count
    st[g, LN_NUM_FULL] = nfull
    st[g, LN_NODE] = node
    st[g, LN_KEY] = key
    st[g, LN_ROW] = HEAD_PENDING
    st[g, LN_COUNT] = count
    prefetch1(S.buckets, key & (S.buckets.shape[0] - 1))
    prefetch_query_block(B, i, count, T)  # registered sequences' tokens were not read for the key
    return True


@helper(inline=False)  # once per request; a call keeps its two call sites from compiling it twice
def lane_take(S, B, st, g, counters, stop, partial, backoff, ssm_lc, tmp):
    """``cpu``: put the next request that has a full block to walk into lane
    ``g`` (requests with none are finished on the spot). Requests are taken
    one by one from the counter all threads share. ``st[g, LN_REQUEST]`` is
    -1 when none is left."""
    while True:
        i = fetch_add(counters, CTR_WALK, 1)
        if i >= stop:
            break
        if B.bad.shape[0] > 0:
            # The request's tokens stream through the cache here, so the
            # walk then finds its query blocks in L2.
            B.bad[i] = first_negative(B.toks, B.starts[i], B.starts[i] + B.lengths[i])
        node, count = begin(S, B, i)
        if lane_begin(S, B, st, g, i, node, count):
            return
        finish(S, B, i, node, count, partial, backoff, ssm_lc, tmp)
    st[g, LN_REQUEST] = -1


@helper
def lane_step(S, B, st, g):
    """One step of lane ``g``; True when its full-block walk has ended."""
    T = S.tokens.shape[1]
    i = st[g, LN_REQUEST]
    r = st[g, LN_ROW]
    if r == HEAD_PENDING:
        r = S.buckets[st[g, LN_KEY] & (S.buckets.shape[0] - 1)]
        st[g, LN_ROW] = r
        if r != NULL:
            prefetch_row(S, r)
        return False
    if r == NULL:
        return True  # block j is not in the tree
    j = st[g, LN_BLOCK]
    node = st[g, LN_NODE]
    if is_child(S, r, node, st[g, LN_KEY], B.toks, B.starts[i] + j * T, T):
        count = st[g, LN_COUNT]
        B.path[B.path_off[i] + count] = r
        st[g, LN_COUNT] = count + 1
        st[g, LN_NODE] = r
        st[g, LN_BLOCK] = j + 1
        return lane_run(S, B, st, g, i, T)
    r = S.blocks[r, BLK_HASH_NEXT]  # another key (or block) in this bucket
    st[g, LN_ROW] = r
    if r != NULL:
        prefetch_row(S, r)
    return False


@helper
def match_one(S, B, i, partial, backoff, ssm_lc, tmp, st):
    """``cuda``: the whole match of request ``i`` on one lane (row ``i`` of
    ``st``), stepped to the end of its full blocks; other threads hide the
    latency the ``cpu`` interleaves lanes for, and prefetches compile to
    nothing."""
    node, count = begin(S, B, i)
    if lane_begin(S, B, st, i, i, node, count):
        while not lane_step(S, B, st, i):
            pass
        node = st[i, LN_NODE]
        count = st[i, LN_COUNT]
    finish(S, B, i, node, count, partial, backoff, ssm_lc, tmp)

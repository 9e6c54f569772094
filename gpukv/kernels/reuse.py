"""Batched reuse matching: walk, partial match, backoff and pruning (§2.3, §2.4).

One request is one item: ``match_one`` walks the child index block by block
(verifying tokens on every hit), tries the partial match among the children of
the last matched block, applies the backoff to the raw path and runs the
coverage-aware pruning fixed point. The ``cpu`` kernel runs ranges of items on
worker threads; the ``cuda`` kernel runs one thread per item. Block content hashes
can come precomputed (``hash_blocks``, parallel over blocks; cached per block by
``TokenSequence``) or be computed during the walk, which hashes only the blocks
the walk reaches.

Results per request go to ``res[i, RES_*]``; the matched block rows go to the
scratch ``path[path_off[i]:...]`` and are compacted into the ragged output by
``compact``.
"""

from __future__ import annotations

import functools
from collections import namedtuple
from types import SimpleNamespace

import numpy as np

from ..core.backend import bind_globals, cpu_kernel, device_jit
from ..core.config import KIND_SSM
from ..core.layout import (
    BLK_FIRST_NEXT, BLK_FLAGS, BLK_HASH_NEXT, BLK_KEY, BLK_NUM_TOKENS, BLK_PARENT, BLK_SERIAL, FLAG_ATTACHED, NULL,
)
from .lifecycle import build_lifecycle
from .prefetch import build_prefetch
from .tree import build_tree

RES_NUM_TOKENS = 0
RES_NUM_LOOKUP_TOKENS = 1
RES_BEFORE_PRUNING = 2
RES_BEFORE_HYBRID_PRUNING = 3
RES_NUM_BLOCKS = 4
RES_WIDTH = 5

PARALLEL_MIN_REQUESTS = 32  # smaller cpu batches run on one thread
PARALLEL_MIN_BLOCKS = 256  # and so do small hashing jobs

# One batch of requests as the match kernel reads it. Request i is
# toks[starts[i]:starts[i] + lengths[i]]; its full-block content hashes are
# hashes[hash_off[i]:] when hash_off is not empty (else the walk hashes).
# Registered sequences also bring their memo: memo_rows/memo_serials (indexed
# like hashes) hold the blocks matched last time, verified[i] how many (updated
# in place) and trusted[i] whether nothing was detached since; all three are
# empty for other input. ``bad``, when not empty, asks the cpu kernel to check
# the tokens of a caller's int32 array: bad[i] becomes the position of request
# i's first negative token, or -1 (checked as the request enters a lane,
# instead of a separate host pass over the whole batch).
MatchBatch = namedtuple(
    "MatchBatch",
    "toks starts lengths hashes hash_off scope_ids scope_keys memo_rows memo_serials verified trusted path path_off res bad",
)


@functools.lru_cache(maxsize=None)
def build_match(target: str) -> SimpleNamespace:
    jit = device_jit(target)
    t = build_tree(target)
    content_hash = t.keys.content_hash
    combine = t.keys.combine
    find_child = t.find_child
    coverage = t.coverage
    find_root = t.find_root
    sibling_hash = t.keys.sibling_hash
    lifecycle = build_lifecycle(jit)
    stale_start, stale_end = lifecycle.stale_start, lifecycle.stale_end
    hints = build_prefetch(target)
    prefetch1, prefetch2 = hints.prefetch1, hints.prefetch2

    @jit
    def common_prefix(S, r, toks, start, n):
        """Length of the common prefix of block ``r``'s tokens and ``toks[start:start+n]``."""
        m = min(n, S.blocks[r, BLK_NUM_TOKENS])
        row = S.tokens[r]
        for k in range(m):
            if row[k] != toks[start + k]:
                return k
        return m

    @jit
    def best_partial_child(S, node, toks, start, n, out):
        """The child sharing the strictly longest token prefix with the chunk;
        the first in insertion order on ties. Every candidate is searched,
        however many children the node has: the sibling index hands over just
        the children that start with the chunk's first token."""
        best = NULL
        best_n = 0
        first = toks[start]
        c = S.sibling_buckets[np.int64(sibling_hash(node, first) & np.uint64(S.sibling_buckets.shape[0] - 1))]
        while c != NULL:
            if S.blocks[c, BLK_PARENT] == node and S.tokens[c, 0] == first:
                m = common_prefix(S, c, toks, start, n)
                if m > best_n or (m == best_n and S.blocks[c, BLK_SERIAL] < S.blocks[best, BLK_SERIAL]):
                    best = c
                    best_n = m
            c = S.blocks[c, BLK_FIRST_NEXT]
        out[0] = best
        out[1] = best_n

    @jit
    def block_hash(toks, start, n_tok, hashes, hash_base, j, T):
        """Content hash of block ``j`` of a request: cached, or computed now."""
        n = min(T, n_tok - j * T)
        if n == T and hash_base >= 0:
            return np.uint64(hashes[hash_base + j])
        return content_hash(toks, start + j * T, n)

    @jit
    def walk(S, node, count, toks, start, n_tok, hashes, hash_base, partial, path, base, tmp):
        """§2.3: extend the raw path in ``path[base:]``, whose first ``count``
        entries are already matched full blocks ending at ``node`` (the root
        when ``count`` is 0); returns (blocks, last n).

        Keys follow from the hashes alone, so the walk runs ahead: while it
        verifies block j it prefetches the row of block j+1's bucket head and
        the bucket of block j+2 (their misses overlap instead of queueing)."""
        T = S.tokens.shape[1]
        mask = S.buckets.shape[0] - 1
        nblocks = (n_tok + T - 1) // T
        last_n = T if count > 0 else 0
        j = count
        if node == NULL or j >= nblocks:
            return count, last_n
        key = combine(S.blocks[node, BLK_KEY], block_hash(toks, start, n_tok, hashes, hash_base, j, T))
        ahead = key
        if j + 1 < nblocks:
            ahead = combine(key, block_hash(toks, start, n_tok, hashes, hash_base, j + 1, T))
            prefetch1(S.buckets, ahead & mask)
        while True:
            n = min(T, n_tok - j * T)
            if j + 2 < nblocks:
                further = combine(ahead, block_hash(toks, start, n_tok, hashes, hash_base, j + 2, T))
                prefetch1(S.buckets, further & mask)
            else:
                further = ahead
            if j + 1 < nblocks:
                c = S.buckets[ahead & mask]
                if c != NULL:
                    prefetch2(S.blocks, c, 0)
                    prefetch2(S.tokens, c, 0)
            r = find_child(S, node, key, toks, start + j * T, n)
            if r != NULL:
                path[base + count] = r
                count += 1
                last_n = n
                node = r
                j += 1
                if j >= nblocks:
                    return count, last_n
                key = ahead
                ahead = further
                continue
            if partial:
                best_partial_child(S, node, toks, start + j * T, n, tmp)
                if tmp[0] != NULL:
                    path[base + count] = tmp[0]
                    count += 1
                    last_n = tmp[1]
            return count, last_n

    @jit
    def recall(S, B, i, hash_base, base):
        """Reuse the blocks a registered sequence matched before (the memo):
        copy them into the path and return how many still hold. They were
        verified token by token then; a row still holds the same block iff it
        is attached with the same serial. When nothing was detached since
        (``trusted``), that check is skipped too."""
        v = B.verified[i]
        k = 0
        while k < v:
            r = B.memo_rows[hash_base + k]
            if not B.trusted[i] and (
                S.blocks[r, BLK_SERIAL] != B.memo_serials[hash_base + k]
                or (S.blocks[r, BLK_FLAGS] & FLAG_ATTACHED) == 0
            ):
                break
            B.path[base + k] = r
            k += 1
        return k

    @jit
    def remember(S, B, i, hash_base, base, count, last_n):
        """Memoize the leading full blocks matched by key for the next call."""
        T = S.tokens.shape[1]
        full = count if last_n == T else count - 1
        for k in range(B.verified[i], full):
            r = B.path[base + k]
            B.memo_rows[hash_base + k] = r
            B.memo_serials[hash_base + k] = S.blocks[r, BLK_SERIAL]
        B.verified[i] = max(full, 0)

    @jit
    def prune(S, path, base, count, last_n, ssm_lc):
        """§2.4: shorten the path until every page the endpoint needs covers it.

        Each retry strictly shortens the match (drops a block, or lowers the
        last block's count to one of its coverages), so the loop ends within
        blocks x (life cycles + 1) rounds."""
        T = S.tokens.shape[1]
        L = S.lc_kind.shape[0]
        while count > 0:
            if ssm_lc >= 0:
                # SSM: the endpoint must be exactly a checkpoint, the latest usable.
                k = count - 1
                found = -1
                while k >= 0:
                    n = last_n if k == count - 1 else T
                    c = coverage(S, path[base + k], ssm_lc)
                    if c > 0 and n >= c:
                        found = k
                        break
                    k -= 1
                if found < 0:
                    return 0, 0
                last_n = coverage(S, path[base + found], ssm_lc)
                count = found + 1
            ntok = T * (count - 1) + last_n
            shortened = False
            for lc in range(L):
                kind = S.lc_kind[lc]
                if kind == KIND_SSM:
                    continue
                # The stale range at the candidate endpoint, recomputed after every clamp.
                sb = stale_start(S, lc, ntok)
                se = stale_end(S, lc, ntok)
                k = 0
                while k < count:
                    if k >= sb and k < se:
                        k = se  # skip, do not require, stale blocks
                        continue
                    n = last_n if k == count - 1 else T
                    c = coverage(S, path[base + k], lc)
                    if c < n:
                        if c > 0:
                            count = k + 1  # clamp inside block k
                            last_n = c
                        else:
                            count = k  # cut at block k's start
                            last_n = T
                        shortened = True
                        break
                    k += 1
                if shortened:
                    break
            if not shortened:
                return count, last_n
        return 0, 0

    @jit
    def begin(S, B, i):
        """Where the walk of request ``i`` starts: ``(node, count)``, the root
        of its scope and, for a registered sequence, the blocks its memo still
        holds (already copied into the path)."""
        base = B.path_off[i]
        hash_base = B.hash_off[i] if B.hash_off.shape[0] > 0 else -1
        node = find_root(S, B.scope_ids[i], B.scope_keys[i]) if B.scope_ids[i] >= 0 else NULL
        count = 0
        if B.verified.shape[0] > 0 and node != NULL:
            count = recall(S, B, i, hash_base, base)
            # Blocks past a failed check are forgotten now, so that ``remember``
            # rewrites them: a later trusted recall must never copy a stale row.
            B.verified[i] = count
            if count > 0:
                node = B.path[base + count - 1]
        return node, count

    @jit
    def finish(S, B, i, node, count, partial, backoff, ssm_lc, tmp):
        """The rest of request ``i``'s match once its first ``count`` full
        blocks are in the path (ending at ``node``): the walk from there, the
        memo, backoff, pruning and the results."""
        start = B.starts[i]
        n_tok = B.lengths[i]
        T = S.tokens.shape[1]
        base = B.path_off[i]
        path = B.path
        res = B.res
        hash_base = B.hash_off[i] if B.hash_off.shape[0] > 0 else -1
        count, last_n = walk(S, node, count, B.toks, start, n_tok, B.hashes, hash_base, partial, path, base, tmp)
        if B.verified.shape[0] > 0:
            remember(S, B, i, hash_base, base, count, last_n)
        raw = T * (count - 1) + last_n if count > 0 else 0
        res[i, RES_NUM_LOOKUP_TOKENS] = n_tok
        res[i, RES_BEFORE_PRUNING] = raw
        # Backoff trims the raw path, before pruning, and only once.
        if backoff > 0:
            left = raw - backoff
            if left <= 0:
                count = 0
                last_n = 0
            else:
                count = (left + T - 1) // T
                last_n = left - T * (count - 1)
        if ssm_lc >= 0:
            c2, n2 = prune(S, path, base, count, last_n, -1)
            res[i, RES_BEFORE_HYBRID_PRUNING] = T * (c2 - 1) + n2 if c2 > 0 else 0
        count, last_n = prune(S, path, base, count, last_n, ssm_lc)
        final = T * (count - 1) + last_n if count > 0 else 0
        res[i, RES_NUM_TOKENS] = final
        if ssm_lc < 0:
            res[i, RES_BEFORE_HYBRID_PRUNING] = final
        res[i, RES_NUM_BLOCKS] = count

    @jit
    def match_one(S, B, i, partial, backoff, ssm_lc, tmp):
        """The whole match of request ``i`` of batch ``B`` (a ``MatchBatch``)."""
        node, count = begin(S, B, i)
        finish(S, B, i, node, count, partial, backoff, ssm_lc, tmp)

    @jit
    def hash_one(g, toks, src, dst, first_block, hashes, T):
        """Content hash of global block ``g``: the ``j``-th block to hash of
        request ``i`` (found by binary search) starts at token ``src[i] + j*T``
        and its hash goes to ``hashes[dst[i] + j]``."""
        lo = 0
        hi = first_block.shape[0] - 1
        while lo < hi:  # the last i with first_block[i] <= g
            mid = (lo + hi + 1) // 2
            if first_block[mid] <= g:
                lo = mid
            else:
                hi = mid - 1
        j = g - first_block[lo]
        hashes[dst[lo] + j] = np.int64(content_hash(toks, src[lo] + j * T, T))

    @jit
    def compact_one(i, B, block_offsets, block_ids):
        dst = block_offsets[i]
        src = B.path_off[i]
        for k in range(B.res[i, RES_NUM_BLOCKS]):
            block_ids[dst + k] = B.path[src + k]

    return SimpleNamespace(
        walk=walk, prune=prune, recall=recall, remember=remember, begin=begin, finish=finish, match_one=match_one,
        block_hash=block_hash, hash_one=hash_one, compact_one=compact_one,
    )


# Lanes of the cpu walk: the state of one request in flight, a row of ``lanes``.
LANES = 8  # requests in flight per thread (4 to 16 measure alike on 2 cores)
LN_I, LN_J, LN_NFULL, LN_NODE, LN_KEY, LN_KEY1, LN_ROW, LN_COUNT = range(8)
LN_WIDTH = 8
HEAD_PENDING = -2  # LN_ROW before the bucket head of LN_KEY was read
# The counter the threads of one cpu match share: the next request to take.
# Taking work as it goes, instead of fixed shares, keeps a thread the OS
# pauses on a busy host from holding up the whole batch.
CTR_WALK = 0


def _build_fetch_add():
    """``fetch_add(a, i, v)``: atomically add ``v`` to the int64 ``a[i]``; returns the old value."""
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


@functools.lru_cache(maxsize=None)
def build_lanes() -> SimpleNamespace:
    """The ``cpu`` walk over full blocks, several requests at a time.

    A walk is a chain of dependent loads (bucket head, then row and tokens),
    each missing every cache in a large tree; one request at a time, the core
    mostly waits. Here each thread keeps ``LANES`` requests in flight and
    advances them round robin, one step per round: a step uses only lines
    asked for (prefetched) one round earlier, and asks for the ones it needs
    next, so the misses of all lanes overlap. Each lane follows exactly
    ``find_child``'s chain order and tests; it stops at the first full block
    that misses (or at the last full block) and ``finish`` does the rest on the
    shared path (the partial tail, the partial match, memo, backoff, pruning)."""
    jit = device_jit("cpu")
    m = build_match("cpu")
    t = build_tree("cpu")
    combine, is_child = t.keys.combine, t.is_child
    block_hash, begin, finish = m.block_hash, m.begin, m.finish
    hints = build_prefetch("cpu")
    prefetch1, prefetch2 = hints.prefetch1, hints.prefetch2
    fetch_add = _build_fetch_add()

    @jit
    def prefetch_row(S, r):
        """Every cache line of row ``r`` a step reads: the key..hash_next
        fields and the tokens (rows do not start on cache lines)."""
        prefetch2(S.blocks, r, BLK_KEY)
        prefetch2(S.blocks, r, BLK_HASH_NEXT)
        T = S.tokens.shape[1]
        k = 0
        while k < T:
            prefetch2(S.tokens, r, k)
            k += 16
        prefetch2(S.tokens, r, T - 1)

    @jit
    def prefetch_query_block(B, i, j, T):
        """The query tokens a lane reads next round (with many lanes the
        hardware prefetcher no longer follows the streams): block ``j + 1``,
        hashed then, or with cached hashes block ``j``, verified then."""
        if B.hash_off.shape[0] == 0:
            j += 1
        if (j + 1) * T <= B.lengths[i]:
            at = B.starts[i] + j * T
            k = 0
            while k < T:
                prefetch1(B.toks, at + k)
                k += 16
            prefetch1(B.toks, at + T - 1)

    @jit
    def lane_key1(S, B, st, g, i, T):
        """The key of the lane's next block (if full), and ask for its bucket
        and for the tokens of the block after it."""
        j = st[g, LN_J]
        if j + 1 < st[g, LN_NFULL]:
            hash_base = B.hash_off[i] if B.hash_off.shape[0] > 0 else -1
            h = block_hash(B.toks, B.starts[i], B.lengths[i], B.hashes, hash_base, j + 1, T)
            key1 = combine(st[g, LN_KEY], h)
            st[g, LN_KEY1] = key1
            prefetch1(S.buckets, key1 & (S.buckets.shape[0] - 1))
            prefetch_query_block(B, i, j + 1, T)

    @jit
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

    @jit
    def lane_start(S, B, st, g, counters, stop, partial, backoff, ssm_lc, tmp):
        """Put the next request that has a full block to walk into lane ``g``
        (requests with none are finished on the spot). Requests are taken
        one by one from the counter all threads share. ``st[g, LN_I]`` is -1
        when none is left."""
        T = S.tokens.shape[1]
        while True:
            i = fetch_add(counters, CTR_WALK, 1)
            if i >= stop:
                break
            if B.bad.shape[0] > 0:
                # The request's tokens stream through the cache here, so the
                # walk then finds its query blocks in L2.
                B.bad[i] = first_negative(B.toks, B.starts[i], B.starts[i] + B.lengths[i])
            node, count = begin(S, B, i)
            nfull = B.lengths[i] // T
            if node == NULL or count >= nfull:
                finish(S, B, i, node, count, partial, backoff, ssm_lc, tmp)
                continue
            hash_base = B.hash_off[i] if B.hash_off.shape[0] > 0 else -1
            key = combine(S.blocks[node, BLK_KEY], block_hash(B.toks, B.starts[i], B.lengths[i], B.hashes, hash_base, count, T))
            st[g, LN_I] = i
            st[g, LN_J] = count
            st[g, LN_NFULL] = nfull
            st[g, LN_NODE] = node
            st[g, LN_KEY] = key
            st[g, LN_ROW] = HEAD_PENDING
            st[g, LN_COUNT] = count
            prefetch1(S.buckets, key & (S.buckets.shape[0] - 1))
            prefetch_query_block(B, i, count, T)
            return
        st[g, LN_I] = -1

    @jit
    def lane_step(S, B, st, g):
        """One step of lane ``g``; True when its full-block walk has ended."""
        T = S.tokens.shape[1]
        i = st[g, LN_I]
        r = st[g, LN_ROW]
        if r == HEAD_PENDING:
            r = S.buckets[st[g, LN_KEY] & (S.buckets.shape[0] - 1)]
            st[g, LN_ROW] = r
            if r != NULL:
                prefetch_row(S, r)
            lane_key1(S, B, st, g, i, T)
            return False
        if r == NULL:
            return True  # block j is not in the tree
        j = st[g, LN_J]
        node = st[g, LN_NODE]
        if is_child(S, r, node, st[g, LN_KEY], B.toks, B.starts[i] + j * T, T):
            count = st[g, LN_COUNT]
            B.path[B.path_off[i] + count] = r
            st[g, LN_COUNT] = count + 1
            st[g, LN_NODE] = r
            j += 1
            st[g, LN_J] = j
            if j >= st[g, LN_NFULL]:
                return True
            key = st[g, LN_KEY1]  # asked for one round ago
            st[g, LN_KEY] = key
            r = S.buckets[key & (S.buckets.shape[0] - 1)]
            st[g, LN_ROW] = r
            if r != NULL:
                prefetch_row(S, r)
            lane_key1(S, B, st, g, i, T)
            return False
        r = S.blocks[r, BLK_HASH_NEXT]  # another key (or block) in this bucket
        st[g, LN_ROW] = r
        if r != NULL:
            prefetch_row(S, r)
        return False

    return SimpleNamespace(lane_start=lane_start, lane_step=lane_step, finish=finish)


@functools.lru_cache(maxsize=None)
def build_match_kernels(target: str) -> SimpleNamespace:
    """Launchers: ``match(...)``, ``hash_blocks(...)``, ``compact(...)``.

    Request ``i`` is ``toks[starts[i]:starts[i] + lengths[i]]``; its full-block
    content hashes are ``hashes[hash_off[i]:]`` when ``hash_off`` is not empty,
    else they are computed during the walk."""
    m = build_match(target)
    helpers = dict(match_one=m.match_one, hash_one=m.hash_one, compact_one=m.compact_one)

    if target == "cpu":
        lanes = build_lanes()
        helpers.update(lane_start=lanes.lane_start, lane_step=lanes.lane_step, finish=lanes.finish)

        def kernel(f):
            return cpu_kernel(bind_globals(f, **helpers), nogil=True)

        # Work runs on worker threads, each a serial kernel with the GIL
        # released: matching takes requests from a shared counter
        # (``_run_shared``), hashing splits blocks into contiguous shares
        # (``_split``). A numba parallel loop would be shorter, but it drops
        # writes made through the batch tuple, and waking its thread pool
        # costs milliseconds on a busy host.
        match_range, hash_range, compact = kernel(_match_cpu_range), kernel(_hash_cpu_range), kernel(_compact_cpu)

        def match(S, B, partial, backoff, ssm_lc):
            n = B.starts.shape[0]
            counters = np.zeros(1, dtype=np.int64)

            def share():
                tmp = np.empty(2, dtype=np.int64)
                lanes = np.empty((LANES, LN_WIDTH), dtype=np.int64)
                match_range(S, B, counters, n, partial, backoff, ssm_lc, tmp, lanes)

            _run_shared(n, PARALLEL_MIN_REQUESTS, share)

        def hash_blocks(toks, src, dst, first_block, hashes, T, total):
            _split(total, PARALLEL_MIN_BLOCKS, lambda lo, hi: hash_range(toks, src, dst, first_block, hashes, T, lo, hi))

        return SimpleNamespace(match=match, hash_blocks=hash_blocks, compact=compact)

    from numba import cuda

    def kernel(f):
        return cuda.jit(bind_globals(f, cuda=cuda, **helpers))

    match_k, hash_k, compact_k = kernel(_match_cuda), kernel(_hash_cuda), kernel(_compact_cuda)
    threads = 128

    def grid(n):
        return max(1, (n + threads - 1) // threads), threads

    def match(S, B, partial, backoff, ssm_lc):
        n = B.starts.shape[0]
        tmp = _like(B.res, (max(n, 1), 2))
        match_k[grid(n)](S, B, partial, backoff, ssm_lc, tmp)

    def hash_blocks(toks, src, dst, first_block, hashes, T, total):
        if total:
            hash_k[grid(total)](toks, src, dst, first_block, hashes, T, total)

    def compact(B, block_offsets, block_ids):
        compact_k[grid(B.res.shape[0])](B, block_offsets, block_ids)

    return SimpleNamespace(match=match, hash_blocks=hash_blocks, compact=compact)


# -- kernels: module level so Numba's disk cache hits (see backend.bind_globals) --------
# noqa: F821 throughout: helpers and cuda are bound by bind_globals.
def _match_cpu_range(S, B, counters, stop, partial, backoff, ssm_lc, tmp, st):
    """One thread's part of a batch of ``stop`` requests, taking them from the
    shared ``counters``, ``LANES`` at a time (``st``: the lanes, ``tmp``:
    scratch of the partial match)."""
    live = 0
    for g in range(LANES):
        lane_start(S, B, st, g, counters, stop, partial, backoff, ssm_lc, tmp)  # noqa: F821
        if st[g, LN_I] >= 0:
            live += 1
    while live > 0:
        for g in range(LANES):
            if st[g, LN_I] < 0 or not lane_step(S, B, st, g):  # noqa: F821
                continue
            finish(S, B, st[g, LN_I], st[g, LN_NODE], st[g, LN_COUNT], partial, backoff, ssm_lc, tmp)  # noqa: F821
            lane_start(S, B, st, g, counters, stop, partial, backoff, ssm_lc, tmp)  # noqa: F821
            if st[g, LN_I] < 0:
                live -= 1


def _hash_cpu_range(toks, src, dst, first_block, hashes, T, lo, hi):
    for g in range(lo, hi):
        hash_one(g, toks, src, dst, first_block, hashes, T)  # noqa: F821


def _compact_cpu(B, block_offsets, block_ids):
    for i in range(B.res.shape[0]):
        compact_one(i, B, block_offsets, block_ids)  # noqa: F821


def _match_cuda(S, B, partial, backoff, ssm_lc, tmp):
    i = cuda.grid(1)  # noqa: F821
    if i < B.starts.shape[0]:
        match_one(S, B, i, partial, backoff, ssm_lc, tmp[i])  # noqa: F821


def _hash_cuda(toks, src, dst, first_block, hashes, T, total):
    g = cuda.grid(1)  # noqa: F821
    if g < total:
        hash_one(g, toks, src, dst, first_block, hashes, T)  # noqa: F821


def _compact_cuda(B, block_offsets, block_ids):
    i = cuda.grid(1)  # noqa: F821
    if i < B.res.shape[0]:
        compact_one(i, B, block_offsets, block_ids)  # noqa: F821


_POOL = []


def _pool():
    """``(executor, threads)`` for cpu matching: the caller runs one share and
    ``threads - 1`` pool workers the others (no executor on a single core)."""
    if not _POOL:
        from concurrent.futures import ThreadPoolExecutor

        from numba import config

        n = max(1, int(config.NUMBA_NUM_THREADS))
        _POOL.append((ThreadPoolExecutor(max_workers=n - 1) if n > 1 else None, n))
    return _POOL[0]


def _fan_out(n: int, minimum: int, run_share):
    """``run_share(w, k)`` for each share ``w`` of ``k``: share 0 on the
    calling thread, the others on pool workers; one share (``k = 1``) on the
    caller alone when ``n`` is small or there is no pool."""
    workers, k = _pool()
    if n < minimum or workers is None:
        run_share(0, 1)
        return
    jobs = [workers.submit(run_share, w, k) for w in range(1, k)]
    run_share(0, k)
    for job in jobs:
        job.result()


def _split(n: int, minimum: int, run):
    """``run(lo, hi)`` over ``[0, n)`` in contiguous shares (see ``_fan_out``)."""
    _fan_out(n, minimum, lambda w, k: run(n * w // k, n * (w + 1) // k))


def _run_shared(n: int, minimum: int, run):
    """``run()`` on every thread ``_fan_out`` uses; the runs share out the work themselves."""
    _fan_out(n, minimum, lambda w, k: run())


def _like(a, shape):
    """A scratch int64 array on the same device as ``a``."""
    if isinstance(a, np.ndarray):
        return np.empty(shape, dtype=np.int64)
    import cupy

    return cupy.empty(shape, dtype=np.int64)

"""One request's reuse match around the walk (§2.3, §2.4).

``begin`` finds the scope's root and recalls a registered sequence's memo;
the lane stepper (``walk.py``) then matches full blocks; ``finish`` does the
rest: the partial tail block, the partial match among the children of the
last matched block, the memo, the backoff on the raw path and the
coverage-aware pruning fixed point. Also here: block content hashing
(``hash_one``, parallel over blocks) and the compaction of matched rows.

Results per request go to ``res[i, RES_*]``; the matched block rows go to the
scratch ``path[path_off[i]:...]`` and are compacted into the ragged output by
``compact``.
"""

from __future__ import annotations

import numpy as np

from ..core.kinds import is_checkpoint
from ..core.layout import (
    BID_KEY,
    BLK_FIRST_NEXT,
    BLK_INFO,
    BLK_PARENT,
    BLK_SERIAL,
    FLAG_ATTACHED,
    NULL,
    RES_BEFORE_HYBRID_PRUNING,
    RES_BEFORE_PRUNING,
    RES_NUM_BLOCKS,
    RES_NUM_LOOKUP_TOKENS,
    RES_NUM_TOKENS,
)
from .link import helper
from .index import created_before, find_child, find_root, num_tokens
from .keys import combine, content_hash, sibling_hash
from .lifecycle import stale_end, stale_start
from .pages import coverage


@helper
def common_prefix(S, r, toks, start, n):
    """Length of the common prefix of block ``r``'s tokens and ``toks[start:start+n]``."""
    m = min(n, num_tokens(S, r))
    row = S.tokens[r]
    for k in range(m):
        if row[k] != toks[start + k]:
            return k
    return m


@helper
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
            if m > best_n or (m == best_n and created_before(S, c, best)):
                best = c
                best_n = m
        c = S.blocks[c, BLK_FIRST_NEXT]
    out[0] = best
    out[1] = best_n


@helper
def block_hash(toks, start, n_tok, hashes, hash_base, j, T):
    """Content hash of block ``j`` of a request: cached, or computed now."""
    n = min(T, n_tok - j * T)
    if n == T and hash_base >= 0:
        return np.uint64(hashes[hash_base + j])
    return content_hash(toks, start + j * T, n)


@helper
def walk_rest(S, B, i, node, count, partial, tmp):
    """§2.3 after the lane stepper (``walk.py``) has matched the request's
    first ``count`` full blocks, ending at ``node`` (the root when 0):
    the partial tail block when every full block matched, then on a miss the
    partial match among ``node``'s children. Returns (blocks, last n)."""
    T = S.tokens.shape[1]
    start = B.starts[i]
    n_tok = B.lengths[i]
    nblocks = (n_tok + T - 1) // T
    last_n = T if count > 0 else 0
    j = count
    if node == NULL or j >= nblocks:
        return count, last_n
    n = min(T, n_tok - j * T)
    base = B.path_off[i]
    if n < T:  # the tail block: the stepper walks full blocks only
        hash_base = B.hash_off[i] if B.hash_off.shape[0] > 0 else -1
        key = combine(S.block_ids[node, BID_KEY], block_hash(B.toks, start, n_tok, B.hashes, hash_base, j, T))
        r = find_child(S, node, key, B.toks, start + j * T, n)
        if r != NULL:
            B.path[base + count] = r
            return count + 1, n
    if partial:
        best_partial_child(S, node, B.toks, start + j * T, n, tmp)
        if tmp[0] != NULL:
            B.path[base + count] = tmp[0]
            count += 1
            last_n = tmp[1]
    return count, last_n


@helper
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
            or (S.blocks[r, BLK_INFO] & FLAG_ATTACHED) == 0
        ):
            break
        B.path[base + k] = r
        k += 1
    return k


@helper
def remember(S, B, i, hash_base, base, count, last_n):
    """Memoize the leading full blocks matched by key for the next call."""
    T = S.tokens.shape[1]
    full = count if last_n == T else count - 1
    for k in range(B.verified[i], full):
        r = B.path[base + k]
        B.memo_rows[hash_base + k] = r
        B.memo_serials[hash_base + k] = S.blocks[r, BLK_SERIAL]
    B.verified[i] = max(full, 0)


@helper
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
            if is_checkpoint(S.lc_kind[lc]):
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


@helper
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


@helper(inline=False)  # once per request, and the largest part of a match: one copy compiles much faster
def finish(S, B, i, node, count, partial, backoff, ssm_lc, tmp):
    """The rest of request ``i``'s match once the lane stepper put its
    leading full blocks in the path (``count`` of them, ending at ``node``):
    the rest of the walk, the memo, backoff, pruning and the results."""
    n_tok = B.lengths[i]
    T = S.tokens.shape[1]
    base = B.path_off[i]
    path = B.path
    res = B.res
    hash_base = B.hash_off[i] if B.hash_off.shape[0] > 0 else -1
    count, last_n = walk_rest(S, B, i, node, count, partial, tmp)
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


@helper
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


@helper
def compact_one(i, B, block_offsets, block_ids):
    dst = block_offsets[i]
    src = B.path_off[i]
    for k in range(B.res[i, RES_NUM_BLOCKS]):
        block_ids[dst + k] = B.path[src + k]

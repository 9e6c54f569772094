"""The child index of the block tree (docs/semantics.md §2.2): finding a block.

A chained hash index from the fast chain key (``keys.py``) to candidate rows
(``buckets`` plus ``BLK_HASH_NEXT``), and a second one from (parent row, first
token) to the children that can share a prefix with a chunk
(``sibling_buckets`` plus ``BLK_FIRST_NEXT``). A hit by key is accepted only
after parent, length and every token compare equal. Roots are rows too, found
by their scope key and checked by scope id.
"""

from __future__ import annotations

import numpy as np

from ..core.layout import (
    BID_KEY,
    BLK_FIRST_NEXT,
    BLK_HASH_NEXT,
    BLK_INFO,
    BLK_PARENT,
    BLK_SERIAL,
    FLAG_ATTACHED,
    FLAG_ROOT,
    NULL,
    ROOT_SCOPE,
    block_info,
    info_num_tokens,
)
from .link import helper
from .keys import sibling_hash

# core/layout.py's block-info bits, compiled for kernels too.
for _f in (block_info, info_num_tokens):
    helper(_f)
del _f


@helper
def num_tokens(S, r):
    """The tokens block row ``r`` holds (1..T; 0 for a root)."""
    return info_num_tokens(S.blocks[r, BLK_INFO])


@helper
def created_before(S, a, b):
    """Whether row ``a``'s block was created before row ``b``'s: the sign
    of their 32-bit serials' difference, taken modulo 2**32 (the serials wrap)."""
    d = (np.int64(S.blocks[a, BLK_SERIAL]) - np.int64(S.blocks[b, BLK_SERIAL])) & 0xFFFFFFFF
    return d >= 0x80000000


@helper
def is_attached(S, r):
    return (S.blocks[r, BLK_INFO] & FLAG_ATTACHED) != 0


@helper
def is_root(S, r):
    return (S.blocks[r, BLK_INFO] & FLAG_ROOT) != 0


@helper
def bucket_of(S, key):
    return key & (S.buckets.shape[0] - 1)


@helper
def sibling_bucket_of(S, parent, first_token):
    return np.int64(sibling_hash(parent, first_token) & np.uint64(S.sibling_buckets.shape[0] - 1))


@helper
def tokens_equal(S, r, toks, start, n):
    # Branch-free, over slices indexed from 0 (no wraparound check for
    # negative indices): the compiler vectorizes this. An early exit would
    # not pay for itself, since a hash hit almost always matches in full.
    row = S.tokens[r]
    q = toks[start:start + n]
    diff = np.int32(0)
    for i in range(n):
        diff |= row[i] ^ q[i]
    return diff == 0


@helper
def is_child(S, r, parent, key, toks, start, n):
    """Is row ``r`` (from ``key``'s bucket chain) the child of ``parent``
    holding exactly ``toks[start:start+n]``? The 64-bit key only selects
    candidates; parent, length and every token are compared too."""
    return (
        S.block_ids[r, BID_KEY] == key
        and S.blocks[r, BLK_PARENT] == parent
        and num_tokens(S, r) == n
        and tokens_equal(S, r, toks, start, n)
    )


@helper
def find_child(S, parent, key, toks, start, n):
    """The child of ``parent`` holding exactly ``toks[start:start+n]``, or NULL."""
    r = S.buckets[bucket_of(S, key)]
    while r != NULL:
        if is_child(S, r, parent, key, toks, start, n):
            return r
        r = S.blocks[r, BLK_HASH_NEXT]
    return NULL


@helper
def find_root(S, scope_id, scope_key):
    r = S.buckets[bucket_of(S, scope_key)]
    while r != NULL:
        if (S.blocks[r, BLK_INFO] & FLAG_ROOT) != 0 and S.blocks[r, ROOT_SCOPE] == scope_id:
            return r
        r = S.blocks[r, BLK_HASH_NEXT]
    return NULL


@helper
def index_insert(S, r):
    """Enter ``r`` in the child index and, unless a root, in the sibling index."""
    b = bucket_of(S, S.block_ids[r, BID_KEY])
    S.blocks[r, BLK_HASH_NEXT] = S.buckets[b]
    S.buckets[b] = r
    if not is_root(S, r):
        f = sibling_bucket_of(S, S.blocks[r, BLK_PARENT], S.tokens[r, 0])
        S.blocks[r, BLK_FIRST_NEXT] = S.sibling_buckets[f]
        S.sibling_buckets[f] = r


@helper
def unchain(S, heads, h, r, next_col):
    """Remove ``r`` from the singly linked chain starting at ``heads[h]``."""
    prev = NULL
    cur = heads[h]
    while cur != NULL and cur != r:
        prev = cur
        cur = S.blocks[cur, next_col]
    if cur == NULL:
        return
    nxt = S.blocks[r, next_col]
    if prev == NULL:
        heads[h] = nxt
    else:
        S.blocks[prev, next_col] = nxt
    S.blocks[r, next_col] = NULL


@helper
def index_remove(S, r):
    """Take ``r`` out of both indexes (while its parent is still set)."""
    unchain(S, S.buckets, bucket_of(S, S.block_ids[r, BID_KEY]), r, BLK_HASH_NEXT)
    if not is_root(S, r):
        f = sibling_bucket_of(S, S.blocks[r, BLK_PARENT], S.tokens[r, 0])
        unchain(S, S.sibling_buckets, f, r, BLK_FIRST_NEXT)

"""The fast 64-bit index key of a block.

``key(block) = combine(key(parent), content_hash(tokens))`` and a root's key is
derived from its scope. The content hash depends on the block's tokens alone, so
a request's blocks hash in parallel and a ``TokenSequence`` hashes each block
once; the chain is folded in during the walk, one ``combine`` per hop.

This key only finds candidates: a child-index hit is accepted after the stored
parent and tokens compare equal, so a collision can never return a foreign
block. The reference SHA-256 chain digest (``sha256.py``) is the identity used
in events.
"""

from __future__ import annotations

import hashlib

import numpy as np

from .link import helper

M1 = np.uint64(0x9E3779B97F4A7C15)
M2 = np.uint64(0xC2B2AE3D27D4EB4F)
F1 = np.uint64(0xFF51AFD7ED558CCD)
F2 = np.uint64(0xC4CEB9FE1A85EC53)
LOW32 = np.uint64(0xFFFFFFFF)
S33 = np.uint64(33)
S32 = np.uint64(32)
S27 = np.uint64(27)
S37 = np.uint64(37)
L1 = np.uint64(0x243F6A8885A308D3)  # lane seeds (digits of pi)
L2 = np.uint64(0x13198A2E03707344)
L3 = np.uint64(0xA4093822299F31D0)


@helper
def fmix64(h):
    h ^= h >> S33
    h *= F1
    h ^= h >> S33
    h *= F2
    h ^= h >> S33
    return h


@helper
def pair(tokens, k):
    """Tokens ``k`` and ``k+1`` as one 64-bit word."""
    return (np.uint64(tokens[k]) & LOW32) | ((np.uint64(tokens[k + 1]) & LOW32) << S32)


@helper
def mix_in(h, w):
    h = (h ^ w) * M2
    return (h << S27) | (h >> S37)


@helper
def content_hash(tokens, start, n):
    """Hash of ``tokens[start:start+n]`` (its length included), as uint64.

    Four independent lanes take two tokens each per step, so the CPU
    overlaps their multiplies instead of waiting on one serial chain; the
    tail goes into lane 0 and the lanes are folded at the end."""
    h0 = np.uint64(n) * M1
    h1 = h0 ^ L1
    h2 = h0 ^ L2
    h3 = h0 ^ L3
    # A slice indexed from 0: Numba adds no wraparound check for negative
    # indices (a check per token, and a loop the compiler cannot unroll).
    t = tokens[start:start + n]
    i = 0
    while i + 8 <= n:
        h0 = mix_in(h0, pair(t, i))
        h1 = mix_in(h1, pair(t, i + 2))
        h2 = mix_in(h2, pair(t, i + 4))
        h3 = mix_in(h3, pair(t, i + 6))
        i += 8
    while i + 2 <= n:
        h0 = mix_in(h0, pair(t, i))
        i += 2
    if i < n:
        h0 = mix_in(h0, np.uint64(t[i]) & LOW32)
    return fmix64(((h0 * M1 + h1) * M1 + h2) * M1 + h3)


@helper
def combine(parent_key, content):
    """Child key from the parent's key (int64 as stored) and a content hash."""
    return np.int64(fmix64((np.uint64(parent_key) * M1) ^ content))


@helper
def sibling_hash(parent, first_token):
    """Bucket hash of (parent row, first token): the children that can share
    a prefix with a chunk are exactly those starting with its first token."""
    h = ((np.uint64(parent) * M1) ^ (np.uint64(first_token) & LOW32)) * M2
    return h ^ (h >> S32)


def sibling_hash_np(parents: np.ndarray, first_tokens: np.ndarray) -> np.ndarray:
    """``sibling_hash`` over arrays (host side, for rebuilding the index)."""
    with np.errstate(over="ignore"):
        h = ((parents.astype(np.uint64) * M1) ^ (first_tokens.astype(np.int64).astype(np.uint64) & LOW32)) * M2
        return h ^ (h >> S32)


def root_key64(scope_bytes: bytes) -> int:
    """A root's fast key: 64 bits of SHA-256 over the scope bytes (as int64)."""
    return int.from_bytes(hashlib.sha256(b"gpukv-root" + scope_bytes).digest()[:8], "little", signed=True)

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
from types import SimpleNamespace

import numpy as np

M1 = np.uint64(0x9E3779B97F4A7C15)
M2 = np.uint64(0xC2B2AE3D27D4EB4F)
F1 = np.uint64(0xFF51AFD7ED558CCD)
F2 = np.uint64(0xC4CEB9FE1A85EC53)
LOW32 = np.uint64(0xFFFFFFFF)
S33 = np.uint64(33)
S32 = np.uint64(32)
S27 = np.uint64(27)
S37 = np.uint64(37)


def build_keys(jit):
    @jit
    def fmix64(h):
        h ^= h >> S33
        h *= F1
        h ^= h >> S33
        h *= F2
        h ^= h >> S33
        return h

    @jit
    def content_hash(tokens, start, n):
        """Hash of ``tokens[start:start+n]`` (its length included), as uint64.

        Two tokens are folded per multiply so the serial dependency chain is
        half as long as the token count.
        """
        h = np.uint64(n) * M1
        i = 0
        while i + 1 < n:
            w = (np.uint64(tokens[start + i]) & LOW32) | ((np.uint64(tokens[start + i + 1]) & LOW32) << S32)
            h = (h ^ w) * M2
            h = (h << S27) | (h >> S37)
            i += 2
        if i < n:
            h = (h ^ (np.uint64(tokens[start + i]) & LOW32)) * M2
        return fmix64(h)

    @jit
    def combine(parent_key, content):
        """Child key from the parent's key (int64 as stored) and a content hash."""
        return np.int64(fmix64((np.uint64(parent_key) * M1) ^ content))

    return SimpleNamespace(fmix64=fmix64, content_hash=content_hash, combine=combine)


def root_key64(scope_bytes: bytes) -> int:
    """A root's fast key: 64 bits of SHA-256 over the scope bytes (as int64)."""
    return int.from_bytes(hashlib.sha256(b"gpukv-root" + scope_bytes).digest()[:8], "little", signed=True)

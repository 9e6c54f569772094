"""The reference-compatible SHA-256 block-key chain, on the host.

A block's key commits to its whole prefix: ``root = SHA256(scope bytes)`` and
``key = SHA256(parent key || encoded tokens)``, where an int token is 4
little-endian bytes and a multimodal token (a 32-byte digest) is its raw bytes
(docs/semantics.md §1.2). Matches are decided by key equality alone, and tokens and
salts can be chosen by an attacker, so the key is never truncated and the hash
never weakened here. ``kernels/sha256.py`` computes the same digest in kernels.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Iterator, Sequence

from .scope import ReuseScope, as_scope

__all__ = [
    "DIGEST_SIZE",
    "MAX_TOKEN_ID",
    "Hasher",
    "block_key",
    "gen_multimodal_cache_key_tokens",
    "root_key",
    "sequence_to_blockchain_keys",
]

DIGEST_SIZE = 32  # bytes in a SHA-256 digest, a block key and a multimodal token
MAX_TOKEN_ID = 2**31 - 1


def _is_int(x) -> bool:
    return isinstance(x, int) and type(x) is not bool


def _check_token(t, pos: int):
    """Return ``t`` as a plain int or bytes token; raise naming ``pos`` if invalid."""
    if isinstance(t, bytes):
        if len(t) != DIGEST_SIZE:
            raise ValueError(
                f"token at position {pos}: a bytes token must be a {DIGEST_SIZE}-byte "
                f"digest, got {len(t)} bytes"
            )
        return t
    if type(t) is bool or not hasattr(t, "__index__"):
        raise TypeError(
            f"token at position {pos} must be an int or a {DIGEST_SIZE}-byte digest, "
            f"got {type(t).__name__}"
        )
    t = t.__index__()  # accepts NumPy integers too
    if not 0 <= t <= MAX_TOKEN_ID:
        raise ValueError(f"token at position {pos} must be in 0..2**31-1, got {t}")
    return t


def _check_tokens(tokens: Iterable, start: int = 0) -> list:
    """Validated copy of ``tokens``; error positions count from ``start``."""
    if isinstance(tokens, (bytes, str)) or not hasattr(tokens, "__iter__"):
        raise TypeError(f"tokens must be a sequence of tokens, got {type(tokens).__name__}")
    return [_check_token(t, start + i) for i, t in enumerate(tokens)]


def _encode(tokens: Sequence) -> bytes:
    """Byte encoding of already validated tokens."""
    return b"".join(t if isinstance(t, bytes) else t.to_bytes(4, "little") for t in tokens)


class Hasher:
    """Incremental SHA-256 over a seed and token blocks, as the reference's Hasher.

    ``Hasher(seed).update(block).digest() == SHA256(seed || enc(block))``.
    """

    __slots__ = ("_h",)

    def __init__(self, seed: bytes = b""):
        if not isinstance(seed, (bytes, bytearray, memoryview)):
            raise TypeError(f"seed must be bytes, got {type(seed).__name__}")
        self._h = hashlib.sha256(seed)

    def update(self, tokens) -> "Hasher":
        """Fold in a token block (a sequence of tokens) or a single int token.

        Lone ``bytes`` are fed raw, as the reference does for seeds and digests.
        """
        if isinstance(tokens, (bytes, bytearray, memoryview)):
            self._h.update(tokens)
            return self
        if _is_int(tokens):
            tokens = [tokens]
        self._h.update(_encode(_check_tokens(tokens)))
        return self

    def digest(self) -> bytes:
        return self._h.digest()


def root_key(scope: ReuseScope | None) -> bytes:
    """The key of a scope's root: SHA256(scope bytes)."""
    return hashlib.sha256(as_scope(scope).to_bytes()).digest()


def block_key(parent_key: bytes, tokens) -> bytes:
    """The key of a block under ``parent_key``: SHA256(parent key || enc(tokens))."""
    if not isinstance(parent_key, bytes) or len(parent_key) != DIGEST_SIZE:
        raise ValueError(f"parent_key must be {DIGEST_SIZE} bytes")
    return hashlib.sha256(parent_key + _encode(_check_tokens(tokens))).digest()


def sequence_to_blockchain_keys(
    tokens_per_block: int, scope: ReuseScope | None, tokens: Iterable
) -> Iterator[tuple[list, bytes]]:
    """Yield ``([], root_key)``, then ``(chunk, key)`` for each chunk of
    ``tokens_per_block`` tokens (the last chunk may be shorter).

    Arguments are validated when called, not on the first ``next()``, so a bad
    token raises here, naming its position in ``tokens``.
    """
    if not _is_int(tokens_per_block):
        raise TypeError(f"tokens_per_block must be an int, got {type(tokens_per_block).__name__}")
    if tokens_per_block <= 0:
        raise ValueError(f"tokens_per_block must be positive, got {tokens_per_block}")
    scope = as_scope(scope)
    tokens = _check_tokens(tokens)
    return _chain(tokens_per_block, scope, tokens)


def _chain(T: int, scope: ReuseScope, tokens: list) -> Iterator[tuple[list, bytes]]:
    key = root_key(scope)
    yield [], key
    for start in range(0, len(tokens), T):
        chunk = tokens[start : start + T]
        key = hashlib.sha256(key + _encode(chunk)).digest()
        yield chunk, key


def gen_multimodal_cache_key_tokens(
    id_offset: int, digest: bytes, num_tokens: int, token_offset: int = 0
) -> list:
    """Synthetic key tokens for ``num_tokens`` positions of one multimodal item.

    Item-local position ``token_offset + i`` becomes the digest itself when it is
    0 (the item's first position) and the int ``id_offset + token_offset + i``
    otherwise; ``id_offset`` is usually the vocabulary size, so these ids never
    collide with real tokens. Only position 0 must be unique: a match needs every
    earlier token to match too. Returns a list (like the reference), so bad
    arguments raise at the call.
    """
    for name, value in (("id_offset", id_offset), ("num_tokens", num_tokens),
                        ("token_offset", token_offset)):
        if not _is_int(value):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not isinstance(digest, bytes):
        raise TypeError(f"digest must be bytes, got {type(digest).__name__}")
    if len(digest) != DIGEST_SIZE:
        raise ValueError(f"digest must be exactly {DIGEST_SIZE} bytes, got {len(digest)}")
    if num_tokens <= 0:
        raise ValueError(f"num_tokens must be positive, got {num_tokens}")
    if token_offset < 0:
        raise ValueError(f"token_offset must be non-negative, got {token_offset}")
    # Every position but the item's first becomes an int token, which must be a valid id.
    ints = range(max(token_offset, 1), token_offset + num_tokens)
    if ints and not (0 <= id_offset + ints[0] and id_offset + ints[-1] <= MAX_TOKEN_ID):
        raise ValueError(
            f"id_offset {id_offset} + positions {ints[0]}..{ints[-1]} must stay in the token range 0..{MAX_TOKEN_ID}"
        )
    return [
        digest if token_offset + i == 0 else id_offset + token_offset + i
        for i in range(num_tokens)
    ]

"""Turning caller token sequences into flat int32 arrays, with validation.

A token is an int in ``0..2**31-1`` or a 32-byte multimodal digest; digests are
interned by the tables and stand in the arrays as negative ids. Errors name the
request index and the position of the bad token.

A 1-D int32 array (an engine's prompt, chunk by chunk) is used as it is, its
sign the only check. Python lists go through ``struct.pack_into``: it
converts in C and rejects non-integers and values outside int32 on the way,
so validation costs one vectorized sign check on top of the conversion
itself. ``struct`` takes a bool
as the int it subclasses; a bool array is rejected by its dtype, so a bool in
a list is rejected too: only the few positions that hold 0 or 1 are looked at.

Accepted sequences are lists, tuples, ranges, 1-D integer arrays and other
``collections.abc.Sequence``s; ``str``, ``bytes``, ``bytearray`` and
``memoryview`` are not token sequences, nor are sets and dicts (no order, or
keys that are not tokens). ``ValidTokens`` wraps an array that was validated
and converted already (digests as interned ids), so it is not checked again.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence as SequenceABC
from operator import itemgetter
from typing import Callable, Sequence

import numpy as np

from .core.config import MAX_TOKEN_ID
from .core.errors import TokenError

DIGEST_BYTES = 32


def _where(request: int | None) -> str:
    return "" if request is None else f"request {request}: "


class ValidTokens:
    """An int32 array already validated and converted (digests as their
    interned ids, as the tables and the arena store them)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array

    def __len__(self) -> int:
        return int(self.array.shape[0])


_NOT_TOKEN_SEQUENCES = (str, bytes, bytearray, memoryview)


def _check_container(tokens, request):
    if isinstance(tokens, _NOT_TOKEN_SEQUENCES) or not isinstance(tokens, SequenceABC):
        raise TypeError(f"{_where(request)}tokens must be a sequence of ints, got {type(tokens).__name__}")


# A list this short (a decode step's tokens) is converted by NumPy after
# C-level checks over the list itself: the fixed cost of the general path's
# array operations is several times that of the conversion.
_SHORT_LIST = 32
_PLAIN_INTS = frozenset({int})
# An array this short is checked as a list: a NumPy reduction's fixed cost is
# several times that of converting a few ints.
_SHORT_ARRAY = 16
_INT32 = np.dtype(np.int32)  # native int32, the dtype object its arrays share (any other: the general way)


def token_array(tokens, intern: Callable[[bytes], int], request: int | None = None) -> np.ndarray:
    """One sequence as a validated int32 array (digests interned)."""
    return tokens_and_digests(tokens, intern, request)[0]


def tokens_and_digests(tokens, intern: Callable[[bytes], int], request: int | None = None) -> tuple:
    """``(token_array(...), whether it holds digests that ``intern`` gave)``:
    only a sequence of more than ints can hold any, so a caller that looked
    digests up and must intern them later never searches the array for them."""
    if type(tokens) is np.ndarray and tokens.dtype is _INT32 and tokens.ndim == 1 and tokens.size > _SHORT_ARRAY:
        # A prefill's chunk, as an engine keeps its prompts: what
        # ``_from_ndarray`` checks of it is only the sign (no int32 passes
        # MAX_TOKEN_ID), and it is the array as it is. A negative token
        # goes on to it, which names the position.
        if least(tokens) >= 0:
            return tokens, False
    if type(tokens) is ValidTokens:
        return tokens.array, False  # digests there are interned already
    if isinstance(tokens, np.ndarray):
        return _from_ndarray(tokens, request), False
    if type(tokens) is list and len(tokens) <= _SHORT_LIST and _PLAIN_INTS.issuperset(map(type, tokens)):
        # Python ints only (no bools, digests or other types); what is out
        # of range takes the general path, which names it.
        if not tokens or min(tokens) >= 0:
            try:
                return np.array(tokens, dtype=np.int32), False
            except OverflowError:
                pass
    _check_container(tokens, request)
    out = np.empty(len(tokens), dtype=np.int32)
    try:
        struct.pack_into(f"={len(out)}i", out, 0, *tokens)
    except struct.error:
        return _slow(tokens, intern, request)
    _check_sign(out, request)
    if _bool_at(tokens, np.flatnonzero(out <= 1)) is not None:
        return _slow(tokens, intern, request)  # raises, naming the position
    return out, False


def _bool_at(tokens, candidates: np.ndarray):
    """The first of ``candidates`` (positions holding 0 or 1) where ``tokens``
    holds a bool, or None."""
    if candidates.size == 0:
        return None
    picked = itemgetter(*candidates.tolist())(tokens)
    if candidates.size == 1:
        picked = (picked,)
    if bool not in map(type, picked):
        return None
    return int(candidates[[type(t) is bool for t in picked].index(True)])


def flatten(requests: Sequence, intern: Callable[[bytes], int]) -> tuple[np.ndarray, np.ndarray]:
    """Many sequences (a list of them, as ``inputs.token_batch`` checked it)
    as ``(flat int32 tokens, int64 offsets of length B+1)``."""
    for i, r in enumerate(requests):  # one check per request, not per token
        if type(r) is not list and type(r) is not ValidTokens and not isinstance(r, np.ndarray):
            _check_container(r, i)
        elif isinstance(r, np.ndarray) and r.ndim != 1:
            raise ValueError(f"request {i}: tokens must be 1-D, got shape {r.shape}")
    lengths = np.fromiter(map(len, requests), dtype=np.int64, count=len(requests))
    offsets = np.zeros(len(requests) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.empty(int(offsets[-1]), dtype=np.int32)
    digest_requests = []  # converted token by token; negative ids there are digests
    packed = []  # lists packed by struct, which takes bools for ints
    for i, r in enumerate(requests):  # one C call per request; no per-token Python
        lo, hi = offsets[i], offsets[i + 1]
        if type(r) is list or type(r) is tuple:
            try:
                struct.pack_into(f"={hi - lo}i", flat, 4 * lo, *r)
                packed.append(i)
                continue
            except struct.error:
                digest_requests.append(i)
        elif type(r) is ValidTokens:
            digest_requests.append(i)
        arr, digests = tokens_and_digests(r, intern, request=i)
        if digests:  # any other sequence (a deque, a range) holding digests
            digest_requests.append(i)
        flat[lo:hi] = arr
    if packed:
        small = np.flatnonzero((flat >= 0) & (flat <= 1))
        if small.size:  # most batches hold no 0 or 1: nothing to look at
            owner = np.searchsorted(offsets, small, side="right") - 1
            keep = _members(packed, len(requests))[owner]
            for i in np.unique(owner[keep]).tolist():  # requests holding a 0 or a 1
                pos = _bool_at(requests[i], small[keep & (owner == i)] - offsets[i])
                if pos is not None:
                    raise _bool_error(i, pos)
    if flat.size and least(flat) < 0:
        negative = np.nonzero(flat < 0)[0]
        owner = np.searchsorted(offsets, negative, side="right") - 1
        bad = ~_members(digest_requests, len(requests))[owner]
        if bad.any():
            k = int(np.argmax(bad))
            i, pos = int(owner[k]), int(negative[k] - offsets[owner[k]])
            raise token_error(i, pos, int(flat[negative[k]]))
    return flat, offsets


def _members(indices: list, n: int) -> np.ndarray:
    """A mask of ``n`` that holds at ``indices`` (``np.isin``'s answer for
    request indices, without its sort)."""
    mask = np.zeros(n, dtype=bool)
    mask[indices] = True
    return mask


def check_flat(flat, offsets, xp, tokens: bool = True) -> tuple:
    """Validate a caller-built ``(flat_tokens, offsets)`` pair on its device.

    ``tokens=False`` leaves the token range of an int32 array to the caller
    (the only bad int32 tokens are negative: the ``cpu`` match kernel finds
    them in its own pass, see ``token_error``); other dtypes are always checked."""
    if not hasattr(flat, "dtype") or not hasattr(offsets, "dtype"):
        raise TypeError("(flat_tokens, offsets) must be integer arrays")
    if flat.ndim != 1 or offsets.ndim != 1:
        raise ValueError("flat_tokens and offsets must be 1-D arrays")
    if flat.dtype.kind not in "iu":
        raise TypeError(f"flat_tokens must hold integers, got dtype {flat.dtype}")
    if offsets.dtype.kind not in "iu":
        raise TypeError(f"offsets must hold integers, got dtype {offsets.dtype}")
    if offsets.shape[0] < 1:
        raise ValueError("offsets must have length B+1 >= 1")
    offsets = offsets.astype(np.int64, copy=False)
    if int(offsets[0]) != 0:
        raise ValueError(f"offsets must start at 0, got {int(offsets[0])}")
    if int(offsets[-1]) != flat.shape[0]:
        raise ValueError(f"offsets must end at the token count {flat.shape[0]}, got {int(offsets[-1])}")
    steps = offsets[1:] - offsets[:-1]
    if steps.size and least(steps) < 0:
        i = int(xp.argmax(steps < 0))
        raise ValueError(f"request {i}: offsets must be non-decreasing ({int(offsets[i])} > {int(offsets[i + 1])})")
    if flat.size and (tokens or flat.dtype != np.int32):
        lo, hi = _token_range(flat)
        if lo < 0 or hi > MAX_TOKEN_ID:
            bad = int(xp.argmax((flat < 0) | (flat > MAX_TOKEN_ID)))
            i = int(np.searchsorted(_host(offsets), bad, side="right") - 1)
            raise token_error(i, bad - int(offsets[i]), int(flat[bad]))
    return flat.astype(np.int32, copy=False), offsets


def token_error(request: int | None, position: int, token: int) -> TokenError:
    """The error for a token outside the id range, naming where it stands."""
    return TokenError(f"{_where(request)}token {token} at position {position} is outside 0..{MAX_TOKEN_ID}")


def least(a) -> int:
    """The least value of a non-empty int array. On NumPy, ``a[a.argmin()]``:
    ``argmin`` has a fifth of ``min``'s fixed cost (about 0.2 µs against 1.1
    for a 512-token chunk), and every append pays this check."""
    return int(a[a.argmin()]) if type(a) is np.ndarray else int(a.min())


def greatest(a) -> int:
    """The greatest value of a non-empty int array (see ``least``)."""
    return int(a[a.argmax()]) if type(a) is np.ndarray else int(a.max())


def _token_range(a) -> tuple[int, int]:
    """``(min, max)`` of a non-empty int token array, as far as the id range
    needs them: no signed int of 32 bits or fewer passes MAX_TOKEN_ID
    (2**31 - 1), so for those only the sign is read (the min stands in for
    the max)."""
    if a.size <= _SHORT_ARRAY and type(a) is np.ndarray:  # a decode step's token or two
        values = a.tolist()
        return min(values), max(values)
    lo = least(a)
    hi = greatest(a) if a.dtype.itemsize > 4 or a.dtype.kind == "u" else lo
    return lo, hi


def _host(a):
    return a if isinstance(a, np.ndarray) else a.get()


def _from_ndarray(a: np.ndarray, request) -> np.ndarray:
    if a.ndim != 1:  # a 0-d array too: one int is not a sequence
        raise ValueError(f"{_where(request)}tokens must be 1-D, got shape {a.shape}")
    if a.dtype.kind not in "iu":
        raise TypeError(f"{_where(request)}tokens must be integers, got dtype {a.dtype}")
    if a.size:
        lo, hi = _token_range(a)
        if lo < 0 or hi > MAX_TOKEN_ID:
            bad = int(np.argmax((a < 0) | (a > MAX_TOKEN_ID)))
            raise token_error(request, bad, int(a[bad]))
    return a.astype(np.int32, copy=False)


def _bool_error(request, pos) -> TypeError:
    return TypeError(f"{_where(request)}token at position {pos} must be an int or 32-byte digest, got a bool")


def _check_sign(a: np.ndarray, request):
    if a.size and least(a) < 0:
        bad = int(np.argmax(a < 0))
        raise token_error(request, bad, int(a[bad]))


def _slow(tokens, intern, request) -> tuple:
    """Token by token: only for sequences holding digests (or errors). Every
    token is validated before any digest is interned, so a rejected sequence
    leaves the digest table as it was. ``(array, whether digests were in it)``."""
    out = np.empty(len(tokens), dtype=np.int32)
    digests = []
    for pos, tok in enumerate(tokens):
        if isinstance(tok, bytes):
            if len(tok) != DIGEST_BYTES:
                raise TokenError(f"{_where(request)}digest token at position {pos} must be 32 bytes, got {len(tok)}")
            digests.append(pos)
        elif type(tok) is bool:
            raise _bool_error(request, pos)
        elif isinstance(tok, (int, np.integer)):
            if not 0 <= tok <= MAX_TOKEN_ID:
                raise token_error(request, pos, tok)
            out[pos] = tok
        else:
            raise TypeError(f"{_where(request)}token at position {pos} must be an int or 32-byte digest, got {tok!r}")
    for pos in digests:
        out[pos] = intern(tokens[pos])
    return out, bool(digests)

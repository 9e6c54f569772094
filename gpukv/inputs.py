"""What every entry point checks, and the one place it is written.

A call of the manager takes, besides single ints and bools, lists with one
entry per request or per cache: token sequences, caches, capacities, flags,
priority callbacks, scopes. Each kind is checked here, by one function, so
every call that takes it refuses the same bad input with the same sentence,
named by the call (``what``: ``"resize_batch()"``) and the entry
(``capacities[2]``), before anything changes:

- ``is_entry_list``: what may stand for one entry per request or cache;
- ``non_negative_int``, ``ints``, ``ints_or_one``, ``flags``, ``callback``,
  ``callbacks``: per-call and per-entry values;
- ``cache_slots``: a list of a manager's caches, each once, as pool slots
  (a ``CacheBatch``: checked once, when it was made);
- ``one_scope``, ``scope_list``: the scopes of a batch, resolved once into a
  ``ScopeList`` that later steps of the same call take as it is;
- ``token_batch``, ``one_request``: a batch's tokens in any of its three
  shapes (a list of token sequences, a ``(flat_tokens, offsets)`` pair,
  registered ``TokenSequence``s), checked once into a ``TokenBatch`` that the
  match and the calls on caches take as it is.

One token sequence is converted and checked by ``tokens.py``'s converters.

A batch of one takes the per-cache path where one exists: checked in plain
Python, no array built.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

import numpy as np

from .arena import TokenArena, TokenSequence
from .core.scope import ReuseScope, as_scope
from .tokens import ValidTokens, check_flat, flatten, least, token_array

_BOOLS = frozenset({bool, np.bool_})
_slot_of = attrgetter("_slot")
_serial_of = attrgetter("_serial")
_NOT_LISTS = (str, bytes, bytearray)


def is_entry_list(values) -> bool:
    """Whether ``values`` is one entry per cache or request: an ordered
    sequence (a list, a tuple, a 1-D array), never a string, a set or a
    mapping, whose order would pair its entries with the caches arbitrarily."""
    if isinstance(values, np.ndarray):
        return values.ndim == 1
    return isinstance(values, Sequence) and not isinstance(values, _NOT_LISTS)


def is_request_list(requests) -> bool:
    """Whether ``requests`` is one token sequence per request: an entry list,
    or a 2-D integer array (one row per request)."""
    return is_entry_list(requests) or isinstance(requests, np.ndarray) and requests.ndim == 2


# -- single values and one value per entry --------------------------------------------------
def non_negative_int(name: str, v) -> int:
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
        raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    return int(v)


def ints(values, n: int, name: str, what: str) -> np.ndarray:
    """One non-negative int per cache, as int64."""
    if not is_entry_list(values):
        raise TypeError(f"{what}: {name} must be one non-negative int per cache (a list or a 1-D array), "
                        f"got {type(values).__name__}")
    if len(values) != n:
        raise ValueError(f"{what}: {name} has {len(values)} entries for {n} caches")
    # NumPy takes a bool for an int, and a ragged list only with an error of its own.
    a = None
    if isinstance(values, np.ndarray) or not _BOOLS.intersection(map(type, values)):
        try:
            a = np.asarray(values)
        except ValueError:
            pass  # ragged: the entry is named below
    if n and (a is None or a.ndim != 1 or a.dtype.kind not in "iu"):
        for i, v in enumerate(values):
            if not isinstance(v, (int, np.integer)) or isinstance(v, (bool, np.bool_)):
                raise TypeError(f"{what}: {name}[{i}] must be a non-negative int, got {v!r}")
        raise TypeError(f"{what}: {name} must be one non-negative int per cache")
    a = a.astype(np.int64, copy=False).reshape(n)
    if n and least(a) < 0:
        i = int(np.argmax(a < 0))
        raise ValueError(f"{what}: {name}[{i}] must be a non-negative int, got {int(a[i])}")
    return a


def ints_or_one(values, n: int, name: str, what: str) -> int | np.ndarray:
    """A non-negative int for all, kept one int (the batched calls' steps
    take an int as they take an array, and build none for it), or one per
    cache, as int64."""
    if isinstance(values, (int, np.integer)) and not isinstance(values, (bool, np.bool_)):
        if values < 0:
            raise ValueError(f"{what}: {name} must be a non-negative int, got {values!r}")
        return int(values)
    return ints(values, n, name, what)


def flags(values, n: int, name: str, what: str) -> np.ndarray:
    """A bool for all, or one per cache."""
    if isinstance(values, (bool, np.bool_)):
        return np.full(n, bool(values))
    if not is_entry_list(values):
        raise TypeError(f"{what}: {name} must be a bool or one bool per cache, got {values!r}")
    if len(values) != n:
        raise ValueError(f"{what}: {name} has {len(values)} entries for {n} caches")
    a = np.asarray(values)
    if n and a.dtype != np.bool_:
        i = next((i for i, v in enumerate(values) if not isinstance(v, (bool, np.bool_))), 0)
        raise TypeError(f"{what}: {name}[{i}] must be a bool, got {values[i]!r}")
    return a.reshape(n)


_CALLBACK = "callable(ordinal, life_cycle_id) -> int"


def callback(cb):
    """One cache's priority callback (or None)."""
    if cb is not None and not callable(cb):
        raise TypeError(f"priority_callback must be {_CALLBACK}, got {cb!r}")
    return cb


def callbacks(priority_callbacks, n: int, what: str) -> list:
    """One priority callback (or None) per request."""
    if priority_callbacks is None:
        return [None] * n
    if not is_entry_list(priority_callbacks):
        raise TypeError(f"{what}: priority_callbacks must be None or one callable (or None) per request (a list), "
                        f"got {priority_callbacks!r}")
    out = list(priority_callbacks)
    if len(out) != n:
        raise ValueError(f"{what}: priority_callbacks has {len(out)} entries for {n} requests")
    for i, cb in enumerate(out):
        if cb is not None and not callable(cb):
            raise TypeError(f"{what}: priority_callbacks[{i}] must be {_CALLBACK}, got {cb!r}")
    return out


# -- caches ---------------------------------------------------------------------------------
def _handle(kv):
    """A cache's pool handle ``(slot, serial)``; None for what is no cache.
    (``KVCache`` lives above this module; a cache is what carries one.)"""
    slot, serial = getattr(kv, "_slot", None), getattr(kv, "_serial", None)
    return None if type(slot) is not int or serial is None else (slot, serial)


class CacheBatch(tuple):
    """A list of one manager's caches, each once, checked once
    (``mgr.cache_batch``): every batched call takes it where it takes a list
    of caches and finds their slots without checking the list again (an
    engine's running batch, the same every decode step). It holds its
    caches, so their slots stay theirs while it lives; each call still
    checks their states."""

    def __new__(cls, caches, slots: np.ndarray, pool):
        batch = super().__new__(cls, caches)
        slots.setflags(write=False)
        batch.slots, batch.pool = slots, pool
        return batch


def cache_slots(caches, pool, what: str) -> np.ndarray:
    """The slots in ``pool`` (a ``CachePool``) of ``caches``: a list of the
    pool's caches, each once, or a ``CacheBatch`` of them."""
    if type(caches) is CacheBatch:
        if caches.pool is not pool:
            raise ValueError(f"{what}: the cache batch belongs to another manager")
        return caches.slots
    if not is_entry_list(caches):
        raise TypeError(f"{what}: caches must be a list of KVCache (in order), got {type(caches).__name__}")
    n = len(caches)
    serial = pool.serial
    if n == 1:  # admission chunks: one cache per call, checked without arrays
        h = _handle(caches[0])
        if h is not None and 0 <= h[0] < serial.shape[0] and serial[h[0]] == h[1]:
            return np.array([h[0]], dtype=np.int64)
    try:
        listed = list(map(_slot_of, caches))
        slots = np.array(listed, dtype=np.int64)
        serials = np.fromiter(map(_serial_of, caches), dtype=np.int64, count=n)
    except (AttributeError, TypeError):
        i = next(i for i, kv in enumerate(caches) if _handle(kv) is None)
        raise TypeError(f"{what}: caches[{i}] is not a KVCache, got {type(caches[i]).__name__}") from None
    # Serials tell every cache of the process apart and a free slot holds
    # -1, so a slot out of range, clipped to one in range, cannot hold the
    # cache's serial: one gather and one test.
    if n and (not serial.shape[0] or not (serial.take(slots, mode="clip") == serials).all()):
        ours = (slots >= 0) & (slots < serial.shape[0])
        ours[ours] = serial[slots[ours]] == serials[ours]
        i = int(np.argmin(ours))
        raise ValueError(f"{what}: caches[{i}] belongs to another manager")
    if len(set(listed)) != n:
        order = np.argsort(slots, kind="stable")
        k = int(np.argmax(slots[order[1:]] == slots[order[:-1]]))
        first, again = sorted((int(order[k]), int(order[k + 1])))
        raise ValueError(f"{what}: caches[{again}] is caches[{first}] again; list each cache once")
    return slots


# -- scopes ---------------------------------------------------------------------------------
class ScopeList(tuple):
    """One ``ReuseScope`` per request, resolved by ``scope_list``: what a
    later step of the same call is handed, and takes without checking again."""

    __slots__ = ()


def one_scope(scopes) -> bool:
    """Whether ``scopes`` is one scope for every request (None: the default)."""
    return scopes is None or isinstance(scopes, ReuseScope)


def scope_list(scopes, n: int, what: str) -> ScopeList:
    """``scopes`` (None, one ``ReuseScope`` for all, or one per request) as
    one ``ReuseScope`` per request."""
    if type(scopes) is ScopeList and len(scopes) == n:
        return scopes
    if one_scope(scopes):
        return ScopeList((as_scope(scopes),) * n)
    if not is_entry_list(scopes):
        raise TypeError(f"{what}: scopes must be None, one gpukv.ReuseScope, or one per request (a list)")
    if len(scopes) != n:
        raise ValueError(f"{what}: scopes has {len(scopes)} entries for {n} requests")
    out = []
    for i, s in enumerate(scopes):
        try:
            out.append(as_scope(s))
        except TypeError as e:
            raise TypeError(f"{what}: scopes[{i}]: {e}") from None
    return ScopeList(out)


# -- tokens ---------------------------------------------------------------------------------
class TokenBatch:
    """A batch's tokens, checked (``token_batch``): ``flat`` int32 with
    ``offsets`` int64 of B + 1 (a caller's device pair stays on its device,
    anything else is on the host), or, when every request is a registered
    ``TokenSequence``, ``sequences`` (their tokens are in the arena already,
    read out only when asked: ``arrays``). ``converted``: ``flat`` was
    converted from token sequences, its digests as the converter gave them;
    ``unchecked``: an int32 pair whose signs are left to the match kernel."""

    __slots__ = ("flat", "offsets", "sequences", "converted", "unchecked", "_backend")

    def __init__(self, backend, flat=None, offsets=None, sequences=None, converted=False, unchecked=False):
        self._backend = backend
        self.flat, self.offsets, self.sequences = flat, offsets, sequences
        self.converted, self.unchecked = converted, unchecked

    def __len__(self) -> int:
        return len(self.sequences) if self.sequences is not None else int(self.offsets.shape[0]) - 1

    def lengths(self) -> np.ndarray:
        """Each request's token count (int64, on the host)."""
        if self.sequences is not None:
            return np.fromiter(map(len, self.sequences), dtype=np.int64, count=len(self.sequences))
        return np.diff(self._backend.to_host(self.offsets))

    def arrays(self) -> tuple:
        """``(flat, offsets)``, ``offsets`` on the host (``flat`` on the
        caller's device for a device pair)."""
        if self.sequences is None:
            return self.flat, self._backend.to_host(self.offsets)
        to_host = self._backend.to_host
        offsets = np.zeros(len(self.sequences) + 1, dtype=np.int64)
        np.cumsum(self.lengths(), out=offsets[1:])
        flat = np.concatenate([np.asarray(to_host(s.tokens)) for s in self.sequences] or [np.zeros(0, np.int32)])
        return flat.astype(np.int32, copy=False), offsets


def check_sequence(i: int, s: TokenSequence, arena: TokenArena) -> None:
    """A registered sequence is request ``i``'s tokens only while it is the
    manager's and not released (its tokens were checked on ``extend``)."""
    if s._arena is not arena:
        raise ValueError(f"request {i}: TokenSequence belongs to another manager")
    if s.released:
        raise ValueError(f"request {i}: TokenSequence was released")


# Entries ``flatten`` takes as they are; any other (a registered sequence, a
# device array, another Sequence) is looked at on its own first.
_FLATTENED = frozenset({list, tuple, np.ndarray, ValidTokens})


def _host_entry(i: int, r, arena: TokenArena):
    if type(r) is TokenSequence:
        check_sequence(i, r, arena)
        return ValidTokens(np.asarray(arena.backend.to_host(r.tokens)))
    return arena.backend.to_host(r) if hasattr(r, "__cuda_array_interface__") else r


def token_batch(tokens, convert, arena: TokenArena, what: str, *, name: str = "requests", n: int | None = None,
                kernel_checks_signs: bool = False) -> TokenBatch:
    """``tokens`` (a list of token sequences, one per request, registered
    ``TokenSequence``s among them; a 2-D array, one row each; or a
    ``(flat_tokens, offsets)`` pair, device arrays accepted) checked as
    ``name`` of ``what``, ``n`` entries (None: any number), digests converted
    by ``convert`` (the tables' ``lookup_digest`` or ``intern_digest``).
    ``kernel_checks_signs``: the match kernel finds negative tokens in an
    int32 pair itself (``TokenBatch.unchecked``)."""
    backend = arena.backend
    if isinstance(tokens, tuple) and len(tokens) == 2 and hasattr(tokens[0], "dtype"):  # (flat_tokens, offsets)
        unchecked = kernel_checks_signs and tokens[0].dtype == np.int32
        flat, offsets = check_flat(tokens[0], tokens[1], backend.xp, tokens=not unchecked)
        if n is not None and offsets.shape[0] != n + 1:
            raise ValueError(f"{what}: offsets has {offsets.shape[0]} entries for {n} caches (needs {n + 1})")
        return TokenBatch(backend, flat, offsets, unchecked=unchecked)
    if not is_request_list(tokens):
        raise TypeError(f"{what}: {name} must be a list of token sequences or a (flat_tokens, offsets) pair, "
                        f"got {type(tokens).__name__}")
    if n is not None and len(tokens) != n:
        raise ValueError(f"{what}: {name} has {len(tokens)} entries for {n} caches")
    kinds = set(map(type, tokens))
    if kinds == {TokenSequence}:  # the scheduler's registered requests: matched from the arena
        for i, s in enumerate(tokens):
            check_sequence(i, s, arena)
        return TokenBatch(backend, sequences=list(tokens))
    if isinstance(tokens, np.ndarray) or not kinds <= _FLATTENED:
        tokens = [_host_entry(i, r, arena) for i, r in enumerate(tokens)]
    flat, offsets = flatten(tokens, convert)
    return TokenBatch(backend, flat, offsets, converted=True)


def one_request(tokens, convert, arena: TokenArena) -> TokenBatch:
    """One request's tokens (a token sequence or a registered
    ``TokenSequence``) as a batch of one."""
    if type(tokens) is TokenSequence:
        check_sequence(0, tokens, arena)
        return TokenBatch(arena.backend, sequences=[tokens])
    a = token_array(tokens, convert)
    return TokenBatch(arena.backend, a, np.array([0, a.shape[0]], dtype=np.int64), converted=True)

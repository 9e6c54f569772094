"""Registered token sequences in one device-resident arena.

A scheduler keeps one ``TokenSequence`` per request and ``extend``s it as
prompt chunks or generated tokens arrive. All sequences share one token array
and one array of per-block content hashes on the backend's device; a
sequence's segment starts on a block boundary, so block ``j`` of a sequence at
``start`` has its hash at ``hashes[start // T + j]``. ``match_batch`` over
registered sequences therefore copies no tokens from the host and hashes only
full blocks that were never hashed before.

Segments grow by doubling (moving on the device); when the arena is full it is
compacted, and doubled if still too small.
"""

from __future__ import annotations

import weakref

import numpy as np

from .launcher import serialized
from .tokens import token_array

MIN_SEGMENT_BLOCKS = 4


class TokenArena:
    def __init__(self, backend, tokens_per_block: int, intern, capacity_blocks: int = 1024):
        self.backend = backend
        self.T = tokens_per_block
        self.intern = intern
        xp = backend.xp
        self.tokens = xp.zeros(capacity_blocks * self.T, dtype=np.int32)
        self.hashes = xp.zeros(capacity_blocks, dtype=np.int64)
        # The memo, indexed like hashes: the tree rows (and their serials) a
        # sequence's leading full blocks matched last time.
        self.memo_rows = xp.zeros(capacity_blocks, dtype=np.int64)
        self.memo_serials = xp.zeros(capacity_blocks, dtype=np.int64)
        self.top_blocks = 0  # bump pointer, in blocks
        # Per-slot metadata on the host: where each sequence lives and how far
        # it is hashed. Freed slot ids are reused.
        self.start = np.zeros(16, dtype=np.int64)
        self.length = np.zeros(16, dtype=np.int64)
        self.cap_blocks = np.zeros(16, dtype=np.int64)
        self.hashed = np.zeros(16, dtype=np.int64)
        self.verified = np.zeros(16, dtype=np.int64)  # memoized blocks
        self.memo_scope = np.zeros(16, dtype=np.int64)  # the scope id they matched under
        self.memo_epoch = np.zeros(16, dtype=np.int64)  # the tree's detach count then
        self.live = np.zeros(16, dtype=bool)
        self._free_slots: list[int] = []
        self._next_slot = 0

    # -- slots --------------------------------------------------------------------
    def new_slot(self) -> int:
        if self._free_slots:
            s = self._free_slots.pop()
        else:
            s = self._next_slot
            self._next_slot += 1
            if s >= self.start.size:
                for name in ("start", "length", "cap_blocks", "hashed", "verified", "memo_scope", "memo_epoch", "live"):
                    old = getattr(self, name)
                    new = np.zeros(2 * old.size, dtype=old.dtype)
                    new[: old.size] = old
                    setattr(self, name, new)
        self.start[s] = self._alloc(MIN_SEGMENT_BLOCKS)
        self.cap_blocks[s] = MIN_SEGMENT_BLOCKS
        self.length[s] = 0
        self.hashed[s] = 0
        self.verified[s] = 0
        self.live[s] = True
        return s

    def release(self, s: int):
        if self.live[s]:
            self.live[s] = False
            self.length[s] = 0
            self._free_slots.append(s)

    # -- tokens --------------------------------------------------------------------
    def extend(self, s: int, tokens):
        arr = token_array(tokens, self.intern)
        if arr.size == 0:
            return
        n0 = int(self.length[s])
        n1 = n0 + arr.size
        need = -(-n1 // self.T)
        if need > self.cap_blocks[s]:
            self._move(s, max(need, 2 * int(self.cap_blocks[s])))
        lo = int(self.start[s]) + n0
        self.tokens[lo:lo + arr.size] = self.backend.to_device(arr)
        self.length[s] = n1

    def view(self, s: int):
        lo = int(self.start[s])
        return self.tokens[lo:lo + int(self.length[s])]

    def prepare(self, slots: np.ndarray):
        """Hash the not-yet-hashed full blocks of ``slots``; return the device
        arrays ``(starts, lengths, hash_off)`` the match kernel reads, plus
        ``(src, dst, first_block, total)`` for the hash kernel (total 0 when
        nothing is new)."""
        starts = self.start[slots]
        lengths = self.length[slots]
        full = lengths // self.T
        fresh = full - self.hashed[slots]
        first_block = np.zeros(slots.size, dtype=np.int64)
        np.cumsum(fresh[:-1], out=first_block[1:])
        total = int(fresh.sum())
        src = starts + self.hashed[slots] * self.T
        dst = starts // self.T + self.hashed[slots]
        self.hashed[slots] = full
        return starts, lengths, starts // self.T, (src, dst, first_block, total)

    # -- space -----------------------------------------------------------------------
    def _alloc(self, blocks: int) -> int:
        if self.top_blocks + blocks > self.hashes.shape[0]:
            self._compact(blocks)
        start = self.top_blocks * self.T
        self.top_blocks += blocks
        return start

    _PER_BLOCK = ("hashes", "memo_rows", "memo_serials")  # device arrays indexed by block

    def _move(self, s: int, blocks: int):
        old_start, n = int(self.start[s]), int(self.length[s])
        old_block0 = old_start // self.T
        kept = int(self.hashed[s])  # hashed >= verified: one count covers all three
        self.live[s] = False  # while moving, a compaction must not keep the old copy
        tok = self.tokens[old_start:old_start + n].copy()
        per_block = [getattr(self, a)[old_block0:old_block0 + kept].copy() for a in self._PER_BLOCK]
        new_start = self._alloc(blocks)
        self.tokens[new_start:new_start + n] = tok
        b0 = new_start // self.T
        for a, values in zip(self._PER_BLOCK, per_block):
            getattr(self, a)[b0:b0 + kept] = values
        self.start[s] = new_start
        self.cap_blocks[s] = blocks
        self.live[s] = True

    def _compact(self, extra_blocks: int):
        """Pack live segments to the front; double the arena while too small."""
        xp = self.backend.xp
        live = np.nonzero(self.live[: self._next_slot])[0]
        used = int(self.cap_blocks[live].sum())
        capacity = self.hashes.shape[0]
        while used + extra_blocks > capacity * 3 // 4:  # keep a quarter free after packing
            capacity *= 2
        tokens = xp.zeros(capacity * self.T, dtype=np.int32)
        per_block = {a: xp.zeros(capacity, dtype=np.int64) for a in self._PER_BLOCK}
        top = 0
        for s in live:  # rare: one copy per live sequence, on the device
            lo, n, h = int(self.start[s]), int(self.length[s]), int(self.hashed[s])
            tokens[top * self.T:top * self.T + n] = self.tokens[lo:lo + n]
            for a, arr in per_block.items():
                arr[top:top + h] = getattr(self, a)[lo // self.T:lo // self.T + h]
            self.start[s] = top * self.T
            top += int(self.cap_blocks[s])
        self.tokens, self.top_blocks = tokens, top
        for a, arr in per_block.items():
            setattr(self, a, arr)


class TokenSequence:
    """One request's tokens, registered in the manager's arena.

    The calls that change the arena (``extend``, ``release``) run under the
    manager's ``CallGuard``, as the manager's own calls do: a match reads the
    arena, so a sequence extended or released from a callback inside a call,
    or from another thread while one is in progress, is refused with
    ``BusyError`` before it changes anything. (Garbage collection releases a
    sequence's slot without the guard: it cannot be refused, and freeing a
    slot moves no data a call in progress reads.)"""

    def __init__(self, arena: TokenArena, launcher):
        self._arena = arena
        self._launcher = launcher  # its guard serializes the calls below with the manager's
        self._slot = arena.new_slot()
        self._finalizer = weakref.finalize(self, arena.release, self._slot)

    @serialized("TokenSequence.extend()")
    def extend(self, tokens) -> "TokenSequence":
        self._check()
        self._arena.extend(self._slot, tokens)
        return self

    def __len__(self) -> int:
        return int(self._arena.length[self._slot]) if self._finalizer.alive else 0

    @property
    def tokens(self):
        """The tokens, read only (valid until the next ``extend``): a NumPy view
        that refuses writes, or a CuPy copy (CuPy has no read-only arrays).
        Writing through a view would change what matching sees behind the
        hashes the arena keeps."""
        self._check()
        view = self._arena.view(self._slot)
        if isinstance(view, np.ndarray):
            view = view.view()
            view.flags.writeable = False
            return view
        return view.copy()

    @serialized("TokenSequence.release()")
    def release(self):
        """Give the arena space back (also done on garbage collection)."""
        self._finalizer()

    @property
    def released(self) -> bool:
        return not self._finalizer.alive

    def _check(self):
        if not self._finalizer.alive:
            raise ValueError("this TokenSequence was released")

    def __repr__(self):
        return f"TokenSequence(len={len(self)})"

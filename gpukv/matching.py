"""The host side of batched reuse matching: pack a batch, launch, unpack.

``Matcher.match`` takes a whole scheduling batch at once, in any of three
shapes (Python token lists, a flat array with offsets, registered
``TokenSequence``s), and returns a ``BatchMatch`` of device arrays. ``probe_reuse``
and ``introspect.reuse_match_pages`` are this same call on a batch of one, so
the three can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from .arena import TokenArena
from .kernels.match import MatchBatch, build_match_kernels
from .core.layout import (
    CNT_DETACHES,
    RES_BEFORE_HYBRID_PRUNING,
    RES_BEFORE_PRUNING,
    RES_NUM_BLOCKS,
    RES_NUM_LOOKUP_TOKENS,
    RES_NUM_TOKENS,
    RES_WIDTH,
)
from . import inputs
from .launcher import Launcher
from .tables import Tables
from .tokens import token_error
from .tree import BlockTree


@dataclass(frozen=True)
class MatchStamp:
    """Which manager made a match, and when: ``admit_batch`` takes the match
    while ``removals`` is still its launcher's (``Launcher.removals``)."""

    launcher: object
    removals: int
    scope_ids: np.ndarray  # per request, on the host; -1: a scope no root was made for yet
    scopes: object  # None, one ReuseScope, or a ScopeList (inputs.scope_list)


@dataclass
class BatchMatch:
    """Per-request reuse results; arrays live on the backend's device.

    The matched tree blocks (table rows) of request ``i`` are
    ``block_ids[block_offsets[i]:block_offsets[i + 1]]``."""

    num_tokens: object
    num_lookup_tokens: object
    num_tokens_before_pruning: object
    num_tokens_before_hybrid_pruning: object
    block_offsets: object
    block_ids: object
    stamp: MatchStamp | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return int(self.num_tokens.shape[0])

    def to_host(self) -> "BatchMatch":
        def host(a):
            return a if isinstance(a, np.ndarray) else a.get()

        arrays = (host(getattr(self, f.name)) for f in fields(self) if f.name != "stamp")
        return BatchMatch(*arrays, stamp=self.stamp)

    def blocks(self, i: int):
        """The matched block rows of request ``i``."""
        return self.block_ids[self.block_offsets[i]:self.block_offsets[i + 1]]


class Matcher:
    def __init__(self, tables: Tables, tree: BlockTree, arena: TokenArena, config, launcher: Launcher):
        self.tables = tables
        self.tree = tree
        self.arena = arena
        self.launcher = launcher
        self.backend = tables.backend
        self.kernels = build_match_kernels(self.backend.target)
        self.T = config.tokens_per_block
        self.default_partial = config.enable_partial_reuse
        self.default_backoff = config.reuse_match_backoff
        ssm = config.ssm_life_cycle_id
        self.ssm_lc = -1 if ssm is None else ssm
        # cpu: hash during the walk (only blocks it reaches); cuda: hash every
        # block first, one thread per block, so the walk threads only look up.
        self.prehash = self.backend.target == "cuda"
        self._empty = self.backend.to_device(np.zeros(0, dtype=np.int64))
        self._empty_bool = self.backend.to_device(np.zeros(0, dtype=bool))
        self._path = None  # scratch, see _take_path

    # -- packing --------------------------------------------------------------------
    def _pack(self, requests, what):
        """``(tokens, starts, lengths, hashes, hash_off, slots, check)`` on the
        device; ``slots`` are the arena slots of registered sequences, else
        None; ``check``: the kernel must check the tokens' signs (on ``cpu``
        an int32 pair's are left to it: no separate pass)."""
        batch = requests if type(requests) is inputs.TokenBatch else inputs.token_batch(
            requests, self.tables.lookup_digest, self.arena, what, kernel_checks_signs=not self.prehash)
        if batch.sequences is not None:
            return self._registered(batch.sequences)
        b = self.backend
        flat, offsets = b.to_device(batch.flat), b.to_device(batch.offsets)
        return (*self._flat(flat, offsets[:-1], offsets[1:] - offsets[:-1]), batch.unchecked)

    def _flat(self, flat, starts, lengths):
        if not self.prehash:
            return flat, starts, lengths, self._empty, self._empty, None
        xp = self.backend.xp
        full = lengths // self.T
        hash_off = xp.zeros(full.shape[0], dtype=np.int64)
        if full.shape[0] > 1:
            xp.cumsum(full[:-1], out=hash_off[1:])
        total = int(full.sum()) if full.shape[0] else 0
        hashes = xp.empty(max(total, 1), dtype=np.int64)
        self.kernels.hash_blocks(flat, starts, hash_off, hash_off, hashes, self.T, total)
        return flat, starts, lengths, hashes, hash_off, None

    def _registered(self, seqs):
        slots = np.fromiter((s._slot for s in seqs), dtype=np.int64, count=len(seqs))
        a = self.arena
        hashed = a.hashed[slots]  # a copy: prepare() counts the blocks as hashed before they are
        try:
            starts, lengths, hash_off, (src, dst, first, total) = a.prepare(slots)
            b = self.backend
            if total:
                self.launcher.read(
                    self.kernels.hash_blocks, a.tokens, b.to_device(src), b.to_device(dst), b.to_device(first),
                    a.hashes, self.T, total,
                )
        except BaseException:
            a.hashed[slots] = hashed  # not hashed after all: the next match hashes them
            raise
        return a.tokens, b.to_device(starts), b.to_device(lengths), a.hashes, b.to_device(hash_off), slots, False

    def _scopes(self, scopes, B, what):
        """Per-request ``(scope ids, root keys)`` as host arrays, and the scopes
        as the match got them (one, or a ``ScopeList``); -1 for a scope never used."""
        if inputs.one_scope(scopes):
            sid = self.tree.scope_id(scopes)
            key = self.tree.scope_key(sid) if sid >= 0 else 0
            return np.full(B, sid, dtype=np.int64), np.full(B, key, dtype=np.int64), scopes
        scopes = inputs.scope_list(scopes, B, what)
        ids = np.empty(B, dtype=np.int64)
        keys = np.zeros(B, dtype=np.int64)
        for i, s in enumerate(scopes):
            ids[i] = self.tree.scope_id(s)
            if ids[i] >= 0:
                keys[i] = self.tree.scope_key(ids[i])
        return ids, keys, scopes

    def _memo(self, slots, scope_ids):
        """The memo arrays for registered sequences: forgotten where the scope
        changed, trusted without re-checking where nothing was detached since."""
        a, b = self.arena, self.backend
        epoch = int(self.tables.counters_host()[CNT_DETACHES])
        verified = np.where(a.memo_scope[slots] == scope_ids, a.verified[slots], 0)
        trusted = a.memo_epoch[slots] == epoch
        return b.to_device(verified), b.to_device(trusted), epoch

    def _take_path(self, n):
        """The scratch path (matched rows per request before compaction) of at
        least ``n`` entries: kept between calls (a fresh array costs a page
        fault per 4 KiB when the kernel first writes it). A concurrent call
        finds none kept and allocates its own."""
        path, self._path = self._path, None
        if path is None or path.shape[0] < n:
            path = self.backend.xp.empty(max(n + n // 4, 1), dtype=np.int64)
        return path

    # -- matching ---------------------------------------------------------------------
    def match(self, requests, scopes=None, partial=None, backoff=None, what="match_batch()") -> BatchMatch:
        """``requests``: any of the three shapes, or a ``TokenBatch`` checked
        already; ``what``: the call whose errors these are."""
        b = self.backend
        xp = b.xp
        partial = self.default_partial if partial is None else partial
        backoff = self.default_backoff if backoff is None else backoff
        toks, starts, lengths, hashes, hash_off, slots, check = self._pack(requests, what)
        B = int(starts.shape[0])
        scope_ids, scope_keys, scopes = self._scopes(scopes, B, what)
        if slots is not None:
            verified, trusted, epoch = self._memo(slots, scope_ids)
            memo_rows, memo_serials = self.arena.memo_rows, self.arena.memo_serials
        else:
            verified, trusted, memo_rows, memo_serials = self._empty, self._empty_bool, self._empty, self._empty
        path_off = xp.zeros(B + 1, dtype=np.int64)
        if B:
            xp.cumsum((lengths + self.T - 1) // self.T, out=path_off[1:])
        path = self._take_path(int(path_off[-1]))
        batch = MatchBatch(
            toks=toks, starts=starts, lengths=lengths, hashes=hashes, hash_off=hash_off,
            scope_ids=b.to_device(scope_ids), scope_keys=b.to_device(scope_keys),
            memo_rows=memo_rows, memo_serials=memo_serials, verified=verified, trusted=trusted,
            path=path, path_off=path_off, res=xp.zeros((B, RES_WIDTH), dtype=np.int64),
            bad=np.empty(B, dtype=np.int64) if check else self._empty,
        )
        if B:
            self.launcher.read(self.kernels.match, self.tables.device, batch, bool(partial), int(backoff), self.ssm_lc)
        if check and B:
            bad = batch.bad
            if int(bad.max()) >= 0:
                i = int(np.argmax(bad >= 0))
                self._path = path
                raise token_error(i, int(bad[i]), int(toks[int(starts[i]) + int(bad[i])]))
        if slots is not None:
            self.arena.verified[slots] = b.to_host(verified)
            self.arena.memo_scope[slots] = scope_ids
            self.arena.memo_epoch[slots] = epoch
        res = batch.res
        block_offsets = xp.zeros(B + 1, dtype=np.int64)
        if B:
            xp.cumsum(res[:, RES_NUM_BLOCKS], out=block_offsets[1:])
        block_ids = xp.empty(int(block_offsets[-1]), dtype=np.int64)
        if B and block_ids.shape[0]:
            self.launcher.read(self.kernels.compact, batch, block_offsets, block_ids)
        self._path = path
        return BatchMatch(
            num_tokens=res[:, RES_NUM_TOKENS],
            num_lookup_tokens=res[:, RES_NUM_LOOKUP_TOKENS],
            num_tokens_before_pruning=res[:, RES_BEFORE_PRUNING],
            num_tokens_before_hybrid_pruning=res[:, RES_BEFORE_HYBRID_PRUNING],
            block_offsets=block_offsets,
            block_ids=block_ids,
            stamp=MatchStamp(self.launcher, self.launcher.removals, scope_ids, scopes),
        )

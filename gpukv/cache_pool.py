"""``CachePool``: the sequence state of every cache of one manager, in one set of device arrays.

A cache owns a *slot* (its row of scalars, arguments and scratch) and a
*segment* of block rows ``[base, base + blocks)`` in the block-indexed arrays
(pages, kinds, tree rows, tokens, priorities, the matched path). The sequence
kernels (``kernels/seq.py``) take the whole pool and a list of slots, and
build each cache's ``SeqTables`` in-kernel as views of its rows, so one
launch serves a whole batch of caches and the per-cache kernel code is the
same for a batch of one.

A segment too small for a resize grows in place when it is the last one, or
else moves to the end of the pool with half as much room again as asked and
at least twice what it had (amortised, like a growing array); when the end
is reached, the live segments are packed to the front, in a bigger pool
when they need it. Moves change the arrays, so a cache's views are rebuilt
when the pool's generation changed. A slot is given back when its cache is
garbage collected (a closed cache still answers its committed tokens until
then), or by the call that took it when that call never made its cache.

A slot is in use exactly while ``serial`` holds its cache's serial (-1:
free); taking and giving back a slot are each one store into it, so an
exception (an interrupt) anywhere around them leaves every slot either free
or listed for its giving back, never lost. A finalizer an interrupt cuts
short before it lists its slot leaves the slot looking taken; the pass over
the slots that runs when no listed slot is free finds it (``_reclaim_lost``).

A slot is named by an int (a call on one cache) or an int64 array of them (a
batched call); every method that takes ``slots`` takes either, so the calls
(``batch.py``) run the same code for one cache as for many.
"""

from __future__ import annotations

import heapq
import itertools
import struct

import numpy as np

from .core.config import DEFAULT_PRIORITY
from .core.errors import LogicError
from .core.kinds import has_window, is_checkpoint
from .core.layout import (
    BATCH_ARGS, BATCH_OP, BATCH_PATH, BATCH_SLOT, BATCH_TOKENS, BATCH_WIDTH, FIRST_COMMIT_OP,
    CLOSED, MAX_CACHES, NULL, Q_COMMITTED, Q_NEVER_RESUMED, Q_SCOPE_ID, Q_SCOPE_KEY, Q_SSM_PAGE, Q_STATUS, Q_WIDTH,
    SEQ_ARGS_WIDTH,
    TREE_OUT,
)
from .kernels.seq import SeqPool, SeqTables, build_seq_kernels, slot_tables
from .table_sizes import scratch_width

_SERIALS = itertools.count(1)  # tells every cache of the process apart (identity checks of batched calls)
NO_CALLBACK = np.iinfo(np.int64).max  # priorities_known of a cache without a priority callback
FIRST_BLOCKS = 4  # block rows a new cache's segment starts with
# A pool past this many block rows is packed into a smaller one once its live
# segments fill less than 1/SHRINK_BELOW of it (after a burst of long caches):
# the new pool has room for them to grow threefold, so usage must fall well
# below where it was before the next shrink, and a steady state never thrashes.
SHRINK_MIN_ROWS = 4096
# Blocks a cache may have whatever its pools (2**18: 4 M tokens at T = 16,
# about 30 MB of segment rows).
MAX_BLOCKS_FLOOR = 1 << 18
SHRINK_BELOW = 16
# Block-indexed arrays and the value of a row no cache has written.
_BLOCK_FILL = {"pages": NULL, "kinds": 0, "tree": NULL, "priority": DEFAULT_PRIORITY, "path": 0}


# The work list of a per-cache call, written with ``struct`` (one store for
# a row costs half of NumPy's slice stores): row 0 is the call (slot, op, its
# token and path offsets 0, its arguments), row 1 ends the token and path lists.
assert (BATCH_SLOT, BATCH_OP, BATCH_TOKENS, BATCH_PATH, BATCH_ARGS) == (0, 1, 2, 3, 4)
_WORK_ROW = struct.Struct(f"={BATCH_WIDTH}q")
_WORK_ENDS = struct.Struct("=2q")
_WORK_ENDS_AT = 8 * (BATCH_WIDTH + BATCH_TOKENS)
# Both rows in one store, up to row 1's path end (its slot and op written 0, as they stay).
_WORK_ONE = struct.Struct(f"={BATCH_WIDTH + BATCH_PATH + 1}q")
_NO_ARGS = (0,) * SEQ_ARGS_WIDTH


def is_batch(slots) -> bool:
    """Whether ``slots`` names many caches (an array) or one (an int)."""
    return type(slots) is np.ndarray


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lengths)])``, vectorised."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(lengths)
    shift = np.repeat(np.asarray(starts, dtype=np.int64) - (ends - lengths), lengths)
    return np.arange(total, dtype=np.int64) + shift


def with_room(blocks):
    """The rows of a segment sized for ``blocks`` blocks: half as much again,
    so that a cache just sized to its prompt then decodes for a while
    without moving."""
    return blocks + blocks // 2


def hold_rules(config) -> tuple:
    """``(window, sink blocks, GPU pool pages)`` of each life cycle whose new
    blocks need pages of their own while a cache is ACTIVE (``window`` 0 for
    full attention); checkpoints keep one live state whatever the length, and
    with scratch reuse a window's blocks share slots."""
    rules = []
    for life, pool in zip(config.life_cycles, config.pages_per_life_cycle_list()):
        if is_checkpoint(life.kind) or (has_window(life.kind) and config.swa_scratch_reuse is not None):
            continue
        rules.append((life.window if has_window(life.kind) else 0, life.num_sink_blocks, pool))
    return tuple(rules)


class CachePool:
    def __init__(self, config, backend):
        self.backend = backend
        self.T = config.tokens_per_block
        self.L = len(config.life_cycles)
        self.width = max(self.L, 1)
        self.scratch_width = scratch_width(config)
        self.hold_rules = hold_rules(config)
        self.hold_table = np.array(self.hold_rules, dtype=np.int64).reshape(-1, 3)  # the same, for compiled loops
        # The most blocks a cache may have: every GPU page of every life
        # cycle, and at least MAX_BLOCKS_FLOOR. Full attention needs a page per
        # block anyway; without it (windows, SSM) nothing else bounds the
        # segment a resize reserves, whose rows (and committed tokens) would
        # grow with any capacity asked.
        self.max_blocks = max(sum(config.pages_per_life_cycle_list()), MAX_BLOCKS_FLOOR)
        self.kernels = build_seq_kernels(backend.target)
        self._on_gpu = backend.on_gpu
        # Whether the host keeps a copy of the scalars to refresh after a
        # launch (elsewhere it reads the device array itself).
        self.scalars_on_device = backend.on_gpu
        self.gen = 0  # bumped whenever a segment moves or an array is replaced
        self.top = 0  # the first block row no segment has used since the last packing
        self.seg = np.zeros((0, 2), dtype=np.int64)  # host copy: (base, blocks) per slot
        self.serial = np.zeros(0, dtype=np.int64)  # the serial of the slot's cache, -1 when free
        # Ordinals whose page priorities the slot's callback gave (NO_CALLBACK: none to ask).
        self.priorities_known = np.zeros(0, dtype=np.int64)
        # The tree's count of detached blocks that caches refer to
        # (CNT_HELD_DETACHES) when each cache's committed chain was last seen
        # whole in the tree (-1: not known). While the count has not moved
        # since, no block of the chain was detached, so a commit re-attaches
        # nothing and needs room for its new blocks only.
        self.attached_at = np.zeros(0, dtype=np.int64)
        # The priority callback of each slot's cache, until the cache closes
        # (a callback that refers to its cache would otherwise keep it alive).
        self.callbacks: list = []
        # The finalizer of each slot's cache (None: no cache made yet), which
        # gives the slot back when the cache is collected.
        self.finalizers: list = []
        self._released: list[tuple] = []  # (slot, serial) given back (appended from finalizers too)
        # Free slots, a min-heap: an allocation takes the lowest without a
        # pass over every slot. ``serial`` stays the truth; an entry whose
        # slot was taken meanwhile is skipped, and one lost to an exception
        # between its pop and its taking is listed again when the heap runs out.
        self._free: list[int] = []
        self.arrays: SeqPool | None = None
        self._synced_seg = None  # the seg the kernels' copy was made from
        xp = backend.xp
        self._work1 = np.zeros((2, BATCH_WIDTH), dtype=np.int64)  # the work list of a per-cache call
        self._compiled: dict = {}  # kernel -> (tables, pool arrays, compiled code) of its last dispatched launch
        self._no_tokens = xp.zeros(0, dtype=np.int32)
        self._no_path = xp.zeros(0, dtype=np.int64)
        self._no_args = xp.zeros(SEQ_ARGS_WIDTH, dtype=np.int64)  # a view's: the arguments of no call
        self._grow_slots(16)
        # An engine that sized the index for its steady state (about a block
        # row per page: ``initial_blocks``) gets the caches' block rows for it
        # too, twice over, written once here: serving then packs no segments
        # into ever larger arrays (each pack copies every live row into
        # memory touched for the first time).
        start = config.initial_blocks
        self.min_rows = 0  # packing never shrinks the pool below this
        self._pack(64 if start is None else start)
        if start is not None:
            self._fill_span(self.arrays, 0, self.num_rows)
            self.arrays.tokens[:] = 0  # touched once here too: commits then write mapped memory
            # Kept through a lull in load: giving these rows up would make
            # the next burst pack into fresh memory again.
            self.min_rows = self.num_rows

    # -- slots --------------------------------------------------------------------------
    @property
    def used(self) -> np.ndarray:
        """Whether each slot is in use (bool per slot)."""
        return self.serial >= 0

    def slots_in_use(self) -> int:
        """Slots held by caches (collected caches' slots taken back first)."""
        self._take_released()
        return int((self.serial >= 0).sum())

    def allocate(self, n: int, scope_ids, scope_keys, digests, blocks, callbacks, taken: list) -> np.ndarray:
        """``n`` fresh slots, SUSPENDED with nothing committed, in the given
        scopes (``digests``: [n, 4] int64), each with room for ``blocks``
        blocks, and the priority callback (or None) of each.

        ``taken`` gets ``(slots, serials)`` before the slots are taken: the
        caller gives back (``give_back``) those it makes no cache of, also
        when this raises."""
        self._take_released()
        picked = self._free_slots(n)
        slots = np.array(picked, dtype=np.int64)
        serials = np.fromiter(itertools.islice(_SERIALS, n), dtype=np.int64, count=n)
        taken.append((slots, serials))
        # One cache (the usual create): plain int indices, each store a
        # fraction of a fancy-indexed one.
        one = n == 1
        at = picked[0] if one else slots
        self.serial[at] = serials[0] if one else serials  # taken: one store
        self.seg[at] = 0
        self._synced_seg = None  # changed in place: the kernels' copy is re-made at the next launch
        for s, cb in zip(picked, callbacks):
            self.callbacks[s] = cb
            self.priorities_known[s] = NO_CALLBACK if cb is None else 0
        self.attached_at[at] = -1
        rows = np.zeros((n, Q_WIDTH), dtype=np.int64)
        rows[:, Q_SSM_PAGE] = NULL
        rows[:, Q_NEVER_RESUMED] = 1
        rows[:, Q_SCOPE_ID] = scope_ids
        rows[:, Q_SCOPE_KEY] = scope_keys
        digests = np.asarray(digests, dtype=np.int64).reshape(n, 4)
        b = self.backend
        A = self.arrays
        d = at if one else b.to_device(slots)
        A.scalars[d] = b.to_device(rows[0] if one else rows)
        A.out[d] = 0
        A.counts[d] = 0
        A.scope_digest[d] = b.to_device(digests[0] if one else digests)
        A.scratch[d] = NULL
        A.scratch_count[d] = 0
        if b.on_gpu:  # elsewhere host_scalars is the device array itself
            self.host_scalars[slots] = rows
        blocks = np.maximum(np.asarray(blocks, dtype=np.int64), FIRST_BLOCKS)
        self._move(at, int(blocks[0]) if one else blocks)
        return slots

    def _free_slots(self, n: int) -> list:
        """The ``n`` lowest free slots (not yet taken), the pool grown when
        it has fewer."""
        free, serial = self._free, self.serial
        picked, seen = [], set()
        while len(picked) < n:
            if not free:
                # Every listed slot is taken: list the free ones again (any
                # an exception left out, and any whose giving back one lost),
                # and grow when there are too few.
                self._reclaim_lost()
                free[:] = [s for s in np.flatnonzero(serial < 0).tolist() if s not in seen]
                heapq.heapify(free)
                if len(free) < n - len(picked):
                    size = self.seg.shape[0]
                    need = size + n - len(picked) - len(free)
                    if need > MAX_CACHES:  # a page's hold counts are 16 bits (layout.page_holds)
                        raise LogicError(f"a manager keeps at most {MAX_CACHES} caches alive at once: "
                                         f"{size - len(free) - len(seen)} are, {n} more asked for (close some, "
                                         f"and drop closed ones: a closed cache's slot returns when it is collected)")
                    self._grow_slots(min(MAX_CACHES, max(2 * size, size + n)))
                    serial = self.serial
                continue
            s = heapq.heappop(free)
            if serial[s] < 0 and s not in seen:
                picked.append(s)
                seen.add(s)
        return picked

    def _reclaim_lost(self) -> None:
        """Give back the slots whose cache is gone but whose giving back was
        lost: an exception (an interrupt) inside the finalizer, before its
        one append. A pass over the slots, made only when no listed slot is
        free. Calls run one at a time, so a slot taken by a call that made no
        cache yet has no finalizer here."""
        lost = [s for s, fin in enumerate(self.finalizers) if fin is not None and not fin.alive and self.serial[s] >= 0]
        for s in lost:
            self.release(s, int(self.serial[s]))
        if lost:
            self._take_released()

    def release(self, slot: int, serial: int) -> None:
        """The cache of ``slot`` (of serial ``serial``) is gone (a finalizer:
        only noted here, taken back at the next allocation); giving back a
        slot twice is harmless."""
        self._released.append((slot, serial))

    def give_back(self, taken: list, caches) -> None:
        """The slots of ``taken`` (``allocate``'s) that none of ``caches``
        (KVCaches made of them) holds: their call failed before it made one."""
        held = {kv._slot for kv in caches}
        for slots, serials in taken:
            for s, serial in zip(slots.tolist(), serials.tolist()):
                if s not in held:
                    self.release(s, serial)

    def _take_released(self):
        # Each entry is handled again if an exception cuts this short (the
        # serial check makes that a no-op), and dropped only after: a
        # finalizer may append meanwhile.
        released = self._released
        k = len(released)
        for s, serial in released[:k]:
            if self.serial[s] != serial:
                continue  # given back already
            self.seg[s] = 0
            self._synced_seg = None
            self.callbacks[s] = None
            self.finalizers[s] = None
            self.serial[s] = -1  # free from here
            heapq.heappush(self._free, s)
        del released[:k]
        if k and self.num_rows > max(SHRINK_MIN_ROWS, self.min_rows):
            live = int(self.seg[self.serial >= 0, 1].sum())
            if SHRINK_BELOW * live < self.num_rows:
                self._pack(0, shrink=True)

    def trim(self, slots, blocks) -> None:
        """The segments of ``slots`` back to ``blocks[i]`` rows where longer
        (a refused resize gives back what it reserved); the rows given up
        are reused at the next packing."""
        slots, blocks = np.atleast_1d(slots), np.atleast_1d(blocks)
        long = self.seg[slots, 1] > blocks
        if not long.any():
            return
        slots, blocks = slots[long], np.maximum(blocks[long], FIRST_BLOCKS)
        self.gen += 1  # views taken before are stale from here on, whatever happens next
        seg = self.seg.copy()
        ends = seg[slots, 0] + seg[slots, 1]
        seg[slots, 1] = blocks
        top = self.top
        if (ends == top).any():  # the last segment: its rows are the top's again
            k = int(np.argmax(ends == top))
            top = int(seg[slots[k], 0] + blocks[k])
        known = self.priorities_known[slots]
        self.priorities_known[slots] = np.where(known == NO_CALLBACK, known, np.minimum(known, blocks))
        self.seg, self.top = seg, top  # one step: the rows and who owns them
        self._sync_seg()
        self.gen += 1

    def _grow_slots(self, n: int):
        self.gen += 1  # views taken before are stale from here on, whatever happens next
        old = self.seg.shape[0]
        b = self.backend
        xp = b.xp
        W, k = self.width, self.scratch_width
        fresh = dict(
            scalars=xp.zeros((n, Q_WIDTH), dtype=np.int64),
            out=xp.zeros((n, max(TREE_OUT.width, 4)), dtype=np.int64),
            counts=xp.zeros((n, W), dtype=np.int64),
            scope_digest=xp.zeros((n, 4), dtype=np.int64),
            scratch=xp.full((n, W, k), NULL, dtype=np.int64),
            scratch_count=xp.zeros((n, W), dtype=np.int64),
        )
        if self.arrays is not None:
            for name, a in fresh.items():
                a[:old] = getattr(self.arrays, name)
        seg = np.zeros((n, 2), dtype=np.int64)
        seg[:old] = self.seg
        serial = np.full(n, -1, dtype=np.int64)
        serial[:old] = self.serial
        known = np.zeros(n, dtype=np.int64)
        known[:old] = self.priorities_known
        attached_at = np.full(n, -1, dtype=np.int64)
        attached_at[:old] = self.attached_at
        callbacks = self.callbacks + [None] * (n - old)
        finalizers = self.finalizers + [None] * (n - old)
        arrays = (self.arrays or SeqPool(**{f: None for f in SeqPool._fields}))._replace(**fresh)
        host = fresh["scalars"]
        if b.on_gpu:
            host = np.zeros((n, Q_WIDTH), dtype=np.int64)
            if old:
                host[:old] = self.host_scalars
        # One step, so an exception anywhere in this method leaves the pool
        # either as it was or grown; ``host_scalars``: the scalars as last read
        # back (the device array itself off the GPU).
        (self.arrays, self.host_scalars, self.seg, self.serial, self.priorities_known, self.callbacks, self.finalizers,
         self.attached_at) = (arrays, host, seg, serial, known, callbacks, finalizers, attached_at)
        self._free.extend(range(old, n))  # above every listed slot: still a heap
        self._sync_seg()
        self.gen += 1

    # -- segments -----------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return 0 if self.arrays.tree is None else int(self.arrays.tree.shape[0])

    def reserve(self, slots, blocks) -> None:
        """Room for ``blocks[i]`` blocks in the segment of ``slots[i]``."""
        if not is_batch(slots):
            if blocks <= self.seg[slots, 1]:
                return
            slots, blocks = np.array([slots]), np.array([blocks])
        short = blocks > self.seg[slots, 1]
        if not short.any():
            return
        grow, want = slots[short], blocks[short]
        # At least double: a segment that keeps growing moves a few times.
        size = np.maximum(with_room(want), 2 * self.seg[grow, 1])
        # The segment that ends at the top grows where it is (no copy) while
        # the pool has the rows: a cache prefilled chunk by chunk right after
        # it was created.
        end = self.seg[grow, 0] + self.seg[grow, 1]
        last = np.flatnonzero((end == self.top) & (self.seg[grow, 1] > 0))
        if last.size and int(self.seg[grow[last[0]], 0] + size[last[0]]) <= self.num_rows:
            k = int(last[0])
            self._grow_in_place(int(grow[k]), int(size[k]))
            grow, size = np.delete(grow, k), np.delete(size, k)
        if grow.size:
            self._move(grow, size)

    def _grow_in_place(self, slot: int, blocks: int) -> None:
        """The last segment (``slot``'s) extended to ``blocks`` rows."""
        self.gen += 1  # views taken before are stale from here on, whatever happens next
        base, kept = int(self.seg[slot, 0]), int(self.seg[slot, 1])
        self._fill_span(self.arrays, base + kept, blocks - kept)
        seg = self.seg.copy()
        seg[slot, 1] = blocks
        self.seg, self.top = seg, base + blocks  # one step: the rows and who owns them
        self._sync_seg()
        self.gen += 1

    def _move(self, slots, blocks) -> None:
        """New segments of ``blocks`` rows for ``slots`` at the end of the
        pool, their rows so far copied along, the rest as no cache wrote them."""
        one = not is_batch(slots)
        need = blocks if one else int(blocks.sum())
        if self.top + need > self.num_rows:
            self._pack(need)
        self.gen += 1  # views taken before are stale from here on, whatever happens next
        old_base, old_len = self.seg[slots, 0], self.seg[slots, 1]
        top = self.top
        base = top if one else top + np.cumsum(blocks) - blocks
        A = self.arrays
        # The new segments are one stretch from the top: filled at once, then
        # the rows the caches had so far copied in (new caches have none).
        self._fill_span(A, top, need)
        if one:
            if old_len:
                self._copy_span(A, A, int(old_base), top, int(old_len))
        else:
            moved = np.flatnonzero(old_len)
            if moved.size <= 8:  # the usual case: a resize or two growing one segment each
                for k in moved.tolist():
                    self._copy_span(A, A, int(old_base[k]), int(base[k]), int(old_len[k]))
            elif moved.size:
                self._copy_rows(A, A, ranges(old_base[moved], old_len[moved]), ranges(base[moved], old_len[moved]))
        seg = self.seg.copy()
        seg[slots, 0] = base
        seg[slots, 1] = blocks
        self.seg, self.top = seg, top + need  # one step: the rows and who owns them
        self._sync_seg()
        self.gen += 1

    def _copy_span(self, src_arrays, dst_arrays, s: int, d: int, n: int):
        """Block rows ``[s, s + n)`` to ``[d, d + n)``."""
        T = self.T
        for name in _BLOCK_FILL:
            getattr(dst_arrays, name)[d:d + n] = getattr(src_arrays, name)[s:s + n]
        dst_arrays.tokens[d * T:(d + n) * T] = src_arrays.tokens[s * T:(s + n) * T]

    def _fill_span(self, arrays, d: int, n: int):
        """Block rows ``[d, d + n)`` as no cache wrote them. Their tokens
        (four fifths of a row's bytes) are left as they are: no kernel and no
        host read goes past a cache's committed tokens, which its commits and
        its reuse setup write."""
        for name, fill in _BLOCK_FILL.items():
            getattr(arrays, name)[d:d + n] = fill

    def _copy_rows(self, src_arrays, dst_arrays, src, dst):
        """Block rows ``src`` to ``dst`` (index arrays)."""
        b = self.backend
        T = self.T
        s, d = b.to_device(src), b.to_device(dst)
        for name in _BLOCK_FILL:
            getattr(dst_arrays, name)[d] = getattr(src_arrays, name)[s]
        # Tokens as [rows, T] views: one index per block row, not per token.
        dst_arrays.tokens.reshape(-1, T)[d] = src_arrays.tokens.reshape(-1, T)[s]

    def _pack(self, extra: int, shrink: bool = False) -> None:
        """Live segments packed to the front (in slot order), with room for
        ``extra`` more rows after them: in a new pool twice what is needed
        when the present one is too small (or, with ``shrink``, whatever its
        size)."""
        self.gen += 1  # views taken before are stale from here on, whatever happens next
        live = np.flatnonzero(self.used & (self.seg[:, 1] > 0))
        lengths = self.seg[live, 1]
        kept = int(lengths.sum())
        rows = self.num_rows
        # Room after packing for every live segment to double once more
        # (their next moves), so packs, which copy every live row, come once
        # per doubling of the caches and not every few moves.
        target = 3 * kept + extra
        if rows < target or shrink:
            rows = max(64, 2 * target, self.min_rows)
        xp = self.backend.xp
        L, W, T = self.L, self.width, self.T
        # Left unwritten: rows past the top are filled when a segment takes them.
        fresh = SeqPool(
            pages=xp.empty((rows, L), dtype=np.int64),
            kinds=xp.empty((rows, L), dtype=np.int64),
            tree=xp.empty(rows, dtype=np.int64),
            tokens=xp.empty(rows * T, dtype=np.int32),
            priority=xp.empty((rows, W), dtype=np.int64),
            path=xp.empty(rows, dtype=np.int64),
            **{f: getattr(self.arrays, f) for f in SeqPool._fields[6:]},
        )
        base = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        if kept >= 16 * live.size:  # long segments: a slice copy each beats a gather of every row
            for src, dst, n in zip(self.seg[live, 0].tolist(), base.tolist(), lengths.tolist()):
                self._copy_span(self.arrays, fresh, src, dst, n)
        elif kept:
            self._copy_rows(self.arrays, fresh, ranges(self.seg[live, 0], lengths), ranges(base, lengths))
        seg = self.seg.copy()
        seg[live, 0] = base
        self.arrays, self.seg, self.top = fresh, seg, kept  # one step
        self._sync_seg()
        self.gen += 1

    def _sync_seg(self):
        """The kernels' copy of ``seg`` (on the device, or the host array
        itself); ``_launch_work`` syncs again when an exception came in between."""
        b = self.backend
        if self.arrays is None:
            return
        seg = self.seg
        before = self.arrays
        self.arrays = before._replace(seg=b.to_device(seg) if b.on_gpu else seg)
        self._synced_seg = seg
        # Segments change with every allocation, release and move: the code a
        # kernel ran on the arrays before still serves them when only ``seg``
        # changed, for the same kind of array (``_launch_work``), so no such launch
        # goes through the dispatcher again.
        if seg.dtype == np.int64 and seg.ndim == 2 and seg.flags.carray:
            for kernel, (tables, arrays, code) in list(self._compiled.items()):
                if arrays is before:
                    self._compiled[kernel] = (tables, self.arrays, code)

    # -- views and launches --------------------------------------------------------------
    def view(self, slot: int) -> SeqTables:
        """Slot ``slot``'s SeqTables: views into the pool, good until ``gen`` changes."""
        a = int(self.seg[slot, 0])
        return slot_tables(self.arrays, slot, a, a + int(self.seg[slot, 1]), self.T, self._no_args)

    def rows(self, array, slots):
        """``array[slots]`` of a per-slot device array, on the host."""
        b = self.backend
        return b.to_host(array[slots if not is_batch(slots) else b.to_device(slots)])

    def refresh(self, slots) -> None:
        """The host copy of ``slots``' scalars, in one transfer (nothing to do
        where the device arrays are host memory)."""
        if self._on_gpu:
            self.host_scalars[slots] = self.rows(self.arrays.scalars, slots)

    def store_priorities(self, slot: int, rows: np.ndarray) -> None:
        """Page priorities for the slot's next ``len(rows)`` ordinals (after
        those known), as its callback gave them; the segment has room."""
        known = int(self.priorities_known[slot])
        base = int(self.seg[slot, 0])
        self.arrays.priority[base + known:base + known + len(rows)] = self.backend.to_device(rows)
        self.priorities_known[slot] = known + len(rows)

    def forget_callbacks(self, slots) -> None:
        """The callbacks of those of ``slots`` whose caches are closed: they
        are never asked again."""
        for s in np.atleast_1d(slots).tolist():
            if self.host_scalars[s, Q_STATUS] == CLOSED:
                self.callbacks[s] = None

    def committed_tokens(self):
        """The committed tokens of every slot in use, one array (digest ids
        among them: ``Tables.digest_references``)."""
        live = np.flatnonzero(self.used)
        counts = np.asarray(self.backend.to_host(self.arrays.scalars[self.backend.to_device(live), Q_COMMITTED]))
        return self.arrays.tokens[self.backend.to_device(ranges(self.seg[live, 0] * self.T, counts))]

    def open_scope_ids(self) -> list:
        """The scope ids of the caches not closed (they may create blocks in theirs)."""
        S = self.host_scalars[np.flatnonzero(self.used)]
        return S[S[:, Q_STATUS] != CLOSED, Q_SCOPE_ID].tolist()

    def launch_calls(self, launcher, slots, ops, args=(), tokens=None, tokens_off=None, path=None, path_off=None,
                     results=None, work=None) -> None:
        """One launch of a sequence kernel (the sizing or the commit kernel,
        as ``ops`` say: never both in one launch): call ``ops[i]`` (or ``ops``
        for all) on slot ``slots[i]``, in order, with its arguments (column
        ``c`` of ``args``: an int for all, or one per slot), its input tokens
        and matched blocks (``tokens[tokens_off[i]:tokens_off[i + 1]]``,
        likewise ``path``; None: none; for one slot, all of ``tokens`` and
        ``path``), all in the work list. ``results`` as ``Launcher.launch``
        takes it. ``work``: the work list of these calls, when the caller
        made it (``call_room.plan_appends``)."""
        if work is not None:  # one op for all
            self._launch_work(launcher, ops >= FIRST_COMMIT_OP, work, tokens, path, results)
            return
        if not is_batch(slots):
            work = self._work1  # no arrays to build for one cache: two stores into its rows, in place
            _WORK_ROW.pack_into(work, 0, slots, ops, 0, 0, *args, *_NO_ARGS[len(args):])
            _WORK_ENDS.pack_into(work, _WORK_ENDS_AT, 0 if tokens is None else len(tokens),
                                 0 if path is None else len(path))
            self._launch_work(launcher, ops >= FIRST_COMMIT_OP, work, tokens, path, results)
            return
        n = len(slots)
        if type(ops) is np.ndarray:
            commit = bool(n) and bool(ops[0] >= FIRST_COMMIT_OP)
            if n and ((ops >= FIRST_COMMIT_OP) != commit).any():
                raise AssertionError("one launch runs sizing calls or commit calls, never both")
        else:
            commit = ops >= FIRST_COMMIT_OP
        work = np.zeros((n + 1, BATCH_WIDTH), dtype=np.int64)
        work[:n, BATCH_SLOT] = slots
        work[:n, BATCH_OP] = ops
        for c, v in enumerate(args):
            work[:n, BATCH_ARGS + c] = v
        if tokens is not None:
            work[:, BATCH_TOKENS] = self.backend.to_host(tokens_off)
        if path is not None:
            work[:, BATCH_PATH] = path_off
        self._launch_work(launcher, commit, work, tokens, path, results)

    def _launch_work(self, launcher, commit: bool, work, tokens, path, results):
        if self._synced_seg is not self.seg:
            self._sync_seg()
        b = self.backend
        kernel = self.kernels.commit if commit else self.kernels.size
        # Numba's dispatcher types every argument of every call to find the
        # compiled code: for the sequence kernels' 41 arrays (the tables and
        # the pool, two named tuples) that is several µs, more than all the
        # rest of a per-cache call. Both tuples are rebuilt whenever an array
        # in them is replaced, and the other arguments are made here with
        # fixed types (the work list, ``_kernel_input``), so while both are
        # the very objects of the last dispatched launch the dispatcher would
        # pick the same code again: that code is called directly. The first
        # launch after either changed (or after an aftermath cut short) goes
        # through the dispatcher and learns anew.
        run = self._known_code(launcher, kernel) or kernel
        launcher.launch(
            run, self.arrays, b.to_device(work) if self._on_gpu else work,
            self._no_tokens if tokens is None else self._kernel_input(tokens, np.int32),
            self._no_path if path is None else self._kernel_input(path, np.int64),
            results=results,
        )
        if run is kernel:
            self._learn_compiled(launcher, kernel)

    def launch_commit_one(self, launcher, slot: int, op: int, args: tuple, tokens) -> None:
        """``launch_calls`` of one commit-kernel call ``op`` on ``slot`` (all
        ``SEQ_ARGS_WIDTH`` of its ``args``) with input ``tokens``, no matched
        path and no results step (off the GPU the scalars are read in place),
        in one short step while the code the kernel ran last still serves
        (``_known_code``): the work list in one store, that code called
        through the launch protocol (``Launcher.launch``) as ``_launch_work``
        calls it. Otherwise the general way. A per-cache append's launch
        (``CacheCalls._append_one``)."""
        code = None if self._on_gpu or self._synced_seg is not self.seg else self._known_code(
            launcher, self.kernels.commit)
        if code is None:
            self.launch_calls(launcher, slot, op, args, tokens)
            return
        work = self._work1
        _WORK_ONE.pack_into(work, 0, slot, op, 0, 0, *args, 0, 0, len(tokens), 0)
        launcher.launch(code, self.arrays, work, self._kernel_input(tokens, np.int32), self._no_path)

    def _known_code(self, launcher, kernel):
        """The compiled code ``kernel`` ran at its last dispatched launch, when
        the tables and the pool are still the very objects it was typed on and
        no aftermath is pending (else None: the dispatcher picks the code)."""
        known = self._compiled.get(kernel)
        if known is not None and known[0] is launcher.tables.device and known[1] is self.arrays and not launcher.pending:
            return known[2]
        return None

    def _learn_compiled(self, launcher, kernel):
        """After a dispatched launch: the code it ran and the arguments it was
        typed on, when the kernel has one compiled signature (Numba's ``cpu``
        dispatchers; the ``cuda`` kernels are launched by plain functions,
        which this leaves alone)."""
        overloads = getattr(kernel, "overloads", None)  # signature -> compiled code
        if overloads is not None and len(overloads) == 1:
            (compiled,) = overloads.values()
            self._compiled[kernel] = (launcher.tables.device, self.arrays, compiled.entry_point)

    def _kernel_input(self, a, dtype):
        """``a`` (a flat list of the kernel's input) as the one signature the
        kernel is compiled for takes it: on the device, one-dimensional,
        contiguous, aligned and writable (Numba types a read-only or
        unaligned array apart, which would compile the kernel again or,
        called directly, misread it; the simulator writes its arguments back)."""
        if type(a) is np.ndarray and a.dtype == dtype and a.ndim == 1 and a.flags.carray and not self._on_gpu:
            return a
        xp = self.backend.xp
        out = xp.ascontiguousarray(xp.asarray(a, dtype=dtype).reshape(-1))
        if isinstance(out, np.ndarray) and not out.flags.carray:
            out = out.copy()
        return out

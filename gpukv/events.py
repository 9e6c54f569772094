"""KV cache events (docs/semantics.md §4), built from the tree's change log.

The tree kernels do not call into Python while they change the tree; they
append records to a change log (``layout.LOG``), which the host drains after
each launch. ``KVCacheEventManager.on_records`` replays those records, in
order, with the effect of the reference event manager's operations:

    EV_STORED_BLOCK header + EV_PAGE_INFO*       -> add_stored_block_event_from_block
    EV_STORED_LIFE_CYCLE header + EV_PAGE_INFO*  -> add_stored_life_cycle_event_from_block
    EV_REMOVED                                   -> add_removed_event([key])
    EV_REMOVED_LIFE_CYCLE                        -> add_removed_life_cycle_event(key, lc)
    EV_UPDATED                                   -> add_updated_event(key, cache_level diff)
    EV_CREATED, EV_ROOT_REMOVED                  -> nothing (tree bookkeeping only)

A header is followed by one EV_PAGE_INFO record per life cycle whose slot holds
a page, ascending; ``covers`` says whether that page covers the whole block.
Both stored paths get every page info, because the life-cycle path falls back
to the whole-block path when the block was never announced.

What a consumer sees is decided by four rules, each in one place below:

- *Announcements* (``_stored``): per block key, its event hash and the life
  cycles announced for it. Only a page that covers the whole block is ever
  announced (the partial-coverage rule): the payload lists the block's full
  token list, which a shorter page is not valid for. Removals report only
  announced life cycles, so every removed (hash, group) was stored before and
  none is removed twice without a store in between (§3 invariant 16).
- *Removed batching* (``_removed``): removed hashes are buffered per layer
  group. Any other event first flushes all of them, one removed event per
  group in ascending group order; a stored event flushes its own group first.
- *Stored coalescing* (``_latest_stored``): a stored event extends its group's
  latest stored event when nothing is buffered for removal and that event's
  last block is the new block's parent, so a committed chain reads as one
  event. Any other event for the group, and every flush, ends the chain.
- *The public queue* (``_queue``): ``flush_iteration_events`` moves the pending
  events there; it keeps the newest ``max_entries`` and drops the oldest.
  Pending events are capped the same way as they arrive (``_trim``), so a
  caller that never drains keeps at most about ``2 * max_entries`` of them:
  an event with ``max_entries`` newer ones could never reach a consumer.

Choices where the reference leaves room, all documented at their definition:
``NO_WINDOW`` (the window size of life cycles without one), the created event's
layer group (None), and the byte order of ``sha256_64`` hashes.

A launch's records are decoded as arrays (``_Launch``: kinds, keys, hashes,
the covering pages and token payloads of every header, the chains of stores
and runs of removals, each in a few operations; a launch of few records
record by record, where that costs less), so what stays per record is the
ordered part the rules need: dictionary lookups and the events themselves; a
chain or a run of removals goes in at once, and the chains of a batched
commit all at once (``_store_chains``). A stored event holds a run of its
launch's stored blocks, kept as columns (``_StoredBlocks``), and makes their
objects, and their blocks' token objects (``_TokenRows``), only when a
consumer first reads them (event_types). A launch applies whole or not at
all (see ``on_records``).

The module is long because the event manager keeps the reference's operations
one to one, and the four rules above only make sense read together.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import accumulate, chain, repeat

import numpy as np

from .core.scope import ReuseScope
from .event_types import (
    HASH_ALGOS,
    NO_WINDOW,
    Diff,
    EventData,
    EventHash,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheRemovedData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    UniqueToken,
    event_block_hash,
    make_event,
    make_stored_block,
    make_stored_block_of_row,
    make_stored_data,
    make_stored_data_of,
)
from .core.layout import (
    EV_CREATED,
    EV_PAGE_INFO,
    EV_REMOVED,
    EV_REMOVED_LIFE_CYCLE,
    EV_ROOT_REMOVED,
    EV_STORED_BLOCK,
    EV_STORED_LIFE_CYCLE,
    EV_UPDATED,
    LOG,
    LOG_COVERS,
    LOG_DIGEST,
    LOG_KIND,
    LOG_LEVEL,
    LOG_LIFE_CYCLE,
    LOG_NUM_TOKENS,
    LOG_OLD_LEVEL,
    LOG_PARENT_DIGEST,
    LOG_PARENT_IS_ROOT,
    LOG_PRIORITY,
    LOG_TOKENS_AT,
)

__all__ = ["KVCacheEventManager", "LoggedBlock", "PageInfo"]

# ---------------------------------------------------------------------------
# A block as one stored-announcement header describes it
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PageInfo:
    covers: bool  # the page's coverage >= the block's token count
    level: int
    priority: int


@dataclass(frozen=True)
class LoggedBlock:
    """The block of an EV_STORED_* header: what the two stored paths read."""

    key: bytes
    parent_key: bytes | None  # None when the parent is a scope root
    tokens: tuple  # ints, and 32-byte digests for multimodal tokens
    pages: dict  # life cycle -> PageInfo, for every slot that holds a page
    scope: ReuseScope | None = None  # None for the default scope


# ---------------------------------------------------------------------------
# The event manager
# ---------------------------------------------------------------------------


_DEFAULT_SCOPE = ReuseScope()


class KVCacheEventManager:
    """Turns the tree's change log into KV cache events (docs/semantics.md §4).

    ``max_entries`` caps the public queue (the oldest events are dropped);
    ``max_entries <= 0`` disables events: every call then does nothing.
    ``window_sizes[g]`` is the window size reported for layer group ``g``
    (``NO_WINDOW`` beyond the list). ``digest_of_token(t)`` maps a negative
    token id of the log to its interned 32-byte multimodal digest.
    ``scope_of_root(digest)`` names the scope of a root by its digest, so
    stored events can carry their scope (``KVCacheStoredData.scope``).
    """

    def __init__(
        self,
        max_entries: int,
        event_hash: str,
        window_sizes: Iterable[int],
        digest_of_token: Callable[[int], bytes],
        scope_of_root: Callable[[bytes], ReuseScope | None] | None = None,
    ):
        if event_hash not in HASH_ALGOS:
            raise ValueError(f"event_hash must be one of {tuple(HASH_ALGOS)}, got {event_hash!r}")
        self.max_entries = int(max_entries)
        self.enabled = self.max_entries > 0
        self.event_hash = event_hash
        self.hash_algo = HASH_ALGOS[event_hash]
        self.window_sizes = [int(w) for w in window_sizes]
        self._window_of = dict(enumerate(self.window_sizes))  # layer group -> window size (NO_WINDOW if absent)
        self._digest_of_token = digest_of_token
        self._scope_of_root = scope_of_root

        self._next_event_id = 0
        # Block key -> (event hash, the life cycles announced, ascending). A
        # tuple, never changed in place: a saved reference is a snapshot (_save).
        self._stored: dict[bytes, tuple] = {}
        self._removed: dict[int, list] = {}  # layer group -> buffered removed hashes
        self._pending: list[KVCacheEvent] = []  # this iteration's events
        self._latest_stored: dict[int, int] = {}  # layer group -> index in _pending
        # Layer group -> runs of blocks that continue its latest stored event
        # and are not written into it yet: a chain grows by appends and its
        # event is rebuilt once (_seal), not once per block. Empty between calls.
        self._extending: dict[int, list] = {}
        # layer group -> last block hash of its latest stored event when _trim
        # dropped that event: a continuation extends it, out of sight, as it
        # would have extended the event that the queue then drops anyway.
        self._dropped_tail: dict[int, tuple] = {}  # (EventHash, scope)
        self._queue: deque[KVCacheEvent] = deque(maxlen=max(self.max_entries, 1))
        self._moving: list | None = None  # a batch on its way to the queue (flush_iteration_events)
        self._handed: tuple | None = None  # (receipt, events) of the last drain (give_back)
        # Block key -> scope, for the blocks of non-default scopes in the tree
        # (a child inherits its parent's; only a root-level block names its root).
        self._scope_of: dict[bytes, ReuseScope] = {}
        # The event id at which each tree clear began, oldest first (see mark_clear).
        self._clear_marks: deque[int] = deque(maxlen=max(self.max_entries, 1))

    # -- the manager's entry points ---------------------------------------------
    def created(self, num_blocks_per_cache_level) -> None:
        """Announce the cache: one created event, of no layer group (None), as
        the reference emits it when it is not given group ids."""
        if self.enabled:
            data = KVCacheCreatedData(tuple(int(n) for n in num_blocks_per_cache_level))
            self._add_event(data, None)

    def on_records(self, records: np.ndarray, log_tokens: np.ndarray, progress: np.ndarray | None = None) -> None:
        """Consume drained change-log rows ([n, LOG.width] int64, in log order);
        ``log_tokens`` holds the token rows the stored headers point at.

        ``progress`` (a one-element int64 array) makes the call resumable: it
        starts at ``records[progress[0]]`` and advances ``progress[0]`` past
        the records it has applied, so records consumed before an exception
        are not applied twice when the same records come again. The records
        from ``progress[0]`` on apply as one: when an exception (an
        asynchronous one included) cuts them short, the event state is put
        back as it was and ``progress[0]`` does not move. Malformed records
        are rejected before anything is applied."""
        if not self.enabled:
            return
        records = np.asarray(records)
        if records.size and (records.ndim != 2 or records.shape[1] != LOG.width):
            raise ValueError(f"records must have shape [n, {LOG.width}], got {records.shape}")
        if progress is None:
            progress = np.zeros(1, dtype=np.int64)
        start, n = int(progress[0]), len(records)
        if start >= n:
            return
        launch = _Launch(records[start:], log_tokens, self.event_hash, self._digest_of_token, _UNIQUE_TOKENS, start)
        if not launch.keys:  # tree bookkeeping only: no event state to change
            progress[0] = n
            return
        # The state a launch may change is saved first and put back unless the
        # count moved: the count is one store, made last.
        saved = self._save(launch.keys)
        try:
            self._apply(launch)
            if self._extending:
                self._seal_all()
            progress[0] = n
        except BaseException:
            if int(progress[0]) != n:
                self._restore(saved)
            raise

    def _save(self, keys: list) -> tuple:
        """What applying records of blocks ``keys`` may change, cheaply: their
        announcements and scopes (references: both are replaced, never
        changed in place; None for no announcement or no scope of any), the small
        per-group dicts, the buffered removals by length, the pending list by
        length and the entries a stored event may extend in place, and the
        event id."""
        pending, stored, scope_of, latest = self._pending, self._stored, self._scope_of, self._latest_stored
        return (
            # None: none of the keys is announced (a commit's new blocks, the usual).
            None if stored.keys().isdisjoint(keys) else dict(zip(keys, map(stored.get, keys))), keys,
            dict(zip(keys, map(scope_of.get, keys))) if scope_of else None,
            self._next_event_id, latest.copy(), self._dropped_tail.copy(),
            {g: (hashes, len(hashes)) for g, hashes in self._removed.items()} if self._removed else {},
            pending, len(pending), {at: pending[at] for at in latest.values()} if latest else {},
        )

    def _restore(self, saved: tuple) -> None:
        """Put back what ``_save`` kept. ``_trim`` and the flushes replace the
        pending list and the removal lists rather than cutting them, so the
        saved ones still hold everything they held."""
        announced, keys, scopes, next_id, latest, tail, removed, pending, n_pending, extended = saved
        if announced is None:
            announced = dict.fromkeys(keys)
        if scopes is None:
            self._scope_of.clear()
            scopes = {}
        for into, was in ((self._stored, announced), (self._scope_of, scopes)):
            for key, value in was.items():
                if value is None:
                    into.pop(key, None)
                else:
                    into[key] = value
        for hashes, n in removed.values():
            del hashes[n:]
        del pending[n_pending:]
        for at, event in extended.items():
            if at < n_pending:
                pending[at] = event
        self._removed = {g: hashes for g, (hashes, _) in removed.items()}
        self._pending = pending
        self._extending = {}
        self._latest_stored = latest
        self._dropped_tail = tail
        self._next_event_id = next_id

    def _apply(self, launch: "_Launch") -> None:
        """Apply a launch's records in log order. Everything per record was
        decoded by ``_Launch``; what is left here is the order-dependent part
        of the rules (announcements, scopes, removal buffering, chains)."""
        scope_of = self._scope_of
        (kinds, life_cycles, old_levels, levels), keys, spans = launch.fields, launch.keys, launch.spans
        hashes, parent_keys, parent_hashes, at_roots, los, his = launch.headers
        blocks, block_lcs = launch.blocks, launch.block_lcs
        i, h, n = 0, 0, len(kinds)  # the record, and the stored header it is when it is one
        rest = spans[0] if launch.store_lcs is not None else -1  # where a commit's second chain starts
        while i < n:
            if i == rest and self._store_chains(launch, i):
                return
            kind, lc = kinds[i], life_cycles[i]
            if kind == EV_STORED_BLOCK or kind == EV_STORED_LIFE_CYCLE:
                if at_roots[h]:
                    parent_hash, scope = None, self._root_scope(parent_keys[h])
                else:
                    parent_hash, scope = parent_hashes[h], scope_of.get(parent_keys[h]) if scope_of else None
                lo, run = los[h], spans[i]
                # Every block of a chain takes its parent's scope, so the
                # first block's, unless that is none and a block of the chain
                # is still recorded with one: then block by block.
                if run > 1 and (scope is not None or not scope_of or scope_of.keys().isdisjoint(keys[i:i + run - 1])):
                    self._store_chain(keys[i:i + run], hashes[h:h + run], parent_hash, scope,
                                      tuple(block_lcs[lo:his[h]]), blocks, lo, his[h + run - 1])
                    i, h = i + run, h + run
                    continue
                key, hi = keys[i], his[h]
                if scope is not None:
                    scope_of[key] = scope
                if lo == hi:  # nothing covers the whole block: nothing to announce
                    pass
                elif kind == EV_STORED_BLOCK:
                    self._store_block(key, hashes[h], parent_hash, scope, tuple(block_lcs[lo:hi]), blocks, lo)
                else:
                    self._store_life_cycle(key, hashes[h], parent_hash, scope, tuple(block_lcs[lo:hi]), blocks, lo, lc)
                h += 1
            elif kind == EV_REMOVED:
                # One record per detached block, a run of them per subtree:
                # removals are buffered per group, in order, until something
                # flushes them, so a run goes in at once.
                removing = keys[i : i + spans[i]]
                if scope_of:
                    for key in removing:
                        scope_of.pop(key, None)
                self.add_removed_event(removing)
                i += len(removing)
                continue
            elif kind == EV_REMOVED_LIFE_CYCLE:
                self.add_removed_life_cycle_event(keys[i], lc)
            else:  # EV_UPDATED (_Launch keeps no other kind)
                self.add_updated_event(keys[i], cache_level=Diff(old_levels[i], levels[i]), priority=None,
                                       layer_group_id=lc)
            i += 1

    def _store_chains(self, launch: "_Launch", first: int) -> bool:
        """The rest of a launch of whole-block stores covered in the same life
        cycles (``store_lcs``: the usual commit), from record ``first`` (the
        second chain) on, at once. With nothing buffered for removal (the
        first chain's event flushed it) and no event to drop (``_trim``),
        each of these chains is a new stored event per life cycle: it does
        not continue the chain before it (``_Launch`` would have joined
        them; their hashes differ, checked for the 64-bit ones), and nothing
        else is there to flush or to continue. So the events are made here
        in one pass, as ``_store_chain`` makes them, scopes included.
        Returns False, having changed nothing, when that does not hold, or
        when a chain without a scope holds blocks still recorded with one
        (``_apply`` takes such a chain block by block)."""
        lcs, k = launch.store_lcs, len(launch.store_lcs)
        hashes, parent_keys, parent_hashes, at_roots, _, _ = launch.headers
        keys, spans, n = launch.keys, launch.spans, len(launch.keys)
        starts, i = [], first  # where each chain starts (a stored header's index is its record's)
        while i < n:
            starts.append(i)
            i += spans[i]
        if (self._removed or len(self._pending) + k * len(starts) >= 2 * self.max_entries + 16
                or self.event_hash == "sha256_64" and any(parent_hashes[a] == hashes[a - 1] for a in starts)):
            return False
        ends = starts[1:] + [n]
        scope_of, added, scopes = self._scope_of, {}, []  # added: the scopes these chains record
        for a, b in zip(starts, ends):
            if at_roots[a]:
                scope = self._root_scope(parent_keys[a])
            else:
                scope = added.get(parent_keys[a]) or scope_of.get(parent_keys[a]) if scope_of or added else None
            if scope is not None:
                added.update(dict.fromkeys(keys[a:b], scope))
            elif b - a > 1 and (scope_of or added) and not (scope_of.keys().isdisjoint(keys[a:b - 1])
                                                            and added.keys().isdisjoint(keys[a:b - 1])):
                return False
            scopes.append(scope)
        for lc in lcs:
            self._end_chain(lc)
        self._stored.update(zip(keys[first:], zip(hashes[first:], repeat(lcs))))
        if added:
            scope_of.update(added)
        blocks = launch.blocks
        data = [make_stored_data_of(None if at_roots[a] else parent_hashes[a], (blocks, a * k + j, b * k, k), scope)
                for a, b, scope in zip(starts, ends, scopes) for j in range(k)]
        windows = [self._window_of.get(lc, NO_WINDOW) for lc in lcs]
        pending, next_id = self._pending, self._next_event_id
        pending.extend(map(make_event, range(next_id, next_id + len(data)), data, windows * len(starts),
                           repeat(self.hash_algo), lcs * len(starts)))
        self._next_event_id = next_id + len(data)
        for j, lc in enumerate(lcs):
            self._latest_stored[lc] = len(pending) - k + j
        return True

    def _root_scope(self, root_key: bytes) -> ReuseScope | None:
        """The scope of the blocks under a root: None for the default scope."""
        found = None if self._scope_of_root is None else self._scope_of_root(root_key)
        return None if found is None or found == _DEFAULT_SCOPE else found

    def flush_iteration_events(self) -> None:
        """End the iteration: flush the buffered removals and move every pending
        event to the public queue (which keeps the newest ``max_entries``).
        No stored event coalesces across a flush."""
        if not self.enabled:
            return
        self._finish_move()
        self._seal_all()
        self._flush_all_removed()
        # The hints into the pending list go first: dropping one early only
        # ends a chain sooner, a stale one would index the next list.
        self._latest_stored = {}
        self._dropped_tail = {}
        batch = self._pending
        if not batch:
            return
        # The hand-over happens once, wherever an interrupt from a signal
        # handler lands: the batch is named, taken off the pending list, then
        # queued, and _finish_move completes what a cut one left undone.
        self._moving = batch
        self._pending = []
        self._queue.extend(batch)
        self._moving = None

    def _finish_move(self) -> None:
        """Complete a hand-over to the queue that an interrupt cut short: the
        batch is queued unless it still is the pending list (not taken yet) or
        the queue holds its newest event already (queued)."""
        batch = self._moving
        if batch is None:
            return
        if self._pending is not batch and not (self._queue and self._queue[-1].event_id >= batch[-1].event_id):
            self._queue.extend(batch)
        self._moving = None

    def get_latest_events(self, receipt=None) -> list[KVCacheEvent]:
        """Drain the public queue, oldest first; ``receipt`` names the drain
        for ``give_back``. The queue is handed over by swapping it for an
        empty one, a single store, so a drain is either done or not."""
        self._finish_move()
        drained = self._queue
        self._handed = (receipt, drained)
        self._queue = deque(maxlen=drained.maxlen)
        return list(drained)

    def give_back(self, receipt) -> None:
        """The events the drain named ``receipt`` took never reached the caller
        (its call raised on the way out): back to the front of the queue, once."""
        handed = self._handed
        if handed is None or handed[0] is not receipt:
            return
        self._handed = None
        if self._queue is not handed[1]:  # the drain had taken them
            self._queue.extendleft(reversed(handed[1]))

    def mark_clear(self) -> None:
        """The whole tree is about to be cleared: remember where in the event
        stream. Every event with an id below the mark happened before the
        clear; the clear's own removals come after it. The reference emits
        only those removals; a router protocol with a clear event reads the
        marks (``take_clear_marks``)."""
        if self.enabled:
            self._clear_marks.append(self._next_event_id)

    def announced(self) -> set:
        """``{(event block hash, life cycle)}``: what has been announced and
        not removed."""
        return {(block_hash, lc) for block_hash, lcs in self._stored.values() for lc in lcs}

    def take_clear_marks(self) -> list[int]:
        """Drain the clear marks, oldest first (the newest ``max_entries`` are kept)."""
        marks = list(self._clear_marks)
        self._clear_marks.clear()
        return marks

    # -- §4 operations, as the reference names them -------------------------------
    def add_stored_block_event_from_block(self, block: LoggedBlock) -> None:
        """Announce every life cycle whose page covers the whole block (and no
        other), one stored event each, ascending; the announcements replace
        any earlier ones of the block. Nothing when no page covers it."""
        covering = _covering_pages(block)
        if covering:
            block_hash = self._hash(block.key)
            self._store_block(block.key, block_hash, self._parent_hash(block), block.scope,
                              tuple(page[0] for page in covering), _StoredBlocks.of(block_hash, block, covering), 0)
            self._seal_all()

    def add_stored_life_cycle_event_from_block(self, block: LoggedBlock, life_cycle: int) -> None:
        """Announce one more life cycle of an announced block, when its page
        covers the whole block; a block never announced takes the whole-block
        path instead."""
        covering = _covering_pages(block)
        if covering:
            block_hash = self._hash(block.key)
            self._store_life_cycle(block.key, block_hash, self._parent_hash(block), block.scope,
                                   tuple(page[0] for page in covering), _StoredBlocks.of(block_hash, block, covering),
                                   0, life_cycle)
            self._seal_all()

    def add_removed_event(self, keys: Iterable[bytes]) -> None:
        """Blocks left the tree: a removed entry per announced life cycle.
        Unknown keys, and keys already removed, are ignored."""
        announced = [state for state in map(self._stored.pop, keys, repeat(None)) if state is not None]
        if not announced:
            return
        life_cycles = {state[1] for state in announced}
        if len(life_cycles) == 1:  # the usual run: every block announced in the same life cycles
            hashes = [state[0] for state in announced]
            for lc in life_cycles.pop():
                self._enqueue_removed(hashes, lc)
            return
        by_group: dict[int, list] = {}
        for block_hash, lcs in announced:
            for lc in lcs:
                by_group.setdefault(lc, []).append(block_hash)
        for lc in sorted(by_group):
            self._enqueue_removed(by_group[lc], lc)

    def add_removed_life_cycle_event(self, key: bytes, life_cycle: int) -> None:
        """One life cycle's page of a block died: a removed entry for that group
        if it was announced. Removing the last announced life cycle forgets the
        block, so a later store announces it from scratch."""
        state = self._stored.get(key)
        if state is None or life_cycle not in state[1]:
            return
        rest = tuple(lc for lc in state[1] if lc != life_cycle)
        if rest:
            self._stored[key] = (state[0], rest)
        else:
            del self._stored[key]
        self._enqueue_removed([state[0]], life_cycle)

    def add_updated_event(
        self,
        key: bytes,
        cache_level: Diff | None = None,
        priority: Diff | None = None,
        layer_group_id: int | None = None,
    ) -> None:
        """A page of an announced block changed level or priority. Nothing for
        a block without announcements, or when both diffs are None."""
        if cache_level is None and priority is None:
            return
        state = self._stored.get(key)
        if state is None:
            return
        self._add_event(KVCacheUpdatedData(state[0], cache_level, priority), layer_group_id)

    # -- the two stored paths, on a decoded block ----------------------------------
    # ``lcs`` lists the life cycles whose pages cover the block whole,
    # ascending (never empty); ``blocks`` (``_StoredBlocks``) holds the
    # stored block of each from ``at`` on, with its page's level and
    # priority. Events take runs of them, ``(blocks, start, stop, step)``.
    def _store_block(self, key: bytes, block_hash, parent_hash, scope, lcs: tuple, blocks, at: int) -> None:
        self._stored[key] = (block_hash, lcs)
        for j, lc in enumerate(lcs):
            self._add_stored_event(parent_hash, (blocks, at + j, at + j + 1, 1), lc, scope)

    def _store_chain(self, keys: list, block_hashes: list, parent_hash, scope, lcs: tuple, blocks, at: int,
                     end: int) -> None:
        """``_store_block`` of each block of a chain (each the parent of the
        next, all whole-block stores covered in the same life cycles
        ``lcs``; ``blocks`` holds each block's from ``at`` to ``end``, by
        block then life cycle), in one pass per life cycle. The same events:
        after its first block, a chain only extends each group's latest
        stored event, which makes no event, so the blocks of a group may go
        in together."""
        self._stored.update(zip(keys, zip(block_hashes, repeat(lcs))))
        if scope is not None:
            self._scope_of.update(dict.fromkeys(keys, scope))
        k = len(lcs)
        for j, lc in enumerate(lcs):
            self._add_stored_event(parent_hash, (blocks, at + j, end, k), lc, scope)

    def _store_life_cycle(self, key: bytes, block_hash, parent_hash, scope, lcs: tuple, blocks, at: int,
                          life_cycle) -> None:
        state = self._stored.get(key)
        if state is None:
            self._store_block(key, block_hash, parent_hash, scope, lcs, blocks, at)
            return
        if life_cycle in state[1] or life_cycle not in lcs:  # announced already, or its page does not cover the block
            return
        self._stored[key] = (state[0], tuple(sorted(state[1] + (life_cycle,))))
        at += lcs.index(life_cycle)
        self._add_stored_event(parent_hash, (blocks, at, at + 1, 1), life_cycle, scope)

    # -- batching and ordering ---------------------------------------------------
    def _add_event(self, data: EventData, group: int | None) -> int:
        """Append an event to this iteration's list; returns its index there."""
        if self._removed and not isinstance(data, KVCacheRemovedData):
            # Removals that happened before this event must be seen before it.
            self._flush_all_removed()
        if not isinstance(data, KVCacheStoredData):
            self._end_chain(group)
        pending = self._pending
        pending.append(make_event(self._next_event_id, data, self._window_of.get(group, NO_WINDOW), self.hash_algo,
                                  group))
        self._next_event_id += 1
        if len(pending) >= 2 * self.max_entries + 16:
            self._trim()
        return len(self._pending) - 1

    def _trim(self) -> None:
        """Keep the newest ``max_entries`` pending events. The queue would drop
        the others at the next flush: it keeps the newest ``max_entries`` of
        everything, and these are newer."""
        self._seal_all()
        cut = len(self._pending) - self.max_entries
        for group, at in list(self._latest_stored.items()):
            if at < cut:
                data = self._pending[at].data
                self._dropped_tail[group] = (_stored_last_hash(data), data.scope)
                del self._latest_stored[group]
            else:
                self._latest_stored[group] = at - cut
        self._pending = self._pending[cut:]  # a new list: a saved one stays whole (_restore)

    def _add_stored_event(self, parent_hash, run: tuple, group: int, scope: ReuseScope | None = None) -> None:
        """Store the blocks of ``run`` (a chain, each the parent of the next,
        the first a child of ``parent_hash``) in ``group``: extending its
        latest stored event when that ends with the parent, else as a new
        event."""
        # The group's own removals go first, ahead of the other groups' too: a
        # block removed and then stored again must not read as stored, removed.
        if self._removed:
            self._flush_removed(group)
        if not self._removed:
            latest = self._latest_stored.get(group)
            if latest is not None:
                event = self._pending[latest]
                extending = self._extending.get(group)
                last = _last_hash(extending[-1]) if extending else _stored_last_hash(event.data)
                if last == parent_hash and event.data.scope == scope:
                    if extending is None:
                        self._extending[group] = [run]
                    else:
                        extending.append(run)
                    return
            if self._dropped_tail and self._dropped_tail.get(group) == (parent_hash, scope):
                self._dropped_tail[group] = (_last_hash(run), scope)  # extends an event the cap dropped
                return
        self._end_chain(group)
        # Not a continuation: a new event (which flushes the other groups'
        # removals, ascending, before it).
        self._latest_stored[group] = self._add_event(make_stored_data_of(parent_hash, run, scope), group)

    def _end_chain(self, group: int | None) -> None:
        """The group's latest stored event takes no more blocks."""
        if self._extending:
            self._seal(group)
        self._latest_stored.pop(group, None)
        if self._dropped_tail:
            self._dropped_tail.pop(group, None)

    def _seal(self, group: int | None) -> None:
        """Write the blocks waiting in ``_extending`` into the group's latest
        stored event."""
        runs = self._extending.get(group)
        if runs:
            at = self._latest_stored[group]
            event = self._pending[at]
            blocks = event.data.blocks + tuple(chain.from_iterable(source.blocks(*span) for source, *span in runs))
            data = make_stored_data(event.data.parent_hash, blocks, event.data.scope)
            self._pending[at] = make_event(event.event_id, data, event.window_size, event.hash_algo, group)
        self._extending.pop(group, None)

    def _seal_all(self) -> None:
        for group in list(self._extending):
            self._seal(group)

    def _enqueue_removed(self, hashes: list, group: int) -> None:
        # The group's chain ends here too: the removed event these hashes are
        # flushed into comes before any later stored event of the group.
        self._removed.setdefault(group, []).extend(hashes)

    def _flush_removed(self, group: int) -> None:
        hashes = self._removed.pop(group, None)
        if hashes:
            self._add_event(KVCacheRemovedData(tuple(hashes)), group)

    def _flush_all_removed(self) -> None:
        if self._removed:
            for group in sorted(self._removed):
                self._flush_removed(group)

    # -- helpers -----------------------------------------------------------------
    def _hash(self, key: bytes) -> EventHash:
        return event_block_hash(key, self.event_hash)

    def _parent_hash(self, block: LoggedBlock) -> EventHash | None:
        return None if block.parent_key is None else self._hash(block.parent_key)


def _covering_pages(block: LoggedBlock) -> list:
    """``(life cycle, level, priority)`` of the pages of ``block`` that cover it
    whole, ascending."""
    return [(lc, page.level, page.priority) for lc, page in sorted(block.pages.items()) if page.covers]


# Token ids below this are kept in _UniqueTokens' table (one pointer each, so at
# most 8 MiB); the others, and multimodal digests, in a dict of at most
# _OTHER_TOKENS_MAX entries that starts over beyond it (digests cannot grow it
# forever).
_TABLE_TOKENS_MAX = 1 << 20
_OTHER_TOKENS_MAX = 1 << 18


class _UniqueTokens:
    """The UniqueToken of every distinct token, made once and shared by all
    stored payloads: a frozen dataclass per token of every stored block would
    be most of the cost of events. One per process (``_UNIQUE_TOKENS``): the
    objects are immutable values, so every event manager may share them, and
    a vocabulary is made once, not once per manager. Token ids in
    [0, _TABLE_TOKENS_MAX) are kept in an object array indexed by id, so the
    payloads of a launch are one gather (``rows``); other tokens in a dict
    (``of``). Filling either in is safe to interrupt, and to race with another
    thread: an entry whose mark is missing is made again (an equal object),
    and the table grows by replacing both arrays in one store."""

    def __init__(self):
        self._table = (np.empty(0, dtype=object), np.zeros(0, dtype=bool))  # (tokens, made), by id
        self._other: dict = {}

    def rows(self, ids: np.ndarray, top: int | None = None) -> list:
        """The UniqueToken tuples of the rows of ``ids`` (2-D, every id in
        [0, _TABLE_TOKENS_MAX); ``top``: their maximum, when known)."""
        tokens, made = self._grown((int(ids.max()) if top is None else top) + 1)
        if not made.take(ids).all():
            new = np.unique(ids[~made.take(ids)])
            tokens[new] = [UniqueToken(t) for t in new.tolist()]
            made[new] = True
        return list(map(tuple, tokens.take(ids).tolist()))

    def of(self, tokens) -> tuple:
        """The UniqueTokens of one token list (ints and 32-byte digests)."""
        return tuple(map(self._one, tokens))

    def _one(self, token) -> UniqueToken:
        if type(token) is int and 0 <= token < _TABLE_TOKENS_MAX:
            return self.rows(np.array([[token]], dtype=np.int64))[0][0]
        found = self._other.get(token)
        if found is None:
            if len(self._other) >= _OTHER_TOKENS_MAX:
                self._other = {}  # one store: an interrupt leaves a whole dict
            found = self._other[token] = UniqueToken(token.hex() if isinstance(token, bytes) else token)
        return found

    def _grown(self, size: int) -> tuple:
        tokens, made = self._table
        if size > len(tokens):
            n = min(max(size, 2 * len(tokens), 1 << 16), _TABLE_TOKENS_MAX)
            bigger, marks = np.empty(n, dtype=object), np.zeros(n, dtype=bool)
            bigger[: len(tokens)], marks[: len(made)] = tokens, made
            self._table = tokens, made = bigger, marks
        return tokens, made


_UNIQUE_TOKENS = _UniqueTokens()


class _TokenRows:
    """The token ids of a launch's stored blocks (rows of plain ids; a row
    past its block's count holds zeros), and their UniqueToken tuples, made
    all at once when a block's ``tokens`` is first read
    (``make_stored_block_of_row``).
    Most of the cost of a stored block was its tuple of token objects (a
    gather of pointers to objects all over memory, then their tuple); a
    consumer that reads the ids (``event_types.token_ids``, the ZMQ
    publisher) or does not read the blocks never pays it, and one that reads
    them pays it once per launch, not once per block."""

    __slots__ = ("ids", "counts", "_tuples")

    def __init__(self, ids: np.ndarray, counts: list | None):
        self.ids = ids  # [blocks, tokens] int32, a copy of the log's rows
        self.counts = counts  # each row's token count; None when every row is full
        self._tuples = None

    def tokens(self, row: int) -> tuple:
        tuples = self._tuples
        if tuples is None:  # made again by a racing thread: equal tuples, one kept
            tuples = _UNIQUE_TOKENS.rows(self.ids, int(self.ids.max()))
            if self.counts is not None:
                tuples = [t[:n] for t, n in zip(tuples, self.counts)]
            self._tuples = tuples
        return tuples[row]

    def token_ids(self, rows):
        """The token ids of row ``rows`` (a tuple), or of each of the rows
        ``rows`` (a sequence: a list of tuples)."""
        if isinstance(rows, int):
            ids = self.ids[rows].tolist()
            return tuple(ids if self.counts is None else ids[: self.counts[rows]])
        ids = self.ids[np.asarray(rows)].tolist()
        if self.counts is None:
            return list(map(tuple, ids))
        return [tuple(row[:n]) for row, n in zip(ids, map(self.counts.__getitem__, rows))]


def _payload(tokens, unique: _UniqueTokens) -> tuple:
    """``(tokens, mm_keys)`` of a block's stored events from its token list
    (ints, and 32-byte digests for multimodal tokens), one token at a time:
    for blocks ``_Launch`` cannot build in bulk (multimodal ones, and blocks
    given to the public stored operations)."""
    mm_keys = tuple(dict.fromkeys(t.hex() for t in tokens if isinstance(t, bytes)))
    return unique.of(tokens), mm_keys


# change-log kind -> what _Launch does with its record; kinds past the table,
# and kind 0, are unknown.
_UNKNOWN, _SKIP, _INFO, _EVENT, _HEADER = range(5)
_KIND_ROLE = np.full(max(EV_CREATED, EV_PAGE_INFO, EV_REMOVED, EV_REMOVED_LIFE_CYCLE, EV_ROOT_REMOVED,
                         EV_STORED_BLOCK, EV_STORED_LIFE_CYCLE, EV_UPDATED) + 2, _UNKNOWN, dtype=np.int8)
_KIND_ROLE[[EV_CREATED, EV_ROOT_REMOVED]] = _SKIP  # tree bookkeeping
_KIND_ROLE[EV_PAGE_INFO] = _INFO
_KIND_ROLE[[EV_REMOVED, EV_REMOVED_LIFE_CYCLE, EV_UPDATED]] = _EVENT
_KIND_ROLE[[EV_STORED_BLOCK, EV_STORED_LIFE_CYCLE]] = _HEADER
_ROLE_OF = {kind: role for kind, role in enumerate(_KIND_ROLE.tolist()) if role != _UNKNOWN}

_FIELDS = [LOG_KIND, LOG_LIFE_CYCLE, LOG_OLD_LEVEL, LOG_LEVEL]  # what _apply reads of a record
_PAGE = [LOG_LIFE_CYCLE, LOG_LEVEL, LOG_PRIORITY]  # what a stored block takes of its page info
_KEY = struct.Struct("<4q").pack  # a digest's int64x4 as its 32 bytes (int64x4_to_digest's byte order)

# Below this many records a launch is decoded record by record (_Launch._rows):
# a few Python operations per record then cost less than the fixed cost of the
# array operations (about 60 of them, whatever the launch's size).
_ROWS_MAX = 64


class _Launch:
    """One launch's change log, decoded. ``fields``, ``keys`` and ``spans``:
    for each record that can make an event, in log order, its kind, life
    cycle, old level and level (four columns), its block key, and how many
    records from it on go in together (a chain of stores it starts, ``_continues_chain``, or
    a run of removals it starts; else 1; only a run's first record is read).
    ``headers``: columns with a row per stored header, in log order: block
    hash, parent key, parent hash, whether the parent is a root, and where
    its covering pages start and end in ``blocks`` and ``block_lcs``: the
    stored block each covering page announces (``_StoredBlocks``: the
    header's hash and payload, the page's level and priority; None when no
    page covers its block) and the page's life cycle, by header, then life
    cycle ascending. Nothing here is event state (the
    token objects are shared, safely), so an interrupt while building it
    changes nothing. Malformed records raise ValueError here, before the
    event manager applies any. ``store_lcs``: when every record that makes
    an event is a whole-block store (EV_STORED_BLOCK) and the same life
    cycles cover each one, those life cycles (a tuple), else None.

    A launch's records are decoded with array operations (``_arrays``), a
    few operations for all records alike; a launch of few records record by
    record (``_rows``), to the same columns."""

    __slots__ = ("fields", "keys", "spans", "headers", "blocks", "block_lcs", "store_lcs")

    def __init__(self, records: np.ndarray, log_tokens: np.ndarray, event_hash: str,
                 digest_of_token: Callable[[int], bytes], unique: _UniqueTokens, first: int = 0):
        records = records.reshape(-1, LOG.width)
        decode = self._rows if len(records) < _ROWS_MAX else self._arrays
        decode(records, log_tokens, event_hash, digest_of_token, unique, first)

    def _arrays(self, records, log_tokens, event_hash, digest_of_token, unique, first) -> None:
        kinds = records[:, LOG_KIND]
        role = _KIND_ROLE.take(kinds, mode="clip")
        is_info = role == _INFO
        # The record each page info belongs to: the last record before it that
        # is no page info (-1 when there is none).
        owner = np.maximum.accumulate(np.where(is_info, -1, np.arange(len(kinds))))
        bad = ((role == _UNKNOWN) | is_info & ((owner < 0) | (role[owner] != _HEADER))).nonzero()[0]
        if bad.size:
            i = int(bad[0])
            if role[i] == _UNKNOWN:
                raise ValueError(f"log record {first + i}: unknown kind {int(kinds[i])}")
            raise ValueError(f"log record {first + i}: a page info record without a stored header")

        events = (role >= _EVENT).nonzero()[0]  # the records that make events
        rows = records[events]
        self.fields = rows[:, _FIELDS].T.tolist()
        self.keys = _keys(rows, LOG_DIGEST)
        removal = rows[:, LOG_KIND] == EV_REMOVED
        removal[1:] &= removal[:-1]  # a removal joins the one before it
        if len(removal):
            removal[0] = False
        spans = _runs(removal) if removal.any() else np.ones(len(rows), dtype=np.int64)
        position = (role[events] == _HEADER).nonzero()[0]  # each stored header's, among the records that make events
        if not position.size:
            self.spans = spans.tolist()
            self.headers, self.blocks, self.block_lcs, self.store_lcs = ((),) * 6, None, [], None
            return
        stores_only = len(position) == len(events)  # a commit's launch: every record that makes an event stores
        headers, h = (events, rows) if stores_only else (events[position], rows[position])
        keys = self.keys if stores_only else [self.keys[p] for p in position.tolist()]
        # Covering page infos (they follow their header, ascending), and the
        # header each belongs to, as its index among the headers.
        covers = (is_info & (records[:, LOG_COVERS] != 0)).nonzero()[0]
        cover_of = headers.searchsorted(owner[covers])
        bounds = cover_of.searchsorted(np.arange(len(headers) + 1))
        each = bounds[1:] - bounds[:-1]  # covering pages per header
        lcs, levels, priorities = records[covers][:, _PAGE].T.tolist()
        k = int(each[0])
        # Every header covered in the same life cycles (the usual): they need no comparing.
        alike = bool(k) and each.min() == each.max() and lcs == lcs[:k] * len(headers)
        hashes = _hashes(h, LOG_DIGEST, event_hash, keys)
        continues = None
        if len(headers) > 1:  # a chain of stores to find
            # The life cycles that cover each header, as bits (a config has few).
            covered = None if alike else np.bincount(cover_of, weights=np.exp2(records[covers, LOG_LIFE_CYCLE]),
                                                     minlength=len(headers))
            continues = _continues_chain(h, position, covered)
            if continues.any():
                spans[position] = _runs(continues)
            else:
                continues = None
        self.spans = spans.tolist()
        self.headers = (hashes, *_parents(h, event_hash, keys, hashes, continues), h[:, LOG_PARENT_IS_ROOT].tolist(),
                        bounds[:-1].tolist(), bounds[1:].tolist())
        self.block_lcs = lcs
        self.store_lcs = tuple(lcs[:k]) if alike and stores_only and (h[:, LOG_KIND] == EV_STORED_BLOCK).all() else None
        if not covers.size:
            self.blocks = None
            return
        # Payloads only for the headers with a covering page: the others
        # announce nothing. Usually that is every header, with one page each.
        if len(covers) == len(headers) and each.all():
            tokens, mm_keys = _payloads(h[:, LOG_TOKENS_AT], h[:, LOG_NUM_TOKENS], log_tokens, digest_of_token, unique)
            self.blocks = _StoredBlocks(hashes, None, tokens, mm_keys, None, levels, priorities)
            return
        wanted = each.nonzero()[0]
        tokens, mm_keys = _payloads(h[wanted, LOG_TOKENS_AT], h[wanted, LOG_NUM_TOKENS], log_tokens, digest_of_token,
                                    unique)
        self.blocks = _StoredBlocks(hashes, wanted.tolist(), tokens, mm_keys, cover_of.tolist(), levels, priorities)

    def _rows(self, records, log_tokens, event_hash, digest_of_token, unique, first) -> None:
        fields, keys, spans = [], [], []
        heads, head_at = [], []  # the stored headers' records, and their indices in fields
        covers = []  # per covering page info: (its header's index in heads, life cycle, level, priority)
        owner = _UNKNOWN  # the role of the last record that is no page info
        run = 0  # where in fields the last run of removals starts
        for i, r in enumerate(records.tolist()):
            kind = r[LOG_KIND]
            role = _ROLE_OF.get(kind, _UNKNOWN)
            if role == _INFO:
                if owner != _HEADER:
                    raise ValueError(f"log record {first + i}: a page info record without a stored header")
                if r[LOG_COVERS]:
                    covers.append((len(heads) - 1, r[LOG_LIFE_CYCLE], r[LOG_LEVEL], r[LOG_PRIORITY]))
                continue
            if role == _UNKNOWN:
                raise ValueError(f"log record {first + i}: unknown kind {kind}")
            owner = role
            if role == _SKIP:
                continue
            if kind == EV_REMOVED:
                if fields and fields[-1][0] == EV_REMOVED:
                    spans[run] += 1  # a removal joins the one before it
                else:
                    run = len(fields)
            elif role == _HEADER:
                heads.append(r)
                head_at.append(len(fields))
            spans.append(1)
            fields.append((kind, r[LOG_LIFE_CYCLE], r[LOG_OLD_LEVEL], r[LOG_LEVEL]))
            keys.append(_KEY(*r[LOG_DIGEST : LOG_DIGEST + 4]))
        self.fields = [list(column) for column in zip(*fields)] if fields else [[], [], [], []]
        self.keys, self.spans = keys, spans
        if not heads:
            self.headers, self.blocks, self.block_lcs, self.store_lcs = ((),) * 6, None, [], None
            return
        counts = [0] * len(heads)
        for c in covers:
            counts[c[0]] += 1
        his = list(accumulate(counts))
        los = [hi - n for hi, n in zip(his, counts)]
        head_keys = [keys[at] for at in head_at]
        parent_keys = [_KEY(*r[LOG_PARENT_DIGEST : LOG_PARENT_DIGEST + 4]) for r in heads]
        at_roots = [r[LOG_PARENT_IS_ROOT] for r in heads]
        lcs = [c[1] for c in covers]
        chain = 0  # the header the current chain starts at
        for j in range(1, len(heads)):
            if (heads[j][LOG_KIND] == EV_STORED_BLOCK == heads[j - 1][LOG_KIND] and head_at[j] == head_at[j - 1] + 1
                    and counts[j] and lcs[los[j]:his[j]] == lcs[los[j - 1]:his[j - 1]]
                    and not at_roots[j] and parent_keys[j] == head_keys[j - 1]):
                spans[head_at[chain]] += 1
            else:
                chain = j
        hashes = [event_block_hash(key, event_hash) for key in head_keys]
        self.headers = (hashes, parent_keys, [event_block_hash(key, event_hash) for key in parent_keys],
                        at_roots, los, his)
        self.block_lcs = lcs
        self.store_lcs = None
        k = counts[0]
        if (k and len(heads) == len(fields) and counts.count(k) == len(heads)
                and all(r[LOG_KIND] == EV_STORED_BLOCK for r in heads) and lcs == lcs[:k] * len(heads)):
            self.store_lcs = tuple(lcs[:k])
        if not covers:
            self.blocks = None
            return
        wanted = [j for j, n in enumerate(counts) if n]
        tokens, mm_keys = _payloads(np.array([heads[j][LOG_TOKENS_AT] for j in wanted]),
                                    np.array([heads[j][LOG_NUM_TOKENS] for j in wanted]),
                                    log_tokens, digest_of_token, unique)
        one_each = len(covers) == len(heads) == len(wanted)
        self.blocks = _StoredBlocks(hashes, None if len(wanted) == len(heads) else wanted, tokens, mm_keys,
                                    None if one_each else [c[0] for c in covers], [c[2] for c in covers],
                                    [c[3] for c in covers])


class _StoredBlocks:
    """A launch's stored blocks, one per covering page (by header, then life
    cycle ascending), as columns: the header's hash and payload, the page's
    level and priority. A stored event holds a run of them (``start``,
    ``stop``, ``step``) and makes their KVCacheStoredBlockData when its
    ``blocks`` is first read (``make_stored_data_of``): a consumer that
    does not read them never pays for them. ``token_rows``: the payloads as
    rows of token ids (``_TokenRows``, row ``rows[i]`` for block i), or
    None with ``tokens`` and ``mm_keys`` made per block."""

    __slots__ = ("hashes", "levels", "priorities", "token_rows", "rows", "tokens", "mm_keys")

    def __init__(self, hashes: list, wanted: list | None, tokens, mm_keys: list | None, cover_of: list,
                 levels: list, priorities: list):
        """``cover_of``: each page's header (None: one page per header, in
        order); ``hashes``: by header;
        ``tokens`` and ``mm_keys``: the payloads of the headers ``wanted``
        (all of them when None), or ``(_TokenRows, None)``, a row each."""
        one_each = cover_of is None  # a page per header, in order: the usual
        self.hashes = hashes if one_each else [hashes[j] for j in cover_of]
        self.levels, self.priorities = levels, priorities
        if isinstance(tokens, _TokenRows):
            self.token_rows, self.tokens, self.mm_keys = tokens, None, None
            if one_each:
                self.rows = range(len(hashes))
            else:
                row_of = range(len(hashes)) if wanted is None else dict(zip(wanted, range(len(wanted))))
                self.rows = [row_of[j] for j in cover_of]
            return
        if wanted is not None:
            tokens, mm_keys = dict(zip(wanted, tokens)), dict(zip(wanted, mm_keys))
        self.token_rows, self.rows = None, None
        self.tokens = tokens if one_each else [tokens[j] for j in cover_of]
        self.mm_keys = mm_keys if one_each else [mm_keys[j] for j in cover_of]

    @staticmethod
    def of(block_hash: EventHash, block: "LoggedBlock", covering: list) -> "_StoredBlocks":
        """The stored blocks of each covering page of one block."""
        tokens, mm_keys = _payload(block.tokens, _UNIQUE_TOKENS)
        return _StoredBlocks([block_hash], [0], [tokens], [mm_keys], [0] * len(covering), [page[1] for page in covering],
                             [page[2] for page in covering])

    def columns(self, start: int, stop: int, step: int) -> tuple:
        """``(hashes, token ids, levels)`` of the run (``stored_columns``)."""
        run = slice(start, stop, step)
        if self.token_rows is not None:
            token_ids = self.token_rows.token_ids(self.rows[run])
        else:
            token_ids = [tuple(token.token_id for token in tokens) for tokens in self.tokens[run]]
        return self.hashes[run], token_ids, self.levels[run]

    def blocks(self, start: int, stop: int, step: int) -> tuple:
        """The KVCacheStoredBlockData of the run."""
        run = slice(start, stop, step)
        if self.token_rows is not None:
            return tuple(map(make_stored_block_of_row, self.hashes[run], repeat(self.token_rows), self.rows[run],
                             self.levels[run], self.priorities[run]))
        return tuple(map(make_stored_block, self.hashes[run], self.tokens[run], self.levels[run],
                         self.priorities[run], self.mm_keys[run]))


def _last_hash(run: tuple) -> EventHash:
    """The hash of the last block of a run ``(_StoredBlocks, start, stop, step)``."""
    source, start, stop, step = run
    return source.hashes[start + (stop - 1 - start) // step * step]


def _stored_last_hash(data: KVCacheStoredData) -> EventHash:
    """The hash of the last block of a stored event, without making its blocks."""
    run = data.__dict__.get("_blocks_of")
    return data.blocks[-1].block_hash if run is None or "blocks" in data.__dict__ else _last_hash(run)


def _continues_chain(headers: np.ndarray, position: np.ndarray, covered: np.ndarray | None) -> np.ndarray:
    """Per stored header, whether it continues the chain of the one before:
    both are whole-block stores (EV_STORED_BLOCK), next to each other among
    the records that make events (``position``), covered in the same, not
    no, life cycles (``covered``: their bits; None when every header is
    covered in the same ones), and its parent is that header's block. The
    first header continues nothing."""
    continues = np.zeros(len(headers), dtype=bool)
    store = headers[:, LOG_KIND] == EV_STORED_BLOCK
    continues[1:] = (
        store[1:] & store[:-1] & (position[1:] - position[:-1] == 1)
        & (headers[1:, LOG_PARENT_IS_ROOT] == 0)
        & (headers[1:, LOG_PARENT_DIGEST : LOG_PARENT_DIGEST + 4] == headers[:-1, LOG_DIGEST : LOG_DIGEST + 4]).all(axis=1)
    )
    if covered is not None:
        continues[1:] &= (covered[1:] == covered[:-1]) & (covered[1:] != 0)
    return continues


def _runs(joins: np.ndarray) -> np.ndarray:
    """For each element, the length of the run it starts (1 where it starts
    none), where ``joins[k]`` says element k joins the run of element k - 1
    (``joins[0]`` must be False)."""
    runs = np.ones(len(joins), dtype=np.int64)
    starts = (~joins).nonzero()[0]
    ends = np.empty_like(starts)
    ends[:-1], ends[-1:] = starts[1:], len(joins)
    runs[starts] = ends - starts
    return runs


def _keys(rows: np.ndarray, col: int) -> list:
    """The int64x4 digests at ``col`` of ``rows`` as 32 bytes each (the byte
    order of ``int64x4_to_digest``), in one conversion."""
    return np.ascontiguousarray(rows[:, col : col + 4], dtype="<i8").view("V32").ravel().tolist()


def _hashes(rows: np.ndarray, col: int, event_hash: str, keys: list) -> list:
    """``event_block_hash`` of the digests at ``col`` of ``rows`` (``keys``:
    the same as bytes), all at once."""
    if event_hash == "sha256_64":  # the first 8 bytes, big-endian unsigned
        return np.ascontiguousarray(rows[:, col], dtype="<i8").view(">u8").tolist()
    return list(map(bytes.hex, keys))


def _parents(headers: np.ndarray, event_hash: str, keys: list, hashes: list, continues: np.ndarray | None) -> tuple:
    """``(parent keys, parent hashes)`` of the headers: where a header
    continues the chain of the one before (``continues``), that one's key and
    hash; made from the log only for the others."""
    if continues is None:
        parent_keys = _keys(headers, LOG_PARENT_DIGEST)
        return parent_keys, _hashes(headers, LOG_PARENT_DIGEST, event_hash, parent_keys)
    starts = (~continues).nonzero()[0]
    first = headers[starts]
    first_keys = _keys(first, LOG_PARENT_DIGEST)
    parent_keys, parent_hashes = [None, *keys[:-1]], [None, *hashes[:-1]]
    for j, key, block_hash in zip(starts.tolist(), first_keys, _hashes(first, LOG_PARENT_DIGEST, event_hash, first_keys)):
        parent_keys[j], parent_hashes[j] = key, block_hash
    return parent_keys, parent_hashes


def _payloads(at: np.ndarray, counts: np.ndarray, log_tokens: np.ndarray, digest_of_token,
              unique: _UniqueTokens) -> tuple:
    """``(tokens, mm_keys)``: the payloads (``_payload``) of the blocks whose
    token rows are ``log_tokens[at]``, of ``counts`` tokens each: the rows of
    plain token ids in one gather, the multimodal ones (negative ids stand
    for interned digests) and any other token by token. When every row holds
    plain ids (the usual launch): ``(_TokenRows, None)``, the tokens made
    when read."""
    rows = np.asarray(log_tokens)[at]
    width = rows.shape[1]
    full = int(counts.min()) >= width
    if not full:  # the tokens past a block's count are not its own: read as 0
        rows = np.where(np.arange(width) < counts[:, None], rows, 0)
    top = int(rows.max())
    if top < _TABLE_TOKENS_MAX and rows.min() >= 0:  # plain ids (the usual launch): tokens made when read
        return _TokenRows(rows, None if full else counts.tolist()), None
    tokens, mm_keys = [None] * len(rows), [()] * len(rows)
    plain = ((rows >= 0) & (rows < _TABLE_TOKENS_MAX)).all(axis=1)
    if plain.any():
        for j, row, n in zip(plain.nonzero()[0].tolist(), unique.rows(rows[plain]), counts[plain].tolist()):
            tokens[j] = row[:n]
    if not plain.all():
        digests: dict[int, bytes] = {}  # negative token id -> digest, once per launch
        for j, row, n in zip((~plain).nonzero()[0].tolist(), rows[~plain].tolist(), counts[~plain].tolist()):
            tokens_of = row[:n]
            for t in tokens_of:
                if t < 0 and t not in digests:
                    digests[t] = bytes(digest_of_token(t))
            tokens[j], mm_keys[j] = _payload([digests[t] if t < 0 else t for t in tokens_of], unique)
    return tokens, mm_keys

"""KV cache events (docs/semantics.md §4), built from the tree's change log.

The tree kernels do not call into Python while they change the tree; they
append records to a change log (``layout.LOG``), which the host drains after
each launch. ``KVCacheEventManager.on_records`` replays those records, in
order, through the reference event manager's operations:

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

The module is long because the event manager keeps the reference's operations
one to one, and the four rules above only make sense read together.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

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
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    UniqueToken,
    event_block_hash,
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


@dataclass
class _Announced:
    block_hash: EventHash
    life_cycles: set


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
        self._digest_of_token = digest_of_token
        self._scope_of_root = scope_of_root

        self._next_event_id = 0
        self._stored: dict[bytes, _Announced] = {}  # block key -> announcements
        self._removed: dict[int, list] = {}  # layer group -> buffered removed hashes
        self._pending: list[KVCacheEvent] = []  # this iteration's events
        self._latest_stored: dict[int, int] = {}  # layer group -> index in _pending
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
        self._unique_tokens: dict = {}  # token (int or digest bytes) -> its UniqueToken (_payload)

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
        each record it has applied, so records consumed before an exception
        are not applied twice when the same records come again."""
        if not self.enabled:
            return
        records = np.asarray(records)
        if records.size and (records.ndim != 2 or records.shape[1] != LOG.width):
            raise ValueError(f"records must have shape [n, {LOG.width}], got {records.shape}")
        if progress is None:
            progress = np.zeros(1, dtype=np.int64)
        n = len(records)
        if int(progress[0]) >= n:
            return
        launch = _Launch(records, log_tokens)
        rows = launch.rows
        while (i := int(progress[0])) < n:
            if rows[i][LOG_KIND] in (EV_CREATED, EV_ROOT_REMOVED):
                # Tree bookkeeping, no event state: nothing to save or restore
                # (about half the records of a step that stores new blocks).
                progress[0] = i + 1
            else:
                self._apply_atomically(launch, progress)

    def _apply_atomically(self, launch: "_Launch", progress: np.ndarray) -> None:
        """Apply the record at ``progress[0]`` and advance ``progress[0]`` past
        it, or, when an exception (an asynchronous one included) cuts the
        application short, leave everything as it was before the record.

        One record changes the event state in several steps (a stored event
        per life cycle; a removal forgets the block, then queues its removed
        hashes), and a record the count does not pass is applied again from
        its start. So the state the record may touch is saved first and put
        back unless the count moved: the count is one store, made last."""
        i = int(progress[0])
        saved = self._save(launch.key(i))
        try:
            progress[0] = self._apply_record(launch, i)
        except BaseException:
            if int(progress[0]) == i:
                self._restore(saved)
            raise

    def _save(self, key: bytes) -> tuple:
        """What applying the record of block ``key`` may change, cheaply: the
        announcements and scope of its block (a record names one block), the
        small per-group dicts, the buffered removals by length, the pending
        list by length and the entries a stored event may extend in place,
        and the event id."""
        announced = self._stored.get(key)
        if announced is not None:
            announced = _Announced(announced.block_hash, set(announced.life_cycles))
        pending = self._pending
        return (
            key, announced, self._scope_of.get(key), self._next_event_id,
            dict(self._latest_stored), dict(self._dropped_tail),
            {g: (hashes, len(hashes)) for g, hashes in self._removed.items()},
            pending, len(pending), {at: pending[at] for at in self._latest_stored.values()},
        )

    def _restore(self, saved: tuple) -> None:
        """Put back what ``_save`` kept. ``_trim`` and the flushes replace the
        pending list and the removal lists rather than cutting them, so the
        saved ones still hold everything they held."""
        key, announced, scope, next_id, latest, tail, removed, pending, n_pending, extended = saved
        if announced is None:
            self._stored.pop(key, None)
        else:
            self._stored[key] = announced
        if scope is None:
            self._scope_of.pop(key, None)
        else:
            self._scope_of[key] = scope
        for hashes, n in removed.values():
            del hashes[n:]
        del pending[n_pending:]
        for at, event in extended.items():
            if at < n_pending:
                pending[at] = event
        self._removed = {g: hashes for g, (hashes, _) in removed.items()}
        self._pending = pending
        self._latest_stored = latest
        self._dropped_tail = tail
        self._next_event_id = next_id

    def _apply_record(self, launch: "_Launch", i: int) -> int:
        """Apply the record at ``i`` (a stored header with its page infos, or
        one record); returns the index of the next one."""
        r = launch.rows[i]
        kind = r[LOG_KIND]
        if kind in (EV_STORED_BLOCK, EV_STORED_LIFE_CYCLE):
            j = launch.next_header(i)
            block = self._logged_block(launch, i, j)
            if kind == EV_STORED_BLOCK:
                self.add_stored_block_event_from_block(block)
            else:
                self.add_stored_life_cycle_event_from_block(block, r[LOG_LIFE_CYCLE])
            return j
        if kind == EV_REMOVED:
            # One record per detached block. Removing a subtree key by key
            # gives the events of one batched call: removals are buffered
            # per group, in order, until something flushes them.
            key = launch.key(i)
            self._scope_of.pop(key, None)
            self.add_removed_event([key])
        elif kind == EV_REMOVED_LIFE_CYCLE:
            self.add_removed_life_cycle_event(launch.key(i), r[LOG_LIFE_CYCLE])
        elif kind == EV_UPDATED:
            self.add_updated_event(
                launch.key(i),
                cache_level=Diff(r[LOG_OLD_LEVEL], r[LOG_LEVEL]),
                priority=None,
                layer_group_id=r[LOG_LIFE_CYCLE],
            )
        elif kind == EV_PAGE_INFO:
            raise ValueError(f"log record {i}: a page info record without a stored header")
        elif kind not in (EV_CREATED, EV_ROOT_REMOVED):
            raise ValueError(f"log record {i}: unknown kind {kind}")
        return i + 1

    def flush_iteration_events(self) -> None:
        """End the iteration: flush the buffered removals and move every pending
        event to the public queue (which keeps the newest ``max_entries``).
        No stored event coalesces across a flush."""
        if not self.enabled:
            return
        self._finish_move()
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
        covering = sorted(lc for lc, page in block.pages.items() if page.covers)
        if not covering:
            return
        block_hash = self._hash(block.key)
        self._stored[block.key] = _Announced(block_hash, set(covering))
        parent_hash = self._parent_hash(block)
        payload = self._payload(block)
        for lc in covering:
            data = self._block_data(payload, block_hash, block.pages[lc])
            self._add_stored_event(parent_hash, data, lc, block.scope)

    def add_stored_life_cycle_event_from_block(self, block: LoggedBlock, life_cycle: int) -> None:
        """Announce one more life cycle of an announced block, when its page
        covers the whole block; a block never announced takes the whole-block
        path instead."""
        state = self._stored.get(block.key)
        if state is None:
            self.add_stored_block_event_from_block(block)
            return
        page = block.pages.get(life_cycle)
        if life_cycle in state.life_cycles or page is None or not page.covers:
            return
        state.life_cycles.add(life_cycle)
        data = self._block_data(self._payload(block), state.block_hash, page)
        self._add_stored_event(self._parent_hash(block), data, life_cycle, block.scope)

    def add_removed_event(self, keys: Iterable[bytes]) -> None:
        """Blocks left the tree: a removed entry per announced life cycle.
        Unknown keys, and keys already removed, are ignored."""
        by_group: dict[int, list] = {}
        for key in keys:
            state = self._stored.pop(key, None)
            if state is None:
                continue
            for lc in sorted(state.life_cycles):
                by_group.setdefault(lc, []).append(state.block_hash)
        for lc in sorted(by_group):
            self._enqueue_removed(by_group[lc], lc)

    def add_removed_life_cycle_event(self, key: bytes, life_cycle: int) -> None:
        """One life cycle's page of a block died: a removed entry for that group
        if it was announced. Removing the last announced life cycle forgets the
        block, so a later store announces it from scratch."""
        state = self._stored.get(key)
        if state is None or life_cycle not in state.life_cycles:
            return
        state.life_cycles.remove(life_cycle)
        if not state.life_cycles:
            del self._stored[key]
        self._enqueue_removed([state.block_hash], life_cycle)

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
        self._add_event(KVCacheUpdatedData(state.block_hash, cache_level, priority), layer_group_id)

    # -- batching and ordering ---------------------------------------------------
    def _add_event(self, data: EventData, group: int | None) -> int:
        """Append an event to this iteration's list; returns its index there."""
        if not isinstance(data, KVCacheRemovedData):
            # Removals that happened before this event must be seen before it.
            self._flush_all_removed()
        event = KVCacheEvent(
            event_id=self._next_event_id,
            data=data,
            window_size=self._window_size(group),
            hash_algo=self.hash_algo,
            attention_dp_rank=0,
            layer_group_id=group,
        )
        self._next_event_id += 1
        self._pending.append(event)
        if not isinstance(data, KVCacheStoredData):
            self._latest_stored.pop(group, None)
            self._dropped_tail.pop(group, None)
        if len(self._pending) >= 2 * self.max_entries + 16:
            self._trim()
        return len(self._pending) - 1

    def _trim(self) -> None:
        """Keep the newest ``max_entries`` pending events. The queue would drop
        the others at the next flush: it keeps the newest ``max_entries`` of
        everything, and these are newer."""
        cut = len(self._pending) - self.max_entries
        for group, at in list(self._latest_stored.items()):
            if at < cut:
                data = self._pending[at].data
                self._dropped_tail[group] = (data.blocks[-1].block_hash, data.scope)
                del self._latest_stored[group]
            else:
                self._latest_stored[group] = at - cut
        self._pending = self._pending[cut:]  # a new list: a saved one stays whole (_restore)

    def _add_stored_event(self, parent_hash, block: KVCacheStoredBlockData, group: int,
                          scope: ReuseScope | None = None) -> None:
        # The group's own removals go first, ahead of the other groups' too: a
        # block removed and then stored again must not read as stored, removed.
        self._flush_removed(group)
        latest = self._latest_stored.get(group)
        if not self._removed and latest is not None:
            event = self._pending[latest]
            if event.data.blocks[-1].block_hash == parent_hash and event.data.scope == scope:
                data = replace(event.data, blocks=event.data.blocks + (block,))
                self._pending[latest] = replace(event, data=data)
                return
        if not self._removed and self._dropped_tail.get(group) == (parent_hash, scope):
            self._dropped_tail[group] = (block.block_hash, scope)  # extends an event the cap dropped
            return
        self._dropped_tail.pop(group, None)
        # Not a continuation: a new event (which flushes the other groups'
        # removals, ascending, before it).
        self._latest_stored[group] = self._add_event(KVCacheStoredData(parent_hash, (block,), scope), group)

    def _enqueue_removed(self, hashes: list, group: int) -> None:
        # The group's chain ends here too: the removed event these hashes are
        # flushed into comes before any later stored event of the group.
        self._removed.setdefault(group, []).extend(hashes)

    def _flush_removed(self, group: int) -> None:
        hashes = self._removed.pop(group, None)
        if hashes:
            self._add_event(KVCacheRemovedData(tuple(hashes)), group)

    def _flush_all_removed(self) -> None:
        for group in sorted(self._removed):
            self._flush_removed(group)

    # -- helpers -----------------------------------------------------------------
    def _window_size(self, group: int | None) -> int:
        if group is not None and 0 <= group < len(self.window_sizes):
            return self.window_sizes[group]
        return NO_WINDOW

    def _hash(self, key: bytes) -> EventHash:
        return event_block_hash(key, self.event_hash)

    def _parent_hash(self, block: LoggedBlock) -> EventHash | None:
        return None if block.parent_key is None else self._hash(block.parent_key)

    @staticmethod
    def _block_data(payload: tuple, block_hash: EventHash, page: PageInfo) -> KVCacheStoredBlockData:
        """The stored payload (``_payload``) of a block as announced for
        ``page``'s life cycle."""
        tokens, mm_keys = payload
        return KVCacheStoredBlockData(block_hash, tokens, page.level, page.priority, mm_keys)

    def _payload(self, block: LoggedBlock) -> tuple:
        """``(tokens, mm_keys)`` of ``block``'s stored events, built once per
        block however many life cycles announce it. Token objects come from
        ``_unique_tokens``: building a frozen dataclass per token of every
        stored block was most of the cost of events."""
        cache = self._unique_tokens
        try:
            tokens = tuple(map(cache.__getitem__, block.tokens))
        except KeyError:
            if len(cache) > _UNIQUE_TOKENS_MAX:
                cache = self._unique_tokens = {}  # one store: an interrupt leaves a whole cache
            for t in block.tokens:
                if t not in cache:
                    cache[t] = UniqueToken(t.hex() if isinstance(t, bytes) else t)
            tokens = tuple(map(cache.__getitem__, block.tokens))
        mm_keys = ()
        if bytes in set(map(type, block.tokens)):
            mm_keys = tuple(dict.fromkeys(t.hex() for t in block.tokens if isinstance(t, bytes)))
        return tokens, mm_keys

    def _logged_block(self, launch: "_Launch", i: int, j: int) -> LoggedBlock:
        """The block of the stored header at ``i``, its page infos up to ``j``."""
        header = launch.rows[i]
        tokens = launch.tokens(header[LOG_TOKENS_AT], header[LOG_NUM_TOKENS])
        if launch.multimodal and min(tokens, default=0) < 0:  # interned multimodal digests
            tokens = tuple(launch.digest_token(t, self._digest_of_token) if t < 0 else t for t in tokens)
        pages = {
            p[LOG_LIFE_CYCLE]: PageInfo(bool(p[LOG_COVERS]), p[LOG_LEVEL], p[LOG_PRIORITY])
            for p in launch.rows[i + 1 : j]
        }
        key = launch.key(i)
        if header[LOG_PARENT_IS_ROOT]:
            parent = None
            found = None if self._scope_of_root is None else self._scope_of_root(launch.parent_key(i))
            scope = None if found is None or found == ReuseScope() else found
        else:
            parent = launch.parent_key(i)
            scope = self._scope_of.get(parent)
        if scope is not None:
            self._scope_of[key] = scope
        return LoggedBlock(key, parent, tokens, pages, scope)


# Distinct tokens whose UniqueToken the event manager keeps (about a vocabulary;
# the cache starts over beyond it, so multimodal digests cannot grow it forever).
_UNIQUE_TOKENS_MAX = 1 << 18


class _Launch:
    """One launch's change log, decoded with a few array operations instead of
    per record: the rows as Python ints, every record's block key and parent
    key as bytes, and the token rows as lists, on first use. Nothing here is
    event state, so an interrupt while building it changes nothing."""

    __slots__ = ("rows", "multimodal", "_keys", "_parents", "_log_tokens", "_token_rows", "_digests")

    def __init__(self, records: np.ndarray, log_tokens: np.ndarray):
        self.rows = records.tolist()
        self._keys = _digest_bytes(records, LOG_DIGEST)
        self._parents = _digest_bytes(records, LOG_PARENT_DIGEST)
        self._log_tokens = log_tokens
        self._token_rows: dict[int, list] = {}
        self.multimodal = bool(np.size(log_tokens)) and int(np.min(log_tokens)) < 0
        self._digests: dict[int, bytes] = {}  # negative token id -> digest

    def key(self, i: int) -> bytes:
        return self._keys[32 * i : 32 * i + 32]

    def parent_key(self, i: int) -> bytes:
        return self._parents[32 * i : 32 * i + 32]

    def next_header(self, i: int) -> int:
        """The index after the page infos that follow the header at ``i``."""
        rows, j = self.rows, i + 1
        while j < len(rows) and rows[j][LOG_KIND] == EV_PAGE_INFO:
            j += 1
        return j

    def tokens(self, at: int, n: int) -> tuple:
        row = self._token_rows.get(at)
        if row is None:
            row = self._token_rows[at] = self._log_tokens[at].tolist()
        return tuple(row[:n])

    def digest_token(self, t: int, digest_of_token) -> bytes:
        d = self._digests.get(t)
        if d is None:
            d = self._digests[t] = bytes(digest_of_token(t))
        return d


def _digest_bytes(records: np.ndarray, col: int) -> bytes:
    """The int64x4 digests at ``col`` of every record, as 32 bytes each (the
    byte order of ``int64x4_to_digest``), in one conversion."""
    return np.ascontiguousarray(records[:, col : col + 4], dtype="<i8").tobytes()

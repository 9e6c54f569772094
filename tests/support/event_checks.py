"""Consistency checks on a stream of KV cache events (docs/semantics.md §3 invariant 16).

A consumer (a router) rebuilds each layer group's set of cached blocks from the
events alone, so the stream must never remove what it did not store:

- every removed (hash, layer group) pair was stored for that group before;
- no pair is removed twice without a stored event in between.

``check_event_consistency`` checks exactly that on a list of events.
``EventTracker`` follows a real manager's stream, drain after drain, and also
holds it against the tree (``check_tree``); see its docstring for the rules.

The checks assume the stream is complete: events dropped by the queue cap
(``max_kv_event_entries``) would make a later removal look unannounced.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpukv import introspect
from gpukv.event_types import (
    KVCacheCreatedData,
    KVCacheRemovedData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    UniqueToken,
    event_block_hash,
)
from gpukv.core.layout import FLAG_ATTACHED, FLAG_IN_USE, FLAG_ROOT, NULL


def check_event_consistency(events, announced: set | None = None) -> set:
    """Assert invariant 16 over ``events`` (oldest first) and return the
    (hash, layer group) pairs stored and not removed at the end.

    Pass that set back as ``announced`` to check a later drain of the same
    manager as a continuation of this one.
    """
    announced = set() if announced is None else set(announced)
    for event in events:
        group = event.layer_group_id
        if isinstance(event.data, KVCacheStoredData):
            for block in event.data.blocks:
                announced.add((block.block_hash, group))
        elif isinstance(event.data, KVCacheRemovedData):
            for h in event.data.block_hashes:
                assert (h, group) in announced, (
                    f"event {event.event_id}: removed {h!r} from layer group {group}, "
                    "which is not stored there (never stored, or already removed)"
                )
                announced.discard((h, group))
    return announced


# ---------------------------------------------------------------------------
# the tree as events see it
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeBlock:
    """An attached non-root block, in event terms."""

    key: bytes
    parent_key: bytes | None  # None under a scope root
    tokens: tuple  # UniqueToken per token (multimodal digests as hex)
    coverage: tuple  # per life cycle, 0 = no page
    level: tuple  # per life cycle: the page's cache level (None = no page)

    def covers(self, lc: int) -> bool:
        return self.coverage[lc] >= len(self.tokens)


def tree_blocks(mgr) -> dict:
    """``{key: TreeBlock}`` for every attached non-root block of ``mgr``."""
    t = introspect.tables(mgr)
    blocks, toks, slots, pages = t["blocks"], t["tokens"], t["block_slots"], t["pages"]
    L = len(mgr.config.life_cycles)
    flags = blocks["flags"]
    live = (flags & (FLAG_IN_USE | FLAG_ATTACHED)) == (FLAG_IN_USE | FLAG_ATTACHED)

    def key(r):
        return np.ascontiguousarray(t["digests"][r]).astype("<i8").tobytes()

    digests: dict[int, str] = {}

    def token(x: int) -> UniqueToken:
        if x >= 0:
            return UniqueToken(x)
        if x not in digests:
            digests[x] = introspect.token_digest(mgr, x).hex()
        return UniqueToken(digests[x])

    out = {}
    for r in np.nonzero(live & ((flags & FLAG_ROOT) == 0))[0]:
        p = int(blocks["parent"][r])
        parent = None if flags[p] & FLAG_ROOT else key(p)
        n = int(blocks["num_tokens"][r])
        cov, level = [], []
        for lc in range(L):
            page = int(slots[r, lc]["page"])
            cov.append(0 if page == NULL else int(slots[r, lc]["coverage"]))
            level.append(None if page == NULL else int(pages["level"][page]))
        k = key(r)
        out[k] = TreeBlock(k, parent, tuple(token(int(x)) for x in toks[r, :n]), tuple(cov), tuple(level))
    return out


# ---------------------------------------------------------------------------
# following a real manager
# ---------------------------------------------------------------------------


class EventTracker:
    """Follows the events of a real manager and holds them against its tree.

    ``drain()`` takes the manager's latest events and checks the stream
    (``feed``); ``check_tree()`` then checks the state the stream describes
    against the tree. The rules, each exact at every point between two
    manager calls (docs/semantics.md §3 invariant 16 and §4):

    Stream (``feed``):
    - event ids increase by one (nothing was dropped: the cap must be large);
    - a removed (hash, group) pair was stored and not removed since;
    - a stored pair is not stored again before its removal (announcements of
      a block only happen when it is new, re-attached, or gains a life cycle);
    - a stored block's parent is either None (a root's child) or a hash;
    - an updated event names a block stored in some group (the reference
      gates updates per block); for a pair stored in that very group, the
      diff's old level is the level the consumer knows.

    Tree (``check_tree``):
    - every announced (hash, group) pair is an attached block whose page in
      that life cycle covers the whole block (coverage never shrinks while a
      slot keeps its page, and a page that leaves a slot is reported removed);
    - the stored payload still describes the block: its full token list,
      its parent, its multimodal keys; and the consumer's cache level of the
      pair is the page's level now;
    - the event manager's own announcement state is exactly the announced set.

    ``unannounced_covered()`` lists the other direction: attached blocks with
    a whole-block page in a life cycle nobody announced (adopted pages, SSM
    snapshots taken after the block's stored event, ...). §4 does not promise
    they are announced, so that is a measurement, not a check.
    """

    def __init__(self, mgr):
        self.mgr = mgr
        self.event_hash = mgr.config.event_hash
        self.announced: dict = {}  # (hash, group) -> the cache level the consumer knows
        self.payload: dict = {}  # hash -> (parent hash, tokens, mm_keys) of its latest stored event
        self.last_id: int | None = None
        self.events: list = []  # every event seen, oldest first
        self.counts = {"stored": 0, "removed": 0, "updated": 0, "updated_unannounced_group": 0}

    # -- the stream --------------------------------------------------------------------
    def drain(self) -> list:
        events = self.mgr.get_latest_events()
        self.feed(events)
        return events

    def feed(self, events) -> None:
        for e in events:
            assert self.last_id is None or e.event_id == self.last_id + 1, (
                f"event ids jump from {self.last_id} to {e.event_id}: events were dropped or reordered"
            )
            self.last_id = e.event_id
            self.events.append(e)
            group, data = e.layer_group_id, e.data
            if isinstance(data, KVCacheCreatedData):
                assert group is None
            elif isinstance(data, KVCacheStoredData):
                assert group is not None
                parent = data.parent_hash
                for b in data.blocks:
                    pair = (b.block_hash, group)
                    assert pair not in self.announced, f"event {e.event_id}: {pair} stored twice without a removal"
                    self.announced[pair] = b.cache_level
                    self.payload[b.block_hash] = (parent, b.tokens, b.mm_keys)
                    parent = b.block_hash  # a coalesced event chains its blocks
                    self.counts["stored"] += 1
            elif isinstance(data, KVCacheRemovedData):
                assert data.block_hashes, f"event {e.event_id}: an empty removed event"
                for h in data.block_hashes:
                    assert (h, group) in self.announced, (
                        f"event {e.event_id}: removed {h!r} from layer group {group}, "
                        "which is not stored there (never stored, or already removed)"
                    )
                    del self.announced[(h, group)]
                    self.counts["removed"] += 1
            elif isinstance(data, KVCacheUpdatedData):
                h = data.block_hash
                assert any(g_h == h for g_h, _ in self.announced), (
                    f"event {e.event_id}: updated {h!r}, which is stored in no layer group"
                )
                assert data.priority is None and data.cache_level is not None
                self.counts["updated"] += 1
                if (h, group) in self.announced:
                    assert self.announced[(h, group)] == data.cache_level.old_value, (
                        f"event {e.event_id}: {h!r} moves from level {data.cache_level.old_value} in group "
                        f"{group}, but the consumer has it at level {self.announced[(h, group)]}"
                    )
                    self.announced[(h, group)] = data.cache_level.new_value
                else:
                    self.counts["updated_unannounced_group"] += 1
            else:  # pragma: no cover
                raise TypeError(f"unknown event data {data!r}")

    # -- against the tree --------------------------------------------------------------------
    def _hash(self, key: bytes):
        return event_block_hash(key, self.event_hash)

    def check_tree(self, blocks: dict | None = None) -> None:
        blocks = tree_blocks(self.mgr) if blocks is None else blocks
        by_hash = {self._hash(k): b for k, b in blocks.items()}
        for (h, lc), level in self.announced.items():
            b = by_hash.get(h)
            assert b is not None, f"({h!r}, group {lc}) is announced but no attached block has that hash"
            assert b.covers(lc), (
                f"({h!r}, group {lc}) is announced but the block's page covers {b.coverage[lc]} "
                f"of its {len(b.tokens)} tokens\n{introspect.dump(self.mgr)}"
            )
            assert b.level[lc] == level, (
                f"({h!r}, group {lc}): the consumer has level {level}, the page is at level {b.level[lc]}"
            )
            parent, tokens, mm_keys = self.payload[h]
            want_parent = None if b.parent_key is None else self._hash(b.parent_key)
            assert parent == want_parent, f"{h!r}: stored with parent {parent!r}, the tree says {want_parent!r}"
            assert tokens == b.tokens, f"{h!r}: the stored tokens are not the block's full token list"
            want_mm = tuple(dict.fromkeys(t.token_id for t in b.tokens if isinstance(t.token_id, str)))
            assert mm_keys == want_mm, f"{h!r}: mm_keys {mm_keys}, the block's digests {want_mm}"
        if introspect.event_manager(self.mgr) is not None:
            state = introspect.announced(self.mgr)
            assert state == set(self.announced), (
                f"the event manager's state and the stream differ: only in the manager "
                f"{state - set(self.announced)}, only in the stream {set(self.announced) - state}"
            )

    def unannounced_covered(self, blocks: dict | None = None) -> list:
        """``(hash, life cycle)`` of whole-block pages that are not announced."""
        blocks = tree_blocks(self.mgr) if blocks is None else blocks
        L = len(self.mgr.config.life_cycles)
        return [
            (self._hash(k), lc)
            for k, b in blocks.items()
            for lc in range(L)
            if b.covers(lc) and (self._hash(k), lc) not in self.announced
        ]

    def step(self) -> None:
        """Drain and check both the stream and the tree."""
        self.drain()
        self.check_tree()

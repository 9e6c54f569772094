"""Consistency checks on a stream of KV cache events (semantics.md §3 invariant 16).

A consumer (a router) rebuilds each layer group's set of cached blocks from the
events alone, so the stream must never remove what it did not store:

- every removed (hash, layer group) pair was stored for that group before;
- no pair is removed twice without a stored event in between.

The checks assume the stream is complete: events dropped by the queue cap
(``max_kv_event_entries``) would make a later removal look unannounced.
"""

from __future__ import annotations

from gpukv.events import KVCacheRemovedData, KVCacheStoredData


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

"""KV cache events (docs/semantics.md §4; scenarios E1-E7 of §6.4).

The event manager is driven here with change-log records written by ``Log``
below, exactly as the tree kernel lays them out (``gpukv.core.layout.LOG``): a
stored header followed by one page-info record per life cycle with a page,
removals, updates. Blocks carry real SHA-256 chain keys, so hashes are the
ones a real tree would report. Every test asserts the exact event sequence,
and every stream passes the invariant-16 checker (``event_checks``).

As in the reference's tests, two life cycles: lc0 is SWA with window T and
lc1 is full attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from gpukv.events import KVCacheEventManager
from gpukv.event_types import (
    Diff,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    UniqueToken,
)
from gpukv.core.hashing import block_key, root_key
from gpukv.kernels.sha256 import digest_to_int64x4
from gpukv.core.layout import (
    EV_CREATED,
    EV_PAGE_INFO,
    EV_REMOVED,
    EV_REMOVED_LIFE_CYCLE,
    EV_ROOT_REMOVED,
    EV_STORED_BLOCK,
    EV_STORED_LIFE_CYCLE,
    EV_UPDATED,
    LOG,
    LOG_BLOCK,
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
    NULL,
)

from tests.support.event_checks import check_event_consistency

T = 2
WINDOWS = [T, 0]  # lc0: SWA with window T; lc1: full attention (no window)
PRIORITY = 35
ROOT = root_key(None)


# ---------------------------------------------------------------------------
# helpers: test blocks and the change log the kernel would write for them
# ---------------------------------------------------------------------------


@dataclass
class Block:
    """A tree block as the log describes it: key, parent, tokens, and per life
    cycle the coverage of its page (0 = no page), level and priority."""

    tokens: list
    coverage: list
    parent: Block | None = None
    level: list = field(default_factory=lambda: [0, 0])
    priority: list = field(default_factory=lambda: [PRIORITY, PRIORITY])

    @property
    def key(self) -> bytes:
        return block_key(ROOT if self.parent is None else self.parent.key, self.tokens)


def make_block(tokens, coverage, parent=None) -> Block:
    return Block(list(tokens), list(coverage), parent)


class Log:
    """Change-log rows in the kernel's layout. Multimodal digest tokens are
    written as negative interned ids, resolved by ``digest_of_token``."""

    def __init__(self):
        self.rows: list[np.ndarray] = []
        self.tokens: list[np.ndarray] = []
        self.digests: dict[int, bytes] = {}  # negative id -> digest

    def digest_of_token(self, token: int) -> bytes:
        return self.digests[token]

    def _row(self, kind, block: Block | None = None, fields: dict | None = None) -> np.ndarray:
        r = np.zeros(LOG.width, dtype=np.int64)
        r[LOG_KIND] = kind
        r[LOG_BLOCK] = NULL
        if block is not None:
            r[LOG_DIGEST : LOG_DIGEST + 4] = digest_to_int64x4(block.key)
        for col, value in (fields or {}).items():
            r[col] = value
        self.rows.append(r)
        return r

    def _token_id(self, t) -> int:
        if isinstance(t, bytes):
            for i, d in self.digests.items():
                if d == t:
                    return i
            i = -1 - len(self.digests)
            self.digests[i] = t
            return i
        return t

    def _stored(self, kind, b: Block, life_cycle=0):
        r = self._row(kind, b)
        parent = ROOT if b.parent is None else b.parent.key
        r[LOG_PARENT_DIGEST : LOG_PARENT_DIGEST + 4] = digest_to_int64x4(parent)
        r[LOG_PARENT_IS_ROOT] = b.parent is None
        r[LOG_NUM_TOKENS] = len(b.tokens)
        r[LOG_TOKENS_AT] = len(self.tokens)
        r[LOG_LIFE_CYCLE] = life_cycle
        self.tokens.append(np.array([self._token_id(t) for t in b.tokens], dtype=np.int32))
        for lc, cov in enumerate(b.coverage):
            if cov:
                self._row(EV_PAGE_INFO, b, {
                    LOG_LIFE_CYCLE: lc, LOG_COVERS: cov >= len(b.tokens),
                    LOG_LEVEL: b.level[lc], LOG_PRIORITY: b.priority[lc],
                })
        return self

    def stored_block(self, b: Block):
        return self._stored(EV_STORED_BLOCK, b)

    def stored_life_cycle(self, b: Block, lc: int):
        return self._stored(EV_STORED_LIFE_CYCLE, b, lc)

    def removed(self, b: Block):
        self._row(EV_REMOVED, b)
        return self

    def removed_life_cycle(self, b: Block, lc: int):
        self._row(EV_REMOVED_LIFE_CYCLE, b, {LOG_LIFE_CYCLE: lc})
        return self

    def updated(self, b: Block, lc: int, old_level: int, level: int):
        self._row(EV_UPDATED, b, {
            LOG_LIFE_CYCLE: lc, LOG_OLD_LEVEL: old_level, LOG_LEVEL: level,
            LOG_PRIORITY: b.priority[lc],
        })
        return self

    def created(self, b: Block):
        self._row(EV_CREATED, b)
        return self

    def root_removed(self):
        self._row(EV_ROOT_REMOVED)
        return self

    def feed(self, em: KVCacheEventManager):
        """Hand the rows written so far to ``em`` (one drained batch)."""
        records = np.array(self.rows, dtype=np.int64).reshape(-1, LOG.width)
        log_tokens = np.zeros((max(1, len(self.tokens)), T), dtype=np.int32)
        for i, t in enumerate(self.tokens):
            log_tokens[i, : len(t)] = t
        em.on_records(records, log_tokens)
        self.rows, self.tokens = [], []


def manager(max_entries=1000, event_hash="sha256", log: Log | None = None) -> KVCacheEventManager:
    digest_of_token = (log or Log()).digest_of_token
    return KVCacheEventManager(max_entries, event_hash, WINDOWS, digest_of_token)


def iteration(em: KVCacheEventManager, log: Log) -> list[KVCacheEvent]:
    """Feed one batch, end the iteration and drain the queue."""
    log.feed(em)
    em.flush_iteration_events()
    return em.get_latest_events()


# expected events -----------------------------------------------------------------


def hx(b: Block):
    return b.key.hex()


def block_data(b: Block, lc: int, h=hx) -> KVCacheStoredBlockData:
    tokens = tuple(UniqueToken(t.hex() if isinstance(t, bytes) else t) for t in b.tokens)
    return KVCacheStoredBlockData(h(b), tokens, b.level[lc], b.priority[lc])


def stored(event_id, lc, *blocks, h=hx, algo="v2_sha256") -> KVCacheEvent:
    parent = blocks[0].parent
    data = KVCacheStoredData(None if parent is None else h(parent), tuple(block_data(b, lc, h) for b in blocks))
    return KVCacheEvent(event_id, data, WINDOWS[lc], algo, 0, lc)


def removed(event_id, lc, *blocks, h=hx, algo="v2_sha256") -> KVCacheEvent:
    return KVCacheEvent(event_id, KVCacheRemovedData(tuple(h(b) for b in blocks)), WINDOWS[lc], algo, 0, lc)


def updated(event_id, lc, b, old, new) -> KVCacheEvent:
    return KVCacheEvent(event_id, KVCacheUpdatedData(hx(b), Diff(old, new), None), WINDOWS[lc], "v2_sha256", 0, lc)


def check(events, expected, announced=None):
    """Assert the exact event sequence and invariant 16; returns the stored
    (hash, group) pairs, to check the next drain as a continuation."""
    assert events == expected
    return check_event_consistency(events, announced)


# ---------------------------------------------------------------------------
# §6.4 scenarios
# ---------------------------------------------------------------------------


def test_e1_partial_life_cycle_coverage_is_omitted():
    em, log = manager(), Log()
    b = make_block([1, 2], [2, 1])
    events = iteration(em, log.stored_block(b))
    assert events[0].data.blocks[0].tokens == (UniqueToken(1), UniqueToken(2))
    announced = check(events, [stored(0, 0, b)])
    # lc1's page covers 1 of the block's 2 tokens: it is never announced.
    check(iteration(em, log.stored_life_cycle(b, 1)), [], announced)


def test_e2_removed_events_per_life_cycle():
    em, log = manager(), Log()
    b = make_block([1, 2], [2, 2])
    announced = check(
        iteration(em, log.stored_block(b).removed_life_cycle(b, 0)),
        [stored(0, 0, b), stored(1, 1, b), removed(2, 0, b)],
    )
    check(iteration(em, log.removed_life_cycle(b, 1).removed_life_cycle(b, 1)), [removed(3, 1, b)], announced)


def test_e3_whole_block_removal_clears_the_life_cycle_state():
    em, log = manager(), Log()
    b = make_block([1, 2], [2, 2])
    log.stored_block(b).removed_life_cycle(b, 0).removed(b).removed(b)
    check(iteration(em, log), [stored(0, 0, b), stored(1, 1, b), removed(2, 0, b), removed(3, 1, b)])


def test_e6_contiguous_stored_events_coalesce():
    em, log = manager(), Log()
    b0 = make_block([1, 2], [2, 2])
    b1 = make_block([3, 4], [2, 2], parent=b0)
    events = iteration(em, log.stored_block(b0).stored_block(b1))
    check(events, [stored(0, 0, b0, b1), stored(1, 1, b0, b1)])
    assert events[0].data.parent_hash is None


def test_e7_the_registry_is_used_for_removal():
    em, log = manager(), Log()
    b = make_block([1, 2], [2, 0])
    check(iteration(em, log.stored_block(b).removed(b).removed(b)), [stored(0, 0, b), removed(1, 0, b)])


# ---------------------------------------------------------------------------
# announcements: the partial-coverage rule and the two stored paths
# ---------------------------------------------------------------------------


def test_partial_block_covering_its_own_tokens_is_announced():
    em, log = manager(), Log()
    b0 = make_block([1, 2], [2, 2])
    tail = make_block([3], [1, 1], parent=b0)  # 1 token, pages cover 1: the whole block
    check(iteration(em, log.stored_block(b0).stored_block(tail)), [stored(0, 0, b0, tail), stored(1, 1, b0, tail)])


def test_block_without_a_covering_page_is_not_announced():
    em, log = manager(), Log()
    b = make_block([1, 2], [1, 1])
    # Nothing announced, so neither the removal nor the update is reported.
    log.stored_block(b).stored_life_cycle(b, 0).updated(b, 0, 0, 1).removed(b)
    check(iteration(em, log), [])


def test_stored_life_cycle_announces_one_more_life_cycle_once():
    em, log = manager(), Log()
    b = make_block([1, 2], [2, 0])
    announced = check(iteration(em, log.stored_block(b)), [stored(0, 0, b)])
    b.coverage = [2, 2]  # lc1's own page was installed (a rebase)
    announced = check(
        iteration(em, log.stored_life_cycle(b, 1).stored_life_cycle(b, 1).stored_life_cycle(b, 0)),
        [stored(1, 1, b)],
        announced,
    )
    # The block's removal now reports both groups.
    check(iteration(em, log.removed(b)), [removed(2, 0, b), removed(3, 1, b)], announced)


def test_stored_life_cycle_of_an_unannounced_block_takes_the_whole_block_path():
    em, log = manager(), Log()
    b = make_block([1, 2], [2, 2])
    check(iteration(em, log.stored_life_cycle(b, 1)), [stored(0, 0, b), stored(1, 1, b)])


def test_last_life_cycle_removal_forgets_the_block():
    em, log = manager(), Log()
    b = make_block([1, 2], [2, 0])
    log.stored_block(b).removed_life_cycle(b, 0).updated(b, 0, 0, 1).removed(b)
    announced = check(iteration(em, log), [stored(0, 0, b), removed(1, 0, b)])
    # A later store announces it from scratch, through either path.
    check(iteration(em, log.stored_life_cycle(b, 0)), [stored(2, 0, b)], announced)


def test_storing_an_announced_block_again_announces_it_afresh():
    em, log = manager(), Log()
    b = make_block([1, 2], [2, 2])
    log.stored_block(b).removed_life_cycle(b, 1)
    announced = check(iteration(em, log), [stored(0, 0, b), stored(1, 1, b), removed(2, 1, b)])
    # A re-attached block takes the whole-block path: every covering life
    # cycle is announced again, and its removal reports them all.
    log.stored_block(b).removed(b)
    check(iteration(em, log), [stored(3, 0, b), stored(4, 1, b), removed(5, 0, b), removed(6, 1, b)], announced)


def test_stored_payload_has_each_life_cycles_level_and_priority():
    em, log = manager(), Log()
    b = make_block([1, 2], [2, 2])
    b.level, b.priority = [1, 0], [20, 80]
    events = iteration(em, log.stored_block(b))
    check(events, [stored(0, 0, b), stored(1, 1, b)])
    assert [(e.data.blocks[0].cache_level, e.data.blocks[0].priority) for e in events] == [(1, 20), (0, 80)]


def test_multimodal_tokens_are_hex_digests_and_mm_keys():
    da, db = bytes(range(32)), bytes(range(100, 132))
    log = Log()
    em = manager(log=log)
    b0 = make_block([da, da], [2, 0])  # the same image twice
    b1 = make_block([7, db], [2, 0], parent=b0)
    b2 = make_block([5], [1, 0], parent=b1)
    events = iteration(em, log.stored_block(b0).stored_block(b1).stored_block(b2))
    assert [e.event_id for e in events] == [0]
    d0, d1, d2 = events[0].data.blocks
    assert [d.block_hash for d in (d0, d1, d2)] == [hx(b0), hx(b1), hx(b2)]
    assert d0.tokens == (UniqueToken(da.hex()), UniqueToken(da.hex()))
    assert d1.tokens == (UniqueToken(7), UniqueToken(db.hex()))
    assert [d.mm_keys for d in (d0, d1, d2)] == [(da.hex(),), (db.hex(),), ()]
    assert d0.cache_salt is None


def test_updated_events_report_the_level_diff():
    em, log = manager(), Log()
    b = make_block([1, 2], [2, 2])
    announced = check(iteration(em, log.stored_block(b)), [stored(0, 0, b), stored(1, 1, b)])
    log.updated(b, 0, 0, 1).updated(b, 1, 0, 1)
    check(iteration(em, log), [updated(2, 0, b, 0, 1), updated(3, 1, b, 0, 1)], announced)


def test_tree_bookkeeping_records_emit_nothing():
    em, log = manager(), Log()
    b = make_block([1, 2], [2, 0])
    log.created(b).stored_block(b).root_removed()
    check(iteration(em, log), [stored(0, 0, b)])


def test_page_info_without_a_header_is_rejected():
    em, log = manager(), Log()
    log.stored_block(make_block([1, 2], [2, 0]))
    log.rows = log.rows[1:]  # keep the page info, drop its header
    with pytest.raises(ValueError, match="page info"):
        log.feed(em)


# ---------------------------------------------------------------------------
# batching and ordering
# ---------------------------------------------------------------------------


def two_announced_blocks(em, log):
    """x and y, announced in both groups in an earlier iteration."""
    x, y = make_block([1, 2], [2, 2]), make_block([5, 6], [2, 2])
    announced = check(
        iteration(em, log.stored_block(x).stored_block(y)),
        [stored(0, 0, x), stored(1, 1, x), stored(2, 0, y), stored(3, 1, y)],
    )
    return x, y, announced


def test_removals_flush_in_ascending_group_order_before_any_other_event():
    em, log = manager(), Log()
    x, y, announced = two_announced_blocks(em, log)
    log.removed_life_cycle(x, 1).removed_life_cycle(y, 0).updated(y, 1, 0, 1)
    check(iteration(em, log), [removed(4, 0, y), removed(5, 1, x), updated(6, 1, y, 0, 1)], announced)


def test_stored_event_flushes_its_own_group_first():
    em, log = manager(), Log()
    x, y, announced = two_announced_blocks(em, log)
    z = make_block([7, 8], [0, 2])
    log.removed_life_cycle(x, 1).removed_life_cycle(y, 0).stored_block(z)
    # lc1's removal goes first (the stored event's own group), then lc0's.
    check(iteration(em, log), [removed(4, 1, x), removed(5, 0, y), stored(6, 1, z)], announced)


def test_subtree_removal_batches_hashes_per_group():
    em, log = manager(), Log()
    b0 = make_block([1, 2], [2, 2])
    b1 = make_block([3, 4], [0, 2], parent=b0)
    announced = check(iteration(em, log.stored_block(b0).stored_block(b1)), [stored(0, 0, b0), stored(1, 1, b0, b1)])
    check(iteration(em, log.removed(b0).removed(b1)), [removed(2, 0, b0), removed(3, 1, b0, b1)], announced)


def test_coalescing_needs_the_parent_to_be_the_last_block():
    em, log = manager(), Log()
    b0 = make_block([1, 2], [2, 0])
    sibling = make_block([1, 3], [2, 0])
    b1 = make_block([3, 4], [2, 0], parent=b0)
    # Both roots' children have parent None, which is no block's hash; b1's
    # parent b0 is not the last block of the latest event.
    check(iteration(em, log.stored_block(b0).stored_block(sibling).stored_block(b1)),
          [stored(0, 0, b0), stored(1, 0, sibling), stored(2, 0, b1)])


def test_pending_removal_in_another_group_stops_coalescing():
    em, log = manager(), Log()
    x, _, announced = two_announced_blocks(em, log)
    b0 = make_block([1, 3], [2, 0])
    b1 = make_block([3, 4], [2, 0], parent=b0)
    log.stored_block(b0).removed_life_cycle(x, 1).stored_block(b1)
    check(iteration(em, log), [stored(4, 0, b0), removed(5, 1, x), stored(6, 0, b1)], announced)


def test_other_event_of_a_group_breaks_only_its_chain():
    em, log = manager(), Log()
    b0 = make_block([1, 2], [2, 2])
    b1 = make_block([3, 4], [2, 2], parent=b0)
    log.stored_block(b0).updated(b0, 0, 0, 1).stored_block(b1)
    check(iteration(em, log), [stored(0, 0, b0), stored(1, 1, b0, b1), updated(2, 0, b0, 0, 1), stored(3, 0, b1)])


def test_removal_in_a_group_breaks_its_chain():
    em, log = manager(), Log()
    x, _, announced = two_announced_blocks(em, log)
    b0 = make_block([1, 3], [2, 0])
    b1 = make_block([3, 4], [2, 0], parent=b0)
    log.stored_block(b0).removed_life_cycle(x, 0).updated(x, 1, 0, 1).stored_block(b1)
    # The update flushed the removal, so nothing is pending at b1, yet lc0's
    # chain ended at the removal.
    check(iteration(em, log),
          [stored(4, 0, b0), removed(5, 0, x), updated(6, 1, x, 0, 1), stored(7, 0, b1)], announced)


def test_a_flush_ends_every_chain():
    em, log = manager(), Log()
    b0 = make_block([1, 2], [2, 0])
    b1 = make_block([3, 4], [2, 0], parent=b0)
    announced = check(iteration(em, log.stored_block(b0)), [stored(0, 0, b0)])
    check(iteration(em, log.stored_block(b1)), [stored(1, 0, b1)], announced)


def test_chains_coalesce_across_log_batches_of_one_iteration():
    em, log = manager(), Log()
    b0 = make_block([1, 2], [2, 0])
    b1 = make_block([3, 4], [2, 0], parent=b0)
    log.stored_block(b0).feed(em)
    check(iteration(em, log.stored_block(b1)), [stored(0, 0, b0, b1)])


# ---------------------------------------------------------------------------
# the queue: created event, ids, cap, disabling
# ---------------------------------------------------------------------------


def test_created_event_and_increasing_ids():
    em, log = manager(), Log()
    em.created([4096, 1024])
    b = make_block([1, 2], [2, 0])
    announced = check(
        iteration(em, log.stored_block(b)),
        [KVCacheEvent(0, KVCacheCreatedData((4096, 1024)), 0, "v2_sha256", 0, None), stored(1, 0, b)],
    )
    assert em.get_latest_events() == []
    check(iteration(em, log.removed(b)), [removed(2, 0, b)], announced)  # ids go on across drains


def test_queue_keeps_the_newest_max_entries():
    em, log = manager(max_entries=3), Log()
    blocks = [make_block([1, i], [2, 0]) for i in range(5)]
    for b in blocks[:2]:
        log.stored_block(b)
    log.feed(em)
    em.flush_iteration_events()
    for b in blocks[2:]:
        log.stored_block(b)
    assert iteration(em, log) == [stored(i, 0, blocks[i]) for i in (2, 3, 4)]


def test_cap_applies_to_whole_events_not_blocks():
    em, log = manager(max_entries=1), Log()
    b0 = make_block([1, 2], [2, 0])
    b1 = make_block([3, 4], [2, 0], parent=b0)
    check(iteration(em, log.stored_block(b0).stored_block(b1)), [stored(0, 0, b0, b1)])


@pytest.mark.parametrize("max_entries", [0, -1])
def test_non_positive_max_entries_disables_events(max_entries):
    em, log = manager(max_entries=max_entries), Log()
    em.created([1, 0])
    b = make_block([1, 2], [2, 2])
    assert iteration(em, log.stored_block(b).updated(b, 0, 0, 1).removed(b)) == []


# ---------------------------------------------------------------------------
# hash formats
# ---------------------------------------------------------------------------


def h64(b: Block) -> int:
    """The reference's truncation: the key's first 8 bytes, big-endian."""
    return int.from_bytes(b.key[:8], "big")


def test_sha256_64_hashes():
    em, log = manager(event_hash="sha256_64"), Log()
    b0 = make_block([1, 2], [2, 0])
    b1 = make_block([3, 4], [2, 2], parent=b0)
    events = iteration(em, log.stored_block(b0).stored_block(b1).removed(b1))
    assert events == [
        stored(0, 0, b0, b1, h=h64, algo="v2_sha256_64"),
        stored(1, 1, b1, h=h64, algo="v2_sha256_64"),
        removed(2, 0, b1, h=h64, algo="v2_sha256_64"),
        removed(3, 1, b1, h=h64, algo="v2_sha256_64"),
    ]
    assert events[1].data.parent_hash == int.from_bytes(b0.key[:8], "big")
    assert all(isinstance(e.data.blocks[0].block_hash, int) for e in events[:2])
    check_event_consistency(events)


def test_unknown_event_hash_is_rejected():
    with pytest.raises(ValueError, match="event_hash"):
        manager(event_hash="md5")

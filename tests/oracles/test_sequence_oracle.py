"""Tests of the sequence-layer oracle (tests/support/oracle_kv.py) on its own: its
eviction order, its status and commit-state errors, and seeded random
multi-turn conversations with rewinds (the driver every lockstep run uses,
tests/support/conversations.py, here on the oracle alone). Every test ends
with ``check_sanity``.

The worked scenarios of docs/semantics.md §6 run on the oracle and on every backend
from one copy (``tests/caches/test_worked_scenarios.py``).
"""

from __future__ import annotations

import random

import pytest

from tests.support import lockstep
from tests.support.conversations import Conversations, Turn
from tests.support.oracle import FULL, LifeCycle
from tests.support.oracle_kv import KVOracle, LogicError, Status, run_turn, verify_reuse, write_tokens

F = LifeCycle(FULL)


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def fresh(o: KVOracle, scope=None):
    kv = o.create_kv_cache(scope=scope)
    assert kv.resume()
    return kv


def execute_and_commit(kv, tokens, is_end=False) -> None:
    """The engine runs ``tokens`` after what is committed, then they are committed."""
    start = kv.num_committed_tokens
    write_tokens(kv, start, tokens)
    kv.commit(tokens, is_end=is_end)


# ---------------------------------------------------------------------------
# manager-level behaviour
# ---------------------------------------------------------------------------


def test_resize_out_of_pages_changes_nothing_and_eviction_is_lru():
    o = KVOracle(4, [F], 6)
    run_turn(o, list(range(8)))  # B0, B1; close releases the last block first: B1 is scheduled first
    run_turn(o, list(range(100, 108)))  # 2 more droppable pages, scheduled later
    assert o.free_pages(0) == 2 and o.evictable_pages(0) == 4
    kv = fresh(o)
    assert kv.resize(4)
    indices = kv.page_indices(0)
    assert not kv.resize(4 * 8)  # needs 7 more pages: 1 free + 4 evictable is not enough
    assert kv.capacity == 4 and kv.page_indices(0) == indices
    assert o.evictable_pages(0) == 4 and o.probe_reuse(list(range(8))) == 8
    assert kv.resize(4 * 3)  # 2 more: the free one, then evict B1 (least recently scheduled)
    assert o.probe_reuse(list(range(8))) == 4
    assert kv.resize(4 * 4)  # 1 more: evict B0; full-attention death removes its subtree
    assert o.probe_reuse(list(range(8))) == 0
    assert o.probe_reuse(list(range(100, 108))) == 8
    o.check_sanity()
    kv.close()
    o.check_sanity()


def test_status_and_commit_state_errors():
    o = KVOracle(4, [F], 16)
    kv = o.create_kv_cache()
    assert kv.status is Status.SUSPENDED
    with pytest.raises(LogicError):
        kv.commit([1])
    with pytest.raises(LogicError):
        kv.resize(4)
    assert kv.resume() and kv.status is Status.ACTIVE
    assert kv.resize(8, 2)
    with pytest.raises(ValueError, match="decreased"):
        kv.resize(8, 1)
    with pytest.raises(ValueError, match="greater than capacity"):
        kv.resize(1)
    with pytest.raises(LogicError):
        kv.plan_committed_block_drop()
    execute_and_commit(kv, [1, 2, 3])
    kv.stop_committing()
    with pytest.raises(LogicError, match="Cannot commit tokens after stop_committing"):
        kv.commit([4])
    kv.close()
    assert kv.status is Status.CLOSED
    kv.close()
    o.check_sanity()


# ---------------------------------------------------------------------------
# seeded random multi-turn conversations with rewinds
# ---------------------------------------------------------------------------

# (name, T, life cycles, commit_min_snapshot, enable_partial_reuse, backoff): the
# configurations every lockstep run plays (tests/support/lockstep.py), oracle side.
RANDOM_CONFIGS = [(name, T, lcs, cms, partial, backoff) for name, T, _, lcs, cms, partial, backoff in lockstep.CONFIGS]
SCOPES = lockstep.ORACLE_SCOPES  # the lockstep's scopes, as the oracle takes them


class OracleAlone(Conversations):
    """The random conversations of ``tests/support/conversations.py`` on the
    oracle alone, with 12, 24 or 64 pages per life cycle (drawn from the seed),
    so that it evicts and refuses too. After every step its sanity checker
    passes and every open cache's reused KV is its own (``verify_reuse``)."""

    def __init__(self, seed: int, config):
        name, T, lcs, cms, partial, backoff = config
        rng = random.Random(seed)
        pages = rng.choice([12, 24, 64])
        oracle = KVOracle(T, lcs, pages, enable_partial_reuse=partial, commit_min_snapshot=cms, reuse_match_backoff=backoff)
        super().__init__(rng, oracle, T, cms, num_scopes=len(SCOPES))

    def create(self, lookup, scope: int) -> Turn:
        n = self.o.probe_reuse(lookup, SCOPES[scope])
        kv = self.o.create_kv_cache(input_tokens=lookup, scope=SCOPES[scope])
        assert kv.num_committed_tokens == n  # probe and create agree (§2.4)
        return Turn(kv, None, scope, lookup[:n])

    def resume(self, t: Turn) -> bool:
        return t.o.resume()

    def suspend(self, t: Turn):
        t.o.suspend()

    def resize(self, t: Turn, capacity, history=None) -> bool:
        return t.o.resize(capacity, history)

    def run(self, t: Turn, tokens_all, start: int, end: int):
        write_tokens(t.o, start, tokens_all[start:end])

    def commit(self, t: Turn, tokens, is_end=False):
        t.o.commit(tokens, is_end=is_end)

    def stop(self, t: Turn):
        t.o.stop_committing()

    def refuse_commit_after_stop(self, t: Turn):
        with pytest.raises(LogicError, match=r"Cannot commit tokens after stop_committing"):
            t.o.commit(self.tokens(1))

    def plan(self, t: Turn):
        return t.o.plan_committed_block_drop()

    def drop(self, plan):
        plan.drop()

    def refuse_second_drop(self, plan):
        with pytest.raises(RuntimeError, match="already been dropped"):
            plan.drop()

    def close(self, t: Turn):
        t.o.close()

    def clear(self):
        self.o.clear_reusable_blocks()

    def refuse_clear(self, num_open: int):
        with pytest.raises(LogicError, match=rf"{num_open} KV cache\(s\) still open"):
            self.o.clear_reusable_blocks()

    def check(self):
        self.o.check_sanity()
        for kv in self.o.open_caches:
            verify_reuse(kv)

    def run_steps(self, steps: int):
        stats = super().run_steps(steps)
        stats.update(self.o.counters)
        return stats


@pytest.mark.parametrize("config", RANDOM_CONFIGS, ids=[c[0] for c in RANDOM_CONFIGS])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_multi_turn_conversations(config, seed):
    stats = OracleAlone(seed, config).run_steps(800)
    assert stats["turns"] > 20 and stats["reused_tokens"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("config", RANDOM_CONFIGS, ids=[c[0] for c in RANDOM_CONFIGS])
@pytest.mark.parametrize("seed", range(2, 22))
def test_random_multi_turn_conversations_long(config, seed):
    OracleAlone(seed, config).run_steps(1500)

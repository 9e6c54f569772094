"""Tests of the sequence-layer oracle (tests/support/oracle_kv.py) on its own: its
eviction order, its status and commit-state errors, and seeded random
multi-turn conversations with rewinds. Every test ends with ``check_sanity``.

The worked scenarios of docs/semantics.md §6 run on the oracle and on every backend
from one copy (``tests/caches/test_worked_scenarios.py``).
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tests.support import lockstep
from tests.support.oracle import FULL, SSM, LifeCycle
from tests.support.oracle_kv import CommitState, KVOracle, LogicError, Status, run_turn, verify_reuse, write_tokens

F = LifeCycle(FULL)


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def reuse(o: KVOracle, tokens, scope=None, check: bool = True) -> int:
    """``probe_reuse`` and ``create_kv_cache`` agree; with ``check`` the cache is
    resumed and its reused KV verified; then closed."""
    n = o.probe_reuse(tokens, scope)
    kv = o.create_kv_cache(input_tokens=tokens, scope=scope)
    assert kv.num_committed_tokens == n
    if check:
        verify_reuse(kv)
        assert kv.resume()
        verify_reuse(kv)
    kv.close()
    o.check_sanity()
    return n


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
VOCAB = lockstep.VOCAB
SCOPES = lockstep.ORACLE_SCOPES


class Conversations:
    """A random multi-turn workload: each turn re-enters an earlier conversation at
    a random endpoint (often mid-block: a rewind) or starts a new one, runs a chunked
    prefill and a few generation steps with speculative tokens that get partly
    rejected (capacity rewinds), and ends with a stop, an end commit, a planned drop,
    or by being left open for a while. Several turns run interleaved."""

    def __init__(self, seed: int, config):
        name, T, lcs, cms, partial, backoff = config
        self.rng = random.Random(seed)
        self.T = T
        self.has_ssm = any(lc.kind == SSM for lc in lcs)
        self.cms = cms
        pages = self.rng.choice([12, 24, 64])
        self.o = KVOracle(T, lcs, pages, enable_partial_reuse=partial, commit_min_snapshot=cms, reuse_match_backoff=backoff)
        self.history: list[tuple] = []  # (scope, committed tokens) of finished turns
        self.plans: list = []
        self.jobs: list = []
        self.stats = Counter()

    def tokens(self, n: int) -> list:
        return [self.rng.randrange(VOCAB) for _ in range(n)]

    def new_prompt(self):
        rng, T = self.rng, self.T
        if self.history and rng.random() < 0.8:
            scope, conv = rng.choice(self.history)
            if rng.random() < 0.3:
                cut = len(conv)  # continue the conversation
            else:
                cut = rng.randint(0, len(conv))  # re-enter at an earlier endpoint, often mid-block
            cut = min(cut, 8 * T)
            prompt = conv[:cut]
            self.stats["continue" if cut == len(conv) else "rewind"] += 1
        else:
            scope, prompt = rng.choice(SCOPES), []
        return scope, prompt + self.tokens(rng.randint(1, 3 * T))

    def give_up(self, kv):
        self.stats["oom"] += 1
        if kv.status is Status.SUSPENDED and not kv.never_resumed and self.rng.random() < 0.5:
            assert kv.resume()
        kv.close()

    def turn(self):
        rng, o, T = self.rng, self.o, self.T
        scope, prompt = self.new_prompt()
        lookup = prompt[:-1] if rng.random() < 0.5 else prompt
        n = o.probe_reuse(lookup, scope)
        kv = o.create_kv_cache(input_tokens=lookup, scope=scope)
        assert kv.num_committed_tokens == n  # probe and create agree (§2.4)
        m = kv.reuse_match
        assert n <= m.num_tokens_before_hybrid_pruning <= m.num_tokens_before_pruning <= m.num_lookup_tokens == len(lookup)
        self.stats["reused_tokens"] += n
        self.stats["partial_reuse"] += n % T != 0
        yield
        while not kv.resume():  # out of pages for the private copies
            if rng.random() < 0.5:
                kv.close()
                self.stats["oom"] += 1
                return
            yield
        pos = n
        # chunked prefill
        while pos < len(prompt):
            end = rng.randint(pos + 1, len(prompt))
            hist = rng.choice([pos, end]) if self.cms else rng.randint(pos, end)
            if not kv.resize(end, hist):
                self.give_up(kv)
                return
            yield
            write_tokens(kv, pos, prompt[pos:end])
            if rng.random() < 0.2:
                kv.suspend()
                yield
                assert kv.resume()  # a later resume never allocates
            kv.commit(prompt[pos:end])
            pos = end
            yield
        # generation with speculative tokens (none with SSM: its state cannot rewind)
        for step in range(rng.randint(0, 2 * T)):
            spec = 0 if self.has_ssm else rng.randint(0, 2)
            if not kv.resize(pos + 1 + spec, pos):
                self.give_up(kv)
                return
            new = self.tokens(1 + spec)
            write_tokens(kv, pos, new)
            accepted = new[: 1 + rng.randint(0, spec)]
            is_end = rng.random() < 0.1
            kv.commit(accepted, is_end=is_end)
            pos += len(accepted)
            if kv.capacity > pos and rng.random() < 0.8:
                assert kv.resize(pos)  # rewind the rejected draft tokens
            yield
            if is_end:
                assert kv.commit_state is CommitState.USER_STOP
                break
        self.history.append((scope, kv.committed_tokens))
        if rng.random() < 0.4:
            kv.stop_committing()
            plan = kv.plan_committed_block_drop()
            self.stats["plans"] += plan is not None
            if plan is not None:
                self.plans.append(plan)
            with pytest.raises(LogicError):
                kv.commit(self.tokens(1))
        for _ in range(rng.randint(0, 3)):  # stay open a while (like A0 in D8)
            if kv.status is Status.ACTIVE and rng.random() < 0.3:
                kv.suspend()
            yield
        kv.close()
        self.stats["turns"] += 1

    def check(self):
        self.o.check_sanity()
        for kv in self.o.open_caches:
            verify_reuse(kv)

    def step(self):
        rng, o = self.rng, self.o
        r = rng.random()
        if r < 0.05 and self.plans:
            plan = self.plans.pop(rng.randrange(len(self.plans)))
            plan.drop()
            self.stats["drops"] += 1
            if rng.random() < 0.2:
                with pytest.raises(RuntimeError, match="already been dropped"):
                    plan.drop()
        elif r < 0.07:
            if o.open_caches:
                with pytest.raises(LogicError, match=f"{len(o.open_caches)} KV cache\\(s\\) still open"):
                    o.clear_reusable_blocks()
            else:
                o.clear_reusable_blocks()
                assert o.tree.next == {}
                assert all(o.free_pages(lc) == o.num_pages[lc] for lc in range(o.num_life_cycles))
                self.stats["clears"] += 1
        elif r < 0.12 and self.history:
            scope, conv = rng.choice(self.history)
            assert reuse(o, conv[: rng.randint(1, len(conv))], scope, check=False) >= 0
        else:
            if len(self.jobs) < 3 and (not self.jobs or rng.random() < 0.3):
                self.jobs.append(self.turn())
            job = rng.choice(self.jobs)
            try:
                next(job)
            except StopIteration:
                self.jobs.remove(job)
        self.check()

    def run(self, steps: int):
        for _ in range(steps):
            self.step()
        while self.jobs:  # finish every turn
            for job in list(self.jobs):
                try:
                    next(job)
                except StopIteration:
                    self.jobs.remove(job)
                self.check()
        assert not self.o.open_caches
        self.stats.update(self.o.counters)
        return self.stats


@pytest.mark.parametrize("config", RANDOM_CONFIGS, ids=[c[0] for c in RANDOM_CONFIGS])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_multi_turn_conversations(config, seed):
    stats = Conversations(seed, config).run(800)
    assert stats["turns"] > 20 and stats["reused_tokens"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("config", RANDOM_CONFIGS, ids=[c[0] for c in RANDOM_CONFIGS])
@pytest.mark.parametrize("seed", range(2, 22))
def test_random_multi_turn_conversations_long(config, seed):
    Conversations(seed, config).run(1500)

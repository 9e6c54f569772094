"""The change log's budget (``table_sizes.CHANGE_LOG_BUDGET``): a call whose worst
case needs more change-log room than the budget runs as consecutive launches
that each fit, and gives exactly what one launch over an unbounded log gives;
removals take no log room at all (retired rows, ``layout.RETIRED_*``), so a
page death that takes a whole subtree fits any budget.

With the budget at its least (``tiny_log``: a thousand log rows, 64 token
rows) nearly every batched call of these workloads is split and many single
calls need a launch beyond the budget; the lockstep tests against the oracle
and against per-cache twins run again under it."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import HealthCheck, given, settings

import gpukv
from gpukv import introspect, table_sizes
from gpukv.core.layout import CNT_BLOCK_FREE_TOP, CNT_RETIRED, EV_CREATED, EV_REMOVED, EV_ROOT_REMOVED, LOG_KIND

from tests.support.backends import make_manager
from tests.support.batch_lockstep import BatchLockstep
from tests.support.engine import Engine
from tests.support.event_lockstep import SUBSET_CONFIGS, events_under_memory_pressure, events_with_a_host_tier
from tests.support.interrupts import Interrupter
from tests.support.lockstep import CONFIG_IDS, CONFIGS, PRESSURE_POOL, run_workload
from tests.support.subtree_victim import SHARED_VICTIM, requests_sharing_a_victim
from tests.support.tree_lockstep import Pair, run_ops, scenario

T = 4


@pytest.fixture
def tiny_log(monkeypatch):
    """The change log and the copy list at their least."""
    monkeypatch.setattr(table_sizes, "CHANGE_LOG_BUDGET", 0)
    monkeypatch.setattr(table_sizes, "COPY_LIST_BUDGET", 0)
    monkeypatch.setattr(table_sizes, "COPY_BUDGET_MIN_ROWS", 32)  # below the small pools' bound too
    return table_sizes.log_budget


def test_the_budget_is_the_same_whatever_max_blocks_is():
    small = gpukv.index_memory(gpukv.CacheConfig(tokens_per_block=32, max_blocks=2**10, max_kv_event_entries=64))
    large = gpukv.index_memory(gpukv.CacheConfig(tokens_per_block=32, max_blocks=2**17, pages_per_life_cycle=2**17,
                                                 max_kv_event_entries=64))
    for field in ("log", "log_tokens"):
        assert small.tables[field] == large.tables[field]
    assert large.tables["log"] + large.tables["log_tokens"] <= table_sizes.CHANGE_LOG_BUDGET
    assert large.tables["log"] == table_sizes.log_budget(32)[0] * table_sizes.LOG.width * 8


def test_an_unread_log_is_not_preallocated():
    """Without events the kernels write no record: a preallocated index
    keeps the log at its least, and it grows only once a sink reads it."""
    config = gpukv.CacheConfig(tokens_per_block=32, max_blocks=2**12, pages_per_life_cycle=2**12)
    memory = gpukv.index_memory(config).tables
    assert memory["log"] == table_sizes.LOG_MIN_ROWS * table_sizes.LOG.width * 8
    mgr = gpukv.KVCacheManager(config)
    assert mgr._tables.log.nbytes == memory["log"] and mgr._tables.log_tokens.nbytes == memory["log_tokens"]
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(3004 * 32)
    kv.commit(list(range(1, 3000 * 32 + 1)))  # far more records than the least log holds, none written
    assert mgr._tables.log.shape[0] == table_sizes.LOG_MIN_ROWS
    log = introspect.record_log(mgr)
    kv.commit(list(range(1, 1 + 4 * 32)))
    assert sum(int(r[LOG_KIND]) == EV_CREATED for r in log) == 4
    assert mgr._tables.log.shape[0] == table_sizes.log_budget(32)[0]  # read now: at its budget, as max_blocks sizes
    kv.close()
    introspect.check_sanity(mgr)


def test_tiny_budget_sizes(tiny_log):
    assert tiny_log(T) == (table_sizes.LOG_BUDGET_MIN_ROWS, table_sizes.LOG_TOKENS_MIN_ROWS)
    mgr = make_manager("cpu", tokens_per_block=T, max_blocks=64, pages_per_life_cycle=320, max_kv_event_entries=64)
    assert mgr._tables.log.shape[0] == table_sizes.LOG_BUDGET_MIN_ROWS
    assert mgr._tables.copies.shape[0] == table_sizes.COPY_BUDGET_MIN_ROWS < 3 * 320
    memory = gpukv.index_memory(mgr.config).tables
    assert memory["log"] == mgr._tables.log.nbytes and memory["copies"] == mgr._tables.copies.nbytes


class Counted(BatchLockstep):
    """The batched lockstep, counting the launches of the batched manager and
    comparing its KV cache events with the per-cache twin's after every step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        events = dataclasses.replace(self.mgr.config, max_kv_event_entries=1 << 20)
        self.mgr = gpukv.KVCacheManager(events)
        self.engine = Engine(self.mgr)
        self.twin = gpukv.KVCacheManager(dataclasses.replace(events, backend="cpu"))
        self.calls = 0

    def _events(self, mgr):
        return [(type(e.data).__name__, repr(e.data)) for e in mgr.get_latest_events()]

    def compare_all(self):
        super().compare_all()
        assert self._events(self.mgr) == self._events(self.twin), "events differ from the per-cache twin's"


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[4], CONFIGS[8]], ids=[CONFIG_IDS[i] for i in (0, 4, 8)])
def test_split_batches_equal_the_per_cache_calls(tiny_log, config):
    """Batched calls over a log a thousand rows long: the same pages, scalars,
    evictions and events as the per-cache twin, and the oracle's tree."""
    lock = Counted(random.Random(3), config, PRESSURE_POOL)
    before = lock.mgr._launcher.launches
    stats = lock.run_steps(30)
    assert stats.get("commits", 0) > 20, stats
    assert lock.mgr._tables.log.shape[0] <= 4 * tiny_log(lock.mgr.config.tokens_per_block)[0]
    assert lock.mgr._launcher.launches > before


def test_a_batch_beyond_the_budget_is_split(tiny_log, backend):
    """Forty caches resized by twenty blocks each: more than a thousand log
    rows, so several launches; each cache gets what a resize alone gives."""
    mgr = make_manager(backend, tokens_per_block=T, pages_per_life_cycle=2000)
    introspect.record_log(mgr)  # records are written only while read: the log's budget counts then
    twin = make_manager("cpu", tokens_per_block=T, pages_per_life_cycle=2000)
    kvs, twins = mgr.create_kv_caches([[]] * 40), twin.create_kv_caches([[]] * 40)
    assert mgr.resume_batch(kvs).all() and all(kv.resume() for kv in twins)
    launches = mgr._launcher.launches
    assert mgr.resize_batch(kvs, [20 * T] * 40).all()
    assert mgr._launcher.launches - launches > 1
    assert all(kv.resize(20 * T) for kv in twins)
    prompts = [[1000 * i + j for j in range(20 * T)] for i in range(40)]
    mgr.commit_batch(kvs, prompts)
    for kv, p in zip(twins, prompts):
        kv.commit(p)
    for a, b in zip(kvs, twins):
        assert list(a.page_indices(0)) == list(b.page_indices(0))
        assert a.num_committed_tokens == b.num_committed_tokens == 20 * T
    assert mgr._tables.log.shape[0] <= table_sizes.LOG_BUDGET_MIN_ROWS  # never grew past the budget
    mgr.close_batch(kvs)
    introspect.check_sanity(mgr)


def test_an_unread_log_splits_no_batch(monkeypatch, backend):
    """Nobody reads the records, so the kernels write none and the log's
    budget splits nothing: forty caches resized by twenty blocks each run in
    one launch, where a log at its least, once read, splits the next such
    resize into several."""
    monkeypatch.setattr(table_sizes, "CHANGE_LOG_BUDGET", 0)  # the log at its least; the copy list as it is
    mgr = make_manager(backend, tokens_per_block=T, pages_per_life_cycle=2000)
    kvs = mgr.create_kv_caches([[]] * 40)
    assert mgr.resume_batch(kvs).all()
    launches = mgr._launcher.launches
    assert mgr.resize_batch(kvs, [20 * T] * 40).all()
    assert mgr._launcher.launches - launches == 1
    assert mgr._tables.log.shape[0] == table_sizes.LOG_MIN_ROWS
    introspect.record_log(mgr)
    launches = mgr._launcher.launches
    assert mgr.resize_batch(kvs, [40 * T] * 40).all()
    assert mgr._launcher.launches - launches > 1
    assert all(len(kv.page_indices(0)) == 40 for kv in kvs)
    mgr.close_batch(kvs)
    introspect.check_sanity(mgr)


def test_one_cache_beyond_the_budget_gets_a_launch_of_its_own(tiny_log):
    """A commit over more blocks than the budget covers: one launch with a
    log sized for it, given back by the next launch that needs less."""
    mgr = make_manager("cpu", tokens_per_block=T, pages_per_life_cycle=2000, max_kv_event_entries=10_000)
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(300 * T)
    kv.commit(list(range(1, 300 * T + 1)))
    stored = sum(len(e.data.blocks) for e in mgr.get_latest_events() if type(e.data).__name__ == "KVCacheStoredData")
    assert stored == 300
    kv.close()
    small = mgr.create_kv_cache()
    assert small.resume() and small.resize(T)
    assert mgr._tables.log.shape[0] == table_sizes.LOG_BUDGET_MIN_ROWS
    assert mgr._tables.log_tokens.shape[0] == table_sizes.LOG_TOKENS_MIN_ROWS
    assert mgr.probe_reuse(list(range(1, 300 * T + 1))) == 300 * T
    introspect.check_sanity(mgr)


def test_a_decode_step_over_whole_chains_reserves_for_its_new_blocks_only(monkeypatch, backend):
    """A commit that completes a block re-attaches its committed chain if a
    block of it was detached meanwhile, so its change-log room covers the
    chain, unless no block a cache refers to was detached since the chain was
    last seen whole (``CachePool.attached_at``): then only the new block.
    Eight caches of 40 committed blocks each completing a block fit one
    launch of the least log (64 token rows) that way, where the chains' room
    would split it. A detached block no cache holds (an eviction victim)
    leaves that so; after a detach of a block in a cache's chain the room
    covers the chains again, and the chain is re-attached. Each step equals
    the per-cache calls on a twin."""
    monkeypatch.setattr(table_sizes, "CHANGE_LOG_BUDGET", 0)  # the log at its least; the copy list as it is
    mgr = make_manager(backend, tokens_per_block=T, pages_per_life_cycle=2000)
    introspect.record_log(mgr)  # records are written only while read: the log's budget counts then
    twin = make_manager("cpu", tokens_per_block=T, pages_per_life_cycle=2000)
    n = 8
    kvs, twins = mgr.create_kv_caches([[]] * n), twin.create_kv_caches([[]] * n)
    assert mgr.resume_batch(kvs).all() and all(kv.resume() for kv in twins)
    assert mgr.resize_batch(kvs, [60 * T] * n).all() and all(kv.resize(60 * T) for kv in twins)
    prompts = [[1000 * i + j + 1 for j in range(40 * T - 1)] for i in range(n)]
    mgr.commit_batch(kvs, prompts)  # 39 blocks and 3 tokens each, the chains now known whole
    for kv, p in zip(twins, prompts):
        kv.commit(p)

    def step(tokens_each: int) -> int:
        """Every cache commits ``tokens_each`` tokens, completing a block: launches taken."""
        tokens = [[7 + i] * tokens_each for i in range(n)]
        before = mgr._launcher.launches
        assert mgr.append_batch(kvs, tokens, room=1).all()
        for kv, t in zip(twins, tokens):
            kv.commit(t)
        for a, b in zip(kvs, twins):
            assert list(a.page_indices(0)) == list(b.page_indices(0))
            assert a.num_committed_tokens == b.num_committed_tokens
        return mgr._launcher.launches - before

    assert step(1) == 1
    other = mgr.create_kv_cache()  # a block of its own, closed, then detached: held by no cache
    assert other.resume() and other.resize(T)
    other.commit([99_999] * T)
    other.close()
    block, _ = introspect.add_block(mgr, [99_999] * T)
    detaches = introspect.detach_count(mgr)
    introspect.remove_subtree(mgr, block)
    assert introspect.detach_count(mgr) == detaches + 1
    assert step(T) == 1  # the chains are still whole
    chain = prompts[3] + [7 + 3] * (T + 1)  # kvs[3]'s 41 committed blocks
    assert introspect.reuse_match_pages(mgr, chain, 0)[0] == 41 * T
    introspect.remove_subtree(mgr, introspect.committed_blocks(kvs[3])[20])  # the middle of its chain, and on
    assert introspect.reuse_match_pages(mgr, chain, 0)[0] == 20 * T
    assert step(T) > 1  # the chains' room again: the tiny log splits the step
    assert introspect.reuse_match_pages(mgr, chain + [7 + 3] * T, 0)[0] == 42 * T  # re-attached, and the new block
    assert step(T) == 1  # seen whole by that step
    mgr.close_batch(kvs)
    introspect.check_sanity(mgr)


def test_a_subtree_removal_takes_no_log_room(tiny_log):
    """A thousand requests share a first block that is the first victim
    (priority 0): its death removes every request's blocks in the launch of
    one resize, far more records than the log has rows; all are reported,
    each before the records logged after it, and the log does not grow."""
    n = 1000  # cpu only: the simulator takes a minute (tests/input_validation/test_hostile_input.py runs a small one on it)
    mgr = requests_sharing_a_victim("cpu", n)
    shared = SHARED_VICTIM
    rows = mgr._tables.log.shape[0]
    assert rows < n
    log = introspect.record_log(mgr)
    other = mgr.create_kv_cache()
    assert other.resume() and other.resize(16 * T)  # 15 free pages: one eviction
    kinds = [int(r[LOG_KIND]) for r in log]
    assert kinds.count(EV_REMOVED) == n + 1 and kinds.count(EV_ROOT_REMOVED) == 1
    assert kinds.index(EV_ROOT_REMOVED) == len(kinds) - 1  # the root goes with its last child
    assert mgr.probe_reuse(shared + [10, 5, 6, 7]) == 0
    removed = [h for e in mgr.get_latest_events() if isinstance(e.data, gpukv.KVCacheRemovedData)
               for h in e.data.block_hashes]
    assert len(removed) == n + 1
    assert mgr._tables.log.shape[0] == rows
    other.close()
    introspect.check_sanity(mgr)
    assert mgr._tables.counters_host()[CNT_BLOCK_FREE_TOP] == mgr._tables.num_rows  # every row back on the stack


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_conversations_agree_with_the_oracle_on_a_tiny_log(tiny_log, config):
    stats = run_workload(0, config, 150)
    assert stats.get("turns", 0) >= 5, stats


@pytest.mark.parametrize("config", SUBSET_CONFIGS, ids=[c[0] for c in SUBSET_CONFIGS])
def test_conversation_events_are_consistent_on_a_tiny_log(tiny_log, config):
    events_under_memory_pressure(config)


@pytest.mark.parametrize("config", SUBSET_CONFIGS, ids=[c[0] for c in SUBSET_CONFIGS])
def test_migrations_to_a_host_tier_fit_a_tiny_copy_list(tiny_log, config):
    """Evictions to the host tier and back: the page copies of a launch,
    within a copy list of 32 rows (or a launch's own when one cache needs
    more)."""
    events_with_a_host_tier(config)


def test_the_copy_list_is_budgeted_only_beyond_the_pools_bound():
    small = make_manager("cpu", tokens_per_block=T, pages_per_life_cycle=64)._tables
    assert small.copies.shape[0] == 3 * 64 + table_sizes.COPY_SLACK and small.copy_room is None
    big = gpukv.index_memory(gpukv.CacheConfig(tokens_per_block=32, max_blocks=2**17, pages_per_life_cycle=2**17))
    assert big.tables["copies"] <= table_sizes.COPY_LIST_BUDGET


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                 HealthCheck.function_scoped_fixture])
@given(scenario())
def test_tree_operations_agree_with_the_oracle_on_a_tiny_log(tiny_log, case):
    model, T_, ops = case
    run_ops(Pair("cpu", model, T_), ops)


def _clear_workload(mgr):
    """Turns sharing prefixes, then a clear: a launch that retires every row."""
    for n, base in ((10, 0), (14, 0), (9, 50), (21, 100)):
        kv = mgr.create_kv_cache(input_tokens=list(range(base, base + n)))
        assert kv.resume() and kv.resize(n, n)
        kv.commit(list(range(base + kv.num_committed_tokens, base + n)))
        kv.close()


def _events_manager():
    """A manager publishing events, with a sink of its log records."""
    mgr = make_manager("cpu", tokens_per_block=T, pages_per_life_cycle=64, max_kv_event_entries=1000)
    return mgr, introspect.record_log(mgr)


def _events_of(mgr) -> list:
    return [(e.event_id, e.data, e.layer_group_id) for e in mgr.get_latest_events()]  # settles first


def _cleared_twin() -> tuple[list, list]:
    """The events and log records of ``_clear_workload`` then a clear, uninterrupted."""
    twin, log = _events_manager()
    _clear_workload(twin)
    twin.clear_reusable_blocks()
    return _events_of(twin), [r.tolist() for r in log]


def _assert_drained_as(mgr, log, want, want_log, where=""):
    """The drain is finished: the twin's events and records, sane tables,
    every row back on the free stack, once."""
    assert _events_of(mgr) == want, where
    assert [r.tolist() for r in log] == want_log, where
    introspect.check_sanity(mgr)
    t = mgr._tables
    assert t.counters_host()[CNT_BLOCK_FREE_TOP] == t.num_rows, where
    assert sorted(t.block_free.tolist()) == list(range(t.num_rows)), where


@pytest.mark.parametrize("where", ["settle", "return_rows", "with_removals", "read_retired", "digests_of"])
def test_an_interrupted_drain_of_retired_rows_is_finished_once(where):
    """A KeyboardInterrupt at every line of the aftermath's steps that report
    and free the retired rows: the next call finishes it, and the records,
    the events and the free stack are those of an uninterrupted twin."""
    want, want_log = _cleared_twin()
    assert sum(r[LOG_KIND] == EV_REMOVED for r in want_log) > 5
    fired = 0
    for k in range(1, 60):
        mgr, log = _events_manager()
        _clear_workload(mgr)
        interrupt = Interrupter(only=where)
        interrupt.arm(k)
        interrupt(mgr.clear_reusable_blocks)
        fired += interrupt.fired
        _assert_drained_as(mgr, log, want, want_log, f"line {k} of {where}")
    assert fired >= (2 if where == "digests_of" else 4)  # digests_of is two lines


def test_retired_rows_pending_a_drain_survive_the_tables_growth():
    """A launch's retired rows wait at the end of the free stack, each row
    holding its log position and kind. Tables that grow before the drain
    (here: directly, after the aftermath failed to read the retired rows
    twice, so the next call must finish it) keep both, so the drain still
    reports the removals of an uninterrupted twin, in place, and returns
    every row once."""
    want, want_log = _cleared_twin()
    mgr, log = _events_manager()
    _clear_workload(mgr)
    t = mgr._tables
    read_retired, failures = t.read_retired, [2]

    def failing(n):
        if failures[0]:
            failures[0] -= 1
            raise KeyboardInterrupt("injected before the retired rows are read")
        return read_retired(n)

    t.read_retired = failing  # the call fails, and so does its retry on the way out
    with pytest.raises(KeyboardInterrupt):
        mgr.clear_reusable_blocks()
    assert mgr._launcher.pending and t.counters_host()[CNT_RETIRED] > 5
    rows = t.num_rows
    t.ensure_free_blocks(2 * rows)
    assert t.num_rows > rows
    _assert_drained_as(mgr, log, want, want_log)


def test_records_are_written_only_while_someone_reads_them(backend):
    """Without events and without a sink the kernels write no change-log
    record (the log is left as it was); a sink started later gets the
    records from then on, and none once it is dropped."""
    mgr = make_manager(backend, tokens_per_block=T, pages_per_life_cycle=16)
    first = mgr.create_kv_cache()  # sizes the log for such a call
    assert first.resume() and first.resize(3 * T)
    first.commit(list(range(50, 50 + 3 * T)))
    first.close()
    mgr._tables.log[:] = -7
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(3 * T)
    kv.commit(list(range(1, 1 + 3 * T)))
    assert (mgr._backend.to_host(mgr._tables.log) == -7).all()
    sink = introspect.record_log(mgr)
    other = mgr.create_kv_cache()
    assert other.resume() and other.resize(2 * T)
    other.commit(list(range(100, 100 + 2 * T)))
    assert [int(r[LOG_KIND]) for r in sink].count(EV_CREATED) == 2  # the second cache's two blocks
    mgr._tree.log_sink = None
    seen = len(sink)
    kv.close()
    other.close()
    assert len(sink) == seen
    introspect.check_sanity(mgr)

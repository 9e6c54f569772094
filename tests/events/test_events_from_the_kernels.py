"""KV cache events from a real manager (docs/semantics.md §4, §6.4, §3 invariant 16).

``test_event_manager.py`` drives the event manager with synthetic change-log records;
here the records come from the kernels: commits, partial snapshots, clears,
page deaths, subtree removals, eviction and migration to the host tier.

- §6.4 E9, E10, E12 and E14 on real commits; E1-E3, E6 and E7 once more on
  real test blocks (``introspect.make_test_block`` fed to the event manager's
  stored paths with ``introspect.event_manager_add_stored_block`` /
  ``_life_cycle``), the ``sha256_64`` format, the queue cap, and the removed
  events of an eviction without a host tier.
- Event consistency of whole workloads: the random conversations of the
  lockstep (``tests/support/event_lockstep.py``: oracle and gpukv) and the
  worked scenarios of ``tests/caches/test_worked_scenarios.py``, rerun with
  events on, with ``event_checks.EventTracker`` after every step. Its rules, exact at
  every point between two manager calls: every removed (hash, group) was
  stored and not removed since; every announced pair is an attached block
  whose page in that life cycle covers the whole block, with the stored
  tokens, parent and cache level still true of it; after a clear nothing is
  announced. And every whole-block page of an *attention* life cycle is
  announced too (checked; SSM snapshots of a full block follow its
  stored event, §2.5.1, so those are not). The conversations also run under
  memory pressure (pages dropped) and with a host tier (pages migrated both
  ways, the consumer's cache levels checked against the pages).

Two kernel bugs these checks found have regression tests at the end.
"""

from __future__ import annotations

import inspect
import itertools
import random

import pytest

import gpukv
from gpukv import Attention, ReuseScope, introspect
from gpukv.event_types import (
    Diff,
    KVCacheEvent,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    UniqueToken,
)
from gpukv.core.hashing import sequence_to_blockchain_keys

from tests.support import scenario_rigs
from tests.caches import test_worked_scenarios as scenarios
from tests.support.backends import make_manager
from tests.support.engine import attached_blocks
from tests.support.event_checks import EventTracker, check_event_consistency
from tests.support.event_lockstep import (
    MANY,
    STEPS,
    SUBSET_CONFIGS,
    EventLockstep,
    events_under_memory_pressure,
    events_with_a_host_tier,
    step_with_attention_lower_bound,
)
from tests.support.lockstep import CONFIG_IDS, CONFIGS, PRESSURE_POOL

PRIORITY = 35  # the default eviction priority, reported in stored payloads


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def events_manager(max_kv_event_entries=MANY, **config):
    """A cpu manager with events on; the created event is drained already."""
    mgr = make_manager("cpu", max_kv_event_entries=max_kv_event_entries, **config)
    (created,) = mgr.get_latest_events()
    assert created.layer_group_id is None and created.event_id == 0
    return mgr


def commit_turn(mgr, tokens, input_tokens=None, scope=None, history=None):
    """Create (reusing ``input_tokens``), resume, resize to ``len(tokens)``,
    commit what was not reused, close. Returns the reused length."""
    kv = mgr.create_kv_cache(input_tokens=input_tokens, scope=scope)
    n = kv.num_committed_tokens
    assert kv.resume() is not False
    assert kv.resize(len(tokens), len(tokens) if history is None else history)
    kv.commit(list(tokens[n:]))
    kv.close()
    return n


def chain_hashes(T, tokens, scope=None, fmt="sha256"):
    """The event hashes of ``tokens``' blocks (the root left out)."""
    keys = [k for _, k in sequence_to_blockchain_keys(T, scope, tokens)][1:]
    return [k.hex() if fmt == "sha256" else int.from_bytes(k[:8], "big") for k in keys]


def brief(events) -> list:
    """``(kind, layer group, hashes)`` per event: a readable exact sequence."""
    out = []
    for e in events:
        d = e.data
        if isinstance(d, KVCacheStoredData):
            out.append(("stored", e.layer_group_id, tuple(b.block_hash for b in d.blocks)))
        elif isinstance(d, KVCacheRemovedData):
            out.append(("removed", e.layer_group_id, d.block_hashes))
        elif isinstance(d, KVCacheUpdatedData):
            out.append(("updated", e.layer_group_id, (d.block_hash,)))
        else:
            out.append((type(d).__name__, e.layer_group_id, ()))
    return out


def ints(tokens) -> tuple:
    return tuple(UniqueToken(t) for t in tokens)


# ---------------------------------------------------------------------------
# §6.4 on real commits
# ---------------------------------------------------------------------------


def test_e9_stored_events_match_the_hash_chain():
    mgr = events_manager(tokens_per_block=4, layers=[Attention(), Attention()])  # one life cycle
    tokens = list(range(8))
    commit_turn(mgr, tokens)
    h0, h1 = chain_hashes(4, tokens)
    events = mgr.get_latest_events()
    assert events == [
        KVCacheEvent(
            1,
            KVCacheStoredData(None, (
                KVCacheStoredBlockData(h0, ints(range(4)), 0, PRIORITY),
                KVCacheStoredBlockData(h1, ints(range(4, 8)), 0, PRIORITY),
            )),
            0, "v2_sha256", 0, 0,
        )
    ]
    check_event_consistency(events)
    # An updated event keyed by the block key reports the same hash.
    introspect.event_manager(mgr).add_updated_event(bytes.fromhex(h0), cache_level=Diff(0, 1), layer_group_id=0)
    (updated,) = mgr.get_latest_events()
    assert updated.data == KVCacheUpdatedData(h0, Diff(0, 1), None)
    assert (updated.event_id, updated.layer_group_id) == (2, 0)


def test_e10_a_reused_prefix_does_not_re_emit():
    mgr = events_manager(tokens_per_block=4)
    tokens = list(range(12))
    h0, h1, h2 = chain_hashes(4, tokens)
    tracker = EventTracker(mgr)
    commit_turn(mgr, tokens[:8])
    assert brief(tracker.drain()) == [("stored", 0, (h0, h1))]
    assert commit_turn(mgr, tokens, input_tokens=tokens[:8]) == 8
    events = tracker.drain()
    assert brief(events) == [("stored", 0, (h2,))]
    assert events[0].data.parent_hash == h1
    tracker.check_tree()


def test_e12_a_covered_partial_commit_emits_nothing():
    T = 8
    digest = bytes(range(40, 72))
    tokens = [1, 2] + gpukv.gen_multimodal_cache_key_tokens(1000, digest, 6)
    assert len(tokens) == T and tokens[2] == digest
    mgr = events_manager(tokens_per_block=T)
    tracker = EventTracker(mgr)

    commit_turn(mgr, tokens)
    (full,) = tracker.drain()
    (block,) = full.data.blocks
    (h_full,) = chain_hashes(T, tokens)
    assert block.block_hash == h_full and block.mm_keys == (digest.hex(),)
    assert block.tokens == ints([1, 2]) + (UniqueToken(digest.hex()),) + ints(range(1001, 1006))
    tracker.check_tree()

    commit_turn(mgr, tokens[:6])  # covered by the full block: VIRTUAL_STOP at close
    assert tracker.drain() == []

    mgr.clear_reusable_blocks()
    assert brief(tracker.drain()) == [("removed", 0, (h_full,))]

    commit_turn(mgr, tokens[:6])
    (partial,) = tracker.drain()
    (block,) = partial.data.blocks
    assert block.block_hash == chain_hashes(T, tokens[:6])[0] != h_full
    assert len(block.tokens) == 6 and block.mm_keys == (digest.hex(),)
    tracker.check_tree()


def test_e14_migration_to_the_host_tier_emits_updated():
    T = 4
    mgr = events_manager(
        tokens_per_block=T, layers=[Attention(window=T), Attention()],  # lc0 = S(T), lc1 = F
        pages_per_life_cycle=4, host_pages_per_life_cycle=8,
    )
    tracker = EventTracker(mgr)
    tokens = list(range(8))
    h0, h1 = chain_hashes(T, tokens)
    commit_turn(mgr, tokens, history=0)  # every block gets pages in both life cycles
    assert brief(tracker.drain()) == [("stored", 0, (h0, h1)), ("stored", 1, (h0, h1))]

    # Another cache takes the whole GPU pool: the tree's four pages move to the host.
    kv = mgr.create_kv_cache()
    assert kv.resume() is not False
    assert kv.resize(16, 0)
    assert mgr.get_and_reset_eviction_stats() == {"evicted": 4, "migrated": 4, "dropped": 0}
    events = tracker.drain()
    assert sorted(brief(events)) == sorted(("updated", lc, (h,)) for lc in (0, 1) for h in (h0, h1))
    for e in events:
        assert e.data.cache_level == Diff(0, 1) and e.data.priority is None
        assert (e.data.block_hash, e.layer_group_id) in tracker.announced  # stored for that very group
        assert e.window_size == (T if e.layer_group_id == 0 else 0)
    tracker.check_tree()  # the consumer's levels (1) are the pages' levels
    kv.close()

    # A reuse brings back what it needs: both F pages and B1's S page (B0 is
    # out of the window at 8).
    kv = mgr.create_kv_cache(input_tokens=tokens)
    assert kv.num_committed_tokens == 8
    assert tracker.drain() == []
    assert kv.resume() is not False
    events = tracker.drain()
    assert sorted(brief(events)) == sorted([("updated", 0, (h1,)), ("updated", 1, (h0,)), ("updated", 1, (h1,))])
    assert all(e.data.cache_level == Diff(1, 0) for e in events)
    tracker.check_tree()
    kv.close()
    mgr.clear_reusable_blocks()
    tracker.step()
    assert tracker.announced == {}


def two_cached_blocks():
    """A four-page pool whose tree holds [0..3] -> [4..7] (T = 4), committed
    and released; returns the manager, its tracker, the tokens and the two
    block hashes."""
    T = 4
    mgr = events_manager(tokens_per_block=T, pages_per_life_cycle=4)
    tracker = EventTracker(mgr)
    tokens = list(range(8))
    commit_turn(mgr, tokens)
    return mgr, tracker, tokens, chain_hashes(T, tokens)


def test_eviction_without_a_host_tier_removes_the_evicted_blocks():
    mgr, tracker, _, (h0, h1) = two_cached_blocks()
    assert brief(tracker.drain()) == [("stored", 0, (h0, h1))]
    kv = mgr.create_kv_cache()
    assert kv.resume() is not False
    assert kv.resize(12)  # one tree page must go: the least recently released one, B1's
    assert brief(tracker.drain()) == [("removed", 0, (h1,))]
    tracker.check_tree()
    assert kv.resize(16)  # B0's full-attention page dies: B0 leaves with its (empty) subtree
    assert brief(tracker.drain()) == [("removed", 0, (h0,))]
    tracker.check_tree()
    assert mgr.get_and_reset_eviction_stats() == {"evicted": 2, "migrated": 0, "dropped": 2}
    kv.close()


def test_evicting_a_parent_removes_its_subtree_in_one_event():
    mgr, tracker, tokens, (h0, h1) = two_cached_blocks()
    tracker.drain()
    b0_page, _ = introspect.reuse_match_pages(mgr, tokens, 0)[1][0]
    introspect.page_death(mgr, b0_page)  # full attention: nothing below B0 is reusable any more
    assert brief(tracker.drain()) == [("removed", 0, (h1, h0))]  # leaves first
    tracker.check_tree()


def test_sha256_64_hashes_on_a_real_commit():
    T = 4
    mgr = events_manager(tokens_per_block=T, event_hash="sha256_64")
    tracker = EventTracker(mgr)
    tokens = list(range(12))
    h0, h1, h2 = chain_hashes(T, tokens, fmt="sha256_64")
    commit_turn(mgr, tokens[:8])
    events = tracker.drain()
    commit_turn(mgr, tokens, input_tokens=tokens[:8])
    events += tracker.drain()
    assert brief(events) == [("stored", 0, (h0, h1)), ("stored", 0, (h2,))]
    assert [e.data.parent_hash for e in events] == [None, h1]
    assert all(e.hash_algo == "v2_sha256_64" for e in events)
    assert all(isinstance(b.block_hash, int) and 0 <= b.block_hash < 2**64 for e in events for b in e.data.blocks)
    tracker.check_tree()
    mgr.clear_reusable_blocks()
    (removed,) = tracker.drain()
    assert set(removed.data.block_hashes) == {h0, h1, h2} and removed.hash_algo == "v2_sha256_64"


def test_scopes_are_separate_roots():
    """Blocks under different scope roots have parent None and distinct hashes."""
    mgr = events_manager(tokens_per_block=4)
    tracker = EventTracker(mgr)
    tokens = list(range(4))
    for scope in (None, ReuseScope(lora_id=1), ReuseScope(salt=9)):
        commit_turn(mgr, tokens, scope=scope)
    events = tracker.drain()
    hashes = [chain_hashes(4, tokens, scope)[0] for scope in (None, ReuseScope(lora_id=1), ReuseScope(salt=9))]
    assert brief(events) == [("stored", 0, (h,)) for h in hashes] and len(set(hashes)) == 3
    assert all(e.data.parent_hash is None for e in events)
    tracker.check_tree()


def test_the_queue_keeps_the_newest_events():
    mgr = make_manager("cpu", tokens_per_block=4, max_kv_event_entries=2)
    prompts = [[k, 1, 2, 3] for k in range(4)]  # four roots' children: nothing coalesces
    hashes = [chain_hashes(4, p)[0] for p in prompts]
    commit_turn(mgr, prompts[0])
    introspect.event_manager(mgr).flush_iteration_events()  # created + stored(0) reach the queue, which keeps both
    commit_turn(mgr, prompts[1])
    commit_turn(mgr, prompts[2])
    commit_turn(mgr, prompts[3])  # queued at the next flush: the two oldest go
    events = mgr.get_latest_events()
    assert brief(events) == [("stored", 0, (hashes[2],)), ("stored", 0, (hashes[3],))]
    assert [e.event_id for e in events] == [3, 4]
    assert mgr.get_latest_events() == []


def test_events_off_by_default():
    mgr = make_manager("cpu", tokens_per_block=4)
    commit_turn(mgr, list(range(8)))
    mgr.clear_reusable_blocks()
    assert mgr.get_latest_events() == []


# ---------------------------------------------------------------------------
# §6.4 E1-E7 on real test blocks (lc0 = S with W = T, lc1 = F; T = 2)
# ---------------------------------------------------------------------------


@pytest.fixture
def blocks_mgr():
    return events_manager(tokens_per_block=2, layers=[Attention(window=2), Attention()], pages_per_life_cycle=16)


def page(mgr, block, lc) -> int:
    return introspect.page_of(mgr, block, lc)[0]


def test_e1_real_partial_life_cycle_coverage_is_omitted(blocks_mgr):
    mgr = blocks_mgr
    b = introspect.make_test_block(mgr, [1, 2], [2, 1])
    assert mgr.get_latest_events() == []  # building a block announces nothing
    introspect.event_manager_add_stored_block(mgr, b)
    h = b.key.hex()
    (stored,) = mgr.get_latest_events()
    assert stored.layer_group_id == 0 and stored.window_size == 2
    assert stored.data == KVCacheStoredData(None, (KVCacheStoredBlockData(h, ints([1, 2]), 0, PRIORITY),))
    introspect.event_manager_add_stored_life_cycle(mgr, b, 1)  # lc1's page covers 1 of 2 tokens
    assert mgr.get_latest_events() == []


def test_e2_real_removed_events_per_life_cycle(blocks_mgr):
    mgr = blocks_mgr
    tracker = EventTracker(mgr)
    b = introspect.make_test_block(mgr, [1, 2], [2, 2])
    h = b.key.hex()
    introspect.event_manager_add_stored_block(mgr, b)
    introspect.page_death(mgr, page(mgr, b, 0))  # an SWA (non-sink) page: the block stays
    assert brief(tracker.drain()) == [("stored", 0, (h,)), ("stored", 1, (h,)), ("removed", 0, (h,))]
    tracker.check_tree()
    # lc1's page death removes the whole block (full attention); removing
    # lc1 once more is silent.
    introspect.page_death(mgr, page(mgr, b, 1))
    introspect.event_manager(mgr).add_removed_life_cycle_event(b.key, 1)
    assert brief(tracker.drain()) == [("removed", 1, (h,))]
    tracker.check_tree()


def test_e3_real_whole_block_removal_clears_the_life_cycle_state(blocks_mgr):
    mgr = blocks_mgr
    b = introspect.make_test_block(mgr, [1, 2], [2, 2])
    h = b.key.hex()
    introspect.event_manager_add_stored_block(mgr, b)
    introspect.page_death(mgr, page(mgr, b, 0))
    introspect.remove_subtree(mgr, b)
    with pytest.raises(ValueError, match="stale"):  # the block is gone: a second removal cannot happen
        introspect.remove_subtree(mgr, b)
    introspect.event_manager(mgr).add_removed_event([b.key])  # ... and one fed directly is ignored
    events = mgr.get_latest_events()
    assert brief(events) == [("stored", 0, (h,)), ("stored", 1, (h,)), ("removed", 0, (h,)), ("removed", 1, (h,))]
    check_event_consistency(events)


def test_e6_real_contiguous_stored_events_coalesce(blocks_mgr):
    mgr = blocks_mgr
    b0 = introspect.make_test_block(mgr, [1, 2], [2, 2])
    b1 = introspect.make_test_block(mgr, [3, 4], [2, 2], parent=b0)
    introspect.event_manager_add_stored_block(mgr, b0)
    introspect.event_manager_add_stored_block(mgr, b1)
    h0, h1 = chain_hashes(2, [1, 2, 3, 4])
    events = mgr.get_latest_events()
    assert brief(events) == [("stored", 0, (h0, h1)), ("stored", 1, (h0, h1))]
    assert all(e.data.parent_hash is None for e in events)
    assert [b.block_hash for b in events[0].data.blocks] == [b0.key.hex(), b1.key.hex()]


def test_e7_real_the_registry_is_used_for_removal(blocks_mgr):
    mgr = blocks_mgr
    b = introspect.make_test_block(mgr, [1, 2], [2, 0])
    h = b.key.hex()
    introspect.event_manager_add_stored_block(mgr, b)
    introspect.remove_subtree(mgr, b)
    introspect.event_manager(mgr).add_removed_event([b.key])
    events = mgr.get_latest_events()
    assert brief(events) == [("stored", 0, (h,)), ("removed", 0, (h,))]
    check_event_consistency(events)


def test_real_stored_life_cycle_path(blocks_mgr):
    """A block never announced takes the whole-block path; an announced one
    gains exactly the life cycle named, once its page covers the block."""
    mgr = blocks_mgr
    tracker = EventTracker(mgr)
    b = introspect.make_test_block(mgr, [1, 2], [2, 1])
    h = b.key.hex()
    introspect.event_manager_add_stored_life_cycle(mgr, b, 1)  # not announced yet: whole-block path
    assert brief(tracker.drain()) == [("stored", 0, (h,))]
    introspect.add_page(mgr, b, 1, 2)  # lc1 now covers the block (a rebase would install it so)
    introspect.event_manager_add_stored_life_cycle(mgr, b, 1)
    introspect.event_manager_add_stored_life_cycle(mgr, b, 1)
    introspect.event_manager_add_stored_life_cycle(mgr, b, 0)
    assert brief(tracker.drain()) == [("stored", 1, (h,))]
    tracker.check_tree()
    introspect.close_test_block(mgr, b)  # S page dies (removed lc0), then F (the block goes)
    assert brief(tracker.drain()) == [("removed", 0, (h,)), ("removed", 1, (h,))]
    tracker.check_tree()


def test_real_partial_block_covering_its_own_tokens_is_announced(blocks_mgr):
    mgr = blocks_mgr
    b0 = introspect.make_test_block(mgr, [1, 2], [2, 2])
    tail = introspect.make_test_block(mgr, [3], [1, 1], parent=b0)
    introspect.event_manager_add_stored_block(mgr, b0)
    introspect.event_manager_add_stored_block(mgr, tail)
    events = mgr.get_latest_events()
    assert brief(events) == [("stored", lc, (b0.key.hex(), tail.key.hex())) for lc in (0, 1)]
    assert events[0].data.blocks[1].tokens == ints([3])


def test_introspect_announce_hooks_validate(blocks_mgr):
    mgr = blocks_mgr
    b = introspect.make_test_block(mgr, [1, 2], [2, 2])
    with pytest.raises(ValueError, match="life_cycle_id"):
        introspect.event_manager_add_stored_life_cycle(mgr, b, 2)
    introspect.remove_subtree(mgr, b)
    with pytest.raises(ValueError, match="stale"):
        introspect.event_manager_add_stored_block(mgr, b)


# ---------------------------------------------------------------------------
# event consistency of the lockstep workloads (tests/support/event_lockstep.py)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_conversation_events_are_consistent(config):
    EventLockstep(random.Random(0), config).run_steps(STEPS)


@pytest.mark.parametrize("config", SUBSET_CONFIGS, ids=[c[0] for c in SUBSET_CONFIGS])
def test_conversation_events_under_memory_pressure_are_consistent(config):
    events_under_memory_pressure(config)


@pytest.mark.parametrize("config", SUBSET_CONFIGS, ids=[c[0] for c in SUBSET_CONFIGS])
def test_conversation_events_with_a_host_tier_are_consistent(config):
    events_with_a_host_tier(config)


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("seed", range(1, 5))
def test_conversation_events_are_consistent_long(config, seed):
    EventLockstep(random.Random(seed), config).run_steps(1000)


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("pool", [PRESSURE_POOL, 12])
@pytest.mark.parametrize("seed", range(1, 5))
def test_conversation_events_under_memory_pressure_are_consistent_long(config, pool, seed):
    EventLockstep(random.Random(seed), config, pool).run_steps(1000)


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("seed", range(1, 5))
def test_conversation_events_with_a_host_tier_are_consistent_long(config, seed):
    # Longer turns lock more pages at once: 48 GPU pages leave room for them
    # (gpukv would rightly refuse resizes the never-evicting oracle grants).
    EventLockstep(random.Random(seed), config, host_tier=True, gpu_pages=48).run_steps(1000)


# ---------------------------------------------------------------------------
# event consistency of the worked scenarios
# ---------------------------------------------------------------------------


def _scenario_cases():
    """Every test of ``tests/caches/test_worked_scenarios.py`` on ``cpu`` (the ``cpu`` side of
    the scenarios played on every side), with its parametrizations expanded:
    ``(id, function, kwargs)``."""
    cases = []
    for name, fn in sorted(vars(scenarios).items()):
        if not name.startswith("test_") or not inspect.isfunction(fn):
            continue
        grids = [{}]
        for mark in getattr(fn, "pytestmark", []):
            if mark.name != "parametrize":
                continue
            names = mark.args[0]
            names = [s.strip() for s in names.split(",")] if isinstance(names, str) else list(names)
            values = [v.values if hasattr(v, "values") else (v if len(names) > 1 else (v,)) for v in mark.args[1]]
            grids = [{**g, **dict(zip(names, v))} for g, v in itertools.product(grids, values)]
        grids = [g for g in grids if g.get("side", "cpu") == "cpu"]
        params = set(inspect.signature(fn).parameters)
        for i, kwargs in enumerate(grids):
            if set(kwargs) != params:
                continue  # a fixture this module does not provide
            cases.append(pytest.param(fn, kwargs, id=f"{name}[{i}]" if len(grids) > 1 else name))
    return cases


SCENARIOS = _scenario_cases()


def test_every_scenario_is_rerun():
    names = {p.values[0].__name__ for p in SCENARIOS}
    assert {"test_P1_rewind_endpoint_survives_a_longer_sibling_created_after", "test_M4_a_snapshot_at_each_commit",
            "test_D8_a_partial_block_is_never_rebased_onto_a_full_tree_block"} <= names
    assert len(SCENARIOS) >= 40


@pytest.mark.parametrize("scenario, kwargs", SCENARIOS)
def test_scenario_events_are_consistent(scenario, kwargs, monkeypatch):
    """The scenario as written, with events on: the event tracker (and the
    attention lower bound) runs at every ``Rig.check`` and at the end; with
    no cache left open, a clear must remove everything that was announced."""
    trackers = []
    make = scenario_rigs.make_manager

    def with_events(backend="cpu", **config):
        config["max_kv_event_entries"] = MANY
        mgr = make(backend, **config)
        trackers.append(EventTracker(mgr))
        return mgr

    check = scenario_rigs.ManagerRig.check

    def check_with_events(rig):
        check(rig)
        for t in trackers:
            if t.mgr is rig.mgr:
                step_with_attention_lower_bound(t)

    monkeypatch.setattr(scenario_rigs, "make_manager", with_events)
    monkeypatch.setattr(scenario_rigs.ManagerRig, "check", check_with_events)
    scenario(**kwargs)
    for t in trackers:
        step_with_attention_lower_bound(t)
        if not introspect.num_open_caches(t.mgr):
            t.mgr.clear_reusable_blocks()
            t.step()
            assert t.announced == {}


# ---------------------------------------------------------------------------
# regression tests of kernel bugs the event checks found
# ---------------------------------------------------------------------------


def test_a_partial_snapshot_never_announces_a_detached_block():
    """commit_min_snapshot, a two-page pool. A's partial snapshot leaves
    [7, 8] in the tree with a whole-block page (announced). B commits
    [7, 8, 9]: the new partial block adopts [7, 8]'s page (the shorter block
    is detached: removed), then copying B's page into the tree needs a GPU
    slot, and the only victim is that adopted page; its death removes the
    new block again (unannounced, so silently). The copy then lands in the
    detached block, which ``snapshot_partial`` used to announce: a stored
    event for a block that is not in the tree and would never be reported
    removed. It now announces only a block still in the tree."""
    mgr = events_manager(tokens_per_block=4, pages_per_life_cycle=2, commit_min_snapshot=True)
    tracker = EventTracker(mgr)
    commit_turn(mgr, [7, 8])
    assert brief(tracker.drain()) == [("stored", 0, (chain_hashes(4, [7, 8])[0],))]
    kv = mgr.create_kv_cache()
    assert kv.resume() is not False
    assert kv.resize(3, 3)
    kv.commit([7, 8, 9])
    assert attached_blocks(mgr) == {}  # the tree is empty ...
    tracker.step()  # ... so nothing may stay announced


def test_a_rebase_announcing_many_life_cycles_fits_the_log():
    """Three SWA life cycles. A commits 30 blocks with history = capacity, so
    blocks 0..28 (stale) get no pages. B commits the same tokens with every
    page (history 0): each of the 29 blocks rebases and announces all three
    life cycles (one EV_STORED_LIFE_CYCLE header, with a token row, each),
    87 token rows. ``KVCache.commit`` used to reserve ``2 * blocks + 2``
    rows (62), so the kernel stopped with ERR_LOG_FULL after the commit had
    changed the tree; it now reserves ``(life cycles + 2) * blocks + 2``."""
    T, B = 4, 30
    mgr = events_manager(
        tokens_per_block=T, layers=[Attention(window=4), Attention(window=5), Attention(window=6)],
        pages_per_life_cycle=256,
    )
    tokens = list(range(T * B))
    commit_turn(mgr, tokens)
    commit_turn(mgr, tokens, history=0)
    tracker = EventTracker(mgr)
    tracker.feed(mgr.get_latest_events())


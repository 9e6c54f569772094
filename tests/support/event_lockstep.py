"""Event consistency of the lockstep's random conversations
(``tests/support/lockstep.py``): ``EventLockstep`` runs them with events on
the gpukv side, checked after every step by an ``EventTracker``
(``tests/support/event_checks.py``).
"""

from __future__ import annotations

import random

from gpukv import introspect
from gpukv.core.config import KIND_SSM

from tests.support import lockstep
from tests.support.event_checks import EventTracker
from tests.support.lockstep import CONFIGS, POOL, PRESSURE_POOL, Lockstep

MANY = 1 << 20  # a queue cap nothing reaches: the trackers need complete streams


def step_with_attention_lower_bound(tracker: EventTracker):
    """``tracker.step()``, and every whole-block page of an attention life
    cycle is announced (SSM snapshots of full blocks are taken after the
    block's stored event, §2.5.1, and stay unannounced)."""
    tracker.step()
    kinds = [lc.kind for lc in tracker.mgr.config.life_cycles]
    missing = [(h, lc) for h, lc in tracker.unannounced_covered() if kinds[lc] != KIND_SSM]
    assert not missing, f"whole-block attention pages never announced: {missing}\n{introspect.dump(tracker.mgr)}"


class EventLockstep(Lockstep):
    """``Lockstep`` with events on the gpukv side, checked after every step by
    an ``EventTracker`` instead of the oracle comparison (which
    ``tests/caches/test_conversations_vs_oracle.py`` runs on the same workloads); every call
    still runs on both sides and must agree there.

    Besides the tracker's rules: every whole-block page of an attention life
    cycle is announced, and the final clear leaves nothing announced.

    ``host_tier``: gpukv gets ``gpu_pages`` GPU pages per life cycle and a
    host tier big enough that nothing is ever dropped, against an oracle
    that never evicts. Pages then only move between levels, so the trees
    stay equal (as long as the pages the open caches lock fit on the GPU;
    otherwise gpukv rightly refuses a resize the oracle grants), and the
    updated events (both ways) keep the consumer's cache
    levels true (the tracker checks them against the pages)."""

    def __init__(self, rng, config, pool=POOL, host_tier=False, gpu_pages=24):
        make = lockstep.make_manager

        def with_events(backend, **kw):
            if host_tier:
                kw.update(pages_per_life_cycle=gpu_pages, host_pages_per_life_cycle=POOL)
            return make(backend, max_kv_event_entries=MANY, **kw)

        lockstep.make_manager = with_events
        try:
            super().__init__(rng, config, pool)
        finally:
            lockstep.make_manager = make
        self.tracker = EventTracker(self.mgr)

    def check(self):
        step_with_attention_lower_bound(self.tracker)

    def run_steps(self, steps):
        stats = super().run_steps(steps)
        assert self.tracker.announced == {}  # run_steps ends with a clear
        assert self.tracker.counts["stored"] > 0 and self.tracker.counts["removed"] > 0
        return stats


# A representative subset for the default run: every life-cycle kind, with
# and without commit_min_snapshot, backoff and partial reuse.
SUBSET = ["F-nopartial-backoff", "F+S", "S+F+Ssink-cms-backoff", "S-only-cms", "F+S+M-partial"]
SUBSET_CONFIGS = [c for c in CONFIGS if c[0] in SUBSET]
STEPS = 200


def events_under_memory_pressure(config):
    """A default-length run under memory pressure: pages are dropped, and the
    removed events keep the consumer's view true."""
    lock = EventLockstep(random.Random(0), config, PRESSURE_POOL)
    lock.run_steps(STEPS)
    assert lock.mgr.get_and_reset_eviction_stats()["dropped"] > 0


def events_with_a_host_tier(config):
    """A default-length run with a host tier: pages migrate both ways and are
    never dropped, and the updated events keep the consumer's cache levels true."""
    lock = EventLockstep(random.Random(0), config, host_tier=True)
    lock.run_steps(STEPS)
    evicted = lock.mgr.get_and_reset_eviction_stats()
    assert evicted["migrated"] == evicted["evicted"] > 0 and evicted["dropped"] == 0
    assert lock.tracker.counts["updated"] > 0

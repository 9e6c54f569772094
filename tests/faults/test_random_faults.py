"""Fault injection: the randomised workloads of the fault harness
(``tests/support/faults.py``: calls fail at random points on real page
memory, everything checked after every step), and regression tests of what
the harness found.
"""

from __future__ import annotations

import sys

import pytest

from gpukv import Attention, introspect

from tests.support.backends import make_manager
from tests.support.event_checks import EventTracker
from tests.support.faults import FaultyWorkload
from tests.support.interrupts import HOST

T = 4


@pytest.mark.parametrize("config", sorted(FaultyWorkload.CONFIGS))
@pytest.mark.parametrize("seed", range(2))
def test_faults_anywhere_leave_every_page_right(config, seed):
    w = FaultyWorkload(seed, config, rate=0.4).run(300)
    fired = w.faults.fired
    # Signals land where the timer says, so only the other kinds are counted.
    assert fired["line"] >= 15 and fired["hook"] >= 3 and fired["callback"] >= 3, fired
    assert w.committed_turns >= 10 and w.unchanged_checks >= 3, (w.committed_turns, w.unchanged_checks)


def test_the_harness_sees_a_lost_copy():
    """The checks bite: a copy executor that forgets its copies (what an
    unresumable aftermath did) is caught without any injected fault."""
    w = FaultyWorkload(0, "hybrid", rate=0.0)
    w.mgr._launcher.copier.carry_out = lambda copies: None
    with pytest.raises(AssertionError, match="wrong"):
        w.run(200)


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(FaultyWorkload.CONFIGS))
@pytest.mark.parametrize("seed", range(100, 106))
def test_faults_anywhere_long(config, seed):
    w = FaultyWorkload(seed, config, rate=0.5).run(1500)
    assert sum(w.faults.fired.values()) >= 300, w.faults.fired


@pytest.mark.cudasim
def test_faults_anywhere_cudasim():
    w = FaultyWorkload(7, "hybrid", backend="cudasim", kinds=("line", "hook", "callback")).run(25)
    assert sum(w.faults.fired.values()) >= 3, w.faults.fired


# ---------------------------------------------------------------------------
# what the harness found: a cache the caller never received
# ---------------------------------------------------------------------------


def _interrupt_at_line(function_name: str, k: int):
    """A trace function raising KeyboardInterrupt before the ``k``-th line of
    gpukv's ``function_name`` runs; returns (trace, fired)."""
    left, fired = [k], []

    def local(frame, event, arg):
        if event == "line":
            left[0] -= 1
            if left[0] == 0:
                fired.append(frame.f_lineno)
                raise KeyboardInterrupt(f"injected at line {frame.f_lineno}")
        return local

    def trace(frame, event, arg):
        code = frame.f_code
        return local if code.co_name == function_name and code.co_filename.startswith(HOST) else None

    return trace, fired


@pytest.mark.parametrize("with_input", [True, False], ids=["reusing", "empty"])
def test_create_kv_cache_interrupted_anywhere_leaves_no_unreachable_open_cache(with_input):
    """An interrupt at any line of create_kv_cache (of ``CacheCalls._create``,
    which makes and opens the cache for it): either the caller gets the
    cache, or no open cache is left behind (one would hold its reused pages
    for good and make shutdown() refuse forever)."""
    mgr = make_manager("cpu", tokens_per_block=T, pages_per_life_cycle=16)
    prompt = list(range(1, 11))
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(10, 10)
    kv.commit(prompt)
    kv.close()
    lines = set()
    for k in range(1, 200):
        trace, fired = _interrupt_at_line("_create", k)
        sys.settrace(trace)
        try:
            got = mgr.create_kv_cache(input_tokens=prompt if with_input else None)
        except KeyboardInterrupt:
            got = None
        finally:
            sys.settrace(None)
        if not fired:
            got.close()
            break  # past the last line: every line was interrupted once
        lines.update(fired)
        open_caches = list(mgr._open_caches)
        assert open_caches == ([got] if got is not None else []), f"interrupted at line {fired[0]}: unreachable open cache"
        if got is not None:
            got.close()
        introspect.check_sanity(mgr)
    assert len(lines) >= 5
    pages = introspect.tables(mgr)["pages"]
    assert not ((pages["locks"] > 0) | (pages["holders"] > 0)).any()
    mgr.shutdown()


# ---------------------------------------------------------------------------
# what the harness found: an event record applied in part
# ---------------------------------------------------------------------------


def _interrupt_call(obj, name, nth):
    """``obj.name`` raises KeyboardInterrupt on its ``nth`` call (1-based), as a
    signal landing in it would."""
    original = getattr(obj, name)
    count = [0]

    def wrapper(*args, **kwargs):
        count[0] += 1
        if count[0] == nth:
            raise KeyboardInterrupt(f"injected in {name}")
        return original(*args, **kwargs)

    setattr(obj, name, wrapper)
    return count


def _event_rig():
    mgr = make_manager("cpu", tokens_per_block=T, layers=[Attention(), Attention(window=8)], pages_per_life_cycle=32,
                       max_kv_event_entries=1000)
    return mgr, EventTracker(mgr)


def test_an_interrupt_between_a_blocks_stored_events_repeats_none():
    """A full block with pages in two life cycles is announced with one stored
    event per group; an interrupt after the first leaves the record unapplied
    by the launcher's count, so the settle on the way out applies it again:
    the record must apply in full or not at all."""
    mgr, tracker = _event_rig()
    tracker.step()
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(8, 8)
    _interrupt_call(mgr._events, "_add_stored_event", 2)
    with pytest.raises(KeyboardInterrupt):
        kv.commit(list(range(1, 9)))
    kv.close()
    tracker.step()  # the first group's block would read as stored twice without a removal


def test_an_interrupt_inside_a_removal_loses_no_removed_event():
    """A removal forgets the block's announcements before it queues the
    removed events; an interrupt in between, and the replay finds nothing to
    remove: the consumer keeps a block the tree no longer has."""
    mgr, tracker = _event_rig()
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(8, 8)
    kv.commit(list(range(1, 9)))
    kv.close()
    tracker.step()
    assert tracker.announced
    _interrupt_call(mgr._events, "_enqueue_removed", 1)
    with pytest.raises(KeyboardInterrupt):
        mgr.clear_reusable_blocks()
    tracker.step()  # the block would stay announced, though no longer in the tree

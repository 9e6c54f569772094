"""``mgr.admit_batch(match, capacities, entries)``: new caches from an earlier
``match_batch``, resumed and sized, without a second match.

That it equals ``create_kv_caches`` and then, per cache, ``resume()`` and
``resize()`` is checked against the oracle and the per-cache calls in
``test_batched_vs_per_cache.py`` (random workloads, with pressure and refusals). Here:
when a match is current, what a stale one does, the input checks (each
refusal changing nothing), and that the caches of one call hold their
prefixes before any of them allocates.
"""

from __future__ import annotations

import numpy as np
import pytest

import gpukv
from gpukv import Attention, introspect

from tests.support.backends import make_manager

T = 4


def manager(backend, pages=16, partial=True):
    return make_manager(backend, tokens_per_block=T, layers=[Attention()], pages_per_life_cycle=pages,
                        enable_partial_reuse=partial)


def cached(mgr, tokens):
    """``tokens`` committed by a cache that then closes: reusable, held by nobody."""
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(len(tokens))
    kv.commit(list(tokens))
    kv.close()


def snapshot(mgr):
    """What a refused call must leave as it was."""
    return mgr.obtainable_pages(), mgr.free_pages(), introspect.dump(mgr)


PREFIX = list(range(100, 110))  # two full blocks and half a block


def test_caches_hold_what_the_match_found_and_are_sized(backend):
    mgr = manager(backend)
    cached(mgr, PREFIX)
    requests = [PREFIX + [7, 7], PREFIX[:6] + [1, 2, 3], [5, 5, 5]]
    m = mgr.match_batch(requests)
    assert mgr.is_current(m)
    caches, ok = mgr.admit_batch(m, [16, 12, 8])
    assert ok.tolist() == [True, True, True]
    assert [kv.num_committed_tokens for kv in caches] == [10, 6, 0]
    assert [kv.status for kv in caches] == [gpukv.KVCacheStatus.ACTIVE] * 3
    assert [kv.capacity for kv in caches] == [16, 12, 8]
    # The committed tokens come from the tree's blocks, a partial one included.
    assert [list(kv.committed_tokens) for kv in caches] == [PREFIX, PREFIX[:6], []]
    assert [len(kv.page_indices(0)) for kv in caches] == [4, 3, 2]
    # Both reuse a partial block: each gets its private copy of it.
    assert len(mgr.take_page_copies().dst_index) == 2
    introspect.check_sanity(mgr)
    for kv in caches:
        kv.close()
    mgr.shutdown()


def test_entries_pick_and_order_the_admitted_requests(backend):
    mgr = manager(backend)
    cached(mgr, PREFIX)
    m = mgr.match_batch([[9, 9, 9, 9, 9], PREFIX, PREFIX[:4]])
    caches, ok = mgr.admit_batch(m, [8, 12, 12], entries=[2, 1, 1])
    assert ok.all()
    assert [kv.num_committed_tokens for kv in caches] == [4, 10, 10]
    # The same request twice: two caches sharing the tree's full blocks.
    assert list(caches[1].page_indices(0))[:2] == list(caches[2].page_indices(0))[:2]
    caches_none, ok_none = mgr.admit_batch(mgr.match_batch([PREFIX]), [], entries=[])
    assert caches_none == [] and ok_none.shape == (0,)
    for kv in caches:
        kv.close()


def test_a_match_stays_current_while_blocks_are_only_added(backend):
    mgr = manager(backend)
    cached(mgr, PREFIX[:8])
    m = mgr.match_batch([PREFIX])
    cached(mgr, PREFIX)  # adds the partial third block: a longer hit now
    assert mgr.is_current(m)
    (kv,), ok = mgr.admit_batch(m, [12])
    assert ok.all() and kv.num_committed_tokens == 8  # what the match found
    assert mgr.probe_reuse(PREFIX) == 10
    kv.close()


def test_a_match_older_than_an_eviction_is_refused_and_nothing_changes(backend):
    mgr = manager(backend, pages=4)
    cached(mgr, PREFIX[:8])  # two pages, evictable
    m = mgr.match_batch([PREFIX[:8] + [1]])
    hog = mgr.create_kv_cache()
    assert hog.resume() and hog.resize(4 * T)  # takes every page: both cached blocks are evicted
    assert not mgr.is_current(m)
    before = snapshot(mgr)
    with pytest.raises(gpukv.StaleMatchError, match="match again"):
        mgr.admit_batch(m, [12])
    assert snapshot(mgr) == before
    hog.close()
    mgr.shutdown()  # the refused call left no cache open


def test_clearing_the_tree_makes_a_match_stale(backend):
    mgr = manager(backend)
    cached(mgr, PREFIX)
    m = mgr.match_batch([PREFIX])
    mgr.clear_reusable_blocks()
    assert not mgr.is_current(m)
    with pytest.raises(gpukv.StaleMatchError):
        mgr.admit_batch(m, [12])


def test_each_admission_holds_its_prefix_before_any_allocates(backend):
    """Admission 0 needs every page the pool has; admission 1's match found
    the two cached blocks. Those are held first, so admission 0's resize
    cannot evict them: it is refused, and admission 1 keeps its prefix."""
    mgr = manager(backend, pages=4, partial=False)
    cached(mgr, PREFIX[:8])
    m = mgr.match_batch([[1, 2, 3], PREFIX[:8] + [1]])
    caches, ok = mgr.admit_batch(m, [4 * T, 3 * T])
    assert ok.tolist() == [False, True]
    assert caches[0].status == gpukv.KVCacheStatus.ACTIVE and caches[0].capacity == 0  # resumed, not resized
    assert caches[1].num_committed_tokens == 8 and caches[1].capacity == 3 * T
    assert mgr.probe_reuse(PREFIX[:8]) == 8
    introspect.check_sanity(mgr)
    for kv in caches:
        kv.close()
    mgr.shutdown()


def test_a_refused_resume_leaves_the_cache_suspended(backend):
    # Partial reuse: a first resume needs a page for its private copy of the
    # partial block; the pool has one left after the three cached ones.
    mgr = manager(backend, pages=4)
    cached(mgr, PREFIX)
    m = mgr.match_batch([PREFIX, PREFIX])
    caches, ok = mgr.admit_batch(m, [12, 12])
    assert ok.tolist() == [True, False]
    assert caches[1].status == gpukv.KVCacheStatus.SUSPENDED and caches[1].num_committed_tokens == 10
    caches[0].close()
    assert caches[1].resume()  # the copy's page is free again
    caches[1].close()
    mgr.shutdown()


@pytest.mark.parametrize("call, error, text", [
    (lambda mgr, m, other: mgr.admit_batch(m.to_host().num_tokens, [8]), TypeError, "match must be what match_batch"),
    (lambda mgr, m, other: mgr.admit_batch(other.match_batch([PREFIX]), [8]), ValueError, "another manager"),
    (lambda mgr, m, other: mgr.admit_batch(m, [8, 8]), ValueError, "capacities has 2 entries for 1"),
    (lambda mgr, m, other: mgr.admit_batch(m, [8], entries={0}), TypeError, "entries must be None or a list"),
    (lambda mgr, m, other: mgr.admit_batch(m, [8], entries=[1]), ValueError, "admission 0: entries names request 1"),
    (lambda mgr, m, other: mgr.admit_batch(m, [8], entries=[-1]), ValueError, r"entries\[0\] must be a non-negative"),
    (lambda mgr, m, other: mgr.admit_batch(m, [True]), TypeError, r"capacities\[0\] must be a non-negative int"),
    (lambda mgr, m, other: mgr.admit_batch(m, [6]), ValueError, "admission 0: capacity 6 is below the 10 tokens"),
    (lambda mgr, m, other: mgr.admit_batch(m, [12], priority_callbacks=[3]), TypeError, "must be callable"),
])
def test_bad_input_is_refused_by_name_and_changes_nothing(call, error, text):
    mgr = manager("cpu")
    other = manager("cpu")
    cached(mgr, PREFIX)
    m = mgr.match_batch([PREFIX])
    before = snapshot(mgr)
    with pytest.raises(error, match=text):
        call(mgr, m, other)
    assert snapshot(mgr) == before and mgr.is_current(m)
    mgr.shutdown()  # no cache was left open


def test_a_match_keeps_its_stamp_on_the_host():
    mgr = manager("cpu")
    m = mgr.match_batch([PREFIX])
    h = m.to_host()
    assert mgr.is_current(h) and isinstance(h.num_tokens, np.ndarray)
    caches, ok = mgr.admit_batch(h, [12])
    assert ok.all()
    caches[0].close()


def test_priority_callbacks_give_the_new_pages_their_priorities():
    mgr = manager("cpu", partial=False)
    cached(mgr, PREFIX[:8])
    asked = []

    def callback(ordinal, lc):
        asked.append(ordinal)
        return 60 + ordinal

    m = mgr.match_batch([PREFIX[:8] + [1, 2], [7, 7]])
    caches, ok = mgr.admit_batch(m, [4 * T, 2 * T], priority_callbacks=[callback, None])
    assert ok.all() and asked == [0, 1, 2, 3]  # asked once per ordinal, before the launch
    for kv in caches:
        kv.commit([3] * (kv.capacity - kv.num_committed_tokens))
    pages = introspect.tables(mgr)["pages"]
    priority = {int(r["pool_index"]): int(r["priority"]) for r in pages if r["state"] != 0}
    first = [priority[p] for p in caches[0].page_indices(0)]
    assert first[2:] == [62, 63]  # its new blocks; the first two are the tree's, priced when cached
    assert [priority[p] for p in caches[1].page_indices(0)] == [35, 35]  # the default
    for kv in caches:
        kv.close()


def test_a_raising_priority_callback_changes_nothing():
    mgr = manager("cpu")
    cached(mgr, PREFIX)
    m = mgr.match_batch([PREFIX])
    before = snapshot(mgr)

    def callback(ordinal, lc):
        raise RuntimeError("no")

    with pytest.raises(ValueError, match=r"admission 0: priority_callback\(0, 0\) raised RuntimeError"):
        mgr.admit_batch(m, [16], priority_callbacks=[callback])
    assert snapshot(mgr) == before and mgr.is_current(m)
    mgr.shutdown()


def test_allocate_batch_refuses_either_part_by_name_and_changes_nothing():
    mgr = manager("cpu")
    cached(mgr, PREFIX)
    running = mgr.create_kv_cache()
    assert running.resume() and running.resize(2 * T)
    running.commit([1] * (2 * T))
    closed = mgr.create_kv_cache()
    closed.close()
    m = mgr.match_batch([PREFIX])
    before = snapshot(mgr)
    with pytest.raises(gpukv.LogicError, match=r"allocate_batch\(\): caches\[1\] is CLOSED"):
        mgr.allocate_batch([running, closed], [3 * T, 3 * T], m, [12])
    with pytest.raises(ValueError, match=r"allocate_batch\(\): caches\[0\]: capacity 4 is below history_length 8"):
        mgr.allocate_batch([running], [T], m, [12])
    with pytest.raises(ValueError, match=r"allocate_batch\(\): admission 0: capacity 6 is below the 10 tokens"):
        mgr.allocate_batch([running], [3 * T], m, [6])
    with pytest.raises(ValueError, match=r"admit_capacities has 2 entries for 1"):
        mgr.allocate_batch([running], [3 * T], m, [12, 12])
    assert snapshot(mgr) == before and running.capacity == 2 * T and mgr.is_current(m)
    resized, caches, ok = mgr.allocate_batch([running], [3 * T], m, [12])
    assert resized.tolist() == [True] and ok.tolist() == [True]
    assert running.capacity == 3 * T and caches[0].num_committed_tokens == 10
    for kv in (running, *caches):
        kv.close()
    mgr.shutdown()

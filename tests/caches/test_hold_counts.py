"""A page's holders and locks share one word (``layout.page_holds``), so a
manager keeps at most ``MAX_CACHES`` caches alive at once and refuses one
more before it changes anything (docs/api.md, "Errors")."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import gpukv
from gpukv import Attention, introspect
from gpukv.core.layout import MAX_CACHES, page_holds

from tests.support.backends import make_manager
from tests.support.turns import finished, seq

T = 4


def _manager(pages: int = 16):
    return make_manager(tokens_per_block=T, layers=[Attention()], pages_per_life_cycle=pages)


def _prefix_pages(mgr):
    """The pages of seq(0)'s two blocks, as ``introspect.tables`` decodes them."""
    pages = introspect.tables(mgr)["pages"]
    rows = [introspect.reuse_match_pages(mgr, seq(0), life_cycle_id=0)[1][i][0] for i in range(2)]
    return pages[rows]


def test_many_caches_count_their_holds_and_locks_on_one_shared_page():
    mgr = _manager()
    finished(mgr, seq(0))
    caches = mgr.create_kv_caches([seq(0)] * 300)
    assert (_prefix_pages(mgr)[["holders", "locks"]].tolist()) == [(300, 0)] * 2  # suspended: held
    for kv in caches:
        assert kv.resume()
    assert (_prefix_pages(mgr)[["holders", "locks"]].tolist()) == [(300, 300)] * 2
    for kv in caches[:120]:
        kv.suspend()
    assert (_prefix_pages(mgr)[["holders", "locks"]].tolist()) == [(300, 180)] * 2
    introspect.check_sanity(mgr)
    for kv in caches:
        kv.close()
    assert (_prefix_pages(mgr)[["holders", "locks"]].tolist()) == [(0, 0)] * 2
    introspect.check_sanity(mgr)


def test_the_word_holds_the_most_of_both_counts():
    assert 0 < page_holds(MAX_CACHES, MAX_CACHES) < 2**31
    assert page_holds(MAX_CACHES + 1, 0) >= 2**31  # one more cache would not fit


def _refuses_past(mgr, limit: int):
    finished(mgr, seq(0))
    caches = mgr.create_kv_caches([seq(0)] * limit)
    before = introspect.tables(mgr)
    with pytest.raises(gpukv.LogicError, match=f"at most {limit} caches alive"):
        mgr.create_kv_cache(seq(0))
    with pytest.raises(gpukv.LogicError, match=f"at most {limit} caches alive"):
        mgr.create_kv_caches([seq(0), seq(1)])
    after = introspect.tables(mgr)
    assert all(np.array_equal(before[k], after[k]) for k in before)  # refused before anything changed
    assert int(_prefix_pages(mgr)["holders"][0]) == limit
    caches.pop().close()
    gc.collect()  # a closed cache's slot returns when it is collected
    kv = mgr.create_kv_cache(seq(0))
    assert kv.num_committed_tokens == len(seq(0))
    introspect.check_sanity(mgr)


def test_a_manager_refuses_a_cache_past_its_limit_and_changes_nothing():
    _refuses_past(_manager(), MAX_CACHES)  # every cache holding the same two pages


def test_a_slot_whose_giving_back_an_interrupt_lost_is_reclaimed_when_slots_run_out(monkeypatch):
    mgr = _manager()
    kv = mgr.create_kv_cache(seq(0))
    pool, slot = kv._pool, kv._slot
    interrupted = []

    class InterruptedOnce(list):
        def append(self, item):  # the finalizer's one append, cut short before it lands
            pool._released = []
            raise KeyboardInterrupt

    kv.close()
    pool._released = InterruptedOnce()
    monkeypatch.setattr("sys.unraisablehook", lambda u: interrupted.append(u.exc_type))
    del kv
    gc.collect()
    assert interrupted == [KeyboardInterrupt] and pool.serial[slot] >= 0  # lost: the slot still looks taken
    kept = [mgr.create_kv_cache() for _ in range(pool.serial.size - 1)]  # every other slot
    assert slot not in {kv._slot for kv in kept}
    again = mgr.create_kv_cache()  # no listed slot is free: the lost one is found and given back
    assert again._slot == slot and pool.serial.size == len(kept) + 1  # reused, not grown
    introspect.check_sanity(mgr)

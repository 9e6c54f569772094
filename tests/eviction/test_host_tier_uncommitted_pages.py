"""A suspended cache's uncommitted pages on the host tier, a kernel rule once
found wanting against the reference, as scenarios: those pages are held, not
locked, and so migrate to the host tier under pressure like its committed
ones, coming back with their data on resume; an unheld uncommitted page still
dies at once.
"""

import numpy as np

import gpukv
from gpukv import introspect
from tests.support.backends import make_manager

T = 32


def host_of(a):
    return np.asarray(a.copy_to_host() if hasattr(a, "copy_to_host") else (a.get() if hasattr(a, "get") else a))


def words(mgr, level=0):
    """The life cycle's pool at ``level`` as ``int64[pages, T]``, copied to the host."""
    return host_of(mgr.page_memory(0, level)).view(np.int64)


def write_pages(mgr, kv, base):
    """The engine writes ``base + 100 * block + slot`` into every GPU page ``kv`` holds."""
    mem = mgr.page_memory(0)
    pages = kv.page_indices(0)
    view = mem.view(np.int64) if isinstance(mem, np.ndarray) else None
    for o, p in enumerate(pages.tolist()):
        row = base + 100 * o + np.arange(T, dtype=np.int64)
        if view is not None:
            view[p] = row
        else:  # a device pool: write the row's bytes
            mem[p] = row.view(np.uint8)


def expected(base, blocks):
    return np.array([base + 100 * o + np.arange(T) for o in range(blocks)], dtype=np.int64)


def tiered(backend, gpu, host, **kw):
    return make_manager(backend, tokens_per_block=T, layers=[gpukv.Attention()], pages_per_life_cycle=gpu,
                        host_pages_per_life_cycle=host, page_bytes=8 * T, **kw)


# -- a suspended cache's uncommitted pages -----------------------------------------------------
def test_a_suspended_caches_uncommitted_pages_make_room_by_moving_to_the_host(backend):
    mgr = tiered(backend, gpu=4, host=16)
    a = mgr.create_kv_cache()
    assert a.resume() and a.resize(4 * T)  # every GPU page, none committed
    write_pages(mgr, a, 1000)
    a.stop_committing()
    a.suspend()  # held, not locked: its pages may go to the colder level
    b = mgr.create_kv_cache()
    assert b.resume() and b.resize(4 * T)  # was refused: uncommitted pages never moved
    stats = mgr.get_and_reset_eviction_stats()
    assert stats["migrated"] == 4 and stats["dropped"] == 0
    assert (a.page_indices(0) == -1).all()  # on the host now
    introspect.check_sanity(mgr)
    b.close()
    assert a.resume()  # locking brings them back onto the GPU, data and all
    pages = a.page_indices(0)
    assert (pages >= 0).all()
    assert (words(mgr)[pages] == expected(1000, 4)).all()
    introspect.check_sanity(mgr)
    a.close()
    assert introspect.free_pages(mgr, 0) == 4 and introspect.free_pages(mgr, 0, 1) == 16
    introspect.check_sanity(mgr)


def test_a_resume_whose_uncommitted_pages_cannot_come_back_is_refused_and_changes_nothing(backend):
    mgr = tiered(backend, gpu=2, host=2)
    a = mgr.create_kv_cache()
    assert a.resume() and a.resize(2 * T)
    a.suspend()
    hog = mgr.create_kv_cache()
    assert hog.resume() and hog.resize(2 * T)  # a's uncommitted pages migrate; hog locks both GPU pages
    before = introspect.tables(mgr)["pages"].copy()
    assert not a.resume()
    assert a.status is gpukv.KVCacheStatus.SUSPENDED
    assert (introspect.tables(mgr)["pages"] == before).all()
    hog.close()
    assert a.resume() and (a.page_indices(0) >= 0).all()
    a.close()
    introspect.check_sanity(mgr)


def test_without_a_host_tier_a_suspended_caches_uncommitted_pages_stay_and_the_resize_is_refused(backend):
    mgr = tiered(backend, gpu=4, host=0)
    a = mgr.create_kv_cache()
    assert a.resume() and a.resize(4 * T)
    a.suspend()
    b = mgr.create_kv_cache()
    assert b.resume() and not b.resize(T)  # held pages at the last level are never evicted
    b.close()
    assert a.resume() and (a.page_indices(0) >= 0).all()
    a.close()
    introspect.check_sanity(mgr)


def test_an_unheld_uncommitted_page_still_dies_at_once(backend):
    mgr = tiered(backend, gpu=4, host=4)
    a = mgr.create_kv_cache()
    assert a.resume() and a.resize(4 * T)
    a.close()  # nothing committed: the pages die, nothing goes to the host
    assert introspect.free_pages(mgr, 0) == 4 and introspect.free_pages(mgr, 0, 1) == 4
    assert mgr.get_and_reset_eviction_stats()["migrated"] == 0
    introspect.check_sanity(mgr)

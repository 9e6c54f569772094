"""SWA scratch slots serve one step, a kernel rule once found wanting against
the reference, as scenarios: the commit that moves the history past the
scratch blocks gives the slots back, not before, and a rewind is allowed again
afterwards.
"""

import gpukv
from gpukv import introspect
from tests.support.backends import make_manager

T = 32


def scratch_manager(backend, window, rewind=0):
    return make_manager(backend, tokens_per_block=T, layers=[gpukv.Attention(window=window)],
                        swa_scratch_reuse=gpukv.SwaScratchReuse(rewind), pages_per_life_cycle=64)


def test_scratch_slots_go_back_at_the_commit_that_passes_the_scratch_blocks(backend):
    mgr = scratch_manager(backend, 128)
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(1024)
    assert kv.scratch_blocks(0).tolist() == list(range(28))  # stale at 1024
    assert len(kv.scratch_page_indices(0)) == 4  # one window of blocks
    free = introspect.free_pages(mgr, 0)
    kv.commit(list(range(1024)))  # the history moves past every scratch block
    assert kv.scratch_page_indices(0).tolist() == []
    assert kv.scratch_blocks(0).tolist() == []
    assert introspect.free_pages(mgr, 0) >= free + 4
    kv.stop_committing()
    assert kv.resize(1056)
    assert kv.scratch_page_indices(0).tolist() == []
    introspect.check_sanity(mgr)
    kv.close()
    introspect.check_sanity(mgr)


def test_scratch_slots_stay_while_the_history_has_not_passed_every_scratch_block(backend):
    mgr = scratch_manager(backend, 128)
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(1024)
    kv.commit(list(range(27 * T)))  # block 27 is the last scratch block: not passed yet
    assert len(kv.scratch_page_indices(0)) == 4
    kv.commit(list(range(27 * T, 28 * T)))  # now it is
    assert kv.scratch_page_indices(0).tolist() == []
    kv.commit(list(range(28 * T, 1024)))
    kv.close()
    introspect.check_sanity(mgr)


def test_after_the_scratch_slots_went_back_a_rewind_is_allowed(backend):
    mgr = scratch_manager(backend, 64, rewind=64)
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(256)
    assert len(kv.scratch_page_indices(0)) > 0
    kv.commit(list(range(256)))
    assert kv.scratch_page_indices(0).tolist() == []
    assert kv.resize(320)
    assert kv.resize(300)  # shrinking was refused while scratch slots were held
    kv.close()
    introspect.check_sanity(mgr)

"""A manager whose next eviction takes a whole subtree at once: ``n`` cached
requests share a first block that is the first victim, so its death
removes every request's blocks in the launch of one resize (far more records
than the change log has rows, and than that launch otherwise touches)."""

from __future__ import annotations

from gpukv import Attention

from tests.support.backends import make_manager

T = 4

SHARED_VICTIM = [1, 2, 3, 4]  # the first block of every request of requests_sharing_a_victim


def requests_sharing_a_victim(backend, n: int):
    """A manager where ``n`` cached requests of two blocks (T = 4) share a
    first block that is the first eviction victim (priority 0), and 15
    pages are free: the next eviction removes every request's blocks. Its
    events so far are drained."""
    mgr = make_manager(backend, tokens_per_block=T, layers=[Attention()], pages_per_life_cycle=n + 16,
                       max_kv_event_entries=10 * n)
    for i in range(n):
        tokens = SHARED_VICTIM + [10 + i, 5, 6, 7]
        kv = mgr.create_kv_cache(input_tokens=tokens, priority_callback=lambda o, lc: 0 if o == 0 else 100)
        assert kv.resume() and kv.resize(len(tokens), kv.num_committed_tokens)
        kv.commit(tokens[kv.num_committed_tokens:])
        kv.close()
    mgr.get_latest_events()
    return mgr

"""The engine's batched reads: ``page_indices_batch``, ``match_pages``, ``free_pages``.

Each is checked against what the per-cache calls and the page table say,
on states where the answers differ between caches and between blocks.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpukv import Attention, introspect
from gpukv.core.layout import PAGE_FREE

from tests.support.backends import make_manager

T = 4


def three_caches(backend, pages=32):
    """A cache that reuses two blocks of a closed one, one of its own, one
    empty: different lengths, shared and private pages."""
    mgr = make_manager(backend, tokens_per_block=T, layers=[Attention()], pages_per_life_cycle=pages)
    first = mgr.create_kv_cache()
    assert first.resume() and first.resize(3 * T)
    first.commit(list(range(3 * T)))
    first.close()
    reuse = mgr.create_kv_cache(list(range(2 * T)) + [99])
    own = mgr.create_kv_cache()
    empty = mgr.create_kv_cache()
    assert (mgr.resume_batch([reuse, own, empty])).all()
    assert mgr.resize_batch([reuse, own], [4 * T, 5 * T]).all()
    return mgr, [reuse, own, empty]


def test_page_indices_batch_equals_the_per_cache_reads(backend):
    mgr, caches = three_caches(backend)
    indices, offsets = mgr.page_indices_batch(caches)
    assert indices.dtype == np.int32 and offsets.dtype == np.int64
    assert offsets.tolist() == [0, 4, 9, 9]
    for i, kv in enumerate(caches):
        assert indices[offsets[i]:offsets[i + 1]].tolist() == kv.page_indices(0).tolist()
    # From a given block on: the blocks each cache gained since.
    indices, offsets = mgr.page_indices_batch(caches, 0, [2, 4, 0])
    assert offsets.tolist() == [0, 2, 3, 3]
    assert indices[0:2].tolist() == caches[0].page_indices(0)[2:].tolist()
    assert indices[2:3].tolist() == caches[1].page_indices(0)[4:].tolist()
    # Past the end: nothing.
    assert mgr.page_indices_batch(caches[:1], 0, [9])[1].tolist() == [0, 0]
    assert mgr.page_indices_batch([])[1].tolist() == [0]


def test_page_indices_batch_refuses_bad_input(backend):
    mgr, caches = three_caches(backend)
    with pytest.raises(ValueError, match="caches\\[1\\] is caches\\[0\\] again"):
        mgr.page_indices_batch([caches[0], caches[0]])
    with pytest.raises(ValueError, match="first_blocks has 1 entries for 2 caches"):
        mgr.page_indices_batch(caches[:2], 0, [1])
    with pytest.raises(ValueError, match="first_blocks\\[0\\] must be a non-negative int"):
        mgr.page_indices_batch(caches[:1], 0, [-1])
    with pytest.raises(ValueError, match="life_cycle_id must be in 0..0"):
        mgr.page_indices_batch(caches, 1)
    other = make_manager(backend, tokens_per_block=T, layers=[Attention()], pages_per_life_cycle=4)
    with pytest.raises(ValueError, match="belongs to another manager"):
        other.page_indices_batch(caches[:1])


def test_match_pages_gives_each_blocks_page_and_whether_it_is_held(backend):
    mgr, caches = three_caches(backend)
    m = mgr.match_batch([list(range(3 * T))]).to_host()
    rows = m.blocks(0)
    assert len(rows) == 3
    pages, held = mgr.match_pages(rows)
    # Blocks 0 and 1 are the reusing cache's first pages (held); block 2 is cached, unheld.
    assert pages[:2].tolist() == caches[0].page_indices(0)[:2].tolist()
    assert held.tolist() == [True, True, False]
    table = introspect.tables(mgr)["pages"]
    by_index = {int(r["pool_index"]): r for r in table if r["state"] != PAGE_FREE and r["level"] == 0}
    for p, h in zip(pages.tolist(), held.tolist()):
        r = by_index[p]
        assert h == bool(r["holders"] > 0 or r["locks"] > 0)
    caches[0].close()
    assert mgr.match_pages(rows)[1].tolist() == [False, False, False]
    assert mgr.match_pages(np.zeros(0, dtype=np.int64))[0].size == 0
    with pytest.raises(TypeError, match="block_rows must be a 1-D array"):
        mgr.match_pages(np.zeros((1, 1), dtype=np.int64))
    with pytest.raises(ValueError, match="block_rows must be tree block rows"):
        mgr.match_pages([-1])


def test_free_pages_counts_the_free_stack_not_the_evictable(backend):
    mgr, caches = three_caches(backend, pages=32)
    # Held: 4 + 5 pages (two of them the closed cache's, shared); cached: its third.
    assert mgr.free_pages() == 32 - (4 + 5) - 1
    assert mgr.obtainable_pages() == mgr.free_pages() + 1
    mgr.close_batch(caches)
    # The private pages of the closed caches return to the free stack, committed ones stay cached.
    assert mgr.free_pages() == 32 - 3
    assert mgr.obtainable_pages() == 32

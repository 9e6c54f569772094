"""``CacheConfig(stable_pages=True)``: the pages a cache reports are its own
until it closes (docs/semantics.md §2.5.1, the rebase).

An engine whose block tables only ever append (vLLM's worker keeps one per
running request and is told only of new blocks) goes on reading a page it was
given. By default a committed full block that the tree holds already
switches the cache to the tree's page and frees its own, which such an engine
would go on reading after another request took it. Under ``stable_pages``
the duplicate block keeps the cache's own page. The randomised lockstep runs
against the oracle are in ``test_conversations_vs_oracle.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpukv import Attention, ConfigError, introspect

from tests.support.backends import make_manager
from tests.support.engine import Engine

T = 4
PROMPT = list(range(100, 100 + 3 * T))


def twins(backend, stable):
    """Two requests with the same prompt, admitted together (neither can
    reuse the other's KV yet), each writing and committing its own blocks;
    A commits first, so B's blocks are duplicates of blocks in the tree."""
    mgr = make_manager(backend, tokens_per_block=T, layers=[Attention()], pages_per_life_cycle=16,
                       page_bytes=8 * T, stable_pages=stable)
    engine = Engine(mgr)
    a, b = mgr.create_kv_cache(), mgr.create_kv_cache()
    for kv in (a, b):
        assert kv.resume() and kv.resize(len(PROMPT))
    reported = [kv.page_indices(0).copy() for kv in (a, b)]
    for kv in (a, b):
        engine.run(kv, PROMPT, 0, len(PROMPT))
        kv.commit(PROMPT)
    return mgr, engine, a, b, reported


def test_a_duplicate_block_keeps_the_caches_own_page(backend):
    mgr, engine, a, b, (pages_a, pages_b) = twins(backend, stable=True)
    assert list(a.page_indices(0)) == list(pages_a)
    assert list(b.page_indices(0)) == list(pages_b), "B's blocks stay on the pages it was given"
    assert not set(pages_a.tolist()) & set(pages_b.tolist())
    # Both are committed as the same tree blocks, which hold A's pages; B's
    # stay private (uncommitted) and still hold B's own KV.
    assert introspect.committed_blocks(b) == introspect.committed_blocks(a)
    assert [introspect.committed_page_is_linked(a, o, 0) for o in range(3)] == [True] * 3
    assert [introspect.committed_page_is_linked(b, o, 0) for o in range(3)] == [None] * 3
    engine.verify_tree()
    engine.verify_reuse(b, PROMPT)
    introspect.check_sanity(mgr)
    # Closing B frees its private pages; A's stay cached and reusable.
    b.close()
    a.close()
    assert mgr.obtainable_pages() == 16
    assert mgr.probe_reuse(PROMPT + [7]) == len(PROMPT)
    introspect.check_sanity(mgr)


def test_by_default_a_duplicate_block_moves_onto_the_tree_page(backend):
    mgr, engine, a, b, (pages_a, pages_b) = twins(backend, stable=False)
    assert list(b.page_indices(0)) == list(pages_a), "B rebased onto A's pages"
    assert not np.array_equal(b.page_indices(0), pages_b)
    introspect.check_sanity(mgr)


def test_stable_pages_must_be_a_bool():
    with pytest.raises(ConfigError, match="stable_pages"):
        make_manager("cpu", stable_pages=1)

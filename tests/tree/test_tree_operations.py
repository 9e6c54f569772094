"""Scenario tests of the block radix tree on the device tables (docs/semantics.md
§1.3-1.5, §2.1, §2.2, §2.7; scenarios D9 and D10 of §6.3).

Each test builds a tiny tree with ``introspect.make_test_block`` (or
``introspect.add_block``), acts through the tree operations of ``introspect``,
and asserts which rows stay attached, which pages
stay linked and with what coverage, and what the change log recorded. Every
test runs on ``cpu`` and on the CUDA kernels (``cudasim``) via the ``backend``
fixture, and ``check_sanity`` runs after every step.
"""

from __future__ import annotations

import numpy as np
import pytest

import gpukv
from gpukv import Attention, ReuseScope, Ssm, introspect
from gpukv.kernels.sha256 import int64x4_to_digest
from gpukv.core.layout import (
    EV_REMOVED,
    EV_REMOVED_LIFE_CYCLE,
    EV_ROOT_REMOVED,
    EV_CREATED,
    FLAG_ATTACHED,
    FLAG_IN_USE,
    FLAG_ROOT,
    LOG,
    NULL,
    PAGE_COMMITTED,
    PAGE_FREE,
    PAGE_SERIAL,
    block_info,
)
from gpukv.tree import BlockRef

from tests.support.backends import make_manager


# ---------------------------------------------------------------------------
# helpers: read the tables by named field
# ---------------------------------------------------------------------------


def blocks(mgr):
    return introspect.tables(mgr)["blocks"]


def alive(mgr, ref: BlockRef) -> bool:
    """The row still holds this block (attached or orphan)."""
    return introspect.block_exists(mgr, ref)


def attached(mgr, ref: BlockRef) -> bool:
    return alive(mgr, ref) and bool(blocks(mgr)[ref.row]["flags"] & FLAG_ATTACHED)


def parent_row(mgr, ref: BlockRef) -> int:
    return int(blocks(mgr)[ref.row]["parent"])


def children(mgr, row: int) -> list[int]:
    """Child rows in insertion order."""
    b = blocks(mgr)
    out, c = [], int(b[row]["first_child"])
    while c != NULL:
        out.append(c)
        c = int(b[c]["next_sibling"])
    return out


def roots(mgr) -> list[int]:
    b = blocks(mgr)
    return [int(r) for r in np.nonzero((b["flags"] & (FLAG_ROOT | FLAG_IN_USE)) == (FLAG_ROOT | FLAG_IN_USE))[0]]


def rows_in_use(mgr) -> list[int]:
    return [int(r) for r in np.nonzero(blocks(mgr)["flags"] & FLAG_IN_USE)[0]]


def page_state(mgr, page: int) -> int:
    return int(introspect.tables(mgr)["pages"][page]["state"])


def page_block(mgr, page: int) -> int:
    return int(introspect.tables(mgr)["pages"][page]["block"])


def cov(mgr, ref: BlockRef, lc: int) -> int:
    """``cov(b, lc)``: the slot's coverage, 0 for an empty slot."""
    p = introspect.page_of(mgr, ref, lc)
    return 0 if p is None else p[1]


def record_log(mgr) -> list:
    return introspect.record_log(mgr)


def logged(records, kind) -> list:
    """``(key, life_cycle)`` of each log record of ``kind``, in order."""
    if not records:
        return []
    recs = LOG.view(np.array(records, dtype=np.int64))
    return [(int64x4_to_digest(r["digest"]), int(r["life_cycle"])) for r in recs if r["kind"] == kind]


def removed_keys(records) -> list[bytes]:
    return [k for k, _ in logged(records, EV_REMOVED)]


def sane(mgr):
    introspect.check_sanity(mgr)


def empty_tree(mgr):
    """``tree.next == {}``: no root, no block row in use, nothing to match."""
    assert roots(mgr) == []
    assert rows_in_use(mgr) == []
    assert introspect.dump(mgr) == "(empty tree)"


def make_childless_root(mgr, scope=None) -> int:
    """A root with no child yet (``introspect.make_childless_root``)."""
    root = introspect.make_childless_root(mgr, scope)
    assert root in roots(mgr) and children(mgr, root) == []
    return root


# ---------------------------------------------------------------------------
# D9: tail prune with two life cycles (T = 2; lc0 = S(W=64), lc1 = F)
# ---------------------------------------------------------------------------

D9_LAYERS = [Attention(window=64), Attention()]


def d9_tree(backend, first_cov, tip_cov, layers=D9_LAYERS):
    mgr = make_manager(backend, tokens_per_block=2, layers=layers)
    first = introspect.make_test_block(mgr, [1, 2], first_cov)
    tip = introspect.make_test_block(mgr, [3, 4], tip_cov, parent=first)
    sane(mgr)
    (root,) = roots(mgr)
    assert children(mgr, root) == [first.row] and children(mgr, first.row) == [tip.row]
    return mgr, root, first, tip


def test_d9_lc0_empty_lc1_present_keeps_tip(backend):
    mgr, root, first, tip = d9_tree(backend, [0, 2], [0, 2])
    log = record_log(mgr)

    introspect.clear_stale_blocks_after_page_unlink(mgr, tip, 0)

    sane(mgr)
    assert attached(mgr, tip) and parent_row(mgr, tip) == first.row
    assert attached(mgr, first) and parent_row(mgr, first) == root
    assert roots(mgr) == [root] and children(mgr, root) == [first.row]
    # SWA non-sink: only a life-cycle removal, no block leaves the tree
    assert logged(log, EV_REMOVED_LIFE_CYCLE) == [(tip.key, 0)]
    assert removed_keys(log) == []
    assert cov(mgr, tip, 0) == 0 and cov(mgr, tip, 1) == 2
    assert f"B1/2 row {tip.row}" in introspect.dump(mgr)
    # nothing is reusable though: W = 64 needs both S pages
    assert introspect.reuse_match_pages(mgr, [1, 2, 3, 4], 1) == (0, [])


def test_d9_both_empty_prunes_up_to_and_including_the_root(backend):
    mgr, root, first, tip = d9_tree(backend, [0, 0], [0, 0])
    log = record_log(mgr)

    introspect.clear_stale_blocks_after_page_unlink(mgr, tip, 0)

    sane(mgr)
    assert not attached(mgr, tip) and not attached(mgr, first)
    assert logged(log, EV_REMOVED_LIFE_CYCLE) == [(tip.key, 0)]
    assert removed_keys(log) == [tip.key, first.key]  # tail first
    assert len(logged(log, EV_ROOT_REMOVED)) == 1
    empty_tree(mgr)
    assert introspect.reuse_match_pages(mgr, [1, 2, 3, 4], 0) == (0, [])
    assert mgr.probe_reuse([1, 2, 3, 4]) == 0


def test_d9_tip_empty_first_with_pages_prunes_only_the_tip(backend):
    mgr, root, first, tip = d9_tree(backend, [2, 2], [0, 0])
    log = record_log(mgr)

    introspect.clear_stale_blocks_after_page_unlink(mgr, tip, 0)

    sane(mgr)
    assert not alive(mgr, tip)  # no sequence refers to it: its row is recycled
    assert attached(mgr, first) and children(mgr, first.row) == []
    assert roots(mgr) == [root]
    assert removed_keys(log) == [tip.key]
    assert introspect.reuse_match_pages(mgr, [1, 2, 3, 4], 0) == (2, [(introspect.page_of(mgr, first, 0)[0], 2)])


def test_d9_lc1_empty_lc0_present_keeps_tip_with_two_windows(backend):
    """The reference runs this case with the windowed life cycle under id 1; in
    gpukv the kind comes from the table, so lc1 is made a second window."""
    layers = [Attention(window=64), Attention(window=128)]
    mgr, root, first, tip = d9_tree(backend, [2, 0], [2, 0], layers=layers)
    log = record_log(mgr)

    introspect.clear_stale_blocks_after_page_unlink(mgr, tip, 1)

    sane(mgr)
    assert attached(mgr, tip) and parent_row(mgr, tip) == first.row
    assert attached(mgr, first) and parent_row(mgr, first) == root
    assert logged(log, EV_REMOVED_LIFE_CYCLE) == [(tip.key, 1)]
    assert removed_keys(log) == []


def test_d9_lc1_empty_lc0_present_on_full_attention_removes_the_tip(backend):
    """With the D9 config lc1 is full attention, whose cleanup removes the
    start's subtree (§2.7); the tail prune then starts at the detached tip and
    stops, so the page-less-in-lc1 ``first`` stays."""
    mgr, root, first, tip = d9_tree(backend, [2, 0], [2, 0])
    tip_page = introspect.page_of(mgr, tip, 0)[0]
    log = record_log(mgr)

    introspect.clear_stale_blocks_after_page_unlink(mgr, tip, 1)

    sane(mgr)
    assert not alive(mgr, tip)
    assert page_state(mgr, tip_page) == PAGE_FREE  # released with its block: nobody held it
    assert attached(mgr, first) and parent_row(mgr, first) == root
    assert removed_keys(log) == [tip.key]
    assert logged(log, EV_REMOVED_LIFE_CYCLE) == []


# ---------------------------------------------------------------------------
# D10: tree clear (0 life cycles, T = 2)
# ---------------------------------------------------------------------------


def d10_manager(backend):
    # A tree with no life cycles (no slots, no pages). CacheConfig refuses
    # layers=[] (a match would report reuse with no KV behind it), so the
    # config is built past that check: the tree itself needs no life cycle.
    config = gpukv.CacheConfig(tokens_per_block=2, backend=backend)
    object.__setattr__(config, "layers", ())
    for derived in ("life_cycles", "ssm_life_cycle_id"):  # computed once, from the layers it was built with
        config.__dict__.pop(derived, None)
    mgr = gpukv.KVCacheManager(config)
    assert mgr.life_cycles == () and introspect.tables(mgr)["slots"].shape[0] == 0
    return mgr


def chain(mgr, tokens, covs=None, scope=None, parent=None) -> list[BlockRef]:
    T = mgr.tokens_per_block
    out = []
    for i in range(0, len(tokens), T):
        c = covs[i // T] if covs is not None else [0] * len(mgr.life_cycles)
        parent = introspect.make_test_block(mgr, tokens[i:i + T], c, parent=parent, scope=scope)
        out.append(parent)
    return out


def test_d10_clear_an_empty_tree(backend):
    mgr = d10_manager(backend)
    log = record_log(mgr)
    mgr.clear_reusable_blocks()
    empty_tree(mgr)
    assert log == []


def test_d10_clear_a_childless_root(backend):
    mgr = d10_manager(backend)
    make_childless_root(mgr)
    mgr.clear_reusable_blocks()
    empty_tree(mgr)
    sane(mgr)


def test_d10_clear_a_chain_of_three_orphans_every_block(backend):
    mgr = d10_manager(backend)
    a, b, c = chain(mgr, [1, 2, 3, 4, 5, 6])
    sane(mgr)
    log = record_log(mgr)

    mgr.clear_reusable_blocks()

    empty_tree(mgr)
    assert removed_keys(log) == [c.key, b.key, a.key]  # post order, leaves first
    assert not any(alive(mgr, x) for x in (a, b, c))
    sane(mgr)


def test_d10_clear_mixed_populated_and_childless_roots(backend):
    mgr = d10_manager(backend)
    (x,) = chain(mgr, [1, 2])
    make_childless_root(mgr, ReuseScope(lora_id=1))
    (y,) = chain(mgr, [1, 2], scope=ReuseScope(salt=2))
    assert len(roots(mgr)) == 3 and x.key != y.key
    log = record_log(mgr)

    mgr.clear_reusable_blocks()

    empty_tree(mgr)
    assert sorted(removed_keys(log)) == sorted([x.key, y.key])
    sane(mgr)


def test_d10_clear_multiple_branches_then_clear_again(backend):
    mgr = d10_manager(backend)
    a = introspect.make_test_block(mgr, [1, 2], [])
    b = introspect.make_test_block(mgr, [3, 4], [], parent=a)
    c = introspect.make_test_block(mgr, [5], [], parent=a)
    d = introspect.make_test_block(mgr, [7, 8], [])
    (root,) = roots(mgr)
    assert children(mgr, root) == [a.row, d.row] and children(mgr, a.row) == [b.row, c.row]
    sane(mgr)
    log = record_log(mgr)

    mgr.clear_reusable_blocks()

    empty_tree(mgr)
    assert removed_keys(log) == [b.key, c.key, a.key, d.key]
    assert len(logged(log, EV_ROOT_REMOVED)) == 1

    # clearing twice changes nothing and logs nothing
    before = introspect.tables(mgr)
    del log[:]
    mgr.clear_reusable_blocks()
    empty_tree(mgr)
    assert log == []
    after = introspect.tables(mgr)
    for name in ("blocks", "slots", "pages"):
        assert np.array_equal(before[name], after[name]), name


def test_d10_after_clear_the_scope_gets_a_new_root_and_matches(backend):
    mgr = d10_manager(backend)
    chain(mgr, [1, 2, 3, 4])
    mgr.clear_reusable_blocks()
    empty_tree(mgr)
    log = record_log(mgr)

    block = introspect.make_test_block(mgr, [1, 2], [])

    assert len(roots(mgr)) == 1 and children(mgr, roots(mgr)[0]) == [block.row]
    assert [k for k, _ in logged(log, EV_CREATED)] == [block.key]
    m = mgr.match_batch([[1, 2]]).to_host()
    assert m.num_tokens.tolist() == [2] and m.blocks(0).tolist() == [block.row]
    sane(mgr)


# ---------------------------------------------------------------------------
# add_or_get (§2.2) and slot replacement (§2.1); T = 4
# ---------------------------------------------------------------------------

TWO_LC = [Attention(), Attention(window=8)]  # lc0 = F, lc1 = S(W=8)


def test_add_or_get_duplicate_returns_the_existing_block(backend):
    mgr = make_manager(backend, tokens_per_block=4, layers=TWO_LC)
    full, new = introspect.add_block(mgr, [1, 2, 3, 4])
    assert new
    part, new = introspect.add_block(mgr, [5, 6], parent=full)
    assert new
    before = introspect.tables(mgr)

    assert introspect.add_block(mgr, [1, 2, 3, 4]) == (full, False)
    assert introspect.add_block(mgr, [5, 6], parent=full) == (part, False)

    after = introspect.tables(mgr)
    assert np.array_equal(before["blocks"], after["blocks"])
    sane(mgr)


def test_add_or_get_partial_covered_by_siblings_returns_the_first_inserted(backend):
    mgr = make_manager(backend, tokens_per_block=4, layers=TWO_LC)
    part = introspect.make_test_block(mgr, [1, 2, 9], [3, 3])  # partial sibling, inserted first
    full = introspect.make_test_block(mgr, [1, 2, 3, 4], [4, 4])
    (root,) = roots(mgr)
    assert children(mgr, root) == [part.row, full.row]

    # [1, 2] is "useless": both siblings cover it, the first in insertion order wins
    assert introspect.add_block(mgr, [1, 2]) == (part, False)
    # [1, 2, 3] is covered only by the full block: a partial may map to a full block
    assert introspect.add_block(mgr, [1, 2, 3]) == (full, False)
    assert children(mgr, root) == [part.row, full.row]
    sane(mgr)

    # the same siblings in the other order: the full one is found first
    mgr2 = make_manager(backend, tokens_per_block=4, layers=TWO_LC)
    full2 = introspect.make_test_block(mgr2, [1, 2, 3, 4], [4, 4])
    introspect.make_test_block(mgr2, [1, 2, 9], [3, 3])
    assert introspect.add_block(mgr2, [1, 2]) == (full2, False)
    sane(mgr2)


def test_add_or_get_new_longer_block_adopts_the_covered_sibling(backend):
    mgr = make_manager(backend, tokens_per_block=4, layers=TWO_LC)
    short = introspect.make_test_block(mgr, [1, 2], [2, 1])  # F2, S1
    f_short, _ = introspect.page_of(mgr, short, 0)
    s_short, _ = introspect.page_of(mgr, short, 1)
    log = record_log(mgr)

    longer, new = introspect.add_block(mgr, [1, 2, 3])

    assert new
    sane(mgr)
    # the pages moved (same page ids), keeping their coverage; the sibling is detached
    assert introspect.page_of(mgr, longer, 0) == (f_short, 2)
    assert introspect.page_of(mgr, longer, 1) == (s_short, 1)
    assert page_block(mgr, f_short) == longer.row and page_block(mgr, s_short) == longer.row
    assert not alive(mgr, short)
    (root,) = roots(mgr)
    assert children(mgr, root) == [longer.row]
    assert [k for k, _ in logged(log, EV_CREATED)] == [longer.key]
    assert removed_keys(log) == [short.key]
    # the adopted F2 still serves a 2-token prefix of the new block; S1 only 1
    assert mgr.probe_reuse([1, 2]) == 1
    n, pages = introspect.reuse_match_pages(mgr, [1, 2, 3], 0, enable_partial=True)
    assert (n, pages) == (1, [(f_short, 2)])

    # the caller's own wider F page replaces the adopted one; S1 stays
    f_own = introspect.add_page(mgr, longer, 0, 3)
    sane(mgr)
    assert introspect.page_of(mgr, longer, 0) == (f_own, 3)
    assert page_state(mgr, f_short) == PAGE_FREE  # unowned, so it died on replacement
    assert introspect.page_of(mgr, longer, 1) == (s_short, 1)

    # a full block in turn adopts the 3-token one
    full, new = introspect.add_block(mgr, [1, 2, 3, 4])
    assert new and not alive(mgr, longer)
    assert introspect.page_of(mgr, full, 0) == (f_own, 3)
    assert introspect.page_of(mgr, full, 1) == (s_short, 1)
    sane(mgr)


def test_add_or_get_adoption_keeps_a_root_whose_only_child_is_adopted(backend):
    """Insert before detaching (§7.5): the scope's root must survive."""
    mgr = make_manager(backend, tokens_per_block=4, layers=TWO_LC)
    scope = ReuseScope(lora_id=3)
    short = introspect.make_test_block(mgr, [1], [1, 1], scope=scope)
    (root,) = roots(mgr)
    log = record_log(mgr)

    longer = introspect.make_test_block(mgr, [1, 2, 3, 4], [4, 0], scope=scope)

    assert roots(mgr) == [root] and children(mgr, root) == [longer.row]
    assert logged(log, EV_ROOT_REMOVED) == []
    assert not alive(mgr, short)
    assert cov(mgr, longer, 0) == 4 and cov(mgr, longer, 1) == 1
    assert mgr.probe_reuse([1, 2, 3, 4], scope=scope) == 1  # S1 clamps (window 8 covers block 0)
    sane(mgr)


def test_replacement_is_strictly_wider_and_ties_keep_the_incumbent(backend):
    mgr = make_manager(backend, tokens_per_block=4, layers=TWO_LC)
    b = introspect.make_test_block(mgr, [1, 2, 3], [2, 0])
    p2, _ = introspect.page_of(mgr, b, 0)
    before = introspect.tables(mgr)

    assert introspect.add_page(mgr, b, 0, 2) == NULL  # tie: the incumbent stays
    assert introspect.add_page(mgr, b, 0, 1) == NULL  # narrower never replaces
    after = introspect.tables(mgr)
    for name in ("blocks", "slots", "pages"):
        assert np.array_equal(before[name], after[name]), name

    p3 = introspect.add_page(mgr, b, 0, 3)
    assert p3 not in (NULL, p2)
    assert introspect.page_of(mgr, b, 0) == (p3, 3)
    assert page_state(mgr, p2) == PAGE_FREE and page_block(mgr, p2) == NULL
    assert introspect.page_of(mgr, b, 1) is None
    p1 = introspect.add_page(mgr, b, 1, 1)  # an empty slot takes any coverage
    assert introspect.page_of(mgr, b, 1) == (p1, 1)
    sane(mgr)


def test_unlink_page_with_an_expected_page(backend):
    mgr = make_manager(backend, tokens_per_block=4, layers=TWO_LC)
    a = introspect.make_test_block(mgr, [1, 2, 3, 4], [4, 4])
    b = introspect.make_test_block(mgr, [5, 6, 7, 8], [4, 4], parent=a)
    pf, _ = introspect.page_of(mgr, b, 0)
    ps, _ = introspect.page_of(mgr, a, 1)

    # a different expected page: nothing happens
    assert introspect.unlink_page(mgr, b, 0, expected=ps) == NULL
    assert introspect.page_of(mgr, b, 0) == (pf, 4)
    # unlinking only severs the link; no tree cleanup runs (that is page death)
    assert introspect.unlink_page(mgr, b, 0, expected=pf) == pf
    assert introspect.page_of(mgr, b, 0) is None
    assert page_block(mgr, pf) == NULL and page_state(mgr, pf) == PAGE_COMMITTED
    assert attached(mgr, b)
    assert introspect.unlink_page(mgr, b, 0) == NULL  # already empty
    assert mgr.probe_reuse(list(range(1, 9))) == 4
    sane(mgr)


def test_partial_blocks_cannot_be_parents(backend):
    mgr = make_manager(backend, tokens_per_block=4, layers=TWO_LC)
    part = introspect.make_test_block(mgr, [1, 2], [2, 2])
    before = introspect.tables(mgr)

    with pytest.raises(ValueError, match="partial"):
        introspect.add_block(mgr, [3], parent=part)
    with pytest.raises(ValueError, match="partial"):
        introspect.make_test_block(mgr, [3, 4, 5, 6], [4, 4], parent=part)

    after = introspect.tables(mgr)
    for name in ("blocks", "slots", "pages"):
        assert np.array_equal(before[name], after[name]), name
    sane(mgr)


# ---------------------------------------------------------------------------
# page death (§2.7)
# ---------------------------------------------------------------------------


def test_full_attention_page_death_removes_the_subtree(backend):
    mgr = make_manager(backend, tokens_per_block=2, layers=[Attention()])
    a, b, c = chain(mgr, [1, 2, 3, 4, 5, 6], [[2], [2], [2]])
    d = introspect.make_test_block(mgr, [7, 8], [2], parent=a)
    pb, pc = introspect.page_of(mgr, b, 0)[0], introspect.page_of(mgr, c, 0)[0]
    log = record_log(mgr)

    introspect.page_death(mgr, pb)

    sane(mgr)
    assert not alive(mgr, b) and not alive(mgr, c)
    assert page_state(mgr, pb) == PAGE_FREE and page_state(mgr, pc) == PAGE_FREE
    assert attached(mgr, a) and attached(mgr, d) and children(mgr, a.row) == [d.row]
    assert removed_keys(log) == [c.key, b.key]
    assert logged(log, EV_REMOVED_LIFE_CYCLE) == []
    assert mgr.probe_reuse([1, 2, 3, 4, 5, 6]) == 2
    assert mgr.probe_reuse([1, 2, 7, 8]) == 4

    with pytest.raises(ValueError, match="not a committed page"):
        introspect.page_death(mgr, pb)  # it is dead already


def test_swa_non_sink_page_death_removes_only_that_life_cycle(backend):
    # lc0 = S(W=4), lc1 = F; T = 2
    mgr = make_manager(backend, tokens_per_block=2, layers=[Attention(window=4), Attention()])
    a, b, c = chain(mgr, [1, 2, 3, 4, 5, 6], [[2, 2], [2, 0], [2, 0]])
    sb, sc = introspect.page_of(mgr, b, 0)[0], introspect.page_of(mgr, c, 0)[0]
    assert mgr.probe_reuse([1, 2]) == 2
    log = record_log(mgr)

    # an interior block: it loses its S page but keeps its place (it has a child)
    introspect.page_death(mgr, sb)

    sane(mgr)
    assert attached(mgr, b) and children(mgr, b.row) == [c.row]
    assert introspect.page_of(mgr, b, 0) is None and introspect.page_of(mgr, b, 1) is None
    assert page_state(mgr, sb) == PAGE_FREE
    assert logged(log, EV_REMOVED_LIFE_CYCLE) == [(b.key, 0)] and removed_keys(log) == []

    # the leaf: tail pruning detaches it and then the now childless, page-less b
    del log[:]
    introspect.page_death(mgr, sc)

    sane(mgr)
    assert not alive(mgr, c) and not alive(mgr, b)
    assert attached(mgr, a) and children(mgr, a.row) == []
    assert logged(log, EV_REMOVED_LIFE_CYCLE) == [(c.key, 0)]
    assert removed_keys(log) == [c.key, b.key]
    assert introspect.reuse_match_pages(mgr, [1, 2, 3, 4], 1)[0] == 2


def test_sink_block_page_death_behaves_like_full_attention(backend):
    # one S life cycle with W = 2 and one sink block (sink_tokens = 1, T = 2)
    mgr = make_manager(backend, tokens_per_block=2, layers=[Attention(window=2, sink_tokens=1)])
    a, b, c = chain(mgr, [1, 2, 3, 4, 5, 6], [[2], [2], [2]])
    pa, pb = introspect.page_of(mgr, a, 0)[0], introspect.page_of(mgr, b, 0)[0]
    # at 6 the stale range is [1, 2): the sink a and the in-window c are needed
    assert mgr.probe_reuse([1, 2, 3, 4, 5, 6]) == 6
    log = record_log(mgr)

    # a non-sink block's death is only a life-cycle removal
    introspect.page_death(mgr, pb)
    sane(mgr)
    assert attached(mgr, b) and logged(log, EV_REMOVED_LIFE_CYCLE) == [(b.key, 0)]
    assert mgr.probe_reuse([1, 2, 3, 4, 5, 6]) == 6  # b is stale at 6: not needed

    # the sink block's death removes the whole subtree, and the root with it
    del log[:]
    introspect.page_death(mgr, pa)
    sane(mgr)
    assert removed_keys(log) == [c.key, b.key, a.key]
    assert logged(log, EV_REMOVED_LIFE_CYCLE) == []
    empty_tree(mgr)


def test_ssm_page_death_removes_only_that_life_cycle(backend):
    mgr = make_manager(backend, tokens_per_block=2, layers=[Attention(), Ssm()], commit_min_snapshot=True)
    a, b = chain(mgr, [1, 2, 3, 4], [[2, 2], [2, 2]])
    mb = introspect.page_of(mgr, b, 1)[0]
    assert mgr.probe_reuse([1, 2, 3, 4]) == 4
    log = record_log(mgr)

    introspect.page_death(mgr, mb)

    sane(mgr)
    assert attached(mgr, b) and cov(mgr, b, 0) == 2 and cov(mgr, b, 1) == 0
    assert logged(log, EV_REMOVED_LIFE_CYCLE) == [(b.key, 1)] and removed_keys(log) == []
    assert mgr.probe_reuse([1, 2, 3, 4]) == 2  # the SSM endpoint falls back to a's checkpoint


def test_remove_subtree_is_post_order(backend):
    mgr = make_manager(backend, tokens_per_block=2, layers=[Attention()])
    a = introspect.make_test_block(mgr, [1, 2], [2])
    b = introspect.make_test_block(mgr, [3, 4], [2], parent=a)
    c = introspect.make_test_block(mgr, [5, 6], [2], parent=b)
    d = introspect.make_test_block(mgr, [7], [1], parent=a)
    e = introspect.make_test_block(mgr, [9, 9], [2])
    log = record_log(mgr)

    introspect.remove_subtree(mgr, a)

    sane(mgr)
    assert removed_keys(log) == [c.key, b.key, d.key, a.key]
    assert attached(mgr, e) and len(roots(mgr)) == 1
    assert not any(alive(mgr, x) for x in (a, b, c, d))


# ---------------------------------------------------------------------------
# row and page recycling
# ---------------------------------------------------------------------------


def test_rows_and_pages_are_recycled_across_insert_and_clear(backend):
    rounds = 40 if backend == "cpu" else 6
    mgr = make_manager(backend, tokens_per_block=2, layers=[Attention(), Attention(window=4)], pages_per_life_cycle=16)
    rows0 = blocks(mgr).shape[0]
    used = None
    for i in range(rounds):
        # two branches of 4 blocks each (8 rows + the root), fresh tokens every round
        base = 1000 * i
        assert introspect.insert_sequence(mgr, [base + k for k in range(8)]) == 4
        assert introspect.insert_sequence(mgr, [base + k for k in range(4)] + [7, 7, 7, 7]) == 4
        sane(mgr)
        assert mgr.probe_reuse([base + k for k in range(8)]) == 8
        rows = rows_in_use(mgr)
        assert len(rows) == 7  # root + 4 + 2 (the two branches share 2 blocks)
        used = rows if used is None else used
        assert rows == used  # the same rows every round
        mgr.clear_reusable_blocks()
        empty_tree(mgr)
        assert (introspect.tables(mgr)["pages"]["state"] == PAGE_FREE).all()
    # 40 rounds x 7 rows would exceed the initial table on cpu had rows leaked
    assert blocks(mgr).shape[0] == rows0


def test_rows_are_recycled_across_make_and_close_test_block(backend):
    rounds = 30 if backend == "cpu" else 5
    mgr = make_manager(backend, tokens_per_block=2, layers=[Attention(window=2), Attention()], pages_per_life_cycle=4)
    rows0 = blocks(mgr).shape[0]
    for i in range(rounds):
        a = introspect.make_test_block(mgr, [i, 1], [2, 2])
        b = introspect.make_test_block(mgr, [i, 2], [1, 0], parent=a)
        sane(mgr)
        introspect.close_test_block(mgr, b)  # S death, then tail prune of the page-less leaf
        assert not alive(mgr, b) and attached(mgr, a)
        introspect.close_test_block(mgr, a)  # S death (a keeps F), then F death removes a
        sane(mgr)
        empty_tree(mgr)
    assert blocks(mgr).shape[0] == rows0
    assert (introspect.tables(mgr)["pages"]["state"] == PAGE_FREE).all()


def test_tables_grow_when_more_rows_are_live_and_keep_the_tree(backend):
    T = 2
    mgr = make_manager(backend, tokens_per_block=T, layers=[Attention()], pages_per_life_cycle=400)
    rows0 = blocks(mgr).shape[0]
    n_blocks = rows0 + 10  # more live blocks than the initial table holds
    seq = list(range(n_blocks * T))
    assert introspect.insert_sequence(mgr, seq) == n_blocks
    assert blocks(mgr).shape[0] > rows0
    sane(mgr)
    assert mgr.probe_reuse(seq) == len(seq)
    assert mgr.probe_reuse(seq[:T * 7 + 1]) == T * 7 + 1  # partial on the next full block


def test_a_block_row_keeps_its_token_count_and_flags_in_one_word(backend):
    """A row's ``info`` packs its token count and its flags; the introspected
    view decodes both: a root (no tokens), a full block, a partial block
    under it, and the rows a page death frees (flags cleared)."""
    mgr = make_manager(backend, tokens_per_block=4)
    full = introspect.make_test_block(mgr, [1, 2, 3, 4], [4])
    part = introspect.make_test_block(mgr, [5, 6], [2], parent=full)
    (root,) = roots(mgr)
    b = blocks(mgr)
    for row, n, flags in ((root, 0, FLAG_IN_USE | FLAG_ATTACHED | FLAG_ROOT),
                          (full.row, 4, FLAG_IN_USE | FLAG_ATTACHED), (part.row, 2, FLAG_IN_USE | FLAG_ATTACHED)):
        assert (b[row]["num_tokens"], b[row]["flags"], b[row]["info"]) == (n, flags, block_info(n, flags))
    mgr._tree.page_death(introspect.page_of(mgr, full, 0)[0])  # full attention: the subtree and the root go
    b = blocks(mgr)
    assert [int(b[r]["flags"]) for r in (root, full.row, part.row)] == [0, 0, 0]
    assert rows_in_use(mgr) == []
    sane(mgr)


def test_a_page_serial_counts_its_rows_allocations_and_wraps_at_32_bits(backend):
    """A page's serial tells it from a later page in the same row (a planned
    drop names pages by row and serial). It counts the row's allocations in
    32 bits that wrap: past 2**31 - 1 comes -2**31, and a plan made for
    that page still drops it while a stale one does not."""
    mgr = make_manager(backend, tokens_per_block=4)
    mgr._tables.pages[:, PAGE_SERIAL] = 2**31 - 1  # every row allocated 2**31 times before
    block = introspect.make_test_block(mgr, [1, 2, 3, 4], [4])
    page, _ = introspect.page_of(mgr, block, 0)
    (serial,) = mgr._tables.page_serials([page]).tolist()
    assert serial == -2**31
    mgr._tree.plan_drops([(page, serial)] * 2)
    mgr._tree.drop_planned([(page, serial + 1)])  # names a later page of the row: nothing happens
    mgr._tree.drop_planned([(page, serial)])
    assert page_state(mgr, page) == PAGE_COMMITTED  # one plan is left
    mgr._tree.drop_planned([(page, serial)])
    assert page_state(mgr, page) == PAGE_FREE
    sane(mgr)


def test_plans_of_pages_that_died_are_forgotten_when_the_table_doubles(backend):
    """Planned drops are counted on the host by (page row, serial). A plan
    never carried out keeps its entry while its page lives (it still holds
    the page back from the other plans' drops); once the page died, the
    entry goes when the table next doubles."""
    mgr = make_manager(backend, tokens_per_block=4, pages_per_life_cycle=128)
    tree = mgr._tree
    blocks = [introspect.make_test_block(mgr, [i, i, i, i], [4]) for i in range(70)]
    pages = [introspect.page_of(mgr, b, 0)[0] for b in blocks]
    keys = list(zip(pages, mgr._tables.page_serials(pages).tolist()))
    tree.plan_drops(keys[:60])  # plans never carried out
    for p in pages[:50]:
        tree.page_death(p)  # ... of pages that die meanwhile
    tree.plan_drops(keys[60:])  # the table reaches 64 entries: the dead pages' go
    assert set(tree._plans) == set(keys[50:])
    tree.drop_planned(keys[50:])  # the live pages' last plans: they die
    assert all(page_state(mgr, p) == PAGE_FREE for p in pages[50:])
    assert not tree._plans
    sane(mgr)

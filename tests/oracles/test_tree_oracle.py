"""Scenario tests of the plain-Python oracle (tests/support/oracle.py) against the worked
examples of docs/semantics.md. Each test sets up a tree, acts, and
asserts concrete numbers; every test ends with ``check_sanity``."""

from __future__ import annotations

import hashlib

import pytest

from tests.support.oracle import FULL, SSM, SWA, Block, LifeCycle, Oracle, block_key, root_key, scope_bytes

F = LifeCycle(FULL)


def S(window: int, sinks: int = 0) -> LifeCycle:
    return LifeCycle(SWA, window, sinks)


M = LifeCycle(SSM)
DEFAULT = (None, None)


def build_chain(o: Oracle, tokens: list, covs: list, scope=DEFAULT) -> list[Block]:
    """Blocks for ``tokens`` cut into chunks of T, chunk ``i`` with coverages
    ``covs[i]`` (one per life cycle, 0 = no page)."""
    parent = o.root(scope)
    blocks = []
    for i, start in enumerate(range(0, len(tokens), o.T)):
        parent = o.make_block(parent, tokens[start : start + o.T], covs[i])
        blocks.append(parent)
    return blocks


def removed(*blocks: Block) -> tuple:
    return ("removed", [b.key for b in blocks])


# ---------------------------------------------------------------------------
# §1.2 keys, §1.5 stale range
# ---------------------------------------------------------------------------


def test_keys_follow_the_hash_chain():
    assert scope_bytes(DEFAULT) == b"\x00"
    assert scope_bytes((7, 11)) == b"\x03" + (7).to_bytes(8, "little") + (11).to_bytes(8, "little")
    assert scope_bytes((None, 11)) == b"\x02" + (11).to_bytes(8, "little")
    assert scope_bytes((123, None)) == b"\x01" + (123).to_bytes(8, "little")
    assert root_key(DEFAULT) == hashlib.sha256(b"\x00").digest()
    assert len({root_key(s) for s in [DEFAULT, (123, None), (None, 123), (123, 456), (456, 123)]}) == 5

    digest = hashlib.sha256(b"image").digest()
    parent = root_key(DEFAULT)
    expected = hashlib.sha256(parent + (1).to_bytes(4, "little") + digest + (2**31 - 1).to_bytes(4, "little")).digest()
    assert block_key(parent, [1, digest, 2**31 - 1]) == expected

    o = Oracle(2, [])
    b, is_new = o.add_or_get(o.root(None), [1, digest])
    assert is_new and b.key == hashlib.sha256(parent + (1).to_bytes(4, "little") + digest).digest()
    with pytest.raises(ValueError):
        o.add_or_get(o.root(None), [2**31])


def test_stale_range_has_the_plus_one_and_clamps_negative_floor_division():
    T = 32
    assert F.stale_range(100, T) == (0, 0)
    assert M.stale_range(100, T) == (0, 3)
    # (h + 1 - W) // T is negative here; Python floors it, max(start, .) clamps it
    assert S(64).stale_range(0, T) == (0, 0)
    assert S(64).stale_range(10, T) == (0, 0)
    assert (10 + 1 - 64) // T == -2
    # D6: at 127 with W = 64 blocks 0 and 1 are stale
    assert S(64).stale_range(127, T) == (0, 2)
    # the +1: at h = 95, W = 33 block 1 (tokens 32..63) is not yet stale
    assert S(33).stale_range(95, T) == (0, 1)
    assert S(33).stale_range(96, T) == (0, 2)
    # P1: at 80 with W = 16, [0, 2); at 160, [0, 4)
    assert S(16).stale_range(80, T) == (0, 2)
    assert S(16).stale_range(160, T) == (0, 4)
    # D1 (T = 8, W = 8): at 24 the window starts at block 2
    assert S(8).stale_range(24, 8) == (0, 2)
    # sinks: start = min(ceil(h / T), sinks)
    assert S(8, 1).stale_range(0, 8) == (0, 0)
    assert S(8, 1).stale_range(5, 8) == (1, 1)
    assert S(8, 1).stale_range(40, 8) == (1, 4)
    # W = 1 at a block boundary: every block is stale
    assert S(1).stale_range(8, 4) == (0, 2)
    assert S(1).stale_range(7, 4) == (0, 1)


# ---------------------------------------------------------------------------
# D9: tail prune with two life cycles (§2.7)
# ---------------------------------------------------------------------------


def d9_tree():
    o = Oracle(2, [S(64, 0), F])
    root = o.root(None)
    first, _ = o.add_or_get(root, [1, 2])
    tip, _ = o.add_or_get(first, [3, 4])
    return o, root, first, tip


def test_d9_lc0_empty_lc1_present_keeps_tip():
    o, root, first, tip = d9_tree()
    o.replace_page(tip, 1, o.new_page(1, 2))
    o.clear_stale_blocks_after_page_unlink(tip, 0)
    assert tip.prev is first and first.next == {tip.key: tip}
    assert first.prev is root and o.next == {root.key: root}
    assert o.events == [("removed_lc", tip.key, 0)]
    o.check_sanity()


def test_d9_both_empty_prunes_to_the_root():
    o, root, first, tip = d9_tree()
    o.clear_stale_blocks_after_page_unlink(tip, 0)
    assert tip.prev is None and first.prev is None
    assert root.next == {} and o.next == {}
    assert o.events == [("removed_lc", tip.key, 0), removed(tip), removed(first)]
    o.check_sanity()


def test_d9_lc1_empty_lc0_present_keeps_tip_newer_rule():
    # The reference test passes the windowed life-cycle object together with id 1;
    # the newer rule checks every slot, so tip (which still has lc0) stays.
    o, root, first, tip = d9_tree()
    o.replace_page(tip, 0, o.new_page(0, 2))
    o.clear_stale_blocks_after_page_unlink(tip, 1, life_cycle=S(64, 0))
    assert tip.prev is first and first.prev is root and root.key in o.next
    assert o.events == [("removed_lc", tip.key, 1)]
    o.check_sanity()


def test_d9_via_page_death():
    # SWA non-sink death only removes the life cycle; full-attention death removes
    # the subtree and (Python variant) the tail prune stops at the detached start,
    # so the page-less `first` stays.
    o, root, first, tip = d9_tree()
    s_page, f_page = o.new_page(0, 2), o.new_page(1, 2)
    o.replace_page(tip, 0, s_page)
    o.replace_page(tip, 1, f_page)
    o.page_death(s_page)
    assert not s_page.alive and s_page.block is None and tip.slots[0] is None
    assert tip.prev is first
    o.page_death(f_page)
    assert tip.prev is None and first.prev is root and first.next == {}
    assert o.events == [("removed_lc", tip.key, 0), removed(tip)]
    o.check_sanity()


# ---------------------------------------------------------------------------
# D10: tree clear (§2.7)
# ---------------------------------------------------------------------------


def test_d10_clear_cases():
    # an empty tree
    o = Oracle(2, [])
    o.clear()
    assert o.next == {} and o.events == []

    # a childless root
    o = Oracle(2, [])
    o.root(None)
    o.clear()
    assert o.next == {} and o.events == []

    # a chain of 3: every block ends up an orphan
    o = Oracle(2, [])
    a, b, c = build_chain(o, [1, 2, 3, 4, 5, 6], [[], [], []])
    o.clear()
    assert o.next == {} and all(x.prev is None for x in (a, b, c))
    assert o.events == [removed(c, b, a)]

    # mixed populated and childless roots
    o = Oracle(2, [])
    (x,) = build_chain(o, [1, 2], [[]])
    o.root((1, None))
    (y,) = build_chain(o, [1, 2], [[]], scope=(None, 2))
    o.clear()
    assert o.next == {} and x.prev is None and y.prev is None
    assert o.events == [removed(x), removed(y)]

    # multiple branches
    o = Oracle(2, [])
    root = o.root(None)
    a, _ = o.add_or_get(root, [1, 2])
    b, _ = o.add_or_get(a, [3, 4])
    c, _ = o.add_or_get(a, [5])
    d, _ = o.add_or_get(root, [7, 8])
    o.clear()
    assert o.next == {} and all(z.prev is None for z in (a, b, c, d))
    assert o.events == [removed(b, c, a), removed(d)]

    # clearing twice
    o.clear()
    assert o.next == {} and len(o.events) == 2
    o.check_sanity()


def test_d10_new_root_after_clear_matches():
    o = Oracle(2, [])
    old_root = o.root(None)
    o.add_or_get(old_root, [1, 2])
    o.clear()
    assert o.next == {}
    new_root = o.root(None)
    assert new_root is not old_root and old_root.prev is None
    block, is_new = o.add_or_get(new_root, [1, 2])
    assert is_new
    m = o.match(None, [1, 2], partial=False)
    assert m.blocks == [block] and m.num_tokens == 2
    o.check_sanity()


# ---------------------------------------------------------------------------
# §2.2 add_or_get
# ---------------------------------------------------------------------------


def test_add_or_get_duplicate_returns_existing():
    o = Oracle(4, [F])
    root = o.root(None)
    b, is_new = o.add_or_get(root, [1, 2, 3, 4])
    assert is_new
    assert o.add_or_get(root, [1, 2, 3, 4]) == (b, False)
    p, is_new = o.add_or_get(b, [5, 6])
    assert is_new and p.ordinal == 1
    assert o.add_or_get(b, [5, 6]) == (p, False)
    assert o.events == []
    o.check_sanity()


def test_add_or_get_useless_partial_returns_first_covering_sibling():
    o = Oracle(4, [F])
    root = o.root(None)
    a, _ = o.add_or_get(root, [1, 2, 9, 9])  # full
    b, _ = o.add_or_get(root, [1, 2, 3])  # partial, not a prefix of a
    assert list(root.next.values()) == [a, b]
    assert o.add_or_get(root, [1, 2]) == (a, False)  # both cover; the first wins
    assert o.add_or_get(root, [1, 2, 3]) == (b, False)  # exact duplicate
    assert o.add_or_get(root, [1, 2, 9]) == (a, False)
    assert list(root.next.values()) == [a, b]

    o2 = Oracle(4, [F])
    r2 = o2.root(None)
    b2, _ = o2.add_or_get(r2, [1, 2, 3])
    a2, _ = o2.add_or_get(r2, [1, 2, 9, 9])
    assert o2.add_or_get(r2, [1, 2]) == (b2, False)
    # a full block is never useless: it is added next to a partial one
    c2, is_new = o2.add_or_get(r2, [1, 2, 3, 4])
    assert is_new and b2.prev is None  # ... and covers (replaces) it
    assert list(r2.next.values()) == [a2, c2]
    o.check_sanity()
    o2.check_sanity()


def test_add_or_get_adopts_covered_sibling_keeping_coverage():
    o = Oracle(4, [F, S(4)])
    root = o.root(None)
    partial = o.make_block(root, [1, 2], [2, 2])
    f2, s2 = partial.slots
    longer, is_new = o.add_or_get(root, [1, 2, 3, 4])
    assert is_new
    # inserted before the sibling was detached: the root survived
    assert o.root(None) is root and root.prev is o
    assert root.next == {longer.key: longer}
    assert partial.prev is None and partial.slots == [None, None]
    assert longer.slots == [f2, s2] and f2.block is longer and s2.block is longer
    assert (f2.coverage, s2.coverage) == (2, 2)
    assert o.events == [removed(partial)]
    # the caller's own wider F page replaces the adopted F2; S2 stays
    f4 = o.new_page(0, 4)
    o.replace_page(longer, 0, f4)
    assert longer.slots == [f4, s2] and f2.block is None and not f2.alive
    assert o.reuse_match_pages(None, [1, 2, 3], 1, partial=True) == (2, [(s2.id, 2)])
    assert o.reuse_match_pages(None, [1, 2, 3, 4], 0) == (2, [(f4.id, 4)])
    o.check_sanity()


def test_add_or_get_partial_covers_shorter_partial():
    o = Oracle(8, [F])
    root = o.root(None)
    b3 = o.make_block(root, [1, 2, 3], [3])
    b5, is_new = o.add_or_get(root, [1, 2, 3, 4, 5])
    assert is_new and b3.prev is None and b5.cov(0) == 3
    assert o.events == [removed(b3)]
    o.check_sanity()


def test_add_or_get_rejects_bad_parents_and_token_counts():
    o = Oracle(4, [F])
    root = o.root(None)
    p, _ = o.add_or_get(root, [1, 2])
    with pytest.raises(AssertionError):
        o.add_or_get(p, [3])  # partial blocks cannot be parents
    with pytest.raises(ValueError):
        o.add_or_get(root, [])
    with pytest.raises(ValueError):
        o.add_or_get(root, [1, 2, 3, 4, 5])
    full, _ = o.add_or_get(root, [1, 2, 3, 4])  # covers p: p becomes an orphan
    with pytest.raises((AssertionError, ValueError)):
        o.add_or_get(p, [5])
    o.check_sanity()


# ---------------------------------------------------------------------------
# §2.1 replace_page
# ---------------------------------------------------------------------------


def test_replace_page_strictly_wider_and_tie_keeps_incumbent():
    o = Oracle(4, [F])
    (b,) = build_chain(o, [1, 2, 3, 4], [[2]])
    incumbent = b.slots[0]
    assert o.can_replace_page(b, 0, 3)
    assert not o.can_replace_page(b, 0, 2)
    assert not o.can_replace_page(b, 0, 1)
    with pytest.raises(AssertionError):
        o.replace_page(b, 0, o.new_page(0, 2))
    assert b.slots[0] is incumbent
    # a held old page survives unlinked; a droppable one dies at once
    o.hold(incumbent)
    wider = o.new_page(0, 3)
    o.replace_page(b, 0, wider)
    assert incumbent.alive and incumbent.block is None and b.slots[0] is wider
    o.release(incumbent)
    assert not incumbent.alive
    widest = o.new_page(0, 4)
    o.replace_page(b, 0, widest)
    assert not wider.alive and wider.block is None
    assert b.prev is not None and o.events == []  # no tree cleanup ran
    o.check_sanity()


def test_unlink_page_with_expected():
    o = Oracle(4, [F])
    (b,) = build_chain(o, [1, 2, 3, 4], [[4]])
    page = b.slots[0]
    other = o.new_page(0, 4)
    assert o.unlink_page(b, 0, expected=other) is None and b.slots[0] is page
    assert o.unlink_page(b, 0, expected=page) is page
    assert page.block is None and b.slots[0] is None
    assert o.unlink_page(b, 0) is None
    o.page_death(page)
    o.check_sanity()


# ---------------------------------------------------------------------------
# §2.3 walk
# ---------------------------------------------------------------------------


def test_walk_partial_lands_on_longer_full_block():
    o = Oracle(4, [F])
    b0, b1 = build_chain(o, list(range(8)), [[4], [4]])
    assert o.walk(None, [0, 1, 2, 3, 4, 5], partial=True) == [(b0, 4), (b1, 2)]
    assert o.walk(None, [0, 1, 2, 3, 4, 5], partial=False) == [(b0, 4)]
    assert o.walk(None, [0, 1, 2, 3, 4, 9, 9, 9, 9], partial=True) == [(b0, 4), (b1, 1)]
    assert o.walk(None, [0, 1, 2, 3, 9], partial=True) == [(b0, 4)]
    assert o.walk((1, None), [0, 1, 2, 3], partial=True) == []
    assert o.match(None, [0, 1, 2, 3, 4, 5], partial=True).num_tokens == 6


def test_walk_partial_lands_on_shorter_partial_block_and_stops():
    o = Oracle(4, [F])
    b0, p = build_chain(o, [0, 1, 2, 3, 4, 5], [[4], [2]])
    assert o.walk(None, list(range(12)), partial=True) == [(b0, 4), (p, 2)]
    assert o.walk(None, list(range(12)), partial=False) == [(b0, 4)]


def test_walk_exact_key_match_of_short_tail_without_partial():
    o = Oracle(4, [F])
    b0, p = build_chain(o, [0, 1, 2, 3, 4, 5], [[4], [2]])
    assert o.walk(None, [0, 1, 2, 3, 4, 5], partial=False) == [(b0, 4), (p, 2)]
    assert o.walk(None, [0, 1, 2, 3, 4], partial=False) == [(b0, 4)]
    assert o.walk(None, [0, 1, 2, 3, 4], partial=True) == [(b0, 4), (p, 1)]


def test_walk_ties_keep_first_in_insertion_order():
    o = Oracle(4, [F])
    root = o.root(None)
    a, _ = o.add_or_get(root, [5, 6, 7, 8])
    b, _ = o.add_or_get(root, [5, 6, 9, 9])
    assert o.walk(None, [5, 6, 1, 1], partial=True) == [(a, 2)]
    c, _ = o.add_or_get(root, [5, 6, 1, 2])  # strictly longer prefix wins
    assert o.walk(None, [5, 6, 1, 1], partial=True) == [(c, 3)]
    assert o.walk(None, [4], partial=True) == []  # every prefix is 0
    o.check_sanity()


def test_walk_searches_even_with_many_children():
    o = Oracle(4, [F])
    root = o.root(None)
    for i in range(40):
        o.add_or_get(root, [i, 0, 0, 0])
    target, _ = o.add_or_get(root, [99, 1, 2, 3])
    assert len(root.next) == 41
    assert o.walk(None, [99, 1, 7, 7], partial=True) == [(target, 2)]


# ---------------------------------------------------------------------------
# §2.4 prune and match
# ---------------------------------------------------------------------------


def test_prune_ssm_exact_checkpoint_inside_a_full_block():
    o = Oracle(32, [F, M])
    (b0,) = build_chain(o, list(range(32)), [[32, 20]])
    m = o.match(None, list(range(32)), partial=False)
    assert m.path == [(b0, 20)] and m.num_tokens == 20
    assert m.num_tokens_before_hybrid_pruning == 32
    assert m.num_tokens_before_pruning == 32 and m.num_lookup_tokens == 32
    # a lookup shorter than the checkpoint cannot end there
    assert o.match(None, list(range(19)), partial=True).num_tokens == 0
    assert o.match(None, list(range(19)), partial=True).num_tokens_before_hybrid_pruning == 19


def test_prune_ssm_takes_the_latest_usable_checkpoint():
    # M6: B0{F32, M32}, B1{F32, M32}
    o = Oracle(32, [F, M])
    p = list(range(96))
    build_chain(o, p[:64], [[32, 32], [32, 32]])
    m = o.match(None, p[:48], partial=True)
    assert (m.num_tokens, m.num_tokens_before_hybrid_pruning, m.num_tokens_before_pruning) == (32, 48, 48)
    m = o.match(None, p[:64], partial=True)
    assert (m.num_tokens, m.num_tokens_before_hybrid_pruning) == (64, 64)
    assert o.match(None, p[:96], partial=False).num_tokens == 64
    # no checkpoint at all: nothing
    o2 = Oracle(32, [F, M])
    build_chain(o2, p[:64], [[32, 0], [32, 0]])
    m = o2.match(None, p[:64], partial=False)
    assert (m.num_tokens, m.num_tokens_before_hybrid_pruning) == (0, 64)


def test_prune_full_attention_clamps_inside_a_block_or_cuts_at_the_boundary():
    o = Oracle(4, [F])
    build_chain(o, list(range(8)), [[4], [2]])
    assert o.match(None, list(range(8)), partial=False).num_tokens == 6

    o = Oracle(4, [F])
    b0, b1 = build_chain(o, list(range(8)), [[4], [0]])
    m = o.match(None, list(range(8)), partial=False)
    assert m.num_tokens == 4 and m.blocks == [b0]

    o = Oracle(4, [F])
    build_chain(o, list(range(8)), [[0], [4]])
    assert o.match(None, list(range(8)), partial=False).num_tokens == 0

    o = Oracle(4, [F])
    build_chain(o, list(range(8)), [[3], [4]])  # the first violation in ascending order
    assert o.match(None, list(range(8)), partial=False).num_tokens == 3


def test_prune_swa_skips_stale_blocks():
    o = Oracle(4, [S(4)])
    b0, b1, b2 = build_chain(o, list(range(12)), [[0], [1], [4]])
    # at 12: stale [0, 2) -> only B2 is needed
    assert o.match(None, list(range(12)), partial=False).num_tokens == 12
    # at 11 (partial on B2): stale (11 + 1 - 4) // 4 = 2 -> B2 covers 4 >= 3
    assert o.match(None, list(range(11)), partial=True).num_tokens == 11
    # at 10: stale (10 + 1 - 4) // 4 = 1 -> B1 is live again, cov 1 < 4 -> clamp to 5;
    # at 5: stale (5 + 1 - 4) // 4 = 0 -> B0 needed, cov 0 -> 0
    assert o.match(None, list(range(10)), partial=True).num_tokens == 0
    # at 8 (exact end of B1): stale (8 + 1 - 4) // 4 = 1 -> B1 needed, cov 1 < 4 -> clamp 5,
    # at 5: stale (5 + 1 - 4) // 4 = 0 -> B0 needed, cov 0 -> 0
    assert o.match(None, list(range(8)), partial=False).num_tokens == 0

    # W = 6 at 12: stale (12 + 1 - 6) // 4 = 1 -> B1 needed (cov 1 < 4): clamp to 5;
    # at 5: (5 + 1 - 6) // 4 = 0 -> B0 needed, no page -> 0
    o = Oracle(4, [S(6)])
    build_chain(o, list(range(12)), [[0], [1], [4]])
    assert o.match(None, list(range(12)), partial=False).num_tokens == 0
    # with B0 covered: at 5 needs B0 (4 >= 4) and B1 (1 >= 1) -> 5
    o = Oracle(4, [S(6)])
    build_chain(o, list(range(12)), [[4], [1], [4]])
    assert o.match(None, list(range(12)), partial=False).num_tokens == 5


def test_prune_swa_sink_blocks_are_always_needed():
    o = Oracle(4, [S(4, 1)])
    build_chain(o, list(range(12)), [[0], [0], [4]])
    assert o.match(None, list(range(12)), partial=False).num_tokens == 0
    o = Oracle(4, [S(4, 1)])
    build_chain(o, list(range(12)), [[4], [0], [4]])
    assert o.match(None, list(range(12)), partial=False).num_tokens == 12


def test_prune_w1_at_a_block_boundary_needs_no_swa_page():
    o = Oracle(4, [S(1)])
    b0, b1 = build_chain(o, list(range(8)), [[0], [0]])
    m = o.match(None, list(range(8)), partial=False)
    assert m.num_tokens == 8 and m.blocks == [b0, b1]
    # at 7 block 1 is live and has no page: cut to 4, where nothing is live
    assert o.match(None, list(range(7)), partial=True).num_tokens == 4


def test_prune_fixed_point_restarts_after_a_clamp():
    # lc0 = SWA W=4, lc1 = full. At 12 SWA needs only B2 (fine), full clamps B2 to 10.
    # Restarting: at 10 SWA needs B1 (no S page) -> cut to 4; at 4 SWA needs B0 (S4).
    # A single pass would have answered 10.
    o = Oracle(4, [S(4), F])
    build_chain(o, list(range(12)), [[4, 4], [0, 4], [4, 2]])
    m = o.match(None, list(range(12)), partial=False)
    assert m.num_tokens == 4
    assert m.num_tokens_before_hybrid_pruning == 4 and m.num_tokens_before_pruning == 12


def test_prune_fixed_point_reruns_ssm_after_an_attention_clamp():
    # SSM picks 8 (B1 M4), full clamps to 6, SSM then needs an earlier checkpoint: B0 at 4.
    o = Oracle(4, [F, M])
    build_chain(o, list(range(8)), [[4, 4], [2, 4]])
    m = o.match(None, list(range(8)), partial=False)
    assert (m.num_tokens, m.num_tokens_before_hybrid_pruning, m.num_tokens_before_pruning) == (4, 6, 8)


def test_prune_is_exposed_directly():
    o = Oracle(4, [F])
    b0, b1 = build_chain(o, list(range(8)), [[4], [3]])
    raw = [(b0, 4), (b1, 4)]
    assert o.prune(raw, None) == [(b0, 4), (b1, 3)]
    assert raw == [(b0, 4), (b1, 4)]  # not mutated
    assert o.prune([], None) == []


# ---------------------------------------------------------------------------
# §2.4 backoff
# ---------------------------------------------------------------------------


def test_backoff_trims_the_raw_path():
    o = Oracle(4, [F])
    b0, b1 = build_chain(o, list(range(8)), [[4], [4]])
    raw = [(b0, 4), (b1, 1)]
    assert o.back_off(raw, 1) == [(b0, 4)]  # a whole tail block is popped
    assert o.back_off(raw, 2) == [(b0, 3)]
    assert o.back_off(raw, 5) == []
    assert o.back_off(raw, 9) == []
    assert o.back_off(raw, 0) == raw
    m = o.match(None, list(range(8)), partial=False, backoff=3)
    assert (m.num_tokens, m.num_tokens_before_pruning, m.num_lookup_tokens) == (5, 8, 8)
    assert o.match(None, [0, 1], partial=True, backoff=3).num_tokens == 0


def test_backoff_p5_rechecks_swa_at_the_final_endpoint():
    """P5: T = 32, lc0 = F, lc1 = S with W = 33, backoff 1."""
    o = Oracle(32, [F, S(33)])
    base = list(range(48))
    boundary = base + list(range(1000, 1048))
    # step 1: run_turn(base, refcheck) -> B0{F32, S32}, B1/16{F16, S16}
    b0, b1_16 = build_chain(o, base, [[32, 32], [16, 16]])
    # step 2: raw 48 backed off to 47; at 47 S needs B0 and B1: 32 >= 32 and 16 >= 15
    m = o.match(None, boundary, partial=True, backoff=1)
    assert (m.num_tokens, m.num_tokens_before_pruning) == (47, 48)
    # the commit creates full B1, adopting F16/S16; own F32 replaces F16; S16 stays
    b1, is_new = o.add_or_get(b0, boundary[32:64])
    assert is_new and b1_16.prev is None and b1.cov(0) == 16 and b1.cov(1) == 16
    o.replace_page(b1, 0, o.new_page(0, 32))
    b2 = o.make_block(b1, boundary[64:96], [32, 32])
    assert o.events == [removed(b1_16)]
    # step 3: reuse_match_pages(base, S) last coverage = 16
    n, pages = o.reuse_match_pages(None, base, 1, partial=True)
    assert n == 48 and pages[-1][1] == 16
    # step 4: raw 96, backed off to 95; at 95 S needs B1, B2 (stale [0, 1));
    # B1's S16 < 32 -> clamp to 48; at 48 everything is covered. Not backed off again.
    m = o.match(None, boundary, partial=True, backoff=1)
    assert (m.num_tokens, m.num_tokens_before_pruning) == (48, 96)
    assert m.blocks == [b0, b1]
    # without backoff the full 96 are reusable (S needs only B2 at 96)
    assert o.match(None, boundary, partial=True).num_tokens == 96
    assert b2.cov(1) == 32
    o.check_sanity()


def test_d1_probe_long_after_dropping_its_window_page():
    """D1 step 5: T = 8, lc0 = S(W=8), lc1 = F; after the B2 S page dies, probe(long)
    is 16 for backoff 0 and 1."""
    o = Oracle(8, [S(8), F])
    long = list(range(24))
    b0, b1, b2 = build_chain(o, long, [[8, 8], [8, 8], [8, 8]])
    o.page_death(b2.slots[0])  # SWA non-sink: only a removed_lc event
    assert b2.prev is b1 and o.events == [("removed_lc", b2.key, 0)]
    assert o.match(None, long, partial=True, backoff=0).num_tokens == 16
    assert o.match(None, long, partial=True, backoff=1).num_tokens == 16
    o.check_sanity()


# ---------------------------------------------------------------------------
# §2.7 removal
# ---------------------------------------------------------------------------


def test_remove_subtree_is_post_order_with_one_event():
    o = Oracle(2, [F])
    root = o.root(None)
    a, _ = o.add_or_get(root, [1, 2])
    b, _ = o.add_or_get(a, [3, 4])
    d, _ = o.add_or_get(b, [5, 6])
    c, _ = o.add_or_get(a, [7, 8])
    e, _ = o.add_or_get(root, [9, 9])
    o.remove_subtree(a)
    assert o.events == [removed(d, b, c, a)]
    assert root.next == {e.key: e} and o.next == {root.key: root}
    o.remove_subtree(e)
    assert o.next == {} and root.prev is None
    o.check_sanity()


def test_full_and_sink_page_death_remove_the_subtree():
    o = Oracle(2, [S(2, 1), F])
    b0, b1, b2 = build_chain(o, [1, 2, 3, 4, 5, 6], [[2, 2], [2, 2], [2, 2]])
    o.page_death(b0.slots[0])  # a sink block's SWA page
    assert o.next == {} and all(b.prev is None for b in (b0, b1, b2))
    assert o.events == [removed(b2, b1, b0)]
    # orphans keep their pages until released; droppable ones then die
    held = b1.slots[1]
    o.hold(held)
    o.release_orphans()
    assert held.alive and held.block is None
    assert all(not p.alive for p in o.pages.values() if p is not held)
    o.release(held)
    assert not held.alive
    assert o.events == [removed(b2, b1, b0)]
    o.check_sanity()


def test_tail_prune_requires_all_slots_empty_and_stops_at_pages():
    o = Oracle(2, [S(2), M])
    b0, b1, b2 = build_chain(o, [1, 2, 3, 4, 5, 6], [[2, 0], [0, 0], [0, 2]])
    o.page_death(b2.slots[1])  # SSM: removed_lc, then prune b2 and the page-less b1
    assert b2.prev is None and b1.prev is None and b0.prev is not None
    assert o.events == [("removed_lc", b2.key, 1), removed(b2), removed(b1)]
    o.check_sanity()


def test_check_sanity_catches_corruption():
    o = Oracle(4, [F])
    (b,) = build_chain(o, [1, 2, 3, 4], [[4]])
    o.check_sanity()
    b.slots[0].coverage = 5
    with pytest.raises(AssertionError):
        o.check_sanity()
    b.slots[0].coverage = 4
    o.check_sanity()
    b.slots[0].alive = False
    with pytest.raises(AssertionError):
        o.check_sanity()


# ---------------------------------------------------------------------------
# Self-consistency on random trees (§3 invariants, §3.15 pruning guarantee)
# ---------------------------------------------------------------------------

LIFE_CYCLE_SETS = [[F], [F, S(3)], [S(2, 1), F, M], [S(1)], [F, M], [S(5), S(9)]]


def assert_reusable(o: Oracle, path: list) -> None:
    """§3.15: at the endpoint every live attention page covers its matched part,
    and the SSM checkpoint is exactly the last block's matched count."""
    n_tok = o.num_matched_tokens(path)
    for lc, life_cycle in o.attention_life_cycles():
        sb, se = life_cycle.stale_range(n_tok, o.T)
        for i in list(range(sb)) + list(range(se, len(path))):
            block, n = path[i]
            assert block.cov(lc) >= n
    if o.ssm_lc is not None and path:
        block, n = path[-1]
        assert block.cov(o.ssm_lc) == n


@pytest.mark.parametrize("seed", range(30))
def test_random_operations_keep_invariants(seed):
    import random

    rng = random.Random(seed)
    T = rng.choice([2, 3, 4])
    o = Oracle(T, LIFE_CYCLE_SETS[seed % len(LIFE_CYCLE_SETS)])
    scopes = [DEFAULT, (1, None)]
    sequences = [[rng.randrange(3) for _ in range(rng.randrange(1, 4 * T))] for _ in range(6)]
    for _ in range(60):
        op = rng.random()
        attached = list(o.attached_blocks().values())
        if op < 0.5:  # commit-like: a chain with random coverage per block
            seq, scope = rng.choice(sequences), rng.choice(scopes)
            parent = o.root(scope)
            for start in range(0, len(seq), T):
                chunk = seq[start : start + T]
                covs = [rng.choice([0, rng.randint(1, len(chunk))]) for _ in o.life_cycles]
                block = o.make_block(parent, chunk, covs)
                if not block.is_full or len(chunk) < T:
                    break
                parent = block
        elif op < 0.75 and attached:  # a page dies
            pages = [p for b in attached for p in b.slots if p is not None]
            if pages:
                o.page_death(rng.choice(pages))
        elif op < 0.85 and attached:
            o.remove_subtree(rng.choice(attached))
        elif op < 0.88:
            o.clear()
        o.release_orphans()
        o.check_sanity()
        for _ in range(3):
            seq = rng.choice(sequences)
            query = seq[: rng.randint(0, len(seq))] + [rng.randrange(3) for _ in range(rng.randrange(3))]
            m = o.match(rng.choice(scopes), query, partial=rng.random() < 0.7, backoff=rng.choice([0, 0, 1, 2]))
            assert m.num_tokens <= m.num_tokens_before_hybrid_pruning <= m.num_tokens_before_pruning <= m.num_lookup_tokens
            assert m.num_tokens == o.num_matched_tokens(m.path) and m.blocks == [b for b, _ in m.path]
            assert all(n == T for _, n in m.path[:-1]) and all(n >= 1 for _, n in m.path)
            assert_reusable(o, m.path)

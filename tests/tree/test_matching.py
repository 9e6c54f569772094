"""Scenario tests of reuse matching (docs/semantics.md §2.3 walk, §2.4 prune and
backoff), on ``cpu`` and on the CUDA kernels (``cudasim``).

Each scenario builds a tiny tree with ``introspect.make_test_block`` (pages of
chosen per-life-cycle coverage), runs a batch of lookups and asserts the
numbers. ``check_batch`` then cross-checks every batch the same way:
``match_batch`` equals ``probe_reuse`` per request, the diagnostics are
ordered, the three input kinds (lists, ``(flat, offsets)``, ``TokenSequence``)
agree, and ``introspect.reuse_match_pages`` agrees on the blocks and pages.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpukv import Attention, ReuseScope, Ssm, introspect
from gpukv.core.layout import CNT_SERIAL, FLAG_ROOT
from gpukv.tree import BlockRef

from tests.support.backends import make_manager


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def chain(mgr, tokens, covs, scope=None, parent=None) -> list[BlockRef]:
    """Blocks for ``tokens`` cut into chunks of T; chunk ``i`` gets the
    per-life-cycle coverages ``covs[i]`` (0 = no page)."""
    T = mgr.tokens_per_block
    out = []
    for i in range(0, len(tokens), T):
        parent = introspect.make_test_block(mgr, tokens[i:i + T], covs[i // T], parent=parent, scope=scope)
        out.append(parent)
    return out


def rows(*blocks) -> list[int]:
    return [b.row for b in blocks]


def slot(mgr, row: int, lc: int):
    """``None | (page, coverage)`` of a block row's slot."""
    s = introspect.tables(mgr)["slots"][row * len(mgr.life_cycles) + lc]
    return None if s["page"] == -1 else (int(s["page"]), int(s["coverage"]))


def check_batch(mgr, lookups, expected=None, scopes=None, expected_rows=None):
    """Run one batch and cross-check it every way; return the host result.

    ``expected``: the num_tokens per request; ``expected_rows``: the matched
    block rows per request (both optional)."""
    m = mgr.match_batch(lookups, scopes).to_host()
    B = len(lookups)
    assert len(m) == B and m.block_offsets.shape == (B + 1,) and m.block_offsets[0] == 0
    assert m.block_ids.shape == (int(m.block_offsets[-1]),)
    per_scope = scopes if isinstance(scopes, (list, tuple)) else [scopes] * B
    T = mgr.tokens_per_block
    for i, toks in enumerate(lookups):
        n = int(m.num_tokens[i])
        # one request alone gives the same answer
        assert mgr.probe_reuse(toks, per_scope[i]) == n, f"request {i}"
        # num_tokens <= before_hybrid <= before_pruning <= lookup
        assert m.num_lookup_tokens[i] == len(toks)
        assert n <= m.num_tokens_before_hybrid_pruning[i] <= m.num_tokens_before_pruning[i] <= len(toks), f"request {i}"
        # the matched blocks are the ones the reusable prefix needs
        assert len(m.blocks(i)) == -(-n // T), f"request {i}"
        if expected_rows is not None:
            assert m.blocks(i).tolist() == expected_rows[i], f"request {i}"
        # reuse_match_pages runs the same match (no backoff) and reads those
        # rows' slots (one life cycle per request, in turn, to keep it quick)
        if mgr.config.reuse_match_backoff == 0:
            lc = i % len(mgr.life_cycles)
            got = introspect.reuse_match_pages(mgr, toks, lc, per_scope[i], enable_partial=mgr.config.enable_partial_reuse)
            assert got == (n, [slot(mgr, int(r), lc) for r in m.blocks(i)]), f"request {i}, life cycle {lc}"
    if expected is not None:
        assert m.num_tokens.tolist() == list(expected)

    # the same batch as (flat, offsets) and as registered TokenSequences
    arrays = [np.asarray(t, dtype=np.int32) for t in lookups]
    flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int32)
    offsets = np.zeros(B + 1, dtype=np.int64)
    np.cumsum([a.size for a in arrays], out=offsets[1:])
    seqs = [mgr.token_sequence(t) for t in lookups]
    try:
        for other in (mgr.match_batch((flat, offsets), scopes).to_host(), mgr.match_batch(seqs, scopes).to_host()):
            for f in ("num_tokens", "num_lookup_tokens", "num_tokens_before_pruning",
                      "num_tokens_before_hybrid_pruning", "block_offsets", "block_ids"):
                assert np.array_equal(getattr(other, f), getattr(m, f)), f
    finally:
        for s in seqs:
            s.release()
    return m


def diag(m, i) -> tuple[int, int, int, int]:
    """``(num_tokens, before_hybrid, before_pruning, lookup)`` of request ``i``."""
    return (int(m.num_tokens[i]), int(m.num_tokens_before_hybrid_pruning[i]),
            int(m.num_tokens_before_pruning[i]), int(m.num_lookup_tokens[i]))


F_ONLY = [Attention()]
B0 = [1, 2, 3, 4]  # T = 4 block contents used throughout
B1 = [5, 6, 7, 8]
B2 = [9, 10, 11, 12]


# ---------------------------------------------------------------------------
# §2.3 the walk
# ---------------------------------------------------------------------------


def test_exact_key_match_of_a_short_tail_without_partial_reuse(backend):
    mgr = make_manager(backend, tokens_per_block=4, layers=F_ONLY, enable_partial_reuse=False)
    a = introspect.make_test_block(mgr, B0, [4])
    tail = introspect.make_test_block(mgr, [5, 6], [2], parent=a)

    check_batch(
        mgr,
        [B0 + [5, 6], B0 + [5], B0 + [5, 6, 7], [1, 2], B0],
        expected=[6, 4, 4, 0, 4],
        expected_rows=[rows(a, tail), rows(a), rows(a), [], rows(a)],
    )


def test_partial_match_lands_on_longer_and_on_shorter_blocks(backend):
    mgr = make_manager(backend, tokens_per_block=4, layers=F_ONLY)
    a = introspect.make_test_block(mgr, B0, [4])
    full = introspect.make_test_block(mgr, B1, [4], parent=a)
    tail = introspect.make_test_block(mgr, [5, 9], [2], parent=a)  # diverges from `full` at its 2nd token

    m = check_batch(
        mgr,
        [
            B0 + [5, 6],  # 2 of the full block (longer than the chunk)
            B0 + [5, 6, 7, 0],  # a full chunk, 3 tokens in common with the full block
            B0 + [5, 9, 7, 8],  # a full chunk landing on the 2-token partial block
            B0 + [5, 9, 7],  # a short chunk landing on the shorter partial block
            B0 + [5, 0],  # 1 token in common with both: the first inserted wins
            [1, 2],  # a partial match on the first block under the root
        ],
        expected=[6, 7, 6, 6, 5, 2],
        expected_rows=[rows(a, full), rows(a, full), rows(a, tail), rows(a, tail), rows(a, full), rows(a)],
    )
    # the walk stops after a partial match; nothing was pruned here
    assert m.num_tokens_before_pruning.tolist() == m.num_tokens.tolist()
    # reuse_match_pages without partial matching stops at the full-key part
    assert introspect.reuse_match_pages(mgr, B0 + [5, 6], 0) == (4, [slot(mgr, a.row, 0)])
    assert introspect.reuse_match_pages(mgr, B0 + [5, 6], 0, enable_partial=True) == (
        6, [slot(mgr, a.row, 0), slot(mgr, full.row, 0)])


# Block serials are 32 bits that wrap: the two siblings that tie are created
# on either side of the signed and of the unsigned wrap too.
@pytest.mark.parametrize("first_serial", [0, 2**31 - 3, 2**32 - 3])
def test_partial_match_ties_keep_the_first_in_insertion_order(backend, first_serial):
    lookup = B0 + [5, 6, 3, 3]
    for order in ((0, 1), (1, 0)):
        mgr = make_manager(backend, tokens_per_block=4, layers=F_ONLY)
        mgr._tables.counters[CNT_SERIAL] = first_serial  # the root, the parent, then the two siblings
        a = introspect.make_test_block(mgr, B0, [4])
        kids = {}
        for k in order:
            kids[k] = introspect.make_test_block(mgr, [5, 6, 1 + k, 1 + k], [4], parent=a)
        first = kids[order[0]]
        check_batch(mgr, [lookup], expected=[6], expected_rows=[rows(a, first)])

        # only a strictly longer common prefix displaces the first
        longer = introspect.make_test_block(mgr, [5, 6, 3, 0], [4], parent=a)
        check_batch(mgr, [lookup], expected=[7], expected_rows=[rows(a, longer)])


def test_partial_search_with_more_than_32_children(backend):
    """The reference skips the partial search at >= 32 children (§2.3, §7.17);
    gpukv deliberately searches every child, however many."""
    mgr = make_manager(backend, tokens_per_block=4, layers=F_ONLY)
    for k in range(40):
        assert introspect.insert_sequence(mgr, [k, 1, 2, 3]) == 1
    blocks = introspect.tables(mgr)["blocks"]
    (root,) = np.nonzero(blocks["flags"] & FLAG_ROOT)[0]
    kids, c = [], int(blocks[root]["first_child"])
    while c != -1:
        kids.append(c)
        c = int(blocks[c]["next_sibling"])
    assert len(kids) == 40 and blocks[kids[0]]["prev_sibling"] == kids[-1]  # the first child names the last

    m = check_batch(mgr, [[39, 1, 9, 9], [35, 1, 2], [39, 1, 2, 3], [40, 1]], expected=[2, 3, 4, 0])
    assert m.blocks(0).tolist() == [kids[39]] and m.blocks(1).tolist() == [kids[35]]


def test_the_row_after_a_match_is_taken_only_when_it_is_the_child(backend):
    """The walk first tries the row after the last matched one (a chain's
    blocks are mostly created in consecutive rows). That row must be the
    child itself: here the row after ``a`` holds the next block's tokens
    under another parent, and the row after ``b`` a 2-token block whose
    row, padded with zeros, equals the next query block; the key lookup
    (and the partial match) must decide instead."""
    mgr = make_manager(backend, tokens_per_block=4, layers=F_ONLY)
    p = introspect.make_test_block(mgr, B2, [4])
    a = introspect.make_test_block(mgr, B0, [4])
    elsewhere = introspect.make_test_block(mgr, B1, [4], parent=p)  # B1's tokens, another parent
    b = introspect.make_test_block(mgr, B1, [4], parent=a)
    short = introspect.make_test_block(mgr, [7, 7], [2], parent=b)  # its row holds 7, 7, 0, 0
    x = introspect.make_test_block(mgr, B0, [4], parent=b)
    y = introspect.make_test_block(mgr, B1, [4], parent=x)  # a run: x, then the row after it
    assert [elsewhere.row, short.row, y.row] == [a.row + 1, b.row + 1, x.row + 1]
    check_batch(
        mgr,
        [B0 + B1, B0 + B1 + [7, 7, 0, 0], B0 + B1 + B0 + B1, B2 + B1, B0 + B1 + [7, 7]],
        expected=[8, 10, 16, 8, 10],
        expected_rows=[rows(a, b), rows(a, b, short), rows(a, b, x, y), rows(p, elsewhere), rows(a, b, short)],
    )


def test_empty_lookups_and_an_empty_batch(backend):
    mgr = make_manager(backend, tokens_per_block=4, layers=F_ONLY)
    introspect.make_test_block(mgr, B0, [4])
    check_batch(mgr, [[], B0, []], expected=[0, 4, 0])
    m = mgr.match_batch([]).to_host()
    assert len(m) == 0 and m.block_offsets.tolist() == [0] and m.block_ids.size == 0


# ---------------------------------------------------------------------------
# §2.4 pruning: attention
# ---------------------------------------------------------------------------


def test_full_attention_clamps_inside_a_block_or_cuts_at_its_start(backend):
    mgr = make_manager(backend, tokens_per_block=4, layers=F_ONLY)
    a = introspect.make_test_block(mgr, B0, [4])
    clamp = introspect.make_test_block(mgr, B1, [2], parent=a)  # F2 on a full block
    introspect.make_test_block(mgr, [5, 6, 0, 0], [0], parent=a)  # a full block with no F page
    introspect.make_test_block(mgr, B2, [4], parent=clamp)

    m = check_batch(
        mgr,
        [B0 + B1 + B2, B0 + B1, B0 + [5, 6], B0 + [5, 6, 0, 0], B0 + [5, 6, 0]],
        expected=[6, 6, 6, 4, 4],
        expected_rows=[rows(a, clamp), rows(a, clamp), rows(a, clamp), rows(a), rows(a)],
    )
    assert diag(m, 0) == (6, 6, 12, 12)
    assert diag(m, 3) == (4, 4, 8, 8)
    assert introspect.reuse_match_pages(mgr, B0 + B1, 0) == (6, [slot(mgr, a.row, 0), slot(mgr, clamp.row, 0)])
    assert slot(mgr, clamp.row, 0)[1] == 2


def test_swa_skips_stale_blocks(backend):
    # T = 4, one S life cycle with W = 5: at 12 the stale range is [0, (13-5)//4) = [0, 2)
    mgr = make_manager(backend, tokens_per_block=4, layers=[Attention(window=5)])
    a, b, c = chain(mgr, B0 + B1 + B2, [[1], [0], [4]])  # a: a stale partial page; b: none

    m = check_batch(mgr, [B0 + B1 + B2, B0 + B1 + B2[:3]], expected=[12, 1])
    # a's partial page and b's missing one do not constrain the match at 12
    assert m.blocks(0).tolist() == rows(a, b, c)
    assert introspect.reuse_match_pages(mgr, B0 + B1 + B2, 0) == (12, [slot(mgr, a.row, 0), None, slot(mgr, c.row, 0)])
    # at 11 the range is [0, 1): b is needed and has no page -> cut to 4; at 4
    # nothing is stale and a's S1 clamps -> 1
    assert diag(m, 1) == (1, 1, 11, 11)
    assert m.blocks(1).tolist() == rows(a)


def test_swa_window_covering_every_block_needs_every_page(backend):
    # W = 9: at 12 the stale range is [0, 1); b has no page -> cut to 4; at 4
    # block 0 is needed for 4 tokens and covers 1 -> clamp to 1.
    mgr = make_manager(backend, tokens_per_block=4, layers=[Attention(window=9)])
    a, b, c = chain(mgr, B0 + B1 + B2, [[1], [0], [4]])
    m = check_batch(mgr, [B0 + B1 + B2], expected=[1], expected_rows=[rows(a)])
    assert diag(m, 0) == (1, 1, 12, 12)


def test_swa_window_of_one_at_a_block_boundary_needs_no_page(backend):
    mgr = make_manager(backend, tokens_per_block=4, layers=[Attention(window=1)])
    a, b = chain(mgr, B0 + B1, [[0], [0]])
    check_batch(
        mgr,
        # 8: the stale range is [0, 2), every block; 7: block 1 (3 tokens) is
        # live and has no page -> 4, where the range is [0, 1) again
        [B0 + B1, B0 + B1[:3], B0, B0[:3]],
        expected=[8, 4, 4, 0],
        expected_rows=[rows(a, b), rows(a), rows(a), []],
    )


def test_swa_sink_blocks_are_always_needed(backend):
    lookup = B0 + B1 + B2
    # sink_tokens = 1 at T = 4: one sink block; W = 4: at 12 the range is [1, 2)
    layers = [Attention(window=4, sink_tokens=1)]
    cases = [
        ([[0], [4], [4]], 0),  # the sink block has no page: nothing is reusable
        ([[4], [0], [4]], 12),  # the page-less block 1 is stale: skipped
        ([[2], [0], [4]], 2),  # a partial sink page clamps inside block 0
    ]
    for covs, expected in cases:
        mgr = make_manager(backend, tokens_per_block=4, layers=layers)
        chain(mgr, lookup, covs)
        check_batch(mgr, [lookup], expected=[expected])
    # sink_tokens = 5: two sink blocks; block 1 is then needed too
    mgr = make_manager(backend, tokens_per_block=4, layers=[Attention(window=4, sink_tokens=5)])
    chain(mgr, lookup, [[4], [0], [4]])
    check_batch(mgr, [lookup], expected=[4])


def test_fixed_point_restarts_after_a_clamp(backend):
    """§7.7: after F clamps to 10, the S stale range at 10 is [0, 1), so block
    1 (no S page) is needed now: cut to 4. Without the restart the answer
    would be 10."""
    mgr = make_manager(backend, tokens_per_block=4, layers=[Attention(), Attention(window=5)])
    a, b, c = chain(mgr, B0 + B1 + B2, [[4, 4], [4, 0], [2, 4]])
    m = check_batch(mgr, [B0 + B1 + B2, B0 + B1 + B2[:2]], expected=[4, 4], expected_rows=[rows(a), rows(a)])
    assert diag(m, 0) == (4, 4, 12, 12)


# ---------------------------------------------------------------------------
# §2.4 pruning: SSM (exact checkpoints)
# ---------------------------------------------------------------------------

SSM_LAYERS = [Attention(), Ssm()]  # lc0 = F, lc1 = M


def ssm_sizes(backend):
    """T = 32 (the M6 numbers) on cpu, a T = 4 copy on the simulator."""
    return [4, 32] if backend == "cpu" else [4]


def test_ssm_m6_before_hybrid_pruning(backend):
    for T in ssm_sizes(backend):
        mgr = make_manager(backend, tokens_per_block=T, layers=SSM_LAYERS, commit_min_snapshot=True)
        p = list(range(1, 3 * T + 1))
        a, b = chain(mgr, p[:2 * T], [[T, T], [T, T]])  # B0{F, M}, B1{F, M} as kv1 of M5 leaves them
        half = T + T // 2
        m = check_batch(mgr, [p[:T], p[:half], p[:2 * T], p[:3 * T]], expected=[T, T, 2 * T, 2 * T])
        # M6: attention alone allows 48 (a partial 16 on B1); B1's checkpoint is at 32 > 16
        assert diag(m, 1) == (T, half, half, half)
        assert diag(m, 2) == (2 * T, 2 * T, 2 * T, 2 * T)
        assert diag(m, 3) == (2 * T, 2 * T, 2 * T, 3 * T)
        assert m.blocks(1).tolist() == rows(a)


def test_ssm_checkpoint_is_exact_and_the_latest_usable_wins(backend):
    for T in ssm_sizes(backend):
        c = T // 2  # a checkpoint inside a full block
        mgr = make_manager(backend, tokens_per_block=T, layers=SSM_LAYERS, commit_min_snapshot=True)
        p = list(range(1, 2 * T + 1))
        a, b = chain(mgr, p, [[T, T], [T, c]])
        m = check_batch(
            mgr,
            # a full match of B1 ends at its checkpoint, not at 2T nor back at T;
            # a match of c - 1 tokens of B1 is before it: back to B0's checkpoint
            [p, p[:T + c], p[:T + c - 1]],
            expected=[T + c, T + c, T],
            expected_rows=[rows(a, b), rows(a, b), rows(a)],
        )
        assert diag(m, 0) == (T + c, 2 * T, 2 * T, 2 * T)
        n, pages = introspect.reuse_match_pages(mgr, p, 1)
        assert n == T + c and [x[1] for x in pages] == [T, c]


def test_ssm_fixed_point_reruns_the_checkpoint_search_after_a_clamp(backend):
    # B1's F2 clamps the endpoint to 6, B1's checkpoint (3) is past that, so the
    # SSM search falls back to B0's checkpoint at 4. Attention alone allows 6.
    mgr = make_manager(backend, tokens_per_block=4, layers=SSM_LAYERS, commit_min_snapshot=True)
    a, b, c = chain(mgr, B0 + B1 + B2, [[4, 4], [2, 3], [4, 4]])
    m = check_batch(mgr, [B0 + B1 + B2], expected=[4], expected_rows=[rows(a)])
    assert diag(m, 0) == (4, 6, 12, 12)


def test_ssm_no_checkpoint_before_the_fork_means_no_reuse(backend):
    # M9 step 2: only R1's last block has a checkpoint, past the fork of R3
    mgr = make_manager(backend, tokens_per_block=4, layers=SSM_LAYERS, commit_min_snapshot=True)
    chain(mgr, B0 + B1 + B2, [[4, 0], [4, 0], [4, 4]])
    r3 = B0 + B1 + [0, 0, 0, 0]
    m = check_batch(mgr, [r3, B0 + B1 + B2], expected=[0, 12])
    assert diag(m, 0) == (0, 8, 8, 12)


def test_ssm_m15_partial_snapshot_respects_the_partial_reuse_setting(backend):
    for T in ssm_sizes(backend):
        h = T // 2
        p = list(range(1, 2 * T + 1))
        for partial, expected_full in ((False, T), (True, T + h)):
            mgr = make_manager(backend, tokens_per_block=T, layers=SSM_LAYERS, commit_min_snapshot=True,
                               enable_partial_reuse=partial)
            a = introspect.make_test_block(mgr, p[:T], [T, T])
            tail = introspect.make_test_block(mgr, p[T:T + h], [h, h], parent=a)  # B1/16{F16, M16}
            check_batch(mgr, [p, p[:T + h]], expected=[expected_full, T + h])
            n, pages = introspect.reuse_match_pages(mgr, p[:T + h], 1)
            assert n == T + h and pages[-1] == slot(mgr, tail.row, 1) and pages[-1][1] == h


# ---------------------------------------------------------------------------
# backoff: trim the raw path, then prune, and not again
# ---------------------------------------------------------------------------


def p5_tree(backend, T):
    """P5 after ``run_turn(boundary)``: B0{F, S}, full B1{F, S at T/2},
    B2{F, S}; S has W = T + 1; backoff 1."""
    mgr = make_manager(backend, tokens_per_block=T, layers=[Attention(), Attention(window=T + 1)], reuse_match_backoff=1)
    boundary = list(range(1, 3 * T + 1))
    blocks = chain(mgr, boundary, [[T, T], [T, T // 2], [T, T]])
    return mgr, boundary, blocks


def test_backoff_p5_rechecks_swa_at_the_final_endpoint(backend):
    for T in ssm_sizes(backend):  # 32 (the P5 numbers) on cpu, 4 on the simulator
        mgr, boundary, (b0, b1, b2) = p5_tree(backend, T)
        h = T // 2
        base = boundary[:T + h]
        m = check_batch(mgr, [boundary, base, boundary[:2 * T], boundary[:1]],
                        expected=[T + h, T + h - 1, T + h, 0])
        # raw 96 -> 95; S needs B1 whole at 95 (16 < 32): clamp to 48; not 47
        assert diag(m, 0) == (T + h, T + h, 3 * T, 3 * T)
        assert m.blocks(0).tolist() == rows(b0, b1)
        # raw 48 (a partial 16 on the full B1) -> 47; B1's S16 covers 15
        assert diag(m, 1) == (T + h - 1, T + h - 1, T + h, T + h)
        # a match shorter than the backoff gives 0
        assert diag(m, 3) == (0, 0, 1, 1)
        # reuse_match_pages uses no backoff
        n, pages = introspect.reuse_match_pages(mgr, base, 1, enable_partial=True)
        assert n == T + h and [c for _, c in pages] == [T, h]


def test_backoff_before_the_ssm_checkpoint_search(backend):
    # raw 8 -> 7; B1's checkpoint at 4 is past 3 matched tokens: back to B0's.
    # Attention alone (before hybrid pruning) keeps the backed-off 7.
    mgr = make_manager(backend, tokens_per_block=4, layers=SSM_LAYERS, commit_min_snapshot=True, reuse_match_backoff=1)
    a, b = chain(mgr, B0 + B1, [[4, 4], [4, 4]])
    m = check_batch(mgr, [B0 + B1, B0 + B1 + [9], B0 + B1[:1]], expected=[4, 4, 4], expected_rows=[rows(a)] * 3)
    assert diag(m, 0) == (4, 7, 8, 8)
    # the backoff trims the raw path (8), not the lookup (9)
    assert diag(m, 1) == (4, 7, 8, 9)
    # raw 5 -> 4: exactly B0's checkpoint
    assert diag(m, 2) == (4, 4, 5, 5)


def test_backoff_trims_whole_blocks_then_the_last(backend):
    mgr = make_manager(backend, tokens_per_block=4, layers=F_ONLY, reuse_match_backoff=5)
    chain(mgr, B0 + B1 + B2, [[4], [4], [4]])
    m = check_batch(mgr, [B0 + B1 + B2, B0 + B1 + [9], B0 + [5], B0], expected=[7, 4, 0, 0])
    assert diag(m, 1) == (4, 4, 9, 9)


# ---------------------------------------------------------------------------
# scopes, mixed batches
# ---------------------------------------------------------------------------


def test_d5_reuse_scopes_isolate(backend):
    mgr = make_manager(backend, tokens_per_block=8, layers=[Attention(), Attention()])
    tokens = list(range(64))
    scope = ReuseScope(lora_id=7, salt=11)
    assert introspect.insert_sequence(mgr, tokens, scope) == 8
    others = [ReuseScope(7, 12), ReuseScope(8, 11), ReuseScope(lora_id=7), ReuseScope(salt=11), None, ReuseScope()]

    # 7 full blocks plus a partial 7 on block 7
    check_batch(mgr, [tokens[:-1]], expected=[63], scopes=scope)
    check_batch(mgr, [tokens[:-1]] * len(others), expected=[0] * len(others), scopes=others)

    assert introspect.insert_sequence(mgr, tokens) == 8  # the default scope
    check_batch(mgr, [tokens[:-1]] * 3, expected=[63, 63, 0], scopes=[None, ReuseScope(), ReuseScope(salt=11)])
    check_batch(mgr, [tokens, tokens], expected=[64, 64], scopes=scope)


def test_a_mixed_batch_equals_per_request_probes(backend):
    """Exact and partial matches, clamps, cuts, stale skips, unknown scopes and
    empty lookups in one batch with per-request scopes."""
    mgr = make_manager(backend, tokens_per_block=4, layers=[Attention(), Attention(window=5)])
    s1, s2 = ReuseScope(lora_id=1), ReuseScope(salt=2)
    a, b, c = chain(mgr, B0 + B1 + B2, [[4, 0], [4, 0], [4, 4]])  # S stale at 12 for a, b
    introspect.make_test_block(mgr, [5, 9], [2, 2], parent=a)
    e, f = chain(mgr, B0 + B1, [[4, 4], [3, 4]], scope=s1)  # F3 on a full block: clamp
    lookups = [
        B0 + B1 + B2,  # 12: S skips a and b
        B0 + B1 + B2[:2],  # 10: S at 10 needs b -> cut to 4; at 4 needs a -> 0
        B0 + [5, 9],  # exact key of the partial [5, 9]: S at 6 needs a (none) -> 0
        B0 + B1,  # scope s1: F3 clamps -> 7
        B0 + [5],  # scope s1: partial 1 on f -> 5
        B0 + B1 + B2,  # unknown scope s2 -> 0
        [],
        B0 + B1 + B2 + [1, 2],  # lookup longer than the tree
    ]
    scopes = [None, None, None, s1, s1, s2, None, None]
    m = check_batch(mgr, lookups, scopes=scopes, expected=[12, 0, 0, 7, 5, 0, 0, 12])
    assert m.blocks(0).tolist() == rows(a, b, c) and m.blocks(3).tolist() == rows(e, f)
    assert diag(m, 1) == (0, 0, 10, 10)
    assert diag(m, 7) == (12, 12, 12, 14)


def test_a_large_batch_equals_its_requests_one_by_one(backend):
    """40 requests: on cpu this splits the batch over threads (small batches run on one)."""
    mgr = make_manager(backend, tokens_per_block=4, layers=[Attention(), Attention(window=5)])
    s1 = ReuseScope(lora_id=1)
    chain(mgr, B0 + B1 + B2, [[4, 0], [4, 0], [4, 4]])
    chain(mgr, B0 + B1, [[4, 4], [3, 4]], scope=s1)
    unique = [(B0 + B1 + B2, None), (B0 + B1 + B2[:2], None), (B0 + B1, s1), (B0 + [5], s1),
              ([], None), (B0 + B1 + B2 + [1, 2], None), (B0 + B1, None), (B0 + B1 + B2, s1)]
    alone = [mgr.match_batch([t], [s]).to_host() for t, s in unique]
    assert [int(a.num_tokens[0]) for a in alone] == [12, 0, 7, 5, 0, 12, 0, 7]
    batch = unique * 5
    m = mgr.match_batch([t for t, _ in batch], [s for _, s in batch]).to_host()
    for i in range(len(batch)):
        a = alone[i % len(unique)]
        got = (diag(m, i), m.blocks(i).tolist())
        assert got == (diag(a, 0), a.blocks(0).tolist()), f"request {i}"


def test_scopes_argument_forms(backend):
    mgr = make_manager(backend, tokens_per_block=4, layers=F_ONLY)
    s = ReuseScope(lora_id=7, salt=11)
    introspect.insert_sequence(mgr, B0 + B1, s)
    # one scope for all, one per request (a tuple too), None
    assert mgr.match_batch([B0, B0 + B1], s).to_host().num_tokens.tolist() == [4, 8]
    assert mgr.match_batch([B0, B0 + B1], (s, None)).to_host().num_tokens.tolist() == [4, 0]
    assert mgr.match_batch([B0, B0 + B1]).to_host().num_tokens.tolist() == [0, 0]


@pytest.mark.parametrize("kind", ["lists", "tuples", "arrays", "flat", "sequences"])
def test_the_request_forms_give_identical_results(backend, kind):
    mgr = make_manager(backend, tokens_per_block=4, layers=[Attention(), Attention(window=5)])
    chain(mgr, B0 + B1 + B2, [[4, 4], [4, 2], [4, 4]])
    lookups = [B0 + B1 + B2, B0 + [5, 6, 7], [], B0 + B1]
    expected = mgr.match_batch(lookups).to_host()
    assert expected.num_tokens.tolist() == [12, 6, 0, 6]
    if kind == "lists":
        got = mgr.match_batch(lookups)
    elif kind == "tuples":
        got = mgr.match_batch(tuple(tuple(x) for x in lookups))
    elif kind == "arrays":
        got = mgr.match_batch([np.array(x, dtype=np.int64) for x in lookups])
    elif kind == "flat":
        got = mgr.match_batch((np.array(sum(lookups, []), dtype=np.int32), np.array([0, 12, 19, 19, 27])))
    else:
        seqs = [mgr.token_sequence(x) for x in lookups]
        got = mgr.match_batch(seqs)
    got = got.to_host()
    for f in ("num_tokens", "num_lookup_tokens", "num_tokens_before_pruning",
              "num_tokens_before_hybrid_pruning", "block_offsets", "block_ids"):
        assert np.array_equal(getattr(got, f), getattr(expected, f)), f

"""The sequence layer (``create_kv_cache`` / ``KVCache``) against the worked
scenarios of docs/semantics.md §6.1-6.3, each written once and played on every side
(``tests/support/scenario_rigs.py``): the plain-Python oracle (``tests/support/oracle_kv.py``),
``cpu``, and the CUDA kernels (in the simulator unless ``GPUKV_TEST_CUDA=1``).

On a backend every cache is driven by the test engine (``tests/support/engine.py``) on
real page memory (``page_bytes = 8 * T``): it writes a value derived from the
whole token prefix for every computed token; on the oracle its fake engine does
the same in page dicts. Every reuse is verified after ``resume``, and every
check runs the side's sanity checker (on a backend also a check of the data of
every page linked in the tree). Pages are named by pool index on both sides.
Notation follows §6: ``Bk`` is the tree block at ordinal k, ``Bk/16`` a partial
block of 16 tokens, ``F32`` an F page with coverage 32. ``chain_covs`` lists the
exact-key chain of a token list as ``(block tokens, coverages)``.

The simulator is slow: P1, M4, D1 and D8 run there in the default suite, the
other scenarios under ``-m slow``. Checks of the test engine itself and bad
input and fault handling (gpukv only, on ``cpu``) are at the end.
"""

from __future__ import annotations

import numpy as np
import pytest

import gpukv
from gpukv import Attention, ReuseScope, Ssm

from tests.support import oracle_kv as OK
from tests.support.scenario_rigs import ORACLE, make_rig, scenario, status


# ---------------------------------------------------------------------------
# the §6 configurations
# ---------------------------------------------------------------------------


def pc(side, W=16, backoff=0):
    """§6.1 config PC: T = 32, lc0 = F, lc1 = S(W); partial reuse and
    commit_min_snapshot on."""
    return make_rig(
        side,
        T=32,
        layers=[Attention(), Attention(window=W)],
        enable_partial_reuse=True,
        commit_min_snapshot=True,
        reuse_match_backoff=backoff,
    )


def ssm(side, partial=False):
    """§6.2 config SSM: T = 32, 2 F layers (lc0) and 2 SSM layers (lc1);
    commit_min_snapshot on."""
    return make_rig(
        side, T=32, layers=[Attention(), Attention(), Ssm(), Ssm()], enable_partial_reuse=partial, commit_min_snapshot=True
    )


def config_d(side, backoff=0):
    """§6.3 config D: T = 8, lc0 = S(8), lc1 = F; commit_min_snapshot off."""
    return make_rig(side, T=8, layers=[Attention(window=8), Attention()], reuse_match_backoff=backoff)


# ---------------------------------------------------------------------------
# §6.1 partial coverage
# ---------------------------------------------------------------------------


@scenario(simulator_by_default=True)
def test_P1_rewind_endpoint_survives_a_longer_sibling_created_after(side):
    rig = pc(side)
    base = list(range(80))
    extended = base + list(range(1000, 1080))
    rewind = base + [2000]

    assert rig.run_turn(base) == 0
    # S stale range at 80 is [0, 2): blocks 0 and 1 have no S page.
    assert rig.chain_covs(base) == [(32, (32, 0)), (32, (32, 0)), (16, (16, 16))]
    b2_16 = rig.chain_blocks(base)[2]

    assert rig.run_turn(extended) == 80
    # Full B2 adopted F16/S16 from B2/16 (now detached); its own F32 replaced F16, S16 stays.
    assert rig.chain_covs(extended) == [(32, (32, 0)), (32, (32, 0)), (32, (32, 16)), (32, (32, 0)), (32, (32, 32))]
    assert not rig.attached(b2_16) and len(rig.chain_covs(base)) == 2, "B2/16 is detached"

    n, pages = rig.reuse_match_pages(rewind, 0, enable_partial=True)
    assert n == 80 and pages[-1][1] == 32
    n, pages = rig.reuse_match_pages(rewind, 1, enable_partial=True)
    assert n == 80 and pages[-1][1] == 16 and pages[:2] == [None, None]
    assert rig.probe(rewind) == 80
    assert rig.probe(extended) == 160  # at 160 only B4 is needed for S
    assert rig.reuse(rewind) == 80  # and the salvaged S16 holds the right KV
    rig.check()


@scenario
def test_P3_reused_partial_coverage_kv_is_correct(side):
    rig = pc(side)
    base = list(range(80))
    extended = base + list(range(1000, 1080))
    rewind = base + list(range(3000, 3040))
    assert rig.run_turn(base, refcheck=True) == 0  # resize(80, 0): every block gets pages
    assert rig.run_turn(extended) == 80
    # The reused KV of both life cycles is verified, including the first 16 tokens
    # of block 2 in S, which only the salvaged coverage-16 page holds.
    assert rig.run_turn(rewind, refcheck=True) == 80
    rig.check()


@scenario
def test_P3_the_engine_catches_wrong_reused_data(side):
    rig = pc(side)
    base = list(range(80))
    rig.run_turn(base, refcheck=True)
    kv = rig.create(base + [7])
    assert kv.num_committed_tokens == 80
    rig.resume(kv)
    rig.verify_reuse(kv, base)
    private = int(kv.page_indices(1)[2])  # the private copy of block 2's S page
    assert rig.committed_page_is_linked(kv, 2, 1) is None
    good = rig.read_page(1, private)[3]
    rig.write_word(1, private, 3, good ^ 1)
    with pytest.raises(AssertionError, match="reused KV at position 67"):
        rig.verify_reuse(kv, base)
    rig.write_word(1, private, 3, good)
    rig.verify_reuse(kv, base)
    kv.close()
    rig.check()


@scenario
def test_P5_backoff_rechecks_swa_coverage_at_the_final_endpoint(side):
    rig = pc(side, W=33, backoff=1)
    base = list(range(48))
    boundary = base + list(range(1000, 1048))

    assert rig.run_turn(base, refcheck=True) == 0
    assert rig.chain_covs(base) == [(32, (32, 32)), (16, (16, 16))]  # S stale range at 48 is empty

    assert rig.run_turn(boundary) == 47  # raw 48, backed off to 47
    assert rig.chain_covs(boundary) == [(32, (32, 32)), (32, (32, 16)), (32, (32, 32))]

    n, pages = rig.reuse_match_pages(base, 1, enable_partial=True)
    assert n == 48 and pages[-1][1] == 16
    assert rig.probe(boundary) == 48  # 95 -> B1 S16 < 32 -> clamp to 48
    assert rig.run_turn(boundary, refcheck=True) == 48
    rig.check()


@scenario
def test_P7_a_replaced_page_does_not_outlive_its_block(side):
    rig = pc(side)
    prompt = list(range(96))
    turn1, turn2 = prompt[:72], prompt[:80]

    kv1 = rig.create(turn1)
    assert kv1.num_committed_tokens == 0
    rig.resume(kv1)
    assert kv1.resize(72, 72)
    rig.execute_and_commit(kv1, turn1, 72, is_end=True)
    assert rig.chain_covs(turn1) == [(32, (32, 0)), (32, (32, 32)), (8, (8, 8))]
    b2_8 = rig.chain_blocks(turn1)[2]
    for lc in (0, 1):  # moved: kv1 locks the tree's own pages
        assert rig.committed_page_is_linked(kv1, 2, lc) is True
        n, pages = rig.reuse_match_pages(turn1, lc)
        assert n == 72 and pages[2][1] == 8
        assert kv1.page_indices(lc)[2] == pages[2][0] == rig.chain_pages(turn1, lc)[2]
    rig.check()

    kv2 = rig.create(turn2)
    assert kv2.num_committed_tokens == 72
    rig.resume(kv2)
    rig.verify_reuse(kv2, turn2)
    assert kv2.resize(80, 80)
    rig.execute_and_commit(kv2, turn2, 80, is_end=True)
    kv2.close()
    assert rig.chain_covs(turn2) == [(32, (32, 0)), (32, (32, 32)), (16, (16, 16))]
    assert not rig.attached(b2_8) and len(rig.chain_covs(turn1)) == 2, "B2/8 is detached"
    for lc in (0, 1):
        assert rig.committed_page_is_linked(kv1, 2, lc) is False
    rig.check()

    b2_16 = rig.chain_blocks(turn2)[2]
    assert rig.run_turn(prompt) == 80
    assert rig.chain_covs(prompt)[2] == (32, (32, 32))
    assert rig.gone(b2_16) and len(rig.chain_covs(turn2)) == 2, "B2/16 is destroyed"
    for lc in (0, 1):
        assert rig.committed_page_is_linked(kv1, 2, lc) is False
    kv1.close()
    rig.check()


# ---------------------------------------------------------------------------
# §6.2 SSM snapshots
# ---------------------------------------------------------------------------


def commit_32_then_32(rig, p: list, stop: bool = False):
    """kv: capacity 32; commit p[:32]; capacity 64; commit p[32:64] (§6.2 M5)."""
    kv = rig.fresh()
    assert kv.resize(32)
    rig.execute_and_commit(kv, p, 32)
    assert kv.resize(64)
    rig.execute_and_commit(kv, p, 64)
    if stop:
        kv.stop_committing()
    return kv


@scenario
def test_M1_no_reuse_without_a_snapshot(side):
    rig = ssm(side)
    assert rig.reuse(list(range(64))) == 0
    rig.check()


@scenario(simulator_by_default=True)
def test_M4_a_snapshot_at_each_commit(side):
    rig = ssm(side)
    prompt = list(range(128))
    early = prompt[:96]
    kv1 = rig.fresh()
    assert kv1.resize(96, 96)
    rig.execute_and_commit(kv1, early, 96)  # one call, not an end commit
    kv1.close()
    assert rig.chain_covs(early) == [(32, (32, 0)), (32, (32, 0)), (32, (32, 32))]  # snapshot ordinal 95 // 32 = 2
    assert rig.reuse(early) == 96

    _, pages = rig.reuse_match_pages(early, 0)
    before = [p[0] for p in pages]
    assert before == rig.chain_pages(early, 0)
    kv3 = rig.fresh()
    assert kv3.resize(128, 128)
    rig.execute_and_commit(kv3, prompt, 128)
    assert list(kv3.page_indices(0)[:3]) == before, "blocks 0..2 rebased onto the tree's pages"
    kv3.close()
    assert rig.chain_covs(prompt) == [(32, (32, 0)), (32, (32, 0)), (32, (32, 32)), (32, (32, 32))]
    assert rig.reuse(prompt) == 128
    assert rig.reuse(early) == 96  # B2 kept its snapshot
    rig.check()


@scenario
def test_M5_snapshots_from_multiple_commits(side):
    rig = ssm(side)
    p = list(range(96))
    commit_32_then_32(rig, p).close()
    assert rig.chain_covs(p[:64]) == [(32, (32, 32)), (32, (32, 32))]
    assert rig.reuse(p[:32]) == 32
    assert rig.reuse(p[:48]) == 32  # partial reuse off
    assert rig.reuse(p[:96]) == 64
    rig.check()


@scenario
def test_M6_the_hybrid_pruning_diagnostic(side):
    rig = ssm(side, partial=True)
    p = list(range(96))
    commit_32_then_32(rig, p).close()
    # (num_tokens, before hybrid pruning, before pruning); attention alone reuses
    # a partial 16 on B1 (F32 >= 16), the SSM endpoint falls back to B0 (B1's M32 > 16).
    assert rig.match([p[:48], p[:64]]) == [(32, 48, 48), (64, 64, 64)]
    assert rig.reuse(p[:48]) == 32
    assert rig.reuse(p[:64]) == 64
    rig.check()


@scenario
def test_M9_a_branch_snapshot_at_the_divergence_unlocks_sibling_reuse(side):
    rig = ssm(side, partial=True)
    shared = list(range(64))
    r1, r2, r3 = (shared + list(range(k, k + 32)) for k in (1000, 2000, 3000))
    kv = rig.fresh()
    assert kv.resize(96, 96)
    rig.execute_and_commit(kv, r1, 96)
    kv.close()
    assert rig.chain_covs(r1) == [(32, (32, 0)), (32, (32, 0)), (32, (32, 32))]

    assert rig.match([r3]) == [(0, 64, 64)]
    assert rig.probe(r3) == 0

    kv2 = rig.create(r2)
    assert kv2.num_committed_tokens == 0 and rig.match([r2])[0].before_pruning == 64
    rig.resume(kv2)
    assert kv2.resize(96, 64)
    rig.execute_and_commit(kv2, r2, 64)  # blocks 0 and 1 rebase; the aligned endpoint puts M32 on B1
    assert rig.chain_covs(shared) == [(32, (32, 0)), (32, (32, 32))]
    rig.execute_and_commit(kv2, r2, 96)
    kv2.close()
    assert rig.reuse(r3) == 64
    rig.check()


@scenario
def test_M11_planned_drops_target_the_latest_snapshot_with_shared_plans(side):
    rig = ssm(side)
    p = list(range(64))
    kv = commit_32_then_32(rig, p, stop=True)
    plan1 = kv.plan_committed_block_drop()
    plan2 = kv.plan_committed_block_drop()
    assert plan1 is not None and plan2 is not None
    kv.close()
    rig.check()
    b0, b1 = rig.chain_blocks(p)
    assert rig.planned_pages(plan1) == rig.planned_pages(plan2) == [(1, rig.chain_pages(p, 1)[1])]  # B1's M page
    assert rig.probe(p) == 64
    plan1.drop()
    assert rig.probe(p) == 64  # shared plans: only the last drop removes the page
    plan2.drop()
    assert rig.probe(p) == 32  # B1's M page died; B0's checkpoint is used
    assert rig.chain_covs(p) == [(32, (32, 32)), (32, (32, 0))] and rig.attached(b1)  # B1 stays, without its M page
    with pytest.raises(RuntimeError, match="already been dropped"):
        plan1.drop()
    assert rig.reuse(p) == 32
    kv = rig.fresh()
    kv.stop_committing()
    assert kv.plan_committed_block_drop() is None  # nothing committed
    kv.close()
    rig.check()


@scenario
def test_M13_monotone_same_block_snapshots_across_turns(side):
    rig = ssm(side, partial=True)
    prompt = list(range(64))
    previous = None
    for L, expected in ((10, 0), (20, 10), (25, 20)):
        assert rig.probe(prompt[:L]) == expected
        kv = rig.create(prompt[:L])
        assert kv.num_committed_tokens == expected
        rig.resume(kv)
        rig.verify_reuse(kv, prompt)
        assert kv.resize(L, L)
        rig.execute_and_commit(kv, prompt, L)  # non-end: a partial snapshot
        kv.close()
        assert rig.chain_covs(prompt[:L]) == [(L, (L, L))]
        assert rig.first_blocks() == 1, "each longer partial block covers and adopts the previous one"
        if previous is not None:
            shorter, block = previous
            assert not rig.attached(block) and rig.chain_covs(prompt[:shorter]) == [], "the shorter partial block is detached"
        previous = (L, rig.chain_blocks(prompt[:L])[0])
        rig.check()
    assert rig.reuse(prompt[:25]) == 25
    rig.check()


@pytest.mark.parametrize("partial", [False, True])
@scenario
def test_M15_a_partial_snapshot_still_respects_the_partial_reuse_setting(side, partial):
    rig = ssm(side, partial=partial)
    p = list(range(64))
    kv = rig.fresh()
    assert kv.resize(32)
    rig.execute_and_commit(kv, p, 32)
    assert kv.resize(48)
    rig.execute_and_commit(kv, p, 48)
    kv.close()
    assert rig.chain_covs(p[:48]) == [(32, (32, 32)), (16, (16, 16))]
    assert rig.reuse(p) == (48 if partial else 32)
    assert rig.reuse(p[:48]) == 48  # exact key match on the partial block
    n, pages = rig.reuse_match_pages(p[:48], 1)
    assert n == 48 and pages[-1][1] == 16
    rig.check()


@scenario
def test_M16_commit_is_end_moves_instead_of_copying(side):
    rig = ssm(side, partial=True)
    prompt = list(range(48))
    kv = rig.fresh()
    assert kv.resize(48, 48)
    f_index, ssm_index = int(kv.page_indices(0)[1]), kv.ssm_page_index()
    assert f_index != -1 and ssm_index != -1
    rig.execute_and_commit(kv, prompt, 48, is_end=True)
    assert kv.ssm_page_index() == -1, "is_end moved the live SSM state into the tree"
    with pytest.raises(rig.LogicError, match=r"Cannot commit tokens after stop_committing\(\)"):
        kv.commit([1])  # is_end stopped committing
    kv.close()
    n, pages = rig.reuse_match_pages(prompt, 0)
    assert n == 48 and pages[-1] == (f_index, 16)
    n, pages = rig.reuse_match_pages(prompt, 1)
    assert n == 48 and pages[0] is None and pages[-1] == (ssm_index, 16)
    rig.check()


@scenario
def test_M17_an_ssm_snapshot_moves_to_the_covering_block(side):
    rig = ssm(side, partial=True)
    p = list(range(96))
    kv1 = rig.fresh()
    assert kv1.resize(48, 48)
    rig.execute_and_commit(kv1, p, 48)
    kv1.close()
    assert rig.chain_covs(p[:48]) == [(32, (32, 0)), (16, (16, 16))]

    kv2 = rig.create(p)
    assert kv2.num_committed_tokens == 48
    rig.resume(kv2)
    rig.verify_reuse(kv2, p)
    assert kv2.resize(96, 96)
    rig.execute_and_commit(kv2, p, 96)
    kv2.close()
    # Full B1 adopts B1/16: F becomes 32, M16 stays (kv2's snapshot goes to B2).
    assert rig.chain_covs(p) == [(32, (32, 0)), (32, (32, 16)), (32, (32, 32))]

    n, pages = rig.reuse_match_pages(p[:48], 1, enable_partial=True)
    assert n == 48 and len(pages) == 2 and pages[-1][1] == 16
    assert rig.reuse(p[:48]) == 48  # the moved M16 holds the state after 48 tokens
    assert rig.reuse(p) == 96
    rig.check()


@scenario
def test_M18_commit_min_snapshot_history_alignment(side):
    rig = ssm(side)
    p = list(range(64))
    kv = rig.fresh()
    assert kv.resize(64, 32)
    rig.execute_and_commit(kv, p, 32)
    assert kv.num_committed_tokens == 32
    kv.close()

    kv = rig.fresh()
    assert kv.resize(64, 48)
    # The reference asserts; gpukv may raise a clearer error.
    with rig.rejected([kv], (AssertionError, ValueError, rig.LogicError)):
        kv.commit(p[:32])
    assert kv.num_committed_tokens == 0 and kv.history_length == 48
    kv.close()

    kv = rig.fresh()
    assert kv.resize(48, 48)
    rig.execute_and_commit(kv, p, 48)
    assert kv.num_committed_tokens == 48
    kv.close()
    rig.check()


@scenario
def test_M19_config_validation(side):
    # gpukv raises ValueError; the model asserts, as the reference does.
    with pytest.raises((ValueError, AssertionError), match="commit_min_snapshot"):
        make_rig(side, T=32, layers=[Attention(), Ssm()], commit_min_snapshot=False)
    rig = make_rig(side, T=32, layers=[Attention(), Ssm()], enable_partial_reuse=True, commit_min_snapshot=True)
    assert rig.run_turn(list(range(40))) == 0
    assert rig.reuse(list(range(40))) == 40
    rig.check()


@scenario
def test_M20_suspend_resume_keeps_the_live_ssm_slot(side):
    rig = ssm(side)
    kv = rig.fresh()
    assert kv.resize(100)
    slot = kv.ssm_page_index()
    assert slot != -1
    kv.stop_committing()
    kv.suspend()
    assert status(kv) == "SUSPENDED"
    rig.check()
    rig.resume(kv)
    assert kv.ssm_page_index() == slot
    kv.close()
    rig.check()


# ---------------------------------------------------------------------------
# §6.3 planned drops, SWA windows, backoff, scopes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backoff", [0, 1])
@scenario(simulator_by_default=True)
def test_D1_planned_drop_handle(side, backoff):
    rig = config_d(side, backoff)
    long = list(range(24))
    short = long[:8]

    def plan(tokens):
        kv = rig.create(tokens)
        r = kv.num_committed_tokens
        rig.resume(kv)
        rig.verify_reuse(kv, tokens)
        assert kv.resize(len(tokens))
        rig.execute_and_commit(kv, tokens, len(tokens))
        kv.stop_committing()
        handle = kv.plan_committed_block_drop()
        assert handle is not None
        indices = [list(kv.page_indices(lc)) for lc in (0, 1)]
        linked = [rig.committed_page_is_linked(kv, 0, lc) for lc in (0, 1)]
        blocks = rig.committed_blocks(kv)
        kv.close()
        rig.check()
        return handle, r, indices, linked, blocks

    h_long, r, _, _, _ = plan(long)
    assert r == 0
    # resize(24) kept history 0, so every block got an S page; stale ones went to the tree.
    assert rig.chain_covs(long) == [(8, (8, 8)), (8, (8, 8)), (8, (8, 8))]
    b0, b1, b2 = rig.chain_blocks(long)
    assert rig.planned_pages(h_long) == [(0, rig.chain_pages(long, 0)[2])]  # window start at 24 is min(2, 3) = 2
    h_short, r, indices, linked, blocks = plan(short)
    assert r == 8 - backoff
    assert rig.planned_pages(h_short) == [(0, rig.chain_pages(short, 0)[0])]
    # With backoff 1 the cache reuses 7, re-commits 1 token and block 0 rebases onto B0.
    for lc in (0, 1):
        n, pages = rig.reuse_match_pages(short, lc)
        assert n == 8
        assert indices[lc] == [pages[0][0]] == [rig.chain_pages(short, lc)[0]]
    assert linked == [True, True] and blocks == [b0]
    assert rig.probe(short) == 8 - backoff

    h_short.drop()
    assert rig.probe(short) == 0
    assert rig.probe(long) == 24 - backoff
    h_long.drop()
    assert rig.probe(long) == 16  # at 24 S needs B2 -> 16; at 16 only B1
    with pytest.raises(RuntimeError, match="already been dropped"):
        h_long.drop()
    assert rig.reuse(long) == 16
    rig.check()


@scenario
def test_D1_a_plan_covers_the_window_of_a_reused_endpoint(side):
    """A cache that reused everything and committed nothing new still plans the
    SWA window at its endpoint."""
    rig = config_d(side)
    tokens = list(range(16))
    assert rig.run_turn(tokens) == 0
    assert rig.chain_covs(tokens) == [(8, (0, 8)), (8, (8, 8))]  # B0 was stale at 16 when resized
    kv = rig.create(tokens)
    assert kv.num_committed_tokens == 16
    rig.resume(kv)
    kv.stop_committing()
    plan = kv.plan_committed_block_drop()
    assert plan is not None
    kv.close()
    plan.drop()
    assert rig.probe(tokens) == 0  # B1's S page died; at 8 S needs B0, which has none
    assert rig.chain_covs(tokens) == [(8, (0, 8)), (8, (0, 8))]  # SWA page death keeps the block
    rig.check()


@scenario
def test_D3_commit_min_snapshot_reuses_the_swa_post_commit_prefix(side):
    rig = make_rig(side, T=32, layers=[Attention(window=64)], pages=64, commit_min_snapshot=True)
    prompt = list(range(128))
    kv = rig.fresh()
    assert kv.resize(128, 128)
    rig.execute_and_commit(kv, prompt, 128)
    kv.close()
    n, pages = rig.reuse_match_pages(prompt, 0)
    assert n == 128 and [p is not None for p in pages] == [False, False, True, True]
    assert rig.probe(prompt[:96]) == 0
    assert rig.reuse(prompt) == 128
    rig.check()


@scenario
def test_D5_reuse_scopes_isolate_reuse(side):
    rig = make_rig(side, T=8, layers=[Attention(), Attention()], pages=64)  # 2 F layers: one life cycle
    tokens = list(range(64))

    def commit_under(scope):
        kv = rig.create(tokens[:-1], scope)
        rig.resume(kv)
        assert kv.resize(64)
        rig.execute_and_commit(kv, tokens, 64)
        kv.stop_committing()
        kv.close()
        rig.check()

    commit_under(ReuseScope(lora_id=7, salt=11))
    assert rig.reuse(tokens[:-1], ReuseScope(lora_id=7, salt=11)) == 63  # 7 full blocks plus a partial 7 on block 7
    for scope in [
        ReuseScope(lora_id=7, salt=12),
        ReuseScope(lora_id=8, salt=11),
        ReuseScope(lora_id=7),
        ReuseScope(salt=11),
        None,
    ]:
        assert rig.reuse(tokens[:-1], scope) == 0, scope
    commit_under(None)
    assert rig.reuse(tokens[:-1], None) > 0
    assert rig.reuse(tokens[:-1], ReuseScope()) > 0
    rig.check()


@scenario(simulator_by_default=True)
def test_D8_a_partial_block_is_never_rebased_onto_a_full_tree_block(side):
    rig = make_rig(side, T=8, layers=[Attention()], pages=64)
    prefix = list(range(100, 116))
    a0 = rig.fresh()
    assert a0.resize(13)
    rig.execute_and_commit(a0, prefix, 13)
    a0.stop_committing()
    assert rig.chain_covs(prefix[:13]) == [(8, (8,)), (5, (5,))]

    a = rig.fresh()
    assert a.resize(16)
    rig.execute_and_commit(a, prefix, 16)
    assert rig.chain_covs(prefix) == [(8, (8,)), (8, (8,))]
    assert rig.committed_page_is_linked(a0, 1, 0) is False  # replaced and unlinked
    rig.check()

    b = rig.create(prefix[:12])
    assert b.num_committed_tokens == 12  # a partial match on the full B1
    rig.resume(b)
    rig.verify_reuse(b, prefix)
    assert b.resize(13)
    rig.execute_and_commit(b, prefix, 13)
    b.stop_committing()  # covered by the full B1: VIRTUAL_STOP, no rebase
    if side == ORACLE:  # only the model records how the commit ended
        assert b.virtual_stopped and b.commit_state is OK.CommitState.USER_STOP
    assert rig.committed_page_is_linked(b, 1, 0) is None, "b's block 1 stays private"
    assert rig.committed_blocks(b)[1] is None, "b's block 1 is not rebased"
    a_index = int(a.page_indices(0)[1])
    b_index = int(b.page_indices(0)[1])
    assert b_index not in (-1, a_index)
    assert rig.chain_covs(prefix) == [(8, (8,)), (8, (8,))]
    rig.check()

    before = rig.read_page(0, a_index)
    assert b.resize(15)
    rig.run(b, prefix[:13] + [900, 901], 13, 15)  # block-1 offsets 5 and 6 of b's own page
    assert rig.read_page(0, a_index) == before, "b wrote into a's page"
    assert rig.read_page(0, a_index)[5] == rig.token_value(0, 13, prefix[:14])
    assert rig.read_page(0, b_index)[5] == rig.token_value(0, 13, prefix[:13] + [900])
    for kv in (a0, a, b):
        kv.close()
    rig.check()


# ---------------------------------------------------------------------------
# manager-level behaviour
# ---------------------------------------------------------------------------


@scenario
def test_clear_reusable_blocks_refuses_while_caches_are_open(side):
    rig = make_rig(side, T=8, layers=[Attention(), Attention(window=8)], pages=32)
    tokens = list(range(20))
    rig.run_turn(tokens)
    kv1 = rig.create(tokens)
    with rig.rejected([kv1], rig.LogicError, r"clear_reusable_blocks\(\).*1 KV cache\(s\) still open"):
        rig.clear_reusable_blocks()
    kv2 = rig.fresh()
    with rig.rejected([kv1, kv2], rig.LogicError, r"clear_reusable_blocks\(\).*2 KV cache\(s\) still open"):
        rig.clear_reusable_blocks()
    with rig.rejected([kv1, kv2], rig.LogicError, r"shutdown\(\).*2 KV cache\(s\) still open"):
        rig.shutdown()
    assert rig.probe(tokens) == 20
    kv1.close()
    with rig.rejected([kv2], rig.LogicError, r"1 KV cache\(s\) still open"):
        rig.clear_reusable_blocks()
    kv2.close()
    rig.clear_reusable_blocks()
    assert rig.probe(tokens) == 0
    assert rig.chain_covs(tokens) == [] and rig.tree_is_empty()
    assert all(rig.free_pages(lc) == 32 for lc in range(2))
    rig.check()
    assert rig.run_turn(tokens) == 0  # the pages came back
    assert rig.probe(tokens) == 20
    rig.shutdown()


# ---------------------------------------------------------------------------
# the test engine catches wrong data (gpukv's engine)
# ---------------------------------------------------------------------------


def test_engine_reports_unwritten_and_foreign_data_and_a_corrupt_tree():
    rig = pc("cpu")
    base = list(range(80))
    rig.run_turn(base, refcheck=True)
    kv = rig.create(base + [7])
    assert kv.num_committed_tokens == 80
    rig.resume(kv)
    private = int(kv.page_indices(1)[2])  # the private copy of block 2's S page
    good = rig.read_page(1, private)[3]
    rig.write_word(1, private, 3, 0)
    with pytest.raises(AssertionError, match="never written"):
        rig.verify_reuse(kv, base)
    rig.write_word(1, private, 3, good)
    rig.verify_reuse(kv, base)
    with pytest.raises(AssertionError, match="reused KV at position 0"):
        rig.verify_reuse(kv, [5] + base[1:])  # another prefix's KV
    kv.close()
    rig.check()

    _, pages = rig.reuse_match_pages(base, 0)
    tree_page = pages[1][0]
    good = rig.read_page(0, tree_page)[4]
    rig.write_word(0, tree_page, 4, good + 1)
    with pytest.raises(AssertionError, match="wrong data at block offset 4"):
        rig.check()
    rig.write_word(0, tree_page, 4, good)
    rig.check()


def test_engine_refuses_to_write_into_a_shared_page():
    rig = make_rig("cpu", T=8, layers=[Attention()], pages=16)
    tokens = list(range(16))
    assert rig.run_turn(tokens) == 0
    kv = rig.create(tokens + [99])
    assert kv.num_committed_tokens == 16
    rig.resume(kv)
    assert kv.resize(17)
    with pytest.raises(AssertionError, match="committed \\(shared\\) page"):
        rig.run(kv, tokens, 0, 1)
    rig.execute_and_commit(kv, tokens + [99], 17)
    kv.close()
    rig.check()


# ---------------------------------------------------------------------------
# bad input and faults: each rejected call changes nothing
# ---------------------------------------------------------------------------


def small_rig(pages=64):
    """cpu, T = 4, lc0 = F, lc1 = S(4)."""
    return make_rig("cpu", T=4, layers=[Attention(), Attention(window=4)], pages=pages)


def test_logic_error_is_a_runtime_error():
    assert issubclass(gpukv.LogicError, RuntimeError)
    assert {s.name for s in gpukv.KVCacheStatus} >= {"ACTIVE", "SUSPENDED", "CLOSED"}


def test_commits_after_stop_committing_are_rejected():
    rig = small_rig()
    tokens = list(range(6))
    kv = rig.fresh()
    assert kv.resize(8)
    rig.execute_and_commit(kv, tokens, 6)
    kv.stop_committing()
    kv.stop_committing()  # idempotent
    for bad in ([1], [1, 2, 3], np.array([7], dtype=np.int32)):
        with rig.rejected([kv], gpukv.LogicError, r"Cannot commit tokens after stop_committing\(\)"):
            kv.commit(bad)
    with rig.rejected([kv], gpukv.LogicError, r"Cannot commit tokens after stop_committing\(\)"):
        kv.commit([1], is_end=True)
    assert kv.num_committed_tokens == 6
    kv.close()
    rig.check()


def test_calls_on_a_closed_cache_are_rejected():
    rig = small_rig()
    tokens = list(range(6))
    kv = rig.fresh()
    assert kv.resize(8)
    rig.execute_and_commit(kv, tokens, 6)
    kv.close()
    assert status(kv) == "CLOSED"
    calls = [
        ("resume", lambda: kv.resume()),
        ("suspend", lambda: kv.suspend()),
        ("resize", lambda: kv.resize(12)),
        ("commit", lambda: kv.commit([1])),
        ("stop_committing", lambda: kv.stop_committing()),
    ]
    for name, call in calls:
        with rig.rejected([kv], gpukv.LogicError):
            call()
    assert status(kv) == "CLOSED"
    assert rig.reuse(tokens) == 6  # the closed cache's commits stay reusable
    rig.check()


def test_calls_in_the_wrong_status_are_rejected():
    """The reference asserts these (docs/semantics.md §2.5 "require ACTIVE"); gpukv
    raises LogicError (oracle_kv choice 3)."""
    rig = small_rig()
    kv = rig.create()
    with rig.rejected([kv], gpukv.LogicError):
        kv.commit([1])
    with rig.rejected([kv], gpukv.LogicError):
        kv.resize(4)
    with rig.rejected([kv], gpukv.LogicError):
        kv.suspend()
    rig.resume(kv)
    with rig.rejected([kv], gpukv.LogicError):
        kv.resume()
    kv.suspend()
    assert status(kv) == "SUSPENDED"
    rig.resume(kv)
    kv.close()
    rig.check()


def test_resize_below_history_is_rejected():
    rig = small_rig()
    kv = rig.fresh()
    assert kv.resize(8, 4)
    assert (kv.capacity, kv.history_length) == (8, 4)
    with rig.rejected([kv], ValueError):
        kv.resize(3)  # capacity below history
    with rig.rejected([kv], ValueError):
        kv.resize(8, 2)  # history never decreases
    with rig.rejected([kv], ValueError):
        kv.resize(2, 2)
    with rig.rejected([kv], ValueError):
        kv.resize(8, 9)  # history above capacity
    assert kv.resize(4)  # exactly the history: fine
    assert (kv.capacity, kv.history_length) == (4, 4)
    kv.close()
    rig.check()


def test_commit_beyond_capacity_is_rejected():
    rig = small_rig()
    kv = rig.fresh()
    assert kv.resize(4)
    with rig.rejected([kv], ValueError):
        kv.commit([1, 2, 3, 4, 5])
    rig.execute_and_commit(kv, [1, 2, 3, 4], 4)
    kv.close()
    rig.check()


@pytest.mark.parametrize(
    "tokens, exc",
    [
        ([1, -1], ValueError),
        ([2**31], ValueError),
        ([1, 2**40], ValueError),
        ([1.5], (TypeError, ValueError)),
        (["a"], (TypeError, ValueError)),
        ("abc", TypeError),
        (np.array([1.0, 2.0]), (TypeError, ValueError)),
        (np.array([-3], dtype=np.int64), ValueError),
    ],
    ids=["negative", "2**31", "2**40", "float", "str-token", "str", "float-array", "negative-array"],
)
def test_bad_tokens_are_rejected(tokens, exc):
    rig = small_rig()
    assert rig.run_turn(list(range(10))) == 0
    kv = rig.fresh()
    assert kv.resize(8)
    rig.execute_and_commit(kv, [5, 6], 2)
    with rig.rejected([kv], exc):
        rig.mgr.create_kv_cache(input_tokens=tokens)
    with rig.rejected([kv], exc):
        kv.commit(tokens)
    kv.close()
    rig.mgr.clear_reusable_blocks()  # the rejected creates left no cache open
    rig.check()


def test_bad_scope_is_rejected():
    rig = small_rig()
    with rig.rejected([], TypeError):
        rig.mgr.create_kv_cache(input_tokens=[1, 2], scope="lora-7")
    with rig.rejected([], TypeError):
        rig.mgr.create_kv_cache(scope=(7, 11))
    rig.mgr.clear_reusable_blocks()


def test_resize_out_of_pages_returns_false_and_changes_nothing():
    rig = make_rig("cpu", T=4, layers=[Attention(), Attention(window=4)], pages=[8, 2])  # lc0 = F (8 pages), lc1 = S (2)
    tokens = list(range(100, 132))
    kv = rig.fresh()
    assert kv.resize(4)
    rig.execute_and_commit(kv, tokens, 3)
    before = rig.state(kv)
    assert kv.resize(12) is False  # F needs 2 more (fine), S needs 2 more (only 1 free)
    rig.assert_unchanged(before, kv)
    assert (kv.num_committed_tokens, kv.history_length, kv.capacity) == (3, 3, 4)
    assert kv.resize(40, 36) is False  # F would need 9 more
    rig.assert_unchanged(before, kv)
    # At history 32 the S stale range is [0, 7): S needs a page for block 7 only. This
    # takes every F page of the pool, so the failed calls leaked none.
    assert kv.resize(32, 32)
    assert int((np.asarray(kv.page_indices(0)) >= 0).sum()) == 8
    assert [int(x) >= 0 for x in kv.page_indices(1)] == [True] + [False] * 6 + [True]  # block 0 held for its commit

    other = rig.fresh()
    before = rig.state(kv, other)
    assert other.resize(4) is False  # no F page left
    rig.assert_unchanged(before, kv, other)
    assert (other.num_committed_tokens, other.history_length, other.capacity) == (0, 0, 0)
    other.close()
    rig.run(kv, tokens, 3, 32)
    kv.commit(tokens[3:28])
    kv.close()
    rig.check()
    assert rig.chain_covs(tokens) == [(4, (4, 4))] + [(4, (4, 0))] * 6
    assert rig.probe(tokens[:28]) == 4  # S needs block 6 at 28, ..., block 0 at 4

"""Scenario tests of the sequence-layer oracle (tests/oracle_kv.py) against the
worked examples of /work/shared/docs/semantics.md §6, plus a seeded random
multi-turn-conversation run with rewinds. Every test ends with ``check_sanity``.

Notation in comments follows §6: ``Bk`` is the tree block at ordinal k, ``Bk/16`` a
partial block of 16 tokens, ``F32`` an F page with coverage 32.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

try:  # tests/ is on sys.path under pytest's default import mode
    from oracle import FULL, SSM, SWA, LifeCycle
    from oracle_kv import (
        CommitState,
        KVOracle,
        LogicError,
        Status,
        UncommittedPage,
        run_turn,
        token_value,
        verify_reuse,
        write_tokens,
    )
except ImportError:  # pragma: no cover - if tests/ becomes a package
    from tests.oracle import FULL, SSM, SWA, LifeCycle
    from tests.oracle_kv import (
        CommitState,
        KVOracle,
        LogicError,
        Status,
        UncommittedPage,
        run_turn,
        token_value,
        verify_reuse,
        write_tokens,
    )

F = LifeCycle(FULL)
M = LifeCycle(SSM)


def S(window: int, sink_blocks: int = 0) -> LifeCycle:
    return LifeCycle(SWA, window, sink_blocks)


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def pc_oracle(W: int = 16, backoff: int = 0) -> KVOracle:
    """§6.1 config PC: T = 32, lc0 = F, lc1 = S(W); partial reuse and
    commit_min_snapshot on."""
    return KVOracle(32, [F, S(W)], 256, enable_partial_reuse=True, commit_min_snapshot=True, reuse_match_backoff=backoff)


def ssm_oracle(partial: bool = False) -> KVOracle:
    """§6.2 config SSM: T = 32, lc0 = F, lc1 = M; commit_min_snapshot on."""
    return KVOracle(32, [F, M], 256, enable_partial_reuse=partial, commit_min_snapshot=True)


def chain_covs(o: KVOracle, tokens, scope=None) -> list:
    """The exact-key chain for ``tokens``: ``(len(block.tokens), coverages)`` per block."""
    return [(len(b.tokens), tuple(b.cov(lc) for lc in range(o.num_life_cycles))) for b, _ in o.tree.walk(scope, tokens, False)]


def chain_blocks(o: KVOracle, tokens, scope=None) -> list:
    return [b for b, _ in o.tree.walk(scope, tokens, False)]


def reuse(o: KVOracle, tokens, scope=None, check: bool = True) -> int:
    """``probe_reuse`` and ``create_kv_cache`` agree; with ``check`` the cache is
    resumed and its reused KV verified; then closed."""
    n = o.probe_reuse(tokens, scope)
    kv = o.create_kv_cache(input_tokens=tokens, scope=scope)
    assert kv.num_committed_tokens == n
    if check:
        verify_reuse(kv)
        assert kv.resume()
        verify_reuse(kv)
    kv.close()
    o.check_sanity()
    return n


def fresh(o: KVOracle, scope=None):
    kv = o.create_kv_cache(scope=scope)
    assert kv.resume()
    return kv


def execute_and_commit(kv, tokens, is_end=False) -> None:
    """The engine runs ``tokens`` after what is committed, then they are committed."""
    start = kv.num_committed_tokens
    write_tokens(kv, start, tokens)
    kv.commit(tokens, is_end=is_end)


# ---------------------------------------------------------------------------
# §6.1 partial coverage
# ---------------------------------------------------------------------------


def test_P1_rewind_endpoint_survives_a_longer_sibling_created_after():
    o = pc_oracle()
    base = list(range(80))
    extended = base + list(range(1000, 1080))
    rewind = base + [2000]

    assert run_turn(o, base) == 0
    # S stale range at 80 is [0, 2): blocks 0 and 1 have no S page.
    assert chain_covs(o, base) == [(32, (32, 0)), (32, (32, 0)), (16, (16, 16))]
    b2_16 = chain_blocks(o, base)[2]

    assert run_turn(o, extended) == 80
    # full B2 adopted F16/S16 from B2/16 (now detached); own F32 replaced F16, S16 stays.
    assert chain_covs(o, extended) == [(32, (32, 0)), (32, (32, 0)), (32, (32, 16)), (32, (32, 0)), (32, (32, 32))]
    assert b2_16.prev is None and len(chain_blocks(o, base)) == 2

    n, pages = o.reuse_match_pages(rewind, 0, enable_partial=True)
    assert n == 80 and pages[-1][1] == 32
    n, pages = o.reuse_match_pages(rewind, 1, enable_partial=True)
    assert n == 80 and pages[-1][1] == 16 and pages[:2] == [None, None]
    assert o.probe_reuse(rewind) == 80
    assert o.probe_reuse(extended) == 160  # at 160 only B4 is needed for S
    o.check_sanity()


def test_P3_reused_partial_coverage_kv_is_correct():
    o = pc_oracle()
    base = list(range(80))
    extended = base + list(range(1000, 1080))
    rewind = base + list(range(3000, 3040))
    assert run_turn(o, base, refcheck=True) == 0
    assert run_turn(o, extended) == 0 + 80
    # verify_reuse inside run_turn checks block 2's first 16 tokens of S, which only
    # the salvaged coverage-16 page holds.
    assert run_turn(o, rewind, refcheck=True) == 80
    o.check_sanity()


def test_P3_verify_reuse_catches_wrong_data():
    o = pc_oracle()
    base = list(range(80))
    run_turn(o, base, refcheck=True)
    kv = o.create_kv_cache(input_tokens=base + [7])
    assert kv.num_committed_tokens == 80 and kv.resume()
    verify_reuse(kv)
    private = kv._blocks[2].pages[1].page
    assert isinstance(private, UncommittedPage)
    private.data[3] ^= 1
    with pytest.raises(AssertionError, match="reused KV at position 67"):
        verify_reuse(kv)
    kv.close()
    o.check_sanity()


def test_P5_backoff_rechecks_swa_coverage_at_the_final_endpoint():
    o = pc_oracle(W=33, backoff=1)
    base = list(range(48))
    boundary = base + list(range(1000, 1048))

    assert run_turn(o, base, refcheck=True) == 0
    assert chain_covs(o, base) == [(32, (32, 32)), (16, (16, 16))]  # S stale range at 48 is empty

    assert run_turn(o, boundary) == 47  # raw 48, backed off to 47
    assert chain_covs(o, boundary) == [(32, (32, 32)), (32, (32, 16)), (32, (32, 32))]

    n, pages = o.reuse_match_pages(base, 1, enable_partial=True)
    assert n == 48 and pages[-1][1] == 16
    assert o.probe_reuse(boundary) == 48  # 95 -> B1 S16 < 32 -> clamp to 48
    assert run_turn(o, boundary, refcheck=True) == 48
    o.check_sanity()


def test_P7_a_replaced_page_does_not_outlive_its_block():
    o = pc_oracle()
    prompt = list(range(96))
    turn1, turn2 = prompt[:72], prompt[:80]

    kv1 = o.create_kv_cache(input_tokens=turn1)
    assert kv1.num_committed_tokens == 0 and kv1.resume()
    assert kv1.resize(72, 72)
    execute_and_commit(kv1, turn1, is_end=True)
    assert chain_covs(o, turn1) == [(32, (32, 0)), (32, (32, 32)), (8, (8, 8))]
    b2_8 = chain_blocks(o, turn1)[2]
    for lc in (0, 1):  # moved: kv1 locks the tree's own pages
        assert kv1._blocks[2].pages[lc].page is b2_8.slots[lc]
        assert kv1.committed_page_is_linked(2, lc) is True

    kv2 = o.create_kv_cache(input_tokens=turn2)
    assert kv2.num_committed_tokens == 72 and kv2.resume()
    verify_reuse(kv2)
    assert kv2.resize(80, 80)
    execute_and_commit(kv2, turn2[72:], is_end=True)
    kv2.close()
    assert chain_covs(o, turn2) == [(32, (32, 0)), (32, (32, 32)), (16, (16, 16))]
    assert b2_8.prev is None
    for lc in (0, 1):
        assert kv1.committed_page_is_linked(2, lc) is False
    o.check_sanity()

    b2_16 = chain_blocks(o, turn2)[2]
    assert run_turn(o, prompt) == 80
    assert chain_covs(o, prompt)[2] == (32, (32, 32))
    assert b2_16.prev is None and all(p is None for p in b2_16.slots)  # destroyed
    for lc in (0, 1):
        assert kv1.committed_page_is_linked(2, lc) is False
    kv1.close()
    o.check_sanity()


# ---------------------------------------------------------------------------
# §6.2 SSM snapshots
# ---------------------------------------------------------------------------


def test_M1_no_reuse_without_a_snapshot():
    o = ssm_oracle()
    assert reuse(o, list(range(64))) == 0


def test_M4_a_snapshot_at_each_commit():
    o = ssm_oracle()
    prompt = list(range(128))
    early = prompt[:96]
    kv1 = fresh(o)
    assert kv1.resize(96, 96)
    execute_and_commit(kv1, early)
    kv1.close()
    assert chain_covs(o, early) == [(32, (32, 0)), (32, (32, 0)), (32, (32, 32))]  # snapshot ordinal 95 // 32 = 2
    assert reuse(o, early) == 96

    before = [b.slots[0] for b in chain_blocks(o, early)]
    kv3 = fresh(o)
    assert kv3.resize(128, 128)
    execute_and_commit(kv3, prompt)
    assert [kv3._blocks[i].pages[0].page for i in range(3)] == before  # blocks 0..2 rebased
    kv3.close()
    assert chain_covs(o, prompt) == [(32, (32, 0)), (32, (32, 0)), (32, (32, 32)), (32, (32, 32))]
    assert reuse(o, prompt) == 128
    assert reuse(o, early) == 96
    o.check_sanity()


def commit_32_then_32(o: KVOracle, p: list, stop: bool = False):
    """kv: capacity 32; commit p[:32]; capacity 64; commit p[32:64] (§6.2 M5)."""
    kv = fresh(o)
    assert kv.resize(32)
    execute_and_commit(kv, p[:32])
    assert kv.resize(64)
    execute_and_commit(kv, p[32:64])
    if stop:
        kv.stop_committing()
    return kv


def test_M5_snapshots_from_multiple_commits():
    o = ssm_oracle()
    p = list(range(96))
    commit_32_then_32(o, p).close()
    assert chain_covs(o, p[:64]) == [(32, (32, 32)), (32, (32, 32))]
    assert reuse(o, p[:32]) == 32
    assert reuse(o, p[:48]) == 32  # partial reuse off
    assert reuse(o, p[:96]) == 64


def test_M6_the_hybrid_pruning_diagnostic():
    o = ssm_oracle(partial=True)
    p = list(range(96))
    commit_32_then_32(o, p).close()
    kv = o.create_kv_cache(input_tokens=p[:48])
    assert (kv.num_committed_tokens, kv.num_tokens_before_hybrid_pruning, kv.num_tokens_before_pruning) == (32, 48, 48)
    kv.close()
    kv = o.create_kv_cache(input_tokens=p[:64])
    assert (kv.num_committed_tokens, kv.num_tokens_before_hybrid_pruning) == (64, 64)
    kv.close()
    o.check_sanity()


def test_M9_a_branch_snapshot_at_the_divergence_unlocks_sibling_reuse():
    o = ssm_oracle(partial=True)
    shared = list(range(64))
    r1, r2, r3 = (shared + list(range(k, k + 32)) for k in (1000, 2000, 3000))
    kv = fresh(o)
    assert kv.resize(96, 96)
    execute_and_commit(kv, r1)
    kv.close()
    assert chain_covs(o, r1) == [(32, (32, 0)), (32, (32, 0)), (32, (32, 32))]

    m = o.match(r3)
    assert (m.num_tokens_before_pruning, m.num_tokens_before_hybrid_pruning, m.num_tokens) == (64, 64, 0)
    assert o.probe_reuse(r3) == 0

    kv2 = o.create_kv_cache(input_tokens=r2)
    assert kv2.num_committed_tokens == 0 and kv2.num_tokens_before_pruning == 64
    assert kv2.resume() and kv2.resize(96, 64)
    execute_and_commit(kv2, r2[:64])  # blocks 0 and 1 rebase; the aligned endpoint puts M32 on B1
    assert chain_covs(o, shared) == [(32, (32, 0)), (32, (32, 32))]
    execute_and_commit(kv2, r2[64:])
    kv2.close()
    assert reuse(o, r3) == 64
    o.check_sanity()


def test_M11_planned_drops_target_the_latest_snapshot_with_shared_plans():
    o = ssm_oracle()
    p = list(range(64))
    kv = commit_32_then_32(o, p, stop=True)
    plan1 = kv.plan_committed_block_drop()
    plan2 = kv.plan_committed_block_drop()
    kv.close()
    b0, b1 = chain_blocks(o, p)
    assert plan1.pages == [b1.slots[1]] and plan2.pages == [b1.slots[1]]
    assert o.probe_reuse(p) == 64
    plan1.drop()
    assert o.probe_reuse(p) == 64
    plan2.drop()
    assert o.probe_reuse(p) == 32  # B1's M page died; B0's checkpoint is used
    assert b1.slots == [b1.slots[0], None] and b1.prev is not None
    kv = fresh(o)
    kv.stop_committing()
    assert kv.plan_committed_block_drop() is None
    kv.close()
    o.check_sanity()


def test_M13_monotone_same_block_snapshots_across_turns():
    o = ssm_oracle(partial=True)
    prompt = list(range(64))
    previous = None
    for L, expected in ((10, 0), (20, 10), (25, 20)):
        assert o.probe_reuse(prompt[:L]) == expected
        kv = o.create_kv_cache(input_tokens=prompt[:L])
        assert kv.num_committed_tokens == expected and kv.resume()
        verify_reuse(kv)
        assert kv.resize(L, L)
        execute_and_commit(kv, prompt[expected:L])  # non-end: a partial snapshot
        kv.close()
        assert chain_covs(o, prompt[:L]) == [(L, (L, L))]
        assert len(o.tree.root(None).next) == 1
        if previous is not None:
            assert previous.prev is None  # covered and adopted, then replaced
        previous = chain_blocks(o, prompt[:L])[0]
    assert reuse(o, prompt[:25]) == 25
    o.check_sanity()


@pytest.mark.parametrize("partial", [False, True])
def test_M15_a_partial_snapshot_still_respects_the_partial_reuse_setting(partial):
    o = ssm_oracle(partial=partial)
    p = list(range(64))
    kv = fresh(o)
    assert kv.resize(32)
    execute_and_commit(kv, p[:32])
    assert kv.resize(48)
    execute_and_commit(kv, p[32:48])
    kv.close()
    assert chain_covs(o, p[:48]) == [(32, (32, 32)), (16, (16, 16))]
    assert reuse(o, p) == (48 if partial else 32)
    assert reuse(o, p[:48]) == 48  # exact key match on the partial block
    n, pages = o.reuse_match_pages(p[:48], 1)
    assert n == 48 and pages[-1][1] == 16
    o.check_sanity()


def test_M16_commit_is_end_moves_instead_of_copying():
    o = ssm_oracle(partial=True)
    prompt = list(range(48))
    kv = fresh(o)
    assert kv.resize(48, 48)
    f_slot, ssm_slot = kv.page_indices(0)[1], kv.ssm_page_index()
    assert ssm_slot != -1
    execute_and_commit(kv, prompt, is_end=True)
    assert kv.ssm_page_index() == -1 and kv.commit_state is CommitState.USER_STOP
    kv.close()
    n, pages = o.reuse_match_pages(prompt, 0)
    assert n == 48 and pages[-1] == (f_slot, 16)
    n, pages = o.reuse_match_pages(prompt, 1)
    assert n == 48 and pages[-1] == (ssm_slot, 16) and pages[0] is None
    o.check_sanity()


def test_M17_an_ssm_snapshot_moves_to_the_covering_block():
    o = ssm_oracle(partial=True)
    p = list(range(96))
    kv1 = fresh(o)
    assert kv1.resize(48, 48)
    execute_and_commit(kv1, p[:48])
    kv1.close()
    assert chain_covs(o, p[:48]) == [(32, (32, 0)), (16, (16, 16))]

    kv2 = o.create_kv_cache(input_tokens=p)
    assert kv2.num_committed_tokens == 48 and kv2.resume()
    verify_reuse(kv2)
    assert kv2.resize(96, 96)
    execute_and_commit(kv2, p[48:])
    kv2.close()
    assert chain_covs(o, p) == [(32, (32, 0)), (32, (32, 16)), (32, (32, 32))]

    n, pages = o.reuse_match_pages(p[:48], 1, enable_partial=True)
    assert n == 48 and len(pages) == 2 and pages[-1][1] == 16
    assert reuse(o, p) == 96
    o.check_sanity()


def test_M18_commit_min_snapshot_history_alignment():
    o = ssm_oracle()
    p = list(range(64))
    kv = fresh(o)
    assert kv.resize(64, 32)
    execute_and_commit(kv, p[:32])
    assert kv.num_committed_tokens == 32
    kv.close()

    kv = fresh(o)
    assert kv.resize(64, 48)
    with pytest.raises(AssertionError):
        kv.commit(p[:32])
    assert kv.num_committed_tokens == 0 and kv.history_length == 48
    o.check_sanity()
    kv.close()

    kv = fresh(o)
    assert kv.resize(48, 48)
    execute_and_commit(kv, p[:48])
    assert kv.num_committed_tokens == 48
    kv.close()
    o.check_sanity()


def test_M19_config_validation():
    with pytest.raises(AssertionError, match="commit_min_snapshot"):
        KVOracle(32, [F, M], 16, commit_min_snapshot=False)
    KVOracle(32, [F, M], 16, enable_partial_reuse=True, commit_min_snapshot=True).check_sanity()


def test_M20_suspend_resume_keeps_the_live_ssm_slot():
    o = ssm_oracle()
    kv = fresh(o)
    assert kv.resize(100)
    slot = kv.ssm_page_index()
    assert slot != -1
    kv.stop_committing()
    kv.suspend()
    o.check_sanity()
    assert kv.resume() and kv.ssm_page_index() == slot
    kv.close()
    o.check_sanity()


# ---------------------------------------------------------------------------
# §6.3 planned drops, SWA windows, backoff, scopes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backoff", [0, 1])
def test_D1_planned_drop_handle(backoff):
    o = KVOracle(8, [S(8), F], 256, reuse_match_backoff=backoff)  # config D
    long = list(range(24))
    short = long[:8]

    def plan(tokens):
        kv = o.create_kv_cache(input_tokens=tokens)
        r = kv.num_committed_tokens
        assert kv.resume() and kv.resize(len(tokens))
        execute_and_commit(kv, tokens[r:])
        kv.stop_committing()
        handle = kv.plan_committed_block_drop()
        assert handle is not None
        blocks = kv.tree_blocks()
        pages = [[e.page if e else None for e in sb.pages] for sb in kv._blocks]
        kv.close()
        o.check_sanity()
        return handle, r, blocks, pages

    h_long, r, _, _ = plan(long)
    b0, b1, b2 = chain_blocks(o, long)
    assert r == 0 and h_long.pages == [b2.slots[0]]  # window start at 24 is min(2, 3) = 2
    h_short, r, blocks, pages = plan(short)
    assert r == 8 - backoff and h_short.pages == [b0.slots[0]]
    assert blocks == [b0] and pages == [[b0.slots[0], b0.slots[1]]]  # with backoff 1: re-commit 1 token, rebase
    assert o.probe_reuse(short) == 8 - backoff

    h_short.drop()
    assert o.probe_reuse(short) == 0
    assert o.probe_reuse(long) == 24 - backoff
    h_long.drop()
    assert o.probe_reuse(long) == 16  # at 24 S needs B2 -> 16; at 16 only B1
    with pytest.raises(RuntimeError, match="already been dropped"):
        h_long.drop()
    o.check_sanity()


def test_D3_commit_min_snapshot_reuses_the_swa_post_commit_prefix():
    o = KVOracle(32, [S(64)], 64, commit_min_snapshot=True)
    prompt = list(range(128))
    kv = fresh(o)
    assert kv.resize(128, 128)
    execute_and_commit(kv, prompt)
    kv.close()
    n, pages = o.reuse_match_pages(prompt, 0)
    assert n == 128 and [p is not None for p in pages] == [False, False, True, True]
    assert o.probe_reuse(prompt[:96]) == 0
    assert reuse(o, prompt) == 128


def test_D5_reuse_scopes_isolate_reuse():
    o = KVOracle(8, [F], 64)  # 2 F layers share one life cycle
    tokens = list(range(64))

    def commit_under(scope):
        kv = o.create_kv_cache(input_tokens=tokens[:-1], scope=scope)
        r = kv.num_committed_tokens
        assert kv.resume() and kv.resize(64)
        execute_and_commit(kv, tokens[r:])
        kv.stop_committing()
        kv.close()

    commit_under((7, 11))
    assert reuse(o, tokens[:-1], (7, 11)) == 63  # 7 full blocks plus a partial 7 on block 7
    for scope in [(7, 12), (8, 11), (7, None), (None, 11), None]:
        assert reuse(o, tokens[:-1], scope) == 0
    commit_under(None)
    assert reuse(o, tokens[:-1], None) > 0
    assert reuse(o, tokens[:-1], (None, None)) > 0
    o.check_sanity()


def test_D8_a_partial_block_is_never_rebased_onto_a_full_tree_block():
    o = KVOracle(8, [F], 64)
    prefix = list(range(100, 116))
    a0 = fresh(o)
    assert a0.resize(13)
    execute_and_commit(a0, prefix[:13])
    a0.stop_committing()
    assert chain_covs(o, prefix[:13]) == [(8, (8,)), (5, (5,))]

    a = fresh(o)
    assert a.resize(16)
    execute_and_commit(a, prefix)
    assert chain_covs(o, prefix) == [(8, (8,)), (8, (8,))]
    assert a0.committed_page_is_linked(1, 0) is False

    b = o.create_kv_cache(input_tokens=prefix[:12])
    assert b.num_committed_tokens == 12 and b.resume()
    verify_reuse(b)
    assert b.resize(13)
    execute_and_commit(b, prefix[12:13])
    b.stop_committing()
    assert b.virtual_stopped and b.commit_state is CommitState.USER_STOP
    assert b.tree_blocks()[1] is None  # not rebased: its block stays private

    a_page = a._blocks[1].pages[0].page
    before = dict(a_page.data)
    assert b.resize(15)
    write_tokens(b, 13, [900, 901])
    assert a_page.data == before
    assert a_page.data[5] == token_value(0, 13, prefix[:14])
    assert b._blocks[1].pages[0].page.data[5] == token_value(0, 13, prefix[:13] + [900])
    for kv in (a0, a, b):
        kv.close()
    o.check_sanity()


# ---------------------------------------------------------------------------
# manager-level behaviour
# ---------------------------------------------------------------------------


def test_clear_reusable_blocks_refuses_while_caches_are_open():
    o = KVOracle(8, [F, S(8)], 32)
    run_turn(o, list(range(20)))
    kv = o.create_kv_cache(input_tokens=list(range(20)))
    keys = set(o.tree.attached_blocks())
    with pytest.raises(LogicError, match=r"clear_reusable_blocks\(\).*1 KV cache\(s\) still open"):
        o.clear_reusable_blocks()
    assert set(o.tree.attached_blocks()) == keys
    o.check_sanity()
    kv.close()
    o.clear_reusable_blocks()
    assert o.tree.next == {} and all(o.free_pages(lc) == 32 for lc in range(2))
    assert o.probe_reuse(list(range(20))) == 0
    o.check_sanity()


def test_resize_out_of_pages_changes_nothing_and_eviction_is_lru():
    o = KVOracle(4, [F], 6)
    run_turn(o, list(range(8)))  # B0, B1; close releases the last block first: B1 is scheduled first
    run_turn(o, list(range(100, 108)))  # 2 more droppable pages, scheduled later
    assert o.free_pages(0) == 2 and o.evictable_pages(0) == 4
    kv = fresh(o)
    assert kv.resize(4)
    indices = kv.page_indices(0)
    assert not kv.resize(4 * 8)  # needs 7 more pages: 1 free + 4 evictable is not enough
    assert kv.capacity == 4 and kv.page_indices(0) == indices
    assert o.evictable_pages(0) == 4 and o.probe_reuse(list(range(8))) == 8
    assert kv.resize(4 * 3)  # 2 more: the free one, then evict B1 (least recently scheduled)
    assert o.probe_reuse(list(range(8))) == 4
    assert kv.resize(4 * 4)  # 1 more: evict B0; full-attention death removes its subtree
    assert o.probe_reuse(list(range(8))) == 0
    assert o.probe_reuse(list(range(100, 108))) == 8
    o.check_sanity()
    kv.close()
    o.check_sanity()


def test_status_and_commit_state_errors():
    o = KVOracle(4, [F], 16)
    kv = o.create_kv_cache()
    assert kv.status is Status.SUSPENDED
    with pytest.raises(LogicError):
        kv.commit([1])
    with pytest.raises(LogicError):
        kv.resize(4)
    assert kv.resume() and kv.status is Status.ACTIVE
    assert kv.resize(8, 2)
    with pytest.raises(ValueError, match="decreased"):
        kv.resize(8, 1)
    with pytest.raises(ValueError, match="greater than capacity"):
        kv.resize(1)
    with pytest.raises(LogicError):
        kv.plan_committed_block_drop()
    execute_and_commit(kv, [1, 2, 3])
    kv.stop_committing()
    with pytest.raises(LogicError, match="Cannot commit tokens after stop_committing"):
        kv.commit([4])
    kv.close()
    assert kv.status is Status.CLOSED
    kv.close()
    o.check_sanity()


# ---------------------------------------------------------------------------
# seeded random multi-turn conversations with rewinds
# ---------------------------------------------------------------------------

# (name, T, life cycles, commit_min_snapshot, enable_partial_reuse, backoff)
RANDOM_CONFIGS = [
    ("F", 4, [F], False, True, 0),
    ("F-nopartial-backoff", 4, [F], False, False, 1),
    ("F+S", 4, [F, S(6)], False, True, 0),
    ("F+S-cms", 4, [F, S(6)], True, True, 0),
    ("S+F+Ssink-cms-backoff", 4, [S(5), F, S(9, 1)], True, True, 2),
    ("S-only-cms", 4, [S(6)], True, True, 0),
    ("S-only", 4, [S(3)], False, True, 1),
    ("F+M", 4, [F, M], True, False, 0),
    ("F+S+M-partial", 4, [F, S(6), M], True, True, 0),
    ("S+M-partial", 4, [S(5), M], True, True, 1),
]
VOCAB = 4  # a tiny vocabulary makes shared prefixes and covering siblings frequent
SCOPES = [None, None, None, (1, None), (None, 9)]


class Conversations:
    """A random multi-turn workload: each turn re-enters an earlier conversation at
    a random endpoint (often mid-block: a rewind) or starts a new one, runs a chunked
    prefill and a few generation steps with speculative tokens that get partly
    rejected (capacity rewinds), and ends with a stop, an end commit, a planned drop,
    or by being left open for a while. Several turns run interleaved."""

    def __init__(self, seed: int, config):
        name, T, lcs, cms, partial, backoff = config
        self.rng = random.Random(seed)
        self.T = T
        self.has_ssm = any(lc.kind == SSM for lc in lcs)
        self.cms = cms
        pages = self.rng.choice([12, 24, 64])
        self.o = KVOracle(T, lcs, pages, enable_partial_reuse=partial, commit_min_snapshot=cms, reuse_match_backoff=backoff)
        self.history: list[tuple] = []  # (scope, committed tokens) of finished turns
        self.plans: list = []
        self.jobs: list = []
        self.stats = Counter()

    def tokens(self, n: int) -> list:
        return [self.rng.randrange(VOCAB) for _ in range(n)]

    def new_prompt(self):
        rng, T = self.rng, self.T
        if self.history and rng.random() < 0.8:
            scope, conv = rng.choice(self.history)
            if rng.random() < 0.3:
                cut = len(conv)  # continue the conversation
            else:
                cut = rng.randint(0, len(conv))  # re-enter at an earlier endpoint, often mid-block
            cut = min(cut, 8 * T)
            prompt = conv[:cut]
            self.stats["continue" if cut == len(conv) else "rewind"] += 1
        else:
            scope, prompt = rng.choice(SCOPES), []
        return scope, prompt + self.tokens(rng.randint(1, 3 * T))

    def give_up(self, kv):
        self.stats["oom"] += 1
        if kv.status is Status.SUSPENDED and not kv.never_resumed and self.rng.random() < 0.5:
            assert kv.resume()
        kv.close()

    def turn(self):
        rng, o, T = self.rng, self.o, self.T
        scope, prompt = self.new_prompt()
        lookup = prompt[:-1] if rng.random() < 0.5 else prompt
        n = o.probe_reuse(lookup, scope)
        kv = o.create_kv_cache(input_tokens=lookup, scope=scope)
        assert kv.num_committed_tokens == n  # probe and create agree (§2.4)
        m = kv.reuse_match
        assert n <= m.num_tokens_before_hybrid_pruning <= m.num_tokens_before_pruning <= m.num_lookup_tokens == len(lookup)
        self.stats["reused_tokens"] += n
        self.stats["partial_reuse"] += n % T != 0
        yield
        while not kv.resume():  # out of pages for the private copies
            if rng.random() < 0.5:
                kv.close()
                self.stats["oom"] += 1
                return
            yield
        pos = n
        # chunked prefill
        while pos < len(prompt):
            end = rng.randint(pos + 1, len(prompt))
            hist = rng.choice([pos, end]) if self.cms else rng.randint(pos, end)
            if not kv.resize(end, hist):
                self.give_up(kv)
                return
            yield
            write_tokens(kv, pos, prompt[pos:end])
            if rng.random() < 0.2:
                kv.suspend()
                yield
                assert kv.resume()  # a later resume never allocates
            kv.commit(prompt[pos:end])
            pos = end
            yield
        # generation with speculative tokens (none with SSM: its state cannot rewind)
        for step in range(rng.randint(0, 2 * T)):
            spec = 0 if self.has_ssm else rng.randint(0, 2)
            if not kv.resize(pos + 1 + spec, pos):
                self.give_up(kv)
                return
            new = self.tokens(1 + spec)
            write_tokens(kv, pos, new)
            accepted = new[: 1 + rng.randint(0, spec)]
            is_end = rng.random() < 0.1
            kv.commit(accepted, is_end=is_end)
            pos += len(accepted)
            if kv.capacity > pos and rng.random() < 0.8:
                assert kv.resize(pos)  # rewind the rejected draft tokens
            yield
            if is_end:
                assert kv.commit_state is CommitState.USER_STOP
                break
        self.history.append((scope, kv.committed_tokens))
        if rng.random() < 0.4:
            kv.stop_committing()
            plan = kv.plan_committed_block_drop()
            self.stats["plans"] += plan is not None
            if plan is not None:
                self.plans.append(plan)
            with pytest.raises(LogicError):
                kv.commit(self.tokens(1))
        for _ in range(rng.randint(0, 3)):  # stay open a while (like A0 in D8)
            if kv.status is Status.ACTIVE and rng.random() < 0.3:
                kv.suspend()
            yield
        kv.close()
        self.stats["turns"] += 1

    def check(self):
        self.o.check_sanity()
        for kv in self.o.open_caches:
            verify_reuse(kv)

    def step(self):
        rng, o = self.rng, self.o
        r = rng.random()
        if r < 0.05 and self.plans:
            plan = self.plans.pop(rng.randrange(len(self.plans)))
            plan.drop()
            self.stats["drops"] += 1
            if rng.random() < 0.2:
                with pytest.raises(RuntimeError, match="already been dropped"):
                    plan.drop()
        elif r < 0.07:
            if o.open_caches:
                with pytest.raises(LogicError, match=f"{len(o.open_caches)} KV cache\\(s\\) still open"):
                    o.clear_reusable_blocks()
            else:
                o.clear_reusable_blocks()
                assert o.tree.next == {}
                assert all(o.free_pages(lc) == o.num_pages[lc] for lc in range(o.num_life_cycles))
                self.stats["clears"] += 1
        elif r < 0.12 and self.history:
            scope, conv = rng.choice(self.history)
            assert reuse(o, conv[: rng.randint(1, len(conv))], scope, check=False) >= 0
        else:
            if len(self.jobs) < 3 and (not self.jobs or rng.random() < 0.3):
                self.jobs.append(self.turn())
            job = rng.choice(self.jobs)
            try:
                next(job)
            except StopIteration:
                self.jobs.remove(job)
        self.check()

    def run(self, steps: int):
        for _ in range(steps):
            self.step()
        while self.jobs:  # finish every turn
            for job in list(self.jobs):
                try:
                    next(job)
                except StopIteration:
                    self.jobs.remove(job)
                self.check()
        assert not self.o.open_caches
        self.stats.update(self.o.counters)
        return self.stats


@pytest.mark.parametrize("config", RANDOM_CONFIGS, ids=[c[0] for c in RANDOM_CONFIGS])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_multi_turn_conversations(config, seed):
    stats = Conversations(seed, config).run(800)
    assert stats["turns"] > 20 and stats["reused_tokens"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("config", RANDOM_CONFIGS, ids=[c[0] for c in RANDOM_CONFIGS])
@pytest.mark.parametrize("seed", range(2, 22))
def test_random_multi_turn_conversations_long(config, seed):
    Conversations(seed, config).run(1500)

"""The sequence layer (``KVCacheManager.create_kv_cache`` / ``KVCache``) against
the worked scenarios of semantics.md §6.1-6.3, with real page memory.

Every cache the tests run is driven by the test engine (``tests/engine.py``) on
``page_bytes = 8 * T``: it writes a value derived from the whole token prefix for
every computed token, and every reuse is verified after ``resume``; every test ends
with ``introspect.check_sanity`` and a check of the data of every page linked in
the tree. Notation follows §6: ``Bk`` is the tree block at ordinal k, ``Bk/16`` a
partial block of 16 tokens, ``F32`` an F page with coverage 32. ``chain_covs``
lists the exact-key chain of a token list as ``(block tokens, coverages)``.

Most scenarios run on ``cpu``; P1, M4, D1 and D8 take the ``backend`` fixture and
so also run the CUDA kernels (in the simulator unless ``GPUKV_TEST_CUDA=1``).
Bad input and fault handling are at the end.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import gpukv
from gpukv import Attention, ReuseScope, Ssm, introspect

try:  # tests/ is on sys.path under pytest's default import mode
    from conftest import make_manager
    from engine import Engine, attached_rows, chain_covs, token_value
except ImportError:  # pragma: no cover - if tests/ becomes a package
    from tests.conftest import make_manager
    from tests.engine import Engine, attached_rows, chain_covs, token_value


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def status(name: str):
    return getattr(gpukv.KVCacheStatus, name)


class Rig:
    """A manager with real page memory, the engine that plays its model, and the
    §6 helpers (``run_turn``, ``reuse``, ``fresh``, ``execute_and_commit``)."""

    def __init__(self, backend="cpu", T=32, layers=(Attention(),), pages=256, **config):
        self.T = T
        self.mgr = make_manager(
            backend, tokens_per_block=T, layers=list(layers), pages_per_life_cycle=pages, page_bytes=8 * T, **config
        )
        self.engine = Engine(self.mgr)

    # -- caches ------------------------------------------------------------------------
    def probe(self, tokens, scope=None) -> int:
        return self.mgr.probe_reuse(list(tokens), scope)

    def create(self, tokens=None, scope=None):
        """A new cache; with ``tokens``, its reuse equals ``probe_reuse`` just before."""
        if tokens is None:
            kv = self.mgr.create_kv_cache(scope=scope)
            assert kv.num_committed_tokens == 0
        else:
            n = self.probe(tokens, scope)
            kv = self.mgr.create_kv_cache(input_tokens=list(tokens), scope=scope)
            assert kv.num_committed_tokens == n, "create_kv_cache and probe_reuse disagree"
        assert kv.status is status("SUSPENDED")
        assert kv.history_length == kv.capacity == kv.num_committed_tokens
        return kv

    def resume(self, kv):
        assert kv.resume() is not False, "out of pages on resume"
        assert kv.status is status("ACTIVE")

    def fresh(self, scope=None):
        kv = self.create(scope=scope)
        self.resume(kv)
        return kv

    def execute_and_commit(self, kv, tokens_all, end, is_end=False):
        """The engine runs ``tokens_all[committed:end]``, then they are committed."""
        start = kv.num_committed_tokens
        self.engine.run(kv, tokens_all, start, end)
        kv.commit(list(tokens_all[start:end]), is_end=is_end)
        assert kv.num_committed_tokens == end
        assert kv.num_committed_tokens <= kv.history_length <= kv.capacity

    def run_turn(self, prompt, refcheck=False, scope=None) -> int:
        """§6 ``run_turn``: create, resume, ``resize(len, r if refcheck else len)``,
        run and commit the rest (not an end commit), close. The reused KV is always
        verified after resume."""
        prompt = list(prompt)
        kv = self.create(prompt, scope)
        r = kv.num_committed_tokens
        self.resume(kv)
        self.engine.verify_reuse(kv, prompt)
        assert kv.resize(len(prompt), r if refcheck else len(prompt)), "out of pages on resize"
        self.execute_and_commit(kv, prompt, len(prompt))
        kv.close()
        assert kv.status is status("CLOSED")
        self.check()
        return r

    def reuse(self, tokens, scope=None) -> int:
        """Create with ``tokens`` (== probe), resume, verify the reused KV, close."""
        kv = self.create(tokens, scope)
        n = kv.num_committed_tokens
        self.resume(kv)
        self.engine.verify_reuse(kv, list(tokens))
        kv.close()
        self.check()
        return n

    def pool_index(self, page):
        """The pool index of a ``reuse_match_pages`` entry ``(page row, coverage)``."""
        return self.engine.pool_index(page[0])

    def check(self):
        introspect.check_sanity(self.mgr)
        self.engine.verify_tree()


def pc(backend="cpu", W=16, backoff=0) -> Rig:
    """§6.1 config PC: T = 32, lc0 = F, lc1 = S(W); partial reuse and
    commit_min_snapshot on."""
    return Rig(
        backend,
        T=32,
        layers=[Attention(), Attention(window=W)],
        enable_partial_reuse=True,
        commit_min_snapshot=True,
        reuse_match_backoff=backoff,
    )


def ssm(backend="cpu", partial=False) -> Rig:
    """§6.2 config SSM: T = 32, 2 F layers (lc0) and 2 SSM layers (lc1);
    commit_min_snapshot on."""
    return Rig(
        backend,
        T=32,
        layers=[Attention(), Attention(), Ssm(), Ssm()],
        enable_partial_reuse=partial,
        commit_min_snapshot=True,
    )


def config_d(backend="cpu", backoff=0) -> Rig:
    """§6.3 config D: T = 8, lc0 = S(8), lc1 = F; commit_min_snapshot off."""
    return Rig(backend, T=8, layers=[Attention(window=8), Attention()], reuse_match_backoff=backoff)


# ---------------------------------------------------------------------------
# §6.1 partial coverage
# ---------------------------------------------------------------------------


def test_P1_rewind_endpoint_survives_a_longer_sibling_created_after(backend):
    rig = pc(backend)
    mgr = rig.mgr
    base = list(range(80))
    extended = base + list(range(1000, 1080))
    rewind = base + [2000]

    assert rig.run_turn(base) == 0
    # S stale range at 80 is [0, 2): blocks 0 and 1 have no S page.
    assert chain_covs(mgr, base) == [(32, (32, 0)), (32, (32, 0)), (16, (16, 16))]

    assert rig.run_turn(extended) == 80
    # Full B2 adopted F16/S16 from B2/16 (now detached); its own F32 replaced F16, S16 stays.
    assert chain_covs(mgr, extended) == [(32, (32, 0)), (32, (32, 0)), (32, (32, 16)), (32, (32, 0)), (32, (32, 32))]
    assert len(chain_covs(mgr, base)) == 2, "B2/16 is detached"

    n, pages = introspect.reuse_match_pages(mgr, rewind, 0, enable_partial=True)
    assert n == 80 and pages[-1][1] == 32
    n, pages = introspect.reuse_match_pages(mgr, rewind, 1, enable_partial=True)
    assert n == 80 and pages[-1][1] == 16 and pages[:2] == [None, None]
    assert rig.probe(rewind) == 80
    assert rig.probe(extended) == 160  # at 160 only B4 is needed for S
    assert rig.reuse(rewind) == 80  # and the salvaged S16 holds the right KV
    rig.check()


def test_P3_reused_partial_coverage_kv_is_correct():
    rig = pc()
    base = list(range(80))
    extended = base + list(range(1000, 1080))
    rewind = base + list(range(3000, 3040))
    assert rig.run_turn(base, refcheck=True) == 0  # resize(80, 0): every block gets pages
    assert rig.run_turn(extended) == 80
    # The reused KV of both life cycles is verified, including the first 16 tokens
    # of block 2 in S, which only the salvaged coverage-16 page holds.
    assert rig.run_turn(rewind, refcheck=True) == 80
    rig.check()


def test_P5_backoff_rechecks_swa_coverage_at_the_final_endpoint():
    rig = pc(W=33, backoff=1)
    mgr = rig.mgr
    base = list(range(48))
    boundary = base + list(range(1000, 1048))

    assert rig.run_turn(base, refcheck=True) == 0
    assert chain_covs(mgr, base) == [(32, (32, 32)), (16, (16, 16))]  # S stale range at 48 is empty

    assert rig.run_turn(boundary) == 47  # raw 48, backed off to 47
    assert chain_covs(mgr, boundary) == [(32, (32, 32)), (32, (32, 16)), (32, (32, 32))]

    n, pages = introspect.reuse_match_pages(mgr, base, 1, enable_partial=True)
    assert n == 48 and pages[-1][1] == 16
    assert rig.probe(boundary) == 48  # 95 -> B1 S16 < 32 -> clamp to 48
    assert rig.run_turn(boundary, refcheck=True) == 48
    rig.check()


def test_P7_a_replaced_page_does_not_outlive_its_block():
    rig = pc()
    mgr = rig.mgr
    prompt = list(range(96))
    turn1, turn2 = prompt[:72], prompt[:80]

    kv1 = rig.create(turn1)
    assert kv1.num_committed_tokens == 0
    rig.resume(kv1)
    assert kv1.resize(72, 72)
    rig.execute_and_commit(kv1, turn1, 72, is_end=True)
    assert chain_covs(mgr, turn1) == [(32, (32, 0)), (32, (32, 32)), (8, (8, 8))]
    for lc in (0, 1):  # moved: kv1 locks the tree's own pages
        assert introspect.committed_page_is_linked(kv1, 2, lc) is True
        n, pages = introspect.reuse_match_pages(mgr, turn1, lc)
        assert n == 72 and pages[2][1] == 8
        assert kv1.page_indices(lc)[2] == rig.pool_index(pages[2])
    rig.check()

    kv2 = rig.create(turn2)
    assert kv2.num_committed_tokens == 72
    rig.resume(kv2)
    rig.engine.verify_reuse(kv2, turn2)
    assert kv2.resize(80, 80)
    rig.execute_and_commit(kv2, turn2, 80, is_end=True)
    kv2.close()
    assert chain_covs(mgr, turn2) == [(32, (32, 0)), (32, (32, 32)), (16, (16, 16))]
    assert len(chain_covs(mgr, turn1)) == 2, "B2/8 is detached"
    for lc in (0, 1):
        assert introspect.committed_page_is_linked(kv1, 2, lc) is False
    rig.check()

    assert rig.run_turn(prompt) == 80
    assert chain_covs(mgr, prompt)[2] == (32, (32, 32))
    assert len(chain_covs(mgr, turn2)) == 2, "B2/16 is detached"
    for lc in (0, 1):
        assert introspect.committed_page_is_linked(kv1, 2, lc) is False
    kv1.close()
    rig.check()


# ---------------------------------------------------------------------------
# §6.2 SSM snapshots
# ---------------------------------------------------------------------------


def commit_32_then_32(rig: Rig, p: list, stop: bool = False):
    """kv: capacity 32; commit p[:32]; capacity 64; commit p[32:64] (§6.2 M5)."""
    kv = rig.fresh()
    assert kv.resize(32)
    rig.execute_and_commit(kv, p, 32)
    assert kv.resize(64)
    rig.execute_and_commit(kv, p, 64)
    if stop:
        kv.stop_committing()
    return kv


def test_M1_no_reuse_without_a_snapshot():
    rig = ssm()
    assert rig.reuse(list(range(64))) == 0
    rig.check()


def test_M4_a_snapshot_at_each_commit(backend):
    rig = ssm(backend)
    mgr = rig.mgr
    prompt = list(range(128))
    early = prompt[:96]
    kv1 = rig.fresh()
    assert kv1.resize(96, 96)
    rig.execute_and_commit(kv1, early, 96)  # one call, not an end commit
    kv1.close()
    assert chain_covs(mgr, early) == [(32, (32, 0)), (32, (32, 0)), (32, (32, 32))]  # snapshot ordinal 95 // 32 = 2
    assert rig.reuse(early) == 96

    _, pages = introspect.reuse_match_pages(mgr, early, 0)
    before = [rig.pool_index(p) for p in pages]
    kv3 = rig.fresh()
    assert kv3.resize(128, 128)
    rig.execute_and_commit(kv3, prompt, 128)
    assert list(kv3.page_indices(0)[:3]) == before, "blocks 0..2 rebased onto the tree's pages"
    kv3.close()
    assert chain_covs(mgr, prompt) == [(32, (32, 0)), (32, (32, 0)), (32, (32, 32)), (32, (32, 32))]
    assert rig.reuse(prompt) == 128
    assert rig.reuse(early) == 96  # B2 kept its snapshot
    rig.check()


def test_M5_snapshots_from_multiple_commits():
    rig = ssm()
    p = list(range(96))
    commit_32_then_32(rig, p).close()
    assert chain_covs(rig.mgr, p[:64]) == [(32, (32, 32)), (32, (32, 32))]
    assert rig.reuse(p[:32]) == 32
    assert rig.reuse(p[:48]) == 32  # partial reuse off
    assert rig.reuse(p[:96]) == 64
    rig.check()


def test_M6_the_hybrid_pruning_diagnostic():
    rig = ssm(partial=True)
    p = list(range(96))
    commit_32_then_32(rig, p).close()
    m = rig.mgr.match_batch([p[:48], p[:64]]).to_host()
    assert list(m.num_tokens) == [32, 64]
    assert list(m.num_tokens_before_hybrid_pruning) == [48, 64]  # attention alone: partial 16 on B1, F32 >= 16
    assert list(m.num_tokens_before_pruning) == [48, 64]
    assert rig.reuse(p[:48]) == 32  # B1's M32 > 16: the SSM endpoint falls back to B0
    assert rig.reuse(p[:64]) == 64
    rig.check()


def test_M9_a_branch_snapshot_at_the_divergence_unlocks_sibling_reuse():
    rig = ssm(partial=True)
    mgr = rig.mgr
    shared = list(range(64))
    r1, r2, r3 = (shared + list(range(k, k + 32)) for k in (1000, 2000, 3000))
    kv = rig.fresh()
    assert kv.resize(96, 96)
    rig.execute_and_commit(kv, r1, 96)
    kv.close()
    assert chain_covs(mgr, r1) == [(32, (32, 0)), (32, (32, 0)), (32, (32, 32))]

    m = mgr.match_batch([r3]).to_host()
    assert (int(m.num_tokens_before_pruning[0]), int(m.num_tokens_before_hybrid_pruning[0]), int(m.num_tokens[0])) == (
        64,
        64,
        0,
    )
    assert rig.probe(r3) == 0

    kv2 = rig.create(r2)
    assert kv2.num_committed_tokens == 0
    rig.resume(kv2)
    assert kv2.resize(96, 64)
    rig.execute_and_commit(kv2, r2, 64)  # blocks 0 and 1 rebase; the aligned endpoint puts M32 on B1
    assert chain_covs(mgr, shared) == [(32, (32, 0)), (32, (32, 32))]
    rig.execute_and_commit(kv2, r2, 96)
    kv2.close()
    assert rig.reuse(r3) == 64
    rig.check()


def test_M11_planned_drops_target_the_latest_snapshot_with_shared_plans():
    rig = ssm()
    mgr = rig.mgr
    p = list(range(64))
    kv = commit_32_then_32(rig, p, stop=True)
    plan1 = kv.plan_committed_block_drop()
    plan2 = kv.plan_committed_block_drop()
    assert plan1 is not None and plan2 is not None
    kv.close()
    rig.check()
    assert rig.probe(p) == 64
    plan1.drop()
    assert rig.probe(p) == 64  # shared plans: only the last drop removes the page
    plan2.drop()
    assert rig.probe(p) == 32  # B1's M page died; B0's checkpoint is used
    assert chain_covs(mgr, p) == [(32, (32, 32)), (32, (32, 0))]  # B1 stays, without its M page
    with pytest.raises(RuntimeError, match="already been dropped"):
        plan1.drop()
    assert rig.reuse(p) == 32
    kv = rig.fresh()
    kv.stop_committing()
    assert kv.plan_committed_block_drop() is None  # nothing committed
    kv.close()
    rig.check()


def test_M13_monotone_same_block_snapshots_across_turns():
    rig = ssm(partial=True)
    mgr = rig.mgr
    prompt = list(range(64))
    previous = None
    for L, expected in ((10, 0), (20, 10), (25, 20)):
        assert rig.probe(prompt[:L]) == expected
        kv = rig.create(prompt[:L])
        assert kv.num_committed_tokens == expected
        rig.resume(kv)
        rig.engine.verify_reuse(kv, prompt)
        assert kv.resize(L, L)
        rig.execute_and_commit(kv, prompt, L)  # non-end: a partial snapshot
        kv.close()
        assert chain_covs(mgr, prompt[:L]) == [(L, (L, L))]
        blocks = introspect.tables(mgr)["blocks"]
        first_blocks = [r for r in attached_rows(blocks) if blocks["ordinal"][r] == 0]
        assert len(first_blocks) == 1, "each longer partial block covers and adopts the previous one"
        if previous is not None:
            assert chain_covs(mgr, prompt[:previous]) == [], "the shorter partial block is detached"
        previous = L
        rig.check()
    assert rig.reuse(prompt[:25]) == 25
    rig.check()


@pytest.mark.parametrize("partial", [False, True])
def test_M15_a_partial_snapshot_still_respects_the_partial_reuse_setting(partial):
    rig = ssm(partial=partial)
    mgr = rig.mgr
    p = list(range(64))
    kv = rig.fresh()
    assert kv.resize(32)
    rig.execute_and_commit(kv, p, 32)
    assert kv.resize(48)
    rig.execute_and_commit(kv, p, 48)
    kv.close()
    assert chain_covs(mgr, p[:48]) == [(32, (32, 32)), (16, (16, 16))]
    assert rig.reuse(p) == (48 if partial else 32)
    assert rig.reuse(p[:48]) == 48  # exact key match on the partial block
    n, pages = introspect.reuse_match_pages(mgr, p[:48], 1)
    assert n == 48 and pages[-1][1] == 16
    rig.check()


def test_M16_commit_is_end_moves_instead_of_copying():
    rig = ssm(partial=True)
    mgr = rig.mgr
    prompt = list(range(48))
    kv = rig.fresh()
    assert kv.resize(48, 48)
    f_index, ssm_index = int(kv.page_indices(0)[1]), kv.ssm_page_index()
    assert f_index != -1 and ssm_index != -1
    rig.execute_and_commit(kv, prompt, 48, is_end=True)
    assert kv.ssm_page_index() == -1, "is_end moved the live SSM state into the tree"
    with pytest.raises(gpukv.LogicError, match=r"Cannot commit tokens after stop_committing\(\)"):
        kv.commit([1])  # is_end stopped committing
    kv.close()
    n, pages = introspect.reuse_match_pages(mgr, prompt, 0)
    assert n == 48 and pages[-1][1] == 16 and rig.pool_index(pages[-1]) == f_index
    n, pages = introspect.reuse_match_pages(mgr, prompt, 1)
    assert n == 48 and pages[0] is None and pages[-1][1] == 16 and rig.pool_index(pages[-1]) == ssm_index
    rig.check()


def test_M17_an_ssm_snapshot_moves_to_the_covering_block():
    rig = ssm(partial=True)
    mgr = rig.mgr
    p = list(range(96))
    kv1 = rig.fresh()
    assert kv1.resize(48, 48)
    rig.execute_and_commit(kv1, p, 48)
    kv1.close()
    assert chain_covs(mgr, p[:48]) == [(32, (32, 0)), (16, (16, 16))]

    kv2 = rig.create(p)
    assert kv2.num_committed_tokens == 48
    rig.resume(kv2)
    rig.engine.verify_reuse(kv2, p)
    assert kv2.resize(96, 96)
    rig.execute_and_commit(kv2, p, 96)
    kv2.close()
    # Full B1 adopts B1/16: F becomes 32, M16 stays (kv2's snapshot goes to B2).
    assert chain_covs(mgr, p) == [(32, (32, 0)), (32, (32, 16)), (32, (32, 32))]

    n, pages = introspect.reuse_match_pages(mgr, p[:48], 1, enable_partial=True)
    assert n == 48 and len(pages) == 2 and pages[-1][1] == 16
    assert rig.reuse(p[:48]) == 48  # the moved M16 holds the state after 48 tokens
    assert rig.reuse(p) == 96
    rig.check()


def test_M18_commit_min_snapshot_history_alignment():
    rig = ssm()
    p = list(range(64))
    kv = rig.fresh()
    assert kv.resize(64, 32)
    rig.execute_and_commit(kv, p, 32)
    assert kv.num_committed_tokens == 32
    kv.close()

    kv = rig.fresh()
    assert kv.resize(64, 48)
    before = snapshot(rig, kv)
    # The reference asserts; gpukv may raise a clearer error (see the report).
    with pytest.raises((AssertionError, ValueError, gpukv.LogicError)):
        kv.commit(p[:32])
    assert kv.num_committed_tokens == 0 and kv.history_length == 48
    assert_unchanged(rig, before, kv)
    kv.close()

    kv = rig.fresh()
    assert kv.resize(48, 48)
    rig.execute_and_commit(kv, p, 48)
    assert kv.num_committed_tokens == 48
    kv.close()
    rig.check()


def test_M19_config_validation():
    with pytest.raises(ValueError, match="commit_min_snapshot"):
        gpukv.CacheConfig(tokens_per_block=32, layers=[Attention(), Ssm()], commit_min_snapshot=False, backend="cpu")
    rig = Rig("cpu", T=32, layers=[Attention(), Ssm()], enable_partial_reuse=True, commit_min_snapshot=True)
    assert rig.run_turn(list(range(40))) == 0
    assert rig.reuse(list(range(40))) == 40
    rig.check()


def test_M20_suspend_resume_keeps_the_live_ssm_slot():
    rig = ssm()
    kv = rig.fresh()
    assert kv.resize(100)
    slot = kv.ssm_page_index()
    assert slot != -1
    kv.stop_committing()
    kv.suspend()
    assert kv.status is status("SUSPENDED")
    rig.check()
    rig.resume(kv)
    assert kv.ssm_page_index() == slot
    kv.close()
    rig.check()


# ---------------------------------------------------------------------------
# §6.3 planned drops, SWA windows, backoff, scopes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backoff", [0, 1])
def test_D1_planned_drop_handle(backend, backoff):
    rig = config_d(backend, backoff)
    mgr = rig.mgr
    long = list(range(24))
    short = long[:8]

    def plan(tokens):
        kv = rig.create(tokens)
        r = kv.num_committed_tokens
        rig.resume(kv)
        rig.engine.verify_reuse(kv, tokens)
        assert kv.resize(len(tokens))
        rig.execute_and_commit(kv, tokens, len(tokens))
        kv.stop_committing()
        handle = kv.plan_committed_block_drop()
        assert handle is not None
        indices = [list(kv.page_indices(lc)) for lc in (0, 1)]
        linked = [introspect.committed_page_is_linked(kv, 0, lc) for lc in (0, 1)]
        kv.close()
        rig.check()
        return handle, r, indices, linked

    h_long, r, _, _ = plan(long)
    assert r == 0
    # resize(24) kept history 0, so every block got an S page; stale ones went to the tree.
    assert chain_covs(mgr, long) == [(8, (8, 8)), (8, (8, 8)), (8, (8, 8))]
    h_short, r, indices, linked = plan(short)
    assert r == 8 - backoff
    # With backoff 1 the cache reuses 7, re-commits 1 token and block 0 rebases onto B0.
    for lc in (0, 1):
        n, pages = introspect.reuse_match_pages(mgr, short, lc)
        assert n == 8
        assert indices[lc] == [rig.pool_index(pages[0])]
    assert linked == [True, True]
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


def test_D1_a_plan_covers_the_window_of_a_reused_endpoint():
    """A cache that reused everything and committed nothing new still plans the
    SWA window at its endpoint."""
    rig = config_d()
    tokens = list(range(16))
    assert rig.run_turn(tokens) == 0
    assert chain_covs(rig.mgr, tokens) == [(8, (0, 8)), (8, (8, 8))]  # B0 was stale at 16 when resized
    kv = rig.create(tokens)
    assert kv.num_committed_tokens == 16
    rig.resume(kv)
    kv.stop_committing()
    plan = kv.plan_committed_block_drop()
    assert plan is not None
    kv.close()
    plan.drop()
    assert rig.probe(tokens) == 0  # B1's S page died; at 8 S needs B0, which has none
    assert chain_covs(rig.mgr, tokens) == [(8, (0, 8)), (8, (0, 8))]  # SWA page death keeps the block
    rig.check()


def test_D3_commit_min_snapshot_reuses_the_swa_post_commit_prefix():
    rig = Rig("cpu", T=32, layers=[Attention(window=64)], pages=64, commit_min_snapshot=True)
    mgr = rig.mgr
    prompt = list(range(128))
    kv = rig.fresh()
    assert kv.resize(128, 128)
    rig.execute_and_commit(kv, prompt, 128)
    kv.close()
    n, pages = introspect.reuse_match_pages(mgr, prompt, 0)
    assert n == 128 and [p is not None for p in pages] == [False, False, True, True]
    assert rig.probe(prompt[:96]) == 0
    assert rig.reuse(prompt) == 128
    rig.check()


def test_D5_reuse_scopes_isolate_reuse():
    rig = Rig("cpu", T=8, layers=[Attention(), Attention()], pages=64)  # 2 F layers: one life cycle
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


def test_D8_a_partial_block_is_never_rebased_onto_a_full_tree_block(backend):
    rig = Rig(backend, T=8, layers=[Attention()], pages=64)
    mgr = rig.mgr
    prefix = list(range(100, 116))
    a0 = rig.fresh()
    assert a0.resize(13)
    rig.execute_and_commit(a0, prefix, 13)
    a0.stop_committing()
    assert chain_covs(mgr, prefix[:13]) == [(8, (8,)), (5, (5,))]

    a = rig.fresh()
    assert a.resize(16)
    rig.execute_and_commit(a, prefix, 16)
    assert chain_covs(mgr, prefix) == [(8, (8,)), (8, (8,))]
    assert introspect.committed_page_is_linked(a0, 1, 0) is False  # replaced and unlinked
    rig.check()

    b = rig.create(prefix[:12])
    assert b.num_committed_tokens == 12  # a partial match on the full B1
    rig.resume(b)
    rig.engine.verify_reuse(b, prefix)
    assert b.resize(13)
    rig.execute_and_commit(b, prefix, 13)
    b.stop_committing()  # covered by the full B1: VIRTUAL_STOP, no rebase
    assert introspect.committed_page_is_linked(b, 1, 0) is None, "b's block 1 stays private"
    a_index = int(a.page_indices(0)[1])
    b_index = int(b.page_indices(0)[1])
    assert b_index not in (-1, a_index)
    assert chain_covs(mgr, prefix) == [(8, (8,)), (8, (8,))]
    rig.check()

    before = rig.engine.read_page(0, a_index)
    assert b.resize(15)
    rig.engine.run(b, prefix[:13] + [900, 901], 13, 15)  # block-1 offsets 5 and 6 of b's own page
    assert np.array_equal(rig.engine.read_page(0, a_index), before), "b wrote into a's page"
    assert rig.engine.read_page(0, a_index)[5] == token_value(0, 13, prefix[:14])
    assert rig.engine.read_page(0, b_index)[5] == token_value(0, 13, prefix[:13] + [900])
    for kv in (a0, a, b):
        kv.close()
    rig.check()


# ---------------------------------------------------------------------------
# the engine catches wrong data
# ---------------------------------------------------------------------------


def test_engine_catches_wrong_reused_data():
    rig = pc()
    base = list(range(80))
    rig.run_turn(base, refcheck=True)
    kv = rig.create(base + [7])
    assert kv.num_committed_tokens == 80
    rig.resume(kv)
    rig.engine.verify_reuse(kv, base)
    private = int(kv.page_indices(1)[2])  # the private copy of block 2's S page
    assert introspect.committed_page_is_linked(kv, 2, 1) is None
    good = int(rig.engine.read_page(1, private)[3])
    rig.engine.write_word(1, private, 3, good ^ 1)
    with pytest.raises(AssertionError, match="reused KV at position 67"):
        rig.engine.verify_reuse(kv, base)
    rig.engine.write_word(1, private, 3, 0)
    with pytest.raises(AssertionError, match="never written"):
        rig.engine.verify_reuse(kv, base)
    rig.engine.write_word(1, private, 3, good)
    rig.engine.verify_reuse(kv, base)
    with pytest.raises(AssertionError, match="reused KV at position 0"):
        rig.engine.verify_reuse(kv, [5] + base[1:])  # another prefix's KV
    kv.close()
    rig.check()

    _, pages = introspect.reuse_match_pages(rig.mgr, base, 0)
    tree_page = rig.pool_index(pages[1])
    good = int(rig.engine.read_page(0, tree_page)[4])
    rig.engine.write_word(0, tree_page, 4, good + 1)
    with pytest.raises(AssertionError, match="wrong data at block offset 4"):
        rig.engine.verify_tree()
    rig.engine.write_word(0, tree_page, 4, good)
    rig.check()


def test_engine_refuses_to_write_into_a_shared_page():
    rig = Rig("cpu", T=8, layers=[Attention()], pages=16)
    tokens = list(range(16))
    assert rig.run_turn(tokens) == 0
    kv = rig.create(tokens + [99])
    assert kv.num_committed_tokens == 16
    rig.resume(kv)
    assert kv.resize(17)
    with pytest.raises(AssertionError, match="committed \\(shared\\) page"):
        rig.engine.run(kv, tokens, 0, 1)
    rig.execute_and_commit(kv, tokens + [99], 17)
    kv.close()
    rig.check()


# ---------------------------------------------------------------------------
# bad input and faults: each rejected call changes nothing
# ---------------------------------------------------------------------------


def snapshot(rig: Rig, *kvs) -> dict:
    t = introspect.tables(rig.mgr)
    L = len(rig.mgr.life_cycles)
    ssm_lc = rig.mgr.ssm_life_cycle_id
    caches = []
    for kv in kvs:
        st = (kv.num_committed_tokens, kv.history_length, kv.capacity, kv.status)
        if kv.status is not status("CLOSED"):
            st += tuple(tuple(int(x) for x in kv.page_indices(lc)) for lc in range(L) if lc != ssm_lc)
            if ssm_lc is not None:
                st += (kv.ssm_page_index(),)
        caches.append(st)
    return {"tables": {name: t[name].copy() for name in ("blocks", "tokens", "slots", "pages")}, "caches": caches}


def assert_unchanged(rig: Rig, before: dict, *kvs):
    after = snapshot(rig, *kvs)
    for name, table in before["tables"].items():
        assert np.array_equal(table, after["tables"][name]), f"table {name} changed"
    assert after["caches"] == before["caches"], "a cache's state changed"
    rig.check()


@contextlib.contextmanager
def rejected(rig: Rig, kvs, exc, match=None):
    """The call raises ``exc`` (message matching ``match``) and changes nothing."""
    before = snapshot(rig, *kvs)
    with pytest.raises(exc, match=match):
        yield
    assert_unchanged(rig, before, *kvs)


def small_rig(pages=64) -> Rig:
    """T = 4, lc0 = F, lc1 = S(4)."""
    return Rig("cpu", T=4, layers=[Attention(), Attention(window=4)], pages=pages)


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
        with rejected(rig, [kv], gpukv.LogicError, r"Cannot commit tokens after stop_committing\(\)"):
            kv.commit(bad)
    with rejected(rig, [kv], gpukv.LogicError, r"Cannot commit tokens after stop_committing\(\)"):
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
    assert kv.status is status("CLOSED")
    calls = [
        ("resume", lambda: kv.resume()),
        ("suspend", lambda: kv.suspend()),
        ("resize", lambda: kv.resize(12)),
        ("commit", lambda: kv.commit([1])),
        ("stop_committing", lambda: kv.stop_committing()),
    ]
    for name, call in calls:
        with rejected(rig, [kv], gpukv.LogicError):
            call()
    assert kv.status is status("CLOSED")
    assert rig.reuse(tokens) == 6  # the closed cache's commits stay reusable
    rig.check()


def test_calls_in_the_wrong_status_are_rejected():
    """The reference asserts these (semantics.md §2.5 "require ACTIVE"); gpukv
    raises LogicError (oracle_kv choice 3)."""
    rig = small_rig()
    kv = rig.create()
    with rejected(rig, [kv], gpukv.LogicError):
        kv.commit([1])
    with rejected(rig, [kv], gpukv.LogicError):
        kv.resize(4)
    with rejected(rig, [kv], gpukv.LogicError):
        kv.suspend()
    rig.resume(kv)
    with rejected(rig, [kv], gpukv.LogicError):
        kv.resume()
    kv.suspend()
    assert kv.status is status("SUSPENDED")
    rig.resume(kv)
    kv.close()
    rig.check()


def test_resize_below_history_is_rejected():
    rig = small_rig()
    kv = rig.fresh()
    assert kv.resize(8, 4)
    assert (kv.capacity, kv.history_length) == (8, 4)
    with rejected(rig, [kv], ValueError):
        kv.resize(3)  # capacity below history
    with rejected(rig, [kv], ValueError):
        kv.resize(8, 2)  # history never decreases
    with rejected(rig, [kv], ValueError):
        kv.resize(2, 2)
    with rejected(rig, [kv], ValueError):
        kv.resize(8, 9)  # history above capacity
    assert kv.resize(4)  # exactly the history: fine
    assert (kv.capacity, kv.history_length) == (4, 4)
    kv.close()
    rig.check()


def test_commit_beyond_capacity_is_rejected():
    rig = small_rig()
    kv = rig.fresh()
    assert kv.resize(4)
    with rejected(rig, [kv], ValueError):
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
    with rejected(rig, [kv], exc):
        rig.mgr.create_kv_cache(input_tokens=tokens)
    with rejected(rig, [kv], exc):
        kv.commit(tokens)
    kv.close()
    rig.mgr.clear_reusable_blocks()  # the rejected creates left no cache open
    rig.check()


def test_bad_scope_is_rejected():
    rig = small_rig()
    with rejected(rig, [], TypeError):
        rig.mgr.create_kv_cache(input_tokens=[1, 2], scope="lora-7")
    with rejected(rig, [], TypeError):
        rig.mgr.create_kv_cache(scope=(7, 11))
    rig.mgr.clear_reusable_blocks()


def test_resize_out_of_pages_returns_false_and_changes_nothing():
    rig = Rig("cpu", T=4, layers=[Attention(), Attention(window=4)], pages=[8, 2])  # lc0 = F (8 pages), lc1 = S (2)
    tokens = list(range(100, 132))
    kv = rig.fresh()
    assert kv.resize(4)
    rig.execute_and_commit(kv, tokens, 3)
    before = snapshot(rig, kv)
    assert kv.resize(12) is False  # F needs 2 more (fine), S needs 2 more (only 1 free)
    assert_unchanged(rig, before, kv)
    assert (kv.num_committed_tokens, kv.history_length, kv.capacity) == (3, 3, 4)
    assert kv.resize(40, 36) is False  # F would need 9 more
    assert_unchanged(rig, before, kv)
    # At history 32 the S stale range is [0, 7): S needs a page for block 7 only. This
    # takes every F page of the pool, so the failed calls leaked none.
    assert kv.resize(32, 32)
    assert int((np.asarray(kv.page_indices(0)) >= 0).sum()) == 8
    assert [int(x) >= 0 for x in kv.page_indices(1)] == [True] + [False] * 6 + [True]  # block 0 held for its commit

    other = rig.fresh()
    before = snapshot(rig, kv, other)
    assert other.resize(4) is False  # no F page left
    assert_unchanged(rig, before, kv, other)
    assert (other.num_committed_tokens, other.history_length, other.capacity) == (0, 0, 0)
    other.close()
    rig.engine.run(kv, tokens, 3, 32)
    kv.commit(tokens[3:28])
    kv.close()
    rig.check()
    assert chain_covs(rig.mgr, tokens) == [(4, (4, 4))] + [(4, (4, 0))] * 6
    assert rig.probe(tokens[:28]) == 4  # S needs block 6 at 28, ..., block 0 at 4


def test_clear_reusable_blocks_refuses_while_caches_are_open():
    rig = Rig("cpu", T=8, layers=[Attention(), Attention(window=8)], pages=32)
    tokens = list(range(20))
    rig.run_turn(tokens)
    kv1 = rig.create(tokens)
    with rejected(rig, [kv1], gpukv.LogicError, r"clear_reusable_blocks\(\).*1 KV cache\(s\) still open"):
        rig.mgr.clear_reusable_blocks()
    kv2 = rig.fresh()
    with rejected(rig, [kv1, kv2], gpukv.LogicError, r"clear_reusable_blocks\(\).*2 KV cache\(s\) still open"):
        rig.mgr.clear_reusable_blocks()
    with rejected(rig, [kv1, kv2], gpukv.LogicError, r"shutdown\(\).*2 KV cache\(s\) still open"):
        rig.mgr.shutdown()
    assert rig.probe(tokens) == 20
    kv1.close()
    with rejected(rig, [kv2], gpukv.LogicError, r"1 KV cache\(s\) still open"):
        rig.mgr.clear_reusable_blocks()
    kv2.close()
    rig.mgr.clear_reusable_blocks()
    assert rig.probe(tokens) == 0
    assert chain_covs(rig.mgr, tokens) == []
    rig.check()
    assert rig.run_turn(tokens) == 0  # the pages came back
    assert rig.probe(tokens) == 20
    rig.mgr.shutdown()

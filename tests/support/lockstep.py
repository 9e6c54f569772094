"""The sequence layer's lockstep: the plain-Python model ``KVOracle``
(``tests/support/oracle_kv.py``, docs/semantics.md to the letter) and a gpukv
manager (``cpu``, real page memory played by ``tests/support/engine.py``)
driven by the random conversations of ``tests/support/conversations.py``,
every call on both sides.

Both sides must give the same outcome for every call (the same value, or
errors of corresponding types; a refused call changes nothing), and after
every step they must agree on:
- ``probe_reuse`` of a few queries (conversation prefixes, cut mid-block, and
  continuations), and the batch diagnostics of the same queries;
- ``introspect.reuse_match_pages`` of those queries for every life cycle, with and
  without partial matching: the reused length and, per matched block, whether a
  page is there and its coverage (page ids are not compared);
- every attached tree block with its per-life-cycle coverage;
- every open cache's ``num_committed_tokens``, ``history_length``, ``capacity``,
  status, which blocks hold a page per life cycle, whether it has a live SSM page,
  and ``committed_page_is_linked`` per block;
and both sanity checkers pass, and the test engine verifies the data of every
page in the tree and the reused KV of every open cache.

``CONFIGS`` are the models every lockstep run plays; ``POOL`` gives both sides
pools big enough that nothing is evicted, ``PRESSURE_POOL`` and ``TIGHT_POOL``
pools so small that allocations evict all the time, and are refused too.
"""

from __future__ import annotations

import random

import pytest

import gpukv
from gpukv import Attention, ReuseScope, Ssm, introspect

from tests.support import oracle as O
from tests.support import oracle_kv as OK
from tests.support.backends import make_manager
from tests.support.conversations import Conversations, Turn
from tests.support.engine import Engine, attached_blocks

F = O.LifeCycle(O.FULL)
M = O.LifeCycle(O.SSM)


def S(window: int, sink_blocks: int = 0) -> O.LifeCycle:
    return O.LifeCycle(O.SWA, window, sink_blocks)


# (name, T, gpukv layers, oracle life cycles, commit_min_snapshot, enable_partial_reuse, backoff).
# Layers are listed so that life-cycle ids agree; sinks are tokens for gpukv and
# blocks for the oracle (1 sink token at T = 4 is one sink block).
CONFIGS = [
    ("F", 4, [Attention()], [F], False, True, 0),
    ("F-nopartial-backoff", 4, [Attention()], [F], False, False, 1),
    ("F+S", 4, [Attention(), Attention(window=6)], [F, S(6)], False, True, 0),
    ("F+S-cms", 4, [Attention(), Attention(window=6)], [F, S(6)], True, True, 0),
    (
        "S+F+Ssink-cms-backoff",
        4,
        [Attention(window=5), Attention(), Attention(window=9, sink_tokens=1)],
        [S(5), F, S(9, 1)],
        True,
        True,
        2,
    ),
    ("S-only-cms", 4, [Attention(window=6)], [S(6)], True, True, 0),
    ("S-only", 4, [Attention(window=3)], [S(3)], False, True, 1),
    ("F+M", 4, [Attention(), Ssm()], [F, M], True, False, 0),
    ("F+S+M-partial", 4, [Attention(), Attention(window=6), Ssm()], [F, S(6), M], True, True, 0),
    ("S+M-partial", 4, [Attention(window=5), Ssm()], [S(5), M], True, True, 1),
]
CONFIG_IDS = [c[0] for c in CONFIGS]
SCOPES = [None, None, None, ReuseScope(lora_id=1), ReuseScope(salt=9)]
ORACLE_SCOPES = [None, None, None, (1, None), (None, 9)]
POOL = 4096  # pages per life cycle on both sides: nothing is ever evicted
PRESSURE_POOL = 24  # ... small enough that allocations evict all the time
TIGHT_POOL = 7  # ... and so small that allocations are refused too


def same_outcome(f_oracle, f_gpukv, what: str):
    """Run one call on both sides: both return (results returned as a pair) or
    both raise exceptions of corresponding types."""
    results, errors = [], []
    for f in (f_oracle, f_gpukv):
        try:
            results.append(f())
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - compared below
            results.append(None)
            errors.append(e)
    eo, eg = errors
    if eo is None and eg is None:
        return results
    if eo is not None and eg is not None:
        kinds = [(OK.LogicError, gpukv.LogicError), (ValueError, ValueError), (TypeError, TypeError)]
        for ko, kg in kinds + [(RuntimeError, RuntimeError)]:
            if isinstance(eo, ko):
                assert isinstance(eg, kg), f"{what}: the oracle raised {eo!r}, gpukv raised {eg!r}"
                raise eg
        raise eg
    said = ["raised " + repr(e) if e is not None else "returned" for e in errors]
    raise AssertionError(f"{what}: the oracle {said[0]}, gpukv {said[1]}")


class Lockstep(Conversations):
    """The oracle and gpukv driven by one random conversation workload
    (``tests/support/conversations.py``), every call on both sides (see the
    module docstring)."""

    def __init__(self, rng, config, pool: int = POOL, stable_pages: bool = False):
        name, T, layers, lcs, cms, partial, backoff = config
        oracle = OK.KVOracle(
            T, lcs, pool, enable_partial_reuse=partial, commit_min_snapshot=cms, reuse_match_backoff=backoff,
            evict=pool != POOL, stable_pages=stable_pages,
        )
        # Under stable_pages, twin requests commit the same full blocks side by
        # side: the later one finds each in the tree already (the rebase).
        super().__init__(rng, oracle, T, cms, num_scopes=len(SCOPES), twins=stable_pages)
        self.L = len(lcs)
        self.mgr = make_manager(
            "cpu",
            tokens_per_block=T,
            layers=layers,
            pages_per_life_cycle=pool,
            page_bytes=8 * T,
            enable_partial_reuse=partial,
            commit_min_snapshot=cms,
            reuse_match_backoff=backoff,
            stable_pages=stable_pages,
        )
        assert len(self.mgr.life_cycles) == self.L, "life-cycle ids must agree"
        self.stable_pages = stable_pages
        self.windowed = [lc.kind == O.SWA for lc in lcs]
        self.reported: dict = {}  # Turn -> {life cycle: page indices last reported while ACTIVE}
        self.engine = Engine(self.mgr)

    # -- one call on both sides ---------------------------------------------------------------
    def probe(self, tokens, scope: int) -> int:
        n_o = self.o.probe_reuse(tokens, ORACLE_SCOPES[scope])
        n_g = self.mgr.probe_reuse(tokens, SCOPES[scope])
        assert n_g == n_o, f"probe_reuse({tokens}, scope {scope}): gpukv {n_g}, oracle {n_o}"
        return n_o

    def create(self, lookup, scope: int) -> Turn:
        n = self.probe(lookup, scope)
        okv = self.o.create_kv_cache(input_tokens=lookup, scope=ORACLE_SCOPES[scope])
        gkv = self.mgr.create_kv_cache(input_tokens=lookup, scope=SCOPES[scope])
        assert okv.num_committed_tokens == n, "the oracle's probe and create disagree"
        assert gkv.num_committed_tokens == n, f"gpukv's create ({gkv.num_committed_tokens}) and probe ({n}) disagree"
        return Turn(okv, gkv, scope, lookup[:n])

    def state(self, t: Turn):
        """Everything a refused call must leave as it was: the tables and the cache."""
        tables = {k: v.copy() for k, v in introspect.tables(self.mgr).items() if k in ("blocks", "slots", "pages", "tokens")}
        return tables, (t.g.num_committed_tokens, t.g.history_length, t.g.capacity, t.g.status,
                        [tuple(t.g.page_indices(lc)) for lc in range(self.L)])

    def assert_unchanged(self, before, t: Turn, what: str):
        after = self.state(t)
        for name, table in before[0].items():
            assert (table == after[0][name]).all(), f"{what} was refused but changed the {name} table"
        assert before[1] == after[1], f"{what} was refused but changed the cache"

    def resume(self, t: Turn) -> bool:
        before = self.state(t)
        ok_o, ok_g = same_outcome(t.o.resume, t.g.resume, "resume")
        assert bool(ok_o) == (ok_g is not False), f"resume: oracle {ok_o}, gpukv {ok_g}"
        if not ok_o:
            self.assert_unchanged(before, t, "resume()")
        return bool(ok_o)

    def suspend(self, t: Turn):
        same_outcome(t.o.suspend, t.g.suspend, "suspend")
        self.observe(t)

    def observe(self, t: Turn):
        """Under ``stable_pages``, a page an ACTIVE cache has reported for a
        block stays what it reports for that block until the cache closes or
        is suspended, except that a window life cycle gives up the pages that
        slid out of its window (-1). Called after every call that may change
        the cache's pages: a shrinking resize ends the blocks past it, so a
        later page for such a block is a new one."""
        if not self.stable_pages:
            return
        if t.g.status.name != "ACTIVE":
            self.reported.pop(t, None)
            return
        seen = self.reported.setdefault(t, {})
        for lc in range(self.L):
            if lc == self.o.ssm_lc:
                continue
            now = [int(x) for x in t.g.page_indices(lc)]
            for o, (was, is_) in enumerate(zip(seen.get(lc, ()), now)):
                if was >= 0 and is_ != was and not (self.windowed[lc] and is_ == -1):
                    raise AssertionError(f"{t}: block {o} of life cycle {lc} was reported on page {was}, now on {is_}")
            seen[lc] = now
            self.count("pages_observed", sum(p >= 0 for p in now))

    def resize(self, t: Turn, capacity, history=None) -> bool:
        before = self.state(t)
        ok_o, ok_g = same_outcome(
            lambda: t.o.resize(capacity, history), lambda: t.g.resize(capacity, history), f"resize({capacity}, {history})"
        )
        assert ok_o == ok_g, f"resize({capacity}, {history}): oracle {ok_o}, gpukv {ok_g}"
        self.observe(t)
        if not ok_o:
            self.assert_unchanged(before, t, f"resize({capacity}, {history})")
        return ok_o

    def run(self, t: Turn, tokens_all, start: int, end: int):
        OK.write_tokens(t.o, start, tokens_all[start:end])
        self.engine.run(t.g, tokens_all, start, end)

    def commit(self, t: Turn, tokens, is_end=False):
        same_outcome(lambda: t.o.commit(tokens, is_end=is_end), lambda: t.g.commit(tokens, is_end=is_end), "commit")
        self.observe(t)

    def stop(self, t: Turn):
        same_outcome(t.o.stop_committing, t.g.stop_committing, "stop_committing")

    def refuse_commit_after_stop(self, t: Turn):
        with pytest.raises(gpukv.LogicError, match=r"Cannot commit tokens after stop_committing\(\)"):
            t.g.commit(self.tokens(1))
        with pytest.raises(OK.LogicError):
            t.o.commit(self.tokens(1))

    def plan(self, t: Turn):
        p_o, p_g = same_outcome(t.o.plan_committed_block_drop, t.g.plan_committed_block_drop, "plan_committed_block_drop")
        assert (p_o is None) == (p_g is None), f"plan_committed_block_drop: oracle {p_o}, gpukv {p_g}"
        return None if p_o is None else (p_o, p_g)

    def drop(self, plan):
        p_o, p_g = plan
        p_o.drop()
        p_g.drop()

    def refuse_second_drop(self, plan):
        p_o, p_g = plan
        with pytest.raises(RuntimeError, match="already been dropped"):
            p_g.drop()
        with pytest.raises(RuntimeError, match="already been dropped"):
            p_o.drop()

    def close(self, t: Turn):
        same_outcome(t.o.close, t.g.close, "close")
        self.reported.pop(t, None)

    def clear(self):
        self.mgr.clear_reusable_blocks()
        self.o.clear_reusable_blocks()
        assert attached_blocks(self.mgr) == {}

    def refuse_clear(self, num_open: int):
        with pytest.raises(gpukv.LogicError, match=rf"clear_reusable_blocks\(\).*{num_open} KV cache\(s\) still open"):
            self.mgr.clear_reusable_blocks()
        with pytest.raises(OK.LogicError):
            self.o.clear_reusable_blocks()

    # -- comparison -----------------------------------------------------------------------------
    def compare_trees(self):
        mine = attached_blocks(self.mgr)
        theirs = {
            k: (tuple(b.tokens), tuple(b.cov(lc) for lc in range(self.L))) for k, b in self.o.tree.attached_blocks().items()
        }
        if mine != theirs:
            only_g = {v for k, v in mine.items() if k not in theirs}
            only_o = {v for k, v in theirs.items() if k not in mine}
            diff = {theirs[k][0]: (mine[k][1], theirs[k][1]) for k in mine.keys() & theirs.keys() if mine[k] != theirs[k]}
            raise AssertionError(
                f"trees differ: only in gpukv {sorted(only_g)}, only in the oracle {sorted(only_o)}, "
                f"coverage (gpukv, oracle) {diff}\n{introspect.dump(self.mgr)}"
            )

    def compare_caches(self):
        for t in self.open:
            o, g = t.o, t.g
            assert g.num_committed_tokens == o.num_committed_tokens == len(t.tokens), f"{t}: committed tokens"
            assert g.history_length == o.history_length, f"{t}: history_length (oracle {o.history_length})"
            assert g.capacity == o.capacity, f"{t}: capacity (oracle {o.capacity})"
            assert g.status.name == o.status.name, f"{t}: status (oracle {o.status})"
            for lc in range(self.L):
                if lc == self.o.ssm_lc:
                    continue
                have_g = [int(x) >= 0 for x in g.page_indices(lc)]
                have_o = [x != -1 for x in o.page_indices(lc)]
                assert have_g == have_o, f"{t}: blocks with a page for life cycle {lc}: gpukv {have_g}, oracle {have_o}"
                linked_g = [introspect.committed_page_is_linked(g, b, lc) for b in range(len(have_g))]
                linked_o = [o.committed_page_is_linked(b, lc) for b in range(len(have_o))]
                assert linked_g == linked_o, (
                    f"{t}: committed_page_is_linked for life cycle {lc}: gpukv {linked_g}, oracle {linked_o}"
                )
            if self.o.ssm_lc is not None and not o.never_resumed:
                assert (g.ssm_page_index() != -1) == (o.ssm_page_index() != -1), f"{t}: live SSM page"

    def queries(self) -> list:
        """A few token lists worth matching now: finished or open conversations,
        cut at random points, sometimes with a new continuation."""
        rng = self.rng
        pool = [(s, c) for s, c in self.history[-8:]] + [(t.scope, t.tokens) for t in self.open]
        out = []
        for _ in range(min(3, len(pool))):
            scope, conv = rng.choice(pool)
            q = list(conv[: rng.randint(0, len(conv))])
            if rng.random() < 0.3:
                q += self.tokens(rng.randint(1, self.T))
            out.append((scope, q))
        return out

    def compare_matches(self):
        qs = self.queries()
        if not qs:
            return
        for scope, q in qs:
            self.probe(q, scope)
            want = self.o.match(q, ORACLE_SCOPES[scope])
            got = self.mgr.match_batch([q], SCOPES[scope]).to_host()
            assert (int(got.num_tokens_before_pruning[0]), int(got.num_tokens_before_hybrid_pruning[0])) == (
                want.num_tokens_before_pruning,
                want.num_tokens_before_hybrid_pruning,
            ), f"match diagnostics of {q}"
            partial = self.rng.random() < 0.5
            for lc in range(self.L):
                n_o, pages_o = self.o.reuse_match_pages(q, lc, ORACLE_SCOPES[scope], enable_partial=partial)
                n_g, pages_g = introspect.reuse_match_pages(self.mgr, q, lc, SCOPES[scope], enable_partial=partial)
                cov_o = [None if p is None else p[1] for p in pages_o]
                cov_g = [None if p is None else p[1] for p in pages_g]
                assert (n_g, cov_g) == (n_o, cov_o), (
                    f"reuse_match_pages({q}, life cycle {lc}, partial={partial}): gpukv {(n_g, cov_g)}, oracle {(n_o, cov_o)}"
                )

    def check(self):
        self.o.check_sanity()
        introspect.check_sanity(self.mgr)
        self.compare_trees()
        self.compare_caches()
        self.compare_matches()
        for t in self.open:
            self.observe(t)
        self.engine.verify_tree()
        for t in self.open:
            self.engine.verify_reuse(t.g, t.tokens)
            OK.verify_reuse(t.o)


def run_workload(seed: int, config, steps: int, pool: int = POOL) -> dict:
    return Lockstep(random.Random(seed), config, pool).run_steps(steps)

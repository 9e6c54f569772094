"""The sequence layer's lockstep: the plain-Python model ``KVOracle``
(``tests/support/oracle_kv.py``, docs/semantics.md to the letter) and a gpukv
manager (``cpu``, real page memory played by ``tests/support/engine.py``)
driven by one random workload, every call on both sides.

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
VOCAB = 4  # a tiny vocabulary makes shared prefixes and covering siblings frequent
SCOPES = [None, None, None, ReuseScope(lora_id=1), ReuseScope(salt=9)]
ORACLE_SCOPES = [None, None, None, (1, None), (None, 9)]
POOL = 4096  # pages per life cycle on both sides: nothing is ever evicted
PRESSURE_POOL = 24  # ... small enough that allocations evict all the time
TIGHT_POOL = 7  # ... and so small that allocations are refused too


class Turn:
    """One cache, created on both sides, and the tokens it has committed."""

    def __init__(self, okv, gkv, scope: int, tokens):
        self.o = okv
        self.g = gkv
        self.scope = scope
        self.tokens = list(tokens)  # committed tokens
        self.stopped = False

    def __repr__(self) -> str:
        return f"Turn(scope={self.scope}, committed={len(self.tokens)}, {self.g!r})"


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


class Lockstep:
    """The oracle and gpukv driven by one random workload (see the module docstring)."""

    def __init__(self, rng, config, pool: int = POOL, stable_pages: bool = False):
        name, T, layers, lcs, cms, partial, backoff = config
        self.rng = rng
        self.T = T
        self.L = len(lcs)
        self.cms = cms
        self.has_ssm = any(lc.kind == O.SSM for lc in lcs)
        self.o = OK.KVOracle(
            T, lcs, pool, enable_partial_reuse=partial, commit_min_snapshot=cms, reuse_match_backoff=backoff,
            evict=pool != POOL, stable_pages=stable_pages,
        )
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
        self.prompts: list = []  # (scope, prompt) of every turn, in order
        self.engine = Engine(self.mgr)
        self.open: list[Turn] = []
        self.history: list[tuple] = []  # (scope index, committed tokens) of finished turns
        self.plans: list[tuple] = []  # (oracle plan, gpukv plan)
        self.jobs: list = []
        self.stats: dict = {}

    def count(self, what: str, n: int = 1):
        self.stats[what] = self.stats.get(what, 0) + n

    # -- random data ----------------------------------------------------------------------
    def tokens(self, n: int) -> list:
        return [self.rng.randrange(VOCAB) for _ in range(n)]

    def new_prompt(self):
        rng, T = self.rng, self.T
        if self.stable_pages and self.prompts and rng.random() < 0.3:
            # A twin of a recent request (n > 1 sampling, a retried request):
            # run side by side, both commit the same full blocks, so the later
            # one finds each of them in the tree already (the rebase).
            self.count("twin")
            return rng.choice(self.prompts[-4:])
        if self.history and rng.random() < 0.8:
            scope, conv = rng.choice(self.history)
            cut = len(conv) if rng.random() < 0.3 else rng.randint(0, len(conv))  # often a mid-block rewind
            prompt = conv[: min(cut, 8 * T)]
            self.count("continue" if cut == len(conv) else "rewind")
        else:
            scope, prompt = rng.randrange(len(SCOPES)), []
        return scope, prompt + self.tokens(rng.randint(1, 3 * T))

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
        turn = Turn(okv, gkv, scope, lookup[:n])
        self.open.append(turn)
        self.count("reused_tokens", n)
        self.count("partial_reuse", n % self.T != 0)
        return turn

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
            self.count("resize_failed")
            self.assert_unchanged(before, t, f"resize({capacity}, {history})")
        return ok_o

    def run(self, t: Turn, tokens_all, start: int, end: int):
        """The model runs positions [start, end) on both sides."""
        OK.write_tokens(t.o, start, tokens_all[start:end])
        self.engine.run(t.g, tokens_all, start, end)

    def commit(self, t: Turn, tokens, is_end=False):
        same_outcome(lambda: t.o.commit(tokens, is_end=is_end), lambda: t.g.commit(tokens, is_end=is_end), "commit")
        self.observe(t)
        t.tokens += tokens
        if is_end:
            t.stopped = True

    def stop(self, t: Turn):
        same_outcome(t.o.stop_committing, t.g.stop_committing, "stop_committing")
        t.stopped = True

    def close(self, t: Turn):
        same_outcome(t.o.close, t.g.close, "close")
        self.open.remove(t)
        self.reported.pop(t, None)

    def plan(self, t: Turn):
        p_o, p_g = same_outcome(t.o.plan_committed_block_drop, t.g.plan_committed_block_drop, "plan_committed_block_drop")
        assert (p_o is None) == (p_g is None), f"plan_committed_block_drop: oracle {p_o}, gpukv {p_g}"
        if p_o is not None:
            self.plans.append((p_o, p_g))
            self.count("plans")

    # -- a turn, as a generator: each yield is a point where other turns interleave ----------------
    def give_up(self, t: Turn):
        if t.g.status.name == "SUSPENDED" and self.rng.random() < 0.5 and not t.o.never_resumed:
            self.resume(t)
        self.close(t)

    def turn(self):
        rng, T = self.rng, self.T
        scope, prompt = self.new_prompt()
        self.prompts.append((scope, prompt))
        lookup = prompt[:-1] if rng.random() < 0.5 else prompt
        t = self.create(lookup, scope)
        yield
        if not self.resume(t):
            self.give_up(t)
            return
        yield
        pos = len(t.tokens)
        while pos < len(prompt):  # chunked prefill
            end = rng.randint(pos + 1, len(prompt))
            hist = rng.choice([pos, end]) if self.cms else rng.randint(pos, end)
            if not self.resize(t, end, hist):
                self.give_up(t)
                return
            yield
            self.run(t, prompt, pos, end)
            if rng.random() < 0.2:
                self.suspend(t)
                yield
                assert self.resume(t), "a later resume never allocates"
            self.commit(t, prompt[pos:end])
            pos = end
            yield
        for _ in range(rng.randint(0, 2 * T)):  # generation, with speculative tokens (none with SSM)
            spec = 0 if self.has_ssm else rng.randint(0, 2)
            if not self.resize(t, pos + 1 + spec, pos):
                self.give_up(t)
                return
            new = self.tokens(1 + spec)
            self.run(t, t.tokens + new, pos, pos + 1 + spec)
            accepted = new[: 1 + rng.randint(0, spec)]
            is_end = rng.random() < 0.1
            self.commit(t, accepted, is_end=is_end)
            pos += len(accepted)
            if t.g.capacity > pos and rng.random() < 0.8:
                assert self.resize(t, pos), "a rewind never allocates"
                self.count("rewinds")
            yield
            if is_end:
                break
        self.history.append((scope, list(t.tokens)))
        if rng.random() < 0.4:
            self.stop(t)
            self.plan(t)
            with pytest.raises(gpukv.LogicError, match=r"Cannot commit tokens after stop_committing\(\)"):
                t.g.commit(self.tokens(1))
            with pytest.raises(OK.LogicError):
                t.o.commit(self.tokens(1))
        for _ in range(rng.randint(0, 3)):  # stay open a while (like A0 in D8)
            if t.g.status.name == "ACTIVE" and rng.random() < 0.3:
                self.suspend(t)
            yield
        self.close(t)
        self.count("turns")

    # -- steps -------------------------------------------------------------------------------------
    def step(self):
        rng = self.rng
        r = rng.random()
        if r < 0.05 and self.plans:
            p_o, p_g = self.plans.pop(rng.randrange(len(self.plans)))
            p_o.drop()
            p_g.drop()
            self.count("drops")
            if rng.random() < 0.3:
                with pytest.raises(RuntimeError, match="already been dropped"):
                    p_g.drop()
                with pytest.raises(RuntimeError, match="already been dropped"):
                    p_o.drop()
        elif r < 0.07:
            if self.open and rng.random() < 0.15:
                self.drain()  # finish every turn, so that the clear below happens
            n = len(self.open)
            if n:
                with pytest.raises(gpukv.LogicError, match=rf"clear_reusable_blocks\(\).*{n} KV cache\(s\) still open"):
                    self.mgr.clear_reusable_blocks()
                with pytest.raises(OK.LogicError):
                    self.o.clear_reusable_blocks()
            else:
                self.mgr.clear_reusable_blocks()
                self.o.clear_reusable_blocks()
                assert attached_blocks(self.mgr) == {}
                self.count("clears")
        elif r < 0.12 and self.history:
            scope, conv = rng.choice(self.history)
            t = self.create(conv[: rng.randint(1, len(conv))], scope)  # a reuse probe that holds pages a moment
            self.check()
            self.close(t)
        else:
            if len(self.jobs) < 3 and (not self.jobs or rng.random() < 0.3):
                self.jobs.append(self.turn())
            job = rng.choice(self.jobs)
            try:
                next(job)
            except StopIteration:
                self.jobs.remove(job)
        self.check()

    def drain(self):
        """Run every turn in progress to its end."""
        while self.jobs:
            for job in list(self.jobs):
                try:
                    next(job)
                except StopIteration:
                    self.jobs.remove(job)
                self.check()
        assert not self.open and not self.o.open_caches

    def run_steps(self, steps: int):
        for _ in range(steps):
            self.step()
        self.drain()
        self.mgr.clear_reusable_blocks()  # no cache is open: allowed
        self.o.clear_reusable_blocks()
        self.check()
        return self.stats

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

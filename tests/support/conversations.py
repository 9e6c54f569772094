"""The random conversation driver: the one workload of the sequence oracle's own
random runs and of every lockstep run against it.

A workload re-enters earlier conversations at random endpoints (often
mid-block), runs chunked prefills and generation steps with speculative tokens
that get partly rejected (capacity rewinds), suspends and resumes, ends turns
with a stop, an end commit or a planned drop, leaves caches open for a while,
and clears the tree. Several turns run interleaved; a step advances one of
them, drops a planned drop, clears the tree (or finds it refused while caches
are open), or holds a reuse probe open for a moment. With ``twins`` a recent
request now and then comes again (n > 1 sampling, a retried request), so that
two caches commit the same full blocks side by side. A tiny vocabulary makes
shared prefixes and covering siblings frequent.

``Conversations`` makes every random choice, from the plain-Python model's
state (``self.o``, a ``KVOracle``: every side has one), and checks what the
model alone must satisfy. A subclass, a *side*, carries each call out: on the
oracle alone (``tests/oracles/test_sequence_oracle.py``), or on the oracle and
gpukv in lockstep, comparing them (``tests/support/lockstep.py``). The side's
``check`` runs after every step.
"""

from __future__ import annotations

from collections import Counter

from tests.support import oracle_kv as OK

VOCAB = 4  # a tiny vocabulary makes shared prefixes and covering siblings frequent


class Turn:
    """One cache of the workload: the oracle's (``o``), gpukv's where the side
    has one (``g``), the index of its scope, and the tokens it has committed."""

    def __init__(self, o, g, scope: int, tokens):
        self.o = o
        self.g = g
        self.scope = scope
        self.tokens = list(tokens)  # committed tokens
        self.stopped = False

    def __repr__(self) -> str:
        return f"Turn(scope={self.scope}, committed={len(self.tokens)}, {self.g if self.g is not None else self.o!r})"


class Conversations:
    """The driver (see the module docstring). ``oracle``: the side's
    ``KVOracle``; ``num_scopes``: how many reuse scopes the side knows (a turn
    names its scope by index); ``commit_min_snapshot``: the configuration's, so
    that a prefill's history ends where a snapshot may be taken."""

    def __init__(self, rng, oracle, tokens_per_block: int, commit_min_snapshot: bool, num_scopes: int,
                 twins: bool = False):
        self.rng = rng
        self.o = oracle
        self.T = tokens_per_block
        self.cms = commit_min_snapshot
        self.has_ssm = oracle.ssm_lc is not None  # no speculative tokens: an SSM state cannot rewind
        self.num_scopes = num_scopes
        self.twins = twins
        self.stats: Counter = Counter()
        self.open: list[Turn] = []
        self.history: list[tuple] = []  # (scope index, committed tokens) of finished turns
        self.prompts: list[tuple] = []  # (scope index, prompt) of every turn, in order
        self.plans: list = []  # planned drops not dropped yet, as the side returned them
        self.jobs: list = []  # the turns in progress, as generators

    # -- the calls, carried out by a side -----------------------------------------------------
    def create(self, lookup, scope: int) -> Turn:
        """A cache reusing what it can of ``lookup``: its ``Turn``, whose tokens are the reused ones."""
        raise NotImplementedError

    def resume(self, t: Turn) -> bool:
        raise NotImplementedError

    def suspend(self, t: Turn):
        raise NotImplementedError

    def resize(self, t: Turn, capacity: int, history=None) -> bool:
        raise NotImplementedError

    def run(self, t: Turn, tokens_all, start: int, end: int):
        """The model runs positions [start, end) of ``tokens_all``."""
        raise NotImplementedError

    def commit(self, t: Turn, tokens, is_end: bool = False):
        raise NotImplementedError

    def stop(self, t: Turn):
        raise NotImplementedError

    def refuse_commit_after_stop(self, t: Turn):
        """A commit after ``stop_committing`` is refused."""
        raise NotImplementedError

    def plan(self, t: Turn):
        """``plan_committed_block_drop``: the plan, or None when there is nothing to drop."""
        raise NotImplementedError

    def drop(self, plan):
        raise NotImplementedError

    def refuse_second_drop(self, plan):
        raise NotImplementedError

    def close(self, t: Turn):
        raise NotImplementedError

    def clear(self):
        raise NotImplementedError

    def refuse_clear(self, num_open: int):
        """``clear_reusable_blocks`` is refused while ``num_open`` caches are open."""
        raise NotImplementedError

    def check(self):
        raise NotImplementedError

    # -- random data -------------------------------------------------------------------------
    def count(self, what: str, n: int = 1):
        self.stats[what] += n

    def tokens(self, n: int) -> list:
        return [self.rng.randrange(VOCAB) for _ in range(n)]

    def new_prompt(self):
        """``(scope index, prompt)``: a twin of a recent request, an earlier
        conversation re-entered at a random endpoint and continued, or a new one."""
        rng, T = self.rng, self.T
        if self.twins and self.prompts and rng.random() < 0.3:
            self.count("twin")
            return rng.choice(self.prompts[-4:])
        if self.history and rng.random() < 0.8:
            scope, conv = rng.choice(self.history)
            cut = len(conv) if rng.random() < 0.3 else rng.randint(0, len(conv))  # often a mid-block rewind
            prompt = conv[: min(cut, 8 * T)]
            self.count("continue" if cut == len(conv) else "rewind")
        else:
            scope, prompt = rng.randrange(self.num_scopes), []
        return scope, prompt + self.tokens(rng.randint(1, 3 * T))

    # -- a turn, as a generator: each yield is a point where other turns interleave ----------------
    def open_turn(self, lookup, scope: int) -> Turn:
        t = self.create(lookup, scope)
        m = t.o.reuse_match  # what the model's match found (docs/semantics.md §2.4)
        n = len(t.tokens)
        assert n == t.o.num_committed_tokens <= m.num_tokens_before_hybrid_pruning <= m.num_tokens_before_pruning
        assert m.num_tokens_before_pruning <= m.num_lookup_tokens == len(lookup)
        self.open.append(t)
        self.count("reused_tokens", n)
        self.count("partial_reuse", n % self.T != 0)
        return t

    def close_turn(self, t: Turn):
        self.close(t)
        self.open.remove(t)

    def give_up(self, t: Turn):
        """Out of pages: the turn ends here."""
        self.count("oom")
        if t.o.status is OK.Status.SUSPENDED and self.rng.random() < 0.5 and not t.o.never_resumed:
            self.resume(t)
        self.close_turn(t)

    def turn(self):
        rng, T = self.rng, self.T
        scope, prompt = self.new_prompt()
        self.prompts.append((scope, prompt))
        lookup = prompt[:-1] if rng.random() < 0.5 else prompt
        t = self.open_turn(lookup, scope)
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
                self.count("resize_failed")
                self.give_up(t)
                return
            yield
            self.run(t, prompt, pos, end)
            if rng.random() < 0.2:
                self.suspend(t)
                yield
                assert self.resume(t), "a later resume never allocates"
            self.commit(t, prompt[pos:end])
            t.tokens += prompt[pos:end]
            pos = end
            yield
        for _ in range(rng.randint(0, 2 * T)):  # generation, with speculative tokens (none with SSM)
            spec = 0 if self.has_ssm else rng.randint(0, 2)
            if not self.resize(t, pos + 1 + spec, pos):
                self.count("resize_failed")
                self.give_up(t)
                return
            new = self.tokens(1 + spec)
            self.run(t, t.tokens + new, pos, pos + 1 + spec)
            accepted = new[: 1 + rng.randint(0, spec)]
            is_end = rng.random() < 0.1
            self.commit(t, accepted, is_end=is_end)
            t.tokens += accepted
            pos += len(accepted)
            if is_end:
                t.stopped = True
                assert t.o.commit_state is OK.CommitState.USER_STOP
            if t.o.capacity > pos and rng.random() < 0.8:
                assert self.resize(t, pos), "a rewind never allocates"
                self.count("rewinds")
            yield
            if is_end:
                break
        self.history.append((scope, list(t.tokens)))
        if rng.random() < 0.4:
            self.stop(t)
            t.stopped = True
            plan = self.plan(t)
            if plan is not None:
                self.plans.append(plan)
                self.count("plans")
            self.refuse_commit_after_stop(t)
        for _ in range(rng.randint(0, 3)):  # stay open a while (like A0 in D8)
            if t.o.status is OK.Status.ACTIVE and rng.random() < 0.3:
                self.suspend(t)
            yield
        self.close_turn(t)
        self.count("turns")

    # -- steps -------------------------------------------------------------------------------------
    def step(self):
        rng = self.rng
        r = rng.random()
        if r < 0.05 and self.plans:
            plan = self.plans.pop(rng.randrange(len(self.plans)))
            self.drop(plan)
            self.count("drops")
            if rng.random() < 0.3:
                self.refuse_second_drop(plan)
        elif r < 0.07:
            if self.open and rng.random() < 0.15:
                self.drain()  # finish every turn, so that the clear below happens
            if self.open:
                self.refuse_clear(len(self.open))
            else:
                self.clear()
                o = self.o
                assert o.tree.next == {}, "a clear with no cache open leaves no block"
                assert all(o.free_pages(lc) == o.num_pages[lc] for lc in range(o.num_life_cycles)), "nor a page in use"
                self.count("clears")
        elif r < 0.12 and self.history:
            scope, conv = rng.choice(self.history)
            t = self.open_turn(conv[: rng.randint(1, len(conv))], scope)  # a reuse probe that holds pages a moment
            self.check()
            self.close_turn(t)
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

    def run_steps(self, steps: int) -> Counter:
        """``steps`` steps, every turn run to its end, a clear (no cache is open:
        allowed), and the stats of the run."""
        for _ in range(steps):
            self.step()
        self.drain()
        self.clear()
        self.check()
        return self.stats

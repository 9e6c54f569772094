"""The batched lockstep: ``Lockstep``'s plain-Python model and gpukv manager
(``tests/support/lockstep.py``), the gpukv side driven through the batched
engine-step calls (``create_kv_caches`` or ``match_batch`` + ``admit_batch``,
``allocate_batch``, ``resume_batch``, ``resize_batch``, ``commit_batch``,
``close_batch``), plus a twin manager driven per cache, in the same order.

A random workload admits a few requests at a time, runs chunked prefills and
decode steps over a random subset of the running caches in a random order,
and finishes some (``BatchLockstep.engine_step``). After every step the
batched manager must agree with the oracle on everything ``Lockstep.check``
compares, and with the per-cache twin exactly (the same page in every slot of
every cache, the same eviction counts).
"""

from __future__ import annotations

import dataclasses

import numpy as np

import gpukv

from tests.support.engine import Engine
from tests.support.conversations import Turn
from tests.support.lockstep import ORACLE_SCOPES, POOL, SCOPES, Lockstep


class BatchLockstep(Lockstep):
    """``Lockstep``'s oracle and gpukv manager, the gpukv side driven through
    the batched calls, plus a twin manager driven per cache."""

    def __init__(self, rng, config, pool: int = POOL, backend: str = "cpu", appends: bool = False):
        super().__init__(rng, config, pool)
        self.appends = appends  # some steps end in append_batch
        if backend != "cpu":  # the batched side on the CUDA kernels, the twin on cpu
            self.mgr = gpukv.KVCacheManager(dataclasses.replace(self.mgr.config, backend=backend))
            self.engine = Engine(self.mgr)
        self.twin = gpukv.KVCacheManager(dataclasses.replace(self.mgr.config, backend="cpu"))
        self.twins: dict = {}  # id(turn) -> the twin's cache
        self.flat_form = False

    # -- the calls, three ways ------------------------------------------------------------
    def admit(self, k: int) -> list:
        prompts = []
        for _ in range(k):
            scope, prompt = self.new_prompt()
            lookup = prompt[:-1] if self.rng.random() < 0.5 else prompt
            prompts.append((scope, prompt, lookup))
        if self.rng.random() < 0.5:
            requests = [lookup for _, _, lookup in prompts]
        else:  # registered sequences, as a scheduler keeps its waiting queue
            requests = [self.mgr.token_sequence(lookup) for _, _, lookup in prompts]
        scopes = [SCOPES[s] for s, _, _ in prompts]
        if self.rng.random() < 0.4:
            return self.admit_matched(prompts, requests, scopes)
        gs = self.mgr.create_kv_caches(requests, scopes=scopes)
        turns = []
        for (scope, prompt, lookup), g in zip(prompts, gs):
            o = self.o.create_kv_cache(input_tokens=lookup, scope=ORACLE_SCOPES[scope])
            w = self.twin.create_kv_cache(input_tokens=lookup, scope=SCOPES[scope])
            assert g.num_committed_tokens == o.num_committed_tokens == w.num_committed_tokens, "reused lengths"
            t = Turn(o, g, scope, lookup[: o.num_committed_tokens])
            t.prompt = prompt
            self.twins[id(t)] = w
            self.open.append(t)
            turns.append(t)
            self.count("reused_tokens", o.num_committed_tokens)
        self.compare_all()
        ok = self.mgr.resume_batch([t.g for t in turns])
        for t, got in zip(turns, ok.tolist()):
            want = t.o.resume()
            assert got == want == self.twins[id(t)].resume(), f"resume: batched {got}, oracle {want}"
        self.close([t for t, good in zip(turns, ok.tolist()) if not good])
        return [t for t, good in zip(turns, ok.tolist()) if good]

    def admit_matched(self, prompts, requests, scopes, grow=None) -> list:
        """The admission through ``match_batch`` + ``admit_batch``, sized for a
        first prefill chunk; the match may hold a request that is not
        admitted, and the admissions may come in another order. With ``grow``
        (running turns and capacities) through ``allocate_batch``, which
        resizes those in the same launch; then ``self.grown`` is its result."""
        rng = self.rng
        k = len(prompts)
        if rng.random() < 0.5:  # a waiting request the step does not admit
            scope, other = self.new_prompt()
            requests = requests + [other if type(requests[0]) is not gpukv.TokenSequence
                                   else self.mgr.token_sequence(other)]
            scopes = scopes + [SCOPES[scope]]
        m = self.mgr.match_batch(requests, scopes=scopes)
        order = list(range(k))
        rng.shuffle(order)
        reused = m.to_host().num_tokens.tolist()
        caps = [rng.randint(reused[i], len(prompts[i][1])) for i in order]
        entries = None if order == list(range(len(requests))) else order
        if grow is None:
            gs, ok = self.mgr.admit_batch(m, caps, entries=entries)
        else:
            running, grow_caps = grow
            before = {id(t): self.cache_state(t) for t in running}
            self.grown, gs, ok = self.mgr.allocate_batch([t.g for t in running], grow_caps, m, caps, entries=entries)
            assert self.grown.dtype == bool and self.grown.shape == (len(running),)
        assert ok.dtype == bool and ok.shape == (k,) and len(gs) == k
        made = []
        for i, g in zip(order, gs):
            scope, prompt, lookup = prompts[i]
            o = self.o.create_kv_cache(input_tokens=lookup, scope=ORACLE_SCOPES[scope])
            w = self.twin.create_kv_cache(input_tokens=lookup, scope=SCOPES[scope])
            assert g.num_committed_tokens == o.num_committed_tokens == w.num_committed_tokens == reused[i], "reused lengths"
            assert list(g.committed_tokens) == list(lookup[:reused[i]]), "committed tokens"
            t = Turn(o, g, scope, lookup[: o.num_committed_tokens])
            t.prompt = prompt
            self.twins[id(t)] = w
            self.open.append(t)
            made.append(t)
            self.count("reused_tokens", o.num_committed_tokens)
        if grow is not None:  # the running caches' resizes come after the admissions hold their prefixes
            for t, c, g in zip(running, grow_caps, self.grown.tolist()):
                h = t.o.history_length
                want = t.o.resize(c, h)
                assert g == want == self.twins[id(t)].resize(c, h), f"resize({c}) of {t}: batched {g}, oracle {want}"
                if not want:
                    self.count("resize_failed")
                    assert self.cache_state(t) == before[id(t)], "a refused resize changed its cache"
            self.count("allocated_together")
        for t, cap, got in zip(made, caps, ok.tolist()):
            w = self.twins[id(t)]
            want = t.o.resume() and t.o.resize(cap, t.o.history_length)
            assert got == want == (w.resume() and w.resize(cap, w.history_length)), f"admission: {got}, oracle {want}"
            self.count("admitted_matched" if got else "admission_refused")
        self.compare_all()
        self.close([t for t, good in zip(made, ok.tolist()) if not good])
        return [t for t, good in zip(made, ok.tolist()) if good]

    def admit_together(self, k: int, running, caps) -> list:
        prompts = []
        for _ in range(k):
            scope, prompt = self.new_prompt()
            prompts.append((scope, prompt, prompt[:-1] if self.rng.random() < 0.5 else prompt))
        return self.admit_matched(prompts, [lookup for _, _, lookup in prompts], [SCOPES[s] for s, _, _ in prompts],
                                  grow=(running, caps))

    def resize(self, turns, caps, hists) -> np.ndarray:
        before = {id(t): self.cache_state(t) for t in turns}
        got = self.mgr.resize_batch([t.g for t in turns], caps, hists)
        assert got.dtype == bool and got.shape == (len(turns),)
        for t, c, h, g in zip(turns, caps, hists, got.tolist()):
            want = t.o.resize(c, h)
            assert g == want == self.twins[id(t)].resize(c, h), f"resize({c}, {h}) of {t}: batched {g}, oracle {want}"
            if not want:
                self.count("resize_failed")
                assert self.cache_state(t) == before[id(t)], "a refused resize changed its cache"
        return got

    def cache_state(self, t):
        g = t.g
        return (g.num_committed_tokens, g.history_length, g.capacity, g.status,
                [tuple(g.page_indices(lc)) for lc in range(self.L)])

    def commit(self, turns, tokens, ends):
        if self.flat_form:
            offsets = np.zeros(len(turns) + 1, dtype=np.int64)
            np.cumsum([len(x) for x in tokens], out=offsets[1:])
            flat = np.array([v for x in tokens for v in x], dtype=np.int32)
            self.mgr.commit_batch([t.g for t in turns], (flat, offsets), is_end=ends)
        else:
            self.mgr.commit_batch([t.g for t in turns], tokens, is_end=list(ends))
        for t, x, e in zip(turns, tokens, ends):
            t.o.commit(x, is_end=e)
            self.twins[id(t)].commit(x, is_end=e)
            t.tokens += x
            t.stopped = t.stopped or e

    def append(self, turns, tokens, rooms, ends) -> np.ndarray:
        """``append_batch``: each turn's commit, then room for more tokens,
        against ``commit`` then ``resize`` (to whole blocks, unless it ended)
        one by one on the oracle and the per-cache twin."""
        room = rooms if self.rng.random() < 0.5 or len(set(rooms)) > 1 else rooms[0]  # one for all, or one each
        got = self.mgr.append_batch([t.g for t in turns], tokens, room=room, is_end=list(ends))
        assert got.dtype == bool and got.shape == (len(turns),)
        T = self.mgr.tokens_per_block
        for t, x, r, e, g in zip(turns, tokens, rooms, ends, got.tolist()):
            outcomes = []
            for c in (t.o, self.twins[id(t)]):
                c.commit(x, is_end=e)
                need = c.num_committed_tokens + r
                outcomes.append(e or need <= c.capacity or c.resize(-(-need // T) * T, c.history_length))
            want, twin = outcomes
            assert g == want == twin, f"append of {t}: batched {g}, oracle {want}, per-cache twin {twin}"
            self.count("append_refused" if not want else "appended")
            t.tokens += x
            t.stopped = t.stopped or e
        return got

    def close(self, turns):
        if not turns:
            return
        self.mgr.close_batch([t.g for t in turns])
        for t in turns:
            t.o.close()
            self.twins.pop(id(t)).close()
            self.open.remove(t)
            self.history.append((t.scope, list(t.tokens)))

    # -- one step of the engine ---------------------------------------------------------------
    def engine_step(self):
        rng = self.rng
        admitting = len(self.open) < 6 and rng.random() < 0.4
        # Sometimes the step's admissions and its running caches' resizes in
        # one allocate_batch (the histories kept, as that call keeps them).
        together = admitting and rng.random() < 0.3
        if admitting and not together:
            self.admit(rng.randint(1, 3))
        running = [t for t in self.open if t.g.status.name == "ACTIVE" and not t.stopped]
        rng.shuffle(running)
        running = running[: rng.randint(0, len(running))]
        if together and not running:
            self.admit(rng.randint(1, 3))
        if running and self.appends and not together and rng.random() < 0.5:
            self.append_step(running)
        elif running:
            caps, hists, plans = [], [], []
            for t in running:
                pos = len(t.tokens)
                if pos < len(t.prompt):  # a prefill chunk
                    end = rng.randint(pos + 1, len(t.prompt))
                    hist = rng.choice([pos, end]) if self.cms else rng.randint(pos, end)
                    new = t.prompt[pos:end]
                else:  # a decode step, with speculative tokens (none with SSM)
                    spec = 0 if self.has_ssm else rng.randint(0, 2)
                    end, hist = pos + 1 + spec, pos
                    new = self.tokens(1 + spec)
                hist = t.g.history_length if together else max(hist, t.g.history_length)
                caps.append(max(end, hist))
                hists.append(hist)
                plans.append(new)
            if together:
                self.admit_together(rng.randint(1, 3), running, caps)
                ok = self.grown
            else:
                ok = self.resize(running, caps, hists)
            self.compare_all()
            self.close([t for t, good in zip(running, ok.tolist()) if not good])
            go = [(t, new) for t, new, good in zip(running, plans, ok.tolist()) if good]
            batch, tokens, ends = [], [], []
            for t, new in go:
                pos = len(t.tokens)
                self.run(t, t.tokens + new, pos, pos + len(new))
                if pos + len(new) > len(t.prompt):
                    new = new[: 1 + rng.randint(0, len(new) - 1)]  # speculative tokens partly accepted
                if self.cms and t.g.history_length not in (pos, pos + len(new)):
                    new = new[: t.g.history_length - pos]
                if not self.cms and rng.random() < 0.1:
                    new = []  # nothing to commit this step (or only the end)
                batch.append(t)
                tokens.append(new)
                ends.append(rng.random() < 0.08)
            self.flat_form = rng.random() < 0.5
            if batch:
                self.commit(batch, tokens, ends)
                self.count("commits", len(batch))
            self.compare_all()
            rewind = [t for t in batch if t.g.capacity > len(t.tokens) >= t.g.history_length and not t.stopped
                      and rng.random() < 0.5]
            if rewind:
                assert self.resize(rewind, [len(t.tokens) for t in rewind], [t.g.history_length for t in rewind]).all()
                self.count("rewinds", len(rewind))
        done = [t for t in self.open if t.stopped or (len(t.tokens) >= len(t.prompt) and rng.random() < 0.2)]
        rng.shuffle(done)
        self.close(done)
        self.compare_all()

    def append_step(self, running):
        """A step that ends in ``append_batch``: each running cache's tokens
        within the room the last step left (none where there is none), then
        room for a random number more (a decode step's one, a chunk's many)."""
        rng = self.rng
        tokens, rooms, ends = [], [], []
        for t in running:
            pos = len(t.tokens)
            k = min(t.g.capacity - pos, rng.randint(0, 3))
            if self.cms and t.g.history_length != pos:
                k = 0  # a commit must start or end at the history: room only
            new = t.prompt[pos:pos + k] if pos < len(t.prompt) else self.tokens(k)
            self.run(t, t.tokens + new, pos, pos + len(new))
            tokens.append(new)
            rooms.append(rng.choice([0, 1, 1, 1, 2, self.mgr.tokens_per_block + 3]))
            ends.append(rng.random() < 0.05)
        ok = self.append(running, tokens, rooms, ends)
        self.compare_all()
        self.close([t for t, good in zip(running, ok.tolist()) if not good])

    def compare_all(self):
        self.check()
        for t in self.open:
            w = self.twins[id(t)]
            g = t.g
            assert (g.num_committed_tokens, g.history_length, g.capacity, g.status) == (
                w.num_committed_tokens, w.history_length, w.capacity, w.status), f"{t}: the per-cache twin differs"
            for lc in range(self.L):
                assert list(g.page_indices(lc)) == list(w.page_indices(lc)), f"{t}: pages of life cycle {lc}"
        assert self.mgr.get_and_reset_eviction_stats() == self.twin.get_and_reset_eviction_stats()

    def run_steps(self, steps: int):
        for _ in range(steps):
            self.engine_step()
        self.close(list(self.open))
        self.check()
        return self.stats

"""The tree's lockstep: the block-radix-tree oracle (``tests/support/oracle.py``,
docs/semantics.md to the letter) and a ``KVCacheManager`` driven by one
sequence of tree operations (``Pair``).

``scenario`` is the hypothesis strategy of a case: a model (tokens per block,
life cycles) and a sequence of operations: add blocks (full and partial) under
random parents with random per-life-cycle coverage, kill pages, remove
subtrees, clear, and match random queries (partial on or off, with backoff).
``run_ops`` applies each operation to both sides; after each step the attached
blocks with their per-life-cycle coverage, every match result (registered
sequences re-matched too) and the removal records must be identical, and
both sanity checkers must pass.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

import gpukv
from gpukv import introspect
from gpukv.kernels.sha256 import int64x4_to_digest
from gpukv.core.layout import EV_REMOVED, EV_REMOVED_LIFE_CYCLE, FLAG_ATTACHED, FLAG_IN_USE, FLAG_ROOT, LOG
from gpukv.tree import BlockRef

from tests.support import oracle as O


# (gpukv layer specs, oracle life cycles), by name; sinks are in tokens for
# gpukv and in blocks for the oracle (one sink block at every T used here).
MODELS = {
    "full": ([gpukv.Attention()], [O.LifeCycle(O.FULL)]),
    "full+swa": ([gpukv.Attention(), gpukv.Attention(window=3)], [O.LifeCycle(O.FULL), O.LifeCycle(O.SWA, 3)]),
    "swa-sink": ([gpukv.Attention(window=2, sink_tokens=1)], [O.LifeCycle(O.SWA, 2, 1)]),
    "full+ssm": ([gpukv.Attention(), gpukv.Ssm()], [O.LifeCycle(O.FULL), O.LifeCycle(O.SSM)]),
    "hybrid": (
        [gpukv.Attention(window=5), gpukv.Attention(), gpukv.Ssm()],
        [O.LifeCycle(O.SWA, 5), O.LifeCycle(O.FULL), O.LifeCycle(O.SSM)],
    ),
}
SCOPES = [None, gpukv.ReuseScope(lora_id=1)]
ORACLE_SCOPES = [(None, None), (1, None)]  # the same scopes as (lora_id, salt)
ALPHABET = 3  # few distinct tokens, so siblings share prefixes and partial matches happen


class Pair:
    """One oracle and one manager driven in lockstep."""

    def __init__(self, backend, model, T):
        layers, lcs = MODELS[model]
        self.T = T
        self.L = len(lcs)
        self.mgr = gpukv.KVCacheManager(
            gpukv.CacheConfig(
                tokens_per_block=T,
                layers=layers,
                pages_per_life_cycle=512,
                commit_min_snapshot=any(isinstance(x, gpukv.Ssm) for x in layers),
                backend=backend,
            )
        )
        self.log = introspect.record_log(self.mgr)
        self.oracle = O.Oracle(T, lcs)
        # Registered sequences kept across operations, so their memoized
        # matches must notice every change of the tree in between.
        self.sequences = {}

    # -- the two states, in one comparable shape ---------------------------------
    def gpukv_blocks(self) -> dict:
        t = introspect.tables(self.mgr)
        blocks, digs, slots, toks = t["blocks"], t["digests"], t["block_slots"], t["tokens"]
        out = {}
        rows = np.nonzero((blocks["flags"] & (FLAG_IN_USE | FLAG_ATTACHED)) == (FLAG_IN_USE | FLAG_ATTACHED))[0]
        for r in rows:
            if blocks["flags"][r] & FLAG_ROOT:
                continue
            key = int64x4_to_digest(digs[r])
            cov = tuple(int(c) for c in slots["coverage"][r])
            out[key] = (int(r), tuple(int(x) for x in toks[r, : blocks["num_tokens"][r]]), cov)
        return out

    def oracle_blocks(self) -> dict:
        return {k: (b, list(b.tokens), tuple(b.cov(lc) for lc in range(self.L))) for k, b in self.oracle.attached_blocks().items()}

    def compare_trees(self):
        g, o = self.gpukv_blocks(), self.oracle_blocks()
        assert set(g) == set(o), "attached blocks differ"
        for k in g:
            assert list(g[k][1]) == o[k][1], "tokens differ"
            assert g[k][2] == o[k][2], f"coverage differs for block {o[k][1]}: gpukv {g[k][2]} oracle {o[k][2]}"

    def compare_log(self):
        """Removal records, in order (the oracle groups a subtree removal in one
        event; gpukv logs one record per detached block)."""
        mine = []
        for rec in LOG.view(np.array(self.log, dtype=np.int64).reshape(-1, LOG.width)):
            if rec["kind"] == EV_REMOVED:
                mine.append(("removed", int64x4_to_digest(rec["digest"])))
            elif rec["kind"] == EV_REMOVED_LIFE_CYCLE:
                mine.append(("removed_lc", int64x4_to_digest(rec["digest"]), int(rec["life_cycle"])))
        theirs = []
        for ev in self.oracle.events:
            if ev[0] == "removed":
                theirs += [("removed", k) for k in ev[1]]
            else:
                theirs.append(("removed_lc", ev[1], ev[2]))
        assert mine == theirs, "removal records differ"

    def compare_registered(self):
        """Every registered sequence, re-matched now, agrees with the oracle."""
        key_of_row = {v[0]: k for k, v in self.gpukv_blocks().items()}
        for (query, pick, partial, backoff), seq in self.sequences.items():
            want = self.oracle.match(ORACLE_SCOPES[pick], list(query), partial, backoff)
            got = introspect.match_batch(self.mgr, [seq], SCOPES[pick], partial=partial, backoff=backoff).to_host()
            assert int(got.num_tokens[0]) == want.num_tokens, f"registered sequence {query}"
            assert [key_of_row[int(r)] for r in got.blocks(0)] == [b.key for b in want.blocks]

    def check(self):
        self.compare_registered()
        self.compare_trees()
        self.compare_log()
        self.oracle.check_sanity()
        introspect.check_sanity(self.mgr)

    # -- operations ------------------------------------------------------------------
    def attached(self):
        """Attached blocks, in a stable order: (key, gpukv row, oracle block)."""
        g, o = self.gpukv_blocks(), self.oracle.attached_blocks()
        return [(k, g[k][0], o[k]) for k in sorted(g)]

    def add(self, parent_pick, scope_pick, tokens, coverage):
        scope, oscope = SCOPES[scope_pick % len(SCOPES)], ORACLE_SCOPES[scope_pick % len(SCOPES)]
        full = [(k, r, b) for k, r, b in self.attached() if len(b.tokens) == self.T]
        if parent_pick is None or not full:
            ref, oparent = None, self.oracle.root(oscope)
        else:
            k, r, b = full[parent_pick % len(full)]
            ref, oparent, scope = BlockRef(r, k), b, None  # a child lives in its parent's scope
        cov = [min(c, len(tokens)) for c in coverage]
        introspect.make_test_block(self.mgr, tokens, cov, parent=ref, scope=scope)
        self.oracle.make_block(oparent, tokens, cov)
        self.oracle.release_orphans()

    def kill_page(self, pick, lc):
        with_pages = [(k, r, b) for k, r, b in self.attached() if b.slots[lc % self.L] is not None]
        if not with_pages:
            return
        k, r, b = with_pages[pick % len(with_pages)]
        lc %= self.L
        page = introspect.page_of(self.mgr, BlockRef(r, k), lc)[0]
        introspect.page_death(self.mgr, page)
        self.oracle.page_death(b.slots[lc])
        self.oracle.release_orphans()

    def remove_subtree(self, pick):
        blocks = self.attached()
        if not blocks:
            return
        k, r, b = blocks[pick % len(blocks)]
        introspect.remove_subtree(self.mgr, BlockRef(r, k))
        self.oracle.remove_subtree(b)
        self.oracle.release_orphans()

    def clear(self):
        self.mgr.clear_reusable_blocks()
        self.oracle.clear()
        self.oracle.release_orphans()

    def match(self, path_pick, suffix, scope_pick, partial, backoff):
        scope, oscope = SCOPES[scope_pick % len(SCOPES)], ORACLE_SCOPES[scope_pick % len(SCOPES)]
        blocks = self.attached()
        prefix = []
        if blocks:
            b = blocks[path_pick % len(blocks)][2]
            chain = []
            while isinstance(b, O.Block):
                chain.append(list(b.tokens))
                b = b.prev
            prefix = [t for blk in reversed(chain) for t in blk]
        query = prefix + list(suffix)
        want = self.oracle.match(oscope, query, partial, backoff)
        got = introspect.match_batch(self.mgr, [query], scope, partial=partial, backoff=backoff).to_host()
        assert int(got.num_tokens[0]) == want.num_tokens, f"num_tokens for {query}"
        assert int(got.num_lookup_tokens[0]) == want.num_lookup_tokens
        assert int(got.num_tokens_before_pruning[0]) == want.num_tokens_before_pruning
        assert int(got.num_tokens_before_hybrid_pruning[0]) == want.num_tokens_before_hybrid_pruning
        key_of_row = {v[0]: k for k, v in self.gpukv_blocks().items()}
        assert [key_of_row[int(r)] for r in got.blocks(0)] == [b.key for b in want.blocks], "matched blocks differ"
        key = (tuple(query), scope_pick % len(SCOPES), partial, backoff)
        if key not in self.sequences:
            self.sequences[key] = self.mgr.token_sequence(query)
        self.compare_registered()
        assert self.mgr.probe_reuse(query, scope) == self.oracle.match(
            oscope, query, self.mgr.config.enable_partial_reuse, self.mgr.config.reuse_match_backoff
        ).num_tokens


def ops_strategy(T, L):
    tokens = st.lists(st.integers(0, ALPHABET - 1), min_size=1, max_size=T)
    cov = st.lists(st.integers(0, T), min_size=L, max_size=L)
    pick = st.integers(0, 10**6)
    return st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.one_of(st.none(), pick), pick, tokens, cov),
            st.tuples(st.just("add"), st.one_of(st.none(), pick), pick, tokens, cov),  # adds twice as likely
            st.tuples(st.just("kill"), pick, st.integers(0, L - 1)),
            st.tuples(st.just("subtree"), pick),
            st.tuples(st.just("clear")),
            st.tuples(
                st.just("match"), pick, st.lists(st.integers(0, ALPHABET - 1), max_size=T + 1), pick, st.booleans(),
                st.integers(0, T + 1),
            ),
        ),
        min_size=1,
        max_size=40,
    )


def run_ops(pair, ops):
    for op in ops:
        kind = op[0]
        if kind == "add":
            pair.add(op[1], op[2], op[3], op[4])
        elif kind == "kill":
            pair.kill_page(op[1], op[2])
        elif kind == "subtree":
            pair.remove_subtree(op[1])
        elif kind == "clear":
            pair.clear()
        else:
            pair.match(*op[1:])
        pair.check()


@st.composite
def scenario(draw):
    model = draw(st.sampled_from(sorted(MODELS)))
    T = draw(st.sampled_from([2, 3, 4]))
    ops = draw(ops_strategy(T, len(MODELS[model][1])))
    return model, T, ops

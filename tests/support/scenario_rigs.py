"""Two rigs that play the worked scenarios of docs/semantics.md §6 the same way.

A scenario (``tests/caches/test_worked_scenarios.py``) is written once against the methods
of ``Rig`` and runs on every *side*: ``"oracle"`` is the plain-Python model
(``tests/support/oracle_kv.py``, whose fake engine keeps page data in dicts); a backend
name (``"cpu"``, ``"cudasim"`` or ``"cuda"``) is a ``KVCacheManager`` with real
page memory, played by the test engine (``tests/support/engine.py``). Both sides take
the configuration in gpukv's terms (``Attention`` / ``Ssm`` layers,
``ReuseScope``), and report pages by their pool index, so one expected number
serves both. The caches themselves (``KVSeq`` on the oracle side, ``KVCache``
on the other) share one API and are used directly.
"""

from __future__ import annotations

import contextlib
import math
from collections import namedtuple

import numpy as np
import pytest

import gpukv
from gpukv import Attention, ReuseScope, Ssm, introspect
from gpukv.core.layout import FLAG_ATTACHED, FLAG_IN_USE

from tests.support import oracle as O
from tests.support import oracle_kv as OK
from tests.support.backends import GPU_BACKEND, make_manager
from tests.support.engine import Engine, attached_rows, chain_rows, token_value

ORACLE = "oracle"

# What a match reports besides the blocks (docs/semantics.md §2.4).
Match = namedtuple("Match", "num_tokens before_hybrid_pruning before_pruning")


def sides(simulator_by_default: bool = False):
    """The ``side`` parameters of a scenario: the oracle, ``cpu`` and the CUDA
    kernels. The simulator is slow, so only scenarios chosen for it run there in
    the default suite; the others run there under ``-m slow``."""
    gpu_marks = [pytest.mark.cudasim] + ([] if simulator_by_default else [pytest.mark.slow])
    return [pytest.param(ORACLE), pytest.param("cpu"), pytest.param(GPU_BACKEND, marks=gpu_marks)]


def scenario(fn=None, *, simulator_by_default: bool = False):
    """Run the decorated ``test_...(side)`` on every side (see ``sides``)."""

    def mark(f):
        return pytest.mark.parametrize("side", sides(simulator_by_default))(f)

    return mark if fn is None else mark(fn)


def make_rig(side: str, T: int = 32, layers=(Attention(),), pages=256, **config) -> "Rig":
    """A rig of ``side`` (``"oracle"`` or a backend name); ``config`` takes the
    ``CacheConfig`` fields both sides model (``enable_partial_reuse``,
    ``commit_min_snapshot``, ``reuse_match_backoff``)."""
    if side == ORACLE:
        return OracleRig(T, layers, pages, **config)
    return ManagerRig(side, T, layers, pages, **config)


def status(kv) -> str:
    """The cache's status by name (the two sides have their own enums)."""
    return kv.status.name


class Rig:
    """The §6 helpers (``run_turn``, ``reuse``, ``fresh``, ``execute_and_commit``,
    ``rejected``) on top of each side's primitives: ``probe``, ``new_cache``,
    ``run`` (the engine runs positions ``[start, end)``), ``verify_reuse``,
    ``check``, ``match``, ``reuse_match_pages``, ``chain`` (the exact-key chain:
    ``(handle, tokens, coverages, pool indices)`` per block), ``attached``,
    ``gone``, ``first_blocks``, ``tree_is_empty``, ``committed_page_is_linked``,
    ``committed_blocks``, ``planned_pages``, ``free_pages``, ``read_page``,
    ``write_word``, ``token_value``, ``clear_reusable_blocks``, ``shutdown`` and
    ``state`` (everything a rejected call must leave as it was)."""

    T: int
    LogicError: type

    # -- caches -------------------------------------------------------------------
    def create(self, tokens=None, scope=None):
        """A new cache; with ``tokens``, its reuse equals ``probe_reuse`` just before."""
        if tokens is None:
            kv = self.new_cache(None, scope)
            assert kv.num_committed_tokens == 0
        else:
            n = self.probe(tokens, scope)
            kv = self.new_cache(list(tokens), scope)
            assert kv.num_committed_tokens == n, "create_kv_cache and probe_reuse disagree"
        assert status(kv) == "SUSPENDED"
        assert kv.history_length == kv.capacity == kv.num_committed_tokens
        return kv

    def resume(self, kv):
        assert kv.resume() is not False, "out of pages on resume"
        assert status(kv) == "ACTIVE"

    def fresh(self, scope=None):
        kv = self.create(scope=scope)
        self.resume(kv)
        return kv

    def execute_and_commit(self, kv, tokens_all, end, is_end=False):
        """The engine runs ``tokens_all[committed:end]``, then they are committed."""
        start = kv.num_committed_tokens
        self.run(kv, tokens_all, start, end)
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
        self.verify_reuse(kv, prompt)
        assert kv.resize(len(prompt), r if refcheck else len(prompt)), "out of pages on resize"
        self.execute_and_commit(kv, prompt, len(prompt))
        kv.close()
        assert status(kv) == "CLOSED"
        self.check()
        return r

    def reuse(self, tokens, scope=None) -> int:
        """Create with ``tokens`` (== probe), resume, verify the reused KV, close."""
        kv = self.create(tokens, scope)
        n = kv.num_committed_tokens
        self.resume(kv)
        self.verify_reuse(kv, list(tokens))
        kv.close()
        self.check()
        return n

    # -- rejected calls -------------------------------------------------------------
    def assert_unchanged(self, before: dict, *kvs):
        after = self.state(*kvs)
        for part in before:
            assert after[part] == before[part], f"a rejected call changed the {part}"
        self.check()

    @contextlib.contextmanager
    def rejected(self, kvs, exc, match=None):
        """The call raises ``exc`` (message matching ``match``) and changes nothing."""
        before = self.state(*kvs)
        with pytest.raises(exc, match=match):
            yield
        self.assert_unchanged(before, *kvs)

    def cache_state(self, kv) -> tuple:
        st = (kv.num_committed_tokens, kv.history_length, kv.capacity, status(kv))
        if status(kv) != "CLOSED":
            ssm = self.ssm_life_cycle_id
            st += tuple(tuple(int(x) for x in kv.page_indices(lc)) for lc in range(self.num_life_cycles) if lc != ssm)
            if ssm is not None:
                st += (kv.ssm_page_index(),)
        return st

    # -- the tree, by the exact-key chain of a token list ---------------------------------
    def chain_covs(self, tokens, scope=None) -> list:
        """``(len(block.tokens), coverage per life cycle)`` per chain block."""
        return [(n, covs) for _, n, covs, _ in self.chain(tokens, scope)]

    def chain_blocks(self, tokens, scope=None) -> list:
        """A handle per chain block (for ``attached`` and ``gone``)."""
        return [b for b, _, _, _ in self.chain(tokens, scope)]

    def chain_pages(self, tokens, lc: int, scope=None) -> list:
        """The pool index of each chain block's page in ``lc`` (None: no page)."""
        return [pages[lc] for _, _, _, pages in self.chain(tokens, scope)]


class OracleRig(Rig):
    """``KVOracle`` and its fake engine (``oracle_kv.write_tokens`` /
    ``verify_reuse``), which knows the tokens of every cache itself."""

    LogicError = OK.LogicError

    def __init__(self, T, layers, pages, **config):
        self.T = T
        specs = list(dict.fromkeys(layers))
        self.life_cycles = [_oracle_life_cycle(s, T) for s in specs]
        self.oracle = OK.KVOracle(T, self.life_cycles, pages, **config)
        self.num_life_cycles = len(specs)
        self.ssm_life_cycle_id = self.oracle.ssm_lc

    # -- primitives --------------------------------------------------------------------------
    def probe(self, tokens, scope=None) -> int:
        return self.oracle.probe_reuse(list(tokens), _oracle_scope(scope))

    def new_cache(self, tokens, scope):
        return self.oracle.create_kv_cache(input_tokens=tokens, scope=_oracle_scope(scope))

    def run(self, kv, tokens_all, start, end):
        OK.write_tokens(kv, start, list(tokens_all[start:end]))

    def verify_reuse(self, kv, tokens_all):
        OK.verify_reuse(kv)

    def check(self):
        self.oracle.check_sanity()

    def match(self, requests, scope=None) -> list:
        """A ``Match`` per token list of one batch."""
        out = []
        for tokens in requests:
            m = self.oracle.match(list(tokens), _oracle_scope(scope))
            out.append(Match(m.num_tokens, m.num_tokens_before_hybrid_pruning, m.num_tokens_before_pruning))
        return out

    def reuse_match_pages(self, tokens, lc, enable_partial=False):
        return self.oracle.reuse_match_pages(list(tokens), lc, enable_partial=enable_partial)

    def chain(self, tokens, scope=None) -> list:
        out = []
        for b, _ in self.oracle.tree.walk(_oracle_scope(scope), list(tokens), False):
            covs = tuple(b.cov(lc) for lc in range(self.num_life_cycles))
            out.append((b, len(b.tokens), covs, [None if p is None else p.slot for p in b.slots]))
        return out

    def attached(self, block) -> bool:
        return block.prev is not None

    def gone(self, block) -> bool:
        """Destroyed: detached, with every page gone."""
        return block.prev is None and all(p is None for p in block.slots)

    def first_blocks(self) -> int:
        """Blocks directly under a scope root."""
        return sum(len(root.next) for root in self.oracle.tree.next.values())

    def tree_is_empty(self) -> bool:
        """No root, no block."""
        return self.oracle.tree.next == {}

    def committed_page_is_linked(self, kv, ordinal, lc):
        return kv.committed_page_is_linked(ordinal, lc)

    def committed_blocks(self, kv) -> list:
        return kv.tree_blocks()

    def planned_pages(self, plan) -> list:
        return [(p.lc, p.slot) for p in plan.pages if p.alive]

    def free_pages(self, lc) -> int:
        return self.oracle.free_pages(lc)

    def read_page(self, lc, pool_index) -> list:
        """The values at the page's T offsets (None: never written)."""
        data = self.oracle.page_at(lc, pool_index).data
        return [data.get(i) for i in range(self.T)]

    def write_word(self, lc, pool_index, offset, value):
        self.oracle.page_at(lc, pool_index).data[offset] = value

    def token_value(self, lc, pos, prefix) -> int:
        return OK.token_value(lc, pos, list(prefix))

    def clear_reusable_blocks(self):
        self.oracle.clear_reusable_blocks()

    def shutdown(self):
        self.oracle.shutdown()

    def state(self, *kvs):
        blocks = {k: (tuple(b.tokens), tuple(b.cov(lc) for lc in range(self.num_life_cycles)))
                  for k, b in self.oracle.tree.attached_blocks().items()}
        free = tuple(self.oracle.free_pages(lc) for lc in range(self.num_life_cycles))
        return {"tree": blocks, "free pages": free, "caches' state": [self.cache_state(kv) for kv in kvs]}


class ManagerRig(Rig):
    """A ``KVCacheManager`` on ``page_bytes = 8 * T`` and the engine that plays its
    model; every check ends with ``introspect.check_sanity`` and a check of the
    data of every page linked in the tree."""

    LogicError = gpukv.LogicError

    def __init__(self, backend, T, layers, pages, **config):
        self.T = T
        self.mgr = make_manager(
            backend, tokens_per_block=T, layers=list(layers), pages_per_life_cycle=pages, page_bytes=8 * T, **config
        )
        self.engine = Engine(self.mgr)
        self.num_life_cycles = len(self.mgr.life_cycles)
        self.ssm_life_cycle_id = self.mgr.ssm_life_cycle_id

    # -- primitives --------------------------------------------------------------------------
    def probe(self, tokens, scope=None) -> int:
        return self.mgr.probe_reuse(list(tokens), scope)

    def new_cache(self, tokens, scope):
        return self.mgr.create_kv_cache(input_tokens=tokens, scope=scope)

    def run(self, kv, tokens_all, start, end):
        self.engine.run(kv, tokens_all, start, end)

    def verify_reuse(self, kv, tokens_all):
        self.engine.verify_reuse(kv, tokens_all)

    def check(self):
        introspect.check_sanity(self.mgr)
        self.engine.verify_tree()

    def match(self, requests, scope=None) -> list:
        m = self.mgr.match_batch([list(t) for t in requests], scope).to_host()
        return [Match(*(int(x) for x in row)) for row in
                zip(m.num_tokens, m.num_tokens_before_hybrid_pruning, m.num_tokens_before_pruning)]

    def reuse_match_pages(self, tokens, lc, enable_partial=False):
        n, pages = introspect.reuse_match_pages(self.mgr, list(tokens), lc, enable_partial=enable_partial)
        return n, [None if p is None else (self.engine.pool_index(p[0]), p[1]) for p in pages]

    def chain(self, tokens, scope=None) -> list:
        t = introspect.tables(self.mgr)
        blocks, slots, pages = t["blocks"], t["block_slots"], t["pages"]
        out = []
        for r in chain_rows(self.mgr, tokens, scope):
            covs = tuple(int(c) for c in slots["coverage"][r])
            pool = [None if p < 0 else int(pages["pool_index"][p]) for p in slots["page"][r]]
            out.append((introspect.block_ref(self.mgr, r), int(blocks["num_tokens"][r]), covs, pool))
        return out

    def attached(self, block) -> bool:
        if not introspect.block_exists(self.mgr, block):
            return False
        return bool(introspect.tables(self.mgr)["blocks"]["flags"][block.row] & FLAG_ATTACHED)

    def gone(self, block) -> bool:
        """Destroyed: its row was released."""
        return not introspect.block_exists(self.mgr, block)

    def first_blocks(self) -> int:
        blocks = introspect.tables(self.mgr)["blocks"]
        return int(np.count_nonzero(blocks["ordinal"][attached_rows(blocks)] == 0))

    def tree_is_empty(self) -> bool:
        return not (introspect.tables(self.mgr)["blocks"]["flags"] & FLAG_IN_USE).any()

    def committed_page_is_linked(self, kv, ordinal, lc):
        return introspect.committed_page_is_linked(kv, ordinal, lc)

    def committed_blocks(self, kv) -> list:
        return introspect.committed_blocks(kv)

    def planned_pages(self, plan) -> list:
        return introspect.planned_pages(plan)

    def free_pages(self, lc) -> int:
        return introspect.free_pages(self.mgr, lc)

    def read_page(self, lc, pool_index) -> list:
        return [int(x) for x in self.engine.read_page(lc, pool_index)]

    def write_word(self, lc, pool_index, offset, value):
        self.engine.write_word(lc, pool_index, offset, value)

    def token_value(self, lc, pos, prefix) -> int:
        return token_value(lc, pos, list(prefix))

    def clear_reusable_blocks(self):
        self.mgr.clear_reusable_blocks()

    def shutdown(self):
        self.mgr.shutdown()

    def state(self, *kvs):
        t = introspect.tables(self.mgr)
        out = {f"table {name}": t[name].tobytes() for name in ("blocks", "tokens", "slots", "pages")}
        out["caches' state"] = [self.cache_state(kv) for kv in kvs]
        return out


# ---------------------------------------------------------------------------
# gpukv's terms for the oracle
# ---------------------------------------------------------------------------


def _oracle_life_cycle(spec, T) -> O.LifeCycle:
    """One distinct layer spec as an oracle life cycle (sinks in whole blocks)."""
    if isinstance(spec, Ssm):
        return O.LifeCycle(O.SSM)
    if spec.window is None:
        return O.LifeCycle(O.FULL)
    return O.LifeCycle(O.SWA, spec.window, math.ceil(spec.sink_tokens / T))


def _oracle_scope(scope):
    if scope is None:
        return None
    assert isinstance(scope, ReuseScope), scope
    return (scope.lora_id, scope.salt)

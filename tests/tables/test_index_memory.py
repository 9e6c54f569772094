"""The index's device memory: ``gpukv.index_memory`` against the arrays a
manager actually allocates, and ``CacheConfig.max_blocks``, which allocates
every table at construction so none grows afterwards (a call that would need
more is refused, changing nothing)."""

from __future__ import annotations

import numpy as np
import pytest

import gpukv
from gpukv import Attention, Ssm, introspect

from tests.support.backends import make_manager
from tests.support.faults import FaultyWorkload

T = 4

CONFIGS = {
    "default": dict(),
    "full": dict(tokens_per_block=T, pages_per_life_cycle=24),
    "hybrid": dict(tokens_per_block=16, layers=[Attention(), Attention(window=100, sink_tokens=16), Ssm()],
                   commit_min_snapshot=True, pages_per_life_cycle=[300, 200, 50], host_pages_per_life_cycle=[40, 0, 10]),
    "preallocated": dict(tokens_per_block=T, layers=[Attention(), Attention(window=8)], pages_per_life_cycle=32,
                         host_pages_per_life_cycle=16, max_blocks=200),
}


def _device_arrays(mgr) -> dict:
    t = mgr._tables
    return {f: getattr(t, f) for f in t.device._fields}


def _pointer(a) -> int:
    return a.__array_interface__["data"][0] if isinstance(a, np.ndarray) else a.data.ptr


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_formula_is_the_tables_nbytes(backend, name):
    mgr = make_manager(backend, **CONFIGS[name])
    got = gpukv.index_memory(mgr.config)
    arrays = _device_arrays(mgr)
    assert set(got.tables) == set(arrays)
    for field, a in arrays.items():
        assert got.tables[field] == a.nbytes, f"{field}: formula {got.tables[field]}, allocated {a.nbytes}"
    assert got.total == int(got) == sum(a.nbytes for a in arrays.values())
    assert got.blocks == (mgr.config.max_blocks or 256)


def test_formula_follows_growth():
    """Without max_blocks the block tables double; the formula at the grown
    row count matches them."""
    mgr = make_manager("cpu", tokens_per_block=T, pages_per_life_cycle=2000)
    introspect.insert_sequence(mgr, list(range(1, 4 * 300 + 1)))  # 300 blocks: past the first 256 rows
    rows = mgr._tables.num_rows
    assert rows == 512
    got = gpukv.index_memory(mgr.config, blocks=rows)
    for field in ("blocks", "tokens", "slots", "buckets", "sibling_buckets", "block_free", "pages", "copies"):
        assert got.tables[field] == getattr(mgr._tables, field).nbytes, field
    with pytest.raises(ValueError, match="blocks"):
        gpukv.index_memory(mgr.config, blocks=0)
    with pytest.raises(TypeError):
        gpukv.index_memory({"tokens_per_block": 4})


def test_formula_grows_with_the_layout_widths(monkeypatch):
    """The per-row sizes come from the layouts, not from numbers of their own:
    a page record one column wider costs one field (int32) per page more."""
    from gpukv import memory as module
    from gpukv.core.layout import Layout, PAGES

    config = gpukv.CacheConfig(**CONFIGS["hybrid"])
    before = gpukv.index_memory(config)
    wider = Layout("pages", PAGES.dtype, PAGES.fields + [("extra", 1)])
    monkeypatch.setattr(module, "PAGES", wider)
    after = gpukv.index_memory(config)
    pages = sum(config.pages_per_life_cycle_list()) + sum(config.pages_per_life_cycle_list(host=True))
    assert after.tables["pages"] - before.tables["pages"] == 4 * pages


def test_max_blocks_tables_never_grow():
    """A long workload with eviction, migrations, snapshots, events and
    clears: with max_blocks no device table is replaced or reallocated."""
    w = FaultyWorkload(1, "hybrid", rate=0.0, max_blocks=160)
    before = {f: (id(a), _pointer(a), a.shape) for f, a in _device_arrays(w.mgr).items()}
    w.run(400)
    after = {f: (id(a), _pointer(a), a.shape) for f, a in _device_arrays(w.mgr).items()}
    changed = sorted(f for f in before if before[f] != after[f])
    assert not changed, f"tables reallocated: {changed}"
    assert w.committed_turns >= 10 and w.mgr.get_and_reset_eviction_stats()["evicted"] > 0


def test_without_max_blocks_the_same_workload_grows():
    """The check above can fail: without max_blocks the log and the victim
    lists of that workload are reallocated."""
    w = FaultyWorkload(1, "hybrid", rate=0.0)
    before = {f: (id(a), _pointer(a)) for f, a in _device_arrays(w.mgr).items()}
    w.run(400)
    after = {f: (id(a), _pointer(a)) for f, a in _device_arrays(w.mgr).items()}
    assert any(before[f] != after[f] for f in before)


def test_max_blocks_refuses_and_changes_nothing():
    mgr = make_manager("cpu", tokens_per_block=T, pages_per_life_cycle=64, max_blocks=8)
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(10 * T, 10 * T)
    before = {k: v.copy() for k, v in introspect.tables(mgr).items()}
    with pytest.raises(gpukv.IndexFullError, match="max_blocks=8"):
        kv.commit(list(range(1, 10 * T + 1)))  # ten blocks and a root: more rows than there are
    assert kv.num_committed_tokens == 0
    after = introspect.tables(mgr)
    for name, table in before.items():
        assert np.array_equal(table, after[name]), f"{name} changed"
    kv.commit(list(range(1, 4 * T + 1)))  # four blocks fit
    assert kv.num_committed_tokens == 4 * T
    kv.close()
    introspect.check_sanity(mgr)
    assert mgr._tables.num_rows == 8


def _sharing_batch(mgr, caches: int, prefix_blocks: int):
    """``caches`` running caches whose prompts share ``prefix_blocks`` blocks
    and end two tokens into a block of their own."""
    prefix = list(range(1, prefix_blocks * T + 1))
    kvs = []
    for i in range(caches):
        prompt = prefix + [10_000 + 10 * i + j for j in range(T + 2)]
        kv = mgr.create_kv_cache(prompt)
        n = kv.num_committed_tokens
        assert kv.resume() and kv.resize(len(prompt) + T - 2, n)
        kv.commit(prompt[n:])
        kvs.append(kv)
    return kvs


def test_a_batched_decode_step_needs_rows_only_for_the_blocks_it_completes(backend):
    """Sixteen caches sharing a 40-block prefix: the step that completes no
    block needs no free block row at all, the next one a row per cache that
    completes its block and the chain it would re-attach. Sized for the
    whole chain of every cache (16 x 42 rows), the first
    step used to be refused under max_blocks, and without it to double the
    tables."""
    mgr = make_manager(backend, tokens_per_block=T, pages_per_life_cycle=256, max_blocks=128)
    kvs = _sharing_batch(mgr, 16, 40)
    assert sum(-(-kv.num_committed_tokens // T) for kv in kvs) > 128  # every chain: more rows than there are
    mgr.commit_batch(kvs, [[7]] * 16)  # each cache's block gets its third token
    assert [kv.num_committed_tokens for kv in kvs] == [40 * T + T + 3] * 16
    mgr.commit_batch(kvs[:1], [[8]])  # one cache completes its block
    assert kvs[0].num_committed_tokens == 40 * T + 2 * T
    assert mgr.probe_reuse(list(range(1, 40 * T + 1)) + [10_000 + j for j in range(T + 2)] + [7, 8]) == 42 * T
    introspect.check_sanity(mgr)


def test_a_batched_decode_step_leaves_growing_tables_as_they_are(backend):
    """What the prefills needed covers a decode step of their caches: neither
    the block table nor the change log grows (sized for the caches' whole
    chains and segments, the step used to double the one and grow the other
    with the batch's total length)."""
    mgr = make_manager(backend, tokens_per_block=T, pages_per_life_cycle=256)
    kvs = _sharing_batch(mgr, 4, 40)
    sizes = {name: len(table) for name, table in introspect.tables(mgr).items()}
    mgr.commit_batch(kvs, [[7]] * 4)
    assert {name: len(table) for name, table in introspect.tables(mgr).items()} == sizes
    introspect.check_sanity(mgr)


@pytest.mark.parametrize("bad", [0, 7, -1, 2.5, True, "8"])
def test_max_blocks_is_validated(bad):
    with pytest.raises(gpukv.ConfigError, match="max_blocks"):
        gpukv.CacheConfig(max_blocks=bad)


def test_initial_blocks_start_the_growing_tables_at_that_size():
    """The workload that grew the default tables to 512 rows fits in tables
    started at 300 rows (512, a power of two): no table is reallocated, and
    past them they still double."""
    mgr = make_manager("cpu", tokens_per_block=T, pages_per_life_cycle=2000, initial_blocks=300)
    assert mgr._tables.num_rows == 512 == gpukv.index_memory(mgr.config).blocks
    before = {f: (id(a), _pointer(a)) for f, a in _device_arrays(mgr).items() if f in ("blocks", "tokens", "slots")}
    introspect.insert_sequence(mgr, list(range(1, 4 * 300 + 1)))
    after = {f: (id(a), _pointer(a)) for f, a in _device_arrays(mgr).items() if f in ("blocks", "tokens", "slots")}
    assert before == after and mgr._tables.num_rows == 512
    introspect.insert_sequence(mgr, list(range(5000, 5000 + 4 * 300)))  # 600 blocks in all: past 512 rows
    assert mgr._tables.num_rows == 1024
    introspect.check_sanity(mgr)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8"])
def test_initial_blocks_is_validated(bad):
    with pytest.raises(gpukv.ConfigError, match="initial_blocks"):
        gpukv.CacheConfig(initial_blocks=bad)


def test_initial_blocks_and_max_blocks_exclude_each_other():
    with pytest.raises(gpukv.ConfigError, match="initial_blocks is for tables that grow"):
        gpukv.CacheConfig(initial_blocks=512, max_blocks=512)

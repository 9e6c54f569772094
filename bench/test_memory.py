"""The index's device memory per block: what an engine sets aside beside its KV.

Not a speed benchmark: the timing is of ``gpukv.index_memory`` (it allocates
nothing) and the figures are in ``extra_info`` (``suite: memory``), bytes per
block row for each table and in all:

* ``preallocated``: ``CacheConfig(max_blocks=2**17)`` with as many pages per
  life cycle, T = 32, one full-attention life cycle: every table allocated
  at start-up, for the manager's life (no KV cache events: the change log,
  which nobody reads, at its least);
* ``events``: ``preallocated`` publishing KV cache events
  (``max_kv_event_entries``): the change log at its budget;
* ``no-digests``: ``preallocated`` with ``block_digests=False`` (an engine
  that reads no gpukv events: the vLLM adapter);
* ``hybrid``: the same with a sliding-window and an SSM life cycle beside it
  (what a hybrid model adds: a slot row per block and life cycle, and each
  pool's pages);
* ``growing``: ``max_blocks=None`` after 15,360 distinct blocks were cached
  (``introspect.insert_sequence``), the arrays' actual ``nbytes`` over the
  blocks in the tree.

    python -m pytest bench/test_memory.py --benchmark-only -s
"""

from __future__ import annotations

import pytest

import gpukv
from gpukv import Attention, Ssm, introspect

T = 32
ROWS = 2**17
GROUP = pytest.mark.benchmark(group="index memory")

CONFIGS = {
    "preallocated": dict(layers=[Attention()], pages_per_life_cycle=ROWS),
    "events": dict(layers=[Attention()], pages_per_life_cycle=ROWS, max_kv_event_entries=1 << 16),
    "no-digests": dict(layers=[Attention()], pages_per_life_cycle=ROWS, block_digests=False),
    "hybrid": dict(layers=[Attention(), Attention(window=4096), Ssm()], pages_per_life_cycle=[ROWS, ROWS // 8, ROWS // 64],
                   commit_min_snapshot=True),
}


def per_block(tables: dict, blocks: int) -> dict:
    return {name: round(b / blocks, 2) for name, b in sorted(tables.items(), key=lambda kv: -kv[1]) if b}


@GROUP
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_preallocated_index_memory(benchmark, name):
    config = gpukv.CacheConfig(tokens_per_block=T, max_blocks=ROWS, backend="cpu", **CONFIGS[name])
    m = benchmark(gpukv.index_memory, config)
    benchmark.extra_info.update(suite="memory", config=name, blocks=ROWS, tokens_per_block=T,
                                life_cycles=len(config.life_cycles), total_bytes=m.total,
                                bytes_per_block=round(m.total / ROWS, 1), per_table=per_block(m.tables, ROWS))
    print(f"\n{name}: {m.total / ROWS:.0f} B per block ({m.total / 2**20:.0f} MiB at {ROWS} blocks)")


@GROUP
def test_growing_index_memory(benchmark):
    """Bytes per distinct cached block when the tables grow on demand."""
    blocks = 15 * 1024  # and 15 roots: the rows of one doubling, nearly full
    mgr = gpukv.KVCacheManager(gpukv.CacheConfig(tokens_per_block=T, layers=[Attention()],
                                                 pages_per_life_cycle=blocks + 64, backend="cpu"))
    for start in range(0, blocks, 1024):  # distinct chains of 1024 blocks
        introspect.insert_sequence(mgr, list(range(start * T + 1, (start + 1024) * T + 1)))
    t = mgr._tables
    arrays = {f: getattr(t, f).nbytes for f in t.device._fields}
    m = benchmark(gpukv.index_memory, mgr.config, t.num_rows)
    total = sum(arrays.values())
    benchmark.extra_info.update(suite="memory", config="growing", blocks=blocks, rows=t.num_rows,
                                tokens_per_block=T, total_bytes=total, formula_bytes=m.total,
                                bytes_per_block=round(total / blocks, 1), per_table=per_block(arrays, blocks))
    print(f"\ngrowing: {total / blocks:.0f} B per distinct block ({t.num_rows} rows for {blocks} blocks)")

"""The step benchmark's gpukv drivers agree with each other (no timing).

The batched driver is checked on a manager whose batched calls are the
per-cache calls in a loop, as the batched calls are specified to behave:
both drivers must reuse the same tokens, leave every cache with the same
committed tokens and capacity, and leave the same tokens reusable.
"""

from __future__ import annotations

import numpy as np
import pytest

import gpukv
from bench import stepbench as sb


class LoopedBatchedCalls(gpukv.KVCacheManager):
    """The batched calls as the per-cache calls issued one by one, in order."""

    def create_kv_caches(self, requests, scopes=None):
        return [self.create_kv_cache(input_tokens=r) for r in requests]

    def resize_batch(self, caches, capacities, history_lengths=None):
        hist = [None] * len(caches) if history_lengths is None else history_lengths
        return np.array([kv.resize(int(c), None if h is None else int(h)) for kv, c, h in zip(caches, capacities, hist)])

    def commit_batch(self, caches, tokens, is_end=False):
        if isinstance(tokens, tuple):
            flat, offsets = tokens
            tokens = [flat[offsets[j]:offsets[j + 1]] for j in range(len(caches))]
        for kv, t in zip(caches, tokens):
            kv.commit(t, is_end=is_end)

    def close_batch(self, caches):
        for kv in caches:
            kv.close()


@pytest.fixture(scope="module")
def small():
    if sb.trace_path() is None:
        pytest.skip("the Mooncake trace is not in shared/data (set GPUKV_TRACE)")
    return sb.load_workload(12, 4, 1)


def drive(d, w, order, steps):
    handles, reused = sb.admit_all(d, order)
    batch = d.running(handles)
    for s in range(steps):
        d.decode(batch, w.step_tokens(len(order), s))
    state = [(kv.num_committed_tokens, kv.capacity, kv.committed_tokens.tolist()) for kv in handles]
    d.finish(batch)
    return reused, state


def test_batched_driver_equals_per_cache_driver(small):
    w, order, steps = small, list(range(8)), 40  # 40 steps: every request fills a block
    pages = sb.roomy_pages(w, order, steps)
    per = sb.GpukvPerCache(w, pages)
    batched = sb.GpukvBatched(w, pages)
    batched.mgr.__class__ = LoopedBatchedCalls
    got_per, got_batched = drive(per, w, order, steps), drive(batched, w, order, steps)
    assert got_per[0] == sb.reference_reuse(w, order)
    assert got_batched == got_per
    for j, i in enumerate(order):
        want = np.concatenate([w.prompts[i], [w.step_tokens(len(order), s)[j] for s in range(steps)]])
        assert got_per[1][j][2] == want.tolist()
        assert batched.mgr.probe_reuse(want) == per.mgr.probe_reuse(want) > 0


def test_per_cache_driver_refuses_when_the_pool_is_short(small):
    d = sb.GpukvPerCache(small, pages=4)
    with pytest.raises(sb.OutOfPages, match="request 0"):
        d.admit(0)

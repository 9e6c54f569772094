"""The eviction order, read without evicting (docs/semantics.md §2.11).

An engine that queues its allocations and answers its scheduler's later
questions in the meantime (vLLM's adapter) must know whether a prefix it
found survives the evictions the queued allocations will make. Those take
the heads of the unheld candidates' lists (``evict.next_victim``): lowest
priority first, oldest first within one. So the pages eviction drops next
are the first entries of those lists, which one thread walks here, writing
nothing: ``next_victims`` is a read, like matching.
"""

from __future__ import annotations

import functools

from ..core.backend import cpu_kernel, launch_stream
from ..core.config import PRIORITY_MAX
from ..core.layout import LG_COUNT, LG_LOWEST, LRU_HEAD, NULL, PAGE_LRU_NEXT, PAGE_POOL_INDEX
from .link import helper, link
from .lru import lru_group, lru_list

__all__ = ["build_victims_kernel"]


@helper
def next_victims(S, pool, count, out):
    """``out[0]``: how many of the first ``count`` unheld candidates of
    ``pool`` (= ``pool_of(lc, level)``) there are, ``n``; ``out[1:1 + n]``:
    their storage slots at that level, in eviction order."""
    group = lru_group(pool, 0)
    n = 0
    if S.lru_groups[group, LG_COUNT] > 0:
        priority = S.lru_groups[group, LG_LOWEST]  # no non-empty priority is below it
        while priority <= PRIORITY_MAX and n < count:
            p = S.lru_lists[lru_list(group, priority), LRU_HEAD]
            while p != NULL and n < count:
                out[1 + n] = S.pages[p, PAGE_POOL_INDEX]
                n += 1
                p = S.pages[p, PAGE_LRU_NEXT]
            priority += 1
    out[0] = n


@functools.lru_cache(maxsize=None)
def build_victims_kernel(target: str):
    """``run(S, pool, count, out)``: ``next_victims``, serially."""
    k = link(target)
    if target == "cpu":
        return cpu_kernel(k.kernel(_run_cpu))

    from numba import cuda

    kernel = cuda.jit(k.kernel(_run_cuda, cuda=cuda))

    def run(S, pool, count, out):
        kernel[1, 1, launch_stream()](S, pool, count, out)

    return run


# Kernel entry points: module level so Numba's disk cache hits (link.py).
def _run_cpu(S, pool, count, out):
    next_victims(S, pool, count, out)


def _run_cuda(S, pool, count, out):
    if cuda.grid(1) == 0:  # noqa: F821 (bound by Linked.kernel)
        next_victims(S, pool, count, out)

"""Batched reuse matching: the kernels and their launchers (§2.3, §2.4).

``build_match_kernels(target)`` returns ``match``, ``hash_blocks`` and
``compact``. One request is one item (``reuse.match_one``). On ``cpu``, worker
threads with the GIL released take requests from a shared counter, several in
flight each (``walk.py``); small batches run on the caller. On ``cuda`` each
request is one thread. Block content hashes can come precomputed
(``hash_blocks``, parallel over blocks; cached per block by ``TokenSequence``)
or be computed during the walk.
"""

from __future__ import annotations

import functools
from collections import namedtuple
from types import SimpleNamespace

import numpy as np

from ..core.backend import cpu_kernel, launch_stream
from ..core.layout import LN_COUNT, LN_NODE, LN_REQUEST, LN_WIDTH
from .walk import LANES, lane_step, lane_take, match_one
from .link import link
from .reuse import compact_one, finish, hash_one

PARALLEL_MIN_REQUESTS = 32  # smaller cpu batches run on one thread
PARALLEL_MIN_BLOCKS = 256  # and so do small hashing jobs

# One batch of requests as the match kernel reads it. Request i is
# toks[starts[i]:starts[i] + lengths[i]]; its full-block content hashes are
# hashes[hash_off[i]:] when hash_off is not empty (else the walk hashes).
# Registered sequences also bring their memo: memo_rows/memo_serials (indexed
# like hashes) hold the blocks matched last time, verified[i] how many (updated
# in place) and trusted[i] whether nothing was detached since; all three are
# empty for other input. ``bad``, when not empty, asks the cpu kernel to check
# the tokens of a caller's int32 array: bad[i] becomes the position of request
# i's first negative token, or -1 (checked as the request enters a lane,
# instead of a separate host pass over the whole batch).
MatchBatch = namedtuple(
    "MatchBatch",
    "toks starts lengths hashes hash_off scope_ids scope_keys memo_rows memo_serials verified trusted path path_off res bad",
)


@functools.lru_cache(maxsize=None)
def build_match_kernels(target: str) -> SimpleNamespace:
    """Launchers: ``match(...)``, ``hash_blocks(...)``, ``compact(...)``.

    Request ``i`` is ``toks[starts[i]:starts[i] + lengths[i]]``; its full-block
    content hashes are ``hashes[hash_off[i]:]`` when ``hash_off`` is not empty,
    else they are computed during the walk."""
    k = link(target)

    if target == "cpu":
        def kernel(f):
            return cpu_kernel(k.kernel(f), nogil=True)

        # Work runs on worker threads, each a serial kernel with the GIL
        # released: matching takes requests from a shared counter
        # (``_run_shared``), hashing splits blocks into contiguous shares
        # (``_split``). A numba parallel loop would be shorter, but it drops
        # writes made through the batch tuple, and waking its thread pool
        # costs milliseconds on a busy host.
        match_range, hash_range, compact = kernel(_match_cpu_range), kernel(_hash_cpu_range), kernel(_compact_cpu)

        def match(S, B, partial, backoff, ssm_lc):
            n = B.starts.shape[0]
            counters = np.zeros(1, dtype=np.int64)

            def share():
                tmp = np.empty(2, dtype=np.int64)
                lanes = np.empty((LANES, LN_WIDTH), dtype=np.int64)
                match_range(S, B, counters, n, partial, backoff, ssm_lc, tmp, lanes)

            _run_shared(n, PARALLEL_MIN_REQUESTS, share)

        def hash_blocks(toks, src, dst, first_block, hashes, T, total):
            _split(total, PARALLEL_MIN_BLOCKS, lambda lo, hi: hash_range(toks, src, dst, first_block, hashes, T, lo, hi))

        # ``dispatchers``: the Numba functions behind the launchers, by kernel
        # name, whose disk cache says whether a first call compiles.
        return SimpleNamespace(match=match, hash_blocks=hash_blocks, compact=compact,
                               dispatchers={"match": match_range, "hash": hash_range})

    from numba import cuda

    def kernel(f):
        return cuda.jit(k.kernel(f, cuda=cuda))

    match_k, hash_k, compact_k = kernel(_match_cuda), kernel(_hash_cuda), kernel(_compact_cuda)
    threads = 128

    def grid(n):
        return max(1, (n + threads - 1) // threads), threads, launch_stream()

    def match(S, B, partial, backoff, ssm_lc):
        n = B.starts.shape[0]
        tmp = _like(B.res, (max(n, 1), 2))
        lanes = _like(B.res, (max(n, 1), LN_WIDTH))
        match_k[grid(n)](S, B, partial, backoff, ssm_lc, tmp, lanes)

    def hash_blocks(toks, src, dst, first_block, hashes, T, total):
        if total:
            hash_k[grid(total)](toks, src, dst, first_block, hashes, T, total)

    def compact(B, block_offsets, block_ids):
        compact_k[grid(B.res.shape[0])](B, block_offsets, block_ids)

    return SimpleNamespace(match=match, hash_blocks=hash_blocks, compact=compact, dispatchers={})


# -- kernels: module level so Numba's disk cache hits (see link.py) --------------------
def _match_cpu_range(S, B, counters, stop, partial, backoff, ssm_lc, tmp, st):
    """One thread's part of a batch of ``stop`` requests, taking them from the
    shared ``counters``, ``LANES`` at a time (``st``: the lanes, ``tmp``:
    scratch of the partial match)."""
    live = 0
    for g in range(LANES):
        lane_take(S, B, st, g, counters, stop, partial, backoff, ssm_lc, tmp)
        if st[g, LN_REQUEST] >= 0:
            live += 1
    while live > 0:
        for g in range(LANES):
            if st[g, LN_REQUEST] < 0 or not lane_step(S, B, st, g):
                continue
            finish(S, B, st[g, LN_REQUEST], st[g, LN_NODE], st[g, LN_COUNT], partial, backoff, ssm_lc, tmp)
            lane_take(S, B, st, g, counters, stop, partial, backoff, ssm_lc, tmp)
            if st[g, LN_REQUEST] < 0:
                live -= 1


def _hash_cpu_range(toks, src, dst, first_block, hashes, T, lo, hi):
    for g in range(lo, hi):
        hash_one(g, toks, src, dst, first_block, hashes, T)


def _compact_cpu(B, block_offsets, block_ids):
    for i in range(B.res.shape[0]):
        compact_one(i, B, block_offsets, block_ids)


def _match_cuda(S, B, partial, backoff, ssm_lc, tmp, lanes):
    i = cuda.grid(1)  # noqa: F821 (bound by Linked.kernel)
    if i < B.starts.shape[0]:
        match_one(S, B, i, partial, backoff, ssm_lc, tmp[i], lanes)


def _hash_cuda(toks, src, dst, first_block, hashes, T, total):
    g = cuda.grid(1)  # noqa: F821 (bound by Linked.kernel)
    if g < total:
        hash_one(g, toks, src, dst, first_block, hashes, T)


def _compact_cuda(B, block_offsets, block_ids):
    i = cuda.grid(1)  # noqa: F821 (bound by Linked.kernel)
    if i < B.res.shape[0]:
        compact_one(i, B, block_offsets, block_ids)


_POOL = []


def _pool():
    """``(executor, threads)`` for cpu matching: the caller runs one share and
    ``threads - 1`` pool workers the others (no executor on a single core)."""
    if not _POOL:
        from concurrent.futures import ThreadPoolExecutor

        from numba import config

        n = max(1, int(config.NUMBA_NUM_THREADS))
        _POOL.append((ThreadPoolExecutor(max_workers=n - 1) if n > 1 else None, n))
    return _POOL[0]


def _fan_out(n: int, minimum: int, run_share):
    """``run_share(w, k)`` for each share ``w`` of ``k``: share 0 on the
    calling thread, the others on pool workers; one share (``k = 1``) on the
    caller alone when ``n`` is small or there is no pool.

    It returns, or raises, only once every worker is done: the workers write
    the caller's result arrays, and a call that raised (an interrupt on the
    calling thread included) must leave nothing writing behind it."""
    workers, k = _pool()
    if n < minimum or workers is None:
        run_share(0, 1)
        return
    jobs = []
    try:
        for w in range(1, k):
            jobs.append(workers.submit(run_share, w, k))
        run_share(0, k)
    finally:
        _join(jobs)
    for job in jobs:
        job.result()  # a worker's exception, once all are done


def _join(jobs) -> None:
    """Wait until every job is done, even through interrupts (a
    ``KeyboardInterrupt`` while waiting): the first one is raised after."""
    from concurrent.futures import wait

    interrupted = None
    while True:
        try:
            wait(jobs)
            break
        except BaseException as e:  # noqa: BLE001 -- re-raised once the workers are done
            if interrupted is None:
                interrupted = e
    if interrupted is not None:
        raise interrupted


def _split(n: int, minimum: int, run):
    """``run(lo, hi)`` over ``[0, n)`` in contiguous shares (see ``_fan_out``)."""
    _fan_out(n, minimum, lambda w, k: run(n * w // k, n * (w + 1) // k))


def _run_shared(n: int, minimum: int, run):
    """``run()`` on every thread ``_fan_out`` uses; the runs share out the work themselves."""
    _fan_out(n, minimum, lambda w, k: run())


def _like(a, shape):
    """A scratch int64 array on the same device as ``a``."""
    if isinstance(a, np.ndarray):
        return np.empty(shape, dtype=np.int64)
    import cupy

    return cupy.empty(shape, dtype=np.int64)

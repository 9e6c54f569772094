"""Page memory and the copy executor: the page data copies a launch recorded.

A launch records the page data copies it decides on (the private copy of a
reused partial tail at first resume, snapshot copies, migrations between the
GPU and the host tier) as storage addresses, in order (``layout.COPIES``).
After the launch ``PageMemory.carry_out`` takes them:

- With ``page_bytes > 0`` every (life cycle, cache level) pool is a real
  ``[pages, page_bytes]`` byte array (GPU pools on the device, host pools in
  host memory) and the copies are made here, in recording order.
- With ``page_bytes == 0`` the engine owns the KV memory: the copies are kept,
  in order, until the engine takes them (``take_copies``, the manager's
  ``take_page_copies``) and carries them out on its own tensors.

Either way the count of copies made inside a GPU pool is kept for the
iteration statistics.

Carrying out is resumable (``launcher.py``): ``done`` counts the copies of the
current list already made or kept, and advances together with the kept count
and the statistics in one array operation after each step, so an exception
between steps repeats at most the step it interrupted. Every step may be
repeated safely: a batched step never reads a slot it writes, a single copy
reads another slot than it writes, and a kept step writes rows past the kept
count before the count moves over them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from .core.layout import COPY_DST_INDEX, COPY_DST_LEVEL, COPY_LIFE_CYCLE, COPY_SRC_INDEX, COPY_SRC_LEVEL, COPY_WIDTH

logger = logging.getLogger("gpukv")

# PageMemory._state: [DONE] copies of the current list done (made or kept),
# [KEPT] copies kept for the engine, [HANDED] copies the last take forgot
# (kept again if that take never reached its caller: ``give_back``),
# [STATS + lc] copies inside the GPU pool of life cycle lc since the
# statistics were last taken.
DONE, KEPT, HANDED, STATS = 0, 1, 2, 3
WARN_KEPT = 1 << 16  # kept copies past which each growth of the buffer is logged


@dataclass(frozen=True, eq=False)
class PageCopies:
    """Page data copies for the engine to carry out, oldest first.

    Copy ``i`` copies the whole page at index ``src_index[i]`` of life cycle
    ``life_cycle[i]``'s pool at cache level ``src_level[i]`` (0: the GPU pool,
    1: the host tier) to index ``dst_index[i]`` of the same life cycle's pool
    at level ``dst_level[i]``. Order matters: a slot may be read by one copy
    and written by a later one. ``batches()`` groups them into steps that are
    each safe as one gather and scatter. The arrays are read only."""

    life_cycle: np.ndarray  # int32
    src_level: np.ndarray  # int32
    src_index: np.ndarray  # int64
    dst_level: np.ndarray  # int32
    dst_index: np.ndarray  # int64

    RECORD = np.dtype([("life_cycle", np.int32), ("src_level", np.int32), ("src_index", np.int64),
                       ("dst_level", np.int32), ("dst_index", np.int64)])

    @classmethod
    def from_table(cls, table: np.ndarray) -> "PageCopies":
        """From recorded copies, ``int64[n, COPY_WIDTH]`` in ``layout.COPIES`` order."""
        table = np.asarray(table, dtype=np.int64).reshape(-1, COPY_WIDTH)
        cols = []
        for col, dtype in ((COPY_LIFE_CYCLE, np.int32), (COPY_SRC_LEVEL, np.int32), (COPY_SRC_INDEX, np.int64),
                           (COPY_DST_LEVEL, np.int32), (COPY_DST_INDEX, np.int64)):
            a = np.ascontiguousarray(table[:, col], dtype=dtype)
            a.setflags(write=False)
            cols.append(a)
        return cls(*cols)

    @classmethod
    def empty(cls) -> "PageCopies":
        return cls.from_table(np.zeros((0, COPY_WIDTH), dtype=np.int64))

    def __len__(self) -> int:
        return int(self.life_cycle.shape[0])

    def records(self) -> np.ndarray:
        """The copies as one structured array (fields named as the attributes)."""
        out = np.empty(len(self), dtype=self.RECORD)
        for name in self.RECORD.names:
            out[name] = getattr(self, name)
        return out

    def table(self) -> np.ndarray:
        """The copies as ``int64[n, 5]``: life cycle, source level, source
        index, destination level, destination index."""
        out = np.empty((len(self), COPY_WIDTH), dtype=np.int64)
        out[:, COPY_LIFE_CYCLE] = self.life_cycle
        out[:, COPY_SRC_LEVEL] = self.src_level
        out[:, COPY_SRC_INDEX] = self.src_index
        out[:, COPY_DST_LEVEL] = self.dst_level
        out[:, COPY_DST_INDEX] = self.dst_index
        return out

    def batches(self):
        """The copies as steps to run in order, each ``(life_cycle, src_level,
        src_index, dst_level, dst_index)`` with index arrays: within a step no
        copy reads a slot another one writes and no two write the same slot,
        so ``dst_pool[dst_index] = src_pool[src_index]`` is exact."""
        table = self.table()
        for lo, hi in copy_steps(table):
            yield (int(table[lo, COPY_LIFE_CYCLE]), int(table[lo, COPY_SRC_LEVEL]), table[lo:hi, COPY_SRC_INDEX],
                   int(table[lo, COPY_DST_LEVEL]), table[lo:hi, COPY_DST_INDEX])


def copy_steps(copies: np.ndarray) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges of ``copies`` (``int64[n, COPY_WIDTH]``), in order,
    each safe as one gather and scatter: a run of copies between the same two
    pools, whole when no copy of it overwrites a slot another writes or reads
    (one copy at a time otherwise: rare, a slot reused within the run)."""
    n = len(copies)
    if not n:
        return []
    key = copies[:, [COPY_LIFE_CYCLE, COPY_SRC_LEVEL, COPY_DST_LEVEL]]
    breaks = np.nonzero((key[1:] != key[:-1]).any(axis=1))[0] + 1
    steps = []
    for lo, hi in zip(np.concatenate([[0], breaks]).tolist(), np.concatenate([breaks, [n]]).tolist()):
        run = copies[lo:hi]
        src, dst = run[:, COPY_SRC_INDEX], run[:, COPY_DST_INDEX]
        same_pool = run[0, COPY_SRC_LEVEL] == run[0, COPY_DST_LEVEL]
        if len(np.unique(dst)) == len(dst) and not (same_pool and np.intersect1d(src, dst).size):
            steps.append((lo, hi))
        else:
            steps.extend((i, i + 1) for i in range(lo, hi))
    return steps


class PageMemory:
    def __init__(self, config, backend):
        self.backend = backend
        self.page_bytes = nbytes = config.page_bytes
        self.num_life_cycles = L = len(config.life_cycles)
        self.pools = [
            [backend.xp.zeros((n, nbytes), dtype=np.uint8) if nbytes else None
             for n in config.pages_per_life_cycle_list()],
            [np.zeros((n, nbytes), dtype=np.uint8) if nbytes and n else None
             for n in config.pages_per_life_cycle_list(host=True)],
        ]
        self._state = np.zeros(STATS + L, dtype=np.int64)
        # Index-only: the copies the engine has not taken yet (the first
        # _state[KEPT] rows).
        self._kept = np.zeros((0 if nbytes else 64, COPY_WIDTH), dtype=np.int64)
        self._handed = self._kept[:0]  # the rows the last take forgot, and that take's receipt
        self._receipt = None

    @property
    def keeps_copies(self) -> bool:
        """True when the engine carries the copies out (``page_bytes == 0``)."""
        return not self.page_bytes

    def pool(self, life_cycle_id: int, level: int = 0):
        return self.pools[level][life_cycle_id]

    @property
    def done(self) -> int:
        return int(self._state[DONE])

    @property
    def num_kept(self) -> int:
        return int(self._state[KEPT])

    def rewind(self) -> None:
        """The list was consumed (its device count reset): the next starts at 0."""
        self._state[DONE] = 0

    def take_intra_device_copies(self) -> np.ndarray:
        """Copies made inside a GPU pool per life cycle since the last call."""
        out = self._state[STATS:].copy()
        self._state[STATS:] -= out
        return out

    def take_copies(self, receipt) -> PageCopies:
        """Every copy kept since the last take, in order, and forget them.

        ``receipt``: an object new to this take. If the take never reaches
        its caller (an exception anywhere on its way out, an interrupt
        included), ``give_back(receipt)`` keeps them all again for the next
        take; without that call they stay handed over."""
        k = self.num_kept
        self._state[HANDED] = 0  # the last take reached its caller: nothing to give back from it
        rows = self._kept[:k].copy()
        copies = PageCopies.from_table(rows) if k else PageCopies.empty()
        self._handed, self._receipt = rows, receipt
        # Forgotten and noted as handed over in one operation: an exception
        # lands before it (nothing taken) or after it (give_back finds them).
        step = np.zeros_like(self._state)
        step[KEPT], step[HANDED] = -k, k
        self._state += step
        return copies

    def give_back(self, receipt) -> None:
        """The copies the take of ``receipt`` forgot, kept again ahead of any
        kept since, as if that take never happened; nothing when it forgot
        none or a later take came after it."""
        if receipt is not self._receipt:
            return
        h = int(self._state[HANDED])
        if not h:
            return
        k = self.num_kept
        if k:  # kept since the take (a launch came in between): the handed rows go first again
            merged = np.empty((max(h + k, self._kept.shape[0]), COPY_WIDTH), dtype=np.int64)
            merged[:h] = self._handed[:h]
            merged[h:h + k] = self._kept[:k]
            self._kept = merged
        # Otherwise the rows are where the take found them: only the counts move back.
        step = np.zeros_like(self._state)
        step[KEPT], step[HANDED] = h, -h
        self._state += step

    def carry_out(self, copies: np.ndarray) -> None:
        """Carry out ``copies`` ([n, COPY_WIDTH], in recording order) from
        ``done`` on: make them (real page memory) or keep them for the engine
        (index-only). Runs of copies between the same two pools go as one
        gather/scatter when that is exact (``copy_steps``)."""
        start = self.done
        if start >= len(copies):
            return
        todo = copies[start:]
        if self.keeps_copies:
            self._keep(todo)
            return
        made_on_gpu = False
        for lo, hi in copy_steps(todo):
            step = todo[lo:hi]
            lc, src_level, dst_level = (int(x) for x in step[0, [COPY_LIFE_CYCLE, COPY_SRC_LEVEL, COPY_DST_LEVEL]])
            self._copy(lc, src_level, step[:, COPY_SRC_INDEX], dst_level, step[:, COPY_DST_INDEX])
            self._advance(step)
            made_on_gpu |= dst_level == 0
        if made_on_gpu:
            # On cuda the copies into GPU pools are queued on the call's
            # stream; a call returns with them complete, so the engine may
            # read the pages on any stream once it has returned.
            self.backend.synchronize()

    def _copy(self, lc: int, src_level: int, src: np.ndarray, dst_level: int, dst: np.ndarray) -> None:
        """One step: pages ``src`` of one pool to pages ``dst`` of another (or the same)."""
        src_mem = self.pools[src_level][lc]
        dst_mem = self.pools[dst_level][lc]
        dst_mem[self._on(dst_level, dst)] = self._to(dst_level, src_mem[self._on(src_level, src)])

    def _keep(self, todo: np.ndarray) -> None:
        """Index-only: append ``todo`` to the kept copies. The rows are
        written past the kept count before one array operation counts them,
        so an interrupt in between keeps nothing twice."""
        k, n = self.num_kept, len(todo)
        if k + n > self._kept.shape[0]:
            grown = np.empty((max(k + n, 2 * self._kept.shape[0]), COPY_WIDTH), dtype=np.int64)
            grown[:k] = self._kept[:k]
            if grown.shape[0] >= WARN_KEPT:
                logger.warning(
                    "%d page copies are waiting for the engine: with page_bytes=0 an engine must call "
                    "take_page_copies() every step and carry them out", k + n)
            self._kept = grown
        self._kept[k:k + n] = todo
        self._advance(todo, kept=True)

    def _advance(self, made: np.ndarray, kept: bool = False) -> None:
        """Count ``made`` as done (and kept), cursor and statistics in one operation."""
        step = np.zeros_like(self._state)
        step[DONE] = len(made)
        step[KEPT] = len(made) if kept else 0
        intra = (made[:, COPY_SRC_LEVEL] == 0) & (made[:, COPY_DST_LEVEL] == 0)
        step[STATS:] = np.bincount(made[intra, COPY_LIFE_CYCLE], minlength=self.num_life_cycles)[: self.num_life_cycles]
        self._state += step

    def _on(self, level: int, index: np.ndarray):
        return self.backend.to_device(index) if level == 0 else index

    def _to(self, level: int, data):
        """Page bytes moved into the memory of ``level`` (device or host)."""
        return self.backend.to_device(data) if level == 0 else np.asarray(self.backend.to_host(data))

"""Page memory and the copy executor: the page data copies a launch recorded.

With ``page_bytes > 0`` every (life cycle, cache level) pool is a real
``[pages, page_bytes]`` byte array (GPU pools on the device, host pools in host
memory), and ``PageMemory.carry_out`` performs the copies a kernel recorded
(private tail copies, snapshots, migrations), in recording order. With
``page_bytes == 0`` there is no memory and only the count of copies made on
the device is kept (the iteration statistics).

Carrying out is resumable (``launcher.py``): ``done`` counts the copies of the
current list already made, and advances together with the statistics in one
array operation after each step, so an exception between steps repeats at
most the step it interrupted. Every step may be repeated safely: a batched
step never reads a slot it writes, and a single copy reads another slot than
it writes.
"""

from __future__ import annotations

import numpy as np

from .core.layout import COPY_DST_INDEX, COPY_DST_LEVEL, COPY_LIFE_CYCLE, COPY_SRC_INDEX, COPY_SRC_LEVEL


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
        # [0]: copies of the current list done; [1 + lc]: copies inside the
        # GPU pool of life cycle lc since the statistics were last taken.
        self._state = np.zeros(1 + L, dtype=np.int64)

    def pool(self, life_cycle_id: int, level: int = 0):
        return self.pools[level][life_cycle_id]

    @property
    def done(self) -> int:
        return int(self._state[0])

    def rewind(self) -> None:
        """The list was consumed (its device count reset): the next starts at 0."""
        self._state[0] = 0

    def take_intra_device_copies(self) -> np.ndarray:
        """Copies made inside a GPU pool per life cycle since the last call."""
        out = self._state[1:].copy()
        self._state[1:] -= out
        return out

    def carry_out(self, copies: np.ndarray) -> None:
        """Carry out ``copies`` ([n, COPY_WIDTH], in recording order) from
        ``done`` on. Runs of copies between the same two pools go as one
        gather/scatter when no copy of the run reads or overwrites a slot
        another one writes."""
        start = self.done
        if start >= len(copies):
            return
        todo = copies[start:]
        if not self.page_bytes:
            self._advance(todo)
            return
        key = todo[:, [COPY_LIFE_CYCLE, COPY_SRC_LEVEL, COPY_DST_LEVEL]]
        breaks = np.nonzero((key[1:] != key[:-1]).any(axis=1))[0] + 1
        for lo, hi in zip(np.concatenate([[0], breaks]).tolist(), np.concatenate([breaks, [len(todo)]]).tolist()):
            run = todo[lo:hi]
            lc, src_level, dst_level = (int(x) for x in key[lo])
            src, dst = run[:, COPY_SRC_INDEX], run[:, COPY_DST_INDEX]
            src_mem = self.pools[src_level][lc]
            dst_mem = self.pools[dst_level][lc]
            same_pool = src_level == dst_level
            if len(np.unique(dst)) == len(dst) and not (same_pool and np.intersect1d(src, dst).size):
                dst_mem[self._on(dst_level, dst)] = self._to(dst_level, src_mem[self._on(src_level, src)])
                self._advance(run)
            else:
                for i in range(len(run)):  # rare: a slot reused within the run
                    dst_mem[int(dst[i])] = self._to(dst_level, src_mem[int(src[i])])
                    self._advance(run[i:i + 1])

    def _advance(self, made: np.ndarray) -> None:
        """Count ``made`` as done, cursor and statistics in one operation."""
        step = np.zeros_like(self._state)
        step[0] = len(made)
        intra = (made[:, COPY_SRC_LEVEL] == 0) & (made[:, COPY_DST_LEVEL] == 0)
        step[1:] = np.bincount(made[intra, COPY_LIFE_CYCLE], minlength=self.num_life_cycles)[: self.num_life_cycles]
        self._state += step

    def _on(self, level: int, index: np.ndarray):
        return self.backend.to_device(index) if level == 0 else index

    def _to(self, level: int, data):
        """Page bytes moved into the memory of ``level`` (device or host)."""
        return self.backend.to_device(data) if level == 0 else np.asarray(self.backend.to_host(data))

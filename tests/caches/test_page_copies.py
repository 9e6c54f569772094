"""The page copies, public: with ``page_bytes=0`` the engine carries out the
copies gpukv decides on (``take_page_copies``), and gets exactly what gpukv's
own page memory does with ``page_bytes > 0``.

- Side by side: one seeded workload on two managers, real page memory and
  index only. The copies taken equal the copies ``PageMemory`` made, copy for
  copy, and after every step the engine's own pools hold exactly the bytes of
  gpukv's page memory (the reference engine checks the data too).
- Under fault injection (interrupts at any line, failing protocol steps,
  failing takes) no copy is lost or repeated: the copies the engine carried
  out are, in order, exactly those the kernels recorded, launch by launch.
- The result type, its batches, and what ``page_bytes > 0`` returns.
"""

from __future__ import annotations


import numpy as np
import pytest

import gpukv
import gpukv.launcher as launcher_module
from gpukv import Attention, introspect
from gpukv.core.layout import CNT_NUM_COPIES, COPY_WIDTH, copies_table

from tests.support.backends import GPU_BACKEND, make_manager
from tests.support.engine import Engine
from tests.support.faults import FaultyWorkload
from tests.support.interrupts import run_interrupted_at_line

T = 4


def _made_copies(mgr) -> list:
    """Record every copy ``PageMemory`` makes (real page memory), as int64[n, 5] steps."""
    pages = mgr._pages
    made = []
    original = pages._copy

    def copy(lc, src_level, src, dst_level, dst):
        step = np.empty((len(src), COPY_WIDTH), dtype=np.int64)
        step[:] = [lc, src_level, 0, dst_level, 0]
        step[:, 2], step[:, 4] = src, dst
        made.append(step)
        original(lc, src_level, src, dst_level, dst)

    pages._copy = copy
    return made


def _table(steps: list) -> np.ndarray:
    return np.concatenate(steps) if steps else np.zeros((0, COPY_WIDTH), dtype=np.int64)


def _assert_same_memory(real: Engine, own: Engine, step: int):
    for lc in range(len(real.specs)):
        for level, (a, b) in enumerate(((real.words(lc), own.own[0][lc]), (real.host_words(lc), own.own[1][lc]))):
            if a is None:
                assert b is None
                continue
            bad = np.nonzero((np.asarray(a) != b).any(axis=1))[0]
            assert not bad.size, f"step {step}: life cycle {lc} level {level}: pages {bad[:8].tolist()} differ"


@pytest.mark.parametrize("config", sorted(FaultyWorkload.CONFIGS))
@pytest.mark.parametrize("seed", range(2))
def test_taken_copies_are_the_copies_page_memory_makes(config, seed):
    real = FaultyWorkload(seed, config, rate=0.0)
    own = FaultyWorkload(seed, config, rate=0.0, index_only=True)
    assert real.engine.owns_memory is False and own.engine.owns_memory is True
    made = _made_copies(real.mgr)
    for step in range(250):
        real.step()
        own.step()
        own.engine.sync()
        assert len(real.mgr.take_page_copies()) == 0  # gpukv made them itself
        _assert_same_memory(real.engine, own.engine, step)
    real.wind_down()
    own.wind_down()
    own.engine.sync()
    taken, performed = own.engine.applied_table(), _table(made)
    assert np.array_equal(taken, performed), "the copies taken differ from the copies page memory made"
    kinds = {(int(a), int(b)) for a, b in taken[:, [1, 3]]}
    if real.mgr.config.host_pages_per_life_cycle:
        assert {(0, 1), (1, 0)} <= kinds, f"no migration both ways among the copies: {kinds}"
    if real.mgr.config.commit_min_snapshot:
        assert (0, 0) in kinds and len(taken) >= 20, f"too few snapshot copies to compare ({len(taken)})"


@pytest.mark.cudasim
def test_taken_copies_match_page_memory_cudasim():
    real = FaultyWorkload(3, "hybrid", rate=0.0, backend=GPU_BACKEND)
    own = FaultyWorkload(3, "hybrid", rate=0.0, backend=GPU_BACKEND, index_only=True)
    made = _made_copies(real.mgr)
    for step in range(30):
        real.step()
        own.step()
        _assert_same_memory(real.engine, own.engine, step)
    own.engine.sync()
    assert np.array_equal(own.engine.applied_table(), _table(made))
    assert len(made) > 0


def _record_launch_copies(monkeypatch, mgr) -> list:
    """The copy records (``layout.COPY_RECORDS``) every launch's kernel
    wrote, read right after the kernel (the truth a lost or repeated copy is
    measured against)."""
    recorded = []
    original = launcher_module.call_kernel
    tables = mgr._tables

    def call_kernel(kernel, *args):
        try:
            original(kernel, *args)
        finally:
            # Also when an interrupt lands in the launcher's own call_kernel
            # after the kernel ran (before it, nothing is recorded yet: the
            # launch starts with an empty list). Read with NumPy alone (the
            # cpu backend's arrays): no gpukv code runs here that the
            # harness could interrupt or has hooked.
            n = int(tables.counters[CNT_NUM_COPIES])
            if n:
                recorded.append(np.array(tables.copies[:n]))  # decoded after the run (copies_table is gpukv's)

    monkeypatch.setattr(launcher_module, "call_kernel", call_kernel)
    return recorded


@pytest.mark.parametrize("config", ["hybrid", "swa-host"])  # the configurations that copy (snapshots, a host tier)
@pytest.mark.parametrize("seed", range(2))
def test_faults_lose_and_repeat_no_copy(monkeypatch, config, seed):
    w = FaultyWorkload(seed, config, rate=0.4, index_only=True)
    recorded = _record_launch_copies(monkeypatch, w.mgr)
    w.run(300)  # every step checks the data in the engine's own arrays
    w.engine.sync()
    fired = w.faults.fired
    assert fired["line"] >= 15 and fired["hook"] >= 3, fired
    expected = _table([copies_table(records) for records in recorded])
    assert len(expected) >= 10, f"too few copies to say anything ({len(expected)})"
    applied = w.engine.applied_table()
    if not np.array_equal(applied, expected):
        n = min(len(applied), len(expected))
        first = int(np.argmax((applied[:n] != expected[:n]).any(axis=1))) if (applied[:n] != expected[:n]).any() else n
        raise AssertionError(
            f"{len(applied)} copies carried out, {len(expected)} recorded by the kernels; first difference at "
            f"copy {first}: carried out {applied[first:first + 3].tolist()}, recorded {expected[first:first + 3].tolist()}"
        )


def test_the_checks_see_a_dropped_copy():
    """The checks bite: a manager that forgets the copies it keeps (counts
    them done without keeping them) is caught by the engine's data checks."""
    w = FaultyWorkload(0, "hybrid", rate=0.0, index_only=True)
    pages = w.mgr._pages
    pages._keep = lambda todo: pages._advance(todo)
    with pytest.raises(AssertionError, match="wrong"):
        w.run(200)


def _one_private_tail_copy(mgr):
    """A cache whose resume decides one copy (its reused partial tail's
    private page); returns the cache and the copy's destination page."""
    kv = mgr.create_kv_cache(input_tokens=list(range(1, 7)) + [9])
    assert kv.num_committed_tokens == 6
    assert kv.resume()
    return kv, int(kv.page_indices(0)[1])


def _tail_rig():
    mgr = make_manager("cpu", tokens_per_block=T, pages_per_life_cycle=16)
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(6, 6)
    kv.commit(list(range(1, 7)))
    kv.close()
    assert len(mgr.take_page_copies()) == 0
    return mgr


def test_a_take_interrupted_at_any_line_hands_each_copy_over_once():
    """An interrupt before any line of gpukv's host code in a take (the
    copies already read, already forgotten, on the call's way out): either
    the take returns the copy or the next one does, exactly once."""
    mgr = _tail_rig()
    interrupted = 0
    for k in range(1, 400):
        kv, dst = _one_private_tail_copy(mgr)
        got, fired = run_interrupted_at_line(k, mgr.take_page_copies)
        later = mgr.take_page_copies()
        handed = ([] if got is None else got.dst_index.tolist()) + later.dst_index.tolist()
        assert handed == [dst], f"interrupted at {fired}: the copy to page {dst} was handed over as {handed}"
        assert len(mgr.take_page_copies()) == 0
        kv.close()
        if not fired:
            break  # past the call's last line
        interrupted += 1
    assert interrupted >= 8, interrupted


def test_a_take_interrupted_after_the_guard_returned_keeps_its_copies(monkeypatch):
    """A signal's handler may run in the call guard's frame after the take
    returned to it, before the manager's frame got the copies (the
    interpreter checks for signals after every call): they stay for the next
    take."""
    mgr = _tail_rig()
    kv, dst = _one_private_tail_copy(mgr)
    guard = mgr._launcher.guard
    original = guard.run

    def run_then_interrupted(*args):
        original(*args)
        raise KeyboardInterrupt("after the take returned into the guard")

    monkeypatch.setattr(guard, "run", run_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        mgr.take_page_copies()
    monkeypatch.setattr(guard, "run", original)
    copies = mgr.take_page_copies()
    assert copies.dst_index.tolist() == [dst] and len(mgr.take_page_copies()) == 0
    assert copies.life_cycle.tolist() == [0] and copies.dst_level.tolist() == [0] and copies.src_level.tolist() == [0]
    assert copies.src_index.tolist() != copies.dst_index.tolist()
    kv.close()


def test_copies_decided_after_a_take_cut_short_come_after_its_own():
    """Copies kept between a take cut short and the next one follow the
    copies that take had taken: the order the engine carries them out in is
    the order they were decided in."""
    mgr = _tail_rig()
    pages = mgr._pages
    kv1, dst1 = _one_private_tail_copy(mgr)
    receipt = object()
    assert pages.take_copies(receipt).dst_index.tolist() == [dst1]  # taken, never returned
    kv2, dst2 = _one_private_tail_copy(mgr)
    pages.give_back(receipt)
    assert mgr.take_page_copies().dst_index.tolist() == [dst1, dst2]
    pages.give_back(receipt)  # a take that is over gives nothing back twice
    assert len(mgr.take_page_copies()) == 0
    kv1.close()
    kv2.close()


def test_page_copies_result():
    mgr = make_manager("cpu", tokens_per_block=T, layers=[Attention(), Attention(window=8)], pages_per_life_cycle=16,
                       host_pages_per_life_cycle=8)
    empty = mgr.take_page_copies()
    assert isinstance(empty, gpukv.PageCopies) and len(empty) == 0 and empty.records().shape == (0,)
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(6, 6)
    kv.commit(list(range(1, 7)))
    kv.suspend()
    other = mgr.create_kv_cache()
    assert other.resume() and other.resize(15 * T)  # 14 pages free: evicts, the suspended cache's pages migrate
    copies = mgr.take_page_copies()
    assert len(copies) > 0
    assert set(copies.src_level.tolist()) == {0} and set(copies.dst_level.tolist()) == {1}
    assert copies.life_cycle.dtype == np.int32 and copies.src_index.dtype == np.int64
    rec = copies.records()
    assert rec.dtype.names == ("life_cycle", "src_level", "src_index", "dst_level", "dst_index")
    assert rec["dst_index"].tolist() == copies.dst_index.tolist()
    with pytest.raises(ValueError):
        copies.src_index[0] = 5  # read only
    with pytest.raises(AttributeError):
        copies.life_cycle = copies.src_level  # frozen
    assert sum(len(b[2]) for b in copies.batches()) == len(copies)
    assert len(mgr.take_page_copies()) == 0  # taken once
    other.close()
    kv.close()


def test_batches_are_exact_in_order():
    """Batches of a copy list applied with one gather/scatter each give what
    copying one page at a time, in order, gives: slots reused within a run
    are split, runs between different pools keep their order."""
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(400):
        lc, sl, dl = int(rng.integers(2)), int(rng.integers(2)), int(rng.integers(2))
        src, dst = rng.choice(6, 2, replace=False)
        rows.append([lc, sl, src, dl, dst])
        if rng.random() < 0.6:  # runs between the same pools
            rows.append([lc, sl, (src + 1) % 6, dl, (dst + 2) % 6])
    copies = gpukv.PageCopies.from_table(np.array(rows, dtype=np.int64))
    one = [[rng.integers(0, 1 << 40, 6) for _ in range(2)] for _ in range(2)]  # [level][lc]
    batched = [[a.copy() for a in level] for level in one]
    for lc, sl, s, dl, d in copies.table().tolist():
        one[dl][lc][d] = one[sl][lc][s]
    for lc, sl, s, dl, d in copies.batches():
        batched[dl][lc][d] = batched[sl][lc][s]
    for level in range(2):
        for lc in range(2):
            assert np.array_equal(one[level][lc], batched[level][lc])


def test_real_page_memory_returns_no_copies():
    mgr = make_manager("cpu", tokens_per_block=T, pages_per_life_cycle=16, page_bytes=8 * T)
    engine = Engine(mgr)
    tokens = list(range(1, 7))
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(6, 6)
    engine.run(kv, tokens, 0, 6)
    kv.commit(tokens)
    kv.close()
    kv = mgr.create_kv_cache(input_tokens=tokens + [9])
    assert kv.resume()
    assert mgr.get_and_reset_iteration_stats() == {0: {"iter_intra_device_copy_blocks": 1, "iter_intra_device_copy_bytes": 32}}
    assert len(mgr.take_page_copies()) == 0
    engine.verify_reuse(kv, tokens + [9])  # gpukv made the copy itself
    kv.close()
    introspect.check_sanity(mgr)


def test_an_interrupt_right_after_the_kernel_loses_no_copy():
    """A KeyboardInterrupt in the launcher right after the kernel ran (its
    copies are recorded, nothing of the aftermath done yet): the call
    raises, and its copy is kept once, for the next take."""
    import inspect
    import sys

    mgr = make_manager("cpu", tokens_per_block=T, pages_per_life_cycle=16)
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(6, 6)
    kv.commit(list(range(1, 7)))
    kv.close()
    assert len(mgr.take_page_copies()) == 0
    kv = mgr.create_kv_cache(input_tokens=list(range(1, 7)) + [9])
    lines, first = inspect.getsourcelines(launcher_module.call_kernel)
    after_kernel = first + next(i for i, line in enumerate(lines) if line.strip() == "return")
    fired = []

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == after_kernel and not fired:
            fired.append(True)
            raise KeyboardInterrupt("right after the kernel")
        return local

    def trace(frame, event, arg):
        return local if frame.f_code is launcher_module.call_kernel.__code__ else None

    sys.settrace(trace)
    try:
        with pytest.raises(KeyboardInterrupt):
            kv.resume()
    finally:
        sys.settrace(None)
    assert fired
    assert kv.status is gpukv.KVCacheStatus.ACTIVE  # the kernel ran; the guard finished its aftermath
    copies = mgr.take_page_copies()
    assert len(copies) == 1 and copies.dst_index.tolist() == [int(kv.page_indices(0)[1])]
    assert len(mgr.take_page_copies()) == 0
    kv.close()
    introspect.check_sanity(mgr)

"""Faults around a launch: exceptions between a kernel launch and its
aftermath, interrupts anywhere in a call, re-entrant callbacks, a second
thread, an interrupted scope registration, an interrupted first kernel load.

Every check is on outcomes: reused pages hold exactly the data written for
their prefix (real page memory, ``tests/support/engine.py``), events equal those of
an uninterrupted twin, the tables pass ``check_sanity``.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import gpukv
from gpukv import Attention, ReuseScope, Ssm, introspect

from tests.support.backends import backend_params, make_manager
from tests.support.engine import Engine
from tests.support.interrupts import HOST, Interrupter

T = 4


def rig(backend="cpu", layers=(Attention(),), pages=64, **config):
    mgr = make_manager(backend, tokens_per_block=T, layers=list(layers), pages_per_life_cycle=pages, page_bytes=8 * T, **config)
    return mgr, Engine(mgr)


def committed_turn(mgr, engine, tokens):
    """A cache computes and commits ``tokens`` (the engine writes their KV), then closes."""
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(len(tokens), len(tokens))
    engine.run(kv, tokens, 0, len(tokens))
    kv.commit(list(tokens))
    kv.close()


class RaiseOnce:
    """Wraps a callable so its first ``times`` calls raise ``exc`` instead of running."""

    def __init__(self, fn, exc=KeyboardInterrupt, times=1):
        self.fn, self.exc, self.left = fn, exc, times

    def __call__(self, *args, **kwargs):
        if self.left:
            self.left -= 1
            raise self.exc("injected between the launch and its aftermath")
        return self.fn(*args, **kwargs)


def fail_copies(mgr, **how):
    copier = mgr._launcher.copier
    copier.carry_out = RaiseOnce(copier.carry_out, **how)
    return copier.carry_out


# ---------------------------------------------------------------------------
# page data copies
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("times", [1, 2], ids=["redone-on-the-way-out", "redone-by-the-next-call"])
def test_a_private_tail_copy_cut_short_is_carried_out(backend, exc, times):
    """The first resume copies a reused partial tail block into a private page.
    A copy executor that raises must not leave that page unwritten."""
    mgr, engine = rig(backend)
    prompt = list(range(100, 106))  # one full block and a 2-token tail
    committed_turn(mgr, engine, prompt)
    kv = mgr.create_kv_cache(input_tokens=prompt + [7, 8])
    assert kv.num_committed_tokens == 6
    injected = fail_copies(mgr, exc=exc, times=times)
    with pytest.raises(exc, match="injected"):
        kv.resume()
    assert injected.left == 0
    assert kv.status is gpukv.KVCacheStatus.ACTIVE  # the launch happened; its scalars came back
    engine.verify_reuse(kv, prompt)  # reads page_indices: a call, which finishes what was left
    assert mgr.get_and_reset_iteration_stats()[0]["iter_intra_device_copy_blocks"] == 1  # counted once
    kv.close()
    introspect.check_sanity(mgr)
    engine.verify_tree()


@pytest.mark.parametrize("times", [1, 2])
def test_a_snapshot_copy_cut_short_is_never_reused_unwritten(times):
    """commit_min_snapshot copies the SSM state into the tree at a commit; the
    next request reuses that page. The copy must have been made."""
    mgr, engine = rig(layers=(Attention(), Ssm()), commit_min_snapshot=True, enable_partial_reuse=False)
    prompt = list(range(200, 212))
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(12, 12)
    engine.run(kv, prompt, 0, 12)
    fail_copies(mgr, times=times)
    with pytest.raises(KeyboardInterrupt):
        kv.commit(prompt)
    assert kv.num_committed_tokens == 12
    kv.close()
    engine.verify_tree()
    reuse = mgr.create_kv_cache(input_tokens=prompt)
    assert reuse.num_committed_tokens == 12
    assert reuse.resume()
    engine.verify_reuse(reuse, prompt)
    reuse.close()
    introspect.check_sanity(mgr)


def test_a_migration_cut_short_is_carried_out():
    """A swap-out to the host tier is a copy too: the page comes back with its data."""
    mgr, engine = rig(pages=4, host_pages_per_life_cycle=8)
    a_tokens = list(range(300, 316))
    a = mgr.create_kv_cache()
    assert a.resume() and a.resize(16, 16)
    engine.run(a, a_tokens, 0, 16)
    a.commit(a_tokens)
    a.suspend()
    b = mgr.create_kv_cache()
    assert b.resume()
    fail_copies(mgr, times=2)
    with pytest.raises(KeyboardInterrupt):
        b.resize(16, 16)  # evicts a's held pages to the host
    assert mgr.get_and_reset_eviction_stats()["migrated"] == 4
    b.close()
    assert a.resume()  # back onto the GPU, copied again
    engine.verify_reuse(a, a_tokens)
    a.close()
    engine.verify_tree()
    introspect.check_sanity(mgr)


# ---------------------------------------------------------------------------
# the change log and the results of a launch
# ---------------------------------------------------------------------------


def event_workload(mgr):
    for n, base in ((10, 0), (14, 0), (9, 50)):
        kv = mgr.create_kv_cache(input_tokens=list(range(base, base + n)))
        assert kv.resume() and kv.resize(n, n)
        kv.commit(list(range(base + kv.num_committed_tokens, base + n)))
        kv.close()
    mgr.clear_reusable_blocks()


@pytest.mark.parametrize("times", [1, 2])
def test_events_survive_an_event_sink_that_raises(times):
    def manager():
        return make_manager("cpu", tokens_per_block=T, pages_per_life_cycle=64, max_kv_event_entries=1000)

    twin, mgr = manager(), manager()
    event_workload(twin)
    want = [(e.event_id, e.data, e.layer_group_id) for e in twin.get_latest_events()]
    events = mgr._events
    events.on_records = RaiseOnce(events.on_records, times=times)
    first = mgr.create_kv_cache()
    assert first.resume() and first.resize(10, 10)
    with pytest.raises(KeyboardInterrupt):
        first.commit(list(range(10)))
    first.close()
    for n, base in ((14, 0), (9, 50)):
        kv = mgr.create_kv_cache(input_tokens=list(range(base, base + n)))
        assert kv.resume() and kv.resize(n, n)
        kv.commit(list(range(base + kv.num_committed_tokens, base + n)))
        kv.close()
    mgr.clear_reusable_blocks()
    got = [(e.event_id, e.data, e.layer_group_id) for e in mgr.get_latest_events()]
    assert got == want


def test_a_cache_closed_in_a_launch_cut_short_leaves_the_open_set():
    mgr, engine = rig()
    kv = mgr.create_kv_cache()
    assert kv.resume()
    pool = mgr._pool  # the launch's results step reads the caches' scalars first, then updates the open set
    pool.refresh = RaiseOnce(pool.refresh, times=2)
    with pytest.raises(KeyboardInterrupt):
        kv.close()
    mgr.shutdown()  # finishes the aftermath first: the cache is CLOSED, nothing is open
    assert kv.status is gpukv.KVCacheStatus.CLOSED


# ---------------------------------------------------------------------------
# interrupts anywhere in a call (tests/support/interrupts.py)
# ---------------------------------------------------------------------------


def interrupted_workload(mgr, engine, rng, prompts, interrupt) -> int:
    """Turns over ``prompts``, a third of the calls interrupted at a random
    line; every turn carries on from whatever state the interrupted call
    left. Returns how many turns committed their prompt."""

    def maybe(fn, *args, **kwargs):
        interrupt.arm(rng.randint(1, 150) if rng.random() < 0.35 else 0)
        return interrupt(fn, *args, **kwargs)

    committed = 0
    for prompt in prompts:
        kv = maybe(mgr.create_kv_cache, input_tokens=prompt[:-1])
        if kv is None:
            continue
        maybe(kv.resume)
        if kv.status is gpukv.KVCacheStatus.ACTIVE:
            engine.verify_reuse(kv, prompt)
            n = kv.num_committed_tokens
            maybe(kv.resize, len(prompt), len(prompt))
            if kv.capacity >= len(prompt) and kv.history_length == len(prompt):
                engine.run(kv, prompt, n, len(prompt))
                maybe(kv.commit, prompt[n:])
                committed += kv.num_committed_tokens == len(prompt)
        maybe(kv.close)
        if kv.status is not gpukv.KVCacheStatus.CLOSED:
            kv.close()
        introspect.check_sanity(mgr)
        engine.verify_tree()
    return committed


@pytest.mark.parametrize("seed", range(3))
def test_interrupts_anywhere_never_leave_wrong_kv(seed):
    rng = random.Random(seed)
    mgr, engine = rig(layers=(Attention(), Attention(window=8), Ssm()), pages=24, host_pages_per_life_cycle=8,
                      commit_min_snapshot=True, enable_partial_reuse=True)
    stems = [[rng.randrange(1000) for _ in range(rng.randrange(3, 14))] for _ in range(4)]
    prompts = [rng.choice(stems) + [rng.randrange(1000) for _ in range(rng.randrange(1, 9))] for _ in range(40)]
    interrupt = Interrupter()
    committed = interrupted_workload(mgr, engine, rng, prompts, interrupt)
    # Not vacuous: many calls were cut short, and some turns still made it
    # into the tree for the checks below to reuse.
    assert interrupt.fired >= 10 and committed >= 3, (interrupt.fired, committed)
    for prompt in prompts[:10]:  # what is reusable now holds the right KV
        kv = mgr.create_kv_cache(input_tokens=prompt)
        assert kv.resume()
        engine.verify_reuse(kv, prompt)
        kv.close()
    mgr.shutdown()


# ---------------------------------------------------------------------------
# re-entrant calls and threads
# ---------------------------------------------------------------------------


def locked_or_held_pages(mgr) -> int:
    pages = introspect.tables(mgr)["pages"]
    return int(np.count_nonzero((pages["locks"] > 0) | (pages["holders"] > 0)))


@pytest.mark.parametrize("backend", backend_params())
def test_a_priority_callback_that_closes_its_cache_is_refused(backend):
    mgr, engine = rig(backend)
    committed_turn(mgr, engine, list(range(8)))
    calls = []

    def callback(ordinal, lc):
        calls.append(ordinal)
        kv.close()
        return 35

    kv = mgr.create_kv_cache(input_tokens=list(range(8)), priority_callback=callback)
    with pytest.raises(gpukv.BusyError, match=r"kv.close\(\) was called while kv.resume\(\) is in progress"):
        kv.resume()
    assert calls == [0]
    assert kv.status is gpukv.KVCacheStatus.SUSPENDED  # the refused resume changed nothing
    assert kv.num_committed_tokens == 8
    introspect.check_sanity(mgr)
    kv.close()
    assert kv.status is gpukv.KVCacheStatus.CLOSED
    assert locked_or_held_pages(mgr) == 0
    mgr.shutdown()


def test_a_callback_may_catch_the_refusal_and_carry_on():
    mgr, _ = rig()
    refused = []

    def callback(ordinal, lc):
        try:
            mgr.match_batch([[1, 2, 3]])
        except gpukv.BusyError as e:
            refused.append(e)
        return 10

    kv = mgr.create_kv_cache(priority_callback=callback)
    assert kv.resume() and kv.resize(8)
    assert len(refused) == 2  # one per ordinal, and the resize went ahead
    kv.close()
    mgr.shutdown()


def test_a_call_from_a_second_thread_is_refused():
    mgr, _ = rig()
    seq = mgr.token_sequence(list(range(12)))
    inside, release = threading.Event(), threading.Event()

    def callback(ordinal, lc):
        inside.set()
        release.wait(30)
        return 35

    kv = mgr.create_kv_cache(priority_callback=callback)
    results = []
    worker = threading.Thread(target=lambda: results.append(kv.resume() and kv.resize(8)))
    worker.start()
    try:
        assert inside.wait(30)
        with pytest.raises(gpukv.BusyError, match=r"from thread .* while kv.resize\(\) is in progress in thread"):
            mgr.match_batch([seq])
        with pytest.raises(gpukv.BusyError, match="single-threaded"):
            kv.close()
    finally:
        release.set()
        worker.join(30)
    assert results == [True]
    assert int(mgr.match_batch([seq]).to_host().num_tokens[0]) == 0
    kv.close()
    mgr.shutdown()


def test_threads_matching_the_same_sequences_get_right_answers_or_a_refusal():
    mgr, engine = rig(pages=256)
    rng = random.Random(1)
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(4, 40))] for _ in range(16)]
    for p in prompts[:8]:
        committed_turn(mgr, engine, p)
    want = [int(mgr.probe_reuse(p)) for p in prompts]
    wrong, answered = [], []

    def worker():
        for _ in range(60):
            try:
                got = mgr.match_batch(shared).to_host().num_tokens.tolist()
            except gpukv.BusyError:
                continue
            answered.append(1)
            if got != want:
                wrong.append(got)

    shared = [mgr.token_sequence(p) for p in prompts]
    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert answered and not wrong


@pytest.mark.parametrize("call", ["extend", "release"])
def test_a_sequence_changed_from_inside_a_call_is_refused(call):
    """A TokenSequence changes the arena that matching reads: from a callback
    inside a call, or from another thread meanwhile, it is refused like any
    call on the manager, and the sequence is left as it was."""
    mgr, _ = rig()
    seq = mgr.token_sequence(list(range(1, 10)))
    refused = []

    def change():
        try:
            seq.extend([7, 8]) if call == "extend" else seq.release()
        except gpukv.BusyError as e:
            refused.append(str(e))

    def callback(ordinal, lc):
        change()
        return 35

    kv = mgr.create_kv_cache(priority_callback=callback)
    assert kv.resume() and kv.resize(8)
    assert refused and f"TokenSequence.{call}()" in refused[0] and "kv.resize()" in refused[0]
    assert len(seq) == 9 and not seq.released and seq.tokens.tolist() == list(range(1, 10))

    inside, release = threading.Event(), threading.Event()

    def blocking(ordinal, lc):
        inside.set()
        release.wait(30)
        return 35

    kv2 = mgr.create_kv_cache(priority_callback=blocking)
    worker = threading.Thread(target=lambda: kv2.resume() and kv2.resize(8))
    worker.start()
    try:
        assert inside.wait(30)
        refused.clear()
        change()
        assert refused and "single-threaded" in refused[0]
    finally:
        release.set()
        worker.join(30)
    assert len(seq) == 9 and not seq.released
    seq.extend([10]) if call == "extend" else seq.release()  # outside a call: allowed
    assert seq.released if call == "release" else len(seq) == 10
    kv.close()
    kv2.close()
    mgr.shutdown()


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs setitimer")
@pytest.mark.parametrize("where", ["caller-share", "while-waiting"])
def test_an_interrupted_fan_out_leaves_no_worker_writing(monkeypatch, where):
    """An interrupt on the calling thread of a cpu match (its own share, or a
    signal while it waits for the workers) raises only once every worker is
    done: nothing writes the result arrays after the call has raised."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from gpukv.kernels import match

    pool = ThreadPoolExecutor(max_workers=3)
    monkeypatch.setattr(match, "_POOL", [(pool, 4)])
    out = np.zeros(4, dtype=np.int64)
    alive = []

    def share(w, k):
        if w == 0:
            if where == "caller-share":
                raise KeyboardInterrupt("injected in the caller's share")
            return
        alive.append(w)
        time.sleep(0.3)
        out[w] = w
        alive.remove(w)

    def on_alarm(sig, frame):
        raise KeyboardInterrupt("injected while waiting for the workers")

    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        if where == "while-waiting":
            signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(KeyboardInterrupt, match="injected"):
            match._fan_out(100, 1, share)
        seen = out.copy()
        assert not alive, f"workers {alive} still running after the call raised"
        time.sleep(0.4)
        assert (out == seen).all(), "a worker wrote the results after the call raised"
        assert seen[1:].tolist() == [1, 2, 3]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        pool.shutdown(wait=True)


# ---------------------------------------------------------------------------
# scope registration
# ---------------------------------------------------------------------------


def test_an_interrupted_scope_registration_leaves_the_registry_whole():
    mgr, engine = rig(pages=256)
    interrupt = Interrupter(only="scope_id")
    scopes = [ReuseScope(salt=i) for i in range(12)]
    for k, scope in enumerate(scopes):
        interrupt.arm(k + 1)
        interrupt(mgr.create_kv_cache, scope=scope)  # registers the scope, interrupted at its k-th line
    assert interrupt.fired >= 5
    tree = mgr._tree
    for scope in scopes + [ReuseScope(lora_id=3)]:
        sid = tree.scope_id(scope, create=True)
        raw = scope.to_bytes()
        assert tree.scope_of(sid) == scope
        assert tree.scope_digest(sid) == hashlib.sha256(raw).digest()
    # Blocks committed under each scope carry that scope's chain keys.
    for scope in scopes[:4]:
        kv = mgr.create_kv_cache(scope=scope)
        assert kv.resume() and kv.resize(4)
        kv.commit([1, 2, 3, 4])
        kv.close()
        keys = [key for _, key in gpukv.sequence_to_blockchain_keys(T, scope, [1, 2, 3, 4])]
        block, _ = tree.add([1, 2, 3, 4], scope=scope)
        assert block.key == keys[1]
    introspect.check_sanity(mgr)


# ---------------------------------------------------------------------------
# the first kernel load of a process
# ---------------------------------------------------------------------------

_FIRST_LOAD = textwrap.dedent("""
    import signal, sys, time
    delay = float(sys.argv[1])
    import gpukv

    def work():
        mgr = gpukv.KVCacheManager(gpukv.CacheConfig(tokens_per_block=4, pages_per_life_cycle=64, backend="cpu"))
        kv = mgr.create_kv_cache(list(range(10)))
        assert kv.resume() and kv.resize(16)
        kv.commit(list(range(16)))
        kv.close()
        assert mgr.probe_reuse(list(range(17))) == 16

    def interrupt(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, delay)
    try:
        work()
    except KeyboardInterrupt:
        print("interrupted")
    signal.setitimer(signal.ITIMER_REAL, 0)
    work()
    print("retry ok")
""")


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs setitimer")
def test_an_interrupted_first_kernel_load_can_be_retried():
    """A SIGALRM handler raising KeyboardInterrupt while the first manager of a
    process imports Numba and loads its kernels: the retry works."""
    mgr, engine = rig()
    committed_turn(mgr, engine, list(range(16)))  # every kernel the child loads is compiled on disk
    assert mgr.probe_reuse(list(range(17))) == 16
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    env["PYTHONPATH"] = os.path.dirname(HOST) + os.pathsep + env.get("PYTHONPATH", "")
    interrupted = 0
    for delay in (0.05, 0.3, 0.8):
        out = subprocess.run([sys.executable, "-c", _FIRST_LOAD, str(delay)], capture_output=True, text=True, env=env,
                             timeout=600)
        assert out.returncode == 0 and "retry ok" in out.stdout, out.stdout + out.stderr
        interrupted += "interrupted" in out.stdout
    assert interrupted

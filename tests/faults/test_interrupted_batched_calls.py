"""Interrupts on every step of a call's way, in index-only mode.

An engine that owns its KV (``page_bytes=0``) drives batches of requests
through the batched calls (``create_kv_caches``, ``resume_batch``,
``resize_batch``, ``commit_batch``, ``close_batch``) and takes the page
copies (``take_page_copies``) every step, carrying them out on its own
arrays (``tests/support/engine.py``). Each kind of call is swept: every other run
of it is interrupted before the ``N``-th line of gpukv's host code it runs
(``KeyboardInterrupt`` from a trace function, as a signal handler would
raise it), N = 1, 1 + s, 1 + 2s, ... until a run completes without the
interrupt firing, then the sweep starts over (the stride ``s`` is 1 in the
long variant, larger in the default run, from a seeded offset). The engine
carries on from whatever an interrupted call left (it reads the caches'
state; a creation that raised made no cache it must know about).

After every step every running cache's reused and written positions hold
their own prefix's data, byte for byte, as do the tree's pages; and at the
end, with everything closed, no cache is open, no page is held or locked and
no pool slot is taken. ``publish()`` is swept the same way against a
subscriber: the router's view is what the publisher says it told it, and
no sequence number is skipped or repeated.
"""

from __future__ import annotations

import gc
import random
import weakref

import numpy as np
import pytest

import gpukv
from gpukv import Attention, Ssm, introspect

from tests.support.backends import GPU_BACKEND, make_manager
from tests.support.engine import Engine
from tests.support.interrupts import run_interrupted_at_line

T = 4
ACTIVE = gpukv.KVCacheStatus.ACTIVE
SUSPENDED = gpukv.KVCacheStatus.SUSPENDED
CLOSED = gpukv.KVCacheStatus.CLOSED


class Sweep:
    """Interrupts every other run of each kind of call, at its next line."""

    def __init__(self, rng: random.Random, stride: int):
        self.rng = rng
        self.stride = stride
        self.next: dict = {}  # kind -> the line its next interrupted run is interrupted at
        self.clean: dict = {}  # kind -> whether its next run goes uninterrupted
        self.fired: dict = {}  # kind -> interrupts that fired
        self.sweeps: dict = {}  # kind -> sweeps completed (a run past the call's last line)

    def call(self, kind: str, fn, *args):
        """``(value, interrupted)``."""
        self.clean[kind] = clean = not self.clean.get(kind, True)
        if clean:
            try:
                return fn(*args), False
            except KeyboardInterrupt:
                raise AssertionError(f"an uninterrupted {kind} raised KeyboardInterrupt") from None
        k = self.next.get(kind) or self.rng.randint(1, self.stride)
        value, fired = run_interrupted_at_line(k, lambda: fn(*args))
        if fired:
            self.fired[kind] = self.fired.get(kind, 0) + 1
            self.next[kind] = k + self.stride
        else:
            self.sweeps[kind] = self.sweeps.get(kind, 0) + 1
            self.next[kind] = None
        return value, bool(fired)


class Request:
    def __init__(self, tokens):
        self.tokens = tokens
        self.kv = None
        self.written = 0  # positions the engine wrote (reused ones count)


class InterruptedEngine:
    """The workload of the module docstring."""

    def __init__(self, seed: int, stride: int, backend: str = "cpu"):
        self.rng = rng = random.Random(seed)
        self.mgr = make_manager(
            backend, tokens_per_block=T, layers=[Attention(), Attention(window=8), Ssm()], pages_per_life_cycle=40,
            host_pages_per_life_cycle=12, page_bytes=0, enable_partial_reuse=True, commit_min_snapshot=True,
        )
        self.engine = Engine(self.mgr)
        self.sweep = Sweep(rng, stride)
        self.stems = [[rng.randrange(1, 500) for _ in range(rng.randrange(3, 12))] for _ in range(3)]
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.finished = 0

    # -- one engine step ------------------------------------------------------------------
    def step(self):
        mgr, sweep, rng = self.mgr, self.sweep, self.rng
        while len(self.waiting) < 2:
            self.waiting.append(Request(rng.choice(self.stems) + [rng.randrange(1, 500) for _ in range(rng.randrange(2, 12))]))
        if len(self.running) < 4:
            batch = self.waiting[:2]
            caches, _ = sweep.call("create_kv_caches", mgr.create_kv_caches, [r.tokens[:-1] for r in batch])
            if caches is not None:
                del self.waiting[:2]
                for r, kv in zip(batch, caches):
                    r.kv, r.written = kv, kv.num_committed_tokens
                    self.running.append(r)
        suspended = [r for r in self.running if r.kv.status is SUSPENDED]
        if suspended:
            sweep.call("resume_batch", mgr.resume_batch, [r.kv for r in suspended])
        active = [r for r in self.running if r.kv.status is ACTIVE]
        copies, _ = sweep.call("take_page_copies", mgr.take_page_copies)
        if copies is not None:
            self.engine.apply(copies)
        for r in active:  # the reused KV is right before the model reads it
            self.engine.verify_reuse(r.kv, r.tokens)
        # One model step: room for a few tokens, the engine writes them, a commit.
        grow = [r for r in active if r.written < len(r.tokens)]
        targets = [min(len(r.tokens), max(r.written, r.kv.history_length) + self.rng.randrange(1, 2 * T)) for r in grow]
        if grow:
            sweep.call("resize_batch", mgr.resize_batch, [r.kv for r in grow], targets, targets)
        wrote = []
        for r, target in zip(grow, targets):
            kv = r.kv
            if kv.status is ACTIVE and kv.capacity >= target and kv.history_length == target:
                self.engine.run(kv, r.tokens, r.written, target)
                r.written = target
                wrote.append(r)
        commit = [r for r in active if r.kv.status is ACTIVE and r.kv.num_committed_tokens < r.written
                  and r.kv.history_length == r.written]
        if commit:
            sweep.call("commit_batch", mgr.commit_batch, [r.kv for r in commit],
                       [r.tokens[r.kv.num_committed_tokens:r.written] for r in commit])
        done = [r for r in self.running
                if r.kv.status is not ACTIVE and self.rng.random() < 0.2
                or r.written == len(r.tokens) and r.kv.num_committed_tokens == r.written]
        if done:
            sweep.call("close_batch", mgr.close_batch, [r.kv for r in done])
            for r in done:
                if r.kv.status is CLOSED:
                    self.running.remove(r)
                    self.finished += 1
        self.verify()

    def verify(self):
        mgr, engine = self.mgr, self.engine
        introspect.check_sanity(mgr)
        engine.verify_tree()
        for r in self.running:
            kv = r.kv
            if kv.status is ACTIVE:
                engine.verify_reuse(kv, r.tokens)
                engine.verify_written(kv, r.tokens, r.written)
        mine = {id(r.kv) for r in self.running}
        assert set(map(id, mgr._open_caches)) == mine, "an open cache the engine never received"

    def run(self, sweeps: int, max_steps: int):
        """Steps until every kind of call was swept ``sweeps`` times."""
        for _ in range(max_steps):
            if all(self.sweep.sweeps.get(kind, 0) >= sweeps for kind in CALLS):
                break
            self.step()
        self.wind_down()
        return self

    def wind_down(self):
        mgr = self.mgr
        mgr.close_batch([r.kv for r in self.running])
        self.running.clear()
        self.engine.sync()
        self.verify()
        pages = introspect.tables(mgr)["pages"]
        assert not ((pages["locks"] > 0) | (pages["holders"] > 0)).any(), "a page is still locked or held"
        self.engine._ssm_state.clear()  # the engine's own references to the caches it ran
        assert_no_slot_taken(mgr)
        mgr.shutdown()


def assert_no_slot_taken(mgr):
    """Once the caches are gone, so are their pool slots: every slot taken
    is a live cache's (a closed one keeps its slot while referenced)."""
    gc.collect()
    # Weak proxies are skipped: one keeps nothing alive, and one whose object
    # is gone (Numba keeps such proxies to the code of functions a process
    # compiled and dropped) raises on isinstance.
    alive = sum(1 for o in gc.get_objects()
                if not isinstance(o, weakref.ProxyTypes) and isinstance(o, gpukv.KVCache) and o._mgr is mgr)
    assert mgr._pool.slots_in_use() == alive == 0, f"{mgr._pool.slots_in_use()} pool slots taken, {alive} caches alive"


CALLS = ("create_kv_caches", "resume_batch", "take_page_copies", "resize_batch", "commit_batch", "close_batch")


def _swept(w, sweeps: int):
    # Not vacuous: every kind of call was cut short many times and swept past
    # its last line, and requests made it through.
    for kind in CALLS:
        assert w.sweep.sweeps.get(kind, 0) >= sweeps, (kind, w.sweep.fired, w.sweep.sweeps)
    assert sum(w.sweep.fired.values()) >= 100 and w.finished >= 10, (w.sweep.fired, w.finished)


@pytest.mark.parametrize("seed", range(2))
def test_every_call_interrupted_along_its_way_leaves_the_kv_right(seed):
    _swept(InterruptedEngine(seed, stride=29).run(sweeps=1, max_steps=600), 1)


@pytest.mark.cudasim
def test_every_call_interrupted_along_its_way_cudasim():
    """The same on the CUDA kernels (simulated): the pool's device arrays,
    the device-side counters of copies and log."""
    w = InterruptedEngine(5, stride=61, backend=GPU_BACKEND).run(sweeps=1, max_steps=40)
    assert sum(w.sweep.fired.values()) >= 20 and w.finished >= 2, (w.sweep.fired, w.finished)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 102))
def test_every_call_interrupted_at_every_line_leaves_the_kv_right(seed):
    _swept(InterruptedEngine(seed, stride=1).run(sweeps=1, max_steps=20000), 1)


# ---------------------------------------------------------------------------
# the way out of a call, past its last line: after the call guard returned
# ---------------------------------------------------------------------------


def _interrupt_after_the_guard(monkeypatch, mgr):
    """The next call returns into the call guard and is interrupted there
    (a signal's handler runs after every call returns)."""
    guard = mgr._launcher.guard
    original = guard.run

    def run_then_interrupted(*args):
        monkeypatch.setattr(guard, "run", original)
        original(*args)
        raise KeyboardInterrupt("after the call returned into the guard")

    monkeypatch.setattr(guard, "run", run_then_interrupted)


def _reusable_prompt(mgr, tokens):
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(len(tokens), len(tokens))
    kv.commit(tokens)
    kv.close()


@pytest.mark.parametrize("batched", [True, False], ids=["create_kv_caches", "create_kv_cache"])
def test_caches_made_by_a_creation_interrupted_on_its_way_out_are_closed(monkeypatch, batched):
    mgr = make_manager("cpu", tokens_per_block=T, pages_per_life_cycle=16)
    prompt = list(range(1, 11))
    _reusable_prompt(mgr, prompt)
    _interrupt_after_the_guard(monkeypatch, mgr)
    with pytest.raises(KeyboardInterrupt):
        if batched:
            mgr.create_kv_caches([prompt, prompt[:6]])
        else:
            mgr.create_kv_cache(input_tokens=prompt)
    assert not mgr._open_caches, "the caches the caller never got are still open"
    pages = introspect.tables(mgr)["pages"]
    assert not (pages["holders"] > 0).any(), "their reused pages are still held"
    gc.collect()
    assert mgr._pool.slots_in_use() == 0
    mgr.shutdown()  # not refused


def test_a_creation_interrupted_at_any_line_leaks_no_pool_slot():
    """Between the pool's slot allocation and the caches' finalizers (the
    pool, the cache's constructor, the call): every slot taken is either a
    cache's the caller got, or back in the pool."""
    mgr = make_manager("cpu", tokens_per_block=T, pages_per_life_cycle=16)
    prompt = list(range(1, 11))
    _reusable_prompt(mgr, prompt)
    interrupted = 0
    for k in range(1, 2000):
        got, fired = run_interrupted_at_line(k, lambda: mgr.create_kv_caches([prompt, prompt[:7], [5, 6]]))
        assert mgr._pool.slots_in_use() == (3 if got is not None else 0), f"interrupted at {fired}"
        assert set(mgr._open_caches) == set(got or []), f"interrupted at {fired}"
        if got is not None:
            mgr.close_batch(got)
            del got
        if not fired:
            break
        interrupted += 1
    assert interrupted >= 50, interrupted
    gc.collect()
    assert mgr._pool.slots_in_use() == 0
    mgr.shutdown()


def test_an_append_interrupted_at_any_line_commits_its_tokens_or_none():
    """A per-cache append on its flat way (``CacheCalls._append_one``: the
    rules, the change log's room, the compiled call, its aftermath) cut
    short before each line of it in turn, chunk after chunk of a prefill:
    the launch committed the chunk, with its room, or nothing changed; the
    tables pass their checks, and the next append carries on from there."""
    mgr = make_manager("cpu", tokens_per_block=T, pages_per_life_cycle=1024)
    pool = mgr._pool
    flat = []
    launch_commit_one = pool.launch_commit_one
    pool.launch_commit_one = lambda *args: flat.append(1) or launch_commit_one(*args)
    prompt = np.arange(1, 2000, dtype=np.int32)  # an int32 array: the tokens' own fast way too
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(6)
    assert kv.append(prompt[:6], room=6)  # uninterrupted: the kernel's first call loads it
    n, k, interrupted, sweeps = 6, 1, 0, 0
    while sweeps < 4:
        n1 = n + 6
        got, fired = run_interrupted_at_line(k, lambda: kv.append(prompt[n:n1], room=6))
        introspect.check_sanity(mgr)
        assert not mgr._launcher.pending, f"interrupted at {fired}"
        assert kv.num_committed_tokens in (n, n1), f"interrupted at {fired}"
        if kv.num_committed_tokens == n1:  # a later line: the next chunk goes on from there
            assert kv.capacity >= n1 + 6, f"interrupted at {fired}"
            n = n1
        assert (got is None) == bool(fired)
        interrupted += bool(fired)
        sweeps += not fired
        k = k + 1 if fired else 1  # a run went through: every line of the way was cut once
    assert interrupted >= 4 * 20 and len(flat) >= 20, (interrupted, len(flat))
    again = mgr.create_kv_cache(input_tokens=prompt[:n + 1])
    assert again.num_committed_tokens == n // T * T
    mgr.close_batch([kv, again])
    introspect.check_sanity(mgr)
    mgr.shutdown()


# ---------------------------------------------------------------------------
# publish()
# ---------------------------------------------------------------------------


def test_a_publish_interrupted_at_any_line_never_leaves_a_router_wrong():
    zmq = pytest.importorskip("zmq", reason="pyzmq is not installed (pip install 'gpukv[events]')")
    msgspec = pytest.importorskip("msgspec", reason="msgspec is not installed (pip install 'gpukv[events]')")
    from gpukv.zmq_events import ZmqEventPublisher

    from gpukv.zmq_events import END_SEQ

    rng = random.Random(3)
    mgr = make_manager("cpu", tokens_per_block=T, layers=[Attention()], pages_per_life_cycle=24,
                       max_kv_event_entries=1 << 20, event_hash="sha256_64")
    pub = ZmqEventPublisher(mgr, endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(pub.endpoint)
    decoder = msgspec.msgpack.Decoder()
    view: set = set()  # (hash, group, medium) as the router holds them
    seqs: list = []  # the batches the router applied, in order
    gaps = []  # where it replayed

    def apply(seq, batch):
        seqs.append(seq)
        for e in batch[1]:
            if e["type"] == "AllBlocksCleared":
                view.clear()
            elif e["type"] == "BlockStored":
                view.update((h, e["group_idx"], e["medium"]) for h in e["block_hashes"])
            else:
                view.difference_update((h, e["group_idx"], e["medium"]) for h in e["block_hashes"])

    def replay(start):
        """The batches from ``start`` on, as a router asks the replay socket for them."""
        req = zmq.Context.instance().socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(pub.replay_endpoint)
        try:
            req.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            while True:
                assert req.poll(5000), "the replay answer stopped before its end marker"
                frames = req.recv_multipart()
                if frames[2] == END_SEQ:
                    return
                yield int.from_bytes(frames[2], "big"), decoder.decode(frames[3])
        finally:
            req.close()

    def receive(wait_ms=200):
        while sub.poll(wait_ms):
            _, seq, payload = sub.recv_multipart()
            seq = int.from_bytes(seq, "big")
            want = seqs[-1] + 1 if seqs else 0
            if seq < want:
                continue  # applied from a replay already
            if seq > want:
                # A publish cut between counting a batch sent and sending it:
                # the router sees the gap and replays it, as designed.
                gaps.append(want)
                for s, batch in list(replay(want)):
                    if s < seq:
                        apply(s, batch)
            apply(seq, decoder.decode(payload))

    try:
        assert pub.wait_for_subscriber(5.0)
        interrupted = k = 0
        while interrupted < 400:
            tokens = [rng.randrange(1, 30) for _ in range(rng.randrange(4, 17))]
            _reusable_prompt(mgr, tokens)  # stores blocks, and evicts some in the small pool
            k += 1
            _, fired = run_interrupted_at_line(k, pub.publish, where=lambda code: not code.co_filename.endswith("events.py")
                                               or code.co_filename.endswith("zmq_events.py"))
            if not fired:
                k = 0  # past publish()'s last line: the sweep starts over
            interrupted += bool(fired)
            if interrupted % 25 == 24 and fired:
                # A publish cut late enough to buffer its batch is rare in a
                # sweep (its lines before that are most of its lines): an
                # uninterrupted one now and then, as the next steps make, so
                # the router follows a stream with cuts in it, not one batch.
                _reusable_prompt(mgr, [rng.randrange(1, 30) for _ in range(8)])
                pub.publish()
            if rng.random() < 0.02:
                mgr.clear_reusable_blocks()
            receive(0)  # keep up, as a router does
        pub.publish()  # uninterrupted: whatever a cut left goes out now
        receive()
        told = {(h, g, a.medium) for (h, g), a in pub._translator.announced.items()}
        assert view == told, f"the router holds {len(view - told)} blocks it was never told and misses {len(told - view)}"
        assert seqs == list(range(len(seqs))), "a batch was missed or applied twice"
        assert len(seqs) >= 10
    finally:
        sub.close()
        pub.close()


def _events_workload(mgr, rounds: int):
    """Commits and closes that store and remove blocks: events every round."""
    for r in range(rounds):
        kv = mgr.create_kv_cache(list(range(r, r + 3 * T)))
        assert kv.resume() and kv.resize(6 * T)
        kv.commit(list(range(500 + 10 * r, 500 + 10 * r + 6 * T - kv.num_committed_tokens)))
        kv.close(evict_first=r % 2 == 1)
        yield


def test_events_drained_under_interrupts_arrive_once_each_in_order():
    """``get_latest_events`` interrupted at every line of its way (the flush
    into the queue, the drain, the return through the guard): every event
    reaches the caller exactly once, in order, as without interrupts."""
    def manager():
        return make_manager("cpu", tokens_per_block=T, layers=[Attention()], pages_per_life_cycle=16,
                            max_kv_event_entries=10_000)

    twin, mgr = manager(), manager()
    want = []
    for _ in _events_workload(twin, 12):
        want.extend(e.event_id for e in twin.get_latest_events())
    got, interrupted = [], 0
    k = 1
    for _ in _events_workload(mgr, 12):
        while True:  # interrupt this drain at line k, k + 1, ... until one runs through
            events, fired = run_interrupted_at_line(k, mgr.get_latest_events)
            if fired:
                interrupted += 1
                k += 1
                assert events is None  # an interrupted drain hands over nothing
                continue
            got.extend(e.event_id for e in events)
            k = 1 + k // 2  # the next round sweeps again from before the middle
            break
    assert interrupted > 20
    assert got == want and len(want) > 12

"""``gpukv.zmq_events``: the payload, the wire frames, the replay protocol and
bad input, without a router.

The payload is decoded with msgspec structs shaped like vLLM's own event
classes (``vllm/distributed/kv_events.py``: the same names, fields, required
fields, tags and array layout), so a batch that decodes here decodes in vLLM
and in every consumer of its format. Runs on the cpu backend."""

from __future__ import annotations

import time

import pytest

zmq = pytest.importorskip("zmq", reason="pyzmq is not installed (pip install 'gpukv[events]')")
msgspec = pytest.importorskip("msgspec", reason="msgspec is not installed (pip install 'gpukv[events]')")

import gpukv  # noqa: E402
from gpukv import Attention, ReuseScope, Ssm  # noqa: E402
from gpukv.core.hashing import sequence_to_blockchain_keys  # noqa: E402
from gpukv.zmq_events import END_SEQ, ZmqEventPublisher, router_lora_name  # noqa: E402
from tests.support.backends import make_manager  # noqa: E402


# -- vLLM's event structs, by shape ---------------------------------------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # required, like medium and lora_name: vLLM rejects a batch without them
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
T = 4


# -- helpers ----------------------------------------------------------------------------------------
def manager(**config):
    config.setdefault("layers", [Attention()])
    config.setdefault("pages_per_life_cycle", 64)
    return make_manager("cpu", tokens_per_block=T, max_kv_event_entries=1 << 20, event_hash="sha256_64", **config)


def commit(mgr, tokens, scope=None, history=None):
    kv = mgr.create_kv_cache(input_tokens=tokens[:-1], scope=scope)
    n = kv.num_committed_tokens
    assert kv.resume()
    assert kv.resize(len(tokens), history)
    kv.commit(tokens[n:])
    kv.close()


def hashes(tokens, scope=None):
    """The 64-bit event hashes of ``tokens``' full blocks."""
    keys = [k for _, k in sequence_to_blockchain_keys(T, scope, tokens)][1:]
    return [int.from_bytes(k[:8], "big") for k in keys][: len(tokens) // T]


class Subscriber:
    """A SUB socket on a publisher, decoding each batch with vLLM's structs."""

    def __init__(self, pub: ZmqEventPublisher, topic: bytes = b""):
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(pub.endpoint)
        assert pub.wait_for_subscriber(5.0)

    def recv(self, timeout_ms=5000):
        assert self.sock.poll(timeout_ms), "no batch arrived"
        topic, seq, payload = self.sock.recv_multipart()
        return topic, int.from_bytes(seq, "big"), DECODER.decode(payload)

    def close(self):
        self.sock.close()


@pytest.fixture
def pub_sub():
    made = []

    def make(mgr, **kw):
        kw.setdefault("endpoint", "tcp://127.0.0.1:0")
        pub = ZmqEventPublisher(mgr, **kw)
        sub = Subscriber(pub)
        made.append((pub, sub))
        return pub, sub

    yield make
    for pub, sub in made:
        sub.close()
        pub.close()


# -- the payload --------------------------------------------------------------------------------------
def test_a_commit_round_trips_through_vllm_structs(pub_sub):
    mgr = manager()
    pub, sub = pub_sub(mgr, topic="kv", data_parallel_rank=3)
    sub.sock.setsockopt(zmq.SUBSCRIBE, b"kv")
    tokens = list(range(10, 20))  # two full blocks and a partial one
    commit(mgr, tokens)
    before = time.time()
    assert pub.publish() == 0
    topic, seq, batch = sub.recv()
    assert (topic, seq, batch.data_parallel_rank) == (b"kv", 0, 3)
    assert before - 1 <= batch.ts <= time.time()
    (stored,) = batch.events
    assert stored == BlockStored(
        block_hashes=hashes(tokens), parent_block_hash=None, token_ids=tokens[:8], block_size=T,
        lora_id=None, medium="GPU", lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention",
    )
    assert pub.publish() is None  # nothing new: nothing sent
    commit(mgr, tokens + [7, 7])  # the third block fills up
    assert pub.publish() == 1
    _, seq, batch = sub.recv()
    assert seq == 1
    (stored,) = batch.events
    assert stored.parent_block_hash == hashes(tokens)[-1]
    assert stored.block_hashes == hashes(tokens + [7, 7])[2:] and stored.token_ids == [18, 19, 7, 7]


def test_the_partial_tail_is_never_announced(pub_sub):
    mgr = manager()
    pub, sub = pub_sub(mgr)
    commit(mgr, [1, 2, 3])  # one partial block: gpukv announces it, a router could not use it
    assert pub.publish() is None
    commit(mgr, [1, 2, 3, 4, 5])
    pub.publish()
    (stored,) = sub.recv()[2].events
    assert stored.token_ids == [1, 2, 3, 4] and len(stored.block_hashes) == 1


def test_groups_carry_their_kind_and_window(pub_sub):
    # Group 0 is the sliding window here: the kind must always be sent.
    mgr = manager(layers=[Attention(window=8), Attention(), Ssm()], commit_min_snapshot=True)
    pub, sub = pub_sub(mgr)
    tokens = list(range(100, 116))
    commit(mgr, tokens)
    pub.publish()
    events = sub.recv()[2].events
    kinds = {e.group_idx: (e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in events}
    assert kinds[0] == ("sliding_window", 8) and kinds[1] == ("full_attention", None)
    assert kinds.get(2, ("mamba", None)) == ("mamba", None)
    full = [e for e in events if e.group_idx == 1]
    assert [h for e in full for h in e.block_hashes] == hashes(tokens)


def test_scopes_become_lora_id_and_name(pub_sub):
    mgr = manager()
    pub, sub = pub_sub(mgr, lora_names={7: "sql-adapter"})
    for scope in (ReuseScope(lora_id=7), ReuseScope(lora_id=8, salt=11), ReuseScope(salt=5)):
        commit(mgr, [1, 2, 3, 4, 5, 6, 7, 8, 9], scope=scope)
    pub.publish()
    events = sub.recv()[2].events
    assert [(e.lora_id, e.lora_name) for e in events] == [(7, "sql-adapter"), (8, "8#11"), (None, "#5")]
    assert [e.block_hashes for e in events] == [
        hashes(list(range(1, 10)), s) for s in (ReuseScope(lora_id=7), ReuseScope(lora_id=8, salt=11),
                                                ReuseScope(salt=5))]
    assert router_lora_name(None) is None and router_lora_name(ReuseScope()) is None
    assert router_lora_name(ReuseScope(lora_id=2)) == "2"


def test_a_scope_s_deep_blocks_keep_its_name(pub_sub):
    mgr = manager()
    pub, sub = pub_sub(mgr)
    scope = ReuseScope(lora_id=4)
    commit(mgr, list(range(9)), scope=scope)
    pub.publish()
    sub.recv()
    commit(mgr, list(range(13)), scope=scope)  # a continuation: its parent is a deep block
    pub.publish()
    (stored,) = sub.recv()[2].events
    assert (stored.lora_id, stored.lora_name, stored.parent_block_hash) == (4, "4", hashes(list(range(8)), scope)[-1])


def test_eviction_removes_only_what_was_announced(pub_sub):
    mgr = manager(pages_per_life_cycle=4)
    pub, sub = pub_sub(mgr)
    first = list(range(0, 9))  # two full blocks and a partial (announced by gpukv, not to routers)
    commit(mgr, first)
    pub.publish()
    sub.recv()
    commit(mgr, list(range(50, 59)))  # needs the pool: evicts the first request's pages
    pub.publish()
    events = sub.recv()[2].events
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed and set(removed) <= set(hashes(first))
    assert all(e.medium == "GPU" for e in events)


def test_host_tier_moves_are_removed_then_stored(pub_sub):
    mgr = manager(pages_per_life_cycle=3, host_pages_per_life_cycle=8)
    pub, sub = pub_sub(mgr)
    first = list(range(0, 8))
    commit(mgr, first)
    pub.publish()
    sub.recv()
    commit(mgr, list(range(50, 58)))  # the first request's pages migrate to the host tier
    pub.publish()
    events = sub.recv()[2].events
    moved = [(type(e).__name__, e.medium, tuple(e.block_hashes)) for e in events
             if set(e.block_hashes) & set(hashes(first))]
    assert moved, "nothing migrated"
    for (k1, m1, h1), (k2, m2, h2) in zip(moved[::2], moved[1::2]):
        assert (k1, m1, k2, m2) == ("BlockRemoved", "GPU", "BlockStored", "CPU") and h1 == h2
    cpu = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert all(len(e.token_ids) == T * len(e.block_hashes) for e in cpu)


def test_a_clear_is_all_blocks_cleared(pub_sub):
    mgr = manager()
    pub, sub = pub_sub(mgr)
    commit(mgr, list(range(8)))
    mgr.clear_reusable_blocks()
    commit(mgr, list(range(20, 28)))
    pub.publish()
    events = sub.recv()[2].events
    assert [type(e).__name__ for e in events] == ["BlockStored", "AllBlocksCleared", "BlockStored"]
    assert events[2].block_hashes == hashes(list(range(20, 28)))
    mgr.clear_reusable_blocks()
    pub.publish()
    assert [type(e).__name__ for e in sub.recv()[2].events] == ["AllBlocksCleared"]


def test_events_lost_to_the_queue_cap_restart_the_router(pub_sub):
    mgr = make_manager("cpu", tokens_per_block=T, layers=[Attention()], max_kv_event_entries=2, event_hash="sha256_64")
    pub, sub = pub_sub(mgr)
    pub.publish()  # the created event: nothing for a router
    for k in range(4):
        commit(mgr, [k + 1] * 4)  # four stored events: the queue keeps the newest two
    pub.publish()
    events = sub.recv()[2].events
    assert [type(e).__name__ for e in events] == ["AllBlocksCleared", "BlockStored", "BlockStored"]
    assert pub.events_lost == 2


# -- replay -------------------------------------------------------------------------------------------
def replay(pub, start: int):
    req = zmq.Context.instance().socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(pub.replay_endpoint)
    try:
        req.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
        got = []
        while True:
            assert req.poll(5000), "the replay answer stopped before its end marker"
            frames = req.recv_multipart()
            assert frames[0] == b""
            if frames[2] == END_SEQ:
                assert frames[1:] == [b"", END_SEQ, b""]
                return got
            got.append((int.from_bytes(frames[2], "big"), DECODER.decode(frames[3])))
    finally:
        req.close()


def test_replay_sends_the_buffered_batches_then_the_end_marker(pub_sub):
    mgr = manager()
    pub, sub = pub_sub(mgr, replay_endpoint="tcp://127.0.0.1:0", buffer_steps=2)
    for k in range(3):
        commit(mgr, [k + 1] * 4)
        assert pub.publish() == k
    got = replay(pub, 1)
    assert [s for s, _ in got] == [1, 2]
    assert got[0][1].events[0].token_ids == [2] * 4
    # Batch 0 is no longer buffered: the answer starts at the oldest kept,
    # so the requester sees the gap (first number > requested).
    assert [s for s, _ in replay(pub, 0)] == [1, 2]
    assert replay(pub, 5) == []


def test_a_malformed_replay_request_gets_the_end_marker(pub_sub):
    mgr = manager()
    pub, _ = pub_sub(mgr, replay_endpoint="tcp://127.0.0.1:0")
    req = zmq.Context.instance().socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(pub.replay_endpoint)
    req.send_multipart([b"", b"abc"])
    assert req.poll(5000)
    assert req.recv_multipart() == [b"", b"", END_SEQ, b""]
    req.close()


# -- bad input and never blocking -------------------------------------------------------------------
def test_an_endpoint_that_cannot_be_bound_is_a_clear_error():
    mgr = manager()
    with ZmqEventPublisher(mgr, endpoint="tcp://127.0.0.1:0") as taken:
        with pytest.raises(OSError, match=r"cannot bind endpoint 'tcp://127\.0\.0\.1:\d+'"):
            ZmqEventPublisher(mgr, endpoint=taken.endpoint)
        with pytest.raises(OSError, match="cannot bind replay_endpoint"):
            ZmqEventPublisher(mgr, endpoint="tcp://127.0.0.1:0", replay_endpoint=taken.endpoint)
    with pytest.raises(OSError, match="cannot bind endpoint"):
        ZmqEventPublisher(mgr, endpoint="tcp://256.1.1.1:5")


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(endpoint="127.0.0.1:5557"), ValueError, "endpoint must be a ZMQ endpoint"),
        (dict(endpoint=5557), ValueError, "endpoint must be a ZMQ endpoint"),
        (dict(replay_endpoint="localhost"), ValueError, "replay_endpoint must be a ZMQ endpoint"),
        (dict(buffer_steps=0), ValueError, "buffer_steps must be an int >= 1"),
        (dict(data_parallel_rank=-1), ValueError, "data_parallel_rank must be an int >= 0"),
        (dict(topic=b"kv"), TypeError, "topic must be a str"),
        (dict(lora_names={"7": "x"}), TypeError, "lora_names must map int"),
        (dict(lora_names=[1]), TypeError, r"lora_names must map int LoRA ids to str names, got \[1\]"),
        (dict(endpoint="tcp://127.0.0.1:99999"), ValueError, "endpoint must name a tcp port 0..65535"),
        (dict(endpoint="tcp://127.0.0.1:-1"), ValueError, "endpoint must name a tcp port 0..65535"),
        (dict(endpoint="tcp://127.0.0.1:0\x00junk"), ValueError, "endpoint must not contain a NUL"),
        (dict(replay_endpoint="tcp://127.0.0.1:70000"), ValueError, "replay_endpoint must name a tcp port"),
        (dict(data_parallel_rank=2**64), ValueError, "data_parallel_rank must be an int >= 0 and <= 2,147,483,647"),
        (dict(hwm=2**31), ValueError, "hwm must be an int >= 1 and <= 2,147,483,647"),
        (dict(buffer_steps=2**40), ValueError, "buffer_steps must be an int >= 1 and <= 1,000,000"),
        (dict(topic="kv\ud800"), ValueError, "topic must be encodable as UTF-8"),
    ],
)
def test_bad_arguments_are_named(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ZmqEventPublisher(manager(), **{"endpoint": "tcp://127.0.0.1:0", **kwargs})


def test_a_manager_without_events_is_refused():
    with pytest.raises(ValueError, match=r"max_kv_event_entries > 0"):
        ZmqEventPublisher(make_manager("cpu", tokens_per_block=T), endpoint="tcp://127.0.0.1:0")
    with pytest.raises(TypeError, match="gpukv.KVCacheManager"):
        ZmqEventPublisher(object(), endpoint="tcp://127.0.0.1:0")


def test_nobody_subscribing_never_blocks_and_stays_replayable():
    mgr = manager()
    with ZmqEventPublisher(mgr, endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0",
                           buffer_steps=50, hwm=1) as pub:
        assert pub.wait_for_subscriber(0.1) is False
        t0 = time.perf_counter()
        for k in range(200):
            commit(mgr, [k % 1000 + 1] * 4)
            pub.publish()
        assert time.perf_counter() - t0 < 30
        assert [s for s, _ in replay(pub, 0)] == list(range(150, 200))  # the newest buffer_steps


def test_a_closed_publisher_refuses_to_publish():
    pub = ZmqEventPublisher(manager(), endpoint="tcp://127.0.0.1:0")
    pub.close()
    pub.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish()
    with pytest.raises(RuntimeError, match="closed"):
        pub.subscriptions
    with pytest.raises(RuntimeError, match="closed"):
        pub.wait_for_subscriber(0)


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), -1, "1", True])
def test_a_wait_needs_a_finite_timeout(timeout):
    with ZmqEventPublisher(manager(), endpoint="tcp://127.0.0.1:0") as pub:
        with pytest.raises(ValueError, match="timeout must be a finite number of seconds"):
            pub.wait_for_subscriber(timeout)


def test_a_publisher_dropped_without_close_ends_its_thread_and_frees_its_ports():
    import gc
    import threading

    mgr = manager()
    pub = ZmqEventPublisher(mgr, endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    endpoints, thread = (pub.endpoint, pub.replay_endpoint), pub._thread
    assert thread.is_alive()
    del pub
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive() and thread not in threading.enumerate()
    with ZmqEventPublisher(mgr, endpoint=endpoints[0], replay_endpoint=endpoints[1]) as again:  # both free
        assert again.endpoint == endpoints[0]


def test_hex_event_hashes_are_sent_as_their_64_bit_ints(pub_sub):
    mgr = make_manager("cpu", tokens_per_block=T, layers=[Attention()], max_kv_event_entries=100)  # "sha256" hex
    pub, sub = pub_sub(mgr)
    commit(mgr, list(range(8)))
    pub.publish()
    (stored,) = sub.recv()[2].events
    assert stored.block_hashes == hashes(list(range(8)))
    assert gpukv.CacheConfig().event_hash == "sha256"

"""KV cache events over ZMQ, in vLLM's wire format, for cluster routers.

A KV-aware router (NVIDIA Dynamo's, llm-d's, ...) keeps an index of what each
worker has cached, built from the workers' KV cache event streams; they read
the stream vLLM publishes. ``ZmqEventPublisher`` turns a manager's events
(``gpukv.events``) into that stream, so a gpukv engine is routable as it is.

The wire protocol, as vLLM's publisher speaks it:

- a PUB socket sends one message per batch, three frames: the topic, the
  batch's sequence number (8 bytes, big-endian, from 0), and the msgpack
  payload ``[timestamp, [event, ...], data_parallel_rank]``;
- events are maps tagged by ``"type"``: ``BlockStored``, ``BlockRemoved``,
  ``AllBlocksCleared`` (fields in ``_stored``, ``_removed`` below);
- an optional ROUTER socket answers replay requests: a request is
  ``[b"", start sequence number (8 bytes)]`` (a DEALER or REQ client); the
  answer is every buffered batch from that number on, each
  ``[b"", topic, sequence number, payload]``, then the end marker
  ``[b"", b"", -1 (8 bytes, signed), b""]``.

What a router is told (the rules are in ``_Translator``):

- Only full blocks (``tokens_per_block`` tokens) are announced: a router
  hashes a query in whole blocks, and reads an event's tokens in whole
  blocks. In a full-attention group a block is announced only while its
  parent is, so every announced chain hangs from a scope root (window and
  SSM groups keep blocks without their ancestors, and name the parent as
  vLLM does); blocks holding multimodal
  digest tokens are not announced (their tokens have no token id a router
  could hash).
- Life cycle ``g`` is group ``g``, with its kind always sent
  (``full_attention``; ``sliding_window`` with its window; ``mamba``).
- A page moving between the GPU and the host tier is ``BlockRemoved`` on
  one medium and ``BlockStored`` on the other.
- A removal names only hashes announced on that (group, medium), once.
- A tree clear is ``AllBlocksCleared``.
- The scope's LoRA id is ``lora_id``; ``lora_name`` is its name
  (``lora_names``, else the id in decimal). A scope's salt has no field of
  its own in the format, so it is folded into ``lora_name``
  (``router_lora_name``): routers that key their index on ``lora_name``
  (Dynamo does) keep salted namespaces apart, and a query for a salted
  request passes the same name.

Publishing never blocks the scheduler: ``publish()`` encodes on the calling
thread and sends without waiting (a subscriber that lags past the high-water
mark loses messages, which it can replay); a daemon thread serves replay
requests. Every buffer is bounded: ``buffer_steps`` batches for replay, the
sockets' high-water marks, and the translation state, which holds one entry
per announced (block, group) -- at most the pools' pages.

Needs the ``events`` extra: ``pip install 'gpukv[events]'`` (pyzmq, msgspec).

The wire format, what a router is told and the transport are kept in this one
module so that the protocol is read in one place, against vLLM's.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping
from itertools import repeat
from typing import NamedTuple

from .core.config import KIND_FULL, KIND_SSM, KIND_SWA
from .core.scope import ReuseScope
from .event_types import (
    KVCacheCreatedData,
    KVCacheRemovedData,
    KVCacheStoredData,
    KVCacheUpdatedData,
)
from .event_types import stored_columns
from .event_types import token_ids as event_token_ids

try:
    import msgspec
    import zmq
except ImportError as e:  # the optional extra is not installed
    raise ImportError(
        "gpukv.zmq_events needs pyzmq and msgspec: pip install 'gpukv[events]'"
    ) from e

__all__ = [
    "END_SEQ",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "ZmqEventPublisher",
    "router_lora_name",
    "spec_kind",
]

MEDIUM_GPU = "GPU"  # cache level 0
MEDIUM_CPU = "CPU"  # cache level 1, the host tier
_MEDIUMS = (MEDIUM_GPU, MEDIUM_CPU)

# The replay answer's last message carries sequence number -1.
END_SEQ = (-1).to_bytes(8, "big", signed=True)

_KIND_NAMES = {KIND_FULL: "full_attention", KIND_SWA: "sliding_window", KIND_SSM: "mamba"}


def spec_kind(life_cycle) -> tuple[str, int | None]:
    """``(kv_cache_spec_kind, kv_cache_spec_sliding_window)`` of a layer spec
    (``gpukv.Attention`` or ``gpukv.Ssm``), as vLLM names its group kinds."""
    from .core.config import life_cycle_of

    lc = life_cycle_of(life_cycle, 1)
    return _KIND_NAMES[lc.kind], (lc.window if lc.kind == KIND_SWA else None)


def router_lora_name(scope: ReuseScope | None, lora_names: Mapping[int, str] | None = None) -> str | None:
    """The ``lora_name`` the publisher sends for blocks of ``scope``, which is
    also what a router query for that scope must pass.

    None for the default scope. The LoRA adapter's name (``lora_names[id]``,
    else the id in decimal) when only ``lora_id`` is set. With a salt,
    ``"<name>#<salt>"`` (``"#<salt>"`` without a LoRA id), the salt in decimal.
    """
    if scope is None:
        return None
    base = None
    if scope.lora_id is not None:
        base = (lora_names or {}).get(scope.lora_id, str(scope.lora_id))
    if scope.salt is None:
        return base
    return f"{base or ''}#{scope.salt}"


# ---------------------------------------------------------------------------
# gpukv events -> vLLM events
# ---------------------------------------------------------------------------


class _Announced(NamedTuple):
    """What a router was told about one (block, group): enough to announce it
    again on the other medium when its page moves between tiers. (A named
    tuple: one is made per block published.)"""

    parent: int | None
    token_ids: tuple
    lora_id: int | None
    lora_name: str | None
    medium: str


def _int_hash(h) -> int:
    """Event hashes as unsigned 64-bit ints: a ``sha256`` hex key becomes its
    first 8 bytes, big-endian, exactly what ``event_hash="sha256_64"`` gives."""
    return int(h[:16], 16) if isinstance(h, str) else int(h)


class _Translator:
    """Turns a manager's events into vLLM event dicts, keeping per (hash,
    group) what was announced, so that a router is told exactly what it can
    use and never a removal of something it was not told about."""

    def __init__(self, tokens_per_block: int, life_cycles, lora_names: Mapping[int, str] | None):
        self.T = tokens_per_block
        self.kinds = [spec_kind(lc) for lc in life_cycles]
        self.lora_names = dict(lora_names or {})
        self.announced: dict[tuple[int, int], _Announced] = {}

    def clear(self) -> list[dict]:
        self.announced.clear()
        return [{"type": "AllBlocksCleared"}]

    def translate(self, event) -> list[dict]:
        data, group = event.data, event.layer_group_id
        if isinstance(data, KVCacheStoredData):
            return self._stored_chain(data, group)
        if isinstance(data, KVCacheRemovedData):
            return self._removed_hashes([_int_hash(h) for h in data.block_hashes], group)
        if isinstance(data, KVCacheUpdatedData):
            return self._moved(data, group)
        if isinstance(data, KVCacheCreatedData):
            return []  # the format has no such event: a router learns a worker from its registration
        raise TypeError(f"unknown event data {type(data).__name__}")

    # -- stored ------------------------------------------------------------------
    def _stored_chain(self, data: KVCacheStoredData, group: int) -> list[dict]:
        scope = data.scope
        lora_id = None if scope is None else scope.lora_id
        lora_name = router_lora_name(scope, self.lora_names)
        parent = None if data.parent_hash is None else _int_hash(data.parent_hash)
        # Full attention reuses a chain from its root: a block whose parent a
        # router was not told about could never be matched, so it is not
        # announced. A window or SSM group keeps blocks without their
        # ancestors; those go out as vLLM sends them, naming the parent.
        chained = self.kinds[group][0] == "full_attention"
        out: list[dict] = []
        run: list = []  # consecutive blocks on one medium: one BlockStored
        run_parent = parent
        # The blocks' columns, read without making block or token objects the
        # event manager has not made.
        columns = stored_columns(data)
        if columns is None:
            blocks = data.blocks
            columns = ([b.block_hash for b in blocks], list(map(event_token_ids, blocks)), [b.cache_level for b in blocks])
        for block_hash, token_ids, level in zip(*columns):
            if chained and parent is not None and (parent, group) not in self.announced:
                break  # a chain a router could not attach (its parent was not announced here)
            if len(token_ids) != self.T or not all(map(isinstance, token_ids, repeat(int))):
                break  # a partial block (always a chain's last), or multimodal digest tokens
            medium = _MEDIUMS[level] if 0 <= level < len(_MEDIUMS) else None
            if medium is None:
                break
            if run and run[-1][2] != medium:
                out.append(self._stored(run, run_parent, group, lora_id, lora_name))
                run, run_parent = [], parent
            h = _int_hash(block_hash)
            self.announced[(h, group)] = _Announced(parent, token_ids, lora_id, lora_name, medium)
            run.append((h, token_ids, medium))
            parent = h
        if run:
            out.append(self._stored(run, run_parent, group, lora_id, lora_name))
        return out

    def _stored(self, run, parent, group, lora_id, lora_name) -> dict:
        kind, window = self.kinds[group]
        token_ids: list[int] = []
        for _, toks, _ in run:
            token_ids.extend(toks)
        return {
            "type": "BlockStored",
            "block_hashes": [h for h, _, _ in run],
            "parent_block_hash": parent,
            "token_ids": token_ids,
            "block_size": self.T,
            "lora_id": lora_id,
            "medium": run[0][2],
            "lora_name": lora_name,
            "group_idx": group,
            "kv_cache_spec_kind": kind,
            "kv_cache_spec_sliding_window": window,
        }

    # -- removed and moved ---------------------------------------------------------
    def _removed_hashes(self, hashes: list[int], group: int) -> list[dict]:
        out: list[dict] = []
        for h in hashes:
            state = self.announced.pop((h, group), None)
            if state is None:
                continue  # never announced to a router (or already removed)
            if out and out[-1]["medium"] == state.medium:
                out[-1]["block_hashes"].append(h)
            else:
                out.append(_removed([h], state.medium, group))
        return out

    def _moved(self, data: KVCacheUpdatedData, group: int) -> list[dict]:
        diff = data.cache_level
        h = _int_hash(data.block_hash)
        state = self.announced.get((h, group))
        if diff is None or state is None or diff.old_value == diff.new_value:
            return []  # a priority change, or a block a router was never told about
        if not 0 <= diff.new_value < len(_MEDIUMS):
            return self._removed_hashes([h], group)
        medium = _MEDIUMS[diff.new_value]
        self.announced[(h, group)] = _Announced(state.parent, state.token_ids, state.lora_id, state.lora_name, medium)
        stored = self._stored([(h, state.token_ids, medium)], state.parent, group, state.lora_id, state.lora_name)
        return [_removed([h], state.medium, group), stored]


def _removed(hashes: list[int], medium: str, group: int) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "group_idx": group}


# ---------------------------------------------------------------------------
# The publisher
# ---------------------------------------------------------------------------


def _check_endpoint(name: str, endpoint) -> str:
    if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"{name} must be a ZMQ endpoint string (tcp://host:port, ipc://path, inproc://name), "
                         f"got {endpoint!r}")
    if "\x00" in endpoint:  # ZMQ would bind the part before it
        raise ValueError(f"{name} must not contain a NUL character, got {endpoint!r}")
    if endpoint.startswith("tcp://"):
        port = endpoint.rpartition(":")[2]
        # ZMQ wraps a port number past 16 bits instead of refusing it.
        if port != "*" and not (port.isdigit() and port.isascii() and int(port) <= 65535):
            raise ValueError(f"{name} must name a tcp port 0..65535 (or *), got {endpoint!r}")
    return endpoint


def _check_int(name: str, value, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an int >= {lo} and <= {hi:,}, got {value!r}")
    return value


def _bind(sock, name: str, endpoint: str) -> str:
    """Bind ``sock``; the endpoint actually bound (a tcp port 0 becomes the port chosen)."""
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        raise OSError(f"cannot bind {name} {endpoint!r}: {e}") from None
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class ZmqEventPublisher:
    """Publishes a manager's KV cache events over ZMQ in vLLM's wire format.

    ``mgr`` must record events (``CacheConfig(max_kv_event_entries > 0)``);
    the publisher drains them, so nothing else should call
    ``mgr.get_latest_events()``. ``endpoint`` is bound (routers connect to
    it); ``replay_endpoint``, when given, is bound for replay requests.
    ``buffer_steps`` batches are kept for replay. ``lora_names`` maps LoRA
    ids to adapter names (see ``router_lora_name``). ``hwm`` is the PUB
    socket's send high-water mark, in messages.

    Call ``publish()`` once per scheduler iteration, from the manager's
    thread. An endpoint that cannot be bound raises ``OSError`` and leaves
    nothing open.
    """

    def __init__(
        self,
        mgr,
        endpoint: str = "tcp://127.0.0.1:5557",
        topic: str = "",
        data_parallel_rank: int = 0,
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        lora_names: Mapping[int, str] | None = None,
        hwm: int = 100_000,
    ):
        from .manager import KVCacheManager

        if not isinstance(mgr, KVCacheManager):
            raise TypeError(f"mgr must be a gpukv.KVCacheManager, got {type(mgr).__name__}")
        if mgr._events is None:
            raise ValueError("mgr records no KV cache events: create it with CacheConfig(max_kv_event_entries > 0)")
        _check_endpoint("endpoint", endpoint)
        if replay_endpoint is not None:
            _check_endpoint("replay_endpoint", replay_endpoint)
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {type(topic).__name__}")
        try:
            topic_bytes = topic.encode()
        except UnicodeEncodeError as e:
            raise ValueError(f"topic must be encodable as UTF-8, got {topic!r} ({e.reason})") from None
        # Bounds of the wire and the socket options: a rank is a msgpack
        # int, a high-water mark a C int, and the replay socket holds two
        # messages per buffered batch.
        _check_int("data_parallel_rank", data_parallel_rank, 0, 2**31 - 1)
        _check_int("buffer_steps", buffer_steps, 1, 10**6)
        _check_int("hwm", hwm, 1, 2**31 - 1)
        if lora_names is not None and (not isinstance(lora_names, Mapping) or not all(
            isinstance(k, int) and not isinstance(k, bool) and isinstance(v, str) for k, v in lora_names.items()
        )):
            raise TypeError(f"lora_names must map int LoRA ids to str names, got {lora_names!r}")

        self._mgr = mgr
        self._topic = topic_bytes
        self._rank = data_parallel_rank
        self._translator = _Translator(mgr.tokens_per_block, mgr.life_cycles, lora_names)
        self._encoder = msgspec.msgpack.Encoder()
        self._next_event_id: int | None = None
        # A publish cut short (an interrupt) leaves what the next one needs:
        # ``_outbox`` its translated events not yet buffered, as (the sequence
        # number they were to go out under, events); ``_torn`` True while the
        # manager's events are drained and translated (cut there, what the
        # translator was told is no longer what a router was: the next batch
        # starts over); ``_live`` the first buffered sequence number not yet
        # sent.
        self._outbox: tuple | None = None
        self._torn = False
        self._live = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        # Shared with the replay thread without a lock: an append and a
        # ``tuple(buffer)`` are each one step under the GIL (and a lock
        # left held by an exception between its acquiring and the block that
        # releases it would stop both for good).
        self._subscriptions = 0
        self.events_lost = 0  # manager events dropped by its queue cap before a publish
        self._closed = False

        self._ctx = zmq.Context.instance()
        self._pub = self._replay = None
        self._thread = None
        self._stop = threading.Event()
        try:
            # XPUB is PUB on the wire; it also hands us subscriptions, so we
            # know when a router is listening (wait_for_subscriber).
            self._pub = self._ctx.socket(zmq.XPUB)
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self.endpoint = _bind(self._pub, "endpoint", endpoint)
            self.replay_endpoint = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # Room for a whole replay and its end marker per requester.
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = _bind(self._replay, "replay_endpoint", replay_endpoint)
                # The thread is handed what it serves, not the publisher, so a
                # publisher dropped without close() is collected and closed.
                self._thread = threading.Thread(
                    target=_serve_replay, args=(self._replay, self._stop, self._buffer, self._topic),
                    name="gpukv-zmq-replay", daemon=True,
                )
                self._thread.start()
        except BaseException:
            _shut(self._stop, self._thread, self._pub, self._replay)
            raise
        self._finalizer = weakref.finalize(self, _shut, self._stop, self._thread, self._pub, self._replay)

    # -- publishing ------------------------------------------------------------------
    def publish(self) -> int | None:
        """Drain the manager's events and send them as one batch; its sequence
        number, or None when there was nothing a router needs to hear.

        A publish that raises (an interrupt too, wherever it lands) loses
        nothing silently: a batch it buffered goes out with the next publish
        (replayable meanwhile); events it translated go out in the next
        batch; cut short while draining or translating, the next batch starts
        with ``AllBlocksCleared``, so a router's view is never wrong, only
        smaller."""
        self._check_open()
        self._send_unsent()
        seq = self._buffer[-1][0] + 1 if self._buffer else 0
        out: list[dict] = []
        if self._torn:
            out += self._translator.clear()
        elif self._outbox is not None and self._outbox[0] == seq:  # translated, never buffered
            out += self._outbox[1]
        self._torn = True
        ev = self._mgr._events
        events = self._mgr.get_latest_events()
        marks = ev.take_clear_marks()
        if events and self._next_event_id is not None and events[0].event_id != self._next_event_id:
            # The manager's queue cap dropped events: what a router holds can
            # no longer be kept exact, so it starts over from nothing.
            self.events_lost += events[0].event_id - self._next_event_id
            out += self._translator.clear()
        for event in events:
            while marks and marks[0] <= event.event_id:
                marks.pop(0)
                out += self._translator.clear()
            out += self._translator.translate(event)
            self._next_event_id = event.event_id + 1
        if marks:
            out += self._translator.clear()
        self._outbox, self._torn = (seq, out), False  # one step: translated, and kept until buffered
        self._drain_subscriptions()
        if not out:
            return None
        payload = self._encoder.encode([time.time(), out, self._rank])
        self._buffer.append((seq, payload))  # published from here on: sent below or by the next publish
        self._send_unsent()
        return seq

    def _send_unsent(self):
        """Send the buffered batches not sent yet, in order: normally the one
        just buffered; more after a publish was cut short. A batch counts as
        sent before it goes, so one is never sent twice (cut in between, a
        router sees the gap and replays it)."""
        if self._buffer and self._buffer[-1][0] >= self._live:
            for s, payload in [(s, p) for s, p in tuple(self._buffer) if s >= self._live]:
                self._live = s + 1
                try:
                    self._pub.send_multipart((self._topic, s.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass  # a subscriber past its high-water mark: it can replay this batch

    @property
    def subscriptions(self) -> int:
        """Topics routers are subscribed to now (0 while nobody listens; the
        socket reports a topic once, however many routers share it)."""
        self._check_open()
        self._drain_subscriptions()
        return self._subscriptions

    def wait_for_subscriber(self, timeout: float = 5.0) -> bool:
        """Wait up to ``timeout`` seconds until some router subscribes; False
        if none did (publishing works either way: batches nobody hears stay
        replayable)."""
        self._check_open()
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < math.inf:
            raise ValueError(f"timeout must be a finite number of seconds >= 0, got {timeout!r}")
        deadline = time.monotonic() + timeout
        while self.subscriptions == 0:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._pub.poll(min(left, 0.05) * 1000, zmq.POLLIN)
        return True

    def close(self) -> None:
        """Stop the replay thread and close the sockets (idempotent)."""
        self._closed = True
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- internals -----------------------------------------------------------------
    def _check_open(self):
        if self._closed:
            raise RuntimeError("the publisher is closed")

    def _drain_subscriptions(self):
        while True:
            try:
                msg = self._pub.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if msg[:1] == b"\x01":
                self._subscriptions += 1
            elif msg[:1] == b"\x00":
                self._subscriptions = max(0, self._subscriptions - 1)


def _serve_replay(sock, stop, buffer, topic: bytes):
    """The replay thread: answer each request with the buffered batches from
    the asked sequence number on, then the end marker."""
    while not stop.is_set():
        try:
            if not sock.poll(50, zmq.POLLIN):
                continue
            frames = sock.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            return  # the socket was closed under us: shutting down
        client = frames[0]
        if len(frames) != 3 or len(frames[2]) != 8:
            _send_replay(sock, client, (b"", END_SEQ, b""))  # malformed: answered with the end marker alone
            continue
        start = int.from_bytes(frames[2], "big", signed=True)
        batches = [(s, p) for s, p in tuple(buffer) if s >= start]
        for s, p in batches:
            _send_replay(sock, client, (topic, s.to_bytes(8, "big"), p))
        _send_replay(sock, client, (b"", END_SEQ, b""))


def _send_replay(sock, client: bytes, frames):
    try:
        sock.send_multipart((client, b"", *frames), flags=zmq.NOBLOCK)
    except zmq.ZMQError:
        pass  # the requester went away or stopped reading: it asks again


def _shut(stop, thread, *sockets):
    """Stop the replay thread and close the sockets (once, by ``close()`` or
    when the publisher is collected)."""
    stop.set()
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=2.0)
    for sock in sockets:
        if sock is not None:
            sock.close(linger=0)

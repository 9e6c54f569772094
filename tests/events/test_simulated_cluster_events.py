"""``gpukv simulate --workers N`` and ``--kv-events ENDPOINT``: a simulated
cluster whose workers publish their KV events, fed to a subscriber and to
the real router (Dynamo's indexer, skipped when it is not installed)."""

from __future__ import annotations

import json

import pytest

from gpukv import cli
from gpukv.sim.cluster import Cluster, offset_endpoint, run_cluster
from gpukv.sim.simulate import SimOptions
from gpukv.sim.workload import default_workload
from tests.support.dynamo_indexer import DynamoIndexer, free_port, needs_dynamo

T = 16
SMALL = ["--conversations", "8", "--duration", "5", "--tokens-per-block", str(T), "--backend", "cpu",
         "--no-progress", "--json"]


def two_free_ports() -> int:
    """A port P with P + 1 free too (worker i publishes on P + i)."""
    import socket

    for _ in range(50):
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise RuntimeError("no two consecutive free ports")


def test_workers_split_the_workload(capsys):
    assert cli.main(["simulate", "--workers", "3", "--model", "attention", *SMALL]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["workers"] == 3 and s["finished"] == s["requests"] > 0
    assert sum(s["requests_per_worker"]) == s["requests"]
    assert sum(1 for n in s["requests_per_worker"] if n) >= 2
    assert s["reused_tokens"] > 0  # follow-up turns reuse on the worker their conversation went to


def test_a_conversation_stays_on_its_worker():
    w = default_workload(10, seed=2, tokens_per_block=T, duration_s=5.0)
    cluster = Cluster(w, SimOptions(model="attention", tokens_per_block=T, backend="cpu"), 2)
    cluster.run()
    for worker in cluster.workers:
        assert worker.stats.finished + worker.stats.rejected == worker.total > 0
    assert sorted(cluster.worker_of) == [r.rid for r in w.requests]
    follow_ups = [r for r in w.requests if r.after is not None]
    assert follow_ups
    for r in follow_ups:
        assert cluster.worker_of[r.rid] == cluster.worker_of[r.after]


def test_offset_endpoints():
    assert offset_endpoint("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert offset_endpoint("tcp://127.0.0.1:5557", 2) == "tcp://127.0.0.1:5559"
    assert offset_endpoint("tcp://127.0.0.1:0", 2) == "tcp://127.0.0.1:0"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv-1"
    with pytest.raises(ValueError, match="needs a port"):
        offset_endpoint("tcp://127.0.0.1", 1)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--workers", "0"], "--workers must be >= 1"),
        (["--kv-events-replay", "tcp://127.0.0.1:5999"], "--kv-events-replay needs --kv-events"),
        (["--kv-events", "tcp://127.0.0.1:5999", "--compare"], "--compare runs twice"),
        (["--kv-events", "tcp://127.0.0.1:5999", "--kv-events-wait", "-1"], "--kv-events-wait must be >= 0"),
        (["--kv-events", "127.0.0.1:5999"], "endpoint must be a ZMQ endpoint"),
    ],
)
def test_bad_cluster_arguments_are_named(argv, message, capsys):
    pytest.importorskip("zmq")
    pytest.importorskip("msgspec")
    assert cli.main(["simulate", *argv, *SMALL]) == 2
    assert message in capsys.readouterr().err


def test_a_taken_port_is_a_clear_error(capsys):
    zmq = pytest.importorskip("zmq")
    pytest.importorskip("msgspec")
    sock = zmq.Context.instance().socket(zmq.PUB)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        assert cli.main(["simulate", "--kv-events", f"tcp://127.0.0.1:{port}", *SMALL]) == 2
        assert f"cannot bind endpoint 'tcp://127.0.0.1:{port}'" in capsys.readouterr().err
    finally:
        sock.close(linger=0)


def test_kv_events_reach_a_subscriber_on_every_worker(capsys):
    zmq = pytest.importorskip("zmq")
    msgspec = pytest.importorskip("msgspec")
    port = two_free_ports()
    subs = []
    for i in range(2):
        s = zmq.Context.instance().socket(zmq.SUB)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{port + i}")  # before the publisher binds: ZMQ reconnects
        subs.append(s)
    try:
        argv = ["simulate", "--workers", "2", "--kv-events", f"tcp://127.0.0.1:{port}", "--kv-events-wait", "20",
                *SMALL]
        assert cli.main(argv) == 0
        out = capsys.readouterr()
        assert f"worker 2: KV events on tcp://127.0.0.1:{port + 1}" in out.err
        assert "2 of 2 workers have a subscriber" in out.err
        s = json.loads(out.out)
        assert s["kv_event_batches"] > 0
        decoder = msgspec.msgpack.Decoder()
        for i, sub in enumerate(subs):
            kinds = set()
            while sub.poll(200):
                _, seq, payload = sub.recv_multipart()
                ts, events, rank = decoder.decode(payload)
                kinds |= {(e["type"], e.get("kv_cache_spec_kind")) for e in events}
            if s["requests_per_worker"][i]:
                assert ("BlockStored", "full_attention") in kinds  # the hybrid model's three groups
                assert ("BlockStored", "sliding_window") in kinds
    finally:
        for sub in subs:
            sub.close()


@needs_dynamo()
def test_a_simulated_cluster_feeds_the_real_router():
    """The main job's setup: a router subscribed to every worker, then the
    simulation. Afterwards the router's score of each worker for each
    request's prompt is what that worker would reuse, in whole blocks."""
    port = two_free_ports()
    endpoints = {i + 1: f"tcp://127.0.0.1:{port + i}" for i in range(2)}
    w = default_workload(8, seed=5, tokens_per_block=T, duration_s=5.0)
    prompts = [r.make_tokens()[: r.prompt_len].tolist() for r in w.requests]
    options = SimOptions(model="attention", tokens_per_block=T, backend="cpu", kv_events=True)
    with DynamoIndexer(T, endpoints) as idx:
        import io

        cluster, summary = run_cluster(w, options, 2, f"tcp://127.0.0.1:{port}", wait_s=20.0, out=io.StringIO())
        assert summary["finished"] == summary["requests"]
        import time

        deadline = time.monotonic() + 10
        while True:
            diff = []
            for p in prompts:
                want = {i + 1: wk.mgr.probe_reuse(p) // T * T for i, wk in enumerate(cluster.workers)}
                want = {k: v for k, v in want.items() if v}
                if idx.scores(p) != want:
                    diff.append((want, idx.scores(p)))
            if not diff or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert not diff, diff[:3]
        assert any(idx.scores(p) for p in prompts)

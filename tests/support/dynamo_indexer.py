"""NVIDIA Dynamo's standalone KV indexer, run as a subprocess for tests.

``python -m dynamo.indexer`` (package ``ai-dynamo-runtime``) subscribes to
workers' ZMQ KV event streams in vLLM's format and answers overlap queries
over HTTP on loopback. ``DynamoIndexer`` starts one, waits (time-boxed) until
its HTTP server and every worker's listener are up, and wraps the calls the
tests make: ``POST /query``, ``GET /dump``, ``GET /workers``, ``POST /register``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

START_TIMEOUT_S = 30.0  # the indexer is up in well under a second when it works at all


def dynamo_missing_reason() -> str | None:
    """Why the real indexer cannot run here, or None when it can."""
    if importlib.util.find_spec("dynamo") is None or importlib.util.find_spec("dynamo.indexer") is None:
        return "ai-dynamo-runtime is not installed (pip install 'ai-dynamo-runtime==1.6.1')"
    for mod in ("zmq", "msgspec"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed (pip install 'gpukv[events]')"
    return None


def needs_dynamo():
    """A mark for tests of the real router: skipped, with the reason, when it
    cannot run here, unless ``GPUKV_REQUIRE_DYNAMO=1`` (CI sets it): then
    they run and fail, so a broken install cannot pass as a skip."""
    import pytest

    reason = dynamo_missing_reason()
    if reason is None or os.environ.get("GPUKV_REQUIRE_DYNAMO") == "1":
        return pytest.mark.skipif(False, reason="")  # runs
    return pytest.mark.skip(reason=reason)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DynamoIndexer:
    """One indexer process. ``workers`` maps worker ids to the ZMQ endpoints
    they publish on (registered at start with ``--workers``)."""

    def __init__(self, block_size: int, workers: dict[int, str] | None = None, model: str = "m"):
        self.block_size = block_size
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "dynamo.indexer", "--block-size", str(block_size), "--port", str(self.port),
                "--model-name", model, "--threads", "1"]
        if workers:
            args += ["--workers", ",".join(f"{w}={ep}" for w, ep in workers.items())]
        self._log = tempfile.TemporaryFile()
        env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_ready(set(workers or ()))
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, workers: set):
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dynamo.indexer exited with code {self.proc.returncode}:\n{self.log()}")
            try:
                listed = self.workers()
                active = {w["instance_id"] for w in listed
                          if all(li.get("status") == "active" for li in w.get("listeners", {}).values())}
                if workers <= active:
                    return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"dynamo.indexer was not ready within {START_TIMEOUT_S:g} s:\n{self.log()}")
            time.sleep(0.05)

    # -- HTTP ------------------------------------------------------------------------
    def _call(self, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            text = r.read().decode()
        return json.loads(text) if text else None

    def workers(self) -> list:
        return self._call("/workers")

    def register(self, worker_id: int, endpoint: str, replay_endpoint: str | None = None):
        body = {"instance_id": worker_id, "endpoint": endpoint, "model_name": self.model,
                "block_size": self.block_size}
        if replay_endpoint is not None:
            body["replay_endpoint"] = replay_endpoint
        return self._call("/register", body)

    def query(self, tokens, lora_name: str | None = None) -> dict:
        """The raw /query answer for a token list."""
        body = {"token_ids": [int(t) for t in tokens], "model_name": self.model}
        if lora_name is not None:
            body["lora_name"] = lora_name
        return self._call("/query", body)

    def scores(self, tokens, lora_name: str | None = None) -> dict[int, int]:
        """Per worker (data parallel rank 0), the matched tokens on the GPU
        tier: the score a KV router routes by. Workers without a match are 0."""
        out = {}
        for w, ranks in self.query(tokens, lora_name)["scores"].items():
            out[int(w)] = int(ranks.get("0", 0))
        return out

    def dump(self) -> list:
        """The indexer's events as it holds them (every model)."""
        return [e for v in self._call("/dump").values() for e in v["events"]]

    # -- lifetime ----------------------------------------------------------------------
    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

"""gpukv workers routed by the real router: NVIDIA Dynamo's standalone KV indexer.

Each test starts ``python -m dynamo.indexer`` (``tests/support/dynamo_indexer.py``;
skipped, with the reason, when ``ai-dynamo-runtime`` is not installed),
drives several managers, each publishing its events with a
``ZmqEventPublisher``, and holds the indexer's per-worker overlap scores
against gpukv's own answer: for every query, Dynamo's score of a worker is
that worker's full-attention reuse of the query, floored to whole blocks.
The indexer applies events asynchronously, so each comparison is retried
for a few seconds before it fails (with the last difference).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.support.dynamo_indexer import DynamoIndexer, dynamo_missing_reason, free_port, needs_dynamo

pytestmark = needs_dynamo()

if dynamo_missing_reason() is None:
    from gpukv import Attention, ReuseScope, Ssm
    from gpukv.core.hashing import sequence_to_blockchain_keys
    from gpukv.zmq_events import ZmqEventPublisher, router_lora_name
    from tests.support.backends import make_manager
    from tests.support.event_checks import tree_blocks

T = 4
SETTLE_S = 10.0  # how long the indexer may take to apply what was published


def manager(**config):
    config.setdefault("layers", [Attention()])
    config.setdefault("pages_per_life_cycle", 24)
    return make_manager("cpu", tokens_per_block=T, max_kv_event_entries=1 << 20, event_hash="sha256_64", **config)


def commit(mgr, tokens, scope=None):
    """One request: reuse what is cached, compute and commit the rest, close."""
    kv = mgr.create_kv_cache(input_tokens=tokens[:-1], scope=scope)
    n = kv.num_committed_tokens
    assert kv.resume() and kv.resize(len(tokens))
    kv.commit(list(tokens[n:]))
    kv.close()


def full_attention_reuse(mgr, tokens, lc: int = 0) -> int:
    """What life cycle ``lc`` (full attention) alone would let ``mgr`` reuse
    of ``tokens``, in whole blocks: the leading blocks in the tree whose page
    in ``lc`` covers the block. The other life cycles' pruning is left out."""
    tree = tree_blocks(mgr)
    n = 0
    for _, key in list(sequence_to_blockchain_keys(T, None, tokens))[1:]:
        block = tree.get(key)
        if block is None or len(block.tokens) != T or not block.covers(lc):
            break
        n += T
    return n


def tcp() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


class Workers:
    """Managers numbered 1..n, each with a publisher."""

    def __init__(self, managers: dict, replay: bool = False):
        self.mgrs = managers
        self.pubs = {w: ZmqEventPublisher(m, tcp(), replay_endpoint=tcp() if replay else None)
                     for w, m in managers.items()}

    def endpoints(self) -> dict:
        return {w: p.endpoint for w, p in self.pubs.items()}

    def publish(self):
        for p in self.pubs.values():
            p.publish()

    def expected(self, tokens, scope=None) -> dict:
        """gpukv's answer: each worker's reuse of ``tokens`` floored to whole blocks (0s left out)."""
        out = {w: m.probe_reuse(tokens, scope) // T * T for w, m in self.mgrs.items()}
        return {w: n for w, n in out.items() if n}

    def close(self):
        for p in self.pubs.values():
            p.close()


@pytest.fixture
def workers():
    made = []

    def make(managers, replay=False):
        made.append(Workers(managers, replay))
        return made[-1]

    yield make
    for w in made:
        w.close()


def settled(idx: DynamoIndexer, queries, expected_of, lora_name=None, timeout=SETTLE_S):
    """Assert that the indexer's scores equal ``expected_of(q)`` for every
    query, retrying until ``timeout`` while the indexer catches up."""
    deadline = time.monotonic() + timeout
    while True:
        diff = []
        for q in queries:
            want, got = expected_of(q), idx.scores(q, lora_name)
            if want != got:
                diff.append((len(q), want, got))
        if not diff:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(diff)} of {len(queries)} queries differ (query length, gpukv, Dynamo): "
                                 f"{diff[:5]}\nindexer log:\n{idx.log()}")
        time.sleep(0.05)


def test_router_scores_equal_gpukv_reuse_through_commits_eviction_and_a_clear(workers):
    """Three workers with small pools take a stream of requests sharing a few
    system prompts; after every few requests, Dynamo's score of each worker
    for each query (the prompts seen, their prefixes, and unseen prompts)
    equals what that worker would reuse, in whole blocks. Then a worker is
    cleared and scores 0 everywhere, and the others are unchanged."""
    ws = workers({1: manager(), 2: manager(), 3: manager(pages_per_life_cycle=40)})
    rng = np.random.default_rng(7)
    systems = [rng.integers(0, 5000, int(n)).tolist() for n in (8, 13, 20, 6)]
    with DynamoIndexer(T, ws.endpoints()) as idx:
        assert all(p.wait_for_subscriber(10.0) for p in ws.pubs.values())
        seen = []
        for i in range(48):
            prompt = systems[i % len(systems)] + rng.integers(0, 5000, int(rng.integers(1, 14))).tolist()
            commit(ws.mgrs[int(rng.integers(1, 4))], prompt)
            seen.append(prompt)
            if i % 8 == 7:
                ws.publish()
                queries = seen[-12:] + [p[: int(rng.integers(1, len(p) + 1))] for p in seen[-12:]] + systems
                queries.append(rng.integers(0, 5000, 17).tolist())
                settled(idx, queries, ws.expected)
        evictions = sum(m.get_and_reset_eviction_stats()["evicted"] for m in ws.mgrs.values())
        assert evictions > 0, "the pools were never under pressure"
        before = {tuple(q): ws.expected(q) for q in seen}
        assert any(1 in v for v in before.values())
        ws.mgrs[1].clear_reusable_blocks()
        ws.publish()
        settled(idx, seen, ws.expected)
        for q in seen:
            assert 1 not in idx.scores(q)
            assert idx.scores(q) == {w: n for w, n in before[tuple(q)].items() if w != 1}


def test_lora_scopes_are_routed_apart(workers):
    ws = workers({1: manager(), 2: manager()})
    lora, salted = ReuseScope(lora_id=3), ReuseScope(lora_id=3, salt=99)
    prompt = list(range(100, 117))
    with DynamoIndexer(T, ws.endpoints()) as idx:
        assert all(p.wait_for_subscriber(10.0) for p in ws.pubs.values())
        commit(ws.mgrs[1], prompt, scope=lora)
        commit(ws.mgrs[2], prompt, scope=salted)
        commit(ws.mgrs[2], prompt[:9])
        ws.publish()
        for scope in (None, lora, salted):
            settled(idx, [prompt, prompt[:10]], lambda q, s=scope: ws.expected(q, s), lora_name=router_lora_name(scope))
        assert idx.scores(prompt, "3") == {1: 16}
        assert idx.scores(prompt, "3#99") == {2: 16}
        assert idx.scores(prompt) == {2: 8}


def test_replay_refills_a_router_that_joined_late(workers):
    ws = workers({1: manager(), 2: manager()}, replay=True)
    late = ws.pubs[2]
    with DynamoIndexer(T, {1: ws.pubs[1].endpoint}) as idx:
        prompts = [list(range(k, k + 10)) for k in (0, 300, 600)]
        for p in prompts:
            commit(ws.mgrs[2], p)
            late.publish()  # nobody listens to worker 2 yet: batches 0..2 are only buffered
        commit(ws.mgrs[1], prompts[0])
        ws.pubs[1].publish()
        settled(idx, prompts, lambda q: {w: n for w, n in ws.expected(q).items() if w == 1})
        idx.register(2, late.endpoint, late.replay_endpoint)
        assert late.wait_for_subscriber(10.0)
        time.sleep(0.2)  # the subscription reaches the socket before the next batch
        commit(ws.mgrs[2], list(range(900, 912)))
        assert late.publish() == 3  # the router sees 3, asks for 0.. and gets everything
        settled(idx, prompts + [list(range(900, 912))], ws.expected)


def test_host_tier_blocks_count_on_their_tier(workers):
    """A page that migrates to the host tier leaves the GPU tier's score and
    stays in the indexer's all-tier match, which equals gpukv's reuse (the
    page comes back on resume)."""
    ws = workers({1: manager(pages_per_life_cycle=3, host_pages_per_life_cycle=8)})
    first = list(range(8))
    with DynamoIndexer(T, ws.endpoints()) as idx:
        assert ws.pubs[1].wait_for_subscriber(10.0)
        commit(ws.mgrs[1], first)
        ws.publish()
        settled(idx, [first], ws.expected)
        commit(ws.mgrs[1], list(range(50, 58)))  # migrates some of the first request's pages
        ws.publish()
        assert ws.mgrs[1].get_and_reset_eviction_stats()["migrated"] > 0
        reuse = ws.mgrs[1].probe_reuse(first) // T * T
        assert reuse == 8
        # A migration is a removal from the GPU tier and a store on the host
        # tier, two events the indexer applies in turn: wait for both.
        deadline = time.monotonic() + SETTLE_S
        while True:
            inst = idx.query(first)["instances"].get("1", {})
            if (inst.get("gpu", 0) < 8 and inst.get("longest_matched") == reuse) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert inst["gpu"] < 8
        assert inst["longest_matched"] == reuse


def test_hybrid_models_are_over_predicted(workers):
    """On full attention + SWA + SSM, Dynamo scores the full-attention group
    alone: its score is exactly what full attention would allow, never below
    what gpukv reuses, and above it where the window or the SSM checkpoint
    prune the match."""
    layers = [Attention(), Attention(window=8), Ssm()]
    ws = workers({1: manager(layers=layers, commit_min_snapshot=True, pages_per_life_cycle=64),
                  2: manager(layers=layers, commit_min_snapshot=True, pages_per_life_cycle=64)})
    rng = np.random.default_rng(3)
    system = rng.integers(0, 5000, 16).tolist()
    with DynamoIndexer(T, ws.endpoints()) as idx:
        assert all(p.wait_for_subscriber(10.0) for p in ws.pubs.values())
        queries = []
        for i in range(12):
            prompt = system + rng.integers(0, 5000, int(rng.integers(3, 20))).tolist()
            commit(ws.mgrs[1 + i % 2], prompt)
            queries += [prompt + [1, 2, 3], prompt[: int(rng.integers(4, len(prompt)))]]
        ws.publish()

        def full_attention(q):
            out = {w: full_attention_reuse(m, q) for w, m in ws.mgrs.items()}
            return {w: n for w, n in out.items() if n}

        settled(idx, queries, full_attention)
        over = []
        for q in queries:
            for w, m in ws.mgrs.items():
                actual = m.probe_reuse(q)
                predicted = idx.scores(q).get(w, 0)
                assert predicted >= actual // T * T
                over.append(predicted - actual)
        assert max(over) > 0, "the window and the SSM checkpoint never pruned a match"

"""How far a KV router's score is from what a hybrid model actually reuses.

Runs ``gpukv simulate``'s cluster (``--workers``) on the hybrid model (full
attention + sliding window + SSM), every worker publishing its KV events to
a real router, NVIDIA Dynamo's standalone indexer. At each routing decision
(a conversation's first turn arriving) it asks the router for its per-worker
overlap scores and compares them with what each worker would really reuse
(``probe_reuse``: the window and the SSM checkpoint pruned in). Prints one
JSON summary.

    python -m bench.tools.router_overprediction [--conversations N] [--workers N] [--window W]

Needs ``pip install 'gpukv[events]' ai-dynamo-runtime==1.6.1``.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from gpukv.sim.cluster import Cluster, ClusterPublishers
from gpukv.sim.simulate import SimOptions, warm_up
from gpukv.sim.workload import default_workload
from tests.support.dynamo_indexer import DynamoIndexer


class MeasuredCluster(Cluster):
    """Routes as the cluster does, recording the router's and gpukv's view of every decision."""

    def __init__(self, *a, indexer: DynamoIndexer, **kw):
        super().__init__(*a, **kw)
        self.indexer = indexer
        self.decisions: list[tuple[list[int], list[int]]] = []  # (router scores, actual reuse) per worker

    def _pick(self, r) -> int:
        lookup = r.make_tokens()[: r.lookup_len()]
        scores = self.indexer.scores(lookup.tolist())
        predicted = [scores.get(i + 1, 0) for i in range(len(self.workers))]
        actual = [int(w.mgr.probe_reuse(lookup)) for w in self.workers]
        self.decisions.append((predicted, actual))
        return super()._pick(r)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=60)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tokens-per-block", type=int, default=32)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    T = args.tokens_per_block
    options = SimOptions(model="hybrid", tokens_per_block=T, window=args.window, backend="cpu", kv_events=True)
    warm_up(SimOptions(model="hybrid", tokens_per_block=T, window=args.window, backend="cpu"))
    w = default_workload(args.conversations, seed=args.seed, tokens_per_block=T, duration_s=30.0)
    # The publishers bind first (ports chosen by the OS), then the router subscribes to them.
    cluster = MeasuredCluster(w, options, args.workers, indexer=None)
    pubs = ClusterPublishers(cluster, "tcp://127.0.0.1:0")

    def publish_and_settle(c):
        pubs(c)
        time.sleep(0.005)  # lets the router apply the step's batches before the next routing decision

    cluster.on_step = publish_and_settle
    try:
        with DynamoIndexer(T, {i + 1: p.endpoint for i, p in enumerate(pubs.publishers)}) as idx:
            cluster.indexer = idx
            assert pubs.wait_for_subscribers(20.0) == args.workers, "the router did not subscribe"
            t0 = time.perf_counter()
            cluster.run()
            wall = time.perf_counter() - t0
    finally:
        pubs.close()
    pred = np.array([p for p, _ in cluster.decisions], dtype=np.int64)
    act = np.array([a for _, a in cluster.decisions], dtype=np.int64)
    act_blocks = act // T * T
    chosen_pred = pred.argmax(axis=1)
    chosen_act = act.argmax(axis=1)
    any_pred = pred.max(axis=1) > 0
    out = {
        "workload": w.description,
        "workers": args.workers,
        "window": args.window,
        "tokens_per_block": T,
        "routing_decisions": len(pred),
        "decisions_with_a_router_match": int(any_pred.sum()),
        "router_predicted_tokens": int(pred.sum()),
        "actually_reusable_tokens": int(act.sum()),
        "over_prediction": float(pred.sum() / max(act.sum(), 1)),
        "pairs_over_predicted": float(np.mean(pred > act_blocks)) if pred.size else 0.0,
        "pairs_under_predicted": float(np.mean(pred < act_blocks)) if pred.size else 0.0,
        "mean_over_prediction_tokens_where_matched": float((pred - act)[pred > 0].mean()) if (pred > 0).any() else 0.0,
        "decisions_where_router_best_is_not_best": int(np.sum(
            any_pred & (act[np.arange(len(act)), chosen_pred] < act.max(axis=1)))),
        "chosen_differs": int(np.sum(any_pred & (chosen_pred != chosen_act))),
        "wall_s": wall,
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

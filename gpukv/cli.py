"""The ``gpukv`` command.

- ``gpukv match`` (the default): replay a workload (built-in synthetic chats,
  or a Mooncake trace) the way a scheduler uses the index: each step matches a
  whole batch of arriving requests in one ``match_batch`` call, then records
  the finished prompts in the tree. Reports hit rates (and how much came from
  partial rewind endpoints) and match latency and throughput.
- ``gpukv info``: the backend, library versions and a default manager's config.
"""

from __future__ import annotations

import argparse
import sys


def _versions() -> dict:
    import numpy

    out = {"numpy": numpy.__version__}
    for name in ("numba", "numba_cuda", "cupy"):
        try:
            mod = __import__(name)
            out[name] = getattr(mod, "__version__", "?")
        except Exception as e:  # a missing or broken optional GPU stack is reported, not fatal
            out[name] = f"unavailable ({type(e).__name__})"
    return out


def cmd_info(args) -> int:
    import gpukv

    config = gpukv.CacheConfig(backend=args.backend)
    mgr = gpukv.KVCacheManager(config)
    print(f"gpukv {gpukv.__version__}")
    print(f"backend: {mgr.backend}")
    for name, v in _versions().items():
        print(f"{name}: {v}")
    print("default config:")
    for field in ("tokens_per_block", "layers", "pages_per_life_cycle", "page_bytes", "enable_partial_reuse",
                  "commit_min_snapshot", "reuse_match_backoff", "max_kv_event_entries"):
        print(f"  {field} = {getattr(config, field)!r}")
    print(f"life cycles: {mgr.life_cycles}")
    return 0


def _requests(args):
    """Token arrays in arrival order, from the trace or the built-in workload."""
    from .workload import expand_tokens, load_mooncake_trace, synthetic_conversations

    if args.trace:
        reqs = load_mooncake_trace(args.trace, limit=args.limit)
        return [expand_tokens(r.hash_ids, r.input_length) for r in reqs], f"trace {args.trace}"
    reqs = synthetic_conversations(args.conversations, seed=args.seed, tokens_per_block=args.tokens_per_block)
    if args.limit is not None:
        reqs = reqs[: args.limit]
    return [r.tokens for r in reqs], f"built-in synthetic chats ({args.conversations} conversations, seed {args.seed})"


def _warm_up(config, T):
    """Compile (or load) every kernel the replay uses before anything is timed."""
    import gpukv
    from gpukv import introspect

    mgr = gpukv.KVCacheManager(config)
    introspect.insert_sequence(mgr, list(range(2 * T + 1)))
    seqs = [mgr.token_sequence(list(range(3 * T))) for _ in range(64)]
    mgr.match_batch(seqs)
    mgr.match_batch([list(range(2 * T))])


def cmd_match(args) -> int:
    import json
    import time

    import numpy as np

    import gpukv
    from gpukv import introspect

    if args.limit is not None and args.limit < 0:
        raise ValueError(f"--limit must be >= 0, got {args.limit}")
    if args.batch < 1:
        raise ValueError(f"--batch must be >= 1, got {args.batch}")
    tokens, source = _requests(args)
    T = args.tokens_per_block
    config = gpukv.CacheConfig(
        tokens_per_block=T, layers=[gpukv.Attention()], pages_per_life_cycle=args.pages,
        enable_partial_reuse=not args.no_partial_reuse, backend=args.backend,
    )
    _warm_up(config, T)
    mgr = gpukv.KVCacheManager(config)
    latencies, sizes = [], []
    reused = np.zeros(len(tokens), dtype=np.int64)
    stored_blocks = 0
    show = sys.stderr.isatty() and not args.json
    for lo in range(0, len(tokens), args.batch):
        batch = tokens[lo:lo + args.batch]
        seqs = [mgr.token_sequence(t) for t in batch]  # a scheduler registers requests on arrival
        t0 = time.perf_counter()
        m = mgr.match_batch(seqs)
        reused[lo:lo + len(batch)] = mgr._backend.to_host(m.num_tokens)
        latencies.append(time.perf_counter() - t0)
        sizes.append(int(sum(len(t) for t in batch)))
        for s, t in zip(seqs, batch):  # each finished prompt is kept for reuse
            stored_blocks += introspect.insert_sequence(mgr, t)
            s.release()
        if show:
            print(f"\r{min(lo + args.batch, len(tokens))}/{len(tokens)} requests", end="", file=sys.stderr)
    if show:
        print(file=sys.stderr)
    lengths = np.array([len(t) for t in tokens], dtype=np.int64)
    lat = np.array(latencies) if latencies else np.zeros(1)
    summary = {
        "workload": source,
        "backend": mgr.backend,
        "policy": "full-blocks" if args.no_partial_reuse else "per-page coverage",
        "requests": len(tokens),
        "input_tokens": int(lengths.sum()),
        "reused_tokens": int(reused.sum()),
        "hit_rate": float(reused.sum() / max(lengths.sum(), 1)),
        "reused_from_partial_endpoints": int((reused % T).sum()),
        "requests_ending_mid_block": int(((reused % T) != 0).sum()),
        "stored_blocks": stored_blocks,
        "match_batches": len(latencies),
        "match_latency_p50_ms": float(np.percentile(lat, 50) * 1e3),
        "match_latency_p99_ms": float(np.percentile(lat, 99) * 1e3),
        "match_query_tokens_per_s": float(sum(sizes) / max(sum(latencies), 1e-12)),
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        width = max(len(k) for k in summary)
        for k, v in summary.items():
            print(f"{k:<{width}}  {v:.4g}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda", "cudasim"])
    p = argparse.ArgumentParser(prog="gpukv", description="GPU-resident KV-cache prefix-reuse index")
    sub = p.add_subparsers(dest="command")
    sub.add_parser("info", parents=[common], help="backend, versions and default config")
    m = sub.add_parser("match", parents=[common], help="replay a workload through batched reuse matching (the default)")
    m.add_argument("--trace", help="a Mooncake-format JSONL trace (512-token hash ids)")
    m.add_argument("--limit", type=int, help="take the first N requests")
    m.add_argument("--conversations", type=int, default=300, help="built-in workload size")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--batch", type=int, default=64, help="requests matched per match_batch call")
    m.add_argument("--tokens-per-block", type=int, default=32)
    m.add_argument("--pages", type=int, default=1 << 20, help="pages per life cycle")
    m.add_argument("--no-partial-reuse", action="store_true", help="reuse full blocks only, as block-granular engines do")
    m.add_argument("--json", action="store_true", help="print the summary as JSON")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not any(a in ("info", "match") for a in argv) and not any(a in ("-h", "--help") for a in argv):
        argv = ["match", *argv]  # the main job is the default command
    args = parser.parse_args(argv)
    try:
        if args.command == "info":
            return cmd_info(args)
        if args.command == "match":
            return cmd_match(args)
    except (ValueError, TypeError, OSError) as e:
        print(f"gpukv: error: {e}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())

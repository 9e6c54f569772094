"""The ``gpukv`` command.

- ``gpukv info``: the backend, library versions and a default manager's config.
- ``gpukv match`` (the default): build a prefix tree from a workload and
  answer batched reuse queries against it, reporting hit rates and throughput.
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpukv", description="GPU-resident KV-cache prefix-reuse index")
    p.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda", "cudasim"])
    sub = p.add_subparsers(dest="command")
    sub.add_parser("info", help="backend, versions and default config")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command in (None, "info"):
            return cmd_info(args)
    except (ValueError, TypeError, OSError) as e:
        print(f"gpukv: error: {e}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())

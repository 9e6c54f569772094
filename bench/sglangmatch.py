"""SGLang's radix-tree lookup on the match benchmark's tree: the peer of
gpukv's flat match (``test_match.py``'s ``test_sglang_walk``).

SGLang 0.5.23's scheduler keeps its prefix index in ``UnifiedRadixCache``
(what ``mem_cache/registry.py`` builds by default), whose tree core is Rust:
``RustUnifiedTreeCore``, an adapter over ``RustUnifiedTreeCoreBinding`` of
the ``sglang.srt.mem_cache.rust_tree_core.mem_cache`` extension (picked by
``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND``, default ``rust``). The Python
``RadixCache`` (the one ``stepbench.py`` drives) is SGLang's older,
pure-Python tree; nothing Rust is behind it.

The tree here is a ``UnifiedRadixCache`` with the one ``FULL`` component,
``page_size = T``, over a real ``PagedTokenToKVPoolAllocator`` on CPU tensors,
holding the same inserted trace requests as gpukv's tree (their whole pages:
SGLang's tree keeps only whole pages at this page size). Its lookups, per
request, on int64 token keys (``array("q")``, what ``RadixKey`` requires):

* ``full_device``: ``binding.match_full_device_prefix(MatchParamsBinding)``,
  the read-only Rust walk over device-resident pages (SGLang's buffer-mode
  pipeline calls it through ``tree_core``); the fastest lookup SGLang has,
  and like ``match_batch`` it changes nothing in the tree;
* ``match_prefix``: ``UnifiedRadixCache.match_prefix(MatchPrefixParams)``,
  what the scheduler calls for each waiting request (``match_kv_cache``): the
  same Rust walk (``binding.match_prefix``, which also refreshes the LRU
  order) behind SGLang's Python wrappers.

Each side's queries are prepared in its own form before timing: the
``MatchParamsBinding`` and ``MatchPrefixParams`` objects here, gpukv's
``(flat int32, offsets)`` pair in ``matchbench.py``.
"""

from __future__ import annotations

import importlib
import time
from array import array
from dataclasses import dataclass

import numpy as np

from .matchbench import T
from .stepbench import TORCHVISION_NOTE, import_sglang_radix_cache

PATHS = ("full_device", "match_prefix")
LABELS = {
    "full_device": "SGLang, Rust match_full_device_prefix",
    "match_prefix": "SGLang, UnifiedRadixCache.match_prefix",
}


def sglang_unavailable() -> str | None:
    """Why SGLang's Rust tree cannot be driven here, or None."""
    try:
        import_sglang_radix_cache()
        importlib.import_module("sglang.srt.mem_cache.rust_tree_core.extension")  # loads the Rust extension
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip
        return (f"SGLang's Rust radix tree is not importable here ({type(e).__name__}: {e}); "
                "see bench/README.md for the install")
    return None


def int64_key(tokens: np.ndarray) -> array:
    """A request's tokens as SGLang's key buffer, ``array("q")``."""
    return array("q", tokens.astype(np.int64).tobytes())


@dataclass
class SglangTree:
    cache: object  # the UnifiedRadixCache
    version: str
    build_s: float

    @property
    def binding(self):
        return self.cache.tree_core._binding

    def prepare(self, path: str, queries) -> list:
        """``queries`` (int32 arrays) as ``path``'s lookup takes them."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        if path == "full_device":
            params = self.cache.tree_core._bindings.MatchParamsBinding
            return [params(key=int64_key(q), extra_key=None, cache_salt=None) for q in queries]
        if path == "match_prefix":
            return [MatchPrefixParams(key=RadixKey(int64_key(q))) for q in queries]
        raise ValueError(f"unknown SGLang lookup {path!r}; one of {PATHS}")

    def lookup(self, path: str):
        """The timed call of ``path``: prepared queries -> reused tokens per request."""
        if path == "full_device":
            walk = self.binding.match_full_device_prefix
            return lambda prepared: [walk(p)[0] for p in prepared]
        match = self.cache.match_prefix
        return lambda prepared: [match(p).device_prefix_len for p in prepared]

    def info(self, path: str) -> dict:
        return {"peer": "sglang", "version": self.version, "sglang_path": path,
                "tree_core": type(self.cache.tree_core).__name__, "note": TORCHVISION_NOTE}


def build_sglang_tree(inserted) -> SglangTree:
    """A ``UnifiedRadixCache`` on the Rust tree core holding the whole pages of
    ``inserted`` (int32 arrays), each page with its own KV slots, as a
    scheduler's cache of those prefills would."""
    import sglang
    import torch

    import_sglang_radix_cache()
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    pages = sum(t.size // T for t in inserted) + 1
    allocator = PagedTokenToKVPoolAllocator(size=pages * T, page_size=T, dtype=torch.float16, device="cpu",
                                            kvcache=None, need_sort=False)
    rows = ReqToTokenPool(size=1, max_context_len=T, device="cpu", enable_memory_saver=False)
    cache = UnifiedRadixCache(CacheInitParams(disable=False, req_to_token_pool=rows,
                                              token_to_kv_pool_allocator=allocator, page_size=T,
                                              tree_components=(ComponentType.FULL,)))
    core = type(cache.tree_core).__name__
    if core != "RustUnifiedTreeCore":
        raise RuntimeError(f"SGLang built its radix tree on {core}, not the Rust tree core")
    for tokens in inserted:
        n = tokens.size // T * T
        if not n:
            continue
        slots = allocator.alloc(n)
        done = cache.insert(InsertParams(key=RadixKey(int64_key(tokens[:n])), value=slots))
        if done.prefix_len:  # pages the tree held already: their new slots go back
            allocator.free(slots[:done.prefix_len])
    return SglangTree(cache, sglang.__version__, time.perf_counter() - t0)

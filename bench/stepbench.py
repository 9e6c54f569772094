"""The serving step on three KV-cache managers: gpukv, vLLM and SGLang.

One serving loop, written once against a small driver interface, with one
driver per system doing what that system's scheduler does:

* ``admit(i)``: match request ``i`` against the reuse index, allocate its
  pages and run its prefill in ``CHUNK``-token chunks (allocate the chunk,
  then make it reusable), returning the handle and the number of reused
  tokens. Requests are admitted one after the other, so a request reuses
  everything earlier requests prefilled.
* ``running(handles)``: the running batch, ``decode(batch, tokens)``: one
  decode step, each running request gains one token (``tokens[j]``).
* ``finish(batch)``: the requests end; their pages stay cached, evictable.

Every system gets the same number of pages of ``T`` tokens, full attention,
and reuses whole blocks of ``prompt[:-1]`` (the last prompt token is always
recomputed for the first output's logits), so all three reuse exactly the
same tokens when nothing is evicted: ``reference_reuse`` computes that
number per request with a Python set of block chains.

vLLM and SGLang are imported only when their driver is built;
``peer_unavailable(name)`` says why one cannot be (None when it can).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
from array import array
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from . import knobs

T = 32  # tokens per block / page (SGLang page_size)
CHUNK = 512  # prefill chunk, tokens
SYSTEMS = ("vllm", "sglang", "gpukv")


# -- the workload ---------------------------------------------------------------------------------------
def trace_path() -> Path | None:
    """The Mooncake trace (``$GPUKV_TRACE``, or where ``find_mooncake_trace`` looks); None when absent."""
    from gpukv.sim.workload import find_mooncake_trace

    return find_mooncake_trace()


@dataclass
class StepWorkload:
    """Trace requests in every form the drivers take them (built once, untimed)."""

    prompts: list  # int32 arrays (gpukv)
    decode_steps: int  # decode steps per timed round
    rounds: int
    rng_seed: int = 0
    _tokens: dict = field(default_factory=dict)
    _lists: dict = field(default_factory=dict)
    _arrays: dict = field(default_factory=dict)

    def tokens_list(self, i: int) -> list:
        """Request ``i`` as a Python int list (vLLM's form)."""
        if i not in self._lists:
            self._lists[i] = self.prompts[i].tolist()
        return self._lists[i]

    def tokens_array(self, i: int) -> array:
        """Request ``i`` as ``array("q")`` (SGLang's form)."""
        if i not in self._arrays:
            self._arrays[i] = array("q", self.prompts[i].astype(np.int64).tobytes())
        return self._arrays[i]

    def prepare(self, order) -> None:
        """Convert ``order``'s requests to every form before anything is timed."""
        for i in order:
            self.tokens_list(i)
            self.tokens_array(i)

    def pages(self, i: int, extra_tokens: int = 0) -> int:
        return -(-(self.prompts[i].size + extra_tokens) // T)

    def step_tokens(self, batch: int, step: int) -> np.ndarray:
        """The tokens the running batch decodes at ``step``: one int32 per request."""
        key = (batch, step)
        if key not in self._tokens:
            rng = np.random.default_rng((self.rng_seed, batch, step))
            self._tokens[key] = rng.integers(0, 2**31 - 1, size=batch, dtype=np.int32)
        return self._tokens[key]


def load_workload(n_requests: int, decode_steps: int, rounds: int) -> StepWorkload:
    from gpukv.sim.workload import load_mooncake_trace

    path = trace_path()
    if path is None:
        raise FileNotFoundError("the Mooncake trace is not in shared/data (set GPUKV_TRACE)")
    prompts = [r.tokens() for r in load_mooncake_trace(path, limit=n_requests)]
    if len(prompts) < n_requests:
        raise ValueError(f"{path} has {len(prompts)} requests, {n_requests} needed")
    return StepWorkload(prompts, decode_steps, rounds)


def block_chain(tokens: list) -> list:
    """Keys of the full blocks of ``tokens``, each naming its whole prefix."""
    keys, parent = [], None
    for j in range(0, len(tokens) // T * T, T):
        parent = hash((parent, tuple(tokens[j:j + T])))
        keys.append(parent)
    return keys


def reference_reuse(w: StepWorkload, order: list) -> list:
    """Reused tokens per request when ``order``'s requests are admitted one by
    one with nothing evicted: the full blocks of ``prompt[:-1]`` that an
    earlier request's prompt holds (every prompt is prefilled whole)."""
    cached: set = set()
    out = []
    for i in order:
        lookup = block_chain(w.tokens_list(i)[:-1])
        n = 0
        while n < len(lookup) and lookup[n] in cached:
            n += 1
        out.append(n * T)
        cached.update(block_chain(w.tokens_list(i)))
    return out


def distinct_blocks(w: StepWorkload, order: list, extra_tokens: int = 0) -> int:
    """Pages the requests of ``order`` hold at once, shared prefix blocks
    counted once (an upper bound: partial tails and decode growth counted per request)."""
    full: set = set()
    tails = 0
    for i in order:
        chain = block_chain(w.tokens_list(i))
        full.update(chain)
        tails += w.pages(i, extra_tokens) - len(chain)
    return len(full) + tails


def filler_plan(w: StepWorkload, running: list, first: int, pages: int, margin: int) -> list:
    """Requests ``first, first + 1, ...`` that, admitted and finished after
    ``running``, bring at least ``pages - (pages running holds) + margin`` new
    pages into the pool: afterwards the pool is full and every allocation evicts.
    Requests too long for the room the running batch leaves are passed over."""
    held: set = set()
    for i in running:
        held.update(block_chain(w.tokens_list(i)))
    room = pages - distinct_blocks(w, running)  # what the fillers can ever have, evicting each other
    need = room + margin
    plan, brought, i = [], 0, first
    while brought < need:
        if i >= len(w.prompts):
            raise ValueError(f"{len(w.prompts)} trace requests cannot fill {pages} pages; load more")
        if w.pages(i) > room - margin:  # could not be admitted even with every other filler evicted
            i += 1
            continue
        chain = block_chain(w.tokens_list(i))
        brought += sum(k not in held for k in chain) + (w.pages(i) - len(chain))
        held.update(chain)
        plan.append(i)
        i += 1
    return plan


def chunks(start: int, end: int):
    """The prefill chunks ``[n0, n1)`` of ``[start, end)``."""
    return [(n0, min(end, n0 + CHUNK)) for n0 in range(start, end, CHUNK)]


class OutOfPages(RuntimeError):
    """A driver could not get pages even after evicting: the pool is too small for the run."""


# -- gpukv ----------------------------------------------------------------------------------------------
class GpukvPerCache:
    """gpukv through the per-cache calls: ``create_kv_cache`` (the match),
    ``resume``, a ``resize`` for the first chunk, then per chunk an
    ``append`` (its commit and room for the next; a gpukv without it:
    ``resize`` and ``commit``), per decode token ``resize`` and ``commit``,
    ``close``."""

    name = "gpukv"
    calls = "per-cache"

    def __init__(self, w: StepWorkload, pages: int):
        import gpukv

        self.w = w
        self.version = gpukv.__version__ if hasattr(gpukv, "__version__") else "dev"
        # The index sized for the pool from the start, as vLLM's block pool is.
        self.mgr = gpukv.KVCacheManager(gpukv.CacheConfig(
            tokens_per_block=T, layers=[gpukv.Attention()], pages_per_life_cycle=pages,
            enable_partial_reuse=False, initial_blocks=pages, block_digests=bool(knobs.integer("step-digests")),
            backend="cpu"))

    def admit(self, i: int):
        p = self.w.prompts[i]
        kv = self.mgr.create_kv_cache(input_tokens=p[:-1])
        reused = kv.num_committed_tokens
        if not kv.resume():
            kv.close()
            raise OutOfPages(f"gpukv: resume of request {i}")
        spans = chunks(reused, p.size)
        if hasattr(kv, "append"):  # per chunk one launch: its commit, then room for the next
            if not kv.resize(spans[0][1], reused):
                kv.close()
                raise OutOfPages(f"gpukv: resize of request {i} to {spans[0][1]}")
            for k, (n0, n1) in enumerate(spans):
                if not kv.append(p[n0:n1], room=spans[k + 1][1] - n1 if k + 1 < len(spans) else 0):
                    kv.close()
                    raise OutOfPages(f"gpukv: room for request {i}'s chunk after {n1}")
            return kv, reused
        for n0, n1 in spans:
            if not kv.resize(n1, n0):
                kv.close()
                raise OutOfPages(f"gpukv: resize of request {i} to {n1}")
            kv.commit(p[n0:n1])
        return kv, reused

    def running(self, handles):
        return list(handles)

    def decode(self, kvs, tokens: np.ndarray):
        for j, kv in enumerate(kvs):
            n = kv.num_committed_tokens
            if n + 1 > kv.capacity and not kv.resize(-(-(n + 1) // T) * T):  # pages a block at a time
                raise OutOfPages(f"gpukv: decode resize of running request {j}")
            kv.commit(tokens[j:j + 1])

    def finish(self, kvs):
        for kv in kvs:
            kv.close()

    def free_pages(self) -> int:
        return int(self.mgr._backend.to_host(self.mgr._tables.pool_top)[0])


class GpukvBatched(GpukvPerCache):
    """gpukv through the batched calls for the running batch: a decode step
    is one ``append_batch`` (the step's token, then room for the next), and
    ``close_batch``. Admission takes one request at a time, so that each
    reuses what the previous ones prefilled, with the per-cache calls a
    batch of one takes (``create_kv_cache``, ``resume``, a ``resize`` for
    the first chunk, then per chunk one ``append``: its commit and room for
    the next). A gpukv without ``append_batch``: ``create_kv_caches``,
    ``resume``, then per chunk and step ``resize_batch`` and
    ``commit_batch``."""

    calls = "batched"
    REQUIRED = ("create_kv_caches", "resize_batch", "commit_batch", "close_batch")

    def admit(self, i: int):
        if hasattr(self.mgr, "append_batch"):  # one request: the calls a batch of one takes, per cache
            return super().admit(i)
        p = self.w.prompts[i]
        (kv,) = self.mgr.create_kv_caches([p[:-1]])  # SUSPENDED, holding its reused pages
        reused = kv.num_committed_tokens
        if not kv.resume():
            self.mgr.close_batch([kv])
            raise OutOfPages(f"gpukv: resume of request {i}")
        for n0, n1 in chunks(reused, p.size):
            if not self.mgr.resize_batch([kv], [n1], [n0])[0]:
                self.mgr.close_batch([kv])
                raise OutOfPages(f"gpukv: resize of request {i} to {n1}")
            self.mgr.commit_batch([kv], [p[n0:n1]])
        return kv, reused

    def running(self, handles):
        kvs = list(handles)
        if hasattr(self.mgr, "append_batch"):  # room for the first decode token; each step then leaves room for the next
            grow = [kv for kv in kvs if kv.num_committed_tokens + 1 > kv.capacity]
            if not self.mgr.resize_batch(grow, [-(-(kv.num_committed_tokens + 1) // T) * T for kv in grow]).all():
                raise OutOfPages("gpukv: room for the first decode token")
            kvs = self.mgr.cache_batch(kvs)  # the running batch, checked once
        return {"kvs": kvs, "n": np.array([kv.num_committed_tokens for kv in kvs], dtype=np.int64),
                "cap": np.array([kv.capacity for kv in kvs], dtype=np.int64),
                "offsets": np.arange(len(kvs) + 1, dtype=np.int64)}

    def decode(self, batch, tokens: np.ndarray):
        kvs = batch["kvs"]
        if hasattr(self.mgr, "append_batch"):
            # One launch: the token the step wrote, then room for the next (a block at a time).
            ok = self.mgr.append_batch(kvs, (tokens, batch["offsets"]), room=1)
            if not ok.all():
                raise OutOfPages(f"gpukv: decode room of running requests {np.flatnonzero(~ok).tolist()}")
            return
        n, cap = batch["n"], batch["cap"]
        grow = np.flatnonzero(n + 1 > cap)
        if grow.size:
            want = -(-(n[grow] + 1) // T) * T
            ok = np.asarray(self.mgr.resize_batch([kvs[j] for j in grow], want))
            if not ok.all():
                raise OutOfPages(f"gpukv: decode resize of running requests {grow[~ok].tolist()}")
            cap[grow] = want
        self.mgr.commit_batch(kvs, (tokens, batch["offsets"]))
        n += 1

    def finish(self, batch):
        self.mgr.close_batch(batch["kvs"])


def gpukv_calls() -> str:
    """``GPUKV_BENCH_STEP_CALLS``: ``per-cache``, ``batched`` or ``auto`` (the
    default: batched when ``KVCacheManager`` has every batched call)."""
    import gpukv

    want = knobs.get("step-calls")
    has = all(hasattr(gpukv.KVCacheManager, m) for m in GpukvBatched.REQUIRED)
    if want == "auto":
        return "batched" if has else "per-cache"
    if want not in ("per-cache", "batched"):
        raise ValueError(f"GPUKV_BENCH_STEP_CALLS must be auto, per-cache or batched, got {want!r}")
    if want == "batched" and not has:
        missing = [m for m in GpukvBatched.REQUIRED if not hasattr(gpukv.KVCacheManager, m)]
        raise RuntimeError(f"GPUKV_BENCH_STEP_CALLS=batched, but KVCacheManager lacks {', '.join(missing)}")
    return want


# -- vLLM -----------------------------------------------------------------------------------------------
class Vllm:
    """vLLM's ``KVCacheManager`` (v1 engine), one full-attention group, prefix
    caching on, the default sha256 block hasher; per step what its scheduler
    calls: ``get_computed_blocks`` + ``allocate_slots`` at admission and per
    chunk, ``allocate_slots(request, 1)`` per decode token, ``free`` at the end."""

    name = "vllm"
    calls = "per-request"

    def __init__(self, w: StepWorkload, pages: int):
        import torch
        import vllm
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request

        self.w, self.version, self._Request = w, vllm.__version__, Request
        spec = FullAttentionSpec(block_size=T, num_kv_heads=1, head_size=1, dtype=torch.float16)
        config = KVCacheConfig(num_blocks=pages + 1,  # block 0 is vLLM's null block
                               kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
        self.mgr = KVCacheManager(config, max_model_len=1 << 22, scheduler_block_size=T, hash_block_size=T,
                                  enable_caching=True)
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(T, sha256)
        self._params = SamplingParams(max_tokens=1 << 20)
        self._ids = 0

    def admit(self, i: int):
        mgr = self.mgr
        self._ids += 1
        r = self._Request(str(self._ids), self.w.tokens_list(i), self._params, None, block_hasher=self._hasher)
        blocks, reused, _ = mgr.get_computed_blocks(r)
        first = True
        for n0, n1 in chunks(reused, r.num_tokens):
            mgr.new_step_starts()
            got = (mgr.allocate_slots(r, n1 - n0, reused, blocks) if first
                   else mgr.allocate_slots(r, n1 - n0))
            if got is None:
                mgr.free(r)
                raise OutOfPages(f"vllm: allocate_slots of request {i} to {n1}")
            r.num_computed_tokens = n1
            first = False
        return r, reused

    def running(self, handles):
        return list(handles)

    def decode(self, reqs, tokens: np.ndarray):
        mgr = self.mgr
        mgr.new_step_starts()
        for j, (r, t) in enumerate(zip(reqs, tokens.tolist())):
            r.append_output_token_ids(t)
            if mgr.allocate_slots(r, 1) is None:
                raise OutOfPages(f"vllm: decode allocate_slots of running request {j}")
            r.num_computed_tokens += 1

    def finish(self, reqs):
        for r in reqs:
            self.mgr.free(r)

    def free_pages(self) -> int:
        """Blocks in the free queue that hold no cached block (vLLM keeps
        cached blocks in the free queue and evicts them as it pops)."""
        pool = self.mgr.block_pool
        return pool.get_num_free_blocks() - _vllm_cached_free(pool)


def _vllm_cached_free(pool) -> int:
    q = pool.free_block_queue
    n, b = 0, q.fake_free_list_head.next_free_block
    while b is not None and b is not q.fake_free_list_tail:
        n += b.block_hash is not None
        b = b.next_free_block
    return n


# -- SGLang ---------------------------------------------------------------------------------------------
TORCHVISION_NOTE = ("SGLang: a placeholder module stands in for torchvision (its import chain reaches a "
                    "vision-model config; torchvision does not import beside the CPU torch wheel)")


class _Placeholder(types.ModuleType):
    """Any attribute is another placeholder; calling one fails loudly."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.__name__} is a placeholder (torchvision is not installed)")


class _PlaceholderFinder:
    """Finds ``torchvision`` and its submodules as placeholders."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, _PlaceholderFinder, is_package=True)
        return None

    @staticmethod
    def create_module(spec):
        m = _Placeholder(spec.name)
        m.__path__ = []
        return m

    @staticmethod
    def exec_module(module):
        pass


def import_sglang_radix_cache():
    """``sglang.srt.mem_cache``'s radix cache modules, with the torchvision placeholder when needed."""
    try:
        importlib.import_module("torchvision")
    except Exception:
        sys.modules.pop("torchvision", None)
        # transformers asks whether torchvision is installed once and remembers the answer:
        # ask before the placeholder exists, so it keeps its vision code paths off.
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()
        sys.meta_path.insert(0, _PlaceholderFinder)
    return importlib.import_module("sglang.srt.mem_cache.radix_cache")


class _SglReq:
    """The fields of SGLang's ``Req`` that its radix cache reads and writes."""

    __slots__ = ("kv", "origin_input_ids", "full_untruncated_fill_ids", "output_ids", "extra_key", "cache_salt",
                 "priority", "lock", "last_node")

    def __init__(self, kv, prompt):
        self.kv, self.origin_input_ids, self.full_untruncated_fill_ids = kv, prompt, prompt
        self.output_ids = array("q")
        self.extra_key = self.cache_salt = self.priority = self.lock = self.last_node = None


class Sglang:
    """SGLang's ``RadixCache`` (page_size = T) with the real
    ``PagedTokenToKVPoolAllocator`` and ``ReqToTokenPool`` on CPU tensors;
    per step what its scheduler does: ``match_prefix`` and a tree lock at
    admission, ``alloc_paged_token_slots_extend`` + ``checkpoint`` per chunk
    (evicting from the tree when short), one ``alloc_paged_token_slots_decode``
    for the whole running batch per decode step, and at the end the
    ``release_kv_cache`` sequence (``checkpoint``, ``free_kv_row``,
    ``unlock``, free the row)."""

    name = "sglang"
    calls = "batched decode"

    def __init__(self, w: StepWorkload, pages: int, rows: int, max_context: int):
        import sglang
        import torch

        rc = import_sglang_radix_cache()
        from sglang.srt.managers.schedule_batch import ReqKvInfo
        from sglang.srt.mem_cache import allocation
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        torch.set_num_threads(1)
        self.w, self.version, self.torch = w, sglang.__version__, torch
        self._ReqKvInfo, self._MatchPrefixParams, self._RadixKey = ReqKvInfo, MatchPrefixParams, rc.RadixKey
        self._extend, self._decode = allocation.alloc_paged_token_slots_extend, allocation.alloc_paged_token_slots_decode
        self.allocator = PagedTokenToKVPoolAllocator(size=pages * T, page_size=T, dtype=torch.float16, device="cpu",
                                                     kvcache=None, need_sort=False)
        self.rows = ReqToTokenPool(size=rows, max_context_len=max_context, device="cpu", enable_memory_saver=False)
        self.tree = rc.RadixCache(CacheInitParams(disable=False, req_to_token_pool=self.rows,
                                                  token_to_kv_pool_allocator=self.allocator, page_size=T))

    def admit(self, i: int):
        torch, tree, rows = self.torch, self.tree, self.rows
        prompt = self.w.tokens_array(i)
        req = _SglReq(self._ReqKvInfo(), prompt)
        m = tree.match_prefix(self._MatchPrefixParams(key=self._RadixKey(prompt[:-1])))
        reused = m.device_prefix_len
        req.last_node = m.last_device_node
        req.lock = tree.lock(req.last_node)
        if rows.alloc([req]) is None:
            raise OutOfPages("sglang: no req_to_token row")
        row = req.kv.req_pool_idx
        if reused:
            rows.write((row, slice(0, reused)), tree.path_device_indices(req.last_node)[:reused].to(torch.int32))
        kv = req.kv
        kv.cache_protected_len = kv.cache_inserted_len = kv.kv_allocated_len = kv.kv_committed_len = reused
        for n0, n1 in chunks(reused, len(prompt)):
            last = int(rows.req_to_token[row, n0 - 1]) if n0 else -1
            lo, hi = torch.tensor([n0], dtype=torch.int64), torch.tensor([n1], dtype=torch.int64)
            try:
                out = self._extend(tree, lo, lo, hi, hi, torch.tensor([last], dtype=torch.int64), n1 - n0)
            except RuntimeError as e:
                raise OutOfPages(f"sglang: extend of request {i} to {n1}: {e}") from None
            rows.write((row, slice(n0, n1)), out.to(torch.int32))
            kv.kv_allocated_len = kv.kv_committed_len = n1
            req.full_untruncated_fill_ids = prompt[:n1]
            tree.checkpoint(req, up_to=n1)  # the chunk is computed: publish it
        return req, reused

    def running(self, handles):
        torch = self.torch
        reqs = list(handles)
        lens = [r.kv.kv_committed_len for r in reqs]
        return {"reqs": reqs, "rows": torch.tensor([r.kv.req_pool_idx for r in reqs], dtype=torch.int64),
                "seq_lens": torch.tensor(lens, dtype=torch.int64), "seq_lens_cpu": torch.tensor(lens, dtype=torch.int64)}

    def decode(self, batch, tokens: np.ndarray):
        torch = self.torch
        rows, seq_lens, seq_lens_cpu = batch["rows"], batch["seq_lens"], batch["seq_lens_cpu"]
        last_loc = self.rows.req_to_token[rows, seq_lens - 1]
        try:
            out = self._decode(self.tree, seq_lens + 1, seq_lens_cpu + 1, last_loc)
        except RuntimeError as e:
            raise OutOfPages(f"sglang: decode: {e}") from None
        self.rows.write((rows, seq_lens), out.to(torch.int32))
        for r, t in zip(batch["reqs"], tokens.tolist()):
            r.kv.kv_allocated_len += 1
            r.kv.kv_committed_len += 1
            r.output_ids.append(t)
        seq_lens.add_(1)
        seq_lens_cpu.add_(1)

    def finish(self, batch):
        tree = self.tree
        for req in batch["reqs"]:
            kv = req.kv
            owned = kv.kv_committed_len
            req.full_untruncated_fill_ids = req.origin_input_ids + req.output_ids
            tree.checkpoint(req, up_to=owned)
            tree.free_kv_row(kv, [(kv.cache_protected_len, owned)])
            tree.unlock(req.lock)
            req.lock = None
            self.rows.free(req)
            kv.mark_kv_released()

    def free_pages(self) -> int:
        return self.allocator.available_size() // T


# -- the running batch, as the decode benchmarks start from it -----------------------------------------
EVICTING_FACTOR = 1.5  # the evicting pool: pages over what the running batch needs


def roomy_pages(w: StepWorkload, order: list, decode_tokens: int) -> int:
    """A pool where nothing is ever evicted: every request's pages, unshared, and some."""
    return sum(w.pages(i, decode_tokens) for i in order) + 64


def admit_all(d, order: list) -> tuple:
    out = [d.admit(i) for i in order]
    return [h for h, _ in out], [r for _, r in out]


def start_running(system: str, w: StepWorkload, order: list, pool: str, decode_tokens: int, first_filler: int):
    """``(driver, handles, reused, facts)``: ``order``'s requests admitted and
    running. ``pool`` ``roomy``: nothing is ever evicted. ``evicting``: the pool
    has ``EVICTING_FACTOR`` x the pages the running batch needs for
    ``decode_tokens`` more tokens each, and trace requests from
    ``first_filler`` on are admitted and finished after the batch until the
    pool is full of their cached pages. The batch's reuse is checked against
    ``reference_reuse`` (nothing is evicted before the fill)."""
    facts = {}
    if pool == "roomy":
        pages = roomy_pages(w, order, decode_tokens)
    elif pool == "evicting":
        need = distinct_blocks(w, order, decode_tokens)
        pages = int(EVICTING_FACTOR * need)
        facts["running_need_pages"] = need
    else:
        raise ValueError(f"pool must be roomy or evicting, got {pool!r}")
    d = make_driver(system, w, pages, len(order))
    handles, reused = admit_all(d, order)
    want = reference_reuse(w, order)
    if reused != want:
        bad = [(i, a, b) for i, a, b in zip(order, reused, want) if a != b]
        raise AssertionError(f"{system} reused other token counts than the reference (request, got, want): {bad[:10]}")
    if pool == "evicting":
        fillers = filler_plan(w, order, first_filler, pages, margin=len(order))
        for i in fillers:
            h, _ = d.admit(i)
            d.finish(d.running([h]))
        facts.update(fillers=len(fillers), free_pages_after_fill=d.free_pages())
    facts["pages"] = pages
    return d, handles, reused, facts


# -- building drivers -----------------------------------------------------------------------------------
def peer_unavailable(name: str) -> str | None:
    """Why ``name``'s driver cannot be built here, or None."""
    try:
        if name == "vllm":
            importlib.import_module("vllm.v1.core.kv_cache_manager")
        elif name == "sglang":
            import_sglang_radix_cache()
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip
        return f"{name} is not importable here ({type(e).__name__}: {e}); see bench/README.md for the install"
    return None


def make_driver(name: str, w: StepWorkload, pages: int, running: int):
    """The driver of system ``name`` with ``pages`` pages, room for ``running``
    requests at once (and one more being admitted)."""
    if name == "gpukv":
        return GpukvBatched(w, pages) if gpukv_calls() == "batched" else GpukvPerCache(w, pages)
    if name == "vllm":
        return Vllm(w, pages)
    if name == "sglang":
        longest = max(p.size for p in w.prompts) + w.decode_steps * (w.rounds + 1) + 2 * T
        return Sglang(w, pages, rows=running + 2, max_context=longest)
    raise ValueError(f"unknown system {name!r}; one of {SYSTEMS}")

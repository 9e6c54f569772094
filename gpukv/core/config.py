"""Configuration: layer specs, the life-cycle registry and ``CacheConfig``.

Layers with equal specs share one *life cycle* (docs/semantics.md §1.5): the unit
that owns a page pool, a page slot per tree block and a coverage rule. Ids are
given 0, 1, ... in order of first appearance in ``CacheConfig.layers``.
"""

from __future__ import annotations

import math
from functools import cached_property
from dataclasses import dataclass, field
from typing import Sequence, Union

import numpy as np

from .backend import BACKENDS
from .errors import ConfigError

from .kinds import KIND_FULL, KIND_SSM, KIND_SWA, has_window, is_checkpoint  # noqa: F401 (KIND_* re-exported)

EVENT_HASHES = ("sha256", "sha256_64")  # block-hash formats of KV cache events

MAX_TOKEN_ID = 2**31 - 1
PRIORITY_MIN = 0  # eviction priorities: lower values are evicted first
PRIORITY_MAX = 100
DEFAULT_PRIORITY = 35
MIN_MAX_BLOCKS = 8  # max_blocks: a root and the blocks of a short request, with the rows a call keeps free


def check_priority(value, what: str) -> int:
    """A valid eviction priority, or a ValueError naming ``what``."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise ValueError(f"{what} must be an int in {PRIORITY_MIN}..{PRIORITY_MAX}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class Attention:
    """An attention layer: full (``window=None``) or sliding-window."""

    window: int | None = None
    sink_tokens: int = 0

    def __post_init__(self):
        if self.window is not None and (
            not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 1
        ):
            raise ConfigError(f"Attention.window must be None or a positive int, got {self.window!r}")
        if not isinstance(self.sink_tokens, int) or isinstance(self.sink_tokens, bool) or self.sink_tokens < 0:
            raise ConfigError(f"Attention.sink_tokens must be a non-negative int, got {self.sink_tokens!r}")
        if self.sink_tokens and self.window is None:
            raise ConfigError("Attention.sink_tokens is only allowed with a window")


@dataclass(frozen=True)
class Ssm:
    """A recurrent-state (SSM) layer. All SSM layers share one life cycle."""


LayerSpec = Union[Attention, Ssm]


@dataclass(frozen=True)
class SwaScratchReuse:
    """SWA prefill memory reuse (§1.5 scratch range): input blocks that will be
    out of the window by the end of the step get no page of their own and
    share a few scratch slots; ``max_rewind_len`` tokens at the end stay real
    pages so a speculative rewind keeps its KV."""

    max_rewind_len: int = 0

    def __post_init__(self):
        if not isinstance(self.max_rewind_len, int) or isinstance(self.max_rewind_len, bool) or self.max_rewind_len < 0:
            raise ConfigError(f"SwaScratchReuse.max_rewind_len must be a non-negative int, got {self.max_rewind_len!r}")


@dataclass(frozen=True)
class LifeCycle:
    """The reuse rule of one life cycle, as stored in the kernels' tables."""

    kind: int
    window: int  # 0 when the kind has no window
    num_sink_blocks: int

    @property
    def is_attention(self) -> bool:
        return not is_checkpoint(self.kind)

    def stale_range(self, history: int, tokens_per_block: int) -> tuple[int, int]:
        """Blocks ``[start, end)`` an endpoint at ``history`` does not read (§1.5);
        the host twin of ``kernels/lifecycle.py``."""
        T = tokens_per_block
        if is_checkpoint(self.kind):
            return 0, history // T
        start = min(-(-history // T), self.num_sink_blocks)
        if not has_window(self.kind):
            return start, start
        # The +1: attention runs for at least the token at position `history`,
        # so the live window is [history + 1 - W, history].
        return start, max(start, (history + 1 - self.window) // T)


def life_cycle_of(spec: LayerSpec, tokens_per_block: int) -> LifeCycle:
    if isinstance(spec, Ssm):
        return LifeCycle(KIND_SSM, 0, 0)
    if spec.window is None:
        return LifeCycle(KIND_FULL, 0, 0)
    return LifeCycle(KIND_SWA, spec.window, math.ceil(spec.sink_tokens / tokens_per_block))


@dataclass(frozen=True)
class CacheConfig:
    tokens_per_block: int = 32
    layers: Sequence[LayerSpec] = field(default_factory=lambda: (Attention(),))
    pages_per_life_cycle: int | Sequence[int] = 4096
    page_bytes: int = 0
    enable_partial_reuse: bool = True
    commit_min_snapshot: bool = False
    # A page a cache has reported (``page_indices``) stays its own until it
    # closes: a committed full block that the tree holds already keeps the
    # cache's page instead of switching to the tree's (for engines whose
    # block tables only ever append, e.g. vLLM's).
    stable_pages: bool = False
    reuse_match_backoff: int = 0
    max_kv_event_entries: int = 0
    backend: str = "auto"
    host_pages_per_life_cycle: int | Sequence[int] = 0
    swa_scratch_reuse: SwaScratchReuse | None = None
    event_hash: str = "sha256"  # block hashes in events: "sha256" (hex) or "sha256_64" (unsigned int)
    # Block rows of the index, allocated at construction: the tables never
    # grow (a call that would need more rows is refused). None: start small
    # and grow by doubling.
    max_blocks: int | None = None
    # Compute each block's SHA-256 chain digest as the block is created. KV
    # cache events and the tree's block handles name blocks by it; matching
    # and reuse do not read it (they key on a 64-bit chain key and compare
    # tokens). Off, a commit skips the hashing, a third to a half of its
    # device time per block; events need it on.
    block_digests: bool = True
    # Without max_blocks: block rows to start with (rounded up to a power of
    # two), still growing by doubling past them. An engine that knows its
    # steady state (about a block per full-attention page) pays no doubling
    # while it serves. None: a small start.
    initial_blocks: int | None = None

    def __post_init__(self):
        if isinstance(self.layers, (str, bytes)) or not hasattr(self.layers, "__iter__"):
            raise ConfigError(f"layers must be a sequence of gpukv.Attention / gpukv.Ssm, got {self.layers!r}")
        object.__setattr__(self, "layers", tuple(self.layers))
        self.validate()

    # -- validation ------------------------------------------------------
    def validate(self):
        def positive_int(name, v, minimum=1):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < minimum:
                raise ConfigError(f"{name} must be an int >= {minimum}, got {v!r}")

        positive_int("tokens_per_block", self.tokens_per_block)
        if self.tokens_per_block > 4096:
            raise ConfigError(f"tokens_per_block must be at most 4096, got {self.tokens_per_block}")
        if not self.layers:
            # No layer means no KV at all: every match would report reuse of nothing.
            raise ConfigError("layers must hold at least one gpukv.Attention or gpukv.Ssm")
        for i, spec in enumerate(self.layers):
            if not isinstance(spec, (Attention, Ssm)):
                raise ConfigError(f"layers[{i}] must be gpukv.Attention or gpukv.Ssm, got {spec!r}")
        for name, minimum in (("pages_per_life_cycle", 1), ("host_pages_per_life_cycle", 0)):
            v = getattr(self, name)
            # A list, tuple or 1-D array only: a generator would be used up by
            # this check, and a dict or set has no order of life cycles.
            if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
                per = [v]
            elif isinstance(v, (list, tuple)) or (isinstance(v, np.ndarray) and v.ndim == 1):
                per = list(v)
                if len(per) != len(self.life_cycles):
                    raise ConfigError(
                        f"{name} must be an int or one int per life cycle ({len(self.life_cycles)}), got {v!r}"
                    )
            else:
                raise ConfigError(
                    f"{name} must be an int or a list of one int per life cycle ({len(self.life_cycles)}), got {v!r}"
                )
            for x in per:
                positive_int(name, x, minimum=minimum)
        positive_int("page_bytes", self.page_bytes, minimum=0)
        positive_int("reuse_match_backoff", self.reuse_match_backoff, minimum=0)
        if self.reuse_match_backoff > MAX_TOKEN_ID:  # the kernels hold it in 64 bits
            raise ConfigError(f"reuse_match_backoff must be at most {MAX_TOKEN_ID}, got {self.reuse_match_backoff!r}")
        if not isinstance(self.max_kv_event_entries, (int, np.integer)) or isinstance(self.max_kv_event_entries, bool):
            raise ConfigError(f"max_kv_event_entries must be an int, got {self.max_kv_event_entries!r}")
        for name in ("enable_partial_reuse", "commit_min_snapshot", "stable_pages", "block_digests"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.max_kv_event_entries > 0 and not self.block_digests:
            raise ConfigError("KV cache events name blocks by their SHA-256 digests: max_kv_event_entries > 0 "
                              "needs block_digests=True")
        if self.swa_scratch_reuse is not None and not isinstance(self.swa_scratch_reuse, SwaScratchReuse):
            raise ConfigError(f"swa_scratch_reuse must be None or gpukv.SwaScratchReuse, got {self.swa_scratch_reuse!r}")
        if self.event_hash not in EVENT_HASHES:
            raise ConfigError(f"event_hash must be one of {EVENT_HASHES}, got {self.event_hash!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.max_blocks is not None:
            positive_int("max_blocks", self.max_blocks, minimum=MIN_MAX_BLOCKS)
        if self.initial_blocks is not None:
            positive_int("initial_blocks", self.initial_blocks)
            if self.max_blocks is not None:
                raise ConfigError("initial_blocks is for tables that grow: with max_blocks they start at max_blocks")
        if self.ssm_life_cycle_id is not None and not self.commit_min_snapshot:
            raise ConfigError("commit_min_snapshot must be True when an Ssm layer exists")

    # -- the life-cycle registry (§1.5) ------------------------------------
    @property
    def life_cycle_specs(self) -> tuple[LayerSpec, ...]:
        """The distinct layer specs by life-cycle id (first appearance order)."""
        seen: dict[LifeCycle, LayerSpec] = {}
        for spec in self.layers:
            seen.setdefault(life_cycle_of(spec, self.tokens_per_block), spec)
        return tuple(seen.values())

    @cached_property  # read by every call's checks: built once (the fields are frozen)
    def life_cycles(self) -> tuple[LifeCycle, ...]:
        seen: dict[LifeCycle, None] = {}
        for spec in self.layers:
            seen.setdefault(life_cycle_of(spec, self.tokens_per_block), None)
        return tuple(seen)

    @cached_property
    def ssm_life_cycle_id(self) -> int | None:
        for i, lc in enumerate(self.life_cycles):
            if is_checkpoint(lc.kind):
                return i
        return None

    def pages_per_life_cycle_list(self, host: bool = False) -> list[int]:
        v = self.host_pages_per_life_cycle if host else self.pages_per_life_cycle
        if isinstance(v, (int, np.integer)):
            return [int(v)] * len(self.life_cycles)
        return [int(x) for x in v]

    def life_cycle_arrays(self):
        """(kind, window, num_sink_blocks) int64 arrays, index = life-cycle id."""
        lcs = self.life_cycles
        return (
            np.array([lc.kind for lc in lcs], dtype=np.int64),
            np.array([lc.window for lc in lcs], dtype=np.int64),
            np.array([lc.num_sink_blocks for lc in lcs], dtype=np.int64),
        )

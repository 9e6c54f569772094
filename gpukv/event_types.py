"""The KV cache events gpukv emits, as data (docs/semantics.md §4).

Names and fields are the reference event manager's; sequences are tuples, so
an event is immutable once queued. ``events.KVCacheEventManager`` builds them
from the tree's change log, ``zmq_events`` publishes them in vLLM's format.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from .core.scope import ReuseScope

__all__ = [
    "HASH_ALGOS",
    "NO_WINDOW",
    "Diff",
    "EventData",
    "EventHash",
    "KVCacheCreatedData",
    "KVCacheEvent",
    "KVCacheRemovedData",
    "KVCacheStoredBlockData",
    "KVCacheStoredData",
    "KVCacheUpdatedData",
    "UniqueToken",
    "event_block_hash",
]

# The window size reported for a layer group without a sliding window (full
# attention, SSM) and for events of no layer group: 0, the reference event
# manager's default. ``[lc.window for lc in config.life_cycles]`` is therefore
# the ``window_sizes`` list of a config (LifeCycle.window is 0 without a window).
NO_WINDOW = 0

# config.event_hash -> the ``hash_algo`` named in every event.
HASH_ALGOS = {"sha256": "v2_sha256", "sha256_64": "v2_sha256_64"}

EventHash = str | int


@dataclass(frozen=True)
class UniqueToken:
    """A token of a stored block: an int token id, or the lowercase hex string
    of a 32-byte multimodal digest token."""

    token_id: int | str
    token_extra_id: int = 0


@dataclass(frozen=True)
class KVCacheCreatedData:
    num_blocks_per_cache_level: tuple[int, ...]


@dataclass(frozen=True)
class KVCacheStoredBlockData:
    block_hash: EventHash
    tokens: tuple[UniqueToken, ...]  # the block's full token list
    cache_level: int  # of the announced life cycle's page: 0 = GPU, 1 = host
    priority: int
    mm_keys: tuple[str, ...] = ()  # hex digests of its multimodal tokens, first appearance order
    cache_salt: str | None = None

    # A block the event manager makes may hold, instead of ``tokens``, the
    # token rows of its launch and its row there (``make_stored_block_of_row``):
    # the tuple of UniqueTokens is made when ``tokens`` is first read, and
    # kept. A consumer that reads the ids instead (``token_ids``), or nothing,
    # never makes it. Equality, hashing, repr and ``dataclasses`` read the
    # attribute, so they see the tuple; pickling and copying carry it too
    # (``__getstate__``), never the launch's rows.
    def __getattr__(self, name: str):
        state = self.__dict__
        if name == "tokens" and "_token_rows" in state:
            tokens = state["tokens"] = state["_token_rows"].tokens(state["_token_row"])
            return tokens
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __getstate__(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class KVCacheStoredData:
    parent_hash: EventHash | None  # None for a block directly under a scope root
    blocks: tuple[KVCacheStoredBlockData, ...]
    # The reuse scope of the chain; None for the default scope. Not part of
    # the reference's event: a publisher for routers needs it (LoRA name).
    scope: ReuseScope | None = None

    # An event the event manager makes may hold, instead of ``blocks``, a
    # run of its launch's stored blocks (``make_stored_data_of``): the tuple
    # is made when ``blocks`` is first read, and kept, as a stored block's
    # ``tokens`` is (see KVCacheStoredBlockData).
    def __getattr__(self, name: str):
        state = self.__dict__
        if name == "blocks" and "_blocks_of" in state:
            source, start, stop, step = state["_blocks_of"]
            blocks = state["blocks"] = source.blocks(start, stop, step)
            return blocks
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __getstate__(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class KVCacheRemovedData:
    block_hashes: tuple[EventHash, ...]


@dataclass(frozen=True)
class Diff:
    old_value: int
    new_value: int


@dataclass(frozen=True)
class KVCacheUpdatedData:
    block_hash: EventHash
    cache_level: Diff | None
    priority: Diff | None


EventData = KVCacheCreatedData | KVCacheStoredData | KVCacheRemovedData | KVCacheUpdatedData


@dataclass(frozen=True)
class KVCacheEvent:
    event_id: int  # increasing in queue order
    data: EventData
    window_size: int
    hash_algo: str
    attention_dp_rank: int = 0
    layer_group_id: int | None = None  # the life-cycle id; None for the created event


# -- makers for the event manager ---------------------------------------------
# A frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``,
# which costs as much as the rest of what the event manager does for an event.
# These make the same objects (equal, hashing alike, the same repr,
# ``dataclasses`` functions and pickling: every field lives in the instance
# ``__dict__``, as the constructor leaves it) by storing into a new
# instance's ``__dict__``, field by field in the class's order (the dict then
# shares its keys with the class's other instances). No class here defines
# ``__post_init__``, so they skip nothing the constructor does.
_new = object.__new__


def make_stored_block(block_hash: EventHash, tokens: tuple, cache_level: int, priority: int,
                      mm_keys: tuple) -> KVCacheStoredBlockData:
    """``KVCacheStoredBlockData(block_hash, tokens, cache_level, priority, mm_keys)``."""
    block = _new(KVCacheStoredBlockData)
    state = block.__dict__
    state["block_hash"] = block_hash
    state["tokens"] = tokens
    state["cache_level"] = cache_level
    state["priority"] = priority
    state["mm_keys"] = mm_keys
    state["cache_salt"] = None
    return block


def make_stored_block_of_row(block_hash: EventHash, token_rows, row: int, cache_level: int,
                             priority: int) -> KVCacheStoredBlockData:
    """``make_stored_block`` of a block without multimodal tokens whose tokens
    are ``token_rows.tokens(row)``, made when first read, and its token ids
    ``token_rows.token_ids(row)`` (``token_ids``)."""
    block = _new(KVCacheStoredBlockData)
    state = block.__dict__
    state["block_hash"] = block_hash
    state["cache_level"] = cache_level
    state["priority"] = priority
    state["mm_keys"] = ()
    state["cache_salt"] = None
    state["_token_rows"] = token_rows
    state["_token_row"] = row
    return block


def token_ids(block: KVCacheStoredBlockData) -> tuple:
    """The block's token ids (ints, and hex strings for multimodal digest
    tokens), read from its launch's token rows when its UniqueTokens are not
    made (``make_stored_block_of_row``)."""
    state = block.__dict__
    if "tokens" not in state and "_token_rows" in state:
        return state["_token_rows"].token_ids(state["_token_row"])
    return tuple(token.token_id for token in block.tokens)


def stored_columns(data: KVCacheStoredData) -> tuple | None:
    """``(block hashes, token ids, cache levels)`` of a stored event's blocks,
    a list each (token ids: a tuple per block, ints and hex strings), read
    from its launch's columns without making its blocks; None once they are
    made, or when the event never held a run (``make_stored_data_of``)."""
    state = data.__dict__
    run = state.get("_blocks_of")
    if run is None or "blocks" in state:
        return None
    source, start, stop, step = run
    return source.columns(start, stop, step)


def make_stored_data(parent_hash: EventHash | None, blocks: tuple, scope: ReuseScope | None) -> KVCacheStoredData:
    """``KVCacheStoredData(parent_hash, blocks, scope)``."""
    data = _new(KVCacheStoredData)
    state = data.__dict__
    state["parent_hash"] = parent_hash
    state["blocks"] = blocks
    state["scope"] = scope
    return data


def make_stored_data_of(parent_hash: EventHash | None, run: tuple, scope: ReuseScope | None) -> KVCacheStoredData:
    """``make_stored_data`` whose blocks are ``source.blocks(start, stop,
    step)`` for ``run = (source, start, stop, step)``, made when first read."""
    data = _new(KVCacheStoredData)
    state = data.__dict__
    state["parent_hash"] = parent_hash
    state["scope"] = scope
    state["_blocks_of"] = run
    return data


def make_event(event_id: int, data: EventData, window_size: int, hash_algo: str,
               layer_group_id: int | None) -> KVCacheEvent:
    """``KVCacheEvent(event_id, data, window_size, hash_algo, 0, layer_group_id)``."""
    event = _new(KVCacheEvent)
    state = event.__dict__
    state["event_id"] = event_id
    state["data"] = data
    state["window_size"] = window_size
    state["hash_algo"] = hash_algo
    state["attention_dp_rank"] = 0
    state["layer_group_id"] = layer_group_id
    return event


def event_block_hash(key: bytes, event_hash: str) -> EventHash:
    """A block key as events name it.

    ``"sha256"``: the key's lowercase hex. ``"sha256_64"``: the first 8 bytes
    of the key read as a big-endian unsigned int, as the reference's
    ``truncate_sha256_hash_to_int64`` does, so a router that hashes token
    blocks itself gets the same numbers.
    """
    if event_hash == "sha256":
        return key.hex()
    if event_hash == "sha256_64":
        return int.from_bytes(key[:8], "big", signed=False)
    raise ValueError(f"event_hash must be one of {tuple(HASH_ALGOS)}, got {event_hash!r}")

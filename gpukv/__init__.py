"""gpukv: the KV-cache prefix-reuse index of an LLM serving engine, on the GPU.

Token sequences are cut into blocks; a radix tree of blocks, kept as flat
device tables, records which KV pages are cached, one page slot per (block,
life cycle), each page with the number of leading tokens it covers. A scheduler
asks, for a whole batch at once, how many leading tokens of each request are
reusable (``KVCacheManager.match_batch``).

The library prints nothing: what it has to say goes to the ``gpukv`` logger
(``logging.getLogger("gpukv")``), which has no handler of its own, so an
engine's logging configuration decides where it goes. The ``gpukv`` command
prints it on stderr.
"""

import logging

from .arena import TokenSequence
from .cache import KVCache, KVCacheStatus
from .inputs import CacheBatch
from .core.config import Attention, CacheConfig, Ssm, SwaScratchReuse
from .core.errors import (
    BackendError, BusyError, ConfigError, IndexFullError, LogicError, StaleMatchError, TokenError, TreeError,
)
from .event_types import (
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
)
from .core.hashing import gen_multimodal_cache_key_tokens, sequence_to_blockchain_keys
from .core.layout import MAX_CACHES
from .memory import IndexMemory, index_memory
from .manager import KVCacheManager
from .page_memory import PageCopies
from .matching import BatchMatch
from .core.scope import ReuseScope

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "Attention",
    "BackendError",
    "BatchMatch",
    "BusyError",
    "CacheBatch",
    "CacheConfig",
    "ConfigError",
    "IndexFullError",
    "IndexMemory",
    "KVCache",
    "KVCacheCreatedData",
    "KVCacheEvent",
    "KVCacheManager",
    "KVCacheRemovedData",
    "KVCacheStoredBlockData",
    "KVCacheStoredData",
    "KVCacheUpdatedData",
    "KVCacheStatus",
    "LogicError",
    "MAX_CACHES",
    "PageCopies",
    "ReuseScope",
    "Ssm",
    "StaleMatchError",
    "SwaScratchReuse",
    "TokenError",
    "TokenSequence",
    "TreeError",
    "gen_multimodal_cache_key_tokens",
    "index_memory",
    "sequence_to_blockchain_keys",
]

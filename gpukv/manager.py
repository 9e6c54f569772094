"""``KVCacheManager``: the scheduler-facing facade.

It validates input, owns the device tables, the tree and the token arena, and
answers reuse queries for whole batches with one kernel launch per stage.
"""

from __future__ import annotations

from .arena import TokenArena, TokenSequence
from .backend import get_backend, quiet_simulator
from .config import CacheConfig
from .matching import BatchMatch, Matcher
from .tables import Tables
from .tree import BlockTree


class KVCacheManager:
    def __init__(self, config: CacheConfig):
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config must be a gpukv.CacheConfig, got {type(config).__name__}")
        self.config = config
        self._backend = get_backend(config.backend)
        quiet_simulator()
        self._tables = Tables(config, self._backend)
        self._tree = BlockTree(self._tables)
        self._arena = TokenArena(self._backend, config.tokens_per_block, self._tables.intern_digest)
        self._matcher = Matcher(self._tables, self._tree, self._arena, config)

    # -- facts ------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        return self._backend.name

    @property
    def life_cycles(self) -> tuple:
        """The distinct layer specs; index = life-cycle id."""
        return self.config.life_cycle_specs

    @property
    def ssm_life_cycle_id(self) -> int | None:
        return self.config.ssm_life_cycle_id

    @property
    def tokens_per_block(self) -> int:
        return self.config.tokens_per_block

    # -- reuse queries -------------------------------------------------------------------
    def match_batch(self, requests, scopes=None) -> BatchMatch:
        """Reuse results for a whole scheduling batch (semantics.md §2.3-2.4).

        ``requests``: token sequences (lists, 1-D integer arrays or registered
        ``TokenSequence``s), or a pair ``(flat_tokens, offsets)`` with offsets of
        length B+1 (device arrays accepted). ``scopes``: None, one ``ReuseScope``
        for all, or one per request. Holds nothing: the result is volatile.
        """
        return self._matcher.match(requests, scopes)

    def probe_reuse(self, tokens, scope=None) -> int:
        """The reusable prefix length of one token sequence; holds nothing."""
        m = self._matcher.match([tokens], scope)
        return int(self._backend.to_host(m.num_tokens)[0])

    def token_sequence(self, tokens=None) -> TokenSequence:
        """A sequence registered in the device arena (see ``TokenSequence``)."""
        seq = TokenSequence(self._arena)
        if tokens is not None:
            seq.extend(tokens)
        return seq

    # -- maintenance -----------------------------------------------------------------------
    def clear_reusable_blocks(self):
        """Drop every block of the reuse tree."""
        self._tree.clear()

    def shutdown(self):
        self.clear_reusable_blocks()

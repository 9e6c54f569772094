"""A plain-Python model of the KV cache manager's *sequence layer*, on top of the
block-radix-tree oracle in ``tests/support/oracle.py``, written to follow
``docs/semantics.md`` literally.

It is the reference for differential tests of gpukv's ``KVCacheManager`` /
``KVCache``: the same operations replayed here and on the real implementation must
give the same reuse lengths, the same tree (blocks and per-life-cycle coverages),
the same page presence per sequence block, and the same answers to the test hooks.
It is written for clarity, not speed, and imports nothing from ``gpukv``.

Section references (§) are to docs/semantics.md.

What is modelled
----------------
- ``KVOracle`` (the manager): one ``Oracle`` tree (§1.3-§2.7), one GPU page pool
  per life cycle with a fixed number of pages (allocation can fail: OOM), the
  eviction controller of §2.11 reduced to one cache level (a droppable committed
  page is scheduled; allocation evicts the least recently scheduled one of that
  life cycle, which drops it: it dies and the tree cleanup of §2.7 runs), reuse
  scopes, ``probe_reuse``, ``create_kv_cache`` (§2.6 reuse setup, holding the
  matched pages at once), ``clear_reusable_blocks`` (§2.7).
- ``KVSeq`` (one sequence's ``_KVCache``, §1.6): holders vs locks (§2.8: LOCK while
  ACTIVE, HOLD while SUSPENDED), ``resize`` with stale-page release
  (``_unlock_stale_blocks``, §2.10), ``commit`` / ``commit_block`` with the rebase
  path / ``snapshot_partial`` / ``copy_page_to_tree`` / ``snapshot_ssm`` /
  ``stop_committing`` / ``on_stop_committing`` (§2.5), the first resume's private
  copies (§2.6), planned drops (§2.9), and the introspection hooks
  ``page_indices`` and ``committed_page_is_linked`` (§5).
- Page DATA: every page carries ``data``, a dict {token position in block: value}
  (for an SSM page: {absolute position of the last consumed token: value}); the
  fake engine ``write_tokens`` writes ``token_value(lc, pos, tokens[:pos + 1])``
  into the pages a sequence owns; every copy copies the dict; ``verify_reuse``
  checks that a reused sequence sees the right values (invariant 15, scenario P3).

Not modelled: SWA scratch reuse
(``swa_scratch_reuse``, §1.5/§2.10, scenarios D6/D7), beams (width 1 only),
colder cache levels (host/disk) and migration, priorities (all pages have the
default priority, so eviction is plain LRU), KV cache events (§4) and statistics
(M2/M3), and the implicit "destroying an undropped plan applies the drop".

Choices where docs/semantics.md is silent or ambiguous
-------------------------------------------------
1. ``commit()`` raises the history to ``N1`` in every commit state. The pseudo-code
   skips it under VIRTUAL_STOP, which would break invariant 11
   (``num_committed_tokens <= history_length``); the reference code (pre-PR
   ``_kv_cache.py``) raises it unconditionally after extending the tokens. As in the
   pseudo-code, VIRTUAL_STOP is turned into USER_STOP inside ``commit_block``, so it
   is never observable after a call; ``KVSeq.virtual_stopped`` records that it
   happened (scenarios D8/E12 talk about "ending in VIRTUAL_STOP").
2. A commit that would make the history exceed the capacity raises ``ValueError``
   before any change (the history setter is ``resize(None, N1)``).
3. ``resize``, ``commit`` and ``suspend`` need ACTIVE, ``resume`` needs SUSPENDED
   (the reference asserts this); violations raise ``LogicError``.
4. Allocation is all-or-nothing per call: it first checks that every life cycle has
   enough free + evictable pages, and only then evicts (so a failed call changes
   nothing). ``copy_page_to_tree`` allocates through the same allocator, so it may
   evict; when even eviction cannot give a page, the copy is skipped silently.
   Free pages are handed out lowest index first. Page ids (``page_indices``,
   ``reuse_match_pages``) are these pool indices; they are NOT part of a
   differential contract (compare presence, coverage and identity relations).
5. Release order, which fixes the LRU order of pages scheduled together: a block
   torn down (close, capacity shrink) releases its life cycles in descending id
   order, last block first (CPython list teardown in the reference);
   ``_unlock_stale_blocks`` releases its collected pages in reverse collection
   order at the end of ``resize`` (the reference keeps them in a backup list until
   ``resize`` returns); everything else releases in ascending life-cycle order.
6. A sequence's committed ``tree_block`` can be an orphan (§7.19). Before
   committing under it, ``_tree_parent`` re-attaches the chain as the newer C++ does
   (PR #18095): ``add_or_get(parent, orphan.tokens)`` and ``_adopt_pages_from`` the
   orphan (pages it cannot adopt stay in the orphan and are released with it). The
   stored Python reference would attach under the orphan instead; the tree oracle
   refuses that (§7.19), and it is unreachable unless every life cycle of an
   ancestor block lost its page (SWA/SSM-only configs under eviction).
7. Invariant 14's carve-out for the stale range of an uncommitted block while
   commits are ALLOWED is read loosely: the entry is a HOLD or empty (a block that
   was stale when allocated never gets a page, whatever was committed since).
8. In a rebase the sequence's new entry on the tree page keeps the kind the old
   entry had (LOCK while ACTIVE); commit needs ACTIVE, so it is always a lock.
9. ``plan_committed_block_drop`` needs USER_STOP (also after close).
"""

from __future__ import annotations

import enum
import heapq
from collections import Counter
from contextlib import contextmanager
from itertools import chain
from typing import Optional

from tests.support import oracle as O

FULL, SWA, SSM = O.FULL, O.SWA, O.SSM
LifeCycle = O.LifeCycle

LOCK, HOLD = "lock", "hold"


class Status(enum.Enum):
    ACTIVE = "ACTIVE"
    SUSPENDED = "SUSPENDED"
    CLOSED = "CLOSED"


class CommitState(enum.Enum):
    ALLOWED = "ALLOWED"
    VIRTUAL_STOP = "VIRTUAL_STOP"
    USER_STOP = "USER_STOP"


class LogicError(RuntimeError):
    """A call that is not allowed in the current state (the reference's LogicError)."""


def token_value(lc: int, pos: int, prefix) -> int:
    """The value the fake engine writes for life cycle ``lc`` at absolute token
    position ``pos``; ``prefix`` is every token up to and including ``pos``."""
    return hash((lc, pos, tuple(prefix)))


# ---------------------------------------------------------------------------
# Pages and sequence entries (§1.4, §1.6)
# ---------------------------------------------------------------------------


def evictable(committed: bool, holders: int, locked: bool, level: int = 0, last_level: int = 0) -> bool:
    """§2.11: (droppable and committed) or (held and not at the last level,
    committed or not); a locked page never is. With the single cache level
    modelled here (``level == last_level == 0``) only droppable committed pages
    qualify; a held page, committed or not, would migrate to a colder level."""
    if locked:
        return False
    if holders == 0:
        return committed
    return level < last_level


class UncommittedPage:
    """§1.4 UncommittedPage: private to one sequence, never in the tree. It dies at
    once when the sequence drops it (an uncommitted droppable page is never
    scheduled, §2.11; a held one is evictable only above the last level, which
    this single-level model has not). ``committed_as`` is set when it became a
    CommittedPage (the same pool slot and data, now an ``O.Page``)."""

    def __init__(self, page_id: int, lc: int, slot: int, owner: "KVSeq"):
        self.id = page_id
        self.lc = lc
        self.slot = slot
        self.owner = owner
        self.data: dict = {}
        self.alive = True
        self.committed_as = None

    def __repr__(self) -> str:
        return f"UncommittedPage(id={self.id}, lc={self.lc}, slot={self.slot}, alive={self.alive})"


def is_committed_page(page) -> bool:
    return isinstance(page, O.Page)


class Entry:
    """One reference a sequence has on a page: a LOCK (while ACTIVE) or a HOLD
    (while SUSPENDED, or a stale page kept only so it can be committed later). Both
    count as one holder of the page (``O.Page.holders``)."""

    __slots__ = ("page", "kind")

    def __init__(self, page, kind: str):
        self.page = page
        self.kind = kind

    def __repr__(self) -> str:
        return f"Entry({self.kind}, {self.page!r})"


class SeqBlock:
    """§1.6 SeqBlock: one entry per life cycle (SSM entries always None) and the
    tree block this ordinal is committed as (None = uncommitted)."""

    def __init__(self, num_life_cycles: int, tree_block=None):
        self.pages: list[Optional[Entry]] = [None] * num_life_cycles
        self.tree_block = tree_block

    def __repr__(self) -> str:
        return f"SeqBlock(tree_block={self.tree_block!r}, pages={self.pages!r})"


class _Tree(O.Oracle):
    """The tree oracle with the manager's hooks: page death frees the pool slot and
    leaves the eviction queue; a committed page whose last holder goes and that
    survives is scheduled for eviction; a held page leaves the queue (with a single
    cache level a HELD page is never evictable, §2.11)."""

    def __init__(self, manager: "KVOracle", tokens_per_block: int, life_cycles: list):
        super().__init__(tokens_per_block, life_cycles)
        self._manager = manager

    def page_death(self, page: O.Page) -> None:
        self._manager._on_page_death(page)
        super().page_death(page)

    def hold(self, page: O.Page) -> None:
        super().hold(page)
        self._manager._unschedule(page)

    def release(self, page: O.Page) -> None:
        super().release(page)
        if page.alive and page.holders == 0:
            self._manager._schedule(page)


class PlannedDrop:
    """§2.9 PlannedDropHandle. ``drop()`` applies it once; a second call raises."""

    def __init__(self, manager: "KVOracle", pages: list):
        self._manager = manager
        self.pages = pages  # the reference keeps weak refs: dead pages are skipped
        self.dropped = False

    def drop(self) -> None:
        if self.dropped:
            raise RuntimeError("This planned drop has already been dropped")
        self.dropped = True
        mgr = self._manager
        for page in self.pages:
            if not page.alive:
                continue
            assert page.planned_drop_count > 0
            page.planned_drop_count -= 1
            # Only a page that is droppable and scheduled right now dies (§2.9: the
            # C++ mirror does not drop a page that is still held when the count hits 0).
            if page.planned_drop_count == 0 and page.holders == 0 and page.id in mgr._lru[page.lc]:
                mgr.counters["planned_drop_killed"] += 1
                mgr.tree.page_death(page)
                mgr._gc()


# ---------------------------------------------------------------------------
# The manager
# ---------------------------------------------------------------------------


class KVOracle:
    """The KV cache manager: a tree, page pools, eviction, open caches.

    ``pages_per_life_cycle`` is an int or one int per life cycle. ``evict=False``
    turns the eviction controller off (a droppable tree page then keeps its slot
    until it dies otherwise)."""

    def __init__(
        self,
        tokens_per_block: int,
        life_cycles,
        pages_per_life_cycle,
        enable_partial_reuse: bool = True,
        commit_min_snapshot: bool = False,
        reuse_match_backoff: int = 0,
        evict: bool = True,
        stable_pages: bool = False,
    ):
        life_cycles = list(life_cycles)
        assert all(isinstance(lc, LifeCycle) for lc in life_cycles)
        assert len(set(life_cycles)) == len(life_cycles), "life cycles are identified by value (§1.5)"
        self.T = tokens_per_block
        self.life_cycles = life_cycles
        self.tree = _Tree(self, tokens_per_block, life_cycles)
        self.ssm_lc: Optional[int] = self.tree.ssm_lc
        # §1.7 / M19: commit_min_snapshot is required (by assertion) with an SSM layer.
        assert self.ssm_lc is None or commit_min_snapshot, "commit_min_snapshot is required when an SSM life cycle exists"
        assert reuse_match_backoff >= 0
        self.enable_partial_reuse = bool(enable_partial_reuse)
        self.commit_min_snapshot = bool(commit_min_snapshot)
        self.reuse_match_backoff = int(reuse_match_backoff)
        self.evict = bool(evict)
        self.stable_pages = bool(stable_pages)
        n = len(life_cycles)
        if isinstance(pages_per_life_cycle, int):
            pages_per_life_cycle = [pages_per_life_cycle] * n
        self.num_pages = [int(x) for x in pages_per_life_cycle]
        assert len(self.num_pages) == n and all(x >= 0 for x in self.num_pages)
        self._free: list[list[int]] = [list(range(x)) for x in self.num_pages]  # min-heaps
        self._slot_owner: list[dict] = [{} for _ in range(n)]  # slot -> live page using it
        self._lru: list[dict] = [{} for _ in range(n)]  # page id -> page, least recently scheduled first
        self._upages: dict[int, UncommittedPage] = {}
        self._next_upage_id = 0
        self._caches: list[KVSeq] = []  # open (not CLOSED) caches, in creation order
        # Blocks an operation in progress refers to (the reference's local variables:
        # an orphan is not destroyed before the operation returns).
        self._pinned: list = []
        # How often each notable path ran (for coverage checks of random workloads).
        self.counters: Counter = Counter()

    # -- public API -----------------------------------------------------------------

    @property
    def num_life_cycles(self) -> int:
        return len(self.life_cycles)

    @property
    def open_caches(self) -> list:
        return list(self._caches)

    def match(self, tokens, scope=None) -> O.Match:
        """The manager's match (§2.4): partial matching per the config, with backoff."""
        return self.tree.match(scope, list(tokens), self.enable_partial_reuse, self.reuse_match_backoff)

    def probe_reuse(self, tokens, scope=None) -> int:
        """§2.4: ``match(...).num_tokens``; holds nothing."""
        return self.match(tokens, scope).num_tokens

    def create_kv_cache(self, input_tokens=None, scope=None) -> "KVSeq":
        """§2.6: a new SUSPENDED cache; with ``input_tokens``, the same match as
        ``probe_reuse`` and the matched pages held at once."""
        seq = KVSeq(self, scope)
        if input_tokens is not None:
            seq._setup_for_reuse(self.match(input_tokens, scope))
        self._caches.append(seq)
        return seq

    def clear_reusable_blocks(self) -> None:
        """§2.7: clear the tree; refused (and nothing changes) while caches are open."""
        n = len(self._caches)
        if n:
            raise LogicError(f"clear_reusable_blocks(): {n} KV cache(s) still open")
        self.tree.clear()
        self._gc()

    def reuse_match_pages(self, tokens, lc: int, scope=None, enable_partial: bool = False):
        """§5 hook: the pruned match without backoff; ``(num_tokens, pages)`` with
        ``pages[i]`` None or ``(page id, coverage)`` for matched block ``i``."""
        m = self.tree.match(scope, list(tokens), enable_partial, 0)
        return m.num_tokens, [None if b.slots[lc] is None else (b.slots[lc].slot, b.slots[lc].coverage) for b in m.blocks]

    def shutdown(self) -> None:
        """Clear the tree for good; refused (and nothing changes) while caches are open."""
        n = len(self._caches)
        if n:
            raise LogicError(f"shutdown(): {n} KV cache(s) still open")
        self.tree.clear()
        self._gc()

    def page_at(self, lc: int, slot: int):
        """The live page (committed or not) that uses pool slot ``slot`` of ``lc``."""
        return self._slot_owner[lc][slot]

    def free_pages(self, lc: int) -> int:
        return len(self._free[lc])

    def evictable_pages(self, lc: int) -> int:
        return len(self._lru[lc])

    # -- pages, pools and the eviction controller ----------------------------------

    def _schedule(self, page: O.Page) -> None:
        """§2.8: schedule a droppable committed page (no-op if already scheduled)."""
        assert page.alive and evictable(True, page.holders, False)
        self._lru[page.lc].setdefault(page.id, page)  # scheduled either way; ``evict`` only gates eviction

    def _unschedule(self, page: O.Page) -> None:
        self._lru[page.lc].pop(page.id, None)

    def _on_page_death(self, page: O.Page) -> None:
        self._unschedule(page)
        slot = getattr(page, "slot", None)
        if slot is not None and self._slot_owner[page.lc].get(slot) is page:
            del self._slot_owner[page.lc][slot]
            heapq.heappush(self._free[page.lc], slot)

    def _alloc(self, counts) -> Optional[list]:
        """All-or-nothing: ``counts[lc]`` fresh slots per life cycle, evicting the
        least recently scheduled droppable pages of that life cycle when there are not
        enough free ones. None (and no change) when even eviction is not enough."""
        counts = list(counts)
        if not any(counts):
            return [[] for _ in counts]
        self._gc()
        for lc, n in enumerate(counts):
            available = len(self._free[lc]) + (len(self._lru[lc]) if self.evict else 0)
            if n > available:
                return None
        out = []
        for lc, n in enumerate(counts):
            while len(self._free[lc]) < n:
                victim = next(iter(self._lru[lc].values()))
                self.counters["evicted"] += 1
                self.tree.page_death(victim)  # dropped from the last level: dies, tree cleanup runs
                self._gc()
            out.append([heapq.heappop(self._free[lc]) for _ in range(n)])
        return out

    def _new_upage(self, lc: int, slot: int, owner: "KVSeq") -> UncommittedPage:
        page = UncommittedPage(self._next_upage_id, lc, slot, owner)
        self._next_upage_id += 1
        self._upages[page.id] = page
        assert slot not in self._slot_owner[lc]
        self._slot_owner[lc][slot] = page
        return page

    def _kill_upage(self, page: UncommittedPage) -> None:
        assert page.alive
        page.alive = False
        del self._upages[page.id]
        if self._slot_owner[page.lc].get(page.slot) is page:
            del self._slot_owner[page.lc][page.slot]
            heapq.heappush(self._free[page.lc], page.slot)

    def _new_committed(self, lc: int, coverage: int, slot: int, data: dict) -> O.Page:
        page = self.tree.new_page(lc, coverage)
        page.slot = slot
        page.data = data
        page.planned_drop_count = 0
        self._slot_owner[lc][slot] = page
        return page

    def _commit_upage(self, page: UncommittedPage, coverage: int) -> O.Page:
        """Convert an uncommitted page into a CommittedPage: same slot, same data."""
        assert page.alive
        page.alive = False
        del self._upages[page.id]
        del self._slot_owner[page.lc][page.slot]
        committed = self._new_committed(page.lc, coverage, page.slot, page.data)
        page.committed_as = committed
        return committed

    def _hold(self, page: O.Page) -> None:
        self.tree.hold(page)

    def _release_entry(self, entry: Entry) -> None:
        """A sequence drops one lock/holder (§2.8)."""
        page = entry.page
        if isinstance(page, UncommittedPage):
            self._kill_upage(page)  # an uncommitted droppable page dies at once
        else:
            self.tree.release(page)  # dies if unlinked / orphaned, else is scheduled

    def _copy_page_to_tree(self, tb: O.Block, lc: int, src, coverage: int):
        """§2.5.2 ``copy_page_to_tree``: only when strictly wider; allocation failure
        skips silently; the replacement happens after the copy."""
        if not self.tree.can_replace_page(tb, lc, coverage):
            return tb.slots[lc]
        one = [0] * self.num_life_cycles
        one[lc] = 1
        slots = self._alloc(one)
        if slots is None:
            self.counters["copy_skipped_oom"] += 1
            return None
        self.counters["copied_to_tree"] += 1
        page = self._new_committed(lc, coverage, slots[lc][0], dict(src.data))
        if self.tree.can_replace_page(tb, lc, coverage):
            self.tree.replace_page(tb, lc, page)
            self._schedule(page)
        else:  # pragma: no cover - eviction cannot make a slot wider
            self.tree.page_death(page)
        return page

    # -- block lifetime (orphans) ------------------------------------------------

    def _kept_blocks(self) -> list:
        kept = [sb.tree_block for seq in self._caches for sb in seq._blocks if sb.tree_block is not None]
        return kept + self._pinned

    @contextmanager
    def _pin(self, block):
        """Keep ``block`` alive (not destroyed if it becomes an orphan) for the
        duration of an operation, like the reference's local variable does."""
        self._pinned.append(block)
        try:
            yield block
        finally:
            self._pinned.pop()

    def _gc(self) -> None:
        """Destroy every orphan no open sequence references (CPython frees it at
        once in the reference): its droppable pages die (§2.1 ``_release_pages``)."""
        self.tree.release_orphans(keep=self._kept_blocks())

    # -- checks ------------------------------------------------------------------------

    def check_sanity(self) -> None:
        """Tree invariants 1-7 and 10, pool accounting, holder counts, the eviction
        queue, and every open cache's invariants 11-14."""
        self.tree.check_sanity()
        kept = {id(b) for b in self._kept_blocks()}
        refs = Counter()
        for seq in self._caches:
            for entry in seq._entries():
                refs[id(entry.page)] += 1
        for lc in range(self.num_life_cycles):
            owners = self._slot_owner[lc]
            free = set(self._free[lc])
            assert len(free) == len(self._free[lc]), "a free slot is listed twice"
            assert not (free & set(owners)), "a slot is both free and used"
            assert len(free) + len(owners) == self.num_pages[lc], "every slot is free or used"
            for slot, page in owners.items():
                assert page.alive and page.slot == slot and page.lc == lc
            for pid, page in self._lru[lc].items():
                assert page.alive and page.holders == 0 and page.id == pid
        for page in self.tree.pages.values():
            if not page.alive:
                continue
            assert self._slot_owner[page.lc].get(page.slot) is page, "a live committed page owns its slot"
            assert page.holders == refs[id(page)], f"holders of {page!r} = sequence references"
            scheduled = page.id in self._lru[page.lc]
            if page.holders == 0:
                assert page.block is not None, "a droppable committed page is linked (else it died)"
                assert page.block.prev is not None or id(page.block) in kept, "a droppable page's orphan block is gone"
                assert scheduled, "a droppable committed page is scheduled for eviction"
            else:
                assert not scheduled, "a held page is not evictable with a single cache level"
        for page in self._upages.values():
            assert page.alive and page.owner.status is not Status.CLOSED
            assert refs[id(page)] == 1, "an uncommitted page has exactly one entry"
            assert self._slot_owner[page.lc].get(page.slot) is page
        for seq in self._caches:
            seq.check_sanity()


# ---------------------------------------------------------------------------
# A sequence's KV cache
# ---------------------------------------------------------------------------


class KVSeq:
    """One sequence's KV cache (§1.6, §2.5, §2.6, §2.8-§2.10). Beam width 1."""

    def __init__(self, manager: KVOracle, scope=None):
        self.mgr = manager
        self.scope = O.normalize_scope(scope)
        self.T = manager.T
        self._status = Status.SUSPENDED
        self._commit_state = CommitState.ALLOWED
        self._blocks: list[SeqBlock] = []
        self._ssm: Optional[Entry] = None  # _ssm_blocks[0][ssm_lc]
        self._committed_tokens: list = []
        self._ncb = 0  # num_committed_blocks
        self._history = 0
        self._capacity = 0
        self._never_resumed = True
        self.virtual_stopped = False  # a commit_block ended in VIRTUAL_STOP (then USER_STOP)
        self.reuse_match: Optional[O.Match] = None
        self.reuse_length = 0
        self.reuse_tokens: list = []
        self._engine_tokens: list = []  # what the fake engine has written, by position

    # -- read-only state -------------------------------------------------------------

    @property
    def status(self) -> Status:
        return self._status

    @property
    def commit_state(self) -> CommitState:
        return self._commit_state

    @property
    def num_committed_tokens(self) -> int:
        return len(self._committed_tokens)

    @property
    def committed_tokens(self) -> list:
        return list(self._committed_tokens)

    @property
    def num_committed_blocks(self) -> int:
        return self._ncb

    @property
    def history_length(self) -> int:
        return self._history

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def never_resumed(self) -> bool:
        return self._never_resumed

    @property
    def num_tokens_before_pruning(self) -> int:
        return 0 if self.reuse_match is None else self.reuse_match.num_tokens_before_pruning

    @property
    def num_tokens_before_hybrid_pruning(self) -> int:
        return 0 if self.reuse_match is None else self.reuse_match.num_tokens_before_hybrid_pruning

    def tree_blocks(self) -> list:
        """``_blocks[o].tree_block`` per ordinal (None = uncommitted)."""
        return [sb.tree_block for sb in self._blocks]

    def page_indices(self, lc: int) -> list:
        """Page id per block for ``lc``, -1 for none (SSM pages never sit in blocks)."""
        return [-1 if sb.pages[lc] is None else sb.pages[lc].page.slot for sb in self._blocks]

    def ssm_page_index(self) -> int:
        """``get_ssm_block_base_index``: the live SSM page id, -1 for none."""
        return -1 if self._ssm is None else self._ssm.page.slot

    def committed_page_is_linked(self, ordinal: int, lc: int) -> Optional[bool]:
        """§5: None if the slot is empty or uncommitted, else whether the committed
        page's back-pointer is set."""
        entry = self._blocks[ordinal].pages[lc]
        if entry is None or not is_committed_page(entry.page):
            return None
        return entry.page.block is not None

    def _entries(self):
        for sb in self._blocks:
            for entry in sb.pages:
                if entry is not None:
                    yield entry
        if self._ssm is not None:
            yield self._ssm

    def _require(self, *statuses: Status) -> None:
        if self._status not in statuses:
            raise LogicError(f"KV cache is {self._status.value}; needs {' or '.join(s.value for s in statuses)}")

    def _kind(self) -> str:
        return LOCK if self._status is Status.ACTIVE else HOLD

    def _non_ssm(self):
        return [(i, lc) for i, lc in enumerate(self.mgr.life_cycles) if i != self.mgr.ssm_lc]

    # -- reuse setup and resume (§2.6) ------------------------------------------------

    def _setup_for_reuse(self, m: O.Match) -> None:
        mgr, T = self.mgr, self.T
        self.reuse_match = m
        N = m.num_tokens
        blocks = m.blocks
        if N == 0:
            return
        path = m.path
        tokens: list = []
        for block, n in path:  # the last block may be LONGER than what was matched (§7.9)
            tokens.extend(block.tokens[:n])
        assert len(tokens) == N
        self._committed_tokens = tokens
        self._history = self._capacity = N
        self._blocks = [SeqBlock(mgr.num_life_cycles, b) for b in blocks]
        for lc, life in self._non_ssm():
            sb, se = life.stale_range(N, T)
            for o in chain(range(sb), range(se, len(blocks))):
                page = blocks[o].slots[lc]
                # pruning guarantees it exists and covers enough (invariant 15)
                assert page is not None and page.coverage >= path[o][1], "prune left an uncovered block"
                mgr._hold(page)
                self._blocks[o].pages[lc] = Entry(page, HOLD)
        if mgr.ssm_lc is not None:
            page = blocks[-1].slots[mgr.ssm_lc]
            assert page is not None and page.coverage == path[-1][1], "prune left no exact SSM checkpoint"
            mgr._hold(page)
            self._ssm = Entry(page, HOLD)
        self._ncb = N // T
        self.reuse_length = N
        self.reuse_tokens = list(tokens)
        self._engine_tokens = list(tokens)

    def resume(self) -> bool:
        """SUSPENDED -> ACTIVE: every holder becomes a lock. The first resume makes
        private copies of a reused partial tail (non-SSM life cycles) and of the SSM
        snapshot (a fresh SSM page when nothing was reused), and clears the partial
        block's ``tree_block``. False (and no change) when pages run out."""
        self._require(Status.SUSPENDED)
        mgr, T = self.mgr, self.T
        N = self.num_committed_tokens
        counts = [0] * mgr.num_life_cycles
        has_partial = False
        if self._never_resumed:
            has_partial = N % T != 0
            for lc in range(mgr.num_life_cycles):
                if lc == mgr.ssm_lc or has_partial:
                    counts[lc] += 1
        slots = mgr._alloc(counts)
        if slots is None:
            return False
        for entry in self._entries():
            entry.kind = LOCK
        if self._never_resumed:
            last = (N - 1) // T
            sources: list[Entry] = []
            fresh: dict[int, UncommittedPage] = {}
            for lc in range(mgr.num_life_cycles):
                if not slots[lc]:
                    continue
                page = mgr._new_upage(lc, slots[lc][0], self)
                fresh[lc] = page
                if lc == mgr.ssm_lc:
                    if N == 0:
                        continue  # a fresh SSM state: nothing to copy
                    src = self._ssm
                else:
                    src = self._blocks[last].pages[lc]
                    assert src is not None, "a partial tail is never stale, so every non-SSM life cycle has its page"
                assert is_committed_page(src.page)
                page.data = dict(src.page.data)
                sources.append(src)
            for src in sources:  # unlock the source pages (ascending life cycle)
                mgr._release_entry(src)
            for lc, page in fresh.items():
                if lc == mgr.ssm_lc:
                    self._ssm = Entry(page, LOCK)
                else:
                    self._blocks[last].pages[lc] = Entry(page, LOCK)
            if has_partial:
                self._blocks[last].tree_block = None  # the block becomes uncommitted
                mgr.counters["private_tail_copy"] += 1
        self._never_resumed = False
        self._status = Status.ACTIVE
        mgr._gc()
        return True

    def suspend(self) -> None:
        """ACTIVE -> SUSPENDED: every lock becomes a holder."""
        self._require(Status.ACTIVE)
        for entry in self._entries():
            entry.kind = HOLD
        self._status = Status.SUSPENDED

    # -- capacity and history (§2.10) --------------------------------------------------

    def resize(self, capacity: Optional[int] = None, history_length: Optional[int] = None) -> bool:
        """§2.10. ``None`` keeps the value. New blocks get an uncommitted page per
        non-SSM life cycle except in that life cycle's stale range at the NEW history;
        SWA blocks that become stale lose their lock (``_unlock_stale_blocks``);
        shrinking drops tail blocks (rewind). False and no change on OOM."""
        self._require(Status.ACTIVE)
        mgr, T = self.mgr, self.T
        cap = self._capacity if capacity is None else int(capacity)
        hist = self._history if history_length is None else int(history_length)
        if hist < self._history:
            raise ValueError("History length cannot be decreased")
        if cap < hist:
            raise ValueError("History length cannot be greater than capacity")
        old_nb, new_nb = len(self._blocks), O.ceil_div(cap, T)
        counts = [0] * mgr.num_life_cycles
        for lc, life in self._non_ssm():
            sb, se = life.stale_range(hist, T)
            counts[lc] = sum(1 for o in range(old_nb, new_nb) if not sb <= o < se)
        slots = mgr._alloc(counts)
        if slots is None:
            return False
        released = self._unlock_stale_blocks(hist)
        while len(self._blocks) > new_nb:  # rewind: drop tail blocks, last first
            self._drop_block(self._blocks.pop())
        for o in range(old_nb, new_nb):
            sb = SeqBlock(mgr.num_life_cycles)
            for lc, life in self._non_ssm():
                s, e = life.stale_range(hist, T)
                if not s <= o < e:
                    sb.pages[lc] = Entry(mgr._new_upage(lc, slots[lc].pop(0), self), LOCK)
            self._blocks.append(sb)
        assert all(not s for s in slots)
        self._capacity, self._history = cap, hist
        for entry in reversed(released):  # the reference's backup holders go when resize returns
            mgr._release_entry(entry)
        mgr._gc()
        return True

    def _set_history_length(self, history: int) -> None:
        ok = self.resize(None, history)
        assert ok, "raising the history never allocates"

    def _unlock_stale_blocks(self, new_history: int) -> list:
        """§2.10: for SWA life cycles, the ordinals that become stale lose their lock.
        Kept as a HOLD only if not commit_min_snapshot, the block is uncommitted and
        commits are ALLOWED; otherwise collected for release (returned)."""
        if new_history == self._history:
            return []
        mgr, T = self.mgr, self.T
        out = []
        for lc, life in self._non_ssm():
            if life.kind != SWA:
                continue
            _, old_end = life.stale_range(self._history, T)
            new_beg, new_end = life.stale_range(new_history, T)
            for o in range(max(old_end, new_beg), min(len(self._blocks), new_end)):
                sb = self._blocks[o]
                entry = sb.pages[lc]
                assert entry is not None, "a block that is not yet stale has its page"
                hold_for_commit = (
                    sb.tree_block is None and self._commit_state is CommitState.ALLOWED and not mgr.commit_min_snapshot
                )
                if hold_for_commit:
                    entry.kind = HOLD
                else:
                    sb.pages[lc] = None
                    out.append(entry)
        return out

    def _drop_block(self, sb: SeqBlock) -> None:
        """Tear a SeqBlock down: its tree block reference goes first (an orphan only
        this sequence kept is destroyed), then its entries in descending life cycle."""
        mgr = self.mgr
        tb, sb.tree_block = sb.tree_block, None
        if tb is not None and tb.prev is None and not any(b is tb for b in mgr._kept_blocks()):
            mgr.tree.release_block_pages(tb)
        for lc in reversed(range(len(sb.pages))):
            entry, sb.pages[lc] = sb.pages[lc], None
            if entry is not None:
                mgr._release_entry(entry)

    # -- commits (§2.5) ----------------------------------------------------------------------

    def commit(self, tokens, is_end: bool = False) -> None:
        """§2.5 ``commit(tokens, is_end)``."""
        self._require(Status.ACTIVE)
        mgr, T = self.mgr, self.T
        tokens = list(tokens)
        for t in tokens:
            O.check_token(t)
        if not tokens:
            if is_end:
                self.stop_committing()
            return
        if self._commit_state is CommitState.USER_STOP:
            raise LogicError("Cannot commit tokens after stop_committing()")
        N0 = self.num_committed_tokens
        N1 = N0 + len(tokens)
        if N1 > self._capacity:
            raise ValueError(f"committing {len(tokens)} tokens: history {N1} would exceed the capacity ({self._capacity})")
        if mgr.commit_min_snapshot and self._history not in (N0, N1):
            raise AssertionError(
                f"commit_min_snapshot: history_length ({self._history}) must equal the committed length before ({N0}) "
                f"or after ({N1}) the commit"
            )
        if self._history < N1:  # also under VIRTUAL_STOP (invariant 11; see the module docstring)
            self._set_history_length(N1)
        self._committed_tokens.extend(tokens)
        if self._commit_state is CommitState.VIRTUAL_STOP:  # pragma: no cover - VIRTUAL_STOP never outlives commit_block
            if is_end:
                self._commit_state = CommitState.USER_STOP
            return
        has_ssm = mgr.ssm_lc is not None
        f0, f1 = self._ncb, N1 // T
        partial = mgr.commit_min_snapshot and N1 % T != 0
        if f1 > f0 or partial:
            snap = (N1 - 1) // T  # the block whose end is the last committed token
            for o in range(f0, f1):
                self._commit_block(o, last=False, ssm=mgr.commit_min_snapshot and has_ssm and o == snap, move_ssm=is_end)
                if self._commit_state is not CommitState.ALLOWED:
                    break
            if partial and self._commit_state is CommitState.ALLOWED:
                if is_end:
                    self._commit_block(f1, last=True, ssm=has_ssm, move_ssm=has_ssm)
                else:
                    self._snapshot_partial(f1, ssm=has_ssm)
        if is_end and self._commit_state is not CommitState.USER_STOP:
            self.stop_committing()
        mgr._gc()

    def stop_committing(self) -> None:
        """§2.5: commit a pending partial tail (by moving our pages), then USER_STOP."""
        if self._status is Status.CLOSED:
            raise LogicError("stop_committing() on a closed KV cache")
        if self._commit_state is CommitState.USER_STOP:
            return
        if self._commit_state is CommitState.VIRTUAL_STOP:  # pragma: no cover - see commit_block
            self._commit_state = CommitState.USER_STOP
            return
        if self.num_committed_tokens > self._ncb * self.T:
            self._commit_block(self._ncb, last=True)  # no SSM snapshot here
        else:
            self._commit_state = CommitState.USER_STOP
            self._on_stop_committing()
        assert self._commit_state is CommitState.USER_STOP
        self.mgr._gc()

    def _tree_parent(self, o: int):
        """The tree parent of ordinal ``o``: the scope's root, or the committed block
        ``o - 1``, re-attaching an orphaned chain first (module docstring, choice 6)."""
        tree = self.mgr.tree
        parent = tree.root(self.scope)
        for k in range(o):
            sb = self._blocks[k]
            tb = sb.tree_block
            assert tb is not None and tb.is_full, "a committed parent is a full block"
            if not tree._is_attached(tb):
                self.mgr.counters["reattached"] += 1
                nb, _ = tree.add_or_get(parent, tb.tokens)
                if nb is not tb:
                    tree._adopt_pages_from(nb, tb)
                    sb.tree_block = nb
                    if not any(b is tb for b in self.mgr._kept_blocks()):
                        tree.release_block_pages(tb)
                tb = nb
            parent = tb
        return parent

    def _commit_block(self, o: int, last: bool, ssm: bool = False, move_ssm: bool = False) -> None:
        """§2.5.1 ``commit_block(o, last, ssm, move_ssm)``."""
        mgr, tree, T = self.mgr, self.mgr.tree, self.T
        assert self._commit_state is CommitState.ALLOWED and o == self._ncb
        tok = self._committed_tokens[o * T : o * T + T]
        n = len(tok)
        full = n == T
        if not last and not full:
            raise LogicError("Cannot commit block that is not full except last block")
        parent = self._tree_parent(o)
        tb, is_new = tree.add_or_get(parent, tok)
        with mgr._pin(tb):
            self._commit_block_into(o, tb, is_new, n, full, last, ssm, move_ssm)

    def _commit_block_into(self, o: int, tb, is_new: bool, n: int, full: bool, last: bool, ssm: bool, move_ssm: bool) -> None:
        mgr, tree, T = self.mgr, self.mgr.tree, self.T
        sb = self._blocks[o]
        did = False
        if is_new:
            for lc, _ in self._non_ssm():
                entry = sb.pages[lc]
                if entry is None or not isinstance(entry.page, UncommittedPage):
                    continue
                page = mgr._commit_upage(entry.page, n)
                tree.replace_page(tb, lc, page)  # replaces any narrower page tb adopted
                mgr._hold(page)  # the sequence keeps its lock/holder, now on the committed page
                entry.page = page
            sb.tree_block = tb
            self._ncb += 1
            did = True
        elif tb.is_full and full:  # rebase (allow_seq_rebasing is always True)
            mgr.counters["rebased"] += 1
            for lc, _ in self._non_ssm():
                entry = sb.pages[lc]
                if entry is None:
                    continue
                assert isinstance(entry.page, UncommittedPage)
                existing = tb.slots[lc]
                if existing is not None and existing.coverage < n:
                    existing = None  # NEVER adopt a narrower tree page
                if existing is None:
                    page = mgr._commit_upage(entry.page, n)
                    tree.replace_page(tb, lc, page)
                    mgr._hold(page)
                    entry.page = page
                elif mgr.stable_pages:
                    mgr.counters["kept_own_page"] += 1  # the engine reads it: it stays ours, uncommitted
                else:
                    own = entry.page
                    mgr._hold(existing)
                    entry.page = existing
                    mgr._kill_upage(own)  # our own uncommitted page is released
            sb.tree_block = tb
            self._ncb += 1
            did = True
        else:
            self._commit_state = CommitState.VIRTUAL_STOP  # e.g. our partial tail is covered by an existing block
            self.virtual_stopped = True
            mgr.counters["virtual_stop"] += 1
        if did and ssm:
            self._snapshot_ssm(tb, o * T + n, move_ssm)
        if sb.tree_block is not None:
            for lc, life in tree.attention_life_cycles():
                s, e = life.stale_range(self._history, T)
                if s <= o < e and sb.pages[lc] is not None:
                    entry, sb.pages[lc] = sb.pages[lc], None
                    mgr._release_entry(entry)  # the tree keeps the page, now evictable
        if last or self._commit_state is CommitState.VIRTUAL_STOP:
            self._commit_state = CommitState.USER_STOP
            self._on_stop_committing()

    def _snapshot_partial(self, o: int, ssm: bool) -> None:
        """§2.5.2: attach copies of the partial block's pages to the tree (coverage
        ``n``); the sequence's block ``o`` stays uncommitted."""
        mgr, tree, T = self.mgr, self.mgr.tree, self.T
        tok = self._committed_tokens[o * T :]
        n = len(tok)
        assert 0 < n < T
        parent = self._tree_parent(o)
        tb, _ = tree.add_or_get(parent, tok)  # exact partial, a longer covering sibling, or new
        sb = self._blocks[o]
        with mgr._pin(tb):
            for lc, _ in tree.attention_life_cycles():
                entry = sb.pages[lc]
                if entry is not None and tb.cov(lc) < n:
                    mgr._copy_page_to_tree(tb, lc, entry.page, n)
            if ssm:
                self._snapshot_ssm(tb, o * T + n, move=False)

    def _snapshot_ssm(self, tb: O.Block, n_total: int, move: bool) -> None:
        """§2.5.3: checkpoint the live SSM state at ``n_total`` tokens on ``tb``."""
        mgr, tree = self.mgr, self.mgr.tree
        lc = mgr.ssm_lc
        c = n_total - tb.ordinal * self.T
        assert 0 < c <= len(tb.tokens)
        if tb.cov(lc) >= c:
            return  # already an equal or later checkpoint
        live = self._ssm
        assert live is not None and isinstance(live.page, UncommittedPage), "a committing sequence has its live SSM state"
        mgr.counters["ssm_snapshot_moved" if move else "ssm_snapshot_copied"] += 1
        if move:  # is_end: hand over the live state itself
            self._ssm = None
            page = mgr._commit_upage(live.page, c)
            tree.replace_page(tb, lc, page)
            mgr._schedule(page)
        else:
            mgr._copy_page_to_tree(tb, lc, live.page, c)

    def _on_stop_committing(self) -> None:
        """§2.10: release held pages of uncommitted blocks in the stale range."""
        mgr, T = self.mgr, self.T
        for lc, life in self._non_ssm():
            s, e = life.stale_range(self._history, T)
            for o in range(max(s, self._ncb), min(e, len(self._blocks))):
                sb = self._blocks[o]
                assert sb.tree_block is None
                entry = sb.pages[lc]
                if entry is not None:
                    assert entry.kind == HOLD
                    sb.pages[lc] = None
                    mgr._release_entry(entry)

    def close(self) -> None:
        """``stop_committing()``, then drop every reference, last block first."""
        if self._status is Status.CLOSED:
            return
        self.stop_committing()
        while self._blocks:
            self._drop_block(self._blocks.pop())
        if self._ssm is not None:
            entry, self._ssm = self._ssm, None
            self.mgr._release_entry(entry)
        self._status = Status.CLOSED
        self.mgr._caches.remove(self)
        self.mgr._gc()

    # -- planned drops (§2.9) ---------------------------------------------------------------

    def plan_committed_block_drop(self) -> Optional[PlannedDrop]:
        """§2.9: plan dropping this turn's SWA window pages and last SSM checkpoint
        (never full attention); None when the committed tokens do not match back to
        their full length (e.g. an endpoint page covers too little). Needs USER_STOP."""
        if self._commit_state is not CommitState.USER_STOP:
            raise LogicError("plan_committed_block_drop() needs stop_committing() first")
        mgr, T = self.mgr, self.T
        N = self.num_committed_tokens
        if N == 0:
            return None
        m = mgr.tree.match(self.scope, self._committed_tokens, mgr.enable_partial_reuse, 0)  # backoff 0 (§2.4)
        if m.num_tokens != N or not m.blocks:
            return None
        E = len(m.blocks)
        pages: list = []
        for lc, life in enumerate(mgr.life_cycles):
            if life.kind == FULL:
                continue  # later turns may still need full-attention blocks
            start = min(life.stale_range(N, T)[1], E) if life.kind == SWA else E - 1
            for o in range(start, E):
                page = m.blocks[o].slots[lc]
                if page is None:
                    return None
                pages.append(page)
        unique: list = []
        for page in pages:
            if not any(p is page for p in unique):
                unique.append(page)
        for page in unique:
            page.planned_drop_count += 1
        return PlannedDrop(mgr, unique)

    # -- checks -------------------------------------------------------------------------

    def check_sanity(self) -> None:
        """§3 invariants 11-14 (14 as read in the module docstring, choice 7)."""
        mgr, T = self.mgr, self.T
        if self._status is Status.CLOSED:
            assert not self._blocks and self._ssm is None, "11. CLOSED implies no blocks"
            return
        assert self.num_committed_tokens <= self._history <= self._capacity, "11. committed <= history <= capacity"
        assert len(self._blocks) == O.ceil_div(self._capacity, T), "11. len(blocks) == ceil(capacity / T)"
        for o, sb in enumerate(self._blocks):
            committed = self._never_resumed or o < self._ncb
            assert committed == (sb.tree_block is not None), f"12. block {o} committed iff never_resumed or o < ncb"
            for lc, life in enumerate(mgr.life_cycles):
                entry = sb.pages[lc]
                if lc == mgr.ssm_lc:
                    assert entry is None, "13. SSM entries in blocks are empty"
                    continue
                if entry is not None:
                    kept_own = mgr.stable_pages and committed and sb.tree_block.is_full  # §2.5.1 stable pages
                    assert committed == is_committed_page(entry.page) or kept_own, "12. committed block <-> committed pages"
                    assert entry.page.alive
                    if isinstance(entry.page, UncommittedPage):
                        assert entry.page.owner is self
                s, e = life.stale_range(self._history, T)
                if s <= o < e:
                    if committed or self._commit_state is not CommitState.ALLOWED:
                        assert entry is None, f"14. stale committed/stopped block {o} lc {lc} is empty"
                    else:
                        assert entry is None or entry.kind == HOLD, f"14. stale block {o} lc {lc} is held"
                        if mgr.commit_min_snapshot:
                            assert entry is None, "14. commit_min_snapshot keeps no stale page"
                else:
                    assert entry is not None, f"14. block {o} lc {lc} has its page"
                    assert entry.kind == self._kind(), "14. locked iff ACTIVE, held iff SUSPENDED"
        if self._ssm is not None:
            if self._never_resumed:
                assert self._ssm.kind == HOLD and is_committed_page(self._ssm.page), "13. reuse snapshot is held"
            else:
                assert self._ssm.kind == LOCK if self._status is Status.ACTIVE else self._ssm.kind == HOLD
                assert isinstance(self._ssm.page, UncommittedPage), "13. live SSM page is uncommitted"
        elif mgr.ssm_lc is not None and not self._never_resumed:
            # the live state is gone only after is_end moved it into the tree
            assert self._commit_state is CommitState.USER_STOP, "13. a resumed SSM cache has its live state"


# ---------------------------------------------------------------------------
# The fake engine
# ---------------------------------------------------------------------------


def write_tokens(seq: KVSeq, start: int, tokens) -> None:
    """Run the model on ``tokens`` at absolute positions ``start..``: write
    ``token_value`` into every page the sequence owns for those positions (an empty
    entry -- a stale SWA block -- has nowhere to write), and set the live SSM state.
    Writing into a committed (shared) page is a bug and fails an assertion."""
    assert seq.status is Status.ACTIVE, "the engine runs an ACTIVE cache"
    assert 0 <= start <= len(seq._engine_tokens), "the engine writes right after what it has"
    mgr, T = seq.mgr, seq.T
    toks = seq._engine_tokens[:start] + list(tokens)
    end = len(toks)
    assert end <= seq.capacity, "the engine writes within the capacity"
    full = tuple(toks)
    for lc, _ in mgr.tree.attention_life_cycles():
        for p in range(start, end):
            entry = seq._blocks[p // T].pages[lc]
            if entry is None:
                continue
            assert isinstance(entry.page, UncommittedPage), f"the engine would write position {p} into a shared page"
            entry.page.data[p % T] = token_value(lc, p, full[: p + 1])
    if mgr.ssm_lc is not None and tokens and seq._ssm is not None:
        assert isinstance(seq._ssm.page, UncommittedPage)
        seq._ssm.page.data = {end - 1: token_value(mgr.ssm_lc, end - 1, full)}
    seq._engine_tokens = toks


def verify_reuse(seq: KVSeq) -> None:
    """Every reused token position of every attention life cycle that is not stale
    at the reuse length (and not stale now: the sequence may since have let such a
    page go) holds the right value; and the SSM state, while the engine has not run
    past the reuse length, is the state after the reused tokens."""
    if seq.status is Status.CLOSED or seq.reuse_length == 0:
        return
    mgr, T = seq.mgr, seq.T
    N, toks = seq.reuse_length, tuple(seq.reuse_tokens)
    for lc, life in mgr.tree.attention_life_cycles():
        sb0, se0 = life.stale_range(N, T)
        sb1, se1 = life.stale_range(seq.history_length, T)
        for o in chain(range(sb0), range(se0, O.ceil_div(N, T))):
            if sb1 <= o < se1:
                continue
            entry = seq._blocks[o].pages[lc]
            assert entry is not None, f"reused block {o} has no page for lc {lc}"
            for p in range(o * T, min(N, o * T + T)):
                assert entry.page.data.get(p % T) == token_value(lc, p, toks[: p + 1]), (
                    f"reused KV at position {p} (block {o}, lc {lc}) is wrong in {entry.page!r}"
                )
    if mgr.ssm_lc is not None and seq._ssm is not None and len(seq._engine_tokens) == N:
        want = {N - 1: token_value(mgr.ssm_lc, N - 1, toks)}
        assert seq._ssm.page.data == want, f"reused SSM state is wrong in {seq._ssm.page!r}"


def run_turn(mgr: KVOracle, prompt, refcheck: bool = False, scope=None) -> int:
    """§6 ``run_turn``: create with the prompt, resume, ``resize(len, r if refcheck
    else len)``, run the engine on the rest, ``commit`` it (not an end commit),
    close; with ``refcheck`` the reused KV is verified after resume."""
    prompt = list(prompt)
    kv = mgr.create_kv_cache(input_tokens=prompt, scope=scope)
    r = kv.num_committed_tokens
    assert kv.resume(), "out of pages on resume"
    if refcheck:
        verify_reuse(kv)
    assert kv.resize(len(prompt), r if refcheck else len(prompt)), "out of pages on resize"
    write_tokens(kv, r, prompt[r:])
    kv.commit(prompt[r:])
    kv.close()
    return r

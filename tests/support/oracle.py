"""A plain-Python model of the block radix tree, written to follow
``docs/semantics.md`` literally.

This is the correctness reference for gpukv: randomised differential tests replay
the same operations on this oracle and on the array/kernel implementation and
compare every observable result. It is written for clarity, not speed: objects,
insertion-ordered dicts and loops that read like the pseudo-code in docs/semantics.md.

It deliberately imports nothing from ``gpukv``; keys are computed with ``hashlib``.

Section references (§) are to docs/semantics.md.

Scope of the model
------------------
The tree (§1.3), pages (§1.4), life cycles and stale ranges (§1.5), the slot
primitives (§2.1), block creation (§2.2), matching and pruning (§2.3, §2.4), and
block removal (§2.7). Sequences, commits and the eviction controller are not
modelled; a page's ``holders`` count stands in for sequence holders/locks, and a
page with ``holders == 0`` is taken to be kept alive only by the eviction
controller (DROPPABLE and scheduled).

Deliberate choices (see also the docstrings):
- ``walk`` always runs the partial search, even at >= 32 children (gpukv does not
  reproduce the reference's speed shortcut, §2.3 / §7.17).
- Tail pruning uses the newer rule: every slot of the block must be empty (§2.7).
- After ``remove_subtree`` the tail-prune loop starts at the already detached
  ``start`` and stops at once (the Python variant of §2.7).
- ``clear()`` also removes childless roots (D10 requires it).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional, Sequence, Union

FULL, SWA, SSM = "full", "swa", "ssm"

Token = Union[int, bytes]
Scope = tuple  # (lora_id | None, salt | None)

# §2.3: the reference skips the partial search at this many children; gpukv does
# not, and neither does this oracle. Kept only to document the deviation.
REFERENCE_PARTIAL_SEARCH_CHILD_LIMIT = 32


# ---------------------------------------------------------------------------
# Keys (§1.2)
# ---------------------------------------------------------------------------


def normalize_scope(scope) -> Scope:
    """``None`` means the default scope ``(None, None)`` (§2.6); any 2-iterable
    (a tuple, or a ReuseScope-like named tuple) is read as ``(lora_id, salt)``."""
    if scope is None:
        return (None, None)
    lora_id, salt = tuple(scope)
    return (lora_id, salt)


def scope_bytes(scope) -> bytes:
    """§1.2 reuse-scope bytes: a mask byte (bit 0 = lora_id present, bit 1 = salt
    present), then one u64 little-endian per present field, in field order."""
    values = normalize_scope(scope)
    mask = 0
    for i, value in enumerate(values):
        if value is not None:
            mask |= 1 << i
    out = bytes([mask])
    for value in values:
        if value is not None:
            out += int(value).to_bytes(8, "little", signed=False)
    return out


def root_key(scope) -> bytes:
    """§1.2: root key = SHA256(scope bytes)."""
    return hashlib.sha256(scope_bytes(scope)).digest()


def check_token(token) -> None:
    """§1.1: an int in [0, 2**31) or an opaque bytes token."""
    if type(token) is int:
        if not 0 <= token < 2**31:
            raise ValueError(f"token id out of range: {token}")
    elif type(token) is not bytes:
        raise ValueError(f"token must be int or bytes, not {type(token).__name__}")


def encode_tokens(tokens: Iterable[Token]) -> bytes:
    """§1.2: an int token is 4 little-endian bytes; a bytes token is its raw bytes."""
    out = b""
    for token in tokens:
        check_token(token)
        out += token.to_bytes(4, "little") if type(token) is int else token
    return out


def block_key(parent_key: bytes, tokens: Sequence[Token]) -> bytes:
    """§1.2: block key = SHA256(parent key || encoded tokens)."""
    return hashlib.sha256(parent_key + encode_tokens(tokens)).digest()


def chain_keys(tokens_per_block: int, scope, tokens: Sequence[Token]) -> Iterator[tuple[list, bytes]]:
    """§1.2 ``sequence_to_blockchain_keys`` without the leading root pair: one
    ``(chunk, key)`` per chunk of ``T`` tokens; the last chunk may be shorter."""
    key = root_key(scope)
    tokens = list(tokens)
    for start in range(0, len(tokens), tokens_per_block):
        chunk = tokens[start : start + tokens_per_block]
        key = block_key(key, chunk)
        yield chunk, key


def common_prefix_len(a: Sequence[Token], b: Sequence[Token]) -> int:
    """Length of the longest common prefix (at most ``min(len(a), len(b))``)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------------------
# Data model (§1.3, §1.4, §1.5)
# ---------------------------------------------------------------------------


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class LifeCycle:
    """§1.5: a reuse/lifetime class. ``kind`` is FULL, SWA or SSM; ``window`` is
    the SWA window ``W`` (None otherwise); ``num_sink_blocks`` only with a window."""

    kind: str
    window: Optional[int] = None
    num_sink_blocks: int = 0

    def __post_init__(self):
        if self.kind == FULL:
            assert self.window is None and self.num_sink_blocks == 0, "full attention has no window/sinks"
        elif self.kind == SWA:
            assert self.window is not None and self.window >= 1, "SWA needs a window >= 1"
            assert self.num_sink_blocks >= 0
        elif self.kind == SSM:
            assert self.window is None and self.num_sink_blocks == 0, "SSM has no parameters"
        else:
            raise ValueError(f"unknown life-cycle kind {self.kind!r}")

    @property
    def is_attention(self) -> bool:
        return self.kind in (FULL, SWA)

    def stale_range(self, history: int, T: int) -> tuple[int, int]:
        """§1.5 stale range ``[start, end)`` of block ordinals at history length ``h``.

        - attention: ``nb = ceil(h / T)``, ``start = min(nb, num_sink_blocks)``;
          full attention: ``[start, start)``;
          SWA: ``[start, max(start, (h + 1 - W) // T))`` -- the ``+ 1`` is deliberate
          (the live window is ``[h + 1 - W, h]``). When ``h + 1 - W`` is negative,
          Python's floor division gives a negative number, which ``max(start, .)``
          (``start >= 0``) clamps away, exactly like C truncation would.
        - SSM: ``[0, h // T)`` (not used for reuse pruning).
        """
        assert history >= 0 and T >= 1
        if self.kind == SSM:
            return (0, history // T)
        nb = ceil_div(history, T)
        start = min(nb, self.num_sink_blocks)
        if self.kind == FULL:
            return (start, start)
        return (start, max(start, (history + 1 - self.window) // T))


class Page:
    """§1.4 CommittedPage as far as the tree sees it.

    ``coverage`` is ``num_tokens_in_block``: a prefix length for attention (``>=``),
    an exact checkpoint for SSM (``==``). ``block`` is the back-pointer (None =
    unlinked). ``holders`` stands for sequence holders/locks; with 0 holders the
    page is DROPPABLE and kept alive only by the eviction controller. ``alive`` is
    False once the page died."""

    def __init__(self, page_id: int, lc: int, coverage: int):
        self.id = page_id
        self.lc = lc
        self.coverage = coverage
        self.block: Optional[Block] = None
        self.holders = 0
        self.alive = True

    def __repr__(self) -> str:
        state = "linked" if self.block is not None else "unlinked"
        return f"Page(id={self.id}, lc={self.lc}, cov={self.coverage}, {state}, holders={self.holders}, alive={self.alive})"


class Root:
    """§1.3 RootBlock: one per reuse scope. ``prev`` is the owning Oracle while the
    root is in the tree, None after it was removed (its last child left)."""

    ordinal = -1

    def __init__(self, scope: Scope, tree: "Oracle"):
        self.scope = normalize_scope(scope)
        self.key = root_key(self.scope)
        self.next: dict[bytes, Block] = {}
        self.prev: Optional[Oracle] = tree

    def __repr__(self) -> str:
        return f"Root(scope={self.scope}, key={self.key.hex()[:8]}, children={len(self.next)})"


class Block:
    """§1.3 Block. ``prev`` is None once detached (an orphan). ``slots`` holds one
    entry per life cycle, each a Page or None. Only full blocks have children."""

    def __init__(self, key: bytes, tokens: list, parent: Union["Block", Root], tokens_per_block: int, num_life_cycles: int):
        self.key = key
        self.tokens = list(tokens)
        self.ordinal = parent.ordinal + 1
        self.prev: Union[Block, Root, None] = parent
        self.next: dict[bytes, Block] = {}
        self.tokens_per_block = tokens_per_block
        self.slots: list[Optional[Page]] = [None] * num_life_cycles

    @property
    def is_full(self) -> bool:
        return len(self.tokens) == self.tokens_per_block

    @property
    def is_orphan(self) -> bool:
        return self.prev is None

    def cov(self, lc: int) -> int:
        """§2 notation ``cov(b, lc)``: the slot's page coverage, 0 when empty
        (``page_coverage`` in §2.1)."""
        page = self.slots[lc]
        return page.coverage if page is not None else 0

    def __repr__(self) -> str:
        covs = ",".join(str(self.cov(i)) for i in range(len(self.slots)))
        orphan = ", orphan" if self.prev is None else ""
        return f"Block(ord={self.ordinal}, key={self.key.hex()[:8]}, n={len(self.tokens)}, cov=[{covs}]{orphan})"


@dataclass
class Match:
    """§2.4 ReuseMatch. ``path`` is the pruned ``[(block, n)]`` list as well."""

    blocks: list
    num_tokens: int
    num_lookup_tokens: int
    num_tokens_before_pruning: int
    num_tokens_before_hybrid_pruning: int
    path: list = field(default_factory=list)


# ---------------------------------------------------------------------------
# The tree
# ---------------------------------------------------------------------------


class Oracle:
    """§1.3 BlockRadixTree plus the page-slot rules of §2.1 and §2.7.

    ``events`` records what the tree hands to the event manager (§4), unfiltered:
    ``("removed", [keys...])`` -- one per ``remove_subtree`` call (post order),
    one per tail-pruned block, one per covered sibling detached by ``add_or_get``,
    one per public ``detach``; ``("removed_lc", key, lc)`` for SWA non-sink / SSM
    page death. (The event manager ignores unknown keys and pairs; that filtering
    is not modelled here.)
    """

    def __init__(self, tokens_per_block: int, life_cycles: list):
        assert tokens_per_block >= 1
        self.T = tokens_per_block
        self.life_cycles: list[LifeCycle] = list(life_cycles)
        ssm_ids = [i for i, lc in enumerate(self.life_cycles) if lc.kind == SSM]
        assert len(ssm_ids) <= 1, "at most one SSM life cycle (§1.5)"
        self.ssm_lc: Optional[int] = ssm_ids[0] if ssm_ids else None
        self.next: dict[bytes, Root] = {}  # the tree: root key -> Root
        self.events: list = []
        self.pages: dict[int, Page] = {}  # every page ever created, by id
        self._next_page_id = 0
        # Every block ever created that may still matter (attached, or an orphan
        # that may still hold pages); by id(); used by check_sanity.
        self._blocks: dict[int, Block] = {}
        # Invariant 10 memory: (block key, lc) -> coverage last seen in that slot.
        # Forgotten whenever the slot is emptied other than by a replacement.
        self._cov_memory: dict[tuple[bytes, int], int] = {}

    @property
    def num_life_cycles(self) -> int:
        return len(self.life_cycles)

    def attention_life_cycles(self) -> list[tuple[int, LifeCycle]]:
        """§1.5 ``attention_life_cycles()``: ``(id, lc)`` pairs in id order."""
        return [(i, lc) for i, lc in enumerate(self.life_cycles) if lc.is_attention]

    # -- roots and blocks (§1.3, §2.2) -------------------------------------

    def root(self, scope) -> Root:
        """§1.3 ``add_or_get_existing(scope)``: the scope's root, created if missing.
        After a root was removed (or after ``clear``) this makes a *new* object."""
        scope = normalize_scope(scope)
        key = root_key(scope)
        existing = self.next.get(key)
        if existing is not None:
            return existing
        r = Root(scope, self)
        self.next[key] = r
        return r

    def add_or_get(self, parent: Union[Block, Root], tokens: Sequence[Token]) -> tuple[Block, bool]:
        """§2.2 ``add_or_get(parent, tok)`` -> ``(block, is_new)``.

        1. duplicate key: return the existing child;
        2. a partial ``tok`` covered by a sibling (the first in insertion order
           whose tokens start with ``tok``): return that sibling ("useless");
        3. otherwise create the block, insert it into ``parent.next`` FIRST (so a
           root whose only child is the covered sibling is not removed, §7.5), then
           detach the (at most one) covered shorter sibling, adopt its pages with
           their coverage (§2.1 ``_adopt_pages_from``), and record
           ``("removed", [sibling key])``.

        ``parent`` must be a Root or a full Block still in the tree; a partial
        parent fails an AssertionError (§1.3, §7.12). Empty or over-long ``tokens``
        raise ValueError. A detached parent (removed root, orphan block) raises
        ValueError: nothing under it could ever be reached (§7.19).
        """
        tok = list(tokens)
        if not 1 <= len(tok) <= self.T:
            raise ValueError(f"a block holds 1..{self.T} tokens, got {len(tok)}")
        for t in tok:
            check_token(t)
        if isinstance(parent, Block):
            assert parent.is_full, "only full blocks may have children (§1.3)"
        if not self._is_attached(parent):
            raise ValueError("parent is not in the tree (removed root or orphan block)")

        k = block_key(parent.key, tok)
        if k in parent.next:  # duplicate: the same tokens exist
            return parent.next[k], False
        if len(tok) < self.T:  # a "useless" partial block
            for s in parent.next.values():  # insertion order; the first one wins
                if s.tokens[: len(tok)] == tok:
                    return s, False
        b = Block(k, tok, parent, self.T, self.num_life_cycles)
        self._blocks[id(b)] = b
        covered = [s for s in parent.next.values() if len(s.tokens) < len(tok) and tok[: len(s.tokens)] == s.tokens]
        assert len(covered) <= 1, "prefixes of one sequence are nested"
        parent.next[k] = b  # insert BEFORE detaching (keeps a root alive)
        for s in covered:
            assert not s.is_full and not s.next, "a covered sibling is a partial leaf"
            self._detach_quiet(s)
            self._adopt_pages_from(b, s)
            self.events.append(("removed", [s.key]))
        return b, True

    # -- slot primitives (§2.1) ----------------------------------------------

    def new_page(self, lc: int, coverage: int) -> Page:
        """A fresh committed page for life cycle ``lc`` with the given coverage,
        unlinked, with 0 holders (DROPPABLE: kept alive only by the eviction
        controller once it is linked/scheduled)."""
        assert 0 <= lc < self.num_life_cycles
        assert 1 <= coverage <= self.T, "coverage is 1..T (§1.4)"
        page = Page(self._next_page_id, lc, coverage)
        self._next_page_id += 1
        self.pages[page.id] = page
        return page

    def can_replace_page(self, block: Block, lc: int, coverage: int) -> bool:
        """§2.1: true iff the slot is empty or its page covers strictly less than
        ``coverage``. Ties keep the incumbent (§7.2)."""
        existing = block.slots[lc]
        return existing is None or existing.coverage < coverage

    def replace_page(self, block: Block, lc: int, page: Page) -> None:
        """§2.1 ``replace_page`` in this order (§7.3):

        1. unlink the old page (clear its back-pointer, empty the slot);
        2. the old page leaves the eviction controller: with no holders it dies --
           safely, as it is already unlinked, so no tree cleanup runs on ``block``;
           a held old page lives on, unlinked, until released (§2.8);
        3. link ``page`` into the slot.
        """
        assert self.can_replace_page(block, lc, page.coverage), "replacement must be strictly wider (§2.1)"
        assert page.lc == lc and page.alive
        assert 1 <= page.coverage <= len(block.tokens), "coverage must fit the block (§1.4)"
        old = self._unlink(block, lc)  # (1)
        if old is not None and old.holders == 0:  # (2)
            self.page_death(old)  # unlinked: only marks it dead
        page.block = block  # (3)
        block.slots[lc] = page
        key = (block.key, lc)
        if block.prev is not None:
            self._cov_memory[key] = max(self._cov_memory.get(key, 0), page.coverage)

    def unlink_page(self, block: Block, lc: int, expected: Optional[Page] = None) -> Optional[Page]:
        """§2.1 ``unlink_page``: the single place a block-page link is severed. If
        ``expected`` is given and the slot holds a different page, do nothing.
        Otherwise clear the page's back-pointer, empty the slot and return the page
        (None if the slot was empty). Does not kill the page."""
        page = block.slots[lc]
        if page is None:
            return None
        if expected is not None and page is not expected:
            return None
        self._cov_memory.pop((block.key, lc), None)  # a removal, not a replacement
        return self._unlink(block, lc)

    def _unlink(self, block: Block, lc: int) -> Optional[Page]:
        page = block.slots[lc]
        if page is None:
            return None
        page.block = None
        block.slots[lc] = None
        return page

    def _adopt_pages_from(self, block: Block, other: Block) -> None:
        """§2.1 ``_adopt_pages_from``: move ``other``'s pages into ``block`` with
        their coverage unchanged (§7.4). The source slot is emptied directly, not
        via unlink, because ``replace_page`` overwrites the back-pointer next."""
        assert other.ordinal == block.ordinal
        for lc in range(self.num_life_cycles):
            page = other.slots[lc]
            if page is None or not self.can_replace_page(block, lc, page.coverage):
                continue
            other.slots[lc] = None
            self.replace_page(block, lc, page)

    def release_block_pages(self, block: Block) -> None:
        """§2.1 ``_release_pages`` (runs when a block object is destroyed): unlink
        every page; a DROPPABLE one (no holders) is excluded from eviction and dies,
        without tree cleanup since it is already unlinked. Idempotent."""
        for lc in range(self.num_life_cycles):
            page = block.slots[lc]
            if page is not None:
                self.unlink_page(block, lc)
                if page.holders == 0 and page.alive:
                    self.page_death(page)
        if block.prev is None:
            self._blocks.pop(id(block), None)

    # -- holders (§2.8) ---------------------------------------------------------

    def hold(self, page: Page) -> None:
        """A sequence takes a holder/lock on ``page``."""
        assert page.alive
        page.holders += 1

    def release(self, page: Page) -> None:
        """§2.8 holder release: when the last holder goes, the page is scheduled for
        eviction; if it is unlinked or its block is an orphan it is excluded at once
        and dies (dropped, not cached)."""
        assert page.alive and page.holders > 0
        page.holders -= 1
        if page.holders == 0 and (page.block is None or page.block.prev is None):
            self.page_death(page)

    # -- removal (§2.7) --------------------------------------------------------

    def page_death(self, page: Page) -> None:
        """§1.4/§2.7 page death: the page dies; if it is still linked it unlinks
        itself (with the ``expected`` check) and runs
        ``clear_stale_blocks_after_page_unlink`` on its block."""
        assert page.alive, "a page dies once"
        assert page.holders == 0, "only a page without holders can die"
        page.alive = False
        block = page.block
        if block is not None:
            self.unlink_page(block, page.lc, expected=page)
            self.clear_stale_blocks_after_page_unlink(block, page.lc)

    def clear_stale_blocks_after_page_unlink(self, start: Block, lc: int, life_cycle: Optional[LifeCycle] = None) -> None:
        """§2.7 ``clear_stale_blocks_after_page_unlink(start, lc_id, lc)``.

        Full attention, or a sink block of SWA: ``remove_subtree(start)`` -- no
        descendant can be reused any more. SWA non-sink or SSM: record
        ``("removed_lc", start.key, lc)``. Then prune the tail: while ``curr`` is an
        attached Block with no children and ALL slots empty (the newer rule),
        detach it (``("removed", [key])``) and move to its parent. After a
        ``remove_subtree`` the loop starts at the detached ``start`` and stops at
        once (Python variant).

        ``life_cycle`` overrides the life-cycle object (the reference passes id and
        object separately; scenario D9 passes the SWA object with id 1). It defaults
        to ``self.life_cycles[lc]``.
        """
        lco = self.life_cycles[lc] if life_cycle is None else life_cycle
        assert start.slots[lc] is None, "the page was unlinked first"
        if lco.is_attention and (lco.window is None or start.ordinal < lco.num_sink_blocks):
            self.remove_subtree(start)
        else:
            self.events.append(("removed_lc", start.key, lc))
        curr: Union[Block, Root, None] = start
        while (
            isinstance(curr, Block)
            and curr.prev is not None
            and not curr.next
            and all(slot is None for slot in curr.slots)
        ):
            parent = curr.prev
            self.detach(curr)
            curr = parent

    def remove_subtree(self, block: Block) -> None:
        """§2.7 ``remove_subtree(b)``: detach ``b`` and all its descendants in post
        order (leaves first, children in insertion order) and record ONE
        ``("removed", keys)`` listing them in that order. A root left with no
        children is removed from the tree. Pages are not touched (they stay in the
        orphans' slots until ``release_block_pages``). On an orphan ``b`` the event
        still lists ``b``'s key, as in the reference."""
        keys: list[bytes] = []

        def visit(b: Block) -> None:
            for child in list(b.next.values()):
                visit(child)
            keys.append(b.key)
            if b.prev is not None:
                self._detach_quiet(b)

        visit(block)
        self.events.append(("removed", keys))

    def detach(self, block: Block) -> None:
        """Detach one leaf block from its parent (``prev = None``) and record
        ``("removed", [key])``; a root left childless is removed from the tree."""
        self._detach_quiet(block)
        self.events.append(("removed", [block.key]))

    def _detach_quiet(self, block: Block) -> None:
        """§2.7 ``detach_next``: empty the parent's child entry, set ``prev = None``;
        a root with no children left leaves the tree."""
        parent = block.prev
        assert parent is not None, "already an orphan"
        assert not block.next, "the tree only ever detaches leaves"
        assert parent.next.get(block.key) is block
        del parent.next[block.key]
        block.prev = None
        for lc in range(self.num_life_cycles):
            self._cov_memory.pop((block.key, lc), None)
        if isinstance(parent, Root) and not parent.next:
            self._remove_root(parent)

    def _remove_root(self, root: Root) -> None:
        if self.next.get(root.key) is root:
            del self.next[root.key]
        root.prev = None

    def clear(self) -> None:
        """§2.7 ``BlockRadixTree.clear()``: ``remove_subtree`` every root's children
        (one removed event each); childless roots are dropped too. Idempotent.
        Afterwards ``root(scope)`` makes a new root object."""
        while self.next:
            root = next(iter(self.next.values()))
            while root.next:
                self.remove_subtree(next(iter(root.next.values())))
            if root.prev is not None:  # it was childless to begin with
                self._remove_root(root)
        assert not self.next

    # -- matching (§2.3, §2.4) -----------------------------------------------------

    def walk(self, scope, tokens: Sequence[Token], partial: bool) -> list[tuple[Block, int]]:
        """§2.3 ``walk``: follow the key chain; at the first chunk whose key is not
        a child, optionally pick the child with the strictly longest common prefix
        (the first in insertion order on ties, none if every prefix is 0) and stop.

        Deviation kept on purpose: the partial search runs whatever the number of
        children (the reference skips it at >= 32). A short last chunk still
        matches a partial block by key when ``partial`` is False. Does not create
        the root."""
        node: Union[Root, Block, None] = self.next.get(root_key(scope))
        if node is None:
            return []
        out: list[tuple[Block, int]] = []
        for chunk, k in chain_keys(self.T, scope, tokens):
            if k in node.next:
                node = node.next[k]
                out.append((node, len(chunk)))
                continue
            if partial:
                best, best_n = None, 0
                for c in node.next.values():  # insertion order; only strictly longer wins
                    m = common_prefix_len(chunk, c.tokens)
                    if m > best_n:
                        best, best_n = c, m
                if best is not None:
                    out.append((best, best_n))
            break
        return out

    def num_matched_tokens(self, matched: list[tuple[Block, int]]) -> int:
        """§2 ``N(matched) = T * (len(matched) - 1) + matched[-1].n`` (0 if empty)."""
        if not matched:
            return 0
        return self.T * (len(matched) - 1) + matched[-1][1]

    def prune(self, matched: list[tuple[Block, int]], ssm_lc: Optional[int]) -> list[tuple[Block, int]]:
        """§2.4 ``prune`` fixed point; returns a new list (the input is not changed).

        Loop: (1) SSM (if ``ssm_lc`` is not None): keep up to the LAST block whose
        checkpoint ``c > 0`` satisfies ``n >= c`` and end exactly at ``c`` (none ->
        empty). (2) For each attention life cycle in id order, with the stale range
        at the current endpoint ``N``: check blocks ``[0, sb)`` then ``[se, len)``
        ascending; the first with ``cov < n`` is clamped to ``cov`` inside the block
        (``cov > 0``) or cut at its start (``cov == 0``), and the loop restarts from
        (1). No violation: fixed point reached.
        """
        matched = list(matched)
        assert all(n == self.T for _, n in matched[:-1]), "only the last block may be partially matched"
        attn = self.attention_life_cycles()
        while True:
            if not matched:
                return matched
            # (1) SSM: the endpoint must be exactly an SSM checkpoint
            if ssm_lc is not None:
                pick = None
                for i in reversed(range(len(matched))):
                    block, n = matched[i]
                    c = block.cov(ssm_lc)
                    if c > 0 and n >= c:
                        pick = (i, c)
                        break
                if pick is None:
                    return []
                i, c = pick
                matched = matched[: i + 1]
                matched[i] = (matched[i][0], c)
            # (2) attention: every page active at this endpoint must cover its part
            ntok = self.num_matched_tokens(matched)
            shortened = False
            for lc, life_cycle in attn:
                sb, se = life_cycle.stale_range(ntok, self.T)
                for i in list(range(0, sb)) + list(range(se, len(matched))):
                    block, n = matched[i]
                    c = block.cov(lc)
                    if c >= n:
                        continue
                    if c > 0:  # clamp inside block i
                        matched = matched[: i + 1]
                        matched[i] = (block, c)
                    else:  # drop block i and everything after it
                        matched = matched[:i]
                    shortened = True
                    break
                if shortened:
                    break
            if not shortened:
                return matched

    def back_off(self, matched: list[tuple[Block, int]], backoff: int) -> list[tuple[Block, int]]:
        """§2.4 backoff on the raw path: drop the last ``backoff`` tokens (pop whole
        tail blocks whose ``n`` is at most what is left to drop, then shrink the last
        ``n``; never below 0). Returns a new list."""
        assert backoff >= 0
        matched = list(matched)
        left = backoff
        while matched and left > 0 and matched[-1][1] <= left:
            left -= matched[-1][1]
            matched.pop()
        if matched and left > 0:
            block, n = matched[-1]
            matched[-1] = (block, n - left)
        return matched

    def match(self, scope, tokens: Sequence[Token], partial: bool, backoff: int = 0) -> Match:
        """§2.4 ``match``: walk, back off the raw path (not again after pruning),
        then prune. ``num_tokens_before_hybrid_pruning`` is the attention-only
        pruning of the same backed-off path when an SSM life cycle exists (else
        ``num_tokens``); ``num_tokens_before_pruning`` is the raw depth before
        backoff. Volatile: nothing is held."""
        tokens = list(tokens)
        raw = self.walk(scope, tokens, partial)
        depth_raw = self.num_matched_tokens(raw)
        if backoff > 0:
            raw = self.back_off(raw, backoff)
        attn_only = self.num_matched_tokens(self.prune(raw, None)) if self.ssm_lc is not None else None
        final = self.prune(raw, self.ssm_lc)
        num_tokens = self.num_matched_tokens(final)
        return Match(
            blocks=[b for b, _ in final],
            num_tokens=num_tokens,
            num_lookup_tokens=len(tokens),
            num_tokens_before_pruning=depth_raw,
            num_tokens_before_hybrid_pruning=num_tokens if attn_only is None else attn_only,
            path=final,
        )

    def reuse_match_pages(self, scope, tokens: Sequence[Token], lc: int, partial: bool = False):
        """§5 ``reuse_match_pages``: ``match`` without backoff; returns
        ``(num_tokens, pages)`` with ``pages[i]`` None when matched block ``i`` has
        no page for ``lc``, else ``(page.id, coverage)``."""
        m = self.match(scope, tokens, partial, backoff=0)
        pages = []
        for b in m.blocks:
            p = b.slots[lc]
            pages.append(None if p is None else (p.id, p.coverage))
        return m.num_tokens, pages

    # -- introspection ------------------------------------------------------------

    def _is_attached(self, node: Union[Block, Root]) -> bool:
        """True iff ``node`` is reachable from the tree."""
        while isinstance(node, Block):
            node = node.prev
            if node is None:
                return False
        return node.prev is self and self.next.get(node.key) is node

    def attached_blocks(self) -> dict[bytes, Block]:
        """Every attached block by key, roots excluded (pre order, insertion order)."""
        out: dict[bytes, Block] = {}

        def visit(b: Block) -> None:
            out[b.key] = b
            for c in b.next.values():
                visit(c)

        for root in self.next.values():
            for child in root.next.values():
                visit(child)
        return out

    def orphans(self) -> list[Block]:
        """Known detached blocks that were not released yet."""
        return [b for b in self._blocks.values() if b.prev is None]

    def release_orphans(self, keep: Iterable[Block] = ()) -> None:
        """Release the pages of every orphan except ``keep`` (those a sequence still
        references), as the reference's garbage collection would on detach."""
        kept = {id(b) for b in keep}
        for b in self.orphans():
            if id(b) not in kept:
                self.release_block_pages(b)

    def make_block(self, parent: Union[Block, Root], tokens: Sequence[Token], coverage_per_lc: Sequence[int]) -> Block:
        """Test helper like ``make_test_block`` (§5): ``add_or_get`` then, per life
        cycle with coverage > 0, a fresh page installed with ``replace_page`` when it
        is strictly wider. Returns the (new or existing) block."""
        assert len(coverage_per_lc) == self.num_life_cycles
        block, _ = self.add_or_get(parent, tokens)
        for lc, c in enumerate(coverage_per_lc):
            if c > 0 and self.can_replace_page(block, lc, c):
                self.replace_page(block, lc, self.new_page(lc, c))
        return block

    def check_sanity(self, strict_roots: bool = False) -> None:
        """§3 invariants 1-7 and 10; raises AssertionError on a violation.

        A childless root is legal between ``root(scope)`` and the first insertion
        (invariant 1 calls it transient); ``strict_roots=True`` rejects it, for
        callers that know no such operation is in flight."""
        attached = self.attached_blocks()
        attached_ids = {id(b) for b in attached.values()}
        # 1. roots
        for k, root in self.next.items():
            assert isinstance(root, Root)
            assert k == root.key == root_key(root.scope), "1. root key = SHA256(scope bytes)"
            assert root.prev is self
            assert not strict_roots or root.next, "1. a childless root outside an operation"
        # 2-4. attached blocks
        parents: list[Union[Root, Block]] = list(self.next.values()) + list(attached.values())
        for p in parents:
            if isinstance(p, Block) and not p.is_full:
                assert not p.next, "3. only full blocks have children"
            children = list(p.next.values())
            for k, b in p.next.items():
                assert b.key == k and b.prev is p, "2. parent link"
                assert b.key == block_key(p.key, b.tokens), "2. key chain"
                assert b.ordinal == p.ordinal + 1, "2. ordinal"
                assert 1 <= len(b.tokens) <= self.T, "2. token count"
                assert len(b.slots) == self.num_life_cycles
            for a in children:
                for b in children:
                    if a is not b:
                        assert not (len(a.tokens) < len(b.tokens) and b.tokens[: len(a.tokens)] == a.tokens), \
                            "4. no sibling is a strict prefix of another"
        # 5. orphans
        for b in self._blocks.values():
            if id(b) not in attached_ids:
                assert b.prev is None, "5. an unreachable block is an orphan (prev None)"
        # 6-7. slots and pages
        seen: dict[int, tuple[int, int]] = {}
        for b in self._blocks.values():
            for lc, p in enumerate(b.slots):
                if p is None:
                    continue
                assert p.alive, "7. no slot refers to a dead page"
                assert p.block is b and p.lc == lc, "6. back-pointer and life cycle"
                assert 1 <= p.coverage <= len(b.tokens), "6. 1 <= coverage <= len(tokens)"
                assert p.id not in seen, "7. a page is in at most one slot"
                seen[p.id] = (id(b), lc)
        for p in self.pages.values():
            if p.block is not None:
                assert p.block.slots[p.lc] is p, "7. a linked page is in its block's slot"
                assert id(p.block) in self._blocks
            if not p.alive:
                assert p.block is None, "7. a dead page is unlinked"
        # 10. coverage in a slot never decreases while the slot stays occupied
        for b in attached.values():
            for lc, p in enumerate(b.slots):
                key = (b.key, lc)
                if p is None:
                    self._cov_memory.pop(key, None)
                    continue
                before = self._cov_memory.get(key)
                assert before is None or p.coverage >= before, "10. coverage never decreases"
                self._cov_memory[key] = p.coverage

"""White-box hooks for tests and for a person at a debugger.

Everything here reads (or, for test blocks and tree operations, drives) the
manager's device tables and host-side state directly, the same way on every
backend, so one test runs against all of them. This module is the one place
outside the facade that knows the manager's internals: tests go through it
rather than through private attributes, so a change of those internals is
met here once. Not thread-safe and not meant for a serving hot path. It is long
for that reason: splitting it would scatter the knowledge of the internals
that it exists to keep in one place.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import numpy as np

from .core.config import PRIORITY_MIN
from .kernels.keys import sibling_hash_np
from .kernels.sha256 import int64x4_to_digest
from .kernels.tree import OP_INSERT
from .core.layout import (
    NUM_HELD,
    NUM_LEVELS,
    NUM_PRIORITIES,
    BID_KEY,
    BLK_FIRST_CHILD,
    BLK_FIRST_NEXT,
    BLK_HASH_NEXT,
    BLK_INFO,
    BLK_NEXT_SIBLING,
    BLK_PARENT,
    BLK_PREV_SIBLING,
    BLK_SERIAL,
    BLOCK_IDS,
    BLOCKS,
    CNT_DETACHES,
    EMPTY_SLOT,
    FREE_ROW_NEXT,
    FLAG_ATTACHED,
    FLAG_IN_USE,
    FLAG_ROOT,
    LG_COUNT,
    LG_LOWEST,
    LOG,
    Layout,
    LRU_GROUPS,
    LRU_HEAD,
    LRU_LISTS,
    LRU_TAIL,
    NULL,
    PAGE_BLOCK,
    PAGE_COMMITTED,
    PAGE_FREE,
    PAGE_HOLDS,
    PAGE_INFO,
    PAGE_LRU_NEXT,
    PAGE_LRU_PREV,
    PAGE_POOL_INDEX,
    PAGE_SERIAL,
    PAGE_LRU_TICK,
    PAGES,
    ROOT_SCOPE,
    SLOT_WORD,
    SLOTS,
    holds_holders,
    holds_locks,
    info_coverage,
    info_flags,
    info_held,
    info_level,
    info_listed,
    info_num_tokens,
    info_priority,
    info_state,
    slot_page,
    slot_row,
    slot_whole,
)
from .tree import BlockRef


def page_life_cycles(tables) -> np.ndarray:
    """The life cycle of every page row of a manager's ``_tables``: each
    life cycle owns the run of rows that starts at its ``row_start``."""
    starts = tables.backend.to_host(tables.row_start)
    return np.searchsorted(starts, np.arange(tables.num_pages), side="right") - 1


def tables(mgr) -> dict:
    """The device tables as NumPy structured arrays with named fields.

    ``blocks`` (decoded: ``blocks_view``) with ``block_ids`` (the same rows:
    the chain key), ``slots`` (row = block * num_life_cycles + life cycle;
    decoded: ``slots_view``), ``pages`` (decoded: ``pages_view``) and
    ``log``;
    ``tokens`` is the plain [rows, T] token array and ``digests`` the plain
    [rows, 4] int64 SHA-256 chain keys ([0, 4] with ``block_digests`` off).
    ``block_slots`` is ``slots`` shaped [block rows, life cycles], so
    ``block_slots[r, lc]["coverage"]`` is ``cov(block r, lc)``.
    ``lru_lists`` are the eviction candidates' lists, row ``lru_list_row(lc,
    level, held, priority)``, each threaded oldest first through the pages'
    ``lru_next``; ``lru_groups``, row ``lru_group_row(lc, level, held)``,
    count their members. A page row's life cycle is not stored: see
    ``page_life_cycles``."""
    t = mgr._tables
    h = t.backend.to_host
    blocks = blocks_view(h(t.blocks))
    raw_pages = h(t.pages)
    slots = slots_view(h(t.slots), raw_pages)
    return {
        "blocks": blocks,
        "block_ids": BLOCK_IDS.view(h(t.block_ids)),
        "digests": np.array(h(t.digests)),
        "tokens": np.array(h(t.tokens)),
        "slots": slots,
        "block_slots": slots.reshape(blocks.shape[0], len(mgr.config.life_cycles)),
        "pages": pages_view(t, raw_pages),
        "log": LOG.view(h(t.log)),
        "lru_lists": LRU_LISTS.view(h(t.lru_lists)),
        "lru_groups": LRU_GROUPS.view(h(t.lru_groups)),
    }


def blocks_view(raw) -> np.ndarray:
    """A host copy of the block table as a structured array: its stored
    fields and, decoded from ``info``, each row's ``num_tokens`` and
    ``flags`` (``layout.FLAG_*``); for a block in the tree, its ``ordinal``
    (-1 for a root) and its root's ``scope`` id, both NULL for other rows."""
    info = raw[:, BLK_INFO]
    flags = info_flags(info)
    root, depth = _roots_and_depths(raw[:, BLK_PARENT], flags)
    in_tree = root != NULL
    ordinal = np.where(in_tree, depth - 1, NULL)
    scope = np.where(in_tree, raw[np.maximum(root, 0), ROOT_SCOPE], NULL)
    decoded = np.column_stack([raw, info_num_tokens(info), flags, ordinal, scope])
    return _BLOCKS_DECODED.view(decoded.astype(BLOCKS.dtype, copy=False))


_BLOCKS_DECODED = Layout("blocks_decoded", BLOCKS.dtype,
                         BLOCKS.fields + [("num_tokens", 1), ("flags", 1), ("ordinal", 1), ("scope", 1)])


def _roots_and_depths(parent, flags):
    """Each attached row's root and its steps up to it (0 for a root), by
    pointer jumping: log2(depth) passes over the column. NULL and 0 for
    rows outside the tree."""
    rows = np.arange(parent.shape[0])
    attached = (flags & (FLAG_IN_USE | FLAG_ATTACHED)) == (FLAG_IN_USE | FLAG_ATTACHED)
    climbs = attached & ((flags & FLAG_ROOT) == 0)
    up = np.where(climbs, parent, rows)
    steps = climbs.astype(np.int64)
    while True:
        higher = up[up]
        if np.array_equal(higher, up):
            break
        steps = steps + steps[up]
        up = higher
    return np.where(attached, up, NULL), np.where(attached, steps, 0)


def slots_view(raw, raw_pages) -> np.ndarray:
    """A host copy of the slot table (``raw``) as a structured array: its
    stored ``word`` and, decoded, each slot's ``page`` (NULL when empty),
    ``whole`` (whether the word says its page covers all T tokens) and,
    read from that page (``raw_pages``: the page table's rows), its
    ``coverage``, 0 when empty."""
    word = raw[:, SLOT_WORD]
    page = slot_page(word)
    cov = np.where(page == NULL, 0, info_coverage(raw_pages[page, PAGE_INFO])) if raw_pages.shape[0] else np.zeros_like(page)
    decoded = np.column_stack([raw, page, slot_whole(word), cov])
    return _SLOTS_DECODED.view(decoded.astype(SLOTS.dtype, copy=False))


_SLOTS_DECODED = Layout("slots_decoded", SLOTS.dtype, SLOTS.fields + [("page", 1), ("whole", 1), ("coverage", 1)])


def pages_view(tables, raw) -> np.ndarray:
    """A host copy of the page table (``raw``: its rows, of ``tables``) as a
    structured array: its stored fields and, decoded from ``info`` and the
    row, each page's ``state``, ``level``, ``priority``, ``coverage``,
    ``holders``, ``locks``, ``life_cycle`` (``page_life_cycles``) and
    ``lru_list`` (the ``lru_lists`` row it is linked in, NULL for none)."""
    info, holds, lc = raw[:, PAGE_INFO], raw[:, PAGE_HOLDS], page_life_cycles(tables)
    decoded = np.column_stack([raw, info_state(info), info_level(info), info_priority(info), info_coverage(info),
                               holds_holders(holds), holds_locks(holds), lc, page_lists(raw, lc)])
    return _PAGES_DECODED.view(decoded.astype(PAGES.dtype, copy=False))


_PAGES_DECODED = Layout("pages_decoded", PAGES.dtype, PAGES.fields + [
    ("state", 1), ("level", 1), ("priority", 1), ("coverage", 1), ("holders", 1), ("locks", 1), ("life_cycle", 1),
    ("lru_list", 1)])


def page_lists(raw, lc) -> np.ndarray:
    """The ``lru_lists`` row each page of ``raw`` (the page table's rows, of
    life cycles ``lc``) is linked in, NULL for none: what its ``info`` and
    its life cycle say."""
    info = raw[:, PAGE_INFO].astype(np.int64)
    group = (lc * NUM_LEVELS + info_level(info)) * NUM_HELD + info_held(info)
    return np.where(info_listed(info) != 0, group * NUM_PRIORITIES + info_priority(info) - PRIORITY_MIN, NULL)


def lru_group_row(life_cycle_id: int, level: int, held: bool) -> int:
    """The ``lru_groups`` row of the candidates of (life cycle, level) that
    are held (or not); the same arithmetic as the kernels'."""
    return (life_cycle_id * NUM_LEVELS + level) * NUM_HELD + int(bool(held))


def lru_list_row(life_cycle_id: int, level: int, held: bool, priority: int) -> int:
    """The ``lru_lists`` row of one priority of that group."""
    return lru_group_row(life_cycle_id, level, held) * NUM_PRIORITIES + priority - PRIORITY_MIN


def eviction_order(mgr, life_cycle_id: int, level: int = 0, held: bool = False) -> list:
    """The page rows of one group of eviction candidates, as the kernels will
    take them: lowest priority first, each priority oldest first."""
    L = len(mgr.config.life_cycles)
    if not isinstance(life_cycle_id, (int, np.integer)) or not 0 <= life_cycle_id < L:
        raise ValueError(f"life_cycle_id must be in 0..{L - 1}, got {life_cycle_id!r}")
    if level not in range(NUM_LEVELS):
        raise ValueError(f"level must be in 0..{NUM_LEVELS - 1}, got {level!r}")
    t = tables(mgr)
    lists, pages = t["lru_lists"], t["pages"]
    order = []
    for priority in range(PRIORITY_MIN, PRIORITY_MIN + NUM_PRIORITIES):
        p = lists[lru_list_row(life_cycle_id, level, held, priority)]["head"]
        while p != NULL and len(order) < pages.shape[0]:
            order.append(int(p))
            p = pages[p]["lru_next"]
    return order


# -- test blocks --------------------------------------------------------------------------
def make_test_block(mgr, tokens, coverage_per_life_cycle, parent=None, scope=None) -> BlockRef:
    """A real tree block (under ``parent`` or the scope's root) with fresh pages
    of the given per-life-cycle coverage (0 = no page), installed by the
    strictly-wider rule. Returns a ``BlockRef``."""
    L = len(mgr.config.life_cycles)
    cov = list(coverage_per_life_cycle)
    if len(cov) != L:
        raise ValueError(f"coverage_per_life_cycle needs one entry per life cycle ({L}), got {len(cov)}")
    n = len(tokens)
    for lc, c in enumerate(cov):
        if not isinstance(c, (int, np.integer)) or not 0 <= c <= n:
            raise ValueError(f"coverage of life cycle {lc} must be in 0..{n}, got {c!r}")
    block, _ = mgr._tree.add(tokens, parent=parent, scope=scope)
    for lc, c in enumerate(cov):
        if c:
            mgr._tree.add_page(block, lc, int(c))
    return block


def test_block_key(mgr, block: BlockRef) -> bytes:
    """The key of a (still existing) test block."""
    mgr._tree.resolve(block)
    return block.key


def close_test_block(mgr, block: BlockRef):
    """Unlink and release every page of a test block (each death runs §2.7)."""
    r = mgr._tree.resolve(block)
    for lc in range(len(mgr.config.life_cycles)):
        p = int(slot_page(mgr._backend.to_host(mgr._tables.slots[r * len(mgr.config.life_cycles) + lc, SLOT_WORD])))
        if p != NULL:
            mgr._tree.page_death(p)


def page_of(mgr, block: BlockRef, life_cycle_id: int):
    """``(page_id, coverage)`` in the block's slot, or None."""
    r = mgr._tree.resolve(block)
    mgr._tree._check_lc(life_cycle_id)
    L = len(mgr.config.life_cycles)
    h = mgr._backend.to_host
    p = int(slot_page(h(mgr._tables.slots[slot_row(r, life_cycle_id, L), SLOT_WORD])))
    return None if p == NULL else (p, int(info_coverage(h(mgr._tables.pages[p, PAGE_INFO]))))


# -- the tree, driven one operation at a time ------------------------------------------------
# Each is one launch of the tree kernel, as the caches would make it; they
# validate their arguments the same way (a bad one raises and changes nothing).
def add_block(mgr, tokens, parent=None, scope=None) -> tuple[BlockRef, bool]:
    """``add_or_get`` (§2.2): the block of ``tokens`` under ``parent`` (a
    ``BlockRef``) or under the scope's root, created without pages when new
    (a longer block adopts the pages of a sibling it covers). Returns
    ``(block, created)``."""
    return mgr._tree.add(tokens, parent=parent, scope=scope)


def add_page(mgr, block: BlockRef, life_cycle_id: int, coverage: int) -> int:
    """Install a fresh committed page of ``coverage`` tokens in the block's slot
    when strictly wider than the incumbent (§2.1); returns its page id, or
    NULL when the incumbent stays."""
    return mgr._tree.add_page(block, life_cycle_id, coverage)


def unlink_page(mgr, block: BlockRef, life_cycle_id: int, expected: int = NULL) -> int:
    """Sever the slot's link to its page (only if it holds ``expected``, when
    given) without any tree cleanup; returns the unlinked page id or NULL."""
    return mgr._tree.unlink_page(block, life_cycle_id, expected)


def page_death(mgr, page: int):
    """A committed page lost its last owner: it dies and the §2.7 cleanup of its
    life-cycle kind runs."""
    mgr._tree.page_death(page)


def remove_subtree(mgr, block: BlockRef):
    """Detach the block and everything under it (post order, leaves first)."""
    mgr._tree.remove_subtree(block)


def clear_stale_blocks_after_page_unlink(mgr, block: BlockRef, life_cycle_id: int):
    """The §2.7 cleanup after ``block`` lost its page in ``life_cycle_id``."""
    mgr._tree.clear_stale_blocks_after_page_unlink(block, life_cycle_id)


def make_childless_root(mgr, scope=None) -> int:
    """The scope's root with no child yet, as ``add_or_get_existing(scope)``
    leaves it in the reference (invariant 1 allows it only transiently); no
    public call leaves one behind. Inserting a sequence of zero tokens creates
    the root and stops. Returns the root's row."""
    tree = mgr._tree
    sid = tree.scope_id(scope, create=True)
    tree._op(OP_INSERT, (sid, tree.scope_key(sid), 0, 0, *tree._scope_digests[sid]), np.zeros(1, dtype=np.int32))
    raw = mgr._backend.to_host(mgr._tables.blocks)
    live_root = (raw[:, BLK_INFO] & (FLAG_ROOT | FLAG_IN_USE)) == (FLAG_ROOT | FLAG_IN_USE)
    (root,) = np.nonzero(live_root & (raw[:, ROOT_SCOPE] == sid))[0]
    return int(root)


def block_exists(mgr, block: BlockRef) -> bool:
    """The block's row still holds this very block (attached or orphan); False
    once the row was released, even if another block took it since."""
    try:
        mgr._tree.resolve(block)
    except ValueError:
        return False
    return True


def block_ref(mgr, row: int) -> BlockRef:
    """A handle on the block now in ``row`` (e.g. one a match returned)."""
    return mgr._tree.ref(row)


def record_log(mgr) -> list:
    """Start collecting the change log: every record a launch writes from now
    on is appended to the returned list (one int64 row each, laid out as
    ``gpukv.core.layout.LOG``: view a list of them with ``LOG.view``)."""
    mgr._tree.log_sink = []
    return mgr._tree.log_sink


# -- matching ---------------------------------------------------------------------------------
def reuse_match_pages(mgr, tokens, life_cycle_id, scope=None, enable_partial=False):
    """Run the match (pruned, no backoff) and return
    ``(num_tokens, [None | (page_id, coverage) for each matched block])``."""
    L = len(mgr.config.life_cycles)
    if not isinstance(life_cycle_id, (int, np.integer)) or not 0 <= life_cycle_id < L:
        raise ValueError(f"life_cycle_id must be in 0..{L - 1}, got {life_cycle_id!r}")
    m = mgr._matcher.match([tokens], scope, partial=bool(enable_partial), backoff=0).to_host()
    h = mgr._backend.to_host
    slots = slots_view(h(mgr._tables.slots), h(mgr._tables.pages))
    pages = []
    for r in m.blocks(0):
        s = slots[slot_row(int(r), life_cycle_id, L)]
        p, c = s["page"], s["coverage"]
        pages.append(None if p == NULL else (int(p), int(c)))
    return int(m.num_tokens[0]), pages


def match_batch(mgr, requests, scopes=None, partial=None, backoff=None):
    """``mgr.match_batch`` with the partial-reuse and backoff settings given
    per call (None: the config's), for comparing one tree under several."""
    return mgr._matcher.match(requests, scopes, partial=partial, backoff=backoff)


def token_digest(mgr, token: int) -> bytes:
    """The 32-byte multimodal digest behind a negative (interned) token id."""
    return mgr._tables.digest_of_token(token)


def interned_digests(mgr) -> tuple[int, np.ndarray]:
    """``(how many digests are interned, a copy of the whole digest table,
    spare rows included)``: enough to tell that a call interned nothing."""
    t = mgr._tables
    return t.num_mm_digests, np.array(mgr._backend.to_host(t.mm_digests))


def interned_scopes(mgr) -> dict:
    """A copy of the scope registry: ``{ReuseScope: scope id}`` of every scope
    a root was ever made for."""
    return dict(mgr._tree._scope_ids)


def detach_count(mgr) -> int:
    """How many times a block has left the tree so far (what a registered
    sequence's memo compares to know whether its rows may have changed)."""
    return int(mgr._tables.counters_host()[CNT_DETACHES])


# -- sanity ---------------------------------------------------------------------------------
def check_sanity(mgr):
    """Verify the tree, slot and eviction-list invariants of docs/semantics.md
    §3 (1-7, 9, 10) and the consistency of both indexes (child keys, siblings
    by first token).

    Raises AssertionError naming the broken invariant."""
    t = tables(mgr)
    toks, slots, pages = t["tokens"], t["slots"], t["pages"]
    raw = mgr._backend.to_host(mgr._tables.blocks)
    ids = mgr._backend.to_host(mgr._tables.block_ids)
    digs = mgr._backend.to_host(mgr._tables.digests)
    digests = mgr.config.block_digests
    T = mgr.config.tokens_per_block
    L = len(mgr.config.life_cycles)
    tree = mgr._tree
    in_use = np.nonzero(raw[:, BLK_INFO] & FLAG_IN_USE)[0]

    def fail(n, msg):
        raise AssertionError(f"invariant {n} broken: {msg}")

    # The child index holds exactly the attached blocks and the roots.
    indexed = set()
    buckets = mgr._backend.to_host(mgr._tables.buckets)
    for b in range(buckets.size):
        r = buckets[b]
        while r != NULL:
            if ids[r, BID_KEY] & (buckets.size - 1) != b:
                fail(2, f"row {r} is chained in bucket {b} but its key belongs elsewhere")
            indexed.add(int(r))
            r = raw[r, BLK_HASH_NEXT]
    # The sibling index holds exactly the attached non-root blocks, each in the
    # bucket of (its parent row, its first token).
    siblings = set()
    heads = mgr._backend.to_host(mgr._tables.sibling_buckets)
    for b in range(heads.size):
        r = heads[b]
        while r != NULL:
            want = sibling_hash_np(np.array([raw[r, BLK_PARENT]]), np.array([toks[r, 0]]))[0] & np.uint64(heads.size - 1)
            if want != b:
                fail(4, f"row {r} is in sibling bucket {b} but its (parent, first token) belongs in {want}")
            siblings.add(int(r))
            r = raw[r, BLK_FIRST_NEXT]
    for r in in_use:
        flags = info_flags(raw[r, BLK_INFO])
        attached = bool(flags & FLAG_ATTACHED)
        if bool(attached and not flags & FLAG_ROOT) != (int(r) in siblings):
            fail(4, f"row {r}: attached non-root={bool(attached and not flags & FLAG_ROOT)} but in the sibling index={int(r) in siblings}")
        if attached != (int(r) in indexed):
            fail(5 if not attached else 2, f"row {r}: attached={attached} but indexed={int(r) in indexed}")
        if flags & FLAG_ROOT:
            scope = _scope_of(tree, raw[r, ROOT_SCOPE])
            if digests and int64x4_to_digest(digs[r]) != hashlib.sha256(scope.to_bytes()).digest():
                fail(1, f"root row {r} is not keyed by SHA256 of its scope bytes")
            if raw[r, BLK_FIRST_CHILD] == NULL:
                fail(1, f"root row {r} has no children outside an operation")
            continue
        if not attached:
            if raw[r, BLK_PARENT] != NULL:
                fail(5, f"orphan row {r} still names parent {raw[r, BLK_PARENT]}")
            continue
        p = raw[r, BLK_PARENT]
        n = info_num_tokens(raw[r, BLK_INFO])
        if not (raw[p, BLK_INFO] & FLAG_IN_USE and raw[p, BLK_INFO] & FLAG_ATTACHED):
            fail(2, f"row {r}'s parent {p} is not an attached block")
        if not 1 <= n <= T:
            fail(2, f"row {r} holds {n} tokens")
        if digests:
            expect = hashlib.sha256(
                int64x4_to_digest(digs[p]) + _encode(mgr, toks[r, :n])
            ).digest()
            if int64x4_to_digest(digs[r]) != expect:
                fail(2, f"row {r}'s key is not SHA256(parent key || tokens)")
        if n < T and raw[r, BLK_FIRST_CHILD] != NULL:
            fail(3, f"partial row {r} ({n} tokens) has children")
    # Children lists: every attached block is in its parent's list exactly
    # once; siblings have unique keys and none is a strict prefix of another.
    for p in in_use:
        if not raw[p, BLK_INFO] & FLAG_ATTACHED:
            continue
        kids = []
        c = raw[p, BLK_FIRST_CHILD]
        while c != NULL:
            if raw[c, BLK_PARENT] != p:
                fail(2, f"row {c} is listed under {p} but names parent {raw[c, BLK_PARENT]}")
            kids.append(int(c))
            c = raw[c, BLK_NEXT_SIBLING]
        # Linked back: each child's prev_sibling names the one before it, the
        # first child's the last.
        back = [int(raw[k, BLK_PREV_SIBLING]) for k in kids]
        if back != kids[-1:] + kids[:-1]:
            fail(2, f"row {p}'s children {kids} are linked back as {back}")
        seqs = [tuple(toks[k, : info_num_tokens(raw[k, BLK_INFO])]) for k in kids]
        if len(set(seqs)) != len(seqs):
            fail(4, f"row {p} has two children with the same tokens")
        for a in seqs:
            for b in seqs:
                if len(a) < len(b) and b[: len(a)] == a:
                    fail(4, f"row {p} has a child whose tokens are a strict prefix of a sibling's")
    # Slots and pages (6, 7). The decoded view's columns: the stored fields,
    # then the decoded ones.
    decoded = pages.view(PAGES.dtype).reshape(pages.shape[0], _PAGES_DECODED.width)
    raw_pages = decoded[:, :PAGES.width]
    page_lc, listed_in = decoded[:, _PAGES_DECODED.col("life_cycle")], decoded[:, _PAGES_DECODED.col("lru_list")]
    for r in in_use:
        if raw[r, BLK_INFO] & FLAG_ROOT:
            continue
        for lc in range(L):
            slot = slots[slot_row(r, lc, L)]
            pg = slot["page"]
            if pg == NULL:
                if slot["word"] != EMPTY_SLOT:
                    fail(6, f"empty slot ({r}, {lc}) holds word {slot['word']}, not {EMPTY_SLOT}")
                continue
            page = pages[pg]
            if slot["whole"] != (page["coverage"] == T):
                fail(6, f"slot ({r}, {lc}) says whole={slot['whole']}, but its page {pg} covers {page['coverage']} of {T}")
            if page["state"] != PAGE_COMMITTED:
                fail(7, f"slot ({r}, {lc}) refers to page {pg}, which is not a live committed page")
            if page["block"] != r or page_lc[pg] != lc:
                fail(6, f"slot ({r}, {lc}) holds page {pg} whose back-pointer is ({page['block']}, {page_lc[pg]})")
            if not 1 <= page["coverage"] <= info_num_tokens(raw[r, BLK_INFO]):
                fail(6, f"slot ({r}, {lc}) page {pg} coverage {page['coverage']} outside 1..{info_num_tokens(raw[r, BLK_INFO])}")
    linked = np.nonzero(raw_pages[:, PAGE_BLOCK] != NULL)[0]
    for pg in linked:
        r = raw_pages[pg, PAGE_BLOCK]
        lc = page_lc[pg]
        if info_state(raw_pages[pg, PAGE_INFO]) != PAGE_COMMITTED or slots[slot_row(r, lc, L)]["page"] != pg:
            fail(7, f"page {pg} points at ({r}, {lc}) but that slot does not hold it")
        if info_coverage(raw_pages[pg, PAGE_INFO]) < 1:
            fail(6, f"page {pg} has coverage {info_coverage(raw_pages[pg, PAGE_INFO])}")
    _check_monotone_coverage(mgr, slots, raw, raw_pages[:, PAGE_SERIAL], digs, in_use, L)
    _check_pools(mgr, raw_pages, fail)
    _check_eviction_lists(mgr, raw_pages, page_lc, listed_in, fail)


def _check_eviction_lists(mgr, pages, page_lc, listed_in, fail):
    """Invariant 9: the eviction candidates are listed exactly, each in the
    list of its (life cycle, level, held or not, priority), every list
    well linked and sorted by tick, the group counts right and every
    group's lowest-priority bound below its members. ``listed_in``: the list
    each page is linked in, as its ``info`` says (``page_lists``)."""
    t = mgr._tables
    h = mgr._backend.to_host
    lists, groups, pool_size = h(t.lru_lists), h(t.lru_groups), h(t.pool_size)
    n = pages.shape[0]
    info = pages[:, PAGE_INFO]
    lc, level, state, priority = page_lc, info_level(info), info_state(info), info_priority(info)
    holders, locks = holds_holders(pages[:, PAGE_HOLDS]), holds_locks(pages[:, PAGE_HOLDS])
    tick = pages[:, PAGE_LRU_TICK]
    has_host = pool_size[(lc * NUM_LEVELS + 1).clip(0, pool_size.size - 1)] > 0
    evictable = (state != PAGE_FREE) & (locks == 0) & np.where(
        holders == 0, state == PAGE_COMMITTED, level < has_host.astype(np.int64))
    group = (lc * NUM_LEVELS + level) * NUM_HELD + (holders > 0)
    want = np.where(evictable, group * NUM_PRIORITIES + priority - PRIORITY_MIN, NULL)
    wrong = np.nonzero(listed_in != want)[0]
    if wrong.size:
        p = int(wrong[0])
        fail(9, f"page {p} is in eviction list {listed_in[p]} but belongs in {want[p]} "
                f"({'a candidate' if evictable[p] else 'no candidate'})")
    free = state == PAGE_FREE  # a free row's lru_next links the free rows
    unlisted = (want == NULL) & ((pages[:, PAGE_LRU_PREV] != NULL) | ((pages[:, PAGE_LRU_NEXT] != NULL) & ~free))
    if unlisted.any():
        fail(9, f"page {int(np.nonzero(unlisted)[0][0])} is in no eviction list but has list neighbours")
    seen = np.zeros(n, dtype=bool)
    for lst in np.nonzero((lists[:, LRU_HEAD] != NULL) | (lists[:, LRU_TAIL] != NULL))[0]:
        prev, p = NULL, lists[lst, LRU_HEAD]
        while p != NULL:
            if not 0 <= p < n or seen[p]:
                fail(9, f"eviction list {lst} reaches page {p} twice or out of range")
            seen[p] = True
            if listed_in[p] != lst or pages[p, PAGE_LRU_PREV] != prev:
                fail(9, f"page {p} is linked in eviction list {lst} but names list "
                        f"{listed_in[p]} and predecessor {pages[p, PAGE_LRU_PREV]} (want {prev})")
            if prev != NULL and tick[prev] > tick[p]:
                fail(9, f"eviction list {lst} is not sorted by tick: page {prev} ({tick[prev]}) before {p} ({tick[p]})")
            prev, p = p, pages[p, PAGE_LRU_NEXT]
        if lists[lst, LRU_TAIL] != prev:
            fail(9, f"eviction list {lst} ends at page {prev} but names tail {lists[lst, LRU_TAIL]}")
    if (seen != (want != NULL)).any():
        fail(9, f"candidate page {int(np.nonzero(seen != (want != NULL))[0][0])} is not reachable in its eviction list")
    listed = want[want != NULL]
    counts = np.bincount(listed // NUM_PRIORITIES, minlength=groups.shape[0])
    bad = np.nonzero(counts != groups[:, LG_COUNT])[0]
    if bad.size:
        g = int(bad[0])
        fail(9, f"eviction group {g} counts {groups[g, LG_COUNT]} candidates but lists {counts[g]}")
    for g in np.unique(listed // NUM_PRIORITIES):
        lowest = int((listed[listed // NUM_PRIORITIES == g] % NUM_PRIORITIES).min()) + PRIORITY_MIN
        if lowest < groups[g, LG_LOWEST]:
            fail(9, f"eviction group {g} lists priority {lowest} below its bound {groups[g, LG_LOWEST]}")


def _check_pools(mgr, pages, fail):
    """Page rows and storage slots are accounted for exactly once; only GPU
    pages are locked; holder counts are sane (§1.4, invariant 9)."""
    t = mgr._tables
    h = mgr._backend.to_host
    pool_top, pool_start, pool_size = h(t.pool_top), h(t.pool_start), h(t.pool_size)
    page_free, row_head, row_start, row_top = h(t.page_free), h(t.row_head), h(t.row_start), h(t.row_top)
    live = info_state(pages[:, PAGE_INFO]) != PAGE_FREE
    level = info_level(pages[:, PAGE_INFO])
    holds = pages[:, PAGE_HOLDS]
    # Negative locks borrow from the holders: they show as more locks than holders.
    if (holds[live] < 0).any() or (holds_locks(holds[live]) > holds_holders(holds[live])).any():
        fail(9, "a page has negative holders or more locks than holders")
    if (level[live & (holds_locks(holds) > 0)] != 0).any():
        fail(9, "a locked page is not on the GPU")
    for lc in range(len(mgr.config.life_cycles)):
        n_rows = int(pool_size[2 * lc] + pool_size[2 * lc + 1])
        rows = np.arange(row_start[lc], row_start[lc] + n_rows)
        free_rows, r = [], row_head[lc]
        while r != NULL and len(free_rows) <= n_rows:  # a cycle stops at one row too many
            free_rows.append(int(r))
            r = pages[r, FREE_ROW_NEXT]
        if len(free_rows) != row_top[lc] or sorted(free_rows) != sorted(rows[~live[rows]].tolist()):
            fail(9, f"life cycle {lc}: the free page rows do not match the free pages")
        for lv in range(2):
            pool = 2 * lc + lv
            in_pool = rows[live[rows] & (level[rows] == lv)]
            used = pages[in_pool, PAGE_POOL_INDEX]
            free = page_free[pool_start[pool]:pool_start[pool] + pool_top[pool]]
            if sorted(np.concatenate([used, free]).tolist()) != list(range(int(pool_size[pool]))):
                fail(9, f"life cycle {lc} level {lv}: storage slots are not each used or free exactly once")


def _check_monotone_coverage(mgr, slots, raw, serials, digs, in_use, L):
    """Invariant 10: while a slot keeps a page, its coverage never decreases.

    Remembered across calls by (block key, life cycle) -> (page serial,
    coverage): a page row is recycled when its page dies, and the serial
    tells a new page in that row from the one seen before. The block key is
    its digest (its serial with ``block_digests`` off). ``serials``: the
    page rows' serials."""
    history = mgr.__dict__.setdefault("_sanity_coverage", {})
    seen = {}
    for r in in_use:
        if raw[r, BLK_INFO] & FLAG_ROOT or not raw[r, BLK_INFO] & FLAG_ATTACHED:
            continue
        key = int64x4_to_digest(digs[r]) if mgr.config.block_digests else int(raw[r, BLK_SERIAL])
        for lc in range(L):
            slot = slots[slot_row(r, lc, L)]
            pg, cov = slot["page"], slot["coverage"]
            if pg == NULL:
                continue
            serial = int(serials[pg])
            before = history.get((key, lc))
            if before is not None and before[0] == serial and cov < before[1]:
                raise AssertionError(f"invariant 10 broken: slot coverage of block row {r}, life cycle {lc} went down")
            seen[(key, lc)] = (serial, int(cov))
    mgr._sanity_coverage = seen


def _scope_of(tree, sid):
    if int(sid) not in tree._scopes:
        raise AssertionError(f"invariant 1 broken: root has unknown scope id {sid}")
    return tree.scope_of(sid)


def _encode(mgr, tokens) -> bytes:
    out = bytearray()
    for t in tokens:
        t = int(t)
        out += mgr._tables.digest_of_token(t) if t < 0 else t.to_bytes(4, "little")
    return bytes(out)


# -- dump --------------------------------------------------------------------------------------
def dump(mgr) -> str:
    """A readable rendering of the tree: one line per block with its tokens
    (abbreviated) and per-life-cycle ``page:coverage``."""
    raw = mgr._backend.to_host(mgr._tables.blocks)
    digs = mgr._backend.to_host(mgr._tables.digests)
    digests = mgr.config.block_digests
    toks = mgr._backend.to_host(mgr._tables.tokens)
    slots = slots_view(mgr._backend.to_host(mgr._tables.slots), mgr._backend.to_host(mgr._tables.pages))
    L = len(mgr.config.life_cycles)
    lines = []
    roots = np.nonzero((raw[:, BLK_INFO] & (FLAG_ROOT | FLAG_IN_USE)) == (FLAG_ROOT | FLAG_IN_USE))[0]
    for root in roots:
        scope = _scope_of(mgr._tree, raw[root, ROOT_SCOPE])
        lines.append(f"root row {root} {scope}")
        stack = [(raw[root, BLK_FIRST_CHILD], 1)]
        while stack:
            r, depth = stack.pop()
            if r == NULL:
                continue
            stack.append((raw[r, BLK_NEXT_SIBLING], depth))
            n = info_num_tokens(raw[r, BLK_INFO])
            shown = [int(x) for x in toks[r, : min(n, 6)]]
            tail = "..." if n > 6 else ""
            pages = " ".join(
                "-" if slots[slot_row(r, lc, L)]["page"] == NULL
                else f"{slots[slot_row(r, lc, L)]['page']}:{slots[slot_row(r, lc, L)]['coverage']}"
                for lc in range(L)
            )
            key = int64x4_to_digest(digs[r]).hex()[:8] if digests else f"#{raw[r, BLK_SERIAL]}"
            lines.append(f"{'  ' * depth}B{depth - 1}/{n} row {r} {key} {shown}{tail} [{pages}]")
            stack.append((raw[r, BLK_FIRST_CHILD], depth + 1))
    return "\n".join(lines) if lines else "(empty tree)"


def insert_sequence(mgr, tokens, scope=None) -> int:
    """Add every block of ``tokens`` to the tree in one launch, each with a
    fresh page of full coverage per life cycle (where strictly wider), as a
    finished request would leave them. Builds trees for benchmarks and
    simulations; returns the number of blocks that got pages."""
    return mgr._tree.insert(tokens, scope)


def committed_page_is_linked(kv, ordinal: int, life_cycle_id: int):
    """None if the cache's slot is empty or holds an uncommitted page; otherwise
    whether that committed page is still linked to a tree block (a page
    replaced by a wider one must be unlinked)."""
    kv._check_lc(life_cycle_id)
    p = int(kv._backend.to_host(kv._q.pages[ordinal, life_cycle_id]))
    if p == NULL:
        return None
    row = kv._backend.to_host(kv._mgr._tables.pages[p])
    if info_state(row[PAGE_INFO]) != PAGE_COMMITTED:
        return None
    return bool(row[PAGE_BLOCK] != NULL)


def committed_blocks(kv) -> list:
    """Per block ordinal of the cache, the tree block it is committed as (a
    ``BlockRef`` to the block now in that row), or None while uncommitted."""
    from .core.layout import Q_NUM_BLOCKS

    n = int(kv._scalars[Q_NUM_BLOCKS])
    rows = kv._backend.to_host(kv._q.tree[:n])
    return [None if r == NULL else kv._mgr._tree.ref(int(r)) for r in rows]


def planned_pages(plan) -> list:
    """``[(life cycle, pool index)]`` of the pages a planned drop names that are
    still the committed pages it was made for, in plan order."""
    tables = plan._tables
    pool_index = tables.backend.to_host(tables.pages[:, PAGE_POOL_INDEX])
    life_cycles = page_life_cycles(tables)
    alive = tables.still_committed([p for p, _ in plan._pages], [s for _, s in plan._pages])
    return [(int(life_cycles[p]), int(pool_index[p])) for (p, _), ok in zip(plan._pages, alive.tolist()) if ok]


def free_pages(mgr, life_cycle_id: int, level: int = 0) -> int:
    """Free storage slots of the life cycle's pool at a cache level (0 = GPU)."""
    mgr._tree._check_lc(life_cycle_id)
    return int(mgr._backend.to_host(mgr._tables.pool_top)[2 * life_cycle_id + level])


# -- KV cache events ---------------------------------------------------------------------------
def event_manager_add_stored_block(mgr, block: BlockRef):
    """Feed a (test) block to the event manager's whole-block stored path, as a
    commit of a new block would (``add_stored_block_event_from_block``): every
    life cycle whose page covers the whole block is announced. Nothing happens
    when events are off."""
    from .core.layout import EV_STORED_BLOCK

    mgr._tree.announce(block, EV_STORED_BLOCK)


def event_manager_add_stored_life_cycle(mgr, block: BlockRef, life_cycle_id: int):
    """Feed a (test) block to the event manager's one-life-cycle stored path,
    as a rebase would (``add_stored_life_cycle_event_from_block``): the life
    cycle is announced when its page covers the whole block; a block never
    announced takes the whole-block path instead."""
    from .core.layout import EV_STORED_LIFE_CYCLE

    mgr._tree.announce(block, EV_STORED_LIFE_CYCLE, life_cycle_id)


def event_manager(mgr):
    """The manager's ``KVCacheEventManager`` (None when events are off), to feed
    it directly or flush its iteration as a scheduler step would."""
    return mgr._events


def announced(mgr) -> set:
    """``{(event block hash, life cycle)}``: what the event manager believes it
    has announced and not removed (empty when events are off)."""
    em = mgr._events
    if em is None:
        return set()
    return em.announced()


# -- the manager -------------------------------------------------------------------------------
def num_open_caches(mgr) -> int:
    """KV caches created and not closed yet."""
    return len(mgr._open_caches)


def cache_segment(kv) -> tuple[int, int]:
    """``(base, rows)``: where a KV cache's block rows lie in its manager's
    cache pool (``CachePool``: ``[base, base + rows)`` of every
    block-indexed array) and how many blocks it has room for."""
    pool = kv._pool
    base, rows = pool.seg[kv._slot]
    return int(base), int(rows)


def cache_pool_rows(mgr) -> int:
    """Block rows of the manager's cache pool: the room of every segment."""
    return mgr._pool.num_rows


# -- the token arena ---------------------------------------------------------------------------
_ARENA_FIELDS = {
    "start": "start",  # where the segment starts, in tokens
    "length": "length",  # tokens
    "capacity_blocks": "cap_blocks",  # the segment's room
    "hashed_blocks": "hashed",  # leading full blocks whose hashes are computed
    "memoized_blocks": "verified",  # leading full blocks whose matched rows are remembered
    "live": "live",
}


def sequence_slot(seq) -> int:
    """The arena slot of a registered ``TokenSequence`` (recycled on release)."""
    return seq._slot


def arena_slot(mgr, slot: int) -> dict:
    """One arena slot's state: ``start``, ``length``, ``capacity_blocks``,
    ``hashed_blocks``, ``memoized_blocks`` (ints) and ``live`` (bool)."""
    a = mgr._arena
    return {name: getattr(a, attr)[slot].item() for name, attr in _ARENA_FIELDS.items()}


def sequence_state(seq) -> dict:
    """``arena_slot`` of a registered sequence's slot."""
    a = seq._arena
    return {name: getattr(a, attr)[seq._slot].item() for name, attr in _ARENA_FIELDS.items()}


def arena_state(mgr) -> dict:
    """Copies of every slot's state (the fields of ``arena_slot``, as arrays)
    and the arena's size: enough to tell that a call changed nothing."""
    a = mgr._arena
    out = {name: getattr(a, attr).copy() for name, attr in _ARENA_FIELDS.items()}
    out["capacity_blocks_total"] = arena_capacity_blocks(mgr)
    return out


def arena_capacity_blocks(mgr) -> int:
    """How many blocks of tokens (and block hashes) the arena holds in all."""
    return int(mgr._arena.hashes.shape[0])


def record_hash_launches(mgr) -> list:
    """From now on, append to the returned list the number of blocks each
    block-hashing launch of this manager hashes."""
    launches = []
    matcher = mgr._matcher
    kernels = matcher.kernels
    inner = kernels.hash_blocks

    def hash_blocks(toks, src, dst, first, hashes, T, total, *rest):
        launches.append(int(total))
        return inner(toks, src, dst, first, hashes, T, total, *rest)

    # The kernels namespace is shared between managers: give this one its own.
    matcher.kernels = SimpleNamespace(**{**vars(kernels), "hash_blocks": hash_blocks})
    return launches

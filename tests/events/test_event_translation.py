"""The event manager's translation of change logs against a plain reference.

``KVCacheEventManager.on_records`` decodes a launch's records as arrays and
applies them in bulk (chains of stored blocks in one pass per layer group).
``Reference`` below is the same four rules of gpukv/events.py written record
by record, the obvious way: no decoding ahead, no batching, events built as
they happen. Randomized change logs (stored chains, single stores, one life
cycle stores, removals, life-cycle removals, updates, bookkeeping records,
multimodal tokens, scopes, in launches and iterations of random sizes) must
give both the same events, ids included, under either event hash and under a
queue cap small enough to drop events.
"""

from __future__ import annotations

import hashlib
import sys
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpukv.core.layout import (
    EV_CREATED,
    EV_PAGE_INFO,
    EV_REMOVED,
    EV_REMOVED_LIFE_CYCLE,
    EV_ROOT_REMOVED,
    EV_STORED_BLOCK,
    EV_STORED_LIFE_CYCLE,
    EV_UPDATED,
    LOG,
    LOG_COVERS,
    LOG_DIGEST,
    LOG_KIND,
    LOG_LEVEL,
    LOG_LIFE_CYCLE,
    LOG_NUM_TOKENS,
    LOG_OLD_LEVEL,
    LOG_PARENT_DIGEST,
    LOG_PARENT_IS_ROOT,
    LOG_PRIORITY,
    LOG_TOKENS_AT,
)
from gpukv.core.scope import ReuseScope
from gpukv.event_types import (
    HASH_ALGOS,
    Diff,
    KVCacheEvent,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    UniqueToken,
    event_block_hash,
)
from gpukv import events
from gpukv.events import _UNIQUE_TOKENS, KVCacheEventManager, _Launch

T = 4  # tokens per block
LIFE_CYCLES = 3
WINDOWS = [T, 0]  # life cycle 2 has none listed: NO_WINDOW


def digest_of_token(t: int) -> bytes:
    return hashlib.sha256(f"mm{t}".encode()).digest()


def key_bytes(words) -> bytes:
    return np.asarray(words, dtype="<i8").tobytes()


# ---------------------------------------------------------------------------
# the reference: the rules, record by record
# ---------------------------------------------------------------------------


class Reference:
    def __init__(self, max_entries, event_hash, windows, digest_of_token, scope_of_root):
        self.max_entries, self.event_hash = max_entries, event_hash
        self.windows, self.digest_of_token, self.scope_of_root = windows, digest_of_token, scope_of_root
        self.announced = {}  # key -> [hash, set of life cycles]
        self.scope_of = {}  # key -> scope (non-default scopes only)
        self.removed = {}  # group -> buffered hashes
        self.pending = []  # [event id, data, group]; a stored one's data is [parent, blocks list, scope]
        self.latest = {}  # group -> its latest stored event (the pending entry), while it may grow
        self.queue = []
        self.next_id = 0

    # -- queueing
    def event(self, data, group):
        if data[0] != "removed":
            self.flush_all()
        entry = [self.next_id, data, group]
        self.next_id += 1
        self.pending.append(entry)
        if data[0] != "stored":
            self.latest.pop(group, None)
        return entry

    def flush(self, group):
        hashes = self.removed.pop(group, None)
        if hashes:
            self.event(("removed", tuple(hashes)), group)

    def flush_all(self):
        for group in sorted(self.removed):
            self.flush(group)

    def stored_event(self, parent_hash, block, group, scope):
        self.flush(group)
        latest = self.latest.get(group)
        if not self.removed and latest is not None:
            _, blocks, latest_scope = latest[1][1]
            if blocks[-1].block_hash == parent_hash and latest_scope == scope:
                blocks.append(block)
                return
        self.latest[group] = self.event(("stored", [parent_hash, [block], scope]), group)

    # -- the records
    def feed(self, records, log_tokens):
        rows = np.asarray(records).reshape(-1, LOG.width).tolist()
        i = 0
        while i < len(rows):
            r = rows[i]
            key = key_bytes(r[LOG_DIGEST : LOG_DIGEST + 4])
            kind = r[LOG_KIND]
            if kind in (EV_STORED_BLOCK, EV_STORED_LIFE_CYCLE):
                j = i + 1
                while j < len(rows) and rows[j][LOG_KIND] == EV_PAGE_INFO:
                    j += 1
                self.header(r, key, rows[i + 1 : j], log_tokens)
                i = j
                continue
            if kind == EV_REMOVED:
                self.scope_of.pop(key, None)
                state = self.announced.pop(key, None)
                if state is not None:
                    for lc in sorted(state[1]):
                        self.removed.setdefault(lc, []).append(state[0])
            elif kind == EV_REMOVED_LIFE_CYCLE:
                state = self.announced.get(key)
                lc = r[LOG_LIFE_CYCLE]
                if state is not None and lc in state[1]:
                    state[1].discard(lc)
                    if not state[1]:
                        del self.announced[key]
                    self.removed.setdefault(lc, []).append(state[0])
            elif kind == EV_UPDATED:
                state = self.announced.get(key)
                if state is not None:
                    data = ("updated", state[0], Diff(r[LOG_OLD_LEVEL], r[LOG_LEVEL]))
                    self.event(data, r[LOG_LIFE_CYCLE])
            i += 1

    def header(self, r, key, infos, log_tokens):
        tokens = [int(t) for t in log_tokens[r[LOG_TOKENS_AT]][: r[LOG_NUM_TOKENS]]]
        tokens = [self.digest_of_token(t) if t < 0 else t for t in tokens]
        pages = {p[LOG_LIFE_CYCLE]: p for p in infos}
        parent_key = key_bytes(r[LOG_PARENT_DIGEST : LOG_PARENT_DIGEST + 4])
        if r[LOG_PARENT_IS_ROOT]:
            parent_hash = None
            scope = self.scope_of_root(parent_key)
            scope = None if scope == ReuseScope() else scope
        else:
            parent_hash = event_block_hash(parent_key, self.event_hash)
            scope = self.scope_of.get(parent_key)
        if scope is not None:
            self.scope_of[key] = scope
        covering = sorted(lc for lc, p in pages.items() if p[LOG_COVERS])
        state = self.announced.get(key)
        if r[LOG_KIND] == EV_STORED_BLOCK or state is None:
            if not covering:
                return
            block_hash = event_block_hash(key, self.event_hash)
            self.announced[key] = [block_hash, set(covering)]
            announce = covering
        else:
            lc = r[LOG_LIFE_CYCLE]
            if lc in state[1] or lc not in covering:
                return
            state[1].add(lc)
            block_hash = state[0]
            announce = [lc]
        unique = tuple(UniqueToken(t.hex() if isinstance(t, bytes) else t) for t in tokens)
        mm_keys = tuple(dict.fromkeys(t.hex() for t in tokens if isinstance(t, bytes)))
        for lc in announce:
            p = pages[lc]
            block = KVCacheStoredBlockData(block_hash, unique, p[LOG_LEVEL], p[LOG_PRIORITY], mm_keys)
            self.stored_event(parent_hash, block, lc, scope)

    # -- the iteration
    def drain(self):
        self.flush_all()
        self.latest = {}
        self.queue = (self.queue + self.pending)[-self.max_entries :]
        self.pending = []
        out = [self.as_event(*entry) for entry in self.queue]
        self.queue = []
        return out

    def as_event(self, event_id, data, group):
        if data[0] == "stored":
            parent, blocks, scope = data[1]
            payload = KVCacheStoredData(parent, tuple(blocks), scope)
        elif data[0] == "removed":
            payload = KVCacheRemovedData(data[1])
        else:
            payload = KVCacheUpdatedData(data[1], data[2], None)
        window = self.windows[group] if 0 <= group < len(self.windows) else 0
        return KVCacheEvent(event_id, payload, window, HASH_ALGOS[self.event_hash], 0, group)


# ---------------------------------------------------------------------------
# random change logs
# ---------------------------------------------------------------------------


class RandomLog:
    """Blocks with random keys under a few roots (some of them scoped), and
    change-log launches over them in the kernel's layout."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.roots = [rng.integers(-2**63, 2**63 - 1, 4, dtype=np.int64) for _ in range(3)]
        self.scopes = {key_bytes(self.roots[1]): ReuseScope(salt=7), key_bytes(self.roots[2]): ReuseScope()}
        self.blocks = []  # (key words, parent words, parent is a root)
        self.rows, self.tokens = [], []

    def scope_of_root(self, digest: bytes):
        return self.scopes.get(digest)

    def row(self, kind, words=None, **cols):
        r = np.zeros(LOG.width, dtype=np.int64)
        r[LOG_KIND] = kind
        r[LOG_LIFE_CYCLE] = -1
        if words is not None:
            r[LOG_DIGEST : LOG_DIGEST + 4] = words
        for col, value in cols.items():
            r[globals()[col]] = value
        self.rows.append(r)

    def new_block(self):
        rng = self.rng
        if self.blocks and rng.random() < 0.7:
            parent, at_root = self.blocks[-1 if rng.random() < 0.7 else int(rng.integers(len(self.blocks)))][0], 0
        else:
            parent, at_root = self.roots[int(rng.integers(len(self.roots)))], 1
        block = (rng.integers(-2**63, 2**63 - 1, 4, dtype=np.int64), parent, at_root)
        self.blocks.append(block)
        return block

    def pages(self):
        """``(life cycle, covers)`` of the pages a block has, ascending."""
        rng = self.rng
        return [(lc, int(rng.random() < 0.8)) for lc in range(LIFE_CYCLES) if rng.random() < 0.75]

    def header(self, kind, block, life_cycle=-1, pages=None):
        rng = self.rng
        words, parent, at_root = block
        n = T if rng.random() < 0.8 else int(rng.integers(1, T + 1))  # the tokens past n are junk
        row = rng.integers(0, 40, T)
        if rng.random() < 0.15:  # multimodal: negative ids stand for digests
            row[rng.random(T) < 0.5] = -int(rng.integers(1, 4))
        elif rng.random() < 0.1:
            row = rng.integers(0, 2**21, T)  # ids past the token table
        self.tokens.append(row)
        self.row(kind, words, LOG_LIFE_CYCLE=life_cycle, LOG_PARENT_IS_ROOT=at_root, LOG_NUM_TOKENS=n,
                 LOG_TOKENS_AT=len(self.tokens) - 1)
        self.rows[-1][LOG_PARENT_DIGEST : LOG_PARENT_DIGEST + 4] = parent
        for lc, covers in self.pages() if pages is None else pages:
            self.row(EV_PAGE_INFO, LOG_LIFE_CYCLE=lc, LOG_COVERS=covers,
                     LOG_LEVEL=int(rng.integers(2)), LOG_PRIORITY=int(rng.integers(3)))

    def known(self):
        return self.blocks[int(self.rng.integers(len(self.blocks)))][0]

    def launch(self, records: int):
        rng = self.rng
        while len(self.rows) < records:
            op = rng.random()
            if op < 0.35 or not self.blocks:  # a committed chain, its blocks mostly paged alike
                pages = self.pages()
                for _ in range(int(rng.integers(1, 6))):
                    if rng.random() < 0.3:
                        self.row(EV_CREATED, self.known() if self.blocks else None)
                    self.header(EV_STORED_BLOCK, self.new_block(), pages=pages if rng.random() < 0.8 else None)
            elif op < 0.45:  # a block stored again
                self.header(EV_STORED_BLOCK, self.blocks[int(rng.integers(len(self.blocks)))])
            elif op < 0.55:
                self.header(EV_STORED_LIFE_CYCLE, self.blocks[int(rng.integers(len(self.blocks)))],
                            int(rng.integers(LIFE_CYCLES)))
            elif op < 0.72:  # a subtree removal
                for _ in range(int(rng.integers(1, 4))):
                    self.row(EV_REMOVED, self.known())
            elif op < 0.82:
                self.row(EV_REMOVED_LIFE_CYCLE, self.known(), LOG_LIFE_CYCLE=int(rng.integers(LIFE_CYCLES)))
            elif op < 0.92:
                self.row(EV_UPDATED, self.known(), LOG_LIFE_CYCLE=int(rng.integers(LIFE_CYCLES)),
                         LOG_OLD_LEVEL=int(rng.integers(2)), LOG_LEVEL=int(rng.integers(2)))
            else:
                self.row(EV_ROOT_REMOVED)
        records = np.array(self.rows, dtype=np.int64).reshape(-1, LOG.width)
        tokens = np.array(self.tokens, dtype=np.int32).reshape(-1, T) if self.tokens else np.zeros((1, T), np.int32)
        self.rows, self.tokens = [], []
        return records, tokens


def both(max_entries, event_hash, log):
    args = (max_entries, event_hash, WINDOWS, digest_of_token, log.scope_of_root)
    return KVCacheEventManager(*args), Reference(*args)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), max_entries=st.sampled_from([5, 40, 10**6]),
       event_hash=st.sampled_from(sorted(HASH_ALGOS)))
def test_translation_matches_the_record_by_record_reference(seed, max_entries, event_hash):
    rng = np.random.default_rng(seed)
    log = RandomLog(rng)
    em, ref = both(max_entries, event_hash, log)
    for _ in range(int(rng.integers(1, 8))):  # iterations
        for _ in range(int(rng.integers(1, 4))):  # launches in one
            records, tokens = log.launch(int(rng.integers(1, 60)))
            em.on_records(records, tokens)
            ref.feed(records, tokens)
        em.flush_iteration_events()
        assert em.get_latest_events() == ref.drain()


def interrupt_at(k: int, fn):
    """Run ``fn`` with a KeyboardInterrupt raised at its ``k``-th line event in
    gpukv/events.py; returns whether it fired."""
    seen = [0]

    def tracer(frame, event, arg):
        if not frame.f_code.co_filename.endswith("gpukv/events.py"):
            return None

        def local(frame, event, arg):
            if event == "line":
                seen[0] += 1
                if seen[0] == k:
                    raise KeyboardInterrupt
            return local

        return local

    sys.settrace(tracer)
    try:
        fn()
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)
    return False


@pytest.mark.parametrize("seed", [1, 2])
def test_a_launch_interrupted_anywhere_applies_whole_when_fed_again(seed):
    """Cut at every line in turn, a launch leaves no trace and its count does
    not move; feeding the same records again from the count gives the events
    of an uninterrupted run."""
    rng = np.random.default_rng(seed)
    log = RandomLog(rng)
    launches = [log.launch(int(rng.integers(20, 60))) for _ in range(4)]
    assert runs_cut_at_every_line(log, launches, uninterrupted_events(log, launches), dense=400, stride=7) > 100


def uninterrupted_events(log: RandomLog, launches: list) -> list:
    """The events of ``launches`` fed in turn to a fresh event manager."""
    em, _ = both(10**6, "sha256", log)
    for records, tokens in launches:
        em.on_records(records, tokens)
    em.flush_iteration_events()
    return em.get_latest_events()


def runs_cut_at_every_line(log: RandomLog, launches: list, want: list, dense: int, stride: int) -> int:
    """``launches`` fed to a fresh event manager once per line event ``k``
    (every one up to ``dense``, then every ``stride``-th), the first launch
    that reaches it cut there and fed again from its count, as the launcher
    does after an interrupt: each run's events equal ``want``, and a cut
    launch left no trace (its count at none or all of its records). How
    many runs were cut, up to the first that ran through."""
    k, cut = 1, 0
    while True:
        em, _ = both(10**6, "sha256", log)
        fired = False
        for records, tokens in launches:
            progress = np.zeros(1, dtype=np.int64)
            if not fired:
                fired = interrupt_at(k, lambda: em.on_records(records, tokens, progress))
                if fired:
                    assert progress[0] in (0, len(records))
            em.on_records(records, tokens, progress)  # what the launcher does after an interrupt
            assert progress[0] == len(records)
        em.flush_iteration_events()
        assert em.get_latest_events() == want, f"interrupted at line event {k}"
        if not fired:
            return cut
        cut += 1
        k += 1 if k < dense else stride


def test_malformed_records_are_rejected_before_any_applies():
    log = RandomLog(np.random.default_rng(3))
    em, _ = both(10**6, "sha256", log)
    records, tokens = log.launch(30)
    bad = np.concatenate([records, records[:1]])
    bad[-1, LOG_KIND] = 99
    with pytest.raises(ValueError, match=f"log record {len(records)}: unknown kind 99"):
        em.on_records(bad, tokens)
    log.header(EV_STORED_BLOCK, log.new_block(), pages=[(0, 1)])
    header_last, tokens = log.launch(0)
    info_first = np.concatenate([header_last[1:], header_last[:1]])  # a page info before any header
    with pytest.raises(ValueError, match="log record 0: a page info record without a stored header"):
        em.on_records(info_first, tokens)
    em.flush_iteration_events()
    assert em.get_latest_events() == []


# ---------------------------------------------------------------------------
# the two decoders, and the launch of whole-block stores in one pass
# ---------------------------------------------------------------------------


def commits(log: RandomLog, chains: int):
    """A launch as a batched commit writes it: chains of whole-block stores,
    each block covered in the same life cycles, a chain under a root, under a
    known block or under the chain before it, with the kernel's bookkeeping
    records among them."""
    rng = log.rng
    pages = [(lc, 1) for lc in range(LIFE_CYCLES) if rng.random() < 0.6] or [(0, 1)]
    for _ in range(chains):
        at = rng.random()
        if at < 0.3 or not log.blocks:
            parent = (log.roots[int(rng.integers(len(log.roots)))], 1)
        elif at < 0.7:
            parent = (log.known(), 0)
        else:
            parent = (log.blocks[-1][0], 0)
        for _ in range(int(rng.integers(1, 5))):
            block = (rng.integers(-2**63, 2**63 - 1, 4, dtype=np.int64), *parent)
            log.blocks.append(block)
            if rng.random() < 0.5:
                log.row(EV_CREATED, block[0])
            log.header(EV_STORED_BLOCK, block, pages=pages)
            parent = (block[0], 0)
    return log.launch(0)


def decoded(records, tokens, decoder, event_hash="sha256"):
    """The columns of a launch decoded by ``decoder``, its stored blocks made."""
    launch = _Launch.__new__(_Launch)
    getattr(launch, decoder)(records, tokens, event_hash, digest_of_token, _UNIQUE_TOKENS, 0)
    columns = {name: getattr(launch, name) for name in _Launch.__slots__}
    if launch.blocks is not None:
        columns["blocks"] = launch.blocks.blocks(0, len(launch.block_lcs), 1)
    return columns


@pytest.mark.parametrize("seed", range(12))
def test_both_decoders_give_the_same_columns(seed):
    """A launch decoded record by record (``_rows``) and with array
    operations (``_arrays``) gives the same columns, whatever its records."""
    rng = np.random.default_rng(seed)
    log = RandomLog(rng)
    commit_launches = 0
    for size in (1, 3, 10, 40, 100, 300):
        for event_hash in sorted(HASH_ALGOS):
            records, tokens = commits(log, size // 4 + 1) if rng.random() < 0.4 else log.launch(size)
            rows = decoded(records, tokens, "_rows", event_hash)
            assert rows == decoded(records, tokens, "_arrays", event_hash)
            commit_launches += rows["store_lcs"] is not None
    assert commit_launches


def commits_and_others(seed, max_entries, event_hash, in_one_pass=None):
    """Batched commits among other launches, in iterations, against the reference."""
    rng = np.random.default_rng(seed)
    log = RandomLog(rng)
    em, ref = both(max_entries, event_hash, log)
    if in_one_pass is not None:  # (taken, whether it recorded scopes) of each try
        store_chains = em._store_chains

        def spy(*args):
            scoped = len(em._scope_of)
            taken = store_chains(*args)
            in_one_pass.append((taken, len(em._scope_of) > scoped))
            return taken

        em._store_chains = spy
    for _ in range(int(rng.integers(1, 6))):  # iterations
        for _ in range(int(rng.integers(1, 4))):  # launches in one
            if rng.random() < 0.6:
                records, tokens = commits(log, int(rng.integers(1, 12)))
            else:
                records, tokens = log.launch(int(rng.integers(1, 60)))
            em.on_records(records, tokens)
            ref.feed(records, tokens)
        em.flush_iteration_events()
        assert em.get_latest_events() == ref.drain()


@pytest.mark.parametrize("decoder_rows_max", [0, 10**9], ids=["arrays", "rows"])
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), max_entries=st.sampled_from([5, 40, 10**6]),
       event_hash=st.sampled_from(sorted(HASH_ALGOS)))
def test_each_decoder_and_the_commit_path_match_the_reference(decoder_rows_max, seed, max_entries, event_hash):
    """Batched commits (``_store_chains``) among other launches, each decoder
    in turn for every launch: the events of the record-by-record reference."""
    with mock.patch.object(events, "_ROWS_MAX", decoder_rows_max):
        commits_and_others(seed, max_entries, event_hash)


def test_the_commit_path_is_taken_scopes_and_all():
    """The runs above take the one-pass path for most commits, scoped chains
    among them, and fall back (matching the reference too) for the rest."""
    in_one_pass = []
    for seed in range(40):
        commits_and_others(seed, 5 if seed % 4 == 0 else 10**6, "sha256", in_one_pass)
    assert in_one_pass.count((True, True)) > 5  # scoped chains
    assert in_one_pass.count((True, False)) > 20
    assert [taken for taken, _ in in_one_pass].count(False) >= 3  # near the cap (_trim)


@pytest.mark.parametrize("decoder_rows_max", [0, 10**9], ids=["arrays", "rows"])
def test_a_commit_interrupted_anywhere_applies_whole_when_fed_again(decoder_rows_max):
    """The one-pass commit path, cut at every line in turn: no trace, and the
    same records fed again give the events of an uninterrupted run."""
    rng = np.random.default_rng(5)
    log = RandomLog(rng)
    launches = [commits(log, 6), log.launch(20), commits(log, 8)]
    with mock.patch.object(events, "_ROWS_MAX", decoder_rows_max):
        want = uninterrupted_events(log, launches)
        assert any(getattr(event.data, "scope", None) is not None for event in want)
        assert runs_cut_at_every_line(log, launches, want, dense=300, stride=5) >= 150

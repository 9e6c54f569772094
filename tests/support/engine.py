"""A fake model that runs on gpukv's real page memory, so tests can prove that
reused KV is the right KV.

With ``page_bytes = 8 * T`` every page is viewed as ``int64[T]``: slot ``i`` of an
attention page holds the "KV" of the token at offset ``i`` of its block; slot 0 of
an SSM page holds the recurrent state. The value written for life cycle ``lc`` at
absolute position ``p`` is ``token_value(lc, p, tokens[:p + 1])``: a 64-bit hash of
everything the model has seen up to ``p``, so a page copied from the wrong place,
never written, or written by another prefix reads back wrong (docs/semantics.md §3
invariant 15, scenarios P3, D6, D8).

- ``Engine.run(kv, tokens_all, start, end)`` is one model step over positions
  ``[start, end)``: it writes every attention page the cache owns for those
  positions (``kv.page_indices``; -1, e.g. a stale SWA block, has nowhere to write)
  and sets the live SSM state to the state after ``tokens_all[:end]``. It refuses to
  write into a committed (shared) page, and checks that the SSM state it reads is
  the state after ``tokens_all[:start]``.
- ``Engine.verify_reuse(kv, tokens_all)`` checks every committed position the cache
  must be able to attend to (outside the stale range at the committed length and at
  the current history) and its SSM state.
- ``Engine.verify_written(kv, tokens_all, n)`` checks every position below ``n``
  that the cache still attends to, committed or not.
- ``Engine.verify_tree()`` checks the data of every page linked in the tree against
  its block's token path, up to the page's coverage.

With ``page_bytes = 0`` (index only) the engine owns the KV memory, as a serving
engine does: one ``int64[pages, T]`` array per life cycle and cache level, sized
from the configuration. Before it touches a page it takes the copies gpukv
decided on (``take_page_copies``) and carries them out on its own arrays, in
order (``sync``); ``applied`` keeps every copy it made, for tests that compare
them with what gpukv's own page memory did.

Only ``gpukv``'s public surface and ``gpukv.introspect`` are used, plus the record
fields that ``introspect.tables`` exposes.
"""

from __future__ import annotations

import hashlib
from itertools import chain

import numpy as np

from gpukv import introspect
from gpukv.core.layout import FLAG_ATTACHED, FLAG_IN_USE, FLAG_ROOT

# ---------------------------------------------------------------------------
# token values
# ---------------------------------------------------------------------------


def _encode(token) -> bytes:
    if isinstance(token, (bytes, bytearray)):
        return bytes(token)
    return int(token).to_bytes(4, "little")


def _extend(digest: bytes, token) -> bytes:
    """The running digest of a token prefix, one token further."""
    return hashlib.blake2b(digest + _encode(token), digest_size=16).digest()


def _value(lc: int, pos: int, digest: bytes) -> int:
    """The engine's value for life cycle ``lc`` at position ``pos`` after the prefix
    whose running digest is ``digest``. Never 0, so zeroed memory never passes."""
    h = hashlib.blake2b(lc.to_bytes(4, "little") + pos.to_bytes(8, "little") + digest, digest_size=8).digest()
    return int.from_bytes(h, "little", signed=True) or 1


def prefix_digests(tokens) -> list:
    """Running digests of ``tokens``: entry ``p`` covers ``tokens[:p + 1]``."""
    out, d = [], b""
    for t in tokens:
        d = _extend(d, t)
        out.append(d)
    return out


def token_value(lc: int, pos: int, prefix) -> int:
    """The value for life cycle ``lc`` at absolute position ``pos``; ``prefix`` is
    every token up to and including ``pos``."""
    prefix = list(prefix)
    if len(prefix) != pos + 1:
        raise ValueError(f"token_value at position {pos} needs the {pos + 1} tokens up to it, got {len(prefix)}")
    return _value(lc, pos, prefix_digests(prefix)[-1])


# ---------------------------------------------------------------------------
# stale ranges (docs/semantics.md §1.5), from the public layer specs
# ---------------------------------------------------------------------------


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def stale_range(spec, history: int, T: int) -> tuple[int, int]:
    """Blocks ``[start, end)`` an attention life cycle does not read at ``history``."""
    start = min(ceil_div(history, T), ceil_div(spec.sink_tokens, T))
    if spec.window is None:
        return start, start
    # The +1: attention always runs for the token at position `history`.
    return start, max(start, (history + 1 - spec.window) // T)


def _host(a) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.get()  # CuPy on the cuda backend


def _xp(a):
    if isinstance(a, np.ndarray):
        return np
    import cupy  # noqa: PLC0415 - only on the cuda backend

    return cupy


# ---------------------------------------------------------------------------
# the engine
# ---------------------------------------------------------------------------


class Engine:
    """Plays the model for every cache of one manager (see the module docstring)."""

    def __init__(self, mgr):
        self.mgr = mgr
        self.T = mgr.tokens_per_block
        config = mgr.config
        self.owns_memory = config.page_bytes == 0
        if not self.owns_memory and config.page_bytes != 8 * self.T:
            raise ValueError(f"the engine needs page_bytes = 8 * T = {8 * self.T} or 0, got {config.page_bytes}")
        # Index only: the engine's own pools, [level][life cycle] (None: no pages there).
        self.own = None
        if self.owns_memory:
            self.own = [
                [np.zeros((n, self.T), dtype=np.int64) if n else None for n in config.pages_per_life_cycle_list(host=host)]
                for host in (False, True)
            ]
        self.applied: list = []  # int64[n, 5] tables of the copies carried out, in order
        self.specs = tuple(mgr.life_cycles)
        self.ssm = mgr.ssm_life_cycle_id
        self.attention = [lc for lc in range(len(self.specs)) if lc != self.ssm]
        self._digests: dict = {}  # tuple(tokens) -> prefix_digests
        self._ssm_state: dict = {}  # id(kv) -> (kv, the live SSM value the engine last wrote)
        self._block_values: dict = {}  # (block digest bytes, lc) -> int64[num_tokens] expected values

    # -- memory -----------------------------------------------------------------------
    def words(self, lc: int):
        """Life cycle ``lc``'s GPU page pool as ``int64[pages, T]`` (a view: writes land)."""
        if self.owns_memory:
            self.sync()
            return self.own[0][lc]
        mem = self.mgr.page_memory(lc)
        return mem.view(np.int64)

    def host_words(self, lc: int):
        """Life cycle ``lc``'s host-tier pool as ``int64[pages, T]``, None without one."""
        if self.owns_memory:
            self.sync()
            return self.own[1][lc]
        mem = self.mgr.page_memory(lc, 1)
        return None if mem is None else mem.view(np.int64)

    def sync(self) -> None:
        """Index only: carry out the copies gpukv decided on since the last
        sync, in order, on the engine's own pools (what a serving engine does
        once per step, before the model runs)."""
        if self.owns_memory:
            self.apply(self.mgr.take_page_copies())

    def apply(self, copies) -> None:
        """Carry out ``copies`` (a ``gpukv.PageCopies``) on the engine's own pools."""
        for lc, src_level, src, dst_level, dst in copies.batches():
            self.own[dst_level][lc][dst] = self.own[src_level][lc][src]
        if len(copies):
            self.applied.append(copies.table())

    def applied_table(self) -> np.ndarray:
        """Every copy carried out so far, ``int64[n, 5]`` in order."""
        return np.concatenate(self.applied) if self.applied else np.zeros((0, 5), dtype=np.int64)

    def read_page(self, lc: int, pool_index: int) -> np.ndarray:
        """A copy of one page's ``T`` words."""
        return np.array(_host(self.words(lc)[int(pool_index)]), dtype=np.int64)

    def write_word(self, lc: int, pool_index: int, slot: int, value: int) -> None:
        self.words(lc)[int(pool_index), int(slot)] = int(value)

    def pool_index(self, page_id: int) -> int:
        """The pool index of a page-table row (``reuse_match_pages`` gives rows)."""
        return int(introspect.tables(self.mgr)["pages"]["pool_index"][int(page_id)])

    # -- values -------------------------------------------------------------------------
    def digests(self, tokens) -> list:
        key = tuple(t if isinstance(t, bytes) else int(t) for t in tokens)
        d = self._digests.get(key)
        if d is None:
            if len(self._digests) > 4096:
                self._digests.clear()
            d = self._digests[key] = prefix_digests(key)
        return d

    def values(self, lc: int, tokens_all, positions) -> np.ndarray:
        d = self.digests(tokens_all)
        return np.array([_value(lc, int(p), d[int(p)]) for p in positions], dtype=np.int64)

    def state_value(self, tokens_all, n: int) -> int:
        """The SSM state after the first ``n`` tokens (n > 0)."""
        return _value(self.ssm, n - 1, self.digests(tokens_all)[n - 1])

    # -- one model step -------------------------------------------------------------------
    def run(self, kv, tokens_all, start: int, end: int) -> None:
        """The model runs positions ``[start, end)`` of ``tokens_all`` on ``kv``."""
        T = self.T
        tokens_all = list(tokens_all)
        assert kv.status.name == "ACTIVE", f"the engine runs an ACTIVE cache, not {kv.status}"
        assert 0 <= start <= end <= len(tokens_all), f"bad range [{start}, {end}) of {len(tokens_all)} tokens"
        assert end <= kv.capacity, f"the engine writes within the capacity ({end} > {kv.capacity})"
        if start == end:
            return
        pos = np.arange(start, end, dtype=np.int64)
        for lc in self.attention:
            idx = np.asarray(kv.page_indices(lc)).astype(np.int64)
            blk = pos // T
            assert blk[-1] < len(idx), f"position {end - 1} is past the cache's {len(idx)} blocks"
            page = idx[blk]
            keep = page >= 0
            for o in np.unique(blk[keep]):
                if introspect.committed_page_is_linked(kv, int(o), lc) is not None:
                    raise AssertionError(
                        f"the engine would write block {o} of life cycle {lc} into a committed (shared) page {idx[o]}"
                    )
            if not keep.any():
                continue
            words = self.words(lc)
            xp = _xp(words)
            words[xp.asarray(page[keep]), xp.asarray(pos[keep] % T)] = xp.asarray(self.values(lc, tokens_all, pos[keep]))
        if self.ssm is not None:
            s = int(kv.ssm_page_index())
            if s >= 0:
                words = self.words(self.ssm)
                if start > 0:  # the model reads the state it continues from
                    want = self._expected_state(kv, tokens_all, start)
                    got = int(words[s, 0])
                    assert got == want, (
                        f"SSM state read at position {start} (page {s}) is wrong: got {got}, want {want}"
                        f"{' (never written)' if got == 0 else ''}"
                    )
                value = self.state_value(tokens_all, end)
                words[s, 0] = value
                self._ssm_state[id(kv)] = (kv, value, end)

    def _expected_state(self, kv, tokens_all, n: int) -> int:
        rec = self._ssm_state.get(id(kv))
        if rec is not None and rec[0] is kv and rec[2] == n:
            return rec[1]
        return self.state_value(tokens_all, n)

    # -- checks ------------------------------------------------------------------------------
    def verify_reuse(self, kv, tokens_all) -> None:
        """Every committed position of every attention life cycle that is needed at
        the committed length (not stale there) and still held (not stale at the
        current history) holds the right value; the SSM page holds the state the
        engine last wrote, or else the state after the committed tokens."""
        T = self.T
        N = int(kv.num_committed_tokens)
        if N == 0 or kv.status.name == "CLOSED":
            return
        tokens_all = list(tokens_all)
        assert len(tokens_all) >= N, f"verify_reuse needs the {N} committed tokens, got {len(tokens_all)}"
        h = int(kv.history_length)
        for lc in self.attention:
            spec = self.specs[lc]
            s0, e0 = stale_range(spec, N, T)
            s1, e1 = stale_range(spec, h, T)
            needed = [o for o in chain(range(s0), range(e0, ceil_div(N, T))) if not s1 <= o < e1]
            if not needed:
                continue
            idx = np.asarray(kv.page_indices(lc)).astype(np.int64)
            for o in needed:
                assert o < len(idx) and idx[o] >= 0, f"reused block {o} has no page for life cycle {lc}"
            pos = np.concatenate([np.arange(o * T, min(N, o * T + T), dtype=np.int64) for o in needed])
            self._check_positions("reused", lc, idx[pos // T], pos, tokens_all)
        if self.ssm is not None:
            s = int(kv.ssm_page_index())
            if s >= 0:
                rec = self._ssm_state.get(id(kv))
                want = rec[1] if rec is not None and rec[0] is kv else self.state_value(tokens_all, N)
                got = int(self.words(self.ssm)[s, 0])
                assert got == want, f"SSM state in page {s} is wrong: got {got}, want {want} (committed length {N})"

    def verify_written(self, kv, tokens_all, n: int) -> None:
        """Every position below ``n`` that the engine wrote for this cache
        (``run``) and that the cache still attends to (not stale at its
        current history) holds the right value: the cache's own pages, private
        or committed, kept their data through suspends, resumes, migrations
        and resizes."""
        T = self.T
        n = min(int(n), int(kv.capacity))
        if n <= 0 or kv.status.name != "ACTIVE":
            return
        tokens_all = list(tokens_all)
        h = int(kv.history_length)
        for lc in self.attention:
            s, e = stale_range(self.specs[lc], h, T)
            idx = np.asarray(kv.page_indices(lc)).astype(np.int64)
            pos = np.arange(n, dtype=np.int64)
            blk = pos // T
            pos = pos[(blk < s) | (blk >= e)]
            if not pos.size:
                continue
            page = idx[pos // T]
            missing = np.nonzero(page < 0)[0]
            assert not missing.size, (
                f"written position {int(pos[missing[0]])} (block {int(pos[missing[0]]) // T}, life cycle {lc}) "
                f"has no page at history {h}"
            )
            self._check_positions("written", lc, page, pos, tokens_all)

    def _check_positions(self, what: str, lc: int, pages: np.ndarray, pos: np.ndarray, tokens_all) -> None:
        """The words at token positions ``pos`` of ``pages`` (one page per
        position) hold what the engine writes there for ``tokens_all``."""
        T = self.T
        words = self.words(lc)
        xp = _xp(words)
        got = _host(words[xp.asarray(pages), xp.asarray(pos % T)])
        want = self.values(lc, tokens_all, pos)
        bad = np.nonzero(got != want)[0]
        if bad.size:
            i = bad[0]
            p = int(pos[i])
            raise AssertionError(
                f"{what} KV at position {p} (block {p // T}, life cycle {lc}, page {pages[i]}) is wrong: "
                f"got {got[i]}, want {want[i]}{' (never written)' if got[i] == 0 else ''}; "
                f"{bad.size} of {pos.size} positions wrong"
            )

    def verify_tree(self) -> None:
        """Every page linked in the tree, on the GPU or on the host tier, holds
        the right values for the first ``coverage`` tokens of its block (an SSM
        page: the state at exactly ``coverage``). Blocks with multimodal
        (digest) tokens are skipped."""
        T = self.T
        t = introspect.tables(self.mgr)
        blocks, digs, toks, slots, pages = t["blocks"], t["digests"], t["tokens"], t["block_slots"], t["pages"]
        L = len(self.specs)
        flags = blocks["flags"]
        rows = attached_rows(blocks)
        rows = rows[np.argsort(blocks["ordinal"][rows], kind="stable")]  # parents first
        gpu = [_host(self.words(lc)) for lc in range(L)]
        host = [self.host_words(lc) for lc in range(L)]
        end_digest: dict = {}  # row -> running digest after the block's last token
        for r in rows:
            parent = int(blocks["parent"][r])
            if flags[parent] & FLAG_ROOT:
                d0 = b""
            elif parent in end_digest:
                d0 = end_digest[parent]
            else:
                continue  # under a skipped block
            n = int(blocks["num_tokens"][r])
            o = int(blocks["ordinal"][r])
            block_tokens = [int(x) for x in toks[r, :n]]
            if min(block_tokens) < 0:
                continue  # a multimodal digest token: its bytes are not in the tables
            key = _key(digs, r)
            ds, d = [], d0
            for tok in block_tokens:
                d = _extend(d, tok)
                ds.append(d)
            end_digest[int(r)] = d
            for lc in range(L):
                pg, cov = int(slots[r, lc]["page"]), int(slots[r, lc]["coverage"])
                if pg < 0:
                    continue
                words = gpu if int(pages["level"][pg]) == 0 else host
                want = self._block_values.get((key, lc))
                if want is None:
                    want = self._block_values[(key, lc)] = np.array(
                        [_value(lc, o * T + i, ds[i]) for i in range(n)], dtype=np.int64
                    )
                pool = int(pages["pool_index"][pg])
                where = (
                    f"tree page {pg} (level {int(pages['level'][pg])}, pool index {pool}) of block {block_tokens} at ordinal {o}, "
                    f"life cycle {lc}, coverage {cov}"
                )
                if lc == self.ssm:
                    got = int(words[lc][pool, 0])
                    assert got == want[cov - 1], f"{where}: SSM state is wrong (got {got}, want {want[cov - 1]})"
                else:
                    got = words[lc][pool, :cov]
                    bad = np.nonzero(got != want[:cov])[0]
                    assert not bad.size, (
                        f"{where}: wrong data at block offset {bad[0]} (got {got[bad[0]]}, want {want[bad[0]]}"
                        f"{', never written' if got[bad[0]] == 0 else ''})"
                    )


# ---------------------------------------------------------------------------
# reading the tree (white box, via introspect.tables)
# ---------------------------------------------------------------------------


def attached_rows(blocks) -> np.ndarray:
    """Rows of the ``blocks`` table that hold an attached, non-root block."""
    flags = blocks["flags"]
    attached = (flags & (FLAG_IN_USE | FLAG_ATTACHED)) == (FLAG_IN_USE | FLAG_ATTACHED)
    return np.nonzero(attached & ((flags & FLAG_ROOT) == 0))[0]


def _key(digests, row) -> bytes:
    """A block's SHA-256 chain key (the reference identity) from its ``digests`` row."""
    return np.ascontiguousarray(digests[row]).astype("<i8").tobytes()


def chain_rows(mgr, tokens, scope=None) -> list:
    """The rows of the exact-key chain of ``tokens`` among attached blocks, one
    per block, stopping at the first key not in the tree (no partial matching,
    no pruning)."""
    import gpukv  # noqa: PLC0415

    t = introspect.tables(mgr)
    by_key = {_key(t["digests"], r): int(r) for r in attached_rows(t["blocks"])}
    out = []
    for i, (_, key) in enumerate(gpukv.sequence_to_blockchain_keys(mgr.tokens_per_block, scope, list(tokens))):
        if i == 0:
            continue  # the root
        r = by_key.get(key)
        if r is None:
            break
        out.append(r)
    return out


def chain_covs(mgr, tokens, scope=None) -> list:
    """The exact-key chain of ``tokens`` (``chain_rows``): one
    ``(len(block.tokens), coverage per life cycle)`` per block."""
    t = introspect.tables(mgr)
    blocks, slots = t["blocks"], t["block_slots"]
    return [(int(blocks["num_tokens"][r]), tuple(int(c) for c in slots["coverage"][r])) for r in chain_rows(mgr, tokens, scope)]


def attached_blocks(mgr) -> dict:
    """``{key: (tokens, coverage per life cycle)}`` for every attached non-root block."""
    t = introspect.tables(mgr)
    blocks, digs, toks, slots = t["blocks"], t["digests"], t["tokens"], t["block_slots"]
    out = {}
    for r in attached_rows(blocks):
        key = _key(digs, r)
        n = int(blocks["num_tokens"][r])
        out[key] = (tuple(int(x) for x in toks[r, :n]), tuple(int(c) for c in slots["coverage"][r]))
    return out

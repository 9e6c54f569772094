"""Bad input is rejected with a clear error and changes nothing (docs/api.md, "Bad input").

Every case asserts the exception type, that the message names the problem
(and the request index where the API has one), and that the device tables
(``blocks``, ``tokens``, ``slots``, ``pages``) are exactly as before.
Validation runs on the host before any launch, so most cases run on ``cpu``
only; the tree operations run on both backends.
"""

from __future__ import annotations

import contextlib
import re

import numpy as np
import pytest

import gpukv
from gpukv import Attention, CacheConfig, ConfigError, ReuseScope, Ssm, TokenError, introspect
from gpukv.core.layout import FLAG_ROOT, PAGE_FREE
from gpukv.tree import BlockRef

from tests.support.backends import make_manager

T = 2
LAYERS = [Attention(), Attention(window=4)]  # lc0 = F, lc1 = S


def snapshot(mgr) -> dict:
    t = introspect.tables(mgr)
    return {name: t[name].copy() for name in ("blocks", "tokens", "slots", "pages")}


@contextlib.contextmanager
def rejected(mgr, exc, match):
    """The call raises ``exc`` with ``match`` in its message and leaves every table as it was."""
    before = snapshot(mgr)
    scopes = introspect.interned_scopes(mgr)
    with pytest.raises(exc, match=match):
        yield
    after = snapshot(mgr)
    for name in before:
        assert np.array_equal(before[name], after[name]), f"table {name} changed"
    assert introspect.interned_scopes(mgr) == scopes, "a scope was interned"
    introspect.check_sanity(mgr)


def small_tree(backend="cpu"):
    """root -> a[1, 2]{F2, S1} -> b[3, 4]{F2, S2}, plus a partial c[5] under a."""
    mgr = make_manager(backend, tokens_per_block=T, layers=LAYERS)
    a = introspect.make_test_block(mgr, [1, 2], [2, 1])
    b = introspect.make_test_block(mgr, [3, 4], [2, 2], parent=a)
    c = introspect.make_test_block(mgr, [5], [1, 1], parent=a)
    introspect.check_sanity(mgr)
    return mgr, a, b, c


# ---------------------------------------------------------------------------
# token sequences
# ---------------------------------------------------------------------------

BAD_TOKENS = [
    ([1, -1], TokenError, r"token -1 at position 1 is outside 0\.\.2147483647"),
    ([2**31], TokenError, r"token 2147483648 at position 0 is outside"),
    ([0, 0, 2**64], TokenError, r"token 18446744073709551616 at position 2 is outside"),
    ([1, 1.0], TypeError, r"token at position 1 must be an int or 32-byte digest, got 1\.0"),
    ([np.float32(1)], TypeError, r"token at position 0 must be an int or 32-byte digest"),
    (["7"], TypeError, r"token at position 0 must be an int or 32-byte digest, got '7'"),
    ([None], TypeError, r"token at position 0 must be an int or 32-byte digest, got None"),
    ([[1, 2]], TypeError, r"token at position 0 must be an int or 32-byte digest"),
    ([b"x" * 31], TokenError, r"digest token at position 0 must be 32 bytes, got 31"),
    ([b"x" * 33], TokenError, r"digest token at position 0 must be 32 bytes, got 33"),
    ("1234", TypeError, r"tokens must be a sequence of ints, got str"),
    (b"1234", TypeError, r"tokens must be a sequence of ints, got bytes"),
    (np.array([1.0, 2.0]), TypeError, r"tokens must be integers, got dtype float64"),
    (np.array([True]), TypeError, r"tokens must be integers, got dtype bool"),
    (np.array([1, 2], dtype=object), TypeError, r"tokens must be integers, got dtype object"),
    (np.array([[1, 2]]), ValueError, r"tokens must be 1-D, got shape \(1, 2\)"),
    (np.array([1, 2**31], dtype=np.int64), TokenError, r"token 2147483648 at position 1 is outside"),
    (np.array([5, -3], dtype=np.int64), TokenError, r"token -3 at position 1 is outside"),
    (np.array([2**40], dtype=np.uint64), TokenError, r"token 1099511627776 at position 0 is outside"),
]


def test_token_errors_are_value_errors():
    assert issubclass(TokenError, ValueError)


@pytest.mark.parametrize("tokens, exc, msg", BAD_TOKENS)
def test_bad_tokens_name_the_token_and_the_request(tokens, exc, msg):
    mgr, *_ = small_tree()
    with rejected(mgr, exc, "request 0: " + msg):
        mgr.probe_reuse(tokens)
    with rejected(mgr, exc, "request 2: " + msg):
        mgr.match_batch([[1, 2], [3], tokens, [4]])


@pytest.mark.parametrize("tokens, exc, msg", BAD_TOKENS)
def test_bad_tokens_are_rejected_by_the_tree_and_the_arena(tokens, exc, msg):
    mgr, a, *_ = small_tree()
    with rejected(mgr, exc, msg):
        introspect.insert_sequence(mgr, tokens)
    if len(tokens) <= T:
        with rejected(mgr, exc, msg):
            introspect.add_block(mgr, tokens, parent=a)
    seq = mgr.token_sequence([1, 2, 3])
    arena = introspect.arena_state(mgr)
    with rejected(mgr, exc, msg):
        seq.extend(tokens)
    assert len(seq) == 3 and seq.tokens.tolist() == [1, 2, 3]
    for k, v in introspect.arena_state(mgr).items():
        assert np.array_equal(arena[k], v), k
    with pytest.raises(exc, match=msg):
        mgr.token_sequence(tokens)


def test_the_largest_token_and_digests_are_accepted():
    mgr, *_ = small_tree()
    assert mgr.probe_reuse([2**31 - 1, 0]) == 0
    assert mgr.probe_reuse(np.array([2**31 - 1], dtype=np.uint32)) == 0
    assert mgr.probe_reuse([b"d" * 32, 1]) == 0


def test_a_request_that_is_not_a_sequence_names_its_index():
    mgr, *_ = small_tree()
    with rejected(mgr, TypeError, r"request 1: tokens must be a sequence"):
        mgr.match_batch([[1, 2], None])


@pytest.mark.parametrize("tokens, pos", [([True, 2, 3, 4], 0), ([1, 2, 0, False], 3), ((5, 1, True), 2)])
def test_bool_tokens_are_rejected_in_lists_as_in_arrays(tokens, pos):
    """A bool array is rejected by its dtype; a bool in a list is rejected the
    same way, although Python counts True as 1 (0 and 1 next to it are fine)."""
    mgr, *_ = small_tree()
    msg = rf"token at position {pos} must be an int or 32-byte digest, got a bool"
    with rejected(mgr, TypeError, "request 0: " + msg):
        mgr.probe_reuse(tokens)
    with rejected(mgr, TypeError, "request 1: " + msg):
        mgr.match_batch([[1, 2], tokens])
    with rejected(mgr, TypeError, msg):
        mgr.token_sequence(tokens)
    with rejected(mgr, TypeError, msg):
        introspect.insert_sequence(mgr, tokens)
    assert mgr.probe_reuse([1, 2, 0, 1]) == mgr.probe_reuse(np.array([1, 2, 0, 1])) > 0


def test_a_rejected_request_interns_no_digest():
    mgr, *_ = small_tree()
    before = introspect.interned_digests(mgr)
    with rejected(mgr, TokenError, r"request 0: token -1 at position 1"):
        mgr.probe_reuse([b"d" * 32, -1])
    after = introspect.interned_digests(mgr)
    assert after[0] == before[0]
    assert np.array_equal(after[1], before[1])


@pytest.mark.parametrize("requests", ["abc", b"ab", 3, None, 2.5])
def test_requests_must_be_a_sequence_of_sequences(requests):
    mgr, *_ = small_tree()
    with rejected(mgr, TypeError, r"requests must be a list of token sequences or a \(flat_tokens, offsets\) pair"):
        mgr.match_batch(requests)


# ---------------------------------------------------------------------------
# (flat_tokens, offsets)
# ---------------------------------------------------------------------------

FLAT = np.array([1, 2, 3], dtype=np.int32)

BAD_FLAT = [
    (FLAT, np.array([1, 3]), ValueError, r"offsets must start at 0, got 1"),
    (FLAT, np.array([0, 2, 1, 3]), ValueError, r"request 1: offsets must be non-decreasing \(2 > 1\)"),
    (FLAT, np.array([0, 5, 3]), ValueError, r"request 1: offsets must be non-decreasing \(5 > 3\)"),
    (FLAT, np.array([0, 2]), ValueError, r"offsets must end at the token count 3, got 2"),
    (FLAT, np.array([0, 4]), ValueError, r"offsets must end at the token count 3, got 4"),
    (FLAT, np.array([], dtype=np.int64), ValueError, r"offsets must have length B\+1 >= 1"),
    (FLAT, np.array([[0, 3]]), ValueError, r"flat_tokens and offsets must be 1-D arrays"),
    (FLAT.reshape(1, 3), np.array([0, 3]), ValueError, r"flat_tokens and offsets must be 1-D arrays"),
    (FLAT, np.array([0.0, 3.0]), TypeError, r"offsets must hold integers, got dtype float64"),
    (FLAT, np.array([False, True]), TypeError, r"offsets must hold integers, got dtype bool"),
    (FLAT, [0, 3], TypeError, r"\(flat_tokens, offsets\) must be integer arrays"),
    (FLAT.astype(np.float64), np.array([0, 3]), TypeError, r"flat_tokens must hold integers, got dtype float64"),
    (np.array([1, 2, -3]), np.array([0, 1, 3]), TokenError, r"request 1: token -3 at position 1 is outside"),
    (np.array([1, 2, 2**31]), np.array([0, 2, 2, 3]), TokenError, r"request 2: token 2147483648 at position 0 is outside"),
]


@pytest.mark.parametrize("flat, offsets, exc, msg", BAD_FLAT)
def test_bad_flat_batches(flat, offsets, exc, msg):
    mgr, *_ = small_tree()
    with rejected(mgr, exc, msg):
        mgr.match_batch((flat, offsets))


def test_good_flat_batches_with_other_integer_dtypes():
    mgr, *_ = small_tree()
    assert mgr.probe_reuse([1, 2, 3]) == 1  # a's S1 clamps
    for offsets in (np.array([0, 3], dtype=np.uint64), np.array([0, 3], dtype=np.int32)):
        for flat in (FLAT, FLAT.astype(np.int64), FLAT.astype(np.uint16)):
            m = mgr.match_batch((flat, offsets)).to_host()
            assert m.num_tokens.tolist() == [1] and m.num_lookup_tokens.tolist() == [3]


# ---------------------------------------------------------------------------
# scopes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, exc, msg",
    [
        (dict(lora_id="7"), TypeError, r"ReuseScope\.lora_id must be an int or None, got str"),
        (dict(salt=1.0), TypeError, r"ReuseScope\.salt must be an int or None, got float"),
        (dict(salt=True), TypeError, r"ReuseScope\.salt must be an int or None, got bool"),
        (dict(lora_id=-1), ValueError, r"ReuseScope\.lora_id must be in 0\.\.2\*\*64-1, got -1"),
        (dict(salt=2**64), ValueError, r"ReuseScope\.salt must be in 0\.\.2\*\*64-1"),
    ],
)
def test_bad_reuse_scope_fields(kwargs, exc, msg):
    with pytest.raises(exc, match=msg):
        ReuseScope(**kwargs)


def test_scopes_of_the_wrong_type_or_length():
    mgr, *_ = small_tree()
    two = [[1, 2], [3]]
    with rejected(mgr, TypeError, r"scopes must be None, one gpukv\.ReuseScope, or one per request"):
        mgr.match_batch(two, "ab")
    with rejected(mgr, TypeError, r"scopes must be None, one gpukv\.ReuseScope, or one per request"):
        mgr.match_batch(two, 7)
    with rejected(mgr, ValueError, r"match_batch\(\): scopes has 1 entries for 2 requests"):
        mgr.match_batch(two, [None])
    with rejected(mgr, ValueError, r"match_batch\(\): scopes has 3 entries for 2 requests"):
        mgr.match_batch(two, [None, None, ReuseScope(salt=1)])
    with rejected(mgr, TypeError, r"match_batch\(\): scopes\[1\]: scope must be a gpukv\.ReuseScope or None, got int"):
        mgr.match_batch(two, [ReuseScope(salt=1), 3])
    with rejected(mgr, TypeError, r"match_batch\(\): scopes\[0\]: scope must be a gpukv\.ReuseScope or None, got tuple"):
        mgr.match_batch(two, [(7, 11), None])
    with rejected(mgr, TypeError, r"scope must be a gpukv\.ReuseScope or None, got int"):
        mgr.probe_reuse([1, 2], scope=7)
    with rejected(mgr, TypeError, r"scope must be a gpukv\.ReuseScope or None, got int"):
        introspect.make_test_block(mgr, [9, 9], [2, 2], scope=7)
    with rejected(mgr, TypeError, r"scope must be a gpukv\.ReuseScope or None, got str"):
        introspect.insert_sequence(mgr, [9, 9], scope="x")
    with rejected(mgr, TypeError, r"scopes must be None, one gpukv\.ReuseScope, or one per request"):
        introspect.reuse_match_pages(mgr, [1, 2], 0, scope=7)


# ---------------------------------------------------------------------------
# tree operations (both backends)
# ---------------------------------------------------------------------------


def test_empty_and_over_long_blocks(backend):
    mgr, a, b, c = small_tree(backend)
    for tokens in ([], [1, 2, 3]):
        n = len(tokens)
        with rejected(mgr, ValueError, rf"a block holds 1\.\.2 tokens, got {n}"):
            introspect.add_block(mgr, tokens)
        with rejected(mgr, ValueError, rf"a block holds 1\.\.2 tokens, got {n}"):
            introspect.add_block(mgr, tokens, parent=b)
        with rejected(mgr, ValueError, rf"a block holds 1\.\.2 tokens, got {n}"):
            introspect.make_test_block(mgr, tokens, [0, 0])


def test_unknown_stale_and_partial_parents(backend):
    mgr, a, b, c = small_tree(backend)
    with rejected(mgr, TypeError, r"parent must be a gpukv BlockRef, got int"):
        introspect.add_block(mgr, [7], parent=a.row)
    with rejected(mgr, TypeError, r"parent must be a gpukv BlockRef, got tuple"):
        introspect.make_test_block(mgr, [7], [1, 1], parent=(a.row, a.key))
    with rejected(mgr, ValueError, r"parent refers to row 1000000, outside the table"):
        introspect.add_block(mgr, [7], parent=BlockRef(10**6, a.key))
    with rejected(mgr, ValueError, r"parent refers to row -1, outside the table"):
        introspect.add_block(mgr, [7], parent=BlockRef(-1, a.key))
    with rejected(mgr, ValueError, r"parent is stale: its block no longer exists"):
        introspect.add_block(mgr, [7], parent=BlockRef(a.row, b.key))  # a live row, another block's key
    with rejected(mgr, ValueError, r"parent is stale"):
        introspect.add_block(mgr, [7], parent=BlockRef(200, a.key))  # a free row
    with rejected(mgr, ValueError, r"parent is a partial block \(1 of 2 tokens\)"):
        introspect.add_block(mgr, [7], parent=c)
    with rejected(mgr, ValueError, r"scope differs from the parent's scope"):
        introspect.add_block(mgr, [7], parent=a, scope=ReuseScope(salt=1))

    # a removed block is a stale parent, even once its row is reused
    introspect.remove_subtree(mgr, b)
    introspect.check_sanity(mgr)
    with rejected(mgr, ValueError, r"parent is stale"):
        introspect.make_test_block(mgr, [7, 7], [2, 2], parent=b)
    d = introspect.make_test_block(mgr, [8, 8], [2, 2], parent=a)
    assert d.row == b.row and d.key != b.key
    with rejected(mgr, ValueError, r"block is stale"):
        introspect.remove_subtree(mgr, b)
    with rejected(mgr, ValueError, r"stale"):
        introspect.page_of(mgr, b, 0)


def test_a_child_takes_its_parents_scope(backend):
    """No root is created for the default scope when the parent lives in another."""
    mgr = make_manager(backend, tokens_per_block=T, layers=LAYERS)
    s = ReuseScope(lora_id=7)
    a = introspect.make_test_block(mgr, [1, 2], [2, 2], scope=s)
    b = introspect.make_test_block(mgr, [3, 4], [2, 2], parent=a)  # scope=None: the parent's
    introspect.make_test_block(mgr, [5, 6], [2, 2], parent=b, scope=s)  # the same scope, explicitly
    introspect.check_sanity(mgr)
    roots = introspect.tables(mgr)["blocks"]["flags"] & FLAG_ROOT
    assert int(np.count_nonzero(roots)) == 1
    assert mgr.probe_reuse([1, 2, 3, 4, 5, 6], s) == 6
    assert mgr.probe_reuse([1, 2, 3, 4, 5, 6]) == 0


def test_bad_life_cycle_ids_and_coverages(backend):
    mgr, a, b, c = small_tree(backend)
    for lc in (2, -1, 1.0, "0", None):
        with rejected(mgr, ValueError, rf"life_cycle_id must be in 0\.\.1, got {lc!r}"):
            introspect.add_page(mgr, b, lc, 1)
        with rejected(mgr, ValueError, r"life_cycle_id must be in 0\.\.1"):
            introspect.unlink_page(mgr, b, lc)
        with rejected(mgr, ValueError, r"life_cycle_id must be in 0\.\.1"):
            introspect.clear_stale_blocks_after_page_unlink(mgr, b, lc)
        with rejected(mgr, ValueError, r"life_cycle_id must be in 0\.\.1"):
            introspect.reuse_match_pages(mgr, [1, 2], lc)
    for cov in (0, 3, -1):
        with rejected(mgr, ValueError, rf"coverage must be in 1\.\.2 \(the block's tokens\), got {cov}"):
            introspect.add_page(mgr, b, 0, cov)
    with rejected(mgr, ValueError, r"coverage must be in 1\.\.1 \(the block's tokens\), got 2"):
        introspect.add_page(mgr, c, 0, 2)  # c holds one token

    # make_test_block: one coverage per life cycle, each in 0..len(tokens)
    with rejected(mgr, ValueError, r"coverage_per_life_cycle needs one entry per life cycle \(2\), got 1"):
        introspect.make_test_block(mgr, [7, 7], [2])
    with rejected(mgr, ValueError, r"coverage_per_life_cycle needs one entry per life cycle \(2\), got 3"):
        introspect.make_test_block(mgr, [7, 7], [2, 2, 2])
    for cov, shown in ((3, "3"), (-1, "-1"), (1.0, "1.0"), ("1", "'1'")):
        with rejected(mgr, ValueError, rf"coverage of life cycle 1 must be in 0\.\.2, got {shown}"):
            introspect.make_test_block(mgr, [7, 7], [2, cov])
    with rejected(mgr, ValueError, r"coverage of life cycle 0 must be in 0\.\.1, got 2"):
        introspect.make_test_block(mgr, [7], [2, 0])


def test_page_death_of_pages_that_are_not_committed(backend):
    mgr, a, b, c = small_tree(backend)
    pages = introspect.tables(mgr)["pages"]
    free = int(np.nonzero(pages["state"] == PAGE_FREE)[0][0])
    with rejected(mgr, ValueError, r"page -1 does not exist"):
        introspect.page_death(mgr, -1)
    with rejected(mgr, ValueError, rf"page {pages.shape[0]} does not exist"):
        introspect.page_death(mgr, pages.shape[0])
    with rejected(mgr, ValueError, rf"page {free} is not a committed page"):
        introspect.page_death(mgr, free)


def test_page_of_checks_the_life_cycle_id():
    mgr, a, b, c = small_tree()
    with pytest.raises(ValueError, match=r"life_cycle_id must be in 0\.\.1"):
        introspect.page_of(mgr, a, 2)  # today: b's life cycle 0 slot


def test_add_page_rejects_a_float_coverage():
    mgr, a, b, c = small_tree()
    introspect.unlink_page(mgr, a, 1)
    with rejected(mgr, TypeError, r"coverage"):
        introspect.add_page(mgr, a, 1, 1.5)  # today: a page of coverage 1


# ---------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------

BAD_CONFIGS = [
    (dict(tokens_per_block=0), "tokens_per_block"),
    (dict(tokens_per_block=-4), "tokens_per_block"),
    (dict(tokens_per_block="4"), "tokens_per_block"),
    (dict(tokens_per_block=True), "tokens_per_block"),
    (dict(tokens_per_block=4.0), "tokens_per_block"),
    (dict(tokens_per_block=5000), "tokens_per_block"),
    (dict(layers=[]), r"layers must hold at least one"),
    (dict(layers=()), r"layers must hold at least one"),
    (dict(layers=[1]), r"layers\[0\]"),
    (dict(layers=[Attention(), "ssm"]), r"layers\[1\]"),
    (dict(layers=[Attention]), r"layers\[0\]"),
    (dict(pages_per_life_cycle=-1), "pages_per_life_cycle"),
    (dict(pages_per_life_cycle=[4, 4]), "pages_per_life_cycle"),  # one life cycle
    (dict(pages_per_life_cycle=[-4]), "pages_per_life_cycle"),
    (dict(host_pages_per_life_cycle=-1), "host_pages_per_life_cycle"),
    (dict(page_bytes=-1), "page_bytes"),
    (dict(reuse_match_backoff=-1), "reuse_match_backoff"),
    (dict(reuse_match_backoff=1.0), "reuse_match_backoff"),
    (dict(reuse_match_backoff=2**64), r"reuse_match_backoff must be at most 2147483647"),
    (dict(reuse_match_backoff=2**31), r"reuse_match_backoff must be at most"),
    (dict(pages_per_life_cycle=0), r"pages_per_life_cycle must be an int >= 1, got 0"),
    (dict(pages_per_life_cycle=[0]), r"pages_per_life_cycle must be an int >= 1, got 0"),
    (dict(pages_per_life_cycle=1.5), r"pages_per_life_cycle must be an int or a list"),
    (dict(pages_per_life_cycle={7: 1}), r"pages_per_life_cycle must be an int or a list"),
    (dict(pages_per_life_cycle={7}), r"pages_per_life_cycle must be an int or a list"),
    (dict(pages_per_life_cycle=(n for n in [4])), r"pages_per_life_cycle must be an int or a list"),
    (dict(pages_per_life_cycle=True), r"pages_per_life_cycle must be an int or a list"),
    (dict(pages_per_life_cycle="4"), r"pages_per_life_cycle must be an int or a list"),
    (dict(host_pages_per_life_cycle=(n for n in [4])), r"host_pages_per_life_cycle must be an int or a list"),
    (dict(max_kv_event_entries="x"), "max_kv_event_entries"),
    (dict(enable_partial_reuse=1), "enable_partial_reuse"),
    (dict(commit_min_snapshot="yes"), "commit_min_snapshot"),
    (dict(backend="gpu"), "backend"),
    (dict(backend=None), "backend"),
    # M19: an Ssm layer needs commit_min_snapshot
    (dict(layers=[Attention(), Ssm()]), "commit_min_snapshot"),
    (dict(layers=[Ssm()], commit_min_snapshot=False, enable_partial_reuse=False), "commit_min_snapshot"),
]


@pytest.mark.parametrize("kwargs, field", BAD_CONFIGS)
def test_invalid_config_fields_raise_config_error_naming_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        CacheConfig(**kwargs)
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: Attention(window=0), r"Attention\.window"),
        (lambda: Attention(window=-1), r"Attention\.window"),
        (lambda: Attention(window=2.0), r"Attention\.window"),
        (lambda: Attention(window=True), r"Attention\.window"),
        (lambda: Attention(sink_tokens=4), r"Attention\.sink_tokens is only allowed with a window"),
        (lambda: Attention(window=4, sink_tokens=-1), r"Attention\.sink_tokens"),
    ],
)
def test_invalid_layer_specs(build, field):
    with pytest.raises(ConfigError, match=field):
        build()


def test_valid_edge_configs():
    # M19: SSM with partial reuse is allowed (with commit_min_snapshot)
    c = CacheConfig(layers=[Attention(), Ssm()], commit_min_snapshot=True, enable_partial_reuse=True)
    assert c.ssm_life_cycle_id == 1
    assert CacheConfig(tokens_per_block=np.int64(4)).tokens_per_block == 4
    assert CacheConfig(max_kv_event_entries=-1).max_kv_event_entries == -1  # <= 0 disables events
    with pytest.raises(TypeError, match="config must be a gpukv.CacheConfig, got dict"):
        gpukv.KVCacheManager({"tokens_per_block": 4})


def test_layers_none_names_the_field():
    with pytest.raises(ConfigError, match="layers"):
        CacheConfig(layers=None)


# ---------------------------------------------------------------------------
# arguments a hostile caller tries
# ---------------------------------------------------------------------------

DIGEST = bytes(range(32))


@pytest.mark.parametrize(
    "tokens, name",
    [({1, 2}, "set"), (frozenset([1]), "frozenset"), ({1: 2}, "dict"), (memoryview(b"ab"), "memoryview"),
     (bytearray(b"ab"), "bytearray"), ((t for t in [1, 2]), "generator")],
)
def test_sets_dicts_and_memoryviews_are_not_token_sequences(tokens, name):
    mgr, *_ = small_tree()
    msg = rf"tokens must be a sequence of ints, got {name}"
    with rejected(mgr, TypeError, "request 0: " + msg):
        mgr.probe_reuse(tokens)
    with rejected(mgr, TypeError, "request 1: " + msg):
        mgr.match_batch([[1], tokens])
    for call in (mgr.create_kv_cache, mgr.token_sequence, lambda t: introspect.insert_sequence(mgr, t)):
        with rejected(mgr, TypeError, msg):
            call(tokens)
    assert not mgr._open_caches


def test_a_zero_dimensional_array_is_not_a_token_sequence():
    mgr, *_ = small_tree()
    with rejected(mgr, ValueError, r"request 0: tokens must be 1-D, got shape \(\)"):
        mgr.probe_reuse(np.array(5))
    with rejected(mgr, ValueError, r"request 1: tokens must be 1-D, got shape \(\)"):
        mgr.match_batch([[1, 2], np.array(5)])  # was: StopIteration
    with rejected(mgr, ValueError, r"tokens must be 1-D, got shape \(\)"):
        mgr.create_kv_cache(input_tokens=np.array(5))


def test_a_rejected_cache_registers_no_scope():
    mgr, *_ = small_tree()
    with rejected(mgr, gpukv.TokenError, r"token -1 at position 0"):
        mgr.create_kv_cache(input_tokens=[-1, 2], scope=ReuseScope(salt=5))
    assert not mgr._open_caches


@pytest.mark.parametrize(
    "id_offset, n, token_offset",
    [(2**31, 4, 0), (2**31 - 3, 4, 0), (2**31 - 10, 2, 9), (-5, 4, 0), (2**64, 2, 0)],
)
def test_multimodal_key_tokens_must_be_token_ids(id_offset, n, token_offset):
    with pytest.raises(ValueError, match=r"id_offset .* must stay in the token range 0\.\.2147483647"):
        gpukv.gen_multimodal_cache_key_tokens(id_offset, DIGEST, n, token_offset)


def test_multimodal_key_tokens_at_the_edge_of_the_range():
    assert gpukv.gen_multimodal_cache_key_tokens(2**31 - 4, DIGEST, 4) == [DIGEST, 2**31 - 3, 2**31 - 2, 2**31 - 1]
    assert gpukv.gen_multimodal_cache_key_tokens(2**40, DIGEST, 1) == [DIGEST]  # no int token at all


def open_cache(mgr, capacity=8, history=0):
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(capacity, history)
    return kv


@pytest.mark.parametrize("is_end", [1, 0, "yes", None, [True]])
def test_is_end_must_be_a_bool(is_end):
    mgr, *_ = small_tree()
    kv = open_cache(mgr)
    with rejected(mgr, TypeError, "is_end must be a bool, got " + re.escape(repr(is_end))):
        kv.commit([7, 7, 7], is_end=is_end)
    assert kv.num_committed_tokens == 0
    kv.close()


def test_the_commit_min_snapshot_history_rule_is_a_value_error():
    mgr = make_manager("cpu", tokens_per_block=T, layers=LAYERS, commit_min_snapshot=True)
    kv = open_cache(mgr, 8, 4)
    with rejected(mgr, ValueError, r"commit_min_snapshot: history_length \(4\) must equal the committed length "
                                   r"before \(0\) or after \(2\) the commit of 2 tokens"):
        kv.commit([1, 2])  # was: AssertionError
    kv.commit([1, 2, 3, 4])
    assert kv.num_committed_tokens == 4
    kv.close()


@pytest.mark.parametrize(
    "args, msg",
    [((7,), r"life_cycle_id must be in 0\.\.1, got 7"), ((-1,), r"life_cycle_id must be in 0\.\.1, got -1"),
     ((True,), r"life_cycle_id must be in 0\.\.1, got True"), (("0",), r"life_cycle_id must be in 0\.\.1, got '0'"),
     ((0, 2), r"level must be 0 \(GPU\) or 1 \(host\), got 2"), ((0, -1), r"level must be 0 \(GPU\) or 1 \(host\)")],
)
def test_page_memory_checks_its_arguments(args, msg):
    mgr = make_manager("cpu", tokens_per_block=T, layers=LAYERS, page_bytes=8, pages_per_life_cycle=4)
    with pytest.raises(ValueError, match=msg):
        mgr.page_memory(*args)  # was: another life cycle's pool (-1) or IndexError (7)
    assert mgr.page_memory(1).shape == (4, 8) and mgr.page_memory(0, 1) is None


def test_a_huge_backoff_is_refused_by_the_config_and_the_largest_works():
    mgr = make_manager("cpu", tokens_per_block=T, layers=LAYERS, reuse_match_backoff=2**31 - 1)
    introspect.make_test_block(mgr, [1, 2], [2, 2])
    assert mgr.probe_reuse([1, 2, 3]) == 0

"""The batched calls on bad input, on every backend, and beside the per-cache calls.

Bad input for any entry (a cache twice, a closed cache, a cache of another
manager, lengths that disagree, a token out of range in one entry) is refused
with an error naming the entry, and every table and every cache is exactly as
before. The CUDA kernels (``cudasim``) run the same batches at small sizes
and must end in the same state as ``cpu``.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import gpukv
from gpukv import Attention, Ssm, introspect

from tests.support.backends import backend_params, make_manager

T = 4
LAYERS = [Attention(), Attention(window=6)]


def state(mgr, caches) -> tuple:
    t = introspect.tables(mgr)
    tables = {name: t[name].copy() for name in ("blocks", "tokens", "slots", "pages")}
    per_cache = [
        (kv.num_committed_tokens, kv.history_length, kv.capacity, kv.status,
         [tuple(kv.page_indices(lc)) if kv.status.name != "CLOSED" else () for lc in range(len(mgr.life_cycles))])
        for kv in caches
    ]
    return tables, per_cache


@contextlib.contextmanager
def rejected(mgr, caches, exc, match):
    """The call raises ``exc`` matching ``match`` and changes no table and no cache."""
    before = state(mgr, caches)
    with pytest.raises(exc, match=match):
        yield
    after = state(mgr, caches)
    for name in before[0]:
        assert np.array_equal(before[0][name], after[0][name]), f"table {name} changed"
    assert before[1] == after[1], "a cache changed"
    introspect.check_sanity(mgr)


def running(mgr, n: int, length: int = 6) -> list:
    """``n`` ACTIVE caches, each with ``length`` tokens committed and room for one block more."""
    kvs = mgr.create_kv_caches([[i + 1] * length for i in range(n)])
    assert mgr.resume_batch(kvs).all()
    assert mgr.resize_batch(kvs, [length + T] * n, [length] * n).all()
    mgr.commit_batch(kvs, [[i + 1] * length for i in range(n)])
    return kvs


@pytest.fixture
def mgr():
    return make_manager("cpu", tokens_per_block=T, layers=LAYERS, pages_per_life_cycle=64)


def test_a_cache_listed_twice_is_refused(mgr):
    kvs = running(mgr, 3)
    with rejected(mgr, kvs, ValueError, r"caches\[2\] is caches\[0\] again"):
        mgr.commit_batch([kvs[0], kvs[1], kvs[0]], [[1], [2], [3]])
    with rejected(mgr, kvs, ValueError, r"caches\[2\] is caches\[1\] again"):
        mgr.resize_batch([kvs[2], kvs[1], kvs[1]], [20, 20, 20])
    with rejected(mgr, kvs, ValueError, r"caches\[1\] is caches\[0\] again"):
        mgr.close_batch([kvs[0], kvs[0]])


def test_a_closed_cache_is_refused(mgr):
    kvs = running(mgr, 3)
    kvs[1].close()
    with rejected(mgr, kvs, gpukv.LogicError, r"caches\[1\] is CLOSED"):
        mgr.commit_batch(kvs, [[1], [2], [3]])
    with rejected(mgr, kvs, gpukv.LogicError, r"caches\[1\] is CLOSED"):
        mgr.resize_batch(kvs, [12, 12, 12])
    with rejected(mgr, kvs, gpukv.LogicError, r"caches\[0\] is CLOSED.*needs SUSPENDED"):
        mgr.resume_batch([kvs[1]])
    mgr.close_batch(kvs)  # closing twice is a no-op, as kv.close() is
    assert [kv.status.name for kv in kvs] == ["CLOSED"] * 3


def test_a_cache_of_another_manager_is_refused(mgr):
    kvs = running(mgr, 2)
    other = make_manager("cpu", tokens_per_block=T, layers=LAYERS, pages_per_life_cycle=64)
    (theirs,) = running(other, 1)
    with rejected(mgr, kvs, ValueError, r"caches\[1\] belongs to another manager"):
        mgr.commit_batch([kvs[0], theirs], [[1], [2]])
    with rejected(mgr, kvs, ValueError, r"caches\[2\] belongs to another manager"):
        mgr.close_batch([kvs[0], kvs[1], theirs])
    with rejected(mgr, kvs, TypeError, r"caches\[0\] is not a KVCache"):
        mgr.close_batch(["kv"])


def test_lengths_that_disagree_are_refused(mgr):
    kvs = running(mgr, 3)
    with rejected(mgr, kvs, ValueError, r"capacities has 2 entries for 3 caches"):
        mgr.resize_batch(kvs, [12, 12])
    with rejected(mgr, kvs, ValueError, r"history_lengths has 4 entries for 3 caches"):
        mgr.resize_batch(kvs, [12, 12, 12], [6, 6, 6, 6])
    with rejected(mgr, kvs, ValueError, r"tokens has 2 entries for 3 caches"):
        mgr.commit_batch(kvs, [[1], [2]])
    with rejected(mgr, kvs, ValueError, r"offsets has 3 entries for 3 caches"):
        mgr.commit_batch(kvs, (np.array([1, 2], dtype=np.int32), np.array([0, 1, 2])))
    with rejected(mgr, kvs, ValueError, r"is_end has 2 entries for 3 caches"):
        mgr.commit_batch(kvs, [[1], [2], [3]], is_end=[True, False])


def test_bad_values_in_one_entry_are_refused(mgr):
    kvs = running(mgr, 3)
    with rejected(mgr, kvs, gpukv.TokenError, r"request 2: token -5 at position 1"):
        mgr.commit_batch(kvs, [[1], [2], [3, -5]])
    with rejected(mgr, kvs, gpukv.TokenError, r"request 1: token -5 at position 0"):
        mgr.commit_batch(kvs, (np.array([1, -5, 3], dtype=np.int64), np.array([0, 1, 2, 3])))
    with rejected(mgr, kvs, ValueError, r"caches\[1\]: committing 5 tokens would pass the capacity \(11 > 10\)"):
        mgr.commit_batch(kvs, [[1], [1] * 5, [3]])
    with rejected(mgr, kvs, ValueError, r"capacities\[2\] must be a non-negative int, got -1"):
        mgr.resize_batch(kvs, [12, 12, -1])
    with rejected(mgr, kvs, TypeError, r"capacities\[1\] must be a non-negative int"):
        mgr.resize_batch(kvs, [12, 1.5, 12])
    with rejected(mgr, kvs, ValueError, r"caches\[0\]: history_length cannot decrease \(2 < 6\)"):
        mgr.resize_batch(kvs, [12, 12, 12], [2, 6, 6])
    with rejected(mgr, kvs, ValueError, r"caches\[1\]: capacity 6 is below history_length 8"):
        mgr.resize_batch(kvs, [12, 6, 12], [6, 8, 6])
    with rejected(mgr, kvs, TypeError, r"is_end\[1\] must be a bool"):
        mgr.commit_batch(kvs, [[1], [2], [3]], is_end=[False, 1, False])
    with rejected(mgr, kvs, ValueError, r"priority_callbacks has 1 entries for 2 requests"):
        mgr.create_kv_caches([[1, 2], [3]], priority_callbacks=[None])


def test_append_batch_refuses_bad_input_by_name(mgr):
    """``append_batch`` refuses what ``commit_batch`` refuses, and a room
    that is no non-negative int, before anything changes."""
    kvs = running(mgr, 3)
    with rejected(mgr, kvs, ValueError, r"append_batch\(\): caches\[2\] is caches\[0\] again"):
        mgr.append_batch([kvs[0], kvs[1], kvs[0]], [[1], [2], [3]])
    with rejected(mgr, kvs, ValueError, r"append_batch\(\): caches\[1\]: committing 5 tokens would pass the capacity"):
        mgr.append_batch(kvs, [[1], [1] * 5, [3]])  # tokens go within the room the last step left
    with rejected(mgr, kvs, gpukv.TokenError, r"request 2: token -5 at position 1"):
        mgr.append_batch(kvs, [[1], [2], [3, -5]])
    with rejected(mgr, kvs, ValueError, r"append_batch\(\): room has 2 entries for 3 caches"):
        mgr.append_batch(kvs, [[1], [2], [3]], room=[1, 1])
    with rejected(mgr, kvs, ValueError, r"room\[1\] must be a non-negative int, got -1"):
        mgr.append_batch(kvs, [[1], [2], [3]], room=[1, -1, 1])
    with rejected(mgr, kvs, ValueError, r"append_batch\(\): room must be a non-negative int, got -2"):
        mgr.append_batch(kvs, [[1], [2], [3]], room=-2)
    with rejected(mgr, kvs, TypeError, r"room\[0\] must be a non-negative int, got True"):
        mgr.append_batch(kvs, [[1], [2], [3]], room=[True, 1, 1])
    with rejected(mgr, kvs, TypeError, r"append_batch\(\): room must be one non-negative int per cache"):
        mgr.append_batch(kvs, [[1], [2], [3]], room=True)
    with rejected(mgr, kvs, TypeError, r"append_batch\(\): is_end\[1\] must be a bool"):
        mgr.append_batch(kvs, [[1], [2], [3]], is_end=[False, 1, False])
    kvs[1].close()
    with rejected(mgr, kvs, gpukv.LogicError, r"append_batch\(\): caches\[1\] is CLOSED"):
        mgr.append_batch(kvs, [[1], [2], [3]])


def test_a_refused_resize_in_the_middle_changes_only_itself():
    mgr = make_manager("cpu", tokens_per_block=T, layers=[Attention()], pages_per_life_cycle=8)
    kvs = running(mgr, 3, length=4)  # 2 pages each: 6 of 8 in use, all locked
    # 1 page; 8 pages (the pool has 2 left: refused in the kernel); 2 pages (1 left: refused)
    got = mgr.resize_batch(kvs, [12, 40, 16], [4, 4, 4])
    assert got.tolist() == [True, False, False]
    assert [kv.capacity for kv in kvs] == [12, 8, 8]
    got = mgr.resize_batch([kvs[2], kvs[1]], [12, 9], [4, 4])  # the last page, then none
    assert got.tolist() == [True, False]
    assert [kv.capacity for kv in kvs] == [12, 8, 12]
    assert not mgr.resize_batch([kvs[0]], [100])[0]  # more than the whole pool: refused before the launch
    introspect.check_sanity(mgr)


def test_batched_and_per_cache_calls_mix():
    mgr = make_manager("cpu", tokens_per_block=T, layers=LAYERS, pages_per_life_cycle=64)
    kvs = running(mgr, 2)
    kvs[0].commit([7, 7])  # per-cache commit on a batched cache
    assert kvs[0].num_committed_tokens == 8
    kv = mgr.create_kv_cache([1] * 6 + [7, 7])  # the batched cache's commits are reusable
    assert kv.num_committed_tokens == 8
    assert kv.resume() and mgr.resize_batch([kv], [12])[0]
    mgr.commit_batch([kv, kvs[1]], [[9], [8]], is_end=[False, True])
    assert kv.num_committed_tokens == 9 and kvs[1].num_committed_tokens == 7
    with pytest.raises(gpukv.LogicError, match="after stop_committing"):
        kvs[1].commit([1])
    mgr.close_batch([kv] + kvs, evict_first=[True, False, False])
    assert mgr.probe_reuse([1] * 6 + [7, 7, 9]) == 9
    introspect.check_sanity(mgr)


def test_segments_grow_and_pack_without_losing_state():
    """Many caches growing one block at a time move their rows around the
    pool; every committed token and page survives."""
    mgr = make_manager("cpu", tokens_per_block=T, layers=[Attention()], pages_per_life_cycle=4096)
    n = 40
    kvs = mgr.create_kv_caches([[i, i] for i in range(n)])
    assert mgr.resume_batch(kvs).all()
    want = [[] for _ in range(n)]
    for step in range(60):
        caps = np.array([kv.capacity for kv in kvs])
        grow = np.flatnonzero(caps < (step + 1))
        if grow.size:
            assert mgr.resize_batch([kvs[i] for i in grow], [-(-(step + 1) // T) * T] * grow.size).all()
        toks = np.arange(n, dtype=np.int32) * 1000 + step
        mgr.commit_batch(kvs, (toks, np.arange(n + 1)))
        for i in range(n):
            want[i].append(int(toks[i]))
        if step == 30:  # some caches finish and are dropped: their rows are reused
            mgr.close_batch(kvs[::3])
            for i in range(0, n, 3):
                assert list(kvs[i].committed_tokens) == want[i]
            keep = [i for i in range(n) if i % 3]
            kvs, want, n = [kvs[i] for i in keep], [want[i] for i in keep], len(keep)
            more = mgr.create_kv_caches([[10**6 + i] for i in range(10)])  # nothing to reuse
            assert mgr.resume_batch(more).all()
            kvs += more
            want += [[] for _ in more]
            n = len(kvs)
    for kv, w in zip(kvs, want):
        assert list(kv.committed_tokens) == w
        assert mgr.probe_reuse(w) == len(w) // T * T
    introspect.check_sanity(mgr)


def _workload(backend):
    """A small engine loop through the batched calls; the end state."""
    layers = [Attention(), Attention(window=6), Ssm()]
    mgr = make_manager(backend, tokens_per_block=T, layers=layers, pages_per_life_cycle=24, commit_min_snapshot=True)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 9], [2, 2, 2, 2, 2, 2, 2, 2, 2]]
    kvs = mgr.create_kv_caches(prompts)
    ok = mgr.resume_batch(kvs)
    out = [ok.tolist()]
    kvs = [kv for kv, good in zip(kvs, ok) if good]
    prompts = [p for p, good in zip(prompts, ok) if good]
    n = [kv.num_committed_tokens for kv in kvs]
    out.append(mgr.resize_batch(kvs, [len(p) for p in prompts], [len(p) for p in prompts]).tolist())
    mgr.commit_batch(kvs, [p[k:] for p, k in zip(prompts, n)])
    for step in range(6):
        caps = [kv.num_committed_tokens + 1 for kv in kvs]
        out.append(mgr.resize_batch(kvs, caps, [kv.num_committed_tokens + 1 for kv in kvs]).tolist())
        mgr.commit_batch(kvs, (np.full(len(kvs), 3 + step, dtype=np.int32), np.arange(len(kvs) + 1)),
                         is_end=[step == 5] * len(kvs))
    mgr.close_batch(kvs)
    again = mgr.create_kv_caches([p + [3, 4, 5] for p in prompts])
    out.append([kv.num_committed_tokens for kv in again])
    mgr.close_batch(again)
    introspect.check_sanity(mgr)
    blocks = introspect.tables(mgr)["blocks"]
    return out, mgr.get_and_reset_eviction_stats(), int((blocks["flags"] != 0).sum())


@pytest.mark.parametrize("backend", [p for p in backend_params() if p.values[0] != "cpu"])
def test_the_cuda_kernels_end_in_the_cpu_state(backend):
    assert _workload(backend) == _workload("cpu")


@pytest.mark.parametrize("call, match", [
    (lambda m, k: m.resize_batch(k, [True, 12, 12]), r"resize_batch\(\): capacities\[0\] must be a non-negative int, got True"),
    (lambda m, k: m.resize_batch(k, [12, 12, 12], [6, np.True_, 6]),
     r"history_lengths\[1\] must be a non-negative int, got np.True_|history_lengths\[1\] must be a non-negative int, got True"),
    (lambda m, k: m.resize_batch(k, [[12, 13], [12], 12]), r"resize_batch\(\): capacities\[0\] must be a non-negative int"),
    (lambda m, k: m.resize_batch(k, np.array(12)), r"resize_batch\(\): capacities must be one non-negative int per cache"),
    (lambda m, k: m.resize_batch(set(k), [12, 12, 12]), r"resize_batch\(\): caches must be a list of KVCache \(in order\), got set"),
    (lambda m, k: m.commit_batch(set(k), [[1], [2], [3]]), r"commit_batch\(\): caches must be a list"),
    (lambda m, k: m.close_batch(frozenset(k)), r"close_batch\(\): caches must be a list"),
    (lambda m, k: m.resume_batch({kv: 1 for kv in k}), r"resume_batch\(\): caches must be a list"),
    (lambda m, k: m.close_batch(k, np.array(True)), r"close_batch\(\): evict_first must be a bool or one bool per cache"),
    (lambda m, k: m.commit_batch(k, np.array(5)), r"commit_batch\(\): tokens must be a list of token sequences"),
    (lambda m, k: m.create_kv_caches([[1, 2]], priority_callbacks=lambda o, lc: 35),
     r"create_kv_caches\(\): priority_callbacks must be None or one callable \(or None\) per request"),
    (lambda m, k: m.create_kv_caches({(1, 2), (3, 4)}), r"create_kv_caches\(\): requests must be a list of token sequences or a \(flat_tokens, offsets\) pair, got set"),
])
def test_unordered_ragged_or_bool_entries_are_refused_by_name(mgr, call, match):
    """A bool is no capacity, a set pairs its entries with the caches in no
    order, a ragged or 0-d array is no list of ints, one callable is not one
    per request: each refused naming the argument (and the entry), nothing
    changed."""
    kvs = running(mgr, 3)
    with rejected(mgr, kvs, TypeError, match):
        call(mgr, kvs)
    assert len(mgr._open_caches) == 3


def test_a_digest_inside_any_sequence_is_taken_by_the_batched_calls(mgr):
    """A valid digest inside a sequence that is not a list (a deque) reads as
    it does in a list, for ``commit_batch`` and ``match_batch`` as for
    ``kv.commit`` (it was refused as an out-of-range token)."""
    from collections import deque

    digest = bytes(range(32))
    tokens = [1, 2, digest, 4, 5, 6, 7, 8]
    (kv,) = mgr.create_kv_caches([[]])
    assert mgr.resume_batch([kv]).all() and mgr.resize_batch([kv], [8], [8]).all()
    mgr.commit_batch([kv], [deque(tokens)])
    assert kv.committed_tokens == tokens
    kv.close()
    reused = mgr.probe_reuse(tokens)
    assert reused > 0 and mgr.match_batch([deque(tokens)]).to_host().num_tokens.tolist() == [reused]


@pytest.mark.parametrize("shape", ["lists", "pair", "rows", "registered"])
def test_every_token_shape_commits_what_lists_commit(mgr, shape):
    """``commit_batch`` takes the token shapes ``match_batch`` takes (lists,
    ``(flat, offsets)``, a 2-D array, registered ``TokenSequence``s), each
    committing the same tokens."""
    rows = [[7, 8, 9, 10], [11, 12, 13, 14], [15, 16, 17, 18]]
    kvs = running(mgr, 3)
    if shape == "lists":
        tokens = rows
    elif shape == "pair":
        tokens = (np.array(rows, dtype=np.int32).ravel(), np.array([0, 4, 8, 12]))
    elif shape == "rows":
        tokens = np.array(rows, dtype=np.int64)
    else:
        tokens = [mgr.token_sequence(r) for r in rows]
    mgr.commit_batch(kvs, tokens)
    assert [np.asarray(kv.committed_tokens[6:]).tolist() for kv in kvs] == rows
    introspect.check_sanity(mgr)


def test_a_released_sequence_is_refused_by_every_batched_call(mgr):
    """A released ``TokenSequence`` is refused, by its request's index, by
    ``match_batch``, ``create_kv_caches`` and ``commit_batch`` alike."""
    kvs = running(mgr, 2)
    live, gone = mgr.token_sequence([1, 2]), mgr.token_sequence([3, 4])
    gone.release()
    for call in (lambda: mgr.match_batch([live, gone]), lambda: mgr.create_kv_caches([live, gone]),
                 lambda: mgr.commit_batch(kvs, [live, gone])):
        with rejected(mgr, kvs, ValueError, "request 1: TokenSequence was released"):
            call()
    assert len(mgr._open_caches) == 2


def test_scopes_are_refused_in_the_same_words_by_match_and_create(mgr):
    """One check of a batch's scopes: the same sentence from either call."""
    for what, call in (("match_batch", mgr.match_batch), ("create_kv_caches", mgr.create_kv_caches)):
        with rejected(mgr, [], ValueError, rf"{what}\(\): scopes has 1 entries for 2 requests"):
            call([[1], [2]], [None])
        with rejected(mgr, [], TypeError, rf"{what}\(\): scopes\[1\]: scope must be a gpukv\.ReuseScope or None, got int"):
            call([[1], [2]], [gpukv.ReuseScope(salt=1), 3])
    assert not mgr._open_caches

"""``TokenSequence`` and the device token arena (gpukv/arena.py, docs/api.md).

A scheduler keeps one registered sequence per request and extends it as
tokens arrive; matching registered sequences copies nothing from the host and
hashes only full blocks never hashed before. These scenarios check the handle
(extend, len, tokens, release), that many sequences growing past the arena's
initial capacity (segment moves, compaction, doubling) still match exactly
like plain lists, that block hashes are computed once, and that released or
foreign sequences are refused.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

import gpukv
from gpukv import Attention, TokenSequence, introspect

from tests.support.backends import make_manager


def host(a) -> list:
    return (a if isinstance(a, np.ndarray) else a.get()).tolist()


def count_hashing(mgr) -> list:
    """Record the number of blocks each hash launch of this manager hashes."""
    return introspect.record_hash_launches(mgr)


def hashed(seq) -> int:
    """Leading full blocks of ``seq`` whose hashes are computed."""
    return introspect.sequence_state(seq)["hashed_blocks"]


def memoized(seq) -> int:
    """Leading full blocks of ``seq`` whose matched rows are remembered."""
    return introspect.sequence_state(seq)["memoized_blocks"]


def tree_manager(backend, T=4):
    """F + S(W = T + 1); two prompts of 3 blocks sharing the first block."""
    mgr = make_manager(backend, tokens_per_block=T, layers=[Attention(), Attention(window=T + 1)])
    p1 = list(range(1, 3 * T + 1))
    p2 = p1[:T] + list(range(100, 100 + 2 * T))
    assert introspect.insert_sequence(mgr, p1) == 3
    assert introspect.insert_sequence(mgr, p2) == 3
    return mgr, p1, p2


def test_extend_len_tokens_and_release(backend):
    mgr, p1, _ = tree_manager(backend)
    seq = mgr.token_sequence()
    assert isinstance(seq, TokenSequence) and len(seq) == 0 and host(seq.tokens) == []
    assert seq.extend(p1[:3]) is seq
    assert len(seq) == 3 and host(seq.tokens) == p1[:3]
    seq.extend([]).extend(np.array(p1[3:6], dtype=np.int64)).extend(tuple(p1[6:7]))
    assert len(seq) == 7 and host(seq.tokens) == p1[:7]
    assert not seq.released and repr(seq) == "TokenSequence(len=7)"

    seq.release()
    assert seq.released and len(seq) == 0
    with pytest.raises(ValueError, match="this TokenSequence was released"):
        seq.tokens
    with pytest.raises(ValueError, match="this TokenSequence was released"):
        seq.extend([1])
    with pytest.raises(ValueError, match="request 0: TokenSequence was released"):
        mgr.match_batch([seq])
    with pytest.raises(ValueError, match="request 0: TokenSequence was released"):
        mgr.probe_reuse(seq)
    seq.release()  # releasing twice is harmless


def test_a_growing_sequence_matches_like_its_list_at_every_step(backend):
    """Prompt chunks, then generated tokens one at a time."""
    mgr, p1, p2 = tree_manager(backend)
    chunks = [p1[:5], p1[5:6], p1[6:9], [7], [8]]  # 12 tokens, then diverges
    seq = mgr.token_sequence()
    sofar = []
    for chunk in chunks:
        seq.extend(chunk)
        sofar += chunk
        m = mgr.match_batch([seq]).to_host()
        assert m.num_tokens.tolist() == [mgr.probe_reuse(sofar)]
        assert m.num_lookup_tokens.tolist() == [len(sofar)]
    assert mgr.probe_reuse(seq) == mgr.probe_reuse(sofar) == 9


def test_many_sequences_past_the_initial_capacity_still_match(backend):
    """300 sequences of 4 segment blocks each overflow the 1024-block arena
    (compaction and doubling); released ones leave holes; extending the rest
    moves their segments. Hashes computed before a move must move with it."""
    T = 4
    mgr, p1, p2 = tree_manager(backend, T)
    cap0 = introspect.arena_capacity_blocks(mgr)
    n = 300
    prompts = [(p1 if i % 2 else p2)[: 5 + i % 7] for i in range(n)]
    seqs = [mgr.token_sequence(p) for p in prompts]
    assert introspect.arena_capacity_blocks(mgr) > cap0  # the arena grew
    assert all(host(s.tokens) == p for s, p in zip(seqs, prompts))

    checked = range(0, n, 1 if backend == "cpu" else 37)  # the simulator is slow: a sample
    before = mgr.match_batch([seqs[i] for i in checked]).to_host()  # hashes the full blocks
    expected = mgr.match_batch([prompts[i] for i in checked]).to_host()
    assert np.array_equal(before.num_tokens, expected.num_tokens)
    assert before.num_tokens.min() >= 5  # every prompt is in the tree

    # release every third; extend the others past their segment (a move each)
    for i in range(0, n, 3):
        seqs[i].release()
    for i in range(n):
        if i % 3:
            tail = p1[len(prompts[i]):] if i % 2 else p2[len(prompts[i]):]
            tail += [7] * (5 * T)  # then diverge: 5 more blocks
            seqs[i].extend(tail)
            prompts[i] = prompts[i] + tail
    gc.collect()
    live = [i for i in range(n) if i % 3]
    assert all(host(seqs[i].tokens) == prompts[i] for i in live)
    assert all(len(seqs[i]) == len(prompts[i]) for i in live)

    sample = [i for i in live if i in checked or backend == "cpu"]
    got = mgr.match_batch([seqs[i] for i in sample]).to_host()
    want = mgr.match_batch([prompts[i] for i in sample]).to_host()
    for f in ("num_tokens", "num_lookup_tokens", "num_tokens_before_pruning", "block_offsets", "block_ids"):
        assert np.array_equal(getattr(got, f), getattr(want, f)), f
    assert got.num_tokens.max() == 3 * T


def test_compaction_keeps_hashes_of_moved_sequences(backend):
    """One long sequence forces the arena to compact and double while other
    sequences, already hashed, are packed to new places."""
    T = 4
    mgr, p1, p2 = tree_manager(backend, T)
    front = [mgr.token_sequence([0]) for _ in range(50)]
    a = mgr.token_sequence(p1)
    b = mgr.token_sequence(p2)
    back = [mgr.token_sequence([0]) for _ in range(150)]  # 202 segments of 4 blocks
    assert mgr.match_batch([a, b]).to_host().num_tokens.tolist() == [12, 12]
    assert hashed(a) == 3 and hashed(b) == 3
    launches = count_hashing(mgr)
    start_a, cap0 = introspect.sequence_state(a)["start"], introspect.arena_capacity_blocks(mgr)
    for f in front:
        f.release()
    big = mgr.token_sequence([9] * (300 * T))  # a fresh 300-block segment: compaction and doubling
    assert introspect.arena_capacity_blocks(mgr) > cap0
    assert introspect.sequence_state(a)["start"] < start_a  # a was packed to the front
    assert all(host(f.tokens) == [0] for f in back)
    assert mgr.match_batch([a, b]).to_host().num_tokens.tolist() == [12, 12]
    assert launches == []  # nothing was hashed again
    assert len(big) == 300 * T


def test_hashes_are_computed_once(backend):
    T = 4
    mgr, p1, p2 = tree_manager(backend, T)
    launches = count_hashing(mgr)
    seq = mgr.token_sequence(p1[:10])  # 2 full blocks and 2 tokens
    assert hashed(seq) == 0 and launches == []  # nothing until a match

    assert mgr.probe_reuse(seq) == 10
    assert hashed(seq) == 2 and launches == [2]
    assert mgr.probe_reuse(seq) == 10
    assert mgr.match_batch([seq, seq]).to_host().num_tokens.tolist() == [10, 10]
    assert launches == [2]  # nothing new to hash

    seq.extend(p1[10:12])  # completes block 2
    other = mgr.token_sequence(p2)  # 3 fresh blocks
    m = mgr.match_batch([seq, other]).to_host()
    assert m.num_tokens.tolist() == [12, 12]
    assert hashed(seq) == 3 and hashed(other) == 3
    assert launches == [2, 1 + 3]  # one launch for both, only the new blocks

    seq.extend([1, 2, 3])  # a partial block is never hashed
    assert mgr.probe_reuse(seq) == 12
    assert launches == [2, 4] and hashed(seq) == 3


def test_a_recycled_slot_does_not_reuse_old_hashes(backend):
    mgr, p1, p2 = tree_manager(backend)
    a = mgr.token_sequence(p1)
    assert mgr.probe_reuse(a) == 12
    slot = introspect.sequence_slot(a)
    a.release()
    b = mgr.token_sequence(p2[:4] + [0] * 8)  # same first block, then nothing in the tree
    assert introspect.sequence_slot(b) == slot
    assert mgr.probe_reuse(b) == mgr.probe_reuse(p2[:4] + [0] * 8) == 4


def test_garbage_collection_releases_the_slot():
    mgr, p1, _ = tree_manager("cpu")
    seq = mgr.token_sequence(p1)
    slot = introspect.sequence_slot(seq)
    assert introspect.arena_slot(mgr, slot)["live"]
    del seq
    gc.collect()
    state = introspect.arena_slot(mgr, slot)
    assert not state["live"] and state["length"] == 0
    assert introspect.sequence_slot(mgr.token_sequence([1])) == slot


def test_sequences_from_another_manager_are_rejected(backend):
    mgr, p1, _ = tree_manager(backend)
    other, _, _ = tree_manager("cpu")
    foreign = other.token_sequence(p1)
    mine = mgr.token_sequence(p1)
    with pytest.raises(ValueError, match="request 0: TokenSequence belongs to another manager"):
        mgr.match_batch([foreign])
    with pytest.raises(ValueError, match="request 1: TokenSequence belongs to another manager"):
        mgr.match_batch([mine, foreign])
    with pytest.raises(ValueError, match="request 0: TokenSequence belongs to another manager"):
        mgr.probe_reuse(foreign)
    assert hashed(mine) == 0  # a rejected batch hashed nothing


def test_a_foreign_sequence_in_a_mixed_batch_is_rejected():
    mgr, p1, _ = tree_manager("cpu")
    other, _, _ = tree_manager("cpu")
    foreign = other.token_sequence(p1)
    with pytest.raises(ValueError, match="request 1: TokenSequence belongs to another manager"):
        mgr.match_batch([p1, foreign])


def test_a_released_sequence_in_a_mixed_batch_names_its_request():
    mgr, p1, _ = tree_manager("cpu")
    seq = mgr.token_sequence(p1)
    seq.release()
    with pytest.raises(ValueError, match="request 1: TokenSequence was released"):
        mgr.match_batch([p1, seq])


def test_a_mixed_batch_of_lists_and_sequences(backend):
    mgr, p1, p2 = tree_manager(backend)
    seq = mgr.token_sequence(p2[:7])
    m = mgr.match_batch([p1, seq, p2]).to_host()
    assert m.num_tokens.tolist() == [12, mgr.probe_reuse(p2[:7]), 12]


# ---------------------------------------------------------------------------
# the memo: a registered sequence remembers the blocks it matched by key
# ---------------------------------------------------------------------------


def agree(mgr, seq, scope=None) -> int:
    """The sequence matches exactly like its tokens as a list; returns num_tokens."""
    got = mgr.match_batch([seq], scope).to_host()
    want = mgr.match_batch([host(seq.tokens)], scope).to_host()
    for f in ("num_tokens", "num_tokens_before_pruning", "num_tokens_before_hybrid_pruning", "block_ids"):
        assert np.array_equal(getattr(got, f), getattr(want, f)), f
    return int(got.num_tokens[0])


def test_rematching_after_the_tree_changes(backend):
    T = 4
    mgr, p1, p2 = tree_manager(backend, T)
    seq = mgr.token_sequence(p1)
    assert agree(mgr, seq) == 12 and memoized(seq) == 3

    # a page dies but no block leaves the tree: the memo stays trusted
    b0, b1, b2 = (introspect.block_ref(mgr, int(r)) for r in mgr.match_batch([p1]).to_host().blocks(0))
    detaches = introspect.detach_count(mgr)
    introspect.page_death(mgr, introspect.page_of(mgr, b2, 1)[0])  # b2's S page (W = 5 needs it)
    assert introspect.detach_count(mgr) == detaches
    assert agree(mgr, seq) == 8

    # b1 and b2 leave; their rows go to p3's new blocks: same rows, other blocks
    introspect.remove_subtree(mgr, b1)
    p3 = p1[:T] + [50 + k for k in range(2 * T)]
    assert introspect.insert_sequence(mgr, p3) == 3
    rows3 = mgr.match_batch([p3]).to_host().blocks(0).tolist()
    assert sorted(rows3[1:]) == sorted([b1.row, b2.row])  # recycled
    assert agree(mgr, seq) == 4
    assert agree(mgr, mgr.token_sequence(p3)) == 12

    # p1 comes back in fresh rows; the sequence finds it again
    assert introspect.insert_sequence(mgr, p1) == 3
    assert agree(mgr, seq) == 12

    # a cleared tree, then another scope: nothing, then everything again
    mgr.clear_reusable_blocks()
    assert agree(mgr, seq) == 0
    s = gpukv.ReuseScope(salt=5)
    introspect.insert_sequence(mgr, p1, s)
    assert agree(mgr, seq) == 0
    assert agree(mgr, seq, s) == 12
    assert agree(mgr, seq) == 0
    introspect.insert_sequence(mgr, p1)
    assert agree(mgr, seq) == 12
    assert agree(mgr, seq, s) == 12


def test_a_rematch_memoizes_the_new_rows_of_blocks_that_moved(backend):
    """The memo stops holding at block 1 and the same match finds blocks 1 and
    2 again in other rows: the memo must take the new rows, or the next
    (trusted: nothing detached since) recall returns the old ones."""
    T = 4
    mgr, p1, _ = tree_manager(backend, T)
    seq = mgr.token_sequence(p1)
    assert agree(mgr, seq) == 12
    old = mgr.match_batch([p1]).to_host().blocks(0).tolist()
    introspect.remove_subtree(mgr, introspect.block_ref(mgr, old[1]))
    p3 = p1[:T] + [50 + k for k in range(2 * T)]
    assert introspect.insert_sequence(mgr, p3) == 3  # takes the freed rows
    assert introspect.insert_sequence(mgr, p1) == 3  # p1's blocks 1, 2 in other rows
    new = mgr.match_batch([p1]).to_host().blocks(0).tolist()
    assert new[0] == old[0] and not set(new[1:]) & set(old[1:])
    detaches = introspect.detach_count(mgr)
    assert agree(mgr, seq) == 12  # recall stops at block 1, the walk finds the new rows
    assert agree(mgr, seq) == 12  # trusted recall
    assert introspect.detach_count(mgr) == detaches
    assert mgr.match_batch([seq]).to_host().blocks(0).tolist() == new


def test_a_memoized_sequence_keeps_growing(backend):
    T = 4
    mgr, p1, p2 = tree_manager(backend, T)
    seq = mgr.token_sequence(p2[:6])
    assert agree(mgr, seq) == 6 and memoized(seq) == 1
    seq.extend(p2[6:])
    assert agree(mgr, seq) == 12 and memoized(seq) == 3
    seq.extend([0] * 9)  # two more full blocks, not in the tree
    assert agree(mgr, seq) == 12 and memoized(seq) == 3
    introspect.insert_sequence(mgr, host(seq.tokens))  # now they are
    assert agree(mgr, seq) == 21
    # the same sequence twice in one batch, and beside other requests
    m = mgr.match_batch([seq, p1, seq]).to_host()
    assert m.num_tokens.tolist() == [21, 12, 21]


_RECALL_IN_A_LARGE_BATCH = """
import gpukv
from gpukv import Attention, introspect
mgr = gpukv.KVCacheManager(gpukv.CacheConfig(tokens_per_block=4, layers=[Attention()], backend="cpu"))
p = list(range(1, 13))
introspect.insert_sequence(mgr, p)
seqs = [mgr.token_sequence(p) for _ in range(40)]
assert mgr.match_batch(seqs[:1]).to_host().num_tokens.tolist() == [12]  # memoizes 3 blocks
m = mgr.match_batch(seqs).to_host()  # 40 >= PARALLEL_MIN_REQUESTS: the parallel cpu kernel
assert m.num_tokens.tolist() == [12] * 40, m.num_tokens
assert m.block_offsets.tolist() == list(range(0, 121, 3)), m.block_offsets
print("ok")
"""


def test_a_large_batch_recalls_memoized_sequences():
    """Run in a child process, so a crash in the kernel fails the test instead of pytest."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    p = subprocess.run([sys.executable, "-c", _RECALL_IN_A_LARGE_BATCH], cwd=root, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and p.stdout.strip() == "ok", (p.returncode, p.stderr[-2000:])

"""Hostile input and unbounded growth, as scenarios.

Each scenario is what a client did that once failed: a multimodal prompt that
could not be admitted, a scheduler that never drained its events, a tenant
per request, a resize to an absurd capacity, a command line of nonsense. Every
test asserts the outcome a client relies on (the reuse, the bound, the message
and exit status), and where a kernel is involved runs on ``cpu`` and, at small
sizes, on the CUDA kernels (``cudasim``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

import gpukv
from gpukv import Attention, ReuseScope, introspect
from gpukv.cli import main as cli_main

from tests.support.backends import make_manager
from tests.support.subtree_victim import SHARED_VICTIM, requests_sharing_a_victim

T = 4
DIGEST = bytes(range(32))
OTHER_DIGEST = bytes(range(1, 33))
HYBRID = [Attention(), Attention(window=8)]  # lc0 full, lc1 a sliding window (a drop plan has pages to name)


def commit_turn(mgr, tokens, scope=None, close=True):
    """One request: admitted with its reuse, computed, committed, closed."""
    kv = mgr.create_kv_cache(input_tokens=tokens, scope=scope)
    assert kv.resume() and kv.resize(len(tokens), kv.num_committed_tokens)
    kv.commit(tokens[kv.num_committed_tokens:])
    if close:
        kv.close()
    return kv


# ---------------------------------------------------------------------------
# A multimodal prompt: a 32-byte digest among the tokens
# ---------------------------------------------------------------------------


def test_a_multimodal_prompt_is_admitted_with_its_reuse(backend):
    mgr = make_manager(backend, tokens_per_block=T, layers=HYBRID)
    image = gpukv.gen_multimodal_cache_key_tokens(1000, DIGEST, 3)
    prompt = [1, 2] + image + [3, 4, 5, 6, 7]
    commit_turn(mgr, prompt)

    kv = mgr.create_kv_cache(input_tokens=prompt)  # raised TokenError: token -1 at position 2
    assert kv.num_committed_tokens == mgr.probe_reuse(prompt) > 2 * T
    kv.close()

    other = [1, 2] + gpukv.gen_multimodal_cache_key_tokens(1000, OTHER_DIGEST, 3) + [3, 4, 5, 6, 7]
    kv = mgr.create_kv_cache(input_tokens=other)  # another image: the prefix before it only
    assert kv.num_committed_tokens == mgr.probe_reuse(other) == 2
    kv.close()
    introspect.check_sanity(mgr)


def test_committed_tokens_hold_the_digest_and_feed_back_into_a_new_cache(backend):
    mgr = make_manager(backend, tokens_per_block=T, layers=HYBRID)
    prompt = [9, DIGEST, 8, 7, 6, 5, 4, 3, 2]
    kv = commit_turn(mgr, prompt, close=False)

    assert kv.committed_tokens == prompt  # the digest as bytes, not its interned id
    head = kv.committed_tokens[: 2 * T]
    kv.close()
    again = mgr.create_kv_cache(input_tokens=head)
    assert again.num_committed_tokens == 2 * T
    again.close()

    plain = commit_turn(mgr, [1, 2, 3, 4, 5], close=False)
    assert isinstance(plain.committed_tokens, np.ndarray)  # no digest: the int32 array as before
    assert plain.committed_tokens.tolist() == [1, 2, 3, 4, 5]
    plain.close()


def test_a_drop_plan_for_a_turn_that_committed_a_digest(backend):
    mgr = make_manager(backend, tokens_per_block=T, layers=HYBRID)
    prompt = [1, DIGEST, 3, 4, 5, 6, 7, 8, 9, 10]
    kv = commit_turn(mgr, prompt, close=False)
    kv.stop_committing()
    plan = kv.plan_committed_block_drop()  # raised TokenError: token -1 at position 1
    assert plan is not None
    kv.close()
    plan.drop()
    introspect.check_sanity(mgr)


def test_a_batch_mixing_a_registered_sequence_with_a_digest_and_a_list(backend):
    mgr = make_manager(backend, tokens_per_block=T, layers=HYBRID)
    prompt = [1, 2, 3, DIGEST, 5, 6, 7, 8, 9]
    commit_turn(mgr, prompt)
    seq = mgr.token_sequence(prompt)
    m = mgr.match_batch([seq, [1, 2, 3, 4], prompt]).to_host()  # raised TokenError on the sequence
    expect = [mgr.probe_reuse(prompt), mgr.probe_reuse([1, 2, 3, 4]), mgr.probe_reuse(prompt)]
    assert m.num_tokens.tolist() == expect and expect[0] > 2 * T
    assert mgr.match_batch([seq]).to_host().num_tokens.tolist() == expect[:1]

    kv = mgr.create_kv_cache(input_tokens=seq)  # the scheduler's own registered request
    assert kv.num_committed_tokens == expect[0]
    kv.close()


def test_the_tokens_of_a_registered_sequence_cannot_be_written_through():
    mgr = make_manager("cpu", tokens_per_block=T, layers=HYBRID)
    commit_turn(mgr, [1, 2, 3, 4, 5, 6, 7, 8])
    seq = mgr.token_sequence([1, 2, 3, 4, 5, 6, 7, 8])
    with pytest.raises(ValueError, match="read-only"):
        seq.tokens[0] = 99  # would make match_batch (hashes kept) and probe_reuse disagree
    assert mgr.match_batch([seq]).to_host().num_tokens.tolist() == [mgr.probe_reuse(seq.tokens)]


# ---------------------------------------------------------------------------
# Unbounded growth
# ---------------------------------------------------------------------------


def distinct_prompts(n, length=2 * T + 1):
    return [[10_000 + i] + list(range(1, length)) for i in range(n)]


def test_a_scheduler_that_never_drains_its_events_keeps_only_what_the_cap_allows():
    cap = 8
    mgr = make_manager("cpu", tokens_per_block=T, layers=HYBRID, max_kv_event_entries=cap, pages_per_life_cycle=64)
    uncapped = make_manager("cpu", tokens_per_block=T, layers=HYBRID, max_kv_event_entries=cap, pages_per_life_cycle=64)
    uncapped._events._trim = lambda: None  # what the queue would show if nothing were dropped early
    pending = []
    for tokens in distinct_prompts(300):
        for m in (mgr, uncapped):
            commit_turn(m, tokens)
        pending.append(len(mgr._events._pending))
    assert max(pending) <= 2 * cap + 16
    assert len(uncapped._events._pending) > 1000  # the growth the cap prevents
    got, want = mgr.get_latest_events(), uncapped.get_latest_events()
    assert len(got) == cap and got == want  # the same newest events, ids and all


def test_a_tenant_per_request_does_not_grow_the_scope_registry(backend):
    n = 400 if backend == "cpu" else 150
    mgr = make_manager(backend, tokens_per_block=T, layers=HYBRID, pages_per_life_cycle=32)
    keep = ReuseScope(salt=7)
    commit_turn(mgr, [1, 2, 3, 4, 5, 6, 7, 8, 9], scope=keep)  # a tenant whose blocks stay
    sizes = []
    for i in range(n):
        salt = ReuseScope(salt=1000 + i)
        assert mgr.probe_reuse([1, 2, 3, 4], salt) == 0  # a lookup registers nothing
        kv = mgr.create_kv_cache(input_tokens=[1, 2, 3, 4], scope=salt)
        kv.close()  # nothing committed: no block refers to the scope
        sizes.append(len(mgr._tree._scope_ids))
    assert max(sizes) <= 2 * 64 + 2
    assert mgr.probe_reuse([1, 2, 3, 4, 5, 6, 7, 8, 9], keep) == 9  # the live tenant was kept
    assert mgr.probe_reuse([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 0
    introspect.check_sanity(mgr)


def test_a_reclaimed_scope_that_returns_sees_only_its_own_blocks():
    mgr = make_manager("cpu", tokens_per_block=T, layers=HYBRID, pages_per_life_cycle=32)
    a, b = ReuseScope(salt=1), ReuseScope(salt=2)
    seq = mgr.token_sequence([1, 2, 3, 4, 5, 6, 7, 8])
    commit_turn(mgr, [1, 2, 3, 4, 5, 6, 7, 8], scope=a)
    assert mgr.match_batch([seq], a).to_host().num_tokens.tolist() == [8]  # memoized under a's id
    mgr.clear_reusable_blocks()
    for i in range(200):  # enough new scopes for a's id to be reclaimed
        mgr.create_kv_cache(scope=ReuseScope(salt=100 + i)).close()
    assert a not in mgr._tree._scope_ids
    commit_turn(mgr, [1, 2, 3, 4, 5, 6, 7, 8], scope=b)
    assert mgr.match_batch([seq], a).to_host().num_tokens.tolist() == [0]
    assert mgr.match_batch([seq], b).to_host().num_tokens.tolist() == [8]


def test_a_stream_of_distinct_images_does_not_grow_the_digest_table(backend):
    n = 300 if backend == "cpu" else 100
    mgr = make_manager(backend, tokens_per_block=T, layers=HYBRID, pages_per_life_cycle=16, max_kv_event_entries=64)
    kept = [5, DIGEST, 6, 7, 8, 9, 10, 11, 12]
    kv_kept = commit_turn(mgr, kept, close=False)  # an open cache holds its digest
    for i in range(n):
        image = i.to_bytes(4, "little") * 8
        commit_turn(mgr, [1, image, 2, 3, 4, 5, 6, 7, 8])  # a tiny pool: older images are evicted
    assert len(mgr._tables._mm_index) <= 2 * 64 + 2
    assert mgr._tables.mm_digests.shape[0] <= 256
    assert kv_kept.committed_tokens == kept
    assert mgr.probe_reuse(kept) == 2 * T  # its full blocks (the partial tail is committed on close)
    mgr.get_latest_events()
    kv_kept.close()
    introspect.check_sanity(mgr)


def test_events_name_the_right_digest_after_rows_are_reclaimed():
    mgr = make_manager("cpu", tokens_per_block=T, layers=[Attention()], pages_per_life_cycle=8, max_kv_event_entries=10_000)
    for i in range(200):
        image = bytes([i % 256, i // 256]) * 16
        commit_turn(mgr, [1, image, 2, 3])
        stored = [e for e in mgr.get_latest_events() if isinstance(e.data, gpukv.KVCacheStoredData)]
        tokens = [t.token_id for e in stored for blk in e.data.blocks for t in blk.tokens]
        assert image.hex() in tokens, i


def test_rejected_calls_intern_no_digest():
    mgr = make_manager("cpu", tokens_per_block=T, layers=HYBRID)
    tables = mgr._tables
    kv = commit_turn(mgr, [1, 2, 3, 4], close=False)
    before = dict(tables._mm_index)
    with pytest.raises(ValueError, match="would pass the capacity"):
        kv.commit([DIGEST, 5])
    kv.stop_committing()
    with pytest.raises(gpukv.LogicError):
        kv.commit([DIGEST])
    with pytest.raises(gpukv.TokenError):
        mgr.create_kv_cache(input_tokens=[DIGEST, -1])
    mgr.create_kv_cache(input_tokens=[DIGEST, 1]).close()  # a lookup: nothing is stored
    with pytest.raises(ValueError, match="a block holds 1..4 tokens"):
        mgr._tree.add([OTHER_DIGEST] * 5)
    assert tables._mm_index == before
    kv.close()


def test_a_rejected_token_sequence_keeps_no_arena_slot_or_segment():
    mgr = make_manager("cpu", tokens_per_block=T, layers=HYBRID)
    arena = mgr._arena
    held = [mgr.token_sequence([1, 2, 3])]
    state = (arena._next_slot, list(arena._free_slots), arena.top_blocks)
    failures = []
    for _ in range(50):
        try:
            held.append(mgr.token_sequence([1, -2]))
        except gpukv.TokenError as e:
            failures.append(e)  # kept: a held traceback once kept its sequence alive too
    assert len(failures) == 50
    assert (arena._next_slot, list(arena._free_slots), arena.top_blocks) == state


def test_the_change_log_is_sized_for_a_launch_not_for_the_pool():
    mgr = make_manager("cpu", tokens_per_block=32, pages_per_life_cycle=66_000)
    log = mgr._tables.log
    assert log.nbytes < 1 << 20  # was 38 MB: 4 records per pool page, 2 per block row
    for i in range(20):
        commit_turn(mgr, list(range(i * 1000, i * 1000 + 300)))
    assert mgr._tables.log.nbytes < 1 << 20
    mgr.clear_reusable_blocks()  # one launch that removes every block
    introspect.check_sanity(mgr)


def test_one_eviction_that_takes_a_whole_subtree_fits_the_log(backend):
    """Many small requests share a first block that is the first victim
    (priority 0): its death removes every request's blocks in the launch of
    the one resize that evicted it, far more than that launch touches."""
    n = 1000 if backend == "cpu" else 30
    mgr = requests_sharing_a_victim(backend, n)
    shared = SHARED_VICTIM
    other = mgr.create_kv_cache()
    assert other.resume() and other.resize(16 * T)  # 15 free pages: one eviction
    assert mgr.probe_reuse(shared + [10, 5, 6, 7]) == 0
    removed = [h for e in mgr.get_latest_events() if isinstance(e.data, gpukv.KVCacheRemovedData)
               for h in e.data.block_hashes]
    assert len(removed) == n + 1
    other.close()
    introspect.check_sanity(mgr)


# ---------------------------------------------------------------------------
# resize to an absurd capacity
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("capacity", [2 * 10**7, 10**9, 2**63])
def test_resize_far_beyond_the_pool_refuses_before_allocating(backend, capacity):
    mgr = make_manager(backend, tokens_per_block=T, layers=HYBRID, pages_per_life_cycle=64)
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(3 * T)
    before = introspect.tables(mgr)["pages"].copy()
    tracemalloc.start()
    try:
        assert kv.resize(capacity) is False  # was: 420 MB taken, or NumPy's dimension error
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert kv.capacity == 3 * T and kv._q.tree.shape[0] <= 4
    assert np.array_equal(introspect.tables(mgr)["pages"], before)
    assert kv.resize(8 * T)  # still usable
    kv.close()


def test_a_sliding_window_resize_with_a_long_history_still_succeeds():
    """Only the pages outside the stale range count: a window cache may hold
    a capacity far larger than its pool."""
    mgr = make_manager("cpu", tokens_per_block=T, layers=[Attention(window=8)], pages_per_life_cycle=8)
    kv = mgr.create_kv_cache()
    assert kv.resume()
    assert kv.resize(400, 392)
    kv.close()


# ---------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------


def trace_file(tmp_path, lines, name="trace.jsonl"):
    path = tmp_path / name
    path.write_bytes(b"".join(line if isinstance(line, bytes) else (json.dumps(line) + "\n").encode() for line in lines))
    return str(path)


GOOD = {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}


def run_cli(capsys, *argv):
    code = cli_main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, err


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--time-scale", "nan"], "argument --time-scale"),  # hung for ever
        (["--time-scale", "inf"], "argument --time-scale"),
        (["--time-scale", "0"], "argument --time-scale"),
        (["--duration", "nan"], "argument --duration"),
        (["--duration", "inf"], "argument --duration"),
        (["--duration", "-5"], "argument --duration"),  # said "high - low < 0"
        (["--seed", "-1"], "argument --seed"),  # said "expected non-negative integer"
        (["match", "--seed", "-1"], "argument --seed"),
    ],
)
def test_nonsense_flags_are_named_with_exit_status_2(capsys, argv, named):
    code, err = run_cli(capsys, *argv)
    assert code == 2 and named in err


@pytest.mark.parametrize(
    "line, says",
    [
        (dict(GOOD, output_length=10**12), r"trace.jsonl:2: a request of 600 \+ 1000000000000 tokens"),
        ({"timestamp": 1, "input_length": 10**7, "output_length": 1, "hash_ids": list(range(19532))},
         r"trace.jsonl:2: a request of 10000000 \+ 1 tokens"),
        (b'{"timestamp": 1, "input_length": 600, "output_length": 4, "hash_ids": [1, 2], "x": "\xff"}\n',
         r"trace.jsonl:2: not valid UTF-8 \(byte 0xff at column 85\)"),
    ],
)
def test_a_hostile_trace_line_is_named_with_exit_status_2(capsys, tmp_path, line, says):
    path = trace_file(tmp_path, [GOOD, line])
    code, err = run_cli(capsys, "simulate", "--trace", path, "--backend", "cpu", "--no-progress")
    assert code == 2
    assert re.search(says, err), err


def test_the_workload_functions_check_their_numbers_too(tmp_path):
    from gpukv.sim import workload as workloads

    with pytest.raises(ValueError, match="duration_s must be a finite number >= 0"):
        workloads.default_workload(2, duration_s=float("nan"))
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        workloads.default_workload(2, seed=-1)
    with pytest.raises(ValueError, match="time_scale must be a positive finite number"):
        workloads.trace_workload(trace_file(tmp_path, [GOOD]), time_scale=float("nan"))


@pytest.mark.parametrize("argv, message", [
    (["--workers", "100000"], "--workers: must be at most 64"),
    (["--pages", str(10**12)], "--pages: must be at most 16,777,216"),
    (["--host-pages", str(10**12)], "--host-pages: must be at most 16,777,216"),
    (["--max-running", str(10**9)], "--max-running: must be at most 65,536"),
    (["--conversations", str(10**9)], "--conversations: must be at most 1,000,000"),
    (["match", "--pages", str(10**12)], "--pages: must be at most 16,777,216"),
    (["--kv-events", "tcp://127.0.0.1:5999", "--kv-events-wait", "inf"], "--kv-events-wait: must be a finite number"),
    (["--kv-events", "tcp://127.0.0.1:5999", "--kv-events-wait", "nan"], "--kv-events-wait: must be a finite number"),
    (["--kv-events", "tcp://127.0.0.1:5999", "--kv-events-wait", "1e308"], "--kv-events-wait: must be at most 86,400"),
    (["--kv-events", ""], "--kv-events: expected an endpoint"),
    (["compile", "--policy", "per-page", "--no-partial-reuse"], "--no-partial-reuse contradicts --policy per-page"),
])
def test_absurd_sizes_and_contradictions_on_the_command_line_are_named(argv, message, capsys):
    """Each of these once ended in a MemoryError traceback, waited forever,
    or was silently taken as something else; nothing is allocated for them."""
    assert cli_main([*argv, "--backend", "cpu"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_match_into_a_closed_pipe_exits_quietly():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(gpukv.__file__)),
                                                       os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "gpukv.cli", "match", "--json", "--backend", "cpu", "--conversations", "2",
           "--limit", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # `| head` that has read all it wanted
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=600) == 0, err
    assert err == ""


# ---------------------------------------------------------------------------
# check_sanity across calls
# ---------------------------------------------------------------------------


def test_check_sanity_called_now_and_then_knows_a_recycled_page_row(backend):
    """A page dies and a new, narrower page of the same block takes its row:
    coverage did not go down in any one page (invariant 10 holds)."""
    mgr = make_manager(backend, tokens_per_block=T, layers=[Attention()])
    a = introspect.make_test_block(mgr, [1, 2, 3, 4], [4])
    introspect.check_sanity(mgr)
    row = introspect.page_of(mgr, a, 0)[0]
    mgr._tree.page_death(row)  # the block goes with its only page ...
    b = introspect.make_test_block(mgr, [1, 2, 3, 4], [2])  # ... and comes back, narrower, in that row
    assert b.key == a.key and introspect.page_of(mgr, b, 0) == (row, 2)
    introspect.check_sanity(mgr)  # raised: invariant 10 broken, slot coverage went down

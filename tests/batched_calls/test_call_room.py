"""``core/call_room.py``: a batched call runs the rules compiled over the
caches' scalars (``plan_appends``, ``appended``, ``can_hold_each``), a
per-cache call runs the same functions as Python. Both must give the same values for any
scalars, including the edges (negative histories never occur, but a cache
may hold fewer blocks than its tokens need after a refusal, an end with no
tokens, a room of 0, windows and sinks of every size).

The calls built on them are checked end to end elsewhere (the batched
lockstep against the oracle, ``test_batched_vs_per_cache.py``); here the
two forms of the rules are compared directly, value by value.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpukv.core.call_room import (
    COMMIT_NOT_AT_SNAPSHOT,
    COMMIT_OK,
    COMMIT_PAST_CAPACITY,
    COMMIT_STOPPED,
    PLAN_ALLOCATED,
    PLAN_ANNOUNCED,
    PLAN_BLOCKS,
    PLAN_DONE,
    PLAN_ERROR,
    PLAN_FIRST,
    PLAN_GROWS,
    PLAN_RESIZING,
    PLAN_ROOM,
    PLAN_ROWS,
    PLAN_RUN,
    PLAN_SPAN,
    PLAN_WIDTH,
    TOTAL_ANNOUNCED,
    TOTAL_CALLS,
    TOTAL_ERRORS,
    TOTAL_LOG_BLOCKS,
    TOTAL_RESIZING,
    TOTAL_ROWS,
    TOTAL_SHORT_SEGMENTS,
    TOTAL_UNKNOWN_PRIORITIES,
    TOTALS_WIDTH,
    append_rules,
    appended,
    can_hold,
    can_hold_each,
    log_blocks,
    plan_appends,
)
from gpukv.core.layout import (
    BATCH_ARGS,
    BATCH_OP,
    BATCH_PATH,
    BATCH_SLOT,
    BATCH_TOKENS,
    BATCH_WIDTH,
    Q_CAPACITY,
    Q_COMMIT_STATE,
    Q_COMMITTED,
    Q_COMMITTED_BLOCKS,
    Q_HISTORY,
    Q_NUM_BLOCKS,
    Q_RESULT,
    Q_WIDTH,
    SEQ_APPEND,
    USER_STOP,
)

small = st.integers(0, 300)
holds = st.lists(st.tuples(st.sampled_from([0, 0, 3, 8, 40]), st.integers(0, 3), st.integers(0, 60)), max_size=3)
caches = st.fixed_dictionaries({
    "n0": small, "state": st.integers(0, 2), "cap": small, "h": small, "nb": st.integers(0, 80),
    "seen": st.integers(-1, 3), "count": st.integers(0, 70), "end": st.booleans(), "room": st.integers(0, 70),
})


@settings(max_examples=60, deadline=None)
@given(cases=st.lists(caches, min_size=1, max_size=12), hold=holds, T=st.sampled_from([1, 4, 16]),
       L=st.integers(1, 3), min_snapshot=st.booleans(), held=st.integers(0, 3), max_blocks=st.integers(1, 90),
       scratch=st.integers(1, 4))
def test_the_compiled_rules_give_what_the_python_rules_give(cases, hold, T, L, min_snapshot, held, max_blocks, scratch):
    """Each cache's values, the work list of those with something to do and
    the launch's totals, against ``append_rules`` run as Python per cache."""
    n = len(cases)
    S = np.zeros((n + 3, Q_WIDTH), dtype=np.int64)
    attached_at = np.full(n + 3, -7, dtype=np.int64)
    seg = np.zeros((n + 3, 2), dtype=np.int64)
    known = np.zeros(n + 3, dtype=np.int64)
    slots = np.arange(n, dtype=np.int64)[::-1] + 2  # not in order, not from 0
    for s, c in zip(slots.tolist(), cases):
        S[s, Q_COMMITTED], S[s, Q_COMMIT_STATE], S[s, Q_CAPACITY] = c["n0"], c["state"], c["cap"]
        S[s, Q_HISTORY], S[s, Q_COMMITTED_BLOCKS], S[s, Q_NUM_BLOCKS] = c["h"], c["n0"] // T, c["nb"]
        attached_at[s] = c["seen"]
        seg[s, 1], known[s] = c["nb"] + c["seen"], c["nb"] + 3 - c["seen"]
    offsets = np.concatenate([[0], np.cumsum([c["count"] for c in cases])]).astype(np.int64)
    end = np.array([c["end"] for c in cases], dtype=np.int64)
    room = np.array([c["room"] for c in cases], dtype=np.int64)
    table = np.array(hold, dtype=np.int64).reshape(-1, 3)
    out = np.full((n, PLAN_WIDTH), -99, dtype=np.int64)
    work = np.zeros((n + 1, BATCH_WIDTH), dtype=np.int64)
    totals = np.full(TOTALS_WIDTH, -99, dtype=np.int64)
    plan_appends(S, attached_at, seg, known, slots, offsets, end, room, held, T, L, min_snapshot, table, max_blocks,
                 scratch, out, work, totals)
    rows = []
    want_totals = [0] * TOTALS_WIDTH
    for i, (s, c) in enumerate(zip(slots.tolist(), cases)):
        want = [int(v) for v in append_rules(c["n0"], c["state"], c["cap"], c["h"], c["n0"] // T, c["nb"], c["seen"],
                                             c["count"], c["end"], c["room"], held, T, L, min_snapshot, tuple(hold),
                                             max_blocks, scratch)]
        assert out[i].tolist() == want, (i, c)
        want_totals[TOTAL_ERRORS] += want[PLAN_ERROR] != 0
        if want[PLAN_RUN]:
            rows.append([s, SEQ_APPEND, offsets[i], 0, want[PLAN_FIRST], c["count"], int(c["end"]), want[PLAN_ROOM]])
            want_totals[TOTAL_CALLS] += 1
            want_totals[TOTAL_ROWS] += want[PLAN_ROWS]
            want_totals[TOTAL_LOG_BLOCKS] += log_blocks(want[PLAN_SPAN], scratch, want[PLAN_ALLOCATED])
            want_totals[TOTAL_ANNOUNCED] += want[PLAN_ANNOUNCED]
            if want[PLAN_RESIZING]:
                want_totals[TOTAL_RESIZING] += 1
                want_totals[TOTAL_SHORT_SEGMENTS] += want[PLAN_BLOCKS] > seg[s, 1]
                want_totals[TOTAL_UNKNOWN_PRIORITIES] += want[PLAN_BLOCKS] > known[s]
    k = len(rows)
    columns = [BATCH_SLOT, BATCH_OP, BATCH_TOKENS, BATCH_PATH] + [BATCH_ARGS + a for a in range(4)]
    assert work[:k][:, columns].tolist() == [[int(v) for v in r] for r in rows]
    assert work[k].tolist() == [offsets[-1] if c == BATCH_TOKENS else 0 for c in range(BATCH_WIDTH)]
    assert not work[k + 1:].any() and not work[:, BATCH_ARGS + 4:].any()
    assert totals.tolist() == want_totals
    have = np.array([c["nb"] for c in cases], dtype=np.int64)
    blocks = have + room // max(T, 1)
    history = np.array([c["h"] for c in cases], dtype=np.int64)
    each = np.zeros(n, dtype=bool)
    can_hold_each(table, T, have, blocks, history, max_blocks, each)
    assert each.tolist() == [can_hold(tuple(hold), T, *v, max_blocks) for v in zip(have.tolist(), blocks.tolist(),
                                                                                   history.tolist())]


@settings(max_examples=30, deadline=None)
@given(plan_rows=st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans()), min_size=1,
                          max_size=10), seen=st.integers(-1, 5))
def test_after_the_launch_each_cache_is_done_where_its_room_is_there(plan_rows, seen):
    """``appended``: done where the plan had the room and the kernel gave it;
    the chains of the commits that grew the tree seen whole at ``seen``
    (none when -1); the count of the caches the kernel refused."""
    n = len(plan_rows)
    slots = np.arange(n, dtype=np.int64) * 2 + 1
    S = np.zeros((2 * n + 1, Q_WIDTH), dtype=np.int64)
    plan = np.zeros((n, PLAN_WIDTH), dtype=np.int64)
    for i, (run, done, grows, ok) in enumerate(plan_rows):
        plan[i, PLAN_RUN], plan[i, PLAN_DONE], plan[i, PLAN_GROWS] = run, done, grows
        S[slots[i], Q_RESULT] = ok
    attached_at = np.full(2 * n + 1, -3, dtype=np.int64)
    out = np.zeros(n, dtype=bool)
    refused = appended(S, slots, plan, attached_at, seen, out)
    assert out.tolist() == [done and ok for run, done, grows, ok in plan_rows]
    assert refused == sum(run and not ok for run, done, grows, ok in plan_rows)
    want = np.full(2 * n + 1, -3)
    for i, (run, done, grows, ok) in enumerate(plan_rows):
        if seen >= 0 and run and grows:
            want[slots[i]] = seen
    assert attached_at.tolist() == want.tolist()


def test_the_first_rule_broken_is_the_error():
    rules = dict(seen=0, held=0, T=4, L=1, min_snapshot=True, hold=(), max_blocks=100, scratch=1)

    def error(n0, state, cap, h, count):
        return append_rules(n0, state, cap, h, n0 // 4, -(-cap // 4), rules["seen"], count, False, 0, rules["held"],
                            rules["T"], rules["L"], rules["min_snapshot"], rules["hold"], rules["max_blocks"],
                            rules["scratch"])[0]

    assert error(4, 0, 8, 4, 2) == COMMIT_OK
    assert error(4, USER_STOP, 8, 4, 2) == COMMIT_STOPPED
    assert error(4, USER_STOP, 5, 0, 2) == COMMIT_STOPPED  # past the capacity and not at a snapshot too
    assert error(4, 0, 5, 0, 2) == COMMIT_PAST_CAPACITY  # not at a snapshot too
    assert error(4, 0, 8, 5, 2) == COMMIT_NOT_AT_SNAPSHOT
    assert error(4, USER_STOP, 5, 0, 0) == COMMIT_OK  # no tokens: nothing to refuse


def test_a_pool_too_small_for_the_room_refuses_only_the_room():
    # 3 blocks held, room for 2 more asked where the only pool has 1 page in all: not done, no resize, the
    # commit runs.
    r = append_rules(10, 0, 12, 10, 2, 3, 0, 1, False, 8, 0, 4, 1, False, ((0, 0, 1),), 100, 1)
    error, run, done, resizing, blocks = r[:5]
    assert (error, run, done, resizing, blocks) == (COMMIT_OK, True, False, False, 5)
    r = append_rules(10, 0, 12, 10, 2, 3, 0, 1, False, 8, 0, 4, 1, False, ((0, 0, 2),), 100, 1)
    assert r[2:5] == (True, True, 5)
    r = append_rules(10, 0, 12, 10, 2, 3, 0, 1, False, 8, 0, 4, 1, False, ((0, 0, 2),), 4, 1)  # past max_blocks
    assert r[2:5] == (False, False, 5)

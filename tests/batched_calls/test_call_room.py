"""``core/call_room.py``: a batched call runs the rules compiled over the
caches' scalars (``plan_appends``, ``can_hold_each``), a per-cache call runs
the same functions as Python. Both must give the same values for any
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
    PLAN_WIDTH,
    append_rules,
    can_hold,
    can_hold_each,
    plan_appends,
)
from gpukv.core.layout import (
    Q_CAPACITY,
    Q_COMMIT_STATE,
    Q_COMMITTED,
    Q_COMMITTED_BLOCKS,
    Q_HISTORY,
    Q_NUM_BLOCKS,
    Q_WIDTH,
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
    n = len(cases)
    S = np.zeros((n + 3, Q_WIDTH), dtype=np.int64)
    attached_at = np.full(n + 3, -7, dtype=np.int64)
    slots = np.arange(n, dtype=np.int64)[::-1] + 2  # not in order, not from 0
    for s, c in zip(slots.tolist(), cases):
        S[s, Q_COMMITTED], S[s, Q_COMMIT_STATE], S[s, Q_CAPACITY] = c["n0"], c["state"], c["cap"]
        S[s, Q_HISTORY], S[s, Q_COMMITTED_BLOCKS], S[s, Q_NUM_BLOCKS] = c["h"], c["n0"] // T, c["nb"]
        attached_at[s] = c["seen"]
    count = np.array([c["count"] for c in cases], dtype=np.int64)
    end = np.array([c["end"] for c in cases], dtype=np.int64)
    room = np.array([c["room"] for c in cases], dtype=np.int64)
    table = np.array(hold, dtype=np.int64).reshape(-1, 3)
    out = np.full((n, PLAN_WIDTH), -99, dtype=np.int64)
    plan_appends(S, attached_at, slots, count, end, room, held, T, L, min_snapshot, table, max_blocks, scratch, out)
    for i, (s, c) in enumerate(zip(slots.tolist(), cases)):
        want = append_rules(c["n0"], c["state"], c["cap"], c["h"], c["n0"] // T, c["nb"], c["seen"], c["count"],
                            c["end"], c["room"], held, T, L, min_snapshot, tuple(hold), max_blocks, scratch)
        assert out[i].tolist() == [int(v) for v in want], (i, c)
    have = np.array([c["nb"] for c in cases], dtype=np.int64)
    blocks = have + room // max(T, 1)
    history = np.array([c["h"] for c in cases], dtype=np.int64)
    each = np.zeros(n, dtype=bool)
    can_hold_each(table, T, have, blocks, history, max_blocks, each)
    assert each.tolist() == [can_hold(tuple(hold), T, *v, max_blocks) for v in zip(have.tolist(), blocks.tolist(),
                                                                                   history.tolist())]


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

"""gpukv.sim.workload: the Mooncake trace loader, hash-id expansion and the
synthetic conversation generator. Small and fast; no kernels."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gpukv.sim.workload import (
    MOONCAKE_BLOCK,
    TraceError,
    TraceRequest,
    as_flat,
    expand_tokens,
    expand_trace,
    find_mooncake_trace,
    load_mooncake_trace,
    synthetic_conversations,
)

GOOD = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}


def write_lines(tmp_path: Path, lines) -> Path:
    p = tmp_path / "trace.jsonl"
    p.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return p


# -- the real trace -----------------------------------------------------------------------
def test_real_trace_first_50_lines_load():
    path = find_mooncake_trace()
    if path is None:
        pytest.skip("the Mooncake trace is not in shared/data (set GPUKV_TRACE)")
    reqs = load_mooncake_trace(path, limit=50)
    assert len(reqs) == 50
    assert [r.line for r in reqs] == list(range(1, 51))
    first = reqs[0]
    assert (first.timestamp, first.input_length, first.output_length) == (0, 6758, 500)
    assert first.hash_ids == tuple(range(14))
    for r in reqs:
        assert MOONCAKE_BLOCK * (len(r.hash_ids) - 1) < r.input_length <= MOONCAKE_BLOCK * len(r.hash_ids)
        toks = r.tokens()
        assert toks.dtype == np.int32 and toks.size == r.input_length
    # The conversation trace starts every request with the same block.
    assert all(r.hash_ids[0] == 0 for r in reqs)
    assert np.array_equal(reqs[1].tokens()[:512], reqs[2].tokens()[:512])
    assert not np.array_equal(reqs[1].tokens()[512:1024], reqs[2].tokens()[512:1024])
    flat, offsets = expand_trace(reqs[:5])
    assert np.array_equal(flat, np.concatenate([r.tokens() for r in reqs[:5]]))
    assert offsets[-1] == sum(r.input_length for r in reqs[:5])


# -- expand_tokens --------------------------------------------------------------------------
def test_expand_tokens_is_deterministic_and_in_range():
    a = expand_tokens([3, 9, 27], 1300)
    b = expand_tokens(np.array([3, 9, 27], dtype=np.int64), 1300)
    assert a.dtype == np.int32 and a.shape == (1300,)
    assert np.array_equal(a, b)
    assert a.min() >= 0
    assert len(np.unique(a)) > 1290  # 31-bit values: no visible repetition


def test_expand_tokens_equal_ids_give_equal_blocks():
    B = MOONCAKE_BLOCK
    x = expand_tokens([5, 6, 7], 3 * B)
    y = expand_tokens([5, 6, 8], 2 * B + 10)
    z = expand_tokens([7, 5], 2 * B)
    assert np.array_equal(x[: 2 * B], y[: 2 * B])  # shared prefix ids
    assert not np.array_equal(x[2 * B:2 * B + 10], y[2 * B:])  # different id, different block
    assert np.array_equal(z[:B], x[2 * B:])  # an id's block does not depend on its position
    assert np.array_equal(z[B:], x[:B])
    # The cut keeps the leading tokens.
    assert np.array_equal(expand_tokens([5, 6, 7], 700), x[:700])
    # A salt gives another, equally consistent, token universe.
    s = expand_tokens([5, 6], 2 * B, salt=1)
    assert not np.array_equal(s[:B], x[:B])
    assert np.array_equal(s, expand_tokens([5, 6], 2 * B, salt=1))


def test_expand_tokens_many_ids_are_distinct():
    ids = np.arange(2000)
    blocks = expand_tokens(ids, ids.size * 64, hash_block=64).reshape(-1, 64)
    assert len({b.tobytes() for b in blocks}) == ids.size
    assert len({int(b[0]) for b in blocks}) == ids.size  # even the first tokens differ


def test_expand_tokens_rejects_bad_lengths():
    with pytest.raises(ValueError, match="outside"):
        expand_tokens([1, 2], 2 * MOONCAKE_BLOCK + 1)
    with pytest.raises(ValueError, match="outside"):
        expand_tokens([1], -1)
    assert expand_tokens([], 0).size == 0


# -- trace validation ----------------------------------------------------------------------
def test_loader_reads_fields_and_limit(tmp_path):
    p = write_lines(tmp_path, [GOOD, "", {**GOOD, "timestamp": 7.5, "extra": 1}, GOOD])
    reqs = load_mooncake_trace(p)
    assert [r.line for r in reqs] == [1, 3, 4]  # blank lines skipped, numbering kept
    assert reqs[1] == TraceRequest(7.5, 600, 5, (0, 1), 3)
    assert len(load_mooncake_trace(p, limit=2)) == 2
    assert load_mooncake_trace(p, limit=0) == []


@pytest.mark.parametrize(
    "bad, message",
    [
        ('{"timestamp": 0, "input_length": 600,', "malformed JSON"),
        ("[1, 2]", "JSON object"),
        ({k: v for k, v in GOOD.items() if k != "hash_ids"}, "missing field"),
        ({**GOOD, "input_length": "600"}, "input_length must be an int"),
        ({**GOOD, "input_length": 600.0}, "input_length must be an int"),
        ({**GOOD, "input_length": True}, "input_length must be an int"),
        ({**GOOD, "output_length": -1}, "output_length"),
        ({**GOOD, "timestamp": "now"}, "timestamp"),
        ({**GOOD, "hash_ids": []}, "hash_ids must be a non-empty list"),
        ({**GOOD, "hash_ids": [0, "1"]}, r"hash_ids\[1\]"),
        ({**GOOD, "hash_ids": [0, -1]}, r"hash_ids\[1\]"),
        ({**GOOD, "input_length": 512}, "disagrees"),  # fits in one block, two ids given
        ({**GOOD, "input_length": 1025}, "disagrees"),  # needs three blocks
    ],
)
def test_malformed_lines_raise_trace_error_with_line_number(tmp_path, bad, message):
    p = write_lines(tmp_path, [GOOD, GOOD, bad, GOOD])
    with pytest.raises(TraceError, match=message) as e:
        load_mooncake_trace(p)
    assert f"{p}:3:" in str(e.value)
    assert isinstance(e.value, ValueError)
    assert len(load_mooncake_trace(p, limit=2)) == 2  # lines before it still load


def test_length_rule_boundaries(tmp_path):
    p = write_lines(tmp_path, [{**GOOD, "input_length": 513}, {**GOOD, "input_length": 1024}])
    assert [r.input_length for r in load_mooncake_trace(p)] == [513, 1024]


# -- synthetic conversations -----------------------------------------------------------------
def test_synthetic_is_deterministic_given_seed():
    a = synthetic_conversations(30, seed=3)
    b = synthetic_conversations(30, seed=3)
    c = synthetic_conversations(30, seed=4)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert np.array_equal(x.tokens, y.tokens)
        assert (x.conversation, x.turn, x.kind, x.rewind, x.timestamp) == (y.conversation, y.turn, y.kind, y.rewind, y.timestamp)
    assert len(a) != len(c) or any(not np.array_equal(x.tokens, y.tokens) for x, y in zip(a, c))


def test_synthetic_structure_and_mid_block_rewinds():
    T = 32
    reqs = synthetic_conversations(60, seed=0, tokens_per_block=T)
    kinds = {r.kind for r in reqs}
    assert kinds == {"first", "follow_up", "regenerate", "edit"}
    assert [r.timestamp for r in reqs] == sorted(r.timestamp for r in reqs)
    systems = {}
    prev = {}
    p_turn = {}
    for r in reqs:
        assert r.tokens.dtype == np.int32 and r.tokens.min() >= 0
        if r.kind == "first":
            sp = r.tokens[: r.rewind]
            systems.setdefault(r.system_prompt, sp)
            assert np.array_equal(systems[r.system_prompt], sp)  # shared system prompts
        else:
            p = prev[r.conversation]
            assert r.turn > p_turn[r.conversation]
            if r.kind == "regenerate":
                assert np.array_equal(r.tokens, p)
            elif r.kind == "follow_up":
                assert r.rewind == p.size and r.tokens.size > p.size
                assert np.array_equal(r.tokens[: p.size], p)
            else:  # edit: shares exactly `rewind` tokens, rewound inside a block
                assert 0 < r.rewind < p.size and r.rewind % T != 0
                assert np.array_equal(r.tokens[: r.rewind], p[: r.rewind])
                assert r.tokens[r.rewind] != p[r.rewind]
        prev[r.conversation] = r.tokens
        p_turn[r.conversation] = r.turn
    assert len(systems) > 1
    assert sum(r.kind == "edit" for r in reqs) >= 5


def test_as_flat_round_trips():
    seqs = [np.arange(5, dtype=np.int32), np.zeros(0, np.int32), np.arange(3, dtype=np.int32) + 9]
    flat, offsets = as_flat(seqs)
    assert flat.dtype == np.int32 and offsets.dtype == np.int64
    assert offsets.tolist() == [0, 5, 5, 8]
    assert [flat[offsets[i]:offsets[i + 1]].tolist() for i in range(3)] == [s.tolist() for s in seqs]

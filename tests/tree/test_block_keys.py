"""Block keys: the reference SHA-256 chain on the host (D12) and in kernels.

Expected values are computed with hashlib directly from the byte layout in
docs/semantics.md §1.2, never with the code under test.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest

from gpukv.core import backend
from gpukv.core.hashing import (
    Hasher,
    block_key,
    gen_multimodal_cache_key_tokens,
    root_key,
    sequence_to_blockchain_keys,
)
from gpukv.core.layout import SHA256_WORK_WORDS
from gpukv.kernels.sha256 import (
    build_sha256_kernel,
    digest_to_int64x4,
    int64x4_to_digest,
)
from gpukv.core.scope import ReuseScope, as_scope


def sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def enc(tokens) -> bytes:
    """The reference encoding, written out independently of gpukv.core.hashing."""
    return b"".join(t if isinstance(t, bytes) else t.to_bytes(4, "little") for t in tokens)


def rand_digest(rng: random.Random) -> bytes:
    return bytes(rng.getrandbits(8) for _ in range(32))


# --- D12 -------------------------------------------------------------------


@pytest.mark.parametrize("length", [0, 1, 7, 32, 33, 257])
def test_d12_hasher_equals_sha256_of_seed_and_int_tokens(length):
    rng = random.Random(length)
    seed = rand_digest(rng)
    block = [rng.randrange(2**31) for _ in range(length)]
    block[:1] = [2**31 - 1] * min(1, length)  # the largest id encodes too
    expected = sha(seed + b"".join(t.to_bytes(4, "little") for t in block))
    assert Hasher(seed).update(block).digest() == expected


def test_d12_hasher_mixed_digests_and_ints():
    rng = random.Random(12)
    seed = rand_digest(rng)
    d1, d2 = rand_digest(rng), rand_digest(rng)
    block = [d1, 5, 6, d2, d2, 0, 2**31 - 1]
    expected = sha(seed + d1 + (5).to_bytes(4, "little") + (6).to_bytes(4, "little")
                   + d2 + d2 + bytes(4) + b"\xff\xff\xff\x7f")
    assert Hasher(seed).update(block).digest() == expected
    # Updating in pieces hashes the concatenation.
    assert Hasher(seed).update(block[:3]).update(block[3:]).digest() == expected


@pytest.mark.parametrize("size", [31, 33])
def test_d12_multimodal_digest_of_wrong_size_is_rejected(size):
    with pytest.raises(ValueError, match="32 bytes"):
        gen_multimodal_cache_key_tokens(1000, b"\x01" * size, 4)


def test_d12_root_keys_differ_per_scope():
    scopes = [ReuseScope(), ReuseScope(lora_id=123), ReuseScope(salt=123),
              ReuseScope(123, 456), ReuseScope(456, 123)]
    keys = [root_key(s) for s in scopes]
    assert len(set(keys)) == len(scopes)
    assert keys[0] == sha(b"\x00") == root_key(None)


# --- ReuseScope ------------------------------------------------------------


def test_scope_byte_layout():
    assert ReuseScope().to_bytes() == b"\x00"
    assert ReuseScope(lora_id=7).to_bytes() == b"\x01" + (7).to_bytes(8, "little")
    assert ReuseScope(salt=11).to_bytes() == b"\x02" + (11).to_bytes(8, "little")
    assert ReuseScope(lora_id=7, salt=11).to_bytes() == (
        b"\x03" + (7).to_bytes(8, "little") + (11).to_bytes(8, "little")
    )
    assert ReuseScope(salt=2**64 - 1).to_bytes() == b"\x02" + b"\xff" * 8
    assert root_key(ReuseScope(1, 2)) == sha(ReuseScope(1, 2).to_bytes())


def test_scope_is_a_hashable_value():
    assert ReuseScope(1, 2) == ReuseScope(lora_id=1, salt=2)
    assert len({ReuseScope(1, 2), ReuseScope(1, 2), ReuseScope(2, 1)}) == 2
    with pytest.raises(AttributeError):
        ReuseScope().salt = 3  # frozen


@pytest.mark.parametrize(
    "kwargs, exc, field",
    [
        ({"lora_id": -1}, ValueError, "lora_id"),
        ({"salt": 2**64}, ValueError, "salt"),
        ({"salt": True}, TypeError, "salt"),
        ({"lora_id": 1.0}, TypeError, "lora_id"),
        ({"lora_id": "7"}, TypeError, "lora_id"),
    ],
)
def test_scope_rejects_bad_fields(kwargs, exc, field):
    with pytest.raises(exc, match=field):
        ReuseScope(**kwargs)


def test_as_scope():
    assert as_scope(None) == ReuseScope()
    s = ReuseScope(salt=3)
    assert as_scope(s) is s
    with pytest.raises(TypeError, match="scope must be a gpukv.ReuseScope or None"):
        as_scope((1, 2))


# --- multimodal key tokens -------------------------------------------------


def test_multimodal_tokens_digest_only_at_item_position_zero():
    d = bytes(range(32))
    assert gen_multimodal_cache_key_tokens(1000, d, 4) == [d, 1001, 1002, 1003]
    # A continuation of the same item (token_offset > 0) carries no digest.
    assert gen_multimodal_cache_key_tokens(1000, d, 3, token_offset=2) == [1002, 1003, 1004]
    assert gen_multimodal_cache_key_tokens(1000, d, 1) == [d]


@pytest.mark.parametrize("num_tokens, token_offset", [(0, 0), (-1, 0), (3, -1)])
def test_multimodal_tokens_bad_counts(num_tokens, token_offset):
    with pytest.raises(ValueError):
        gen_multimodal_cache_key_tokens(1000, bytes(32), num_tokens, token_offset)


# --- the chain ---------------------------------------------------------------


def test_sequence_chunks_and_keys():
    scope = ReuseScope(lora_id=5)
    tokens = list(range(100, 110))
    pairs = list(sequence_to_blockchain_keys(4, scope, tokens))
    assert [chunk for chunk, _ in pairs] == [[], tokens[0:4], tokens[4:8], tokens[8:10]]
    key = sha(b"\x01" + (5).to_bytes(8, "little"))
    assert pairs[0][1] == key
    for chunk, got in pairs[1:]:
        key = sha(key + enc(chunk))
        assert got == key
    # block_key is one link of the same chain.
    assert block_key(pairs[1][1], tokens[4:8]) == pairs[2][1]


def test_sequence_with_multimodal_tokens_and_numpy_ids():
    d = bytes(range(1, 33))
    tokens = [7, 8] + gen_multimodal_cache_key_tokens(50_000, d, 3) + [9]
    pairs = list(sequence_to_blockchain_keys(2, None, [0] + tokens))
    assert [c for c, _ in pairs][1:] == [[0, 7], [8, d], [50_001, 50_002], [9]]
    assert pairs[2][1] == sha(pairs[1][1] + (8).to_bytes(4, "little") + d)
    # NumPy integer ids hash like the same Python ints.
    ids = np.arange(6, dtype=np.int32)
    assert list(sequence_to_blockchain_keys(4, None, ids)) == list(
        sequence_to_blockchain_keys(4, None, list(range(6)))
    )


def test_empty_sequence_yields_only_the_root():
    assert list(sequence_to_blockchain_keys(4, None, [])) == [([], sha(b"\x00"))]


@pytest.mark.parametrize(
    "bad, exc",
    [(-1, ValueError), (2**31, ValueError), (True, TypeError), (1.0, TypeError),
     ("a", TypeError), (b"\x00" * 31, ValueError), (b"\x00" * 33, ValueError)],
)
def test_bad_token_is_rejected_at_call_naming_its_position(bad, exc):
    tokens = [1, 2, 3, 4, 5, bad, 7]
    with pytest.raises(exc, match="position 5"):
        sequence_to_blockchain_keys(4, None, tokens)  # raises before any next()
    with pytest.raises(exc, match="position 5"):
        Hasher(b"").update(tokens)
    with pytest.raises(exc, match="position 5"):
        block_key(bytes(32), tokens)


@pytest.mark.parametrize("T, exc", [(0, ValueError), (-4, ValueError), (2.0, TypeError),
                                    (True, TypeError)])
def test_bad_tokens_per_block(T, exc):
    with pytest.raises(exc, match="tokens_per_block"):
        sequence_to_blockchain_keys(T, None, [1, 2])


def test_bad_scope_type():
    with pytest.raises(TypeError, match="scope"):
        sequence_to_blockchain_keys(4, (1, 2), [1, 2])


# --- the kernel ----------------------------------------------------------------


def test_digest_int64x4_round_trip():
    d = bytes(range(200, 232))
    a = digest_to_int64x4(d)
    assert a.dtype == np.int64 and a.shape == (4,)
    assert a.view(np.uint8).tobytes() == d  # memory order on a little-endian host
    assert int64x4_to_digest(a) == d
    with pytest.raises(ValueError):
        digest_to_int64x4(d[:31])


def random_blocks(seed: int, lengths: list[int], T: int, k: int):
    """Kernel inputs for blocks of the given lengths (about 1 in 8 tokens a
    multimodal digest), plus the expected keys from hashlib."""
    rng = np.random.default_rng(seed)
    B = len(lengths)
    mm = rng.integers(0, 256, (k, 32), dtype=np.uint8)
    tokens = rng.integers(0, 2**31, (B, T), dtype=np.int64).astype(np.int32)
    tokens[:, 0] = 2**31 - 1  # the largest id
    is_mm = rng.random((B, T)) < 0.125
    tokens[is_mm] = -rng.integers(1, k + 1, int(is_mm.sum()))
    parents = rng.integers(-(2**63), 2**63 - 1, (B, 4), dtype=np.int64, endpoint=True)
    expected = []
    for i, n in enumerate(lengths):
        block = [bytes(mm[-t - 1]) if t < 0 else int(t) for t in tokens[i, :n]]
        expected.append(sha(parents[i].astype("<i8").tobytes() + enc(block)))
    return parents, tokens, np.array(lengths, np.int32), mm, expected


def run_kernel(target, parents, tokens, lengths, mm):
    out = np.zeros((len(lengths), 4), np.int64)
    build_sha256_kernel(target)(parents, tokens, lengths, mm, out)
    return [int64x4_to_digest(row) for row in out]


def test_work_words_constant():
    assert SHA256_WORK_WORDS == 24  # 8 state words + a 16-word message block


def test_cpu_kernel_matches_hashlib_for_every_length():
    # 32 + 4n bytes crosses each padding case: n = 6, 7 (mod 16) need an extra
    # block for the length, n = 8 fills a block exactly; digests shift it further.
    T = 40
    lengths = list(range(1, T + 1)) * 2
    parents, tokens, lengths, mm, expected = random_blocks(1, lengths, T, k=3)
    assert run_kernel("cpu", parents, tokens, lengths, mm) == expected


def test_cpu_kernel_chains_like_sequence_to_blockchain_keys():
    T = 4
    d = bytes(range(32))
    seq = [1, 2, 3] + gen_multimodal_cache_key_tokens(1000, d, 6) + [4, 5]
    keys = [key for _, key in sequence_to_blockchain_keys(T, ReuseScope(salt=9), seq)]
    mm = np.frombuffer(d, np.uint8).reshape(1, 32)
    # The device form of the sequence: the digest becomes token -1 (row 0 of mm).
    dev = np.array([-1 if isinstance(t, bytes) else t for t in seq], np.int32)
    parent = digest_to_int64x4(keys[0])[None, :]
    kernel = build_sha256_kernel("cpu")
    for b, start in enumerate(range(0, len(seq), T)):
        chunk = dev[start:start + T]
        tokens = np.zeros((1, T), np.int32)
        tokens[0, :len(chunk)] = chunk
        out = np.zeros((1, 4), np.int64)
        kernel(parent, tokens, np.array([len(chunk)], np.int32), mm, out)
        assert int64x4_to_digest(out[0]) == keys[b + 1]
        parent = out


def test_cpu_kernel_without_multimodal_digests_and_empty_batch():
    parents, tokens, lengths, _, expected = random_blocks(2, [1, 8, 16], 16, k=1)
    tokens[tokens < 0] = 42
    expected = [sha(parents[i].astype("<i8").tobytes() + enc(tokens[i, :n].tolist()))
                for i, n in enumerate(lengths)]
    no_mm = np.zeros((0, 32), np.uint8)
    assert run_kernel("cpu", parents, tokens, lengths, no_mm) == expected
    assert run_kernel("cpu", parents[:0], tokens[:0], lengths[:0], no_mm) == []


def test_kernel_rejects_wrong_dtypes():
    parents, tokens, lengths, mm, _ = random_blocks(3, [1], 4, k=1)
    out = np.zeros((1, 4), np.int64)
    with pytest.raises(TypeError, match="tokens"):
        build_sha256_kernel("cpu")(parents, tokens.astype(np.int64), lengths, mm, out)


@pytest.mark.cudasim
@pytest.mark.skipif(not backend.simulator_enabled(), reason="needs NUMBA_ENABLE_CUDASIM=1")
def test_cuda_kernel_in_simulator_matches_hashlib():
    backend.quiet_simulator()
    T = 16
    lengths = [1, 6, 7, 8, 14, 16]  # the padding cases, see the cpu test
    parents, tokens, lengths, mm, expected = random_blocks(4, lengths, T, k=2)
    assert run_kernel("cuda", parents, tokens, lengths, mm) == expected

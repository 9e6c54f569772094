"""SHA-256 of a block key inside kernels.

New tree blocks need the reference-compatible key ``SHA256(parent key ||
encoded tokens)`` (``gpukv.hashing``). Computing it where the block is created
saves a host round trip per commit.

Why the message is streamed in 32-bit words: every input item is a multiple of
4 bytes (the 32-byte parent digest, 4-byte int tokens, 32-byte multimodal
digests), so the message never has a partial word and each token costs one
byte swap and one store. The 64-byte message block lives in ``work[8:24]`` as
16 big-endian words; the message schedule is rolled over those same 16 words,
so the whole state is ``SHA256_WORK_WORDS`` uint32 words of caller scratch
(device code cannot allocate).

Arithmetic is done on int64 values masked to 32 bits, never on uint32/uint64:
Numba widens uint32 sums to uint64 and mixes uint64 with int64 into float64,
while the simulator computes on NumPy scalars. Masked int64 behaves the same in
``njit``, ``cuda.jit`` and the simulator, and every shift is arranged so no
intermediate exceeds 64 bits.

Digests cross the host/device boundary as int64[4]: the 32 digest bytes in
memory order (little-endian host), which fits the int64 device tables.
"""

from __future__ import annotations

import functools

import numpy as np

from ..core.backend import bind_globals, launch_stream
from ..core.layout import SHA256_WORK_WORDS
from .link import helper, link

__all__ = [
    "build_sha256_kernel",
    "digest_to_int64x4",
    "int64x4_to_digest",
]

_STATE = 0
_MSG = 8

M32 = 0xFFFFFFFF

_H0 = np.array(
    [0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A,
     0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19],
    dtype=np.int64,
)
# Round constants (FIPS 180-4 §4.2.2), int64 so reads need no cast.
_K = np.array(
    [0x428A2F98, 0x71374491, 0xB5C0FBCF, 0xE9B5DBA5, 0x3956C25B, 0x59F111F1, 0x923F82A4, 0xAB1C5ED5,
     0xD807AA98, 0x12835B01, 0x243185BE, 0x550C7DC3, 0x72BE5D74, 0x80DEB1FE, 0x9BDC06A7, 0xC19BF174,
     0xE49B69C1, 0xEFBE4786, 0x0FC19DC6, 0x240CA1CC, 0x2DE92C6F, 0x4A7484AA, 0x5CB0A9DC, 0x76F988DA,
     0x983E5152, 0xA831C66D, 0xB00327C8, 0xBF597FC7, 0xC6E00BF3, 0xD5A79147, 0x06CA6351, 0x14292967,
     0x27B70A85, 0x2E1B2138, 0x4D2C6DFC, 0x53380D13, 0x650A7354, 0x766A0ABB, 0x81C2C92E, 0x92722C85,
     0xA2BFE8A1, 0xA81A664B, 0xC24B8B70, 0xC76C51A3, 0xD192E819, 0xD6990624, 0xF40E3585, 0x106AA070,
     0x19A4C116, 0x1E376C08, 0x2748774C, 0x34B0BCB5, 0x391C0CB3, 0x4ED8AA4A, 0x5B9CCA4F, 0x682E6FF3,
     0x748F82EE, 0x78A5636F, 0x84C87814, 0x8CC70208, 0x90BEFFFA, 0xA4506CEB, 0xBEF9A3F7, 0xC67178F2],
    dtype=np.int64,
)


@helper
def rotr(x, n):
    # x < 2**32; the low n bits move to the top without a 64-bit overflow.
    return (x >> n) | ((x & ((1 << n) - 1)) << (32 - n))


@helper
def bswap32(x):
    return (
        ((x & 0xFF) << 24) | ((x & 0xFF00) << 8) | ((x >> 8) & 0xFF00) | ((x >> 24) & 0xFF)
    )


@helper
def compress(work):
    """Fold the 16 message words in ``work[8:24]`` into the state ``work[0:8]``.

    The schedule overwrites the message words in place: W[t] only needs
    W[t-2], W[t-7], W[t-15] and W[t-16], all within the last 16.
    """
    a = np.int64(work[0])
    b = np.int64(work[1])
    c = np.int64(work[2])
    d = np.int64(work[3])
    e = np.int64(work[4])
    f = np.int64(work[5])
    g = np.int64(work[6])
    h = np.int64(work[7])
    for t in range(64):
        if t < 16:
            w = np.int64(work[_MSG + t])
        else:
            w15 = np.int64(work[_MSG + ((t - 15) & 15)])
            w2 = np.int64(work[_MSG + ((t - 2) & 15)])
            s0 = rotr(w15, 7) ^ rotr(w15, 18) ^ (w15 >> 3)
            s1 = rotr(w2, 17) ^ rotr(w2, 19) ^ (w2 >> 10)
            w = (
                np.int64(work[_MSG + (t & 15)]) + s0 + np.int64(work[_MSG + ((t - 7) & 15)]) + s1
            ) & M32
            work[_MSG + (t & 15)] = w
        big_s1 = rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)
        ch = (e & f) ^ ((e ^ M32) & g)
        t1 = (h + big_s1 + ch + _K[t] + w) & M32
        big_s0 = rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)
        maj = (a & b) ^ (a & c) ^ (b & c)
        t2 = (big_s0 + maj) & M32
        h = g
        g = f
        f = e
        e = (d + t1) & M32
        d = c
        c = b
        b = a
        a = (t1 + t2) & M32
    work[0] = (np.int64(work[0]) + a) & M32
    work[1] = (np.int64(work[1]) + b) & M32
    work[2] = (np.int64(work[2]) + c) & M32
    work[3] = (np.int64(work[3]) + d) & M32
    work[4] = (np.int64(work[4]) + e) & M32
    work[5] = (np.int64(work[5]) + f) & M32
    work[6] = (np.int64(work[6]) + g) & M32
    work[7] = (np.int64(work[7]) + h) & M32


@helper
def message_words(tokens, n):
    """Words in the unpadded message: 8 for the parent, 1 per int token, 8 per digest."""
    nwords = 8
    for i in range(n):
        nwords += 1 if tokens[i] >= 0 else 8
    return nwords


@helper
def chain_digest(parent_digest, tokens, n, mm_digests, out, work):
    """``out`` = SHA256(parent digest || enc(tokens[0:n])) as int64[4].

    A token ``t >= 0`` is 4 little-endian bytes; ``t < 0`` stands for the
    32 bytes of ``mm_digests[-t - 1]``. ``work`` holds ``SHA256_WORK_WORDS``
    uint32 words of scratch.
    """
    for j in range(8):
        work[_STATE + j] = _H0[j]
    nwords = message_words(tokens, n)
    # Padding: the 0x80 byte (a whole word, as the message is word aligned),
    # zeros, and the bit length as a big-endian u64 in the last two words.
    total = (nwords + 3 + 15) // 16 * 16
    nbits = np.int64(nwords) * 32
    # One loop produces every message word, so compress() has a single call
    # site (it is inlined; five sites made compiling five times slower).
    i = 0  # current token
    j = 0  # next word of the current multimodal digest
    for k in range(total):
        if k < 8:
            # int64 word k>>1 holds digest bytes 8(k>>1)..; its low half comes first.
            w = bswap32((np.int64(parent_digest[k >> 1]) >> (32 * (k & 1))) & M32)
        elif k < nwords:
            t = np.int64(tokens[i])
            if t >= 0:
                w = bswap32(t)
                i += 1
            else:
                r = -t - 1
                w = (
                    (np.int64(mm_digests[r, 4 * j]) << 24)
                    | (np.int64(mm_digests[r, 4 * j + 1]) << 16)
                    | (np.int64(mm_digests[r, 4 * j + 2]) << 8)
                    | np.int64(mm_digests[r, 4 * j + 3])
                )
                j += 1
                if j == 8:
                    j = 0
                    i += 1
        elif k == nwords:
            w = np.int64(0x80000000)
        elif k == total - 2:
            w = (nbits >> 32) & M32
        elif k == total - 1:
            w = nbits & M32
        else:
            w = np.int64(0)
        work[_MSG + (k & 15)] = w
        if (k & 15) == 15:
            compress(work)
    # State words are big-endian digest words; out[k] packs digest bytes
    # 8k..8k+7 little-endian, i.e. two byte-swapped words, low first.
    for k in range(4):
        lo = bswap32(np.int64(work[_STATE + 2 * k]))
        hi = bswap32(np.int64(work[_STATE + 2 * k + 1]))
        if hi >= 0x80000000:
            hi -= 0x100000000  # reinterpret as signed so the int64 store cannot overflow
        out[k] = (hi << 32) | lo


@functools.lru_cache(maxsize=None)
def build_sha256_kernel(target: str):
    """A callable ``(parent_digests int64[B,4], tokens int32[B,T], lengths int32[B],
    mm_digests uint8[k,32], out int64[B,4]) -> None`` digesting B blocks at once.

    Row i of ``out`` becomes the key of block ``tokens[i, :lengths[i]]`` under
    ``parent_digests[i]``. Negative tokens must name existing ``mm_digests`` rows;
    lengths above T are clamped to T. Arrays live where ``target`` computes
    (NumPy for ``cpu`` and the simulator, CuPy or device arrays for ``cuda``).
    """
    chain_digest = link(target).chain_digest

    if target == "cpu":
        from numba import njit, prange

        # Helpers reach the kernel as globals, not closure cells: Numba keys its
        # disk cache on pickled closure cells, and a pickled dispatcher carries a
        # fresh random uuid per process, so a closure over one never hits the cache.
        kernel = njit(parallel=True, cache=True)(
            bind_globals(_cpu_digest_blocks, chain_digest=chain_digest, prange=prange)
        )
    elif target == "cuda":
        from numba import cuda

        # As globals too: the simulator swaps in its fake ``cuda`` module only
        # where a kernel's globals name the real one.
        cuda_kernel = cuda.jit(
            bind_globals(_cuda_digest_blocks, chain_digest=chain_digest, cuda=cuda)
        )
        threads = 128

        def kernel(parents, tokens, lengths, mm, out):
            blocks = (tokens.shape[0] + threads - 1) // threads
            cuda_kernel[blocks, threads, launch_stream()](parents, tokens, lengths, mm, out)
    else:
        raise ValueError(f"unknown kernel target {target!r}")

    def run(parent_digests, tokens, lengths, mm_digests, out):
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be 2-D [B, T], got shape {tokens.shape}")
        nblocks = tokens.shape[0]
        if parent_digests.shape != (nblocks, 4) or out.shape != (nblocks, 4):
            raise ValueError("expected parent_digests[B,4], tokens[B,T] and out[B,4]")
        if lengths.shape != (nblocks,) or mm_digests.ndim != 2 or mm_digests.shape[1] != 32:
            raise ValueError("expected lengths[B] and mm_digests[k,32]")
        for name, a, dtype in (("parent_digests", parent_digests, np.int64), ("tokens", tokens, np.int32),
                               ("lengths", lengths, np.int32), ("mm_digests", mm_digests, np.uint8),
                               ("out", out, np.int64)):
            if a.dtype != dtype:
                raise TypeError(f"{name} must be {np.dtype(dtype).name}, got {a.dtype}")
        if nblocks == 0:
            return
        if mm_digests.shape[0] == 0:
            # A zero-sized array is awkward to pass to a kernel; nothing reads it anyway.
            mm_digests = _ZERO_MM if target == "cpu" else _like(mm_digests, _ZERO_MM)
        kernel(parent_digests, tokens, lengths, mm_digests, out)

    return run


def _cpu_digest_blocks(parents, tokens, lengths, mm, out):
    # Compiled by build_sha256_kernel("cpu") with chain_digest and prange bound.
    nblocks, width = tokens.shape
    work = np.empty((nblocks, SHA256_WORK_WORDS), np.uint32)
    for i in prange(nblocks):  # noqa: F821 (bound by bind_globals)
        n = min(np.int64(lengths[i]), width)
        chain_digest(parents[i], tokens[i], n, mm, out[i], work[i])  # noqa: F821


def _cuda_digest_blocks(parents, tokens, lengths, mm, out):
    # Compiled by build_sha256_kernel("cuda") with chain_digest and cuda bound.
    i = cuda.grid(1)  # noqa: F821
    if i < tokens.shape[0]:
        work = cuda.local.array(SHA256_WORK_WORDS, np.uint32)  # noqa: F821
        n = min(np.int64(lengths[i]), tokens.shape[1])
        chain_digest(parents[i], tokens[i], n, mm, out[i], work)  # noqa: F821


_ZERO_MM = np.zeros((1, 32), np.uint8)


def _like(ref, host):
    """``host`` copied to the device when ``ref`` is a device array."""
    if isinstance(ref, np.ndarray):
        return host
    from numba import cuda

    return cuda.to_device(host)


def digest_to_int64x4(digest: bytes) -> np.ndarray:
    """32 digest bytes -> int64[4] holding them in memory order."""
    if len(digest) != 32:
        raise ValueError(f"a digest is 32 bytes, got {len(digest)}")
    return np.frombuffer(bytes(digest), dtype="<i8").astype(np.int64)


def int64x4_to_digest(arr) -> bytes:
    """int64[4] (as stored in device tables) -> the 32 digest bytes."""
    a = np.asarray(arr)
    if a.shape != (4,):
        raise ValueError(f"expected an int64[4] digest, got shape {a.shape}")
    return a.astype("<i8").tobytes()

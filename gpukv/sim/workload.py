"""Workloads for benchmarks and simulations: the Mooncake trace and a
synthetic multi-turn chat generator.

The Mooncake conversation trace (``load_mooncake_trace``) carries no tokens,
only per-request lists of prefix-block hash ids with a block size of 512
tokens. ``expand_tokens`` turns such a list into a deterministic token
sequence: every hash id becomes the same 512 tokens wherever it appears, so
two requests share exactly the token prefix their hash ids share.

``synthetic_conversations`` generates a workload with the reuse patterns a
chat front end produces (shared system prompts, follow-up turns, regenerations,
edits that rewind a conversation into the middle of a block) when no trace is
at hand.

``default_workload`` and ``trace_workload`` turn either into what ``gpukv
simulate`` replays: ``Request``s with their output tokens and the order of a
conversation's turns.

Token ids are in ``0..2**31-1`` (gpukv's token range); all generation is
vectorized NumPy, one call per block or segment, never one per token.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

MOONCAKE_BLOCK = 512  # tokens per hash id in the Mooncake traces

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


class TraceError(ValueError):
    """A trace line that cannot be a request; the message names file and line."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a Mooncake trace.

    ``timestamp`` is the arrival time in ms; ``hash_ids`` are the prefix block
    ids (512 tokens each, the last block usually partial); ``line`` is the
    1-based line number in the file."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple
    line: int

    def tokens(self, hash_block: int = MOONCAKE_BLOCK, salt: int = 0) -> np.ndarray:
        """The request's prompt as an int32 token array (see ``expand_tokens``)."""
        return expand_tokens(self.hash_ids, self.input_length, hash_block, salt)


# -- the Mooncake trace ----------------------------------------------------------------
MOONCAKE_TRACE_NAME = "mooncake_conversation_trace.jsonl"


def find_mooncake_trace() -> Path | None:
    """The trace ``$GPUKV_TRACE`` names (the benchmarks' and ``gpukv simulate
    --trace``'s default); None when it is not set."""
    env = os.environ.get("GPUKV_TRACE")
    return Path(env) if env else None


_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def load_mooncake_trace(path: str | PathLike, limit: int | None = None,
                        hash_block: int = MOONCAKE_BLOCK) -> list[TraceRequest]:
    """The requests of a Mooncake JSONL trace, in file order.

    Each non-blank line must be a JSON object with ``timestamp`` (a
    non-negative number, ms), ``input_length`` (int >= 1), ``output_length``
    (int >= 0) and ``hash_ids`` (a non-empty list of non-negative ints) whose
    length agrees with ``input_length``: ``hash_block * (len(hash_ids) - 1) <
    input_length <= hash_block * len(hash_ids)`` (every line of the shipped
    conversation trace satisfies this exactly). Extra fields are ignored;
    blank lines are skipped. ``limit``: read at most that many requests.

    Raises ``TraceError`` naming the file and line number of the first bad line.
    """
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
        raise ValueError(f"limit must be None or an int >= 0, got {limit!r}")
    out: list[TraceRequest] = []
    if limit == 0:
        return out
    with open(path, "rb") as f:  # decoded line by line, so a bad byte is reported with its line
        for lineno, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                where = f"byte 0x{raw[e.start]:02x} at column {e.start + 1}"
                raise TraceError(f"{path}:{lineno}: not valid UTF-8 ({where})") from None
            if not text.strip():
                continue
            out.append(_parse_line(text, path, lineno, hash_block))
            if limit is not None and len(out) >= limit:
                break
    return out


def _parse_line(text: str, path, lineno: int, hash_block: int) -> TraceRequest:
    def bad(msg):
        return TraceError(f"{path}:{lineno}: {msg}")

    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad(f"malformed JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(d, dict):
        raise bad(f"expected a JSON object, got {type(d).__name__}")
    missing = [k for k in _FIELDS if k not in d]
    if missing:
        raise bad(f"missing field(s) {', '.join(missing)}")

    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    ts = d["timestamp"]
    if not (is_int(ts) or isinstance(ts, float)) or not math.isfinite(ts) or ts < 0:
        raise bad(f"timestamp must be a non-negative number, got {ts!r}")
    n_in, n_out, ids = d["input_length"], d["output_length"], d["hash_ids"]
    if not is_int(n_in) or n_in < 1:
        raise bad(f"input_length must be an int >= 1, got {n_in!r}")
    if not is_int(n_out) or n_out < 0:
        raise bad(f"output_length must be an int >= 0, got {n_out!r}")
    if not isinstance(ids, list) or not ids:
        raise bad(f"hash_ids must be a non-empty list of ints, got {ids!r}")
    for k, h in enumerate(ids):
        if not is_int(h) or h < 0 or h >= 2**63:
            raise bad(f"hash_ids[{k}] must be an int in 0..2**63-1, got {h!r}")
    lo, hi = hash_block * (len(ids) - 1), hash_block * len(ids)
    if not lo < n_in <= hi:
        raise bad(
            f"input_length {n_in} disagrees with {len(ids)} hash ids of {hash_block} tokens "
            f"(must be in {lo + 1}..{hi})"
        )
    return TraceRequest(float(ts) if isinstance(ts, float) else ts, n_in, n_out, tuple(ids), lineno)


# -- tokens from hash ids ---------------------------------------------------------------
def _mix64(z: np.ndarray) -> np.ndarray:
    """The SplitMix64 finalizer (a bijection of uint64), elementwise."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _expand_ids(ids: np.ndarray, hash_block: int, salt: int) -> np.ndarray:
    """``[len(ids), hash_block]`` uint64 -> token ids in 0..2**31-1 (int32)."""
    seeds = _mix64(ids.astype(np.uint64) + np.uint64(salt % 2**64) * _GOLDEN)  # per id stream
    pos = (np.arange(1, hash_block + 1, dtype=np.uint64) * _GOLDEN)[None, :]
    z = _mix64(seeds[:, None] + pos)
    return (z >> np.uint64(33)).astype(np.int32)  # the top 31 bits


def expand_tokens(hash_ids: Sequence[int] | np.ndarray, input_length: int,
                  hash_block: int = MOONCAKE_BLOCK, salt: int = 0) -> np.ndarray:
    """The token sequence of a request given as block hash ids.

    Hash id ``h`` expands to ``hash_block`` token ids that depend only on ``h``
    (and ``salt``): ``mix(mix(h + salt*phi) + (j+1)*phi) >> 33`` for position
    ``j``, with ``mix`` the SplitMix64 finalizer, so equal ids give equal blocks
    and different ids give different blocks except with probability about
    ``2**-(31*hash_block)``. The result is cut to ``input_length`` tokens
    (int32, values in ``0..2**31-1``). Vectorized: no Python loop per token.
    """
    ids = np.asarray(hash_ids)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise TypeError("hash_ids must be a 1-D sequence of ints")
    if not isinstance(hash_block, (int, np.integer)) or hash_block < 1:
        raise ValueError(f"hash_block must be an int >= 1, got {hash_block!r}")
    n = int(input_length)
    if not 0 <= n <= hash_block * ids.size:
        raise ValueError(f"input_length {n} is outside 0..{hash_block * ids.size} ({ids.size} hash ids)")
    need = -(-n // hash_block)
    return _expand_ids(ids[:need].astype(np.int64), hash_block, salt).reshape(-1)[:n]


def expand_trace(requests: Iterable[TraceRequest], hash_block: int = MOONCAKE_BLOCK,
                 salt: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Many trace requests as ``(flat int32 tokens, int64 offsets of length B+1)``
    (the ``(flat, offsets)`` input of ``KVCacheManager.match_batch``)."""
    # Recomputing a block's tokens is cheaper than gathering it from a table of
    # distinct ids (that table would not fit in cache), so expand per request.
    return as_flat([r.tokens(hash_block, salt) for r in requests])


# -- synthetic conversations --------------------------------------------------------------
@dataclass(frozen=True)
class SyntheticRequest:
    """One request of a synthetic workload.

    ``kind``: ``"first"`` (system prompt + first user message), ``"follow_up"``
    (the previous request + its reply + a new user message), ``"regenerate"``
    (the previous request again, token for token) or ``"edit"`` (the
    conversation rewound into an earlier user message, at ``rewind`` tokens,
    followed by new text). ``rewind`` is the length of the prefix this request
    shares by construction with the conversation's previous request (for
    ``edit``: the rewind point, never a multiple of ``tokens_per_block``; for
    ``follow_up``/``regenerate``: the previous request's length; for ``first``:
    the shared system prompt's length)."""

    tokens: np.ndarray
    conversation: int
    turn: int
    kind: str
    rewind: int
    timestamp: float
    system_prompt: int


KINDS = ("first", "follow_up", "regenerate", "edit")


def synthetic_conversations(
    num_conversations: int,
    seed: int = 0,
    *,
    num_system_prompts: int = 4,
    system_prompt_tokens: tuple[int, int] = (300, 2500),
    turns: tuple[int, int] = (1, 8),
    user_tokens: tuple[int, int] = (10, 400),
    reply_tokens: tuple[int, int] = (20, 600),
    p_regenerate: float = 0.1,
    p_edit: float = 0.15,
    tokens_per_block: int = 32,
    vocab_size: int = 32000,
    duration_s: float = 600.0,
    think_time_s: float = 20.0,
) -> list[SyntheticRequest]:
    """A deterministic multi-turn chat workload, in arrival order.

    Each conversation starts with one of ``num_system_prompts`` shared system
    prompts followed by a user message, then has up to ``turns[1]`` requests in
    all. After each request the model "replies" (``reply_tokens`` tokens that
    the next follow-up includes); with probability ``p_regenerate`` the user
    asks for a new reply instead (the same prompt again, then a different
    reply), and with probability ``p_edit`` edits an earlier user message: the
    conversation rewinds to a point strictly inside that message, never on a
    ``tokens_per_block`` boundary, and continues from the edited text (the edit
    request's first new token differs from the one it replaces, so the shared
    prefix with the previous request is exactly ``rewind`` tokens). Conversations start uniformly in
    ``duration_s`` seconds with exponential think times between turns; the
    result is sorted by arrival time. Ranges are inclusive ``(lo, hi)``.
    """
    if num_conversations < 0:
        raise ValueError(f"num_conversations must be >= 0, got {num_conversations}")
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    for name, value in (("duration_s", duration_s), ("think_time_s", think_time_s)):
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if not 1 <= turns[0] <= turns[1]:
        raise ValueError(f"turns must be 1 <= lo <= hi, got {turns}")
    if user_tokens[0] < 2:
        raise ValueError("user_tokens must be at least 2 (an edit rewinds strictly inside a message)")
    if not 2 <= vocab_size <= 2**31:
        raise ValueError(f"vocab_size must be in 2..2**31, got {vocab_size}")
    rng = np.random.default_rng(seed)
    T = tokens_per_block

    def draw(lo_hi):
        return int(rng.integers(lo_hi[0], lo_hi[1] + 1))

    def text(n):
        return rng.integers(0, vocab_size, size=n, dtype=np.int32)

    systems = [text(draw(system_prompt_tokens)) for _ in range(max(num_system_prompts, 1))]
    out: list[SyntheticRequest] = []
    for c in range(num_conversations):
        sp = int(rng.integers(len(systems)))
        t = float(rng.uniform(0, duration_s))
        hist = systems[sp]
        user_spans: list[tuple[int, int]] = []  # [lo, hi) of each user message in hist

        def add_user(base, n_user):
            msg = text(n_user)
            user_spans.append((base.size, base.size + n_user))
            return np.concatenate([base, msg])

        req = add_user(hist, draw(user_tokens))
        out.append(SyntheticRequest(req, c, 0, "first", systems[sp].size, t, sp))
        n_turns = draw(turns)
        for turn in range(1, n_turns):
            t += float(rng.exponential(think_time_s))
            u = rng.random()
            if u < p_regenerate:
                out.append(SyntheticRequest(req.copy(), c, turn, "regenerate", req.size, t, sp))
                continue  # the new reply is drawn when the next follow-up is built
            if u < p_regenerate + p_edit:
                lo, hi = user_spans[int(rng.integers(len(user_spans)))]
                cut = _mid_block_point(rng, lo + 1, hi, T)  # keep >= 1 token of the message
                if cut is not None:
                    new = text(draw(user_tokens))
                    if new[0] == req[cut]:  # cut < hi <= req.size: diverge right at the cut
                        new[0] = (int(new[0]) + 1) % vocab_size
                    user_spans[:] = [s for s in user_spans if s[0] < cut]
                    user_spans[-1] = (user_spans[-1][0], cut + new.size)
                    req = np.concatenate([req[:cut], new])
                    out.append(SyntheticRequest(req, c, turn, "edit", cut, t, sp))
                    continue
            prev = req.size
            req = add_user(np.concatenate([req, text(draw(reply_tokens))]), draw(user_tokens))
            out.append(SyntheticRequest(req, c, turn, "follow_up", prev, t, sp))
    out.sort(key=lambda r: (r.timestamp, r.conversation, r.turn))
    return out


def _mid_block_point(rng, lo: int, hi: int, T: int) -> int | None:
    """A uniform position in ``[lo, hi)`` that is not a multiple of ``T``."""
    cands = np.arange(lo, hi)
    cands = cands[cands % T != 0]
    return int(cands[rng.integers(cands.size)]) if cands.size else None


def as_flat(seqs: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Token arrays as ``(flat int32, int64 offsets of length B+1)``."""
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs]) if seqs else np.zeros(0, np.int32)
    return flat, offsets


# -- the simulator's workloads ------------------------------------------------------------------
@dataclass(eq=False)
class Request:
    """One request of a workload. Its tokens (prompt, then output) are made on
    arrival and dropped when it finishes, so a long trace never holds all of
    them at once."""

    rid: int
    arrival_ms: float
    prompt_len: int
    output_len: int
    make_tokens: Callable[[], np.ndarray]
    after: int | None = None  # the rid of the conversation's previous turn, which must finish first
    kind: str = ""
    # -- simulation state --
    tokens: np.ndarray | None = None
    seq: object = None  # TokenSequence while waiting
    kv: object = None  # KVCache while admitted
    done: int = 0  # tokens computed (KV written) so far
    prefill_end: int = 0  # computed as a prefill up to here: the prompt, or more after a preemption
    checkpoint: int = 0  # a prefill chunk ends here (see Simulator._step_tokens)
    reused: int | None = None  # reuse at first admission
    finished_ms: float | None = None

    @property
    def compute_len(self) -> int:
        """Tokens whose KV is computed: the prompt and all output tokens but the last."""
        return self.prompt_len + max(self.output_len - 1, 0)

    def lookup_len(self) -> int:
        """Tokens looked up for reuse: all of the prefill but its last token,
        which is always computed (for the logits of the next token)."""
        return self.prefill_end - 1

    def __post_init__(self):
        self.prefill_end = self.prompt_len


@dataclass
class Workload:
    requests: list
    description: str


def default_workload(num_conversations: int = 200, seed: int = 0, tokens_per_block: int = 64,
                     duration_s: float = 60.0) -> Workload:
    """Multi-turn chats (``workload.synthetic_conversations``): shared system
    prompts, follow-ups, regenerations and edits that rewind a conversation
    into the middle of an earlier message.

    Each request's output is the model's reply: when the conversation's next
    request is a follow-up, the reply is the start of that follow-up's new
    text (the rest is the user's next message, split at a length drawn from
    the generator's user-message range), so committing the decoded tokens is
    what lets the follow-up reuse them. A reply nobody continues (before a
    regeneration or an edit, or at the end) is random text of the generator's
    reply length range.
    """
    user_tokens, reply_tokens = (10, 400), (20, 600)
    chats = synthetic_conversations(num_conversations, seed=seed, tokens_per_block=tokens_per_block,
                                    user_tokens=user_tokens, reply_tokens=reply_tokens, duration_s=duration_s)
    rng = np.random.default_rng(seed + 1)
    by_conv: dict[int, list] = {}
    for r in chats:
        by_conv.setdefault(r.conversation, []).append(r)
    nxt = {}
    for turns in by_conv.values():
        turns.sort(key=lambda r: r.turn)
        for a, b in itertools.pairwise(turns):
            nxt[id(a)] = b
    index = {id(r): i for i, r in enumerate(chats)}
    out = []
    for i, r in enumerate(chats):
        n = nxt.get(id(r))
        if n is not None and n.kind == "follow_up":
            new = n.tokens[r.tokens.size:]
            user = int(rng.integers(user_tokens[0], user_tokens[1] + 1))
            reply = new[: max(1, new.size - user)]
        else:
            reply = rng.integers(0, 32000, size=int(rng.integers(reply_tokens[0], reply_tokens[1] + 1)),
                                 dtype=np.int32)
        tokens = np.concatenate([r.tokens, reply])
        prev = None
        if r.turn > 0:
            prev = index[id(by_conv[r.conversation][r.turn - 1])]
        out.append(Request(i, r.timestamp * 1e3, r.tokens.size, reply.size, lambda t=tokens: t, prev, r.kind))
    desc = (f"built-in chats: {num_conversations} conversations, {len(out)} requests "
            f"(seed {seed}, arrivals over {duration_s:g} s)")
    return Workload(out, desc)


MAX_REQUEST_TOKENS = 1 << 20  # input + output of one simulated request


def trace_workload(path, limit: int | None = None, time_scale: float = 1.0,
                   max_request_tokens: int = MAX_REQUEST_TOKENS) -> Workload:
    """The requests of a Mooncake-format trace; each 512-token hash id expands
    to deterministic tokens (``TraceRequest.tokens``). The output tokens are
    deterministic random text per request (a trace does not say what the model
    answered). ``time_scale`` divides the arrival times (2 = twice the load).

    A request longer than ``max_request_tokens`` (input + output) is a
    ``TraceError`` naming its line: the pool is sized from the longest
    request, and one decode step per output token must end."""
    if not (isinstance(time_scale, (int, float)) and math.isfinite(time_scale) and time_scale > 0):
        raise ValueError(f"time_scale must be a positive finite number, got {time_scale!r}")
    trace = load_mooncake_trace(path, limit=limit)
    for t in trace:
        if t.input_length + t.output_length > max_request_tokens:
            raise TraceError(
                f"{path}:{t.line}: a request of {t.input_length} + {t.output_length} tokens (input + output) is "
                f"longer than the simulator takes ({max_request_tokens})"
            )
    out = []
    for i, t in enumerate(trace):
        def make(t=t, i=i):
            out_tokens = np.random.default_rng(i).integers(0, 2**31 - 1, size=t.output_length, dtype=np.int32)
            return np.concatenate([t.tokens(), out_tokens])
        out.append(Request(i, float(t.timestamp) / time_scale, t.input_length, t.output_length, make))
    return Workload(out, f"trace {path}: {len(out)} requests")

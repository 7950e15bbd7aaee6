"""Expert-load accounting: how many expert weight reads a batching plan costs.

Loads of a batch = for every forward pass the batch goes through and every MoE layer, the
number of distinct experts its tokens use, summed (Doubleword, "MoE expert co-activations").
Prefill is one forward over all prompt tokens of all members; decode step t is one forward
over the t-th generated token of every member still running.

Prefill-only traces (no generated tokens) use a decode proxy: every request with n >= 2
tokens takes part in `decode_steps` steps and at step t contributes its prompt token
1 + (t mod (n - 1)) (token 0 is BOS). Short and long prompts run equally long, so grouping
prompts by length gains nothing from run time. It does gain from phase, though: two requests
of equal length visit the same token positions at the same steps, and on real traces routing
correlates with position (on the DeepSeek traces, sorting prompts by length alone captures a
large share of the oracle's saving; docs/results.md). `phase="random"` removes that: request r
starts its cycle at a seeded random offset o_r, contributing token 1 + ((t + o_r) mod (n - 1)).
"aligned" (o_r = 0) is the default, the definition the reference figures use.

Expert sets are bitmasks: W = ceil(E / 64) uint64 words per (request, step, layer), so the
union of a batch is a bitwise OR and its size a popcount.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

from moe_cohort.traces.format import TraceSet

DEFAULT_DECODE_STEPS = 64
DecodeMode = Literal["auto", "real", "proxy"]
Phase = Literal["aligned", "random"]


@dataclass(frozen=True)
class ExpertMasks:
    """Per-request expert bitmasks of the prefill forward and of every decode step."""

    prefill: np.ndarray  # [N, L, W] uint64
    decode: np.ndarray  # [N, D, L, W] uint64; all-zero where the request is not running
    num_experts: int
    decode_mode: str  # "real" or "proxy"

    def __len__(self) -> int:
        return len(self.prefill)

    @property
    def decode_steps(self) -> int:
        return self.decode.shape[1]

    def flat(self) -> np.ndarray:  # [N, (1 + D) * L * W]
        """Prefill and decode masks side by side: one row per request, one column per (forward, layer, word)."""
        n = len(self)
        return np.concatenate([self.prefill.reshape(n, -1), self.decode.reshape(n, -1)], axis=1)


@dataclass(frozen=True)
class Loads:
    prefill: int
    decode: int

    @property
    def total(self) -> int:
        return self.prefill + self.decode


def token_masks(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """[T, L, k] expert ids -> [T, L, W] uint64 bitmasks (duplicate ids count once)."""
    words = (num_experts + 63) // 64
    ids = experts.astype(np.uint64)  # [T, L, k]
    bits = np.left_shift(np.uint64(1), ids % np.uint64(64))  # [T, L, k]
    word = ids // np.uint64(64)  # [T, L, k]
    out = np.zeros(experts.shape[:2] + (words,), dtype=np.uint64)  # [T, L, W]
    for w in range(words):  # W is tiny (1 for E <= 64); each pass is vectorised
        picked = np.where(word == w, bits, np.uint64(0))  # [T, L, k]
        out[..., w] = np.bitwise_or.reduce(picked, axis=-1)
    return out


def expert_masks(ts: TraceSet, *, decode_steps: int = DEFAULT_DECODE_STEPS, decode: DecodeMode = "auto",
                 phase: Phase = "aligned", seed: int = 0) -> ExpertMasks:
    """Build the prefill and decode bitmasks of every request of `ts`.

    decode="real" uses the generated tokens (steps = the longest generation); "proxy" uses the
    prompt-token proxy with `decode_steps` steps; "auto" picks real when any request has
    generated tokens. `phase` and `seed` set the proxy's starting offsets (see the module docstring).
    """
    mode = ("real" if ts.num_decode_tokens.any() else "proxy") if decode == "auto" else decode
    tok = token_masks(ts.experts, ts.num_experts)  # [T, L, W]
    tok = np.concatenate([tok, np.zeros((1,) + tok.shape[1:], np.uint64)])  # row T = "no token"
    prefill = _segment_or(tok, ts.token_offsets[:-1], ts.num_prompt_tokens)
    if mode == "real":
        index = _real_decode_index(ts)  # [N, D]
    else:
        index = _proxy_decode_index(ts, decode_steps, _proxy_offsets(ts, phase, seed))  # [N, D]
    return ExpertMasks(prefill=prefill, decode=tok[index], num_experts=ts.num_experts, decode_mode=mode)


def _segment_or(tok: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """OR of rows tok[s:s+n] for every (s, n); empty segments give 0. tok ends with a zero row."""
    n = len(starts)
    out = np.zeros((n,) + tok.shape[1:], dtype=np.uint64)  # [N, L, W]
    nonempty = np.flatnonzero(lengths > 0)
    if len(nonempty) == 0:
        return out
    bounds = np.stack([starts[nonempty], starts[nonempty] + lengths[nonempty]], axis=1).ravel()  # [2M]
    out[nonempty] = np.bitwise_or.reduceat(tok, bounds, axis=0)[::2]  # last row of tok is a zero sentinel
    return out


def _real_decode_index(ts: TraceSet) -> np.ndarray:
    """[N, D] token index of each request's t-th generated token, or T (the zero row) when done."""
    nd = ts.num_decode_tokens  # [N]
    steps = np.arange(max(int(nd.max(initial=0)), 1))  # [D]
    first = ts.token_offsets[:-1] + ts.num_prompt_tokens  # [N]
    index = first[:, None] + steps[None, :]  # [N, D]
    return np.where(steps[None, :] < nd[:, None], index, len(ts.experts))


def _proxy_offsets(ts: TraceSet, phase: Phase, seed: int) -> np.ndarray:
    """[N] starting offset of each request's cycle: 0 ("aligned") or uniform in [0, n - 1) ("random")."""
    if phase == "aligned":
        return np.zeros(len(ts), dtype=np.int64)
    if phase != "random":
        raise ValueError(f"phase must be 'aligned' or 'random', got {phase!r}")
    cycle = np.maximum(ts.num_prompt_tokens - 1, 1)  # [N]
    return (np.random.default_rng(seed).random(len(ts)) * cycle).astype(np.int64)


def _proxy_decode_index(ts: TraceSet, decode_steps: int, offsets: np.ndarray) -> np.ndarray:
    """[N, D] prompt token 1 + ((t + o) mod (n - 1)) of each request; T (the zero row) when n < 2."""
    n = ts.num_prompt_tokens  # [N]
    t = np.arange(decode_steps)  # [D]
    index = ts.token_offsets[:-1, None] + 1 + (t[None, :] + offsets[:, None]) % np.maximum(n - 1, 1)[:, None]  # [N, D]
    return np.where((n >= 2)[:, None], index, len(ts.experts))


def popcount_sum(masks: np.ndarray, axis=None) -> np.ndarray | int:
    """Number of set bits, summed over `axis` (all axes when None)."""
    return np.bitwise_count(masks).sum(axis=axis, dtype=np.int64)


def batch_loads(masks: ExpertMasks, members: Sequence[int]) -> Loads:
    """Loads of one batch: distinct experts per forward and layer, summed."""
    idx = np.asarray(members, dtype=np.int64)
    prefill = np.bitwise_or.reduce(masks.prefill[idx], axis=0)  # [L, W]
    decode = np.bitwise_or.reduce(masks.decode[idx], axis=0)  # [D, L, W]
    return Loads(prefill=int(popcount_sum(prefill)), decode=int(popcount_sum(decode)))


def plan_loads(masks: ExpertMasks, batches: Sequence[Sequence[int]]) -> Loads:
    """Loads of a plan (a list of batches of request indices), summed over batches."""
    sizes = np.array([len(b) for b in batches], dtype=np.int64)
    if len(sizes) == 0:
        return Loads(0, 0)
    order = np.concatenate([np.asarray(b, dtype=np.int64) for b in batches])  # [N]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])  # [B]
    nonempty = starts[sizes > 0]
    prefill = np.bitwise_or.reduceat(masks.prefill[order], nonempty, axis=0)  # [B, L, W]
    decode = np.bitwise_or.reduceat(masks.decode[order], nonempty, axis=0)  # [B, D, L, W]
    return Loads(prefill=int(popcount_sum(prefill)), decode=int(popcount_sum(decode)))

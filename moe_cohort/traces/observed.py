"""Observed expert counts of one served request: what the online learner (train.online) fits the head on.

For each finished request: per MoE layer, how many of its prompt tokens and, kept apart, how many of
its generated tokens picked each expert, and how many tokens each part had. Counts only: never the
text, never token ids. Two sources produce them, read by the proxy (send/learning/learning.py):

- vLLM's own `routed_experts` response field (server flag `--enable-return-routed-experts`): base64
  `.npy` bytes of shape [tokens - 1, L, k], every token that went through the model (the last
  sampled one never does), prompt first (`from_routed_experts` with the answer's prompt token count);
- moe-cohort's plugin, which counts in the engine for the requests the proxy marks and hands the
  counts over in `to_wire` form (a JSON object: token counts and base64 `.npy` [2, L, E] counts).

`profile()` is the learner's target and matches train.targets.profiles for a decode trace: per layer,
the fraction of the generated tokens that picked each expert (a request that generated nothing: of
its prompt tokens).
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from typing import Any

import numpy as np


class BadObservation(ValueError):
    """Routing data that cannot be an observation (wrong shape, expert ids out of range, bad encoding)."""


@dataclass(frozen=True)
class Observed:
    prompt: np.ndarray  # [L, E] int64: prompt tokens that picked expert e at layer l
    decode: np.ndarray  # [L, E] int64: the same over the generated tokens that went through the model
    prompt_tokens: int
    decode_tokens: int

    @property
    def num_layers(self) -> int:
        return self.prompt.shape[0]

    @property
    def num_experts(self) -> int:
        return self.prompt.shape[1]

    @property
    def top_k(self) -> int:
        """Experts per token and layer, from the counts (each token picks k distinct experts per layer)."""
        counts, tokens = (self.decode, self.decode_tokens) if self.decode_tokens else (self.prompt, self.prompt_tokens)
        return int(round(counts.sum() / max(1, tokens * self.num_layers)))

    def profile(self) -> np.ndarray:  # [L, E] float32
        """Per layer, the fraction of the generated tokens (none: of the prompt tokens) that picked each expert."""
        counts, tokens = (self.decode, self.decode_tokens) if self.decode_tokens else (self.prompt, self.prompt_tokens)
        return (counts / max(tokens, 1)).astype(np.float32)

    def padded(self, num_experts: int) -> Observed:
        """The same counts over `num_experts` experts (the ones added picked by no token)."""
        pad = ((0, 0), (0, num_experts - self.num_experts))
        return Observed(np.pad(self.prompt, pad), np.pad(self.decode, pad), self.prompt_tokens, self.decode_tokens)

    def to_wire(self) -> dict[str, Any]:
        """A JSON-able object: {"prompt_tokens", "decode_tokens", "counts": base64 .npy [2, L, E] uint32}."""
        return {"prompt_tokens": self.prompt_tokens, "decode_tokens": self.decode_tokens,
                "counts": _b64_npy(np.stack([self.prompt, self.decode]).astype(np.uint32))}

    @classmethod
    def from_wire(cls, obj: Any) -> Observed:
        """The inverse of `to_wire`; BadObservation for anything else."""
        if not isinstance(obj, dict) or not {"prompt_tokens", "decode_tokens", "counts"} <= obj.keys():
            raise BadObservation("an observation is an object with prompt_tokens, decode_tokens and counts")
        counts = decode_npy(obj["counts"])
        if counts.ndim != 3 or counts.shape[0] != 2 or counts.dtype.kind not in "ui":
            raise BadObservation(f"observation counts must be integers of shape [2, L, E], got {counts.dtype} {counts.shape}")
        prompt_tokens, decode_tokens = obj["prompt_tokens"], obj["decode_tokens"]
        if not all(type(v) is int and v >= 0 for v in (prompt_tokens, decode_tokens)):
            raise BadObservation("prompt_tokens and decode_tokens must be non-negative integers")
        counts = counts.astype(np.int64)
        return cls(counts[0], counts[1], prompt_tokens, decode_tokens)


def from_routed_experts(rows: np.ndarray, prompt_tokens: int, num_experts: int, prompt_start: int = 0) -> Observed:
    """An observation from vLLM's routed experts rows [T, L, k] (T = tokens - 1; the first `prompt_start`
    prompt tokens left out, vLLM's `routed_experts_prompt_start`) of a request with `prompt_tokens`."""
    if rows.ndim != 3 or rows.dtype.kind not in "ui":
        raise BadObservation(f"routed experts must be integer ids of shape [tokens - 1, layers, k], "
                             f"got {rows.dtype} {rows.shape}")
    if rows.size and (rows.min() < 0 or rows.max() >= num_experts):
        raise BadObservation(f"routed experts name experts outside [0, {num_experts})")
    split = min(max(prompt_tokens - prompt_start, 0), len(rows))
    return Observed(count_experts(rows[:split], num_experts), count_experts(rows[split:], num_experts), split,
                    len(rows) - split)


def count_experts(rows: np.ndarray, num_experts: int) -> np.ndarray:  # [n, L, k] -> [L, E] int64
    """How many of the rows (tokens) picked each expert at each layer."""
    layers = rows.shape[1]
    cell = np.arange(layers)[None, :, None] * num_experts + rows.astype(np.int64)  # [n, L, k]
    return np.bincount(cell.ravel(), minlength=layers * num_experts).reshape(layers, num_experts)


def decode_npy(text: Any) -> np.ndarray:
    """base64 `.npy` bytes (vLLM's encoding of arrays in JSON) -> the array, never a pickle."""
    if not isinstance(text, str):
        raise BadObservation(f"expected base64 .npy text, got {type(text).__name__}")
    try:
        return np.load(io.BytesIO(base64.b64decode(text, validate=True)), allow_pickle=False)
    except (binascii.Error, ValueError, OSError, EOFError) as exc:
        raise BadObservation(f"not base64 .npy data: {exc}") from None


def _b64_npy(array: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")

"""What the proxy and the engine say to each other: the `vllm_xargs` keys moe-cohort owns, and the profile codec.

The proxy writes them into the body it forwards; vLLM hands them to the engine as
`sampling_params.extra_args`, where the plugin (engine/) and the expert-aware scheduler read them.
One module for both sides, so a renamed key or a changed encoding cannot leave one side behind.

- `ROUTING_KEY`: the request's routing policy string (engine.policy's grammar), e.g. "xshare;m=24".
- `PROFILE_KEY`: the request's predicted expert profile in compact form (`compact`), for an engine
  that admits from its own queue by the same rule (engine.scheduler).
- `RECORD_KEY`: whether the plugin records this request's expert trace.
- `BATCH_KEY`: 1 for a batch line (a batch file's, the Batch API's, a Ray Data LLM row): its file is waited on
  as a whole, so the engine chooses it under neither fairness bound (admission.waiting, rule 1). A client may
  send it too; it gives up only its own bound.
- `FCFS_KEY`: 1 for a request the engine must admit first come, first served (no routing of its prompt is used,
  so it joins no resident set): `cohort compare` sends its baseline so.
- `OBSERVE_KEY`: a token under which the plugin counts this request's experts (prompt and generated tokens
  apart, counts only) for the proxy's online learning to take (engine.observed_endpoint).

Compact form, for a field that carries flat lists of scalars: per MoE layer the `COMPACT_TOP` most
frequent experts, each as one int `expert * 256 + q` with q = round(255 * u) in 0..255, layer after
layer (L * top ints; 26 * 8 = 208 for DeepSeek-V2-Lite). `expand` restores an [L, E] profile with the
rest of each layer at 0; `decode_profile` checks and expands a value as it arrives from a client.

`Prediction` is what the proxy knows of a request before admitting it: its vector (what the resident
set scores it by) and, with a profile head, the compact form it forwards. `with_xargs` is the one way the
proxy writes these keys into a body.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

ROUTING_KEY = "moe_routing"
PROFILE_KEY = "moe_profile"
RECORD_KEY = "moe_record"
OBSERVE_KEY = "moe_observe"
BATCH_KEY = "moe_batch"
FCFS_KEY = "moe_fcfs"

COMPACT_TOP = 8
_LEVELS = 255


def with_xargs(xargs: dict | None, **keys: Any) -> dict:
    """A body's `vllm_xargs` (None: none yet) with `keys` set over what it had; the given dict is not changed."""
    return {**(xargs or {}), **keys}


@dataclass(frozen=True, eq=False)
class Prediction:
    """A request's prediction: `vector` [L*E] flat expert profile, or [D] unit embedding (no profile head),
    float32; `compact` the profile's wire form for `vllm_xargs.moe_profile` (None for an embedding)."""

    vector: np.ndarray = field(repr=False)  # [L*E] or [D] float32
    compact: list[int] | None = None

    @classmethod
    def of_profile(cls, profile: np.ndarray) -> Prediction:
        """From a predicted profile [L, E]: the flat vector and its compact form."""
        return cls(np.asarray(profile, np.float32).ravel(), compact(profile))


def compact(profile: np.ndarray, top: int = COMPACT_TOP) -> list[int]:
    """[L, E] profile -> L * top ints `expert * 256 + q` (see the module docstring)."""
    p = np.clip(np.asarray(profile, dtype=np.float64), 0.0, 1.0)  # [L, E]
    top = min(top, p.shape[1])
    ids = np.argsort(-p, axis=1, kind="stable")[:, :top]  # [L, top]
    q = np.rint(np.take_along_axis(p, ids, axis=1) * _LEVELS).astype(np.int64)  # [L, top]
    return (ids * 256 + q).ravel().tolist()


def expand(codes: list[int] | np.ndarray, num_layers: int, num_experts: int) -> np.ndarray:  # [L, E] float32
    """Inverse of `compact` up to quantisation (experts outside each layer's top get 0)."""
    c = np.asarray(codes, dtype=np.int64).reshape(num_layers, -1)  # [L, top]
    ids, q = c // 256, c % 256
    if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
        raise ValueError(f"compact profile names experts outside [0, {num_experts})")
    out = np.zeros((num_layers, num_experts), np.float32)
    np.put_along_axis(out, ids, (q / _LEVELS).astype(np.float32), axis=1)
    return out


def decode_profile(value: Any, num_experts: int) -> np.ndarray | None:
    """A `moe_profile` value -> flat frequencies [L*E] float32, or None if it is not a valid one
    (a list of `COMPACT_TOP` non-negative ints per layer, naming experts below `num_experts`)."""
    if (not isinstance(value, list) or not value or len(value) % COMPACT_TOP
            or not all(type(v) is int and v >= 0 for v in value)):
        return None
    try:
        return expand(value, len(value) // COMPACT_TOP, num_experts).ravel()  # [L*E]
    except ValueError:  # an expert id outside the model's
        return None

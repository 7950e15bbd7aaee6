"""Overlap targets: how much two requests save by sharing a batch, from their expert traces.

A request's *profile* is u[l, e] = the fraction of its decode tokens that pick expert e at MoE
layer l (each row sums to k, or to 0 for a request with no decode token). Decode tokens are the
tokens that `traces.loads` charges to decode steps: the generated tokens when the traces have
them, otherwise the prompt tokens after BOS (the prompt-token decode proxy).

Targets for a pair (a, b), all in [0, 1]:

- ``weighted_jaccard`` (the default): per layer sum_e min(u_a, u_b) / sum_e max(u_a, u_b),
  averaged over layers; it equals Jaccard on 0/1 sets (a weighted version of the Jaccard target
  of Doubleword, "MoE expert co-activations: reordering inputs yields easy throughput gains").
- ``overlap``: sum_{l,e} u_a[l,e] * u_b[l,e] / (L * k). If each decode step draws each request's
  token independently from its profile, sum_e u_a[l,e] u_b[l,e] is the expected number of experts
  the two share at layer l, i.e. exactly the decode loads saved by pairing them, so overlap / 2
  is the expected pair saving 1 - loads({a,b}) / (loads(a) + loads(b)).
- ``jaccard``: Jaccard of the sets of (layer, expert) a request touches at all (Doubleword's
  target); it saturates on real traces, where even a short prompt touches most experts.

Weighted Jaccard is the default because batches of B >= 8 saturate a layer's experts: it puts like with
like at both ends (diffuse with diffuse, concentrated with concentrated) and is a proper similarity (1
with itself, 1 - it a metric) for cosine clustering, where overlap, a pair quantity, ignores saturation
(benchmarks/target_study.py, bench_train.py; figures: docs/results.md, "fine-tuning with CoSENT pairs").

Pure numpy; every function is vectorised over pairs and works in bounded-memory chunks.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from moe_cohort.traces.format import TraceSet

Target = Literal["overlap", "weighted_jaccard", "jaccard"]
TARGETS: tuple[str, ...] = ("overlap", "weighted_jaccard", "jaccard")
DEFAULT_TARGET: Target = "weighted_jaccard"
TokenMode = Literal["auto", "decode", "prompt"]
_CHUNK_FLOATS = 1 << 24  # float32 values per broadcast chunk (64 MiB), which bounds the memory


def counted_tokens(ts: TraceSet, tokens: TokenMode = "auto") -> np.ndarray:  # [T] bool
    """The tokens a profile counts: generated ones ("decode"), prompt ones after BOS ("prompt"),
    or "auto": decode when any request has generated tokens, as `traces.loads.expert_masks` does."""
    mode = ("decode" if ts.num_decode_tokens.any() else "prompt") if tokens == "auto" else tokens
    position = np.arange(len(ts.experts)) - np.repeat(ts.token_offsets[:-1], ts.num_tokens)  # [T] index in its request
    n_prompt = np.repeat(ts.num_prompt_tokens, ts.num_tokens)  # [T]
    if mode == "decode":
        return position >= n_prompt
    if mode == "prompt":
        return (position >= 1) & (position < n_prompt)
    raise ValueError(f"tokens must be 'auto', 'decode' or 'prompt', got {tokens!r}")


def profiles(ts: TraceSet, tokens: TokenMode = "auto") -> np.ndarray:  # [N, L, E] float32
    """u[r, l, e] = fraction of request r's counted tokens that pick expert e at layer l.

    A token listing the same id twice picks it once; a request with no counted token is all zero.
    """
    n, layers, experts = len(ts), ts.num_layers, ts.num_experts
    keep = counted_tokens(ts, tokens)  # [T]
    req = np.repeat(np.arange(n), ts.num_tokens)[keep]  # [T']
    ids = np.sort(ts.experts[keep].astype(np.int64), axis=-1)  # [T', L, k]
    first = np.ones(ids.shape, dtype=bool)  # [T', L, k] first occurrence of an id in its token
    first[..., 1:] = ids[..., 1:] != ids[..., :-1]
    cell = (req[:, None, None] * layers + np.arange(layers)[None, :, None]) * experts + ids  # [T', L, k]
    counts = np.bincount(cell[first], minlength=n * layers * experts).reshape(n, layers, experts)
    per_request = np.bincount(req, minlength=n)  # [N]
    return (counts / np.maximum(per_request, 1)[:, None, None]).astype(np.float32)


def pair_targets(prof: np.ndarray, pairs: np.ndarray, top_k: int, kind: Target = DEFAULT_TARGET) -> np.ndarray:
    """Targets [P] float64 of pairs [P, 2] of rows of `prof` [N, L, E] (see the module docstring)."""
    pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    fn = _pair_fn(kind)
    step = max(1, _CHUNK_FLOATS // max(1, prof[0].size))
    out = [fn(prof[pairs[i:i + step, 0]], prof[pairs[i:i + step, 1]], top_k) for i in range(0, len(pairs), step)]
    return np.concatenate(out) if out else np.zeros(0)


def target_matrix(prof: np.ndarray, top_k: int, kind: Target = DEFAULT_TARGET) -> np.ndarray:  # [N, N] float32
    """Targets of every pair of rows of `prof` [N, L, E]; the diagonal is each request with itself."""
    return target_block(prof, np.arange(len(prof)), top_k, kind)


def target_block(prof: np.ndarray, rows: np.ndarray, top_k: int, kind: Target = DEFAULT_TARGET) -> np.ndarray:
    """Targets [R, N] float32 of the requests `rows` [R] against every request of `prof` [N, L, E]."""
    n, fn = len(prof), _pair_fn(kind)
    flat = prof.reshape(n, -1).astype(np.float64)  # [N, L*E]; float64 keeps neighbour ranks stable across BLAS builds
    if kind == "overlap":
        return ((flat[rows] @ flat.T) / (prof.shape[1] * top_k)).astype(np.float32)
    if kind == "jaccard":
        touched = (flat > 0).astype(np.float64)  # [N, L*E] counts below are exact integers
        inter = touched[rows] @ touched.T  # [R, N]
        size = touched.sum(1)  # [N]
        union = size[rows, None] + size[None, :] - inter
        return np.where(union > 0, inter / np.maximum(union, 1), 0).astype(np.float32)
    step = max(1, _CHUNK_FLOATS // max(1, flat.size))
    out = [fn(prof[rows[i:i + step], None], prof[None], top_k) for i in range(0, len(rows), step)]  # each [c, N]
    return np.concatenate(out).astype(np.float32) if out else np.zeros((0, n), np.float32)


def _pair_fn(kind: str):
    try:
        return {"overlap": _overlap, "weighted_jaccard": _weighted_jaccard, "jaccard": _jaccard}[kind]
    except KeyError:
        raise ValueError(f"unknown target {kind!r}; choose one of {', '.join(TARGETS)}") from None


def _overlap(a: np.ndarray, b: np.ndarray, top_k: int) -> np.ndarray:  # [..., L, E] x2 -> [...]
    return (a.astype(np.float64) * b).sum(axis=(-2, -1)) / (a.shape[-2] * top_k)


def _weighted_jaccard(a: np.ndarray, b: np.ndarray, top_k: int) -> np.ndarray:  # [..., L, E] x2 -> [...]
    mins = np.minimum(a, b).sum(-1, dtype=np.float64)  # [..., L]
    maxs = np.maximum(a, b).sum(-1, dtype=np.float64)  # [..., L]
    per_layer = np.divide(mins, maxs, out=np.zeros_like(mins), where=maxs > 0)
    return per_layer.mean(-1)


def _jaccard(a: np.ndarray, b: np.ndarray, top_k: int) -> np.ndarray:  # [..., L, E] x2 -> [...]
    ta, tb = a > 0, b > 0
    inter = (ta & tb).sum(axis=(-2, -1), dtype=np.float64)
    union = (ta | tb).sum(axis=(-2, -1), dtype=np.float64)
    return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)

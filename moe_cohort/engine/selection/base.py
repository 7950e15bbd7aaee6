"""The selector contract, the shared tensor steps, and the `topk` reference selector.

A selector is a function

    selector(router_logits, top_k, policy, *, request_spans=None, expert_groups=None,
             scoring="softmax", renormalize=True, layer=None) -> (topk_weights, topk_ids)

- router_logits [T, E] float (any float dtype); scores are computed in float32 like vLLM's
  FusedTopK: softmax (Qwen, Mixtral, OLMoE, DeepSeek-V2) or sigmoid (DeepSeek-V3 style, without
  the grouped/bias correction, which a model applies before calling us).
- topk_weights [T, top_k] float32 and topk_ids [T, top_k] int64, slots in descending score.
- A token that uses fewer than top_k experts fills its spare slots with weight 0 and its first
  (best) id, so spare slots load no new expert. Every token keeps at least one expert.
- renormalize=True: the kept weights of a token sum to 1. renormalize=False: kept weights are the
  raw scores, as the model would produce them for those experts.

Selectors are registered by policy name in `SELECTORS` (see `register`). A selector declares
only the batch context it reads (`request_spans`, `expert_groups`, `layer`), so a misspelt
keyword raises TypeError; `context_for(name, ...)` picks a selector's context from all of it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch

from moe_cohort.engine.policy import Policy

Selector = Callable[..., tuple[torch.Tensor, torch.Tensor]]
SELECTORS: dict[str, Selector] = {}
SCORINGS = ("softmax", "sigmoid")
CONTEXT = ("request_spans", "expert_groups", "layer")  # batch context a selector may read
_CONTEXT_OF: dict[str, tuple[str, ...]] = {}


def register(name: str) -> Callable[[Selector], Selector]:
    """Decorator: add a selector to `SELECTORS` under a policy name."""
    def add(fn: Selector) -> Selector:
        SELECTORS[name] = fn
        _CONTEXT_OF[name] = tuple(k for k in inspect.signature(fn).parameters if k in CONTEXT)
        return fn
    return add


def context_for(name: str, **context: object) -> dict[str, object]:
    """The part of the batch context (request_spans, expert_groups, layer) selector `name` reads."""
    unknown = set(context) - set(CONTEXT)
    if unknown:
        raise TypeError(f"unknown batch context {sorted(unknown)}; known: {CONTEXT}")
    return {key: value for key, value in context.items() if key in _CONTEXT_OF[name]}


def gate_scores(router_logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """[T, E] logits -> [T, E] float32 gating scores (softmax or sigmoid)."""
    if scoring == "softmax":
        return torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    if scoring == "sigmoid":
        return router_logits.float().sigmoid()
    raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")


def finish(weights: torch.Tensor, ids: torch.Tensor, used: torch.Tensor,
           renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the spare-slot convention to sorted slots and renormalize.

    weights, ids, used: [T, k]; slot 0 of every token must be used.
    """
    ids = torch.where(used, ids, ids[:, :1])                    # [T, k] spare -> best id
    weights = torch.where(used, weights, torch.zeros_like(weights))
    if renormalize:
        total = weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        weights = weights / total
    return weights.float(), ids.long()


def route_within(scores: torch.Tensor, allowed: torch.Tensor, top_k: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-k experts inside its allowed set (fewer if the set is smaller).

    scores [T, E] float32 >= 0; allowed [E] (one set for the batch) or [T, E] bool with >= 1
    expert per token. Disallowed experts are pushed below every score (scores are >= 0).
    """
    masked = scores.masked_fill(~allowed, -1.0)                 # [T, E] (an [E] mask broadcasts)
    weights, ids = masked.topk(top_k, dim=-1)                   # [T, k]
    used = allowed[ids] if allowed.dim() == 1 else allowed.gather(1, ids)   # [T, k]
    return finish(weights, ids, used, renormalize)


def compact(weights: torch.Tensor, ids: torch.Tensor, kept: torch.Tensor, top_k: int,
            renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the first top_k kept slots of rank-sorted candidates, in order, without a new top-k.

    weights, ids, kept: [T, K] sorted by descending score, K >= top_k; every token keeps >= 1.
    """
    pos = kept.long().cumsum(dim=-1) - 1                        # [T, K] target slot of kept ones
    keep = kept & (pos < top_k)
    pos = torch.where(keep, pos, torch.full_like(pos, top_k))  # others -> a scratch column
    shape = (ids.shape[0], top_k + 1)
    out_w = weights.new_zeros(shape).scatter(1, pos, weights)[:, :top_k]
    out_ids = ids.new_zeros(shape).scatter(1, pos, ids)[:, :top_k]
    used = torch.arange(top_k, device=ids.device)[None, :] < keep.sum(-1, keepdim=True)
    return finish(out_w, out_ids, used, renormalize)


def request_ids(num_tokens: int, request_spans: Sequence[tuple[int, int]] | None,
                device: torch.device) -> tuple[torch.Tensor, int]:
    """([T] int64 request index of every token, number of requests R).

    Spans are sorted, disjoint [start, end) ranges (None: one request); a token outside every
    span is its own request. One repeat_interleave over the segment lengths (a list built per
    request and per gap, `[1] * gap`), not a loop over tokens.
    """
    spans = [(0, num_tokens)] if request_spans is None else request_spans
    lengths, cursor = [], 0
    for start, end in [*spans, (num_tokens, num_tokens)]:
        lengths += [1] * (start - cursor) + ([end - start] if end > start else [])
        cursor = end
    segments = torch.tensor(lengths, dtype=torch.int64, device=device)          # [R]
    index = torch.arange(len(lengths), device=device)
    return index.repeat_interleave(segments, output_size=num_tokens), max(len(lengths), 1)


def check_spans(num_tokens: int, request_spans: Sequence[tuple[int, int]] | None) -> None:
    """Raise ValueError unless spans are sorted, disjoint, non-empty ranges within [0, T]."""
    previous_end = 0
    for start, end in request_spans or []:
        if not (previous_end <= start < end <= num_tokens):
            raise ValueError(f"request_spans must be sorted, disjoint, non-empty ranges within "
                             f"[0, {num_tokens}], got {list(request_spans)}")
        previous_end = end


@register("topk")
def select_topk(router_logits: torch.Tensor, top_k: int, policy: Policy | None = None,
                *, scoring: str = "softmax", renormalize: bool = True,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The unchanged router, as vLLM's FusedTopK: scores -> top-k -> optional renormalize."""
    weights, ids = gate_scores(router_logits, scoring).topk(top_k, dim=-1)   # [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return weights, ids.long()

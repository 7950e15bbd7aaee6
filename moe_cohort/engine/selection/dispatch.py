"""Entry points: one policy for a batch (`select_experts`) or one policy per request
(`select_experts_mixed`, what the vLLM plugin calls)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from moe_cohort.engine.policy import Policy, TopK, parse_policy
from moe_cohort.engine.selection import fused
from moe_cohort.engine.selection.base import SCORINGS, SELECTORS, check_spans, context_for

Span = tuple[int, int]


def as_policy(policy: Policy | str) -> Policy:
    """A Policy, parsing strings with `parse_policy` (cached). Compiled callers pass Policy objects."""
    return parse_policy(policy) if isinstance(policy, str) else policy


def check_call(router_logits: torch.Tensor, top_k: int, scoring: str) -> None:
    """Raise ValueError on arguments no selector can serve."""
    if router_logits.dim() != 2 or not router_logits.is_floating_point():
        raise ValueError(f"router_logits must be a [T, E] float tensor, got {router_logits.dtype} "
                         f"{tuple(router_logits.shape)}")
    if not 1 <= top_k <= router_logits.shape[1]:
        raise ValueError(f"top_k must be in 1..{router_logits.shape[1]}, got {top_k}")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")


def select_experts(router_logits: torch.Tensor, top_k: int, policy: Policy | str, *,
                   request_spans: Sequence[Span] | None = None,
                   expert_groups: Sequence[int] | torch.Tensor | None = None,
                   is_prefill: bool = False, scoring: str = "softmax", renormalize: bool = True,
                   layer: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Route a batch with one policy: [T, E] logits -> ([T, top_k] float32, [T, top_k] int64).

    See `engine.selection.base` for the contract. A `decode_only` policy routes a prefill batch
    with plain top-k. `layer` is needed only by `moe-spec;rank=static` with per-layer counts.
    On CUDA with Triton installed the fused kernels run (`engine.selection.fused`: no host
    synchronisation, CUDA-graph safe once warmed up); elsewhere the torch selectors.
    Raises PolicyError (a ValueError) if the policy does not fit the model (e.g. k0 > top_k).
    """
    policy = as_policy(policy)
    check_call(router_logits, top_k, scoring)
    check_spans(router_logits.shape[0], request_spans)
    policy.validate_for_model(top_k, router_logits.shape[1])
    policy = policy.effective(is_prefill)
    if not isinstance(policy, TopK) and fused.available(router_logits) and router_logits.is_cuda:
        return fused.select_fused(router_logits, top_k, policy, request_spans=request_spans,
                                  expert_groups=expert_groups, scoring=scoring, renormalize=renormalize,
                                  layer=layer)
    context = context_for(policy.name, request_spans=request_spans, expert_groups=expert_groups, layer=layer)
    return SELECTORS[policy.name](router_logits, top_k, policy, scoring=scoring, renormalize=renormalize, **context)


def _groups(policies: Sequence[Policy], spans: Sequence[Span],
            num_tokens: int) -> dict[Policy, list[Span]]:
    """Spans grouped by policy (first-seen order); tokens outside every span go to topk."""
    groups: dict[Policy, list[Span]] = {}
    previous_end = 0
    for policy, (start, end) in zip(policies, spans):
        if start > previous_end:
            groups.setdefault(TopK(), []).append((previous_end, start))
        groups.setdefault(policy, []).append((start, end))
        previous_end = end
    if previous_end < num_tokens:
        groups.setdefault(TopK(), []).append((previous_end, num_tokens))
    return groups


def _rebased(spans: list[Span], device: torch.device) -> tuple[torch.Tensor, list[Span]]:
    """[N] token indices of spans in order, and the spans rebased onto that sub-batch."""
    lengths = [end - start for start, end in spans]
    stops = list(itertools.accumulate(lengths))
    shift = torch.tensor([start - stop + length for (start, _), stop, length in zip(spans, stops, lengths)],
                         dtype=torch.int64, device=device)        # [R] original - rebased start
    repeats = torch.tensor(lengths, dtype=torch.int64, device=device)
    index = torch.arange(stops[-1], device=device) + shift.repeat_interleave(repeats, output_size=stops[-1])
    return index, [(stop - length, stop) for stop, length in zip(stops, lengths)]


def select_experts_mixed(router_logits: torch.Tensor, top_k: int,
                         policies: Sequence[Policy | str], request_spans: Sequence[Span], *,
                         is_prefill: bool = False, scoring: str = "softmax",
                         renormalize: bool = True,
                         expert_groups: Sequence[int] | torch.Tensor | None = None,
                         layer: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Route a batch whose requests carry different policies.

    policies[i] applies to request_spans[i]. The spans of one policy form one sub-batch for that
    policy's selector (its spans rebased, so xshare-spec still sees requests); tokens outside
    every span use plain top-k. Results are scattered back to the original token order.
    """
    if len(policies) != len(request_spans):
        raise ValueError(f"need one policy per request span, got {len(policies)} policies "
                         f"for {len(request_spans)} spans")
    num_tokens = router_logits.shape[0]
    check_call(router_logits, top_k, scoring)
    check_spans(num_tokens, request_spans)
    groups = _groups([as_policy(p) for p in policies], request_spans, num_tokens)
    common = dict(expert_groups=expert_groups, is_prefill=is_prefill, scoring=scoring,
                  renormalize=renormalize, layer=layer)
    if len(groups) == 1:
        ((policy, spans),) = groups.items()
        return select_experts(router_logits, top_k, policy, request_spans=spans, **common)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    for policy, spans in groups.items():
        index, rebased = _rebased(spans, router_logits.device)
        sub_w, sub_ids = select_experts(router_logits[index], top_k, policy,
                                        request_spans=rebased, **common)
        weights[index], ids[index] = sub_w, sub_ids
    return weights, ids

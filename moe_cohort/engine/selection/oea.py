"""OEA: opportunistic expert activation.

Oncescu et al., "Opportunistic Expert Activation: Batch-Aware Expert Routing for Faster Decode
Without Retraining" (arXiv 2511.02237), Sec. 3. Decode latency follows the number of distinct
experts the batch loads, so routing runs in two phases:

1. baseline (batch independent, the quality floor): every token keeps its best experts;
2. piggybacking (free): a token also uses any of its high-ranked experts that the baseline of
   some token in the batch already loads, up to top_k experts in all, best first.

Simplified form (`oea;k0=K`): the baseline is the top-k0, the piggyback candidates are the token's
top-k. General form: `p` extends the baseline to the smallest prefix of the token's ranking whose
share of its top-k mass reaches p (the mass is measured on the token's top-k weights normalised
to 1, so it means the same for softmax and sigmoid scoring); the baseline is then
max(k0, that prefix). `max_p` is the rank cutoff of the piggyback candidates (default top_k; it
may exceed top_k, letting a token ride on a loaded expert ranked below its top-k, while the token
still uses at most top_k experts). Weights are renormalised over the kept experts when the model
renormalises.
"""

from __future__ import annotations

import torch

from moe_cohort.engine.policy import OEA
from moe_cohort.engine.selection.base import compact, gate_scores, register
from moe_cohort.engine.selection.sets import expert_mask


def baseline_sizes(weights: torch.Tensor, top_k: int, k0: int, p: float | None) -> torch.Tensor:
    """[T, K] rank-sorted scores -> [T] baseline size per token, in 1..top_k."""
    if p is None:
        return torch.full(weights.shape[:1], max(k0, 1), dtype=torch.int64, device=weights.device)
    head = weights[:, :top_k]                                   # [T, k]
    mass = head / head.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    before = mass.cumsum(dim=-1) - mass                         # [T, k] mass ranked above
    by_mass = (before < p).sum(dim=-1)                          # [T] smallest prefix >= p
    return by_mass.clamp_min(max(k0, 1))


def oea_kept(weights: torch.Tensor, ids: torch.Tensor, num_experts: int, top_k: int, k0: int,
             p: float | None, max_p: int) -> torch.Tensor:
    """[T, K] rank-sorted candidates -> [T, K] bool: baseline slots plus piggybacked slots."""
    slots = torch.arange(ids.shape[1], device=ids.device)[None, :]          # [1, K]
    baseline = slots < baseline_sizes(weights, top_k, k0, p)[:, None]      # [T, K]
    loaded = expert_mask(torch.where(baseline, ids, ids[:, :1]), num_experts)   # [E]
    return baseline | ((slots < max_p) & loaded[ids])


@register("oea")
def select_oea(router_logits: torch.Tensor, top_k: int, policy: OEA, *,
               scoring: str = "softmax", renormalize: bool = True,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """OEA routing: baseline + piggybacking, at most top_k experts per token, best first.

    Promise: the batch loads exactly the union of the baselines; a token keeps its baseline.
    """
    scores = gate_scores(router_logits, scoring)                # [T, E]
    max_p = top_k if policy.max_p is None else policy.max_p
    width = min(max(top_k, max_p), scores.shape[1])
    weights, ids = scores.topk(width, dim=-1)                   # [T, K] rank-sorted candidates
    kept = oea_kept(weights, ids, scores.shape[1], top_k, policy.k0, policy.p, max_p)
    return compact(weights, ids, kept, top_k, renormalize)

"""Lynx: dynamic, batch-aware expert reduction in decode.

Gupta et al., "Lynx: Enabling Efficient MoE Inference through Dynamic Batch-Aware Expert
Selection" (arXiv 2411.08982). In decode, each expert's importance to a batch is its vote count:
how many tokens route to it (Sec. 3). Both variants run in decode only; prefill batches keep the
plain router (the policies are `decode_only`, applied by `select_experts`).

- Lynx-Lat: drop the `drop` least-voted of the batch's active experts per layer; tokens routed to
  a dropped expert are remapped to their next-best kept expert, i.e. each token uses its top-k
  inside the kept set.
- Lynx-Acc: the same, but the primary (top-1) expert of every high-confidence token is never
  dropped, so those tokens keep their primary expert and only the rest are remapped.

Choices where the paper leaves room: vote ties drop the expert with the lower summed gating
score first, then the lower index; at least one active expert always stays; a token's
confidence is its top-1 weight normalised over its top-k weights (comparable across softmax and
sigmoid scoring), compared with `conf`.
"""

from __future__ import annotations

import torch

from moe_cohort.engine.policy import LynxAcc, LynxLat
from moe_cohort.engine.selection.base import gate_scores, register, route_within
from moe_cohort.engine.selection.sets import expert_votes, lex_rank


def lynx_kept(scores: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, drop: int,
              conf: float | None) -> torch.Tensor:
    """[T, E] scores, [T, k] top-k -> [E] bool experts kept after dropping the least voted.

    conf None: Lynx-Lat; otherwise Lynx-Acc, which protects the primary experts of tokens whose
    normalised top-1 weight is >= conf. Promise: kept = active - min(drop, droppable,
    active - 1) experts.
    """
    num_experts = scores.shape[1]
    votes = expert_votes(ids, num_experts)                      # [E]
    active = votes > 0
    droppable = active
    if conf is not None:
        top1 = weights[:, 0] / weights.sum(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
        protected = votes.new_zeros(num_experts).index_add(0, ids[:, 0], (top1 >= conf).long())
        droppable = active & (protected == 0)
    n_drop = torch.minimum(droppable.sum(), active.sum() - 1).clamp(min=0, max=drop)
    rank = lex_rank([votes, scores.sum(dim=0)], droppable)     # [E] fewest votes first
    return active & ~(droppable & (rank < n_drop))


def _select(router_logits: torch.Tensor, top_k: int, drop: int, conf: float | None,
            scoring: str, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    scores = gate_scores(router_logits, scoring)                # [T, E]
    weights, ids = scores.topk(top_k, dim=-1)                   # [T, k]
    kept = lynx_kept(scores, weights, ids, drop, conf)          # [E]
    return route_within(scores, kept, top_k, renormalize)


@register("lynx-lat")
def select_lynx_lat(router_logits: torch.Tensor, top_k: int, policy: LynxLat, *,
                    scoring: str = "softmax", renormalize: bool = True,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Lynx-Lat: drop the `drop` least-voted experts; remap their tokens inside the kept set."""
    return _select(router_logits, top_k, policy.drop, None, scoring, renormalize)


@register("lynx-acc")
def select_lynx_acc(router_logits: torch.Tensor, top_k: int, policy: LynxAcc, *,
                    scoring: str = "softmax", renormalize: bool = True,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Lynx-Acc: as Lynx-Lat, but confident tokens' primary experts are never dropped."""
    return _select(router_logits, top_k, policy.drop, policy.conf, scoring, renormalize)

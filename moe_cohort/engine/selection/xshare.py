"""XShare: batch-aware expert selection as a modular objective.

Vankov et al., "XShare: Collaborative in-Batch Expert Sharing for Faster MoE Inference"
(arXiv 2602.07265). Per layer, the value of loading expert e for a batch is its summed gating
score over the batch's tokens, agg_e = sum_t g[t, e]; the objective sum_{e in S} agg_e is modular,
so a greedy pick by agg_e is optimal under a cardinality budget. Every variant below:

1. warm-up: S starts as the union of every token's top-k0 experts (each token's best k0 are
   guaranteed; if that union exceeds the budget it is kept whole, the paper's order of steps);
2. fill: add experts in descending agg_e until the budget is reached;
3. refine: each token is routed to its top-k experts inside S (fewer if |S| < top_k).

Choices where the paper leaves room (documented per function): the threshold form compares the
summed score agg_e with tau; spans without a request are one-token requests; S is never empty.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moe_cohort.engine.policy import XShare, XShareEP, XShareSpec
from moe_cohort.engine.selection.base import gate_scores, register, request_ids, route_within
from moe_cohort.engine.selection.sets import ensure_nonempty, fill_to_budget, lex_rank, warmup_mask


def xshare_set(scores: torch.Tensor, k0: int, m: int | None, tau: float | None) -> torch.Tensor:
    """[T, E] scores -> [E] bool selected experts S (Alg. 2; Alg. 1 threshold form).

    Alg. 2: warm-up top-k0, fill by agg_e to m. Threshold form (Alg. 1): the Lagrangian of the
    budget, max sum_{e in S} (agg_e - tau), keeps every expert with agg_e >= tau; tau is in units
    of summed gating score, i.e. the score mass an expert must attract to be worth its load. With
    both m and tau, fill candidates must pass tau and the budget caps them. S is never empty.
    """
    agg = scores.sum(dim=0)                                     # [E]
    warm = warmup_mask(scores, k0)                              # [E]
    fill = torch.ones_like(warm) if tau is None else agg >= tau
    if m is None:
        selected = warm | fill
    else:
        selected = fill_to_budget(warm[None], fill[None], agg[None], m)[0]
    return ensure_nonempty(selected, agg)


@register("xshare")
def select_xshare(router_logits: torch.Tensor, top_k: int, policy: XShare, *,
                  scoring: str = "softmax", renormalize: bool = True,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """XShare Alg. 2 / Alg. 1: each token's top-k inside the batch's selected set S.

    Promise: |S| <= max(m, |warm-up union|); every token keeps its top-k0 experts.
    """
    scores = gate_scores(router_logits, scoring)                # [T, E]
    selected = xshare_set(scores, policy.k0, policy.m, policy.tau)
    return route_within(scores, selected, top_k, renormalize)


def request_stage(scores: torch.Tensor, rid: torch.Tensor, num_requests: int, k0: int,
                  mr: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Alg. 3, every request at once: ([R, E] request sets, [R, E] warm-ups, [R, E] scores).

    Request r's set: the warm-up of its tokens' top-k0, filled by r's summed score to mr
    (mr None: every expert).
    """
    num_experts = scores.shape[1]
    agg_r = scores.new_zeros(num_requests, num_experts).index_add(0, rid, scores)   # [R, E]
    warm_r = torch.zeros(num_requests, num_experts, dtype=torch.bool, device=scores.device)
    if k0 > 0:
        ids0 = scores.topk(k0, dim=-1).indices                                      # [T, k0]
        warm_r = warm_r.index_put((rid[:, None].expand_as(ids0), ids0),
                                  torch.ones_like(ids0, dtype=torch.bool))
    everything = torch.ones_like(warm_r)
    sets = everything if mr is None else fill_to_budget(warm_r, everything, agg_r, mr)
    return sets, warm_r, agg_r


def xshare_spec_allowed(scores: torch.Tensor, rid: torch.Tensor, num_requests: int, k0: int,
                        mr: int | None, m: int | None) -> torch.Tensor:
    """[T, E] scores, [T] request ids -> [T, E] bool: the experts each token may use (Alg. 3-4).

    Alg. 4 (batch): the union of the request sets is the candidate pool; warm-up with every
    token's top-k0, fill by the batch's summed score to m. A token may use the experts of its
    request's set that survive the batch stage; if none do (possible only with k0 = 0) it may use
    the batch set, so every token keeps an expert and the batch stays within S.
    """
    sets, warm_r, agg_r = request_stage(scores, rid, num_requests, k0, mr)           # [R, E]
    pool, warm, agg = sets.any(dim=0), warm_r.any(dim=0), agg_r.sum(dim=0)          # [E]
    batch_set = pool if m is None else fill_to_budget(warm[None], pool[None], agg[None], m)[0]
    batch_set = ensure_nonempty(batch_set, agg)
    allowed = sets[rid] & batch_set[None, :]                                         # [T, E]
    if k0 > 0:   # a token's top-k0 lies in its request's and the batch's warm-up: never empty
        return allowed
    return allowed | (~allowed.any(dim=-1, keepdim=True) & batch_set[None, :])


@register("xshare-spec")
def select_xshare_spec(router_logits: torch.Tensor, top_k: int, policy: XShareSpec, *,
                       request_spans: Sequence[tuple[int, int]] | None = None,
                       scoring: str = "softmax", renormalize: bool = True,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """XShare Alg. 3-4 (speculative decoding): per-request budget mr, then batch budget m.

    request_spans: the requests' token ranges (a request's draft tokens are contiguous); None
    means one request. Promise: batch union <= max(m, warm-up union); a request's tokens use
    <= max(mr, its warm-up union) experts when k0 >= 1.
    """
    scores = gate_scores(router_logits, scoring)                # [T, E]
    rid, num_requests = request_ids(scores.shape[0], request_spans, scores.device)   # [T]
    allowed = xshare_spec_allowed(scores, rid, num_requests, policy.k0, policy.mr, policy.m)
    return route_within(scores, allowed, top_k, renormalize)


def xshare_ep_set(scores: torch.Tensor, groups: torch.Tensor, k0: int, mg: int) -> torch.Tensor:
    """[T, E] scores, [E] GPU of each expert -> [E] bool selected experts (Alg. 5-6).

    Alg. 5-6 fill GPU by GPU in turn, each turn adding a GPU's best remaining expert by agg_e,
    until every GPU holds mg experts; this bounds the maximum per-GPU load by max(mg, that GPU's
    warm-up count). Because each GPU's picks depend only on its own experts, the turn order does
    not change the final set, which is each GPU's top (mg - |warm-up on it|) experts by agg_e,
    computed here for all GPUs at once.
    """
    agg = scores.sum(dim=0)                                     # [E]
    warm = warmup_mask(scores, k0)                              # [E]
    same_gpu = groups[None, :] == groups[:, None]               # [E, E]
    room = (mg - (same_gpu & warm[None, :]).sum(dim=-1)).clamp_min(0)   # [E] room on e's GPU
    rank = lex_rank([-agg], ~warm, groups)                      # [E] rank on e's GPU
    return ensure_nonempty(warm | (~warm & (rank < room)), agg)


@register("xshare-ep")
def select_xshare_ep(router_logits: torch.Tensor, top_k: int, policy: XShareEP, *,
                     expert_groups: Sequence[int] | torch.Tensor | None = None,
                     scoring: str = "softmax", renormalize: bool = True,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """XShare Alg. 5-6 (expert parallelism): at most mg experts per GPU beyond the warm-up.

    expert_groups: [E] GPU index of every expert; None means one GPU (then this equals xshare
    with m = mg). Promise: experts on GPU g <= max(mg, warm-up experts on g).
    """
    scores = gate_scores(router_logits, scoring)                # [T, E]
    groups = expert_group_tensor(expert_groups, scores.shape[1], scores.device)
    selected = xshare_ep_set(scores, groups, policy.k0, policy.mg)
    return route_within(scores, selected, top_k, renormalize)


def expert_group_tensor(expert_groups: Sequence[int] | torch.Tensor | None, num_experts: int,
                        device: torch.device) -> torch.Tensor:
    """Expert -> GPU map as an [E] int64 tensor; None is a single GPU."""
    if expert_groups is None:
        return torch.zeros(num_experts, dtype=torch.int64, device=device)
    groups = torch.as_tensor(expert_groups, dtype=torch.int64, device=device)
    if groups.shape != (num_experts,):
        raise ValueError(f"expert_groups must have one GPU index per expert ({num_experts}), "
                         f"got shape {tuple(groups.shape)}")
    return groups

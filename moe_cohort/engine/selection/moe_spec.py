"""MoE-Spec: a hard per-layer expert budget for speculative-decoding verification.

McDanel et al., "MoE-Spec: Expert Budgeting for Efficient Speculative Decoding"
(arXiv 2602.16052), Sec. 3. The verification batch may load at most B experts per layer:

- ranking (Sec. 3.1, Alg. 1): `rank=router` scores each expert by its aggregate routing
  probability over the batch's tokens, sum_t p[t, e]; `rank=topk` (an option, not the paper's)
  sums only each token's top-k weights, the mass the batch actually routes; `rank=static` uses
  a ranking counted offline on calibration data (`calib` file);
- selection: the top-B experts by that ranking;
- coverage (Sec. 3.2): `cover=truncate` drops a token's experts outside the budget (the token
  keeps the rest); `cover=substitute` replaces each missing expert with the token's next-best
  expert inside the budget (its top-k within the budget set).

Choices where the paper leaves room: every ranking considers only experts some token selects,
so the budget is never spent on an expert nobody uses and |S| <= min(B, union of top-k). A token
whose top-k lies wholly outside the budget under truncation would keep no expert; it keeps its
best expert inside the budget instead (every token keeps >= 1 expert; the union stays <= B).

Calibration file (`calib`): JSON, either a list or {"counts": ...}, holding [E] counts (one
ranking for every layer) or [L, E] (one per layer; then `layer` must be given).
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import torch

from moe_cohort.engine.policy import MoESpec
from moe_cohort.engine.selection.base import compact, gate_scores, register, route_within
from moe_cohort.engine.selection.sets import expert_mask, lex_rank

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=16)
def load_calibration(path: str) -> torch.Tensor:
    """Read a calibration count file -> [E] or [L, E] float32 counts (cached per path)."""
    with Path(path).open(encoding="utf-8") as handle:
        data = json.load(handle)
    counts = torch.tensor(data["counts"] if isinstance(data, dict) else data, dtype=torch.float32)
    if counts.dim() not in (1, 2) or counts.numel() == 0 or bool((counts < 0).any()):
        raise ValueError(f"{path}: counts must be a non-empty [E] or [L, E] array of numbers >= 0")
    logger.info("loaded expert calibration counts %s from %s", tuple(counts.shape), path)
    return counts


@torch.compiler.assume_constant_result
def static_ranking(path: str, layer: int | None, num_experts: int) -> torch.Tensor:
    """The [E] calibration counts for one layer of a count file.

    A compile-time constant under torch.compile: the file is read eagerly, not traced.
    """
    counts = load_calibration(path)
    if counts.dim() == 2:
        if layer is None or not 0 <= layer < counts.shape[0]:
            raise ValueError(f"{path} holds counts for {counts.shape[0]} layers; "
                             f"pass layer in 0..{counts.shape[0] - 1}, got {layer}")
        counts = counts[layer]
    if counts.shape[0] != num_experts:
        raise ValueError(f"{path} has counts for {counts.shape[0]} experts, the router has {num_experts}")
    return counts


def moe_spec_route(scores: torch.Tensor, top_k: int, budget: int, substitute: bool,
                   static: torch.Tensor | None, renormalize: bool,
                   topk_mass: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] scores -> (weights, ids) with at most `budget` distinct experts in the batch.

    static: [E] calibration counts for `rank=static`; None ranks by the batch's summed routing
    probabilities (`rank=router`), or with topk_mass by its summed top-k weights (`rank=topk`).
    Ranking ties go to the lower expert index.
    """
    num_experts = scores.shape[1]
    weights, ids = scores.topk(top_k, dim=-1)                   # [T, k]
    used = expert_mask(ids, num_experts)                        # [E]
    if static is None and topk_mass:
        static = scores.new_zeros(num_experts).index_add(0, ids.reshape(-1), weights.reshape(-1))
    elif static is None:
        static = scores.sum(dim=0)                              # [E] aggregate probability
    rank = lex_rank([-static.to(scores)], used)                 # [E] ties: lower index first
    budget_set = used & (rank < budget)                         # [E]
    if substitute:
        return route_within(scores, budget_set, top_k, renormalize)
    kept = budget_set[ids]                                      # [T, k]
    best = scores.masked_fill(~budget_set, -1.0).argmax(dim=-1, keepdim=True)   # [T, 1] fallback
    ids = torch.cat([ids, best], dim=-1)                        # [T, k + 1], still rank-sorted
    weights = torch.cat([weights, scores.gather(1, best)], dim=-1)
    kept = torch.cat([kept, ~kept.any(dim=-1, keepdim=True)], dim=-1)
    return compact(weights, ids, kept, top_k, renormalize)


@register("moe-spec")
def select_moe_spec(router_logits: torch.Tensor, top_k: int, policy: MoESpec, *,
                    scoring: str = "softmax", renormalize: bool = True, layer: int | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE-Spec: budget B per layer; promise: the batch uses <= B distinct experts."""
    scores = gate_scores(router_logits, scoring)                # [T, E]
    static = None
    if policy.rank == "static":
        static = static_ranking(policy.calib, layer, scores.shape[1]).to(scores.device)
    return moe_spec_route(scores, top_k, policy.budget, policy.cover == "substitute", static,
                          renormalize, topk_mass=policy.rank == "topk")

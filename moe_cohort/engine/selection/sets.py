"""Expert-set primitives over [E] or [R, E] boolean masks, shared by the selectors.

All of them are tensor ops without data-dependent shapes, so they trace under
`torch.compile(fullgraph=True)`.
"""

from __future__ import annotations

import torch


def expert_mask(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, j] expert ids -> [E] bool: the experts any token uses."""
    mask = torch.zeros(num_experts, dtype=torch.bool, device=ids.device)
    return mask.index_fill(0, ids.reshape(-1), True)


def expert_votes(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, j] expert ids -> [E] int64: how many token slots choose each expert."""
    flat = ids.reshape(-1)
    votes = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    return votes.scatter_add(0, flat, torch.ones_like(flat))


def warmup_mask(scores: torch.Tensor, k0: int) -> torch.Tensor:
    """[T, E] scores -> [E] bool: the union of every token's top-k0 experts (empty if k0 = 0)."""
    if k0 == 0:
        return torch.zeros(scores.shape[1], dtype=torch.bool, device=scores.device)
    return expert_mask(scores.topk(k0, dim=-1).indices, scores.shape[1])


def ensure_nonempty(selected: torch.Tensor, aggregate: torch.Tensor) -> torch.Tensor:
    """[E] bool set -> the same set, or {argmax aggregate} if it was empty."""
    best = torch.zeros_like(selected).index_fill(0, aggregate.argmax().reshape(1), True)
    return selected | (best & ~selected.any())


def fill_to_budget(base: torch.Tensor, candidates: torch.Tensor, score: torch.Tensor,
                   budget: int) -> torch.Tensor:
    """Per row, add the best-scoring candidates to `base` until the row holds `budget` experts.

    base, candidates [R, E] bool; score [R, E] >= 0. A row already holding >= budget experts
    keeps exactly `base`. Returns [R, E] bool.
    """
    width = min(budget, base.shape[-1])
    room = (budget - base.sum(dim=-1, keepdim=True)).clamp_min(0)        # [R, 1]
    fresh = candidates & ~base                                            # [R, E]
    order = score.masked_fill(~fresh, -1.0).topk(width, dim=-1).indices  # [R, w] best first
    slots = torch.arange(width, device=base.device)
    take = (slots[None, :] < room) & fresh.gather(-1, order)             # [R, w]
    return base | torch.zeros_like(base).scatter(-1, order, take)


def lex_rank(keys: list[torch.Tensor], candidates: torch.Tensor,
             groups: torch.Tensor | None = None) -> torch.Tensor:
    """[E] rank of each candidate among the candidates (of its group) in ascending key order.

    keys: [E] tensors, most significant first; remaining ties go to the lower index. Ranks of
    non-candidates are >= the number of candidates in their group (they sort last). Stable
    argsorts from the least significant key up, so no data-dependent shapes.
    """
    order = torch.arange(candidates.shape[0], device=candidates.device)    # [E] index order
    significance = [(~candidates).to(torch.int8), *keys]                 # most significant first
    if groups is not None:
        significance = [groups] + significance
    for key in reversed(significance):
        order = order[torch.argsort(key[order], stable=True)]
    position = torch.arange(order.shape[0], device=order.device)
    if groups is not None:
        sorted_groups = groups[order]                                       # [E] by group
        first = torch.ones_like(sorted_groups, dtype=torch.bool)
        first[1:] = sorted_groups[1:] != sorted_groups[:-1]
        starts = torch.where(first, position, torch.zeros_like(position)).cummax(dim=0).values
        position = position - starts                                        # rank in group
    return torch.empty_like(position).scatter(0, order, position)

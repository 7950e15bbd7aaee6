"""Table-driven routing in torch: every policy's decision from numbers in device tensors.

`route_tables(logits, top_k, tables)` routes a batch whose tokens carry policy slots
(`engine.selection.table`). It makes the same decisions as the per-policy selectors
(`engine.selection.xshare`, `oea`, `lynx`, `moe_spec`; see their docstrings for the papers), but
reads every parameter (k0, m, tau, budgets, drop, conf, ...) from `tables.params`, so under
`torch.compile(fullgraph=True)` or a CUDA graph new parameters need no re-trace. It is the CPU
twin of the Triton kernels (`engine.selection.triton_kernels`) and the reference they are
tested against. Every policy slot is computed for every kind and the token's kind picks one
(P is small); shapes are static, there is no host synchronisation.
"""

from __future__ import annotations

import torch

from moe_cohort.engine.selection.base import finish, gate_scores
from moe_cohort.engine.selection.table import (
    BUDGET, CONF, DROP, K0, KEEP, KIND, LYNX, M, MAXP, MG, MOE_SPEC, MR, OEA_KIND, P,
    RANK, SUBST, TAU, XSHARE, XSHARE_EP, XSHARE_SPEC, RoutingTables,
)


def token_ranks(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] scores -> ([T, E] rank of every expert, [T, E] scores sorted); ties: lower index first."""
    values, order = scores.sort(dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order).scatter_(1, order, torch.arange(scores.shape[1], device=scores.device).expand_as(order))
    return ranks, values


def pair_rank(key: torch.Tensor, key2: torch.Tensor, candidates: torch.Tensor,
              groups: torch.Tensor | None = None) -> torch.Tensor:
    """[P, E] rank of each expert among the candidates (of its group) by ascending (key, key2, index)."""
    index = torch.arange(key.shape[-1], device=key.device)
    a, b = key[:, None, :], key[:, :, None]                      # [P, 1, E] others, [P, E, 1] self
    a2, b2 = key2[:, None, :], key2[:, :, None]
    before = (a < b) | ((a == b) & ((a2 < b2) | ((a2 == b2) & (index[None, :] < index[:, None]))))
    before = before & candidates[:, None, :]                     # [P, E, E]
    if groups is not None:
        before = before & (groups[None, :] == groups[:, None])
    return before.sum(dim=-1)                                    # [P, E]


def fill(warm: torch.Tensor, candidates: torch.Tensor, score: torch.Tensor,
         budget: torch.Tensor) -> torch.Tensor:
    """[P, E]: warm plus the best-scoring fresh candidates until each row holds `budget` [P]."""
    fresh = candidates & ~warm
    room = budget[:, None] - warm.sum(dim=-1, keepdim=True)      # [P, 1]
    return warm | (fresh & (pair_rank(-score, torch.zeros_like(score), fresh) < room))


def nonempty(selected: torch.Tensor, agg: torch.Tensor) -> torch.Tensor:
    """[P, E] sets; an empty row becomes {argmax agg} (lower index on ties)."""
    best = torch.zeros_like(selected).scatter_(1, agg.argmax(dim=-1, keepdim=True), True)
    return selected | (best & ~selected.any(dim=-1, keepdim=True))


def request_sets(scores, warm_t, tables: RoutingTables) -> torch.Tensor:
    """[R, E] XShare-spec request sets (Alg. 3): warm-up of its tokens filled by its score to mr."""
    num_requests = tables.req_start.shape[0]
    rid = tables.rid.long()
    agg_r = scores.new_zeros(num_requests, scores.shape[1]).index_add(0, rid, scores)
    warm_r = scores.new_zeros(agg_r.shape).index_add(0, rid, warm_t.float()) > 0
    mr = tables.params[tables.pid[tables.req_start.long()].long(), MR]          # [R]
    return fill(warm_r, torch.ones_like(warm_r), agg_r, mr)


def slot_sets(stats: dict[str, torch.Tensor], prm: torch.Tensor, static: torch.Tensor,
              groups: torch.Tensor) -> torch.Tensor:
    """[P, E] bool: each slot's batch set S by its kind (OEA: the experts its baselines load)."""
    agg, warm, votes = stats["agg"], stats["warm"], stats["votes"]
    kind, zero = prm[:, KIND, None], torch.zeros_like(agg)
    xshare = nonempty(fill(warm, agg >= prm[:, TAU, None], agg, prm[:, M]), agg)
    spec = nonempty(fill(warm, stats["pool"], agg, prm[:, M]), agg)
    same_gpu_warm = ((groups[None, :] == groups[:, None])[None] & warm[:, None, :]).sum(-1)   # [P, E]
    room = prm[:, MG, None] - same_gpu_warm
    ep = nonempty(warm | (~warm & (pair_rank(-agg, zero, ~warm, groups) < room)), agg)
    active = votes > 0
    droppable = active & ((prm[:, CONF, None] < 0) | (stats["prot"] == 0))
    n_drop = torch.minimum(torch.minimum(prm[:, DROP], droppable.sum(-1).float()),
                           active.sum(-1).float() - 1).clamp_min(0)
    lynx = active & ~(droppable & (pair_rank(votes, agg, droppable) < n_drop[:, None]))
    key = torch.where(prm[:, RANK, None] == 0, agg, torch.where(prm[:, RANK, None] == 1, stats["wsum"], static))
    spec_budget = active & (pair_rank(-key, zero, active) < prm[:, BUDGET, None])
    sets = torch.ones_like(warm)
    for code, chosen in ((XSHARE, xshare), (XSHARE_SPEC, spec), (XSHARE_EP, ep), (OEA_KIND, stats["loaded"]),
                         (LYNX, lynx), (MOE_SPEC, spec_budget)):
        sets = torch.where(kind == code, chosen, sets)
    return sets


def oea_baseline(values: torch.Tensor, top_k: int, k0: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """[T] OEA baseline size: max(k0, 1), or with p >= 0 the top-k mass prefix reaching p."""
    head = values[:, :top_k]                                     # [T, k]
    before = head.cumsum(dim=-1) - head
    by_mass = (before < p[:, None] * head.sum(dim=-1, keepdim=True)).sum(dim=-1)
    floor = k0.clamp_min(1)
    return torch.where(p < 0, floor, torch.maximum(by_mass.float(), floor))


def route_tables(router_logits: torch.Tensor, top_k: int, tables: RoutingTables, *,
                 scoring: str = "softmax", renormalize: bool = True,
                 router: tuple[torch.Tensor, torch.Tensor] | None = None,
                 scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> ([T, top_k] float32 weights, [T, top_k] int64 ids), per-token policies.

    router: the router's (weights, ids) [T, k], kept for KEEP-slot tokens (else plain top-k);
    scale multiplies the weights of the other tokens.
    """
    weights, ids = _route(router_logits, top_k, tables, scoring, renormalize)
    if router is None and scale == 1.0:
        return weights, ids
    keep = tables.params[tables.pid.long(), KIND, None] == KEEP                     # [T, 1]
    if router is None:
        return torch.where(keep, weights, weights * scale), ids
    return (torch.where(keep, router[0].float(), weights * scale),
            torch.where(keep, router[1].long(), ids))


def _route(router_logits, top_k, tables, scoring, renormalize):
    scores = gate_scores(router_logits, scoring)                 # [T, E]
    ranks, values = token_ranks(scores)
    prm = tables.params[tables.pid.long()]                       # [T, NCOL]
    kind = prm[:, KIND, None]
    in_top, warm_t = ranks < top_k, ranks < prm[:, K0, None]
    base_t = ranks < oea_baseline(values, top_k, prm[:, K0], prm[:, P])[:, None]
    total = values[:, :top_k].sum(dim=-1)
    confident = (prm[:, CONF] >= 0) & (values[:, 0] >= prm[:, CONF] * total)
    reqset = request_sets(scores, warm_t, tables)[tables.rid.long()] if tables.has_requests \
        else torch.ones_like(in_top)                                                 # [T, E]
    onehot = torch.nn.functional.one_hot(tables.pid.long(), tables.params.shape[0]).float().T   # [P, T]
    stats = {"agg": onehot @ scores, "warm": onehot @ warm_t.float() > 0, "votes": onehot @ in_top.float(),
             "wsum": onehot @ (scores * in_top), "prot": onehot @ (confident[:, None] & (ranks == 0)).float(),
             "loaded": onehot @ base_t.float() > 0, "pool": onehot @ reqset.float() > 0}
    sets = slot_sets(stats, tables.params, tables.static, tables.groups)[tables.pid.long()]   # [T, E]
    spec = reqset & sets
    spec = torch.where(spec.any(-1, keepdim=True), spec, sets)
    oea = base_t | ((ranks < prm[:, MAXP, None]) & sets)
    truncated = in_top & sets
    cut = (prm[:, SUBST, None] == 0) & truncated.any(-1, keepdim=True)
    moe_spec = torch.where(cut, truncated, sets)
    cap = torch.where((kind == MOE_SPEC) & (prm[:, SUBST, None] == 0) & ~cut, 1, top_k)      # [T, 1]
    allowed = torch.where(kind == XSHARE_SPEC, spec, torch.where(kind == OEA_KIND, oea, sets))
    allowed = torch.where(kind == MOE_SPEC, moe_spec, allowed)
    allowed = torch.where(kind == KEEP, torch.ones_like(allowed), allowed)
    weights, ids = scores.masked_fill(~allowed, -1.0).sort(dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]            # [T, k]
    used = allowed.gather(1, ids) & (torch.arange(top_k, device=ids.device)[None, :] < cap)
    return finish(weights, ids, used, renormalize)

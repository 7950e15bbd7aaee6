"""Batch-aware expert selectors re-stated over traces: per step and MoE layer, which experts a cut keeps.

In the replay (eval.replay) a decode step of an engine kept full runs S resident tokens, each with its
top-k experts per layer as the traces hold them. A selector cuts the step's expert set per layer; what
a cut costs is its fidelity, the share of (token, expert) routings of the traces it removes, and what
it buys is the experts loaded. These are the rules of engine/selection (torch, the engine's) in numpy,
over what traces hold: each token's top-k ids in the order the trace lists them, and router weights
where present (else each routing weighs 1, so summed weight is a vote count). Only experts some token
chose are candidates (a trace has no score for the others), so a set never holds an expert nobody uses.

- XShare (`xshare_cut`, m, k0): warm-up with the union of every token's first k0 experts (kept whole
  if it exceeds m), then fill to m by summed weight over the step's tokens.
- OEA (`oea_cut`, k0): every token keeps its first k0 experts; the step loads their union; a token also
  keeps any other of its top-k experts in that union (piggybacking).
- MoE-Spec (`moe_spec_cut`, m): a hard budget of the m experts of highest summed weight; a token's
  experts outside it are dropped (truncation).
- Lynx-Lat (`lynx_cut`, drop): drop the `drop` least-voted of the step's experts (ties: the lower summed
  weight, then the lower index), keeping at least one.

Ranking ties go to the lower expert index. Every cut maps ids [G, T, k] (G groups = (step, layer), T
tokens each; ids < 0 are no routing) to `Cut`: the kept expert set [G, E] and the kept routings
[G, T, k]. `step_choices` gathers the ids of a replay's full steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_cohort.eval.replay import DecodeTokens, Replay


@dataclass(frozen=True)
class Cut:
    """What a selector keeps per (step, layer) group."""

    experts: np.ndarray  # [G, E] bool: the experts loaded
    routings: np.ndarray  # [G, T, k] bool: the (token, expert) routings kept

    @property
    def loads(self) -> int:
        return int(self.experts.sum())

    @property
    def kept(self) -> int:
        return int(self.routings.sum())


def step_choices(experts: np.ndarray, tokens: DecodeTokens, run: Replay, lengths: np.ndarray,
                 slots: int) -> np.ndarray:  # [F * L, S, k]
    """Expert ids of every resident token of the replay's steps with all `slots` slots busy (one engine):
    group g = step * L + layer; ids -1 where a request has no decode token. `experts` [T, L, k] are the
    trace's ids, in the rows `tokens` reads (eval.replay.decode_tokens of the same trace set)."""
    lengths = np.asarray(lengths, np.int64)
    req = np.repeat(np.arange(len(lengths)), lengths)  # [tokens] request of each generated token
    local = np.arange(len(req)) - np.repeat(np.cumsum(lengths) - lengths, lengths)  # [tokens] its decode step
    step = run.start[req] + local  # [tokens]
    full = np.bincount(step) == slots  # [steps]
    keep = full[step]
    order = np.lexsort((req[keep], step[keep]))
    req, local = req[keep][order].reshape(-1, slots), local[keep][order].reshape(-1, slots)  # [F, S]
    rows = tokens.base[req] + local % tokens.cycle[req]  # [F, S]
    padded = np.concatenate([experts.astype(np.int64), np.full((1,) + experts.shape[1:], -1, np.int64)])
    ids = padded[np.minimum(rows, len(experts))]  # [F, S, L, k]; row T (no token) reads -1
    return ids.transpose(0, 2, 1, 3).reshape(-1, slots, experts.shape[2])  # [F * L, S, k]


def summed(ids: np.ndarray, num_experts: int, weights: np.ndarray | None = None) -> np.ndarray:  # [G, E]
    """Per group, each expert's summed routing weight (votes when `weights` is None)."""
    g = ids.shape[0]
    valid = ids >= 0  # [G, T, k]
    cell = (np.arange(g)[:, None, None] * num_experts + np.where(valid, ids, 0))[valid]
    w = np.ones(cell.shape) if weights is None else weights[valid].astype(np.float64)
    return np.bincount(cell, weights=w, minlength=g * num_experts).reshape(g, num_experts)


def union(ids: np.ndarray, num_experts: int) -> np.ndarray:  # [G, E] bool
    """Per group, the experts any listed routing uses."""
    return summed(ids, num_experts) > 0


def _ranks(*keys: np.ndarray) -> np.ndarray:  # [G, E] rank of each expert, ascending keys (most significant first)
    g, e = keys[0].shape
    order = np.lexsort((np.broadcast_to(np.arange(e), (g, e)), *reversed(keys)), axis=-1)  # [G, E]
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(e)[None, :].repeat(g, 0), axis=-1)
    return rank


def _cut(ids: np.ndarray, experts: np.ndarray) -> Cut:
    g = np.arange(ids.shape[0])[:, None, None]
    return Cut(experts, (ids >= 0) & experts[g, np.maximum(ids, 0)])


def xshare_cut(ids: np.ndarray, num_experts: int, m: int, k0: int = 1, weights: np.ndarray | None = None) -> Cut:
    """XShare (Alg. 2): warm-up of the first k0 experts of every token, filled to m by summed weight."""
    agg = summed(ids, num_experts, weights)  # [G, E]
    warm = union(ids[:, :, :k0], num_experts)  # [G, E]
    chosen = agg > 0
    rank = _ranks(~chosen, ~warm, -agg)  # warm-up first, then by summed weight
    size = np.maximum(m, warm.sum(-1))  # [G]
    return _cut(ids, chosen & (rank < size[:, None]))


def moe_spec_cut(ids: np.ndarray, num_experts: int, m: int, weights: np.ndarray | None = None) -> Cut:
    """MoE-Spec (truncation): the m experts of highest summed weight; routings outside are dropped."""
    agg = summed(ids, num_experts, weights)  # [G, E]
    chosen = agg > 0
    return _cut(ids, chosen & (_ranks(~chosen, -agg) < m))


def oea_cut(ids: np.ndarray, num_experts: int, k0: int) -> Cut:
    """OEA: the union of every token's first k0 experts, and each token's routings inside it."""
    return _cut(ids, union(ids[:, :, :k0], num_experts))


def lynx_cut(ids: np.ndarray, num_experts: int, drop: int, weights: np.ndarray | None = None) -> Cut:
    """Lynx-Lat: the step's experts less the `drop` least voted (at least one kept)."""
    votes = summed(ids, num_experts)  # [G, E]
    agg = votes if weights is None else summed(ids, num_experts, weights)
    active = votes > 0
    n_drop = np.clip(np.minimum(drop, active.sum(-1) - 1), 0, None)  # [G]
    rank = _ranks(~active, votes, agg)  # fewest votes first, then lower summed weight, then lower index
    return _cut(ids, active & (rank >= n_drop[:, None]))


def sweep(ids: np.ndarray, num_experts: int, selector: str, params: list[int], k0: int = 1,
          weights: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:  # ([P], [P])
    """(experts loaded, routings kept) summed over the groups, for each parameter of one selector: the budget
    m of "xshare" (warm-up `k0`) and "moe-spec", the experts dropped of "lynx", k0 of "oea". One ranking
    serves every parameter; each entry equals the `Cut` of that selector and parameter."""
    valid = ids >= 0  # [G, T, k]
    g = np.arange(ids.shape[0])[:, None, None]
    if selector == "oea":
        cuts = [oea_cut(ids, num_experts, p) for p in params]
        return np.array([c.loads for c in cuts]), np.array([c.kept for c in cuts])
    agg = summed(ids, num_experts, weights)  # [G, E]
    votes = agg if weights is None else summed(ids, num_experts)
    chosen = votes > 0
    if selector == "xshare":
        warm = union(ids[:, :, :k0], num_experts)
        rank, floor = _ranks(~chosen, ~warm, -agg), warm.sum(-1)  # [G, E], [G]
    elif selector == "moe-spec":
        rank, floor = _ranks(~chosen, -agg), np.zeros(len(ids), np.int64)
    elif selector == "lynx":
        rank = _ranks(~chosen, votes, agg)
    else:
        raise ValueError(f"selector must be xshare, moe-spec, lynx or oea, got {selector!r}")
    routed = np.where(valid, rank[g, np.maximum(ids, 0)], -1)[valid]  # [routings] rank of each routing's expert
    group = np.broadcast_to(g, ids.shape)[valid]  # [routings]
    active = chosen.sum(-1)  # [G]
    loads, kept = [], []
    for p in params:
        if selector == "lynx":
            low = np.clip(np.minimum(p, active - 1), 0, None)  # [G] ranks below are dropped
            loads.append(int((active - low).sum()))
            kept.append(int((routed >= low[group]).sum()))
        else:
            size = np.maximum(p, floor)  # [G]
            loads.append(int(np.minimum(size, active).sum()))
            kept.append(int((routed < size[group]).sum()))
    return np.array(loads), np.array(kept)

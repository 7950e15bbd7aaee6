"""Brute-force, per-token, pure-Python versions of every selector, written from the papers'
step-by-step descriptions (greedy loops, sets, sorting), to compare the vectorised ones against.

Every reference takes `rows`: the [T][E] gating scores as Python floats, and returns, per token,
the list of experts it uses in descending score order. Ties go to the lower expert index.
"""

from __future__ import annotations

import torch

from moe_cohort.engine.policy import OEA, LynxAcc, LynxLat, MoESpec, Policy, XShare, XShareEP, XShareSpec


def ranking(row: list[float]) -> list[int]:
    return sorted(range(len(row)), key=lambda e: (-row[e], e))


def top_within(row: list[float], allowed: set[int], k: int) -> list[int]:
    return [e for e in ranking(row) if e in allowed][:k]


def column_sums(rows: list[list[float]], tokens: list[int] | None = None) -> list[float]:
    tokens = range(len(rows)) if tokens is None else tokens
    return [sum(rows[t][e] for t in tokens) for e in range(len(rows[0]))]


def warm_up(rows: list[list[float]], tokens: list[int], k0: int) -> set[int]:
    return {e for t in tokens for e in ranking(rows[t])[:k0]}


def greedy_fill(selected: set[int], candidates: set[int], agg: list[float], budget: int | None,
                tau: float | None = None) -> set[int]:
    """Add candidates one at a time, best summed score first, while the budget has room."""
    selected = set(selected)
    for e in sorted(candidates - selected, key=lambda e: (-agg[e], e)):
        if budget is not None and len(selected) >= budget:
            break
        if tau is None or agg[e] >= tau:
            selected.add(e)
    return selected


def nonempty(selected: set[int], agg: list[float]) -> set[int]:
    return selected or {max(range(len(agg)), key=lambda e: (agg[e], -e))}


def ref_xshare(rows, k, policy: XShare, **_):
    agg, everyone = column_sums(rows), list(range(len(rows)))
    candidates = set(range(len(agg)))
    selected = greedy_fill(warm_up(rows, everyone, policy.k0), candidates, agg, policy.m, policy.tau)
    selected = nonempty(selected, agg)
    return [top_within(row, selected, k) for row in rows]


def requests_of(num_tokens: int, spans) -> list[list[int]]:
    spans = [(0, num_tokens)] if spans is None else spans
    covered = {t for start, end in spans for t in range(start, end)}
    groups = [list(range(start, end)) for start, end in spans]
    groups += [[t] for t in range(num_tokens) if t not in covered]
    return groups


def ref_xshare_spec(rows, k, policy: XShareSpec, request_spans=None, **_):
    num_experts, requests = len(rows[0]), requests_of(len(rows), request_spans)
    request_sets, warm = {}, set()
    for tokens in requests:
        warm_r = warm_up(rows, tokens, policy.k0)
        warm |= warm_r
        chosen = greedy_fill(warm_r, set(range(num_experts)), column_sums(rows, tokens), policy.mr)
        for t in tokens:
            request_sets[t] = chosen if policy.mr is not None else set(range(num_experts))
    pool = set().union(*request_sets.values())
    agg = column_sums(rows)
    batch = nonempty(greedy_fill(warm, pool, agg, policy.m), agg)
    out = []
    for t, row in enumerate(rows):
        allowed = (request_sets[t] & batch) or batch
        out.append(top_within(row, allowed, k))
    return out


def ref_xshare_ep(rows, k, policy: XShareEP, expert_groups=None, **_):
    """Alg. 5-6 literally: GPUs take turns adding their best remaining expert until full."""
    num_experts = len(rows[0])
    groups = [0] * num_experts if expert_groups is None else list(expert_groups)
    agg = column_sums(rows)
    selected = warm_up(rows, list(range(len(rows))), policy.k0)
    progressed = True
    while progressed:
        progressed = False
        for gpu in sorted(set(groups)):
            load = sum(1 for e in selected if groups[e] == gpu)
            remaining = [e for e in range(num_experts) if groups[e] == gpu and e not in selected]
            if load < policy.mg and remaining:
                selected.add(min(remaining, key=lambda e: (-agg[e], e)))
                progressed = True
    selected = nonempty(selected, agg)
    return [top_within(row, selected, k) for row in rows]


def ref_oea(rows, k, policy: OEA, **_):
    max_p = k if policy.max_p is None else policy.max_p
    baselines = []
    for row in rows:
        ranked = ranking(row)
        size = policy.k0
        if policy.p is not None:
            head = [row[e] for e in ranked[:k]]
            total, running, by_mass = sum(head), 0.0, k
            for n, value in enumerate(head, start=1):
                running += value
                if running / total >= policy.p:
                    by_mass = n
                    break
            size = max(size, by_mass)
        baselines.append(ranked[:max(size, 1)])
    loaded = {e for base in baselines for e in base}
    out = []
    for row, base in zip(rows, baselines):
        extra = [e for e in ranking(row)[len(base):max_p] if e in loaded]
        out.append((base + extra)[:k])
    return out


def ref_lynx(rows, k, policy: LynxLat | LynxAcc, **_):
    votes = [0] * len(rows[0])
    protected = set()
    for row in rows:
        top = ranking(row)[:k]
        for e in top:
            votes[e] += 1
        if isinstance(policy, LynxAcc) and row[top[0]] / sum(row[e] for e in top) >= policy.conf:
            protected.add(top[0])
    agg = column_sums(rows)
    active = {e for e, v in enumerate(votes) if v > 0}
    droppable = sorted(active - protected, key=lambda e: (votes[e], agg[e], e))
    n_drop = max(0, min(policy.drop, len(droppable), len(active) - 1))
    kept = active - set(droppable[:n_drop])
    return [top_within(row, kept, k) for row in rows]


def ref_moe_spec(rows, k, policy: MoESpec, static=None, **_):
    tops = [ranking(row)[:k] for row in rows]
    used = {e for top in tops for e in top}
    if static is None and policy.rank == "topk":
        static = [0.0] * len(rows[0])
        for row, top in zip(rows, tops):
            for e in top:
                static[e] += row[e]
    elif static is None:      # the paper's: routing probability summed over the batch's tokens
        static = column_sums(rows)
    budget_set = set(sorted(used, key=lambda e: (-static[e], e))[:policy.budget])
    out = []
    for row, top in zip(rows, tops):
        if policy.cover == "substitute":
            out.append(top_within(row, budget_set, k))
        else:
            out.append([e for e in top if e in budget_set] or top_within(row, budget_set, 1))
    return out


def ref_topk(rows, k, policy: Policy, **_):
    return [ranking(row)[:k] for row in rows]


REFERENCES = {
    "topk": ref_topk, "xshare": ref_xshare, "xshare-spec": ref_xshare_spec,
    "xshare-ep": ref_xshare_ep, "oea": ref_oea, "lynx-lat": ref_lynx, "lynx-acc": ref_lynx,
    "moe-spec": ref_moe_spec,
}


def expected_outputs(scores: torch.Tensor, top_k: int, chosen: list[list[int]],
                     renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference experts per token -> (weights, ids) in the selector contract's layout."""
    weights = torch.zeros(scores.shape[0], top_k, dtype=torch.float64)
    ids = torch.zeros(scores.shape[0], top_k, dtype=torch.int64)
    for t, experts in enumerate(chosen):
        values = [float(scores[t, e]) for e in experts]
        total = sum(values) if renormalize else 1.0
        for slot in range(top_k):
            used = slot < len(experts)
            ids[t, slot] = experts[slot] if used else experts[0]
            weights[t, slot] = values[slot] / total if used else 0.0
    return weights, ids


def random_batches(seed: int, count: int, *, max_tokens: int = 10, max_experts: int = 14,
                   max_k: int = 4, min_k: int = 1):
    """Yield (logits [T, E], top_k) small random cases, including T = 1 and E = top_k."""
    gen = torch.Generator().manual_seed(seed)

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (), generator=gen))

    for case in range(count):
        top_k = draw(min_k, max_k)
        num_experts = top_k if case % 5 == 0 else draw(top_k, max(max_experts, top_k))
        num_tokens = 1 if case % 7 == 0 else draw(1, max_tokens)
        yield torch.randn(num_tokens, num_experts, generator=gen) * 2.0, top_k


def assert_matches_reference(logits: torch.Tensor, top_k: int, policy: Policy, *,
                             scoring: str = "softmax", renormalize: bool = True,
                             **context) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the registered selector and compare it with the brute-force reference."""
    from moe_cohort.engine.selection import SELECTORS, gate_scores

    static = context.pop("static", None)  # reference counts for moe-spec;rank=static
    weights, ids = SELECTORS[policy.name](logits, top_k, policy, scoring=scoring,
                                          renormalize=renormalize, **context)
    scores = gate_scores(logits, scoring)
    rows = scores.tolist()
    chosen = REFERENCES[policy.name](rows, top_k, policy, static=static, **context)
    want_w, want_ids = expected_outputs(scores, top_k, chosen, renormalize)
    assert torch.equal(ids, want_ids), f"{policy}: ids\n{ids}\n!= reference\n{want_ids}"
    torch.testing.assert_close(weights.double(), want_w, rtol=1e-5, atol=1e-6)
    return weights, ids

"""Policies as numbers: the per-policy parameter table that graph-safe routing reads on the device.

A CUDA graph replays kernels with the pointers it captured, so a routing call that must follow
per-request policies cannot take them as Python values. Instead every call reads:

    params   [P, NCOL] float32   one row per policy slot (`encode`), written before each step
    pid      [T] int32           each token's policy slot
    rid      [T] int32           each token's request (row of `req_start` / `req_end`)
    req_start, req_end [R] int32 request spans (XShare-spec's per-request stage)
    static   [P, E] float32      MoE-Spec calibration counts per slot (rank=static)
    groups   [E] int32           GPU of every expert (XShare-EP)

`RoutingTables` bundles them. The torch twin (`engine.selection.table_torch`) and the Triton
kernels (`engine.selection.triton_kernels`) implement the same decisions from these numbers, so
writing new numbers into the same tensors changes the decisions without re-tracing or
re-capturing. Pure torch; no Triton import.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moe_cohort.engine.policy import OEA, LynxAcc, LynxLat, MoESpec, Policy, TopK, XShare, XShareEP, XShareSpec

# kinds (column KIND)
KEEP, XSHARE, XSHARE_SPEC, XSHARE_EP, OEA_KIND, LYNX, MOE_SPEC = range(7)
# columns
KIND, K0, M, TAU, MR, MG, P, MAXP, DROP, CONF, BUDGET, RANK, SUBST = range(13)
NCOL = 13
# MoE-Spec ranking codes (column RANK)
RANK_PROBS, RANK_TOPK, RANK_STATIC = 0, 1, 2
NO_LIMIT = float(1 << 24)  # a budget no batch reaches (exact in float32)


def encode(policy: Policy, top_k: int) -> list[float]:
    """One parameter row [NCOL] for a policy (`TopK` -> KEEP: the router's own choice)."""
    row = [0.0] * NCOL
    row[TAU], row[P], row[CONF] = -math.inf, -1.0, -1.0
    row[M] = row[MR] = row[MG] = row[BUDGET] = NO_LIMIT
    row[MAXP] = float(top_k)
    if isinstance(policy, TopK):
        row[KIND] = KEEP
    elif isinstance(policy, XShare):
        row[KIND], row[K0] = XSHARE, policy.k0
        row[M] = NO_LIMIT if policy.m is None else policy.m
        row[TAU] = -math.inf if policy.tau is None else policy.tau
    elif isinstance(policy, XShareSpec):
        row[KIND], row[K0] = XSHARE_SPEC, policy.k0
        row[M] = NO_LIMIT if policy.m is None else policy.m
        row[MR] = NO_LIMIT if policy.mr is None else policy.mr
    elif isinstance(policy, XShareEP):
        row[KIND], row[K0], row[MG] = XSHARE_EP, policy.k0, policy.mg
    elif isinstance(policy, OEA):
        row[KIND], row[K0] = OEA_KIND, policy.k0
        row[P] = -1.0 if policy.p is None else policy.p
        row[MAXP] = top_k if policy.max_p is None else policy.max_p
    elif isinstance(policy, (LynxLat, LynxAcc)):
        row[KIND], row[DROP] = LYNX, policy.drop
        row[CONF] = policy.conf if isinstance(policy, LynxAcc) else -1.0
    elif isinstance(policy, MoESpec):
        row[KIND], row[BUDGET] = MOE_SPEC, policy.budget
        row[RANK] = {"router": RANK_PROBS, "topk": RANK_TOPK, "static": RANK_STATIC}[policy.rank]
        row[SUBST] = float(policy.cover == "substitute")
    else:
        raise TypeError(f"no table encoding for policy {policy!r}")
    return row


def rank_width(policies: Sequence[Policy], top_k: int, num_experts: int) -> int:
    """How many of each token's best experts the kernels must rank: top_k, or OEA's max_p."""
    widths = [top_k] + [p.max_p for p in policies if isinstance(p, OEA) and p.max_p is not None]
    return min(max(widths), num_experts)


@dataclass
class RoutingTables:
    """The device tensors one routing call reads (see the module docstring for shapes)."""

    params: torch.Tensor     # [P, NCOL] float32
    pid: torch.Tensor        # [T] int32
    rid: torch.Tensor        # [T] int32
    req_start: torch.Tensor  # [R] int32
    req_end: torch.Tensor    # [R] int32
    static: torch.Tensor     # [P, E] float32
    groups: torch.Tensor     # [E] int32
    rank_width: int          # experts ranked per token (>= top_k; OEA max_p)
    has_requests: bool       # some slot is xshare-spec: run the per-request stage
    needs_ranks: bool = True  # some slot is OEA or MoE-Spec: routing reads each token's ranks


def request_layout(num_tokens: int,
                   request_spans: Sequence[tuple[int, int]] | None) -> tuple[list[int], list[int], list[int]]:
    """(rid [T], starts [R], ends [R]): spans as requests, a token outside every span its own one."""
    spans = [(0, num_tokens)] if request_spans is None else list(request_spans)
    starts, ends, rid, cursor = [], [], [], 0
    for start, end in [*spans, (num_tokens, num_tokens)]:
        for token in range(cursor, start):
            rid.append(len(starts))
            starts.append(token)
            ends.append(token + 1)
        if end > start:
            rid.extend([len(starts)] * (end - start))
            starts.append(start)
            ends.append(end)
        cursor = end
    return rid, starts, ends


def build_tables(num_tokens: int, num_experts: int, top_k: int, policies: Sequence[Policy],
                 pid: Sequence[int] | None, request_spans: Sequence[tuple[int, int]] | None,
                 static: Sequence[torch.Tensor | None], expert_groups: Sequence[int] | torch.Tensor | None,
                 device: torch.device) -> RoutingTables:
    """Host-built tables, copied to `device` once (callers cache or refill them, never per layer)."""
    rid, starts, ends = request_layout(num_tokens, request_spans)
    rows = torch.tensor([encode(p, top_k) for p in policies], dtype=torch.float32)
    static_rows = torch.zeros(len(policies), num_experts)
    for slot, counts in enumerate(static):
        if counts is not None:
            static_rows[slot] = counts.float().cpu()
    groups = torch.zeros(num_experts, dtype=torch.int32) if expert_groups is None else \
        torch.as_tensor(expert_groups).to(torch.int32).cpu()
    if groups.shape != (num_experts,):
        raise ValueError(f"expert_groups must have one GPU index per expert ({num_experts}), "
                         f"got shape {tuple(groups.shape)}")
    pids = torch.zeros(num_tokens, dtype=torch.int32) if pid is None else torch.tensor(pid, dtype=torch.int32)

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(device)

    return RoutingTables(
        params=dev(rows), pid=dev(pids), rid=dev(torch.tensor(rid, dtype=torch.int32)),
        req_start=dev(torch.tensor(starts, dtype=torch.int32)),
        req_end=dev(torch.tensor(ends, dtype=torch.int32)), static=dev(static_rows), groups=dev(groups),
        rank_width=rank_width(policies, top_k, num_experts),
        has_requests=any(isinstance(p, XShareSpec) for p in policies),
        needs_ranks=any(isinstance(p, (OEA, MoESpec)) for p in policies))

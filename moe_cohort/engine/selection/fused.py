"""Launch the Triton selection kernels: table-driven routing with no host synchronisation.

`route_fused(logits, top_k, tables)` is the device twin of `table_torch.route_tables`; it only
launches kernels over tensors already on the device, so it can be captured in a CUDA graph and
replayed with new numbers written into `tables`. `select_fused` serves the one-policy contract
of `engine.selection.select_experts` on CUDA: its tables are built once per (policy, shape,
spans, groups, layer) and cached on the device, so repeated calls copy nothing to the device.

Triton is optional: `available(tensor)` says whether the kernels can run on that tensor (CUDA
with Triton installed, or any tensor under `TRITON_INTERPRET=1`, which must be set before this
module is first used). Both facts are decided once, when this module loads, so that a compiled caller
reads constants and never looks anything up while it is traced.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from collections.abc import Sequence

import torch

from moe_cohort.engine.policy import Policy
from moe_cohort.engine.selection.table import NCOL, RoutingTables, build_tables


TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter (read when kernels are defined)


def available(tensor: torch.Tensor) -> bool:
    """Whether `route_fused` can run on this tensor's device."""
    return TRITON_INSTALLED and (tensor.is_cuda or INTERPRETING)


@functools.cache
def _kernels():
    from moe_cohort.engine.selection import triton_kernels

    return triton_kernels


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def route_fused(router_logits: torch.Tensor, top_k: int, tables: RoutingTables, *,
                scoring: str = "softmax", renormalize: bool = True,
                router: tuple[torch.Tensor, torch.Tensor] | None = None, scale: float = 1.0,
                out_dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.int64),
                record: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> ([T, top_k] weights, [T, top_k] ids), each token by its slot's policy.

    router: the router's own (weights [T, k], ids [T, k]); KEEP-slot tokens then return them
    unchanged; without it they get plain top-k. scale multiplies the weights of re-routed tokens
    (a model's routed_scaling_factor). out_dtypes: of the returned (weights, ids). record:
    contiguous (before [T, k] int32, after [T, k] int32, weights [T, k] float32) that also receive
    the router's ids (with `router`), the chosen ids and weights, in the same kernel.
    """
    k = _kernels()
    num_tokens, num_experts = router_logits.shape
    e_pad, kp = _pow2(num_experts), _pow2(top_k)
    block = max(1, min(_pow2(num_tokens), 32, 4096 // e_pad))
    num_blocks, num_slots = triton_cdiv(num_tokens, block), tables.params.shape[0]
    device = router_logits.device
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    part = torch.empty(num_blocks, num_slots, k.NUM_STATS, e_pad, dtype=torch.float32, device=device)
    reqset = torch.empty(tables.req_start.shape[0] if tables.has_requests else 1, e_pad,
                         dtype=torch.int8, device=device)
    out_w = torch.empty(num_tokens, top_k, dtype=out_dtypes[0], device=device)
    out_ids = torch.empty(num_tokens, top_k, dtype=out_dtypes[1], device=device)
    if num_tokens == 0:
        return out_w, out_ids
    sigmoid = scoring == "sigmoid"
    warps = 4 if block * e_pad <= 2048 else 8
    common = dict(K=top_k, KP=kp, BT=block, E_PAD=e_pad, NCOL=NCOL, SIGMOID=sigmoid)
    num_requests = tables.req_start.shape[0] if tables.has_requests else 0
    k._stats_kernel[(num_blocks + num_requests,)](
        logits, logits.stride(0), num_tokens, num_experts, tables.params, tables.pid, tables.req_start,
        tables.req_end, reqset, part, num_blocks, num_slots, W=tables.rank_width, num_warps=warps, **common)
    sets = torch.empty(num_slots, e_pad, dtype=torch.int8, device=device)
    r_pad = _pow2(max(num_requests, 1))
    k._sets_kernel[(num_slots,)](
        part, num_blocks, num_slots, num_experts, tables.params, tables.static, tables.groups, tables.pid,
        tables.req_start, tables.req_end, reqset, num_requests, sets, NB_PAD=_pow2(num_blocks), R_PAD=r_pad,
        E_PAD=e_pad, NCOL=NCOL, num_warps=4 if e_pad <= 64 else 8)
    router_w, router_ids = router if router is not None else (out_w, out_ids)
    k._route_kernel[(num_blocks,)](
        logits, logits.stride(0), num_tokens, num_experts, tables.params, tables.pid, tables.rid, reqset, sets,
        router_w, router_ids, out_w, out_ids, float(scale),
        *(record if record is not None else (out_ids, out_ids, out_w)),
        W=tables.rank_width, HAS_REQ=tables.has_requests,
        HAS_ROUTER=router is not None, RENORM=renormalize, RECORD=record is not None,
        RANKED=tables.needs_ranks, num_warps=warps, **common)
    return out_w, out_ids


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=256)
def _cached_tables(policy: Policy, num_tokens: int, num_experts: int, top_k: int,
                   spans: tuple | None, groups: tuple | None, layer: int | None,
                   device: torch.device) -> RoutingTables:
    static = None
    if getattr(policy, "rank", None) == "static":
        from moe_cohort.engine.selection.moe_spec import static_ranking

        static = static_ranking(policy.calib, layer, num_experts)
    return build_tables(num_tokens, num_experts, top_k, [policy], None, spans, [static], groups, device)


def select_fused(router_logits: torch.Tensor, top_k: int, policy: Policy, *,
                 request_spans: Sequence[tuple[int, int]] | None = None,
                 expert_groups: Sequence[int] | torch.Tensor | None = None,
                 scoring: str = "softmax", renormalize: bool = True,
                 layer: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One policy for the whole batch, through the kernels (tables cached on the device).

    expert_groups: a list (part of the cache key) or an [E] tensor (used as given, never read
    back to the host).
    """
    groups_tensor = expert_groups if isinstance(expert_groups, torch.Tensor) else None
    tables = _cached_tables(
        policy, router_logits.shape[0], router_logits.shape[1], top_k,
        None if request_spans is None else tuple(map(tuple, request_spans)),
        None if expert_groups is None or groups_tensor is not None else tuple(expert_groups), layer,
        router_logits.device)
    if groups_tensor is not None:
        if groups_tensor.shape != (router_logits.shape[1],):
            raise ValueError(f"expert_groups must have one GPU index per expert ({router_logits.shape[1]}), "
                             f"got shape {tuple(groups_tensor.shape)}")
        tables = dataclasses.replace(tables, groups=groups_tensor.to(router_logits.device, torch.int32))
    return route_fused(router_logits, top_k, tables, scoring=scoring, renormalize=renormalize)

"""Persistent routing tables of one engine process: written before each step, read inside graphs.

A captured CUDA graph (or a `torch.compile` graph) replays the routing kernels with the tensors it
saw at capture. `StepTables` owns those tensors for the process's lifetime: before every forward
`write(spans, num_tokens)` fills pinned host mirrors and copies them to the device without
blocking (once per step, never per layer), and each MoE layer's routing reads `view(T, layer)`.
Token rows past the step's own (padding of a captured batch size) belong to slot 0, which keeps
the router's choice.

Limits fixed for the process (a graph cannot change them): at most `max_slots - 1` distinct
policies per step (further ones run top-k, reported by `write`), OEA's `max_p` up to
`rank_width`, and XShare-spec only if `requests` (its per-request stage is one more kernel per
layer). `capture_error` says why a policy cannot run under these limits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from moe_cohort.engine.policy import OEA, MoESpec, Policy, TopK, XShareSpec
from moe_cohort.engine.selection import fused
from moe_cohort.engine.selection.table import NCOL, RoutingTables, encode
from moe_cohort.engine.selection.table_torch import route_tables

SpanPolicy = tuple[int, int, Policy]  # rows [start, end) and their effective policy


def capture_error(policy: Policy, rank_width: int, requests: bool) -> str | None:
    """Why `policy` cannot be served by graph-captured routing with these limits, or None."""
    if isinstance(policy, XShareSpec) and not requests:
        return ("xshare-spec needs its per-request kernel in the captured graph: start the engine with "
                "COHORT_GRAPH_XSHARE_SPEC=1 (one more kernel per MoE layer for every step)")
    if isinstance(policy, OEA) and policy.max_p is not None and policy.max_p > rank_width:
        return (f"oea: max_p={policy.max_p} exceeds the {rank_width} experts per token that the captured "
                f"kernels rank; set COHORT_GRAPH_RANK_WIDTH >= {policy.max_p}")
    return None


class StepTables:
    """Device tables (`RoutingTables` views) plus per-layer buffers of what routing decided."""

    def __init__(self, *, max_tokens: int, num_layers: int, num_experts: int, top_k: int,
                 device: torch.device, max_slots: int = 16, rank_width: int | None = None,
                 requests: bool = False,
                 static_counts: Callable[[MoESpec, int], torch.Tensor] | None = None) -> None:
        self.max_tokens, self.num_layers, self.top_k = max_tokens, num_layers, top_k
        self.rank_width = min(num_experts, rank_width or 2 * top_k)
        self.requests, self.static_counts = requests, static_counts
        pin = device.type == "cuda"
        shapes = {"params": ((max_slots, NCOL), torch.float32), "pid": ((max_tokens,), torch.int32),
                  "rid": ((max_tokens,), torch.int32), "req_start": ((max_tokens,), torch.int32),
                  "req_end": ((max_tokens,), torch.int32),
                  "static": ((num_layers, max_slots, num_experts), torch.float32)}
        self.device = {name: torch.zeros(shape, dtype=dt, device=device) for name, (shape, dt) in shapes.items()}
        self.host = [{name: torch.zeros(shape, dtype=dt, pin_memory=pin) for name, (shape, dt) in shapes.items()}
                     for _ in range(2)]  # alternate: a step's async copy may still read the other one
        self._flip = 0
        self.groups = torch.zeros(num_experts, dtype=torch.int32, device=device)
        # what each layer decided, for metrics and recording: [L, max_tokens, k]
        self.before = torch.zeros(num_layers, max_tokens, top_k, dtype=torch.int32, device=device)
        self.after = torch.zeros_like(self.before)
        self.weights = torch.zeros(num_layers, max_tokens, top_k, dtype=torch.float32, device=device)
        self.write([], 0)

    def slots_for(self, spans: Sequence[SpanPolicy]) -> tuple[list[Policy], list[int], list[Policy]]:
        """(slot policies, slot of each span, policies that found no free slot and run top-k)."""
        slots: dict[Policy, int] = {TopK(): 0}
        span_slots, overflow = [], []
        for _, _, policy in spans:
            if policy not in slots and len(slots) < self.device["params"].shape[0]:
                slots[policy] = len(slots)
            if policy not in slots:
                overflow.append(policy)
            span_slots.append(slots.get(policy, 0))
        return list(slots), span_slots, overflow

    def write(self, spans: Sequence[SpanPolicy], num_tokens: int) -> list[Policy]:
        """Publish a step (spans sorted, within max_tokens); returns policies that had to run top-k."""
        if num_tokens > self.max_tokens:
            raise ValueError(f"step of {num_tokens} tokens exceeds the routing tables' {self.max_tokens}")
        policies, span_slots, overflow = self.slots_for(spans)
        host = self.host[self._flip]
        self._flip ^= 1
        host["params"][:] = torch.tensor(encode(TopK(), self.top_k))
        host["params"][: len(policies)] = torch.tensor([encode(p, self.top_k) for p in policies])
        for name in ("pid", "rid", "req_start", "req_end"):
            host[name].zero_()
        if spans:   # numpy views: one vectorised fill, not a loop over requests
            starts, ends = (np.array([span[i] for span in spans], dtype=np.int64) for i in (0, 1))
            lengths = ends - starts
            rows = np.repeat(starts - np.cumsum(lengths) + lengths, lengths) + np.arange(lengths.sum())
            host["pid"].numpy()[rows] = np.repeat(np.array(span_slots, dtype=np.int32), lengths)
            host["rid"].numpy()[rows] = np.repeat(np.arange(len(spans), dtype=np.int32), lengths)
            host["req_start"].numpy()[: len(spans)] = starts
            host["req_end"].numpy()[: len(spans)] = ends
        self._write_static(host, policies)
        for name, tensor in self.device.items():
            tensor.copy_(host[name], non_blocking=True)
        return overflow

    def _write_static(self, host: dict, policies: list[Policy]) -> None:
        host["static"].zero_()
        for slot, policy in enumerate(policies):
            if isinstance(policy, MoESpec) and policy.rank == "static" and self.static_counts is not None:
                for layer in range(self.num_layers):
                    host["static"][layer, slot] = self.static_counts(policy, layer)

    def view(self, num_tokens: int, layer: int) -> RoutingTables:
        """The tables one layer's routing of `num_tokens` rows reads (views: fixed addresses)."""
        d = self.device
        return RoutingTables(params=d["params"], pid=d["pid"][:num_tokens], rid=d["rid"][:num_tokens],
                             req_start=d["req_start"][:num_tokens], req_end=d["req_end"][:num_tokens],
                             static=d["static"][layer], groups=self.groups, rank_width=self.rank_width,
                             has_requests=self.requests)

    def route(self, layer: int, router_logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, *,
              top_k: int, scoring: str, renormalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's routing by the published step: tensor work only (capturable, compilable).

        router_logits [T, E]; weights, ids [T, k]: the router's choice, kept for slot-0 rows.
        Returns new (weights, ids) in the input dtypes; also fills before/after/weights[layer, :T].
        """
        num_tokens = router_logits.shape[0]
        tables = self.view(num_tokens, layer)
        record = (self.before[layer, :num_tokens], self.after[layer, :num_tokens], self.weights[layer, :num_tokens])
        if router_logits.is_cuda and fused.available(router_logits):
            return fused.route_fused(router_logits, top_k, tables, scoring=scoring, renormalize=renormalize,
                                     router=(weights, ids), scale=scale, out_dtypes=(weights.dtype, ids.dtype),
                                     record=record)
        new_w, new_ids = route_tables(router_logits, top_k, tables, scoring=scoring, renormalize=renormalize,
                                      router=(weights, ids), scale=scale)
        record[0].copy_(ids)
        record[1].copy_(new_ids)
        record[2].copy_(new_w)
        return new_w.to(weights.dtype), new_ids.to(ids.dtype)

    def keep(self, layer: int, ids: torch.Tensor) -> None:
        """Record a layer that keeps its router's choice (its router cannot be re-routed)."""
        self.before[layer, : ids.shape[0]].copy_(ids)
        self.after[layer, : ids.shape[0]].copy_(ids)

    def decided(self, num_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Host copies of every layer's (router ids, chosen ids, weights) for the step's rows [L, n, k]."""
        return tuple(t[:, :num_tokens].cpu().numpy() for t in (self.before, self.after, self.weights))

"""Table mode of `engine.routing_hook.RoutingHook`: the routing vLLM may capture in CUDA graphs.

`begin_step` publishes the step into persistent device tables (`engine.selection.step_tables`),
every layer's `route` only launches the selection kernels over them (Triton on CUDA, the torch
twin elsewhere), and `end_step` reads back, once per step, what every layer decided for the
metrics and the recorder. No Python decision depends on the step inside `route`, so a captured
graph (or a `torch.compile` graph) stays right for every later step.
"""

from __future__ import annotations

import torch

from moe_cohort.engine.engine_state import Step
from moe_cohort.engine.policy import Policy
from moe_cohort.engine.selection.moe_spec import static_ranking
from moe_cohort.engine.selection.step_tables import StepTables, capture_error


class TableMode:
    """Mixin of RoutingHook (uses its config, layers, metrics, observe, _step and _warn_once)."""

    def _wants_tables(self, router_logits: torch.Tensor) -> bool:
        if self.tables is not None:
            return True
        wanted = self.config.graph_tables
        if not (router_logits.is_cuda if wanted is None else wanted):
            return False
        self.use_tables(router_logits.device)
        return True

    def use_tables(self, device: torch.device) -> StepTables:
        """Switch to table mode on `device` (once, before any graph capture) and publish the step."""
        if self.tables is None:
            info = next(iter(self.layers.values()))
            self.tables = StepTables(
                max_tokens=self.config.max_tokens, num_layers=max(self.layers) + 1, num_experts=info.num_experts,
                top_k=info.top_k, device=torch.device(device), rank_width=self.config.rank_width,
                requests=self.config.graph_spec,
                static_counts=lambda policy, layer: static_ranking(policy.calib, layer, info.num_experts))
            self._publish(self._step)
        return self.tables

    def capture_error(self, policy: Policy) -> str | None:
        """Why table mode cannot serve `policy` (None: it can, or the hook is in eager mode)."""
        if self.tables is None:
            return None
        return capture_error(policy, self.tables.rank_width, self.tables.requests)

    def _publish(self, step: Step | None) -> None:
        self._published = step
        spans = [] if step is None else [(s.start, s.end, s.effective_policy) for s in step.spans if s.rerouted]
        for policy in self.tables.write(spans, 0 if step is None else step.num_tokens):
            self._warn_once(f"slots:{policy}", "more distinct policies in one step than the routing tables "
                            "hold; requests with %s run top-k in such steps", policy)

    def _route_tables(self, layer: int, info: LayerInfo, router_logits: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not info.supports_policies:
            self._warn_once(f"layer{layer}", "MoE layer %d: its router (bias-corrected, grouped or custom) "
                            "cannot be re-routed by policies; using top-k", layer)
            self.tables.keep(layer, ids)
            return weights, ids
        return self.tables.route(layer, router_logits, weights, ids, top_k=info.top_k, scoring=info.scoring,
                                 renormalize=info.renormalize, scale=info.scale)

    def _collect_tables(self, step: Step) -> None:
        """Table mode: what every layer decided, read back once per step (outside any graph)."""
        recording, counting = step.record and self.observe, step.observe and self.observe
        if self.metrics is None and not recording and not counting:
            return
        before, after, weights = self.tables.decided(step.num_tokens)    # [L, n, k] each
        layers = sorted(self.layers)
        if self.metrics is not None:
            self._routed = [(before[i], after[i]) for i in layers]
        if recording:
            self._captured = [(after[i], weights[i]) for i in layers]
        if counting:
            self._counted = [after[i] for i in layers]


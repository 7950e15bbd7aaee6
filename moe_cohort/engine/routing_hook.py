"""The engine-side logic of the plugin, free of vLLM: per step, per MoE layer, re-route the
tokens of each request with its policy, count distinct experts, and capture recorded rows.

The vLLM wiring (`engine.vllm_patches`) calls, per forward pass:

    hook.begin_step(step)                      # who owns which rows (engine.engine_state.Step)
    hook.route(layer, logits, w, ids) -> w, ids   # from every MoE layer's router, in order
    hook.end_step()                            # publish metrics, store recorded rows

and `hook.finish_request(...)` when a request leaves the engine. Two routing modes, with
the same decisions: rows whose effective policy is top-k keep exactly the router's output, so
`topk` requests are unaffected by the policies of their batch mates.

- tables (default on CUDA, `HookConfig.graph_tables`): `begin_step` publishes the step into
  persistent device tables (`engine.selection.step_tables`) and `route` only launches the
  selection kernels over them (Triton on CUDA, the torch twin elsewhere), with no Python decision
  per step and no host synchronisation, so vLLM may capture it in CUDA graphs;
- eager (default on CPU): `route` calls `engine.selection.select_experts_mixed` on the
  sub-batch of re-routed rows, skipping steps where every row is top-k.

What `route` keeps of each layer and `end_step` publishes (metrics, recorded rows, the observed requests'
expert counts) is `engine.step_outputs`; table mode is `engine.routing_tables`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moe_cohort.engine.engine_state import RequestOptions, Step, request_options
from moe_cohort.engine.expert_counts import ExpertCounts
from moe_cohort.engine.metrics import ExpertLoadMetrics
from moe_cohort.engine.policy import Policy, PolicyError, TopK
from moe_cohort.engine.prompt_routing import PromptRouting
from moe_cohort.engine.recorder import TraceRecorder
from moe_cohort.engine.routing_tables import TableMode
from moe_cohort.engine.selection import select_experts_mixed
from moe_cohort.engine.selection.step_tables import StepTables
from moe_cohort.engine.step_outputs import KEEPERS, Kept, StepOutputs

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class LayerInfo:
    """What the routing of one MoE layer needs from its router."""

    top_k: int
    num_experts: int
    renormalize: bool = True
    scoring: str = "softmax"
    scale: float = 1.0  # routed_scaling_factor applied to the router's weights
    supports_policies: bool = True  # False: a routing the selectors cannot reproduce (bias, custom fn)


@dataclass(frozen=True)
class HookConfig:
    default_policy: Policy = TopK()
    record_all: bool = False
    trace_dir: Path = Path("cohort-traces")
    model: str = ""
    graph_tables: bool | None = None  # route from persistent device tables; None: on CUDA only
    max_tokens: int = 8192  # rows per forward the tables hold (vLLM's max_num_batched_tokens)
    rank_width: int | None = None  # experts ranked per token in table mode (default 2 top_k; OEA max_p)
    graph_spec: bool = False  # table mode runs XShare-spec's per-request kernel in every step
    record_requests: bool = False  # a request's moe_record: true is honoured (COHORT_RECORD_TRACES=request)


@dataclass(frozen=True)
class _Plan:
    """The re-routed part of a step: rows [m] of non-top-k spans, their rebased spans and policies."""

    rows: torch.Tensor
    spans: list[tuple[int, int]]
    policies: list[Policy]


class RoutingHook(TableMode, StepOutputs):
    """Per-process state of the plugin inside the engine (table mode: `engine.routing_tables`; what a step
    publishes: `engine.step_outputs`)."""

    def __init__(self, config: HookConfig, metrics: ExpertLoadMetrics | None = None,
                 decode_text: Callable[[list[int]], str] | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.decode_text = decode_text
        self.model_name = config.model
        self.observe = True  # False on tensor-parallel ranks > 0: route, but neither count nor record
        self.layers: dict[int, LayerInfo] = {}
        self._options: dict[str, RequestOptions] = {}
        self._recorder: TraceRecorder | None = None
        self._step: Step | None = None
        self._plan: _Plan | None = None
        self._plan_of: tuple[Step | None, _Plan | None] = (None, None)  # a reused Step keeps its plan
        self._routed: list[tuple[Kept, Kept | None]] = []  # per layer: ids [n, k] before, after
        self._captured: list[tuple[Kept, Kept]] = []  # per layer: ids [n, k], weights [n, k]
        self._counted: list[Kept] = []  # per layer: ids [n, k] after the policies, for the observed requests' counts
        self.counts: ExpertCounts | None = None  # observed requests' expert counts (created with the first)
        self.route_prompts = False  # count every prompt's routing for the decode gate (engine.scheduler)
        self.prompts: PromptRouting | None = None  # ... its counts (created with the first prefill)
        self._warned: set[str] = set()
        self.tables: StepTables | None = None
        self._published: Step | None = None  # the step the tables hold (a steady Step is reused)
        self.plugin_ns = 0  # time spent in the plugin since the last end_step (the wiring adds to it)

    # ---- requests ------------------------------------------------------------------------------

    @property
    def known_options(self) -> dict[str, RequestOptions]:
        """Options of the requests seen so far and not finished, by request id (read-only use)."""
        return self._options

    def options_for(self, req_id: str, extra_args: Mapping | None) -> RequestOptions:
        """The request's options (cached); a policy the model cannot run falls back to the default."""
        opts = self._options.get(req_id)
        if opts is None:
            opts = self._options[req_id] = self._parse_options(req_id, extra_args)
        return opts

    def _parse_options(self, req_id: str, extra_args: Mapping | None) -> RequestOptions:
        try:
            opts = request_options(extra_args, self.config.default_policy, self.config.record_all,
                                   self.config.record_requests)
            if self.layers:
                info = next(iter(self.layers.values()))
                opts.policy.validate_for_model(info.top_k, info.num_experts)
            return opts
        except (PolicyError, ValueError) as exc:
            # The API server validates first (400); this is the documented fallback for engines
            # reached without it (offline LLM, other front ends): warn and use the default policy.
            log.warning("request %s: %s; using the default policy %s", req_id, exc, self.config.default_policy)
            return RequestOptions(self.config.default_policy, self.config.record_all)

    def idle(self) -> None:
        """The engine has no tokens to run: publish pending metrics now."""
        if self.metrics is not None:
            self.metrics.flush(force=True)

    def finish_request(self, req_id: str, prompt_token_ids: Sequence[int] | None,
                       output_token_ids: Sequence[int]) -> Path | None:
        """Forget the request; its expert counts wait for the proxy if it was observed; write its trace if it was recorded."""
        self._options.pop(req_id, None)
        if self.counts is not None:
            self.counts.finish(req_id)
        if self.prompts is not None:
            self.prompts.finish(req_id)
        if self._recorder is None or not self._recorder.is_recording(req_id):
            return None
        return self._recorder.finish(req_id, list(prompt_token_ids or []), list(output_token_ids))

    # ---- steps ---------------------------------------------------------------------------------

    def begin_step(self, step: Step | None) -> None:
        """Publish the batch of the coming forward (None: route nothing, e.g. the batch is unknown)."""
        if self.tables is not None and (step is None or step is not self._published):
            self._publish(step)
        self._step = step
        if step is None or step.all_topk:
            self._plan = None
        elif self._plan_of[0] is step:
            self._plan = self._plan_of[1]
        else:
            self._plan = _plan(step)
            self._plan_of = (step, self._plan)
        self._routed.clear()
        self._captured.clear()
        self._counted.clear()

    def route(self, layer: int, router_logits: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, *, copy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply the step's policies to one layer's routing.

        router_logits [T, E]; weights [T, k] float32 and ids [T, k] int: the router's choice.
        Returns new (weights, ids) of the same dtypes, or the inputs when nothing changes.
        copy: keep copies of what end_step needs (a compiled graph may reuse the memory of these
        tensors for later layers; in eager mode the references stay valid).
        """
        step, info = self._step, self.layers.get(layer)
        if info is not None and self._wants_tables(router_logits):
            return self._route_tables(layer, info, router_logits, weights, ids)
        if step is None or info is None or step.num_tokens == 0:
            return weights, ids
        new_w, new_ids = weights, ids
        if self._plan is not None:
            new_w, new_ids = self._reroute(layer, info, router_logits, weights, ids)
        keep, n = KEEPERS[(ids.is_cpu, copy)], step.num_tokens
        if ids.shape[0] == n:  # no padding rows (always on CPU): keep whole tensors, skip the slicing
            kept_ids, kept_new, kept_w = ids, new_ids, new_w
        else:
            kept_ids, kept_new, kept_w = ids[:n], new_ids[:n], new_w[:n]
        if self.metrics is not None:
            self._routed.append((keep(kept_ids), None if new_ids is ids else keep(kept_new)))
        if step.record and self.observe:
            self._captured.append((keep(kept_new), keep(kept_w)))
        if (step.observe or (step.prefilling and self.route_prompts)) and self.observe:
            self._counted.append(keep(kept_new))
        return new_w, new_ids

    def _reroute(self, layer: int, info: LayerInfo, router_logits: torch.Tensor, weights: torch.Tensor,
                 ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not info.supports_policies:
            self._warn_once(f"layer{layer}", "MoE layer %d: its router (bias-corrected, grouped or custom) "
                            "cannot be re-routed by policies; using top-k", layer)
            return weights, ids
        plan = self._plan
        whole = plan.rows.numel() == router_logits.shape[0]  # every row re-routed (no top-k rows, no padding)
        if not whole and plan.rows.device != router_logits.device:  # once per step, not per layer
            plan = self._plan = dataclasses.replace(plan, rows=plan.rows.to(router_logits.device))
            self._plan_of = (self._step, plan)
        sub_w, sub_ids = select_experts_mixed(
            router_logits if whole else router_logits[plan.rows], info.top_k, plan.policies, plan.spans,
            # the spans' policies are already effective (Policy.effective resolved decode-only per span)
            is_prefill=False, scoring=info.scoring, renormalize=info.renormalize, layer=layer)  # [m, k] each
        if info.scale != 1.0:
            sub_w = sub_w * info.scale
        if whole:
            return sub_w.to(weights.dtype), sub_ids.to(ids.dtype)
        new_w, new_ids = weights.clone(), ids.clone()
        new_w[plan.rows], new_ids[plan.rows] = sub_w.to(weights.dtype), sub_ids.to(ids.dtype)
        return new_w, new_ids

    def end_step(self, forward_ns: int = 0) -> None:
        """Publish the step's counts to the metrics and its recorded rows to the recorder.

        forward_ns: wall time of this forward; with `plugin_ns` it goes to the overhead counters.
        """
        step = self._step
        self._step = self._plan = None
        if self.metrics is not None and forward_ns:
            self.metrics.add_time(self.plugin_ns / 1e9, forward_ns / 1e9)
            self.plugin_ns = 0
        if step is None or step.num_tokens == 0:
            return
        if self.tables is not None:
            self._collect_tables(step)
        self._publish_outputs(step)

    def _warn_once(self, key: str, msg: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)


def _plan(step: Step) -> _Plan:
    """Rows of the spans whose effective policy is not top-k, rebased onto that sub-batch."""
    chosen = [s for s in step.spans if s.rerouted]
    rows = torch.from_numpy(np.concatenate([np.arange(s.start, s.end) for s in chosen]))  # [m]
    lengths = np.cumsum([0] + [s.end - s.start for s in chosen])
    spans = [(int(lengths[i]), int(lengths[i + 1])) for i in range(len(chosen))]
    return _Plan(rows=rows, spans=spans, policies=[s.effective_policy for s in chosen])

"""What one step of the routing hook publishes: the distinct experts per layer to the metrics, recorded rows
to the trace recorder, and the observed requests' expert counts (handed to the proxy once they finish).

`route` keeps each layer's routing until `end_step` (`KEEPERS` say how, per device); `_publish_outputs`
then publishes whatever the step asked for. A mixin of `engine.routing_hook.RoutingHook`, whose state it
reads: `layers`, `metrics`, `config`, `_routed`, `_captured`, `_counted`, `counts`, `_recorder`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
import logging

import numpy as np
import torch

from moe_cohort.engine.distinct import distinct_experts
from moe_cohort.engine.engine_state import PREFILL, Step
from moe_cohort.engine.expert_counts import ExpertCounts
from moe_cohort.engine.prompt_routing import PromptRouting
from moe_cohort.engine.recorder import TraceRecorder

log = logging.getLogger(__name__)

Kept = np.ndarray | torch.Tensor  # routing results kept from route() to end_step (see KEEPERS)


class StepOutputs:
    """Publishing a step's routing (mixed into RoutingHook)."""

    def _publish_outputs(self, step: Step) -> None:
        """The step's counts to the metrics, its recorded rows to the recorder, its observed requests' counts."""
        if self.metrics is not None and self._routed:
            before, after = self._count_distinct(step)
            self.metrics.observe_forward(
                list(step.groups), list(step.group_tokens), [row[:-1] for row in before],
                [row[:-1] for row in after], step.batch_labels, [row[-1] for row in before],
                [row[-1] for row in after])
            self.metrics.flush()
        if step.record and self._captured:
            self._store_rows(step)
        if self._counted:
            self._count_counted(step)
        self._routed.clear()
        self._captured.clear()
        self._counted.clear()

    def _count_distinct(self, step: Step) -> tuple[list[list[int]], list[list[int]]]:
        """Distinct experts [L][G + 1] before and after the policies, for the layers of this step."""
        num_experts = next(iter(self.layers.values())).num_experts  # one MoE shape per model
        count = functools.partial(distinct_experts, group=step.token_group, num_groups=len(step.groups),
                                  num_experts=num_experts)
        before = count(_host([b for b, _ in self._routed]))  # [L][G + 1]
        if all(a is None for _, a in self._routed):
            return before, before
        return before, count(_host([b if a is None else a for b, a in self._routed]))

    def _store_rows(self, step: Step) -> None:
        if len(self._captured) != len(self.layers):
            self._warn_once("layers", "recording needs every MoE layer per forward; saw %d of %d",
                            len(self._captured), len(self.layers))
            return
        ids = np.stack(_host([i for i, _ in self._captured]), axis=1)  # [n, L, k]
        weights = np.stack(_host([w for _, w in self._captured]), axis=1).astype(np.float32)
        recorder = self._get_recorder()
        for span in step.spans:
            if span.options.record:
                recorder.add_rows(span.req_id, span.options.label, span.position,
                                  ids[span.start:span.end], weights[span.start:span.end])

    def _count_counted(self, step: Step) -> None:
        """The observed requests' expert counts, and the prompts' routing where the decode gate asks for it."""
        if len(self._counted) != len(self.layers):
            self._warn_once("counted", "counting experts needs every MoE layer per forward; saw %d of %d",
                            len(self._counted), len(self.layers))
            return
        ids = np.stack(_host(self._counted), axis=1)  # [n, L, k]
        num_experts = next(iter(self.layers.values())).num_experts
        if step.observe:
            if self.counts is None:
                self.counts = ExpertCounts(len(self.layers), num_experts)
            self.counts.add_step([(span.req_id, span.options.observe, span.position, span.num_prompt_tokens,
                                   span.start, span.end) for span in step.spans if span.options.observe], ids)
        if step.prefilling and self.route_prompts:
            if self.prompts is None:
                self.prompts = PromptRouting(len(self.layers), num_experts)
            self.prompts.add_step([(span.req_id, span.position, span.num_prompt_tokens, span.start, span.end)
                                   for span in step.spans if span.phase == PREFILL], ids)

    def take_prompt_routing(self) -> dict[str, np.ndarray]:
        """The prompt routings [L, E] of the prefills that ended since the last call (engine.prompt_routing)."""
        return {} if self.prompts is None else self.prompts.take()

    def take_observed(self, tokens: Sequence[str]) -> dict[str, dict]:
        """The finished observed requests' counts under `tokens` (engine.expert_counts), handed over once."""
        return {} if self.counts is None else self.counts.take(tokens)

    def _get_recorder(self) -> TraceRecorder:
        if self._recorder is None:
            info = next(iter(self.layers.values()))
            self._recorder = TraceRecorder(
                self.config.trace_dir, num_layers=len(self.layers), num_experts=info.num_experts,
                top_k=info.top_k, model=self.model_name, decode_text=self.decode_text)
            log.info("recording expert traces to %s", self.config.trace_dir)
        return self._recorder


def _numpy_view(t: torch.Tensor) -> np.ndarray:
    return t.numpy()


def _numpy_copy(t: torch.Tensor) -> np.ndarray:
    return t.numpy().copy()


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


# How route() keeps tensors until end_step, by (on CPU, copy): CPU tensors as numpy arrays (these
# are tiny, and numpy's per-op cost inside the engine is a fraction of torch's), other devices as
# tensors moved to the host once per step in `_host`. Copies when asked: a compiled graph may
# reuse the memory of its tensors for later layers.
KEEPERS = {(True, False): _numpy_view, (True, True): _numpy_copy, (False, False): _same, (False, True): torch.clone}


def _host(parts: list) -> list[np.ndarray] | np.ndarray:
    """What `KEEPERS` kept, on the host: numpy arrays as they are, tensors in one transfer."""
    return parts if isinstance(parts[0], np.ndarray) else torch.stack(parts).cpu().numpy()

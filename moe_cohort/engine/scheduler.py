"""vLLM schedulers that admit waiting requests by predicted experts (`--scheduler-cls`).

    vllm serve MODEL --scheduler-cls moe_cohort.engine.scheduler.ExpertAwareScheduler

The one name fits both of vLLM's scheduling modes: with async scheduling on (vLLM 0.32's default on
GPU) it builds on AsyncScheduler, otherwise on Scheduler (see ExpertAwareScheduler.__new__).

vLLM's own scheduler (FCFS) is kept whole: running requests, preemption, chunked prefill, the
KV budget and skipped requests all work as in vLLM. Two things are added:

- prefill ahead (on by default): the engine prefills up to `COHORT_PREFILL_AHEAD` requests more than
  it decodes and holds them, KV kept, until a decode slot frees; then `engine.decode_gate.DecodeGate`
  admits to decode the held request whose prompt routing (counted by the plugin during that request's
  own prefill) best fits the decoding ones. max_num_seqs stays the number of sequences decoded per step:
  the model runner gets max_num_seqs + ahead slots (`reserve_prefill_ahead`, run by the plugin where
  vLLM builds its config), a held request is kept out of the step with vLLM's
  `Request.next_decode_eligible_step`, and past half the KV cache no request is taken in to be held
  (`active_limit`, through vLLM's `max_num_active_reqs`);
- its waiting queue is `engine.expert_queue.ExpertAwareQueue`, whose front is the waiting request
  expected to add the fewest experts per step to the running set, read from the `moe_profile` the
  proxy sends in `vllm_xargs` (requests without one keep FCFS).

vLLM warns that the scheduler interface is not public: these classes are written for, and tested on,
the versions of `engine.vllm_plugin.TESTED_VERSIONS` (vLLM 0.32); `check_vllm_version` refuses others.

Environment (read when the engine builds the scheduler), the fairness bounds under the proxy's names for
them (its settings max_queue_ms and max_passed: one environment sets both alike):

    COHORT_MAX_QUEUE_MS   a request waiting this many milliseconds goes first (default 30000)
    COHORT_MAX_PASSED     a request that this many later arrivals were admitted before goes first
                          (default, and 0: 3 x max_num_seqs)
    COHORT_PREFILL_AHEAD  requests prefilled and held ahead of decode (default: 16 x max_num_seqs; 0: off,
                          admission by the proxy's predicted profiles alone). A batch line
                          (`vllm_xargs.moe_batch`) is held under neither fairness bound; a request
                          with `vllm_xargs.moe_fcfs` is held in arrival order, its routing unused.
                          Needs the plugin loaded where vLLM builds its config (VLLM_PLUGINS unset or
                          naming moe_cohort)
"""

from __future__ import annotations

import logging
import os

import vllm
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import RequestQueue, SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler

from moe_cohort.admission.fairness import MAX_WAIT_S, PASSED_PER_SLOT
from moe_cohort.engine.decode_gate import DecodeGate
from moe_cohort.engine.engine_info import decode_slots
from moe_cohort.engine.prefill_ahead import (ENV_AHEAD, active_limit, prefill_ahead,  # noqa: F401 (public here too)
                                             reserve_prefill_ahead)
from moe_cohort.engine.expert_queue import ExpertAwareQueue, batch_line, first_come, profile_of
from moe_cohort.engine.prompt_routing import OUTPUT_ATTR
from moe_cohort.engine.vllm_plugin import ENV_ALLOW, check_vllm_version

log = logging.getLogger(__name__)

ENV_MAX_WAIT, ENV_MAX_PASSED = "COHORT_MAX_QUEUE_MS", "COHORT_MAX_PASSED"
HOLD = 1 << 62  # a held request's next_decode_eligible_step: no step reaches it
RequestQueue.register(ExpertAwareQueue)  # it implements the whole contract, without importing vLLM


def max_wait_s(environ=None) -> float:
    """The fairness bound in seconds, from COHORT_MAX_QUEUE_MS; ValueError names the variable."""
    env = os.environ if environ is None else environ
    text = env.get(ENV_MAX_WAIT) or str(MAX_WAIT_S * 1000)
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ValueError(f"{ENV_MAX_WAIT} must be a number of milliseconds >= 0, got {text!r}")
    return value / 1000.0


def max_passed(max_num_seqs: int, environ=None) -> int:
    """How many later arrivals may be admitted before a waiting request (COHORT_MAX_PASSED; unset or 0: three
    times the engine's slots, so that its wait stays within that many admissions of first come, first served's)."""
    env = os.environ if environ is None else environ
    text = env.get(ENV_MAX_PASSED, "0")
    if not text.isdigit():
        raise ValueError(f"{ENV_MAX_PASSED} must be a whole number of admissions >= 0 (0: 3 x max_num_seqs), "
                         f"got {text!r}")
    return int(text) or PASSED_PER_SLOT * max_num_seqs


def routed_experts(hf_config) -> int:
    """Routed experts per MoE layer, under the names the MoE architectures vLLM serves use."""
    for name in ("num_experts", "n_routed_experts", "num_local_experts"):
        if isinstance(getattr(hf_config, name, None), int):
            return getattr(hf_config, name)
    raise ValueError(f"--scheduler-cls {__name__}: the model ({type(hf_config).__name__}) has no routed experts "
                     f"(num_experts, n_routed_experts or num_local_experts); admission by experts needs an MoE model")


class _ExpertAware:
    """Mixin: after vLLM's scheduler is built, swap its (empty) FCFS waiting queue for ours."""

    def __init__(self, *args, **kwargs) -> None:
        check_vllm_version(vllm.__version__, allow_untested=os.environ.get(ENV_ALLOW, "0") == "1")
        super().__init__(*args, **kwargs)
        if self.policy != SchedulingPolicy.FCFS:
            raise ValueError(f"{type(self).__name__} reorders an FCFS queue; vLLM was started with "
                             f"--scheduling-policy {self.policy.value}: use fcfs, or drop --scheduler-cls")
        self.waiting = ExpertAwareQueue(lambda: self.running, routed_experts(self.vllm_config.model_config.hf_text_config),
                                        max_wait_s=max_wait_s(),
                                        max_passed=max_passed(decode_slots(self.scheduler_config)
                                                              or self.scheduler_config.max_num_seqs))
        log.info("moe-cohort: admission by predicted experts (fairness bounds %.1f s, %s admissions)",
                 self.waiting.max_wait_s, self.waiting.max_passed)
        self.gate, self._held = self._decode_gate(), {}

    def _decode_gate(self) -> DecodeGate | None:
        slots = decode_slots(self.scheduler_config)
        if slots is None:
            log.info("moe-cohort: no prefill ahead (%s=0, or the plugin did not build this engine's config)", ENV_AHEAD)
            return None
        log.info("moe-cohort: prefill ahead: %d sequences decode per step, up to %d more prefilled and held; "
                 "admission to decode by each prompt's routing", slots, self.max_num_running_reqs - slots)
        return DecodeGate(slots, max_wait_s=self.waiting.max_wait_s, max_passed=self.waiting.max_passed,
                          fallback=lambda request: profile_of(request, self.waiting.num_experts),
                          bounded=lambda request: not batch_line(request),
                          ordered=lambda request: not first_come(request))

    def schedule(self, *args, **kwargs):
        if self.gate is not None:
            self._gate_decode()
            self.max_num_active_reqs = active_limit(self.gate.slots, self.max_num_running_reqs, len(self.running),
                                                    self.kv_cache_manager.usage)
        return super().schedule(*args, **kwargs)

    def _gate_decode(self) -> None:
        """Before vLLM's pass over RUNNING: the held requests sit this step out, the rest may decode."""
        _, held = self.gate.step(self.running)
        held = {r.request_id: r for r in held}
        for rid, request in self._held.items():
            if rid not in held:  # admitted to decode, or left RUNNING (a preempted one must prefill again)
                request.next_decode_eligible_step = 0
        for request in held.values():
            request.next_decode_eligible_step = HOLD
        self._held = held

    def update_from_output(self, scheduler_output, model_runner_output):
        routing = getattr(model_runner_output, OUTPUT_ATTR, None)
        if routing and self.gate is not None:
            self.gate.routed(routing)
        return super().update_from_output(scheduler_output, model_runner_output)


class ExpertAwareScheduler(_ExpertAware, Scheduler):
    """vLLM's scheduler with admission by predicted experts, on the base vLLM's config asks for: built
    as an ExpertAwareAsyncScheduler (AsyncScheduler underneath) whenever async scheduling is on, as
    vLLM 0.32 leaves it by default on GPU, else on Scheduler (async scheduling off, as on CPU).

    vLLM builds the scheduler as `get_scheduler_cls()(vllm_config=..., ...)`, after its config has
    decided `scheduler_config.async_scheduling`; `__new__` reads that decision, so the one name of the
    README does the right thing. (vLLM still logs its generic "custom scheduler class" warning.)"""

    def __new__(cls, *args, **kwargs):
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        if cls is ExpertAwareScheduler and async_scheduling(vllm_config):
            cls = ExpertAwareAsyncScheduler  # a subclass: Python then runs its __init__ with these arguments
        return super().__new__(cls)


class ExpertAwareAsyncScheduler(ExpertAwareScheduler, AsyncScheduler):
    """vLLM's AsyncScheduler with admission by predicted experts (what ExpertAwareScheduler builds when
    async scheduling is on; naming it forces the async base)."""


def async_scheduling(vllm_config) -> bool:
    """Whether vLLM's config (a VllmConfig, after its own defaults were applied) has async scheduling on."""
    return bool(getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False))

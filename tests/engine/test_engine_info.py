"""The engine's description (engine.engine_info): MoE shapes of real transformers configs against a brute-force
count, the description of a vLLM config, vLLM's rule for loading endpoint plugins, the /metrics labels, and
GET /v1/cohort/info on a throwaway app. The end-to-end check (a real server) is in test_vllm_plugin.py."""

from __future__ import annotations

import importlib.util
import os
from importlib.metadata import version
from types import SimpleNamespace

import pytest

from moe_cohort.engine.engine_info import endpoint_plugin_loaded, engine_info, info_labels, moe_shape
from moe_cohort.engine.policy import POLICY_NAMES

transformers = pytest.importorskip("transformers")
has_vllm = importlib.util.find_spec("vllm") is not None
OURS = "moe_cohort.engine.scheduler.ExpertAwareScheduler"
OURS_ASYNC = "moe_cohort.engine.scheduler.ExpertAwareAsyncScheduler"


def routed_layers(kind: str, config) -> int:
    """Brute force: mark every layer dense or routed one rule at a time, as a reader of the model code would."""
    n = config.num_hidden_layers
    dense = set()
    if kind == "qwen":
        dense |= set(config.mlp_only_layers)
        dense |= {i for i in range(n) if (i + 1) % config.decoder_sparse_step != 0}
    elif kind == "deepseek":
        dense |= set(range(config.first_k_dense_replace))
        dense |= {i for i in range(n) if i % getattr(config, "moe_layer_freq", 1) != 0}
    return n - len(dense)


CONFIGS = [  # (kind, config, experts, top_k)
    ("qwen", lambda: transformers.Qwen3MoeConfig(num_hidden_layers=9, num_experts=24, num_experts_per_tok=3,
                                                 decoder_sparse_step=2, mlp_only_layers=[3, 4]), 24, 3),
    ("qwen", lambda: transformers.Qwen3MoeConfig(num_hidden_layers=4, num_experts=16, num_experts_per_tok=4), 16, 4),
    ("qwen", lambda: transformers.Qwen2MoeConfig(num_hidden_layers=6, num_experts=60, num_experts_per_tok=4,
                                                 decoder_sparse_step=3, mlp_only_layers=[0]), 60, 4),
    ("deepseek", lambda: transformers.DeepseekV2Config(num_hidden_layers=7, n_routed_experts=10, num_experts_per_tok=6,
                                                       first_k_dense_replace=2, moe_layer_freq=2), 10, 6),
    ("deepseek", lambda: transformers.DeepseekV3Config(num_hidden_layers=5, n_routed_experts=32, num_experts_per_tok=8,
                                                       first_k_dense_replace=3), 32, 8),
    ("all", lambda: transformers.MixtralConfig(num_hidden_layers=3, num_local_experts=8, num_experts_per_tok=2), 8, 2),
    ("all", lambda: transformers.OlmoeConfig(num_hidden_layers=4, num_experts=64, num_experts_per_tok=8), 64, 8),
]
if hasattr(transformers, "GptOssConfig"):
    CONFIGS.append(("all", lambda: transformers.GptOssConfig(num_hidden_layers=3, num_local_experts=32,
                                                             num_experts_per_tok=4), 32, 4))


@pytest.mark.parametrize("kind, make, experts, top_k", CONFIGS)
def test_moe_shape_of_real_configs_matches_a_brute_force_count(kind, make, experts, top_k):
    config = make()
    assert moe_shape(config) == {"layers": routed_layers(kind, config), "experts": experts, "top_k": top_k}


def test_moe_shape_counts_the_dense_layers_of_mixed_models():
    qwen = transformers.Qwen3MoeConfig(num_hidden_layers=9, num_experts=24, num_experts_per_tok=3,
                                       decoder_sparse_step=2, mlp_only_layers=[3, 4])
    assert moe_shape(qwen)["layers"] == 3  # layers 1, 5, 7 (3 is listed dense; 0, 2, 4, 6, 8 fall between steps)
    deepseek = transformers.DeepseekV2Config(num_hidden_layers=7, n_routed_experts=10, num_experts_per_tok=6,
                                             first_k_dense_replace=2, moe_layer_freq=2)
    assert moe_shape(deepseek)["layers"] == 3  # from layer 2 on, every second: 2, 4, 6


def test_a_dense_model_has_no_moe_shape():
    assert moe_shape(transformers.LlamaConfig(num_hidden_layers=2)) is None
    assert moe_shape(transformers.Qwen2MoeConfig(num_hidden_layers=2, num_experts=0)) is None


def _vllm_config(scheduler_cls=None, async_scheduling=False, served_model_name="tiny"):
    """A stand-in for vLLM's VllmConfig with the attribute paths engine_info reads, so that every scheduler
    setting is checked without vLLM (a real one: test_engine_info_of_a_real_vllm_config)."""
    hf = transformers.Qwen3MoeConfig(num_hidden_layers=4, num_experts=16, num_experts_per_tok=4)
    return SimpleNamespace(
        model_config=SimpleNamespace(served_model_name=served_model_name, model="/models/tiny", hf_text_config=hf),
        scheduler_config=SimpleNamespace(max_num_seqs=16, scheduler_cls=scheduler_cls,
                                         async_scheduling=async_scheduling))


def test_engine_info_has_the_versioned_shape():
    info = engine_info(_vllm_config(), {"VLLM_PLUGINS": "moe_cohort"}, vllm_version="0.32.0")
    assert info == {"object": "cohort.engine_info", "schema": 1, "plugin_version": version("moe-cohort"),
                    "vllm_version": "0.32.0", "model": "tiny", "moe": {"layers": 4, "experts": 16, "top_k": 4},
                    "max_num_seqs": 16,
                    "scheduler": {"expert_aware": False, "class": "vllm.v1.core.sched.scheduler.Scheduler",
                                  "base": "Scheduler", "prefill_ahead": 0},
                    "observed_counts": True, "policies": list(POLICY_NAMES)}
    assert info["policies"][:2] == ["topk", "xshare"]


class PlainScheduler:  # a scheduler class given as a class, not a name
    pass


@pytest.mark.parametrize("scheduler_cls, async_scheduling, expected", [
    (None, False, {"expert_aware": False, "class": "vllm.v1.core.sched.scheduler.Scheduler", "base": "Scheduler", "prefill_ahead": 0}),
    (None, True, {"expert_aware": False, "class": "vllm.v1.core.sched.async_scheduler.AsyncScheduler",
                  "base": "AsyncScheduler", "prefill_ahead": 0}),
    (OURS, False, {"expert_aware": True, "class": OURS, "base": "Scheduler", "prefill_ahead": 0}),
    (OURS, True, {"expert_aware": True, "class": OURS, "base": "AsyncScheduler", "prefill_ahead": 0}),
    (OURS_ASYNC, False, {"expert_aware": True, "class": OURS_ASYNC, "base": "AsyncScheduler", "prefill_ahead": 0}),  # forces async
    (PlainScheduler, False, {"expert_aware": False, "class": f"{__name__}.PlainScheduler", "base": "Scheduler", "prefill_ahead": 0}),
])
def test_scheduler_is_named_and_ours_recognised(scheduler_cls, async_scheduling, expected):
    info = engine_info(_vllm_config(scheduler_cls, async_scheduling), {}, vllm_version="0.32.0")
    assert info["scheduler"] == expected


def test_the_model_is_the_served_name_else_the_path():
    assert engine_info(_vllm_config(served_model_name=None), {}, vllm_version="x")["model"] == "/models/tiny"


PLUGIN_LISTS = [(None, False), ("moe_cohort", True), ("a,moe_cohort", True), ("none", False), ("", False),
                ("a, moe_cohort", False), ("moe_cohort_extra", False)]


@pytest.mark.parametrize("value, loaded", PLUGIN_LISTS)
def test_endpoint_plugin_loaded_follows_vllm_plugins(value, loaded):
    assert endpoint_plugin_loaded({} if value is None else {"VLLM_PLUGINS": value}) is loaded


@pytest.mark.skipif(not has_vllm, reason="vLLM is not installed")
@pytest.mark.parametrize("value, loaded", PLUGIN_LISTS)
def test_endpoint_plugin_loaded_agrees_with_vllms_own_reading(monkeypatch, value, loaded):
    """vLLM loads an endpoint plugin iff VLLM_PLUGINS, as vllm.envs parses it, is set and lists its name."""
    from vllm.envs import environment_variables

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    if value is not None:
        monkeypatch.setenv("VLLM_PLUGINS", value)
    allowed = environment_variables["VLLM_PLUGINS"]()
    assert endpoint_plugin_loaded(os.environ) is (allowed is not None and "moe_cohort" in allowed) is loaded


def test_info_labels_are_the_facts_as_strings():
    info = engine_info(_vllm_config(OURS), {}, vllm_version="0.32.0")
    assert info_labels(info) == {
        "schema": "1", "plugin_version": version("moe-cohort"), "vllm_version": "0.32.0", "model": "tiny",
        "moe_layers": "4", "experts": "16", "top_k": "4", "max_num_seqs": "16", "expert_aware_scheduler": "true",
        "scheduler_class": OURS, "scheduler_base": "Scheduler", "prefill_ahead": "0", "observed_counts": "false",
        "policies": ",".join(POLICY_NAMES)}
    dense = info_labels({**info, "moe": None})
    assert (dense["moe_layers"], dense["experts"], dense["top_k"]) == ("", "", "")
    assert info_labels(info).keys() == dense.keys()  # one label set: the gauge is registered once


@pytest.mark.skipif(not has_vllm, reason="vLLM is not installed")
def test_info_route_serves_the_kept_description_else_503(monkeypatch):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from moe_cohort.engine import vllm_patches
    from moe_cohort.engine.observed_endpoint import ObservedEndpoint

    app = FastAPI()
    ObservedEndpoint().attach_router(app)
    client = TestClient(app)
    monkeypatch.setattr(vllm_patches, "STATE", vllm_patches.PluginState())
    missing = client.get("/v1/cohort/info")
    assert missing.status_code == 503 and "no engine description" in missing.json()["error"]["message"]
    assert missing.json()["error"]["type"] == "invalid_request_error"
    info = engine_info(_vllm_config(), {}, vllm_version="0.32.0")  # built where VLLM_PLUGINS was unset
    monkeypatch.setattr(vllm_patches, "STATE", vllm_patches.PluginState(engine_info=info))
    served = client.get("/v1/cohort/info")
    assert served.status_code == 200 and served.json() == {**info, "observed_counts": True}


@pytest.mark.skipif(not has_vllm, reason="vLLM is not installed")
def test_engine_info_of_a_real_vllm_config(tmp_path):
    """vLLM's own config objects, from a model folder that holds only a config.json (no weights are read)."""
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

    hf = transformers.Qwen3MoeConfig(num_hidden_layers=6, hidden_size=64, intermediate_size=128,
                                     moe_intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                                     head_dim=32, num_experts=16, num_experts_per_tok=4, decoder_sparse_step=2,
                                     mlp_only_layers=[3], vocab_size=300, architectures=["Qwen3MoeForCausalLM"])
    hf.save_pretrained(tmp_path)
    config = VllmConfig(model_config=ModelConfig(model=str(tmp_path), max_model_len=256, skip_tokenizer_init=True,
                                                 served_model_name=["tiny", "alias"]),
                        scheduler_config=SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=256, max_model_len=256,
                                                         is_encoder_decoder=False),
                        cache_config=CacheConfig(block_size=16))
    config.scheduler_config.scheduler_cls = OURS
    import vllm

    from moe_cohort.engine.scheduler import reserve_prefill_ahead

    reserve_prefill_ahead(config)  # what the plugin does where vLLM builds its config: 3 decode + 16 x 3 ahead
    assert config.scheduler_config.max_num_seqs == 3 + 48
    info = engine_info(config, {"VLLM_PLUGINS": "moe_cohort"})
    assert info["vllm_version"] == vllm.__version__ and info["model"] == "tiny" and info["max_num_seqs"] == 3
    assert routed_layers("qwen", hf) == 2  # layers 1 and 5 (3 is listed dense)
    assert info["moe"] == {"layers": 2, "experts": 16, "top_k": 4}
    base = "AsyncScheduler" if config.scheduler_config.async_scheduling else "Scheduler"  # vLLM CPU: off
    assert info["scheduler"] == {"expert_aware": True, "class": OURS, "base": base, "prefill_ahead": 48}
    assert info["observed_counts"] is True

"""Pieces of the vLLM wiring that run without a server: the custom op under torch.compile,
router description, model limits, and request validation."""

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from moe_cohort.engine import vllm_patches
from moe_cohort.engine.engine_state import RequestOptions, build_step
from moe_cohort.engine.metrics import ExpertLoadMetrics
from moe_cohort.engine.policy import PolicyError, TopK, parse_policy
from moe_cohort.engine.routing_hook import HookConfig, LayerInfo, RoutingHook
from moe_cohort.engine.selection import select_topk

has_vllm = importlib.util.find_spec("vllm") is not None
LYNX = parse_policy("lynx-lat;drop=6")


@pytest.fixture
def hook(monkeypatch):
    hook = RoutingHook(HookConfig(), ExpertLoadMetrics())
    hook.layers[0] = LayerInfo(top_k=4, num_experts=16)
    monkeypatch.setattr(vllm_patches, "STATE", vllm_patches.PluginState(hook=hook))
    vllm_patches._define_custom_op()
    return hook


def _step():
    opts = [RequestOptions(TopK(), False), RequestOptions(LYNX, False), RequestOptions(LYNX, False)]
    return build_step(["a", "b", "c"], [0, 1, 2, 3], [5, 5, 5], [3, 3, 3], opts)


def test_custom_op_under_torch_compile_matches_eager(hook):
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(0)) * 3
    weights, ids = select_topk(logits, 4)
    ids = ids.int()
    hook.begin_step(_step())
    eager_w, eager_ids = hook.route(0, logits, weights, ids)
    hook.end_step()

    @torch.compile(fullgraph=True, backend="aot_eager", dynamic=True)
    def moe_layer(logits, weights, ids):
        w, i = torch.ops.moe_cohort.plugin_route(logits, weights, ids, 0)
        return w * 2, i + 0  # the graph goes on using the op's outputs

    hook.begin_step(_step())
    compiled_w, compiled_ids = moe_layer(logits, weights, ids)
    hook.end_step()
    assert torch.equal(compiled_ids, eager_ids) and torch.allclose(compiled_w, 2 * eager_w)
    assert not torch.equal(eager_ids[1:], ids[1:])  # the policy rows did change
    # the op ran inside the compiled graph and counted both forwards
    assert hook.metrics.value("cohort_moe_layer_forwards_total", "decode", "lynx-lat;drop=6") == 2


def test_custom_op_output_never_aliases_its_input(hook):
    logits = torch.randn(2, 16)
    weights, ids = select_topk(logits, 4)
    w, i = torch.ops.moe_cohort.plugin_route(logits, weights, ids, 0)  # no step: unchanged values
    assert torch.equal(w, weights) and w.data_ptr() != weights.data_ptr() and i.data_ptr() != ids.data_ptr()


def test_route_safely_keeps_the_router_choice_when_the_hook_fails(hook, monkeypatch, caplog):
    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(hook, "route", broken)
    weights, ids = torch.rand(2, 4), torch.zeros(2, 4, dtype=torch.int32)
    for _ in range(3):
        assert vllm_patches.route_safely(0, torch.randn(2, 16), weights, ids) == (weights, ids)
    vllm_patches.route_safely(1, torch.randn(2, 16), weights, ids)
    assert caplog.text.count("Traceback") == 2  # once per layer, not once per call
    assert "routing failed in MoE layer 0" in caplog.text and "routing failed in MoE layer 1" in caplog.text


def test_layer_info_describes_plain_and_special_routers():
    plain = SimpleNamespace(top_k=8, global_num_experts=128, renormalize=False, scoring_func="softmax")
    assert vllm_patches.layer_info(plain) == LayerInfo(8, 128, renormalize=False)
    biased = SimpleNamespace(top_k=8, global_num_experts=256, scoring_func="sigmoid",
                             e_score_correction_bias=torch.zeros(256), routed_scaling_factor=2.5)
    info = vllm_patches.layer_info(biased)
    assert info.scoring == "sigmoid" and info.scale == 2.5 and not info.supports_policies


@pytest.mark.parametrize("config, expected", [
    (SimpleNamespace(num_experts_per_tok=8, num_experts=128), {"top_k": 8, "num_experts": 128}),  # Qwen3-MoE
    (SimpleNamespace(num_experts_per_tok=2, num_local_experts=8), {"top_k": 2, "num_experts": 8}),  # Mixtral
    (SimpleNamespace(num_experts_per_tok=6, n_routed_experts=64), {"top_k": 6, "num_experts": 64}),  # DeepSeek
    (SimpleNamespace(hidden_size=64), {}),  # dense model: nothing to check
])
def test_model_limits(config, expected):
    assert vllm_patches.model_limits(config) == expected


@pytest.mark.skipif(not has_vllm, reason="vLLM is not installed")
def test_validation_raises_vllm_400_errors_and_skips_the_prefix_cache(monkeypatch):
    from vllm.exceptions import VLLMValidationError

    from moe_cohort.engine.vllm_plugin import PluginConfig

    config = PluginConfig.from_env({})
    monkeypatch.setattr(vllm_patches, "STATE", vllm_patches.PluginState(model_limits={"top_k": 4, "num_experts": 16}))

    def params(extra):
        return SimpleNamespace(extra_args=extra, skip_reading_prefix_cache=None)

    with pytest.raises(VLLMValidationError, match="invalid vllm_xargs.moe_routing: oea: key 'k0' must be <= top_k=4"):
        vllm_patches.validate_extra_args(params({"moe_routing": "oea;k0=5"}), config)
    with pytest.raises(VLLMValidationError, match="invalid vllm_xargs.moe_record"):
        vllm_patches.validate_extra_args(params({"moe_record": "x"}), config)
    with pytest.raises(VLLMValidationError, match="invalid vllm_xargs.moe_record: this server does not record"):
        vllm_patches.validate_extra_args(params({"moe_record": True}), config)  # recording is off (the default)
    vllm_patches.validate_extra_args(params({"moe_record": False}), config)
    config = PluginConfig.from_env({"COHORT_RECORD_TRACES": "request"})
    for extra, skips in [({"moe_routing": LYNX.name + ";drop=2"}, None),  # decode only: cache is fine
                         ({"moe_routing": "xshare;m=4"}, True),  # changes prefill: compute it
                         ({"moe_record": True}, True),  # recording needs every position computed
                         ({}, None)]:
        p = params(extra)
        vllm_patches.validate_extra_args(p, config)
        assert p.skip_reading_prefix_cache is skips


def _engine_config(v2=False, cudagraph="NONE"):
    return SimpleNamespace(use_v2_model_runner=v2,
                           compilation_config=SimpleNamespace(cudagraph_mode=SimpleNamespace(name=cudagraph)))


def test_engine_settings_that_would_bypass_the_plugin_are_refused(monkeypatch):
    assert vllm_patches.check_engine_config(_engine_config()) is False  # V1 runner, no CUDA graphs
    with pytest.raises(RuntimeError, match="Model Runner V2 was chosen.*unset VLLM_USE_V2_MODEL_RUNNER"):
        vllm_patches.check_engine_config(_engine_config(v2=True))
    monkeypatch.setattr(vllm_patches.importlib.util, "find_spec", lambda name: object())
    assert vllm_patches.check_engine_config(_engine_config(cudagraph="FULL_AND_PIECEWISE")) is True
    monkeypatch.setattr(vllm_patches.importlib.util, "find_spec", lambda name: None)  # no Triton
    with pytest.raises(RuntimeError, match="CUDA graphs need the Triton selection kernels"):
        vllm_patches.check_engine_config(_engine_config(cudagraph="FULL_AND_PIECEWISE"))


def test_policies_the_captured_kernels_cannot_serve_are_refused_under_cuda_graphs(monkeypatch):
    from moe_cohort.engine.vllm_plugin import PluginConfig

    limits = {"top_k": 4, "num_experts": 16, "graphs": True}
    monkeypatch.setattr(vllm_patches, "STATE", vllm_patches.PluginState(model_limits=limits))
    config = PluginConfig.from_env({})
    vllm_patches.check_policy(parse_policy("oea;k0=1;max_p=8"), config)   # 2 x top_k: ranked
    with pytest.raises(PolicyError, match="cannot run in the engine's CUDA graphs.*COHORT_GRAPH_RANK_WIDTH >= 9"):
        vllm_patches.check_policy(parse_policy("oea;k0=1;max_p=9"), config)
    with pytest.raises(PolicyError, match="COHORT_GRAPH_XSHARE_SPEC=1"):
        vllm_patches.check_policy(parse_policy("xshare-spec;m=4"), config)
    spec_config = PluginConfig.from_env({"COHORT_GRAPH_XSHARE_SPEC": "1", "COHORT_GRAPH_RANK_WIDTH": "9"})
    vllm_patches.check_policy(parse_policy("xshare-spec;m=4"), spec_config)
    vllm_patches.check_policy(parse_policy("oea;k0=1;max_p=9"), spec_config)
    limits["graphs"] = False                                                 # eager engine: all fine
    vllm_patches.check_policy(parse_policy("xshare-spec;m=4"), config)


def test_the_plugin_chooses_the_v1_runner_only_where_the_user_did_not_choose():
    environ = {}
    assert vllm_patches.choose_model_runner(environ) is True and environ == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert vllm_patches.choose_model_runner(environ) is False  # chosen already: nothing more, no second log line
    for explicit in ("1", "0", "true"):
        environ = {"VLLM_USE_V2_MODEL_RUNNER": explicit}
        assert vllm_patches.choose_model_runner(environ) is False and environ["VLLM_USE_V2_MODEL_RUNNER"] == explicit


@pytest.mark.integration
@pytest.mark.skipif(not has_vllm, reason="vLLM is not installed")
@pytest.mark.parametrize("runner", [None, "0"])
def test_vllm_builds_its_engine_config_on_the_runner_the_plugin_hooks(tiny_moe_dir, runner):
    """A fresh process loads vLLM's plugins as `vllm serve` does and builds the engine config of the tiny MoE:
    without a choice the plugin chose V1 (the config says so), an explicit 0 is kept; V2 forced through the
    config object (vLLM CPU has no Triton, so it refuses VLLM_USE_V2_MODEL_RUNNER=1 itself) is refused by the
    plugin, naming the variable."""
    import os
    import subprocess
    import sys

    code = f"""
import os
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.engine.arg_utils import EngineArgs
from moe_cohort.engine.vllm_patches import check_engine_config
config = EngineArgs(model={str(tiny_moe_dir)!r}, max_model_len=256, enforce_eager=True).create_engine_config()
print("V2" if config.use_v2_model_runner else "V1", os.environ.get("VLLM_USE_V2_MODEL_RUNNER"))
type(config).use_v2_model_runner = property(lambda self: True)  # a feature that needs V2, or an explicit choice
try:
    check_engine_config(config)
except RuntimeError as exc:
    print("refused", exc)
"""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_USE_V2_MODEL_RUNNER"}
    if runner == "0":
        env["VLLM_USE_V2_MODEL_RUNNER"] = runner
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    chosen, refused = done.stdout.strip().splitlines()[-2:]
    assert chosen == "V1 0"
    assert refused.startswith("refused") and "Model Runner V2 was chosen" in refused


@pytest.mark.skipif(not has_vllm, reason="vLLM is not installed")
@pytest.mark.parametrize("module, cls, member", vllm_patches.PATCHED)
def test_every_patched_member_exists_in_the_installed_vllm(module, cls, member):
    assert callable(getattr(vllm_patches.patched_class(module, cls), member))


@pytest.mark.integration
@pytest.mark.skipif(not has_vllm, reason="vLLM is not installed")
def test_register_is_idempotent_and_patches_once():
    """In a fresh process (patching vLLM classes must not leak into this one)."""
    import subprocess
    import sys

    code = """
from moe_cohort.engine.vllm_plugin import register
from moe_cohort.engine.vllm_patches import PATCHED, patched_class
register(); register()
for module, cls, member in PATCHED:
    fn = getattr(patched_class(module, cls), member)
    ours = fn.__code__.co_filename.endswith("vllm_patches.py")
    assert ours and not fn.__wrapped__.__code__.co_filename.endswith("vllm_patches.py"), (cls, member)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]

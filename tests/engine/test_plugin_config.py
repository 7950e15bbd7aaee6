"""Plugin configuration, version check and layering (no vLLM server needed)."""

import subprocess
import sys
from pathlib import Path

import pytest

from moe_cohort.engine.policy import PolicyError, TopK, parse_policy
from moe_cohort.engine.vllm_plugin import PluginConfig, UnsupportedVllmError, check_vllm_version


def test_config_defaults():
    config = PluginConfig.from_env({})
    assert config.default_policy == TopK() and not config.record_all and config.metrics
    assert config.trace_dir == Path("cohort-traces").absolute()


def test_config_from_environment(tmp_path):
    config = PluginConfig.from_env({"COHORT_DEFAULT_POLICY": "oea;k0=2", "COHORT_RECORD_TRACES": "1",
                                    "COHORT_TRACE_DIR": str(tmp_path), "COHORT_MOE_METRICS": "0"})
    assert config == PluginConfig(parse_policy("oea;k0=2"), True, tmp_path, False)


def test_recording_on_request_is_the_operators_choice():
    assert (PluginConfig.from_env({}).record_all, PluginConfig.from_env({}).record_requests) == (False, False)
    on_request = PluginConfig.from_env({"COHORT_RECORD_TRACES": "Request"})
    assert (on_request.record_all, on_request.record_requests) == (False, True)
    assert PluginConfig.from_env({"COHORT_RECORD_TRACES": "1"}).record_all


def test_bad_default_policy_names_the_variable():
    with pytest.raises(PolicyError, match="COHORT_DEFAULT_POLICY='xshare': xshare: needs key 'm'"):
        PluginConfig.from_env({"COHORT_DEFAULT_POLICY": "xshare"})


def test_bad_flag_names_the_variable():
    with pytest.raises(ValueError, match="COHORT_RECORD_TRACES must be 0 or 1, got 'sometimes'"):
        PluginConfig.from_env({"COHORT_RECORD_TRACES": "sometimes"})


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.33.0"])
def test_supported_versions(version):
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0"])
def test_unsupported_versions_raise_a_clear_error(version):
    with pytest.raises(UnsupportedVllmError, match=rf"vLLM {version} is not supported \(supported: 0.32.x, 0.33.x\)"):
        check_vllm_version(version)
    check_vllm_version(version, allow_untested=True)  # the escape hatch only warns


@pytest.mark.integration
def test_engine_side_modules_do_not_import_vllm():
    """Layering: only engine.vllm_plugin's lazily loaded engine.vllm_patches imports vLLM."""
    modules = ["moe_cohort.engine.vllm_plugin", "moe_cohort.engine.routing_hook", "moe_cohort.engine.engine_state", "moe_cohort.engine.metrics",
               "moe_cohort.engine.recorder", "moe_cohort.embedded.vllm_server", "moe_cohort.devtools.tiny_moe", "moe_cohort.engine.policy", "moe_cohort.engine.selection"]
    code = (f"import sys, importlib; [importlib.import_module(m) for m in {modules!r}]; "
            "bad = sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')); "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_schedulers_bound_in_admissions_is_three_rounds_of_its_slots_unless_set():
    import pytest
    pytest.importorskip("vllm")
    from moe_cohort.engine.scheduler import max_passed

    assert max_passed(16, {}) == 48 and max_passed(16, {"COHORT_MAX_PASSED": "5"}) == 5
    assert max_passed(16, {"COHORT_MAX_PASSED": "0"}) == 48  # as the proxy's max_passed: 0 is the default
    with pytest.raises(ValueError, match="COHORT_MAX_PASSED must be a whole number"):
        max_passed(16, {"COHORT_MAX_PASSED": "-2"})

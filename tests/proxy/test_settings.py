import pytest

from proxy.settings import SettingsError, load_settings


def test_environment_then_flags():
    env = {"COHORT_MAX_WAIT_MS": "20", "COHORT_API_KEYS": "a, b", "COHORT_LOG_PROMPTS": "true", "COHORT_PORT": "9000"}
    s = load_settings({"port": 9100, "batch_size": None}, environ=env)
    assert (s.max_wait_ms, s.api_keys, s.log_prompts, s.port, s.batch_size) == (20.0, ("a", "b"), True, 9100, 16)
    assert s.flush_size == 16 and s.replace(window_size=64).flush_size == 64


@pytest.mark.parametrize("env, message", [
    ({"COHORT_PORT": "eighty"}, "COHORT_PORT='eighty': expected int"),
    ({"COHORT_BATCH_SIZE": "0"}, "batch_size must be >= 1"),
    ({"COHORT_LOG_PROMPTS": "maybe"}, "expected bool"),
    ({"COHORT_MAX_WAIT_MS": "-1"}, "max_wait_ms must be >= 0"),
])
def test_bad_values_name_the_setting(env, message):
    with pytest.raises(SettingsError, match=message):
        load_settings(environ=env)

import pytest

from proxy.settings import SettingsError, load_settings


def test_environment_then_flags():
    env = {"COHORT_MAX_QUEUE_MS": "20", "COHORT_API_KEYS": "a, b", "COHORT_LOG_PROMPTS": "true", "COHORT_PORT": "9000"}
    s = load_settings({"port": 9100, "max_in_flight": None}, environ=env)
    assert (s.max_queue_ms, s.api_keys, s.log_prompts, s.port, s.max_in_flight) == (20.0, ("a", "b"), True, 9100, 256)
    assert s.batch_in_flight == 256 and s.replace(batch_concurrency=8).batch_in_flight == 8


@pytest.mark.parametrize("env, message", [
    ({"COHORT_PORT": "eighty"}, "COHORT_PORT='eighty': expected int"),
    ({"COHORT_MAX_IN_FLIGHT": "0"}, r"max_in_flight \(env COHORT_MAX_IN_FLIGHT\) must be >= 1, got 0"),
    ({"COHORT_LOG_PROMPTS": "maybe"}, "expected bool"),
    ({"COHORT_MAX_QUEUE_MS": "-1"}, r"max_queue_ms \(env COHORT_MAX_QUEUE_MS\) must be a finite number >= 0, got -1.0"),
    ({"COHORT_DEFAULT_POLICY": "bogus"}, r"default_policy \(env COHORT_DEFAULT_POLICY\) 'bogus': .*allowed"),
])
def test_bad_values_name_the_setting(env, message):
    with pytest.raises(SettingsError, match=message):
        load_settings(environ=env)

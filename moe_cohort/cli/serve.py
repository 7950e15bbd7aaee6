"""`cohort serve`: the OpenAI-compatible proxy in front of vLLM (or of an embedded tiny-MoE vLLM).

Settings come from flags > COHORT_* variables > a config file (--config / COHORT_CONFIG) > defaults
(send/settings.py); every one is checked before anything starts, and a bad one is one line, exit 2. The flags
are the settings a user sets (`SETTINGS`), grouped by the settings' sections; every other setting (limits,
timeouts, fairness bounds, learning's tuning) is a variable and a config key, in docs/configuration.md.
With a backend, each replica is asked for /health at start-up, retried with backoff for backend_wait_s,
then the proxy starts anyway (requests get 502 until the replica is up).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import socket
import sys
import time
from pathlib import Path

from moe_cohort.cli.setting_flags import add_setting_flags, flag_overrides, flag_table, section_groups
from moe_cohort.send.setting_sources import CONFIG_VARIABLE, load_settings, setting_names
from moe_cohort.send.settings import Settings, SettingsError

# the settings `cohort serve` takes as flags, in the order of their sections
SETTINGS = ("backends", "replica_routing", "model_dir", "host", "port", "api_keys", "max_in_flight", "default_policy",
            "forward_profiles", "encoder", "learn", "data_dir")
_FLAGS = flag_table(SETTINGS)
EPILOG = ("Every setting, these and the rest (limits, timeouts, fairness bounds, learning's tuning, the Batch "
          "API's), is also a COHORT_* variable and a key of the --config file: docs/configuration.md lists them.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--config, then the settings' flags in one argument group per section (`--help` shows them so)."""
    parser.add_argument("--config", metavar="FILE", help=f"settings file, YAML or TOML, keys = setting names "
                        f"(e.g. port: 9000); flags and COHORT_* variables win over it (env {CONFIG_VARIABLE})")
    add_setting_flags(parser, _FLAGS, section_groups(parser))
    parser.epilog = EPILOG
    parser.set_defaults(no_progress=True)  # a server log is no terminal: no "Loading weights" bars


def run(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(flag_overrides(args, _FLAGS), config=args.config, flags=_FLAGS)
    except SettingsError as exc:
        return _fail(str(exc))
    from moe_cohort.send.profiles import encoder_problem

    problem = (encoder_problem(settings) or _port_problem(settings.host, settings.port, "port")
               or _data_dir_problem(settings.data_dir))
    if not problem and settings.backend_port and not settings.backends:
        problem = _port_problem("127.0.0.1", settings.backend_port, "backend_port")
    if problem:
        return _fail(problem)
    # SIGTERM (docker stop, systemd, kill) stops like Ctrl-C: uvicorn re-raises the signal after its
    # graceful shutdown, and with the default handler the process died there, leaving the embedded vLLM
    # (its own process group) running
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    server = None
    if settings.backends:
        for url in settings.backends:  # each replica
            wait_for_backend(url, settings.backend_wait_s, settings.backend_api_key)
    else:
        server, settings = _start_embedded(settings, explicit_in_flight=args.max_in_flight is not None)
    try:
        return _serve(settings)
    finally:
        if server is not None:
            print("stopping the embedded vLLM backend")
            server.stop()


def wait_for_backend(url: str, wait_s: float, api_key: str = "") -> bool:
    """Ask the backend's /health (then /v1/models: vLLM answers both, other OpenAI servers at least the second)
    until it answers, with backoff, for at most `wait_s` seconds; say what happens. True when it answered;
    never raises."""
    if wait_s <= 0:
        return False
    import asyncio

    from moe_cohort.send.backend_client import BackendClient

    client = BackendClient(url, api_key=api_key)
    deadline, delay = time.monotonic() + wait_s, 0.5
    while True:
        problem = asyncio.run(client.problem(3.0, ("/health", "/v1/models")))
        if problem is None:
            print(f"backend {url} is up")
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            print(f"warning: backend {url} still not answering after {wait_s:g} s ({problem}); starting anyway: "
                  f"requests get 502 until it is up, and the proxy uses it as soon as it answers")
            return False
        delay = min(delay, left)
        print(f"backend {url} not answering ({problem}); retrying in {delay:.1f} s "
              f"(starting anyway after {wait_s:g} s, backend_wait_s)")
        time.sleep(delay)
        delay = min(delay * 2, 8.0)


def _port_problem(host: str, port: int, name: str) -> str | None:
    """A port that another process holds, or a host that is no local address: one line now, naming the setting
    `name` (port, backend_port), not a bind error after vLLM has started."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if exc.errno == errno.EADDRINUSE:
            return (f"{setting_names(name, _FLAGS)}: cannot listen on {host}:{port} ({reason}); is another server "
                    f"on it? pick another port")
        return (f"{setting_names('host', _FLAGS)}: cannot listen on {host}:{port} ({reason}); give an address of "
                f"this machine, e.g. 127.0.0.1 or 0.0.0.0 for all")
    return None


def _data_dir_problem(data_dir: str) -> str | None:
    """An explicit data_dir that cannot be created or written (it is created on first use)."""
    if not data_dir:
        return None
    path = Path(data_dir).expanduser()
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    named = setting_names("data_dir", _FLAGS)
    if existing is not None and not existing.is_dir():
        return f"{named} {path}: {existing} is a file, not a folder"
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        return f"{named} {path}: {existing} is not writable"
    return None


def _start_embedded(settings: Settings, *, explicit_in_flight: bool):
    """vLLM CPU on the tiny MoE trained on text (trained into model_dir first when it holds no model), on
    backend_port, with the plugin and the expert-aware scheduler; the settings pointed at it. Its slots
    (max_num_seqs) are the given max_in_flight, else 16; the proxy takes its own from the engine's handshake."""
    from moe_cohort.embedded.backend import TRAIN_MINUTES, default_model_dir, ensure_trained_model, has_model, \
        start_embedded_backend
    from moe_cohort.embedded.placement import move_process, split_cpus

    given = explicit_in_flight or settings.max_in_flight != Settings.max_in_flight  # a flag, variable or file
    max_num_seqs = settings.max_in_flight if given else 16
    path = Path(settings.model_dir).expanduser() if settings.model_dir else default_model_dir()
    if not has_model(path):
        print(f"no model in {path}: training the tiny MoE on text there, once (it takes {TRAIN_MINUTES}; "
              f"--model-dir DIR serves a model folder of yours)...", flush=True)
    path = ensure_trained_model(path)
    print(f"no --backend given: starting a local vLLM CPU server on the tiny MoE in {path} (with the moe-cohort "
          f"plugin and its expert-aware scheduler, max_num_seqs {max_num_seqs}; this can take a few minutes)...",
          flush=True)
    placement = split_cpus()  # no process of ours beside one of vLLM's (embedded/placement.py)
    if placement:
        move_process(placement.ours)  # before anything of ours starts: the learner and encoder threads inherit it
    server = start_embedded_backend(path, max_num_seqs=max_num_seqs, port=settings.backend_port or None,
                                    cpus=placement and placement.engine)
    print(f"vLLM backend ready at {server.url} (model '{server.served_model_name}', log {server.log_path})")
    if placement:
        print(f"vLLM runs on CPUs {_cpus(placement.engine)}, the proxy on {_cpus(placement.ours)}")
    return server, settings.replace(backends=(server.url,))


def _cpus(cpus) -> str:
    return ",".join(map(str, sorted(cpus)))


def _serve(settings: Settings) -> int:
    """Listen at once (proxy/http/starting.py answers 503 "not ready" meanwhile) and build the proxy, whose
    encoder may take minutes the first time (encoder/static.py distils it); 1 when it could not be built."""
    import uvicorn

    from moe_cohort.proxy.app import create_app
    from moe_cohort.proxy.http.limits import server_options
    from moe_cohort.proxy.http.starting import Starting
    from moe_cohort.send.profiles import limit_threads

    where = f"http://{settings.host}:{settings.port}"
    replicas = f", replica routing {settings.replica_routing}" if len(settings.backends) > 1 else ""

    def ready() -> None:  # in the server's thread, as before it served: the encoder's libraries are loaded now
        limit_threads(settings.encoder_threads)
        print(f"moe-cohort proxy ready on {where}/v1 -> {', '.join(settings.backends)} (policy {settings.default_policy}"
              f"{replicas}); point an OpenAI client at base_url={where}/v1. Ctrl-C stops.", flush=True)
        print(app.app.state.proxy.configuration, flush=True)

    encoder = settings.encoder.lower() != "none"
    app = Starting(lambda: create_app(settings), on_ready=ready,  # create_app loads the encoder
                   on_failed=lambda exc: setattr(server, "should_exit", True),
                   doing="loading the encoder" if encoder else "starting")
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **server_options(settings)))  # host, port, head limits
    loading = f", loading its encoder ({settings.encoder or 'the packaged MiniLM'})" if encoder else ""
    print(f"moe-cohort proxy listening on {where}{loading}; GET /health answers 503 until it is ready", flush=True)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises Ctrl-C (or SIGTERM, above) after its shutdown
        server.run()
    if app.failed is not None:
        print(f"cohort serve: error: the proxy could not start: {app.failed}", file=sys.stderr)
        return 1
    return 0


def _fail(message: str) -> int:
    print(f"cohort serve: error: {message}", file=sys.stderr)
    return 2

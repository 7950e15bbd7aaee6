"""`cohort serve`: the OpenAI-compatible proxy in front of vLLM (or of an embedded tiny-MoE vLLM).

Settings come from flags > COHORT_* variables > a config file (--config / COHORT_CONFIG) > defaults
(proxy/settings.py), its flags grouped by the settings' sections; every one is checked before anything
starts, and a bad one is one line, exit 2.
With --backend, the backend is asked for /health at start-up, retried with backoff for
--backend-wait-s, then the proxy starts anyway (requests get 502 until the backend is up).
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

from moe_cohort.cli.checks import ENCODER_CHOICES
from moe_cohort.cli.setting_flags import add_setting_flags, flag_overrides, section_groups
from moe_cohort.proxy.setting_sources import load_settings
from moe_cohort.proxy.settings import Settings, SettingsError

# flag -> Settings field; defaults live in Settings (and COHORT_* variables), not here
_FLAGS = {
    "--backend": ("backend_url", list, "vLLM server to front, e.g. http://127.0.0.1:8000; repeat it for several "
                                       "replicas (a comma list in the variable), each with --max-in-flight slots "
                                       "(default: start a tiny one)"),
    "--routing": ("routing", str, "which replica takes which request: affinity, least-loaded or round-robin"),
    "--backend-api-key": ("backend_api_key", str, "API key to send to the backend"),
    "--request-timeout-s": ("request_timeout_s", float, "backend timeout per request"),
    "--host": ("host", str, "address to listen on"),
    "--port": ("port", int, "port to listen on"),
    "--max-body-bytes": ("max_body_bytes", int, "largest request body accepted"),
    "--max-header-bytes": ("max_header_bytes", int, "largest request head (target and headers together); over "
                                                     "it: 431"),
    "--max-headers": ("max_headers", int, "most headers a request may have; over it: 431"),
    "--head-timeout-s": ("head_timeout_s", float, "seconds a connection has to send a request's whole head "
                                                  "(from its opening or the last answer's end); then it is closed"),
    "--allowed-policy": ("allowed_policies", list, "a routing policy clients may ask for (X-MoE-Routing, "
                                                   "vllm_xargs.moe_routing): a name such as oea (any parameters) or "
                                                   "a policy such as 'xshare;m=24'; repeatable (default: any)"),
    "--max-in-flight": ("max_in_flight", int, "requests at each replica at once (default: from its vLLM: its "
                                               "max_num_seqs, more where vLLM runs moe-cohort's scheduler, 256 where "
                                               "it does not say; the embedded vLLM: 16)"),
    "--max-queue-ms": ("max_queue_ms", float, "fairness bound: a request waiting this long is admitted first"),
    "--max-passed": ("max_passed", int, "fairness bound: a request that this many later arrivals were admitted "
                                         "before goes first (default: 3 x the replica's slots)"),
    "--default-policy": ("default_policy", str, "routing policy when a request has no X-MoE-Routing header"),
    "--profile-deadline-ms": ("profile_deadline_ms", float, "longest wait for a request's predicted profile; past "
                                                             "it the request goes on without one (default: 50 for a "
                                                             "static encoder, 500 for a transformer)"),
    "--encoder": ("encoder", str, f"predicts each request's experts from its text: {ENCODER_CHOICES}; 'none': "
                                  f"no prediction, first come, first served"),
    "--encoder-threads": ("encoder_threads", int, "CPU threads the encoder may use (torch, BLAS, tokenizer); 1 "
                                                   "leaves the other cores to the engine"),
    "--learn-sample-rate": ("learn_sample_rate", float, "with --learn: share of the requests the reservoir does "
                                                         "not keep that are observed anyway, for the live fit "
                                                         "(the reservoir keeps every request until it is full, "
                                                         "then capacity / seen of them)"),
    "--learn-capacity": ("learn_capacity", int, "with --learn: observations kept (a uniform sample of all seen)"),
    "--learn-refit-every": ("learn_refit_every", int, "with --learn: kept observations between refits, at least"),
    "--data-dir": ("data_dir", str, "Batch API storage (uploaded files, results, SQLite records) and the learned "
                                    "head (learned/) (default: $XDG_DATA_HOME/moe-cohort or ~/.local/share/moe-cohort)"),
    "--max-file-bytes": ("max_file_bytes", int, "largest file uploaded to /v1/files (Batch API input)"),
}
BACKEND_WAIT_S = 30.0
# --learn: where the head it learns comes from, and what admission reads before its first
LEARN_HELP = ("learn the profile head online from the engine's routing of answered requests: the expert counts "
              "that moe-cohort's vLLM plugin serves (VLLM_PLUGINS=moe_cohort), or vLLM's routed_experts in "
              "non-streamed answers (a vLLM started with --enable-return-routed-experts); it starts from what "
              "earlier runs learned, kept in --data-dir/learned, and until its first head admission reads the "
              "head of an --encoder folder from `cohort train` (fitted on recorded traces), if it has one "
              "(default: on when a replica serves its expert counts; env COHORT_LEARN)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags in one argument group per section of the settings (`--help` shows them so)."""
    parser.add_argument("--config", metavar="FILE", help="settings file, YAML or TOML, keys = setting names "
                        "(e.g. port: 9000); flags and COHORT_* variables win over it (env COHORT_CONFIG)")
    groups = section_groups(parser)
    groups["api_keys"].add_argument("--api-key", dest="api_keys", action="append", help="accept this proxy API key "
                                    "(repeatable; env COHORT_API_KEYS=k1,k2; default: none, the proxy is open)")
    groups["learn"].add_argument("--learn", action=argparse.BooleanOptionalAction, default=None, help=LEARN_HELP)
    add_setting_flags(parser, _FLAGS, groups)
    backend = groups["backend_url"]
    backend.add_argument("--backend-wait-s", type=_seconds, default=BACKEND_WAIT_S,
                         help="with --backend: how long to retry its /health at start-up before starting anyway; "
                              "0: do not check")
    backend.add_argument("--model-dir", help="without --backend: model folder for the embedded vLLM, served as it "
                         "is; without a model there, the tiny MoE is trained on text into it once (default: "
                         "trained-tiny-moe-model in $COHORT_CACHE_DIR, else $XDG_CACHE_HOME/moe-cohort or "
                         "~/.cache/moe-cohort)")
    backend.add_argument("--backend-port", type=_port, help="without --backend: port of the embedded vLLM "
                         "(default: a free port)")
    groups["log_prompts"].add_argument("--log-prompts", action="store_true", default=None,
                                       help="log prompt texts (off: they are user data; env COHORT_LOG_PROMPTS)")
    access = groups["api_keys"]
    access.add_argument("--protect-metrics", action="store_true", default=None, help="/metrics needs an --api-key and "
                        "/health shows callers without one only its status (env COHORT_PROTECT_METRICS)")
    access.add_argument("--api-docs", action="store_true", default=None, help="serve /openapi.json, /docs and /redoc "
                        "(behind the --api-key like every route; /docs and /redoc load JavaScript from a CDN; "
                        "default: off, env COHORT_API_DOCS)")
    access.add_argument("--trust-client-hints", action="store_true", default=None, help="forward what clients send "
                        "in vllm_xargs.moe_profile and moe_record (trusted callers only: a client's profile can put it "
                        "first in the engine's queue, moe_record writes its prompt to the engine's disk; default: "
                        "dropped; env COHORT_TRUST_CLIENT_HINTS)")
    groups["forward_profiles"].add_argument(
        "--forward-profiles", action=argparse.BooleanOptionalAction, default=None, help="every request waits for its "
        "prediction (--profile-deadline-ms at most) and carries it: vllm_xargs.moe_profile for a vLLM running "
        "moe-cohort's expert-aware scheduler, x-cohort-key for a router such as llm-d's (default: on for each "
        "replica whose vLLM runs that scheduler, which then admits; env COHORT_FORWARD_PROFILES)")
    parser.set_defaults(no_progress=True)  # a server log is no terminal: no "Loading weights" bars


def run(args: argparse.Namespace) -> int:
    overrides = flag_overrides(args, _FLAGS)
    overrides.update(api_keys=tuple(args.api_keys) if args.api_keys else None, log_prompts=args.log_prompts,
                     protect_metrics=args.protect_metrics, forward_profiles=args.forward_profiles,
                     api_docs=args.api_docs, trust_client_hints=args.trust_client_hints, learn=args.learn)
    try:
        settings = load_settings(overrides, config=args.config, flags={**_FLAGS, "--api-key": ("api_keys", list, "")})
    except SettingsError as exc:
        return _fail(str(exc))
    from moe_cohort.proxy.profiles import encoder_problem

    problem = (encoder_problem(settings) or _port_problem(settings.host, settings.port, "--port (env COHORT_PORT)")
               or _data_dir_problem(settings.data_dir))
    if not problem and args.backend_port and not settings.backend_url:
        problem = _port_problem("127.0.0.1", args.backend_port, "--backend-port")
    if problem:
        return _fail(problem)
    # SIGTERM (docker stop, systemd, kill) stops like Ctrl-C: uvicorn re-raises the signal after its
    # graceful shutdown, and with the default handler the process died there, leaving the embedded vLLM
    # (its own process group) running
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    server = None
    if settings.backend_url:
        for url in settings.backend_urls:  # each replica
            wait_for_backend(url, args.backend_wait_s)
    else:
        server, settings = _start_embedded(settings, args.model_dir, args.backend_port,
                                           explicit_in_flight=args.max_in_flight is not None)
    try:
        return _serve(settings)
    finally:
        if server is not None:
            print("stopping the embedded vLLM backend")
            server.stop()


def wait_for_backend(url: str, wait_s: float) -> bool:
    """Ask the backend's /health (then /v1/models) until it answers 200, with backoff, for at most
    `wait_s` seconds; say what happens. True when it answered; never raises."""
    if wait_s <= 0:
        return False
    import httpx

    deadline, delay = time.monotonic() + wait_s, 0.5
    while True:
        problem = _backend_problem(httpx, url)
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
              f"(starting anyway after {wait_s:g} s, --backend-wait-s)")
        time.sleep(delay)
        delay = min(delay * 2, 8.0)


def _backend_problem(httpx, url: str) -> str | None:
    for path in ("/health", "/v1/models"):  # vLLM answers both; other OpenAI servers at least the second
        try:
            response = httpx.get(url.rstrip("/") + path, timeout=3.0)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if response.status_code == 200:
            return None
    return f"GET {path} answered {response.status_code}"


def _port_problem(host: str, port: int, flag: str) -> str | None:
    """A port that another process holds, or a host that is no local address: one line now, not a
    bind error after vLLM has started."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if exc.errno == errno.EADDRINUSE:
            return f"{flag}: cannot listen on {host}:{port} ({reason}); is another server on it? pick another port"
        return (f"--host (env COHORT_HOST): cannot listen on {host}:{port} ({reason}); give an address of this "
                f"machine, e.g. 127.0.0.1 or 0.0.0.0 for all")
    return None


def _data_dir_problem(data_dir: str) -> str | None:
    """An explicit --data-dir that cannot be created or written (it is created on first use)."""
    if not data_dir:
        return None
    path = Path(data_dir).expanduser()
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        return f"--data-dir (env COHORT_DATA_DIR) {path}: {existing} is a file, not a folder"
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        return f"--data-dir (env COHORT_DATA_DIR) {path}: {existing} is not writable"
    return None


def _start_embedded(settings: Settings, model_dir: str | None, port: int | None, *, explicit_in_flight: bool):
    """vLLM CPU on the tiny MoE trained on text (trained into `model_dir` first when it holds no model), with
    the plugin and the expert-aware scheduler; the settings pointed at it. Its slots (max_num_seqs) are the
    given max_in_flight, else 16; the proxy takes its own from the engine's handshake."""
    from moe_cohort.proxy.embedded import TRAIN_MINUTES, default_model_dir, ensure_trained_model, has_model, \
        start_embedded_backend
    from moe_cohort.proxy.vllm_server import stay_off_worker_cpus

    given = explicit_in_flight or settings.max_in_flight != Settings.max_in_flight  # a flag, variable or file
    max_num_seqs = settings.max_in_flight if given else 16
    path = Path(model_dir) if model_dir else default_model_dir()
    if not has_model(path):
        print(f"no model in {path}: training the tiny MoE on text there, once (it takes {TRAIN_MINUTES}; "
              f"--model-dir DIR serves a model folder of yours)...", flush=True)
    path = ensure_trained_model(path)
    print(f"no --backend given: starting a local vLLM CPU server on the tiny MoE in {path} (with the moe-cohort "
          f"plugin and its expert-aware scheduler, max_num_seqs {max_num_seqs}; this can take a few minutes)...",
          flush=True)
    server = start_embedded_backend(path, max_num_seqs=max_num_seqs, port=port)
    print(f"vLLM backend ready at {server.url} (model '{server.served_model_name}', log {server.log_path})")
    if stay_off_worker_cpus(server):  # its worker busy-polls its cores; the proxy would wait behind it
        print(f"proxy runs on CPUs {sorted(os.sched_getaffinity(0))}, beside vLLM's worker "
              f"on {sorted(server.worker_cpus())}")
    return server, settings.replace(backend_url=server.url)


def _serve(settings: Settings) -> int:
    """Listen at once (proxy/http/starting.py answers 503 "not ready" meanwhile) and build the proxy, whose
    encoder may take minutes the first time (encoder/static.py distils it); 1 when it could not be built."""
    import uvicorn

    from moe_cohort.proxy.app import create_app
    from moe_cohort.proxy.http.limits import server_options
    from moe_cohort.proxy.http.starting import Starting
    from moe_cohort.proxy.profiles import limit_threads

    where = f"http://{settings.host}:{settings.port}"
    replicas = f", routing {settings.routing}" if len(settings.backend_urls) > 1 else ""

    def ready() -> None:  # in the server's thread, as before it served: the encoder's libraries are loaded now
        limit_threads(settings.encoder_threads)
        print(f"moe-cohort proxy ready on {where}/v1 -> {settings.backend_url} (policy {settings.default_policy}"
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


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port in 1..65535, got {text!r}")
    return int(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def _fail(message: str) -> int:
    print(f"cohort serve: error: {message}", file=sys.stderr)
    return 2

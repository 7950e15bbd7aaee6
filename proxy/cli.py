"""`cohort serve`: the OpenAI-compatible proxy in front of vLLM (or of an embedded tiny-MoE vLLM)."""

from __future__ import annotations

import argparse
import os

from proxy.settings import Settings, SettingsError, add_setting_flags, flag_overrides, load_settings

# flag -> Settings field; defaults live in Settings (and COHORT_* variables), not here
_FLAGS = {
    "--backend": ("backend_url", str, "vLLM server to front, e.g. http://127.0.0.1:8000 (default: start a tiny one)"),
    "--host": ("host", str, "address to listen on"),
    "--port": ("port", int, "port to listen on"),
    "--max-queue-ms": ("max_queue_ms", float, "fairness bound: a request waiting this long is admitted first"),
    "--max-in-flight": ("max_in_flight", int, "requests at the backend at once: set it to its max_num_seqs"),
    "--default-policy": ("default_policy", str, "routing policy when a request has no X-MoE-Routing header"),
    "--encoder": ("encoder", str, "encoder name or path (a folder from `cohort train` brings its profile head); "
                                  "'static' is fast; 'none': first come, first served"),
    "--backend-api-key": ("backend_api_key", str, "API key to send to the backend"),
    "--request-timeout-s": ("request_timeout_s", float, "backend timeout per request"),
    "--max-body-bytes": ("max_body_bytes", int, "largest request body accepted"),
    "--data-dir": ("data_dir", str, "Batch API storage: uploaded files, results, SQLite records"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_setting_flags(parser, _FLAGS)
    parser.add_argument("--api-key", dest="api_keys", action="append", help="accept this proxy API key (repeatable)")
    parser.add_argument("--log-prompts", action="store_true", default=None, help="log prompt texts (off: they are user data)")
    parser.add_argument("--model-dir", help="tiny MoE folder for the embedded backend (built there if missing)")


def run(args: argparse.Namespace) -> int:
    overrides = flag_overrides(args, _FLAGS)
    overrides.update(api_keys=tuple(args.api_keys) if args.api_keys else None, log_prompts=args.log_prompts)
    try:
        settings = load_settings(overrides)
    except SettingsError as exc:
        print(f"cohort serve: error: {exc}")
        return 2
    from proxy.profiles import encoder_problem

    problem = encoder_problem(settings)
    if problem:
        print(f"cohort serve: error: {problem}")
        return 2
    server = None
    if not settings.backend_url:
        server, settings = _start_embedded(settings, args.model_dir, explicit_in_flight=args.max_in_flight is not None)
    try:
        _serve(settings)
    finally:
        if server is not None:
            print("stopping the embedded vLLM backend")
            server.stop()
    return 0


def _start_embedded(settings: Settings, model_dir: str | None, *, explicit_in_flight: bool):
    from devtools.server import stay_off_worker_cpus
    from proxy.embedded import ensure_tiny_model, start_embedded_backend

    max_num_seqs = settings.max_in_flight if explicit_in_flight else 16
    path = ensure_tiny_model(model_dir)
    print(f"no --backend given: starting a local vLLM CPU server on the tiny MoE in {path} "
          f"(with the moe-cohort plugin; about 20 s)...")
    server = start_embedded_backend(path, max_num_seqs=max_num_seqs)
    print(f"vLLM backend ready at {server.url} (model '{server.served_model_name}', log {server.log_path})")
    if stay_off_worker_cpus(server):  # its worker busy-polls its cores; the proxy would wait behind it
        print(f"proxy runs on CPUs {sorted(os.sched_getaffinity(0))}, beside vLLM's worker "
              f"on {sorted(server.worker_cpus())}")
    return server, settings.replace(backend_url=server.url, max_in_flight=max_num_seqs)


def _serve(settings: Settings) -> None:
    import uvicorn

    from proxy.app import create_app

    app = create_app(settings)
    print(f"moe-cohort proxy on http://{settings.host}:{settings.port}/v1 -> {settings.backend_url} "
          f"({settings.max_in_flight} in flight, policy {settings.default_policy}); "
          f"point an OpenAI client at base_url=http://{settings.host}:{settings.port}/v1. Ctrl-C stops.")
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning")

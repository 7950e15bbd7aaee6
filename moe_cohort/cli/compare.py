"""`cohort compare`: what admission saves on a running `cohort serve`, against first come, first served.

    cohort serve &                # the embedded tiny MoE trained on text, or --backend YOUR_VLLM
    cohort compare                # --proxy http://127.0.0.1:8080, its backend from the proxy's /health

Prompts no model saw (the held-out side of devtools/corpus.py's split) go, in each of --rounds rounds,
first DIRECTLY to the backend (first come, first served: they carry no profile and ask the engine for
arrival order, `vllm_xargs.moe_fcfs`, so that our scheduler orders them neither by a profile nor by
their prompt's routing), then through the proxy (admission by predicted experts, in the proxy or
inside vLLM). Each round takes the next --requests held-out prompts: a
learning proxy learns from what it serves, so a prompt sent through it in an earlier round would no
longer be one it never saw (they repeat only when rounds x requests exceed the held-out side). Before
the rounds, --learn-requests prompts of the training side go through the proxy, so that a learning
proxy has a profile head. --clients closed-loop clients keep more requests waiting than the engine has
slots: admission chooses among those.

Each run is measured by the difference of the backend's plugin counters (send/engine_counters.py):
decode expert loads per GENERATED token, and decode tokens per forward beside it (fewer tokens per
forward touch fewer experts by themselves). FCFS and admission alternate on one server, so the
engine's drift over minutes hits both alike. The counters are server-wide: run it on a backend that
nothing else uses.

Longer than the house's other modules on purpose: one command read top to bottom. Finding the proxy's
backend and model, the learning phase, the rounds, the closed-loop clients, the reads of the backend
(over aiohttp) and the printed rows share one Target and one Run; split apart they would be imported by
nothing else.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import sys
import time
from dataclasses import dataclass

from moe_cohort.admission.wire import FCFS_KEY
from moe_cohort.cli.checks import positive_int
from moe_cohort.send.engine_counters import (DecodeCounters, MetricsUnreadable, has_plugin_counters, parse_counters,
                                             read_counters, read_metrics)

log = logging.getLogger(__name__)

DEFAULT_PROXY = "http://127.0.0.1:8080"
INFO_PATH = "/v1/cohort/info"  # the engine handshake (engine/engine_info.py): {"moe": {"layers": ...}, ...}
PUBLISH_S = 1.5  # the plugin's worker publishes its counters at most once a second while busy
QUIET_S = 5.0  # a learning proxy whose observed count has not risen for this long has taken what it will
NOT_READY_WAIT_S = 120.0  # a proxy still loading its encoder answers /health 503 "not ready"
NO_PLUGIN = ("the backend {backend} shows no moe-cohort plugin counters on /metrics: install moe-cohort in vLLM's "
             "environment (pip install moe-cohort beside vllm), restart vLLM, and run this again")


class CompareError(Exception):
    """One line for the user; `code` the exit status (2: nothing was measured, 1: a run failed)."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


class NoAnswer(Exception):
    """A GET that got no HTTP answer (refused, reset, timed out); the message names the cause."""


@dataclass(frozen=True)
class Target:
    """The proxy, the vLLM server behind it, the served model, and the proxy's key."""

    proxy: str
    backend: str
    model: str
    api_key: str | None = None

    def headers(self, url: str) -> dict[str, str]:
        """The proxy's key goes to the proxy only."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key and url == self.proxy else {}


@dataclass(frozen=True)
class Run:
    """One pass of the prompts: decode expert loads per generated token, decode tokens per forward (None
    without the MoE layer count), wall seconds, requests."""

    loads_per_token: float
    tokens_per_forward: float | None
    wall_s: float
    requests: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--proxy", metavar="URL", default=DEFAULT_PROXY, help="the running `cohort serve`")
    parser.add_argument("--backend", metavar="URL", help="its vLLM server, measured through its /metrics and sent "
                        "the first come, first served runs (default: the `backend` the proxy's GET /health shows)")
    parser.add_argument("--api-key", metavar="KEY", help="the proxy's API key, if it has one (sent to the proxy only)")
    parser.add_argument("--learn-requests", metavar="N", type=int, default=400, help="training-side prompts "
                        "sent through the proxy first, so that a learning proxy fits its profile head (0: none)")
    parser.add_argument("--requests", metavar="N", type=positive_int, default=240, help="held-out prompts per run")
    parser.add_argument("--rounds", metavar="R", type=positive_int, default=2, help="rounds of first come, first "
                        "served, then admission")
    parser.add_argument("--clients", metavar="C", type=positive_int, default=64, help="closed-loop clients, each sends "
                        "its next prompt when its answer came (more than the engine's slots: requests wait)")
    parser.add_argument("--max-tokens", metavar="T", type=positive_int, default=64, help="tokens generated per request "
                        "(ignore_eos)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts' order (default 0)")


def run(args: argparse.Namespace) -> int:
    try:
        target = find_target(args.proxy, args.backend, args.api_key)
        layers = engine_facts(target)
        train, held = corpus_prompts(args.seed)
        print(f"proxy {target.proxy} -> backend {target.backend}, model {target.model!r} "
              f"({f'{layers} MoE layers' if layers else 'MoE layers unknown'}); {args.clients} clients, "
              f"{args.max_tokens} tokens per request", flush=True)
        if args.learn_requests > 0:
            print(f"sending {min(args.learn_requests, len(train))} training-side prompts through the proxy "
                  f"(a learning proxy learns from them)...", flush=True)
            learn(target, train[: args.learn_requests], args.clients, args.max_tokens)
        print(f"the proxy's admission: {_describe(proxy_health(target.proxy, target.api_key))}", flush=True)
        if args.rounds * args.requests > len(held):
            print(f"note: {args.rounds} rounds of {args.requests} take more than the {len(held)} held-out prompts: "
                  f"later rounds repeat some, which a learning proxy has learned from", flush=True)
        rows: list[tuple[Run, Run]] = []
        for r, prompts in enumerate(round_prompts(held, args.requests, args.rounds)):
            fcfs = measure(target, target.backend, prompts, args.clients, args.max_tokens, layers)
            print(_row(f"round {r + 1}/{args.rounds} first come, first served (direct to vLLM)", fcfs), flush=True)
            admitted = measure(target, target.proxy, prompts, args.clients, args.max_tokens, layers)
            print(_row(f"round {r + 1}/{args.rounds} admission (through the proxy)", admitted), flush=True)
            rows.append((fcfs, admitted))
    except CompareError as exc:
        print(f"cohort compare: error: {exc}", file=sys.stderr)
        return exc.code
    print(_summary(rows))
    return 0


def find_target(proxy: str, backend: str | None, api_key: str | None) -> Target:
    """The proxy's backend (from its /health unless given) and served model (its /v1/models' first id)."""
    proxy = proxy.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    health = proxy_health(proxy, api_key)
    if not backend:
        urls = [r.get("backend") for r in health.get("replicas", []) if isinstance(r, dict)]
        backend = urls[0] if len(urls) == 1 else None
        if not isinstance(backend, str) or not backend:
            shown = "several replicas" if len(urls) > 1 else "no backend"
            raise CompareError(f"the proxy's /health shows {shown} (with protect_metrics on, only to an --api-key): "
                               f"pass --backend URL, the vLLM server to measure")
    try:
        _, text = _get(proxy + "/v1/models", headers)
    except NoAnswer as exc:
        raise CompareError(f"{proxy}/v1/models did not answer ({exc})") from None
    try:
        model = json.loads(text)["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise CompareError(f"{proxy}/v1/models names no model ({type(exc).__name__}: {exc})") from None
    return Target(proxy, backend.rstrip("/"), model, api_key)


def proxy_health(proxy: str, api_key: str | None = None) -> dict:
    """The proxy's GET /health JSON, waiting while it says it is still starting (503 "not ready")."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + NOT_READY_WAIT_S
    while True:
        try:
            code, text = _get(proxy + "/health", headers)
        except NoAnswer as exc:
            raise CompareError(f"no proxy answers at {proxy} ({exc}): start `cohort serve` first, or pass "
                               f"--proxy URL") from None
        try:
            body = json.loads(text)
        except ValueError:
            body = {}
        if code == 200 and isinstance(body, dict):
            return body
        status = body.get("status") if isinstance(body, dict) else None
        if code != 503 or status != "not ready" or time.monotonic() > deadline:
            raise CompareError(f"{proxy}/health answered {code} {status or text[:200]!r}")
        time.sleep(1.0)


def engine_facts(target: Target) -> int | None:
    """The model's MoE layer count, from the engine's handshake (GET /v1/cohort/info, moe.layers), else
    measured on one request sent alone to the backend, whose decode forwards each carry one token
    (layer-forwards per decode token); None when neither tells. Raises CompareError when the backend's
    /metrics shows no plugin counters, even after that request (a fresh vLLM publishes them once it ran one)."""
    text = _scrape(target.backend)
    before, layers = parse_counters(text), _info_layers(target.backend)
    if layers is not None and has_plugin_counters(text):
        return layers
    asyncio.run(_send(target, target.backend, ["Say hello."], 1, 4))
    time.sleep(PUBLISH_S)
    text = _scrape(target.backend)
    if not has_plugin_counters(text):
        raise CompareError(NO_PLUGIN.format(backend=target.backend))
    if layers is None:  # exact only when nothing else ran meanwhile: then a whole number of layers per token
        ran = parse_counters(text) - before
        if ran.tokens > 0 and ran.layer_forwards > 0 and ran.layer_forwards % ran.tokens == 0:
            layers = int(ran.layer_forwards // ran.tokens)
    return layers


def corpus_prompts(seed: int = 0) -> tuple[list[str], list[str]]:
    """(training-side, held-out) prompts of devtools/corpus.py, each side in its own seeded order."""
    from moe_cohort.devtools.corpus import build_corpus

    corpus = build_corpus()
    train, held = [d.text for d in corpus.train], [d.text for d in corpus.heldout]
    random.Random(seed).shuffle(train)
    random.Random(seed + 1).shuffle(held)
    return train, held


def round_prompts(held: list[str], requests: int, rounds: int) -> list[list[str]]:
    """Per round, the next `requests` of `held`, from where the last round stopped (cycling when they run out)."""
    return [[held[(r * requests + i) % len(held)] for i in range(requests)] for r in range(rounds)]


def learn(target: Target, prompts: list[str], clients: int, max_tokens: int, timeout_s: float = 300.0) -> int | None:
    """Send `prompts` through the proxy; when its /health shows learning, wait until it has observed as many
    more, or its count stopped rising for QUIET_S. How many it observed then (None: it does not learn)."""
    first = _observed(proxy_health(target.proxy, target.api_key))
    asyncio.run(_send(target, target.proxy, prompts, clients, max_tokens))
    deadline, last, since = time.monotonic() + timeout_s, -1, time.monotonic()
    while True:
        health = proxy_health(target.proxy, target.api_key)
        observed = _observed(health)
        if observed is None or first is None or observed - first >= len(prompts) or time.monotonic() > deadline:
            return observed
        if observed != last:
            last, since = observed, time.monotonic()
        elif time.monotonic() - since > QUIET_S:
            return observed
        time.sleep(0.5)


def measure(target: Target, url: str, prompts: list[str], clients: int, max_tokens: int,
            layers: int | None) -> Run:
    """`prompts` sent to `url` (the backend or the proxy) by `clients` closed-loop clients; the backend's
    decode counters over it. Raises CompareError (exit 1) when they counted no decoded token."""
    before = _read_counters(target.backend)
    wall = asyncio.run(_send(target, url, prompts, clients, max_tokens))
    time.sleep(PUBLISH_S)
    ran = _read_counters(target.backend) - before
    if ran.loads_per_token is None:
        raise CompareError(f"{target.backend}/metrics counted no decoded token in a run: is it the server the proxy "
                           f"sends to (--backend)?", code=1)
    return Run(ran.loads_per_token, ran.tokens_per_forward(layers), wall, len(prompts))


def savings(rows: list[tuple[Run, Run]]) -> list[float]:
    """Per round, 1 - admission's decode expert loads per generated token / first come, first served's."""
    return [1 - admitted.loads_per_token / fcfs.loads_per_token for fcfs, admitted in rows]


async def _send(target: Target, url: str, prompts: list[str], clients: int, max_tokens: int) -> float:
    """Closed loop: `clients` clients, each sends the next prompt when its answer came; wall seconds."""
    import aiohttp

    pending = iter(prompts)
    headers = target.headers(url)
    direct = {"vllm_xargs": {FCFS_KEY: 1}} if url == target.backend else {}  # the engine's own order: arrival

    async def client(http: aiohttp.ClientSession) -> None:
        for prompt in pending:
            body = {"model": target.model, "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": max_tokens, "ignore_eos": True, "truncate_prompt_tokens": 256, **direct}
            async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise CompareError(f"{url}/v1/chat/completions answered {resp.status}: {text[:300]}", code=1)

    start = time.perf_counter()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients),
                                         timeout=aiohttp.ClientTimeout(total=None, sock_read=900)) as http:
            await asyncio.gather(*(client(http) for _ in range(min(clients, len(prompts)))))
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise CompareError(f"a request to {url} failed ({type(exc).__name__}: {exc})", code=1) from None
    return time.perf_counter() - start


def _get(url: str, headers: dict[str, str] | None = None, timeout_s: float = 30.0) -> tuple[int, str]:
    """(status, body) of GET `url`, any status, in an event loop of its own; NoAnswer when none came in time."""
    import aiohttp

    async def get() -> tuple[int, str]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
            async with http.get(url, headers=headers or {}) as resp:
                return resp.status, (await resp.read()).decode("utf-8", errors="replace")

    try:
        return asyncio.run(get())
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:  # aiohttp's timeouts are TimeoutErrors
        raise NoAnswer(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) from exc


def _scrape(backend: str) -> str:
    try:
        return read_metrics(backend)
    except MetricsUnreadable as exc:
        raise CompareError(f"{exc}: is --backend the vLLM server?") from None


def _read_counters(backend: str) -> DecodeCounters:
    try:
        return read_counters(backend)
    except MetricsUnreadable as exc:
        raise CompareError(str(exc), code=1) from None


def _observed(health: dict) -> int | None:
    """/health's admission.learning.observed: requests whose experts a learning proxy took; None without learning."""
    admission = health.get("admission")
    learning = admission.get("learning") if isinstance(admission, dict) else None
    observed = learning.get("observed") if isinstance(learning, dict) else None
    return observed if isinstance(observed, int) else None


def _info_layers(backend: str) -> int | None:
    """moe.layers of the engine's handshake; None when it has none (an older plugin, a plain vLLM)."""
    try:
        layers = json.loads(_get(backend + INFO_PATH, timeout_s=10)[1])["moe"]["layers"]
    except (NoAnswer, ValueError, KeyError, TypeError):
        return None
    return layers if isinstance(layers, int) and not isinstance(layers, bool) and layers > 0 else None


def _describe(health: dict) -> str:
    admission = health.get("admission") if isinstance(health.get("admission"), dict) else {}
    mode, learning = admission.get("mode", "not shown in its /health"), admission.get("learning")
    return f"{mode}; " + (f"learning {json.dumps(learning)}" if isinstance(learning, dict) else "not learning")


def _row(name: str, run: Run) -> str:
    tpf = f"{run.tokens_per_forward:5.2f}" if run.tokens_per_forward is not None else "  n/a"
    return (f"{name:>52}: {run.loads_per_token:7.3f} decode expert loads per generated token, {tpf} decode "
            f"tokens per forward, wall {run.wall_s:6.1f} s ({run.requests} requests)")


def _summary(rows: list[tuple[Run, Run]]) -> str:
    s = savings(rows)
    spread = f" +- {statistics.pstdev(s):.1%}" if len(s) > 1 else ""

    def tokens_per_forward(side: int) -> str:
        values = [row[side].tokens_per_forward for row in rows]
        return "n/a" if None in values else f"{statistics.fmean(values):.2f}"
    return (f"admission against first come, first served: {statistics.fmean(s):+.1%}{spread} decode expert loads per "
            f"generated token saved (held-out prompts, mean +- std over {len(rows)} round(s)); decode tokens per "
            f"forward: first come, first served {tokens_per_forward(0)}, admission {tokens_per_forward(1)}")

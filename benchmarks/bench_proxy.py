"""Benchmark: what the proxy adds, and what admission buys, against one vLLM backend in one run.

    python -m benchmarks.bench_proxy [--backend URL] [--requests-per-client 40] [--no-pin]

Part 1, overhead: clients send tiny completions (max_tokens=1) directly to vLLM and through the
proxy, alternating, at 1, 16 and 64 concurrent clients; prints latency p50/p99 and throughput of
each, and the added p50/p99; then the same for streams (max_tokens=8) timed to their first chunk,
at up to 16 clients. Once per encoder of --overhead-encoders (default: none, i.e. first come first
served, and the default encoder ""; NAME+learn: that encoder with `--learn`, its learning phase of
--learn-warm requests timed apart, so the measured runs are what learning costs once it has seen that
much traffic, with learning's own CPU from its counter (cohort_learning_cpu_seconds_total); then the
head it learned, served by a proxy without `--learn`): with an encoder every request carries a distinct prompt of
mixed.jsonl (the same bodies go direct) and the proxy's embedding cache is off, so each is
embedded and profiled on arrival. The proxy admits up to 256 at once, above the clients, so no request waits for a slot:
the added latency is the proxy's own work (relay, embedding, admission). Beside it: the CPU per
request of the load generator and of the proxy process, and the proxy's own time per request as
its Server-Timing header reports it (arrival to answer headers, less the backend's time: free of
the backend's run-to-run noise, which on one vLLM CPU core is larger than the proxy's work).
CPUs: the embedded backend runs on the first half of this process's CPUs and the proxy on the
other half, as a proxy runs beside (not on) an inference server's cores. `--load-on backend`
(default) puts the load generator with the backend, so the proxy has its half to itself, as in
production where clients are remote; the load generator's CPU then slows the backend equally in
both paths. `--load-on proxy` puts it with the proxy: at 64 clients vLLM answers a step's requests
at once, and the proxy and the clients then take turns on one core for each of them, which adds
64 x (proxy + client CPU per request) to every round trip; that measures the shared core as much
as the proxy. Without a split (--no-pin) everything competes for all cores.
Part 2, admission at saturation: the same prompts ($COHORT_DATA/prompts/mixed.jsonl) through the
proxy first come first served (encoder none) and by admission (--encoder, default the packaged
MiniLM), 64 concurrent clients and --slots requests in flight (the backend's max_num_seqs), so
requests wait and admission has a pool to choose from; with --engine-side also through a second
vLLM server with max_num_seqs = --slots and `--scheduler-cls engine.scheduler.ExpertAwareScheduler`,
the proxy forwarding at once (admission inside the engine, from the profiles the proxy sends);
prints the mean distinct experts per layer per decode forward from the plugin's counters, with
the tokens per forward beside it (fewer tokens per forward touch fewer experts by themselves).
With --replicas 2 (issue 18): a second tiny-MoE vLLM server is started beside the first; part 1
adds a proxy fronting both (`--backend A --backend B`, routing affinity) to the same comparison
(the direct baseline is still server A alone), and part 2 becomes the two-replica run: the prompts
through `cohort serve --backend A --backend B --replica-routing X` for X in round-robin, least-loaded and
affinity (--slots in flight per replica, --encoder), the distinct experts per layer per decode
forward summed over both servers' counters, and the wall time.
Without --backend, a tiny-MoE vLLM CPU server is started (and stopped) here. The proxy runs as
its own process (`cohort serve`), as in production. Over 300 lines on purpose: its parts share the one
backend it starts (vLLM CPU takes minutes to start), and one run measures them side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np

from benchmarks.heldout import prompt_texts
from moe_cohort.embedded.vllm_server import free_port
from moe_cohort.send.engine_counters import DecodeCounters, metric_sum, read_counters, read_metrics


async def post(http: aiohttp.ClientSession, url: str, body: dict, own: list[float] | None = None) -> float:
    """Send `body`, read the whole answer; seconds until the first chunk of it arrived. The proxy's own
    seconds from its Server-Timing header go to `own`, when it sends one."""
    t = time.perf_counter()
    first = None
    async with http.post(url, json=body) as resp:
        resp.raise_for_status()
        timing = re.search(r"proxy;dur=([0-9.]+)", resp.headers.get("server-timing", ""))
        if timing and own is not None:
            own.append(float(timing.group(1)) / 1000)
        async for _ in resp.content.iter_any():
            first = first or time.perf_counter() - t
    return first


async def client_loop(http: aiohttp.ClientSession, url: str, bodies, n: int, latencies: list[float],
                      own: list[float] | None = None) -> None:
    """n requests one after another, each with the next of `bodies` (an iterator shared by the clients);
    a latency each: whole answer, or first chunk of a stream."""
    for _ in range(n):
        body = next(bodies)
        t = time.perf_counter()
        first = await post(http, url, body, own)
        latencies.append(first if body.get("stream") else time.perf_counter() - t)


async def load(url: str, clients: int, per_client: int, stream: bool = False,
               prompts: list[str] | None = None) -> tuple[np.ndarray, float, np.ndarray]:
    """Latencies [clients * per_client] in seconds, requests per second, and the proxy's own seconds
    per request (Server-Timing; empty for vLLM). A streamed request (8 tokens) is timed to its first
    chunk (time to first token), a plain one (1 token) to its end. The prompt is "hi", or the next
    of `prompts` (cycled) for each request."""
    # the body vLLM gets either way: the proxy would add this policy field to a body without it
    body = {"model": "tiny", "max_tokens": 8 if stream else 1, "vllm_xargs": {"moe_routing": "topk"}}
    if stream:
        body.update(stream=True, ignore_eos=True)
    if prompts:  # a few of mixed.jsonl are longer than the tiny MoE's max_model_len in its tokens
        body["truncate_prompt_tokens"] = 512
    bodies = ({**body, "prompt": p} for p in itertools.cycle(prompts or ["hi"]))
    latencies: list[float] = []
    own: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as http:
        warm: list[float] = []  # the connection pool, the server and the proxy at this concurrency
        await asyncio.gather(*(client_loop(http, url, bodies, 3, warm) for _ in range(clients)))
        t = time.perf_counter()
        await asyncio.gather(*(client_loop(http, url, bodies, per_client, latencies, own) for _ in range(clients)))
        wall = time.perf_counter() - t
    return np.array(latencies), len(latencies) / wall, np.array(own)


def split_cpus() -> tuple[set[int], set[int]]:
    """(backend CPUs, proxy + client CPUs): the first and second half of the CPUs we may use."""
    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    return set(cpus[:half]), set(cpus[half:] or cpus)


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False


PROXY_CPUS: set[int] | None = None  # where `cohort serve` runs (main() sets it); None: where this process runs


def start_proxy(backend: str, *flags: str, env: dict[str, str] | None = None,
                log: str | Path | None = None) -> tuple[subprocess.Popen, str]:
    """`cohort serve` in front of `backend` (several replicas: a comma list, one --backend each), with
    `env` added to this process's environment, on PROXY_CPUS; its output goes to `log` (else nowhere)."""
    port = free_port()
    backends = [a for url in backend.split(",") for a in ("--backend", url)]
    cmd = [sys.executable, "-m", "moe_cohort.cli", "serve", *backends, "--port", str(port), *flags]
    pin = (lambda: os.sched_setaffinity(0, PROXY_CPUS)) if PROXY_CPUS else None
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 (the child holds it)
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
                            env={**os.environ, **(env or {})}, preexec_fn=pin)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if healthy(url):
            return proc, url
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"proxy did not start: {' '.join(cmd)}")


def overhead(backend: str, concurrency: list[int], per_client: int, rounds: int, encoder: str,
             prompts: list[str], replica: str | None = None, learn_warm: int = 0, settle: int = 0) -> None:
    """Part 1 for one encoder ("none": no embedding, the prompt "hi"; else distinct `prompts`); with
    `replica`, also a proxy fronting `backend` and `replica` ("proxy2"); a learning proxy first answers
    `learn_warm` requests (its learning phase, timed apart), any other `settle` requests (untimed)."""
    procs, proxies = [], {}
    encoder, learn = encoder.removesuffix("+learn"), encoder.endswith("+learn")
    # "+learn": the proxy learns its head from the backend's counts of every request (issue 26)
    data_dir = tempfile.mkdtemp(prefix="bench-proxy-learn-")
    learning = ["--learn", "--data-dir", data_dir] if learn else ["--no-learn"]
    for name, backends in [("proxy", backend)] + ([("proxy2", f"{backend},{replica}")] if replica else []):
        # the embedding cache off: each load restarts at the first prompt, and every request should pay
        proc, url = start_proxy(backends, "--encoder", encoder, "--max-in-flight", "256", *learning,
                                env={"COHORT_ENCODER_CACHE": "0"})
        procs.append(proc)
        proxies[name] = (url, proc.pid)
    texts = None if encoder == "none" else prompts
    try:
        if learn and learn_warm:
            warm_up(*proxies["proxy"], learn_warm, texts)
        elif settle:
            asyncio.run(load(proxies["proxy"][0] + "/v1/completions", 64, max(1, settle // 64), False, texts))
        before = learning_cpu(proxies["proxy"][0])
        print(f"encoder {encoder or 'default'!r}{', learning' if learn else ''}; whole answers (max_tokens=1):")
        compare(backend, proxies, concurrency, per_client, rounds, stream=False, prompts=texts)
        print(f"encoder {encoder or 'default'!r}{', learning' if learn else ''}; streams (max_tokens=8), time to the "
              f"first chunk:")
        compare(backend, proxies, [c for c in concurrency if c <= 16], per_client, rounds, stream=True, prompts=texts)
        if learn:
            print_learning_cpu("the measured runs", before, learning_cpu(proxies["proxy"][0]))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)  # a learning proxy saves its head on the way out
    if learn and learn_warm:
        print("the head it learned, served without --learn (after 1,024 requests untimed):")
        overhead(backend, concurrency, per_client, rounds, learned_encoder(encoder, Path(data_dir)), prompts, replica,
                 settle=1024)


def learned_encoder(encoder: str, data_dir: Path) -> str:
    """An encoder folder: `encoder`'s model with the head a learning proxy saved in `data_dir`."""
    from moe_cohort.encoder.embedding import resolve_model
    from moe_cohort.encoder.profile import HEAD_FILE

    out = data_dir / "learned-encoder"
    shutil.copytree(resolve_model(encoder or "static"), out)
    shutil.copy(data_dir / "learned" / HEAD_FILE, out / HEAD_FILE)
    return str(out)


def learning_cpu(url: str) -> dict[str, float]:
    """The proxy's learning CPU seconds by thread (cohort_learning_cpu_seconds_total) and its requests answered."""
    text = read_metrics(url)
    out = {t: metric_sum(text, "cohort_learning_cpu_seconds_total", thread=t) for t in ("worker", "event_loop")}
    return out | {"requests": metric_sum(text, "cohort_requests_total")}


def print_learning_cpu(what: str, before: dict[str, float], after: dict[str, float]) -> None:
    requests = after["requests"] - before["requests"]
    per = {k: (after.get(k, 0.0) - before.get(k, 0.0)) / max(requests, 1) * 1e6 for k in ("worker", "event_loop")}
    print(f"learning's own CPU over {what} ({requests:.0f} requests, cohort_learning_cpu_seconds_total): worker "
          f"{per['worker']:.0f} us/request, event loop {per['event_loop']:.0f} us/request")


def warm_up(url: str, pid: int, requests: int, prompts: list[str] | None) -> None:
    """`requests` tiny completions through the learning proxy at `url` (64 clients); prints its CPU per request
    over them, learning's own part, and what it learned (/health)."""
    before = learning_cpu(url)
    cpu, start = cpu_seconds(pid), time.perf_counter()
    latencies, _, _ = asyncio.run(load(url + "/v1/completions", 64, max(1, requests // 64), False, prompts))
    time.sleep(2 * 0.5)  # the last counts are taken from the backend every 0.5 s
    cpu, wall = cpu_seconds(pid) - cpu, time.perf_counter() - start
    with urllib.request.urlopen(url + "/health", timeout=10) as resp:
        learning = json.load(resp)["admission"]["learning"]
    print(f"learning phase: {len(latencies) + 3 * 64} requests in {wall:.0f} s, proxy CPU "
          f"{cpu / (len(latencies) + 3 * 64) * 1000:.2f} ms/request; then /health learning: {learning}")
    print_learning_cpu("the learning phase", before, learning_cpu(url))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (/proc; its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def compare(backend: str, proxies: dict[str, tuple[str, int]], concurrency: list[int], per_client: int, rounds: int,
            *, stream: bool, prompts: list[str] | None = None) -> None:
    """`rounds` direct and proxied runs, alternating, at each concurrency (the machine drifts: one
    of each in a row would compare two moments); a table of p50/p99/throughput, the CPU per request
    of the load generator and of the proxy process, and each proxy's difference. `proxies`: name ->
    (url, pid)."""
    print(f"{'clients':>7} {'path':>6} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8}  CPU ms/request: clients, proxy;"
          f" the proxy's own ms (Server-Timing) p50 / p99")
    for c in concurrency:
        rows = {}
        for name, (url, pid) in [("direct", (backend, None)), *proxies.items()] * rounds:
            cpu = (time.process_time(), cpu_seconds(pid) if pid else 0.0)
            lat, rps, own = asyncio.run(load(url + "/v1/completions", c, per_client, stream, prompts))
            used = (time.process_time() - cpu[0], (cpu_seconds(pid) - cpu[1]) if pid else 0.0)
            rows.setdefault(name, []).append((lat, rps, own, *(u / (len(lat) + 3 * c) * 1000 for u in used)))
        stats = {}
        for name, runs in rows.items():
            lat, own = (np.concatenate([r[i] for r in runs]) * 1000 for i in (0, 2))
            stats[name] = (np.percentile(lat, 50), np.percentile(lat, 99), np.mean([r[1] for r in runs]))
            client_ms, proxy_ms = np.mean([r[3] for r in runs]), np.mean([r[4] for r in runs])
            extra = f", {proxy_ms:.2f}" if name != "direct" else ""
            if len(own):
                extra += f";  {np.percentile(own, 50):.2f} / {np.percentile(own, 99):.2f}"
            print(f"{c:>7} {name:>6} {stats[name][0]:>8.2f} {stats[name][1]:>8.2f} {stats[name][2]:>8.1f}  "
                  f"{client_ms:.2f}{extra}")
        for name in proxies:
            label = "added" if name == "proxy" else f"+{name}"
            print(f"{c:>7} {label:>6} {stats[name][0] - stats['direct'][0]:>8.2f} "
                  f"{stats[name][1] - stats['direct'][1]:>8.2f}")


def decode_line(ran: DecodeCounters, moe_layers: int, detail: str = "") -> str:
    """Distinct experts per layer per decode step and decode tokens per forward of what ran between two readings,
    with the counts behind the first (and `detail`) in parentheses."""
    return (f"{ran.experts_per_layer_step or 0:6.2f} distinct experts per layer per decode forward at "
            f"{ran.tokens_per_forward(moe_layers) or 0:.1f} tokens per forward ({ran.batch_after:,.0f} loads over "
            f"{ran.batch_layer_steps:,.0f} layer-forwards{detail})")


async def send_prompts(url: str, prompts: list[str], clients: int, max_tokens: int) -> float:
    queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)

    async def worker(http: aiohttp.ClientSession) -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                    "ignore_eos": True}
            await post(http, url + "/v1/chat/completions", body)

    t = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as http:
        await asyncio.gather(*(worker(http) for _ in range(clients)))
    return time.perf_counter() - t


def admission(backend: str, prompts: list[str], slots: int, max_tokens: int, moe_layers: int, encoder: str,
              engine_backend: str | None = None) -> None:
    enc = ["--encoder", encoder] if encoder else []
    print(f"{len(prompts)} prompts, 64 clients, {slots} in flight, {max_tokens} tokens each")
    runs = [("fcfs", backend, ["--encoder", "none", "--max-in-flight", str(slots)]),
            ("proxy", backend, [*enc, "--max-in-flight", str(slots), "--no-learn"])]
    if engine_backend:
        runs.append(("engine", engine_backend, [*enc, "--max-in-flight", "256", "--forward-profiles", "--no-learn"]))
    for name, backend, extra in runs:
        proc, proxy = start_proxy(backend, *extra)
        try:
            before = read_counters(backend)
            wall = asyncio.run(send_prompts(proxy, prompts, 64, max_tokens))
            ran = read_counters(backend) - before
        finally:
            proc.terminate()
            proc.wait(30)
        print(f"{name:>8}: {decode_line(ran, moe_layers)}, wall {wall:.1f} s")


def replicas_run(backends: list[str], prompts: list[str], slots: int, max_tokens: int, moe_layers: int,
                 encoder: str) -> None:
    """Part 2 with several replicas: one proxy in front of all `backends` per routing; the decode
    counters summed over every backend."""
    enc = ["--encoder", encoder] if encoder else []
    print(f"{len(backends)} replicas, {len(prompts)} prompts, 64 clients, {slots} in flight per replica, "
          f"{max_tokens} tokens each, encoder {encoder or 'default'!r}")
    for routing in ("round-robin", "least-loaded", "affinity"):
        proc, proxy = start_proxy(",".join(backends), *enc, "--max-in-flight", str(slots), "--replica-routing", routing,
                                  "--no-learn")
        try:
            before = [read_counters(b) for b in backends]
            wall = asyncio.run(send_prompts(proxy, prompts, 64, max_tokens))
            ran = [read_counters(b) - r for b, r in zip(backends, before)]
        finally:
            proc.terminate()
            proc.wait(30)
        split = "/".join(f"{r.batch_layer_steps:,.0f}" for r in ran)
        print(f"{routing:>12}: {decode_line(sum(ran, DecodeCounters()), moe_layers, f', {split} per replica')}, "
              f"wall {wall:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", help="vLLM URL (default: start a tiny-MoE vLLM CPU server)")
    parser.add_argument("--requests-per-client", type=int, default=40)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--rounds", type=int, default=2, help="direct/proxy alternations per concurrency")
    parser.add_argument("--prompts", type=int, default=512, help="prompts of mixed.jsonl for part 2")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--moe-layers", type=int, default=4, help="MoE layers of the backend's model (tiny MoE: 4)")
    parser.add_argument("--slots", type=int, default=16, help="part 2: requests in flight (the backend's max_num_seqs)")
    parser.add_argument("--overhead-encoders", default="none,",
                        help="part 1: the proxy's encoders, comma-separated ('' = the default; NAME+learn: with "
                             "--learn; default %(default)r)")
    parser.add_argument("--learn-warm", type=int, default=0, help="part 1, NAME+learn: requests through the learning "
                        "proxy before the measured runs (its learning phase, reported apart; default none)")
    parser.add_argument("--encoder", default="", help="part 2: the admission encoder (a `cohort train` folder brings "
                        "its profile head; default: the packaged MiniLM, nearest embedding)")
    parser.add_argument("--model-dir", default=None, help="the MoE to serve when no --backend (default: the random tiny MoE)")
    parser.add_argument("--heldout", action="store_true", help="only the held-out prompts of mixed.jsonl (traces.split): "
                        "what no encoder, profile head or trained MoE saw")
    parser.add_argument("--skip-overhead", action="store_true", help="part 2 only")
    parser.add_argument("--skip-admission", action="store_true", help="part 1 only")
    parser.add_argument("--engine-side", action="store_true",
                        help="part 2: also admission inside vLLM (a second server with our --scheduler-cls)")
    parser.add_argument("--replicas", type=int, default=1, choices=(1, 2),
                        help="2: start a second vLLM server; part 1 adds a proxy fronting both, part 2 compares "
                             "the routings over both (needs no --backend)")
    parser.add_argument("--load-on", choices=("backend", "proxy"), default="backend",
                        help="the load generator's CPUs: the backend's half (the proxy's half is its own, as with "
                             "remote clients) or the proxy's half (default %(default)s)")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="run backend, proxy and clients on all CPUs (default: split the CPUs)")
    args = parser.parse_args()
    global PROXY_CPUS
    backend_cpus, PROXY_CPUS = split_cpus() if args.pin else (os.sched_getaffinity(0),) * 2
    client_cpus = backend_cpus if args.load_on == "backend" else PROXY_CPUS
    server = engine = second = None
    if args.replicas == 2 and args.backend:
        parser.error("--replicas 2 starts both servers itself; leave out --backend")
    if not args.backend:
        from moe_cohort.embedded.backend import ensure_tiny_model, start_embedded_backend

        os.sched_setaffinity(0, backend_cpus)  # vLLM's processes inherit it
        model = ensure_tiny_model(args.model_dir)
        server = start_embedded_backend(model, max_num_seqs=64, expert_aware=False)
        args.backend = server.url
        if args.replicas == 2:
            second = start_embedded_backend(model, max_num_seqs=64, expert_aware=False)
    if args.engine_side:
        from moe_cohort.embedded.backend import ensure_tiny_model
        from moe_cohort.embedded.vllm_server import start

        os.sched_setaffinity(0, backend_cpus)
        engine = start(ensure_tiny_model(args.model_dir), max_num_seqs=args.slots,
                       extra_args=["--scheduler-cls", "moe_cohort.engine.scheduler.ExpertAwareScheduler"])
    os.sched_setaffinity(0, client_cpus)  # the load generator
    try:
        where = f"backend on CPUs {sorted(backend_cpus)}, " if server else ""
        print(f"backend {args.backend}; proxy = `cohort serve` in its own process; {os.cpu_count()} CPUs: "
              f"{where}proxy on CPUs {sorted(PROXY_CPUS)}, load generator on CPUs {sorted(client_cpus)}")
        prompts = prompt_texts(args.heldout)
        if not args.skip_overhead:
            for encoder in args.overhead_encoders.split(","):
                overhead(args.backend, [int(c) for c in args.concurrency.split(",")], args.requests_per_client,
                         args.rounds, encoder.strip(), prompts, second.url if second else None, args.learn_warm)
        prompts = prompts[: args.prompts]
        if args.skip_admission:
            pass
        elif second is not None:
            replicas_run([args.backend, second.url], prompts, args.slots, args.max_tokens, args.moe_layers,
                         args.encoder)
        else:
            admission(args.backend, prompts, args.slots, args.max_tokens, args.moe_layers, args.encoder,
                      engine.url if engine else None)
    finally:
        for s in (server, engine, second):
            if s is not None:
                s.stop()


if __name__ == "__main__":
    main()

"""Through a local Ray Serve: Serve's default request router against ExpertAffinityRouter, interleaved rounds.

    python -m benchmarks.bench_ray_serve [--model-dir DIR] [--learn 400] [--measure 240] [--rounds 2]
        [--clients 64] [--slots 16] [--max-tokens 64] [--json FILE]

Two vLLM CPU servers on the trained tiny MoE (the plugin and our scheduler, eager, max_num_seqs = --slots),
both on the first half of the CPUs; Ray, Serve and the clients on the other half. A Serve application: an
ingress deployment (the OpenAI chat route) calls an engine deployment of two replicas, replica i fronting
server i. First the no-flag proxy (`cohort serve --backend`) answers --learn training-side prompts and saves
the head it learned; then, --rounds times, the application is deployed with Serve's default router
(power of two choices, max_ongoing_requests = --slots) and with ExpertAffinityRouter (slots = --slots, the
static encoder, head = the learned one), and --clients clients send the --measure held-out prompts (closed
loop, greedy, ignore_eos). Per run: decode expert loads per GENERATED token and tokens per forward over both
servers (the plugin's counters), p50 / p99 request latency, and the ingress replica's CPU per request (it
runs the router): ours less the default's is the router's own CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from collections import deque
from pathlib import Path

import aiohttp
import numpy as np
from fastapi import FastAPI, Request  # module level: the routes' annotations are strings, resolved here
from fastapi.responses import JSONResponse

from benchmarks import bench_proxy
from benchmarks.bench_out_of_box import SCHEDULER, add_served_arguments, learn_through, served_setup
from moe_cohort.send.engine_counters import DecodeCounters, read_counters


def build_app(urls: list[str], kind: str, slots: int, head: str):
    """The Serve application: ingress -> engine (one replica per backend URL, routed by `kind`)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    router = {} if kind == "default" else {"request_router_config": RequestRouterConfig(
        request_router_class="moe_cohort.ray_serve.router:ExpertAffinityRouter",
        request_router_kwargs={"slots": slots, "encoder": "static", "head": head})}

    @serve.deployment(num_replicas=len(urls), max_ongoing_requests=slots, ray_actor_options={"num_cpus": 0},
                      **router)
    class Engine:
        def __init__(self) -> None:
            self.url = urls[serve.get_replica_context().rank.rank]
            self.http = None

        async def __call__(self, body: dict) -> tuple[int, dict]:
            if self.http is None:
                self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600))
            async with self.http.post(self.url + "/v1/chat/completions", json=body) as resp:
                return resp.status, await resp.json()

    api = FastAPI()

    @serve.deployment(max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0})  # Serve's default of 5 would
    @serve.ingress(api)                                                              # hold the clients back
    class Ingress:
        def __init__(self, engine) -> None:
            self.engine = engine

        @api.post("/v1/chat/completions")
        async def chat(self, request: Request) -> JSONResponse:
            status, body = await self.engine.remote(await request.json())
            return JSONResponse(body, status_code=status)

        @api.get("/cpu")
        def cpu(self) -> dict:
            t = os.times()
            return {"cpu_s": t.user + t.system}

    return Ingress.bind(Engine.bind())


async def closed_loop(url: str, prompts: list[str], clients: int, max_tokens: int) -> tuple[list[float], int]:
    """Each prompt once through `clients` clients; per request its latency (s), and the failures."""
    queue, latencies, failed = list(reversed(prompts)), [], [0]

    async def client(http: aiohttp.ClientSession) -> None:
        while queue:
            body = {"model": "tiny", "messages": [{"role": "user", "content": queue.pop()}], "max_tokens": max_tokens,
                    "ignore_eos": True, "temperature": 0, "truncate_prompt_tokens": 256}
            start = time.perf_counter()
            try:
                async with http.post(url + "/v1/chat/completions", json=body) as resp:
                    text = await resp.text()
                    if resp.status != 200:
                        failed[0] += 1
                        if failed[0] == 1:
                            print(f"first failure: {resp.status} {text[:300]}", flush=True)
                        continue
            except (aiohttp.ClientError, TimeoutError) as exc:
                failed[0] += 1
                if failed[0] == 1:
                    print(f"first failure: {exc!r}", flush=True)
                continue
            latencies.append(time.perf_counter() - start)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients),
                                     timeout=aiohttp.ClientTimeout(total=3600)) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return latencies, failed[0]


def ingress_cpu(url: str) -> float:
    import httpx

    return httpx.get(url + "/cpu", timeout=30).json()["cpu_s"]


def sums(urls: list[str]) -> DecodeCounters:
    """The plugin's decode counters summed over the servers."""
    return sum((read_counters(u) for u in urls), DecodeCounters())


def one_run(kind: str, urls: list[str], held: list[str], args, layers: int, head: str, port: int) -> dict:
    from ray import serve

    serve.run(build_app(urls, kind, args.slots, head), name="bench", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    asyncio.run(closed_loop(url, held[: args.clients], args.clients, 4))  # warm: routers made, encoder loaded
    time.sleep(1.5)
    before, cpu = sums(urls), ingress_cpu(url)
    start = time.perf_counter()
    latencies, failed = asyncio.run(closed_loop(url, held, args.clients, args.max_tokens))
    wall = time.perf_counter() - start
    cpu = ingress_cpu(url) - cpu
    time.sleep(1.5)  # the worker publishes its counters at most once a second while busy
    ran = sums(urls) - before
    loads, tokens_per_forward = ran.loads_per_token, ran.tokens_per_forward(layers)
    serve.delete("bench")
    return {"router": kind, "loads_per_token": loads, "tokens_per_forward": tokens_per_forward,
            "p50_s": float(np.percentile(latencies, 50)), "p99_s": float(np.percentile(latencies, 99)),
            "ingress_cpu_ms_per_request": 1000 * cpu / max(1, len(latencies)), "wall_s": wall, "failed": failed}


def router_cpu_ms(prompts: list[str], head: str, slots: int, waiting: int = 64) -> dict[str, float]:
    """The router's own work per request, in this process (CPU ms): its prediction (the static encoder and the
    learned head, one prompt at a time, as requests arrive) and its bookkeeping (arrive, a freed slot's take
    over `waiting` waiting requests, the completion), on two replicas of `slots`; Serve's own routing
    machinery, the same for every router, is left out."""
    from moe_cohort.ray_serve.admission import ServeAdmission
    from moe_cohort.send.profiles import FixedHead
    from moe_cohort.send.profiles import make_predictor
    from moe_cohort.send.settings import Settings

    predictor = make_predictor(Settings(encoder="static"))
    predictor.follow(FixedHead.from_folder(head))
    predictor.predict(prompts[:8])  # loaded, warm
    book = ServeAdmission(slots, resident_factory=predictor.resident_factory)
    book.replicas_changed({"a": slots, "b": slots})
    placed = {"a": deque(), "b": deque()}  # each replica's requests, oldest first
    predict = book_cpu = 0.0
    for i, text in enumerate(prompts * 2):
        rid = "ab"[i % 2]
        start = time.process_time()
        vector = predictor.predict([text])[0].vector
        middle = time.process_time()
        book.arrive(i, vector, float(i))
        if i >= waiting and placed[rid]:  # the pool is full: one of rid's requests completes first
            book.completed(rid, placed[rid].popleft())
        taken = book.take(rid, float(i))
        book_cpu += time.process_time() - middle
        predict += middle - start
        if taken is not None:
            placed[rid].append(taken)
    n = 2 * len(prompts)
    return {"predict_ms": 1000 * predict / n, "bookkeeping_ms": 1000 * book_cpu / n}


def summary(rows: list[dict]) -> list[str]:
    """Ours against the default router of the same round: saving in loads per token, latency ratios, router CPU."""
    lines, paired = [], []
    for r in range(max(row["round"] for row in rows) + 1):
        d, o = ({row["router"]: row for row in rows if row["round"] == r}[k] for k in ("default", "ours"))
        paired.append((1 - o["loads_per_token"] / d["loads_per_token"], o["p99_s"] / d["p99_s"] - 1,
                       o["ingress_cpu_ms_per_request"] - d["ingress_cpu_ms_per_request"]))
        lines.append(f"round {r}: saving {paired[-1][0]:+.1%}, p50 {o['p50_s'] / d['p50_s'] - 1:+.1%}, p99 "
                     f"{paired[-1][1]:+.1%}, router CPU {paired[-1][2]:+.2f} ms per request")
    saving, p99, cpu = np.array(paired).T
    tpf = {k: np.mean([row["tokens_per_forward"] for row in rows if row["router"] == k]) for k in ("default", "ours")}
    lines.append(f"over {len(paired)} rounds: saving {saving.mean():+.1%} +- {saving.std():.1%}, p99 {p99.mean():+.1%}, "
                 f"router CPU {cpu.mean():+.2f} +- {cpu.std():.2f} ms per request; tokens per forward default "
                 f"{tpf['default']:.2f}, ours {tpf['ours']:.2f}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_served_arguments(p, rounds=2)
    args = p.parse_args()
    import ray
    from ray import serve

    from moe_cohort.embedded.vllm_server import free_port, start

    model, layers, learn, held, backend_cpus = served_setup(args)
    work = Path(tempfile.mkdtemp(prefix="bench-ray-serve-"))
    servers = [start(model, max_num_seqs=args.slots, max_model_len=1024, extra_args=SCHEDULER) for _ in range(2)]
    try:
        urls = [s.url for s in servers]
        os.sched_setaffinity(0, bench_proxy.PROXY_CPUS)  # Ray, Serve and the clients, off vLLM's CPUs
        learn_through(urls[0], learn, args, work / "state", work / "learning.log")
        head = str(work / "state" / "learned")
        cpu = router_cpu_ms(held, head, args.slots)
        print(f"router's own CPU per request (this process): prediction {cpu['predict_ms']:.3f} ms, bookkeeping "
              f"{cpu['bookkeeping_ms']:.3f} ms", flush=True)
        ray.init(include_dashboard=False, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        rows = []
        for r in range(args.rounds):
            for kind in ("default", "ours"):
                row = {**one_run(kind, urls, held, args, layers, head, port), "round": r}
                print(f"round {r} {kind:>7}: {row['loads_per_token']:6.3f} decode expert loads per generated token, "
                      f"{row['tokens_per_forward']:5.2f} tokens per forward, p50 {row['p50_s']:.2f} s, p99 "
                      f"{row['p99_s']:.2f} s, ingress CPU {row['ingress_cpu_ms_per_request']:.2f} ms per request, "
                      f"wall {row['wall_s']:.0f} s, {row['failed']} failed", flush=True)
                rows.append(row)
        print("\n".join(summary(rows)))
        serve.shutdown()
        ray.shutdown()
    finally:
        for s in servers:
            s.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

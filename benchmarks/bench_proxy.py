"""Benchmark: what the proxy adds, and what planning buys, against one vLLM backend in one run.

    python benchmarks/bench_proxy.py [--backend URL] [--requests-per-client 40]

Part 1, overhead (window at 0, no encoder): clients send tiny completions (max_tokens=1)
directly to vLLM and through the proxy, alternating, at 1, 16 and 64 concurrent clients;
prints latency p50/p99 and throughput of each, and the added p50/p99.
Part 2, planning (window on): the same prompts (../shared/data/prompts/mixed.jsonl) through the
proxy in arrival order (encoder none) and planned (default encoder), 64 concurrent clients;
prints the mean distinct experts per layer per decode forward from the plugin's counters, with
the tokens per forward beside it (fewer tokens per forward touch fewer experts by themselves).
Without --backend, a tiny-MoE vLLM CPU server is started (and stopped) here. The proxy runs as
its own process (`cohort serve`), as in production.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from backend.server import free_port

PROMPTS = Path(__file__).resolve().parents[1] / "../shared/data/prompts/mixed.jsonl"


async def client_loop(http: httpx.AsyncClient, url: str, body: dict, n: int, latencies: list[float]) -> None:
    for _ in range(n):
        t = time.perf_counter()
        resp = await http.post(url, json=body)
        resp.raise_for_status()
        latencies.append(time.perf_counter() - t)


async def load(url: str, clients: int, per_client: int) -> tuple[np.ndarray, float]:
    """Latencies [clients * per_client] in seconds and requests per second."""
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    latencies: list[float] = []
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=clients)) as http:
        await http.post(url, json=body)  # warm the connection pool and the server
        t = time.perf_counter()
        await asyncio.gather(*(client_loop(http, url, body, per_client, latencies) for _ in range(clients)))
        wall = time.perf_counter() - t
    return np.array(latencies), len(latencies) / wall


def start_proxy(backend: str, *flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "cohort.cli", "serve", "--backend", backend, "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"proxy did not start: {' '.join(cmd)}")


def overhead(backend: str, concurrency: list[int], per_client: int) -> None:
    proc, proxy = start_proxy(backend, "--max-wait-ms", "0", "--encoder", "none", "--max-in-flight", "256")
    try:
        print(f"{'clients':>7} {'path':>6} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8}")
        for c in concurrency:
            rows = {}
            for name, url in (("direct", backend), ("proxy", proxy), ("direct", backend), ("proxy", proxy)):
                lat, rps = asyncio.run(load(url + "/v1/completions", c, per_client))
                rows.setdefault(name, []).append((lat, rps))
            stats = {}
            for name, runs in rows.items():
                lat = np.concatenate([r[0] for r in runs]) * 1000
                stats[name] = (np.percentile(lat, 50), np.percentile(lat, 99), np.mean([r[1] for r in runs]))
                print(f"{c:>7} {name:>6} {stats[name][0]:>8.2f} {stats[name][1]:>8.2f} {stats[name][2]:>8.1f}")
            print(f"{c:>7} {'added':>6} {stats['proxy'][0] - stats['direct'][0]:>8.2f} "
                  f"{stats['proxy'][1] - stats['direct'][1]:>8.2f}")
    finally:
        proc.terminate()
        proc.wait(30)


def decode_distinct(backend: str) -> tuple[float, float, float]:
    """(decode expert loads, decode layer-forwards, decode tokens x layers) from the plugin's counters."""
    text = httpx.get(backend + "/metrics").text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf'^{name}\{{[^}}]*phase="decode"[^}}]*\}} ([0-9.e+]+)$', text, re.M))

    return (total("cohort_moe_batch_expert_loads_after_total"), total("cohort_moe_batch_layer_forwards_total"),
            total("cohort_moe_routed_tokens_total"))


async def send_prompts(url: str, prompts: list[str], clients: int, max_tokens: int) -> float:
    queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)

    async def worker(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                    "ignore_eos": True}
            (await http.post(url + "/v1/chat/completions", json=body)).raise_for_status()

    t = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients)) as http:
        await asyncio.gather(*(worker(http) for _ in range(clients)))
    return time.perf_counter() - t


def planning(backend: str, prompts: list[str], batch_size: int, max_tokens: int, moe_layers: int) -> None:
    common = ["--batch-size", str(batch_size), "--window-size", str(4 * batch_size), "--max-wait-ms", "200",
              "--max-in-flight", str(batch_size)]
    print(f"{len(prompts)} prompts, 64 clients, B={batch_size}, window {4 * batch_size} requests / 200 ms, "
          f"{max_tokens} tokens each")
    for name, extra in (("arrival", ["--encoder", "none"]), ("planned", [])):
        proc, proxy = start_proxy(backend, *common, *extra)
        try:
            loads0, fwd0, tok0 = decode_distinct(backend)
            wall = asyncio.run(send_prompts(proxy, prompts, 64, max_tokens))
            loads1, fwd1, tok1 = decode_distinct(backend)
        finally:
            proc.terminate()
            proc.wait(30)
        per, occupancy = (loads1 - loads0) / max(fwd1 - fwd0, 1), (tok1 - tok0) * moe_layers / max(fwd1 - fwd0, 1)
        print(f"{name:>8}: {per:6.2f} distinct experts per layer per decode forward at {occupancy:.1f} tokens "
              f"per forward ({loads1 - loads0:,.0f} loads over {fwd1 - fwd0:,.0f} layer-forwards), wall {wall:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", help="vLLM URL (default: start a tiny-MoE vLLM CPU server)")
    parser.add_argument("--requests-per-client", type=int, default=40)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--prompts", type=int, default=512, help="prompts of mixed.jsonl for part 2")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--moe-layers", type=int, default=4, help="MoE layers of the backend's model (tiny MoE: 4)")
    args = parser.parse_args()
    server = None
    if not args.backend:
        from proxy.embedded import start_embedded_backend

        server = start_embedded_backend(max_num_seqs=64)
        args.backend = server.url
    try:
        print(f"backend {args.backend}; proxy = `cohort serve` in its own process; {os.cpu_count()} CPUs")
        overhead(args.backend, [int(c) for c in args.concurrency.split(",")], args.requests_per_client)
        prompts = [json.loads(line)["text"] for line in PROMPTS.read_text().splitlines()][: args.prompts]
        planning(args.backend, prompts, 16, args.max_tokens, args.moe_layers)
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()

"""End to end through vLLM CPU: a proxy that starts with no head and learns one from the served model (issue 26).

    python -m benchmarks.bench_learning_e2e [--model-dir DIR] [--first 200] [--warm 800] [--clients 64]
        [--slots 16] [--max-tokens 32] [--rounds 3] [--engine-side | --engine-side-only]

The served model is the tiny MoE trained on text (`cohort make-tiny-moe --trained`, built and cached if
--model-dir has none), on a vLLM CPU server with the moe-cohort plugin and max_num_seqs = --slots, pinned
to the first half of the CPUs; the proxies and the clients run on the other half.
Prompts: $COHORT_DATA/prompts/mixed.jsonl under the project's split, each side in a seeded order (the
file groups its prompts by source, which would favour first come, first served), the held-out side for
the measured runs. --clients closed-loop clients each send their next
prompt when their answer came (so at most clients - slots requests wait), `ignore_eos`, --max-tokens.

Proxy side (`cohort serve --max-in-flight SLOTS`, a fresh process each):
- fcfs: `--encoder none`, on the first --first training prompts and on the held-out ones;
- learning: `--learn` with an empty --data-dir and the default (static) encoder: the first --first
  training prompts (it starts with no head), the training prompts up to --warm observed, then the
  held-out ones, restarted from what it saved (it keeps learning from them, as it would in service);
- offline: the static encoder with the head fitted (train.profile_head) on every training prompt's
  observed profile, collected by a learning proxy over the whole training side (what `cohort train
  --traces` fits on recorded traces of the same prompts), on the held-out prompts.
The held-out prompts run --rounds times, fcfs, learning (each round from a copy of the state after
--warm) and offline in turn on the same server, and the savings are taken against the same round's
fcfs: one run of each, minutes apart, differed by several points from one vLLM start to the next
(offline head 25-32% over 8 starts), while interleaved rounds on one server agree to 1-2 points.
With --engine-side, the same three on a second server with `--scheduler-cls ExpertAwareScheduler` and
the proxy forwarding at once with the profiles (`--forward-profiles --max-in-flight 256`).

Each measured set prints, from the plugin's counters: decode expert loads per GENERATED token (the
distinct experts of each forward's decode tokens, summed over layers and forwards, over the decode
tokens), decode tokens per forward (fewer tokens per forward touch fewer experts by themselves), the
wall time, the mean number of requests waiting in vLLM's queue and in the proxy (sampled every 0.2 s:
the pool admission chose from; the rest of the clients' requests are running or in transit); and for
the learning proxy its observed count and mode from /health.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np

from benchmarks import bench_proxy
from benchmarks.bench_proxy import split_cpus, start_proxy
from benchmarks.heldout import prompt_texts
from moe_cohort.embedded.backend import default_model_dir, ensure_trained_model
from moe_cohort.send.engine_counters import metric_sum, read_counters, read_metrics
from moe_cohort.traces.split import split_requests

TRAINED = default_model_dir()  # where `cohort serve` keeps it
FCFS_HELD, OFFLINE_HELD = "fcfs, held-out", "offline head, held-out"  # row names (bench_replay_vs_engine reads them)


async def send(url: str, prompts: list[str], clients: int, max_tokens: int) -> dict:
    """Closed loop: `clients` clients, each sends the next prompt when its answer came. Wall seconds, each
    answered request's latency (seconds), and the failures (status or exception, counted by kind)."""
    queue, latencies, failures = list(reversed(prompts)), [], {}

    async def client(http: aiohttp.ClientSession) -> None:
        while queue:
            body = {"model": "tiny", "messages": [{"role": "user", "content": queue.pop()}], "max_tokens": max_tokens,
                    "ignore_eos": True, "truncate_prompt_tokens": 256}
            start = time.perf_counter()
            try:
                async with http.post(url + "/v1/chat/completions", json=body) as resp:
                    await resp.read()
                    if resp.status != 200:
                        failures[str(resp.status)] = failures.get(str(resp.status), 0) + 1
                        continue
            except (aiohttp.ClientError, TimeoutError) as exc:
                failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1
                continue
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients),
                                     timeout=aiohttp.ClientTimeout(total=3600)) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return {"wall_s": time.perf_counter() - start, "latencies": latencies, "failures": failures}


def waiting(backend: str, proxy: str) -> tuple[float, float]:
    """Requests waiting now: in vLLM's queue (vllm:num_requests_waiting) and in the proxy (cohort_waiting)."""
    return (metric_sum(read_metrics(backend), "vllm:num_requests_waiting"),
            metric_sum(read_metrics(proxy), "cohort_waiting"))


def measure(name: str, backend: str, proxy: str, prompts: list[str], args, layers: int) -> dict:
    before = read_counters(backend)
    samples: list[tuple[float, float]] = []
    done = threading.Event()

    def sample() -> None:  # the pools admission chose from, every 0.2 s
        while not done.wait(0.2):
            samples.append(waiting(backend, proxy))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    sent = asyncio.run(send(proxy, prompts, args.clients, args.max_tokens))
    wall, failed = sent["wall_s"], sum(sent["failures"].values())
    done.set()
    sampler.join()
    time.sleep(1.5)  # the worker publishes its counters at most once a second while busy
    ran = read_counters(backend) - before
    loads_per_token, tokens_per_forward = ran.loads_per_token, ran.tokens_per_forward(layers)
    engine_pool, proxy_pool = np.mean(samples, axis=0) if samples else (float("nan"), float("nan"))
    row = {"run": name, "requests": len(prompts), "loads_per_token": loads_per_token,
           "tokens_per_forward": tokens_per_forward, "wall_s": wall, "failed": failed, "failures": sent["failures"],
           "waiting_engine": float(engine_pool), "waiting_proxy": float(proxy_pool)}
    health = health_of(proxy)
    if "learning" in health.get("admission", {}):
        row["admission"] = health["admission"]
    print(f"{name:>28}: {row['loads_per_token']:6.3f} decode expert loads per generated token, "
          f"{row['tokens_per_forward']:5.2f} decode tokens per forward, wall {wall:6.1f} s ({len(prompts)} requests), "
          f"waiting {engine_pool:4.1f} in vLLM + {proxy_pool:4.1f} in the proxy, {failed} failed"
          f"{' ' + str(sent['failures']) if failed else ''}"
          + (f"  [{health['admission']['mode']}, {health['admission']['learning']['observed']} observed]"
             if "admission" in row else ""), flush=True)
    return row


def health_of(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=30) as resp:
        return json.loads(resp.read())


def wait_learned(proxy: str, sent: int, timeout_s: float = 120.0) -> int:
    """Until the learning proxy has taken the counts of every request sent, or stopped taking more for 5 s; how
    many it took."""
    deadline, last, since = time.monotonic() + timeout_s, -1, time.monotonic()
    while time.monotonic() < deadline:
        observed = (health_of(proxy).get("admission", {}).get("learning") or {}).get("observed", 0)
        if observed >= sent:
            return observed
        if observed != last:
            last, since = observed, time.monotonic()
        elif time.monotonic() - since > 5:
            print(f"  (learned from {observed} of {sent} requests)")
            return observed
        time.sleep(0.5)
    return last


def offline_encoder(learned: Path, out: Path) -> Path:
    """The static encoder's folder with the head fitted on every observation `learned` holds."""
    from moe_cohort.encoder.embedding import resolve_model
    from moe_cohort.train.online import LearnConfig, OnlineLearner

    learner = OnlineLearner.load(learned, LearnConfig(capacity=100_000), key="static")
    shutil.copytree(resolve_model("static"), out)
    learner.refit().save(out)
    print(f"offline head: fitted on all {learner.reservoir.size} training prompts' observed profiles")
    return out


def runs(backend: str, flags: list[str], train: list[str], held: list[str], args, layers: int, work: Path) -> list[dict]:
    """The first prompts (fcfs, the learning proxy from nothing), the learning up to --warm, the offline head,
    then --rounds rounds of the held-out prompts, each measuring fcfs, learning and offline in turn."""
    first, warm = train[: args.first], train[args.first: args.warm]
    out = [measure_with(backend, ["--encoder", "none", *flags], "fcfs, first prompts", first, args, layers)]
    learned = Path(tempfile.mkdtemp(dir=work))  # what the learning proxy knows after --warm (saved when it stops)
    proc, proxy = start_proxy(backend, "--learn", "--data-dir", str(learned), *flags)
    try:
        out.append(measure(f"learning, first {len(first)}", backend, proxy, first, args, layers))
        asyncio.run(send(proxy, warm, args.clients, args.max_tokens))
        wait_learned(proxy, args.warm)
    finally:
        proc.terminate(), proc.wait(60)
    encoder = offline_encoder(collect_all(backend, flags, train, args, work),
                              Path(tempfile.mkdtemp(dir=work)) / "offline")
    no_refit = {"COHORT_LEARN_REFIT_EVERY": "1000000"} if args.no_refit_held_out else {}
    for r in range(args.rounds):  # interleaved: the engine's drift over minutes hits all three alike
        resumed = Path(tempfile.mkdtemp(dir=work))  # a copy: every round resumes from the state after --warm
        shutil.copytree(learned, resumed, dirs_exist_ok=True)
        out += [measure_with(backend, ["--encoder", "none", *flags], FCFS_HELD, held, args, layers, r),
                measure_with(backend, ["--learn", "--data-dir", str(resumed), *flags],
                             f"learning, held-out after {args.warm}", held, args, layers, r, env=no_refit),
                measure_with(backend, ["--encoder", str(encoder), "--no-learn", *flags], OFFLINE_HELD, held, args,
                             layers, r)]
    return out


def measure_with(backend: str, proxy_flags: list[str], name: str, prompts: list[str], args, layers: int,
                 round_: int | None = None, env: dict[str, str] | None = None) -> dict:
    """`measure` through a fresh proxy started with `proxy_flags` and `env` (stopped after)."""
    proc, proxy = start_proxy(backend, *proxy_flags, env=env, log=_log(args, name, round_))
    try:
        row = measure(name, backend, proxy, prompts, args, layers)
    finally:
        proc.terminate(), proc.wait(60)
    return row if round_ is None else {**row, "round": round_}


def _log(args, name: str, round_: int | None = None) -> Path | None:
    """Where the proxy of run `name` logs (--logs), or None."""
    if not args.logs:
        return None
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    return Path(args.logs) / f"{name.split(',')[0].replace(' ', '-')}{'' if round_ is None else f'-r{round_}'}.log"


def collect_all(backend: str, flags: list[str], train: list[str], args, work: Path) -> Path:
    """Every training prompt observed once by a learning proxy (what the offline head fits on): its learned folder."""
    data = Path(tempfile.mkdtemp(dir=work))
    proc, proxy = start_proxy(backend, "--learn", "--data-dir", str(data), *flags,
                              env={"COHORT_LEARN_CAPACITY": "100000"})
    try:
        asyncio.run(send(proxy, train, args.clients, args.max_tokens))
        wait_learned(proxy, len(train))
    finally:
        proc.terminate(), proc.wait(60)  # saves what it learned
    return data / "learned"


def savings(rows: list[dict], name: str) -> np.ndarray:
    """Per round, the saving of run `name` against the same round's fcfs (held-out rows)."""
    fcfs = {r.get("round", 0): r["loads_per_token"] for r in rows if r["run"] == FCFS_HELD}
    return np.array([1 - r["loads_per_token"] / fcfs[r.get("round", 0)] for r in rows if r["run"] == name])


def summary(side: str, rows: list[dict], learning: str) -> str:
    """The held-out savings against each round's fcfs, mean +- std over rounds, and tokens per forward."""
    tpf = lambda name: np.mean([r["tokens_per_forward"] for r in rows if r["run"] == name])  # noqa: E731

    def line(name: str) -> str:
        s = savings(rows, name)
        return f"{name.split(',')[0]} {s.mean():+.1%} +- {s.std():.1%} ({tpf(name):.2f} tokens per forward)"
    rounds = sum(r["run"] == FCFS_HELD for r in rows)
    failed = sum(r.get("failed", 0) for r in rows)
    return (f"{side}: held-out saving against fcfs over {rounds} rounds: {line(learning)}, "
            f"{line(OFFLINE_HELD)}; fcfs {tpf(FCFS_HELD):.2f} tokens per forward; {failed} requests failed in all runs")


def trained_model(model_dir: str) -> tuple[Path, int]:
    """The trained tiny MoE in `model_dir` (trained there first if missing) and its layer count."""
    model = ensure_trained_model(model_dir)
    return model, json.loads((model / "config.json").read_text())["num_hidden_layers"]


@contextlib.contextmanager
def pinned():
    """vLLM started inside gets the first half of the CPUs (its processes inherit this process's affinity), the
    proxies (bench_proxy.PROXY_CPUS) and, once the caller moves there, the clients the other half: a GPU engine
    and its proxy never share a core, and on 2 cores vLLM's busy worker would otherwise starve the proxy."""
    everything = os.sched_getaffinity(0)
    backend_cpus, bench_proxy.PROXY_CPUS = split_cpus()
    os.sched_setaffinity(0, backend_cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, everything)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=str(TRAINED), help="the trained tiny MoE (built here if missing)")
    p.add_argument("--first", type=int, default=200)
    p.add_argument("--warm", type=int, default=800)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--limit", type=int, help="at most this many training and this many held-out prompts (a quick run)")
    p.add_argument("--engine-side", action="store_true")
    p.add_argument("--engine-side-only", action="store_true", help="the engine-side runs alone (no proxy side)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the held-out prompts (fcfs, learning, offline each)")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--logs", help="a folder for the proxies' logs (default: none kept)")
    p.add_argument("--keep", help="copy the runs' data folders (learned heads, the offline encoder) here")
    p.add_argument("--no-refit-held-out", action="store_true", help="a diagnosis: the learning proxy, restarted from "
                   "what it learned, observes the held-out prompts but refits nothing while they run")
    args = p.parse_args()
    from moe_cohort.embedded.vllm_server import start

    model, layers = trained_model(args.model_dir)
    texts = prompt_texts()
    train_idx, held_idx = split_requests(len(texts), groups=texts)
    train, held = [texts[i] for i in train_idx], [texts[i] for i in held_idx]
    random.Random(0).shuffle(train)  # arrivals in no order (mixed.jsonl groups its prompts by source)
    random.Random(1).shuffle(held)
    if args.limit:
        train, held = train[: args.limit], held[: args.limit]
    print(f"{len(train)} training prompts (seeded order), {len(held)} held-out; {args.clients} clients, "
          f"{args.slots} slots, {args.max_tokens} tokens each; model {model}")
    work = Path(tempfile.mkdtemp(prefix="bench-learning-"))
    rows = {}
    try:
        if not args.engine_side_only:
            with pinned(), start(model, max_num_seqs=args.slots, max_model_len=1024) as server:
                os.sched_setaffinity(0, bench_proxy.PROXY_CPUS)  # the clients, off vLLM's core
                print("\n-- proxy-side admission (the proxy holds --slots requests at the backend)")
                rows["proxy"] = runs(server.url, ["--max-in-flight", str(args.slots)], train, held, args, layers, work)
        if args.engine_side or args.engine_side_only:
            with pinned(), start(model, max_num_seqs=args.slots, max_model_len=1024,
                                 extra_args=["--scheduler-cls", "moe_cohort.engine.scheduler.ExpertAwareScheduler"]) \
                    as server:
                os.sched_setaffinity(0, bench_proxy.PROXY_CPUS)
                print("\n-- engine-side admission (ExpertAwareScheduler; the proxy forwards at once with the profiles)")
                rows["engine"] = runs(server.url, ["--max-in-flight", "256", "--forward-profiles"], train, held, args,
                                      layers, work)
    finally:
        if args.keep:
            shutil.copytree(work, args.keep, dirs_exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)
    for side, side_rows in rows.items():
        print(summary(side, side_rows, f"learning, held-out after {args.warm}"))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

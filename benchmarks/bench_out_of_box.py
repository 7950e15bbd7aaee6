"""End to end through vLLM CPU: what `cohort serve --backend URL` gives with no other flag, against first come,
first served.

    python -m benchmarks.bench_out_of_box [--model-dir DIR] [--learn 400] [--measure 240] [--rounds 4]
        [--clients 64] [--slots 16] [--max-tokens 64] [--servers ours,plain] [--json FILE]

The served model is the tiny MoE trained on text (`cohort serve`'s embedded default, trained and cached if
--model-dir has none), on vLLM CPU with the moe-cohort plugin (its counters measure every run), eager,
max_num_seqs = --slots, pinned to a core of its own; the proxies and the clients run on the other cores.
Prompts: $COHORT_DATA/prompts/mixed.jsonl (chat and questions: MT-Bench, Vicuna, GSM8K, HumanEval) under the
project's split, in a seeded order; --learn training-side prompts to learn from, then --measure held-out ones.

Per server kind (--servers): "ours" runs vLLM with `--scheduler-cls ...ExpertAwareScheduler` (the README's
quick start), "plain" without it (vLLM's own scheduler; the plugin still counts). On each:
1. the no-flag proxy (`cohort serve --backend URL`, a fresh --data-dir) answers the --learn prompts (it
   configures itself from the engine and learns from it), and stops (saving what it learned);
2. --rounds rounds, each: FCFS (`--encoder none`: a proxy that predicts nothing, so vLLM's queue is first come,
   first served) then the no-flag proxy restarted from a copy of the state after step 1, both on the held-out
   prompts. The saving is taken against the same round's FCFS (interleaved: the engine drifts over minutes).
Each run prints decode expert loads per GENERATED token and decode tokens per forward (the plugin's counters),
p50 / p99 latency of a whole answer, wall time, and how many requests failed (a failure is counted, never
an abort).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import bench_proxy
from benchmarks.bench_learning_e2e import health_of, send, wait_learned
from benchmarks.bench_proxy import split_cpus, start_proxy
from benchmarks.heldout import prompt_texts
from moe_cohort.embedded.backend import default_model_dir, ensure_trained_model
from moe_cohort.engine.engine_info import SCHEDULER_CLS
from moe_cohort.send.engine_counters import read_counters
from moe_cohort.traces.split import split_requests

SCHEDULER = ["--scheduler-cls", SCHEDULER_CLS]


def measure(name: str, backend: str, proxy: str, prompts: list[str], args, layers: int) -> dict:
    """One run of `prompts` through `proxy`: the engine's decode rates over it, latency, wall, failures."""
    before = read_counters(backend)
    sent = asyncio.run(send(proxy, prompts, args.clients, args.max_tokens))
    time.sleep(1.5)  # the worker publishes its counters at most once a second while busy
    ran = read_counters(backend) - before
    loads, tokens_per_forward = ran.loads_per_token, ran.tokens_per_forward(layers)
    lat = np.array(sent["latencies"] or [float("nan")])
    row = {"run": name, "requests": len(prompts), "loads_per_token": loads, "tokens_per_forward": tokens_per_forward,
           "p50_s": float(np.percentile(lat, 50)), "p99_s": float(np.percentile(lat, 99)), "wall_s": sent["wall_s"],
           "failed": sum(sent["failures"].values()), "failures": sent["failures"]}
    print(f"{name:>24}: {loads:6.3f} decode expert loads per generated token, {tokens_per_forward:5.2f} tokens per "
          f"forward, p50 {row['p50_s']:5.2f} s, p99 {row['p99_s']:5.2f} s, wall {row['wall_s']:6.1f} s, "
          f"{row['failed']} of {len(prompts)} failed {sent['failures'] or ''}", flush=True)
    return row


def through(backend: str, flags: list[str], logs: Path, name: str, prompts: list[str], args, layers: int) -> dict:
    """`measure` through a fresh `cohort serve --backend BACKEND *flags` (its log kept in `logs`), stopped after."""
    proc, proxy = start_proxy(backend, *flags, log=logs / f"{name.replace(' ', '-')}.log")
    try:
        health = health_of(proxy)
        row = measure(name, backend, proxy, prompts, args, layers)
        row["configuration"] = health.get("configuration")
        return row
    finally:
        proc.terminate(), proc.wait(60)


def one_server(kind: str, model: Path, layers: int, learn: list[str], held: list[str], args, work: Path) -> list[dict]:
    from moe_cohort.embedded.vllm_server import start

    logs = work / kind
    logs.mkdir()
    state = logs / "learned-state"
    with start(model, max_num_seqs=args.slots, max_model_len=1024, extra_args=SCHEDULER if kind == "ours" else ()) \
            as server:
        os.sched_setaffinity(0, bench_proxy.PROXY_CPUS)  # the clients, off vLLM's core
        print(f"\n-- vLLM {'with' if kind == 'ours' else 'without'} moe-cohort's scheduler ({server.url})", flush=True)
        learn_through(server.url, learn, args, state, logs / "learning.log")
        rows = []
        for r in range(args.rounds):
            resumed = Path(tempfile.mkdtemp(dir=work))
            shutil.copytree(state, resumed, dirs_exist_ok=True)  # every round resumes from the state after learning
            rows.append({**through(server.url, ["--encoder", "none"], logs, f"fcfs r{r}", held, args, layers),
                         "kind": "fcfs", "round": r})
            rows.append({**through(server.url, ["--data-dir", str(resumed)], logs, f"no-flag proxy r{r}", held, args,
                                   layers), "kind": "no-flag", "round": r})
    return rows


def summary(kind: str, rows: list[dict]) -> str:
    fcfs = {r["round"]: r for r in rows if r["kind"] == "fcfs"}
    ours = [r for r in rows if r["kind"] == "no-flag"]
    saving = np.array([1 - r["loads_per_token"] / fcfs[r["round"]]["loads_per_token"] for r in ours])
    mean = lambda key, k: np.mean([r[key] for r in rows if r["kind"] == k])  # noqa: E731
    tpf, p99 = mean("tokens_per_forward", "no-flag") / mean("tokens_per_forward", "fcfs") - 1, \
        mean("p99_s", "no-flag") / mean("p99_s", "fcfs") - 1
    failed = sum(r["failed"] for r in rows)
    return (f"{kind}: the no-flag proxy against fcfs over {len(ours)} rounds: {saving.mean():+.1%} +- {saving.std():.1%} "
            f"fewer decode expert loads per generated token; tokens per forward {tpf:+.1%} "
            f"({mean('tokens_per_forward', 'no-flag'):.2f} against {mean('tokens_per_forward', 'fcfs'):.2f}); p99 "
            f"{p99:+.1%} ({mean('p99_s', 'no-flag'):.2f} s against {mean('p99_s', 'fcfs'):.2f} s); p50 "
            f"{mean('p50_s', 'no-flag'):.2f} s against {mean('p50_s', 'fcfs'):.2f} s; wall {mean('wall_s', 'no-flag'):.1f} s "
            f"against {mean('wall_s', 'fcfs'):.1f} s; {failed} requests failed")


def add_served_arguments(p: argparse.ArgumentParser, rounds: int) -> None:
    """The flags of a run through vLLM CPU on the trained tiny MoE (this benchmark's, bench_levers_e2e's)."""
    p.add_argument("--model-dir", default=str(default_model_dir()), help="the trained tiny MoE (trained here if missing)")
    p.add_argument("--learn", type=int, default=400, help="training-side requests the proxy learns from first")
    p.add_argument("--measure", type=int, default=240, help="held-out requests per measured run")
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--slots", type=int, default=16, help="vLLM's max_num_seqs")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", help="also write the rows here")


def served_setup(args) -> tuple[Path, int, list[str], list[str], set[int]]:
    """(the model, its MoE layers, the learning prompts, the held-out prompts, vLLM's CPUs); this process is
    pinned to vLLM's CPUs (its processes inherit them) and bench_proxy.PROXY_CPUS set to the others."""
    model = ensure_trained_model(Path(args.model_dir))
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    texts = prompt_texts()
    train_idx, held_idx = split_requests(len(texts), groups=texts)
    learn, held = [texts[i] for i in train_idx], [texts[i] for i in held_idx]
    random.Random(0).shuffle(learn)  # mixed.jsonl groups its prompts by source
    random.Random(1).shuffle(held)
    backend_cpus, bench_proxy.PROXY_CPUS = split_cpus()
    os.sched_setaffinity(0, backend_cpus)
    return model, layers, learn[: args.learn], held[: args.measure], backend_cpus


def learn_through(url: str, learn: list[str], args, state: Path, log: Path) -> None:
    """The no-flag proxy (`cohort serve --backend URL --data-dir STATE`) answers `learn` and stops, saving what it
    learned in `state`."""
    proc, proxy = start_proxy(url, "--data-dir", str(state), log=log)
    try:
        print(f"configuration: {json.dumps(health_of(proxy).get('configuration'))}")
        learned = asyncio.run(send(proxy, learn, args.clients, args.max_tokens))
        print(f"learning: {len(learn)} requests in {learned['wall_s']:.0f} s, {len(learned['failures'])} kinds of "
              f"failure {learned['failures']}; learned from {wait_learned(proxy, len(learn))}", flush=True)
    finally:
        proc.terminate(), proc.wait(60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_served_arguments(p, rounds=4)
    p.add_argument("--servers", default="ours,plain", help="ours (vLLM with our scheduler), plain (without), or both")
    args = p.parse_args()
    model, layers, learn, held, backend_cpus = served_setup(args)
    print(f"{len(learn)} learning prompts, {len(held)} held-out; {args.clients} clients, {args.slots} slots, "
          f"{args.max_tokens} tokens each; vLLM on CPUs {sorted(backend_cpus)}, proxies and clients on "
          f"{sorted(bench_proxy.PROXY_CPUS)}; model {model}", flush=True)
    work, out = Path(tempfile.mkdtemp(prefix="bench-out-of-box-")), {}
    for kind in args.servers.split(","):
        os.sched_setaffinity(0, backend_cpus)
        out[kind] = one_server(kind, model, layers, learn, held, args, work)
    finish([summary(kind, rows) for kind, rows in out.items()], out, work, args.json)


def finish(lines: list[str], rows, work: Path, json_path: str | None) -> None:
    """The end of a served benchmark: its summary lines, where the logs are, and the rows as JSON when asked."""
    print("\n".join(lines))
    print(f"proxy logs: {work}")
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

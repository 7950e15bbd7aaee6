"""End to end through vLLM CPU: the two levers together, admission and a batch-aware expert selector.

    python -m benchmarks.bench_levers_e2e [--model-dir DIR] [--learn 400] [--measure 240] [--rounds 2]
        [--clients 64] [--slots 16] [--max-tokens 64] [--policies "topk,xshare;m=16;k0=1,..."] [--json FILE]

The served model is the tiny MoE trained on text (`cohort serve`'s embedded default), on vLLM CPU with the
moe-cohort plugin and its scheduler, eager, max_num_seqs = --slots, pinned to a core of its own; the
proxies and the clients run on the other cores. Prompts: $COHORT_DATA/prompts/mixed.jsonl under the
project's split; --learn training-side prompts to learn from, then --measure held-out ones.

1. The no-flag proxy (`cohort serve --backend URL`, a fresh --data-dir) answers the --learn prompts and
   stops, saving what it learned.
2. --rounds rounds, each, for every policy of --policies (the proxies' `--default-policy`): first come,
   first served (`--encoder none`) then admission (the no-flag proxy resumed from the learned state), on
   the held-out prompts, greedy (temperature 0, ignore_eos, the generated token ids returned).
Each run prints decode expert loads per GENERATED token after the policy (the plugin's counters) and
the share of generated tokens identical, position by position, to the same prompt's tokens under `topk`
first come, first served in the same round (the model's own routing, which no batch mate changes).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from benchmarks import bench_proxy
from benchmarks.bench_out_of_box import SCHEDULER, add_served_arguments, finish, learn_through, served_setup
from benchmarks.bench_proxy import start_proxy
from moe_cohort.send.engine_counters import read_counters

POLICIES = "topk,xshare;m=16;k0=1,xshare;m=24;k0=1,moe-spec;budget=16,moe-spec;budget=24"


def identical_share(reference: dict[int, list[int]], got: dict[int, list[int]]) -> float:
    """Of the reference's generated tokens, the share that `got` generated at the same position of the same
    prompt (prompts missing from either side are left out); NaN when nothing is compared."""
    same = total = 0
    for prompt, ref in reference.items():
        if prompt in got:
            other = got[prompt]
            same += sum(a == b for a, b in zip(ref, other))
            total += len(ref)
    return same / total if total else float("nan")


async def generate(url: str, prompts: list[str], clients: int, max_tokens: int) -> tuple[dict[int, list[int]], int]:
    """Closed loop of `clients`: each prompt's generated token ids (greedy), and how many requests failed."""
    queue, out, failed = list(reversed(range(len(prompts)))), {}, [0]

    async def client(http: aiohttp.ClientSession) -> None:
        while queue:
            i = queue.pop()
            body = {"model": "tiny", "messages": [{"role": "user", "content": prompts[i]}], "max_tokens": max_tokens,
                    "ignore_eos": True, "temperature": 0, "truncate_prompt_tokens": 256, "return_token_ids": True}
            try:
                async with http.post(url + "/v1/chat/completions", json=body) as resp:
                    answer = await resp.json()
                    if resp.status != 200:
                        failed[0] += 1
                        continue
                    out[i] = answer["choices"][0]["token_ids"]
            except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
                failed[0] += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients),
                                     timeout=aiohttp.ClientTimeout(total=3600)) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return out, failed[0]


def run(name: str, backend: str, flags: list[str], held: list[str], args, layers: int, logs: Path) -> dict:
    """One run of the held-out prompts through a fresh `cohort serve --backend BACKEND *flags`."""
    proc, proxy = start_proxy(backend, *flags, log=logs / f"{name.replace(' ', '-').replace(';', '_')}.log")
    try:
        before = read_counters(backend)
        start = time.perf_counter()
        tokens, failed = asyncio.run(generate(proxy, held, args.clients, args.max_tokens))
        wall = time.perf_counter() - start
        time.sleep(1.5)  # the worker publishes its counters at most once a second while busy
        ran = read_counters(backend) - before
        loads, tokens_per_forward = ran.loads_per_token, ran.tokens_per_forward(layers)
    finally:
        proc.terminate(), proc.wait(60)
    return {"run": name, "loads_per_token": loads, "tokens_per_forward": tokens_per_forward, "wall_s": wall,
            "failed": failed, "tokens": tokens}


def rounds(backend: str, state: Path, held: list[str], args, layers: int, work: Path) -> list[dict]:
    rows = []
    for r in range(args.rounds):
        reference = None
        for policy in args.policies.split(","):
            resumed = Path(tempfile.mkdtemp(dir=work))
            shutil.copytree(state, resumed, dirs_exist_ok=True)
            for kind, flags in (("fcfs", ["--encoder", "none"]), ("admission", ["--data-dir", str(resumed)])):
                row = run(f"{kind} {policy} r{r}", backend, [*flags, "--default-policy", policy], held, args,
                          layers, work)
                if reference is None:  # topk, first come, first served: the model's own routing
                    reference = row["tokens"]
                row.update(kind=kind, policy=policy, round=r, identical=identical_share(reference, row.pop("tokens")))
                print(f"{row['run']:>34}: {row['loads_per_token']:6.3f} decode expert loads per generated token, "
                      f"{row['tokens_per_forward']:5.2f} tokens per forward, {row['identical']:6.1%} of tokens as "
                      f"topk, wall {row['wall_s']:5.1f} s, {row['failed']} failed", flush=True)
                rows.append(row)
    return rows


def summary(rows: list[dict]) -> list[str]:
    """Per policy and admission: mean loads per token, tokens identical to topk; the saving of each against
    first come, first served with `topk` in the same round, and admission against first come, first served
    with the same policy."""
    base = {r["round"]: r["loads_per_token"] for r in rows if r["kind"] == "fcfs" and r["policy"] == "topk"}
    lines = []
    for policy in dict.fromkeys(r["policy"] for r in rows):
        cells, fcfs = [], {r["round"]: r for r in rows if r["policy"] == policy and r["kind"] == "fcfs"}
        for kind in ("fcfs", "admission"):
            own = [r for r in rows if r["policy"] == policy and r["kind"] == kind]
            saving = np.array([1 - r["loads_per_token"] / base[r["round"]] for r in own])
            cells.append(f"{kind} {np.mean([r['loads_per_token'] for r in own]):6.3f} ({saving.mean():+.1%} vs "
                         f"fcfs topk; {np.mean([r['identical'] for r in own]):.1%} as topk)")
        admitted = [r for r in rows if r["policy"] == policy and r["kind"] == "admission"]
        gain = np.array([1 - r["loads_per_token"] / fcfs[r["round"]]["loads_per_token"] for r in admitted])
        lines.append(f"{policy:>22}: {' | '.join(cells)} | admission vs fcfs, same policy: "
                     f"{gain.mean():+.1%} +- {gain.std():.1%}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_served_arguments(p, rounds=2)
    p.add_argument("--policies", default=POLICIES, help="comma-separated routing policies; the first is the reference")
    args = p.parse_args()
    from moe_cohort.embedded.vllm_server import start

    model, layers, learn, held, _ = served_setup(args)
    work = Path(tempfile.mkdtemp(prefix="bench-levers-e2e-"))
    state = work / "learned-state"
    with start(model, max_num_seqs=args.slots, max_model_len=1024, extra_args=SCHEDULER) as server:
        os.sched_setaffinity(0, bench_proxy.PROXY_CPUS)  # the clients, off vLLM's core
        learn_through(server.url, learn, args, state, work / "learning.log")
        rows = rounds(server.url, state, held, args, layers, work)
    finish(summary(rows), rows, work, args.json)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

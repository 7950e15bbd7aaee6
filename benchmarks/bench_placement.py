"""What the embedded default's placement costs vLLM, and what it gives the proxy: the same server, its processes
moved between two placements round by round.

    python -m benchmarks.bench_placement [--rounds 3] [--learn 400] [--measure 240] [--clients 64]
        [--max-tokens 64] [--model-dir DIR]

The trained tiny MoE on vLLM CPU (the plugin and our scheduler, max_num_seqs 16, eager). Placements:
- "floating": what a user gets with nothing pinned: vLLM CPU binds its worker to all cores but one and its API
  server and engine core float over every core, as do the proxies and the clients;
- "placed": the embedded `cohort serve`'s rule (embedded/placement.py): every process of vLLM on all cores but
  one, the proxies and the clients on that one.
vLLM's worker stays where vLLM bound it in both (the same cores: started on the engine's side, vLLM binds it
there too); the rest is moved between rounds (every thread, as `taskset -a` does). A bare proxy (`cohort serve
--backend URL`, which learns from the engine) first answers --learn training-side prompts. Then per round and
placement, in turn: vLLM called directly, an FCFS proxy (`--encoder none`) and the bare proxy, each on the same
--measure held-out prompts. Per run: decode expert loads per generated token and decode tokens per forward (the
plugin's counters), generated tokens per second, wall, and the CPU seconds of vLLM's processes and of the proxy.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

from benchmarks import bench_proxy
from benchmarks.bench_learning_e2e import send, wait_learned
from benchmarks.bench_out_of_box import SCHEDULER, add_served_arguments, served_setup
from benchmarks.bench_proxy import start_proxy
from moe_cohort.embedded.placement import move_process, split_cpus
from moe_cohort.embedded.vllm_server import group_members, start
from moe_cohort.send.engine_counters import read_counters

PLACEMENTS = ("floating", "placed")


def place(name: str, allowed: set[int], vllm_pgid: int, proxies: list[int]) -> None:
    """Move vLLM's processes but its workers, the proxies (with their children) and this process to `name`."""
    split = split_cpus(allowed)
    engine, ours = (allowed, allowed) if name == "floating" else (split.engine, split.ours)
    for pid in group_members(vllm_pgid):
        if not psutil.Process(pid).name().startswith("VLLM::Worker"):
            move_process(engine, pid)
    for pid in proxies:
        for process in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
            move_process(ours, process.pid)
    move_process(ours)


def cpu_seconds(pids: list[int]) -> float:
    return sum(sum(psutil.Process(p).cpu_times()[:2]) for p in pids if psutil.pid_exists(p))


def run(name: str, backend: str, url: str, vllm: list[int], proxy: int | None, prompts, args, layers: int) -> dict:
    """`prompts` through `url`; the engine's decode rates over the run, its throughput and everyone's CPU."""
    before, vllm_cpu, proxy_cpu = read_counters(backend), cpu_seconds(vllm), cpu_seconds([proxy] if proxy else [])
    sent = asyncio.run(send(url, prompts, args.clients, args.max_tokens))
    vllm_cpu, proxy_cpu = cpu_seconds(vllm) - vllm_cpu, cpu_seconds([proxy] if proxy else []) - proxy_cpu
    time.sleep(1.5)  # the worker publishes its counters at most once a second while busy
    ran = read_counters(backend) - before
    row = {"run": name, "loads_per_token": ran.loads_per_token, "tokens_per_forward": ran.tokens_per_forward(layers),
           "tokens_per_s": len(sent["latencies"]) * args.max_tokens / sent["wall_s"], "wall_s": sent["wall_s"],
           "vllm_cpu_s": vllm_cpu, "proxy_cpu_s": proxy_cpu, "failed": sum(sent["failures"].values())}
    print(f"{name:>22}: {row['loads_per_token']:6.3f} decode loads per token, {row['tokens_per_forward']:5.2f} tokens "
          f"per forward, {row['tokens_per_s']:6.1f} tokens/s, wall {row['wall_s']:5.2f} s, vLLM CPU "
          f"{row['vllm_cpu_s']:5.1f} s, proxy CPU {row['proxy_cpu_s']:4.1f} s, {row['failed']} failed", flush=True)
    return row


def summary(rows: list[dict], rounds: int) -> list[str]:
    lines = []
    for name in PLACEMENTS:
        runs = lambda path: [r for r in rows if r["placement"] == name and r["path"] == path]  # noqa: E731
        mean = lambda path, key: np.mean([r[key] for r in runs(path)])  # noqa: E731
        saving = np.array([1 - b["loads_per_token"] / f["loads_per_token"] for b, f in zip(runs("bare"), runs("fcfs"))])
        lines.append(f"{name}: bare against FCFS {saving.mean():+.1%} +- {saving.std():.1%} ({rounds} rounds); tokens "
                     f"per forward direct {mean('direct', 'tokens_per_forward'):.2f}, FCFS {mean('fcfs', 'tokens_per_forward'):.2f}, "
                     f"bare {mean('bare', 'tokens_per_forward'):.2f}; tokens/s direct {mean('direct', 'tokens_per_s'):.1f}, "
                     f"FCFS {mean('fcfs', 'tokens_per_s'):.1f}, bare {mean('bare', 'tokens_per_s'):.1f}; vLLM CPU per run "
                     f"direct {mean('direct', 'vllm_cpu_s'):.1f} s; proxy CPU bare {mean('bare', 'proxy_cpu_s'):.2f} s")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_served_arguments(p, rounds=3)
    args = p.parse_args()
    allowed = os.sched_getaffinity(0)
    model, layers, learn, held, _ = served_setup(args)
    move_process(allowed)  # served_setup pinned this process and chose the proxies' CPUs: here `place` does
    bench_proxy.PROXY_CPUS = None
    if split_cpus() is None:
        raise SystemExit("one core: there is nothing to place")
    work = Path(tempfile.mkdtemp(prefix="bench-placement-"))
    with start(model, max_num_seqs=args.slots, max_model_len=1024, extra_args=SCHEDULER) as server:
        fcfs, fcfs_url = start_proxy(server.url, "--encoder", "none", log=work / "fcfs.log")
        bare, bare_url = start_proxy(server.url, "--data-dir", str(work / "data"), log=work / "bare.log")
        try:
            vllm = group_members(server.process.pid)
            learned = asyncio.run(send(bare_url, learn, args.clients, args.max_tokens))
            print(f"learning: {len(learn)} requests in {learned['wall_s']:.0f} s; learned from "
                  f"{wait_learned(bare_url, len(learn))}", flush=True)
            rows = []
            for r in range(args.rounds):
                for name in PLACEMENTS:
                    place(name, allowed, server.process.pid, [fcfs.pid, bare.pid])
                    for path, url, proxy in (("direct", server.url, None), ("fcfs", fcfs_url, fcfs.pid),
                                             ("bare", bare_url, bare.pid)):
                        rows.append({**run(f"{name} {path} r{r}", server.url, url, vllm, proxy, held, args, layers),
                                     "placement": name, "path": path})
        finally:
            for proc in (fcfs, bare):
                proc.terminate(), proc.wait(60)
    print("\n".join(summary(rows, args.rounds)))
    print(f"proxy logs: {work}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

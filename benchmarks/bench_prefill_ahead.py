"""End to end through vLLM CPU, on a cold prefix cache: one prefill per request (our scheduler's prefill ahead)
against file order and against today's one-token probe.

    python -m benchmarks.bench_prefill_ahead [--model-dir DIR] [--lines 600] [--rounds 2] [--slots 16]
        [--max-tokens 64] [--ahead N] [--probe] [--online [--clients 64]] [--plain-vllm] [--shared]
        [--max-in-flight N] [--json FILE]

The served model is the tiny MoE a user gets (`cohort serve`'s embedded default, trained without COHORT_DATA;
give a widened copy, `cohort make-tiny-moe --trained DIR --expert-width N`, for wall time on experts of real size),
on vLLM CPU with the plugin and `--scheduler-cls ...ExpertAwareScheduler`, eager, max_num_seqs = --slots, pinned to
a core of its own; the runner runs on the other core. The file: --lines prompts that no model here saw (the
held-out sides of the Puffin chat prompts and of mixed.jsonl; the user's tiny MoE, trained without COHORT_DATA,
saw neither source), shuffled, --max-tokens each (`ignore_eos`).

Every run gets a FRESH vLLM server (an empty prefix cache, as a user's batch finds it), and each round alternates
which run goes first:
- file order: COHORT_PREFILL_AHEAD=0 and `cohort batch run --encoder none` (vLLM's own first come, first served);
- prefill ahead: the default server and the bare `cohort batch run --backend URL` (each prompt routed in its own
  prefill, admitted to decode by that routing);
- with --probe, today's probe: COHORT_PREFILL_AHEAD=0 and the bare command (a one-token probe of every line first).

Per run: decode expert loads per GENERATED token and decode tokens per forward (the plugin's counters), wall time
(from the runner's first request, and with start-up), our runner's CPU seconds, every line answered exactly once.

With --plain-vllm the server runs vLLM's own scheduler (the plugin loaded: it counts experts, so a bare run
probes), and the runs are file order and the probe; --shared pins nothing (vLLM and the runner share every core,
as on a user's one machine); --max-in-flight N is every run's `--max-in-flight` (the runner's own default
otherwise).

With --online the same prompts are chat requests from --clients closed-loop clients instead of a file: through a
first come, first served proxy (`cohort serve --backend URL --encoder none`) on the file-order server, through the
bare `cohort serve --backend URL` (a fresh data dir) on the prefill-ahead one; each run also prints p50 and p99
latency of a whole answer, and failures.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from benchmarks import bench_proxy
from benchmarks.bench_batch_out_of_box import add_file_arguments, batch_file, cli_run, heldout_prompts, measured
from benchmarks.bench_out_of_box import SCHEDULER, finish, through
from benchmarks.bench_proxy import split_cpus
from moe_cohort.embedded.backend import ensure_trained_model

RUNS = {  # name -> (server environment, runner flags)
    "file order": ({"COHORT_PREFILL_AHEAD": "0"}, ["--encoder", "none"]),
    "prefill ahead": ({}, []),
    "probe": ({"COHORT_PREFILL_AHEAD": "0"}, []),
}


def one_run(name: str, model: Path, src: Path, work: Path, args, layers: int, r: int) -> dict:
    from moe_cohort.embedded.vllm_server import start

    env, flags = RUNS[name]
    env = {**env, **({"COHORT_PREFILL_AHEAD": str(args.ahead)} if args.ahead is not None and not env else {})}
    flags = [*flags, *(["--max-in-flight", str(args.max_in_flight)] if args.max_in_flight else [])]
    tag = name.replace(" ", "-")
    with start(model, extra_env=env, max_num_seqs=args.slots, max_model_len=1024,
               extra_args=[] if args.plain_vllm else SCHEDULER,
               log_path=work / f"vllm-{tag}-r{r}.log") as server:
        if args.online:  # the same flags make the FCFS proxy (--encoder none) and the bare one
            row = through(server.url, [*flags, "--data-dir", str(work / f"data-{tag}-r{r}")], work, f"{name} r{r}",
                          args.prompts, args, layers)
            return {**row, "kind": name, "round": r, "wall_after_start_s": row["wall_s"], "cpu_s": float("nan"),
                    "once": row["failed"] == 0, "log": None}
        row = measured(f"{name} r{r}", server.url, layers,
                       cli_run(src, work / f"{tag}-r{r}.jsonl", server.url,
                               ["--data-dir", str(work / f"data-{tag}-r{r}"), *flags]))
    return {**row, "kind": name, "round": r}


def summary(rows: list[dict]) -> list[str]:
    out = []
    for kind in [k for k in RUNS if k != "file order"]:
        pairs = [(b, o) for b in rows if b["kind"] == "file order"
                 for o in rows if o["kind"] == kind and o["round"] == b["round"]]
        if not pairs:
            continue
        saving = np.array([1 - o["loads_per_token"] / b["loads_per_token"] for b, o in pairs])
        tpf = np.array([o["tokens_per_forward"] / b["tokens_per_forward"] for b, o in pairs])
        wall = np.array([o["wall_after_start_s"] / b["wall_after_start_s"] - 1 for b, o in pairs])
        out.append(f"{kind} against file order, {len(pairs)} rounds: {saving.mean():+.1%} fewer decode loads per "
                   f"generated token (rounds {', '.join(f'{s:+.1%}' for s in saving)}), tokens per forward "
                   f"{tpf.mean():.3f} x, wall {', '.join(f'{w:+.1%}' for w in wall)}, our CPU "
                   f"{np.mean([o['cpu_s'] for _, o in pairs]):.1f} s against "
                   f"{np.mean([b['cpu_s'] for b, _ in pairs]):.1f} s, every line once: "
                   f"{all(o['once'] and b['once'] for b, o in pairs)}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_file_arguments(p, rounds=2)
    p.add_argument("--ahead", type=int, default=None, help="COHORT_PREFILL_AHEAD of the prefill-ahead server "
                                                           "(default: the scheduler's, 16 per slot)")
    p.add_argument("--probe", action="store_true", help="also today's one-token probe, on a server without prefill ahead")
    p.add_argument("--online", action="store_true", help="closed-loop chat clients through the proxy, not a file")
    p.add_argument("--clients", type=int, default=64, help="with --online: clients, each sends its next prompt when "
                                                           "answered")
    p.add_argument("--plain-vllm", action="store_true", help="vLLM's own scheduler (the plugin loaded): file order "
                                                             "against the probe")
    p.add_argument("--shared", action="store_true", help="pin nothing: vLLM and the runner share every core")
    p.add_argument("--max-in-flight", type=int, default=0, help="every run's --max-in-flight (0: the runner's own)")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    model = ensure_trained_model(Path(args.model_dir))
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    work = Path(tempfile.mkdtemp(prefix="bench-prefill-ahead-"))
    args.prompts = heldout_prompts(args.lines)
    src = batch_file(work / "in.jsonl", args.prompts, args.max_tokens)
    backend_cpus, bench_proxy.PROXY_CPUS = split_cpus()
    if args.shared:
        backend_cpus, bench_proxy.PROXY_CPUS = os.sched_getaffinity(0), None
    os.sched_setaffinity(0, backend_cpus)  # vLLM inherits it; the runner goes to the other core
    print(f"{args.lines} held-out lines, {args.max_tokens} tokens each, max_num_seqs {args.slots}, a fresh "
          f"{'plain ' if args.plain_vllm else ''}vLLM per run on CPUs {sorted(backend_cpus)}, runner on "
          f"{sorted(bench_proxy.PROXY_CPUS or backend_cpus)}; model {model}", flush=True)
    kinds = ["file order", "probe"] if args.plain_vllm else [k for k in RUNS if args.probe or k != "probe"]
    rows = []
    for r in range(args.rounds):
        for name in (kinds if r % 2 == 0 else kinds[::-1]):  # alternate which goes first
            rows.append(one_run(name, model, src, work, args, layers, r))
    for row in rows:
        row.pop("log")
    finish(summary(rows), rows, work, args.json)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

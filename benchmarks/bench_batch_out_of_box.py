"""End to end through vLLM CPU: what a bare `cohort batch run --backend URL` gives a batch file, against file order.

    python -m benchmarks.bench_batch_out_of_box [--model-dir DIR] [--lines 600] [--rounds 4] [--slots 16]
        [--max-tokens 64] [--api] [--shared] [--plain-vllm] [--json FILE]

The served model is the tiny MoE trained on text (`cohort serve`'s embedded default, trained and cached if
--model-dir has none; give a widened copy, `cohort make-tiny-moe --trained DIR --expert-width N`, for wall time
on experts of real size), on vLLM CPU with the moe-cohort plugin and its scheduler (`--scheduler-cls
...ExpertAwareScheduler`, the README's command), eager, max_num_seqs = --slots, pinned to a core of its own; the
runner and the proxy run on the other core (--shared: nothing pinned, vLLM and the runner share every core, as on a
user's first try; --plain-vllm: vLLM's own scheduler, the plugin loaded). The batch file: --lines chat and question prompts that no model here
saw (the held-out sides of $COHORT_DATA/prompts/mixed.jsonl and of the DeepSeek-V2-Lite Puffin chat prompts),
shuffled, --max-tokens each (`ignore_eos`: every order does the same decode work).

Each round, on the same server, one after the other (the engine drifts over minutes; interleaved rounds do not):
- file order: `cohort batch run --encoder none` (nothing predicted or learned: the file's order);
- cold: the bare command with a FRESH --data-dir (no head: a sample first, then the rest ordered);
- warm: the bare command again on the data dir the cold run left (the head it learned orders from the first line).
  Its head has seen every line of this file answered: a re-run, ordered by profiles it memorised. Where the run
  probes each prompt through the engine (the default where vLLM counts experts) it learns only with --learn in
  --flags: warm is then a second run like the cold one;
- with --new-lines N, a second file of N other held-out lines, in file order and then warm on a copy of the data dir
  the cold run left: the head's saving on lines it never saw (what a cold run's head can reach at best).
With --api, then the same file through the Batch API of a bare `cohort serve --backend URL` (the official openai
client: files.create, batches.create, poll, download): file order (`--encoder none`) and cold, per round.

Per run: decode expert loads per GENERATED token and decode tokens per forward (the plugin's counters over the
run), the wall time with start-up (the command's) and without it (from its first request: the runner's summary),
the CPU seconds of our own process (the runner, or the proxy behind the Batch API), and whether every line was
answered exactly once. Savings are taken against the same round's file order.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import bench_proxy
from benchmarks.bench_out_of_box import SCHEDULER, finish
from benchmarks.bench_proxy import split_cpus, start_proxy
from benchmarks.heldout import TRACES, data_path, prompt_texts
from moe_cohort.embedded.backend import default_model_dir, ensure_trained_model
from moe_cohort.send.engine_counters import read_counters
from moe_cohort.traces.split import split_requests

MAX_CHARS = 1500  # longer prompts are cut (the tiny model's context is 1024 tokens)


def heldout_prompts(n: int, seed: int = 0) -> list[str]:
    """`n` prompts no model here saw: the held-out sides of mixed.jsonl and of the Puffin chat prompts, shuffled."""
    lines = (data_path(TRACES) / "prompts.jsonl").read_text(encoding="utf-8").splitlines()
    puffin = [json.loads(line)["text"] for line in lines if line.strip()]
    puffin = [puffin[i] for i in split_requests(len(puffin), groups=puffin)[1]]
    texts = [t[:MAX_CHARS] for t in prompt_texts(heldout=True) + puffin if t.strip()]
    random.Random(seed).shuffle(texts)
    if len(texts) < n:
        raise SystemExit(f"only {len(texts)} held-out prompts; ask for --lines {len(texts)} or fewer")
    return texts[:n]


def batch_file(path: Path, prompts: list[str], max_tokens: int) -> Path:
    path.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                        "body": {"model": "tiny", "messages": [{"role": "user", "content": p}],
                                                 "max_tokens": max_tokens, "ignore_eos": True, "truncate_prompt_tokens": 512}}) + "\n"
                            for i, p in enumerate(prompts)))
    return path


def answered_once(lines: list[str], total: int) -> bool:
    ids = [json.loads(line)["custom_id"] for line in lines if line.strip()]
    return len(ids) == total and len(set(ids)) == total


def measured(name: str, backend: str, layers: int, send) -> dict:
    """`send()` -> (wall without start-up or None, output lines, total lines, its log), with the engine's counters
    read around it."""
    before, start, cpu = read_counters(backend), time.perf_counter(), _children_cpu_s()
    after_start, lines, total, log = send()
    wall, cpu = time.perf_counter() - start, _children_cpu_s() - cpu
    time.sleep(1.5)  # the worker publishes its counters at most once a second
    ran = read_counters(backend) - before
    loads, tokens_per_forward = ran.loads_per_token, ran.tokens_per_forward(layers)
    row = {"run": name, "loads_per_token": loads, "tokens_per_forward": tokens_per_forward, "wall_s": wall,
           "wall_after_start_s": after_start, "cpu_s": cpu, "once": answered_once(lines, total)}
    print(f"{name:>18}: {loads:6.3f} decode loads per generated token, {tokens_per_forward:5.2f} tokens per forward, "
          f"wall {wall:6.1f} s ({after_start or float('nan'):6.1f} s from the first request), our CPU {cpu:5.1f} s, every "
          f"line once: {row['once']}", flush=True)
    row["log"] = log
    return row


def _children_cpu_s() -> float:
    """User + system CPU seconds of the finished child processes so far (the runner, the proxy)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cli_run(src: Path, out: Path, backend: str, flags: list[str]):
    """One `cohort batch run` subprocess on the runner's core."""
    def send():
        cmd = [sys.executable, "-m", "moe_cohort.cli", "batch", "run", "--input", str(src), "--output", str(out),
               "--backend", backend, "--no-progress", *flags]
        proc = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=_pin)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr}")
        found = re.search(r"in ([0-9.]+) s from the first sent", proc.stderr)
        return (float(found.group(1)) if found else None, out.read_text().splitlines(),
                sum(1 for _ in src.open()), proc.stderr)
    return send


def api_run(src: Path, backend: str, flags: list[str], logs: Path, name: str):
    """The file through the Batch API of a fresh `cohort serve --backend URL *flags` (the official client)."""
    def send():
        import openai

        proc, url = start_proxy(backend, *flags, log=logs / f"{name}.log")
        try:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
            started = time.perf_counter()
            upload = client.files.create(file=src.open("rb"), purpose="batch")
            batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")
            while batch.status not in ("completed", "failed", "expired", "cancelled"):
                time.sleep(0.5)
                batch = client.batches.retrieve(batch.id)
            wall = time.perf_counter() - started
            if batch.status != "completed":
                raise RuntimeError(f"batch {batch.id} ended {batch.status}: {batch.errors}")
            lines = client.files.content(batch.output_file_id).text.splitlines()
            return wall, lines, sum(1 for _ in src.open()), (logs / f"{name}.log").read_text()
        finally:
            proc.terminate(), proc.wait(60)
    return send


def _pin() -> None:
    if bench_proxy.PROXY_CPUS:
        os.sched_setaffinity(0, bench_proxy.PROXY_CPUS)


def rounds(backend: str, src: Path, work: Path, args, layers: int) -> list[dict]:
    rows = []
    for r in range(args.rounds):
        cold = work / f"data-r{r}"
        rows.append({**measured(f"file order r{r}", backend, layers,
                                cli_run(src, work / f"file-r{r}.jsonl", backend, ["--encoder", "none"])),
                     "kind": "file", "round": r})
        rows.append({**measured(f"cold r{r}", backend, layers,
                                cli_run(src, work / f"cold-r{r}.jsonl", backend, ["--data-dir", str(cold), *args.flags])),
                     "kind": "cold", "round": r})
        warm = work / f"data-r{r}-warm"
        shutil.copytree(cold, warm) if cold.exists() else warm.mkdir()  # a probing run learns only when asked
        rows.append({**measured(f"warm r{r}", backend, layers,
                                cli_run(src, work / f"warm-r{r}.jsonl", backend,
                                        ["--data-dir", str(warm), *(args.flags if args.warm_flags is None else
                                                                    args.warm_flags)])),
                     "kind": "warm", "round": r})
        if args.new_lines:
            rows.append({**measured(f"new file order r{r}", backend, layers,
                                    cli_run(args.new_src, work / f"new-file-r{r}.jsonl", backend, ["--encoder", "none"])),
                         "kind": "new-file", "round": r})
            new = work / f"data-r{r}-new"
            shutil.copytree(cold, new) if cold.exists() else new.mkdir()
            rows.append({**measured(f"new warm r{r}", backend, layers,
                                    cli_run(args.new_src, work / f"new-warm-r{r}.jsonl", backend,
                                            ["--data-dir", str(new), *(args.flags if args.warm_flags is None else
                                                                       args.warm_flags)])),
                         "kind": "new-warm", "round": r})
        if args.api:
            rows.append({**measured(f"API file order r{r}", backend, layers,
                                    api_run(src, backend, ["--encoder", "none", "--data-dir", str(work / f"api-f{r}")],
                                            work, f"api-file-r{r}")), "kind": "api-file", "round": r})
            rows.append({**measured(f"API cold r{r}", backend, layers,
                                    api_run(src, backend, ["--data-dir", str(work / f"api-c{r}")], work,
                                            f"api-cold-r{r}")), "kind": "api-cold", "round": r})
    return rows


def summary(rows: list[dict]) -> list[str]:
    out = []
    for kind, base in (("cold", "file"), ("warm", "file"), ("new-warm", "new-file"), ("api-cold", "api-file")):
        ours = [r for r in rows if r["kind"] == kind]
        if not ours:
            continue
        by_round = {r["round"]: r for r in rows if r["kind"] == base}
        saving = np.array([1 - r["loads_per_token"] / by_round[r["round"]]["loads_per_token"] for r in ours])
        mean = lambda k, key: float(np.mean([r[key] for r in rows if r["kind"] == k]))  # noqa: E731
        wall = np.array([r["wall_s"] / by_round[r["round"]]["wall_s"] - 1 for r in ours])
        out.append(f"{kind} against {base} order over {len(ours)} rounds: {saving.mean():+.1%} +- {saving.std():.1%} "
                   f"fewer decode loads per generated token (each round: {', '.join(f'{s:+.1%}' for s in saving)}); "
                   f"tokens per forward {mean(kind, 'tokens_per_forward'):.2f} against "
                   f"{mean(base, 'tokens_per_forward'):.2f}; wall with start-up {mean(kind, 'wall_s'):.1f} s against "
                   f"{mean(base, 'wall_s'):.1f} s ({wall.mean():+.1%} +- {wall.std():.1%}); our CPU "
                   f"{mean(kind, 'cpu_s'):.1f} s against {mean(base, 'cpu_s'):.1f} s; every line once: "
                   f"{all(r['once'] for r in rows if r['kind'] in (kind, base))}")
    return out


def add_file_arguments(p: argparse.ArgumentParser, rounds: int) -> None:
    """The arguments every held-out batch benchmark takes: the model, the file's size, rounds, slots, tokens."""
    p.add_argument("--model-dir", default=str(default_model_dir()), help="the trained tiny MoE (trained here if "
                                                                          "missing), or a widened copy of it")
    p.add_argument("--lines", type=int, default=600)
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--slots", type=int, default=16, help="vLLM's max_num_seqs")
    p.add_argument("--max-tokens", type=int, default=64)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_file_arguments(p, rounds=4)
    p.add_argument("--new-lines", type=int, default=0, help="also a second file of this many other held-out lines, "
                   "ordered by the head the cold run learned (its saving on lines it never saw)")
    p.add_argument("--api", action="store_true", help="also through the Batch API of a bare cohort serve")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--shared", action="store_true", help="pin nothing: vLLM and the runs share every core")
    p.add_argument("--plain-vllm", action="store_true", help="vLLM's own scheduler (the plugin still loaded)")
    p.add_argument("--flags", type=str.split, default=[], help="flags for the cold and warm runs, in one string "
                   "(e.g. '--max-in-flight 16'); none: the bare command")
    p.add_argument("--warm-flags", type=str.split, default=None, help="the warm runs' flags instead (e.g. "
                   "'--no-learn': ordered by the head the cold run learned, learning nothing more)")
    args = p.parse_args()
    from moe_cohort.embedded.vllm_server import start

    model = ensure_trained_model(Path(args.model_dir))
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    work = Path(tempfile.mkdtemp(prefix="bench-batch-out-of-box-"))
    prompts = heldout_prompts(args.lines + args.new_lines)
    src = batch_file(work / "in.jsonl", prompts[: args.lines], args.max_tokens)
    args.new_src = batch_file(work / "new.jsonl", prompts[args.lines:], args.max_tokens) if args.new_lines else None
    backend_cpus, bench_proxy.PROXY_CPUS = split_cpus()
    if args.shared:
        backend_cpus, bench_proxy.PROXY_CPUS = os.sched_getaffinity(0), None
    os.sched_setaffinity(0, backend_cpus)  # vLLM inherits it; the runs go to the other core
    print(f"{args.lines} held-out lines, {args.max_tokens} tokens each, max_num_seqs {args.slots}; vLLM with "
          f"{'its own' if args.plain_vllm else 'moe-cohort' + chr(39) + 's'} scheduler on CPUs {sorted(backend_cpus)}, "
          f"runner and proxy on {sorted(bench_proxy.PROXY_CPUS or backend_cpus)}; model {model}", flush=True)
    with start(model, max_num_seqs=args.slots, max_model_len=1024, extra_args=[] if args.plain_vllm else SCHEDULER) as server:
        rows = rounds(server.url, src, work, args, layers)
    first = next(r["log"] for r in rows if r["kind"] == "cold")
    print("the bare command said:\n  " + "\n  ".join(first.strip().splitlines()))
    for r in rows:
        r.pop("log")
    finish(summary(rows), rows, work, args.json)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

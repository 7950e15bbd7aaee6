"""A long batch gets better as it runs: `cohort batch run --learn` against file order (issue 26, item 4).

    python -m benchmarks.bench_batch_learning [--model-dir DIR] [--requests 1200] [--slots 16] [--max-tokens 32]

One vLLM CPU server: the tiny MoE trained on text (`cohort make-tiny-moe --trained`, built and cached if
--model-dir has none), the moe-cohort plugin on, max_num_seqs = --slots. One batch file: --requests chat
requests of $COHORT_DATA/prompts/mixed.jsonl in a seeded order (the file groups its prompts by source,
which would favour file order), `ignore_eos`, --max-tokens each. A learning batch learns from its own
answers: every request is predicted before it is observed, so what it gains is on requests its head
never saw. Runs of `cohort batch run --max-in-flight SLOTS`, a subprocess each, the same file:
- file order: `--encoder none`;
- learning: `--learn` with an empty --data-dir (the default, static, encoder): file order until its first
  head, then admission by the head it keeps learning;
- learning, second batch: `--learn` again on that --data-dir (it starts with the head the first left);
- the first run's head, not learning: the static encoder with the head refitted on what the first run
  kept (bench_learning_e2e.offline_encoder), no --learn. It has seen most of the file, so it is no
  held-out figure: it shows what the head's order does to the engine without learning's CPU beside it.
Printed per quarter of the file (by results written) and for the whole run: decode expert loads per
GENERATED token (the distinct experts of each forward's decode tokens summed over layers and forwards,
over the decode tokens; the plugin's counters), decode tokens per forward (fewer tokens per forward touch
fewer experts by themselves) and the wall time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_learning_e2e import TRAINED, offline_encoder, trained_model
from benchmarks.heldout import prompt_texts
from moe_cohort.send.engine_counters import DecodeCounters, read_counters


def batch_file(path: Path, prompts: list[str], max_tokens: int) -> Path:
    path.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                        "body": {"model": "tiny", "messages": [{"role": "user", "content": p}],
                                                 "max_tokens": max_tokens, "ignore_eos": True,
                                                 "truncate_prompt_tokens": 256}}) + "\n"
                            for i, p in enumerate(prompts)))
    return path


def rates(ran: DecodeCounters, layers: int) -> tuple[float, float]:
    """(decode expert loads per generated token, decode tokens per forward) of what ran; NaN where nothing did."""
    per_token, per_step = ran.loads_per_token, ran.tokens_per_forward(layers)
    return (math.nan if per_token is None else per_token, math.nan if per_step is None else per_step)


def run(name: str, flags: list[str], src: Path, work: Path, backend: str, slots: int, layers: int) -> dict:
    """One `cohort batch run`; its decode counters per quarter of the file and over all of it."""
    out = work / f"{name.replace(' ', '-').replace(',', '')}.jsonl"
    total = sum(1 for _ in src.open())
    marks = [total * k // 4 for k in (1, 2, 3, 4)]
    cmd = [sys.executable, "-m", "moe_cohort.cli", "batch", "run", "--input", str(src), "--output", str(out),
           "--backend", backend, "--max-in-flight", str(slots), "--no-progress", *flags]
    snaps, start = [read_counters(backend)], time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while proc.poll() is None:
        done = sum(1 for _ in out.open()) if out.exists() else 0
        if len(snaps) < 4 and done >= marks[len(snaps) - 1]:
            snaps.append(read_counters(backend))
        time.sleep(0.2)
    wall = time.perf_counter() - start
    err = proc.stderr.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err}")
    time.sleep(1.5)  # the worker publishes its counters at most once a second
    snaps += [read_counters(backend)] * (5 - len(snaps))
    quarters = [rates(b - a, layers) for a, b in zip(snaps, snaps[1:])]
    whole = rates(snaps[-1] - snaps[0], layers)
    learned = next((line for line in err.splitlines() if line.startswith("learned:")), "")
    print(f"{name:>26}: " + "  ".join(f"{q[0]:.3f}/{q[1]:.1f}" for q in quarters)
          + f"  | all {whole[0]:.3f}/{whole[1]:.2f}  wall {wall:5.1f} s  {learned}", flush=True)
    return {"run": name, "quarters": quarters, "loads_per_token": whole[0], "tokens_per_forward": whole[1],
            "wall_s": wall, "learned": learned}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=str(TRAINED), help="the trained tiny MoE (built here if missing)")
    p.add_argument("--requests", type=int, default=1200)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    from moe_cohort.embedded.vllm_server import start

    model, layers = trained_model(args.model_dir)
    prompts = prompt_texts()
    random.Random(0).shuffle(prompts)
    work = Path(tempfile.mkdtemp(prefix="bench-batch-learning-"))
    src = batch_file(work / "in.jsonl", prompts[: args.requests], args.max_tokens)
    print(f"{min(args.requests, len(prompts))} requests (seeded order), {args.slots} at a time, {args.max_tokens} "
          f"tokens each; model {model}\nper quarter of the file: decode expert loads per generated token / decode "
          f"tokens per forward")
    data = work / "data"
    with start(model, max_num_seqs=args.slots, max_model_len=1024) as server:
        rows = [run("file order", ["--encoder", "none"], src, work, server.url, args.slots, layers),
                run("learning", ["--learn", "--data-dir", str(data)], src, work, server.url, args.slots, layers),
                run("learning, second batch", ["--learn", "--data-dir", str(data)], src, work, server.url,
                    args.slots, layers)]
        head = offline_encoder(data / "learned", work / "head")
        rows.append(run("first run's head, no learning", ["--encoder", str(head)], src, work, server.url, args.slots,
                        layers))
    base = rows[0]
    for row in rows[1:]:
        print(f"{row['run']}: {1 - row['loads_per_token'] / base['loads_per_token']:.1%} fewer decode loads per "
              f"generated token than file order (last quarter {1 - row['quarters'][3][0] / base['quarters'][3][0]:.1%}), "
              f"tokens per forward {row['tokens_per_forward']:.2f} vs {base['tokens_per_forward']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

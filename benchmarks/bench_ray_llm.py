"""End to end through Ray Data LLM and vLLM CPU: the plain vLLM processor against ours (batch/ray_llm/processor.py).

    python -m benchmarks.bench_ray_llm [--lines 600] [--rounds 2] [--max-tokens 64] [--slots 16] [--model-dir DIR]
        [--concurrency 1] [--ray-cpus N] [--engine-orders] [--pending N] [--json FILE]

The trained tiny MoE (`cohort serve`'s embedded default; give a widened copy for wall time on experts of real
size), eager, max_num_seqs = --slots, one engine per --concurrency, each on a Ray placement bundle of one CPU, in a
local Ray of this machine's CPUs (--ray-cpus: as many logical CPUs, so that two engines and the stages fit on
fewer cores; the pre- and postprocessing, chat template and tokenizer stages at a quarter of a
CPU each, so that a 2-core machine holds them beside the engine). The rows: --lines chat prompts no model here saw (bench_batch_out_of_box's
held-out mix, cut to MAX_CHARS), shuffled, --max-tokens each (`ignore_eos`), through the chat template and tokenizer stages.

Each round, one after the other (the engine drifts over minutes; interleaved rounds do not):
- plain: `build_processor(vLLMEngineProcessorConfig(...))` with vLLM's own scheduler, the Dataset in its order
  (our plugin loaded, to count);
- cold: `ExpertAware.load` on a FRESH data dir, as shipped: every row's prompt probed by the engine first, the rows
  then ordered and profiled by the probes' counts, nothing learned;
- warm: the same on the data dir the cold run left: a second run (a probing run learns nothing, so it orders as the
  first did; a new engine starts with an empty prefix cache).
With --engine-orders the runs after plain are instead `ExpertAware.load(encoder="none")`: no probes, the rows in
the Dataset's order, our scheduler in the engine routing each row's prompt in its own prefill and admitting it to
decode by that routing (prefill ahead). --pending sets the processor config's `max_pending_requests` (the rows
inside vLLM at once; default: ExpertAware's).
Per run: decode expert loads per GENERATED token and decode tokens per forward, from the plugin's counters (each run
points COHORT_METRICS_DIR at a folder of its own through the runtime env; the engine's worker writes its totals
there, `cohort-<pid>.prom`, and this process sums them once the run is over), the wall time of the whole run
(engine start-up included) and when its first and last answers came out (start-up against answering), the CPU
seconds of this process (ordering, predicting, learning), and whether every row was answered once. Savings are
taken against the same round's plain run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_batch_out_of_box import heldout_prompts
from moe_cohort.batch.ray_llm import PLUGIN, ExpertAware
from moe_cohort.embedded.backend import default_model_dir, ensure_trained_model
from moe_cohort.send.engine_counters import DecodeCounters, parse_counters

STAGE_CPUS = 0.25
MAX_CHARS = 680  # prompts cut to at most about 512 tokens, as the batch benchmark truncates them (Ray Data LLM's
# tokenizer stage does not truncate, and vLLM refuses a prompt over max_model_len)


def counters(folder: Path) -> DecodeCounters:
    """The plugin's decode counters summed over the engines that wrote into `folder`."""
    from prometheus_client import CollectorRegistry, generate_latest

    from moe_cohort.engine.metrics import SnapshotCollector

    registry = CollectorRegistry()
    registry.register(SnapshotCollector(folder))
    return parse_counters(generate_latest(registry).decode())


def ray_cpus(concurrency: int) -> int:
    """This machine's CPUs, or the logical CPUs one run asks for where that is more: an engine's bundle and its
    chat template and tokenizer actors per engine, the pre- and postprocessing tasks. With fewer, Ray Data's
    resource budget holds the preprocessing back behind the engines for good and the run never starts."""
    asks = concurrency * (1 + 2 * STAGE_CPUS) + 2 * STAGE_CPUS
    return max(len(os.sched_getaffinity(0)), math.ceil(asks))


def config(args, model: Path, metrics: Path):
    from ray.data.llm import ChatTemplateStageConfig, TokenizerStageConfig, vLLMEngineProcessorConfig

    light = {"num_cpus": STAGE_CPUS}  # the template and tokenizer stages must leave the engine its CPU
    return vLLMEngineProcessorConfig(
        model_source=str(model), engine_kwargs={"max_num_seqs": args.slots, "enforce_eager": True, "max_model_len": 1024},
        runtime_env={"env_vars": {"VLLM_PLUGINS": PLUGIN, "VLLM_CPU_KVCACHE_SPACE": "1",
                                  "COHORT_METRICS_DIR": str(metrics)}},
        placement_group_config={"bundles": [{"CPU": 1}]}, concurrency=(args.concurrency, args.concurrency),
        batch_size=args.slots, chat_template_stage=ChatTemplateStageConfig(**light),
        **({"max_pending_requests": args.pending} if args.pending else {}),
        tokenize_stage=TokenizerStageConfig(**light), detokenize_stage=False)


def one_run(name: str, rows: list[dict], args, model: Path, layers: int, work: Path, aware: ExpertAware | None) -> dict:
    import ray.data
    from ray.data.llm import build_processor

    metrics = Path(tempfile.mkdtemp(prefix=f"{name}-metrics-", dir=work))
    started, cpu = time.perf_counter(), time.process_time()

    def preprocess(row: dict) -> dict:
        return {"messages": [{"role": "user", "content": row["text"]}],
                "sampling_params": {"max_tokens": args.max_tokens, "ignore_eos": True}}

    def postprocess(row: dict) -> dict:
        return {"id": row["id"], "tokens": row["num_generated_tokens"]}

    ds = ray.data.from_items(rows, override_num_blocks=math.ceil(len(rows) / args.slots))  # as `order` cuts them
    light = {"num_cpus": STAGE_CPUS}
    build = build_processor if aware is None else aware.build_processor  # ours orders ds first
    processor = build(config(args, model, metrics), preprocess=preprocess, postprocess=postprocess,
                      preprocess_map_kwargs=light, postprocess_map_kwargs=light)
    out, first_s = [], None
    for answer in processor(ds).iter_rows():  # as the postprocessing stage hands each batch on
        first_s = first_s or time.perf_counter() - started
        out.append(answer)
    last_s = time.perf_counter() - started
    learned = aware.learn() if aware is not None else 0
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    time.sleep(1.0)  # the engine's last totals, written when it went idle
    ran = counters(metrics)
    ids = sorted(r["id"] for r in out)
    row = {"run": name, "loads_per_token": ran.loads_per_token, "tokens_per_forward": ran.tokens_per_forward(layers),
           "wall_s": wall, "first_answer_s": first_s, "answers_s": last_s - first_s, "cpu_s": cpu,
           "answered_once": ids == list(range(len(rows))),
           "tokens": int(sum(r["tokens"] for r in out)), "learned": learned,
           "probed": aware.probed if aware is not None else 0}
    probed = f", {row['probed']} rows ordered by their probes" if row["probed"] else ""
    print(f"{name:>9}: {row['loads_per_token']:6.3f} decode loads per generated token, {row['tokens_per_forward']:5.2f} "
          f"tokens per forward, wall {wall:6.1f} s (the first answer after {first_s:5.1f} s, the last "
          f"{last_s - first_s:5.1f} s later), our CPU {cpu:5.1f} s, {row['tokens']} tokens, every row once: "
          f"{row['answered_once']}{f', learned from {learned} rows' if learned else ''}"
          f"{probed}", flush=True)
    return row


def _mean(rows, key: str) -> float:
    return float(np.mean([r[key] for r in rows]))


def summary(rows: list[dict]) -> list[str]:
    lines = []
    for kind, base in (("cold", "plain"), ("warm", "plain"), ("engine", "plain")):
        plain = {r["round"]: r for r in rows if r["kind"] == base}
        mine = [r for r in rows if r["kind"] == kind]
        if not mine:
            continue
        saving = np.array([1 - r["loads_per_token"] / plain[r["round"]]["loads_per_token"] for r in mine])
        tpf = [r["tokens_per_forward"] for r in mine]
        wall = [r["wall_s"] / plain[r["round"]]["wall_s"] - 1 for r in mine]
        lines.append(f"{kind}: {saving.mean():+.1%} +- {saving.std():.1%} ({', '.join(f'{s:+.1%}' for s in saving)}) "
                     f"fewer decode loads per generated token than plain; tokens per forward {np.mean(tpf):.2f} against "
                     f"{np.mean([r['tokens_per_forward'] for r in plain.values()]):.2f}; wall "
                     f"{', '.join(f'{w:+.1%}' for w in wall)} (first answer after "
                     f"{_mean(mine, 'first_answer_s'):.1f} s against {_mean(plain.values(), 'first_answer_s'):.1f} s, "
                     f"answering {_mean(mine, 'answers_s'):.1f} s against {_mean(plain.values(), 'answers_s'):.1f} s); "
                     f"our CPU {np.mean([r['cpu_s'] for r in mine]):.1f} s "
                     f"against {np.mean([r['cpu_s'] for r in plain.values()]):.1f} s; every row once: "
                     f"{all(r['answered_once'] for r in rows)}")
    return lines


def _shuffled(texts: list[str]) -> list[str]:
    texts = list(texts)
    random.Random(0).shuffle(texts)
    return texts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lines", type=int, default=600)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--slots", type=int, default=16, help="vLLM's max_num_seqs")
    p.add_argument("--concurrency", type=int, default=1, help="engines (Ray Data LLM's concurrency)")
    p.add_argument("--ray-cpus", type=int, help="logical CPUs of the local Ray (default: this machine's, or what the "
                   "engines and stages ask for where that is more: ray_cpus)")
    p.add_argument("--model-dir", default=str(default_model_dir()))
    p.add_argument("--engine-orders", action="store_true", help="no probes: the Dataset's order, our scheduler "
                                                                "admitting each row by its own prefill's routing")
    p.add_argument("--pending", type=int, default=0, help="max_pending_requests (0: ExpertAware's)")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    import ray

    model = ensure_trained_model(Path(args.model_dir))
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    prompts = [t[:MAX_CHARS] for t in heldout_prompts(args.lines)]
    rows = [{"id": i, "text": t} for i, t in enumerate(_shuffled(prompts))]
    work = Path(tempfile.mkdtemp(prefix="bench-ray-llm-"))
    print(f"{len(rows)} held-out chat rows, {args.max_tokens} tokens each, max_num_seqs {args.slots}, "
          f"{args.concurrency} engine(s); model {model}; work {work}", flush=True)
    ray.init(num_cpus=args.ray_cpus or ray_cpus(args.concurrency), include_dashboard=False, log_to_driver=False)
    out = []
    try:
        for r in range(args.rounds):
            data = work / f"data-r{r}"
            out.append({**one_run(f"plain r{r}", rows, args, model, layers, work, None), "kind": "plain", "round": r})
            if args.engine_orders:
                engine = ExpertAware.load(data_dir=str(data), encoder="none", max_num_seqs=args.slots)
                out.append({**one_run(f"engine r{r}", rows, args, model, layers, work, engine), "kind": "engine",
                            "round": r})
                continue
            cold = ExpertAware.load(data_dir=str(data), max_num_seqs=args.slots)
            out.append({**one_run(f"cold r{r}", rows, args, model, layers, work, cold), "kind": "cold", "round": r})
            warm = ExpertAware.load(data_dir=str(data), max_num_seqs=args.slots)
            out.append({**one_run(f"warm r{r}", rows, args, model, layers, work, warm), "kind": "warm", "round": r})
    finally:
        ray.shutdown()
    print("\n".join(summary(out)))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

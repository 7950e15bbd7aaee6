"""Benchmark: an offline Batch file through the tiny MoE on vLLM CPU, in arrival order versus admission.

    python -m benchmarks.bench_batch [--backend URL] [--model-dir DIR] [--prompts 1643] [--batch-size 16] [--max-tokens 16]

$COHORT_DATA/prompts/mixed.jsonl becomes an OpenAI Batch file of /v1/completions lines (`max_tokens`
short, `ignore_eos`, so every order does the same decode work; prompts that do not fit the model's
context are left out). Three orders of the same file, against one backend, in one process:

    shuffled   the file shuffled (seed 0): a random arrival order
    file       the file's own order; mixed.jsonl is sorted by source (GSM8K, HumanEval, MT-Bench,
               Vicuna), so this is already a category-ordered baseline
    admission  the file's order, each freed slot going to the request that best fits those out
               (`cohort batch run`'s default: the --encoder's profile head, else nearest embedding)

Two ways of sending, each reading the plugin's counters on the backend's /metrics before and after:

1. `cohort batch run` (batch.run.run_batch): one request per line, B = concurrency = the
   backend's max_num_seqs, a freed slot goes to the order's next request. Wall time, and distinct
   experts per MoE layer per pure decode step. On a small, busy CPU host the engine is often starved
   (the API server cannot feed a model this fast), so the number of requests that share a decode step
   varies from run to run; it is printed as "tok/step" and must be read next to the expert counts.
2. lockstep: the order cut into groups of B (admission: the order its dry run writes), each group one
   /v1/completions request with B prompts, the next sent when it finishes, so every decode step holds
   exactly the group (Doubleword's setting). Distinct experts per decode step then compare the orders alone.

3. positive control (lockstep): B distinct prompts, each repeated B times, shuffled. Identical prompts
   decode identical tokens (temperature 0), so their routing does track the text; a plan that puts the
   copies together must show far fewer experts per decode step. This checks that admission, the
   dispatch and the counters can show a saving when the model's routing depends on the prompt.

Without --backend a tiny-MoE vLLM CPU server is started (and stopped) here, with prefix caching off
(a later run must not get cheaper prefills from an earlier one). The counters are server-wide: use a
backend nothing else is using.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from pathlib import Path

from benchmarks.heldout import prompt_texts
from moe_cohort.batch.core import RunConfig
from moe_cohort.batch.format import read_batch_file
from moe_cohort.batch.journal import Journal, JournalPaths
from moe_cohort.batch.order import admission_plan
from moe_cohort.batch.run import run_batch
from moe_cohort.encoder.plans import chunk
from moe_cohort.send.backend_client import BackendClient
from moe_cohort.send.engine_counters import DecodeCounters, parse_counters
from moe_cohort.send.profiles import Predictor, make_predictor
from moe_cohort.send.settings import Settings



def shuffled(texts: list[str]) -> list[str]:
    out = list(texts)
    random.Random(0).shuffle(out)
    return out


def cached(predictor: Predictor) -> Predictor:
    """The predictor with its answers kept per text, so no measured run pays for the encoder again."""
    memo: dict[str, object] = {}

    def predict(texts):
        missing = [t for t in dict.fromkeys(texts) if t not in memo]
        memo.update(zip(missing, predictor.predict(missing)) if missing else ())
        return [memo[t] for t in texts]
    return Predictor(predict, predictor.resident_factory, predictor.kind)


async def fitting_prompts(backend: BackendClient, texts: list[str], max_tokens: int) -> list[str]:
    """The prompts whose tokens + max_tokens fit the served model's context (vLLM's /tokenize)."""
    card = json.loads((await backend.request("GET", "/v1/models")).content)["data"][0]
    limit = card.get("max_model_len") or 1 << 30
    counts = await asyncio.gather(*(backend.request("POST", "/tokenize", json={"model": card["id"], "prompt": t})
                                    for t in texts))
    return [t for t, c in zip(texts, counts) if json.loads(c.content)["count"] + max_tokens <= limit]


def write_batch_file(path: Path, texts: list[str], max_tokens: int) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            body = {"model": "tiny", "prompt": text, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
            f.write(json.dumps({"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")


async def counters(backend: BackendClient) -> DecodeCounters:
    """The plugin's decode counters on the backend now (send/engine_counters.py)."""
    return parse_counters((await backend.request("GET", "/metrics")).text)


def delta(after: DecodeCounters, before: DecodeCounters, layers: int) -> dict:
    """What ran between two readings, and its decode tokens per forward (0 when none)."""
    d = after - before
    return {"decode": d, "tok_per_step": d.tokens_per_forward(layers) or 0.0}


async def run_runner(name: str, batch_file: Path, predictor, backend: BackendClient, args, workdir: Path) -> dict:
    """`cohort batch run`'s code path: run_batch() with a fresh journal."""
    parsed = read_batch_file(batch_file, default_policy="topk", max_line_bytes=10 << 20)
    journal = Journal.open(JournalPaths.for_output(workdir / f"{name}.out.jsonl"), parsed.journal_meta)
    config = RunConfig.from_settings(args.settings, metrics_interval_s=0)
    before = await counters(backend)
    start = time.perf_counter()
    try:
        stats = await run_batch(parsed, journal, [backend], predictor, config)
    finally:
        journal.close()
    wall = time.perf_counter() - start
    return {"name": name, "wall": wall, "ok": stats.succeeded, "failed": stats.failed,
            **delta(await counters(backend), before, args.layers)}


async def run_lockstep(name: str, batch_file: Path, predictor, backend: BackendClient, args) -> dict:
    """The order in groups of B, each one multi-prompt /v1/completions request, one group at a time."""
    parsed = read_batch_file(batch_file, default_policy="topk", max_line_bytes=10 << 20)
    sent, _ = admission_plan(parsed.requests, predictor, args.batch_size)
    batches = [[sent[i] for i in group] for group in chunk(range(len(sent)), args.batch_size)]
    before = await counters(backend)
    start = time.perf_counter()
    for batch in batches:
        body = {**batch[0].body, "prompt": [r.body["prompt"] for r in batch]}
        await backend.request("POST", "/v1/completions", json=body)
    wall = time.perf_counter() - start
    return {"name": name, "wall": wall, "ok": len(parsed.requests), "failed": 0,
            **delta(await counters(backend), before, args.layers)}


async def warm_up(backend: BackendClient, texts: list[str], max_tokens: int) -> None:
    """One batch first, so that no measured run pays for the server's first steps."""
    await backend.request("POST", "/v1/completions", json={"model": "tiny", "prompt": texts, "max_tokens": max_tokens})


def report(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"{'order':>9} {'wall s':>7} {'ok':>5} {'fail':>4} {'tok/step':>8} {'experts/layer/decode step':>25} "
          f"{'decode loads':>12} {'layer-steps':>11}")
    for r in rows:
        d = r["decode"]
        print(f"{r['name']:>9} {r['wall']:>7.1f} {r['ok']:>5} {r['failed']:>4} {r['tok_per_step']:>8.1f} "
              f"{d.experts_per_layer_step or 0:>25.2f} {d.batch_after:>12,.0f} {d.batch_layer_steps:>11,.0f}")
    planned = rows[-1]
    for base in rows[:-1]:
        p, b = planned["decode"], base["decode"]
        pe, be = p.experts_per_layer_step, b.experts_per_layer_step
        if pe and be:
            print(f"{planned['name']} vs {base['name']}: {1 - pe / be:.1%} fewer distinct experts per "
                  f"decode step ({pe:.2f} vs {be:.2f}, at {planned['tok_per_step']:.1f} vs "
                  f"{base['tok_per_step']:.1f} tok/step), {1 - p.batch_after / b.batch_after:.1%} fewer decode expert "
                  f"loads ({p.batch_after:,.0f} vs {b.batch_after:,.0f}); wall {planned['wall']:.1f} s vs "
                  f"{base['wall']:.1f} s")


async def bench(args, backend_url: str) -> None:
    # the process's one Settings: concurrency = --batch-size = the backend's max_num_seqs; the admission encoder
    args.settings = Settings(backends=(backend_url,), batch_max_in_flight=args.batch_size, encoder=args.encoder or "")
    backend = BackendClient.from_settings(args.settings)
    texts = prompt_texts(args.heldout)[: args.prompts]
    fitting = await fitting_prompts(backend, texts, args.max_tokens)
    t = time.perf_counter()
    predictor = make_predictor(args.settings)
    if predictor is None:
        raise SystemExit("bench_batch: --encoder none leaves admission nothing to predict with; give an encoder")
    predictor = cached(predictor)
    print(f"{len(fitting)} of {len(texts)} prompts of mixed.jsonl (the rest do not fit the context), "
          f"{args.max_tokens} tokens each (ignore_eos), B = concurrency = {args.batch_size}, backend {backend_url}, "
          f"{os.cpu_count()} CPUs; encoder loaded in {time.perf_counter() - t:.1f} s, admission by {predictor.kind}")
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
        batch_file, shuffled_file = Path(tmp) / "requests.jsonl", Path(tmp) / "shuffled.jsonl"
        write_batch_file(batch_file, fitting, args.max_tokens)
        write_batch_file(shuffled_file, shuffled(fitting), args.max_tokens)
        await warm_up(backend, fitting[: args.batch_size], args.max_tokens)
        t = time.perf_counter()
        predictor.predict(fitting)
        print(f"predicting {len(fitting)} prompts: {time.perf_counter() - t:.1f} s (once; not in the walls)")
        orders = [("shuffled", shuffled_file, None), ("file", batch_file, None), ("admission", batch_file, predictor)]
        runner = [await run_runner(name, f, p, backend, args, Path(tmp)) for name, f, p in orders]
        lockstep = [await run_lockstep(name, f, p, backend, args) for name, f, p in orders]
        control_file = Path(tmp) / "control.jsonl"
        copies = [fitting[i * len(fitting) // args.batch_size] for i in range(args.batch_size)] * args.batch_size
        write_batch_file(control_file, shuffled(copies), args.max_tokens)
        control = [await run_lockstep(name, control_file, p, backend, args) for name, p in
                   (("shuffled", None), ("admission", predictor))]
    await backend.close()
    report("1. `cohort batch run` (one request per line, sliding window of B)", runner)
    report("2. lockstep (one multi-prompt request per planned batch: every decode step holds one whole batch)", lockstep)
    report(f"3. positive control, lockstep: {args.batch_size} prompts x {args.batch_size} copies, shuffled file", control)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", help="vLLM URL with the moe-cohort plugin (default: start a tiny-MoE vLLM CPU server)")
    parser.add_argument("--prompts", type=int, default=1643, help="first N prompts of mixed.jsonl")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4, help="MoE layers of the served model (the tiny MoE: 4)")
    parser.add_argument("--encoder", default=None, help="encoder for admission (a `cohort train` folder brings its "
                        "profile head; default: the packaged MiniLM, nearest embedding)")
    parser.add_argument("--model-dir", default=None, help="the MoE to serve when no --backend (default: the random tiny MoE)")
    parser.add_argument("--heldout", action="store_true", help="only the held-out prompts of mixed.jsonl (traces.split): "
                        "what no encoder, profile head or trained MoE saw")
    args = parser.parse_args()
    server = None
    if not args.backend:
        from moe_cohort.embedded.backend import ensure_tiny_model
        from moe_cohort.embedded.vllm_server import start

        server = start(ensure_tiny_model(args.model_dir), max_num_seqs=args.batch_size,
                       extra_args=["--no-enable-prefix-caching"])
    try:
        asyncio.run(bench(args, args.backend or server.url))
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()

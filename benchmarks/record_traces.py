"""Record expert traces of a served MoE through the moe-cohort vLLM plugin (prefill and real decode).

    python -m benchmarks.record_traces --model MODEL_DIR --out TRACE_DIR [--prompts mixed.jsonl]
        [--limit N] [--max-num-seqs 16] [--mean-tokens 64 | --max-tokens N] [--seed 0]

Starts a vLLM CPU server on MODEL_DIR with COHORT_RECORD_TRACES=1, sends every prompt of the
prompt set (file order) as a chat completion (sampled, temperature 0.8, seed per request; output
length drawn from a lognormal of mean --mean-tokens, 8..256; or with --max-tokens N the requests
bench_learning_e2e sends: N tokens each, `ignore_eos`, the server's default sampling, the prompt cut
to its last 256 tokens), stops the server, and rewrites each
recorded file as TRACE_DIR/<prompt id>.npz with the prompt's own text, its id as request id, its
category, and `extra["split"]` ("train" or "heldout" under traces.split, as the trained tiny MoE
was trained). With every prompt recorded, file-name order is the prompt set's order, so
`cohort eval --traces TRACE_DIR --heldout-only` holds out exactly the prompts the model never saw.
Prints the recording time and the per-layer category/expert mutual information of the traces.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks.heldout import PROMPTS, data_path
from benchmarks.routing_mi import category_mi, chat_prompt
from moe_cohort.devtools.corpus import read_prompts, split_prompts
from moe_cohort.embedded.vllm_server import start
from moe_cohort.traces.format import TraceSet, load_trace_file, save_traces
from moe_cohort.traces.importers import load_traces

log = logging.getLogger("record_traces")


def output_lengths(n: int, mean: float, seed: int) -> np.ndarray:
    """[n] max_tokens per request: lognormal (sigma 0.6) with the given mean, clipped to 8..256."""
    sigma = 0.6
    raw = np.random.default_rng(seed).lognormal(np.log(mean) - sigma**2 / 2, sigma, n)
    return np.clip(np.round(raw), 8, 256).astype(int)


def send(url: str, text: str, max_tokens: int, seed: int | None) -> None:
    """One chat completion: sampled at temperature 0.8 with `seed`, or (seed None) as bench_learning_e2e sends it."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": int(max_tokens)}
    if seed is None:
        body |= {"ignore_eos": True, "truncate_prompt_tokens": 256}
    else:
        body |= {"temperature": 0.8, "seed": seed, "min_tokens": min(8, int(max_tokens))}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        resp.read()


def relabel(raw_dir: Path, out_dir: Path, rows: list[dict], side: dict[str, str]) -> int:
    """Rewrite raw plugin files as <prompt id>.npz carrying text, id, category and split."""
    by_prompt = {chat_prompt(r["text"]): r for r in rows}  # the decoded prompt, special tokens kept or not
    by_prompt |= {f"user\n{r['text']}\nassistant\n": r for r in rows}
    written = 0
    for path in sorted(raw_dir.glob("*.npz")):
        ts = load_trace_file(path)
        row = _match(by_prompt, str(ts.texts[0])) if ts.texts is not None else None
        if row is None:
            log.warning("%s: prompt text not in the prompt set; skipped", path.name)
            continue
        fixed = TraceSet(num_experts=ts.num_experts, num_layers=ts.num_layers, top_k=ts.top_k,
                         token_offsets=ts.token_offsets, experts=ts.experts, weights=ts.weights,
                         num_prompt_tokens=ts.num_prompt_tokens, request_ids=np.array([row["id"]]),
                         texts=np.array([row["text"]]), categories=np.array([row["category"]]), model=ts.model,
                         extra={**ts.extra, "split": side[row["id"]], "engine_request_id": str(ts.request_ids[0])})
        save_traces(out_dir / f"{row['id']}.npz", fixed)
        written += 1
    return written


def _match(by_prompt: dict[str, dict], text: str) -> dict | None:
    """The prompt row of a recorded prompt text: whole, or (a prompt cut to its last tokens) by its ending."""
    if text in by_prompt:
        return by_prompt[text]
    tail = text[-200:]
    return next((row for prompt, row in by_prompt.items() if len(tail) >= 50 and prompt.endswith(tail)), None)


def record(args: argparse.Namespace) -> Path:
    prompts = args.prompts or data_path(PROMPTS)
    rows = read_prompts(prompts)[: args.limit or None]
    train, held = split_prompts(read_prompts(prompts))
    side = {r["id"]: "train" for r in train} | {r["id"]: "heldout" for r in held}
    out, raw = Path(args.out), Path(args.out) / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    lengths = output_lengths(len(rows), args.mean_tokens, args.seed) if args.max_tokens is None else \
        np.full(len(rows), args.max_tokens)
    seed = lambda i: None if args.max_tokens is not None else args.seed + i  # noqa: E731
    env = {"COHORT_RECORD_TRACES": "1", "COHORT_TRACE_DIR": str(raw)}
    t0 = time.perf_counter()
    with start(args.model, extra_env=env, max_num_seqs=args.max_num_seqs, max_model_len=1024,
               extra_args=["--no-enable-prefix-caching"], log_path=out / "vllm.log", timeout=600) as server:
        with ThreadPoolExecutor(args.max_num_seqs) as pool:
            list(pool.map(lambda i: send(server.url, rows[i]["text"], lengths[i], seed(i)), range(len(rows))))
        time.sleep(2.0)  # the recorder writes a request one engine step after it finishes
    seconds = time.perf_counter() - t0
    written = relabel(raw, out, rows, side)
    if written == len(list(raw.glob("*.npz"))):
        shutil.rmtree(raw)
    print(f"recorded {written} of {len(rows)} requests in {seconds:.0f}s -> {out}")
    return out


def report(out: Path) -> None:
    ts = load_traces(out)
    print(f"{len(ts)} requests, {int(ts.num_prompt_tokens.sum())} prompt + {int(ts.num_decode_tokens.sum())} "
          f"decode tokens, {ts.num_layers} layers, {ts.num_experts} experts, top-{ts.top_k}")
    for phase in ("prefill", "decode"):
        choices = []
        for i in range(len(ts)):
            ids = ts.request_experts(i)  # [n_i, L, k]
            n_p = int(ts.num_prompt_tokens[i])
            choices.append(ids[:n_p] if phase == "prefill" else ids[n_p:])
        keep = [i for i, c in enumerate(choices) if len(c)]
        mi = category_mi([choices[i] for i in keep], [str(ts.categories[i]) for i in keep], ts.num_experts)
        print(f"MI(category; expert) bits, {phase}: " + " ".join(f"{x:.3f}" for x in mi))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model folder (e.g. cohort make-tiny-moe --trained)")
    parser.add_argument("--out", required=True, help="trace folder to write (outside git)")
    parser.add_argument("--prompts", help=f"prompt set, JSON lines with \"text\" (default: $COHORT_DATA/{PROMPTS})")
    parser.add_argument("--limit", type=int, default=0, help="first N prompts only (0: all)")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--mean-tokens", type=float, default=64)
    parser.add_argument("--max-tokens", type=int, help="N tokens per request, as bench_learning_e2e sends them")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    report(record(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

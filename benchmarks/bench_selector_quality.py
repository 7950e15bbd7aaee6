"""What pruning costs in quality: held-out next-token cross-entropy under each expert selector.

    python -m benchmarks.bench_selector_quality --model TRAINED_DIR [--batch-size 16] [--batches 4]
        [--seq-len 128] [--out DIR]

Held-out text of the trained tiny MoE (devtools.corpus: package code and prose, mixed.jsonl
prompts as ChatML turns; the side it never trained on) is cut into windows of --seq-len tokens,
and random batches of --batch-size windows (kinds mixed, seed 0) are scored with a transformers
forward in which every router's top-k is replaced by a selector of engine.selection. Position t
of the B windows is one decode step of B requests (each its own request span), the setting of
the OEA paper's perplexity measure: the selector sees the step's B tokens together. Reported per
policy: cross-entropy (nats/token) and perplexity, and distinct experts per layer per step
(what a decode step loads), against plain top-k. Writes quality.json, quality.md and
quality.png to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

from benchmarks.heldout import PROMPTS, data_location
from benchmarks.routing_mi import chat_prompt
from moe_cohort.engine.selection import select_experts
from moe_cohort.devtools.corpus import CorpusArgs, build_corpus

POLICIES = ["topk", "xshare;m=16", "xshare;m=24", "xshare;m=32", "oea;k0=1", "oea;k0=2", "oea;k0=3",
            "lynx-lat;drop=4", "lynx-lat;drop=8", "lynx-lat;drop=16", "moe-spec;budget=16", "moe-spec;budget=24",
            "moe-spec;budget=32"]


def heldout_windows(tokenizer, seq_len: int, per_kind: int, seed: int = 0) -> list[list[int]]:
    """Up to `per_kind` windows of `seq_len` held-out tokens per kind, kinds interleaved, shuffled."""
    corpus = build_corpus(CorpusArgs(prompts_path=str(data_location() / PROMPTS)))
    streams: dict[str, list[int]] = {}
    for d in corpus.heldout:
        text = d.text + "<|endoftext|>" if d.category in ("stdlib", "pydoc") else chat_prompt(d.text) + "<|im_end|>\n"
        streams.setdefault(d.kind, []).extend(tokenizer(text).input_ids)
    windows = [s[i:i + seq_len] for s in streams.values() for i in range(0, len(s) - seq_len + 1, seq_len)[:per_kind]]
    random.Random(seed).shuffle(windows)
    return windows


class PolicyRouter:
    """Replaces the routers' top-k: [B * S, E] logits -> each position's B tokens through `policy`."""

    def __init__(self, policy: str, batch_size: int):
        self.policy, self.batch_size, self.distinct = policy, batch_size, []

    def __call__(self, router, hidden_states):
        import torch

        logits = torch.nn.functional.linear(hidden_states.reshape(-1, router.hidden_dim), router.weight)  # [B*S, E]
        b = self.batch_size
        steps = logits.reshape(b, -1, logits.shape[-1]).transpose(0, 1)  # [S, B, E]
        spans = [(i, i + 1) for i in range(b)]
        weights, ids = zip(*(select_experts(step, router.top_k, self.policy, request_spans=spans) for step in steps))
        ids = torch.stack(ids)  # [S, B, k]
        self.distinct += [len(torch.unique(step)) for step in ids]
        flat = lambda x: x.transpose(0, 1).reshape(-1, router.top_k)  # noqa: E731  [S, B, k] -> [B*S, k]
        return logits, flat(torch.stack(weights)).to(logits.dtype), flat(ids)


def evaluate(model, windows, policy: str, batch_size: int) -> dict:
    import torch
    from transformers.models.qwen3_moe import modeling_qwen3_moe as qm

    router = PolicyRouter(policy, batch_size)
    original = qm.Qwen3MoeTopKRouter.forward
    qm.Qwen3MoeTopKRouter.forward = lambda self, h: router(self, h)
    losses = []
    try:
        with torch.no_grad():
            for i in range(0, len(windows) - batch_size + 1, batch_size):
                batch = torch.tensor(windows[i:i + batch_size])  # [B, S]
                losses.append(float(model(input_ids=batch, labels=batch).loss))
    finally:
        qm.Qwen3MoeTopKRouter.forward = original
    ce = sum(losses) / len(losses)
    return {"policy": policy, "cross_entropy": ce, "perplexity": math.exp(ce),
            "distinct_per_layer_step": sum(router.distinct) / len(router.distinct)}


def write_report(rows: list[dict], out: Path, batch_size: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "quality.json").write_text(json.dumps(rows, indent=2) + "\n")
    base = rows[0]
    lines = ["| policy | cross-entropy | perplexity | distinct experts / layer / step | saved vs topk |",
             "|---|---|---|---|---|"]
    for r in rows:
        saved = 1 - r["distinct_per_layer_step"] / base["distinct_per_layer_step"]
        lines.append(f"| {r['policy']} | {r['cross_entropy']:.4f} | {r['perplexity']:.2f} | "
                     f"{r['distinct_per_layer_step']:.2f} | {saved:.1%} |")
    (out / "quality.md").write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for family in dict.fromkeys(r["policy"].split(";")[0] for r in rows):
        pts = [r for r in rows if r["policy"].split(";")[0] == family]
        ax.plot([p["distinct_per_layer_step"] for p in pts], [p["perplexity"] for p in pts], "o-", label=family)
        for p in pts:
            ax.annotate(p["policy"].partition(";")[2], (p["distinct_per_layer_step"], p["perplexity"]), fontsize=7)
    ax.set_xlabel(f"distinct experts per layer per decode step (B = {batch_size})")
    ax.set_ylabel("held-out perplexity")
    ax.set_title("trained tiny MoE: quality vs experts loaded")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "quality.png", dpi=120)
    print("\n".join(lines))


def main(argv=None) -> int:
    import torch
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="trained model folder (cohort make-tiny-moe --trained)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", default="reports/selector-quality")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    windows = heldout_windows(tok, args.seq_len, per_kind=args.batches * args.batch_size)[: args.batches * args.batch_size]
    print(f"{len(windows)} held-out windows of {args.seq_len} tokens, batches of {args.batch_size}")
    rows = [evaluate(model, windows, p, args.batch_size) for p in POLICIES]
    write_report(rows, Path(args.out), args.batch_size)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

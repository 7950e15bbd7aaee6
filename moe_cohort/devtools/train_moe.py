"""Train a small Qwen3-MoE language model whose routing follows the text (code, math, chat, prose).

The random tiny MoE (`devtools.tiny_moe`) routes by token identity only and, with 16 experts top-4,
touches nearly every expert in any batch. This recipe trains a model with many experts (64, top-4
by default) on the corpus of `devtools.corpus` (training side of the project's held-out split
only), with the usual next-token loss, the Switch-Transformer load-balancing loss (Fedus et al.
2021, as transformers' Qwen3-MoE computes it) and a sequence-expert mutual-information term
(`routing_mi_loss`), so that experts specialise by text and all stay in use. A short CPU training
does not reach the domain specialisation large MoEs show; the MI term stands in.

    out = train_tiny_moe("/tmp/tiny-trained", RECIPES["full"])   # cached: the second call copies

Deterministic under `TrainArgs.seed` on one machine (fixed thread count, seeded batches). The
result is cached in `cache_dir/<recipe hash>/` (hash of the arguments, the corpus texts and the
library versions) and copied to `out_dir`; `cohort_tiny_moe.json` records the training figures
(time, peak memory, losses, size on disk).

Cost: "full" trains 819,200 tokens (400 steps of 16 x 128), "ci" a small fraction of that; how long
they take on a CPU host (far longer when its cores are shared) is measured in docs/results.md
("The trained tiny MoE"), and every run records its own figures in `cohort_tiny_moe.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import resource
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from moe_cohort.devtools.corpus import KINDS, Corpus, CorpusArgs, Doc, build_corpus
from moe_cohort.devtools.tiny_moe import TinyMoeArgs, build_config, build_tokenizer, write_model_dir

log = logging.getLogger(__name__)

RECIPE_VERSION = 1
USER, ASSISTANT, END, EOT = "<|im_start|>user\n", "<|im_start|>assistant\n", "<|im_end|>\n", "<|endoftext|>"


@dataclass(frozen=True)
class TrainArgs:
    """The whole recipe: model shape, corpus, optimisation. `RECIPES` holds the two we ship."""

    model: TinyMoeArgs = TinyMoeArgs(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, num_experts=64,
                                     top_k=4, moe_intermediate_size=64, vocab_size=2048, router_scale=1.0)
    corpus: CorpusArgs = CorpusArgs()
    steps: int = 400
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 30
    aux_loss_coef: float = 0.01
    mi_coef: float = 0.5  # weight of the sequence-expert mutual information term (routing_mi_loss)
    threads: int = 2
    seed: int = 0
    log_every: int = 50


RECIPES = {
    "full": TrainArgs(),
    "ci": TrainArgs(model=TinyMoeArgs(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, num_experts=32,
                                      top_k=4, moe_intermediate_size=32, vocab_size=1024, router_scale=1.0),
                    corpus=CorpusArgs(max_code_files=60), steps=120, batch_size=8, seq_len=96, lr=5e-3,
                    warmup=10, mi_coef=1.0, log_every=20),
}


@dataclass
class TrainStats:
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # user + system CPU time of the process (wall time depends on other load)
    peak_rss_mb: float = 0.0
    tokens: int = 0
    losses: list[float] = field(default_factory=list)  # mean LM loss of each log_every window


def default_cache_dir() -> Path:
    """$COHORT_CACHE_DIR, else ~/.cache/moe-cohort: outside any git checkout."""
    return Path(os.environ.get("COHORT_CACHE_DIR", Path.home() / ".cache" / "moe-cohort")) / "trained-tiny-moe"


def recipe_key(args: TrainArgs, corpus: Corpus) -> str:
    """sha256 of the arguments, the corpus texts, the recipe version and the library versions."""
    import torch
    import transformers

    blob = json.dumps([dataclasses.asdict(args), corpus.digest(), RECIPE_VERSION, torch.__version__,
                       transformers.__version__], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def train_tiny_moe(out_dir: str | Path, args: TrainArgs = RECIPES["full"], cache_dir: str | Path | None = None,
                   use_cache: bool = True) -> Path:
    """Write the trained model to `out_dir` (a model folder vLLM and transformers load) and return it.

    With `use_cache`, a model already trained under the same recipe key in `cache_dir` is copied
    instead of trained again; a new one is trained into the cache first, then copied.
    """
    out = Path(out_dir)
    corpus = build_corpus(args.corpus)
    if not use_cache:
        return _train_into(out, args, corpus)
    cached = Path(cache_dir or default_cache_dir()) / recipe_key(args, corpus)
    if (cached / "config.json").exists():
        log.info("using the cached trained model %s", cached)
    else:
        _train_into(cached, args, corpus)
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(cached.iterdir(), key=lambda p: p.name == "config.json"):
        shutil.copy2(path, out / path.name)
    return out


def _train_into(out: Path, args: TrainArgs, corpus: Corpus) -> Path:
    import torch

    torch.set_num_threads(args.threads)
    texts = training_texts(corpus.train)
    tokenizer = build_tokenizer(args.model.vocab_size, [t for kind in sorted(texts) for t in texts[kind]])
    model = init_model(args, tokenizer)
    streams = {k: torch.tensor(ids, dtype=torch.long) for k, ids in token_streams(texts, tokenizer).items()}
    stats = train_loop(model, streams, args)
    model.config.output_router_logits = False
    model = model.to(torch.bfloat16).eval()
    summary = {**dataclasses.asdict(args.model), "vocab_size": len(tokenizer), "trained": True,
               "num_parameters": sum(p.numel() for p in model.parameters()),
               "recipe": dataclasses.asdict(args), "corpus_digest": corpus.digest(),
               "train_docs": {k: sum(d.kind == k for d in corpus.train) for k in KINDS},
               "train_seconds": round(stats.seconds, 1),
               "train_cpu_seconds": round(stats.cpu_seconds, 1), "peak_rss_mb": round(stats.peak_rss_mb, 1),
               "train_tokens": stats.tokens, "lm_losses": [round(x, 4) for x in stats.losses]}
    write_model_dir(out, model, tokenizer, summary)
    size = sum(p.stat().st_size for p in out.iterdir())
    summary["size_on_disk_bytes"] = size
    (out / "cohort_tiny_moe.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    log.info("trained %s in %.0fs (peak RSS %.0f MB, %.1f MB on disk) -> %s",
             args.model.arch, stats.seconds, stats.peak_rss_mb, size / 2**20, out)
    return out


def training_texts(docs: list[Doc]) -> dict[str, list[str]]:
    """Per kind, the formatted training texts. Package text is a plain document ending in
    <|endoftext|>; a prompt becomes a ChatML user turn whose assistant reply is the next training
    text of the same kind (code -> code, math -> math, chat -> prose), so that the model keeps
    to the prompt's kind when it generates."""
    by_kind = {k: [d.text for d in docs if d.kind == k] for k in KINDS}
    package = {k: [d.text for d in docs if d.kind == k and d.category in ("stdlib", "pydoc")] for k in KINDS}
    replies = {"code": package["code"], "math": by_kind["math"], "chat": package["prose"]}
    out: dict[str, list[str]] = {k: [] for k in KINDS}
    for i, d in enumerate(docs):
        if d.category in ("stdlib", "pydoc"):
            out[d.kind].append(d.text + EOT)
            continue
        pool = replies[d.kind] or [d.text]
        reply = pool[(i + 1) % len(pool)][:1500]
        out[d.kind].append(USER + d.text + END + ASSISTANT + reply + END)
    return {k: v for k, v in out.items() if v}


def token_streams(texts: dict[str, list[str]], tokenizer) -> dict[str, list[int]]:
    """Per kind, the concatenated token ids of its texts."""
    return {k: [t for ids in tokenizer(v).input_ids for t in ids] for k, v in texts.items()}


def init_model(args: TrainArgs, tokenizer):
    """A float32 Qwen3-MoE (transformers) with seeded initial weights, router logits on."""
    import torch
    import transformers

    config = build_config(args.model, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    config.output_router_logits = True
    config.router_aux_loss_coef = args.aux_loss_coef
    config._experts_implementation = "grouped_mm"  # one grouped product: faster on CPU than a loop of mm per expert
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.train()


def sample_batch(streams: dict, args: TrainArgs, gen):
    """[B, seq_len] windows; kinds take turns so every kind gets the same share of tokens."""
    import torch

    kinds = sorted(streams)
    rows = []
    for b in range(args.batch_size):
        s = streams[kinds[b % len(kinds)]]  # [N_kind]
        start = int(torch.randint(0, max(1, len(s) - args.seq_len), (1,), generator=gen))
        rows.append(s[start : start + args.seq_len])
    return torch.stack(rows)


def lr_at(step: int, args: TrainArgs) -> float:
    """Linear warm-up, then cosine decay to a tenth of `lr`."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))


def routing_mi_loss(router_logits, batch_size: int):
    """Minus the mutual information (nats) between sequence and expert, averaged over layers:
    mean_b H(p_b) - H(mean_b p_b), with p_b a sequence's average routing distribution. Lowering
    it makes each text lean on a subset of experts while the batch as a whole keeps all experts
    in use (the MI loss of Mod-Squad, Chen et al. 2023), as domain-specialised large MoEs do.

    router_logits: one [B * S, E] tensor per MoE layer.
    """
    import torch

    def entropy(p):  # [..., E] -> [...]
        return -(p * torch.log(p + 1e-9)).sum(-1)

    total = 0.0
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1).reshape(batch_size, -1, logits.shape[-1])  # [B, S, E]
        per_seq = probs.mean(dim=1)  # [B, E]
        total = total + entropy(per_seq).mean() - entropy(per_seq.mean(dim=0))
    return total / len(router_logits)


def train_loop(model, streams: dict, args: TrainArgs) -> TrainStats:
    """AdamW on LM loss + aux_loss_coef * load balancing + mi_coef * routing MI loss."""
    import torch

    gen = torch.Generator().manual_seed(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    stats, window, t0, c0 = TrainStats(), [], time.perf_counter(), time.process_time()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        batch = sample_batch(streams, args, gen)  # [B, S]
        out = model(input_ids=batch, labels=batch)  # labels are shifted inside
        loss = out.loss + args.mi_coef * routing_mi_loss(out.router_logits, batch.shape[0])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        window.append(float(out.loss.detach() - args.aux_loss_coef * out.aux_loss.detach()))
        stats.tokens += batch.numel()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            stats.losses.append(sum(window) / len(window))
            log.info("step %d/%d: lm loss %.3f, aux %.3f, %.0f tok/s", step + 1, args.steps, stats.losses[-1],
                     float(out.aux_loss.detach()), stats.tokens / (time.perf_counter() - t0))
            window = []
    stats.seconds = time.perf_counter() - t0
    stats.cpu_seconds = time.process_time() - c0
    stats.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return stats


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="train the tiny MoE of a recipe into a folder (cached by recipe)")
    parser.add_argument("out_dir", help="the model folder to write")
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="full")
    parser.add_argument("--cache-dir", default=None, help="where trained models are cached by recipe")
    args = parser.parse_args()
    train_tiny_moe(args.out_dir, RECIPES[args.recipe], cache_dir=args.cache_dir)

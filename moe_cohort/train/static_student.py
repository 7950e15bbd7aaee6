"""A static student of a fine-tuned encoder: most of the teacher's planning quality at a static model's cost.

`--encoder static` (encoder.static) distils all-MiniLM-L6-v2 token by token (Model2Vec): every
vocabulary token is embedded alone, which loses what fine-tuning taught about how tokens combine in context.

The student here learns from sentences instead (the idea of Tokenlearn, Minish Lab 2025): one
vector per vocabulary token, mean-pooled over a text's tokens (sentence-transformers'
StaticEmbedding, an EmbeddingBag), fitted so that the student's embedding of a text points where
the fine-tuned teacher's does (loss 1 - cosine, plus a pull of every vector toward where it
started). Every token starts at the teacher's embedding of that token alone (Model2Vec's whole
model; tokens the texts never use keep it), or with `start="mean"` at the teacher's mean
embedding. The texts are the training
side of the project's split (traces.split) and random windows of them (spans of at least a
quarter of a text), which multiply the examples of each token in new company. A tenth of the
texts (with their windows) is set aside to pick the step; the held-out requests are never seen.
The student keeps the teacher's tokenizer and its truncation, so it reads the same tokens.

The bag is plain unigrams over in-domain text only: what limits the student is generalisation, not
capacity. Its speed, saving and limits: docs/results.md ("Speed and quality", "The static student").

Output: an ordinary sentence-transformers folder; `cohort train --student static` fits the
expert-profile head on the student's own embeddings beside it, and `--encoder FOLDER` loads both.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

import numpy as np

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StudentConfig:
    """Defaults, not tuned on held-out requests; benchmarks.bench_encoder measures the student they give on
    the DeepSeek traces (docs/results.md)."""

    windows: int = 6  # random windows per text
    steps: int = 200  # full-batch Adam steps (the best on the validation texts is kept)
    learning_rate: float = 0.005
    pull: float = 0.1  # weight of the pull of every token vector toward its start
    validation: float = 0.1  # share of texts (with their windows) that pick the step
    seed: int = 0
    start: Literal["tokens", "mean"] = "tokens"  # "tokens": each vocabulary token embedded alone by the teacher (Model2Vec's start); "mean"


def with_windows(texts: Sequence[str], offsets: Sequence[Sequence[tuple[int, int]]], windows: int,
                 seed: int = 0) -> tuple[list[str], np.ndarray]:
    """The distinct texts plus up to `windows` random token spans of each text of >= 8 tokens, and
    for every output text the index of the text it came from ([M] int64). `offsets` are each text's
    token character spans (a fast tokenizer's `Encoding.offsets`)."""
    rng = random.Random(seed)
    out: dict[str, int] = {}
    for parent, (text, spans) in enumerate(zip(texts, offsets)):
        out.setdefault(text, parent)
        n = len(spans)
        for _ in range(windows if n >= 8 else 0):
            start = rng.randrange(0, n // 2)
            end = rng.randrange(start + max(4, n // 4), n + 1)  # a span of at least a quarter of the text
            out.setdefault(text[spans[start][0] : spans[end - 1][1]], parent)
    return list(out), np.fromiter(out.values(), dtype=np.int64, count=len(out))


def fit_student(ids: list[list[int]], targets: np.ndarray, parents: np.ndarray, vocab_size: int,
                config: StudentConfig = StudentConfig(), start: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """Token vectors [V, D] whose per-text mean has the direction of `targets` [M, D] (unit teacher
    embeddings), and the best mean cosine on the validation texts. `ids`: each text's token ids;
    `parents` [M]: the text each row came from (a text and its windows share one side). Vectors
    start at, and are pulled toward, `start` [V, D] (default: the mean target, for every token)."""
    import torch

    y = torch.as_tensor(targets, dtype=torch.float32)  # [M, D]
    is_val = np.random.default_rng(config.seed).random(int(parents.max()) + 1) < config.validation
    val, fit = np.flatnonzero(is_val[parents]), np.flatnonzero(~is_val[parents])
    if len(val) == 0 or len(fit) == 0:
        val = fit = np.arange(len(ids))  # too few texts to set some aside: pick the step on the fit itself
    anchor = y[fit].mean(0).expand(vocab_size, -1) if start is None else torch.as_tensor(start, dtype=torch.float32)  # [V, D]
    bag = torch.nn.EmbeddingBag(vocab_size, y.shape[1], mode="mean")
    with torch.no_grad():
        bag.weight.copy_(anchor)
    optimiser = torch.optim.Adam(bag.parameters(), lr=config.learning_rate)
    torch.manual_seed(config.seed)
    fit_in, val_in = _bags(ids, fit), _bags(ids, val)
    best_cos, best = -1.0, bag.weight.detach().clone()
    for _ in range(config.steps):
        optimiser.zero_grad()
        cos = torch.nn.functional.cosine_similarity(bag(*fit_in), y[fit])  # [fit]
        loss = (1 - cos).mean() + config.pull * (bag.weight - anchor).pow(2).sum(1).mean()
        loss.backward()
        optimiser.step()
        with torch.no_grad():
            val_cos = torch.nn.functional.cosine_similarity(bag(*val_in), y[val]).mean().item()
        if val_cos > best_cos:
            best_cos, best = val_cos, bag.weight.detach().clone()
    return best.numpy(), best_cos


def _bags(ids: list[list[int]], rows: np.ndarray):
    """EmbeddingBag input (flat ids [T], offsets [n]) of the texts `rows`; an empty text gets the unknown token 0."""
    import torch

    chosen = [ids[i] or [0] for i in rows]
    flat = torch.tensor([t for one in chosen for t in one], dtype=torch.long)
    offsets = torch.tensor(np.cumsum([0] + [len(one) for one in chosen[:-1]]), dtype=torch.long)
    return flat, offsets


def distil_student(teacher: str, texts: Sequence[str], output: str | Path,
                   config: StudentConfig = StudentConfig()) -> tuple[Path, dict]:
    """Fit a static student of the sentence-transformers `teacher` (a folder) on `texts` (the training
    side only) and save it to `output`; returns the folder and a small report."""
    from moe_cohort.encoder.embedding import Embedder
    from moe_cohort.encoder.static import save_static

    model = Embedder(teacher)
    tokenizer = model._fast_tokenizer()
    if tokenizer is None:
        raise ValueError(f"the teacher {teacher!r} has no fast tokenizer; a static student needs one")
    tokenizer = type(tokenizer).from_str(tokenizer.to_str())  # a copy: truncation and padding change below
    tokenizer.no_padding()
    tokenizer.no_truncation()
    texts = list(dict.fromkeys(texts))  # distinct, in order
    spans = [e.offsets for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    rows, parents = with_windows(texts, spans, config.windows, config.seed)
    log.info("static student: %d texts with windows; embedding them with the teacher", len(rows))
    targets = model.encode(rows)  # [M, D]
    limit = model._max_tokens()
    if limit:
        tokenizer.enable_truncation(int(limit))  # the student reads what the teacher reads
    ids = [e.ids for e in tokenizer.encode_batch(rows, add_special_tokens=False)]
    vocab = tokenizer.get_vocab_size()
    start = model.encode([tokenizer.id_to_token(i) or "" for i in range(vocab)]) if config.start == "tokens" else None
    weights, val_cos = fit_student(ids, targets, parents, vocab, config, start)  # start: [V, D] unit rows
    path = save_static(tokenizer, weights, Path(output))
    return path, {"texts": len(texts), "with_windows": len(rows), "validation_cosine": round(val_cos, 4)}

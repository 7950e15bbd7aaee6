"""Fine-tune a sentence encoder on expert traces: to predict each request's expert profile (the default
`profile` loss), or so that embedding cosine ranks requests by expert overlap (the pair losses).

Pipeline (`train_encoder`): check the traces (texts, shapes) -> split by request
(traces.split.split_requests, the project's one split) -> expert profiles and overlap targets
(train.targets) -> for a pair loss, pairs over the training side only (near neighbours, hard
negatives against the base encoder, random)
-> sentence-transformers training with the profile loss or CoSENT (Su 2022, "CoSENT: a more efficient sentence
vector scheme than Sentence-BERT"; `sentence_transformers.losses.CoSENTLoss`) through
`SentenceTransformerTrainer` -> a normal sentence-transformers folder (loadable by
`SentenceTransformer(path)` and `cohort plan --encoder PATH`) with `training.json` beside the
weights: the config, the split (request ids), the pair (or request) counts and the held-out Spearman
correlation between embedding cosine and the target, before and after.

CoSENT only uses the order of the labels within a batch, so the target's scale does not matter,
only its ranking: exactly what a planner that clusters by cosine consumes. The pair target is one of
train.targets (default: weighted Jaccard of expert-frequency profiles).

The `profile` loss (train.profile_loss) needs no pairs: the training requests themselves, each with
its expert profile, as many examples as the pair objectives' budget (epochs x max_pairs), so the run
costs about the same number of steps and no pair mining. It is the default: its encoders admit best
(docs/results.md, "How close do text predictors get to the reference?").

Checkpoints go to OUTPUT/checkpoints every `save_steps` steps; `resume=True` reloads the saved
pairs (OUTPUT/pairs.npz) and continues from the newest checkpoint. The Trainer shows a progress
bar, and runs on the GPU when one is present (bf16 where supported), else on the CPU.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moe_cohort.traces.format import TraceSet
from moe_cohort.train.correlation import cosine_spearman
from moe_cohort.traces.split import split_requests
from moe_cohort.train.pairs import PairSet, sample_pairs
from moe_cohort.train.targets import DEFAULT_TARGET, TARGETS, counted_tokens, profiles

log = logging.getLogger(__name__)

PAIRS_FILE, REPORT_FILE, CHECKPOINTS = "pairs.npz", "training.json", "checkpoints"
LOSSES = ("profile", "cosent", "angle", "cosine")
PROFILE_LAYER_LR = 1e-2  # the profile loss's linear layer, which starts at zero (the encoder: learning_rate)


class TrainDataError(ValueError):
    """The traces cannot be trained on (no texts, too few requests, ...); the message says why."""


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides a training run; stored in training.json and checked on resume.

    Defaults: the best measured on held-out admission (benchmarks/bench_train.py, bench_predictor_cv.py;
    docs/results.md); texts truncated to 64 word pieces, as a CPU step costs about linearly in the padded length.
    """

    epochs: float = 1.0
    max_pairs: int = 6000
    batch_size: int = 32
    learning_rate: float = 5e-5
    warmup_ratio: float = 0.1
    max_seq_length: int | None = 64  # truncation while training and in the saved model; None keeps the base's
    target: str = DEFAULT_TARGET
    loss: str = "profile"
    near_frac: float = 0.4
    hard_frac: float = 0.2
    holdout: float = 0.2
    seed: int = 0
    save_steps: int = 50

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {self.target!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if not (self.epochs > 0 and self.max_pairs >= 2 and self.batch_size >= 2 and 0 <= self.holdout < 1):
            raise ValueError("epochs > 0, max_pairs >= 2, batch_size >= 2 and 0 <= holdout < 1 are required")


@dataclass
class TrainResult:
    output: Path
    train_ids: list[str]
    heldout_ids: list[str]
    pair_counts: dict[str, int]
    device: str
    train_seconds: float
    spearman_before: dict[str, float] = field(default_factory=dict)
    spearman_after: dict[str, float] = field(default_factory=dict)


def check_traces(ts: TraceSet, holdout: float = 0.0) -> None:
    """Raise TrainDataError unless `ts` can be trained on. Cheap: call it before loading any model."""
    if ts.texts is None:
        raise TrainDataError("the traces carry no prompt texts; training needs the text of every request "
                             "(import traces with texts, e.g. a .jsonl with a 'text' field)")
    empty = np.flatnonzero(np.char.str_len(ts.texts.astype(str)) == 0)
    if len(empty):
        raise TrainDataError(f"{len(empty)} request(s) have an empty text (first: request id {ts.request_ids[empty[0]]!r})")
    counted = np.bincount(np.repeat(np.arange(len(ts)), ts.num_tokens)[counted_tokens(ts)], minlength=len(ts))
    usable = int((counted > 0).sum())
    need = 4 if holdout == 0 else 8
    if usable < need:
        raise TrainDataError(f"only {usable} request(s) have decode tokens (or prompt tokens after BOS); "
                             f"training needs at least {need}")


def build_pairs(ts: TraceSet, prof: np.ndarray, train_idx: np.ndarray, config: TrainConfig,
                embeddings: np.ndarray | None = None) -> PairSet:
    """Pairs among the requests `train_idx` only, as indices into `ts`; `embeddings` [len(train_idx), d]."""
    local = sample_pairs(prof[train_idx], ts.top_k, config.max_pairs, embeddings=embeddings, kind=config.target,
                         near_frac=config.near_frac, hard_frac=config.hard_frac, seed=config.seed)
    return PairSet(pairs=train_idx[local.pairs], labels=local.labels, kinds=local.kinds)


def train_encoder(ts: TraceSet, base: Any, output_dir: str | Path, config: TrainConfig = TrainConfig(), *,
                  resume: bool = False, progress: bool = True, callbacks: list | None = None) -> TrainResult:
    """Run the whole pipeline of the module docstring; `base` is a SentenceTransformer or a name/path.

    `callbacks` are transformers TrainerCallbacks handed to the Trainer."""
    check_traces(ts, config.holdout)
    out = Path(output_dir)
    check_output(out, resume)
    valid = _has_tokens(ts)  # [N]
    if resume and (out / PAIRS_FILE).exists():
        train_idx, held_idx, pairs = _load_pairs(out / PAIRS_FILE, ts, config)
    else:
        train_idx, held_idx = split_requests(len(ts), config.holdout, config.seed, groups=ts.texts)
        pairs = None
    train_idx = train_idx[valid[train_idx]]  # a request without decode tokens has no target to learn
    scored = held_idx[valid[held_idx]]  # held-out requests the correlations are measured on
    prof = profiles(ts)  # [N, L, E]
    model = _load_base(base)
    result = TrainResult(output=out, train_ids=ts.request_ids[train_idx].tolist(), heldout_ids=ts.request_ids[held_idx].tolist(),
                         pair_counts={}, device=str(model.device), train_seconds=0.0)
    if len(scored) >= 3:  # the base as it is, before the truncation below
        result.spearman_before = cosine_spearman(_embed(model, ts.texts[scored]), prof[scored], ts.top_k, config.target)
    if config.max_seq_length:
        model.max_seq_length = config.max_seq_length
    if pairs is None:
        pairs = _NO_PAIRS if config.loss == "profile" else build_pairs(
            ts, prof, train_idx, config, _embed(model, ts.texts[train_idx]) if config.hard_frac > 0 else None)
        _save_pairs(out / PAIRS_FILE, ts, train_idx, held_idx, pairs, config)
    result.pair_counts = {"requests": len(train_idx)} if config.loss == "profile" else pairs.counts()
    start = time.perf_counter()
    if config.loss == "profile":
        finetune_profiles(model, ts.texts[train_idx], prof[train_idx], out, config, resume=resume, progress=progress,
                          callbacks=callbacks)
    else:
        finetune(model, ts.texts, pairs, out, config, resume=resume, progress=progress, callbacks=callbacks)
    result.train_seconds = time.perf_counter() - start
    if len(scored) >= 3:
        result.spearman_after = cosine_spearman(_embed(model, ts.texts[scored]), prof[scored], ts.top_k, config.target)
    _write_report(out / REPORT_FILE, result, config)
    return result


def finetune(model, texts: np.ndarray, pairs: PairSet, output_dir: str | Path, config: TrainConfig, *,
             resume: bool = False, progress: bool = True, callbacks: list | None = None) -> Path:
    """Train `model` in place on `pairs` (indices into `texts`) with a pair loss and save it to `output_dir`."""
    from datasets import Dataset

    data = Dataset.from_dict({"sentence1": texts[pairs.pairs[:, 0]].tolist(), "sentence2": texts[pairs.pairs[:, 1]].tolist(),
                              "score": pairs.labels.astype(float).tolist()})
    return _fit(model, data, _loss(model, config.loss), config.epochs, Path(output_dir), config, {}, resume, progress, callbacks)


def finetune_profiles(model, texts: np.ndarray, prof: np.ndarray, output_dir: str | Path, config: TrainConfig, *,
                      resume: bool = False, progress: bool = True, callbacks: list | None = None) -> Path:
    """Train `model` in place to predict the profiles prof [n, L, E] of `texts` [n] (train.profile_loss), as many
    examples as the pair objectives' budget (epochs x max_pairs), and save it to `output_dir`."""
    from datasets import Dataset

    from moe_cohort.train.profile_loss import PROFILE_LAYER, ProfileLoss, profile_targets

    target = profile_targets(prof)  # [n, L, E]
    data = Dataset.from_dict({"sentence": texts.tolist(), "label": target.reshape(len(target), -1).tolist()})
    loss = ProfileLoss(model, target.mean(axis=0))
    epochs = config.epochs * config.max_pairs / len(texts)
    return _fit(model, data, loss, epochs, Path(output_dir), config, {rf"^{PROFILE_LAYER}\.": PROFILE_LAYER_LR},
                resume, progress, callbacks)


def _fit(model, data, loss, epochs: float, out: Path, config: TrainConfig, rates: dict[str, float], resume: bool,
         progress: bool, callbacks: list | None) -> Path:
    """SentenceTransformerTrainer over `data` for `epochs` with `loss` (`rates`: learning rates of the loss's own
    parameters by name pattern); checkpoints in out/checkpoints, the model saved to `out`."""
    import torch
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    steps = int(np.ceil(epochs * np.ceil(len(data) / config.batch_size)))
    cuda = torch.cuda.is_available()
    args = SentenceTransformerTrainingArguments(
        output_dir=str(out / CHECKPOINTS), num_train_epochs=epochs, per_device_train_batch_size=config.batch_size,
        learning_rate_mapping=rates,
        learning_rate=config.learning_rate, warmup_steps=int(np.ceil(config.warmup_ratio * steps)),
        seed=config.seed, data_seed=config.seed, save_strategy="steps", save_steps=config.save_steps, save_total_limit=1,
        logging_steps=max(1, min(config.save_steps, steps // 10)), report_to="none", disable_tqdm=not progress,
        bf16=cuda and torch.cuda.is_bf16_supported(), use_cpu=not cuda, dataloader_num_workers=0,
    )
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=loss, callbacks=callbacks)
    checkpoint = _latest_checkpoint(out / CHECKPOINTS) if resume else None
    log.info("training on %s: %d examples, %d steps%s", model.device, len(data), steps,
             f", resuming from {checkpoint}" if checkpoint else "")
    trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    model.save(str(out))
    shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)
    return out


def _loss(model, name: str):
    try:  # sentence-transformers >= 6 moved the losses; older releases keep them at the top level
        from sentence_transformers.sentence_transformer import losses
    except ImportError:
        from sentence_transformers import losses

    return {"cosent": losses.CoSENTLoss, "angle": losses.AnglELoss, "cosine": losses.CosineSimilarityLoss}[name](model)


def _load_base(base: Any):
    """A SentenceTransformer as is; a name or path through encoder.embedding.resolve_model (local folder,
    the bundled offline default, or a hub name), on the GPU when one is present."""
    if not isinstance(base, (str, Path)):
        return base
    import torch
    from sentence_transformers import SentenceTransformer

    from moe_cohort.encoder.embedding import resolve_model

    return SentenceTransformer(resolve_model(str(base)), device="cuda" if torch.cuda.is_available() else "cpu")


def _embed(model, texts: np.ndarray) -> np.ndarray:  # [n, d] float32, unit norm
    return np.asarray(model.encode(texts.tolist(), batch_size=64, normalize_embeddings=True, show_progress_bar=False))


_NO_PAIRS = PairSet(pairs=np.zeros((0, 2), np.int64), labels=np.zeros(0, np.float32), kinds=np.zeros(0, np.int8))


def _has_tokens(ts: TraceSet) -> np.ndarray:  # [N] bool: requests with counted tokens
    return np.bincount(np.repeat(np.arange(len(ts)), ts.num_tokens)[counted_tokens(ts)], minlength=len(ts)) > 0


def check_output(out: Path, resume: bool) -> None:
    """Raise FileExistsError unless `out` can take a new run (empty or absent) or a resumed, unfinished one."""
    if not resume and out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; choose a new --output, or pass --resume to continue a run there")
    if resume and (out / REPORT_FILE).exists():
        raise FileExistsError(f"{out} holds a finished run ({REPORT_FILE}); there is nothing to resume")
    out.mkdir(parents=True, exist_ok=True)


def _latest_checkpoint(folder: Path) -> Path | None:
    found = sorted(folder.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1])) if folder.exists() else []
    return found[-1] if found else None


def _save_pairs(path: Path, ts: TraceSet, train_idx, held_idx, pairs: PairSet, config: TrainConfig) -> None:
    np.savez(path, pairs=pairs.pairs, labels=pairs.labels, kinds=pairs.kinds, train=train_idx, heldout=held_idx,
             request_ids=ts.request_ids.astype(str), config=np.array(json.dumps(asdict(config))))


def _load_pairs(path: Path, ts: TraceSet, config: TrainConfig) -> tuple[np.ndarray, np.ndarray, PairSet]:
    with np.load(path, allow_pickle=False) as z:
        if z["request_ids"].tolist() != ts.request_ids.astype(str).tolist():
            raise TrainDataError(f"{path} was built from other traces (request ids differ); resume with the same --traces")
        saved = json.loads(str(z["config"]))
        if saved != json.loads(json.dumps(asdict(config))):
            raise TrainDataError(f"{path} was built with other settings {saved}; resume with the same options")
        return z["train"], z["heldout"], PairSet(pairs=z["pairs"], labels=z["labels"], kinds=z["kinds"])


def _write_report(path: Path, result: TrainResult, config: TrainConfig) -> None:
    report = {**asdict(result), "output": str(result.output), "config": asdict(config)}
    path.write_text(json.dumps(report, indent=2) + "\n")

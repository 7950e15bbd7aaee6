"""Predictors compared on the TRAINING side by K-fold replays, the encoder fine-tuned per fold (issue 25).

    python -m benchmarks.bench_predictor_cv [--traces A,B] [--encoders static,base]
        [--finetune NAME[:key=value,...]] ... [--folds 4] [--slots 16,32] [--seeds 6]

Why: the held-out side of gpt-oss-20b is 82 requests, about 2.5 fills of 32 slots, so a choice between
two predictors made there is mostly a choice between two draws (docs/results.md: the static head led the
fine-tuned one by 10 points there and trailed it by 13-18 in these folds). Here every training request
is scored once, by a predictor that never saw it, and nothing of the held-out side is read.

Per trace folder (default: both of the data folder), the training side of the project's split
(benchmarks.heldout) in K folds, requests with the same text in one fold (seeded). Per fold: the profile head
of every --encoders encoder fitted on the other folds; for every --finetune variant, `cohort train`'s
pipeline (train.finetune.train_encoder: the defaults, with key=value overriding TrainConfig fields, e.g.
`ft128:max_seq_length=128`) run on the other folds only, then its head on them; then the fold replayed
through S slots with the engine kept full (eval.engine, random order as the yardstick). A policy's
share of the reference is its saving summed over folds over the reference's (the rule that knows the
fold's traces). The fine-tuned folders go to --workdir (outside the repository).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np

from benchmarks.heldout import HeldOut, data_path, embeddings
from moe_cohort.eval.cost import parse_cost_model
from moe_cohort.eval.engine import REFERENCE, evaluate_continuous
from moe_cohort.eval.policies import by_profile
from moe_cohort.eval.replay import decode_tokens
from moe_cohort.traces.format import TraceSet
from moe_cohort.traces.importers import load_traces
from moe_cohort.train.profile_head import fit_profile_head

from benchmarks.bench_continuous import MODELS, held_lengths

Embed = Callable[[list, str | None], np.ndarray]  # (texts, encoder) -> [N, D]


def training_folds(ts: TraceSet, k: int, seed: int = 1) -> list[np.ndarray]:
    """K disjoint sorted index arrays covering the training side's requests with counted tokens; one text, one fold."""
    train = HeldOut.of(ts).fit_idx  # [M]
    keys = np.unique(ts.texts[train].astype(str), return_inverse=True)[1].ravel()  # [M] text group
    fold_of_group = np.random.default_rng(seed).permutation(keys.max() + 1) % k  # [G]
    return [train[fold_of_group[keys] == f] for f in range(k)]


def parse_variant(spec: str) -> tuple[str, dict]:
    """"NAME[:key=value,...]" -> (NAME, TrainConfig overrides), values typed like the field's default."""
    from moe_cohort.train.finetune import TrainConfig

    name, _, rest = spec.partition(":")
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    overrides = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in fields:
            raise ValueError(f"--finetune {spec!r}: {key!r} is not a TrainConfig field ({', '.join(fields)})")
        overrides[key] = _typed(value, getattr(TrainConfig(), key))
    return name, overrides


def _typed(value: str, default):
    if value.lower() == "none":
        return None
    if isinstance(default, bool):
        return value.lower() in ("1", "true", "yes")
    return type(default)(value) if default is not None else int(value)


def fine_tune(fit: TraceSet, folder: Path, overrides: dict, base: str | None = None) -> Path:
    """`cohort train`'s encoder (no head) on every request of `fit`, into a fresh `folder`."""
    import shutil

    from moe_cohort.encoder.embedding import DEFAULT_MODEL
    from moe_cohort.train.finetune import TrainConfig, train_encoder

    shutil.rmtree(folder, ignore_errors=True)
    config = replace(TrainConfig(), **{**overrides, "holdout": 0.0})
    return train_encoder(fit, base or DEFAULT_MODEL, folder, config, progress=False).output


def measure_cv(ts: TraceSet, encoders: list[str], finetune: dict[str, dict], slots: list[int], seeds: int, embed: Embed,
               workdir: Path, *, folds: int = 4, base: str | None = None, report: Callable[[str], None] = print) -> dict:
    """Per policy and S: the saving of each fold and the share of the reference (sums over folds)."""
    cost = parse_cost_model("deepseek-v2-lite")
    texts = [str(t) for t in ts.texts]
    prof = HeldOut.of(ts).all_profiles  # [N, L, E]
    fixed = {f"text-profile-{enc}": embed(texts, None if enc == "base" else enc) for enc in encoders}  # [N, D] each
    savings: dict[str, dict[int, list[float]]] = {}
    parts = training_folds(ts, folds)
    for f, fold in enumerate(parts):
        fit = np.sort(np.concatenate([p for g, p in enumerate(parts) if g != f]))
        xs = dict(fixed)
        for name, overrides in finetune.items():  # an encoder that never saw the fold
            xs[f"text-profile-{name}"] = embed(texts, str(fine_tune(ts.subset(fit), workdir / f"fold{f}" / name,
                                                                    overrides, base)))
        policies = {name: replace(by_profile(_head_on(x, texts, prof, fit, fold, ts.top_k)), shuffle=True)
                    for name, x in xs.items()}
        policies[REFERENCE] = replace(by_profile(prof[fold]), shuffle=True)
        sub = ts.subset(fold)
        tokens = decode_tokens(sub)
        for s in slots:
            rows = evaluate_continuous(tokens, s, policies, held_lengths(sub, tokens.mode), cost, ts.num_layers,
                                       seeds=seeds, kept_full=True)["plans"]
            for name, row in rows.items():
                savings.setdefault(name, {}).setdefault(s, []).append(row["saving"])
        report(f"fold {f}: {len(fold)} requests, fitted on {len(fit)}")
    return _summary(savings, slots, report)


def _head_on(x: np.ndarray, texts: list[str], prof: np.ndarray, fit: np.ndarray, fold: np.ndarray,
             top_k: int) -> np.ndarray:  # [n, L, E]
    """The profiles of the `fold` requests predicted by a head fitted on the `fit` requests of embeddings x [N, D]."""
    head = fit_profile_head(x[fit], prof[fit], top_k, texts=[texts[i] for i in fit])
    return head.predict(x[fold], [texts[i] for i in fold])


def _summary(savings: dict, slots: list[int], report) -> dict:
    ref = {s: float(np.sum(savings[REFERENCE][s])) for s in slots}
    out = {}
    for name, by_s in savings.items():
        out[name] = {s: {"fold_savings": by_s[s], "capture": float(np.sum(by_s[s])) / ref[s] if ref[s] > 0 else 0.0}
                     for s in slots}
        report(f"{name:24s} " + "  ".join(f"S = {s}: {np.mean(by_s[s]):6.2%} ({out[name][s]['capture']:4.0%})"
                                          for s in slots))
    return out


def main() -> None:
    args = _parse()
    embed = lambda texts, enc: embeddings(texts, enc, args.cache)  # noqa: E731
    variants = dict(parse_variant(v) for v in args.finetune)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="cohort-cv-"))
    for path in (args.traces.split(",") if args.traces else [str(data_path(m)) for m in MODELS]):
        print(f"\n===== {path}: training side, {args.folds} folds, kept full, {args.seeds} seeds =====")
        print("policy                   saving per fold, mean (share of the reference over all folds)")
        measure_cv(load_traces(path), [e for e in args.encoders.split(",") if e], variants, _ints(args.slots),
                   args.seeds, embed, workdir / Path(path).name, folds=args.folds)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", help=f"trace folders, comma-separated (default: {', '.join(MODELS)} of the data folder)")
    p.add_argument("--encoders", default="static,base", help="encoders whose head is fitted per fold (default %(default)s)")
    p.add_argument("--finetune", action="append", default=[],
                   help="NAME[:key=value,...]: `cohort train` per fold with these TrainConfig overrides (repeatable)")
    p.add_argument("--folds", type=int, default=4)
    p.add_argument("--slots", default="16,32")
    p.add_argument("--seeds", type=int, default=6)
    p.add_argument("--cache", default="/tmp/cohort-bench-cache", help="embedding cache (outside the repository)")
    p.add_argument("--workdir", help="where the per-fold encoders go (default: a new temporary folder)")
    return p.parse_args()


if __name__ == "__main__":
    main()

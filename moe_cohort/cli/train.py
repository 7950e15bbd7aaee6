"""`cohort train`: fine-tune a sentence encoder on expert traces (by default to predict each request's expert
profile, train.profile_loss), then fit the profile head that admission reads beside it."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from moe_cohort.encoder.embedding import DEFAULT_MODEL
from moe_cohort.traces.format import TraceFormatError
from moe_cohort.traces.importers import load_traces
from moe_cohort.train.targets import DEFAULT_TARGET, TARGETS
from moe_cohort.train.finetune import LOSSES, TrainConfig, TrainDataError, check_traces, check_output, train_encoder

_DEFAULTS = TrainConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--traces", required=True, help="trace file or directory with prompt texts (see `cohort traces`)")
    parser.add_argument("--base", default=DEFAULT_MODEL,
                        help="the encoder to fine-tune: a sentence-transformers folder or hub name (default: the "
                             "packaged all-MiniLM-L6-v2, not the other commands' 'static' --encoder: a static model "
                             "has no transformer to fine-tune, and the static student is distilled from this one)")
    parser.add_argument("--output", required=True, help="folder for the fine-tuned model (a sentence-transformers folder)")
    parser.add_argument("--epochs", type=_positive_float, default=_DEFAULTS.epochs, help="passes over the pairs (default %(default)s)")
    parser.add_argument("--max-pairs", type=_int_from(2), default=_DEFAULTS.max_pairs,
                        help="training pairs per epoch; with --loss profile, examples per epoch drawn from the training "
                             "requests (default %(default)s)")
    parser.add_argument("--batch-size", type=_int_from(2), default=_DEFAULTS.batch_size, help="pairs per step (default %(default)s)")
    parser.add_argument("--learning-rate", type=_positive_float, default=_DEFAULTS.learning_rate, help="default %(default)s")
    parser.add_argument("--max-seq-len", type=_int_from(0), default=_DEFAULTS.max_seq_length,
                        help="truncate texts to this many word pieces, in training and in the saved model; 0 keeps the base's (default %(default)s)")
    parser.add_argument("--target", choices=TARGETS, default=DEFAULT_TARGET, help="overlap target (default %(default)s)")
    parser.add_argument("--loss", choices=LOSSES, default=_DEFAULTS.loss,
                        help="profile: learn to predict each request's expert profile; cosent, angle, cosine: make "
                             "cosine track the --target overlap of pairs (default %(default)s)")
    parser.add_argument("--holdout-share", type=_share, default=_DEFAULTS.holdout,
                        help="share of the requests held out of training, for the before/after report (default "
                             "%(default)s: with the default --seed, the held-out side of `cohort eval "
                             "--heldout-only`)")
    parser.add_argument("--seed", type=int, default=_DEFAULTS.seed, help="split, pair sampling and training seed (default %(default)s)")
    parser.add_argument("--save-steps", type=_int_from(1), default=_DEFAULTS.save_steps, help="checkpoint every N steps (default %(default)s)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --output from its newest checkpoint")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--profile-head", choices=("yes", "no", "only"), default="yes",
                        help="also fit the expert-profile head (embedding -> per-layer expert frequencies) on the "
                             "training side and save it beside the encoder (yes, default); no; or only fit the head for "
                             "the --base encoder, saving it in --output, without fine-tuning")
    parser.add_argument("--student", choices=("static",),
                        help="instead of fine-tuning, distil the --base encoder (e.g. a folder from `cohort train`) "
                             "into a static student, far faster per prompt, and fit the profile head on it")


def _int_from(low: int):
    """argparse type: an integer >= low."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return value
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        config = TrainConfig(epochs=args.epochs, max_pairs=args.max_pairs, batch_size=args.batch_size,
                             learning_rate=args.learning_rate, max_seq_length=args.max_seq_len or None,
                             target=args.target, loss=args.loss, holdout=args.holdout_share, seed=args.seed,
                             save_steps=args.save_steps)
        ts = load_traces(args.traces)
        check_traces(ts, config.holdout)  # before any model is loaded
        if args.profile_head != "only":
            check_output(Path(args.output), args.resume)
    except (TraceFormatError, TrainDataError, ValueError, OSError) as exc:
        print(f"cohort train: error: {exc}")
        return 2
    if args.profile_head == "only":
        return _profile_head(ts, args.base, args.output, config)
    if args.student:
        return _student(ts, args, config)
    print(f"training on {len(ts)} requests of {args.traces} ({config.holdout:.0%} held out), base {args.base}")
    try:
        result = train_encoder(ts, args.base, args.output, config, resume=args.resume, progress=not args.no_progress)
    except (TrainDataError, OSError, ValueError) as exc:  # OSError: e.g. a base model that cannot be found
        print(f"cohort train: error: {exc}")
        return 2
    print(f"saved the fine-tuned encoder to {result.output} ({result.device}, {result.train_seconds:.0f} s of training; "
          f"training examples {result.pair_counts})")
    for name in result.spearman_after:
        print(f"held-out Spearman(cosine, {config.target}) on {name.replace('_', ' ')}: "
              f"{result.spearman_before[name]:.3f} before, {result.spearman_after[name]:.3f} after")
    return _profile_head(ts, str(result.output), result.output, config) if args.profile_head == "yes" else 0


def _student(ts, args: argparse.Namespace, config: TrainConfig) -> int:
    """Distil --base into a static student on the training side of the split; fit its profile head."""
    from moe_cohort.traces.split import split_requests
    from moe_cohort.train.static_student import StudentConfig, distil_student

    train_idx, _ = split_requests(len(ts), config.holdout, config.seed, groups=ts.texts)
    print(f"distilling {args.base} into a static student on {len(train_idx)} training requests of {args.traces}")
    try:
        path, report = distil_student(args.base, [str(t) for t in ts.texts[train_idx]], args.output,
                                      StudentConfig(seed=config.seed))
    except (OSError, ValueError) as exc:
        print(f"cohort train: error: {exc}")
        return 2
    print(f"saved the static student to {path} ({report['with_windows']} texts with windows; "
          f"validation cosine to the teacher {report['validation_cosine']:.3f})")
    return _profile_head(ts, str(path), path, config)


def _profile_head(ts, encoder: str, output, config: TrainConfig) -> int:
    """Fit the expert-profile head on `encoder`'s embeddings of the training side; save it in `output`."""
    from moe_cohort.encoder.embedding import Embedder
    from moe_cohort.train.profile_head import train_profile_head

    try:
        embedder = Embedder(encoder)
        head, path = train_profile_head(ts, embedder.encode, output, holdout=config.holdout, seed=config.seed)
        if not (Path(output) / "modules.json").exists():  # `--profile-head only` into a new folder: the encoder goes
            embedder.model.save(str(output))              # beside its head, so `--encoder OUTPUT` finds both
    except (OSError, ValueError) as exc:
        print(f"cohort train: error: {exc}")
        return 2
    print(f"saved the expert-profile head to {path} (ridge, alpha {head.alpha:g}; "
          f"[{head.dim}] -> [{head.num_layers}, {head.num_experts}])")
    return 0

"""The held-out setup of the benchmarks, written once, and where their data lives.

Every held-out figure is taken the same way: split the traces by request with the project's one
split (traces.split), fit a profile head on the training side only (or load the one `cohort
train` saved beside the encoder, which saw that side only), embed, and measure on the held-out
side against its requests' own profiles (the reference admission's input).

    data = HeldOut.of(load_traces(args.traces or data_path(TRACES)))
    x = embeddings(data.traces.texts, encoder, cache)  # [N, D], cached on disk by encoder and texts
    head = data.head(x, encoder)                      # the saved head, else fitted on the training side
    head.predict(x[data.held_idx], data.held_texts)   # [n, L, E] predicted profiles of the held-out side
    data.held, data.reference                         # the held-out TraceSet, its own profiles [n, L, E]

It is the benchmarks' own setup, not part of the installed package: it needs the split (traces/),
the encoder and its saved head (encoder/) and the head's fit and the profiles (train/), and it takes
nothing from the replay: the reference profiles are train.targets.profiles of the held-out side,
which are what eval.replay.decode_profiles reads from the replay's decode tokens (generated tokens,
else the prompt after BOS; a test checks they are equal).

The data folder is $COHORT_DATA, else ../shared/data from the working directory (the repository
root, where `python -m benchmarks.bench_x` runs); `data_dir` is the one place that reads it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Sequence

import numpy as np

from moe_cohort.encoder.profile import ProfileHead, load_profile_head
from moe_cohort.traces.format import TraceSet
from moe_cohort.traces.split import heldout_split, split_requests
from moe_cohort.train.profile_head import fit_profile_head
from moe_cohort.train.targets import profiles

log = logging.getLogger(__name__)

DATA_ENV = "COHORT_DATA"
DEFAULT_DATA = "../shared/data"
TRACES = "deepseek-v2-lite-puffin"  # the DeepSeek-V2-Lite traces of 1,499 puffin prompts
PROMPTS = "prompts/mixed.jsonl"  # GSM8K, HumanEval, MT-Bench, ... prompt texts, one JSON object a line


def data_location() -> Path:
    """Where the data folder is meant to be: $COHORT_DATA, else ../shared/data from the working directory."""
    return Path(os.environ.get(DATA_ENV) or DEFAULT_DATA)


def data_dir() -> Path:
    """The benchmark data folder (`data_location`), which must exist."""
    path = data_location()
    if not path.is_dir():
        raise FileNotFoundError(f"no data folder at {path} (from the working directory {Path.cwd()}): set {DATA_ENV} "
                                f"to the folder that holds {TRACES}/ and {PROMPTS}")
    return path


def data_path(name: str) -> Path:
    """`name` (e.g. TRACES, PROMPTS) inside the data folder; FileNotFoundError naming $COHORT_DATA when missing."""
    path = data_dir() / name
    if not path.exists():
        raise FileNotFoundError(f"{path} not found in the data folder; set {DATA_ENV} to the folder that holds {name}")
    return path


def prompt_texts(heldout: bool = False, path: str | Path | None = None) -> list[str]:
    """The texts of a prompt set (default: PROMPTS of the data folder) in file order; with `heldout`,
    only the held-out side of the project's split (the prompts a model trained on the set never saw)."""
    lines = Path(path or data_path(PROMPTS)).read_text(encoding="utf-8").splitlines()
    texts = [json.loads(line)["text"] for line in lines if line.strip()]
    return [texts[i] for i in split_requests(len(texts), groups=texts)[1]] if heldout else texts


@dataclass(frozen=True)
class HeldOut:
    """One trace set under the project's split: the training side fits, the held-out side is measured."""

    traces: TraceSet
    train_idx: np.ndarray  # [N_train] int64, sorted
    held_idx: np.ndarray  # [n] int64, sorted

    @classmethod
    def of(cls, ts: TraceSet) -> HeldOut:
        return cls(ts, *heldout_split(ts))

    @cached_property
    def held(self) -> TraceSet:
        return self.traces.subset(self.held_idx)

    @property
    def held_texts(self) -> list[str] | None:
        """The held-out requests' prompt texts (what a head that reads n-grams needs beside the embeddings)."""
        return None if self.traces.texts is None else [str(t) for t in self.traces.texts[self.held_idx]]

    @cached_property
    def reference(self) -> np.ndarray:  # [n, L, E] float32
        """The held-out requests' own profiles: what the reference admission ranks by."""
        return profiles(self.held)

    @cached_property
    def all_profiles(self) -> np.ndarray:  # [N, L, E] float32
        """Every request's own profile (train.targets.profiles), in trace order."""
        return profiles(self.traces)

    @cached_property
    def fit_idx(self) -> np.ndarray:  # [M] int64, sorted
        """The training requests with counted tokens: what every head is fitted on."""
        return self.train_idx[self.all_profiles[self.train_idx].sum(axis=(1, 2)) > 0]

    def fit_head(self, x: np.ndarray, limit: int | None = None, seed: int = 0) -> ProfileHead:
        """A profile head fitted on the training side of embeddings x [N, D] (all requests, in trace order);
        with `limit`, on a seeded random `limit` of the training requests (a learning curve's point)."""
        fit, prof = self.fit_idx, self.all_profiles
        if limit is not None and limit < len(fit):
            fit = np.sort(np.random.default_rng(seed).choice(fit, limit, replace=False))
        texts = None if self.traces.texts is None else [str(t) for t in self.traces.texts[fit]]
        return fit_profile_head(x[fit], prof[fit], self.traces.top_k, texts=texts)

    def head(self, x: np.ndarray, encoder: str | Path | None = None) -> ProfileHead:
        """The head `cohort train` saved in the `encoder` folder when it has one, else `fit_head(x)`."""
        saved = load_profile_head(encoder) if encoder and Path(encoder).is_dir() else None
        if saved is not None:
            return saved
        log.info("no profile head in %s: fitted on the %d training requests", encoder or "the packaged encoder",
                 len(self.train_idx))
        return self.fit_head(x)


def embeddings(texts: Sequence[str], encoder: str | None = None, cache: str | Path | None = None) -> np.ndarray:
    """Embeddings [N, D] of `texts` by `encoder` (encoder.embed_texts); with `cache`, kept there as .npy by
    encoder and texts (embedding 1,499 prompts takes minutes of CPU; benchmarks re-run)."""
    from moe_cohort.encoder import embed_texts

    if cache is None:
        return embed_texts(list(texts), encoder=encoder)
    source = str(Path(encoder).resolve()) if encoder and Path(encoder).exists() else encoder or "base"
    key = hashlib.sha1(source.encode() + "\0".join(texts).encode()).hexdigest()[:16]
    path = Path(cache) / f"emb-{key}.npy"
    if path.exists():
        return np.load(path)
    x = embed_texts(list(texts), encoder=encoder)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, x)
    return x

"""Learn the profile head from the served model's own routing, online: observations in, a head out.

The proxy (send/learning/learning.py) hands the learner each observed request as what the head reads
(encoder.profile.head_features: the unit embedding beside the prompt's hashed n-grams, never the
text) and its observed counts (traces.observed). The learner keeps a bounded uniform sample of all
requests offered to it (`Reservoir`, Vitter's algorithm R: it decides before a request runs whether
it will be kept, so only those need observing) and refits the head on it (train.profile_head; the
penalty searched while the reservoir grows and every SEARCH_EVERY-th refit once full) once `first_fit`
rows are in, then whenever enough rows changed (`LearnConfig.refit_every`, and at least a quarter of
what the last fit saw while growing, half once full: a full reservoir is a uniform sample of all
traffic). Once full, a request is kept with probability capacity / seen, so the cost per request of
observing and refitting falls as 1 / seen (benchmarks/bench_refit --service). The new head is swapped
in with one assignment (readers in other threads see the old head or the new one, never a mix).

`live_fit()`: the mean overlap (sum min(p, o) / sum o) of each observed profile with the prediction
made for it on arrival, when no head had seen it, over the most recent `recent`, beside the overlap
of the reservoir's mean profile (what a head that learned nothing would score).

`save(folder)` / `OnlineLearner.load(folder)` keep the reservoir and the head across restarts (npz, no
pickles; written to a temporary name and renamed). Not thread-safe: one thread observes and refits
(the proxy's learning worker); `head` may be read, and `reservoir.offer` called, from anywhere.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from moe_cohort.encoder.ngrams import DEFAULT_NGRAM_DIM
from moe_cohort.encoder.profile import HEAD_FILE, ProfileHead, load_profile_head
from moe_cohort.traces.observed import Observed
from moe_cohort.train.profile_head import DEFAULT_ALPHAS, fit_head_features

log = logging.getLogger(__name__)

Fit = Callable[..., ProfileHead]  # (f [n, F], profiles [n, L, E], top_k, alphas, *, ngram_dim) -> the head

SEARCH_EVERY = 4  # once the reservoir is full, every 4th refit searches the penalty (the others reuse the last)
RENEWED_GROWING, RENEWED_FULL = 4, 2  # a refit waits for 1/4 of the last fit's rows to be new (1/2 once full)

RESERVOIR_FILE = "reservoir.npz"
STATE_KEYS = {"key", "observed", "seen", "size", "shape", "fitted_on", "fitted_at", "stored_at_fit", "stored", "rng",
              "coin"}


@dataclass(frozen=True)
class LearnConfig:
    capacity: int = 1000  # observations kept (a uniform sample of all seen); memory ~ capacity * (F + L*E) * 2 bytes
    first_fit: int = 16  # observations before the first head
    refit_every: int = 50  # new observations between fits, at least (and a quarter of what the last fit saw)
    ngram_dim: int = DEFAULT_NGRAM_DIM  # hashed n-gram features beside the embedding (encoder.ngrams)
    recent: int = 100  # unseen observations the live fit is measured over
    # a refitted head is saved at most this often (and when the learner stops): a crash loses at most this much
    # learning, and the reservoir (the bulk of the state) is not rewritten after every refit of a fast-growing one
    save_every_s: float = 60.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.capacity < 2 or not 2 <= self.first_fit <= self.capacity or self.refit_every < 1 or self.recent < 1:
            raise ValueError(f"learning settings: need capacity >= first_fit >= 2, refit_every >= 1 and recent >= 1, "
                             f"got {self}")


class Reservoir:
    """A uniform sample of at most `capacity` of the (features [F], profile [P]) rows offered so far.

    Vitter's algorithm R with its coin tossed first: `offer()` counts one more candidate and says whether
    the sample takes it (the first `capacity`, then each with probability capacity / seen), before anything
    of it is known; `put` then stores the row, in place of a uniformly chosen kept one once full. So the
    proxy asks the engine to count only the requests the reservoir will keep: capacity * (1 + ln(seen /
    capacity)) of `seen` in expectation, a share that falls as traffic goes on. `add` is both at once.
    `offer` may be called from any thread; `put` from one.
    """

    def __init__(self, capacity: int, seed: int = 0) -> None:
        self.capacity, self.seen, self.size = capacity, 0, 0
        self.stored = 0  # rows ever put (kept)
        self.rng = np.random.default_rng(seed)  # the slots `put` replaces
        self.coin = np.random.default_rng([seed, 1])  # `offer`'s draws, under `_lock`
        self._lock = threading.Lock()
        self.features: np.ndarray | None = None  # [capacity, F] float32 once the first row came
        self.profiles: np.ndarray | None = None  # [capacity, P] float32
        self.total: np.ndarray | None = None  # [P] float64: the kept profiles' sum (their mean without a pass)

    def offer(self) -> bool:
        """One more candidate: whether the sample keeps it (then `put` its row when it is known)."""
        with self._lock:
            self.seen += 1
            return self.seen <= self.capacity or self.coin.random() * self.seen < self.capacity

    def put(self, f: np.ndarray, y: np.ndarray) -> None:
        """Store a kept row: appended while there is room, else in place of a uniformly chosen kept row."""
        if self.features is None:
            self.allocate(f.shape[-1], y.shape[-1])
        if self.size < self.capacity:
            slot, self.size = self.size, self.size + 1
        else:
            slot = int(self.rng.integers(self.capacity))
            self.total -= self.profiles[slot]
        self.features[slot], self.profiles[slot] = f, y
        self.total += self.profiles[slot]
        self.stored += 1

    def add(self, f: np.ndarray, y: np.ndarray) -> None:
        """Offer row (f, y) and store it if kept."""
        if self.offer():
            self.put(f, y)

    def allocate(self, num_features: int, num_profile: int) -> None:
        self.features = np.zeros((self.capacity, num_features), np.float32)
        self.profiles = np.zeros((self.capacity, num_profile), np.float32)
        self.total = np.zeros(num_profile, np.float64)

    def mean(self) -> np.ndarray:  # [P]
        return (self.total / max(self.size, 1)).astype(np.float32)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:  # [n, F], [n, P] copies
        return self.features[: self.size].copy(), self.profiles[: self.size].copy()


class OnlineLearner:
    """A reservoir of observations and the head fitted on it (`head`: None until `first_fit` of them)."""

    def __init__(self, config: LearnConfig = LearnConfig(), key: str = "") -> None:
        self.config, self.key = config, key  # key: what the features depend on (the encoder), checked on load
        self.reservoir = Reservoir(config.capacity, config.seed)
        self.head: ProfileHead | None = None
        self.fitted_on, self.fitted_at = 0, 0.0  # rows the last fit saw; its time.time()
        self.stored_at_fit = 0  # the reservoir's `stored` then
        self.shape: tuple[int, int, int] | None = None  # (L, E, top_k) of the served model
        self.observed = 0  # observations ever learned from, kept or not (this learner and the ones it was loaded from)
        self.refits = 0  # by this learner (not saved: a restarted one searches its penalty at its first refit)
        self.saved_at = float("-inf")  # when `save_when_due` last saved (a monotonic clock's seconds)
        self._fit_recent: deque[tuple[float, float]] = deque(maxlen=config.recent)  # (head, mean) overlaps


    def observe(self, features: np.ndarray, observed: Sequence[Observed],
                predicted: Sequence[np.ndarray | None] | None = None, kept: Sequence[bool] | None = None) -> None:
        """Add observations: features [n, F] (encoder.profile.head_features) of the requests `observed`; `predicted`:
        each one's profile [L*E] as admission predicted it before the request ran (None: the current head's);
        `kept`: whether the reservoir took each one when it was offered (None: offer them now; False: they only
        feed the live fit)."""
        predicted = predicted if predicted is not None else [None] * len(observed)
        kept = kept if kept is not None else [None] * len(observed)
        for f, obs, p, keep in zip(np.asarray(features, np.float32), observed, predicted, kept, strict=True):
            y = self._fitted(obs).profile().ravel()  # [L*E]
            if p is None and self.head is not None:  # an observation the current head never saw
                p = self.head.from_features(f[None])[0]
            if p is not None and len(p) == len(y):  # the live fit
                self._fit_recent.append((_overlap(p, y), _overlap(self.mean_profile(), y)))
            self.observed += 1
            if keep is None:
                keep = self.reservoir.offer()
            if keep:
                self.reservoir.put(f, y)

    def _fitted(self, obs: Observed) -> Observed:
        """`obs` at the learner's width. A source that sees only expert ids (vLLM's routed experts) knows the
        experts up to the largest id seen: before the first head the width grows (an expert no earlier request
        picked has count 0 in all of them, so padding loses nothing), a narrower observation is padded."""
        layers, experts = obs.num_layers, obs.num_experts
        if self.shape is None:
            self.shape = (layers, experts, obs.top_k)
        # experts per token: the most seen (a pruning routing policy picks fewer than the model's top-k)
        self.shape = self.shape[:2] + (max(self.shape[2], obs.top_k),)
        if (layers, experts) == self.shape[:2]:
            return obs
        if layers == self.shape[0] and (experts < self.shape[1] or self.head is None):
            if experts > self.shape[1]:
                self._widen(experts)
            return obs.padded(self.shape[1])
        raise ValueError(f"an observation of {layers} layers x {experts} experts where the learner holds "
                         f"{self.shape[0]} x {self.shape[1]}: a different model; start it afresh (--data-dir)")

    def _widen(self, experts: int) -> None:
        layers, old, top_k = self.shape
        r = self.reservoir
        if r.profiles is not None:
            grown = np.zeros((r.capacity, layers, experts), np.float32)
            grown[:, :, :old] = r.profiles.reshape(r.capacity, layers, old)
            r.profiles = grown.reshape(r.capacity, layers * experts)
            r.total = np.pad(r.total.reshape(layers, old), ((0, 0), (0, experts - old))).ravel()
        self.shape = (layers, experts, top_k)

    def due(self) -> bool:
        """Whether the reservoir changed enough for a (re)fit: `first_fit` rows for the first head, then
        `refit_every` new rows, and at least a quarter of the rows the last fit saw (half once it is full)."""
        r, cfg = self.reservoir, self.config
        if self.head is None:
            return r.size >= cfg.first_fit
        share = RENEWED_FULL if r.size >= r.capacity else RENEWED_GROWING
        return r.stored - self.stored_at_fit >= max(cfg.refit_every, self.fitted_on // share)

    def refit(self, fit: Fit = fit_head_features) -> ProfileHead:
        """Fit a head on the reservoir with `fit` (train.profile_head.fit_head_features, or a call of it that runs
        elsewhere: the proxy's runs in a process of its own) and swap it in."""
        f, y = self.reservoir.arrays()  # [n, F], [n, L*E]
        layers, experts, top_k = self.shape
        start = time.perf_counter()
        head = fit(f, y.reshape(len(y), layers, experts), top_k, self._alphas(), ngram_dim=self.config.ngram_dim)
        self.head, self.fitted_on, self.fitted_at = head, len(f), time.time()
        self.stored_at_fit, self.refits = self.reservoir.stored, self.refits + 1
        log.info("online profile head: refitted on %d of %d observations in %.2f s (alpha %g)",
                 len(f), self.reservoir.seen, time.perf_counter() - start, head.alpha)
        return head

    def _alphas(self) -> Sequence[float]:
        """The penalties a refit tries: all of them first; while the reservoir grows, and every SEARCH_EVERY-th
        refit once it is full, the last fit's and its neighbours (the choice moves slowly; 3 leave-one-out
        passes instead of 7); else the last fit's alone, which train.profile_head solves without the spectrum."""
        if self.head is None or self.head.alpha not in DEFAULT_ALPHAS:
            return DEFAULT_ALPHAS
        if self.reservoir.size >= self.reservoir.capacity and self.refits % SEARCH_EVERY:
            return (self.head.alpha,)
        i = DEFAULT_ALPHAS.index(self.head.alpha)
        return DEFAULT_ALPHAS[max(i - 1, 0): i + 2]

    def mean_profile(self) -> np.ndarray:  # [L*E]
        return self.reservoir.mean()

    def live_fit(self) -> tuple[float, float, int] | None:
        """(the predictions' mean overlap, the mean profile's, how many) over the most recent observations."""
        if not self._fit_recent:
            return None
        head, mean = np.mean(np.asarray(self._fit_recent), axis=0)
        return float(head), float(mean), len(self._fit_recent)

    # ---- persistence -----------------------------------------------------------------------------

    def save_when_due(self, folder: str | Path, now: float) -> bool:
        """`save` to `folder` unless it saved less than `save_every_s` before `now` (monotonic seconds); whether it did."""
        if now - self.saved_at < self.config.save_every_s:
            return False
        self.save(folder)
        self.saved_at = now
        return True

    def save(self, folder: str | Path) -> None:
        """Write the reservoir and the head to `folder` (each file replaced atomically)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        if self.head is not None:
            tmp = folder / ".tmp"
            os.replace(self.head.save(tmp), folder / HEAD_FILE)
            tmp.rmdir()
        r = self.reservoir
        meta = {"key": self.key, "observed": self.observed, "seen": r.seen, "size": r.size, "shape": self.shape,
                "fitted_on": self.fitted_on, "fitted_at": self.fitted_at, "stored_at_fit": self.stored_at_fit,
                "stored": r.stored, "rng": r.rng.bit_generator.state, "coin": r.coin.bit_generator.state}
        arrays = {"meta": np.array(json.dumps(meta))}
        if r.features is not None:
            arrays.update(features=r.features[: r.size].astype(np.float16), profiles=r.profiles[: r.size].astype(np.float16))
        part = folder / (RESERVOIR_FILE + ".part")
        with open(part, "wb") as fh:
            np.savez(fh, **arrays)
        os.replace(part, folder / RESERVOIR_FILE)

    @classmethod
    def load(cls, folder: str | Path, config: LearnConfig = LearnConfig(), key: str = "") -> OnlineLearner:
        """The learner saved in `folder`; a fresh one when there is none or it was learned with another `key`."""
        learner, path = cls(config, key), Path(folder) / RESERVOIR_FILE
        if not path.is_file():
            return learner
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if meta["key"] != key:
                log.warning("%s was learned with %r, not %r: starting afresh", path, meta["key"], key)
                return learner
            if not STATE_KEYS <= meta.keys():
                log.warning("%s was saved by an older moe-cohort (no %s): starting afresh", path,
                            ", ".join(sorted(STATE_KEYS - meta.keys())))
                return learner
            if meta["size"]:
                r, keep = learner.reservoir, min(meta["size"], config.capacity)
                r.allocate(z["features"].shape[1], z["profiles"].shape[1])
                r.features[:keep], r.profiles[:keep] = z["features"][:keep], z["profiles"][:keep]
                r.size, r.total = keep, r.profiles[:keep].sum(axis=0, dtype=np.float64)
        r = learner.reservoir
        learner.observed, learner.fitted_on, learner.fitted_at = meta["observed"], meta["fitted_on"], meta["fitted_at"]
        r.seen, r.stored, learner.stored_at_fit = meta["seen"], meta["stored"], meta["stored_at_fit"]
        r.rng.bit_generator.state, r.coin.bit_generator.state = meta["rng"], meta["coin"]
        learner.shape = tuple(meta["shape"]) if meta["shape"] else None
        learner.head = load_profile_head(folder) if learner.fitted_on else None
        log.info("online profile head: loaded %d observations (%d seen)%s from %s", learner.reservoir.size,
                 learner.reservoir.seen, ", and the head fitted on them" if learner.head else "", folder)
        return learner


def _overlap(predicted: np.ndarray, observed: np.ndarray) -> float:
    """sum min(p, o) / sum o: the share of the observed profile's mass the prediction covers."""
    return float(np.minimum(predicted, observed).sum() / max(float(observed.sum()), 1e-12))

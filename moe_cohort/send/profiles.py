"""What the proxy predicts of a request on arrival, for admission: its expert profile (or its embedding).

`make_predictor(settings)`: the settings' EncoderPredictor (encoder + profile head), which `follow`s the
online learner's head once the proxy's learning is built; None with `--encoder none` (no prediction, first
come, first served). `Predictor` is what admission asks of either.

Pure of asyncio and HTTP: the online gate (send/gate.py) runs `predict` in a worker
thread; a batch run (batch/order.py) calls it once over the whole file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
from collections import OrderedDict
from typing import Callable, Protocol, Sequence

import numpy as np

from moe_cohort.admission.resident import Resident, ResidentEmbedding, ResidentExperts
from moe_cohort.admission.router import ResidentFactory
from moe_cohort.admission.wire import Prediction
from moe_cohort.encoder.ngrams import DEFAULT_NGRAM_DIM
from moe_cohort.encoder.profile import ProfileHead
from moe_cohort.send.settings import Settings

log = logging.getLogger(__name__)

STATIC_DEADLINE_S, MODEL_DEADLINE_S = 0.05, 0.5  # Predictor.deadline_s of a static and of a transformer encoder
# texts -> per text its Prediction: a flat predicted profile [L*E] and its compact form with a profile
# head, else a unit embedding [D]; None for a text that got no prediction
PredictFn = Callable[[Sequence[str]], list[Prediction | None]]


class Learned(Protocol):
    """What a predictor reads of the online learning it follows (send.learning.learning.Learning), per prediction."""

    @property
    def head(self) -> ProfileHead | None: ...  # the latest learned head; None before the first, or not learning

    @property
    def on(self) -> bool | None: ...  # whether learning is on: False never, None not decided yet


class FixedHead:
    """A profile head that does not change, followed by a predictor as a learned one (Learned): a head an earlier run
    learned when this one does not learn, or a folder's head given to the Ray Serve router."""

    def __init__(self, head: ProfileHead) -> None:
        self.head, self.on = head, True

    @classmethod
    def from_folder(cls, folder: str) -> FixedHead:
        from moe_cohort.encoder.profile import load_profile_head

        head = load_profile_head(folder)
        if head is None:
            raise ValueError(f"head: {folder} holds no expert_profile_head.npz; give a `cohort train` folder or a "
                             f"proxy's --data-dir/learned after its first refit")
        return cls(head)


def encoder_problem(settings: Settings) -> str | None:
    """What is wrong with the settings' encoder (an absent folder, an unreachable hub model), checked before
    any work; None when it will load. `static` is distilled on first use."""
    if settings.encoder.lower() in ("none", "static"):
        return None
    from moe_cohort.encoder.embedding import EncoderNotFound, check_available, resolve_model

    try:
        check_available(resolve_model(settings.encoder or None))
    except EncoderNotFound as exc:
        return f"--encoder (COHORT_ENCODER): {exc}"
    return None


def limit_threads(threads: int) -> None:
    """Let this process's encoder use at most `threads` CPU threads: torch's intra-op pool, the BLAS
    libraries loaded so far (threadpoolctl), the tokenizer's batch parallelism. For the proxy's process,
    after its encoder loaded: a request is embedded alone or in a small batch, where more threads
    gain little and their spinning takes the event loop's core (one thread costs less CPU per request
    than the default pools: docs/results.md)."""
    from threadpoolctl import threadpool_limits

    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    if "torch" in sys.modules:  # loaded with the encoder; an ONNX encoder or none does not need it
        sys.modules["torch"].set_num_threads(threads)
    threadpool_limits(limits=threads)


class Predictor:
    """What admission asks of a request's prediction on arrival (the online gate, a batch's order, /health). This
    one predicts with the functions it is given (a fixed predictor: tests, a cache over another predictor's
    answers); EncoderPredictor predicts with the settings' encoder."""

    def __init__(self, predict: PredictFn, resident_factory: ResidentFactory, kind: str,
                 deadline_s: float = STATIC_DEADLINE_S) -> None:
        self._predict, self._resident_factory = predict, resident_factory
        self.kind = kind  # "profile" or "embedding": what `predict` returns
        # how long a request may wait for its prediction by default: a static encoder embeds almost at once, a
        # transformer on one CPU thread takes far longer per prompt (Settings.profile_deadline_ms: 0)
        self.deadline_s = deadline_s

    def predict(self, texts: Sequence[str]) -> list[Prediction | None]:
        return self._predict(texts)

    def resident_factory(self, size: int) -> Resident:
        """The resident set that scores what `predict` returns now (vectors of `size`)."""
        return self._resident_factory(size)

    def mode(self) -> str:
        """What admission runs on now (/health)."""
        return "embeddings" if self.kind == "embedding" else "profiles"

    def ready(self) -> bool:
        """Whether `predict` would predict anything now (else: none, first come, first served)."""
        return True


class EncoderPredictor(Predictor):
    """The settings' encoder, with the profile head its folder holds (`cohort train` writes
    `expert_profile_head.npz` beside a fine-tuned encoder), and the online learner's head once it `follow`s one.
    Loaded once per process (at start-up, not on the first request). A profile head predicts each request's
    per-layer expert frequencies [L, E]: admission then minimises expected new experts (ResidentExperts), and
    the compact profile is forwarded as `vllm_xargs.moe_profile` for an engine-side scheduler. Without a head,
    admission falls back to the nearest embedding (ResidentEmbedding)."""

    def __init__(self, settings: Settings, threads: int | None = None) -> None:
        """`threads`: an ONNX encoder's threads (default: one per core; torch's are set by `limit_threads`).
        Every method of Predictor is overridden here, so none of its functions are passed up."""
        from moe_cohort.encoder.embedding import Embedder
        from moe_cohort.encoder.profile import load_profile_head

        self._embedder = Embedder(settings.encoder or None, max_seq_len=settings.encoder_max_seq_len,
                                  cache_size=settings.encoder_cache, threads=threads)
        self._trained = load_profile_head(self._embedder.source)
        log.info("encoder loaded: %s (%s)", self._embedder.source,
                 "with a profile head: admission by expected new experts" if self._trained
                 else "no profile head: nearest embedding")
        self._lock = threading.Lock()  # online admission and Batch API jobs predict from different threads; tokenizers are not re-entrant
        self._learning: Learned | None = None
        self._recent: RecentFeatures | None = None  # kept while following a learner
        self.deadline_s = STATIC_DEADLINE_S if self._embedder.static else MODEL_DEADLINE_S

    def follow(self, learning: Learned) -> None:
        """Predict with `learning.head` (read per prediction) once there is one: it wins over the folder's head;
        until then the folder's head or, without one, no prediction (first come, first served). `learning.on`
        False: learning was turned off (send/autoconfig.py), so without a folder's head admission reads
        embeddings instead of waiting for a learned head; None: not decided yet (no prediction). Each text's
        features and prediction are kept for the learner from now on (`features`)."""
        self._learning, self._recent = learning, RecentFeatures()

    @property
    def kind(self) -> str:
        return "embedding" if self._trained is None and self._learning is None else "profile"

    def predict(self, texts: Sequence[str]) -> list[Prediction | None]:
        current = self._head()
        if current is None:
            return [None] * len(texts) if self._awaits_learning() else [Prediction(row) for row in self._embed(texts)]
        keep = self._recent is not None and current.ngram_dim == DEFAULT_NGRAM_DIM
        # texts predicted lately (again by a newer head) from their kept features, the others read now
        f = self._kept_or_read(texts)[0] if keep else self._read(texts, current.ngram_dim)  # [N, F]
        flat = current.from_features(f)  # [N, L*E]
        if keep:
            self._recent.put(texts, f, flat)
        shape = (current.num_layers, current.num_experts)
        return [Prediction.of_profile(p.reshape(shape)) for p in flat]

    def features(self, texts: Sequence[str]) -> tuple[np.ndarray, list[np.ndarray | None]]:
        """What a learned head reads of `texts` [N, F] (train.online.LearnConfig's n-grams), and each text's profile
        as predicted on its arrival [L*E] (None: not at hand): kept ones for texts predicted lately."""
        if self._recent is None:
            return self._read(texts, DEFAULT_NGRAM_DIM), [None] * len(texts)
        return self._kept_or_read(texts)

    def ready(self) -> bool:
        return self._head() is not None or not self._awaits_learning()

    def mode(self) -> str:
        if self._learning is not None and self._learning.head is not None:
            return "learned head"
        if self._trained is not None:
            return "trained head"
        return "first come, first served until the first learned head" if self._awaits_learning() else "embeddings"

    def resident_factory(self, size: int) -> Resident:
        if self._trained is None and not self._awaits_learning():
            return ResidentEmbedding(size)
        return ResidentExperts(1, size)

    def _head(self) -> ProfileHead | None:
        return (self._learning.head if self._learning is not None else None) or self._trained

    def _awaits_learning(self) -> bool:
        """No head yet, and one is being learned (or may be): first come, first served."""
        return self._learning is not None and self._learning.on is not False

    def _embed(self, texts: Sequence[str]) -> np.ndarray:  # [N, D] float32, L2-normalised
        with self._lock:
            return self._embedder.encode(list(texts))

    def _read(self, texts: Sequence[str], ngram_dim: int) -> np.ndarray:  # [N, F]
        from moe_cohort.encoder.profile import head_features

        return head_features(self._embed(texts), list(texts), ngram_dim)

    def _kept_or_read(self, texts: Sequence[str]) -> tuple[np.ndarray, list[np.ndarray | None]]:
        """([N, F] features, N predictions or None): kept ones from `_recent`, the rest read from the texts now."""
        found = self._recent.get(texts)
        missing = [texts[i] for i, item in enumerate(found) if item is None]
        rows = iter(self._read(missing, DEFAULT_NGRAM_DIM) if missing else ())  # [M, F]
        f = np.stack([next(rows) if item is None else item[0].astype(np.float32) for item in found])  # [N, F]
        return f, [None if item is None else item[1] for item in found]


def make_predictor(settings: Settings, threads: int | None = None) -> EncoderPredictor | None:
    """The settings' encoder predictor; None with `--encoder none` (no prediction: first come, first served)."""
    return None if settings.encoder.lower() == "none" else EncoderPredictor(settings, threads)


class RecentFeatures:
    """The head features [F] and predicted profile [L*E] of the last `size` texts predicted, by text digest: the
    online learner pairs them with the request's observed profile when its answer is in, without reading the
    text again (its n-grams cost more than the rest of learning from it) and with the prediction admission used
    (its live fit). Features are kept as float16, half the memory of float32."""

    def __init__(self, size: int = 2048) -> None:
        self.size = size
        self._items: OrderedDict[bytes, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()  # put from the predicting thread, get from the learning one

    def put(self, texts: Sequence[str], f: np.ndarray, predicted: np.ndarray) -> None:
        with self._lock:
            for text, row, p in zip(texts, f.astype(np.float16), predicted):
                key = _digest(text)
                self._items[key] = (row, p)
                self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get(self, texts: Sequence[str]) -> list[tuple[np.ndarray, np.ndarray] | None]:
        """Per text its (features [F] float16, predicted profile [L*E]) entry, None where there is none."""
        with self._lock:
            return [self._items.get(_digest(t)) for t in texts]


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()

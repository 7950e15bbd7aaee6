"""What the proxy predicts of a request on arrival, for admission: its expert profile (or its embedding).

`make_predictor(settings)` loads the encoder once per process (at start-up, not on the first
request) and, when the encoder's folder holds a profile head (`cohort train` writes
`expert_profile_head.npz` beside a fine-tuned encoder), predicts each request's per-layer expert
frequencies [L, E]: admission then minimises expected new experts (`ResidentExperts`), and the
compact profile is forwarded as `vllm_xargs.moe_profile` for an engine-side scheduler. Without a
head, admission falls back to the nearest embedding (`ResidentEmbedding`). `--encoder none`:
no prediction, first come, first served.

Pure of asyncio and HTTP: the online gate (proxy/gate.py) runs `predict` in a worker
thread; a batch run (proxy/batch/order.py) calls it once over the whole file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from moe_cohort.admission.resident import ResidentEmbedding, ResidentExperts
from moe_cohort.admission.router import ResidentFactory
from moe_cohort.admission.wire import Prediction
from moe_cohort.encoder.ngrams import DEFAULT_NGRAM_DIM
from moe_cohort.encoder.profile import ProfileHead
from moe_cohort.proxy.settings import Settings

log = logging.getLogger(__name__)

STATIC_DEADLINE_S, MODEL_DEADLINE_S = 0.05, 0.5  # Predictor.deadline_s of a static and of a transformer encoder
# texts -> per text its Prediction: a flat predicted profile [L*E] and its compact form with a profile
# head, else a unit embedding [D]; None for a text that got no prediction
PredictFn = Callable[[Sequence[str]], list[Prediction | None]]


@dataclass(frozen=True)
class Predictor:
    predict: PredictFn
    resident_factory: ResidentFactory  # vector size -> the resident set that scores such vectors
    kind: str  # "profile" or "embedding"
    # texts -> ([N, F] what a learned head reads, each text's profile predicted on arrival [L*E] or None)
    features: Callable[[Sequence[str]], tuple[np.ndarray, list[np.ndarray | None]]] | None = None
    mode: Callable[[], str] = lambda: "embeddings"  # what admission runs on now (/health)
    ready: Callable[[], bool] = lambda: True  # whether `predict` would predict anything now (else: none, FCFS)
    # how long a request may wait for its prediction by default: a static encoder embeds in microseconds, a
    # transformer on one CPU thread takes tens of milliseconds a prompt (Settings.profile_deadline_ms: 0)
    deadline_s: float = 0.05


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
    gain little and their spinning takes the event loop's core (one thread costs less than half the
    CPU per request of the default pools: docs/results.md)."""
    from threadpoolctl import threadpool_limits

    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    if "torch" in sys.modules:  # loaded with the encoder; an ONNX encoder or none does not need it
        sys.modules["torch"].set_num_threads(threads)
    threadpool_limits(limits=threads)


def make_predictor(settings: Settings, threads: int | None = None,
                   learned: Callable[[], ProfileHead | None] | None = None,
                   learning_on: Callable[[], bool | None] = lambda: True) -> Predictor | None:
    """The encoder (+ profile head) of the settings; None with `--encoder none`. `threads`: an ONNX
    encoder's threads (default: one per core; torch's are set by `limit_threads`). `learned`: the online
    learner's latest head (proxy.learning), read per prediction; it wins over the folder's head once there
    is one, and until then the folder's head or, without one, no prediction (first come, first served).
    `learning_on()` False: learning was turned off (proxy/autoconfig.py), so without a folder's head
    admission reads embeddings instead of waiting for a learned head; None: not decided yet (no prediction)."""
    if settings.encoder.lower() == "none":
        return None
    from moe_cohort.encoder.embedding import Embedder
    from moe_cohort.encoder.profile import head_features, load_profile_head

    embedder = Embedder(settings.encoder or None, max_seq_len=settings.encoder_max_seq_len,
                        cache_size=settings.encoder_cache, threads=threads)
    trained = load_profile_head(embedder.source)
    log.info("encoder loaded: %s (%s)", embedder.source,
             "with a profile head: admission by expected new experts" if trained else "no profile head: nearest embedding")
    lock = threading.Lock()  # online admission and Batch API jobs predict from different threads; tokenizers are not re-entrant

    def embed(texts: Sequence[str]) -> np.ndarray:  # [N, D] float32, L2-normalised
        with lock:
            return embedder.encode(list(texts))

    def head() -> ProfileHead | None:
        return (learned() if learned else None) or trained

    recent = RecentFeatures() if learned is not None else None

    def awaits_learning() -> bool:  # no head yet, and one is being learned (or may be): first come, first served
        return learned is not None and learning_on() is not False

    def ready() -> bool:
        return head() is not None or not awaits_learning()

    def predict(texts: Sequence[str]) -> list[Prediction | None]:
        current = head()
        if current is None:
            return [None] * len(texts) if awaits_learning() else [Prediction(row) for row in embed(texts)]
        learning = recent is not None and current.ngram_dim == DEFAULT_NGRAM_DIM
        # texts predicted lately (again by a newer head) from their kept features, the others read now
        f = kept_or_read(recent, texts)[0] if learning else head_features(embed(texts), list(texts), current.ngram_dim)
        flat = current.from_features(f)  # [N, L*E]
        if learning:
            recent.put(texts, f, flat)
        shape = (current.num_layers, current.num_experts)
        return [Prediction.of_profile(p.reshape(shape)) for p in flat]

    def features(texts: Sequence[str]) -> tuple[np.ndarray, list[np.ndarray | None]]:
        """What a learned head reads of `texts` [N, F] (train.online.LearnConfig's n-grams), and each text's profile
        as predicted on its arrival [L*E] (None: not at hand): from `recent` when the texts were predicted lately."""
        if recent is None:
            return head_features(embed(texts), list(texts), DEFAULT_NGRAM_DIM), [None] * len(texts)
        return kept_or_read(recent, texts)

    def kept_or_read(recent: RecentFeatures, texts: Sequence[str]) -> tuple[np.ndarray, list[np.ndarray | None]]:
        """([N, F] features, N predictions or None): kept ones from `recent`, the rest read from the texts now."""
        found = recent.get(texts)
        missing = [i for i, item in enumerate(found) if item is None]
        read = head_features(embed([texts[i] for i in missing]), [texts[i] for i in missing],
                             DEFAULT_NGRAM_DIM) if missing else None  # [M, F]
        rows = iter(() if read is None else read)
        f = np.stack([next(rows) if item is None else item[0].astype(np.float32) for item in found])  # [N, F]
        return f, [None if item is None else item[1] for item in found]

    def mode() -> str:
        if learned is not None and learned() is not None:
            return "learned head"
        return "trained head" if trained else "first come, first served until the first learned head" \
            if awaits_learning() else "embeddings"

    def resident(size: int):  # the resident set that scores what `predict` returns now
        return ResidentEmbedding(size) if trained is None and not awaits_learning() else ResidentExperts(1, size)

    kind = "embedding" if trained is None and learned is None else "profile"
    return Predictor(predict, resident, kind, features, mode, ready, STATIC_DEADLINE_S if embedder.static
                     else MODEL_DEADLINE_S)


class RecentFeatures:
    """The head features [F] and predicted profile [L*E] of the last `size` texts predicted, by text digest: the
    online learner pairs them with the request's observed profile when its answer is in, without reading the
    text again (its n-grams cost more than the rest of learning from it) and with the prediction admission used
    (its live fit). float16 features: ~9 KB a text with the default n-grams, 2,048 texts ~18 MB."""

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

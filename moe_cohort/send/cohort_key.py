"""The cohort key: one number per request that alike requests share, sent to the backend as `x-cohort-key`.

Routers in front of several vLLM replicas can use it without knowing anything about experts: an
Endpoint Picker of the Gateway API Inference Extension (llm-d's scheduler) orders its flow-control
queue by numbers in a request's `ordering.custom` metadata (`custom-data-ordering-policy`), and an
affinity scorer can send equal keys to the same replica (README, "llm-d").

The proxy's per-request knowledge is the admission's prediction (admission.wire.Prediction): its vector
is the predicted expert profile [L*E] with a profile head, else the prompt's unit embedding [D]. The
key is its SimHash: bit i is the sign of the vector's projection on the i-th of `bits` fixed random
directions (seeded by the vector's length, so every proxy process gives a vector the same key).
Vectors at a small angle share most bits; sorting by the key groups equal keys and puts keys that
agree on their leading bits (the same side of the first hyperplanes) next to each other. Each
vector is centred first (its mean removed): expert profiles are all non-negative, and without the
centring their common component would make most bits the same for every request.

Pure: numpy only; no HTTP (the caller adds the header to what it sends).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from moe_cohort.admission.wire import Prediction

HEADER = "x-cohort-key"
DEFAULT_BITS = 16  # keys in [0, 65536): exact in the float64 an ordering policy compares
_SEED = 0x5EED


def cohort_key(vector: np.ndarray, bits: int = DEFAULT_BITS) -> int:
    """The SimHash of `vector` ([N] float, any N >= 1) as an integer in [0, 2**bits)."""
    x = np.asarray(vector, dtype=np.float64).ravel()  # [N]
    if x.size == 0 or not np.all(np.isfinite(x)):
        raise ValueError(f"a cohort key needs a non-empty finite vector, got shape {np.shape(vector)}")
    signs = _planes(x.size, bits) @ (x - x.mean()) >= 0  # [bits]
    return int(signs.astype(np.int64) @ (1 << np.arange(bits - 1, -1, -1, dtype=np.int64)))


def cohort_key_header(prediction: Prediction | None) -> dict[str, str]:
    """`{"x-cohort-key": "<int>"}` for a request with a prediction; {} without one (no encoder, or predicted late)."""
    return {} if prediction is None else {HEADER: str(cohort_key(prediction.vector))}


@lru_cache(maxsize=8)
def _planes(size: int, bits: int) -> np.ndarray:
    """[bits, size] fixed random directions for vectors of length `size`."""
    if not 1 <= bits <= 52:
        raise ValueError(f"bits must be in 1..52 (a float64 holds the key exactly), got {bits}")
    return np.random.default_rng([_SEED, size]).standard_normal((bits, size))

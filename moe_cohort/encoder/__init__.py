"""Text -> embeddings (encoder.embedding) and embeddings -> batches and their order (encoder.planner).

`encoder_plan` is the one call that `cohort eval` and the proxy need: prompt texts in, a plan out.
Importing this package loads neither torch nor FAISS; they load when a function needs them.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def embed_texts(texts: Sequence[str], *, encoder: str | None = None, max_seq_len: int | None = None,
                progress: bool = False) -> np.ndarray:
    """L2-normalised float32 embeddings [N, D] of `texts` with the encoder `encoder` (default: packaged MiniLM)."""
    from moe_cohort.encoder.embedding import Embedder

    return Embedder(encoder, max_seq_len=max_seq_len).encode(list(texts), progress=progress)


def encoder_plan(texts: Sequence[str], batch_size: int, *, encoder: str | None = None, seed: int = 0,
                 max_seq_len: int | None = None, progress: bool = False) -> list[np.ndarray]:
    """Batches (int64 arrays of indices into `texts`, at most `batch_size` each) planned from the texts alone.

    Embeds with `encoder` (a local folder, a hub name, or None for the packaged all-MiniLM-L6-v2) and
    runs `encoder.planner.plan_batches` with its defaults. See encoder.plans.Plan.
    """
    from moe_cohort.encoder.planner import plan_batches

    x = embed_texts(texts, encoder=encoder, max_seq_len=max_seq_len, progress=progress)  # [N, D]
    return plan_batches(x, batch_size, seed=seed)

"""The batcher's plan function: texts -> batches of indices, from the encoder and the planner.

Built once per process from the settings; the encoder model is loaded here, at start-up, not on
the first request.
"""

from __future__ import annotations

import logging
import threading
from typing import Sequence

from encoder.plans import Plan, arrival_plan
from proxy.batcher import PlanFn
from proxy.settings import Settings

log = logging.getLogger(__name__)


def arrival_batches(texts: Sequence[str], batch_size: int) -> Plan:
    """Batches in arrival order: the plan when no encoder is configured."""
    return arrival_plan(len(texts), batch_size)


def make_plan_fn(settings: Settings) -> PlanFn:
    """Embed with the configured encoder and plan with encoder.planner; 'none' = arrival order."""
    if settings.encoder.lower() == "none":
        return arrival_batches
    from encoder.embedding import Embedder
    from encoder.planner import plan_batches

    embedder = Embedder(settings.encoder or None, max_seq_len=settings.encoder_max_seq_len)
    log.info("encoder loaded: %s", embedder.source)
    lock = threading.Lock()  # the batcher and Batch API jobs plan from different threads; fast tokenizers are not re-entrant

    def plan_fn(texts: Sequence[str], batch_size: int) -> list[Sequence[int]]:
        with lock:
            embeddings = embedder.encode(list(texts))  # [N, D] float32, L2-normalised
            return plan_batches(embeddings, batch_size, seed=settings.seed)

    return plan_fn

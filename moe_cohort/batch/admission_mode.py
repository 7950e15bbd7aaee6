"""How a batch run admits its lines, worked out once: the order `BatchCore` starts with, the task that runs beside
the sends (probing the prompts, following later heads, or handing a sample over to admission), and the words the
run's log line says it with.

- probed (`config.probe`, one backend, no gate): admission by the engine's routing of each prompt, probed while
  the lines go (batch/probe.py);
- file order without a predictor;
- admission by the predicted profiles of every line, predicted here, when the predictor can predict now; with
  `learning`, each later head re-predicts the lines next in line (batch/follow.follow_heads);
- otherwise (the encoder loading, or no head while one is learned) a sample drawn from across the file, then
  admission (batch/follow.order_after).
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence, TypeVar

from moe_cohort.batch.core import BatchCore, RunConfig
from moe_cohort.batch.follow import follow_heads, order_after, sample_size
from moe_cohort.batch.format import BatchRequest
from moe_cohort.batch.order import FileOrder, Order, SpreadOrder, make_order
from moe_cohort.batch.probe import probed_order
from moe_cohort.send.backend_client import BackendClient
from moe_cohort.send.learning.learning import Learning
from moe_cohort.send.profiles import Predictor

T = TypeVar("T")


@dataclass(frozen=True)
class AdmissionMode:
    """A run's order, the task beside its sends (None: none), and what the log says the order is."""

    order: Order
    follow: Callable[[], Awaitable[None]] | None
    description: str


async def admission_mode(core: BatchCore, pending: Sequence[BatchRequest],
                         predictor: Predictor | Awaitable[Predictor] | None, config: RunConfig, *, probe_client: BackendClient | None, headers: dict[str, str],
                         learning: Learning | None, background: Callable[..., Awaitable], seed: int) -> AdmissionMode:
    """The admission of `core`'s `pending` lines: probed on `probe_client` (with `headers`) when `config.probe` and
    a client is given, else by `predictor` (send/profiles.py, an awaitable of one still loading, or None: file
    order). `background` runs the predictions (the learning worker, behind serving); `seed` draws the sample."""
    if config.probe and probe_client is not None:
        order, follow = probed_order(pending, probe_client, core.stats, config.max_in_flight, headers)
        return AdmissionMode(order, follow, "admission order by the engine's routing of each prompt")
    if predictor is None:
        return AdmissionMode(FileOrder(), None, "file order")
    if not inspect.isawaitable(predictor) and predictor.ready():
        order = await asyncio.to_thread(make_order, pending, predictor, config.max_in_flight)
        follow = None if learning is None else (
            lambda: follow_heads(lambda: learning.head, predictor.predict, order, lambda: core.waiting, background))
        return AdmissionMode(order, follow, "admission order")
    # no prediction yet (the encoder loading, or no head learned): a sample first
    sample = sample_size(learning.learner.config.first_fit if learning else 2, len(pending))
    return AdmissionMode(
        SpreadOrder((r.line for r in pending), seed=seed),
        lambda: order_after(core, predictor if inspect.isawaitable(predictor) else _now(predictor), learning,
                            sample=sample, run=background),
        "a sample drawn from across the file until there are predictions, then admission order")


async def _now(value: T) -> T:
    return value

"""A batch's order as the run learns: learn first from a sample of the file, then order the rest; follow later heads.

A batch knows every line before it starts, but a run with no profile head yet (a fresh `--data-dir`, learning
on) cannot predict them. So it sends a sample first (`SpreadOrder`: a seeded permutation of the file, so the
first lines sent are drawn from across it) while the engine counts each answer's experts, and `order_after`
runs beside the sends:

1. it waits for the predictor (`cohort batch run` loads the encoder while the sample goes out) and, when a
   head is being learned and none is there yet, for the first answers' observations (as many as the learner's
   first head needs: the earlier the hand-over, the more of the file is ordered, and later heads fit better);
   it then fits the head on them on the learning worker and saves it, so a run resumed after a kill orders
   from its first line;
2. it predicts every waiting line and hands the order over (`ExpertOrder.taking_over`): from then on a freed
   slot takes the waiting line that best fits the requests out, the whole remaining file being the pool;
3. with learning, `follow_heads`: each later head re-predicts the lines next in line.

Until the hand-over the sample simply grows (freed slots take the permutation's next lines), so the engine
never waits for the head. Without learning counts (a plain vLLM) no observation comes and the file goes in the
permutation's order, which is as good as file order for the engine.

`follow_heads` looks, every FOLLOW_S, at the first `window` waiting requests (the ones admission chooses from,
batch/order.py); when one of them was not predicted by the current head, it predicts the next
2 x `window` waiting requests that the current head has not, on the learning worker, and hands them to
`ExpertOrder.predicted`, which re-scores the waiting ones in place. So a file of any size costs one prediction
per request per head it waits through near the front, never the whole file per head.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Sequence

from moe_cohort.admission.wire import Prediction
from moe_cohort.batch.format import BatchRequest
from moe_cohort.batch.order import ExpertOrder

log = logging.getLogger(__name__)

FOLLOW_S = 0.5
SAMPLE_POLL_S = 0.05  # how often the sample's observations are counted (the hand-over should not lag them)
BATCH_REFIT_EVERY = 16  # `cohort batch run` refits after this many new observations (the online proxy: 50)
Predict = Callable[[Sequence[str]], list[Prediction | None]]


def sample_size(first_fit: int, pending: int) -> int:
    """How many observations a run with no head learns from before it orders the rest of `pending` lines: the
    learner's first head's (`first_fit`), a quarter of the file at most."""
    return max(2, min(first_fit, pending // 4))


async def follow_heads(head: Callable[[], object], predict: Predict, order: ExpertOrder,
                       waiting: Callable[[], Sequence[BatchRequest]],
                       run: Callable[..., Awaitable] = asyncio.to_thread) -> None:
    """Until cancelled: predict the requests next in line (`waiting()`, in file order) again with each new
    `head()` (None: no head yet) through `predict` (called by `run`: the learning worker, behind serving), and
    refresh `order` with them."""
    current, fresh = None, set()  # the head the lines in `fresh` were predicted by
    while True:
        await asyncio.sleep(FOLLOW_S)
        latest = head()
        if latest is None:
            continue
        if latest is not current:
            current, fresh = latest, set()
        if all(r.line in fresh for r in waiting()[: order.window]):
            continue
        todo = [r for r in waiting()[: 2 * order.window] if r.line not in fresh]
        predicted = await run(predict, [r.text for r in todo])
        order.predicted({r.line: p for r, p in zip(todo, predicted)})
        fresh.update(r.line for r in todo)


async def order_after(core, predictor: Awaitable, learning, *, sample: int,
                      run: Callable[..., Awaitable] = asyncio.to_thread) -> None:
    """Beside the sends of `core` (batch/core.BatchCore, sending in a SpreadOrder): once `predictor`
    (awaited: send.profiles.Predictor) can predict, after `sample` new observations of `learning`
    (send.learning.learning.Learning) when it can only once a head is learned, hand `core` over to admission by the
    predicted profiles of every waiting line; then follow the later heads. `run` calls the predictions (the
    learning worker, behind serving)."""
    predictor = await predictor
    if not predictor.ready():  # no head yet, and one is being learned: learn first, from the sample
        start = learning.learner.observed
        while learning.learner.observed - start < sample:
            await asyncio.sleep(SAMPLE_POLL_S)
        await learning.fit_now()
        log.info("learned a head from %d observations of this file's first answers; ordering the rest",
                 learning.learner.observed - start)
    lines = {r.line: r for r in [*core.waiting, *core.out.values()]}
    predicted = dict(zip(lines, await run(predictor.predict, [r.text for r in lines.values()])))
    waiting = {r.line: predicted[r.line] for r in core.waiting}  # sends went on meanwhile
    out = {line: predicted.get(line) for line in core.out}
    order = ExpertOrder.taking_over(waiting, out, predictor.resident_factory, core.config.max_in_flight)
    core.order = order
    log.info("%d requests waiting, ordered by %s", len(waiting), predictor.mode())
    if learning is not None:
        await follow_heads(lambda: learning.head, predictor.predict, order, lambda: core.waiting, run)

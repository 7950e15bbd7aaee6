"""A learning batch run gets better as it runs: each new profile head re-predicts the requests next in line.

With learning (`cohort batch run --learn`, the Batch API of `cohort serve --learn`: proxy/learning.py)
the run's answers teach the online learner, which swaps in a new head now and then. `follow_heads`
runs beside the sends: every FOLLOW_S it looks at the first `window` waiting requests (the ones
admission chooses from, proxy/batch/order.py); when one of them was not predicted by the current head
(an older head's, or none: before the first head a learning run goes first come, first served), it
predicts the next 2 x `window` waiting requests that the current head has not, on the learning worker, and
hands them to `ExpertOrder.refresh`, which re-scores the waiting ones in place. So a file of any size
costs one prediction per request per head it waits through near the front, never the whole file per head.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Sequence

from moe_cohort.admission.wire import Prediction
from moe_cohort.proxy.batch.format import BatchRequest
from moe_cohort.proxy.batch.order import ExpertOrder

FOLLOW_S = 0.5


async def follow_heads(head: Callable[[], object], predict: Callable[[Sequence[str]], list[Prediction | None]],
                       order: ExpertOrder, waiting: Callable[[], Sequence[BatchRequest]],
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
        order.refresh({r.line: None if p is None else p.vector for r, p in zip(todo, predicted)})
        fresh.update(r.line for r in todo)

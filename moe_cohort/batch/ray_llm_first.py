"""A cold Ray Data LLM run's schedule: learn first from a sample, then hand the rest over in parts, each ordered by
the latest head (batch/follow.py's schedule for `cohort batch run`, in the parts a Dataset can be read in).

`learn_first_split` draws the rows sent before any head: a sample from across the Dataset and an engine-full behind
it. `hand_over` runs on a driver thread beside the execution: when each part is due (`due_at`) it refits
the head on every count the engine took so far and gives the observation box (batch/ray_llm_box.py) the rows
admission by that head sends first, with their profiles; the Dataset's read task for that part waits for them.
Nothing here imports Ray: batch/ray_llm.py passes the box's calls in.
"""

from __future__ import annotations

import logging
import math
import random
import time
from typing import Callable

log = logging.getLogger(__name__)

AHEAD_PARTS = 2  # parts out before the next is handed over: the engine's and one in Ray Data's stages

Part = tuple[list[int], list[list[int]]]  # rows in sending order, their compact profiles


def learn_first_split(n: int, sample: int, engine_rows: int, batch: int) -> tuple[list[int], list[int]]:
    """(the rows of `n` a learn-first run sends before its hand-over, the rest): `sample` rows and `engine_rows`
    more (what the engine holds, so that it stays fed while the head is fitted), in whole batches of `batch` (a
    stage waits for a whole batch), drawn from across the Dataset (a seeded permutation)."""
    lead = math.ceil((sample + engine_rows) / batch) * batch
    spread = list(range(n))
    random.Random(n).shuffle(spread)
    return spread[:lead], spread[lead:]


def part_sizes(rest: int, size: int) -> list[int]:
    """`rest` rows in parts of `size`, the last one less."""
    return [min(size, rest - k) for k in range(0, rest, size)]


def due_at(k: int, out: int, sample: int, size: int) -> tuple[int | None, int]:
    """When part `k` (of `size` rows) is due, `out` rows sent so far: (rows counted and not yet learned from, rows
    finished), whichever comes first (None: counts do not matter). The first part once the sample is counted (or
    every row out finished); each later one once no more than AHEAD_PARTS parts' rows are out, so that it is
    ordered by the latest head and still reaches the engine before it runs dry."""
    if k == 0:
        return sample, out
    return None, out - AHEAD_PARTS * size


def hand_over(until: Callable[[int | None, int], tuple[int, int]],
              give: Callable[[int, list[int], list[list[int]]], None], rest: list[int], size: int, sample: int,
              sent: int, fit: Callable[[], None], order: Callable[[list[int], int], Part]) -> None:
    """Give the parts of `rest` (`give(k, rows, profiles)`: to the observation box), `sent` rows having gone first
    and `until(counted, finished)` returning (rows counted and not yet learned from, rows finished) once either
    reaches its bound: when each is due (`due_at`), `fit()` (learn from the counts), then `order(remaining, size)`
    chooses and profiles the part. Whatever fails, the remaining parts are given in the order drawn, without
    profiles: the source waits for every part."""
    parts = part_sizes(len(rest), size)
    remaining, next_part = list(rest), 0
    try:
        for k in range(len(parts)):
            out = sent + sum(parts[:k])
            until(*due_at(k, out, sample, size))
            due = time.perf_counter()
            fit()
            fitted = time.perf_counter()
            rows, profiles = order(remaining, parts[k])
            give(k, rows, profiles)
            chosen = set(rows)
            remaining, next_part = [r for r in remaining if r not in chosen], k + 1
            log.info("part %d of %d: %d rows; fit %.2f s, order %.2f s; %d rows of %d still out when given",
                     k + 1, len(parts), len(rows), fitted - due, time.perf_counter() - fitted,
                     out - until(None, 0)[1], out)
    except Exception:  # noqa: BLE001 (the run goes on without the order)
        log.exception("cannot order the rest of the rows by a learned head; they go in the order drawn")
        for k in range(next_part, len(parts)):
            give(k, remaining[:parts[k]], [[] for _ in remaining[:parts[k]]])
            remaining = remaining[parts[k]:]

"""The Ray side of batch/ray_llm.py: the engine stage that hands each row's expert counts on, the actor that keeps
them, and the source that sends a cold run's rows as its head is learned.

`ObservingEngineUDF` is Ray's own engine stage (tested on Ray 2.60, whose stage class is internal) with one
addition: a row sent with a `moe_observe` token (batch/ray_llm.py's preprocess) has the counts our plugin took
of its request fetched from the engine once it finished (`cohort_take_observed`, as the proxy's learner
fetches them over HTTP: engine/observed_endpoint.py) and put in `ObservationBox`, a Ray actor the driver reads.
Every such row is counted there as finished, counts or not. The row's output is the plain stage's.

`LearnFirstSource` is a Dataset source of read tasks that run one after the other: the first rows (a sample from
across the Dataset and the rows that keep the engine fed behind it), then the rest in parts, each once the driver
hands the box its rows (ordered by the latest head learned from the engine's counts: batch/ray_llm.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from typing import Any, Callable, Iterator, Sequence

import pyarrow as pa
import ray
from ray.data import Datasource, ReadTask
from ray.data.block import BlockMetadata
from ray.llm._internal.batch.stages.vllm_engine_stage import vLLMEngineStageUDF

from moe_cohort.admission.wire import OBSERVE_KEY

log = logging.getLogger(__name__)

ENV_BOX = "COHORT_RAY_OBSERVATIONS"  # the Ray actor the engine stage hands the counts to (set by batch/ray_llm.py)
TAKE_TRIES, TAKE_WAIT_S = 20, 0.05  # the plugin finishes a request's counts one engine step after its answer


class Observations:
    """The engine's counts of a run's rows, by observe token, until the driver takes them; a learn-first run's
    later parts, from the driver's hand-over until the source reads them. Run as an async Ray actor
    (`ObservationBox`): a caller that waits (`until`, `handed_over`) makes one call that returns when its condition
    holds, instead of asking again and again."""

    def __init__(self) -> None:
        self.observed: dict[str, dict] = {}
        self.finished = 0  # rows with a token that finished, counted or not
        self.parts: dict[int, tuple[list[dict], list[list[int]]]] = {}  # a learn-first run's later rows, profiles
        self.changed = asyncio.Condition()

    async def put(self, found: dict[str, dict]) -> None:
        """One finished row's counts ({}: none came back)."""
        async with self.changed:
            self.observed.update(found)
            self.finished += 1
            self.changed.notify_all()

    async def until(self, counted: int | None, finished: int) -> tuple[int, int]:
        """(rows counted and not yet taken, rows finished), once at least `counted` rows are counted and not taken
        (None: never enough) or `finished` rows finished."""
        async with self.changed:
            await self.changed.wait_for(
                lambda: (counted is not None and len(self.observed) >= counted) or self.finished >= finished)
            return len(self.observed), self.finished

    async def take(self) -> dict[str, dict]:
        taken, self.observed = self.observed, {}
        return taken

    async def hand_over(self, part: int, rows: list[dict], profiles: list[list[int]]) -> None:
        async with self.changed:
            self.parts[part] = (rows, profiles)
            self.changed.notify_all()

    async def handed_over(self, part: int) -> tuple[list[dict], list[list[int]]]:
        """Part `part`'s rows and profiles, once the driver handed it over."""
        async with self.changed:
            await self.changed.wait_for(lambda: part in self.parts)
            return self.parts[part]


ObservationBox = ray.remote(num_cpus=0)(Observations)


class ObservingEngineUDF(vLLMEngineStageUDF):
    async def _generate_with_error_handling(self, row: dict[str, Any], batch_uuid: uuid.UUID) -> dict[str, Any]:
        token = ((row.get("sampling_params") or {}).get("extra_args") or {}).get(OBSERVE_KEY)
        out = await super()._generate_with_error_handling(row, batch_uuid)
        if token:
            found = {} if out.get("__inference_error__") else await self._take_observed(token)
            if not found and not out.get("__inference_error__"):
                log.warning("no expert counts from the engine for %s (the moe-cohort plugin not loaded?)", token)
            self._box().put.remote(found)
        return out

    async def _take_observed(self, token: str) -> dict[str, dict]:
        for _ in range(TAKE_TRIES):
            found: dict[str, dict] = {}
            for part in await self.llm.engine.collective_rpc("cohort_take_observed", args=([token],)):
                found.update(part or {})  # the first tensor-parallel rank counts; the others answer {}
            if found:
                return found
            await asyncio.sleep(TAKE_WAIT_S)
        return {}

    def _box(self):
        if getattr(self, "_observation_box", None) is None:
            self._observation_box = ray.get_actor(os.environ[ENV_BOX])
        return self._observation_box


def handed_over(box_name: str, part: int) -> tuple[list[dict], list[list[int]]]:
    """Part `part` of the rest (its rows in sending order, their profiles), once the driver handed it to the box
    named `box_name` (one call, which returns then)."""
    return ray.get(ray.get_actor(box_name).handed_over.remote(part))


def table(rows: Sequence[dict], profiles: Sequence[Sequence[int]], column: str) -> pa.Table:
    """`rows`, each with its profile in the list column `column` (typed: [] and [..] alike)."""
    part = pa.Table.from_pylist([{k: v for k, v in r.items() if k != column} for r in rows])
    return part.append_column(column, pa.array([[int(c) for c in p] for p in profiles], type=pa.list_(pa.int64())))


class LearnFirstSource(Datasource):
    """A learn-first run's rows as 1 + len(`parts`) read tasks, in this order: the `first` rows without a profile,
    at once; then part k (of `parts[k]` rows), the rows and profiles `rest(k)` gives (blocking until the driver
    hands that part over: `handed_over`; a part's rows travel with it, so no task carries the whole Dataset), the
    profiles in column `column`. Ray Data hands a read task's output on when the task ends, so each part reaches
    the engine while the next one waits."""

    def __init__(self, first: Sequence[dict], rest: Callable[[int], tuple[list[dict], list[list[int]]]],
                 parts: Sequence[int], column: str) -> None:
        self.first, self.rest, self.parts, self.column = list(first), rest, list(parts), column

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context=None) -> list[ReadTask]:
        first, rest, column = self.first, self.rest, self.column

        def first_rows() -> Iterator[pa.Table]:
            yield table(first, [[]] * len(first), column)

        def part(k: int) -> Callable[[], Iterator[pa.Table]]:
            return lambda: iter([table(*rest(k), column)])

        return [ReadTask(first_rows, _metadata(len(first))),
                *(ReadTask(part(k), _metadata(n)) for k, n in enumerate(self.parts))]


def _metadata(rows: int) -> BlockMetadata:
    return BlockMetadata(num_rows=rows, size_bytes=None, exec_stats=None)

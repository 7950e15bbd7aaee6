"""The Ray side of batch/ray_llm.py: the engine stage that hands each row's expert counts on, the actor that keeps
them, and the source that sends a cold run's rows as its head is learned.

`ObservingEngineUDF` is Ray's own engine stage (tested on Ray 2.60, whose stage class is internal) with one
addition: a row sent with a `moe_observe` token (batch/ray_llm.py's preprocess) has the counts our plugin took
of its request fetched from the engine once it finished (`cohort_take_observed`, as the proxy's learner
fetches them over HTTP: engine/observed_endpoint.py) and put in `ObservationBox`, a Ray actor the driver reads.
Every such row is counted there as finished, counts or not. The row's output is the plain stage's.

`LearnFirstSource` is a Dataset source of one read task: it yields its first rows (a sample from across the
Dataset and the rows that keep the engine fed behind it), then waits until the driver hands the box the order of
the rest (predicted by the head learned from the sample's counts: batch/ray_llm.py), and yields the rest in it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import Any, Iterator, Sequence

import pyarrow as pa
import ray
from ray.data import Datasource, ReadTask
from ray.data.block import BlockMetadata
from ray.llm._internal.batch.stages.vllm_engine_stage import vLLMEngineStageUDF

from moe_cohort.admission.wire import OBSERVE_KEY

log = logging.getLogger(__name__)

ENV_BOX = "COHORT_RAY_OBSERVATIONS"  # the Ray actor the engine stage hands the counts to (set by batch/ray_llm.py)
TAKE_TRIES, TAKE_WAIT_S = 20, 0.05  # the plugin finishes a request's counts one engine step after its answer
REST_POLL_S = 0.05  # how often the source asks the box for the order of the rest


@ray.remote(num_cpus=0)
class ObservationBox:
    """The engine's counts of a run's rows, by observe token, until the driver takes them."""

    def __init__(self) -> None:
        self.observed: dict[str, dict] = {}
        self.finished = 0  # rows with a token that finished, counted or not
        self.rest: tuple[list[int], list[list[int]]] | None = None  # a learn-first run's later rows and profiles

    def put(self, found: dict[str, dict]) -> None:
        """One finished row's counts ({}: none came back)."""
        self.observed.update(found)
        self.finished += 1

    def counts(self) -> tuple[int, int]:
        """(rows counted and not yet taken, rows finished)"""
        return len(self.observed), self.finished

    def take(self) -> dict[str, dict]:
        taken, self.observed = self.observed, {}
        return taken

    def hand_over(self, rows: list[int], profiles: list[list[int]]) -> None:
        self.rest = (rows, profiles)

    def handed_over(self) -> tuple[list[int], list[list[int]]] | None:
        return self.rest


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


def blocks(rows: Sequence[dict], first: Sequence[int], rest: Iterator[tuple[list[int], list[list[int]]]],
           size: int, profile: str) -> Iterator[list[dict]]:
    """`rows` by index: those in `first` as they are, then, once `rest` yields (the order of the others and their
    profiles), those with their profile in column `profile`; `size` rows at a time."""
    for k in range(0, len(first), size):
        yield [rows[i] for i in first[k: k + size]]
    order, profiles = next(rest)
    for k in range(0, len(order), size):
        yield [{**rows[i], profile: p} for i, p in zip(order[k: k + size], profiles[k: k + size])]


def handed_over(box_name: str) -> Iterator[tuple[list[int], list[list[int]]]]:
    """The order of the rest once the driver handed it to the box named `box_name` (polled)."""
    box = ray.get_actor(box_name)
    while (rest := ray.get(box.handed_over.remote())) is None:
        time.sleep(REST_POLL_S)
    yield rest


class LearnFirstSource(Datasource):
    """`rows` (dicts, each with its list column `profile`) as one read task: `first`, then the rest in the order
    the box named `box_name` is handed, `block_rows` rows a block."""

    def __init__(self, rows: Sequence[dict], first: Sequence[int], box_name: str, block_rows: int,
                 profile: str) -> None:
        self.rows, self.first, self.box_name = list(rows), list(first), box_name
        self.block_rows, self.profile = block_rows, profile

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context=None) -> list[ReadTask]:
        rows, first, box_name, size, profile = self.rows, self.first, self.box_name, self.block_rows, self.profile

        def read() -> Iterator[pa.Table]:
            for part in blocks(rows, first, handed_over(box_name), size, profile):
                profiles = pa.array([r[profile] for r in part], type=pa.list_(pa.int64()))  # [] and [..] alike
                table = pa.Table.from_pylist([{k: v for k, v in r.items() if k != profile} for r in part])
                yield table.append_column(profile, profiles)

        return [ReadTask(read, BlockMetadata(num_rows=len(rows), size_bytes=None, exec_stats=None))]

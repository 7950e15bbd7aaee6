"""A probing Ray Data LLM run's rows as a Dataset source (batch/ray_llm/processor.py): the first rows at once (the probes), then the rest in parts, each once the driver hands it to the box (batch/ray_llm/box.py),
ordered by the profiles the engine's counts gave; and the processor's output without the probes' answers.

This module imports Ray Data and pyarrow, not vLLM: the read tasks run in processes of their own, which import it
beside an engine that is starting on the same cores (batch/ray_llm/box.py says why that matters).
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import pyarrow as pa
import pyarrow.compute as pc
from ray.data import Datasource, ReadTask
from ray.data.block import BlockMetadata


def table(rows: Sequence[dict], profiles: Sequence[Sequence[int]], column: str) -> pa.Table:
    """`rows`, each with its profile in the list column `column` (typed: [] and [..] alike)."""
    part = pa.Table.from_pylist([{k: v for k, v in r.items() if k != column} for r in rows])
    return part.append_column(column, pa.array([[int(c) for c in p] for p in profiles], type=pa.list_(pa.int64())))


def without(batch: pa.Table, column: str) -> pa.Table:
    """The rows of `batch` whose bool `column` is false, without that column (a probing run's output: the rows'
    answers, not their probes')."""
    return batch.filter(pc.invert(batch[column])).drop_columns([column])


class PartsSource(Datasource):
    """A run's rows as 1 + len(`parts`) read tasks, in this order: the `first` rows without a profile, at once (in
    blocks of `block` rows: each block goes whole to one engine); then part k (of `parts[k]` rows), the rows and profiles `rest(k)` gives (blocking until the driver
    hands that part over: `handed_over`; a part's rows travel with it, so no task carries the whole Dataset), the
    profiles in column `column`. Ray Data hands a read task's output on when the task ends, so each part reaches
    the engine while the next one waits."""

    def __init__(self, first: Sequence[dict], rest: Callable[[int], tuple[list[dict], list[list[int]]]],
                 parts: Sequence[int], column: str, block: int | None = None) -> None:
        self.first, self.rest, self.parts, self.column = list(first), rest, list(parts), column
        self.block = block or max(1, len(self.first))

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context=None) -> list[ReadTask]:
        first, rest, column, block = self.first, self.rest, self.column, self.block

        def first_rows() -> Iterator[pa.Table]:
            for at in range(0, len(first), block):
                rows = first[at:at + block]
                yield table(rows, [[]] * len(rows), column)

        def part(k: int) -> Callable[[], Iterator[pa.Table]]:
            return lambda: iter([table(*rest(k), column)])

        return [ReadTask(first_rows, _metadata(len(first))),
                *(ReadTask(part(k), _metadata(n)) for k, n in enumerate(self.parts))]


def _metadata(rows: int) -> BlockMetadata:
    return BlockMetadata(num_rows=rows, size_bytes=None, exec_stats=None)

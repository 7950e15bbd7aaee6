"""The actor where a Ray Data LLM run's driver, engine stage and source meet (batch/ray_llm/processor.py): the
engine's counts of each observed row (a probe, or an answer learned from), until the driver takes them, and a probing
run's rows in parts, from the driver's hand-over until the source reads them.

This module imports Ray and nothing heavier (no vLLM, no Ray Data LLM): the actor's process, which imports it,
starts beside an engine that is starting on the same cores, and importing vLLM there would take seconds of a core
from that engine (docs/results.md).
"""

from __future__ import annotations

import asyncio

import ray

ENV_BOX = "COHORT_RAY_OBSERVATIONS"  # the Ray actor the engine stage hands the counts to (set by ray_llm/processor.py)


class Observations:
    """The engine's counts of a run's rows, by observe token, until the driver takes them; a probing run's rows
    in parts, from the driver's hand-over until the source reads them. Run as an async Ray actor
    (`ObservationBox`): a caller that waits (`until`, `handed_over`) makes one call that returns when its condition
    holds, instead of asking again and again."""

    def __init__(self) -> None:
        self.observed: dict[str, dict] = {}
        self.finished = 0  # rows with a token that finished, counted or not
        self.parts: dict[int, tuple[list[dict], list[list[int]]]] = {}  # a probing run's rows in parts, their profiles
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


def handed_over(box_name: str, part: int) -> tuple[list[dict], list[list[int]]]:
    """Part `part` of the rest (its rows in sending order, their profiles), once the driver handed it to the box
    named `box_name` (one call, which returns then)."""
    return ray.get(ray.get_actor(box_name).handed_over.remote(part))

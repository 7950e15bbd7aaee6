"""moe_cohort.batch.ray_llm_first: which rows a cold Ray Data LLM run sends first, when each later part is due, and
the hand-over against a simulated engine (rows finish first in, first out, each counted as it finishes)."""

from collections import deque

import pytest

from moe_cohort.batch.ray_llm_first import due_at, hand_over, learn_first_split, part_sizes


def test_a_learn_first_run_sends_its_sample_and_an_engine_full_first_in_whole_batches():
    for n, sample, engine_rows, batch in [(100, 16, 64, 16), (100, 12, 16, 8), (50, 12, 16, 24), (20, 5, 16, 32)]:
        first, rest = learn_first_split(n, sample, engine_rows, batch)
        assert sorted(first + rest) == list(range(n))
        assert len(first) == min(n, -(-(sample + engine_rows) // batch) * batch)
        assert (first, rest) == learn_first_split(n, sample, engine_rows, batch)  # seeded
    first, _ = learn_first_split(400, 16, 64, 16)
    assert max(first) > 300 and min(first) < 100  # drawn from across the Dataset, not its head


def test_parts_are_due_once_the_sample_is_counted_then_when_no_more_than_two_are_out():
    assert part_sizes(40, 18) == [18, 18, 4] and part_sizes(18, 18) == [18] and part_sizes(0, 18) == []
    # the first part once the sample (5) is counted, or every row out (30) finished
    assert due_at(0, 30, 5, 18) == (5, 30)
    # a later one once no more than 2 parts (of 18) are out: 48 sent, so 12 finished; counts do not matter
    assert due_at(1, 48, 5, 18) == (None, 12) and due_at(3, 84, 5, 18) == (None, 48)


class Engine:
    """Rows given to it finish first in, first out, one at a time while `until` waits; each finished row is counted
    (until taken by `fit`)."""

    def __init__(self, first: list[int]) -> None:
        self.queue = deque(first)
        self.finished, self.counted, self.parts = [], 0, {}

    def until(self, counted: int | None, finished: int) -> tuple[int, int]:
        while not ((counted is not None and self.counted >= counted) or len(self.finished) >= finished):
            assert self.queue, "waiting for rows that were never given: the run would hang"
            self.finished.append(self.queue.popleft())
            self.counted += 1
        return self.counted, len(self.finished)

    def give(self, k: int, rows: list[int], profiles: list[list[int]]) -> None:
        assert k == len(self.parts)  # in order, each once
        self.parts[k] = (rows, profiles)
        self.queue.extend(rows)

    def fit(self) -> None:
        self.counted = 0


def test_the_hand_over_gives_each_part_in_order_by_the_latest_head_and_every_row_once():
    first, rest = learn_first_split(50, 5, 8, 4)  # 16 first, 34 in parts of 8
    engine, fits = Engine(first), []

    def fit():
        fits.append(len(engine.finished))
        engine.fit()

    def order(remaining, size):  # the "head": the highest rows first, profiled by how many were finished
        chosen = sorted(remaining, reverse=True)[:size]
        return chosen, [[len(engine.finished)]] * len(chosen)

    hand_over(engine.until, engine.give, rest, 8, 5, len(first), fit, order)
    assert [len(engine.parts[k][0]) for k in sorted(engine.parts)] == [8, 8, 8, 8, 2]
    assert sorted(r for rows, _ in engine.parts.values() for r in rows) == sorted(rest)  # every row once
    assert fits[0] == 5  # the first head once the sample is counted
    assert fits[1:] == [16 + 8 * k - 16 for k in range(1, 5)]  # each later one when 2 parts are out
    assert [profiles[0][0] for _, profiles in (engine.parts[k] for k in sorted(engine.parts))] == fits


def test_when_ordering_fails_the_remaining_parts_go_in_the_order_drawn_without_profiles():
    first, rest = learn_first_split(40, 4, 4, 4)
    engine, calls = Engine(first), []

    def order(remaining, size):
        calls.append(size)
        if len(calls) == 2:
            raise ValueError("no head")
        return remaining[:size], [[1]] * size

    hand_over(engine.until, engine.give, rest, 8, 4, len(first), engine.fit, order)
    rows = [engine.parts[k][0] for k in sorted(engine.parts)]
    assert sum(rows, []) == rest  # every row once, the first part ordered, then the order drawn
    assert engine.parts[0][1] == [[1]] * 8 and all(p == [] for k in range(1, len(rows)) for p in engine.parts[k][1])
    with pytest.raises(AssertionError):
        engine.give(0, [], [])  # the engine's own check: a part given twice

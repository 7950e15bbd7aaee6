"""moe_cohort.batch.ray_llm.source: the probing source's blocks (the end-to-end run through Ray Data LLM and
vLLM is in tests/batch/ray_llm/test_processor.py)."""

import importlib.util

import pytest

if importlib.util.find_spec("ray") is None or importlib.util.find_spec("vllm") is None:
    pytest.skip("Ray Data LLM needs ray and vLLM (bash scripts/setup.sh dev)", allow_module_level=True)
# here, not in a test: Ray subclasses subprocess.Popen when it is imported, and a quick test's Popen is conftest's guard
import pyarrow as pa  # noqa: E402

from moe_cohort.batch.ray_llm.source import PartsSource, without  # noqa: E402


def test_the_first_rows_go_without_waiting_and_each_later_part_as_handed_over_with_its_profiles():
    rows = [{"id": i, "text": f"t{i}"} for i in range(8)]
    parts = {0: ([rows[7], rows[2]], [[1, 9], [2]]), 1: ([rows[5]], [[]])}
    handed = []

    def rest(k):
        handed.append(k)
        return parts[k]

    tasks = PartsSource([rows[i] for i in [4, 0, 6, 3, 1]], rest, [2, 1], "p").get_read_tasks(3)
    assert [t.metadata.num_rows for t in tasks] == [5, 2, 1]
    first = [t.to_pylist() for t in tasks[0].read_fn()]
    assert first == [[{"id": i, "text": f"t{i}", "p": []} for i in [4, 0, 6, 3, 1]]] and not handed
    later = [[t.to_pylist() for t in task.read_fn()] for task in tasks[1:]]
    assert handed == [0, 1]
    assert later == [[[{"id": 7, "text": "t7", "p": [1, 9]}, {"id": 2, "text": "t2", "p": [2]}]],
                     [[{"id": 5, "text": "t5", "p": []}]]]



def test_the_first_rows_go_in_blocks_of_the_size_given():
    rows = [{"id": i} for i in range(5)]
    tasks = PartsSource(rows, lambda k: ([], []), [], "p", block=2).get_read_tasks(1)
    assert [[r["id"] for r in t.to_pylist()] for t in tasks[0].read_fn()] == [[0, 1], [2, 3], [4]]


def test_the_output_keeps_the_rows_answers_not_their_probes():
    batch = pa.Table.from_pylist([{"id": 0, "probe": True}, {"id": 0, "probe": False}, {"id": 1, "probe": False}])
    assert without(batch, "probe").to_pylist() == [{"id": 0}, {"id": 1}]

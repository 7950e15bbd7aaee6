"""moe_cohort.batch.ray_llm_engine: the learn-first source's blocks (the end-to-end run through Ray Data LLM and
vLLM is in tests/batch/test_ray_llm.py)."""

import importlib.util

import pytest

if importlib.util.find_spec("ray") is None or importlib.util.find_spec("vllm") is None:
    pytest.skip("Ray Data LLM needs ray and vLLM (bash scripts/setup.sh dev)", allow_module_level=True)
# here, not in a test: Ray subclasses subprocess.Popen when it is imported, and a quick test's Popen is conftest's guard
from moe_cohort.batch.ray_llm_engine import LearnFirstSource  # noqa: E402


def test_the_first_rows_go_without_waiting_for_the_hand_over_and_the_rest_in_its_order_with_its_profiles():
    rows = [{"id": i, "text": f"t{i}"} for i in range(8)]
    handed = []

    def rest():
        handed.append(True)
        return [7, 2, 5], [[1, 9], [2], []]

    first_task, rest_task = LearnFirstSource(rows, [4, 0, 6, 3, 1], rest, "p").get_read_tasks(2)
    first = [t.to_pylist() for t in first_task.read_fn()]
    assert first == [[{"id": i, "text": f"t{i}", "p": []} for i in [4, 0, 6, 3, 1]]] and not handed
    later = [t.to_pylist() for t in rest_task.read_fn()]
    assert handed == [True]
    assert later == [[{"id": 7, "text": "t7", "p": [1, 9]}, {"id": 2, "text": "t2", "p": [2]},
                      {"id": 5, "text": "t5", "p": []}]]
    assert first_task.metadata.num_rows == 5 and rest_task.metadata.num_rows == 3

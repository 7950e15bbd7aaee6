"""moe_cohort.batch.ray_llm_engine: the learn-first source's blocks (the end-to-end run through Ray Data LLM and
vLLM is in tests/batch/test_ray_llm.py)."""

import importlib.util

import pytest

if importlib.util.find_spec("ray") is None or importlib.util.find_spec("vllm") is None:
    pytest.skip("Ray Data LLM needs ray and vLLM (bash scripts/setup.sh dev)", allow_module_level=True)
# here, not in a test: Ray subclasses subprocess.Popen when it is imported, and a quick test's Popen is conftest's guard
from moe_cohort.batch.ray_llm_engine import blocks  # noqa: E402


def test_the_first_rows_go_before_the_hand_over_is_awaited_and_the_rest_in_its_order_with_its_profiles():
    rows = [{"id": i, "p": []} for i in range(10)]
    awaited = []

    def rest():
        awaited.append(True)
        yield [9, 2, 5, 0, 7], [[1], [2], [3], [4], [5]]

    parts = blocks(rows, [8, 1, 6, 3, 4], rest(), 2, "p")
    early = [next(parts) for _ in range(3)]
    assert early == [[rows[8], rows[1]], [rows[6], rows[3]], [rows[4]]] and not awaited  # the engine fed meanwhile
    late = list(parts)
    assert awaited == [True]
    assert late == [[{"id": 9, "p": [1]}, {"id": 2, "p": [2]}], [{"id": 5, "p": [3]}, {"id": 0, "p": [4]}],
                    [{"id": 7, "p": [5]}]]
    assert sorted(r["id"] for part in early + late for r in part) == list(range(10))  # each row once

"""moe_cohort.encoder.plans: the plan invariants, the arrival chunker, and the one plan-file format."""

import json

import numpy as np
import pytest

from moe_cohort.encoder.plans import PlanError, arrival_plan, chunk, read_plan_file, validate_plan, write_plan_file


def test_arrival_plan_cuts_in_order_with_a_short_last_batch():
    assert [b.tolist() for b in arrival_plan(5, 2)] == [[0, 1], [2, 3], [4]]
    assert [b.tolist() for b in chunk([4, 2, 0], 2)] == [[4, 2], [0]]


def test_written_plans_read_back_with_extra_fields_ignored(tmp_path):
    plan = [np.array([3, 0]), np.array([2]), np.array([1, 4])]
    ids = ["a", "b", "c", "d", "e"]
    write_plan_file(tmp_path / "p.jsonl", plan, ids, extra=[{"line": i + 1, "policy": "topk"} for i in range(5)])
    rows = [json.loads(x) for x in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert rows[0] == {"id": "d", "batch": 0, "position": 0, "line": 4, "policy": "topk"}
    assert [b.tolist() for b in read_plan_file(tmp_path / "p.jsonl", ids)] == [b.tolist() for b in plan]


@pytest.mark.parametrize("plan, message", [
    ([np.array([0, 1, 2]), np.array([3])], "holds 3 requests, more than the batch size 2"),
    ([np.array([0, 1]), np.array([3])], "request index 2 appears 0 times"),
    ([np.array([0, 1]), np.array([2, 2]), np.array([3])], "request index 2 appears 2 times"),
    ([np.array([0, 1]), np.array([], dtype=np.int64), np.array([2, 3])], "batch 1 is empty"),
    ([np.array([0, 1]), np.array([2, 7])], "outside"),
])
def test_broken_plans_are_named(plan, message):
    with pytest.raises(PlanError, match=message):
        validate_plan(plan, 4, 2)


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_plan_file_orders_batches_and_members_by_position(tmp_path):
    path = _write(tmp_path / "p.jsonl", [{"id": "c", "batch": 7, "position": 3}, {"id": "a", "batch": 2, "position": 1},
                                         {"id": "b", "batch": 7, "position": 2}, {"id": "d", "batch": 2, "position": 0}])
    plan = read_plan_file(path, ["a", "b", "c", "d"])
    assert [b.tolist() for b in plan] == [[3, 0], [1, 2]]


def test_plan_file_matches_numeric_ids_as_strings(tmp_path):
    path = _write(tmp_path / "p.jsonl", [{"id": 1, "batch": 0}, {"id": 2, "batch": 0}])
    assert [b.tolist() for b in read_plan_file(path, ["1", "2"])] == [[0, 1]]


@pytest.mark.parametrize("rows, message", [
    (['{"id": "a", "batch": 0}', "{oops"], "line 2: invalid JSON"),
    ([{"id": "a", "batch": 0}, {"id": "zz", "batch": 0}], "line 2: id 'zz' is not a request"),
    ([{"id": "a", "batch": 0}, {"id": "a", "batch": 1}], "line 2: id 'a' already placed on line 1"),
    ([{"id": "a", "batch": "x"}], "line 1: 'batch' must be an integer"),
    ([{"id": "a"}], "line 1: expected an object with 'id' and 'batch'"),
    ([{"id": "a", "batch": 0}], r"1 request\(s\) of the traces are in no batch \(e.g. id 'b'\)"),
])
def test_bad_plan_files_name_the_line(tmp_path, rows, message):
    with pytest.raises(PlanError, match=message):
        read_plan_file(_write(tmp_path / "p.jsonl", rows), ["a", "b"])

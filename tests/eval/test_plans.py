import numpy as np

from moe_cohort.encoder.plans import validate_plan
from moe_cohort.eval.plans import category_plan, random_plan


def test_baseline_plans_place_every_request_once():
    for plan in (random_plan(10, 4, seed=3), category_plan(list("abcabcabca"), 4)):
        validate_plan(plan, 10, 4)
        assert [len(b) for b in plan] == [4, 4, 2]


def test_category_plan_is_stable_inside_a_category():
    plan = category_plan(["b", "a", "b", "a", "a"], 2)
    assert [b.tolist() for b in plan] == [[1, 3], [4, 0], [2]]


def test_random_plans_are_seeded():
    assert [b.tolist() for b in random_plan(9, 3, 1)] == [b.tolist() for b in random_plan(9, 3, 1)]
    assert [b.tolist() for b in random_plan(9, 3, 1)] != [b.tolist() for b in random_plan(9, 3, 2)]

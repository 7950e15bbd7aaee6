"""moe_cohort.batch.ray_llm.rows: a row's text, the plan against brute force on small inputs, and the expert args
its sampling parameters carry."""

import numpy as np

from moe_cohort.admission.resident import ResidentExperts
from moe_cohort.admission.wire import Prediction
from moe_cohort.admission.wire import compact
from moe_cohort.batch.ray_llm.rows import plan, probed_plan, row_text, with_expert_args
from moe_cohort.send.profiles import Predictor
from tests.helpers.brute_force import brute_force_order


def _predictor(vectors):
    by_text = {f"p{i}": v for i, v in enumerate(vectors)}
    return Predictor(lambda texts: [Prediction(by_text[t], [i * 256 for i in range(8)]) for t in texts],
                     lambda size: ResidentExperts(1, size), "profile")


def test_the_plan_is_admission_by_predicted_experts_against_brute_force():
    rng = np.random.default_rng(3)
    for trial in range(10):
        vectors = [rng.random(6) * (rng.random(6) < 0.4) for _ in range(9)]
        order, profiles = plan([f"p{i}" for i in range(9)], _predictor(vectors), max_num_seqs=3)
        assert order == brute_force_order(vectors, 3), trial
        assert plan([f"p{i}" for i in range(9)], _predictor(vectors), max_num_seqs=3, limit=4)[0] == order[:4]
        assert profiles == [[i * 256 for i in range(8)]] * 9


def test_the_probed_plan_is_admission_by_the_probes_profiles_against_brute_force_the_unprobed_last():
    rng = np.random.default_rng(5)
    for trial in range(10):
        profiles = {i: rng.random((2, 3)) * (rng.random((2, 3)) < 0.4) for i in range(11) if i not in (2, 7)}
        order, compacts = probed_plan(11, profiles, max_num_seqs=3)
        probed = sorted(profiles)
        expected = [probed[i] for i in brute_force_order([profiles[r].ravel() for r in probed], 3)]
        assert order == expected + [7, 2], trial  # the unprobed go last, from the far end
        assert compacts == [compact(profiles[i]) if i in profiles else [] for i in range(11)]


def test_without_a_predictor_the_rows_keep_their_order_and_carry_no_profile():
    assert plan(["a", "b", "c"], None, 2) == ([0, 1, 2], [[], [], []])


def test_a_rows_text_is_what_the_proxy_reads_of_a_body():
    assert row_text({"messages": [{"role": "user", "content": "hello there"}]}) == "hello there"
    assert row_text({"prompt": "a prompt"}) == "a prompt"
    assert row_text({"id": 3}) == ""


def test_expert_args_join_the_users_sampling_parameters():
    params = {"max_tokens": 8, "extra_args": {"mine": 1}}
    out = with_expert_args(params, np.array([3, 5]), "run-7")
    assert out == {"max_tokens": 8, "extra_args": {"mine": 1, "moe_batch": 1, "moe_profile": [3, 5],
                                                   "moe_observe": "run-7"}}
    assert all(type(c) is int for c in out["extra_args"]["moe_profile"])  # Arrow hands lists back as arrays
    assert params == {"max_tokens": 8, "extra_args": {"mine": 1}}  # the caller's dict untouched
    assert with_expert_args({"max_tokens": 8}, [], None) == {"max_tokens": 8, "extra_args": {"moe_batch": 1}}
    assert with_expert_args(None, [], "t") == {"extra_args": {"moe_batch": 1, "moe_observe": "t"}}

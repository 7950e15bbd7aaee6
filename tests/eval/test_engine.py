"""evaluate_continuous: savings paired by seed, capture against the reference, the cost model, lengths."""

import json

import numpy as np
import pytest

from moe_cohort.eval.cost import PRESETS, CostModel, parse_cost_model
from moe_cohort.eval.engine import evaluate_continuous, lengths_from_spec, lognormal_lengths, read_lengths
from moe_cohort.eval.policies import by_profile, fixed_order, random_order
from moe_cohort.eval.replay import decode_profiles, decode_tokens
from moe_cohort.traces.synthetic import synthetic_traces

COST = CostModel("t", 10.0, 40.0, 2.0, moe_share=0.5)


def _setup(n=120):
    ts = synthetic_traces(n, num_experts=16, num_layers=3, top_k=2, seed=3, topic_strength=0.8)
    tok = decode_tokens(ts)
    return ts, tok, decode_profiles(tok, ts)


def test_rows_are_paired_by_seed_and_the_reference_captures_all_of_itself():
    ts, tok, prof = _setup()
    lengths = lengths_from_spec("lognormal:0.5", ts.request_ids, mean=8)
    policies = {"arrival": fixed_order(np.arange(len(ts))), "reference": by_profile(prof)}
    out = evaluate_continuous(tok, 4, policies, lengths, COST, ts.num_layers, seeds=3)
    rows = out["plans"]
    assert list(rows) == ["random", "arrival", "reference"]
    assert rows["random"]["saving"] == 0 and rows["reference"]["capture"] == pytest.approx(1.0)
    assert rows["reference"]["saving"] > 0.05  # planted topics: like with like pays
    rnd = [np.mean([random_order().run(tok, lengths(s), 4, s * 4 + j).loads_per_token for j in range(4)])
           for s in range(3)]
    ref = [by_profile(prof).run(tok, lengths(s), 4).loads_per_token for s in range(3)]
    savings = [1 - a / b for a, b in zip(ref, rnd)]
    assert rows["reference"]["saving"] == pytest.approx(np.mean(savings))
    assert rows["reference"]["saving_std"] == pytest.approx(np.std(savings))
    assert rows["reference"]["saving_per_seed"] == pytest.approx(savings)  # in seed order, for paired comparisons
    json.dumps(out)


def test_a_zero_fairness_bound_turns_every_policy_into_arrival_order():
    ts, tok, prof = _setup(60)
    lengths = lengths_from_spec("lognormal", ts.request_ids, mean=4)
    policies = {"arrival": fixed_order(np.arange(len(ts))), "reference": by_profile(prof)}
    free = evaluate_continuous(tok, 2, policies, lengths, COST, ts.num_layers, seeds=2)["plans"]
    bound = evaluate_continuous(tok, 2, policies, lengths, COST, ts.num_layers, seeds=2, max_wait=0)["plans"]
    assert free["reference"]["loads_per_token"] != free["arrival"]["loads_per_token"]
    assert bound["reference"]["loads_per_token"] == bound["arrival"]["loads_per_token"] == free["arrival"]["loads_per_token"]
    assert bound["reference"]["max_queue_steps"] == free["arrival"]["max_queue_steps"]


def test_step_time_is_moe_time_plus_the_non_moe_share_of_a_random_step():
    ts, tok, prof = _setup(60)
    lengths = lengths_from_spec("fixed", ts.request_ids, mean=5)
    out = evaluate_continuous(tok, 3, {"reference": by_profile(prof)}, lengths, COST, ts.num_layers, seeds=2,
                              random_draws=1)
    rnd = [random_order().run(tok, lengths(s), 3, s) for s in range(2)]
    moe = np.mean([COST.moe_us(r.steps, r.resident, r.loads, 3) / r.tokens for r in rnd])
    steps = np.mean([r.steps.sum() / r.tokens for r in rnd])
    assert out["non_moe_us_per_step"] == pytest.approx(moe / steps)  # share 0.5: non-MoE = MoE
    row = out["plans"]["random"]
    assert row["step_us_per_token"] == pytest.approx(row["moe_us_per_token"] + moe / steps * row["steps_per_token"])
    assert row["tokens_per_s"] == pytest.approx(1e6 / row["step_us_per_token"])


def test_kept_full_times_the_same_steps_as_it_counts_loads():
    ts, tok, prof = _setup(60)
    lengths = lengths_from_spec("lognormal", ts.request_ids, mean=6)
    out = evaluate_continuous(tok, 4, {}, lengths, COST, ts.num_layers, seeds=1, random_draws=1, kept_full=True)
    r = random_order().run(tok, lengths(0), 4, 0)
    full = r.full  # [K] spans with every slot busy; the drain at the end is not
    assert not full.all()
    tokens = (r.steps[full] * r.resident[full]).sum()
    row = out["plans"]["random"]
    assert row["loads_per_token"] == pytest.approx(r.loads[full].sum() / tokens)
    assert row["moe_us_per_token"] == pytest.approx(COST.moe_us(r.steps[full], r.resident[full], r.loads[full], 3) / tokens)
    assert row["steps_per_token"] == pytest.approx(r.steps[full].sum() / tokens)


def test_cost_model_is_a_plus_b_u_per_layer_with_a_growing_in_the_tokens():
    cost = PRESETS["deepseek-v2-lite"]
    assert cost.a(8) == 59 and cost.a(128) == 108 and cost.a(68) == pytest.approx(83.5) and cost.a(512) == 108
    steps, tokens, loads = np.array([2, 3]), np.array([8, 128]), np.array([100, 40])
    assert cost.moe_us(steps, tokens, loads, 26) == pytest.approx(2 * 26 * 59 + 3 * 26 * 108 + 6.35 * 140)
    custom = parse_cost_model("50,90,3", non_moe_us=200)
    assert (custom.a_small, custom.a_large, custom.b, custom.non_moe_us) == (50, 90, 3, 200)
    with pytest.raises(ValueError, match="cost model"):
        parse_cost_model("fast")


def test_lengths_fixed_lognormal_and_files(tmp_path):
    ids = np.array(["a", "b", "c"])
    assert lengths_from_spec("fixed", ids, mean=7)(0).tolist() == [7, 7, 7]
    big = lognormal_lengths(200_000, 64, 1.0, seed=1)
    assert big.min() >= 1 and abs(big.mean() - 64) < 1.0
    np.testing.assert_array_equal(lognormal_lengths(5, 64, 1.0, 2), lognormal_lengths(5, 64, 1.0, 2))
    (tmp_path / "l.txt").write_text("3\n4\n5\n")
    (tmp_path / "l.jsonl").write_text('{"id": "c", "length": 9}\n{"id": "a", "length": 1}\n{"id": "b", "length": 2}\n')
    assert lengths_from_spec(str(tmp_path / "l.txt"), ids)(0).tolist() == [3, 4, 5]
    assert read_lengths(tmp_path / "l.jsonl", ids).tolist() == [1, 2, 9]
    (tmp_path / "bad.txt").write_text("3\n")
    with pytest.raises(ValueError, match="lengths for 3"):
        read_lengths(tmp_path / "bad.txt", ids)


def test_the_cli_builds_every_policy_the_inputs_allow_and_text_profiles_come_from_the_head():
    from moe_cohort.cli.replay import continuous_policies
    from moe_cohort.train.profile_head import fit_profile_head
    from moe_cohort.train.targets import profiles

    ts, tok, prof = _setup(80)
    x = np.random.default_rng(0).normal(size=(len(ts), 6)).astype(np.float32)
    head = fit_profile_head(x, profiles(ts), ts.top_k)
    names = list(continuous_policies(ts, tok, 4, x=x, head=head))
    assert names == ["arrival", "plan", "text-nearest", "text-profile", "reference"]
    assert list(continuous_policies(ts, tok, 4)) == ["arrival", "reference"]
    policy = continuous_policies(ts, tok, 4, x=x, head=head)["text-profile"]
    np.testing.assert_allclose(policy.vectors, head.predict(x).reshape(len(ts), -1))

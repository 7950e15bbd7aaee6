"""moe_cohort.batch.ray_llm: a Ray Data LLM run ordered by predicted experts, each row's profile in its sampling
parameters, our scheduler and plugin set, and the engine's counts learned from; against brute force on small
inputs, and end to end through Ray Data LLM and vLLM CPU on the tiny MoE."""

import importlib.util

import numpy as np
import pytest

from moe_cohort.admission.resident import ResidentExperts
from moe_cohort.admission.wire import Prediction
from moe_cohort.batch.ray_llm import (PENDING_PER_SLOT, SCHEDULER_CLS, ExpertAware, learn_first_split, plan, row_text,
                                      with_expert_args)
from moe_cohort.send.profiles import Predictor
from tests.batch.test_order import brute_force_order
from tests.send.learning.test_learning import encoder  # noqa: F401 (a fixture)

needs_ray_llm = pytest.mark.skipif(importlib.util.find_spec("ray") is None or importlib.util.find_spec("vllm") is None,
                                   reason="Ray Data LLM needs ray and vLLM (bash scripts/setup.sh dev)")
if importlib.util.find_spec("ray") is not None and importlib.util.find_spec("vllm") is not None:
    # here, not in a test: Ray subclasses subprocess.Popen when it is imported, and a quick test's Popen is
    # conftest's guard
    from ray.data.llm import vLLMEngineProcessorConfig


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


def test_without_a_predictor_the_rows_keep_their_order_and_carry_no_profile():
    assert plan(["a", "b", "c"], None, 2) == ([0, 1, 2], [[], [], []])


def test_a_learn_first_run_sends_its_sample_and_an_engine_full_first_in_whole_batches():
    for n, sample, engine_rows, batch in [(100, 16, 64, 16), (100, 12, 16, 8), (50, 12, 16, 24), (20, 5, 16, 32)]:
        first, rest = learn_first_split(n, sample, engine_rows, batch)
        assert sorted(first + rest) == list(range(n))
        assert len(first) == min(n, -(-(sample + engine_rows) // batch) * batch)
        assert (first, rest) == learn_first_split(n, sample, engine_rows, batch)  # seeded
    first, _ = learn_first_split(400, 16, 64, 16)
    assert max(first) > 300 and min(first) < 100  # drawn from across the Dataset, not its head


def test_a_learn_first_run_hands_the_rest_over_in_engine_fulls_of_whole_batches():
    aware = ExpertAware(predictor=None, max_num_seqs=4, batch=6)
    assert aware._parts(40) == [18, 18, 4]  # 4 x 4 rows an engine holds, in batches of 6
    assert aware._parts(18) == [18] and aware._parts(0) == []
    # the first part once the sample (5) is counted or every row out (30) finished; a later one once no more than
    # 2 parts' rows are out
    assert [aware._next_part_due(0, 30, 5, counted, finished) for counted, finished in [(4, 29), (5, 5), (0, 30)]] == \
        [False, True, True]
    assert [aware._next_part_due(1, 48, 5, 0, finished) for finished in [11, 12, 40]] == [False, True, True]


def test_a_rows_text_is_what_the_proxy_reads_of_a_body():
    assert row_text({"messages": [{"role": "user", "content": "hello there"}]}) == "hello there"
    assert row_text({"prompt": "a prompt"}) == "a prompt"
    assert row_text({"id": 3}) == ""


def test_expert_args_join_the_users_sampling_parameters():
    params = {"max_tokens": 8, "extra_args": {"mine": 1}}
    out = with_expert_args(params, np.array([3, 5]), "run-7")
    assert out == {"max_tokens": 8, "extra_args": {"mine": 1, "moe_profile": [3, 5], "moe_observe": "run-7"}}
    assert all(type(c) is int for c in out["extra_args"]["moe_profile"])  # Arrow hands lists back as arrays
    assert params == {"max_tokens": 8, "extra_args": {"mine": 1}}  # the caller's dict untouched
    assert with_expert_args({"max_tokens": 8}, [], None) == {"max_tokens": 8}  # nothing to add, no extra_args
    assert with_expert_args(None, [], "t") == {"extra_args": {"moe_observe": "t"}}


@needs_ray_llm
def test_the_engine_is_set_up_for_admission_by_experts_and_the_users_choices_win():
    aware = ExpertAware(predictor=None)
    plain = vLLMEngineProcessorConfig(model_source="/m", engine_kwargs={"max_num_seqs": 8},
                                      runtime_env={"env_vars": {"VLLM_PLUGINS": "other", "X": "1"}})
    config = aware.configure(plain)
    assert config.engine_kwargs["scheduler_cls"] == SCHEDULER_CLS and config.engine_kwargs["max_num_seqs"] == 8
    assert config.runtime_env["env_vars"] == {"VLLM_PLUGINS": "other,moe_cohort", "X": "1"}
    assert config.max_pending_requests == PENDING_PER_SLOT * 8 and aware.max_num_seqs == 8
    assert aware.batch == plain.batch_size  # Ray's default batch, its stages taking as many
    assert "scheduler_cls" not in plain.engine_kwargs and plain.max_pending_requests is None  # a copy
    theirs = vLLMEngineProcessorConfig(model_source="/m", engine_kwargs={"scheduler_cls": "my.Scheduler"},
                                       max_pending_requests=5, runtime_env={"env_vars": {"VLLM_PLUGINS": "moe_cohort"}})
    config = aware.configure(theirs)
    assert config.engine_kwargs["scheduler_cls"] == "my.Scheduler" and config.max_pending_requests == 5
    assert config.runtime_env["env_vars"]["VLLM_PLUGINS"] == "moe_cohort"
    aware.configure(vLLMEngineProcessorConfig(model_source="/m", batch_size=8, tokenize_stage={"batch_size": 12}))
    assert aware.batch == 24  # whole batches of every stage


def _prompt(i: int) -> str:
    return f"question {i} about {'python lists' if i % 2 else 'cooking rice'}"


def _run(aware, model_dir, n: int) -> list[dict]:
    import ray.data

    config = vLLMEngineProcessorConfig(
        model_source=str(model_dir), engine_kwargs={"max_num_seqs": 4, "enforce_eager": True, "max_model_len": 512},
        runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1"}}, placement_group_config={"bundles": [{"CPU": 1}]},
        concurrency=1, batch_size=8, chat_template_stage=False, tokenize_stage=False, detokenize_stage=False)
    ds = ray.data.from_items([{"id": i, "text": _prompt(i)} for i in range(n)])
    processor = aware.build_processor(
        config, preprocess=lambda row: {"prompt": row["text"], "sampling_params": {"max_tokens": 4, "ignore_eos": True}},
        postprocess=lambda row: {"id": row["id"], "tokens": row["num_generated_tokens"], "params": row["params"]})
    return processor(ds).take_all()


@needs_ray_llm
@pytest.mark.integration
def test_a_cold_run_learns_the_head_that_orders_and_profiles_the_next(tiny_moe_dir, encoder, tmp_path):  # noqa: F811
    """Cold: no head; the first rows (a sample and an engine-full) go without a profile, the rest each with the
    profile the latest head learned from the engine's counts predicts, in the same run; every row answered once and
    counted by the engine, the head saved. Warm, on the same data dir: every row's profile reaches vLLM."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        cold = ExpertAware.load(data_dir=str(tmp_path / "data"), encoder=encoder)
        out = _run(cold, tiny_moe_dir, 64)
        assert sorted(r["id"] for r in out) == list(range(64)) and {r["tokens"] for r in out} == {4}
        assert all("moe_observe" in r["params"] for r in out)
        first, rest = learn_first_split(64, 16, PENDING_PER_SLOT * 4, 8)  # the rest in 2 parts: 2 heads
        assert {r["id"] for r in out if "moe_profile" not in r["params"]} == set(first)
        assert {r["id"] for r in out if "moe_profile" in r["params"]} == set(rest)
        assert cold.learn() == 64 and cold.learner.head is not None
        assert (tmp_path / "data" / "learned").is_dir()

        warm = ExpertAware.load(data_dir=str(tmp_path / "data"), encoder=encoder, learn=False)
        out = _run(warm, tiny_moe_dir, 16)
        assert sorted(r["id"] for r in out) == list(range(16))
        assert all("moe_profile" in r["params"] and "moe_observe" not in r["params"] for r in out)
        assert warm.learn() == 0
    finally:
        ray.shutdown()

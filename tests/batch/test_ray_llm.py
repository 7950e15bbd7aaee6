"""moe_cohort.batch.ray_llm: the engine set up for admission by experts, and end to end through Ray Data LLM and
vLLM CPU on the tiny MoE: a cold run learns first and orders and profiles its later rows, a warm one all of them.
The rows' plan and expert args: test_ray_llm_rows.py; the learn-first schedule: test_ray_llm_first.py."""

import importlib.util

import pytest

from moe_cohort.batch.ray_llm import PENDING_PER_SLOT, SCHEDULER_CLS, ExpertAware
from moe_cohort.batch.ray_llm_first import learn_first_split
from tests.send.learning.test_learning import encoder  # noqa: F401 (a fixture)

needs_ray_llm = pytest.mark.skipif(importlib.util.find_spec("ray") is None or importlib.util.find_spec("vllm") is None,
                                   reason="Ray Data LLM needs ray and vLLM (bash scripts/setup.sh dev)")
if importlib.util.find_spec("ray") is not None and importlib.util.find_spec("vllm") is not None:
    # here, not in a test: Ray subclasses subprocess.Popen when it is imported, and a quick test's Popen is
    # conftest's guard
    from ray.data.llm import vLLMEngineProcessorConfig


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


@needs_ray_llm
def test_a_run_that_ended_before_its_last_part_was_sent_learns_nothing(monkeypatch, caplog):
    import threading

    from moe_cohort.batch import ray_llm

    monkeypatch.setattr(ray_llm, "HAND_OVER_JOIN_S", 0.01)
    waiting = threading.Event()
    aware = ExpertAware(predictor=None, learner=object(), _box=object(),
                        _handing_over=threading.Thread(target=waiting.wait, daemon=True))
    aware._handing_over.start()
    try:
        assert aware.learn() == 0 and "nothing learned" in caplog.text  # the box is not even read
    finally:
        waiting.set()


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
        cold = ExpertAware.load(data_dir=str(tmp_path / "data"), encoder=encoder, probe=False, learn=True)
        out = _run(cold, tiny_moe_dir, 64)
        assert sorted(r["id"] for r in out) == list(range(64)) and {r["tokens"] for r in out} == {4}
        assert all("moe_observe" in r["params"] for r in out)
        first, rest = learn_first_split(64, 16, PENDING_PER_SLOT * 4, 8)  # the rest in 2 parts: 2 heads
        assert {r["id"] for r in out if "moe_profile" not in r["params"]} == set(first)
        assert {r["id"] for r in out if "moe_profile" in r["params"]} == set(rest)
        assert cold.learn() == 64 and cold.learner.head is not None
        assert (tmp_path / "data" / "learned").is_dir()

        warm = ExpertAware.load(data_dir=str(tmp_path / "data"), encoder=encoder, probe=False)
        out = _run(warm, tiny_moe_dir, 16)
        assert sorted(r["id"] for r in out) == list(range(16))
        assert all("moe_profile" in r["params"] and "moe_observe" not in r["params"] for r in out)
        assert warm.learn() == 0
    finally:
        ray.shutdown()


@needs_ray_llm
@pytest.mark.integration
def test_a_probing_run_orders_every_row_by_its_prompts_routing_and_answers_each_once(tiny_moe_dir, tmp_path):
    """Every row's prompt is probed by the engine first (one token, counted by our plugin); the rows then go each
    with the profile its probe gave, one answer per row, the probes' answers not among the outputs. Nothing is
    learned, and no encoder is loaded."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        aware = ExpertAware.load(data_dir=str(tmp_path / "data"))
        assert aware.probe and aware.predictor is None and aware.learner is None
        out = _run(aware, tiny_moe_dir, 24)
        assert sorted(r["id"] for r in out) == list(range(24)) and {r["tokens"] for r in out} == {4}
        assert all("moe_profile" in r["params"] and "moe_observe" not in r["params"] for r in out)
        assert aware.probed == 24 and aware.learn() == 0
    finally:
        ray.shutdown()

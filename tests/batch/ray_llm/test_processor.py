"""moe_cohort.batch.ray_llm (processor.py): the engine set up for admission by experts, and end to end through
Ray Data LLM and vLLM CPU on the tiny MoE: a probing run orders every row by its prompt's routing (and, learning,
saves the head a run without probes orders by). The rows' plans and expert args: test_rows.py; the source and the
output's filter: test_source.py."""

import importlib.util

import pytest

from moe_cohort.batch.ray_llm import PENDING_PER_SLOT, SCHEDULER_CLS, ExpertAware
from tests.helpers.encoders import encoder  # noqa: F401 (a fixture)

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

    from moe_cohort.batch.ray_llm import processor

    monkeypatch.setattr(processor, "HAND_OVER_JOIN_S", 0.01)
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


def test_a_run_probes_by_default_and_then_loads_no_encoder_and_without_an_encoder_keeps_the_datasets_order(tmp_path):
    probing = ExpertAware.load(data_dir=str(tmp_path))
    assert probing.probe and probing.predictor is None and probing.learner is None
    plain = ExpertAware.load(data_dir=str(tmp_path), encoder="none", learn=True)
    assert not plain.probe and plain.predictor is None and plain.learner is None


@needs_ray_llm
@pytest.mark.integration
def test_a_probing_run_orders_each_row_by_its_prompts_routing_and_learns_the_head_a_run_without_probes_uses(
        tiny_moe_dir, encoder, tmp_path):  # noqa: F811
    """Probing and learning: every row's prompt is probed by the engine first (one token, counted by our plugin);
    the rows then go each with the profile its probe gave and counted for learning, one answer per row, the
    probes' answers not among the outputs; `learn` saves the head. Without probes, on that data dir, every row's
    profile is the head's."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        probing = ExpertAware.load(data_dir=str(tmp_path / "data"), encoder=encoder, learn=True)
        out = _run(probing, tiny_moe_dir, 24)
        assert sorted(r["id"] for r in out) == list(range(24)) and {r["tokens"] for r in out} == {4}
        assert all("moe_profile" in r["params"] and "moe_observe" in r["params"] for r in out)
        assert probing.probed == 24
        assert probing.learn() == 24 and probing.learner.head is not None
        assert (tmp_path / "data" / "learned").is_dir()

        warm = ExpertAware.load(data_dir=str(tmp_path / "data"), encoder=encoder, probe=False)
        out = _run(warm, tiny_moe_dir, 16)
        assert sorted(r["id"] for r in out) == list(range(16))
        assert all("moe_profile" in r["params"] and "moe_observe" not in r["params"] for r in out)
        assert warm.probed == 0 and warm.learn() == 0
    finally:
        ray.shutdown()

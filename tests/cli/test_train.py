"""`cohort train` end to end: clear errors before any model is loaded, and a short real run."""

import json

import numpy as np
import pytest

import moe_cohort.train.finetune
from moe_cohort.cli import main
from moe_cohort.traces.format import save_traces
from moe_cohort.traces.synthetic import synthetic_traces


@pytest.fixture
def no_model_loading(monkeypatch):
    def refuse(base):
        raise AssertionError("a model was loaded before the traces were checked")

    monkeypatch.setattr(moe_cohort.train.finetune, "_load_base", refuse)


def run(capsys, *argv):
    code = main(["train", *map(str, argv)])
    return code, capsys.readouterr().out


def test_traces_without_texts_fail_before_any_model_is_loaded(tmp_path, capsys, no_model_loading):
    ts = synthetic_traces(30, seed=0)
    path = save_traces(tmp_path / "t.npz", type(ts)(**{**ts.__dict__, "texts": None}))
    code, out = run(capsys, "--traces", path, "--base", "any-model", "--output", tmp_path / "m")
    assert code == 2 and "no prompt texts" in out
    assert not (tmp_path / "m").exists()


def test_traces_with_wrong_shapes_fail_with_the_reason(tmp_path, capsys, no_model_loading):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "a", "text": "x", "experts": [[[0, 1]], [[2, 3]]]}) + "\n"
                   + json.dumps({"id": "b", "text": "y", "experts": [[[0, 1], [1, 2]]]}) + "\n")
    code, out = run(capsys, "--traces", bad, "--base", "any-model", "--output", tmp_path / "m")
    assert code == 2 and "cohort train: error:" in out and "same number of layers" in out


def test_a_missing_trace_file_and_bad_options_are_errors(tmp_path, capsys, no_model_loading):
    code, out = run(capsys, "--traces", tmp_path / "none.npz", "--base", "m", "--output", tmp_path / "m")
    assert code == 2 and "no such file" in out


def test_a_non_empty_output_needs_resume(tmp_path, capsys, no_model_loading):
    path = save_traces(tmp_path / "t.npz", synthetic_traces(30, seed=0))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "something").write_text("x")
    code, out = run(capsys, "--traces", path, "--base", "m", "--output", tmp_path / "m")
    assert code == 2 and "--resume" in out


def test_a_short_run_saves_a_model_and_reports_the_correlations(tmp_path, capsys, tiny_model_dir):
    from sentence_transformers import SentenceTransformer

    path = save_traces(tmp_path / "t.npz", synthetic_traces(60, seed=1))
    code, out = run(capsys, "--traces", path, "--base", tiny_model_dir, "--output", tmp_path / "m", "--max-pairs", "64",
                    "--batch-size", "16", "--no-progress")
    assert code == 0, out
    assert "saved the fine-tuned encoder" in out and "held-out Spearman" in out
    model = SentenceTransformer(str(tmp_path / "m"), device="cpu")
    assert model.encode(["sum integer equation"]).shape == (1, 32)
    assert np.isfinite(json.loads((tmp_path / "m" / "training.json").read_text())["spearman_after"]["all_pairs"])


def test_a_base_model_that_cannot_be_found_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = save_traces(tmp_path / "t.npz", synthetic_traces(30, seed=0))
    code, out = run(capsys, "--traces", path, "--base", tmp_path / "no-such-model", "--output", tmp_path / "m")
    assert code == 2 and "cohort train: error:" in out


def test_a_run_saves_the_profile_head_beside_the_encoder_and_only_fits_a_head_on_request(tmp_path, capsys, tiny_model_dir):
    from moe_cohort.encoder.profile import load_profile_head

    ts = synthetic_traces(60, seed=1)
    path = save_traces(tmp_path / "t.npz", ts)
    code, out = run(capsys, "--traces", path, "--base", tiny_model_dir, "--output", tmp_path / "m", "--max-pairs", "64",
                    "--batch-size", "16", "--no-progress")
    assert code == 0, out
    assert "saved the expert-profile head" in out
    head = load_profile_head(tmp_path / "m")
    assert head.dim == 32 and head.weight.shape == (32 + head.ngram_dim, ts.num_layers * ts.num_experts)
    code, out = run(capsys, "--traces", path, "--base", tiny_model_dir, "--output", tmp_path / "h", "--profile-head", "only")
    assert code == 0 and load_profile_head(tmp_path / "h") is not None and not (tmp_path / "h" / "training.json").exists()
    from moe_cohort.encoder.embedding import Embedder

    assert Embedder(tmp_path / "h").dim == 32  # the base encoder is saved beside its head: --encoder h finds both
    code, out = run(capsys, "--traces", path, "--base", tiny_model_dir, "--output", tmp_path / "n", "--max-pairs", "64",
                    "--batch-size", "16", "--no-progress", "--profile-head", "no")
    assert code == 0 and load_profile_head(tmp_path / "n") is None


@pytest.mark.parametrize("flag, value, said", [
    ("--learning-rate", "-1", "expected a number > 0, got '-1'"),
    ("--epochs", "0", "expected a number > 0, got '0'"),
    ("--holdout-share", "2", "expected a number in [0, 1), got '2'"),
    ("--max-pairs", "1", "expected an integer >= 2, got '1'"),
    ("--batch-size", "x", "expected an integer >= 2, got 'x'"),
    ("--save-steps", "0", "expected an integer >= 1, got '0'"),
    ("--max-seq-len", "-3", "expected an integer >= 0, got '-3'"),
])
def test_a_bad_number_is_one_line_naming_its_flag_before_any_work(tmp_path, capsys, no_model_loading, flag, value, said):
    with pytest.raises(SystemExit) as exited:
        main(["train", "--traces", "sample", "--output", str(tmp_path / "m"), flag, value])
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and f"argument {flag}: {said}" in err and len(err.splitlines()) == 1, err


def test_a_decode_folder_trains_on_its_generated_tokens(tmp_path, capsys, tiny_model_dir):
    """meta.json "tokens": "decode": pairs and head targets are the generated tokens (no prompt tokens)."""
    from moe_cohort.encoder.profile import load_profile_head
    from moe_cohort.traces.importers import load_traces
    from moe_cohort.traces.split import heldout_split
    from moe_cohort.train.targets import profiles
    from tests.conftest import write_trace_dir

    folder = write_trace_dir(tmp_path / "d", synthetic_traces(60, seed=2), decode=True)
    ts = load_traces(folder)
    assert not ts.num_prompt_tokens.any()
    code, out = run(capsys, "--traces", folder, "--base", tiny_model_dir, "--output", tmp_path / "m", "--max-pairs", "64",
                    "--batch-size", "16", "--no-progress")
    assert code == 0, out
    head = load_profile_head(tmp_path / "m")
    train, _ = heldout_split(ts)
    every_token = np.stack([np.stack([np.bincount(ts.request_experts(i)[:, layer].ravel(), minlength=ts.num_experts)
                                      for layer in range(ts.num_layers)]) / ts.num_tokens[i] for i in train])  # [n, L, E]
    np.testing.assert_allclose(head.memory_y.reshape(every_token.shape), every_token, atol=1e-3)  # float16 memory
    np.testing.assert_allclose(profiles(ts)[train], every_token, atol=1e-6)

"""A folder of per-request trace files (as the vLLM plugin records them) reads as one trace set."""

import re

import numpy as np
import pytest

import moe_cohort.train.finetune
from moe_cohort.cli import main
from tests.conftest import random_traces
from moe_cohort.traces.format import TraceFormatError, save_traces
from moe_cohort.traces.importers import load_traces
from moe_cohort.traces.merge import load_trace_dir, merge_traces


def _recorded_folder(path, ts, policies=("topk",)):
    """One file per request, named so that file-name order is request order, as the plugin writes them."""
    path.mkdir(parents=True, exist_ok=True)
    for i in range(len(ts)):
        one = ts.subset([i])
        extra = {"source": "moe-cohort vllm plugin", "policy": policies[i % len(policies)]}
        save_traces(path / f"req{i:03d}.npz", type(one)(**{**one.__dict__, "extra": extra}))
    return path


def _assert_same_requests(got, ts):
    np.testing.assert_array_equal(got.token_offsets, ts.token_offsets)
    np.testing.assert_array_equal(got.experts, ts.experts)
    np.testing.assert_array_equal(got.num_prompt_tokens, ts.num_prompt_tokens)
    assert got.request_ids.tolist() == ts.request_ids.tolist() and got.texts.tolist() == ts.texts.tolist()


def test_load_traces_reads_a_folder_of_recorded_files_in_name_order(tmp_path):
    ts = random_traces(9, max_decode=4, seed=2, with_weights=True, categories=["a", "b"])
    folder = _recorded_folder(tmp_path / "rec", ts, policies=["topk", "lynx-lat;drop=2"])
    got = load_traces(folder)
    _assert_same_requests(got, ts)
    np.testing.assert_array_equal(got.weights, ts.weights)
    assert got.categories.tolist() == ts.categories.tolist()
    assert got.extra["policies"] == {f"r{i}": ["topk", "lynx-lat;drop=2"][i % 2] for i in range(9)}
    assert got.extra["source"] == "moe-cohort vllm plugin"


def test_merge_keeps_an_optional_array_only_if_every_set_has_it():
    a, b = random_traces(3, seed=0, with_weights=True), random_traces(2, seed=1)
    b = type(b)(**{**b.__dict__, "request_ids": np.array(["x", "y"]), "texts": None})
    got = merge_traces([a, b])
    assert got.weights is None and got.texts is None and got.request_ids.tolist() == ["r0", "r1", "r2", "x", "y"]
    np.testing.assert_array_equal(got.experts, np.concatenate([a.experts, b.experts]))
    np.testing.assert_array_equal(got.token_offsets, np.concatenate([a.token_offsets, a.token_offsets[-1] + b.token_offsets[1:]]))


def test_merge_rejects_different_model_shapes_and_nothing():
    with pytest.raises(TraceFormatError, match="different model shapes"):
        merge_traces([random_traces(2, num_experts=8), random_traces(2, num_experts=9)])
    with pytest.raises(TraceFormatError, match="no trace sets"):
        merge_traces([])


def test_duplicate_request_ids_across_files_are_rejected(tmp_path):
    ts = random_traces(2, seed=0)
    save_traces(tmp_path / "a.npz", ts)
    save_traces(tmp_path / "b.npz", random_traces(2, seed=1))  # the same ids r0, r1
    with pytest.raises(TraceFormatError, match="request_ids must be unique"):
        load_traces(tmp_path)


def test_a_broken_file_in_the_folder_is_named(tmp_path):
    _recorded_folder(tmp_path, random_traces(2))
    (tmp_path / "zz.npz").write_bytes(b"not a zip")
    with pytest.raises(TraceFormatError, match="zz.npz: not a readable"):
        load_traces(tmp_path)


def test_a_folder_without_trace_files_says_what_is_expected(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(TraceFormatError, match="recorded .npz trace files"):
        load_traces(tmp_path)
    with pytest.raises(TraceFormatError, match="no .npz trace files"):
        load_trace_dir(tmp_path)


def test_cohort_eval_and_traces_info_take_the_folder(tmp_path, capsys):
    folder = _recorded_folder(tmp_path / "rec", random_traces(24, num_experts=16, max_decode=3, seed=4))
    assert main(["traces", "info", str(folder)]) == 0
    assert re.search(r"requests\s+24\n", capsys.readouterr().out)
    assert main(["eval", "--traces", str(folder), "--batch-size", "4", "--json", "--decode-steps", "2"]) == 0
    assert '"num_requests": 24' in capsys.readouterr().out


def test_cohort_train_reads_the_folder_before_loading_a_model(tmp_path, capsys, monkeypatch):
    def no_model(base):
        raise OSError(f"no model {base} in this test")

    monkeypatch.setattr(moe_cohort.train.finetune, "_load_base", no_model)
    folder = _recorded_folder(tmp_path / "rec", random_traces(30, num_experts=16, seed=5))
    assert main(["train", "--traces", str(folder), "--base", "m", "--output", str(tmp_path / "out")]) == 2
    out = capsys.readouterr().out
    assert f"training on 30 requests of {folder}" in out and "no model m in this test" in out

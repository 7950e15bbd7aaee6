import json

import numpy as np
import pytest

from tests.conftest import random_traces
from moe_cohort.traces.format import TraceFormatError
from moe_cohort.traces.importers import import_jsonl, load_traces


def _write_prompt_trace_dir(path, ts):
    """The DeepSeek-V2-Lite Puffin layout: experts [L, T, k], numeric prompt ids, prompts.jsonl."""
    path.mkdir()
    np.savez(path / "traces.npz", prompt_ids=np.arange(1, len(ts) + 1), token_offsets=ts.token_offsets,
             experts=ts.experts.transpose(1, 0, 2))
    with open(path / "prompts.jsonl", "w") as f:
        for i in range(len(ts)):
            f.write(json.dumps({"prompt_id": i + 1, "text": f"prompt {i}", "n_tokens": int(ts.num_tokens[i])}) + "\n")


def test_prompt_trace_dir_is_imported_token_major(tmp_path):
    ts = random_traces(num_experts=12)
    _write_prompt_trace_dir(tmp_path / "d", ts)
    got = load_traces(tmp_path / "d", num_experts=12)
    np.testing.assert_array_equal(got.experts, ts.experts)
    np.testing.assert_array_equal(got.num_prompt_tokens, ts.num_tokens)  # prompt-only traces
    assert got.request_ids[0] == "1" and got.texts[2] == "prompt 2" and got.num_experts == 12


def test_a_decode_trace_dir_is_read_as_generated_tokens(tmp_path):
    """meta.json "tokens": "decode" (the gpt-oss-20b layout): every token is a decode step, the shape from meta."""
    ts = random_traces(num_experts=12, max_prompt=9, seed=4)
    _write_prompt_trace_dir(tmp_path / "d", ts)
    meta = {"model": "m/decoder", "num_layers": ts.num_layers, "num_experts": 16, "top_k": ts.top_k, "tokens": "decode"}
    (tmp_path / "d" / "meta.json").write_text(json.dumps(meta))
    got = load_traces(tmp_path / "d")
    np.testing.assert_array_equal(got.experts, ts.experts)
    np.testing.assert_array_equal(got.num_decode_tokens, ts.num_tokens)
    assert not got.num_prompt_tokens.any() and got.num_experts == 16 and got.model == "m/decoder"
    (tmp_path / "d" / "meta.json").write_text(json.dumps({**meta, "tokens": "prompt"}))
    assert not load_traces(tmp_path / "d").num_decode_tokens.any()
    (tmp_path / "d" / "meta.json").write_text(json.dumps({**meta, "tokens": "generated"}))
    with pytest.raises(TraceFormatError, match='"tokens" must be one of prompt, decode'):
        load_traces(tmp_path / "d")


def test_prompt_trace_dir_with_mismatched_lengths_is_rejected(tmp_path):
    ts = random_traces(seed=3)
    _write_prompt_trace_dir(tmp_path / "d", ts)
    lines = (tmp_path / "d" / "prompts.jsonl").read_text().splitlines()
    rec = json.loads(lines[1]); rec["n_tokens"] += 1; lines[1] = json.dumps(rec)
    (tmp_path / "d" / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceFormatError, match="prompts.jsonl line 2: n_tokens="):
        load_traces(tmp_path / "d")


def _records(ts):
    for i in range(len(ts)):
        yield {"id": ts.request_ids[i], "text": ts.texts[i], "experts": ts.request_experts(i).tolist(),
               "num_prompt_tokens": int(ts.num_prompt_tokens[i]), "category": "c"}


def test_jsonl_import_round_trips_prompt_and_decode_tokens(tmp_path):
    ts = random_traces(max_decode=4, seed=5)
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _records(ts)))
    got = load_traces(path, num_experts=ts.num_experts)
    np.testing.assert_array_equal(got.experts, ts.experts)
    np.testing.assert_array_equal(got.token_offsets, ts.token_offsets)
    np.testing.assert_array_equal(got.num_prompt_tokens, ts.num_prompt_tokens)
    assert got.categories.tolist() == ["c"] * len(ts)


@pytest.mark.parametrize("bad, message", [
    ("{not json", "line 2: invalid JSON"),
    (json.dumps({"experts": [[[1, 2]]]}), "line 2: missing field 'id'"),
    (json.dumps({"id": "x", "experts": [[[1, 2]]], "num_prompt_tokens": 5}), "line 2: num_prompt_tokens must be"),
    (json.dumps({"id": "x", "experts": [[[1, "a"]]]}), "line 2: 'experts'/'weights' must be nested lists"),
    (json.dumps({"id": "x", "experts": [[[1, 2]]], "weights": [[[0.5]]]}), "line 2: 'weights' shape"),
    (json.dumps({"id": "x", "experts": [[[1, 2, 3]]]}), "same number of layers and k ids"),
])
def test_jsonl_errors_name_the_line(tmp_path, bad, message):
    good = json.dumps({"id": "a", "text": "t", "experts": [[[0, 1]], [[1, 2]]], "num_prompt_tokens": 2})
    path = tmp_path / "t.jsonl"
    path.write_text(good + "\n" + bad + "\n")
    with pytest.raises(TraceFormatError, match=message):
        import_jsonl(path)


def test_unknown_paths_and_layouts_say_what_is_expected(tmp_path):
    with pytest.raises(TraceFormatError, match="no such file or directory"):
        load_traces(tmp_path / "missing.npz")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(TraceFormatError, match="unknown trace layout"):
        load_traces(tmp_path / "x.csv")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceFormatError, match="needs traces.npz and prompts.jsonl"):
        load_traces(tmp_path / "empty")


def test_builtin_sample_has_texts_and_categories():
    ts = load_traces("sample")
    assert len(ts) == 400 and ts.texts is not None and len(set(ts.categories.tolist())) == 8

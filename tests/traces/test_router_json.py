"""The router JSON folder (the public GPT-OSS-MoE-ExpertFingerprinting layout), imported against the arrays
the test wrote; malformed files named with the key at fault; dropping leading tokens against a loop."""

import json
import logging

import numpy as np
import pytest

from moe_cohort.traces.format import TraceFormatError
from moe_cohort.traces.importers import drop_leading_tokens, import_router_json_dir, load_traces
from tests.conftest import random_traces
from tests.helpers.router_dir import write_router_dir


def test_the_folder_is_imported_as_decode_tokens_in_file_number_order(tmp_path):
    written = write_router_dir(tmp_path / "d")
    ts = load_traces(tmp_path / "d")
    order = ["1", "2", "10"]
    assert ts.request_ids.tolist() == order
    assert ts.texts.tolist() == [written[n][0] for n in order]
    np.testing.assert_array_equal(ts.experts, np.concatenate([written[n][1] for n in order]))
    np.testing.assert_array_equal(ts.weights, np.concatenate([written[n][2] for n in order]))
    np.testing.assert_array_equal(ts.num_tokens, [len(written[n][1]) for n in order])
    assert not ts.num_prompt_tokens.any()  # every token was generated
    assert (ts.num_experts, ts.num_layers, ts.top_k) == (32, 2, 4)


def test_num_experts_given_or_inferred_past_gpt_oss_with_a_warning(tmp_path, caplog):
    write_router_dir(tmp_path / "d", num_experts=40, lengths=(6, 6, 6), seed=1)
    assert import_router_json_dir(tmp_path / "d", num_experts=64).num_experts == 64
    with caplog.at_level(logging.WARNING):
        ts = import_router_json_dir(tmp_path / "d")
    assert ts.num_experts == int(ts.experts.max()) + 1 > 32
    assert "num_experts inferred" in caplog.text
    with pytest.raises(TraceFormatError, match=r"expert ids must lie in \[0, 8\)"):
        import_router_json_dir(tmp_path / "d", num_experts=8)


def test_an_empty_answer_is_a_request_without_tokens(tmp_path):
    write_router_dir(tmp_path / "d", lengths=(2, 0, 3))
    ts = load_traces(tmp_path / "d")
    assert ts.num_tokens.tolist() == [3, 0, 2]  # files 1, 2, 10


def _token(experts=(0, 1, 2, 3), probs=(0.4, 0.3, 0.2, 0.1)):
    return {"token_0": {"layer_0": {"selected_experts": list(experts), "selected_probs": list(probs)}}}


@pytest.mark.parametrize("record, message", [
    ("{not json", "not valid JSON"),
    ([], "expected a JSON object"),
    ({"router_data": [_token()]}, 'key "original_prompt"'),
    ({"original_prompt": "p"}, 'key "router_data"'),
    ({"original_prompt": "p", "router_data": {"token_0": {}}}, 'key "router_data"'),
    ({"original_prompt": "p", "router_data": [{"layer_0": {}}]}, r'router_data\[0\] must be \{"token_N"'),
    ({"original_prompt": "p", "router_data": [{"token_0": {"mlp": {}}}]}, r'router_data\[0\]\.token_0 must map "layer_L"'),
    ({"original_prompt": "p", "router_data": [{"token_0": {"layer_0": {"selected_probs": [1.0]}}}]},
     r'token_0\.layer_0: key "selected_experts"'),
    ({"original_prompt": "p", "router_data": [{"token_0": {"layer_0": {"selected_experts": [1]}}}]},
     r'token_0\.layer_0: key "selected_probs"'),
    ({"original_prompt": "p", "router_data": [_token(), _token(experts=(0, 1, 2))]}, "same count k"),
    ({"original_prompt": "p", "router_data": [_token(probs=(0.5, 0.5))]}, "same count k"),
    ({"original_prompt": "p", "router_data": [_token(experts=(0.5, 1, 2, 3))]}, 'key "selected_experts" must hold integer'),
    ({"original_prompt": "p", "router_data": [_token(experts=(-1, 1, 2, 3))]}, 'key "selected_experts" holds a negative'),
    ({"original_prompt": "p", "router_data": [_token(), {"token_1": {"layer_1": _token()["token_0"]["layer_0"]}}]},
     r"router_data\[1\]\.token_1 lists layers \['layer_1'\]"),
])
def test_a_malformed_file_is_named_with_its_key(tmp_path, record, message):
    write_router_dir(tmp_path / "d", lengths=(2,), names=("good",))
    bad = tmp_path / "d" / "bad.json"
    bad.write_text(record if isinstance(record, str) else json.dumps(record))
    with pytest.raises(TraceFormatError, match=message) as err:
        load_traces(tmp_path / "d")
    assert str(err.value).startswith(str(bad)) and "\n" not in str(err.value)


def test_files_that_disagree_on_layers_are_refused(tmp_path):
    write_router_dir(tmp_path / "d", lengths=(2,), names=("a",))
    (tmp_path / "d" / "b.json").write_text(json.dumps({"original_prompt": "p", "router_data": [_token()]}))
    with pytest.raises(TraceFormatError, match="same layers and k experts"):
        load_traces(tmp_path / "d")


def test_dropping_leading_tokens_matches_a_loop_over_requests():
    ts = random_traces(30, max_prompt=4, max_decode=5, seed=6, with_weights=True)
    for n in (0, 1, 3, 20):
        got = drop_leading_tokens(ts, n)
        for i in range(len(ts)):
            np.testing.assert_array_equal(got.request_experts(i), ts.request_experts(i)[n:])
            start, end = ts.token_offsets[i], ts.token_offsets[i + 1]
            np.testing.assert_array_equal(got.weights[got.token_offsets[i]:got.token_offsets[i + 1]],
                                          ts.weights[start:end][n:])
            assert got.num_prompt_tokens[i] == max(int(ts.num_prompt_tokens[i]) - n, 0)
            assert got.num_decode_tokens[i] == min(int(ts.num_decode_tokens[i]), len(ts.request_experts(i)[n:]))
        assert got.request_ids.tolist() == ts.request_ids.tolist()

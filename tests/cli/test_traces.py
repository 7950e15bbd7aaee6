import json

import numpy as np

from moe_cohort.cli import main
from moe_cohort.traces.importers import load_traces
from tests.helpers.router_dir import write_router_dir


def test_import_then_info(tmp_path, capsys):
    src = tmp_path / "t.jsonl"
    src.write_text(json.dumps({"id": "a", "text": "hi", "experts": [[[0, 5]], [[1, 5]]], "num_prompt_tokens": 1}) + "\n")
    assert main(["traces", "import", str(src), "-o", str(tmp_path / "out"), "--num-experts", "8"]) == 0
    assert "wrote" in capsys.readouterr().out
    ts = load_traces(tmp_path / "out.npz")
    assert (ts.num_experts, int(ts.num_decode_tokens[0])) == (8, 1)
    assert main(["traces", "info", str(tmp_path / "out.npz")]) == 0
    out = capsys.readouterr().out
    assert "8 per layer, top-2, 1 MoE layers" in out and "2 (1 prompt, 1 generated)" in out


def test_import_error_is_reported(tmp_path, capsys):
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"id": "a", "experts": [[[0, 1]]], "num_prompt_tokens": 3}\n')
    assert main(["traces", "import", str(bad), "-o", str(tmp_path / "o.npz")]) == 2
    assert "line 1: num_prompt_tokens must be" in capsys.readouterr().out


def test_an_output_that_is_a_folder_or_a_bad_expert_count_is_one_line(tmp_path, capsys):
    import pytest

    assert main(["traces", "import", "sample", "-o", str(tmp_path)]) == 2
    said = capsys.readouterr().out.strip()
    assert said == f"cohort traces: error: --output {tmp_path} is a folder; give a file path such as {tmp_path / 'traces.npz'}"
    with pytest.raises(SystemExit):
        main(["traces", "import", "sample", "-o", str(tmp_path / "t.npz"), "--num-experts", "0"])
    assert "argument --num-experts: expected a positive integer, got '0'" in capsys.readouterr().err


def test_a_router_json_folder_is_imported_with_its_leading_tokens_dropped(tmp_path, capsys):
    written = write_router_dir(tmp_path / "gpt-oss", lengths=(5, 2, 4))
    out = tmp_path / "gpt-oss.npz"
    assert main(["traces", "import", str(tmp_path / "gpt-oss"), "-o", str(out), "--drop-leading-tokens", "3"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out} (3 requests)"
    ts = load_traces(out)
    order = ["1", "2", "10"]
    assert ts.request_ids.tolist() == order and ts.texts.tolist() == [written[n][0] for n in order]
    np.testing.assert_array_equal(ts.experts, np.concatenate([written[n][1][3:] for n in order]))
    np.testing.assert_array_equal(ts.weights, np.concatenate([written[n][2][3:] for n in order]))
    assert ts.num_tokens.tolist() == [1, 0, 2] and not ts.num_prompt_tokens.any() and ts.num_experts == 32
    assert main(["traces", "info", str(out)]) == 0
    assert "32 per layer, top-4, 2 MoE layers" in capsys.readouterr().out


def test_a_malformed_router_file_is_one_line_naming_the_file_and_the_key(tmp_path, capsys):
    write_router_dir(tmp_path / "d", lengths=(2,), names=("7",))
    (tmp_path / "d" / "8.json").write_text(json.dumps({"router_data": []}))
    assert main(["traces", "import", str(tmp_path / "d"), "-o", str(tmp_path / "o.npz")]) == 2
    said = capsys.readouterr().out
    assert said == f'cohort traces: error: {tmp_path / "d" / "8.json"}: key "original_prompt" must be the prompt text (a string)\n'

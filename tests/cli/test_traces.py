import json

from moe_cohort.cli import main
from moe_cohort.traces.importers import load_traces


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

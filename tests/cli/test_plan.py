import json

import numpy as np
import pytest

from moe_cohort.cli import main
from moe_cohort.encoder.plans import read_plan_file, validate_plan


def batch_line(cid, content):
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "m", "messages": [{"role": "user", "content": content}]}})


TOPICS = ["python list sorting", "pizza recipes from Naples", "proof of the prime number theorem", "the French revolution"]
GOOD = [batch_line(f"req-{i}", f"Question {i} about {TOPICS[i % 4]}") for i in range(10)] + [
    json.dumps({"id": i, "text": f"Note {i} on {TOPICS[i % 4]}"}) for i in range(10, 14)]


def write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_bad_line_stops_with_its_line_number(tmp_path, capsys):
    src = write(tmp_path / "in.jsonl", GOOD[:3] + ['{"custom_id": "x", "body": {"prompt": [1, 2]}}'] + GOOD[3:])
    rc = main(["plan", "--input", str(src), "--batch-size", "4", "--output", str(tmp_path / "plan.jsonl")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "line 4" in err and "token-id" in err
    assert not (tmp_path / "plan.jsonl").exists()


@pytest.mark.parametrize("args, match", [
    (["--batch-size", "4", "--errors", "r.jsonl"], "--errors only applies with --skip-invalid"),
])
def test_bad_arguments(tmp_path, capsys, args, match):
    src = write(tmp_path / "in.jsonl", GOOD)
    assert main(["plan", "--input", str(src), "--output", str(tmp_path / "p.jsonl")] + args) == 2
    assert match in capsys.readouterr().err


def test_missing_input_and_nothing_valid(tmp_path, capsys):
    out = str(tmp_path / "p.jsonl")
    assert main(["plan", "--input", str(tmp_path / "nope.jsonl"), "--batch-size", "4", "--output", out]) == 2
    src = write(tmp_path / "bad.jsonl", ["nope", "{}"])
    assert main(["plan", "--input", str(src), "--batch-size", "4", "--output", out, "--skip-invalid"]) == 2
    assert "no valid requests" in capsys.readouterr().err


def test_plans_good_lines_and_rejects_bad_ones(tmp_path, capsys, minilm_dir):
    lines = GOOD[:5] + ["{broken", "", GOOD[0].replace("Question 0", "dup")] + GOOD[5:]
    src, out, rejects = write(tmp_path / "in.jsonl", lines), tmp_path / "plan.jsonl", tmp_path / "rej.jsonl"
    rc = main(["plan", "--input", str(src), "--batch-size", "4", "--output", str(out), "--skip-invalid",
               "--errors", str(rejects), "--encoder", minilm_dir, "--max-seq-len", "64", "--no-progress"])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(set(r) == {"id", "batch", "position"} for r in rows)
    ids = [json.loads(g).get("custom_id", json.loads(g).get("id")) for g in GOOD]
    assert sorted(map(str, (r["id"] for r in rows))) == sorted(map(str, ids))
    assert [r["id"] for r in rows if r["id"] in (10, 11, 12, 13)]  # integer ids stay integers
    plan = read_plan_file(out, [str(i) for i in ids])  # what `cohort eval --plan` reads
    validate_plan(plan, len(ids), 4)
    assert [len(b) for b in plan] == [4, 4, 4, 2]
    assert [r["position"] for r in rows[:4]] == [0, 1, 2, 3]
    rej = [json.loads(line) for line in rejects.read_text().splitlines()]
    assert [(r["line"], r["raw"]) for r in rej] == [(6, "{broken"), (8, lines[7])]
    assert "duplicate id" in rej[1]["error"]
    assert "planned 14 requests into 4 batches" in capsys.readouterr().err


def test_encoder_plan_api(minilm_dir):
    from moe_cohort.encoder import encoder_plan

    texts = [f"Question {i} about {TOPICS[i % 4]}" for i in range(12)]
    plan = encoder_plan(texts, 3, encoder=minilm_dir)
    validate_plan(plan, 12, 3)
    assert all(len({i % 4 for i in b.tolist()}) == 1 for b in plan)  # one topic per batch
    assert isinstance(plan[0], np.ndarray)


@pytest.mark.parametrize("extra, message", [
    (["--encoder", "/nope"], "no such model folder"),
    (["--output", "."], "is a folder; give a file path"),
    (["--output", "/no/such/dir/plan.jsonl"], "does not exist"),
])
def test_bad_arguments_fail_before_any_work_in_one_line(tmp_path, capsys, extra, message):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "text": "hello"}) + "\n")
    args = ["plan", "--input", str(src), "--batch-size", "4", "--output", str(tmp_path / "plan.jsonl"), *extra]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("extra, message", [
    (["--max-seq-len", "0"], "argument --max-seq-len: expected a positive integer, got 0"),
    (["--batch-size", "0"], "argument --batch-size: expected a positive integer, got 0"),
    (["--batch-size", "x"], "argument --batch-size: expected a positive integer, got 'x'"),
    (["--input", "."], "--input .: is a folder"),
])
def test_bad_values_are_one_line_naming_the_flag(tmp_path, capsys, extra, message):
    src = write(tmp_path / "in.jsonl", GOOD)
    try:
        code = main(["plan", "--input", str(src), "--batch-size", "4", "--output", str(tmp_path / "p.jsonl"), *extra])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err

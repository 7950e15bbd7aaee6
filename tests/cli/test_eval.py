"""`cohort eval` and `cohort replay` end to end on small trace files written by the test."""

import json
import re

import pytest

from moe_cohort.cli import main
from tests.conftest import random_traces, write_trace_dir
from moe_cohort.traces.format import save_traces


@pytest.fixture
def trace_file(tmp_path):
    return save_traces(tmp_path / "t.npz", random_traces(40, num_experts=24, top_k=3, max_prompt=9, seed=7,
                                                         categories=["x", "y"]))


def test_json_output_has_every_plan_and_the_schema(trace_file, capsys):
    assert main(["eval", "--traces", str(trace_file), "--batch-size", "8", "--json", "--decode-steps", "6",
                 "--encoder", "none"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["batch_size"], out["decode_steps"], out["num_requests"]) == (8, 6, 40)
    assert set(out["plans"]) == {"random", "arrival", "category", "oracle"}
    for row in out["plans"].values():
        assert {"decode_loads", "prefill_loads", "saving", "capture"} <= set(row)
    assert out["plans"]["oracle"]["capture"] == 1.0
    assert out["plans"]["oracle"]["decode_loads"] < out["plans"]["random"]["decode_loads"]


def test_plan_file_is_evaluated_beside_the_baselines(trace_file, tmp_path, capsys):
    plan = tmp_path / "plan.jsonl"
    plan.write_text("".join(json.dumps({"id": f"r{i}", "batch": i // 8}) + "\n" for i in range(40)))
    assert main(["eval", "--traces", str(trace_file), "--batch-size", "8", "--plan", str(plan), "--json",
                 "--encoder", "none"]) == 0
    out = json.loads(capsys.readouterr().out)["plans"]
    assert out["plan"]["decode_loads"] == out["arrival"]["decode_loads"]  # same batches as arrival order


def test_report_writes_json_markdown_and_plot(trace_file, tmp_path, capsys):
    assert main(["eval", "--traces", str(trace_file), "--batch-size", "4", "--report", str(tmp_path / "r"),
                 "--sweep", "2,8", "--encoder", "none"]) == 0
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert [r["batch_size"] for r in report] == [2, 4, 8]
    assert (tmp_path / "r" / "saving.png").read_bytes()[:4] == b"\x89PNG"
    assert "oracle" in capsys.readouterr().out


def test_errors_are_one_clear_line(tmp_path, trace_file, capsys):
    assert main(["eval", "--traces", str(tmp_path / "nope.npz"), "--batch-size", "4"]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    bad = tmp_path / "plan.jsonl"
    bad.write_text(json.dumps({"id": "r0", "batch": 0}) + "\n")
    assert main(["eval", "--traces", str(trace_file), "--batch-size", "4", "--plan", str(bad)]) == 2
    assert "39 request(s) of the traces are in no batch" in capsys.readouterr().err


def test_batch_size_must_be_positive(trace_file, capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--traces", str(trace_file), "--batch-size", "0"])
    assert "expected a positive integer" in capsys.readouterr().err


@pytest.mark.integration  # the packaged encoder
def test_encoder_plan_recovers_planted_topics(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["eval", "--traces", "sample", "--batch-size", "16", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert plans["encoder"]["capture"] > 0.6  # texts carry the topic that drives the experts
    assert plans["encoder"]["decode_loads"] < plans["arrival"]["decode_loads"]


def test_random_decode_phase_is_accepted(trace_file, capsys):
    assert main(["eval", "--traces", str(trace_file), "--batch-size", "8", "--json", "--encoder", "none",
                 "--decode-phase", "random"]) == 0
    assert json.loads(capsys.readouterr().out)["plans"]["oracle"]["saving"] > 0


def test_continuous_engine_json_keeps_the_plans_shape_and_the_report_draws_both_engines(tmp_path, capsys):
    from moe_cohort.traces.synthetic import synthetic_traces

    path = save_traces(tmp_path / "s.npz", synthetic_traces(90, num_experts=16, num_layers=3, top_k=2, seed=1))
    assert main(["replay", "--traces", str(path), "--slots", "4", "--json", "--encoder", "none",
                 "--lengths", "lognormal:0.5", "--mean-length", "6", "--seeds", "2", "--cost-model", "qwen3-30b-a3b"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["slots"], out["num_requests"], out["cost_model"]) == (4, 90, "qwen3-30b-a3b")
    assert list(out["plans"]) == ["random", "arrival", "reference"]
    for row in out["plans"].values():
        assert {"saving", "capture", "loads_per_token", "step_us_per_token", "tokens_per_s"} <= set(row)
    assert out["plans"]["reference"]["capture"] == 1.0 and out["plans"]["reference"]["saving"] > 0
    assert main(["replay", "--traces", str(path), "--slots", "4", "--encoder", "none",
                 "--mean-length", "6", "--seeds", "2", "--report", str(tmp_path / "r"), "--sweep", "2,8"]) == 0
    assert {p.name for p in (tmp_path / "r").iterdir()} == {"report.json", "report.md", "saving.png", "moe_time.png"}
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert [r["slots"] for r in report["continuous"]] == [2, 4, 8] == [r["batch_size"] for r in report["static"]]
    assert all("moe_us_per_token" in row for r in report["static"] for row in r["plans"].values())


def test_closed_loop_clients_leave_the_reference_less_to_choose_from(tmp_path, capsys):
    from moe_cohort.traces.synthetic import synthetic_traces

    path = save_traces(tmp_path / "s.npz", synthetic_traces(90, num_experts=16, num_layers=3, top_k=2, seed=1))
    common = ["replay", "--traces", str(path), "--slots", "4", "--json", "--encoder", "none", "--lengths", "fixed",
              "--mean-length", "6", "--seeds", "2"]
    saving = {}
    for clients in (None, 5, 90):
        assert main(common + ([] if clients is None else ["--clients", str(clients)])) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["clients"] == clients
        saving[clients] = out["plans"]["reference"]["saving"]
    assert saving[90] == saving[None]  # as many clients as requests: every request waits from the start
    assert 0 < saving[5] < saving[None]  # one request waiting at most: little to choose from
    assert main([a for a in common if a != "--json"] + ["--clients", "5"]) == 0
    assert "S = 4 slots, 5 closed-loop clients" in capsys.readouterr().out


def test_the_replay_keeps_the_engine_full_unless_told_not_to(tmp_path, capsys):
    from moe_cohort.traces.synthetic import synthetic_traces

    path = save_traces(tmp_path / "s.npz", synthetic_traces(40, num_experts=16, num_layers=3, top_k=2, seed=2))
    common = ["replay", "--traces", str(path), "--slots", "8", "--json", "--encoder", "none", "--lengths", "lognormal",
              "--mean-length", "12", "--seeds", "2"]
    rows = {}
    for flag, kept_full in (([], True), (["--kept-full"], True), (["--no-kept-full"], False)):
        assert main(common + flag) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["kept_full"] is kept_full, flag
        rows[kept_full] = out["plans"]["random"]["loads_per_token"]
    assert rows[True] < rows[False]  # the drain: the last requests share each load with fewer tokens
    assert main([a for a in common if a != "--json"]) == 0
    assert "S = 8 slots, steps with every slot busy only" in capsys.readouterr().out
    assert main(common + ["--report", str(tmp_path / "r"), "--sweep", "8"]) == 0  # the report counts every step
    assert json.loads((tmp_path / "r" / "report.json").read_text())["continuous"][0]["kept_full"] is False


def test_replay_rejects_a_bad_cost_model_and_eval_needs_a_batch_size(trace_file, capsys):
    assert main(["replay", "--traces", str(trace_file), "--encoder", "none", "--cost-model", "warp-drive"]) == 2
    assert "cost model" in capsys.readouterr().err
    assert _run(["eval", "--traces", str(trace_file), "--encoder", "none"], capsys)[::2] == (2, (
        "cohort eval: error: the following arguments are required: --batch-size (see `cohort eval --help`)\n"))


def test_both_commands_read_decode_traces_with_their_own_lengths(tmp_path, capsys):
    ts = random_traces(30, num_experts=12, top_k=2, max_prompt=4, max_decode=6, seed=4)
    path = save_traces(tmp_path / "decode.npz", ts)
    assert main(["eval", "--traces", str(path), "--batch-size", "4", "--json", "--encoder", "none"]) == 0
    assert json.loads(capsys.readouterr().out)["decode_mode"] == "real"
    rows = []
    for lengths in (["--lengths", "fixed", "--mean-length", "1"], []):  # ignored: each request runs as long as it ran
        assert main(["replay", "--traces", str(path), "--slots", "4", "--json", "--encoder", "none", "--seeds", "2",
                     *lengths]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["decode_mode"] == "real"
        rows.append(out["plans"])
    assert rows[0] == rows[1]


@pytest.mark.parametrize("layout", ["decode-folder", "no-prompt-npz"])
def test_decode_only_traces_replay_their_generated_tokens(tmp_path, capsys, layout):
    """A folder whose meta.json says "tokens": "decode", and a moe-cohort trace whose requests have no prompt
    tokens: static plans and the replay read the generated tokens, each request for as long as it ran."""
    ts = random_traces(30, num_experts=12, top_k=2, max_prompt=0, max_decode=8, seed=6)
    path = write_trace_dir(tmp_path / "d", ts, decode=True) if layout == "decode-folder" else save_traces(tmp_path / "d.npz", ts)
    assert main(["eval", "--traces", str(path), "--batch-size", "4", "--json", "--encoder", "none"]) == 0
    static = json.loads(capsys.readouterr().out)
    assert static["decode_mode"] == "real" and static["plans"]["oracle"]["saving"] > 0
    rows = []
    for lengths in ([], ["--lengths", "fixed", "--mean-length", "50"]):  # ignored: each request runs as long as it ran
        assert main(["replay", "--traces", str(path), "--slots", "4", "--json", "--encoder", "none", "--seeds", "2",
                     *lengths]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["decode_mode"] == "real" and out["num_requests"] == 30
        rows.append(out["plans"])
    assert rows[0] == rows[1] and rows[0]["reference"]["saving"] > 0


def _run(args, capsys) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `cohort ARGS`, argparse's exits included."""
    try:
        code = main(args)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("command, extra, flag", [
    ("eval", ["--sweep", "8,abc", "--report", "{tmp}/r"], "--sweep"),
    ("eval", ["--report", "{tmp}/existing.txt"], "--report"),
    ("eval", ["--traces", "{tmp}/nope.npz"], "--traces"),
    ("eval", ["--plan", "{tmp}/nope.jsonl"], "--plan"),
    ("eval", ["--seeds", "0"], "--seeds"),
    ("eval", ["--decode-steps", "x"], "--decode-steps"),
    ("eval", ["--encoder", "{tmp}/no-such-encoder"], "--encoder"),
    ("replay", ["--traces", "{tmp}/nope.npz"], "--traces"),
    ("replay", ["--encoder", "{tmp}/no-such-encoder"], "--encoder"),
    ("replay", ["--slots", "0"], "--slots"),
    ("replay", ["--mean-length", "0"], "--mean-length"),
    ("replay", ["--lengths", "lognormal:wide"], "--lengths"),
    ("replay", ["--lengths", "{tmp}/nope.txt"], "--lengths"),
    ("replay", ["--cost-model", "warp-drive"], "--cost-model"),
    ("replay", ["--moe-share", "2"], "--moe-share"),
    ("replay", ["--non-moe-us", "-1"], "--non-moe-us"),
    ("replay", ["--max-queue-steps", "-3"], "--max-queue-steps"),
    ("replay", ["--clients", "0"], "--clients"),
    ("replay", ["--clients", "8", "--replicas", "2"], "--clients"),
    ("replay", ["--kept-full", "--replicas", "2"], "--kept-full"),
    ("replay", ["--sweep", "4,,x", "--report", "{tmp}/r"], "--sweep"),
])
def test_a_bad_argument_is_one_line_naming_the_flag_before_any_work(trace_file, tmp_path, capsys, command, extra, flag):
    (tmp_path / "existing.txt").write_text("not a folder\n")
    extra = [a.replace("{tmp}", str(tmp_path)) for a in extra]
    size = ["--batch-size", "4"] if command == "eval" else []
    code, out, err = _run([command, "--traces", str(trace_file), *size, "--encoder", "none", *extra], capsys)
    assert (code, out) == (2, "")  # nothing evaluated or printed before the check
    assert len(err.strip().splitlines()) == 1 and flag in err and "Traceback" not in err, err
    assert err.startswith(f"cohort {command}: error:"), err
    assert not (tmp_path / "r").exists()


@pytest.mark.integration  # a process, and the packaged encoder
@pytest.mark.parametrize("quiet", [False, True])
def test_embedding_shows_progress_on_stderr_unless_no_progress(quiet):
    import os
    import subprocess
    import sys

    # the packaged MiniLM: a transformer, embedding long enough for a bar (the default static encoder shows none)
    args = [sys.executable, "-m", "moe_cohort.cli", "eval", "--traces", "sample", "--batch-size", "16", "--json",
            "--encoder", "all-MiniLM-L6-v2", *(["--no-progress"] if quiet else [])]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr
    assert "encoder" in json.loads(done.stdout)["plans"]  # the traces' texts were embedded
    if quiet:
        assert "embedding" not in done.stderr and "Loading weights" not in done.stderr, done.stderr
    else:
        # tqdm's bar, prompts embedded out of all (the bar clears itself at the end: its last refresh may be
        # short of 100% when the embedding is fast)
        assert re.search(r"embedding: +\d+%.*\| *\d+/400 ", done.stderr), done.stderr


def test_the_replay_gives_a_head_that_reads_ngrams_the_prompt_texts():
    import numpy as np

    from moe_cohort.eval.replay import decode_tokens
    from moe_cohort.cli.replay import continuous_policies
    from moe_cohort.train.profile_head import fit_profile_head
    from moe_cohort.train.targets import profiles

    ts = random_traces(30, num_experts=12, top_k=2, max_prompt=0, max_decode=6, seed=9)
    x = np.random.default_rng(0).normal(size=(30, 5)).astype(np.float32)  # [N, D]
    texts = [str(t) for t in ts.texts]
    head = fit_profile_head(x, profiles(ts), ts.top_k, texts=texts)
    assert head.ngram_dim > 0
    policies = continuous_policies(ts, decode_tokens(ts), 4, x=x, head=head)
    np.testing.assert_allclose(policies["text-profile"].vectors, head.predict(x, texts).reshape(30, -1), rtol=1e-6)

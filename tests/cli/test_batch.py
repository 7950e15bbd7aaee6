"""`cohort batch run` against a real vLLM CPU server: kill -9 and resume, invalid lines, dry run."""

import json
import re
import signal
import subprocess
import sys
import time

import pytest

from moe_cohort.cli import main
from tests.helpers.batch_files import request_line, results, write
from tests.helpers.encoders import encoder  # noqa: F401 (a fixture)


def journal_entries(path):
    try:
        return max(0, len(path.read_bytes().split(b"\n")) - 2)  # header + complete entries, torn tail excluded
    except FileNotFoundError:
        return 0


def test_kill_9_mid_run_then_rerun_finishes_without_loss_or_duplicates(vllm_server, tmp_path):
    n = 80
    src = write(tmp_path / "in.jsonl", [request_line(f"k{i}", f"kill test {i}", max_tokens=12,
                                                     url="/v1/completions" if i % 2 else "/v1/chat/completions")
                                        for i in range(n)])
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "moe_cohort.cli", "batch", "run", "--input", str(src), "--output", str(out),
           "--backend", vllm_server.url, "--encoder", "none", "--max-in-flight", "1", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    journal = tmp_path / "out.jsonl.journal"
    deadline = time.monotonic() + 120
    # Kill once the journal shows a finished request. Not later: commits are grouped, and while one
    # fsync is slow (a busy disk) every request can finish and wait for the next commit.
    while journal_entries(journal) < 1:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    committed = journal_entries(journal)
    assert 1 <= committed < n, "the run was not killed mid-way"
    first = [json.loads(x) for x in out.read_bytes().split(b"\n")[:committed]]  # past them: maybe torn

    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert rerun.returncode == 0, rerun.stderr
    final = results(out)
    ids = [r["custom_id"] for r in final]
    assert sorted(ids) == sorted(f"k{i}" for i in range(n)) and len(ids) == len(set(ids))
    assert final[: len(first)] == first  # finished results were kept, not redone
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in final)
    assert results(tmp_path / "out.errors.jsonl") == []
    assert f"done: {n} succeeded" in rerun.stderr and "distinct experts per MoE layer" in rerun.stderr

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)  # a third run has nothing to do
    assert again.returncode == 0 and results(out) == final


def test_invalid_lines_stop_the_run_before_anything_is_sent(tmp_path, capsys):
    src = write(tmp_path / "in.jsonl", [request_line("a", "hi"), "not json", request_line("a", "dup"),
                                        request_line("b", "x" * 3000)])
    out = tmp_path / "out.jsonl"
    # an unreachable backend: any request sent would end the run with another error
    code = main(["batch", "run", "--input", str(src), "--output", str(out), "--backend", "http://127.0.0.1:9",
                 "--encoder", "none", "--max-body-bytes", "2000", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "3 invalid line(s); nothing was sent" in err
    assert "line 2: invalid JSON" in err and 'line 3: duplicate custom_id "a" (first on line 1)' in err
    assert "line 4: " in err and "over the limit of 2000 bytes" in err
    assert not out.exists() and not (tmp_path / "out.jsonl.journal").exists()


@pytest.mark.parametrize("policy, said", [("bogus", "unknown policy 'bogus'"),
                                          ("xshare;tau=inf", "must be a finite number > 0, got inf")])
def test_a_bad_policy_flag_is_one_line_naming_it_before_the_file_is_read(tmp_path, capsys, policy, said):
    src = write(tmp_path / "in.jsonl", [request_line(f"r{i}", "hi") for i in range(5)])
    code = main(["batch", "run", "--input", str(src), "--output", str(tmp_path / "out.jsonl"),
                 "--backend", "http://127.0.0.1:9", "--encoder", "none", "--default-policy", policy])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and said in err, err
    assert err.startswith("cohort batch: error: --default-policy (env COHORT_DEFAULT_POLICY)") and "X-MoE-Routing" not in err


def test_an_output_that_is_a_folder_is_one_line(tmp_path, capsys):
    src = write(tmp_path / "in.jsonl", [request_line("a", "hi")])
    code = main(["batch", "run", "--input", str(src), "--output", str(tmp_path), "--backend", "http://127.0.0.1:9",
                 "--encoder", "none"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == (f"cohort batch: error: --output {tmp_path} is a folder; give a file path for the "
                                 f"results, e.g. {tmp_path / 'results.jsonl'}")


def test_skip_invalid_writes_bad_lines_to_the_error_file_once(vllm_server, tmp_path, capsys):
    src = write(tmp_path / "in.jsonl", [request_line("a", "hi"), "{oops", request_line("a", "dup"),
                                        request_line("b", "there", url="/v1/completions"),
                                        request_line("c", "long", max_tokens=5000)])
    out, errors = tmp_path / "res.jsonl", tmp_path / "err.jsonl"
    args = ["batch", "run", "--input", str(src), "--output", str(out), "--errors", str(errors),
            "--backend", vllm_server.url, "--encoder", "none", "--skip-invalid", "--no-progress"]
    assert main(args) == 0
    assert sorted(r["custom_id"] for r in results(out)) == ["a", "b"]
    errs = results(errors)
    skipped = {r["error"]["message"].split(":")[0]: r for r in errs if r["response"] is None}
    assert set(skipped) == {"line 2", "line 3"} and skipped["line 3"]["custom_id"] == "a"
    assert skipped["line 2"]["error"]["code"] == "invalid_request"
    (rejected,) = [r for r in errs if r["response"] is not None]  # sent, and vLLM said no
    assert rejected["custom_id"] == "c" and rejected["response"]["status_code"] == 400
    assert "max_tokens=5000" in rejected["error"]["message"]
    assert main(args) == 0  # rerun: nothing new, nothing twice
    assert len(results(errors)) == 3 and len(results(out)) == 2
    assert "done: 2 succeeded" in capsys.readouterr().err


def test_output_from_another_input_is_never_mixed(vllm_server, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    first = write(tmp_path / "one.jsonl", [request_line("a", "hi", max_tokens=1)])
    other = write(tmp_path / "two.jsonl", [request_line("b", "ho", max_tokens=1)])
    base = ["batch", "run", "--output", str(out), "--backend", vllm_server.url, "--encoder", "none", "--no-progress"]
    assert main([*base, "--input", str(first)]) == 0
    assert main([*base, "--input", str(other)]) == 2
    assert "belongs to another run" in capsys.readouterr().err and len(results(out)) == 1


def test_learn_learns_from_the_plugins_counts_and_keeps_the_head_for_the_next_run(vllm_server, encoder, tmp_path,
                                                                                capsys):
    """The real vLLM CPU server with our plugin counts each request's experts; the run learns a head from 24 of
    them (the first after 16) and saves it under --data-dir/learned, where the next run (and cohort serve) start."""
    src = write(tmp_path / "in.jsonl", [request_line(f"r{i}", f"question {i} about {'python' if i % 2 else 'rice'}")
                                        for i in range(24)])
    data = tmp_path / "data"
    args = ["batch", "run", "--input", str(src), "--output", str(tmp_path / "out.jsonl"), "--backend", vllm_server.url,
            "--encoder", encoder, "--learn", "--data-dir", str(data), "--max-in-flight", "4", "--no-progress"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "done: 24 succeeded" in err and "learned: 24 observed requests, a head fitted on" in err, err
    assert (data / "learned" / "reservoir.npz").exists() and (data / "learned" / "expert_profile_head.npz").exists()


def test_where_vllm_counts_experts_a_run_probes_every_prompt_and_answers_each_line_once(vllm_server, encoder,
                                                                                        tmp_path, capsys):
    """The real vLLM CPU server with our plugin routes lines' prompts (one-token probes, while the first lines go at
    once); the lines' answers are the file's, each once, and nothing is learned unless asked."""
    src = write(tmp_path / "in.jsonl", [request_line(f"p{i}", f"question {i} about {'python' if i % 2 else 'rice'}",
                                                     url="/v1/completions" if i % 3 else "/v1/chat/completions")
                                        for i in range(24)])
    out = tmp_path / "out.jsonl"
    args = ["batch", "run", "--input", str(src), "--output", str(out), "--backend", vllm_server.url,
            "--encoder", encoder, "--data-dir", str(tmp_path / "data"), "--max-in-flight", "4", "--no-progress"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "each line's prompt routed by the engine before its turn" in err and "learning off" in err, err
    assert "done: 24 succeeded" in err, err
    probed = re.search(r"probed: (\d+) of 24 lines", err)
    assert probed and 1 <= int(probed.group(1)) <= 20, err  # never the first 4: they go at once, unprobed
    final = results(out)
    assert sorted(r["custom_id"] for r in final) == sorted(f"p{i}" for i in range(24))
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 4 for r in final)  # the lines', not the probes'
    assert not (tmp_path / "data" / "learned").exists()


def test_learn_is_refused_where_no_answer_comes_back_to_learn_from(tmp_path, capsys):
    src = write(tmp_path / "in.jsonl", [request_line("a", "hi")])
    code = main(["batch", "run", "--input", str(src), "--output", str(tmp_path / "out.jsonl"), "--dry-run", "--learn",
                 "--encoder", "static"])
    assert code == 2 and "--learn learns from answers as the local runner gets them; drop --learn for --dry-run" \
        in capsys.readouterr().err


@pytest.mark.integration
def test_dry_run_plans_with_the_encoder_and_sends_nothing(tmp_path, capsys):
    pytest.importorskip("sentence_transformers")
    math = [f"What is {a} plus {b}? Solve the arithmetic problem step by step." for a, b in zip(range(8), range(10, 18))]
    poems = [f"Write a short poem about the {w} and the sea at night." for w in
             ("moon", "stars", "wind", "waves", "harbour", "lighthouse", "sailors", "tide")]
    lines = [request_line(f"{kind}{i}", text) for i in range(8) for kind, text in (("m", math[i]), ("p", poems[i]))]
    src = write(tmp_path / "in.jsonl", lines)  # interleaved: arrival order mixes the topics in every batch
    plan_path = tmp_path / "plan.jsonl"
    code = main(["batch", "run", "--input", str(src), "--output", str(tmp_path / "out.jsonl"), "--dry-run",
                 "--plan", str(plan_path), "--max-in-flight", "8", "--no-progress"])
    assert code == 0 and "planned 16 requests into 2 batches" in capsys.readouterr().err
    plan = results(plan_path)
    assert sorted(p["custom_id"] for p in plan) == sorted(json.loads(x)["custom_id"] for x in lines)
    batches = {}
    for p in plan:
        batches.setdefault(p["batch"], set()).add(p["custom_id"][0])
    assert sorted(map(sorted, batches.values())) == [["m"], ["p"]]  # one topic per batch
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "out.jsonl.journal").exists()


def _served(server) -> float:
    """Requests the vLLM server has answered so far (vllm:request_success_total)."""
    import urllib.request

    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(float(v) for v in re.findall(r"^vllm:request_success_total(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.M))


def test_killed_twice_in_its_probes_and_twice_in_its_lines_a_run_answers_each_line_once_and_probes_no_answered_line(
        vllm_server, encoder, tmp_path):
    """kill -9 twice just after a run's first requests (its first probes and lines out), twice once lines are in the
    journal, then a run to the end: every line answered exactly once, and the last run sends at most a probe and the
    line itself for each line not answered before it (no answered line's prompt is routed again)."""
    n = 120
    src = write(tmp_path / "in.jsonl", [request_line(f"q{i}", f"probe kill {i} about {'rice' if i % 2 else 'lists'}")
                                        for i in range(n)])
    out, journal = tmp_path / "out.jsonl", tmp_path / "out.jsonl.journal"
    cmd = [sys.executable, "-m", "moe_cohort.cli", "batch", "run", "--input", str(src), "--output", str(out),
           "--backend", vllm_server.url, "--encoder", encoder, "--data-dir", str(tmp_path / "data"),
           "--max-in-flight", "2", "--no-progress"]

    def killed_once(ready) -> None:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not ready():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert journal_entries(journal) < n, "a run was not killed mid-way"

    for _ in range(2):  # its first requests served: probes, and the lines that go at once
        start = _served(vllm_server)
        killed_once(lambda: _served(vllm_server) - start >= 3)
    for at_least in (20, 50):
        killed_once(lambda: journal_entries(journal) >= at_least)
    answered = journal_entries(journal)
    assert 50 <= answered < n

    before = _served(vllm_server)
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0 and "probed:" in rerun.stderr, rerun.stderr
    final = results(out)
    ids = [r["custom_id"] for r in final]
    assert sorted(ids) == sorted(f"q{i}" for i in range(n)) and len(ids) == len(set(ids))
    assert all(r["response"]["status_code"] == 200 for r in final)
    time.sleep(1.0)  # vLLM's counters follow its last answers
    assert _served(vllm_server) - before <= 2 * (n - answered)

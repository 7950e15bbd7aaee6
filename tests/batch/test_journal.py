"""The batch journal (commits, resume, torn tails, one writer, rollback) and the output and error files: one line
per record whatever separators the answers hold."""

from __future__ import annotations

import json
import time

import pytest

from moe_cohort.batch.journal import Journal, JournalError, JournalPaths, Record

from moe_cohort.embedded.vllm_server import free_port
from moe_cohort.send.settings import Settings
from tests.helpers.proxy_thread import ProxyThread
from tests.helpers.vllm_stub import SEPARATORS, EchoBackend


def test_batch_output_lines_escape_unicode_line_separators(tmp_path):
    """A Batch API run whose answers and custom_ids hold U+0085, U+2028, U+2029: the output and error files
    split into exactly one line per record with str.splitlines(), and each line reads back the same text."""
    import openai

    lines = [json.dumps({"custom_id": f"ok\u2028{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}, ensure_ascii=False)
             for i in range(3)]
    lines.append(json.dumps({"custom_id": "bad\u0085id", "method": "POST", "url": "/v1/chat/completions",
                             "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}},
                            ensure_ascii=False))
    with EchoBackend() as backend, ProxyThread(Settings(backends=(backend.url,), port=free_port(), encoder="none",
                                                         data_dir=str(tmp_path))) as proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
        upload = client.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 60
        while batch.status not in ("completed", "failed", "cancelled"):
            assert time.monotonic() < deadline, batch.status
            time.sleep(0.1)
            batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed", batch.errors
        output = client.files.content(batch.output_file_id).text
        errors = client.files.content(batch.error_file_id).text
    assert len(output.splitlines()) == 3 and len(errors.splitlines()) == 1, output + errors
    records = [json.loads(line) for line in output.splitlines()]
    assert sorted(r["custom_id"] for r in records) == [f"ok\u2028{i}" for i in range(3)]
    assert all(r["response"]["body"]["choices"][0]["message"]["content"] == SEPARATORS for r in records)
    error = json.loads(errors.splitlines()[0])
    assert error["custom_id"] == "bad\u0085id" and error["response"]["body"]["error"]["message"] == SEPARATORS
    assert "\\u2028" in output and "\\u0085" in errors  # escaped, not dropped


META = {"input_sha256": "abc", "input_bytes": 10}


def rec(n, kind="output"):
    return Record(n, kind, {"id": f"batch_req_{n}", "custom_id": f"c{n}", "response": None, "error": None})


def lines_of(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_journal_commits_and_resumes(tmp_path):
    paths = JournalPaths.for_output(tmp_path / "out.jsonl")
    assert paths.errors.name == "out.errors.jsonl" and paths.journal.name == "out.jsonl.journal"
    j = Journal.open(paths, META)
    j.commit([rec(1), rec(2, "errors")])
    j.commit([rec(4)])
    with pytest.raises(JournalError, match="already finished"):
        j.commit([rec(4)])
    j.close()
    j = Journal.open(paths, META)
    assert j.done == {1: "output", 2: "errors", 4: "output"} and j.counts == {"output": 2, "errors": 1}
    j.commit([rec(3)])
    j.close()
    assert [r["custom_id"] for r in lines_of(paths.output)] == ["c1", "c4", "c3"]
    assert [r["custom_id"] for r in lines_of(paths.errors)] == ["c2"]


def test_torn_tails_and_uncommitted_lines_are_cut_on_resume(tmp_path):
    paths = JournalPaths.for_output(tmp_path / "out.jsonl", tmp_path / "err.jsonl")
    j = Journal.open(paths, META)
    j.commit([rec(1), rec(2)])
    j.close()
    committed = paths.output.read_bytes()
    # a crash: a whole data line whose journal entry never came, a torn data line, a torn journal entry
    with open(paths.output, "ab") as f:
        f.write(json.dumps(rec(3).data).encode() + b"\n" + b'{"id": "batch_req_4", "cus')
    with open(paths.journal, "ab") as f:
        f.write(b'{"line": 3, "file": "out')
    j = Journal.open(paths, META)
    assert set(j.done) == {1, 2}
    assert paths.output.read_bytes() == committed
    j.commit([rec(3)])
    j.close()
    assert [r["custom_id"] for r in lines_of(paths.output)] == ["c1", "c2", "c3"]
    assert all(json.loads(x) for x in paths.journal.read_text().splitlines())


def test_journal_refuses_another_input_foreign_files_and_a_second_writer(tmp_path):
    paths = JournalPaths.for_output(tmp_path / "out.jsonl")
    j = Journal.open(paths, META)
    with pytest.raises(JournalError, match="another process is writing"):
        Journal.open(paths, META)
    j.commit([rec(1)])
    j.close()
    with pytest.raises(JournalError, match="belongs to another run"):
        Journal.open(paths, {**META, "input_sha256": "changed"})
    paths.output.write_bytes(b"")  # shorter than the journal says
    with pytest.raises(JournalError, match="truncated or replaced"):
        Journal.open(paths, META)
    other = JournalPaths.for_output(tmp_path / "existing.jsonl")
    other.output.write_text('{"something": "else"}\n')
    with pytest.raises(JournalError, match="has no journal"):
        Journal.open(other, META)


def test_failed_commit_rolls_back(tmp_path, monkeypatch):
    paths = JournalPaths.for_output(tmp_path / "out.jsonl")
    j = Journal.open(paths, META)
    j.commit([rec(1)])
    size = paths.output.stat().st_size

    def disk_full(f, data):
        f.write(data[: len(data) // 2])
        f.flush()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Journal, "_append", staticmethod(disk_full))
    with pytest.raises(OSError):
        j.commit([rec(2)])
    monkeypatch.undo()
    assert paths.output.stat().st_size == size and 2 not in j.done
    j.commit([rec(2)])
    j.close()
    assert [r["custom_id"] for r in lines_of(paths.output)] == ["c1", "c2"]

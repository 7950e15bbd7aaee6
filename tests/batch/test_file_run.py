"""run_file, the batch runner's one entry point: a file through a backend, every line answered once; what stops a
run before it starts is one BatchRunError that says what to fix."""

import json

import pytest

from moe_cohort.batch.file_run import BatchRunError, FileJob, InvalidLines, run_file
from moe_cohort.send.settings import Settings
from tests.helpers.vllm_stub import EchoBackend


def _file(tmp_path, lines):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _line(i, **body):
    return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": f"hello {i}"}], **body}}


def test_a_file_runs_through_a_backend_once_and_a_rerun_sends_nothing(tmp_path):
    src = _file(tmp_path, [_line(i) for i in range(5)])
    job = FileJob(src, tmp_path / "out.jsonl")
    with EchoBackend() as backend:
        settings = Settings(backends=(backend.url,), encoder="none", data_dir=str(tmp_path / "d"))
        first = run_file(settings, job)
        sent = len(backend.bodies)
        again = run_file(settings, job)
    ids = [json.loads(x)["custom_id"] for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(ids) == [f"r{i}" for i in range(5)] and first.stats.succeeded == 5 and first.counts["output"] == 5
    assert sent == 5 and len(backend.bodies) == 5 and again.stats.succeeded == 0 and again.stats.finished_before == 5


def test_what_stops_a_run_says_what_to_fix(tmp_path):
    src = _file(tmp_path, [_line(0), {"custom_id": "bad"}])
    with pytest.raises(BatchRunError, match="no backend: pass --backend URL"):
        run_file(Settings(encoder="none"), FileJob(src, tmp_path / "out.jsonl"))
    with pytest.raises(InvalidLines) as caught:
        run_file(Settings(backends=("http://127.0.0.1:9",), encoder="none"), FileJob(src, tmp_path / "out.jsonl"))
    assert len(caught.value.errors) == 1 and caught.value.code == 2 and not (tmp_path / "out.jsonl").exists()
    with pytest.raises(BatchRunError, match="is a folder; give a file path"):
        run_file(Settings(backends=("http://127.0.0.1:9",), encoder="none"), FileJob(src, tmp_path))


def test_a_local_run_keeps_blas_on_one_thread_for_the_whole_process(tmp_path):
    """A batch run shares the machine with the engine: its process runs BLAS on one thread (encoder_threads), set
    once for the process, not per call (a pool of BLAS threads spins on the engine's cores after each call)."""
    from threadpoolctl import threadpool_info, threadpool_limits

    def blas_threads() -> set[int]:
        return {lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}

    src = _file(tmp_path, [_line(i) for i in range(2)])
    with threadpool_limits(limits=2, user_api="blas"), EchoBackend() as backend:  # restored after the test
        assert blas_threads() == {2}
        run_file(Settings(backends=(backend.url,), encoder="none", data_dir=str(tmp_path / "d")),
                 FileJob(src, tmp_path / "out.jsonl"))
        assert blas_threads() == {1}

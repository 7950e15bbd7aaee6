"""`cohort batch run --runner ray`: a local Ray instance sending to throwaway backends (order, one block per
replica at a time, a replica dying mid-run and the rerun) and to a real vLLM CPU server (the same results as
the local runner)."""

import asyncio
import json
import subprocess
import sys

import pytest
from aiohttp import web

from moe_cohort.cli import main
from tests.helpers.batch_files import request_line, results, write
from tests.helpers.vllm_stub import answer, body_of, drop, local_backend

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.integration  # a local Ray instance, or a process


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance for the module (`cohort batch run` joins a running one instead of starting its own)."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


class Replica:
    """A throwaway backend that records what it was sent, and how many requests it had at once."""

    def __init__(self, answer_first: int | None = None, delay_s: float = 0.02) -> None:
        self.seen: list[str] = []  # the prompts, in arrival order
        self.out = self.most_out = 0
        self.answer_first = answer_first  # after this many answers the connection drops (None: always answer)
        self.delay_s = delay_s

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.method != "POST":
            return web.Response(status=404)
        content = (await body_of(request))["messages"][0]["content"]
        if self.answer_first is not None and len(self.seen) >= self.answer_first:
            return drop(request)
        self.seen.append(content)
        self.out += 1
        self.most_out = max(self.most_out, self.out)
        await asyncio.sleep(self.delay_s)
        self.out -= 1
        return answer({"choices": [{"message": {"role": "assistant", "content": f"re: {content}"}}],
                       "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})


def run_cli(replicas, args) -> tuple[int, str]:
    """`cohort batch run --runner ray ARGS --backend <the replicas>` in a thread beside the replicas' event loop."""
    async def go(urls, stack):
        for replica in replicas:
            urls.append(await stack.enter_async_context(local_backend(replica.handle)))
        return await asyncio.to_thread(main, ["batch", "run", "--runner", "ray", "--backend", ",".join(urls),
                                              "--no-progress", *args])

    async def with_stack():
        from contextlib import AsyncExitStack

        async with AsyncExitStack() as stack:
            return await go([], stack)

    return asyncio.run(with_stack())


def chat_lines(n, text=lambda i: f"m{i}"):
    return [request_line(f"c{i}", text(i)) for i in range(n)]


def test_each_replica_gets_whole_blocks_in_order_one_block_at_a_time(local_ray, tmp_path, capsys):
    src = write(tmp_path / "in.jsonl", chat_lines(48))
    out = tmp_path / "out.jsonl"
    replicas = [Replica(), Replica()]
    # --max-in-flight 1: blocks of 8 (BLOCK_BATCHES batches of 1), and the arrival order is the sending order
    code = run_cli(replicas, ["--input", str(src), "--output", str(out), "--encoder", "none", "--max-in-flight", "1"])
    assert code == 0, capsys.readouterr().err
    final = results(out)
    assert sorted(r["custom_id"] for r in final) == sorted(f"c{i}" for i in range(48)) and len(final) == 48
    assert all(r["response"]["body"]["choices"][0]["message"]["content"] == f"re: m{r['custom_id'][1:]}"
               for r in final)
    assert all(r.most_out == 1 for r in replicas)  # never two blocks at one replica
    assert all(r.seen for r in replicas)  # both replicas were used
    blocks = [[f"m{i}" for i in range(b, b + 8)] for b in range(0, 48, 8)]
    for r in replicas:  # a replica's requests are whole blocks, each in file order
        got = [r.seen[i: i + 8] for i in range(0, len(r.seen), 8)]
        assert all(block in blocks for block in got), r.seen
    assert "done: 48 succeeded" in capsys.readouterr().err


def test_blocks_follow_the_admission_plan_of_dry_run(local_ray, tmp_path, capsys):
    pytest.importorskip("sentence_transformers")
    math = [f"What is {a} plus {b}? Solve the arithmetic problem step by step." for a, b in zip(range(8), range(10, 18))]
    poems = [f"Write a short poem about the {w} and the sea at night." for w in
             ("moon", "stars", "wind", "waves", "harbour", "lighthouse", "sailors", "tide")]
    texts = [t for pair in zip(math, poems) for t in pair]  # interleaved topics
    src = write(tmp_path / "in.jsonl", chat_lines(16, lambda i: texts[i]))
    args = ["--input", str(src), "--output", str(tmp_path / "out.jsonl"), "--max-in-flight", "2"]
    assert main(["batch", "run", *args, "--dry-run", "--plan", str(tmp_path / "plan.jsonl"), "--no-progress"]) == 0
    planned = [texts[int(p["custom_id"][1:])] for p in results(tmp_path / "plan.jsonl")]
    assert planned[:8] == [t for t in planned if t in math]  # admission reorders this file: one topic, then the other
    replica = Replica(delay_s=0.1)
    assert run_cli([replica], args) == 0, capsys.readouterr().err
    # one block of 16 (BLOCK_BATCHES batches of 2), sent two at a time in the plan's order: the k-th pair that
    # arrives is the plan's k-th pair (the two of a pair go together, so they may arrive either way round)
    pairs = lambda seq: [set(seq[i: i + 2]) for i in range(0, len(seq), 2)]  # noqa: E731
    assert pairs(replica.seen) == pairs(planned)


def ids(prompts):
    return sorted(f"c{m[1:]}" for m in prompts)


def test_a_replica_that_dies_mid_run_then_the_rerun_finishes_every_line_once(local_ray, tmp_path, capsys):
    src = write(tmp_path / "in.jsonl", chat_lines(24))
    out = tmp_path / "out.jsonl"
    args = ["--input", str(src), "--output", str(out), "--encoder", "none", "--max-in-flight", "1", "--max-retries", "0"]
    replica = Replica(answer_first=10)  # the 11th request it is sent breaks (block 1's 3rd, if the blocks go in order)
    assert run_cli([replica], args) == 1
    err = capsys.readouterr().err
    assert "cannot reach the backend" in err and "run the same command again to finish the rest" in err
    first = results(out)
    # every answer the replica gave is kept, whichever order Ray ran the blocks in (it may run a later one first)
    assert len(first) == 10 and sorted(r["custom_id"] for r in first) == ids(replica.seen)

    kept, replica.answer_first, replica.seen = ids(replica.seen), None, []
    assert run_cli([replica], args) == 0, capsys.readouterr().err
    final = results(out)
    assert sorted(r["custom_id"] for r in final) == sorted(f"c{i}" for i in range(24)) and len(final) == 24
    assert final[:10] == first  # kept, not redone
    assert sorted(ids(replica.seen) + kept) == sorted(f"c{i}" for i in range(24))  # only the rest was sent again
    assert results(tmp_path / "out.errors.jsonl") == []


def test_a_dead_replica_stops_the_run_and_the_blocks_out_elsewhere_are_kept(local_ray, tmp_path, capsys):
    src = write(tmp_path / "in.jsonl", chat_lines(48))
    out = tmp_path / "out.jsonl"
    args = ["--input", str(src), "--output", str(out), "--encoder", "none", "--max-in-flight", "1", "--max-retries", "0"]
    dead, slow = Replica(answer_first=0), Replica(delay_s=0.1)  # a block at `dead` stops at once, `slow`'s take 0.8 s
    assert run_cli([dead, slow], args) == 1
    assert "cannot reach the backend" in capsys.readouterr().err
    first = results(out)
    # the block `slow` had out when `dead` stopped the run came back after the stop, and is kept
    assert sorted(r["custom_id"] for r in first) == ids(slow.seen)
    assert len(slow.seen) < 48  # blocks not started when the run stopped were not sent

    answered, dead.answer_first, slow.seen = ids(slow.seen), None, []
    assert run_cli([dead, slow], args) == 0, capsys.readouterr().err
    final = results(out)
    assert sorted(r["custom_id"] for r in final) == sorted(f"c{i}" for i in range(48)) and len(final) == 48
    assert sorted(ids(dead.seen + slow.seen) + answered) == sorted(f"c{i}" for i in range(48))  # each sent once


def test_a_block_is_skipped_once_the_run_stopped_and_a_stopping_block_raises_the_flag(local_ray):
    from ray.util.queue import Queue

    from moe_cohort.batch.core import RunConfig
    from moe_cohort.batch.ray import _SendBlock, read_block

    block = {"line": [3], "custom_id": ["c3"], "url": ["/v1/chat/completions"], "policy": [""],
             "body": [json.dumps(json.loads(request_line("c3", "m3"))["body"])]}
    leases, stop = Queue(), Queue()
    leases.put(0)
    nobody = "http://127.0.0.1:9"  # nothing listens: the block stops at its first request
    send = _SendBlock([nobody], RunConfig(max_in_flight=1, max_retries=0), leases, stop, timeout_s=5,
                      connect_timeout_s=1)
    records, why = read_block(send(block))
    assert records == [] and len(why) == 1 and "cannot reach the backend" in why[0]
    assert stop.qsize() == 1 and leases.qsize() == 1  # the flag is up, the lease back
    assert read_block(send(block)) == ([], [])  # skipped: nothing sent, no second reason


def test_ray_missing_is_one_line_and_exit_2(tmp_path):
    src = write(tmp_path / "in.jsonl", chat_lines(2))
    code = ("import sys; sys.modules['ray'] = None; from moe_cohort.cli import main; sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, "batch", "run", "--runner", "ray", "--input", str(src),
                           "--output", str(tmp_path / "out.jsonl"), "--backend", "http://127.0.0.1:9",
                           "--encoder", "none"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().startswith("cohort batch: error: --runner ray needs Ray Data")
    assert "pip install 'moe-cohort[ray]'" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out.jsonl").exists()


def test_several_backends_need_the_ray_engine(tmp_path, capsys):
    src = write(tmp_path / "in.jsonl", chat_lines(2))
    code = main(["batch", "run", "--input", str(src), "--output", str(tmp_path / "out.jsonl"), "--encoder", "none",
                 "--backend", "http://127.0.0.1:9,http://127.0.0.1:10", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "--runner local sends to one backend" in err and "--runner ray" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out.jsonl").exists()


def test_ray_and_local_runner_give_the_same_results_on_vllm(local_ray, vllm_server, tmp_path, capsys):
    n = 30
    src = write(tmp_path / "in.jsonl", [request_line(f"k{i}", f"ray test {i}", max_tokens=4,
                                                     url="/v1/completions" if i % 3 == 0 else "/v1/chat/completions")
                                        for i in range(n)])
    runs = {}
    for engine in ("local", "ray"):
        out = tmp_path / f"{engine}.jsonl"
        code = main(["batch", "run", "--runner", engine, "--input", str(src), "--output", str(out),
                     "--backend", vllm_server.url, "--max-in-flight", "4", "--no-progress"])
        assert code == 0, capsys.readouterr().err
        runs[engine] = {r["custom_id"]: r for r in results(out)}
        assert len(results(out)) == n and results(tmp_path / f"{engine}.errors.jsonl") == []
    assert sorted(runs["ray"]) == sorted(runs["local"]) == sorted(f"k{i}" for i in range(n))
    for cid, r in runs["ray"].items():
        assert r["response"]["status_code"] == 200 and r["error"] is None
        assert r["response"]["body"]["usage"] == runs["local"][cid]["response"]["body"]["usage"]
        assert r["response"]["body"]["object"] == runs["local"][cid]["response"]["body"]["object"]
    assert "distinct experts per MoE layer" in capsys.readouterr().err  # the plugin's counters, read by the driver

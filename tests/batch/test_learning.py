"""A learning batch run (`cohort batch run`, the Batch API of `cohort serve`, learning on): with no head yet it
sends a sample drawn from across the file, learns a head from those answers, then orders the rest by it; each
new head re-predicts the requests next in line. A resumed run never sends a line twice.
The backend counts experts like our plugin (tests/helpers/plugin_vllm.py): a prompt about python routes to
experts 0, 1, one about cooking to 4, 5."""

import asyncio
import json

from moe_cohort.batch.core import RunConfig
from moe_cohort.batch.format import read_batch_file
from moe_cohort.batch.journal import Journal, JournalPaths
from moe_cohort.batch.run import run_batch
from moe_cohort.send.backend_client import BackendClient
from moe_cohort.send.learning.learning import Learning
from moe_cohort.send.metrics import Metrics
from moe_cohort.send.profiles import make_predictor
from moe_cohort.send.settings import Settings
from moe_cohort.train.online import LearnConfig, OnlineLearner
from tests.helpers.encoders import encoder  # noqa: F401 (a fixture)
from tests.helpers.plugin_vllm import plugin_backend, topic_prompt
from tests.helpers.vllm_stub import body_of, local_backend

CONFIG = RunConfig(max_in_flight=2, max_retries=1, backoff_s=0.001, metrics_interval_s=0)


def _batch(tmp_path, n):
    """n chat requests, python and cooking alternating (file order is the worst order for the experts)."""
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                        "body": {"model": "tiny",
                                                 "messages": [{"role": "user", "content": topic_prompt(i)}]}})
                            + "\n" for i in range(n)))
    return read_batch_file(path, default_policy="topk", max_line_bytes=10_000)


def _slow(handler, prompts):
    """`handler`, answering chats after 20-60 ms by line (so the run lasts past the first head, and the slots
    free one at a time, as a real engine's do), recording their prompts."""
    async def slow(request):
        if request.path == "/v1/chat/completions":
            prompts.append((await body_of(request))["messages"][-1]["content"])
            await asyncio.sleep(0.02 + 0.01 * (_line(prompts[-1]) % 5))
        return await handler(request)
    return slow


def _line(prompt: str) -> int:
    return int(prompt.split()[1])


async def _learning_run(parsed, tmp_path, learner, encoder, prompts, tokens, *, stop_after: int | None = None):
    """One run of `parsed` through a counting backend; `stop_after`: stop it once that many lines were answered
    (as a kill would: the journal keeps what finished)."""
    predictor = make_predictor(Settings(encoder=encoder))
    paths = JournalPaths.for_output(tmp_path / "out.jsonl")
    stop = asyncio.Event()

    def progress(stats):
        if stop_after is not None and stats.done >= stop_after:
            stop.set()

    async with local_backend(_slow(plugin_backend(tokens), prompts)) as url:
        backend = BackendClient(url, timeout_s=5)
        learning = Learning(learner, predictor.features, tmp_path / "learned", Metrics(), 0.0, [backend])
        predictor.follow(learning)
        journal = Journal.open(paths, parsed.journal_meta)
        try:
            return await run_batch(parsed, journal, [backend], predictor, CONFIG, learning=learning, stop=stop,
                                   on_progress=progress)
        finally:
            journal.close()
            await learning.flush()
            await asyncio.to_thread(learning.close)
            await backend.close()


def _alike(prompts) -> float:
    """Share of consecutive sends on the same topic (file order: 0, they alternate; random: about half)."""
    topics = ["python" in p for p in prompts]
    return sum(a == b for a, b in zip(topics, topics[1:])) / max(len(topics) - 1, 1)


def test_with_no_head_a_run_sends_a_sample_from_across_the_file_then_orders_the_rest_by_the_head_it_learned(
        encoder, tmp_path):
    parsed, prompts, tokens = _batch(tmp_path, 120), [], []
    learner = OnlineLearner(LearnConfig(capacity=200, first_fit=16, ngram_dim=4096), key=encoder)
    stats = asyncio.run(_learning_run(parsed, tmp_path, learner, encoder, prompts, tokens))
    assert stats.succeeded == 120 and sorted(prompts) == sorted(topic_prompt(i) for i in range(120))  # each once
    assert all(tokens) and len(set(tokens)) == 120  # every request was marked: the reservoir keeps each (capacity 200)
    assert learner.head is not None and learner.observed == 120
    assert (tmp_path / "learned" / "reservoir.npz").exists()  # saved for the next run
    sample = [_line(p) for p in prompts[:16]]  # sample_size: 16 observations (first_fit) before the hand-over
    assert sample != sorted(sample) and max(sample) >= 60  # drawn from across the file, not its first lines
    assert _alike(prompts[32:]) >= 0.8, prompts  # after the hand-over (and the sample's tail): grouped by topic


def test_with_a_head_learned_before_a_run_orders_from_its_first_line(encoder, tmp_path):
    parsed, prompts, tokens = _batch(tmp_path, 60), [], []
    learner = OnlineLearner(LearnConfig(capacity=200, first_fit=16, ngram_dim=4096), key=encoder)
    asyncio.run(_learning_run(_batch(tmp_path / "first", 40) if (tmp_path / "first").mkdir() is None else None,
                              tmp_path / "first", learner, encoder, [], []))
    assert learner.head is not None
    asyncio.run(_learning_run(parsed, tmp_path, learner, encoder, prompts, tokens))
    assert sorted(prompts) == sorted(topic_prompt(i) for i in range(60))
    assert _alike(prompts[:40]) >= 0.8, prompts  # no sample: grouped from the start


def test_a_run_killed_in_its_sample_or_after_it_resumes_without_sending_a_line_twice(encoder, tmp_path):
    from moe_cohort.train.online import OnlineLearner as Loaded

    parsed, prompts, tokens = _batch(tmp_path, 120), [], []
    config = LearnConfig(capacity=200, first_fit=16, ngram_dim=4096)
    learner = OnlineLearner(config, key=encoder)
    first = asyncio.run(_learning_run(parsed, tmp_path, learner, encoder, prompts, tokens, stop_after=6))
    assert first.succeeded < 16 and learner.head is None  # stopped in the sample phase
    learner = Loaded.load(tmp_path / "learned", config, key=encoder)  # what the run saved, as a new process reads it
    second = asyncio.run(_learning_run(parsed, tmp_path, learner, encoder, prompts, tokens, stop_after=70))
    assert learner.head is not None and second.finished_before == first.succeeded  # ordered after its own sample
    learner = Loaded.load(tmp_path / "learned", config, key=encoder)
    assert learner.head is not None  # saved at the hand-over: the next run orders from its first line
    third = asyncio.run(_learning_run(parsed, tmp_path, learner, encoder, prompts, tokens))
    assert third.finished_before == first.succeeded + second.succeeded and third.succeeded > 0
    answered = [json.loads(line)["custom_id"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(answered) == sorted(f"c{i}" for i in range(120))  # every line answered exactly once over 3 runs
    # a finished line is never sent again; only the requests out at each stop (abandoned, unanswered) go twice
    assert set(prompts) == {topic_prompt(i) for i in range(120)} and len(prompts) <= 120 + 2 * CONFIG.max_in_flight
    assert _alike(prompts[len(prompts) - third.succeeded:]) >= 0.8  # the third run: ordered from its first line


def test_a_request_a_refused_replica_never_ran_is_learned_once_from_the_replica_that_ran_it(encoder, tmp_path):
    from moe_cohort.send.gate import AdmissionGate
    from moe_cohort.send.replicas import ReplicaSet
    from tests.helpers.vllm_stub import refused_url

    parsed, prompts, tokens = _batch(tmp_path, 24), [], []
    learner = OnlineLearner(LearnConfig(capacity=200, first_fit=16, ngram_dim=4096), key=encoder)
    predictor = make_predictor(Settings(encoder=encoder))

    async def main():
        async with local_backend(_slow(plugin_backend(tokens), prompts)) as url:
            live, down = BackendClient(url, timeout_s=5), BackendClient(refused_url(), timeout_s=5)
            gate = AdmissionGate(None, Metrics(), ReplicaSet([down, live], [2, 2], "least-loaded"))
            learning = Learning(learner, predictor.features, tmp_path / "learned", Metrics(), 0.0, [live])
            predictor.follow(learning)
            journal = Journal.open(JournalPaths.for_output(tmp_path / "out.jsonl"), parsed.journal_meta)
            try:
                stats = await run_batch(parsed, journal, [live], predictor, CONFIG, gate=gate, learning=learning)
                await learning.flush()
                return stats, learning.counts.waiting_on(), learning.metrics
            finally:
                journal.close()
                await asyncio.to_thread(learning.close)
                await live.close()
                await down.close()

    stats, waiting_on, metrics = asyncio.run(main())
    assert stats.succeeded == 24 and sorted(prompts) == sorted(topic_prompt(i) for i in range(24))  # each ran once
    assert learner.observed == 24 and len(set(tokens)) == 24  # learned once each, from the replica that ran it
    assert waiting_on == set()  # no token left waiting on the replica that refused it (it would expire as unclaimed)
    assert metrics.registry.get_sample_value("cohort_learned_dropped_total", {"reason": "unclaimed"}) is None


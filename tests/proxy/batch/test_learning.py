"""A learning batch run (`cohort batch run --learn`, the Batch API of `cohort serve --learn`): its answers teach
the online learner, and each new head re-predicts the requests next in line, so the run gets better as it goes.
The backend counts experts like our plugin (tests/proxy/test_learning.py): a prompt about python routes to
experts 0, 1, one about cooking to 4, 5."""

import asyncio
import json

from moe_cohort.proxy.backend_client import BackendClient
from moe_cohort.proxy.batch.core import RunConfig
from moe_cohort.proxy.batch.format import read_batch_file
from moe_cohort.proxy.batch.journal import Journal, JournalPaths
from moe_cohort.proxy.batch.run import run_batch
from moe_cohort.proxy.learning import Learning
from moe_cohort.proxy.metrics import ProxyMetrics
from moe_cohort.proxy.profiles import make_predictor
from moe_cohort.proxy.settings import Settings
from moe_cohort.train.online import LearnConfig, OnlineLearner
from tests.proxy.servers import body_of, local_backend
from tests.proxy.test_learning import _plugin_backend, _prompt, encoder  # noqa: F401 (a fixture)

CONFIG = RunConfig(concurrency=2, max_retries=1, backoff_s=0.001, metrics_interval_s=0)


def _batch(tmp_path, n):
    """n chat requests, python and cooking alternating (file order is the worst order for the experts)."""
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                        "body": {"model": "tiny", "messages": [{"role": "user", "content": _prompt(i)}]}})
                            + "\n" for i in range(n)))
    return read_batch_file(path, default_policy="topk", max_line_bytes=10_000)


def _slow(handler, prompts):
    """`handler`, answering chats after 40 ms (so the run lasts past the first head), recording their prompts."""
    async def slow(request):
        if request.path == "/v1/chat/completions":
            prompts.append((await body_of(request))["messages"][-1]["content"])
            await asyncio.sleep(0.04)
        return await handler(request)
    return slow


def test_a_learning_batch_run_learns_from_its_answers_and_groups_the_rest_by_the_learned_head(encoder, tmp_path):
    parsed, prompts, tokens = _batch(tmp_path, 120), [], []
    learner = OnlineLearner(LearnConfig(capacity=200, first_fit=16, ngram_dim=4096), key=encoder)
    predictor = make_predictor(Settings(encoder=encoder))
    paths = JournalPaths.for_output(tmp_path / "out.jsonl")

    async def main():
        async with local_backend(_slow(_plugin_backend(tokens), prompts)) as url:
            backend = BackendClient(url, timeout_s=5)
            learning = Learning(learner, predictor.features, tmp_path / "learned", ProxyMetrics(), 0.0, backend)
            predictor.follow(learning)
            journal = Journal.open(paths, parsed.journal_meta)
            try:
                return await run_batch(parsed, journal, backend, predictor, CONFIG, learning=learning)
            finally:
                journal.close()
                await asyncio.to_thread(learning.close)
                await backend.close()

    stats = asyncio.run(main())
    assert stats.succeeded == 120 and sorted(prompts) == sorted(_prompt(i) for i in range(120))  # each once
    assert all(tokens) and len(set(tokens)) == 120  # every request was marked: the reservoir keeps each (capacity 200)
    assert learner.head is not None and learner.observed >= 16
    assert (tmp_path / "learned" / "reservoir.npz").exists()  # saved for the next run
    topics = ["python" in p for p in prompts]
    alike = sum(a == b for a, b in zip(topics, topics[1:]))  # first come, first served: 0 (they alternate)
    assert alike >= 30, (alike, topics)
    first_alike = next(i for i, (a, b) in enumerate(zip(topics, topics[1:])) if a == b)
    assert first_alike >= 16  # no head before 16 observations: file order until then


def test_a_request_a_refused_replica_never_ran_is_learned_once_from_the_replica_that_ran_it(encoder, tmp_path):
    from moe_cohort.proxy.gate import AdmissionGate
    from moe_cohort.proxy.replicas import ReplicaSet
    from tests.proxy.test_replicas import refused_url

    parsed, prompts, tokens = _batch(tmp_path, 24), [], []
    learner = OnlineLearner(LearnConfig(capacity=200, first_fit=16, ngram_dim=4096), key=encoder)
    predictor = make_predictor(Settings(encoder=encoder))

    async def main():
        async with local_backend(_slow(_plugin_backend(tokens), prompts)) as url:
            live, down = BackendClient(url, timeout_s=5), BackendClient(refused_url(), timeout_s=5)
            gate = AdmissionGate(None, ProxyMetrics(), ReplicaSet([down, live], [2, 2], "least-loaded"))
            learning = Learning(learner, predictor.features, tmp_path / "learned", ProxyMetrics(), 0.0, live)
            predictor.follow(learning)
            journal = Journal.open(JournalPaths.for_output(tmp_path / "out.jsonl"), parsed.journal_meta)
            try:
                stats = await run_batch(parsed, journal, live, predictor, CONFIG, gate=gate, learning=learning)
                await learning.flush()
                return stats, learning.counts.waiting_on(), learning.metrics
            finally:
                journal.close()
                await asyncio.to_thread(learning.close)
                await live.close()
                await down.close()

    stats, waiting_on, metrics = asyncio.run(main())
    assert stats.succeeded == 24 and sorted(prompts) == sorted(_prompt(i) for i in range(24))  # each ran once
    assert learner.observed == 24 and len(set(tokens)) == 24  # learned once each, from the replica that ran it
    assert waiting_on == set()  # no token left waiting on the replica that refused it (it would expire as unclaimed)
    assert metrics.registry.get_sample_value("cohort_learned_dropped_total", {"reason": "unclaimed"}) is None

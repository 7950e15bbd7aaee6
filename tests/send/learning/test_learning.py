"""The proxy learns its profile head from the routing a vLLM backend returns (`routed_experts`, vLLM's documented
format: base64 .npy [tokens - 1, layers, k]), swaps it in, shows it in /metrics and /health, and keeps it across
a restart. The backend here answers like vLLM 0.32 with --enable-return-routed-experts."""

import asyncio
import base64
import io
import re
import sys
import time
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from moe_cohort.proxy.app import create_app
from moe_cohort.send.settings import Settings, SettingsError
from moe_cohort.train.online import Reservoir
from tests.helpers.encoders import encoder  # noqa: F401 (a fixture)
from tests.helpers.plugin_vllm import EXPERTS, K, LAYERS, plugin_backend, topic_prompt, topic_routing
from tests.helpers.vllm_stub import answer, body_of, local_backend


def _b64_npy(array):
    buf = io.BytesIO()
    np.save(buf, array)
    return base64.b64encode(buf.getvalue()).decode()


async def vllm_like(request):
    if request.method == "GET":  # /health
        return answer({})
    if request.path != "/v1/chat/completions":  # a vLLM without our plugin: no /v1/cohort/observed
        return answer({"detail": "Not Found"}, status=404)
    body = await body_of(request)
    prompt = body["messages"][-1]["content"]
    return answer({"id": "c", "object": "chat.completion", "model": "tiny",
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop",
                                "routed_experts": _b64_npy(topic_routing(prompt))}],
                   "usage": {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}})


async def _serve(url, encoder, data_dir, requests, **extra):
    app = create_app(Settings(backends=(url,), encoder=encoder, learn=True, data_dir=str(data_dir), **extra))
    proxy = app.state.proxy
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
            answers = [await client.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": topic_prompt(i)}]}) for i in range(requests)]
            deadline = time.monotonic() + 30
            while proxy.learning.learner.observed < requests and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # the worker thread learns off the event loop
            await asyncio.sleep(0.2)
            health = (await client.get("/health")).json()
            metrics = (await client.get("/metrics")).text
            predicted = proxy.predictor.predict(["one more question about python dicts", "about cooking pasta"])
    finally:
        await proxy.close()
    return answers, health, metrics, predicted


def _metric(text: str, name: str) -> float:
    return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))


def test_the_proxy_learns_a_head_from_routed_experts_and_admits_by_it(encoder, tmp_path):
    async def main():
        async with local_backend(vllm_like) as url:
            return await _serve(url, encoder, tmp_path / "data", 20)

    answers, health, metrics, predicted = asyncio.run(main())
    assert all(a.status_code == 200 and "routed_experts" not in a.json()["choices"][0] for a in answers)
    assert _metric(metrics, 'cohort_learned_profiles_total{source="routed_experts"}') == 20
    assert _metric(metrics, "cohort_learned_refits_total") == 1 and _metric(metrics, "cohort_learned_head_observations") == 16
    head_fit, mean_fit = (_metric(metrics, f'cohort_learned_head_fit{{predictor="{p}"}}') for p in ("head", "mean"))
    assert head_fit > 0.9 > 0.6 > mean_fit  # the 4 requests after the fit: the head knows them, the mean profile half
    assert health["admission"] == {"mode": "learned head", "learning": {"observed": 20, "head_fitted_on": 16}}
    python, cooking = (p.vector.reshape(LAYERS, EXPERTS) for p in predicted)
    assert set(np.argsort(-python[0])[:2]) == {0, 1} and set(np.argsort(-cooking[0])[:2]) == {4, 5}
    assert python[:, 6:].max() < 0.05  # the prompt's experts are not the answer's


def test_a_restart_admits_by_what_was_learned_and_goes_on_learning(encoder, tmp_path):
    async def main():
        async with local_backend(vllm_like) as url:
            await _serve(url, encoder, tmp_path / "data", 10)  # stopped before its first head (16)
            return await _serve(url, encoder, tmp_path / "data", 8)

    _, health, metrics, _ = asyncio.run(main())
    assert health["admission"] == {"mode": "learned head", "learning": {"observed": 18, "head_fitted_on": 16}}
    assert _metric(metrics, 'cohort_learned_profiles_total{source="routed_experts"}') == 8  # this process's


def test_without_learning_admission_reads_the_head_an_earlier_run_learned(encoder, tmp_path):
    """--no-learn (and a batch run that does not learn) still admits by the head saved in the data dir."""
    async def main():
        async with local_backend(vllm_like) as url:
            await _serve(url, encoder, tmp_path / "data", 20)  # learns and saves a head
            app = create_app(Settings(backends=(url,), encoder=encoder, learn=False, data_dir=str(tmp_path / "data")))
            try:
                predicted = app.state.proxy.predictor.predict(["about python dicts", "about cooking pasta"])
                return app.state.proxy.learning, app.state.proxy.predictor.mode(), predicted
            finally:
                await app.state.proxy.close()

    learning, mode, predicted = asyncio.run(main())
    python, cooking = (p.vector.reshape(LAYERS, EXPERTS) for p in predicted)
    assert learning is None and mode == "learned head"
    assert set(np.argsort(-python[0])[:2]) == {0, 1} and set(np.argsort(-cooking[0])[:2]) == {4, 5}


def test_before_the_first_head_requests_go_first_come_first_served(encoder, tmp_path):
    async def main():
        async with local_backend(vllm_like) as url:
            return await _serve(url, encoder, tmp_path / "data", 3)

    _, health, _, predicted = asyncio.run(main())
    assert health["admission"]["mode"] == "first come, first served until the first learned head"
    assert health["admission"]["learning"] == {"observed": 3, "head_fitted_on": 0, "first_head_after": 16}
    assert predicted == [None, None]


def test_a_client_that_asked_gets_the_routed_experts_and_bad_ones_are_counted_not_learned(encoder, tmp_path):
    async def garbled(request):
        if request.method == "GET":
            return answer({})
        if request.path != "/v1/chat/completions":
            return answer({"detail": "Not Found"}, status=404)
        body = await body_of(request)
        routed = "bm90IGFuIGFycmF5" if "bad" in body["messages"][-1]["content"] else _b64_npy(topic_routing("python"))
        return answer({"id": "c", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "routed_experts": routed}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}})

    async def main():
        async with local_backend(garbled) as url:
            app = create_app(Settings(backends=(url,), encoder=encoder, learn=True, data_dir=str(tmp_path / "d")))
            try:
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as c:
                    chat = {"model": "tiny", "messages": [{"role": "user", "content": "a python question"}]}
                    asked = await c.post("/v1/chat/completions", json={**chat, "routed_experts_prompt_start": 0})
                    bad = await c.post("/v1/chat/completions", json={**chat, "messages": [
                        {"role": "user", "content": "a bad one"}]})
                    await asyncio.sleep(0.3)
                    return asked, bad, (await c.get("/metrics")).text
            finally:
                await app.state.proxy.close()

    asked, bad, metrics = asyncio.run(main())
    assert asked.json()["choices"][0]["routed_experts"] == _b64_npy(topic_routing("python"))
    assert bad.status_code == 200 and "routed_experts" not in bad.json()["choices"][0]
    assert _metric(metrics, 'cohort_learned_dropped_total{reason="invalid"}') == 1
    assert _metric(metrics, 'cohort_learned_profiles_total{source="routed_experts"}') == 1


def test_learning_needs_an_encoder():
    with pytest.raises(SettingsError, match="learn.*needs an encoder"):
        Settings(backends=("http://x:1",), encoder="none", learn=True)


def test_the_proxy_learns_from_the_plugins_counts_of_streamed_and_whole_answers(encoder, tmp_path):
    seen = []

    async def main():
        async with local_backend(plugin_backend(seen)) as url:
            app = create_app(Settings(backends=(url,), encoder=encoder, learn=True, data_dir=str(tmp_path / "d")))
            proxy = app.state.proxy
            try:
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as c:
                    for i in range(21):
                        chat = {"model": "tiny", "messages": [{"role": "user", "content": topic_prompt(i)}],
                                "stream": i % 3 == 0, "vllm_xargs": {"moe_observe": "a client's own token"}}
                        assert (await c.post("/v1/chat/completions", json=chat)).status_code == 200
                        await asyncio.sleep(0.02)
                    deadline = time.monotonic() + 30
                    while proxy.learning.learner.observed < 20 and time.monotonic() < deadline:
                        await asyncio.sleep(0.1)
                    await asyncio.sleep(0.2)
                    return (await c.get("/health")).json(), (await c.get("/metrics")).text
            finally:
                await proxy.close()

    health, metrics = asyncio.run(main())
    assert seen[0] is None  # the first request went before the backend said it serves the counts
    assert all(t and t != "a client's own token" for t in seen[1:]) and len(set(seen[1:])) == 20
    assert _metric(metrics, 'cohort_learned_profiles_total{source="plugin"}') == 20
    assert health["admission"]["mode"] == "learned head" and health["admission"]["learning"]["observed"] == 20
    worker, loop = (_metric(metrics, f'cohort_learning_cpu_seconds_total{{thread="{t}"}}') for t in ("worker", "event_loop"))
    assert 0 < loop < worker < 30  # the worker featurized, observed and refitted; the loop read the counts


def test_once_the_reservoir_is_full_the_proxy_marks_only_what_it_keeps_and_a_sample_for_the_live_fit(encoder, tmp_path):
    """capacity 16, 120 requests: the engine counts the first 16, then each request the reservoir keeps (with
    probability 16 / n) and a sample-rate share of the others, whose counts feed the live fit only."""
    seen = []

    async def main():
        async with local_backend(plugin_backend(seen)) as url:
            app = create_app(Settings(backends=(url,), encoder=encoder, learn=True, learn_capacity=16,
                                      learn_sample_rate=0.25, data_dir=str(tmp_path / "d")))
            learning = app.state.proxy.learning
            async with app.router.lifespan_context(app):  # asks the backend first: every request is offered
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as c:
                    for i in range(120):
                        chat = {"model": "tiny", "messages": [{"role": "user", "content": topic_prompt(i)}]}
                        assert (await c.post("/v1/chat/completions", json=chat)).status_code == 200
                    marked = [t for t in seen if t]
                    deadline = time.monotonic() + 30
                    while learning.learner.observed < len(marked) and time.monotonic() < deadline:
                        await asyncio.sleep(0.1)
                    return learning.learner, marked

    learner, marked = asyncio.run(main())
    kept = [t for t in marked if not t.endswith("-live")]
    reservoir = learner.reservoir
    assert reservoir.seen == 120 and reservoir.size == 16 and learner.observed == len(marked)
    same_coin = Reservoir(16, seed=0)  # the proxy's reservoir offered 120 requests: these were the kept ones
    assert len(kept) == sum(same_coin.offer() for _ in range(120)) == reservoir.stored  # and only they were stored
    assert abs(len(kept) - 16 * (1 + sum(1 / n for n in range(17, 121)))) < 15, len(kept)  # ~48 in expectation
    live_only = len(marked) - len(kept)
    assert 0.1 * (120 - len(kept)) < live_only < 0.4 * (120 - len(kept)), live_only
    assert learner.live_fit()[2] >= live_only  # the live-only ones were measured, never stored


def test_a_proxy_that_starts_asks_the_backend_first_and_marks_its_first_request(encoder, tmp_path):
    seen = []

    async def main():
        async with local_backend(plugin_backend(seen)) as url:
            app = create_app(Settings(backends=(url,), encoder=encoder, learn=True, data_dir=str(tmp_path / "d")))
            async with app.router.lifespan_context(app):  # what uvicorn runs at start-up
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as c:
                    chat = {"model": "tiny", "messages": [{"role": "user", "content": topic_prompt(1)}]}
                    assert (await c.post("/v1/chat/completions", json=chat)).status_code == 200

    asyncio.run(main())
    assert seen[0] is not None


def test_the_learner_gets_each_requests_features_and_arrival_prediction_without_reading_it_again(encoder):
    from moe_cohort.encoder.ngrams import DEFAULT_NGRAM_DIM
    from moe_cohort.encoder.profile import ProfileHead, head_features
    from moe_cohort.send.profiles import make_predictor

    rng = np.random.default_rng(0)
    head = ProfileHead(rng.normal(size=(8 + DEFAULT_NGRAM_DIM, LAYERS * EXPERTS)).astype(np.float32),
                       np.zeros(LAYERS * EXPERTS, np.float32), LAYERS, EXPERTS, top_k=K, ngram_dim=DEFAULT_NGRAM_DIM)
    predictor = make_predictor(Settings(encoder=encoder))
    predictor.follow(SimpleNamespace(head=head, on=True))
    texts = ["a question about python", "about cooking rice"]
    predicted = predictor.predict(texts)
    features, at_arrival = predictor.features(texts)
    from moe_cohort.encoder.embedding import Embedder

    x = Embedder(encoder).encode(texts)  # [2, 8]
    np.testing.assert_allclose(features, head_features(x, texts, DEFAULT_NGRAM_DIM), atol=1e-3)
    for p, q in zip(predicted, at_arrival):
        np.testing.assert_array_equal(p.vector, q)
    _, unknown = predictor.features(["never predicted"])
    assert unknown == [None]


def test_a_batch_with_one_text_not_predicted_reads_only_that_one(encoder, monkeypatch):
    """The learner's batch mixes requests predicted on arrival with one that was not (evicted, failed): the kept
    ones keep their features and arrival predictions, only the other is read again."""
    import moe_cohort.encoder.profile as profile_module
    from moe_cohort.encoder.ngrams import DEFAULT_NGRAM_DIM
    from moe_cohort.encoder.profile import ProfileHead
    from moe_cohort.send.profiles import make_predictor

    read = []
    real = profile_module.head_features
    monkeypatch.setattr(profile_module, "head_features", lambda x, texts, dim: read.append(list(texts)) or real(x, texts, dim))
    rng = np.random.default_rng(1)
    head = ProfileHead(rng.normal(size=(8 + DEFAULT_NGRAM_DIM, LAYERS * EXPERTS)).astype(np.float32),
                       np.zeros(LAYERS * EXPERTS, np.float32), LAYERS, EXPERTS, top_k=K, ngram_dim=DEFAULT_NGRAM_DIM)
    predictor = make_predictor(Settings(encoder=encoder))
    predictor.follow(SimpleNamespace(head=head, on=True))
    predicted = predictor.predict(["a question about python", "about cooking rice"])
    read.clear()
    texts = ["about cooking rice", "never predicted", "a question about python"]
    features, at_arrival = predictor.features(texts)
    assert read == [["never predicted"]]
    np.testing.assert_array_equal(at_arrival[0], predicted[1].vector)
    np.testing.assert_array_equal(at_arrival[2], predicted[0].vector)
    assert at_arrival[1] is None and features.shape == (3, 8 + DEFAULT_NGRAM_DIM)
    np.testing.assert_allclose(features[1], real(predictor_embed(encoder, ["never predicted"]), ["never predicted"],
                                                 DEFAULT_NGRAM_DIM)[0], atol=1e-5)


def predictor_embed(encoder: str, texts: list[str]) -> np.ndarray:
    from moe_cohort.encoder.embedding import Embedder

    return Embedder(encoder).encode(texts)


def test_a_newer_head_predicts_texts_seen_lately_from_their_kept_features(encoder, monkeypatch):
    """A batch re-predicts the requests next in line with each new head: from the features kept at their first
    prediction, without embedding them or hashing their n-grams again; a text not seen lately is read."""
    from moe_cohort.encoder.embedding import Embedder
    from moe_cohort.encoder.ngrams import DEFAULT_NGRAM_DIM
    from moe_cohort.encoder.profile import ProfileHead, head_features
    from moe_cohort.send.profiles import make_predictor

    rng = np.random.default_rng(1)
    heads = [ProfileHead(rng.normal(size=(8 + DEFAULT_NGRAM_DIM, LAYERS * EXPERTS)).astype(np.float32),
                         np.zeros(LAYERS * EXPERTS, np.float32), LAYERS, EXPERTS, top_k=K, ngram_dim=DEFAULT_NGRAM_DIM)
             for _ in range(2)]
    learning = SimpleNamespace(head=heads[0], on=True)
    predictor = make_predictor(Settings(encoder=encoder))
    predictor.follow(learning)
    texts = ["a question about python", "about cooking rice"]
    predictor.predict(texts)
    expected = heads[1].from_features(head_features(Embedder(encoder).encode(texts), texts, DEFAULT_NGRAM_DIM))

    def read_again(self, texts):
        raise AssertionError(f"read again: {texts}")

    monkeypatch.setattr(Embedder, "encode", read_again)
    learning.head = heads[1]
    again = predictor.predict(texts)
    np.testing.assert_allclose([p.vector for p in again], expected, atol=2e-3)  # from float16 features
    with pytest.raises(AssertionError, match="read again"):
        predictor.predict(["a text not seen lately"])


def test_the_learning_worker_keeps_the_serving_priority_on_one_blas_thread(tmp_path):
    """Observations and a batch's re-predictions run on the learning worker, a thread of the serving process: at the
    serving threads' priority (a thread the OS keeps off the CPU would hold the GIL meanwhile, and the event loop
    would wait for it), BLAS on one thread (no spinning helpers)."""
    import os
    import threading

    from threadpoolctl import threadpool_info

    from moe_cohort.send.learning.learning import Learning
    from moe_cohort.send.metrics import Metrics
    from moe_cohort.train.online import OnlineLearner

    def where() -> tuple[int, set[int]]:
        blas = {lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), blas

    learning = Learning(OnlineLearner(), lambda texts: (np.zeros((len(texts), 1)), [None] * len(texts)),
                        tmp_path, Metrics(), on=False)
    try:
        nice, blas = asyncio.run(learning.in_background(where))
    finally:
        learning.close()
    assert nice == where()[0] and blas == {1}, (nice, blas)


@pytest.mark.integration  # starts the learner's process
def test_a_refit_runs_in_a_process_of_its_own_at_the_lowest_priority():
    """fit_apart: the same head as fitting here (the reference), fitted in another process that runs only on a core
    nothing else wants (SCHED_IDLE, and nice 19), which shares no GIL with the serving event loop; one that died is
    replaced at the next fit."""
    import os

    from moe_cohort.send.learning import behind_serving
    from moe_cohort.train.profile_head import fit_head_features

    rng = np.random.default_rng(0)
    f, y = rng.normal(size=(40, 24)).astype(np.float32), rng.random((40, 2, 8))  # [N, F], [N, L, E]
    apart = behind_serving.fit_apart(f, y, 2, (0.1, 10.0), ngram_dim=0)
    here = fit_head_features(f, y, 2, (0.1, 10.0), ngram_dim=0)
    assert apart.alpha == here.alpha
    np.testing.assert_array_equal(apart.from_features(f), here.from_features(f))
    child = behind_serving._apart().process
    assert child.pid != os.getpid() and os.getpriority(os.PRIO_PROCESS, child.pid) == behind_serving.LOWEST
    if sys.platform == "linux":
        assert os.sched_getscheduler(child.pid) == os.SCHED_IDLE
    with pytest.raises(ValueError):  # the fit's own error comes back
        behind_serving.fit_apart(f, y[:3], 2, (1.0,), ngram_dim=0)
    child.kill()
    child.wait()
    with pytest.raises(behind_serving.LearnerProcessError):
        behind_serving.fit_apart(f, y, 2, (0.1,), ngram_dim=0)
    again = behind_serving.fit_apart(f, y, 2, (0.1, 10.0), ngram_dim=0)
    assert behind_serving._apart().process.pid != child.pid
    np.testing.assert_array_equal(again.from_features(f), here.from_features(f))


def test_the_worker_limits_blas_without_inspecting_the_libraries_each_time(monkeypatch):
    """One inspection of the loaded BLAS libraries (~2.5 ms: more than learning from a request) serves every batch
    until a module is imported; within the block every BLAS runs one thread."""
    import types

    from threadpoolctl import threadpool_info

    import moe_cohort.send.learning.behind_serving as behind_serving

    made = []
    real = behind_serving.ThreadpoolController
    monkeypatch.setattr(behind_serving, "ThreadpoolController", lambda: made.append(1) or real())
    behind_serving._blas.cache_clear()
    for _ in range(5):
        with behind_serving.one_blas_thread():
            blas = [lib for lib in threadpool_info() if lib["user_api"] == "blas"]
            assert blas and all(lib["num_threads"] == 1 for lib in blas)
    assert len(made) == 1
    monkeypatch.setitem(sys.modules, "a_module_loaded_since", types.ModuleType("a_module_loaded_since"))
    with behind_serving.one_blas_thread():
        pass
    assert len(made) == 2
    behind_serving._blas.cache_clear()


def test_the_learning_worker_refits_through_the_learner_process(tmp_path, monkeypatch):
    """Every refit of the proxy's learner goes to the learner's process (behind_serving.fit_apart), never runs on
    the worker thread itself: the fits that come in are the ones the schedule asks for."""
    from moe_cohort.send.learning import behind_serving
    from moe_cohort.train.profile_head import fit_head_features

    fits = []

    class Recording:
        def call(self, args, kwargs):
            fits.append(len(args[0]))
            return fit_head_features(*args, **kwargs)

    monkeypatch.setattr(behind_serving, "_apart", Recording)
    learning = _learning_fed(tmp_path, 8)
    learning.close()
    assert fits == [4, 8] and learning.head is not None  # the first head at 4 rows, the next 4 rows later


def _learning_fed(folder, n: int):
    """A Learning that fits its first head at 4 observations and refits every 4, fed `n` random ones."""
    from moe_cohort.send.learning.learning import Learning
    from moe_cohort.send.metrics import Metrics
    from moe_cohort.traces.observed import Observed
    from moe_cohort.train.online import LearnConfig, OnlineLearner

    rng = np.random.default_rng(0)
    learning = Learning(OnlineLearner(LearnConfig(first_fit=4, refit_every=4, ngram_dim=0)),
                        lambda texts: (rng.normal(size=(len(texts), 6)).astype(np.float32), [None] * len(texts)),
                        folder, Metrics())
    for i in range(n):
        counts = rng.integers(0, 5, (2, 8))  # [L, E]
        learning.add(f"prompt {i}", Observed(counts, counts, 4, 4), "plugin", True)
    return learning


def test_closing_stops_a_refit_that_does_not_end_and_returns(tmp_path, monkeypatch, caplog):
    """A refit stuck in the learner's process must not hold a closing proxy: after the wait, close stops the
    process (the refit's call then fails, as when the process dies) and saves what was learned."""
    import threading

    from moe_cohort.send.learning import learning as learning_module
    from moe_cohort.send.learning.behind_serving import LearnerProcessError

    killed, refitting = threading.Event(), threading.Event()

    def stuck_fit(*args, **kwargs):  # the learner process's call, waiting on a process that never answers
        refitting.set()
        killed.wait(30)
        raise LearnerProcessError("the learner's process ended (exit status -9)")

    monkeypatch.setattr(learning_module, "fit_apart", stuck_fit)
    monkeypatch.setattr(learning_module, "stop_apart", killed.set)
    learning = _learning_fed(tmp_path, 4)
    assert refitting.wait(10)
    started = time.monotonic()
    learning.close(timeout_s=0.3)
    assert killed.is_set() and time.monotonic() - started < 5
    assert learning.head is None and list(tmp_path.iterdir())  # no head, but the observations are saved
    assert "stopping its refit" in caplog.text


@pytest.mark.integration  # starts the learner's process
def test_what_the_learner_process_prints_does_not_reach_its_answers():
    """The learner process answers on the pipe that was its stdout; a library that prints in it (here the fit itself)
    writes to its stderr instead, and the serving process still reads each answer."""
    import pickle
    import subprocess

    from moe_cohort.train.profile_head import fit_head_features

    code = ("import moe_cohort.train.profile_head as p; fit = p.fit_head_features\n"
            "def noisy(*a, **k):\n    print('a library talks'); return fit(*a, **k)\n"
            "p.fit_head_features = noisy\n"
            "from moe_cohort.send.learning import behind_serving as b; b._serve(__import__('sys').stdin.buffer, b._answers())")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    rng = np.random.default_rng(0)
    f, y = rng.normal(size=(40, 24)).astype(np.float32), rng.random((40, 2, 8))  # [N, F], [N, L, E]
    try:
        for _ in range(2):
            pickle.dump(((f, y, 2, (0.1, 10.0)), {"ngram_dim": 0}), child.stdin)
            child.stdin.flush()
            ok, head = pickle.load(child.stdout)
            assert ok
            np.testing.assert_array_equal(head.from_features(f),
                                          fit_head_features(f, y, 2, (0.1, 10.0), ngram_dim=0).from_features(f))
    finally:
        child.stdin.close()  # the learner process ends at the end of its stdin
        child.wait(30)
    assert child.stderr.read().decode().count("a library talks") == 2

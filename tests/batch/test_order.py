"""Batch orders: admission by predicted vectors against a brute-force replay, and the dry run's simulation."""


import numpy as np

from moe_cohort.admission.resident import ResidentEmbedding, ResidentExperts
from moe_cohort.admission.wire import Prediction
from moe_cohort.batch.order import ExpertOrder, FileOrder, make_order, sending_order
from moe_cohort.send.profiles import Predictor
from tests.helpers.batch_files import parsed
from tests.helpers.brute_force import brute_force_order


def test_simulated_admission_matches_brute_force(tmp_path):
    rng = np.random.default_rng(4)
    for trial in range(10):
        vectors = [rng.random(6) * (rng.random(6) < 0.4) for _ in range(9)]
        requests = parsed(tmp_path, [f"p{i}" for i in range(9)])
        order = ExpertOrder(3, lambda size: ResidentExperts(1, size), vectors={r.line: v for r, v in zip(requests, vectors)})
        got = [requests.index(r) for r in sending_order(requests, order, max_in_flight=3)]
        assert got == brute_force_order(vectors, 3), trial


def test_the_window_limits_how_far_ahead_admission_looks(tmp_path):
    requests = parsed(tmp_path, ["a", "b", "c", "a"])
    a, b = np.array([1.0, 0.0]), np.array([0.0, 1.0])
    vectors = {r.line: v for r, v in zip(requests, [a, b, b, a])}
    wide = sending_order(requests, ExpertOrder(2, lambda n: ResidentExperts(1, n), vectors=vectors), 2)
    narrow = sending_order(requests, ExpertOrder(2, lambda n: ResidentExperts(1, n), window=1, vectors=vectors), 2)
    assert [r.text for r in wide] == ["a", "a", "b", "c"] and [r.text for r in narrow] == ["a", "b", "c", "a"]


def test_make_order_predicts_once_and_falls_back_to_the_file_order(tmp_path):
    requests = parsed(tmp_path, ["x", "yy"])
    calls = []

    def predict(texts):
        calls.append(list(texts))
        return [Prediction(np.ones(3) / np.sqrt(3)), None]

    order = make_order(requests, Predictor(predict, ResidentEmbedding, "embedding"), 2)
    assert calls == [["x", "yy"]] and order.vectors[requests[1].line] is None
    assert isinstance(make_order(requests, None, 2), FileOrder)


def test_a_refresh_rescores_the_waiting_requests_in_place(tmp_path):
    """The first `k` sends without predictions (first come, first served: no head yet), then every line's
    profile comes in (a learned head): the rest follow the brute force, in which a request sent before the
    refresh adds nothing known to the resident set."""
    rng = np.random.default_rng(7)
    for trial in range(10):
        vectors = [rng.random(6) * (rng.random(6) < 0.4) for _ in range(10)]
        requests = parsed(tmp_path, [f"p{i}" for i in range(10)])
        order = ExpertOrder(3, lambda size: ResidentExperts(1, size), window=6, vectors={r.line: None for r in requests})
        k = int(rng.integers(3, 7))  # after the first 3 (chosen at once, into the free slots), one choice per send
        waiting, out, sent = list(requests), [], []
        while waiting:  # sending_order, with the refresh after k sends
            if len(out) >= 3:
                order.finished(out.pop(0))
            if len(sent) == k:
                order.refresh({r.line: v for r, v in zip(requests, vectors)})
            request = waiting.pop(order.pick(waiting))
            order.sent(request)
            out.append(request)
            sent.append(requests.index(request))
        assert sent[:k] == list(range(k)), trial
        assert sent == _brute_force_after(vectors, 3, k, window=6), trial


def _brute_force_after(vectors, concurrency, k, window):
    """brute_force_order over the first `window` waiting, with no vectors for the first `k` sends."""
    waiting, out, sent = list(range(len(vectors))), [], []
    while waiting:
        if len(out) >= concurrency:
            out.pop(0)
        known = [o for o in out if sent.index(o) >= k]
        if len(sent) < k or not known:
            choice = waiting[0]
        else:
            idle = np.prod([1 - np.clip(vectors[o], 0, 0.999) for o in known], axis=0)
            choice = min(waiting[:window], key=lambda i: (round(float(vectors[i] @ idle), 9), i))
        waiting.remove(choice)
        out.append(choice)
        sent.append(choice)
    return sent

"""moe_cohort.ray_serve.admission: a Ray Serve router's bookkeeping against the admission router it drives."""

from types import SimpleNamespace

from pydantic import BaseModel

import numpy as np
import pytest

from moe_cohort.admission.router import ReplicaRouter
from moe_cohort.admission.wire import PROFILE_KEY, Prediction
from moe_cohort.ray_serve.admission import ServeAdmission, call_text, with_profile


class Message(BaseModel):  # a chat message as a pydantic request model holds it
    role: str
    content: str


def test_free_slots_found_one_at_a_time_admit_what_the_admission_router_admits():
    """Serve finds free replicas one at a time (an offer, then a take); the choices equal ReplicaRouter.admit's
    on the same arrivals and completions."""
    rng = np.random.default_rng(3)
    book, router = ServeAdmission(slots=3, max_wait=5.0), ReplicaRouter([3, 3], "affinity", max_wait=5.0)
    book.replicas_changed({"r0": 99, "r1": 99})  # `slots` wins over what the replicas say
    placed, key = [], 0
    for now in range(60):
        for _ in range(int(rng.integers(0, 4))):
            vector = (rng.random(8) * (rng.random(8) < 0.4)).astype(np.float32)
            book.arrive(key, vector, float(now))
            router.add(key, vector, float(now))
            key += 1
        expected = router.admit(float(now))
        got = []
        while offered := book.offer(["r1", "r0"]):
            taken = book.take(offered[0], float(now))
            if taken is None:
                break
            got.append((taken, book.index[offered[0]]))
        assert got == expected, now
        placed += got
        for k, r in [p for p in placed if rng.random() < 0.4]:
            assert book.completed(f"r{r}", k) and router.release(k) == r
            placed.remove((k, r))


def test_replicas_that_come_and_go():
    book = ServeAdmission()
    book.replicas_changed({"a": 2})
    for key in range(4):
        book.arrive(key, None, 0.0)
    assert book.take("a", 0.0) == 0 and book.take("a", 0.0) == 1 and book.take("a", 0.0) is None  # full
    book.replicas_changed({"b": 1})  # "a" died, Serve started "b" with its own capacity
    assert book.offer(["a", "b"]) == ["b"] and book.take("a", 0.0) is None
    assert book.take("b", 0.0) == 2
    assert book.completed("a", 0) and book.completed("a", 1)  # "a"'s requests ended with errors
    assert book.offer(["a", "b"]) == [] and book.take("unknown", 0.0) is None


def test_a_completion_frees_only_the_slot_of_that_request_on_that_replica():
    book = ServeAdmission(slots=1)
    book.replicas_changed({"a": 1, "b": 1})
    book.arrive("x", None, 0.0)
    assert book.take("a", 0.0) == "x"
    assert not book.completed("b", "x") and not book.completed("a", "never-seen")
    assert book.offer(["a", "b"]) == ["b"]
    book.arrive("x", None, 1.0)  # refused by "a" and routed again before the refusal was reported
    assert book.offer(["a", "b"]) == ["a", "b"]
    assert book.take("a", 1.0) == "x"  # placed again
    assert not book.completed("a", "x")  # the refused attempt's report frees nothing: x holds its new slot
    assert book.offer(["a", "b"]) == ["b"]
    assert book.completed("a", "x") and book.offer(["a", "b"]) == ["a", "b"]


def test_a_late_prediction_and_a_request_that_leaves():
    book = ServeAdmission(slots=2)
    book.replicas_changed({"a": 2})
    resident, near, far = np.eye(4)[0], np.eye(4)[0] * 0.9, np.eye(4)[3]
    book.arrive("seed", resident, 0.0)
    assert book.take("a", 0.0) == "seed"
    book.arrive("far", far, 0.0)
    book.arrive("late", None, 1.0)
    book.predicted("late", near)  # fits the resident: goes before the older "far"
    assert book.take("a", 1.0) == "late"
    book.leave("far")
    book.completed("a", "seed")
    assert book.take("a", 2.0) is None


@pytest.mark.parametrize("args,kwargs,text", [
    ([{"messages": [{"role": "user", "content": "hi there"}]}], {}, "hi there"),
    ([{"prompt": ["a", "b"]}], {}, "a\nb"),
    ([], {"request": {"input": "responses api"}}, "responses api"),
    ([SimpleNamespace(messages=[{"role": "user", "content": "pydantic"}], prompt=None)], {}, "pydantic"),
    ([SimpleNamespace(messages=[Message(role="user", content="models")])], {}, "models"),
    ([{"prompt": [1, 2, 3]}], {}, None),  # token ids: no text
    (["not a request"], {}, None),
])
def test_call_text(args, kwargs, text):
    assert call_text(args, kwargs) == text


def test_with_profile_sets_vllm_xargs_and_keeps_the_others():
    prediction = Prediction.of_profile(np.eye(2, 4))
    body = {"prompt": "x", "vllm_xargs": {"moe_routing": "topk"}}
    with_profile(body, prediction)
    assert body["vllm_xargs"] == {"moe_routing": "topk", PROFILE_KEY: prediction.compact}
    request = SimpleNamespace(vllm_xargs=None)
    with_profile(request, prediction)
    assert request.vllm_xargs == {PROFILE_KEY: prediction.compact}

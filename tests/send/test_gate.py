"""The proxy's online admission: slots, the waiting pool, the rule, fairness, background work, profiles.

Observed from outside: which waiter is admitted, the admissions' fields, and the gate's ReplicaSet
(its router's waiting count and resident sets, its slots in flight)."""

import asyncio
import threading
import time

import numpy as np

import moe_cohort.send.gate
from moe_cohort.admission.wire import Prediction
from moe_cohort.send.gate import AdmissionGate, Profiler
from moe_cohort.send.metrics import Metrics
from moe_cohort.send.replicas import ReplicaSet
from tests.helpers.idle_clients import idle_clients

A, B = np.array([1.0, 1.0, 0.0, 0.0]), np.array([0.0, 0.0, 1.0, 1.0])  # [L*E] profiles of two kinds
PROFILES = {"a1": A, "a2": A, "a3": A, "b1": B, "b2": B}
predicted = []  # texts the blocked gates' predictor answered


def predict(texts):
    return [None if t not in PROFILES else Prediction(PROFILES[t], [7]) for t in texts]


def gate(capacity, now=None, predict=predict, profile_first=True):
    """A gate of one slot-only replica of `capacity` slots (fairness bound 30 s); `now`: a clock [seconds]."""
    clock = (lambda: now[0]) if now is not None else time.monotonic
    replicas = ReplicaSet(idle_clients(1), [capacity], "affinity", max_queue_s=30.0, clock=clock)
    return AdmissionGate(Profiler(predict), Metrics(), replicas, profile_first=profile_first)


def in_flight(g):
    return g.replicas.in_flight()


def resident_count(g):
    resident = g.replicas.router.resident(0)
    return 0 if resident is None else resident.count


async def until(condition, timeout=10.0):
    """Yield to the loop (and the profiler's thread) until `condition()` holds; then a few more turns."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.002)
    for _ in range(5):
        await asyncio.sleep(0)


def pooled(g, n):
    return lambda: g.replicas.router.waiting() == n


def profiled(g):
    """Waiting requests whose prediction has landed."""
    pool = g.replicas.router.pool
    return int((pool.active & pool.profiled).sum())


def run(coro):
    return asyncio.run(coro)


def test_a_lone_request_is_admitted_at_once_with_its_profile():
    async def main():
        g = gate(4)
        admission = await asyncio.wait_for(g.admit("a1"), 5)
        assert admission.prediction.compact == [7] and admission.queue_s >= 0 and in_flight(g) == 1
        assert resident_count(g) == 1
        g.release(admission)
        assert in_flight(g) == 0 and resident_count(g) == 0
    run(main())


def test_a_freed_slot_goes_to_the_request_that_fits_the_resident_set():
    async def main():
        g = gate(2)
        resident = await g.admit("a1")
        other = await g.admit("b1")  # both slots taken
        waiting = {"b2": asyncio.ensure_future(g.admit("b2"))}
        await until(pooled(g, 1))
        waiting["a2"] = asyncio.ensure_future(g.admit("a2"))  # arrival order: b2 first
        await until(lambda: profiled(g) == 2)  # both pooled, their predictions landed where they wait
        assert not any(w.done() for w in waiting.values())
        g.release(other)  # a1 stays resident: a2 fits it
        await until(waiting["a2"].done)
        assert not waiting["b2"].done()
        g.release(resident)
        g.release(waiting["a2"].result())
        await until(waiting["b2"].done)
    run(main())


def test_with_nobody_resident_the_oldest_goes_first():
    async def main():
        g = gate(1)
        first = await g.admit("a1")
        waiting = [asyncio.ensure_future(g.admit("b1"))]
        await until(pooled(g, 1))
        waiting.append(asyncio.ensure_future(g.admit("a2")))
        await until(pooled(g, 2))
        g.release(first)  # the resident set is empty again: nothing to fit, b1 is oldest
        await until(waiting[0].done)
        assert not waiting[1].done()
        assert resident_count(g) == 1  # b1's profile
    run(main())


def test_a_request_past_the_fairness_bound_goes_first():
    async def main():
        now = [0.0]
        g = gate(2, now=now)
        resident, other = await g.admit("a1"), await g.admit("b1")
        misfit = asyncio.ensure_future(g.admit("b2"))
        await until(pooled(g, 1))
        now[0] = 31.0  # b2 has waited past max_queue_s
        fit = asyncio.ensure_future(g.admit("a2"))
        await until(pooled(g, 2))
        g.release(other)
        await until(misfit.done)
        assert not fit.done()
        g.release(resident)
    run(main())


def test_requests_without_a_profile_are_first_come_first_served():
    async def main():
        g = gate(2)
        resident, other = await g.admit("a1"), await g.admit("b1")
        plain = asyncio.ensure_future(g.admit("no profile"))
        await until(pooled(g, 1))
        fit = asyncio.ensure_future(g.admit("a2"))
        await until(pooled(g, 2))
        g.release(other)
        await until(plain.done)
        assert not fit.done()
        g.release(resident)
    run(main())


def test_background_work_only_gets_slots_no_waiting_request_wants():
    async def main():
        g = gate(1)
        first = await g.admit("a1")
        background = asyncio.ensure_future(g.admit_background())
        online = asyncio.ensure_future(g.admit("b1"))
        await until(pooled(g, 1))
        g.release(first)
        await until(online.done)
        assert not background.done()
        g.release(online.result())
        await until(background.done)
        assert in_flight(g) == 1
        g.release(background.result())
    run(main())


def test_cancelled_waiters_hold_no_slot():
    async def main():
        g = gate(1)
        first = await g.admit("a1")
        waiting = asyncio.ensure_future(g.admit("a2"))
        await until(pooled(g, 1))
        waiting.cancel()
        await until(pooled(g, 0))
        g.release(first)
        assert in_flight(g) == 0 and g.replicas.router.waiting() == 0
        assert (await asyncio.wait_for(g.admit("b1"), 5)).prediction.compact == [7]
    run(main())


def test_the_profiler_batches_what_arrives_together_and_survives_a_failure():
    calls = []

    def batched(texts):
        calls.append(list(texts))
        if "boom" in texts:
            raise RuntimeError("encoder down")
        return [Prediction(np.full(2, float(len(t)))) for t in texts]

    async def main():
        p = Profiler(batched)
        got = await asyncio.gather(*(p.profile(t) for t in ("x", "yy", "zzz")))
        assert [g.vector[0] for g in got] == [1.0, 2.0, 3.0]
        assert len(calls) <= 2 and sum(map(len, calls)) == 3  # the first alone at most, the rest together
        assert await p.profile("boom") is None  # FCFS for these, nothing lost
        p.close()
    run(main())


def test_the_wait_for_a_slot_excludes_the_profile_prediction():
    now = [0.0]

    def slow_predict(texts):
        now[0] += 0.1  # each prediction takes 0.1 s on the gate's clock
        return predict(texts)

    async def main():
        g = gate(1, now=now, predict=slow_predict)
        first = await g.admit("a1")  # arrives at 0, predicted at 0.1, admitted at once
        second = asyncio.ensure_future(g.admit("b1"))  # arrives at 0.1, predicted at 0.2, then waits
        await until(pooled(g, 1))
        now[0] = 0.5
        g.release(first)
        return first, await asyncio.wait_for(second, 5)

    first, second = run(main())
    assert (first.queue_s, first.wait_s) == (0.1, 0.0)
    assert np.allclose([second.arrived, second.queue_s, second.wait_s], [0.1, 0.4, 0.3])


def blocked_gate(capacity):
    """A gate that admits a request finding a free slot at once (profile_first=False), and a predictor
    that answers only once `go` is set."""
    go = threading.Event()

    def slow_predict(texts):
        assert go.wait(10), "the test never let the prediction finish"
        predicted.extend(texts)
        return predict(texts)

    return gate(capacity, predict=slow_predict, profile_first=False), go


def test_a_request_that_finds_a_free_slot_goes_before_its_profile_which_joins_later():
    async def main():
        g, go = blocked_gate(2)
        first = await asyncio.wait_for(g.admit("a1"), 2)  # the prediction is still blocked
        assert first.prediction is None and resident_count(g) == 0
        go.set()
        await until(lambda: resident_count(g) == 1)  # a1's profile joined
        g.release(first)
        assert resident_count(g) == 0
        early = await g.admit("b1")
        g.release(early)  # finished before its profile came
        await until(lambda: "b1" in predicted)  # its late prediction came
        await asyncio.sleep(0.05)  # and was handed to the router, which holds b1 no more
        assert resident_count(g) == 0 and in_flight(g) == 0
    run(main())


def test_a_late_profile_steers_the_next_choice_and_a_waiting_request_waits_for_its_own():
    async def main():
        g, go = blocked_gate(2)
        go.set()
        resident, other = await g.admit("a1"), await g.admit("b1")  # both at once; profiles follow
        await until(lambda: resident_count(g) == 2)
        waiting = {"b2": asyncio.ensure_future(g.admit("b2"))}
        await until(pooled(g, 1))
        waiting["a2"] = asyncio.ensure_future(g.admit("a2"))  # arrival order: b2 first
        await until(lambda: profiled(g) == 2)  # both pooled, their predictions landed where they wait
        g.release(other)  # a1 stays resident, known only from its late profile: a2 fits it
        await until(waiting["a2"].done)
        assert not waiting["b2"].done() and waiting["a2"].result().prediction.compact == [7]  # predicted before it waited
        g.release(resident)
        g.release(waiting["a2"].result())
        await until(waiting["b2"].done)
        g.release(waiting["b2"].result())
    run(main())


def test_a_late_profile_is_predicted_only_after_the_burst(monkeypatch):
    monkeypatch.setattr(moe_cohort.send.gate, "LATE_PROFILE_S", 60.0)  # longer than the test
    asked = []

    def counting_predict(texts):
        asked.append(len(texts))
        return predict(texts)

    async def main():
        g = gate(4, predict=counting_predict, profile_first=False)
        admitted = [await g.admit(t) for t in ("a1", "b1")]
        await asyncio.sleep(0.05)  # the loop and the profiler's thread get their turns
        assert asked == [] and all(a.prediction is None for a in admitted)  # admitted, not predicted yet
        g.close()
    run(main())


def test_a_prediction_past_its_deadline_sends_the_request_on_without_it_and_joins_when_ready():
    async def main():
        g, go = blocked_gate(2)
        g.profile_first, g.deadline_s = True, 0.05  # every request waits for its profile, at most 50 ms
        admitted = await asyncio.wait_for(g.admit("a1"), 2)
        assert admitted.prediction is None and g.metrics.profile_late._value.get() == 1
        go.set()
        await until(lambda: resident_count(g) == 1)  # the late profile joined the resident set
        second = await g.admit("a2")  # in time now
        assert second.prediction is not None and g.metrics.profile_late._value.get() == 1
        g.release(admitted), g.release(second)
    run(main())


def test_a_predictor_with_nothing_to_predict_yet_is_not_asked_first_come_first_served():
    asked = []

    def counting_predict(texts):
        asked.extend(texts)
        return predict(texts)

    async def main():
        clock = [0.0]
        replicas = ReplicaSet(idle_clients(1), [1], "affinity", max_queue_s=30.0, clock=lambda: clock[0])
        g = AdmissionGate(Profiler(counting_predict, ready=lambda: False), Metrics(), replicas)
        first = await g.admit("a1")
        waiting = [asyncio.ensure_future(g.admit(t)) for t in ("b1", "a2")]
        await until(pooled(g, 2))
        g.release(first)
        await until(waiting[0].done)
        assert not waiting[1].done() and asked == []  # arrival order, and no prediction asked for
        g.release(waiting[0].result())
        g.release(await waiting[1])
    run(main())


def test_a_waiting_request_takes_a_freed_slot_before_its_prediction_lands():
    async def main():
        g, go = blocked_gate(1)
        g.deadline_s = 30.0  # no deadline frees the slot: the rule does
        first = await asyncio.wait_for(g.admit("a1"), 2)
        second = asyncio.ensure_future(g.admit("b1"))
        await until(pooled(g, 1))
        assert profiled(g) == 0  # pooled at once, first come, first served until predicted
        g.release(first)
        await until(second.done)  # the freed slot did not wait for the prediction (still blocked)
        assert not go.is_set() and second.result().prediction is None and in_flight(g) == 1
        go.set()
        await until(lambda: resident_count(g) == 1)  # its profile joined the resident set when it came
        g.release(second.result())
    run(main())


def test_with_profile_first_a_request_waits_for_its_prediction_only_while_the_engines_are_fed():
    async def main():
        g, go = blocked_gate(8)
        g.profile_first, g.deadline_s, g.fed_at = True, 30.0, 2  # fed from 2 requests at the backend
        early = [await asyncio.wait_for(g.admit(t), 2) for t in ("a1", "b1")]  # the engine has room: at once
        assert all(a.prediction is None for a in early)
        fed = asyncio.ensure_future(g.admit("a2"))
        await asyncio.sleep(0.1)
        assert not fed.done()  # the engine is fed: this one waits for its profile, to carry it
        go.set()
        admitted = await asyncio.wait_for(fed, 5)
        assert admitted.prediction.compact == [7]
        for a in (*early, admitted):
            g.release(a)
    run(main())

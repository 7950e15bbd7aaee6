"""The proxy's online admission: slots, the waiting pool, the rule, fairness, background work, profiles."""

import asyncio
import threading
import time

import numpy as np
import pytest

from moe_cohort.proxy.admission import AdmissionGate, Profiler
from moe_cohort.proxy.metrics import ProxyMetrics

A, B = np.array([1.0, 1.0, 0.0, 0.0]), np.array([0.0, 0.0, 1.0, 1.0])  # [L*E] profiles of two kinds
PROFILES = {"a1": A, "a2": A, "a3": A, "b1": B, "b2": B}


def predict(texts):
    return [None if t not in PROFILES else (PROFILES[t], [7]) for t in texts]


def gate(capacity, now=None, **kw):
    clock = (lambda: now[0]) if now is not None else None
    return AdmissionGate(Profiler(predict), ProxyMetrics(), max_in_flight=capacity, max_queue_s=30.0,
                         **({"clock": clock} if clock else {}), **kw)


async def until(condition, timeout=10.0):
    """Yield to the loop (and the profiler's thread) until `condition()` holds; then a few more turns."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.002)
    for _ in range(5):
        await asyncio.sleep(0)


def pooled(g, n):
    return lambda: len(g._pool) == n


def run(coro):
    return asyncio.run(coro)


def test_a_lone_request_is_admitted_at_once_with_its_profile():
    async def main():
        g = gate(4)
        admission = await asyncio.wait_for(g.admit("a1"), 5)
        assert admission.profile == [7] and admission.queue_s >= 0 and g._in_flight == 1
        g.release(admission)
        assert g._in_flight == 0 and g._resident.count == 0
    run(main())


def test_a_freed_slot_goes_to_the_request_that_fits_the_resident_set():
    async def main():
        g = gate(2)
        resident = await g.admit("a1")
        other = await g.admit("b1")  # both slots taken
        waiting = {"b2": asyncio.ensure_future(g.admit("b2"))}
        await until(pooled(g, 1))
        waiting["a2"] = asyncio.ensure_future(g.admit("a2"))  # arrival order: b2 first
        await until(pooled(g, 2))
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
        assert g._resident.count == 1  # b1's profile
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
        assert g._in_flight == 1
        g.release()
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
        assert g._in_flight == 0 and not g._pool
        assert (await asyncio.wait_for(g.admit("b1"), 5)).profile == [7]
    run(main())


def test_the_profiler_batches_what_arrives_together_and_survives_a_failure():
    calls = []

    def batched(texts):
        calls.append(list(texts))
        if "boom" in texts:
            raise RuntimeError("encoder down")
        return [(np.full(2, float(len(t))), None) for t in texts]

    async def main():
        p = Profiler(batched)
        got = await asyncio.gather(*(p.profile(t) for t in ("x", "yy", "zzz")))
        assert [g[0][0] for g in got] == [1.0, 2.0, 3.0]
        assert len(calls) <= 2 and sum(map(len, calls)) == 3  # the first alone at most, the rest together
        assert await p.profile("boom") is None  # FCFS for these, nothing lost
        p.close()
    run(main())


def test_the_wait_for_a_slot_excludes_the_profile_prediction():
    def slow_predict(texts):
        time.sleep(0.1)
        return predict(texts)

    async def main():
        g = AdmissionGate(Profiler(slow_predict), ProxyMetrics(), max_in_flight=1)
        first = await g.admit("a1")
        second = asyncio.ensure_future(g.admit("b1"))
        await asyncio.sleep(0.3)  # predicted after 0.1 s, then waits for the slot
        g.release(first)
        second = await asyncio.wait_for(second, 5)
        return first, second

    first, second = run(main())
    assert first.queue_s >= 0.1 and first.wait_s < 0.05  # predicted, then admitted at once
    assert second.queue_s >= 0.3 and 0.15 <= second.wait_s <= second.queue_s - 0.1


def blocked_gate(capacity):
    """A gate that admits a request finding a free slot at once (profile_first=False), and a predictor
    that answers only once `go` is set."""
    go = threading.Event()

    def slow_predict(texts):
        assert go.wait(10), "the test never let the prediction finish"
        return predict(texts)

    return AdmissionGate(Profiler(slow_predict), ProxyMetrics(), max_in_flight=capacity, profile_first=False), go


def test_a_request_that_finds_a_free_slot_goes_before_its_profile_which_joins_later():
    async def main():
        g, go = blocked_gate(2)
        first = await asyncio.wait_for(g.admit("a1"), 2)  # the prediction is still blocked
        assert first.profile is None and (g._resident is None or g._resident.count == 0)
        go.set()
        await until(lambda: g._resident is not None and g._resident.count == 1)  # a1's profile joined
        g.release(first)
        assert g._resident.count == 0
        early = await g.admit("b1")
        g.release(early)  # finished before its profile came
        await until(lambda: not g._late)
        assert g._resident.count == 0 and g._in_flight == 0
    run(main())


def test_a_late_profile_steers_the_next_choice_and_a_waiting_request_waits_for_its_own():
    async def main():
        g, go = blocked_gate(2)
        go.set()
        resident, other = await g.admit("a1"), await g.admit("b1")  # both at once; profiles follow
        await until(lambda: g._resident is not None and g._resident.count == 2)
        waiting = {"b2": asyncio.ensure_future(g.admit("b2"))}
        await until(pooled(g, 1))
        waiting["a2"] = asyncio.ensure_future(g.admit("a2"))  # arrival order: b2 first
        await until(pooled(g, 2))
        g.release(other)  # a1 stays resident, known only from its late profile: a2 fits it
        await until(waiting["a2"].done)
        assert not waiting["b2"].done() and waiting["a2"].result().profile == [7]  # predicted before it waited
        g.release(resident)
        g.release(waiting["a2"].result())
        await until(waiting["b2"].done)
        g.release(waiting["b2"].result())
    run(main())


def test_a_late_profile_is_predicted_only_after_the_burst(monkeypatch):
    import moe_cohort.proxy.admission

    monkeypatch.setattr(proxy.admission, "LATE_PROFILE_S", 0.3)
    asked = []

    def counting_predict(texts):
        asked.append(len(texts))
        return predict(texts)

    async def main():
        g = AdmissionGate(Profiler(counting_predict), ProxyMetrics(), max_in_flight=4, profile_first=False)
        admitted = [await g.admit(t) for t in ("a1", "b1")]
        await asyncio.sleep(0.1)
        assert asked == [] and all(a.profile is None for a in admitted)  # admitted, not predicted yet
        await until(lambda: g._resident is not None and g._resident.count == 2)
        assert sum(asked) == 2
    run(main())

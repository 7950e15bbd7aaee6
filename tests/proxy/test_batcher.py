"""The window and dispatcher, driven directly with asyncio (no HTTP)."""

import asyncio

from proxy.batcher import Batcher
from proxy.metrics import ProxyMetrics
from proxy.planning import arrival_batches


def reversed_plan(texts, batch_size):
    """A planner that visibly reorders: reversed arrival order, cut into batches."""
    order = list(range(len(texts)))[::-1]
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def make(plan_fn=reversed_plan, **kw):
    kw = {"batch_size": 2, "flush_size": 4, "max_wait_s": 30.0, "max_in_flight": 100, **kw}
    return Batcher(plan_fn, ProxyMetrics(), **kw)


def sample(batcher, name):
    return batcher.metrics.registry.get_sample_value(name) or 0


async def admit_all(batcher, texts, policy="topk"):
    tasks = [asyncio.create_task(batcher.admit(t, policy)) for t in texts]
    await asyncio.sleep(0)
    return tasks


def test_full_window_flushes_and_admits_in_planned_order():
    async def main():
        b = make()
        order = []
        tasks = await admit_all(b, "abcd")
        for text, task in zip("abcd", tasks):
            task.add_done_callback(lambda t, text=text: order.append((text, t.result().batch_id)))
        await asyncio.gather(*tasks)
        return b, order

    b, order = asyncio.run(main())
    assert order == [("d", "b0"), ("c", "b0"), ("b", "b1"), ("a", "b1")]
    assert b.metrics.registry.get_sample_value("cohort_window_flushes_total", {"reason": "size"}) == 1


def test_lone_request_leaves_at_the_deadline():
    async def main():
        b = make(max_wait_s=0.01)
        admission = await b.admit("x", "topk")
        return b, admission

    b, admission = asyncio.run(main())
    assert admission.queue_s >= 0.01
    assert b.metrics.registry.get_sample_value("cohort_window_flushes_total", {"reason": "deadline"}) == 1


def test_policies_are_never_batched_together():
    async def main():
        b = make(flush_size=2)
        tasks = await admit_all(b, "ab", "topk") + await admit_all(b, "cd", "oea;k0=1")
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        return [t.result().batch_id for t in tasks]

    ids = asyncio.run(main())
    assert ids[0] == ids[1] and ids[2] == ids[3] and ids[0] != ids[2]


def test_in_flight_cap_holds_requests_until_release():
    async def main():
        b = make(plan_fn=arrival_batches, flush_size=5, max_in_flight=2)
        tasks = await admit_all(b, "abcde")
        await asyncio.gather(*tasks[:2])  # planned (in the planning thread), then the first two admitted
        first = (sample(b, "cohort_in_flight"), sample(b, "cohort_waiting"), [t.done() for t in tasks[2:]])
        b.release()
        await tasks[2]
        second = (sample(b, "cohort_in_flight"), sample(b, "cohort_waiting"), [t.done() for t in tasks[3:]])
        for _ in range(4):
            b.release()
        await asyncio.gather(*tasks)
        return first, second

    first, second = asyncio.run(main())
    assert first == (2, 3, [False, False, False])  # the cap holds c, d, e back
    assert second == (2, 2, [False, False])  # one release lets exactly one more in


def test_overdue_request_beats_the_plan():
    now = [0.0]

    async def main(release_at):
        b = make(flush_size=3, batch_size=1, max_in_flight=2, max_queue_s=5.0, clock=lambda: now[0])
        await b.admit_background()  # holds one of the two slots
        tasks = {}
        for t, text in enumerate("bcd"):  # b arrives at 0 s, c at 1 s, d at 2 s: one window, planned reversed
            now[0] = float(t)
            tasks[text] = asyncio.create_task(b.admit(text, "topk"))
            await asyncio.sleep(0)  # let it enter the window
        first = await tasks["d"]  # the plan's head takes the free slot once the planning thread is done
        now[0] = release_at
        b.release()  # d finishes: c is next in the plan, unless b is past max_queue_s
        done, _ = await asyncio.wait({tasks["b"], tasks["c"]}, timeout=5, return_when=asyncio.FIRST_COMPLETED)
        (winner,) = done
        return first, next(k for k, v in tasks.items() if v is winner), winner.result()

    first, winner, admission = asyncio.run(main(release_at=5.5))  # b has waited 5.5 s > 5, c 4.5 s
    assert first.batch_id == "b0" and winner == "b" and (admission.batch_id, admission.queue_s) == ("b2", 5.5)
    first, winner, admission = asyncio.run(main(release_at=4.0))  # nobody is overdue: the plan's order
    assert winner == "c" and (admission.batch_id, admission.queue_s) == ("b1", 3.0)


def test_cancelled_requests_free_their_place():
    async def main():
        b = make(plan_fn=arrival_batches, flush_size=1, max_in_flight=1)
        await b.admit("a", "topk")
        queued = asyncio.create_task(b.admit("b", "topk"))
        later = asyncio.create_task(b.admit("c", "topk"))
        await asyncio.sleep(0.01)
        queued.cancel()
        await asyncio.sleep(0.01)
        b.release()  # a finishes: c, not the cancelled b, gets the slot
        await asyncio.wait_for(later, 1)
        return b

    b = asyncio.run(main())
    assert b._in_flight == 1 and sample(b, "cohort_waiting") == 0


def test_cancel_in_the_window_removes_the_request():
    async def main():
        b = make(flush_size=3)
        t1, t2 = await admit_all(b, "ab")
        t1.cancel()
        await asyncio.sleep(0)
        t3 = (await admit_all(b, "c"))[0]
        t4 = (await admit_all(b, "d"))[0]
        admissions = await asyncio.gather(t2, t3, t4)
        return t1, [a.batch_id for a in admissions]

    cancelled, ids = asyncio.run(main())
    assert cancelled.cancelled() and ids == ["b1", "b0", "b0"]  # b, c, d planned (reversed) together; a is gone


def test_planner_failure_falls_back_to_arrival_order():
    def broken(texts, batch_size):
        raise RuntimeError("encoder crashed")

    async def main():
        b = make(plan_fn=broken)
        tasks = await admit_all(b, "abcd")
        return [a.batch_id for a in await asyncio.gather(*tasks)]

    assert asyncio.run(main()) == ["b0", "b0", "b1", "b1"]


def test_background_work_takes_only_slots_no_ready_request_wants():
    async def main():
        b = make(plan_fn=arrival_batches, flush_size=1, max_in_flight=2)
        order = []

        async def background(name):
            await b.admit_background()
            order.append(name)

        first = asyncio.create_task(background("bg1"))  # a free slot: granted at once
        online = [asyncio.create_task(b.admit(t, "topk")) for t in "ab"]
        second = asyncio.create_task(background("bg2"))
        await asyncio.sleep(0.01)
        granted = ([t.done() for t in online], first.done(), second.done(), sample(b, "cohort_in_flight"))
        b.release()  # bg1 finishes: the ready online request goes before the waiting background one
        await asyncio.sleep(0)
        after_release = ([t.done() for t in online], second.done())
        for _ in range(2):
            b.release()  # online a, then b
        await asyncio.wait_for(second, 1)
        await asyncio.wait_for(b.admit("c", "topk"), 1)  # both slots taken again: bg2 and c
        cancelled = asyncio.create_task(background("bg3"))
        await asyncio.sleep(0)
        cancelled.cancel()  # a cancelled waiter gives its place back and never holds a slot
        await asyncio.sleep(0)
        b.release()  # c finishes
        return order, granted, after_release, b._in_flight

    order, granted, after_release, in_flight = asyncio.run(main())
    assert granted == ([True, False], True, False, 2)
    assert after_release == ([True, True], False)
    assert order == ["bg1", "bg2"] and in_flight == 1  # bg2 still holds its slot

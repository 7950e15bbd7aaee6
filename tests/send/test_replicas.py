"""moe_cohort.send.replicas.ReplicaSet against throwaway local servers: capacity, affinity, health checks, no
replica left, and merged /v1/models (failover: tests/send/test_lifecycle.py)."""

import asyncio

import numpy as np
import pytest

from moe_cohort.send.backend_client import BackendClient
from moe_cohort.send.errors import BackendUnreachable
from moe_cohort.send.replicas import ReplicaSet, Slot
from tests.helpers.vllm_stub import local_backend, named, refused_url

A, B = np.array([1.0, 1.0, 0, 0]), np.array([0, 0, 1.0, 1.0])


def unused(n: int) -> list[BackendClient]:
    return [BackendClient(refused_url()) for _ in range(n)]


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_each_replica_holds_its_capacity_and_a_freed_slot_takes_the_next_waiter():
    async def main():
        replicas = ReplicaSet(unused(2), [1, 2], "least-loaded")
        held = [await replicas.acquire(Slot()) for _ in range(3)]
        assert sorted(lease.replica for lease in held) == [0, 1, 1]
        first, second = (asyncio.create_task(replicas.acquire(Slot())) for _ in range(2))
        await settle()
        assert not first.done() and not second.done()
        first.cancel()  # a waiter that leaves gives up its turn
        await settle()
        replicas.release(held[0])
        assert (await second).replica == held[0].replica

    asyncio.run(main())


def test_affinity_gives_a_freed_slot_to_the_waiting_request_that_fits_that_replica():
    async def main():
        replicas = ReplicaSet(unused(2), [2, 2], "affinity")
        on_a, on_b = await replicas.acquire(Slot(vector=A)), await replicas.acquire(Slot(vector=B))
        assert (on_a.replica, on_b.replica) == (0, 1)
        assert [(await replicas.acquire(Slot(vector=v))).replica for v in (A, B)] == [0, 1]  # slots free: nobody waits
        like_a = asyncio.create_task(replicas.acquire(Slot(vector=A * 0.9)))  # older
        like_b = asyncio.create_task(replicas.acquire(Slot(vector=B * 0.9)))
        await settle()
        replicas.release(on_b)
        assert (await like_b).replica == 1 and not like_a.done()  # the B-like one, though A-like waited longer
        replicas.release(on_a)
        assert (await like_a).replica == 0

    asyncio.run(main())


def test_health_checks_take_a_replica_out_and_back():
    seen: list = []
    health = {"down": True}

    async def main():
        async with local_backend(named("a", seen, health)) as a, local_backend(named("b", seen)) as b:
            replicas = ReplicaSet([BackendClient(a), BackendClient(b)], [4, 1], "least-loaded")
            try:
                assert await replicas.check() == [False, True]
                assert (await replicas.acquire(Slot())).replica == 1  # a has more free slots but is out
                health["down"] = False
                assert await replicas.check() == [True, True]
                assert (await replicas.acquire(Slot())).replica == 0
            finally:
                await replicas.close()

    asyncio.run(main())


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_probe_no_replica_answers_takes_none_out_and_the_last_one_is_never_failed_over_from(replicas):
    """A set of one and a set of two are served by the same rule: the probe never empties the set, and a request
    that failed on the last healthy replica has nowhere else to go (its own error, not a resend)."""
    async def main():
        unanswered = ReplicaSet(unused(replicas), [1] * replicas, "least-loaded", health_timeout_s=1.0)
        assert await unanswered.check() == [False] * replicas
        assert unanswered.router.healthy.all()
        if replicas == 2:
            unanswered.set_healthy(1, False)
        slot = await unanswered.acquire(Slot())
        never_sent = BackendUnreachable("refused")
        assert not await unanswered.failover(slot, never_sent) and unanswered.router.healthy[slot.replica]

    asyncio.run(main())


def test_with_no_replica_left_waiting_and_new_requests_fail_at_once():
    async def main():
        replicas = ReplicaSet(unused(1), [1], "affinity")
        await replicas.acquire(Slot(vector=A))
        waiter = asyncio.create_task(replicas.acquire(Slot(vector=B)))
        await settle()
        replicas.set_healthy(0, False)
        with pytest.raises(BackendUnreachable, match="no healthy backend replica"):
            await asyncio.wait_for(waiter, 30)  # a guard against hanging, not a timing
        with pytest.raises(BackendUnreachable, match="no healthy backend replica"):
            await asyncio.wait_for(replicas.acquire(Slot(vector=A)), 30)

    asyncio.run(main())


def test_models_merges_the_replicas_lists_by_id():
    seen: list = []

    async def main():
        async with local_backend(named("a", seen)) as a, local_backend(named("b", seen)) as b:
            replicas = ReplicaSet([BackendClient(a), BackendClient(b), BackendClient(refused_url())], [1, 1, 1])
            replicas.set_healthy(2, False)
            try:
                return await replicas.models()
            finally:
                await replicas.close()

    merged = asyncio.run(main())
    assert merged["object"] == "list"
    assert [(m["id"], m.get("owned_by")) for m in merged["data"]] == [("m-a", None), ("shared", "a"), ("m-b", None)]


def test_one_capacity_per_backend():
    with pytest.raises(ValueError, match="one capacity per backend"):
        ReplicaSet(unused(2), [1])

"""Batches share the background slots (issue 27 item 5): round-robin over tenants, then over a tenant's
batches (proxy/batch/share.py), checked on the share's own order, and end to end: two keys of two
tenants, the official openai client against the proxy under uvicorn, a throwaway local backend that
holds one request of the long batch for as long as the test wants."""

import asyncio
import json

import openai
import pytest

from moe_cohort.embedded.vllm_server import free_port
from moe_cohort.proxy.batch.share import FairShare
from moe_cohort.send.settings import Settings
from tests.helpers.proxy_thread import ProxyThread
from tests.helpers.vllm_stub import answer, body_of, local_backend

OK = {"id": "cmpl", "object": "chat.completion",
      "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
      "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_slots_go_round_robin_over_tenants_then_their_batches():
    async def main():
        share, granted = FairShare(1), []
        await share.seat("bob", "b1").acquire()  # the one slot is taken: everyone below waits

        async def wait(tenant, batch):
            await share.seat(tenant, batch).acquire()
            granted.append(f"{tenant}/{batch}")

        waiters = [asyncio.create_task(wait(*who)) for who in
                   [("bob", "b1"), ("bob", "b1"), ("bob", "b1"), ("bob", "b2"), ("alice", "a1")]]
        await settle()
        for _ in waiters:
            share.seat("any", "any").release()
            await settle()
        return granted, share.free, share.waiting

    granted, free, waiting = asyncio.run(main())
    # bob's first batch had waited first; then alice (the other tenant), then bob's second batch, then the rest
    assert granted == ["bob/b1", "alice/a1", "bob/b2", "bob/b1", "bob/b1"]
    assert (free, waiting) == (0, 0)


def test_a_waiter_that_leaves_is_forgotten_and_a_slot_granted_to_a_leaver_comes_back():
    async def main():
        share = FairShare(1)
        alice, bob = share.seat("alice", "a"), share.seat("bob", "b")
        await alice.acquire()
        leaving = asyncio.create_task(bob.acquire())
        staying = asyncio.create_task(share.seat("carol", "c").acquire())
        await settle()
        leaving.cancel()  # bob stops while he waits
        await settle()
        alice.release()
        await settle()
        carol_got_it = staying.done()
        late = asyncio.create_task(bob.acquire())
        await settle()
        share.seat("carol", "c").release()  # granted to bob's new waiter...
        late.cancel()  # ...who leaves before he runs: the slot is given back
        await settle()
        return carol_got_it, share.free, share.waiting

    carol_got_it, free, waiting = asyncio.run(main())
    assert carol_got_it and (free, waiting) == (1, 0)


def request_line(cid, content):
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 1}})


def test_a_small_batch_of_one_tenant_finishes_while_another_tenants_long_batch_runs(tmp_path):
    """Bob's 200-line batch starts first; its first request is held at the backend until the test lets it go,
    so bob cannot finish. Alice's 1-line batch, created after, must complete meanwhile, and the two batches
    together never have more than batch_max_in_flight (2) requests at the backend."""
    bob_lines = 200
    held, release, bob_rest_sent = asyncio.Event(), asyncio.Event(), asyncio.Event()
    at_backend, most, seen = [0], [0], []

    async def backend(request):
        if request.method != "POST":  # the proxy's health probes
            return answer({})
        content = (await body_of(request))["messages"][0]["content"]
        seen.append(content)
        at_backend[0] += 1
        most[0] = max(most[0], at_backend[0])
        try:
            if content == "bob 0":
                held.set()
                await release.wait()
            elif sum(s.startswith("bob") for s in seen) == bob_lines:
                bob_rest_sent.set()  # every bob line but the held one was sent: alice can no longer come first
            return answer(OK)
        finally:
            at_backend[0] -= 1

    async def poll(client, batch_id, statuses):
        while (batch := await client.batches.retrieve(batch_id)).status not in statuses:
            await asyncio.sleep(0.02)
        return batch

    async def submit(client, lines):
        upload = await client.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
        return await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                           completion_window="24h")

    async def main():
        async with local_backend(backend) as url:
            settings = Settings(backends=(url,), port=free_port(), encoder="none", data_dir=str(tmp_path),
                                batch_max_in_flight=2, api_keys=("sk-alice=alice", "sk-bob=bob"))
            with ProxyThread(settings) as proxy:
                alice, bob = (openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0)
                              for key in ("sk-alice", "sk-bob"))
                long = await submit(bob, [request_line(f"b{i}", f"bob {i}") for i in range(bob_lines)])
                await held.wait()  # bob's batch runs; its first request holds one of the two slots
                small = await submit(alice, [request_line("a0", "alice 0")])
                alice_done = asyncio.create_task(poll(alice, small.id, ("completed", "failed")))
                await asyncio.wait({alice_done, asyncio.create_task(bob_rest_sent.wait())},
                                   return_when=asyncio.FIRST_COMPLETED)
                first = alice_done.done()
                bob_then = await bob.batches.retrieve(long.id)
                release.set()
                small_end, long_end = await alice_done, await poll(bob, long.id, ("completed", "failed"))
                return first, bob_then, small_end, long_end

    first, bob_then, small_end, long_end = asyncio.run(main())
    assert first, "alice's 1-line batch waited for bob's whole batch"
    assert bob_then.status == "in_progress" and bob_then.request_counts.completed < bob_lines
    assert small_end.status == "completed" and small_end.request_counts.completed == 1
    assert long_end.status == "completed" and long_end.request_counts.completed == bob_lines
    assert most[0] <= 2  # the batches share batch_max_in_flight slots; they do not get that many each
    assert seen.count("alice 0") == 1 and len(seen) == bob_lines + 1  # each request sent once

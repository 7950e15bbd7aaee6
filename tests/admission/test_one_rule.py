"""One admission rule: the replay (eval.replay, the reference policy) and the proxy (AdmissionGate over a
ReplicaSet) admit the same requests in the same order, given the same arrivals, slots and finishing times.

The proxy runs for real (its Profiler thread, its asyncio waiters, its router) on an injected clock that
counts replay steps. Within a step the replay lets the step's departures leave and its arrival join before
it fills the free slots; the proxy admits at each release, so the run feeds it the step's arrival first,
then the departure. The fixture has at most one arrival and one departure per step, where the
two timelines coincide (simultaneous events are a quantisation of the replay only).
"""

import asyncio

import numpy as np
import pytest

from moe_cohort.admission.wire import Prediction
from moe_cohort.eval.policies import by_profile
from moe_cohort.eval.replay import decode_profiles, decode_tokens
from moe_cohort.send.gate import AdmissionGate, Profiler
from moe_cohort.send.metrics import Metrics
from moe_cohort.send.replicas import ReplicaSet
from tests.conftest import random_traces
from tests.helpers.idle_clients import idle_clients

N, MAX_WAIT = 24, 15  # requests; the fairness bound in steps (seconds on the proxy's clock)


def _replayed(seed, slots, kind):
    """Admission by profiles [N, L*E] replayed on distinct arrival steps [N], with output lengths [N] drawn
    until no two requests leave at one step: (profiles, times, lengths, replay). `kind`: "reference", the
    traces' own profiles (each sums to top_k per layer), or "predicted", those with noise, as a profile
    head's are (their sums differ: what an empty resident set would rank by if the replay had its own rule)."""
    ts = random_traces(N, num_experts=8, num_layers=2, max_prompt=8, seed=seed)
    tokens = decode_tokens(ts, "proxy")
    profiles = decode_profiles(tokens, ts).reshape(N, -1)  # [N, L*E]
    rng = np.random.default_rng(seed)
    if kind == "predicted":
        profiles = np.clip(profiles + rng.normal(0, 0.15, profiles.shape), 0, 1).astype(np.float32)
    span = max(N, N * 6 // slots)  # about one request per slot per mean length (6 steps): a queue comes and goes
    times = np.sort(rng.choice(np.arange(span), N, replace=False))  # [N] one arrival per step at most
    for _ in range(1000):
        lengths = rng.integers(1, 12, size=N)  # [N]
        replay = by_profile(profiles).run(tokens, lengths, slots, max_wait=MAX_WAIT, times=times)
        if len(set((replay.start + lengths).tolist())) == N:
            return profiles, times, lengths, replay
    raise AssertionError("no lengths without simultaneous departures")


async def _proxy_order(profiles, times, lengths, slots):
    """Admission order of the proxy's gate, driven step by step: the step's arrival, then its departure."""
    now = [0.0]
    replicas = ReplicaSet(idle_clients(1), [slots], "affinity", max_queue_s=MAX_WAIT, clock=lambda: now[0])
    gate = AdmissionGate(Profiler(lambda texts: [Prediction(profiles[int(t)]) for t in texts]), Metrics(), replicas)
    tasks, admitted, finish = {}, {}, {}  # request -> its admit() task, its Admission, its finishing step
    step = 0
    while len(finish) < N or any(f >= step for f in finish.values()):
        now[0] = float(step)
        for i in np.flatnonzero(times == step):
            tasks[int(i)] = asyncio.ensure_future(gate.admit(str(i)))
            await _settled(tasks, admitted, replicas)
        for i, f in finish.items():
            if f == step:
                gate.release(admitted[i])
                await _settled(tasks, admitted, replicas)
        for i, a in admitted.items():
            finish.setdefault(i, round(a.arrived + a.queue_s) + int(lengths[i]))
        step += 1
    gate.close()
    return [i for i, _ in sorted(admitted.items(), key=lambda kv: int(kv[1].id[1:]))], finish


async def _settled(tasks, admitted, replicas):
    """Let the loop run until every request is either admitted or waiting in the router (none predicting)."""
    for _ in range(2000):
        for i, task in tasks.items():
            if task.done() and i not in admitted:
                admitted[i] = task.result()
        if len(admitted) + replicas.router.waiting() == len(tasks):
            for _ in range(3):
                await asyncio.sleep(0)
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the gate never settled")


@pytest.mark.parametrize("slots", [1, 2, 3])  # 1: every choice is made with nobody resident
@pytest.mark.parametrize("seed", [0, 2])  # each with queues, choices by fit and overdue requests
@pytest.mark.parametrize("kind", ["reference", "predicted"])
def test_the_replay_and_the_proxy_admit_the_same_requests_in_the_same_order(slots, seed, kind):
    profiles, times, lengths, replay = _replayed(seed, slots, kind)
    order, finish = asyncio.run(_proxy_order(profiles, times, lengths, slots))
    assert order == replay.order.tolist()
    assert [finish[i] for i in range(N)] == (replay.start + lengths).tolist()

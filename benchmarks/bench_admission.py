"""What admission costs per admitted request: the vLLM queue (engine side) and the proxy's gate.

    python -m benchmarks.bench_admission [--pool 1000] [--resident 32] [--layers 26] [--experts 64]

Profiles are random predicted profiles of DeepSeek-V2-Lite's shape (26 MoE layers x 64 experts,
top-6), sent in admission.wire's compact form. Prints, for a pool of --pool waiting requests and
--resident running ones:

- engine side: `engine.expert_queue.ExpertAwareQueue`, one peek + pop (what vLLM's scheduler
  calls per admitted request), the running set read anew each time;
- proxy side: `send.gate.AdmissionGate`, one release + the admission it triggers;
- batch side: `batch.order.ExpertOrder`, one finished + pick + sent (what `cohort batch run` does per
  line when a slot frees), with --pool lines waiting and --resident out;
- the decode step time each cost keeps up with: a 16-slot engine whose requests generate --tokens tokens frees
  16 / tokens slots per step on average, so one choice per slot freed must fit in tokens / 16 steps.
Target (issue 13): < 1 ms per request for a pool of 1,000 on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from types import SimpleNamespace

import numpy as np
from threadpoolctl import threadpool_limits

from moe_cohort.admission.resident import ResidentExperts
from moe_cohort.admission.wire import Prediction, compact, expand
from moe_cohort.batch.format import BatchRequest
from moe_cohort.batch.order import ExpertOrder
from moe_cohort.engine.expert_queue import ExpertAwareQueue
from moe_cohort.send.gate import AdmissionGate, Profiler
from moe_cohort.send.metrics import Metrics
from moe_cohort.send.replicas import ReplicaSet


def profiles(n: int, layers: int, experts: int, top_k: int, rng) -> list[np.ndarray]:
    """n profiles [L, E]: each layer's frequencies concentrated on a few experts (rows sum to top_k)."""
    out = []
    for _ in range(n):
        u = rng.dirichlet(np.full(experts, 0.1), size=layers) * top_k  # [L, E]
        out.append(np.clip(u, 0, 1))
    return out


def engine_side(pool: int, resident: int, layers: int, experts: int, rng) -> float:
    """Microseconds per peek + pop of ExpertAwareQueue."""
    def request(i, u):
        return SimpleNamespace(request_id=f"r{i}", arrival_time=time.time(),
                               sampling_params=SimpleNamespace(extra_args={"moe_profile": compact(u)}))
    running = [request(-i - 1, u) for i, u in enumerate(profiles(resident, layers, experts, 6, rng))]
    queue = ExpertAwareQueue(lambda: running, experts)
    for i, u in enumerate(profiles(pool + 200, layers, experts, 6, rng)):
        queue.add_request(request(i, u))
    start = time.perf_counter()
    for _ in range(200):
        queue.peek_request()
        admitted = queue.pop_request()
        running[0] = admitted  # a running request finished, the admitted one took its slot
    return (time.perf_counter() - start) / 200 * 1e6


def proxy_side(pool: int, resident: int, layers: int, experts: int, rng) -> float:
    """Microseconds per release + the admission it triggers, in AdmissionGate."""
    vectors = [u.ravel() for u in profiles(pool + resident + 200, layers, experts, 6, rng)]

    async def main() -> float:
        replicas = ReplicaSet([None], [resident], "affinity", max_queue_s=1e9)
        gate = AdmissionGate(Profiler(lambda texts: [Prediction(vectors[int(t)]) for t in texts]), Metrics(), replicas)
        held = [await gate.admit(str(i)) for i in range(resident)]
        waiting = [asyncio.ensure_future(gate.admit(str(resident + i))) for i in range(pool + 200)]
        while replicas.router.waiting() < pool + 200:
            await asyncio.sleep(0.01)
        seconds = 0.0
        for i in range(200):
            start = time.perf_counter()
            gate.release(held.pop(0))  # frees a slot: the gate admits from the pool at once
            seconds += time.perf_counter() - start
            await asyncio.sleep(0)  # the admitted request's task takes its admission
            held += [w.result() for w in waiting if w.done() and w.result() not in held]
            waiting = [w for w in waiting if not w.done()]
        for w in waiting:
            w.cancel()
        return seconds / 200 * 1e6
    return asyncio.run(main())


def batch_side(pool: int, resident: int, layers: int, experts: int, rng) -> float:
    """Microseconds per finished + pick + sent of ExpertOrder (the batch runner's choice of its next line)."""
    n = pool + resident + 200
    vectors = {i: u.ravel() for i, u in enumerate(profiles(n, layers, experts, 6, rng))}
    requests = [BatchRequest(i, f"c{i}", "/v1/chat/completions", {}, "none", "") for i in range(n)]
    order = ExpertOrder(resident, lambda size: ResidentExperts(1, size), vectors=dict(vectors))
    waiting, out = list(requests), []
    for _ in range(resident):  # the engine filled, as at the start of a run
        request = waiting.pop(order.pick(waiting))
        order.sent(request)
        out.append(request)
    start = time.perf_counter()
    for _ in range(200):
        order.finished(out.pop(0))
        request = waiting.pop(order.pick(waiting))
        order.sent(request)
        out.append(request)
    return (time.perf_counter() - start) / 200 * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pool", type=int, default=1000)
    p.add_argument("--resident", type=int, default=32)
    p.add_argument("--layers", type=int, default=26)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64, help="mean tokens generated per request")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    assert np.allclose(expand(compact(np.eye(3, 8)), 3, 8), np.eye(3, 8))
    with threadpool_limits(limits=1, user_api="blas"):
        engine = engine_side(args.pool, args.resident, args.layers, args.experts, rng)
        proxy = proxy_side(args.pool, args.resident, args.layers, args.experts, rng)
        batch = batch_side(args.pool, args.resident, args.layers, args.experts, rng)
    shape = f"{args.layers} x {args.experts} profiles, {args.pool} waiting, {args.resident} running, 1 BLAS thread"
    print(f"admission cost per request ({shape}):")
    print(f"  engine side, ExpertAwareQueue peek + pop: {engine:8.0f} us")
    print(f"  proxy side, AdmissionGate release -> admit: {proxy:8.0f} us")
    print(f"  batch side, ExpertOrder finished + pick + sent: {batch:8.0f} us")
    steps = args.tokens / 16  # decode steps of a 16-slot engine per slot freed
    for name, us in (("engine", engine), ("proxy", proxy), ("batch", batch)):
        print(f"  {name} side keeps a 16-slot engine fed at decode steps of >= {us / steps / 1000:.3f} ms "
              f"({args.tokens} tokens per request: one choice every {steps:.0f} steps)")


if __name__ == "__main__":
    main()

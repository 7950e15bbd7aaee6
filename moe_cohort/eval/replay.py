"""Replay of continuous-batching engines (vLLM's execution model) over expert traces, admitted by the router.

R replicas of S slots each (one engine: R = 1); every resident request emits one token per step; a
request leaves after its output length and the freed slot is filled at once by
`admission.router.ReplicaRouter`, the one admission rule the proxy serves with (send/replicas.py)
and the batch runner orders by (batch/order.py): fairness bound first, FCFS for requests
without a vector, the oldest when nobody is resident, else the fewest expected new experts (or the
nearest embedding), ties to the earliest arrival. A step of replica r loads, per MoE layer, the
distinct experts of r's residents' current tokens; its loads are those counts summed over layers
(Doubleword's expert loads, per decode forward). `Replay.loads_per_token_full` counts only the spans in
which the replica had every slot busy: a server under steady load, without the drain that ends a finite
replay (its last requests running beside free slots, with nothing left to choose).

Time is in steps: requests that arrive at the same step join the router together (in `order`) before
it fills the free slots; requests that finish at the same step all leave before it does. With
`clients` C (closed-loop clients, as a load generator or a user population runs them) requests join
in `order`: C at step 0, then one more for each request that finishes, at the step it finishes, so at
most C - S wait; what an engine kept full by C clients sees, where "all arrive at step 0" lets the
router choose from every request at once.

Decode tokens: traces with generated tokens use them (a request runs for as many steps as it
generated); prompt-only traces use the decode proxy of traces.loads: a request's step t takes
its prompt token 1 + (t mod (n - 1)) (token 0 is BOS), for as many steps as its output length.

Vectorised by spans: between two events (an admission, a departure, an arrival) the resident sets
are fixed, so the loads of all the span's steps come from one gather [R, span, L, W] and one OR
over R. A replay costs about one span per request.

The load bound is checked here, independently of the router: a span in which some replica has a free
slot while an arrived request still waits counts its steps as violations; a routing with one shared
pool (least-loaded, affinity) must have none, and the replay raises RuntimeError if it does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_cohort.admission.router import ReplicaRouter
from moe_cohort.traces.format import TraceSet
from moe_cohort.traces.loads import popcount_sum, token_masks


@dataclass(frozen=True)
class DecodeTokens:
    """Where every request's decode steps read their expert masks: row base + (t mod cycle) of `masks`."""

    masks: np.ndarray  # [T + 1, L, W] uint64 token masks; row T is "no token" (all zero)
    base: np.ndarray  # [N] int64 row of decode step 0
    cycle: np.ndarray  # [N] int64 >= 1
    mode: str  # "real" or "proxy"

    def __len__(self) -> int:
        return len(self.base)

    def rows(self, requests: np.ndarray, start: np.ndarray, steps: int) -> np.ndarray:  # [R, steps]
        """Mask rows of `steps` consecutive decode steps of `requests` [R] from their local steps `start` [R]."""
        t = start[:, None] + np.arange(steps)[None, :]  # [R, steps]
        return self.base[requests, None] + t % self.cycle[requests, None]


def decode_tokens(ts: TraceSet, decode: str = "auto") -> DecodeTokens:
    """The decode tokens of every request: generated ones ("real") or the prompt proxy ("proxy")."""
    mode = ("real" if ts.num_decode_tokens.any() else "proxy") if decode == "auto" else decode
    tok = token_masks(ts.experts, ts.num_experts)  # [T, L, W]
    tok = np.concatenate([tok, np.zeros((1,) + tok.shape[1:], np.uint64)])  # [T + 1, L, W]
    starts, empty = ts.token_offsets[:-1], len(ts.experts)
    if mode == "real":
        base, cycle = starts + ts.num_prompt_tokens, ts.num_decode_tokens
    elif mode == "proxy":
        base, cycle = starts + 1, ts.num_prompt_tokens - 1
    else:
        raise ValueError(f"decode must be 'auto', 'real' or 'proxy', got {decode!r}")
    base = np.where(cycle >= 1, base, empty).astype(np.int64)  # no decode token: the zero row
    return DecodeTokens(masks=tok, base=base, cycle=np.maximum(cycle, 1).astype(np.int64), mode=mode)


def decode_profiles(tokens: DecodeTokens, ts: TraceSet) -> np.ndarray:  # [N, L, E] float32
    """u[r, l, e]: the fraction of request r's decode-cycle tokens that pick expert e at layer l."""
    n, cyc = len(tokens), tokens.cycle
    rows = np.repeat(tokens.base, cyc) + np.arange(cyc.sum()) - np.repeat(np.cumsum(cyc) - cyc, cyc)  # [T']
    req = np.repeat(np.arange(n), cyc)  # [T']
    valid = rows < len(ts.experts)  # a request without decode tokens reads the zero row
    ids = np.sort(ts.experts[rows[valid]].astype(np.int64), axis=-1)  # [T', L, k]
    first = np.ones(ids.shape, dtype=bool)  # [T', L, k] a token listing an id twice picks it once
    first[..., 1:] = ids[..., 1:] != ids[..., :-1]
    layers, experts = ts.num_layers, ts.num_experts
    cell = (req[valid, None, None] * layers + np.arange(layers)[None, :, None]) * experts + ids  # [T', L, k]
    counts = np.bincount(cell[first], minlength=n * layers * experts).reshape(n, layers, experts)
    return (counts / cyc[:, None, None]).astype(np.float32)


BOUNDED = ("least-loaded", "affinity")  # routings that share one pool: no replica idles while another queues


@dataclass(frozen=True)
class Replay:
    """What a replay measured, per replica and span of steps with fixed resident sets, and per request."""

    steps: np.ndarray  # [K] steps in each span
    resident: np.ndarray  # [K] resident requests (tokens per step) in each span
    loads: np.ndarray  # [K] loads summed over the span's steps and the layers
    full: np.ndarray  # [K] bool: the span's replica had every slot busy (not the drain after the last request)
    start: np.ndarray  # [N] step at which each request was admitted
    order: np.ndarray  # [N] requests in admission order
    replica: np.ndarray  # [N] the replica that served each request
    violations: int  # steps in which some replica had a free slot while a request waited
    makespan: int  # steps until the last request finished

    @property
    def tokens(self) -> int:
        return int((self.steps * self.resident).sum())

    @property
    def loads_per_token(self) -> float:
        return float(self.loads.sum()) / max(self.tokens, 1)

    @property
    def loads_per_token_full(self) -> float:
        """Loads per token over the spans with the engine kept full: a server under steady load never drains,
        while a finite replay ends with its last requests running alone, fewer tokens sharing each load."""
        f = self.full
        return float(self.loads[f].sum()) / max(int((self.steps[f] * self.resident[f]).sum()), 1)


def replay(tokens: DecodeTokens, lengths: np.ndarray, router: ReplicaRouter, *, vectors: np.ndarray | None = None,
           order: np.ndarray | None = None, arrivals: np.ndarray | None = None, clients: int | None = None) -> Replay:
    """Run every request through the router's replicas; `lengths` [N] >= 1 output tokens, `vectors` [N, F]
    what the router fits requests by (None: none, FCFS), `order` [N] the order in which requests arriving
    at the same step join (default: index order), `arrivals` [N] steps (default: all at 0), `clients`
    closed-loop clients (default: none, every request arrives at its step; not with `arrivals`)."""
    n = len(lengths)
    if clients is not None and (clients < 1 or arrivals is not None):
        raise ValueError(f"clients must be >= 1 and come without arrivals, got {clients} and "
                         f"{'arrivals' if arrivals is not None else 'none'}")
    released = n if clients is None else min(clients, n)  # requests the clients have sent so far
    arrivals = np.zeros(n, np.int64) if arrivals is None else np.asarray(arrivals, np.int64)
    order = np.arange(n) if order is None else np.asarray(order, np.int64)
    pending = order[np.argsort(arrivals[order], kind="stable")]  # [N] by arrival, ties in `order`
    slot_rep = np.repeat(np.arange(router.replicas), router.capacity)  # [S_total] replica of each slot
    slot_req, slot_t = np.full(len(slot_rep), -1, np.int64), np.zeros(len(slot_rep), np.int64)
    start, served, admitted = np.full(n, -1, np.int64), np.full(n, -1, np.int64), []
    spans: list[tuple[int, int, int]] = []
    now = head = finished = violations = 0
    while finished < n:
        while head < released and arrivals[pending[head]] <= now:
            r = int(pending[head])
            router.add(r, None if vectors is None else vectors[r], int(arrivals[r]))  # joins late in a full span
            head += 1
        for key, rep in router.admit(now):
            slot = int(np.flatnonzero((slot_rep == rep) & (slot_req < 0))[0])
            slot_req[slot], slot_t[slot], start[key], served[key] = key, 0, now, rep
            admitted.append(key)
        busy = slot_req >= 0  # [S_total]
        if not busy.any():
            now = int(arrivals[pending[head]])
            continue
        rows = np.flatnonzero(busy)
        span = int((lengths[slot_req[rows]] - slot_t[rows]).min())
        if head < released and not busy.all():
            span = min(span, max(int(arrivals[pending[head]]) - now, 1))
        if not busy.all() and head > len(admitted):  # a free slot while an arrived request waits
            violations += span
        for rep in range(router.replicas):
            mine = rows[slot_rep[rows] == rep]
            if len(mine):
                spans.append((span, len(mine), span_loads(tokens, slot_req[mine], slot_t[mine], span),
                              len(mine) == router.capacity[rep]))
        now += span
        slot_t[rows] += span
        for slot in rows[slot_t[rows] >= lengths[slot_req[rows]]]:
            router.release(int(slot_req[slot]))
            slot_req[slot] = -1
            finished += 1
            released = min(released + (clients is not None), n)  # its client sends the next request
    if violations and router.routing in BOUNDED:
        raise RuntimeError(f"{router.routing}: a replica had a free slot while requests waited for {violations} steps")
    k = np.array(spans, dtype=np.int64).reshape(-1, 4)
    return Replay(steps=k[:, 0], resident=k[:, 1], loads=k[:, 2], full=k[:, 3].astype(bool), start=start,
                  order=np.array(admitted, np.int64), replica=served, violations=violations, makespan=now)


def span_loads(tokens: DecodeTokens, requests: np.ndarray, start: np.ndarray, steps: int) -> int:
    """Distinct experts per layer of the requests' tokens, summed over layers and the span's steps."""
    union = np.bitwise_or.reduce(tokens.masks[tokens.rows(requests, start, steps)], axis=0)  # [steps, L, W]
    return int(popcount_sum(union))

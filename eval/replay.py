"""Replay of a continuous-batching engine (vLLM's execution model) over expert traces.

S slots; every resident request emits one token per step; a request leaves after its output
length and the admission policy fills the freed slot at once from the waiting pool. A step
loads, per MoE layer, the distinct experts of the resident requests' current tokens; its
loads are those counts summed over layers (Doubleword's expert loads, per decode forward).

Decode tokens: traces with generated tokens use them (a request runs for as many steps as it
generated); prompt-only traces use the decode proxy of traces.loads: a request's step t takes
its prompt token 1 + (t mod (n - 1)) (token 0 is BOS), for as many steps as its output length.

Vectorised by spans: between two departures the resident set is fixed, so the loads of all the
span's steps come from one gather [R, span, L, W] and one OR over R. A replay of 1,499 requests
costs about one span per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from moe_cohort.admission.resident import oldest_overdue
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


class Policy(Protocol):
    """An admission policy as the replay drives it: choose among waiting requests, track residents."""

    def choose(self, waiting: np.ndarray) -> int:  # waiting: [N] bool -> a request index with waiting[i]
        ...

    def admit(self, request: int) -> None:
        ...

    def release(self, request: int) -> None:
        ...


@dataclass(frozen=True)
class Replay:
    """What a replay measured, per span of steps with a fixed resident set, and per request."""

    steps: np.ndarray  # [K] steps in each span
    resident: np.ndarray  # [K] resident requests (tokens per step) in each span
    loads: np.ndarray  # [K] loads summed over the span's steps and the layers
    start: np.ndarray  # [N] step at which each request was admitted
    order: np.ndarray  # [N] requests in admission order

    @property
    def tokens(self) -> int:
        return int((self.steps * self.resident).sum())

    @property
    def loads_per_token(self) -> float:
        return float(self.loads.sum()) / max(self.tokens, 1)


def replay(tokens: DecodeTokens, lengths: np.ndarray, slots: int, policy: Policy, *,
           arrivals: np.ndarray | None = None, max_wait: float | None = None) -> Replay:
    """Run every request through `slots` slots; `lengths` [N] >= 1 output tokens; `arrivals` [N] steps.

    A waiting request that has waited >= `max_wait` steps is admitted before the policy's choice
    (oldest first): the fairness bound."""
    n = len(lengths)
    arrivals = np.zeros(n, np.int64) if arrivals is None else np.asarray(arrivals, np.int64)
    state = _State(n, slots)
    pending = np.argsort(arrivals, kind="stable")  # [N] not yet arrived, by arrival
    spans: list[tuple[int, int, int]] = []
    head = 0
    while state.finished < n:
        head = state.arrive(pending, arrivals, head)
        state.fill(policy, arrivals, max_wait)
        rows = np.flatnonzero(state.slot_req >= 0)  # [R] busy slots
        if len(rows) == 0:
            state.now = int(arrivals[pending[head]])
            continue
        span = int((lengths[state.slot_req[rows]] - state.slot_t[rows]).min())
        if head < n and state.waiting.sum() == 0 and len(rows) < slots:
            span = min(span, max(int(arrivals[pending[head]]) - state.now, 1))
        spans.append((span, len(rows), span_loads(tokens, state.slot_req[rows], state.slot_t[rows], span)))
        state.advance(rows, span, lengths, policy)
    k = np.array(spans, dtype=np.int64).reshape(-1, 3)
    return Replay(steps=k[:, 0], resident=k[:, 1], loads=k[:, 2], start=state.start, order=np.array(state.order, np.int64))


def span_loads(tokens: DecodeTokens, requests: np.ndarray, start: np.ndarray, steps: int) -> int:
    """Distinct experts per layer of the requests' tokens, summed over layers and the span's steps."""
    union = np.bitwise_or.reduce(tokens.masks[tokens.rows(requests, start, steps)], axis=0)  # [steps, L, W]
    return int(popcount_sum(union))


class _State:
    """Slots, the waiting pool and the clock of one replay."""

    def __init__(self, n: int, slots: int):
        self.slot_req = np.full(slots, -1, np.int64)  # [S] request in each slot, -1 when free
        self.slot_t = np.zeros(slots, np.int64)  # [S] decode steps the slot's request has run
        self.waiting = np.zeros(n, bool)  # [N]
        self.start = np.full(n, -1, np.int64)  # [N]
        self.order: list[int] = []
        self.now, self.finished = 0, 0

    def arrive(self, pending: np.ndarray, arrivals: np.ndarray, head: int) -> int:
        while head < len(pending) and arrivals[pending[head]] <= self.now:
            self.waiting[pending[head]] = True
            head += 1
        return head

    def fill(self, policy: Policy, arrivals: np.ndarray, max_wait: float | None) -> None:
        for slot in np.flatnonzero(self.slot_req < 0):
            if not self.waiting.any():
                return
            waited = np.where(self.waiting, self.now - arrivals, np.nan)  # [N]
            late = oldest_overdue(waited, max_wait)
            r = late if late is not None else policy.choose(self.waiting)
            self.waiting[r] = False
            self.slot_req[slot], self.slot_t[slot], self.start[r] = r, 0, self.now
            self.order.append(int(r))
            policy.admit(int(r))

    def advance(self, rows: np.ndarray, span: int, lengths: np.ndarray, policy: Policy) -> None:
        self.now += span
        self.slot_t[rows] += span
        for slot in rows[self.slot_t[rows] >= lengths[self.slot_req[rows]]]:
            policy.release(int(self.slot_req[slot]))
            self.slot_req[slot] = -1
            self.finished += 1

"""The plugin's side of online learning: per observed request, how many tokens picked each expert.

A request the proxy marks (`vllm_xargs.moe_observe`: a token) has its experts counted in the engine, per
MoE layer, over its prompt tokens and, kept apart, over its generated tokens, after its routing policy
(what the engine loaded). Counts only: never token ids or text. When the request finishes, its counts
wait under its token (at most `keep` of them, the oldest dropped first) until the proxy takes them
(engine.observed_endpoint: `POST /v1/cohort/observed` on the vLLM server, which reaches this
through vLLM's collective_rpc). Rows are counted by sequence position: a request preempted and
recomputed is not counted twice.

Pure numpy; `engine.routing_hook` feeds it once per forward.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from moe_cohort.traces.observed import Observed

log = logging.getLogger(__name__)

KEEP = 10_000  # finished requests' counts waiting to be taken


@dataclass
class _Live:
    token: str
    counts: np.ndarray  # [2, L, E] int64: prompt, generated
    tokens: list[int] = field(default_factory=lambda: [0, 0])  # prompt, generated rows counted
    until: int = 0  # positions below this are counted


class ExpertCounts:
    def __init__(self, num_layers: int, num_experts: int, keep: int = KEEP) -> None:
        self.num_layers, self.num_experts, self.keep = num_layers, num_experts, keep
        self._live: dict[str, _Live] = {}
        self._done: OrderedDict[str, Observed] = OrderedDict()

    def add(self, req_id: str, token: str, position: int, num_prompt: int, ids: np.ndarray) -> None:
        """ids [n, L, k]: the experts of the request's tokens at positions [position, position + n)."""
        self.add_step([(req_id, token, position, num_prompt, 0, len(ids))], ids)

    def add_step(self, spans: Sequence[tuple[str, str, int, int, int, int]], ids: np.ndarray) -> None:
        """One forward's observed requests at once: each span (req_id, token, position, num_prompt, start, end) says
        that rows [start, end) of ids [n, L, k] are that request's tokens at positions [position, ...). One
        bincount for the whole step, whatever the number of requests."""
        slot = np.full(len(ids), -1, np.int64)  # [n]: 2 x span + (0 prompt, 1 generated); -1 not counted
        lives: list[_Live | None] = []
        for i, (req_id, token, position, num_prompt, start, end) in enumerate(spans):
            live = self._live.get(req_id)
            if live is None:
                live = self._live[req_id] = _Live(token, np.zeros((2, self.num_layers, self.num_experts), np.int64))
            skip = max(0, live.until - position)  # recomputed after a preemption: counted already
            if skip >= end - start:
                lives.append(None)
                continue
            first, position = start + skip, position + skip
            split = first + min(max(num_prompt - position, 0), end - first)  # rows [first, split) are prompt tokens
            slot[first:split], slot[split:end] = 2 * i, 2 * i + 1
            live.tokens[0] += split - first
            live.tokens[1] += end - split
            live.until = position + end - first
            lives.append(live)
        counted = slot >= 0
        if not counted.any():
            return
        layers, experts = self.num_layers, self.num_experts
        cell = (slot[counted, None, None] * layers + np.arange(layers)[None, :, None]) * experts + ids[counted]  # [m, L, k]
        counts = np.bincount(cell.ravel(), minlength=2 * len(spans) * layers * experts)
        counts = counts.reshape(len(spans), 2, layers, experts)
        for live, c in zip(lives, counts):
            if live is not None:
                live.counts += c

    def finish(self, req_id: str) -> None:
        """The request left the engine: its counts wait under its token."""
        live = self._live.pop(req_id, None)
        if live is None:
            return
        self._done.pop(live.token, None)
        self._done[live.token] = Observed(live.counts[0], live.counts[1], *live.tokens)
        while len(self._done) > self.keep:
            dropped, _ = self._done.popitem(last=False)
            log.debug("dropping the expert counts of %s: nobody took them", dropped)

    def take(self, tokens: Iterable[str]) -> dict[str, dict]:
        """The finished counts of `tokens` (`Observed.to_wire` form), removed; unknown tokens are left out."""
        return {t: self._done.pop(t).to_wire() for t in tokens if t in self._done}

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
from typing import Iterable, Sequence

import numpy as np

from moe_cohort.traces.observed import Observed

log = logging.getLogger(__name__)

KEEP = 10_000  # finished requests' counts waiting to be taken


class ExpertCounts:
    """Live requests' counts in one table [R, 2, L, E] (a row per request, reused once it finishes), so that a
    forward's observed rows are counted with one scatter-add whatever the number of requests."""

    def __init__(self, num_layers: int, num_experts: int, keep: int = KEEP) -> None:
        self.num_layers, self.num_experts, self.keep = num_layers, num_experts, keep
        self._row_of: dict[str, int] = {}  # live request -> its row
        self._token: list[str] = []  # [R]: the token a row's counts are handed over under
        self._free: list[int] = []  # rows of finished requests, zeroed
        self._table = np.zeros((0, 2, num_layers, num_experts), np.int64)  # [R, 2, L, E]: prompt, generated
        self._tokens = np.zeros((0, 2), np.int64)  # [R, 2]: prompt, generated rows counted
        self._until = np.zeros(0, np.int64)  # [R]: positions below this are counted
        self._done: OrderedDict[str, Observed] = OrderedDict()

    def add_step(self, spans: Sequence[tuple[str, str, int, int, int, int]], ids: np.ndarray) -> None:
        """One forward's observed requests at once: each span (req_id, token, position, num_prompt, start, end) says
        that rows [start, end) of ids [n, L, k] are that request's tokens at positions [position, ...); a request
        has at most one span per forward."""
        if not spans:
            return
        req_ids, tokens, *fields = zip(*spans)
        known = self._row_of
        rows = np.array([known[r] if r in known else self._row(r, t) for r, t in zip(req_ids, tokens)])  # [s]
        position, num_prompt, start, end = (np.array(f, np.int64) for f in fields)  # [s] each
        length = end - start
        span = np.repeat(np.arange(len(spans)), length)  # [m]: the span of each of the step's rows counted here
        offset = np.arange(len(span)) - np.repeat(np.cumsum(length) - length, length)  # [m]: row within its span
        at = position[span] + offset  # [m]: its sequence position
        new = at >= self._until[rows][span]  # recomputed after a preemption: counted already
        slot = 2 * rows[span[new]] + (at[new] >= num_prompt[span[new]])  # [m'] row x (0 prompt, 1 generated)
        layers, experts = self.num_layers, self.num_experts
        taken = ids[start[span[new]] + offset[new]]  # [m', L, k]: the experts of the rows counted
        cell = (slot[:, None, None] * layers + np.arange(layers)[None, :, None]) * experts + taken  # [m', L, k]
        np.add.at(self._table.reshape(-1), cell.ravel(), 1)
        np.add.at(self._tokens.reshape(-1), slot, 1)
        self._until[rows] = np.maximum(self._until[rows], position + length)

    def _row(self, req_id: str, token: str) -> int:
        """A new request's row in the table: a free one, or a new one (the table doubles)."""
        if not self._free:
            grown = max(len(self._token), 8)
            self._table = np.concatenate([self._table, np.zeros((grown, *self._table.shape[1:]), np.int64)])
            self._tokens = np.concatenate([self._tokens, np.zeros((grown, 2), np.int64)])
            self._until = np.concatenate([self._until, np.zeros(grown, np.int64)])
            self._free = list(range(len(self._token) + grown - 1, len(self._token) - 1, -1))
            self._token.extend([""] * grown)
        row = self._row_of[req_id] = self._free.pop()
        self._token[row] = token
        return row

    def finish(self, req_id: str) -> None:
        """The request left the engine: its counts wait under its token, and its row is zeroed for the next."""
        row = self._row_of.pop(req_id, None)
        if row is None:
            return
        token = self._token[row]
        self._done.pop(token, None)
        self._done[token] = Observed(self._table[row, 0].copy(), self._table[row, 1].copy(),
                                     int(self._tokens[row, 0]), int(self._tokens[row, 1]))
        self._table[row], self._tokens[row], self._until[row] = 0, 0, 0
        self._free.append(row)
        while len(self._done) > self.keep:
            dropped, _ = self._done.popitem(last=False)
            log.debug("dropping the expert counts of %s: nobody took them", dropped)

    def take(self, tokens: Iterable[str]) -> dict[str, dict]:
        """The finished counts of `tokens` (`Observed.to_wire` form), removed; unknown tokens are left out."""
        return {t: self._done.pop(t).to_wire() for t in tokens if t in self._done}

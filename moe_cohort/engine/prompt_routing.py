"""Each request's prompt routing, counted during its own prefill: the profile the decode gate admits by.

Per request, per MoE layer, the fraction of its computed prompt tokens that picked each expert
(after its routing policy: what the engine loaded). A prefill may run in chunks over several
forwards; the profile is handed over once, in the forward that computes the last prompt token. Tokens
found in the prefix cache are not computed, so not counted: the profile is that of the prompt's
computed tail (vLLM computes at least its last token).

Pure numpy; `engine.routing_hook` feeds it once per forward that holds a prefill.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

OUTPUT_ATTR = "cohort_prompt_routing"  # the attribute of a step's ModelRunnerOutput that carries them to the scheduler


class PromptRouting:
    """Prompt-token expert counts of the requests in prefill, [L, E] each, until their prefill ends."""

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self._counts: dict[str, np.ndarray] = {}  # request id -> [L, E] int64, prefill not ended
        self._tokens: dict[str, int] = {}  # request id -> prompt tokens counted
        self._next: dict[str, int] = {}  # request id -> the position its next prompt row must have
        self.done: dict[str, np.ndarray] = {}  # request id -> [L, E] float32 profile, not taken yet

    def add_step(self, spans: Sequence[tuple[str, int, int, int, int]], ids: np.ndarray) -> None:
        """One forward: each span (req_id, position, num_prompt, start, end) says that rows [start, end) of
        ids [n, L, k] are that request's tokens at positions [position, ...). Only prompt positions count."""
        for rid, position, num_prompt, start, end in spans:
            prompt_rows = min(end, start + num_prompt - position) - start  # rows of this span that are prompt
            if prompt_rows <= 0:
                continue
            counts = self._counts.get(rid)
            if counts is None or position < self._next[rid]:  # new, or recomputed after a preemption: afresh
                counts = self._counts[rid] = np.zeros((self.num_layers, self.num_experts), np.int64)
                self._tokens[rid] = 0
            taken = ids[start:start + prompt_rows]  # [m, L, k]
            layer = np.broadcast_to(np.arange(self.num_layers)[None, :, None], taken.shape)  # [m, L, k]
            np.add.at(counts, (layer.ravel(), taken.ravel()), 1)
            self._tokens[rid] += prompt_rows
            self._next[rid] = position + prompt_rows
            if position + prompt_rows >= num_prompt:  # the last prompt token is in this forward
                self.done[rid] = (counts / self._tokens.pop(rid)).astype(np.float32)
                del self._counts[rid], self._next[rid]

    def take(self) -> dict[str, np.ndarray]:
        """The profiles [L, E] of the prefills that ended since the last take."""
        done, self.done = self.done, {}
        return done

    def finish(self, req_id: str) -> None:
        """The request left the engine (finished or aborted during its prefill): drop what it left."""
        self._counts.pop(req_id, None)
        self._tokens.pop(req_id, None)
        self._next.pop(req_id, None)
        self.done.pop(req_id, None)

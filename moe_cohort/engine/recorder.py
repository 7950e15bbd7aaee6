"""Record the experts every token of a request used, and write them in the trace format.

The vLLM plugin feeds the recorder once per forward pass (`add_rows`: the rows of each recorded
request, all MoE layers) and once per finished request (`finish`). Rows are stored by sequence
position, so a request that is preempted and recomputed overwrites its rows instead of adding
them twice. A finished request becomes one `traces.format` file, `<dir>/<request id>.npz`,
holding one request: its prompt tokens and every generated token that went through the model
(the last sampled token never does), ids and router weights of every MoE layer, and the prompt
text when a tokenizer is at hand. `traces.importers.load_traces(dir)` (and so `cohort eval
--traces dir`, `cohort train --traces dir`) reads a folder of such files as one TraceSet.

Positions the engine did not compute (a prompt prefix served from vLLM's prefix cache) leave a
hole; such a request is skipped with a warning. The plugin asks vLLM not to read the prefix cache
for recorded requests, so this only happens if that is overridden.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moe_cohort.traces.format import TraceSet, expert_dtype, save_traces

log = logging.getLogger(__name__)

SOURCE = "moe-cohort vllm plugin"


@dataclass
class _Buffer:
    """Rows of one request by position: experts/weights [capacity, L, k], filled [capacity]."""

    num_layers: int
    top_k: int
    policy: str
    experts: np.ndarray = field(init=False)
    weights: np.ndarray = field(init=False)
    filled: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self._allocate(64)

    def _allocate(self, capacity: int) -> None:
        old = getattr(self, "filled", np.zeros(0, bool))
        experts = np.zeros((capacity, self.num_layers, self.top_k), np.int32)
        weights = np.zeros((capacity, self.num_layers, self.top_k), np.float32)
        filled = np.zeros(capacity, bool)
        if len(old):
            experts[: len(old)], weights[: len(old)], filled[: len(old)] = self.experts, self.weights, old
        self.experts, self.weights, self.filled = experts, weights, filled

    def write(self, position: int, experts: np.ndarray, weights: np.ndarray) -> None:
        """experts/weights [n, L, k] of the tokens at positions [position, position + n)."""
        end = position + len(experts)
        if end > len(self.filled):
            self._allocate(max(end, 2 * len(self.filled)))
        self.experts[position:end], self.weights[position:end] = experts, weights
        self.filled[position:end] = True


class TraceRecorder:
    """Per-request expert traces of one engine, written to `out_dir` when requests finish.

    decode_text: prompt token ids -> text, stored as the trace's text (None: no texts).
    """

    def __init__(self, out_dir: str | Path, *, num_layers: int, num_experts: int, top_k: int, model: str = "",
                 decode_text: Callable[[list[int]], str] | None = None) -> None:
        self.out_dir = Path(out_dir)
        self.num_layers, self.num_experts, self.top_k, self.model = num_layers, num_experts, top_k, model
        self.decode_text = decode_text
        self._buffers: dict[str, _Buffer] = {}

    def add_rows(self, req_id: str, policy: str, position: int, experts: np.ndarray, weights: np.ndarray) -> None:
        """experts [n, L, k] ids and weights [n, L, k] of one request's tokens at `position`..."""
        buf = self._buffers.get(req_id)
        if buf is None:
            buf = self._buffers[req_id] = _Buffer(self.num_layers, self.top_k, policy)
        buf.write(position, experts, weights)

    def is_recording(self, req_id: str) -> bool:
        return req_id in self._buffers

    def drop(self, req_id: str) -> None:
        self._buffers.pop(req_id, None)

    def finish(self, req_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> Path | None:
        """Write the finished request's trace; return its path (None if nothing or a hole)."""
        buf = self._buffers.pop(req_id, None)
        if buf is None:
            return None
        num_tokens = int(buf.filled.sum())
        if num_tokens == 0 or not buf.filled[:num_tokens].all():
            first_hole = int(np.argmin(buf.filled))
            log.warning("not recording %s: position %d was never computed (prefix cache hit?); "
                        "recorded requests must not read vLLM's prefix cache", req_id, first_hole)
            return None
        num_prompt = min(len(prompt_token_ids), num_tokens)
        texts = None
        if self.decode_text is not None:
            texts = np.array([self.decode_text(list(prompt_token_ids))])
        ts = TraceSet(
            num_experts=self.num_experts, num_layers=self.num_layers, top_k=self.top_k,
            token_offsets=np.array([0, num_tokens], np.int64),
            experts=buf.experts[:num_tokens].astype(expert_dtype(self.num_experts)),
            weights=buf.weights[:num_tokens].copy(), num_prompt_tokens=np.array([num_prompt], np.int64),
            request_ids=np.array([req_id]), texts=texts, model=self.model,
            extra={"source": SOURCE, "policy": buf.policy,
                   "token_ids": [int(t) for t in list(prompt_token_ids) + list(output_token_ids)][:num_tokens]},
        )
        path = save_traces(self.out_dir / f"{_file_name(req_id)}.npz", ts)
        log.info("recorded %s: %d tokens (%d prompt) -> %s", req_id, num_tokens, num_prompt, path)
        return path


def _file_name(req_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", req_id)[:200]

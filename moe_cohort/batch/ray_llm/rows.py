"""What batch/ray_llm/processor.py reads and writes of a Ray Data LLM row: its text, its place in the admission
order (by predicted profiles, or by the profiles its prompt's probe gave), and the expert args its sampling
parameters carry to our scheduler and plugin."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from moe_cohort.admission.wire import BATCH_KEY, OBSERVE_KEY, PROFILE_KEY, Prediction
from moe_cohort.batch.order import AS_PROFILES_ARRIVE, ExpertOrder, Order, admission_plan, sending_order
from moe_cohort.encoder.text import RequestTextError, request_text
from moe_cohort.send.profiles import Predictor


@dataclass(frozen=True)
class _Line:
    """A row as batch/order.py sees a request: its place and its text."""

    line: int
    text: str


def row_text(row: dict) -> str:
    """What the encoder reads of a row: its chat `messages` or its `prompt`, as the proxy reads a request body;
    "" for a row without either (it goes first come, first served)."""
    try:
        return request_text(row)
    except RequestTextError:
        return ""


def plan(texts: Sequence[str], predictor: Predictor | None, max_num_seqs: int,
         limit: int | None = None) -> tuple[list[int], list[list[int]]]:
    """(the rows' sending order, its first `limit` rows only when given; each row's compact profile ([] when
    none)): the batch runner's admission by predicted experts with `max_num_seqs` rows out, finishing first in
    first out; the given order without a predictor."""
    sent, order = admission_plan([_Line(i, t) for i, t in enumerate(texts)], predictor, max_num_seqs, limit)
    return _rows(sent, order, len(texts))


def probed_plan(n: int, profiles: Mapping[int, np.ndarray], max_num_seqs: int) -> tuple[list[int], list[list[int]]]:
    """(the sending order of `n` rows, each row's compact profile ([] when none)): admission by `profiles` (by row,
    each [L, E]: its prompt's probe) with `max_num_seqs` rows out, finishing first in first out; rows without a
    profile go last."""
    order = ExpertOrder(max_num_seqs, fill=AS_PROFILES_ARRIVE)
    order.predicted({i: Prediction.of_profile(p) for i, p in profiles.items()})
    return _rows(sending_order([_Line(i, "") for i in range(n)], order, max_num_seqs), order, n)


def _rows(sent: Sequence[_Line], order: Order, n: int) -> tuple[list[int], list[list[int]]]:
    """(the rows in the order `sent`, the compact profile `order` forwards for each of `n` rows ([] when none))."""
    return [x.line for x in sent], [order.compact(i) or [] for i in range(n)]


def part_sizes(rows: int, size: int) -> list[int]:
    """`rows` rows in parts of `size`, the last one less."""
    return [min(size, rows - k) for k in range(0, rows, size)]


def with_expert_args(sampling_params: dict | None, profile: Sequence[int], token: str | None) -> dict:
    """`sampling_params` with the row's profile (when it has one) and observe token (when learning) in its
    `extra_args`, marked a batch line (no fairness bound at the engine), the caller's own extra args kept."""
    params = dict(sampling_params or {})
    extra = {**(params.get("extra_args") or {}), BATCH_KEY: 1}
    if len(profile):
        extra[PROFILE_KEY] = [int(c) for c in profile]  # Arrow hands lists back as numpy arrays
    if token:
        extra[OBSERVE_KEY] = token
    params["extra_args"] = extra
    return params

"""Merge trace sets, and read a folder of trace files (what the vLLM plugin records) as one set.

The plugin writes one `traces.format` file per finished request, `<dir>/<request id>.npz`, with
the request's routing policy in `extra["policy"]`. `load_trace_dir(dir)` reads every `.npz` of
such a folder in file-name order and `merge_traces` concatenates them, so that `cohort eval`,
`cohort train` and `traces.importers.load_traces` take the folder as they take one file. The
merged set keeps each request's policy in `extra["policies"]` ({request id: policy}).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from moe_cohort.traces.format import TraceFormatError, TraceSet, load_trace_file

log = logging.getLogger(__name__)


def merge_traces(sets: Sequence[TraceSet]) -> TraceSet:
    """One TraceSet holding the requests of `sets` in order.

    Every set must have the same (num_experts, num_layers, top_k); request ids must be unique
    across sets. An optional array (weights, texts, categories) is kept only if every set has it.
    The model name is the first set's; `extra` is {"policies": {request id: policy}} gathered from
    single-request sets' `extra["policy"]` and any set's `extra["policies"]`, plus "source" when
    all sets name the same one. Raises TraceFormatError on mismatched shapes or an empty list.
    """
    if not sets:
        raise TraceFormatError("no trace sets to merge")
    _check_same_shape(sets)
    lengths = np.concatenate([ts.num_tokens for ts in sets])  # [N]
    return TraceSet(
        num_experts=sets[0].num_experts, num_layers=sets[0].num_layers, top_k=sets[0].top_k,
        token_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        experts=np.concatenate([ts.experts for ts in sets]),  # [T, L, k]
        weights=_concat_optional(sets, "weights"),  # [T, L, k] or None
        num_prompt_tokens=np.concatenate([ts.num_prompt_tokens for ts in sets]),
        request_ids=np.concatenate([ts.request_ids for ts in sets]),
        texts=_concat_optional(sets, "texts"), categories=_concat_optional(sets, "categories"),
        model=sets[0].model, extra=_merged_extra(sets),
    )


def load_trace_dir(directory: str | Path) -> TraceSet:
    """Merge every `.npz` trace file directly in `directory` (sorted by file name) into one TraceSet.

    Raises TraceFormatError if the folder holds no `.npz` file, or naming the file that is not a
    valid trace file.
    """
    paths = sorted(Path(directory).glob("*.npz"))
    if not paths:
        raise TraceFormatError(f"{directory}: no .npz trace files in this directory")
    merged = merge_traces([load_trace_file(p) for p in paths])
    log.info("merged %d trace files, %d requests, %d tokens from %s",
             len(paths), len(merged), int(merged.token_offsets[-1]), directory)
    return merged


def _check_same_shape(sets: Sequence[TraceSet]) -> None:
    first = (sets[0].num_experts, sets[0].num_layers, sets[0].top_k)
    for ts in sets:
        shape = (ts.num_experts, ts.num_layers, ts.top_k)
        if shape != first:
            raise TraceFormatError(f"cannot merge traces of different model shapes (num_experts, num_layers, "
                                   f"top_k): {first} vs {shape}")


def _concat_optional(sets: Sequence[TraceSet], name: str) -> np.ndarray | None:
    arrays = [getattr(ts, name) for ts in sets]
    return None if any(a is None for a in arrays) else np.concatenate(arrays)


def _merged_extra(sets: Sequence[TraceSet]) -> dict:
    policies: dict[str, str] = {}
    for ts in sets:
        if "policy" in ts.extra and len(ts) == 1:
            policies[str(ts.request_ids[0])] = ts.extra["policy"]
        policies.update(ts.extra.get("policies", {}))
    extra: dict = {"policies": policies}
    sources = {ts.extra.get("source") for ts in sets}
    if len(sources) == 1 and None not in sources:
        extra["source"] = sources.pop()
    return extra

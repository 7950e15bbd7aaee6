"""The expert-trace format: which experts every token of every request chose.

A `TraceSet` holds many requests in flat, columnar numpy arrays (the layout of the
DeepSeek traces, token-major so one request is one contiguous slice):

    token_offsets  int64  [N + 1]     request i owns tokens token_offsets[i]:token_offsets[i+1]
    experts        uint8/int16/int32 [T, L, k]   top-k expert ids per token and MoE layer
    weights        float32 [T, L, k] or None     router weights of those experts, when known
    num_prompt_tokens int64 [N]       the first n tokens of a request are prompt (prefill)
                                      tokens, the rest were generated (decode) tokens
    request_ids    str    [N]
    texts          str    [N] or None  the prompt text (needed to plan and train from text)
    categories     str    [N] or None

On disk it is one uncompressed `.npz` (no pickles) with a JSON `meta` entry carrying the
format name, the version and the model shape (num_experts, num_layers, top_k, model).
`load_traces` validates everything and raises `TraceFormatError` naming the problem.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FORMAT_NAME = "moe-cohort-trace"
FORMAT_VERSION = 1
_ARRAY_FIELDS = ("token_offsets", "experts", "num_prompt_tokens", "request_ids", "weights", "texts", "categories")


class TraceFormatError(ValueError):
    """A trace file or array does not follow the trace format; the message says what and how to fix it."""


@dataclass(frozen=True)
class TraceSet:
    num_experts: int
    num_layers: int
    top_k: int
    token_offsets: np.ndarray  # [N + 1] int64
    experts: np.ndarray  # [T, L, k] unsigned/signed int
    num_prompt_tokens: np.ndarray  # [N] int64
    request_ids: np.ndarray  # [N] str
    weights: np.ndarray | None = None  # [T, L, k] float32
    texts: np.ndarray | None = None  # [N] str
    categories: np.ndarray | None = None  # [N] str
    model: str = ""
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate(self)

    def __len__(self) -> int:
        return len(self.token_offsets) - 1

    @property
    def num_tokens(self) -> np.ndarray:  # [N]
        return np.diff(self.token_offsets)

    @property
    def num_decode_tokens(self) -> np.ndarray:  # [N]
        return self.num_tokens - self.num_prompt_tokens

    def request_experts(self, i: int) -> np.ndarray:  # [n_i, L, k]
        return self.experts[self.token_offsets[i] : self.token_offsets[i + 1]]

    def subset(self, indices) -> "TraceSet":
        """The requests at `indices` (in that order), as a new TraceSet."""
        idx = np.asarray(indices, dtype=np.int64)
        starts, lengths = self.token_offsets[idx], self.num_tokens[idx]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        tokens = np.arange(offsets[-1]) + np.repeat(starts - offsets[:-1], lengths)  # [T'] source token index
        pick = lambda a: None if a is None else a[idx]  # noqa: E731
        return TraceSet(
            num_experts=self.num_experts, num_layers=self.num_layers, top_k=self.top_k,
            token_offsets=offsets,
            experts=self.experts[tokens], num_prompt_tokens=self.num_prompt_tokens[idx],
            request_ids=self.request_ids[idx], weights=None if self.weights is None else self.weights[tokens],
            texts=pick(self.texts), categories=pick(self.categories), model=self.model, extra=dict(self.extra),
        )


def expert_dtype(num_experts: int) -> np.dtype:
    """The smallest integer dtype that holds ids 0..num_experts-1."""
    return np.dtype(np.uint8 if num_experts <= 256 else np.int16 if num_experts <= 32767 else np.int32)


def validate(ts: TraceSet) -> None:
    """Raise TraceFormatError if shapes, dtypes or id ranges are inconsistent."""
    _check(ts.num_experts >= 1 and ts.num_layers >= 1 and ts.top_k >= 1,
           f"num_experts, num_layers and top_k must be >= 1, got {ts.num_experts}, {ts.num_layers}, {ts.top_k}")
    _check(ts.top_k <= ts.num_experts, f"top_k ({ts.top_k}) exceeds num_experts ({ts.num_experts})")
    _validate_offsets(ts.token_offsets)
    n, t = len(ts.token_offsets) - 1, int(ts.token_offsets[-1])
    _check(ts.experts.ndim == 3 and ts.experts.shape == (t, ts.num_layers, ts.top_k),
           f"experts must have shape [tokens={t}, layers={ts.num_layers}, k={ts.top_k}], got {list(ts.experts.shape)}")
    _check(np.issubdtype(ts.experts.dtype, np.integer), f"experts must be integer ids, got dtype {ts.experts.dtype}")
    if t:
        lo, hi = int(ts.experts.min()), int(ts.experts.max())
        _check(lo >= 0 and hi < ts.num_experts,
               f"expert ids must lie in [0, {ts.num_experts}), found ids in [{lo}, {hi}]; is num_experts right?")
    if ts.weights is not None:
        _check(ts.weights.shape == ts.experts.shape and np.issubdtype(ts.weights.dtype, np.floating),
               f"weights must be float with the shape of experts {list(ts.experts.shape)}, "
               f"got {ts.weights.dtype} {list(ts.weights.shape)}")
    _check(ts.num_prompt_tokens.shape == (n,), f"num_prompt_tokens must have shape [{n}], got {list(ts.num_prompt_tokens.shape)}")
    bad = np.flatnonzero((ts.num_prompt_tokens < 0) | (ts.num_prompt_tokens > np.diff(ts.token_offsets)))
    _check(len(bad) == 0, f"num_prompt_tokens must lie in [0, tokens of the request]; request index {bad[:1].tolist()} breaks it")
    for name in ("request_ids", "texts", "categories"):
        arr = getattr(ts, name)
        _check(arr is None or arr.shape == (n,), f"{name} must have one entry per request ({n}), got {None if arr is None else list(arr.shape)}")
    _check(len(set(ts.request_ids.tolist())) == n, "request_ids must be unique")


def _validate_offsets(off: np.ndarray) -> None:
    _check(off.ndim == 1 and len(off) >= 1 and np.issubdtype(off.dtype, np.integer),
           f"token_offsets must be a 1-D integer array [N+1], got {off.dtype} {list(off.shape)}")
    _check(int(off[0]) == 0, f"token_offsets must start at 0, got {int(off[0])}")
    _check(bool(np.all(np.diff(off) >= 0)), "token_offsets must be non-decreasing")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise TraceFormatError(message)


def save_traces(path: str | Path, ts: TraceSet) -> Path:
    """Write `ts` to `path` (.npz appended if missing) and return the path."""
    path = Path(path)
    if path.suffix != ".npz":
        path = path.with_name(path.name + ".npz")
    meta = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "num_experts": ts.num_experts,
            "num_layers": ts.num_layers, "top_k": ts.top_k, "model": ts.model, "extra": ts.extra}
    arrays = {"meta": np.array(json.dumps(meta)), "token_offsets": ts.token_offsets.astype(np.int64),
              "experts": ts.experts.astype(expert_dtype(ts.num_experts)),
              "num_prompt_tokens": ts.num_prompt_tokens.astype(np.int64),
              "request_ids": ts.request_ids.astype(str)}
    for name in ("weights", "texts", "categories"):
        arr = getattr(ts, name)
        if arr is not None:
            arrays[name] = arr.astype(np.float32 if name == "weights" else str)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
    tmp.replace(path)
    return path


def load_trace_file(path: str | Path) -> TraceSet:
    """Read a `.npz` written by `save_traces`, validating it."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise TraceFormatError(f"{path}: not a readable .npz trace file ({exc})") from exc
    if "meta" not in arrays:
        raise TraceFormatError(f"{path}: no 'meta' entry; this is not a moe-cohort trace file "
                               f"(import other layouts with `cohort traces import`)")
    meta = json.loads(str(arrays.pop("meta")))
    if meta.get("format") != FORMAT_NAME or meta.get("version") != FORMAT_VERSION:
        raise TraceFormatError(f"{path}: format {meta.get('format')!r} version {meta.get('version')!r}; "
                               f"this reader supports {FORMAT_NAME!r} version {FORMAT_VERSION}")
    missing = {"token_offsets", "experts", "num_prompt_tokens", "request_ids"} - arrays.keys()
    arrays = {k: v for k, v in arrays.items() if k in _ARRAY_FIELDS}
    if missing:
        raise TraceFormatError(f"{path}: missing arrays {sorted(missing)}")
    try:
        return TraceSet(num_experts=int(meta["num_experts"]), num_layers=int(meta["num_layers"]),
                        top_k=int(meta["top_k"]), model=meta.get("model", ""), extra=meta.get("extra", {}), **arrays)
    except TraceFormatError as exc:
        raise TraceFormatError(f"{path}: {exc}") from exc

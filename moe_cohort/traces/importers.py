"""Importers from other trace layouts, and `load_traces`, which recognises them all.

Layouts understood by `load_traces(path)`:
- a moe-cohort `.npz` (see traces.format);
- a directory holding `traces.npz` + `prompts.jsonl` in the layout of the DeepSeek-V2-Lite
  Puffin traces (experts [L, T, k], prompt-only, token 0 is BOS); with a `meta.json` saying
  `"tokens": "decode"` (the gpt-oss-20b layout) every token is one the model GENERATED, so each
  request's tokens are its decode steps, in order (replayed as they are, no decode proxy), and the
  model's shape (`num_experts`, `top_k`, `model`) comes from meta.json;
- a directory of moe-cohort `.npz` files, one request each as the vLLM plugin records them,
  merged in file-name order (see traces.merge);
- a `.jsonl` file of records {"id", "text", "experts": [[[k ids] x layers] x tokens],
  "num_prompt_tokens", optional "weights" (same nesting), optional "category"}, so that traces
  from any engine can be brought in;
- a directory of router JSON files, one per prompt, in the layout of the public
  GPT-OSS-MoE-ExpertFingerprinting traces of openai/gpt-oss-20b (`import_router_json_dir`): every
  token is one the model generated, in order;
- the word `sample`: a small synthetic trace set built in (see traces.synthetic).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np

from moe_cohort.traces.format import FORMAT_NAME, TraceFormatError, TraceSet, expert_dtype, load_trace_file
from moe_cohort.traces.merge import load_trace_dir

log = logging.getLogger(__name__)

SAMPLE = "sample"
GPT_OSS_EXPERTS = 32  # routed experts per MoE layer of openai/gpt-oss-20b


def load_traces(path: str | Path, *, num_experts: int | None = None) -> TraceSet:
    """Load traces from any supported layout; `num_experts` overrides the inferred count for imports."""
    if str(path) == SAMPLE and not Path(path).exists():
        from moe_cohort.traces.synthetic import synthetic_traces

        return synthetic_traces()
    path = Path(path)
    if path.is_dir():
        if (path / "traces.npz").exists() and (path / "prompts.jsonl").exists():
            return import_prompt_trace_dir(path, num_experts=num_experts)
        if any(path.glob("*.npz")):
            return load_trace_dir(path)
        if any(path.glob("*.json")):
            return import_router_json_dir(path, num_experts=num_experts)
        raise TraceFormatError(f"{path}: a trace directory needs traces.npz and prompts.jsonl "
                               f"(the DeepSeek-V2-Lite Puffin layout), recorded .npz trace files or router "
                               f".json files, one per prompt (the GPT-OSS-MoE-ExpertFingerprinting layout); "
                               f"pass a file path otherwise")
    if not path.exists():
        raise TraceFormatError(f"{path}: no such file or directory (use '{SAMPLE}' for the built-in sample traces)")
    if path.suffix == ".jsonl":
        return import_jsonl(path, num_experts=num_experts)
    if path.suffix == ".npz":
        return load_trace_file(path)
    raise TraceFormatError(f"{path}: unknown trace layout; expected a {FORMAT_NAME} .npz, a .jsonl of "
                           f"records, a directory of recorded .npz files or one with traces.npz + prompts.jsonl")


def import_prompt_trace_dir(path: str | Path, *, num_experts: int | None = None) -> TraceSet:
    """Import `traces.npz` (prompt_ids [N], token_offsets [N+1], experts [L, T, k]) + `prompts.jsonl`
    (+ an optional `meta.json`: which tokens were routed, the model's shape)."""
    path = Path(path)
    meta = read_meta(path)
    with np.load(path / "traces.npz", allow_pickle=False) as z:
        missing = {"prompt_ids", "token_offsets", "experts"} - set(z.files)
        if missing:
            raise TraceFormatError(f"{path / 'traces.npz'}: missing arrays {sorted(missing)}")
        prompt_ids, offsets, experts_ltk = z["prompt_ids"], z["token_offsets"].astype(np.int64), z["experts"]
    if experts_ltk.ndim != 3:
        raise TraceFormatError(f"{path / 'traces.npz'}: experts must be [layers, tokens, k], got {list(experts_ltk.shape)}")
    prompts = _read_jsonl(path / "prompts.jsonl")
    if [p.get("prompt_id") for p in prompts] != prompt_ids.tolist():
        raise TraceFormatError(f"{path}: prompts.jsonl must list the prompt_ids of traces.npz in the same order")
    lengths = np.diff(offsets)
    for line, (p, n) in enumerate(zip(prompts, lengths), start=1):
        if "n_tokens" in p and p["n_tokens"] != n:
            raise TraceFormatError(f"{path / 'prompts.jsonl'} line {line}: n_tokens={p['n_tokens']} but traces.npz has {n}")
    experts = np.ascontiguousarray(experts_ltk.transpose(1, 0, 2))  # [L, T, k] -> [T, L, k]
    e = num_experts or meta.get("num_experts") or int(experts.max()) + 1
    decode = meta.get("tokens") == "decode"
    log.info("imported %d requests, %d %s tokens from %s", len(prompts), len(experts), "decode" if decode else "prompt", path)
    return TraceSet(num_experts=e, num_layers=experts.shape[1], top_k=experts.shape[2], token_offsets=offsets,
                    experts=experts.astype(expert_dtype(e)), num_prompt_tokens=np.zeros_like(lengths) if decode else lengths.copy(),
                    request_ids=np.array([str(i) for i in prompt_ids.tolist()]),
                    texts=np.array([str(p.get("text", "")) for p in prompts]), model=meta.get("model", path.name))


TOKEN_KINDS = ("prompt", "decode")


def read_meta(path: Path) -> dict:
    """A trace folder's `meta.json` ({} without one: prompt tokens), checked: `tokens` is one of TOKEN_KINDS."""
    file = path / "meta.json"
    if not file.exists():
        return {}
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{file}: not valid JSON ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("tokens", "prompt") not in TOKEN_KINDS:
        raise TraceFormatError(f"{file}: \"tokens\" must be one of {', '.join(TOKEN_KINDS)} (which tokens were "
                               f"routed), got {meta.get('tokens') if isinstance(meta, dict) else meta!r}")
    return meta


def import_jsonl(path: str | Path, *, num_experts: int | None = None) -> TraceSet:
    """Import one JSON record per request (see the module docstring); errors name the line."""
    path = Path(path)
    records = _read_jsonl(path)
    if not records:
        raise TraceFormatError(f"{path}: no records")
    parsed = [_parse_record(r, f"{path} line {i}") for i, r in enumerate(records, start=1)]
    shapes = {p["experts"].shape[1:] for p in parsed if len(p["experts"])}
    if len(shapes) != 1:
        raise TraceFormatError(f"{path}: every token must list the same number of layers and k ids; found shapes {sorted(shapes)}")
    (num_layers, top_k), = shapes
    experts = np.concatenate([p["experts"].reshape(-1, num_layers, top_k) for p in parsed])
    has_w = [p["weights"] is not None for p in parsed]
    if any(has_w) and not all(has_w):
        raise TraceFormatError(f"{path}: give weights for every record or for none (record {has_w.index(not has_w[0]) + 1} differs)")
    weights = np.concatenate([p["weights"].reshape(-1, num_layers, top_k) for p in parsed]) if all(has_w) else None
    e = num_experts or int(experts.max()) + 1
    cats = [p["category"] for p in parsed]
    return TraceSet(
        num_experts=e, num_layers=num_layers, top_k=top_k,
        token_offsets=np.concatenate([[0], np.cumsum([len(p["experts"]) for p in parsed])]).astype(np.int64),
        experts=experts.astype(expert_dtype(e)), weights=weights,
        num_prompt_tokens=np.array([p["num_prompt_tokens"] for p in parsed], dtype=np.int64),
        request_ids=np.array([p["id"] for p in parsed]), texts=np.array([p["text"] for p in parsed]),
        categories=np.array(cats) if all(c is not None for c in cats) else None, model=path.stem,
    )


def import_router_json_dir(path: str | Path, *, num_experts: int | None = None) -> TraceSet:
    """Import a folder of router JSON files, one request each, in file-name order (numbers compared as numbers).

    Each file is {"original_prompt": str, "router_data": [one entry per generated token, in order]}
    (other keys, such as "full_text" and "generated_only", are not read), each entry
    {"token_N": {"layer_L": {"selected_experts": [k ids], "selected_probs": [k floats]}}}. The request
    id is the file name without .json, the text is `original_prompt`, every token is a decode token,
    layers go in the order of their numbers and the probabilities become the weights. `num_experts`
    defaults to gpt-oss-20b's GPT_OSS_EXPERTS; when ids reach past it and none was given, it is
    inferred as the largest id + 1, with a warning.
    """
    path = Path(path)
    files = sorted(path.glob("*.json"), key=lambda f: _natural_key(f.name))
    if not files:
        raise TraceFormatError(f"{path}: no .json router files")
    parsed = [_parse_router_file(f) for f in files]
    shapes = {p["experts"].shape[1:] for p in parsed if len(p["experts"])}
    if len(shapes) > 1:
        raise TraceFormatError(f"{path}: every token of every file must list the same layers and k experts; "
                               f"found [layers, k] {sorted(map(list, shapes))}")
    if not shapes:
        raise TraceFormatError(f"{path}: no file has a routed token (every \"router_data\" is empty)")
    (num_layers, top_k), = shapes
    experts = np.concatenate([p["experts"].reshape(-1, num_layers, top_k) for p in parsed])
    weights = np.concatenate([p["weights"].reshape(-1, num_layers, top_k) for p in parsed])
    largest = int(experts.max()) if len(experts) else -1
    e = num_experts or GPT_OSS_EXPERTS
    if num_experts is None and largest >= e:
        e = largest + 1
        log.warning("%s: expert id %d is past gpt-oss-20b's %d experts per layer: num_experts inferred as %d "
                    "(give --num-experts to set it)", path, largest, GPT_OSS_EXPERTS, e)
    lengths = [len(p["experts"]) for p in parsed]
    log.info("imported %d requests, %d decode tokens from %s", len(parsed), sum(lengths), path)
    return TraceSet(num_experts=e, num_layers=num_layers, top_k=top_k,
                    token_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                    experts=experts.astype(expert_dtype(max(e, largest + 1))), weights=weights,
                    num_prompt_tokens=np.zeros(len(parsed), np.int64),
                    request_ids=np.array([f.name.removesuffix(".json") for f in files]),
                    texts=np.array([p["text"] for p in parsed]), model=path.name)


def _parse_router_file(file: Path) -> dict:
    """{"text", "experts" [T, L, k] int64, "weights" [T, L, k] float32} of one router JSON file."""
    try:
        rec = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TraceFormatError(f"{file}: not valid JSON ({exc})") from exc
    if not isinstance(rec, dict):
        raise TraceFormatError(f"{file}: expected a JSON object with \"original_prompt\" and \"router_data\"")
    if not isinstance(rec.get("original_prompt"), str):
        raise TraceFormatError(f"{file}: key \"original_prompt\" must be the prompt text (a string)")
    tokens = rec.get("router_data")
    if not isinstance(tokens, list):
        raise TraceFormatError(f"{file}: key \"router_data\" must be a list with one entry per generated token")
    experts, weights, layer_names = [], [], None
    for i, entry in enumerate(tokens):
        where = f"{file}: router_data[{i}]"
        if not (isinstance(entry, dict) and len(entry) == 1 and str(next(iter(entry))).startswith("token_")):
            raise TraceFormatError(f"{where} must be {{\"token_N\": {{\"layer_L\": ...}}}}")
        (token_key, layers), = entry.items()
        if not isinstance(layers, dict) or not layers or not all(_LAYER.fullmatch(str(k)) for k in layers):
            raise TraceFormatError(f"{where}.{token_key} must map \"layer_L\" keys to the layer's choice")
        names = sorted(layers, key=lambda k: int(k.removeprefix("layer_")))
        if layer_names is None:
            layer_names = names
        elif names != layer_names:
            raise TraceFormatError(f"{where}.{token_key} lists layers {names}, token 0 {layer_names}")
        ids, probs = [], []
        for name in names:
            choice = layers[name]
            for key, out in (("selected_experts", ids), ("selected_probs", probs)):
                if not isinstance(choice, dict) or not isinstance(choice.get(key), list):
                    raise TraceFormatError(f"{where}.{token_key}.{name}: key \"{key}\" must be a list")
                out.append(choice[key])
        experts.append(ids)
        weights.append(probs)
    try:
        experts_arr = np.asarray(experts)  # [T, L, k]
        weights_arr = np.asarray(weights, dtype=np.float32)  # [T, L, k]
    except (ValueError, TypeError) as exc:
        raise TraceFormatError(f"{file}: \"selected_experts\" and \"selected_probs\" must hold numbers, the same "
                               f"count k in every layer of every token ({exc})") from exc
    if experts_arr.size and not np.issubdtype(experts_arr.dtype, np.integer):
        raise TraceFormatError(f"{file}: key \"selected_experts\" must hold integer expert ids")
    experts_arr = experts_arr.astype(np.int64)
    if len(tokens) and (experts_arr.ndim != 3 or weights_arr.shape != experts_arr.shape):
        raise TraceFormatError(f"{file}: \"selected_experts\" and \"selected_probs\" must hold the same count k of "
                               f"entries in every layer of every token")
    if experts_arr.size and experts_arr.min() < 0:
        raise TraceFormatError(f"{file}: key \"selected_experts\" holds a negative expert id")
    return {"text": rec["original_prompt"], "experts": experts_arr, "weights": weights_arr}


_LAYER = re.compile(r"layer_\d+")


def _natural_key(name: str) -> list:
    """Sort key comparing the digit runs of `name` as numbers: 2.json before 10.json."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)]


def drop_leading_tokens(ts: TraceSet, n: int) -> TraceSet:
    """`ts` without the first `n` tokens of every request (all of a shorter one); prompt tokens go first."""
    if n <= 0:
        return ts
    lengths = ts.num_tokens  # [N]
    dropped = np.minimum(lengths, n)  # [N]
    keep = np.ones(int(ts.token_offsets[-1]), bool)  # [T]
    for start, d in zip(ts.token_offsets[:-1], dropped):
        keep[start : start + d] = False
    offsets = np.concatenate([[0], np.cumsum(lengths - dropped)]).astype(np.int64)
    return TraceSet(num_experts=ts.num_experts, num_layers=ts.num_layers, top_k=ts.top_k, token_offsets=offsets,
                    experts=ts.experts[keep], weights=None if ts.weights is None else ts.weights[keep],
                    num_prompt_tokens=np.maximum(ts.num_prompt_tokens - dropped, 0), request_ids=ts.request_ids,
                    texts=ts.texts, categories=ts.categories, model=ts.model, extra=dict(ts.extra))


def _parse_record(rec: dict, where: str) -> dict:
    for key in ("id", "experts"):
        if key not in rec:
            raise TraceFormatError(f"{where}: missing field {key!r}")
    try:
        experts = np.asarray(rec["experts"], dtype=np.int64)  # [n, L, k]
        weights = None if rec.get("weights") is None else np.asarray(rec["weights"], dtype=np.float32)
    except (ValueError, TypeError) as exc:
        raise TraceFormatError(f"{where}: 'experts'/'weights' must be nested lists [tokens][layers][k] of numbers ({exc})") from exc
    if experts.ndim != 3 and experts.size:
        raise TraceFormatError(f"{where}: 'experts' must be nested [tokens][layers][k], got {experts.ndim} levels")
    if weights is not None and weights.shape != experts.shape:
        raise TraceFormatError(f"{where}: 'weights' shape {list(weights.shape)} differs from 'experts' {list(experts.shape)}")
    if experts.size and experts.min() < 0:
        raise TraceFormatError(f"{where}: expert ids must be >= 0")
    n_prompt = rec.get("num_prompt_tokens", len(experts))
    if not isinstance(n_prompt, int) or not 0 <= n_prompt <= len(experts):
        raise TraceFormatError(f"{where}: num_prompt_tokens must be an integer in [0, {len(experts)}], got {n_prompt!r}")
    return {"id": str(rec["id"]), "text": str(rec.get("text", "")), "experts": experts, "weights": weights,
            "num_prompt_tokens": n_prompt, "category": rec.get("category")}


def _read_jsonl(path: Path) -> list[dict]:
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(f"{path} line {i}: invalid JSON ({exc.msg})") from exc
            if not isinstance(rec, dict):
                raise TraceFormatError(f"{path} line {i}: expected a JSON object, got {type(rec).__name__}")
            out.append(rec)
    return out

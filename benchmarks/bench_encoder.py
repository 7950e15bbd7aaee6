"""Encoder candidates side by side: prompts per CPU-second and planning quality, in one run.

    python benchmarks/bench_encoder.py [--candidate NAME=SPEC ...] [--slots 16,32] [--seeds 5]

A candidate SPEC is an `--encoder` value (folder, hub name, `static`, or empty for the packaged
MiniLM) with optional `@N` for inputs cut to their first N tokens, e.g. `minilm-32=@32`,
`static-ft=/tmp/static-ft`. Defaults: minilm, minilm-32, static.

1. Speed, on the held-out prompts (distinct texts, cache off): prompts per CPU-second of each
   candidate's `Embedder.encode` with torch on 1 thread and on 2, beside plain
   `SentenceTransformer.encode(batch_size=32)` of all-MiniLM-L6-v2 (the baseline of the target:
   >= 20x); and the time of a cache hit (`Embedder(cache_size=...)`, one prompt seen before).
2. Quality, on held-out requests only (traces.split): each candidate's profile head (the one its
   folder holds from `cohort train`, else a ridge head fitted here on the training side) drives
   admission in the continuous replay (S slots, lognormal lengths, seeds), against random; the
   saving of `text-profile` beside the reference that knows the traces; and the static B = 16
   plan's capture of the oracle as a side figure. Target: the default encoder within 5%
   (relative) of the fine-tuned MiniLM's continuous saving.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DATA = ROOT.parent / "shared" / "data" / "deepseek-v2-lite-puffin"
DEFAULT_CANDIDATES = ("minilm=", "minilm-32=@32", "static=static")


def main() -> None:
    args = _parse()
    from traces.importers import load_traces
    from traces.split import heldout_split

    ts = load_traces(args.traces)
    train_idx, held_idx = heldout_split(ts)
    candidates = dict(_candidate(c) for c in (args.candidate or DEFAULT_CANDIDATES))
    held_texts = list(dict.fromkeys(ts.texts[held_idx].tolist()))  # distinct, in order
    print(f"{len(ts)} requests, {len(held_idx)} held out ({len(held_texts)} distinct prompts)\n")
    if not args.no_speed:
        speed(candidates, held_texts, args.repeats)
    if not args.no_quality:
        quality(candidates, ts, train_idx, held_idx, args)


def speed(candidates: dict, texts: list[str], repeats: int) -> None:
    import torch

    from encoder.embedding import Embedder

    print(f"prompts per CPU-second (torch on 1, then 2 threads; best of {repeats}):")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        base = Embedder(None)
        plain = _rate(lambda: base.model.encode(texts, batch_size=32, normalize_embeddings=True), len(texts), repeats)
        print(f"  {'plain encode':<12} {threads} thread(s): {plain:10.1f} prompts/CPU-s (all-MiniLM-L6-v2)")
        for name, (source, cut) in candidates.items():
            e = Embedder(source or None, max_seq_len=cut)
            e.encode(texts[:32])  # warm-up
            rate = _rate(lambda: e.encode(texts), len(texts), repeats)
            print(f"  {name:<12} {threads} thread(s): {rate:10.1f} prompts/CPU-s = {rate / plain:6.1f}x plain encode")
    _cache_hit(texts)


def _rate(fn, n: int, repeats: int) -> float:
    best = np.inf
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return n / best


def _cache_hit(texts: list[str]) -> None:
    from encoder.embedding import Embedder

    e = Embedder("static", cache_size=len(texts))
    e.encode(texts)
    start = time.perf_counter()
    for t in texts:
        e.encode([t])
    print(f"\ncache hit (one prompt seen before, static model): {(time.perf_counter() - start) / len(texts) * 1e6:.1f} us\n")


def quality(candidates: dict, ts, train_idx, held_idx, args) -> None:
    from encoder import embed_texts
    from encoder.profile import load_profile_head
    from eval.cost import parse_cost_model
    from eval.engine import REFERENCE, evaluate_continuous, lengths_from_spec
    from eval.engine_cli import text_policies
    from eval.policies import by_profile
    from eval.replay import decode_profiles, decode_tokens
    from train.profile_head import fit_profile_head
    from train.targets import profiles

    prof = profiles(ts)  # [N, L, E]
    fit_idx = train_idx[prof[train_idx].sum(axis=(1, 2)) > 0]
    held = ts.subset(held_idx)
    tokens = decode_tokens(held)
    lengths, cost = lengths_from_spec("lognormal", held.request_ids), parse_cost_model("deepseek-v2-lite")
    policies, statics = {REFERENCE: by_profile(decode_profiles(tokens, held))}, {}
    for name, (source, cut) in candidates.items():
        x = embed_texts(list(ts.texts), encoder=source or None, max_seq_len=cut)  # [N, D]
        head = (load_profile_head(source) if source and Path(source).is_dir() else None) or \
            fit_profile_head(x[fit_idx], prof[fit_idx], ts.top_k)
        policies.update({k: v for k, v in text_policies(f"-{name}", x[held_idx], head).items() if "profile-" in k
                         and "lead" not in k})
        statics[name] = x[held_idx]
    for slots in _ints(args.slots):
        rows = evaluate_continuous(tokens, slots, policies, lengths, cost, held.num_layers, seeds=args.seeds)["plans"]
        ref = rows[REFERENCE]["saving"]
        print(f"S = {slots}: reference saving {ref:.2%}")
        for name in candidates:
            r = rows[f"text-profile-{name}"]
            print(f"  {name:<12} continuous saving {r['saving']:6.2%} (std {r['saving_std']:.2%}), {r['capture']:.0%} of the reference")
    _static_capture(held, statics)


def _static_capture(held, statics: dict) -> None:
    from encoder.planner import plan_batches
    from eval.metrics import evaluate

    planners = {name: (lambda ts_, b, x=x: plan_batches(x, b)) for name, x in statics.items()}
    rows = evaluate(held, 16, seeds=5, planners=planners)["plans"]
    print("\nstatic plans, B = 16 (side figure): " + ", ".join(
        f"{name} capture {rows[name]['capture']:.1%}" for name in statics) + f"; oracle saving {rows['oracle']['saving']:.1%}")


def _candidate(text: str) -> tuple[str, tuple[str, int | None]]:
    name, _, spec = text.partition("=")
    source, _, cut = spec.partition("@")
    return name, (source, int(cut) if cut else None)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", default=str(DATA))
    p.add_argument("--candidate", action="append", help="NAME=SPEC (see the module docstring); repeatable")
    p.add_argument("--slots", default="16,32")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--no-quality", action="store_true", help="speed only")
    p.add_argument("--no-speed", action="store_true", help="quality only")
    return p.parse_args()


if __name__ == "__main__":
    main()

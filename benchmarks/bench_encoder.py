"""Encoder candidates side by side: prompts per CPU-second and planning quality, in one run; the default by rule.

    python -m benchmarks.bench_encoder --finetuned DIR [--finetuned-static DIR] [--student DIR] [--candidate NAME=SPEC ...]
                                       [--slots 16,32] [--seeds 5]

A candidate SPEC is an `--encoder` value (folder, hub name, `static`, `onnx`, `onnx:FOLDER`, or empty
for the packaged MiniLM) with optional `@N` for inputs cut to their first N tokens, e.g.
`onnx-ft-32=onnx:/tmp/ft@32`. Without --candidate: the packaged MiniLM at 128 tokens (the proxy's
--encoder-max-seq-len), 64 and 32, and on ONNX int8 at 128 and 32; the fine-tuned MiniLM of
--finetuned as saved (64 tokens), at 128 and 32, and on ONNX int8 at 64 and 32; the distilled
static model and the fine-tuned one of --finetuned-static (all tokens); the static student of
--student (`cohort train --student static`). The fine-tuned folders
come from `cohort train` (hours of CPU: not rebuilt here).

1. Speed, on the held-out prompts (distinct texts, cache off): prompts per CPU-second and per
   wall-second of each candidate's `Embedder.encode`, torch and ONNX Runtime on 1 thread, then 2,
   beside plain `SentenceTransformer.encode(batch_size=32)` of all-MiniLM-L6-v2 in the same run
   (the baseline of the target: >= 20x per CPU-second); then cache hits (`cache_size`): a text
   seen before, and a new text whose first N tokens were seen (the truncated-token key).
2. Quality, on held-out requests only (traces.split): each candidate's profile head (the one its
   folder holds from `cohort train` when its inputs are not cut, else a head fitted here on the
   training side with its own embeddings; with --as-served, none: nearest-embedding admission, what
   the proxy does with an encoder that has no head) drives admission in the continuous replay (S slots,
   lognormal lengths, seeds) against random; beside each, its saving as a share of `--reference`'s
   with a 95% bootstrap interval over seeds (the candidates replay the same seeds, so the pair's
   ratio is far tighter than either saving's spread); the static B = 16 plan's capture as a side figure.
3. The rule: the default is the fastest candidate (1 thread, per CPU-second) that reaches 20x plain
   encode with a continuous saving, at every S, within 5% (relative) of the fine-tuned MiniLM's
   (`--reference`). Speeds from one run on a shared machine: compare the ratios, not the absolutes.
   None has passed so far; the proxy ships `static`: of the encoders that need no trained folder it
   plans at least as well as the packaged MiniLM as served (`--as-served --reference minilm`, 200
   seeds: 107% of its saving at S = 16, 240% at S = 32) at ~100x its speed.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from benchmarks.heldout import TRACES, HeldOut, data_path
from moe_cohort.traces.importers import load_traces

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SPEED_TARGET, QUALITY_TOLERANCE = 20.0, 0.05


def main() -> None:
    args = _parse()
    data = HeldOut.of(load_traces(args.traces or data_path(TRACES)))
    candidates = dict(_candidate(c) for c in (args.candidate or _default_candidates(args)))
    held_texts = list(dict.fromkeys(data.held.texts.tolist()))  # distinct, in order
    print(f"{len(data.traces)} requests, {len(data.held_idx)} held out ({len(held_texts)} distinct prompts); "
          f"{os.cpu_count()} CPUs, shared with other work: compare ratios within this run\n")
    for name, (source, cut) in candidates.items():
        print(f"  {name:<14} --encoder {source or '(packaged MiniLM)'}" + (f", first {cut} tokens" if cut else ""))
    print()
    rates = speed(candidates, held_texts, args.repeats) if not args.no_speed else {}
    savings = quality(candidates, data, args) if not args.no_quality else {}
    if rates and savings:
        choose(candidates, rates, savings, args.reference)


def _default_candidates(args) -> list[str]:
    out = ["minilm=@128", "minilm-64=@64", "minilm-32=@32", "onnx=onnx@128", "onnx-32=onnx@32"]  # 128: the proxy's
    if args.finetuned:  # `cohort train` saves its encoder at 64 tokens
        ft = args.finetuned
        out += [f"minilm-ft={ft}", f"minilm-ft-128={ft}@128", f"minilm-ft-32={ft}@32", f"onnx-ft=onnx:{ft}",
                f"onnx-ft-32=onnx:{ft}@32"]
    else:
        print("no --finetuned folder: the fine-tuned MiniLM candidates (and the quality reference) are left out")
    out += ["static=static"] + ([f"static-ft={args.finetuned_static}"] if args.finetuned_static else [])
    return out + ([f"student={args.student}"] if args.student else [])


def speed(candidates: dict, texts: list[str], repeats: int) -> dict[str, float]:
    """Prompts per CPU-second at 1 thread as multiples of plain encode, by candidate."""
    import torch

    from moe_cohort.encoder.embedding import Embedder

    ratios = {}
    print(f"speed (held-out prompts, cache off, best of {repeats}): prompts per CPU-second | per wall-second")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        base = Embedder(None)
        plain, plain_wall = _rate(lambda: base.model.encode(texts, batch_size=32, normalize_embeddings=True), len(texts), repeats)
        print(f"  {threads} thread(s): {'plain encode':<14} {plain:8.1f} | {plain_wall:8.1f}   (all-MiniLM-L6-v2, the 1x; "
              f"max {base.model.max_seq_length} tokens)")
        for name, (source, cut) in candidates.items():
            e = Embedder(source or None, max_seq_len=cut, threads=threads)
            e.encode(texts[:32])  # warm-up
            rate, wall = _rate(lambda: e.encode(texts), len(texts), repeats)
            print(f"  {threads} thread(s): {name:<14} {rate:8.1f} | {wall:8.1f}   = {rate / plain:6.1f}x plain encode"
                  f"   (max {e._max_tokens() or 'all'} tokens)")
            if threads == 1:
                ratios[name] = rate / plain
    torch.set_num_threads(2)
    _cache_hits(texts)
    return ratios


def _rate(fn, n: int, repeats: int) -> tuple[float, float]:
    cpu = wall = np.inf
    for _ in range(repeats):
        start, start_wall = time.process_time(), time.perf_counter()
        fn()
        cpu, wall = min(cpu, time.process_time() - start), min(wall, time.perf_counter() - start_wall)
    return n / cpu, n / wall


def _cache_hits(texts: list[str], cut: int = 32) -> None:
    """A text seen before (text key), and new texts that share their first `cut` tokens with one seen (token key)."""
    from moe_cohort.encoder.embedding import Embedder

    e = Embedder("static", max_seq_len=cut, cache_size=4 * len(texts))
    e.encode(texts)
    start = time.perf_counter()
    for t in texts:
        e.encode([t])
    text_hit = (time.perf_counter() - start) / len(texts)
    long = [t for t, n in zip(texts, e.token_lengths(texts)) if n >= cut]  # cut: a different ending still hits
    start = time.perf_counter()
    for t in long:
        e.encode([t + " (a different ending)"])
    token_hit = (time.perf_counter() - start) / max(len(long), 1)
    print(f"\ncache hit: a text seen before {text_hit * 1e6:.1f} us; a new text with the first {cut} tokens of one seen "
          f"{token_hit * 1e6:.1f} us (tokenizer pass + key; {len(long)} texts; static model)\n")


def quality(candidates: dict, data: HeldOut, args) -> dict[str, dict[int, float]]:
    """Continuous saving by candidate and S, on the held-out requests."""
    from moe_cohort.encoder.embedding import Embedder
    from moe_cohort.encoder.profile import load_profile_head
    from moe_cohort.eval.cost import parse_cost_model
    from moe_cohort.eval.engine import REFERENCE, evaluate_continuous, lengths_from_spec
    from moe_cohort.cli.replay import text_policies
    from moe_cohort.eval.policies import by_profile
    from moe_cohort.eval.replay import decode_tokens

    held = data.held
    tokens = decode_tokens(held)
    lengths, cost = lengths_from_spec("lognormal", held.request_ids), parse_cost_model("deepseek-v2-lite")
    policies, statics, heads, key = {REFERENCE: by_profile(data.reference)}, {}, [], {}
    for name, (source, cut) in candidates.items():
        e = Embedder(source or None, max_seq_len=cut)
        x = e.encode(list(data.traces.texts))  # [N, D]
        head = load_profile_head(e.source) if cut is None else None
        served = head is None and args.as_served  # no head of its own: admitted by nearest embedding, as served
        heads.append(f"{name} " + ("its folder" if head else "none: nearest embedding" if served else "fitted here"))
        if not served:
            head = head or data.fit_head(x)
        mine = text_policies(f"-{name}", x[data.held_idx], head)
        key[name] = f"text-nearest-{name}" if served else f"text-profile-{name}"
        policies[key[name]] = mine[key[name]]
        statics[name] = x[data.held_idx]
    print("profile heads: " + ", ".join(heads))
    savings: dict[str, dict[int, float]] = {name: {} for name in candidates}
    for slots in _ints(args.slots):
        rows = evaluate_continuous(tokens, slots, policies, lengths, cost, held.num_layers, seeds=args.seeds)["plans"]
        print(f"S = {slots}: reference saving {rows[REFERENCE]['saving']:.2%} ({args.seeds} seeds)")
        per_seed = {name: np.array(rows[key[name]]["saving_per_seed"]) for name in candidates}  # [seeds]
        for name in candidates:
            r = rows[key[name]]
            savings[name][slots] = r["saving"]
            versus = ""
            if args.reference in per_seed and name != args.reference:
                ratio, lo, hi = paired_ratio(per_seed[name], per_seed[args.reference])
                versus = f"; {ratio:.0%} of {args.reference}'s (95% interval over seeds {lo:.0%}-{hi:.0%})"
            print(f"  {name:<14} continuous saving {r['saving']:6.2%} (std {r['saving_std']:.2%}), "
                  f"{r['capture']:.0%} of the reference{versus}")
    _static_capture(held, statics)
    return savings


def paired_ratio(saving: np.ndarray, reference: np.ndarray, draws: int = 4000) -> tuple[float, float, float]:
    """mean(saving) / mean(reference) over the same seeds [S], with a 95% bootstrap interval that
    resamples seeds (both candidates replay the same arrivals and lengths per seed, so they move together)."""
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(saving), size=(draws, len(saving)))  # [draws, S]
    ratios = saving[picks].mean(axis=1) / np.maximum(reference[picks].mean(axis=1), 1e-12)  # [draws]
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return float(saving.mean() / reference.mean()), float(lo), float(hi)


def _static_capture(held, statics: dict) -> None:
    from moe_cohort.encoder.planner import plan_batches
    from moe_cohort.eval.metrics import evaluate

    planners = {name: (lambda ts_, b, x=x: plan_batches(x, b)) for name, x in statics.items()}
    rows = evaluate(held, 16, seeds=5, planners=planners)["plans"]
    print("\nstatic plans, B = 16 (side figure): " + ", ".join(
        f"{name} capture {rows[name]['capture']:.1%}" for name in statics) + f"; oracle saving {rows['oracle']['saving']:.1%}")


def choose(candidates: dict, ratios: dict[str, float], savings: dict[str, dict[int, float]], reference: str) -> None:
    """Print the rule's verdict for every candidate and the default it picks."""
    if reference not in savings:
        print(f"\nno reference candidate {reference!r} in this run: no default chosen")
        return
    ref = savings[reference]
    print(f"\nthe rule: >= {SPEED_TARGET:.0f}x plain encode (1 thread) and a continuous saving >= "
          f"{1 - QUALITY_TOLERANCE:.0%} of {reference}'s at every S ({', '.join(f'S={s}: {v:.2%}' for s, v in ref.items())})")
    passing = []
    for name in candidates:
        fast = ratios[name] >= SPEED_TARGET
        good = all(savings[name][s] >= (1 - QUALITY_TOLERANCE) * ref[s] for s in ref)
        rel = ", ".join(f"S={s}: {savings[name][s] / ref[s]:.0%}" if ref[s] > 0 else f"S={s}: n/a" for s in ref)
        print(f"  {name:<14} {ratios[name]:6.1f}x {'fast' if fast else 'slow'}, quality {rel} of the reference: "
              f"{'PASSES' if fast and good else 'fails'}")
        if fast and good:
            passing.append(name)
    if passing:
        best = max(passing, key=ratios.get)
        print(f"default: {best} (--encoder {candidates[best][0] or '(packaged MiniLM)'}), the fastest that passes")
    else:
        print("default: none passes the target; the proxy ships `static`, the better of the encoders that need "
              "no `cohort train` folder as served (compare them with --as-served --reference minilm)")


def _candidate(text: str) -> tuple[str, tuple[str, int | None]]:
    name, _, spec = text.partition("=")
    source, _, cut = spec.rpartition("@") if "@" in spec else (spec, "", "")
    return name, (source, int(cut) if cut else None)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", help=f"trace folder (default: $COHORT_DATA/{TRACES})")
    p.add_argument("--finetuned", help="folder of the fine-tuned MiniLM with its profile head (cohort train)")
    p.add_argument("--finetuned-static", help="folder of the fine-tuned static encoder with its profile head")
    p.add_argument("--student", help="folder of the static student of the fine-tuned MiniLM (cohort train --student static)")
    p.add_argument("--candidate", action="append", help="NAME=SPEC (see the module docstring); repeatable")
    p.add_argument("--reference", default="minilm-ft", help="the candidate whose saving sets the quality bar")
    p.add_argument("--slots", default="16,32")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--no-quality", action="store_true", help="speed only")
    p.add_argument("--no-speed", action="store_true", help="quality only")
    p.add_argument("--as-served", action="store_true",
                   help="a candidate without a profile head of its own is admitted by nearest embedding, as the "
                        "proxy serves it (default: a head is fitted here on the training side)")
    return p.parse_args()


if __name__ == "__main__":
    main()

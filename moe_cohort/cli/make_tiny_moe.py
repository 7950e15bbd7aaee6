"""`cohort make-tiny-moe DIR`: write a tiny random MoE model that vLLM (CPU) can serve.

`cohort make-tiny-moe --trained DIR` writes a trained one instead (devtools.train_moe: 64 experts,
top-4, routing that follows the text), trained once per recipe and cached outside git.

`--expert-width N` widens every expert of either model to intermediate size N with inert neurons
(devtools.widen: new output weights zero, so the logits stay the same): experts of real size, whose
loads cost time on a CPU. The cached trained model stays as it is; DIR gets the widened copy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

from moe_cohort.devtools.tiny_moe import ARCHITECTURES, TinyMoeArgs, make_tiny_moe


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = TinyMoeArgs()
    parser.add_argument("out_dir", metavar="DIR", help="output directory (created; files are overwritten)")
    parser.add_argument("--arch", choices=ARCHITECTURES, default=defaults.arch, help="model architecture")
    for name, help_text in (("num_layers", "MoE layers"), ("num_experts", "routed experts per layer"),
                            ("top_k", "experts per token"), ("hidden_size", "hidden size"),
                            ("num_heads", "attention heads"), ("head_dim", "head size (>= 32 for vLLM CPU)"),
                            ("seed", "random seed of the weights")):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name),
                            help=f"{help_text} (default {getattr(defaults, name)})")
    parser.add_argument("--router-scale", type=float, default=defaults.router_scale,
                        help=f"multiplier of the random router weights; larger = more decisive routing "
                             f"(default {defaults.router_scale})")
    parser.add_argument("--trained", action="store_true",
                        help="train a small MoE on code, math, chat and prose instead (cached; the shape "
                             "options above are then ignored: the recipe fixes them)")
    parser.add_argument("--recipe", choices=("full", "ci"), default="full",
                        help="with --trained: 'full' (64 experts, 4 layers; minutes) or 'ci' (small, quick)")
    parser.add_argument("--cache-dir", default=None,
                        help="with --trained: cache of trained models (default $COHORT_CACHE_DIR or "
                             "~/.cache/moe-cohort, subfolder trained-tiny-moe)")
    parser.add_argument("--no-cache", action="store_true", help="with --trained: train afresh, cache nothing")
    parser.add_argument("--expert-width", type=int, default=None, metavar="N",
                        help="widen every expert to intermediate size N (>= its own: 32 random, 64 trained) with "
                             "inert neurons (new gate/up rows random, new down columns zero: same logits), so "
                             "that expert loads cost time; weights keep the model's dtype (bf16 for both tiny "
                             "models: N=4096 with hidden 128 is 3 MiB per expert)")
    parser.add_argument("--expert-width-seed", type=int, default=0,
                        help="with --expert-width: seed of the new rows (default 0)")


def run(args: argparse.Namespace) -> int:
    if args.trained:
        return _run_trained(args)
    fields = {f.name for f in dataclasses.fields(TinyMoeArgs)}
    try:
        tiny = TinyMoeArgs(**{k: v for k, v in vars(args).items() if k in fields})
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    out = _build_maybe_widened(args, lambda d: make_tiny_moe(d, tiny))
    if out is None:
        return 2
    summary = json.loads((out / "cohort_tiny_moe.json").read_text())
    print(f"wrote {summary['arch']} to {out}: {summary['num_layers']} MoE layers, {summary['num_experts']} experts, "
          f"top-{summary['top_k']}, {summary['num_parameters']:,} parameters, vocab {summary['vocab_size']}")
    print(f"serve: python -m vllm.entrypoints.openai.api_server --model {out} --served-model-name tiny "
          f"--enforce-eager --max-model-len 1024  (with VLLM_CPU_KVCACHE_SPACE=1 on CPU)")
    return 0


def _run_trained(args: argparse.Namespace) -> int:
    import logging

    from moe_cohort.devtools.train_moe import RECIPES, train_tiny_moe

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out = _build_maybe_widened(args, lambda d: train_tiny_moe(d, RECIPES[args.recipe], cache_dir=args.cache_dir,
                                                               use_cache=not args.no_cache))
    if out is None:
        return 2
    s = json.loads((out / "cohort_tiny_moe.json").read_text())
    print(f"wrote trained {s['arch']} ({args.recipe}) to {out}: {s['num_layers']} MoE layers, {s['num_experts']} "
          f"experts, top-{s['top_k']}, {s['num_parameters']:,} parameters, vocab {s['vocab_size']}")
    print(f"trained {s['train_tokens']:,} tokens in {s['train_seconds']:.0f}s wall ({s['train_cpu_seconds']:.0f}s CPU), "
          f"peak RSS {s['peak_rss_mb']:.0f} MB, {s['size_on_disk_bytes'] / 2**20:.1f} MiB on disk, "
          f"final LM loss {s['lm_losses'][-1]:.3f}")
    return 0


def _build_maybe_widened(args: argparse.Namespace, build) -> Path | None:
    """`build(dir)` into DIR; with --expert-width, into a scratch folder beside DIR, then widened into DIR.
    None (after printing the error) when the width is refused."""
    if args.expert_width is None:
        return build(args.out_dir)
    from moe_cohort.devtools.widen import expert_size_bytes, widen_experts

    out = Path(args.out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".make-tiny-moe-", dir=out.parent) as tmp:
        src = build(Path(tmp) / "model")
        before, width_before, count = expert_size_bytes(src)
        try:
            widen_experts(src, out, args.expert_width, seed=args.expert_width_seed)
        except ValueError as exc:
            print(f"error: {exc}")
            return None
    after, width_after, _ = expert_size_bytes(out)
    print(f"experts widened from {width_before} to {width_after}: {before / 1e6:.3f} MB -> {after / 1e6:.3f} MB "
          f"each, {count * before / 1e6:.1f} MB -> {count * after / 1e6:.1f} MB for all {count}")
    return out

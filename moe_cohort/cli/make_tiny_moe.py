"""`cohort make-tiny-moe DIR`: write a tiny random MoE model that vLLM (CPU) can serve.

`cohort make-tiny-moe --trained DIR` writes a trained one instead (devtools.train_moe: 64 experts,
top-4, routing that follows the text), trained once per recipe and cached outside git.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

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


def run(args: argparse.Namespace) -> int:
    if args.trained:
        return _run_trained(args)
    fields = {f.name for f in dataclasses.fields(TinyMoeArgs)}
    try:
        tiny = TinyMoeArgs(**{k: v for k, v in vars(args).items() if k in fields})
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    out = make_tiny_moe(args.out_dir, tiny)
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
    out = train_tiny_moe(args.out_dir, RECIPES[args.recipe], cache_dir=args.cache_dir, use_cache=not args.no_cache)
    s = json.loads((out / "cohort_tiny_moe.json").read_text())
    print(f"wrote trained {s['arch']} ({args.recipe}) to {out}: {s['num_layers']} MoE layers, {s['num_experts']} "
          f"experts, top-{s['top_k']}, {s['num_parameters']:,} parameters, vocab {s['vocab_size']}")
    print(f"trained {s['train_tokens']:,} tokens in {s['train_seconds']:.0f}s wall ({s['train_cpu_seconds']:.0f}s CPU), "
          f"peak RSS {s['peak_rss_mb']:.0f} MB, {s['size_on_disk_bytes'] / 2**20:.1f} MiB on disk, "
          f"final LM loss {s['lm_losses'][-1]:.3f}")
    return 0

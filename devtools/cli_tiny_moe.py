"""`cohort make-tiny-moe DIR`: write a tiny random MoE model that vLLM (CPU) can serve."""

from __future__ import annotations

import argparse
import dataclasses
import json

from devtools.tiny_moe import ARCHITECTURES, TinyMoeArgs, make_tiny_moe


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


def run(args: argparse.Namespace) -> int:
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

"""`cohort traces`: inspect trace files and convert other layouts to the moe-cohort format."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from moe_cohort.traces.format import TraceFormatError, TraceSet, save_traces
from moe_cohort.traces.importers import drop_leading_tokens, load_traces


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    info = sub.add_parser("info", help="print the shape and size of a trace set")
    info.add_argument("path", help="trace file or directory (any layout `cohort eval --traces` accepts)")
    imp = sub.add_parser("import", help="convert a trace directory or .jsonl to a moe-cohort .npz")
    imp.add_argument("path", help="traces.npz+prompts.jsonl directory, directory of router .json files (one per "
                                  "prompt, the GPT-OSS-MoE-ExpertFingerprinting layout), .jsonl of records, or 'sample'")
    imp.add_argument("--output", "-o", required=True, help="where to write the .npz")
    imp.add_argument("--num-experts", type=_positive_int,
                     help="experts per layer (default: meta.json's, else 32 for router .json files, else largest id + 1)")
    imp.add_argument("--drop-leading-tokens", type=_count, default=0, metavar="N",
                     help="drop the first N routed tokens of every request, such as the chat-template tokens every "
                          "answer starts with (default: 0)")


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return int(text)


def run(args: argparse.Namespace) -> int:
    if args.action == "import" and Path(args.output).is_dir():
        print(f"cohort traces: error: --output {args.output} is a folder; give a file path such as "
              f"{Path(args.output) / 'traces.npz'}")
        return 2
    try:
        ts = load_traces(args.path, num_experts=getattr(args, "num_experts", None))
        if args.action == "import":
            ts = drop_leading_tokens(ts, args.drop_leading_tokens)
            print(f"wrote {save_traces(args.output, ts)} ({len(ts)} requests)")
        else:
            print(describe(ts))
    except (TraceFormatError, OSError) as exc:
        print(f"cohort traces: error: {exc}")
        return 2
    return 0


def describe(ts: TraceSet) -> str:
    n_tok = ts.num_tokens if len(ts) else np.zeros(1, np.int64)
    return "\n".join([
        f"model        {ts.model or '-'}",
        f"requests     {len(ts)}",
        f"experts      {ts.num_experts} per layer, top-{ts.top_k}, {ts.num_layers} MoE layers",
        f"tokens       {int(n_tok.sum())} ({int(ts.num_prompt_tokens.sum())} prompt, {int(ts.num_decode_tokens.sum())} generated)",
        f"per request  min {int(n_tok.min())}, median {float(np.median(n_tok)):g}, max {int(n_tok.max())}",
        f"has          {', '.join(n for n in ('weights', 'texts', 'categories') if getattr(ts, n) is not None) or 'ids only'}",
    ])

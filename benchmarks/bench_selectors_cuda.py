"""GPU half of `python -m benchmarks.bench_selectors --device cuda`: CUDA-graph timings.

For every configuration and policy: GPU microseconds per call inside a CUDA graph for the Triton
kernels (`select_experts` on CUDA) and for the torch selectors (`engine.selection.SELECTORS`),
and whether each call runs without host synchronisation (`torch.cuda.set_sync_debug_mode("error")`
around an eager call). A path that synchronises, or copies host data to the device per call, cannot
be captured; it is reported as such and not timed.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import torch

from moe_cohort.engine.policy import parse_policy
from moe_cohort.engine.selection import SELECTORS, select_experts, select_topk
from moe_cohort.engine.selection.base import context_for

CALLS_PER_GRAPH, REPLAYS, ROUNDS = 10, 20, 5


def sync_free(fn) -> bool:
    """Whether one eager call runs with no host synchronisation (after a warm-up call)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return True
    except RuntimeError:
        return False
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


def capture(fn) -> torch.cuda.CUDAGraph:
    """A CUDA graph of CALLS_PER_GRAPH calls of fn (warmed up on a side stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_us(graphs: list) -> list[float]:
    """GPU microseconds per call of each captured graph: best over interleaved rounds."""
    best = [float("inf")] * len(graphs)
    for _ in range(ROUNDS):
        for i, graph in enumerate(graphs):
            if graph is None:
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(REPLAYS):
                graph.replay()
            end.record()
            end.synchronize()
            best[i] = min(best[i], start.elapsed_time(end) * 1e3 / (REPLAYS * CALLS_PER_GRAPH))
    return best


def bench_config(num_tokens, num_experts, calib, make_logits, policies, top_k, spec_len, gpus):
    """Rows (policy, kernel us, kernel sync-free, torch us or None, torch sync-free, distinct)."""
    torch.manual_seed(num_tokens * 1000 + num_experts)
    logits = make_logits(num_tokens, num_experts).cuda()
    spans = [(s, min(s + spec_len, num_tokens)) for s in range(0, num_tokens, spec_len)]
    context = dict(request_spans=spans, expert_groups=[e * gpus // num_experts for e in range(num_experts)])
    texts = ["topk"] + policies(num_tokens, num_experts, calib)
    rows = []
    base = capture(lambda: select_topk(logits, top_k))
    for text in texts:
        policy = parse_policy(text)
        fused = functools.partial(select_experts, logits, top_k, policy, **context)
        reference = functools.partial(SELECTORS[policy.name], logits, top_k, policy,
                                      **context_for(policy.name, **context))
        fused_ok, ref_ok = sync_free(fused), sync_free(reference)
        graphs = [capture(fused) if fused_ok else None, capture(reference) if ref_ok else None]
        _, fused_us, ref_us = graph_us([base, *graphs])
        distinct = fused()[1].unique().numel()
        rows.append((text, fused_us, fused_ok, ref_us if ref_ok else None, ref_ok, distinct))
        del graphs
    return graph_us([base])[0], rows


def print_rows(num_tokens, num_experts, base_us, rows, calib) -> float:
    """Print one configuration; return the worst kernel ratio to topk."""
    print(f"\nT={num_tokens} E={num_experts}  (topk routing: {base_us:.1f} us per call in a CUDA graph)")
    print(f"  {'policy':44s} {'kernel us':>9s} {'vs topk':>8s} {'sync-free':>9s} {'torch us':>9s} "
          f"{'vs topk':>8s} {'distinct':>8s}")
    worst = 0.0
    for text, fused_us, fused_ok, ref_us, ref_ok, distinct in rows:
        label = text.replace(calib, "<counts.json>")
        ratio = fused_us / base_us
        worst = max(worst, ratio) if text != "topk" else worst
        torch_cell = f"{ref_us:9.1f} {ref_us / base_us:7.2f}x" if ref_ok else f"{'no graph':>9s} {'(sync)':>8s}"
        print(f"  {label:44s} {fused_us:9.1f} {ratio:7.2f}x {str(fused_ok):>9s} {torch_cell} {distinct:8d}")
    return worst


def bench_cuda(args, make_logits, policies, top_k, spec_len, gpus) -> int:
    configs = [(256, 128)] if args.quick else [(t, e) for t in args.tokens for e in args.experts]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, top_k={top_k}, float32 logits; "
          f"GPU us per call in a CUDA graph ({CALLS_PER_GRAPH} calls per graph, best of {ROUNDS} rounds "
          f"of {REPLAYS} replays); 'kernel' = Triton (select_experts on CUDA), 'torch' = SELECTORS")
    def one(num_tokens, num_experts, calib):
        base_us, rows = bench_config(num_tokens, num_experts, calib, make_logits, policies, top_k, spec_len, gpus)
        return print_rows(num_tokens, num_experts, base_us, rows, calib)

    report_target(over_configs(configs, one), "every kernel selector <= 1.5x topk in a CUDA graph", 1.5)
    return 0


def over_configs(configs, one) -> dict:
    """{(T, E): worst ratio} of `one(T, E, calib)` per configuration, with a static calibration file per E."""
    worst = {}
    with tempfile.TemporaryDirectory() as tmp:
        for num_tokens, num_experts in configs:
            calib = str(Path(tmp) / f"counts{num_experts}.json")
            Path(calib).write_text(json.dumps(torch.randperm(num_experts).tolist()))
            worst[num_tokens, num_experts] = one(num_tokens, num_experts, calib)
    return worst


def report_target(worst: dict, what: str, limit: float) -> None:
    """The target line, when T=256, E=128 ran."""
    if (256, 128) in worst:
        ratio = worst[256, 128]
        print(f"\ntarget ({what} at T=256, E=128): worst {ratio:.2f}x -> {'met' if ratio <= limit else 'MISSED'}")

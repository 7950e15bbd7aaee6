"""Time a whole MoE decode step with plain top-k routing and with each batch-aware selector.

The net effect of a selector is its own GPU time minus the expert weight reads it saves; this
harness measures it instead of inferring it. A gpt-fast-style decoder with the shapes of
transformers' `Qwen3MoeConfig` (defaults: Qwen3-30B-A3B-like, 128 experts, top-8, hidden 2048,
expert width 768; `--layers` sets the depth) and random bf16 weights runs one decode step for a
batch of B sequences: per layer RMSNorm, QKV, q/k-norm, a static KV cache (write at the step's
position, SDPA over the cache), the router, the selector under test, and the experts as two
bf16 grouped GEMMs (`torch._grouped_mm`) over the experts the batch touches (an expert no token
uses is never read), then the final norm and LM head. The whole step is captured in one CUDA
graph and replayed; CUDA events time the replays.

Random router weights route almost uniformly; real routers are skewed, so by default each layer
adds a fixed Dirichlet(0.3) expert-popularity bias to its router logits (as bench_selectors'
synthetic logits; `--no-skew` turns it off). Printed per (B, policy): ms per step, ratio to
top-k, and mean distinct experts per layer. Target (issue 15): at the papers' operating points
(xshare m=24, oea k0=4, moe-spec budget=32 on 128 experts, B = 32-64) the step is faster than
top-k's. A policy written `torch:NAME...` runs the torch selector instead of the Triton kernels.

    python -m benchmarks.bench_decode_step [--layers 24] [--batch 32 64]
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch.distributions import Dirichlet

from moe_cohort.engine.policy import parse_policy
from moe_cohort.engine.selection import SELECTORS, select_experts, select_topk

POLICIES = ["topk", "xshare;m=24;k0=1", "oea;k0=4", "moe-spec;budget=32", "moe-spec;budget=32;cover=substitute",
            "moe-spec;budget=32;rank=topk", "lynx-lat;drop=32", "oea;k0=1;p=0.6;max_p=16", "torch:xshare;m=24;k0=1"]


def model_shapes(layers: int) -> dict:
    """Qwen3-MoE shapes from transformers' config (its defaults), depth overridden."""
    try:
        from transformers import Qwen3MoeConfig

        cfg = Qwen3MoeConfig()
        shapes = dict(hidden=cfg.hidden_size, heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                      head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                      experts=cfg.num_experts, top_k=cfg.num_experts_per_tok, width=cfg.moe_intermediate_size,
                      vocab=cfg.vocab_size, eps=cfg.rms_norm_eps, source="transformers.Qwen3MoeConfig()")
    except ImportError:
        shapes = dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8, width=768,
                      vocab=151936, eps=1e-6, source="Qwen3-30B-A3B shapes (transformers not installed)")
    shapes["layers"] = layers
    return shapes


class Layer:
    """One decoder layer's random weights and its static KV cache."""

    def __init__(self, s: dict, batch: int, cache_len: int, skew: bool, dev: torch.device) -> None:
        h, d, dt = s["hidden"], s["head_dim"], torch.bfloat16

        def w(*shape):
            return torch.randn(*shape, device=dev, dtype=dt) / math.sqrt(shape[-1])

        self.qkv = w((s["heads"] + 2 * s["kv_heads"]) * d, h)
        self.o = w(h, s["heads"] * d)
        self.gate = w(s["experts"], h)
        self.w13 = w(s["experts"], 2 * s["width"], h)       # [E, 2I, H]
        self.w2 = w(s["experts"], h, s["width"])            # [E, H, I]
        popularity = 0.9 * Dirichlet(torch.full((s["experts"],), 0.3)).sample() + 0.1 / s["experts"]
        self.bias = (popularity.log() if skew else torch.zeros(s["experts"])).to(dev)
        self.k_cache = torch.zeros(batch, s["kv_heads"], cache_len, d, device=dev, dtype=dt)
        self.v_cache = torch.zeros_like(self.k_cache)


def attention(x, layer: Layer, s: dict, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x [B, H] -> [B, H]: one new token per sequence against the static cache."""
    b, d, nh, nkv = x.shape[0], s["head_dim"], s["heads"], s["kv_heads"]
    q, k, v = (x @ layer.qkv.T).split([nh * d, nkv * d, nkv * d], dim=-1)
    q = F.rms_norm(q.view(b, nh, 1, d), (d,), eps=s["eps"])
    k = F.rms_norm(k.view(b, nkv, 1, d), (d,), eps=s["eps"])
    layer.k_cache.index_copy_(2, pos, k)
    layer.v_cache.index_copy_(2, pos, v.view(b, nkv, 1, d))
    out = F.scaled_dot_product_attention(q, layer.k_cache, layer.v_cache, attn_mask=mask, enable_gqa=True)
    return out.reshape(b, nh * d) @ layer.o.T


def experts(x, layer: Layer, weights, ids, num_experts: int) -> torch.Tensor:
    """x [B, H], weights/ids [B, k] -> [B, H] via grouped GEMMs over the touched experts only."""
    flat = ids.reshape(-1)                                              # [B*k]
    order = flat.argsort(stable=True)
    token = order // ids.shape[1]
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)                          # [E] group ends
    h = torch._grouped_mm(x[token], layer.w13.transpose(-2, -1), offs=offs)   # [B*k, 2I]
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, layer.w2.transpose(-2, -1), offs=offs)  # [B*k, H]
    y = y * weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)


def decode_step(x, layers, s, head, pos, mask, route, distinct):
    """One decode step; `route(logits)` -> (weights, ids); distinct [L] gets each layer's union size."""
    for i, layer in enumerate(layers):
        x = x + attention(F.rms_norm(x, (s["hidden"],), eps=s["eps"]), layer, s, pos, mask)
        h = F.rms_norm(x, (s["hidden"],), eps=s["eps"])
        weights, ids = route(h @ layer.gate.T + layer.bias)             # [B, k] each
        distinct[i] = torch.zeros(s["experts"], device=x.device).index_fill_(0, ids.reshape(-1), 1).sum()
        x = x + experts(h, layer, weights, ids, s["experts"])
    return F.rms_norm(x, (s["hidden"],), eps=s["eps"]) @ head.T


def time_policy(text, x, layers, s, head, pos, mask, replays: int) -> tuple[float, float]:
    """(ms per decode step in a CUDA graph, mean distinct experts per layer) for one policy."""
    policy = parse_policy(text.removeprefix("torch:"))

    def route(logits):
        if text == "topk":
            return select_topk(logits, s["top_k"])
        if text.startswith("torch:"):   # the torch selector on the GPU, for comparison
            return SELECTORS[policy.name](logits, s["top_k"], policy)
        return select_experts(logits, s["top_k"], policy)

    distinct = torch.zeros(len(layers), device=x.device)
    step = lambda: decode_step(x, layers, s, head, pos, mask, route, distinct)  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / replays)
    return best, distinct.mean().item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--context", type=int, default=1024, help="static KV cache length")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--no-skew", dest="skew", action="store_false")
    parser.add_argument("--policies", nargs="+", default=POLICIES)
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    s = model_shapes(args.layers)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; shapes: {s['source']} "
          f"(E={s['experts']}, top_k={s['top_k']}, hidden={s['hidden']}, expert width={s['width']}), "
          f"{args.layers} layers, KV cache {args.context}, router skew {'on' if args.skew else 'off'}; "
          f"whole decode step in one CUDA graph, best of 5 x {args.replays} replays")
    for batch in args.batch:
        layers = [Layer(s, batch, args.context, args.skew, dev) for _ in range(args.layers)]
        head = torch.randn(s["vocab"], s["hidden"], device=dev, dtype=torch.bfloat16) / math.sqrt(s["hidden"])
        x = torch.randn(batch, s["hidden"], device=dev, dtype=torch.bfloat16)
        position = args.context - 8
        pos = torch.tensor([position], device=dev)
        mask = (torch.arange(args.context, device=dev) <= position).view(1, 1, 1, -1)
        print(f"\nB={batch}\n  {'policy':40s} {'ms/step':>8s} {'vs topk':>8s} {'distinct/layer':>15s}")
        base = None
        for text in args.policies:
            ms, distinct = time_policy(text, x, layers, s, head, pos, mask, args.replays)
            base = ms if base is None else base
            print(f"  {text:40s} {ms:8.3f} {ms / base:7.3f}x {distinct:15.1f}", flush=True)
        del layers, head
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

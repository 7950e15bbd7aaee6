"""Expert loads as time: vLLM CPU's fused MoE kernel on the trained tiny MoE widened to experts of real size.

The trained tiny MoE (64 experts, top-4, hidden 128, 4 layers) has experts of intermediate size 64
(48 KB in bf16): vLLM CPU's fused MoE then costs the same whatever number of distinct experts u a
step touches. Widened with inert neurons (devtools.widen: same logits and routing) to `--width`
(default 4096, 3 MiB per expert), the kernel reads u experts' weights and its time grows with u.
This script builds the widened copy in a temporary folder (from `ensure_trained_model`) and prints:

1. the MoE layer's time per call against u (16 tokens, top-4; routing forced so that the batch
   touches exactly u experts, a fresh random set of them per call, layers taken in turn so that
   caches hold no weights from the call before) and the least-squares fit t = a + b*u, for the
   widened model and for the original one;
2. one decode step of 16 sequences (static KV cache of `--context` positions): per layer RMSNorm,
   attention (`bench_decode_step.attention`: QKV, q/k-norm, cache write, SDPA), the router, and the
   fused MoE on the routing the trained model itself chose at a real decode step of 16 held-out
   prompts (transformers, original model: widening keeps the routing), then the LM head; printed:
   ms per step, the MoE layers' ms and their share. This is the model's own compute: a vLLM step
   adds its scheduler, input preparation and sampling on top, so the MoE's share of vLLM's wall
   time is smaller.

The kernel is vLLM's `cpu_fused_moe` on weights prepacked as vLLM prepacks them, with the ISA vLLM
would pick on this CPU; without vLLM, a loop over the touched experts as transformers' eager experts
run. Times are medians over repetitions, on `--threads` threads (default 1). Numbers only.

    python -m benchmarks.bench_wide_moe [--width 4096] [--tokens 16] [--us 4 8 16 32 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.bench_decode_step import attention


def fused_moe_backend():
    """(name, isa, prepack, call) of vLLM's CPU fused MoE as vLLM picks it here, else a torch loop."""
    try:
        from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
                                                                          ArmCPUUnquantizedExperts, CPUUnquantizedExperts, PowerCPUUnquantizedExperts, X86CPUUnquantizedExperts)
    except ImportError:
        return "torch loop over touched experts (vLLM not importable)", None, lambda w: w, _torch_experts
    order = (X86CPUUnquantizedExperts, ArmCPUUnquantizedExperts, PowerCPUUnquantizedExperts, CPUUnquantizedExperts)
    isa = next(cls.isa for cls in order if cls._supports_current_device())

    def call(x, w13, w2, weights, ids):
        out = torch.empty_like(x)
        cpu_fused_moe(out, x, w13, w2, None, None, weights, ids, "silu", isa)
        return out

    return f"vLLM cpu_fused_moe (isa {isa})", isa, lambda w: cpu_prepack_moe_weight(w, isa), call


def _torch_experts(x, w13, w2, weights, ids):
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights/ids [T, k] -> [T, H]."""
    out = torch.zeros_like(x, dtype=torch.float32)
    for e in ids.unique().tolist():
        token, slot = (ids == e).nonzero(as_tuple=True)
        gate, up = (x[token] @ w13[e].T).chunk(2, dim=-1)
        out.index_add_(0, token, ((F.silu(gate) * up) @ w2[e].T).float() * weights[token, slot, None])
    return out.to(x.dtype)


def load_layers(model_dir: Path, prepack, context: int, batch: int) -> tuple[list, dict, dict]:
    """(per layer weights, {embed, norm, head}, shapes) of a qwen3_moe folder; experts stacked as vLLM
    stacks them (w13 = [gate; up]) and prepacked; a static KV cache [B, kv, C, d] per layer."""
    from safetensors import safe_open

    cfg = json.loads((model_dir / "config.json").read_text())
    s = dict(hidden=cfg["hidden_size"], heads=cfg["num_attention_heads"], kv_heads=cfg["num_key_value_heads"],
             head_dim=cfg["head_dim"], eps=cfg["rms_norm_eps"], top_k=cfg["num_experts_per_tok"],
             experts=cfg.get("num_experts", cfg.get("num_local_experts")), width=cfg["moe_intermediate_size"])
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        def t(name):
            return f.get_tensor(name)

        layers = []
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            experts = [p + f"mlp.experts.{e}." for e in range(s["experts"])]
            w13 = torch.stack([torch.cat([t(e + "gate_proj.weight"), t(e + "up_proj.weight")]) for e in experts])
            w2 = torch.stack([t(e + "down_proj.weight") for e in experts])  # [E, H, I]
            cache = torch.randn(batch, s["kv_heads"], context, s["head_dim"], dtype=torch.bfloat16)
            layers.append(SimpleNamespace(
                qkv=torch.cat([t(p + "self_attn.q_proj.weight"), t(p + "self_attn.k_proj.weight"),
                               t(p + "self_attn.v_proj.weight")]),
                o=t(p + "self_attn.o_proj.weight"), in_norm=t(p + "input_layernorm.weight"),
                post_norm=t(p + "post_attention_layernorm.weight"), router=t(p + "mlp.gate.weight"),
                w13=prepack(w13.contiguous()), w2=prepack(w2.contiguous()),  # [E, 2I, H], [E, H, I]
                k_cache=cache, v_cache=cache.clone()))
        top = dict(embed=t("model.embed_tokens.weight"), norm=t("model.norm.weight"), head=t("lm_head.weight"))
    return layers, top, s


def forced_routing(u: int, tokens: int, top_k: int, num_experts: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, ids [T, k] int32) touching exactly u experts (a random set of them), each
    token k distinct ones: slot j of token t takes the ((t * k + j) mod u)-th chosen expert."""
    assert top_k <= u <= min(num_experts, tokens * top_k), u
    chosen = torch.randperm(num_experts, generator=gen)[:u]
    slots = torch.arange(tokens * top_k).reshape(tokens, top_k) % u
    return torch.full((tokens, top_k), 1.0 / top_k), chosen[slots].to(torch.int32).contiguous()


def time_moe_vs_u(layers, s, call, us, tokens: int, reps: int) -> dict[int, float]:
    """u -> median ms of one MoE layer call on `tokens` tokens; layers in turn, fresh experts per call."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, s["hidden"], generator=gen).to(torch.bfloat16)
    result = {}
    for u in us:
        times = []
        for r in range(reps + len(layers)):  # the first round over the layers warms up
            layer = layers[r % len(layers)]
            weights, ids = forced_routing(u, tokens, s["top_k"], s["experts"], gen)
            t0 = time.perf_counter()
            call(x, layer.w13, layer.w2, weights, ids)
            if r >= len(layers):
                times.append(time.perf_counter() - t0)
        result[u] = 1e3 * statistics.median(times)
    return result


def fit_line(us, ms) -> tuple[float, float, float]:
    """(a, b, R^2) of the least-squares t = a + b*u."""
    b, a = np.polyfit(np.asarray(us, float), np.asarray(ms, float), 1)
    pred = a + b * np.asarray(us, float)
    ss = float(((np.asarray(ms) - np.mean(ms)) ** 2).sum())
    return float(a), float(b), 1 - float(((np.asarray(ms) - pred) ** 2).sum()) / ss if ss else 1.0


def decode_routing(model_dir: Path, tokens: int, context: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (weights [T, k] float32, ids [T, k] int32) the model's routers choose for the first
    generated token of `tokens` held-out prompts (kinds in turn), each cut to `context` - 1 tokens."""
    import transformers

    from benchmarks.routing_mi import chat_prompt
    from moe_cohort.devtools.corpus import CorpusArgs, build_corpus

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    k = model.config.num_experts_per_tok
    docs = build_corpus(CorpusArgs()).heldout
    kinds = sorted({d.kind for d in docs})
    picked = [[d for d in docs if d.kind == kind] for kind in kinds]
    prompts = [picked[i % len(kinds)][i // len(kinds)] for i in range(tokens)]
    per_token = []  # T x L x [E]
    with torch.no_grad():
        for d in prompts:
            text = d.text if d.category in ("stdlib", "pydoc") else chat_prompt(d.text)
            ids = tok(text, return_tensors="pt").input_ids[:, : context - 1]  # [1, S]
            out = model(ids, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)  # [1, 1]
            step = model(nxt, past_key_values=out.past_key_values, output_router_logits=True)
            per_token.append([logits.reshape(-1).float() for logits in step.router_logits])
    routing = []
    for layer in range(len(per_token[0])):
        probs = torch.softmax(torch.stack([t[layer] for t in per_token]), dim=-1)  # [T, E]
        weights, ids = probs.topk(k, dim=-1)
        routing.append(((weights / weights.sum(-1, keepdim=True)).contiguous(), ids.to(torch.int32).contiguous()))
    return routing


def time_decode_step(layers, top, s, call, routing, context: int, reps: int) -> tuple[float, float]:
    """(median ms of one decode step, median ms of its MoE calls) for B = len(routing[0][1]) sequences."""
    batch, h = routing[0][1].shape[0], s["hidden"]
    pos = torch.tensor([context - 1])
    mask = torch.ones(1, 1, 1, context, dtype=torch.bool)
    tokens = torch.arange(batch) + 10

    def step():
        moe = 0.0
        x = top["embed"][tokens]  # [B, H]
        for layer, (weights, ids) in zip(layers, routing):
            x = x + attention(F.rms_norm(x, (h,), layer.in_norm, s["eps"]), layer, s, pos, mask)
            y = F.rms_norm(x, (h,), layer.post_norm, s["eps"])
            torch.softmax((y @ layer.router.T).float(), dim=-1).topk(s["top_k"], dim=-1)  # cost only: the
            t0 = time.perf_counter()                                 # recorded real routing is used instead
            x = x + call(y, layer.w13, layer.w2, weights, ids)
            moe += time.perf_counter() - t0
        F.rms_norm(x, (h,), top["norm"], s["eps"]) @ top["head"].T  # [B, V]
        return moe

    steps, moes = [], []
    for r in range(reps + 2):
        t0 = time.perf_counter()
        moe = step()
        if r >= 2:
            steps.append(time.perf_counter() - t0)
            moes.append(moe)
    return 1e3 * statistics.median(steps), 1e3 * statistics.median(moes)


def report_model(name: str, model_dir: Path, args, backend, routing) -> None:
    label, _, prepack, call = backend
    layers, top, s = load_layers(model_dir, prepack, args.context, args.tokens)
    expert_mb = 3 * s["hidden"] * s["width"] * layers[0].w13.element_size() / 1e6
    print(f"\n{name}: expert width {s['width']}, {expert_mb:.3f} MB per expert (bf16), {len(layers)} layers x "
          f"{s['experts']} experts = {expert_mb * s['experts'] * len(layers):.1f} MB of experts")
    us = [u for u in args.us if s["top_k"] <= u <= min(s["experts"], args.tokens * s["top_k"])]
    ms = time_moe_vs_u(layers, s, call, us, args.tokens, args.reps)
    print(f"  MoE layer, {args.tokens} tokens top-{s['top_k']}, forced to touch u experts: "
          + ", ".join(f"u={u}: {t:.3f} ms" for u, t in ms.items()))
    a, b, r2 = fit_line(list(ms), list(ms.values()))
    print(f"  fit: t = {a:.3f} + {b:.4f} x u ms per layer (R^2 {r2:.3f}); at u=64 the part that grows with u is "
          f"{(b * 64) / (a + b * 64):.0%} of the layer's time")
    step_ms, moe_ms = time_decode_step(layers, top, s, call, routing, args.context, args.reps)
    distinct = [len(set(ids.reshape(-1).tolist())) for _, ids in routing]
    print(f"  decode step, {args.tokens} sequences, context {args.context}, the model's own routing "
          f"(distinct experts per layer {distinct}, mean {np.mean(distinct):.1f}): {step_ms:.2f} ms per step, "
          f"MoE layers {moe_ms:.2f} ms = {moe_ms / step_ms:.0%} of the step; the fit predicts "
          f"{sum(a + b * u for u in distinct):.2f} ms for the MoE layers")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=4096, help="expert intermediate size after widening")
    parser.add_argument("--tokens", type=int, default=16, help="tokens (sequences) per decode step")
    parser.add_argument("--us", type=int, nargs="+", default=[4, 8, 16, 32, 64], help="distinct experts forced")
    parser.add_argument("--context", type=int, default=256, help="KV cache positions per sequence")
    parser.add_argument("--reps", type=int, default=20, help="timed repetitions (median)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model-dir", default=None, help="trained model folder (default: ensure_trained_model's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from moe_cohort.devtools.widen import widen_experts
    from moe_cohort.embedded.backend import ensure_trained_model

    backend = fused_moe_backend()
    trained = ensure_trained_model(args.model_dir)
    print(f"torch {torch.__version__}, {args.threads} thread(s); kernel: {backend[0]}; "
          f"model: trained tiny MoE {trained}")
    routing = decode_routing(trained, args.tokens, args.context)
    with tempfile.TemporaryDirectory(prefix="wide-moe-") as tmp:
        t0 = time.perf_counter()
        wide = widen_experts(trained, Path(tmp) / "wide", args.width)
        print(f"widened to {args.width} in {time.perf_counter() - t0:.1f} s")
        report_model("widened", wide, args, backend, routing)
    report_model("original", trained, args, backend, routing)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

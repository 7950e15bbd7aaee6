"""Modelled decode-step time: t = a(T) + b * u per MoE layer, plus the rest of the step.

The model (its coefficients per served model are measurements: docs/results.md and docs/design.md): one
MoE layer with u distinct experts takes a + b*u microseconds (bf16 grouped GEMM over the touched
experts only, CUDA graph, weights read from HBM); a grows with the step's tokens T (from a(8) to
a(128), interpolated linearly in T and held flat outside), b is the per-expert weight read. The
MoE blocks are a share `moe_share` of a whole decode step, so by default the non-MoE part of a step
is (1 / moe_share - 1) times the MoE time of a random-order step at the same S: a fixed cost per
step that no admission order changes. `non_moe_us` sets it explicitly instead.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

TOKENS_SMALL, TOKENS_LARGE = 8, 128


@dataclass(frozen=True)
class CostModel:
    name: str
    a_small: float  # us per MoE layer at T = 8 tokens in the step
    a_large: float  # us per MoE layer at T = 128
    b: float  # us per distinct expert per layer
    moe_share: float = 0.73  # MoE share of a random-order step, when non_moe_us is None
    non_moe_us: float | None = None  # us per step outside the MoE blocks

    def a(self, tokens: np.ndarray) -> np.ndarray:
        """Fixed cost per MoE layer at `tokens` tokens per step (linear between T = 8 and 128)."""
        return np.interp(tokens, [TOKENS_SMALL, TOKENS_LARGE], [self.a_small, self.a_large])

    def moe_us(self, steps: np.ndarray, tokens: np.ndarray, loads: np.ndarray, num_layers: int) -> float:
        """MoE time of spans of `steps` [K] steps with `tokens` [K] per step and `loads` [K] summed loads."""
        return float((steps * num_layers * self.a(tokens)).sum() + self.b * loads.sum())


PRESETS = {
    "deepseek-v2-lite": CostModel("deepseek-v2-lite", 59.0, 108.0, 6.35),  # 64 experts, top-6
    "qwen3-30b-a3b": CostModel("qwen3-30b-a3b", 58.0, 115.0, 3.5),  # 128 experts, top-8
    "qwen3.5-35b-a3b": CostModel("qwen3.5-35b-a3b", 58.0, 111.0, 2.42),  # 256 experts, top-8
    "mixtral": CostModel("mixtral", 61.0, 125.0, 129.0),  # Mixtral-8x7B: 8 experts, top-2
}
DEFAULT_COST_MODEL = "deepseek-v2-lite"


def parse_cost_model(text: str, non_moe_us: float | None = None, moe_share: float | None = None) -> CostModel:
    """A preset name, or explicit coefficients "A8,A128,B" (us); optional overrides of the non-MoE part."""
    if text in PRESETS:
        model = PRESETS[text]
    else:
        try:
            a_small, a_large, b = (float(v) for v in text.split(","))
        except ValueError:
            raise ValueError(f"cost model must be one of {sorted(PRESETS)} or 'A8,A128,B' in us, got {text!r}") from None
        if min(a_small, a_large, b) < 0:
            raise ValueError(f"cost coefficients must be >= 0, got {text!r}")
        model = CostModel("custom", a_small, a_large, b)
    if moe_share is not None and not 0 < moe_share <= 1:
        raise ValueError(f"moe share must lie in (0, 1], got {moe_share}")
    return replace(model, non_moe_us=non_moe_us if non_moe_us is not None else model.non_moe_us,
                   moe_share=moe_share if moe_share is not None else model.moe_share)


def static_moe_us_per_token(cost: CostModel, decode_loads: float, num_requests: int, batch_size: int,
                            decode_steps: int, num_layers: int) -> float:
    """MoE time per token of static batches: ceil(N / B) batches of `decode_steps` steps at B tokens each."""
    batches = -(-num_requests // batch_size)
    fixed = batches * decode_steps * num_layers * float(cost.a(min(batch_size, num_requests)))
    return (fixed + cost.b * decode_loads) / (num_requests * decode_steps)

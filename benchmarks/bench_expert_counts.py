"""What counting the observed requests' experts costs the engine per forward (engine.expert_counts).

    python -m benchmarks.bench_expert_counts [--shapes 4x64x4,26x64x6] [--requests 16,64,256] [--steps 2000]

The plugin's routing hook hands `ExpertCounts.add_step` one forward's expert ids [n, L, k] and a span per
observed request, as `StepOutputs._count_observed` builds them: here every request decodes one token per
forward, all of them observed, positions advancing as in decode. Prints microseconds of CPU per forward for
each shape (layers x experts x top-k: the tiny MoE's 4 x 64 x 4, DeepSeek-V2-Lite's 26 x 64 x 6) and number of
requests: what each decode step of the engine waits for while it counts.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from moe_cohort.engine.expert_counts import ExpertCounts


def per_step_us(layers: int, experts: int, top_k: int, requests: int, steps: int) -> float:
    """Mean microseconds of one `add_step` of `requests` decode rows, spans built as the hook builds them."""
    rng = np.random.default_rng(0)
    per_layer = [rng.integers(0, experts, (requests, top_k)) for _ in range(layers)]  # [S, k] each
    counts = ExpertCounts(layers, experts)
    started = time.process_time()
    for step in range(steps):
        ids = np.stack(per_layer, axis=1)  # [S, L, k], as _count_observed stacks the layers
        counts.add_step([(f"r{i}", f"t{i}", 100 + step, 50, i, i + 1) for i in range(requests)], ids)
    return (time.process_time() - started) / steps * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="4x64x4,26x64x6", help="layers x experts x top-k, comma-separated")
    parser.add_argument("--requests", default="16,64,256", help="observed decode requests per forward")
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args(argv)
    for shape in args.shapes.split(","):
        layers, experts, top_k = (int(x) for x in shape.split("x"))
        for requests in (int(r) for r in args.requests.split(",")):
            us = per_step_us(layers, experts, top_k, requests, args.steps)
            print(f"{layers} layers x {experts} experts, top-{top_k}: {requests:4d} observed decode requests "
                  f"{us:8.0f} us per forward")


if __name__ == "__main__":
    main()

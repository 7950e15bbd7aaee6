"""A router JSON folder (the public GPT-OSS-MoE-ExpertFingerprinting layout) written from random routing."""

from __future__ import annotations

import json

import numpy as np

LAYERS = (2, 10)  # numbered as in the source; "layer_10" sorts before "layer_2" as text, after it as a number


def write_router_dir(path, lengths=(3, 1, 4), names=("10", "2", "1"), top_k=4, num_experts=32, seed=0):
    """One JSON file per prompt in the public layout; returns {name: (prompt, experts [T, L, k], probs [T, L, k])}."""
    rng = np.random.default_rng(seed)
    path.mkdir()
    written = {}
    for name, n in zip(names, lengths):
        experts = np.stack([[rng.choice(num_experts, top_k, replace=False) for _ in LAYERS] for _ in range(n)]) \
            if n else np.zeros((0, len(LAYERS), top_k), np.int64)
        probs = rng.random(experts.shape).astype(np.float32)
        router_data = [{f"token_{40 + t}": {f"layer_{layer}": {"selected_experts": experts[t, j].tolist(),
                                                                "selected_probs": probs[t, j].tolist()}
                                             for j, layer in reversed(list(enumerate(LAYERS)))}}
                       for t in range(n)]
        prompt = f"prompt {name}: what is {n} + {n}?"
        record = {"original_prompt": prompt, "full_text": prompt + " answer", "generated_only": "answer",
                  "router_data": router_data}
        (path / f"{name}.json").write_text(json.dumps(record))
        written[name] = (prompt, experts, probs)
    return written

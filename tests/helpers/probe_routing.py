"""The routing of the probe tests' stand-in vLLM: every token of a prompt about python, cooking or chess routes to
that topic's two experts."""

from __future__ import annotations

import numpy as np

LAYERS, EXPERTS = 2, 8
TOPICS = {"python": [0, 1], "cooking": [4, 5], "chess": [2, 3]}  # a prompt's tokens route to these experts
PROMPT_TOKENS = 4


def routing_of(prompt: str, generated: int) -> np.ndarray:  # [tokens - 1, L, k]
    experts = next(e for topic, e in TOPICS.items() if topic in prompt)
    return np.tile(np.array(experts, np.uint8), (PROMPT_TOKENS + generated - 1, LAYERS, 1))

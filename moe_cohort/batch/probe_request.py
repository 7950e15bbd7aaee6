"""What a probe asks of the engine, and the profile its answer gives: a one-token copy of a request, marked for
the expert counts of moe-cohort's vLLM plugin, whose prompt counts per token are the request's profile [L, E].

This module imports no HTTP client and no Ray: the batch runner's probes (batch/probe.py) and Ray Data LLM's
(batch/ray_llm/processor.py, in Ray's workers) both use it.
"""

from __future__ import annotations

import numpy as np

from moe_cohort.traces.observed import Observed

# what a one-token copy of a request leaves out: how much and how it answers, not what its prompt is (an OpenAI
# body's keys and vLLM SamplingParams' alike)
DROPPED = ("stream", "stream_options", "n", "best_of", "logprobs", "top_logprobs", "prompt_logprobs", "echo",
           "min_tokens", "max_completion_tokens", "response_format", "structured_outputs", "guided_json",
           "guided_regex", "guided_choice", "guided_grammar", "guided_decoding")


def probe_body(body: dict) -> dict:
    """The body (or vLLM sampling parameters) of a request's probe: the same prompt and routing policy, one token,
    one choice, not streamed."""
    return {**{k: v for k, v in body.items() if k not in DROPPED}, "max_tokens": 1}


def prompt_profile(counts: Observed) -> np.ndarray:  # -> [L, E] float32
    """Per layer, the share of the prompt's tokens that picked each expert (rows sum to top_k)."""
    return (counts.prompt / max(counts.prompt_tokens, 1)).astype(np.float32)

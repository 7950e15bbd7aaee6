"""A small synthetic trace set with planted topics: the bundled sample and a test fixture.

Each topic has its own skewed preference over experts in every layer, and every prompt is
written from its topic's vocabulary, so both the expert traces and the texts carry the topic:
a planner that groups prompts by text can recover expert-coherent batches, as on real traces.
Deterministic under `seed`.
"""

from __future__ import annotations

import numpy as np

from moe_cohort.traces.format import TraceSet, expert_dtype

TOPICS = {
    "math": "sum product integer equation solve fraction percent total divide multiply",
    "code": "function python return list string loop class variable compile bug",
    "cooking": "recipe bake flour sugar oven simmer garlic onion butter salt",
    "travel": "flight hotel city museum beach train passport itinerary map tour",
    "health": "sleep diet exercise doctor symptom vitamin heart muscle stress rest",
    "finance": "stock bond invest budget loan interest tax savings market credit",
    "music": "guitar song chord melody rhythm piano band lyrics album tempo",
    "history": "empire war king revolution ancient treaty dynasty century battle colony",
}


def synthetic_traces(num_requests: int = 400, *, num_experts: int = 32, num_layers: int = 4, top_k: int = 4,
                     num_topics: int = 8, tokens: tuple[int, int] = (8, 40), decode_tokens: int = 0,
                     topic_strength: float = 0.5, seed: int = 0) -> TraceSet:
    """Return `num_requests` requests over `num_topics` planted topics (categories = topic names).

    Each token draws its top-k experts without replacement from a mixture of its topic's
    distribution (weight `topic_strength`) and a shared one, per layer (Gumbel top-k).
    `decode_tokens` > 0 appends that many generated tokens to every request.
    """
    rng = np.random.default_rng(seed)
    names = list(TOPICS)[:num_topics]
    shared = rng.dirichlet(np.full(num_experts, 0.5), size=num_layers)  # [L, E]
    topic_p = rng.dirichlet(np.full(num_experts, 0.2), size=(len(names), num_layers))  # [C, L, E]
    topic_of = rng.integers(0, len(names), size=num_requests)  # [N]
    n_prompt = rng.integers(tokens[0], tokens[1] + 1, size=num_requests)  # [N]
    n_total = n_prompt + decode_tokens
    probs = topic_strength * topic_p[np.repeat(topic_of, n_total)] + (1 - topic_strength) * shared  # [T, L, E]
    gumbel = np.log(probs) - np.log(-np.log(rng.random(probs.shape)))  # [T, L, E]
    experts = np.argsort(-gumbel, axis=-1)[..., :top_k]  # [T, L, k]
    vocab = {c: TOPICS[c].split() for c in names}
    texts = [" ".join(rng.choice(vocab[names[c]], size=min(int(n), 12))) for c, n in zip(topic_of, n_prompt)]
    return TraceSet(
        num_experts=num_experts, num_layers=num_layers, top_k=top_k,
        token_offsets=np.concatenate([[0], np.cumsum(n_total)]).astype(np.int64),
        experts=experts.astype(expert_dtype(num_experts)), num_prompt_tokens=n_prompt.astype(np.int64),
        request_ids=np.array([f"s{i:05d}" for i in range(num_requests)]), texts=np.array(texts),
        categories=np.array([names[c] for c in topic_of]), model="synthetic-sample",
    )

"""Does routing follow content? Mutual information between a text's category and its experts.

For every MoE layer, each token contributes its k chosen experts. With p(e | c) the share of
category c's expert choices that go to expert e, and categories weighted equally (so a large
category cannot dominate), the mutual information in bits is

    I(C; E) = mean_c KL(p(. | c) || p(.)),   p(e) = mean_c p(e | c).

0 means the expert choice says nothing about the category; log2(#categories) is the ceiling.
Expert choices come from a transformers forward pass (`output_router_logits`) of the model.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def category_mi(choices: Sequence[np.ndarray], categories: Sequence[str], num_experts: int) -> np.ndarray:
    """[L] mutual information (bits) between category and expert choice, per layer.

    choices: one int array [T_i, L, k] of expert ids per text; categories: one label per text.
    """
    labels = sorted(set(categories))
    num_layers = choices[0].shape[1]
    counts = np.zeros((len(labels), num_layers, num_experts))  # [C, L, E]
    for ids, cat in zip(choices, categories):
        c = labels.index(cat)
        for layer in range(num_layers):
            counts[c, layer] += np.bincount(ids[:, layer].ravel(), minlength=num_experts)
    p_e_c = counts / np.maximum(counts.sum(-1, keepdims=True), 1)  # [C, L, E]
    p_e = p_e_c.mean(0, keepdims=True)  # [1, L, E]
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p_e_c > 0, p_e_c * np.log2(p_e_c / p_e), 0.0)  # [C, L, E]
    return terms.sum(-1).mean(0)  # [L]


def expert_choices(model, tokenizer, texts: Sequence[str], max_tokens: int = 128) -> list[np.ndarray]:
    """Per text, the top-k experts [T, L, k] the model's routers pick (first `max_tokens` tokens)."""
    import torch

    top_k = model.config.num_experts_per_tok
    out = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt").input_ids[:, :max_tokens]  # [1, T]
            logits = model(ids, output_router_logits=True).router_logits  # L x [T, E]
            per_layer = [lg.reshape(ids.shape[1], -1).float().topk(top_k, dim=-1).indices for lg in logits]
            out.append(torch.stack(per_layer, dim=1).numpy())  # [T, L, k]
    return out


def model_category_mi(model, tokenizer, texts: Sequence[str], categories: Sequence[str],
                      max_tokens: int = 128) -> np.ndarray:
    """[L] category_mi of `model` on `texts`."""
    choices = expert_choices(model.eval(), tokenizer, texts, max_tokens)
    return category_mi(choices, categories, model.config.num_experts)


def chat_prompt(text: str) -> str:
    """A prompt as the server sees it: a ChatML user turn and the assistant's opening."""
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"

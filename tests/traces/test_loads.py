"""Load accounting against a brute-force Python-set implementation."""

import numpy as np
import pytest

from tests.conftest import random_traces
from moe_cohort.traces.loads import batch_loads, expert_masks, plan_loads, token_masks


def brute_force_loads(ts, batch, decode_steps, mode):
    """Distinct experts per forward and layer, with Python sets, straight from the definition."""
    prefill = 0
    for layer in range(ts.num_layers):
        used = set()
        for i in batch:
            for tok in ts.request_experts(i)[: ts.num_prompt_tokens[i]]:
                used |= set(tok[layer].tolist())
        prefill += len(used)
    steps = max(ts.num_decode_tokens.max(), 1) if mode == "real" else decode_steps
    decode = 0
    for t in range(steps):
        for layer in range(ts.num_layers):
            used = set()
            for i in batch:
                tok = _decode_token(ts, i, t, mode)
                if tok is not None:
                    used |= set(tok[layer].tolist())
            decode += len(used)
    return prefill, decode


def _decode_token(ts, i, t, mode):
    toks = ts.request_experts(i)
    if mode == "real":
        n_p = ts.num_prompt_tokens[i]
        return toks[n_p + t] if t < len(toks) - n_p else None
    n = ts.num_prompt_tokens[i]
    return toks[1 + t % (n - 1)] if n >= 2 else None


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("num_experts", [10, 64, 130])
def test_proxy_loads_match_brute_force(seed, num_experts):
    ts = random_traces(15, num_experts=num_experts, top_k=3, max_prompt=6, seed=seed)
    masks = expert_masks(ts, decode_steps=11)
    assert masks.decode_mode == "proxy"
    batch = np.random.default_rng(seed).permutation(len(ts))[:6]
    got = batch_loads(masks, batch)
    assert (got.prefill, got.decode) == brute_force_loads(ts, batch, 11, "proxy")


@pytest.mark.parametrize("seed", range(5))
def test_real_decode_loads_match_brute_force(seed):
    ts = random_traces(12, num_experts=20, max_prompt=4, max_decode=6, seed=seed)
    masks = expert_masks(ts)
    assert masks.decode_mode == "real"
    batch = list(range(0, 12, 2))
    got = batch_loads(masks, batch)
    assert (got.prefill, got.decode) == brute_force_loads(ts, batch, None, "real")


def test_proxy_cycles_prompt_tokens_and_skips_short_requests():
    ts = random_traces(30, num_experts=16, max_prompt=4, seed=9)
    masks = expert_masks(ts, decode_steps=7)
    tok = token_masks(ts.experts, ts.num_experts)
    for i in range(len(ts)):
        n, start = ts.num_prompt_tokens[i], ts.token_offsets[i]
        for t in range(7):
            want = tok[start + 1 + t % (n - 1)] if n >= 2 else 0
            np.testing.assert_array_equal(masks.decode[i, t], want)
    assert (ts.num_prompt_tokens < 2).any()  # the fixture exercises the skip


def test_random_phase_shifts_each_cycle_by_a_seeded_offset():
    ts = random_traces(40, num_experts=16, max_prompt=9, seed=3)
    aligned = expert_masks(ts, decode_steps=12)
    shifted = expert_masks(ts, decode_steps=12, phase="random", seed=5)
    again = expert_masks(ts, decode_steps=12, phase="random", seed=5)
    np.testing.assert_array_equal(shifted.decode, again.decode)  # deterministic under the seed
    moved = 0
    for i in range(len(ts)):
        n = ts.num_prompt_tokens[i]
        if n < 2:
            assert not shifted.decode[i].any()
            continue
        # the shifted cycle is the aligned one rotated by some offset o in [0, n - 1)
        cycle = aligned.decode[i, : n - 1]
        offsets = [o for o in range(n - 1) if all(
            np.array_equal(shifted.decode[i, t], cycle[(t + o) % (n - 1)]) for t in range(12))]
        assert offsets, f"request {i} is not a rotation of its aligned cycle"
        moved += 0 not in offsets
    assert moved > 5


def test_duplicate_ids_in_a_token_count_once():
    masks = token_masks(np.array([[[3, 3, 70]]]), num_experts=128)  # [T=1, L=1, k=3]
    assert masks.shape == (1, 1, 2)
    assert int(np.bitwise_count(masks).sum()) == 2


def test_plan_loads_is_the_sum_of_batch_loads():
    ts = random_traces(23, num_experts=33, seed=4)
    masks = expert_masks(ts, decode_steps=5)
    plan = [np.arange(0, 8), np.arange(8, 16), np.arange(16, 23)]
    total = plan_loads(masks, plan)
    parts = [batch_loads(masks, b) for b in plan]
    assert total.decode == sum(p.decode for p in parts) and total.prefill == sum(p.prefill for p in parts)

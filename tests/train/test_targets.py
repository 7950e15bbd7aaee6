"""Overlap targets against brute-force references written from the definitions."""

import numpy as np
import pytest

from tests.conftest import random_traces
from moe_cohort.traces.loads import batch_loads, expert_masks
from moe_cohort.traces.format import TraceSet
from moe_cohort.train.targets import TARGETS, counted_tokens, pair_targets, profiles, target_block, target_matrix


def brute_profile(ts, i, tokens):
    """u[l, e] with Python loops over the request's counted tokens."""
    toks = ts.request_experts(i)
    n_p = ts.num_prompt_tokens[i]
    chosen = range(n_p, len(toks)) if tokens == "decode" else range(1, n_p)
    u = np.zeros((ts.num_layers, ts.num_experts))
    for t in chosen:
        for layer in range(ts.num_layers):
            for e in set(toks[t][layer].tolist()):
                u[layer, e] += 1
    return u / max(len(chosen), 1)


def brute_target(ua, ub, top_k, kind):
    layers = ua.shape[0]
    if kind == "overlap":
        return sum(ua[l, e] * ub[l, e] for l in range(layers) for e in range(ua.shape[1])) / (layers * top_k)
    if kind == "weighted_jaccard":
        per = [np.minimum(ua[l], ub[l]).sum() / np.maximum(ua[l], ub[l]).sum() if np.maximum(ua[l], ub[l]).sum() else 0.0
               for l in range(layers)]
        return float(np.mean(per))
    a = {(l, e) for l, e in zip(*np.nonzero(ua))}
    b = {(l, e) for l, e in zip(*np.nonzero(ub))}
    return len(a & b) / len(a | b) if a | b else 0.0


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("tokens", ["prompt", "decode"])
def test_profiles_match_brute_force(seed, tokens):
    ts = random_traces(10, num_experts=9, num_layers=3, top_k=3, max_prompt=6, max_decode=4, seed=seed)
    got = profiles(ts, tokens)
    assert got.shape == (10, 3, 9)
    for i in range(len(ts)):
        np.testing.assert_allclose(got[i], brute_profile(ts, i, tokens), atol=1e-6)


def test_auto_tokens_follow_the_decode_mode_of_expert_masks():
    prefill_only = random_traces(8, max_prompt=5, seed=2)
    with_decode = random_traces(8, max_prompt=5, max_decode=3, seed=2)
    np.testing.assert_array_equal(counted_tokens(prefill_only), counted_tokens(prefill_only, "prompt"))
    np.testing.assert_array_equal(counted_tokens(with_decode), counted_tokens(with_decode, "decode"))
    with pytest.raises(ValueError, match="tokens must be"):
        counted_tokens(prefill_only, "bos")


def test_a_repeated_id_in_one_token_counts_once():
    ts = TraceSet(num_experts=4, num_layers=1, top_k=2, token_offsets=np.array([0, 3]),
                  experts=np.array([[[0, 1]], [[2, 2]], [[2, 3]]], dtype=np.uint8),
                  num_prompt_tokens=np.array([3]), request_ids=np.array(["a"]))
    np.testing.assert_allclose(profiles(ts)[0, 0], [0, 0, 1.0, 0.5])


@pytest.mark.parametrize("kind", TARGETS)
@pytest.mark.parametrize("seed", range(3))
def test_pair_targets_and_matrices_match_brute_force(kind, seed):
    ts = random_traces(9, num_experts=7, num_layers=2, top_k=2, max_prompt=6, seed=seed)
    prof = profiles(ts)
    pairs = np.array([(a, b) for a in range(9) for b in range(9)])
    want = np.array([brute_target(prof[a].astype(float), prof[b].astype(float), ts.top_k, kind) for a, b in pairs])
    np.testing.assert_allclose(pair_targets(prof, pairs, ts.top_k, kind), want, atol=1e-6)
    np.testing.assert_allclose(target_matrix(prof, ts.top_k, kind).ravel(), want, atol=1e-6)
    rows = np.array([4, 1])
    np.testing.assert_allclose(target_block(prof, rows, ts.top_k, kind), want.reshape(9, 9)[rows], atol=1e-6)
    assert np.all((want >= 0) & (want <= 1 + 1e-9))


def test_weighted_jaccard_equals_jaccard_on_zero_one_profiles():
    rng = np.random.default_rng(0)
    sets = (rng.random((6, 1, 12)) < 0.4).astype(np.float32)  # one layer, 0/1 "profiles"
    pairs = np.array([(a, b) for a in range(6) for b in range(6)])
    np.testing.assert_allclose(pair_targets(sets, pairs, 1, "weighted_jaccard"), pair_targets(sets, pairs, 1, "jaccard"))


def test_overlap_is_the_expected_number_of_shared_experts():
    """Over every combination of one token of a and one of b, the mean shared count is L * k * overlap."""
    ts = random_traces(6, num_experts=8, num_layers=3, top_k=3, max_prompt=7, seed=5)
    prof = profiles(ts)
    for a in range(6):
        for b in range(6):
            ta, tb = ts.request_experts(a)[1:ts.num_prompt_tokens[a]], ts.request_experts(b)[1:ts.num_prompt_tokens[b]]
            if len(ta) == 0 or len(tb) == 0:
                continue
            shared = np.mean([sum(len(set(x[l].tolist()) & set(y[l].tolist())) for l in range(3)) for x in ta for y in tb])
            assert shared == pytest.approx(3 * 3 * pair_targets(prof, [[a, b]], 3, "overlap")[0])


def test_half_the_overlap_is_the_measured_pair_saving_over_a_full_proxy_cycle():
    """Decode-proxy cycles of coprime lengths 3 and 4 meet every token combination once in 12 steps."""
    rng = np.random.default_rng(1)
    experts = np.argsort(rng.random((9, 2, 6)), axis=-1)[..., :2].astype(np.uint8)  # 4 + 5 tokens, BOS first
    ts = TraceSet(num_experts=6, num_layers=2, top_k=2, token_offsets=np.array([0, 4, 9]), experts=experts,
                  num_prompt_tokens=np.array([4, 5]), request_ids=np.array(["a", "b"]))
    masks = expert_masks(ts, decode_steps=12)
    alone = batch_loads(masks, [0]).decode + batch_loads(masks, [1]).decode
    saving = 1 - batch_loads(masks, [0, 1]).decode / alone
    assert saving == pytest.approx(pair_targets(profiles(ts), [[0, 1]], 2, "overlap")[0] / 2)


def test_unknown_target_is_rejected():
    prof = profiles(random_traces(4, seed=0))
    with pytest.raises(ValueError, match="unknown target"):
        pair_targets(prof, [[0, 1]], 2, "cosine")

"""Pair sampling over the training side of the split: no leakage, determinism, and what each pair kind means."""

import numpy as np
import pytest

from tests.conftest import random_traces
from moe_cohort.traces.synthetic import synthetic_traces
from moe_cohort.train.finetune import TrainConfig, build_pairs
from moe_cohort.traces.split import split_requests
from moe_cohort.train.pairs import HARD, NEAR, RANDOM, hard_negative_pairs, near_pairs, random_pairs, sample_pairs
from moe_cohort.train.targets import pair_targets, profiles, target_matrix


def test_pairs_are_built_from_training_requests_only():
    ts = synthetic_traces(60, seed=1)
    train, held = split_requests(len(ts), 0.25, seed=0, groups=ts.texts)
    emb = np.random.default_rng(0).normal(size=(len(train), 8))
    pairs = build_pairs(ts, profiles(ts), train, TrainConfig(max_pairs=400), emb)
    assert set(pairs.pairs.ravel()) <= set(train.tolist())
    assert not set(pairs.pairs.ravel()) & set(held.tolist())


def test_sample_pairs_is_unique_labelled_and_deterministic():
    ts = synthetic_traces(50, seed=2)
    prof = profiles(ts)
    emb = np.random.default_rng(1).normal(size=(50, 8))
    a = sample_pairs(prof, ts.top_k, 300, embeddings=emb, seed=4)
    b = sample_pairs(prof, ts.top_k, 300, embeddings=emb, seed=4)
    np.testing.assert_array_equal(a.pairs, b.pairs)
    assert len(a) == 300 and np.all(a.pairs[:, 0] < a.pairs[:, 1])
    assert len({tuple(p) for p in a.pairs.tolist()}) == 300
    np.testing.assert_allclose(a.labels, pair_targets(prof, a.pairs, ts.top_k), rtol=1e-6)
    counts = a.counts()
    assert counts["near"] == 120 and counts["hard"] > 0 and sum(counts.values()) == 300
    assert not np.array_equal(sample_pairs(prof, ts.top_k, 300, embeddings=emb, seed=5).pairs, a.pairs)


def test_without_embeddings_the_hard_share_goes_to_random_pairs():
    ts = synthetic_traces(40, seed=3)
    counts = sample_pairs(profiles(ts), ts.top_k, 200, seed=0).counts()
    assert counts == {"near": 80, "hard": 0, "random": 120}


def test_a_budget_over_all_pairs_takes_every_pair():
    ts = random_traces(8, seed=0)
    assert len(sample_pairs(profiles(ts), ts.top_k, 10_000, seed=0)) == 28


def test_near_pairs_are_each_anchors_top_partners_by_target():
    ts = synthetic_traces(30, seed=4)
    prof = profiles(ts)
    got = {tuple(p) for p in near_pairs(prof, ts.top_k, 3).tolist()}
    t = target_matrix(prof, ts.top_k)
    np.fill_diagonal(t, -np.inf)
    want = {(min(a, b), max(a, b)) for a in range(30) for b in np.argsort(-t[a], kind="stable")[:3]}
    assert got == want


def test_hard_negatives_are_cosine_neighbours_with_the_lowest_targets():
    ts = synthetic_traces(30, seed=5)
    prof = profiles(ts)
    emb = np.random.default_rng(2).normal(size=(30, 6))
    got = hard_negative_pairs(prof, emb, ts.top_k, per_anchor=2, candidates=5)
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    cos = unit @ unit.T
    np.fill_diagonal(cos, -np.inf)
    t = target_matrix(prof, ts.top_k)
    want = set()
    for a in range(30):
        cand = np.argsort(-cos[a], kind="stable")[:5]
        for b in cand[np.argsort(t[a, cand], kind="stable")[:2]]:
            want.add((min(a, int(b)), max(a, int(b))))
    assert {tuple(p) for p in got.tolist()} == want


def test_random_pairs_avoid_the_excluded_ones():
    rng = np.random.default_rng(0)
    exclude = np.array([[0, 1], [2, 3]])
    got = random_pairs(5, 100, rng, exclude=exclude)
    assert len(got) == 8  # 10 pairs of 5 requests, 2 excluded
    assert not {(0, 1), (2, 3)} & {tuple(p) for p in got.tolist()}
    assert (NEAR, HARD, RANDOM) == (0, 1, 2)


@pytest.mark.integration
def test_targets_and_pairs_import_no_torch_web_framework_or_vllm():
    import subprocess
    import sys

    code = ("import sys, moe_cohort.train.targets, moe_cohort.train.pairs; "
            "print(sorted(m for m in ('torch', 'vllm', 'fastapi', 'starlette', 'httpx', 'requests', 'aiohttp') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

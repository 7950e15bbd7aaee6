"""The online learner: the reservoir's uniform sample, the refit schedule, the swap, persistence, the live fit."""

import numpy as np
import pytest

from moe_cohort.traces.observed import Observed
from moe_cohort.train.online import LearnConfig, OnlineLearner, Reservoir
from moe_cohort.train.profile_head import DEFAULT_ALPHAS, fit_head_features

LAYERS, EXPERTS, K = 2, 6, 2


def _stream(n, seed=0, clusters=3):
    """n observations of `clusters` kinds of request: features say the kind, each kind prefers its own experts."""
    rng = np.random.default_rng(seed)
    kinds = rng.integers(clusters, size=n)
    features = np.eye(clusters, 8)[kinds] + 0.05 * rng.normal(size=(n, 8))
    observed = []
    for kind in kinds:
        decode = np.zeros((LAYERS, EXPERTS), np.int64)
        for layer in range(LAYERS):
            decode[layer, [2 * kind, 2 * kind + 1]] = 10  # 10 generated tokens, each picks its kind's two experts
        observed.append(Observed(np.zeros_like(decode), decode, 4, 10))
    return features.astype(np.float32), observed


def test_reservoir_keeps_every_row_with_the_same_probability():
    capacity, stream, runs = 4, 12, 3000
    hits = np.zeros(stream)
    for seed in range(runs):
        r = Reservoir(capacity, seed)
        for i in range(stream):
            r.add(np.array([float(i)]), np.array([0.0]))
        assert r.size == capacity and r.seen == stream
        hits[r.arrays()[0][:, 0].astype(int)] += 1
    expected = runs * capacity / stream  # 1000 each; binomial sd ~ 26
    assert np.abs(hits - expected).max() < 120, hits


def test_the_reservoir_decides_before_it_sees_a_row_and_keeps_few_once_full():
    """offer() then put() is algorithm R: candidate n is kept with probability capacity / n, so of N candidates
    capacity * (1 + H_N - H_capacity) are stored in expectation (harmonic numbers), and each stored one takes
    a uniformly chosen slot."""
    capacity, stream, runs = 5, 200, 2000
    kept_at, stored = np.zeros(stream), []
    for seed in range(runs):
        r = Reservoir(capacity, seed)
        for i in range(stream):
            if r.offer():
                kept_at[i] += 1
                r.put(np.array([float(i)]), np.array([0.0]))
        stored.append(r.stored)
        assert r.size == capacity and r.seen == stream
    n = np.arange(1, stream + 1)
    expected = runs * np.minimum(1.0, capacity / n)
    assert np.abs(kept_at - expected).max() < 4 * np.sqrt(expected.max()) + 1, kept_at[:12]
    harmonic = np.cumsum(1.0 / n)
    assert np.mean(stored) == pytest.approx(capacity * (1 + harmonic[-1] - harmonic[capacity - 1]), rel=0.03)


def test_observations_the_reservoir_did_not_keep_feed_only_the_live_fit():
    learner = OnlineLearner(LearnConfig(capacity=100, first_fit=20, ngram_dim=0))
    f, obs = _stream(40, seed=5)
    learner.observe(f[:20], obs[:20])
    learner.refit()
    before = learner.reservoir.arrays()[0]
    learner.observe(f[20:], obs[20:], kept=[False] * 20)
    assert learner.live_fit()[2] == 20 and learner.reservoir.seen == 20 and not learner.due()
    np.testing.assert_array_equal(learner.reservoir.arrays()[0], before)
    learner.observe(f[20:], obs[20:], kept=[True] * 20)  # offered (and kept) elsewhere, before they ran
    assert learner.reservoir.size == 40 and learner.reservoir.seen == 20


def test_the_reservoirs_running_mean_is_the_mean_of_what_it_keeps():
    r = Reservoir(5, seed=3)
    rng = np.random.default_rng(3)
    for _ in range(40):  # most adds replace a kept row
        r.add(rng.normal(size=2), rng.random(3))
        np.testing.assert_allclose(r.mean(), r.arrays()[1].mean(axis=0), rtol=1e-5, atol=1e-6)


def test_first_head_after_first_fit_observations_then_refits_on_schedule():
    learner = OnlineLearner(LearnConfig(capacity=200, first_fit=10, refit_every=5, ngram_dim=0))
    f, obs = _stream(130)
    learner.observe(f[:9], obs[:9])
    assert not learner.due() and learner.head is None
    learner.observe(f[9:10], obs[9:10])
    assert learner.due()
    learner.refit()
    learner.observe(f[10:14], obs[10:14])
    assert not learner.due()  # 4 new < refit_every
    learner.observe(f[14:15], obs[14:15])
    assert learner.due()
    learner.refit()  # fitted on 15
    learner.observe(f[15:100], obs[15:100])
    learner.refit()  # fitted on 100: the next needs a quarter of that, 25 new
    learner.observe(f[100:124], obs[100:124])
    assert not learner.due()
    learner.observe(f[124:125], obs[124:125])
    assert learner.due()
    learner.refit()  # fitted on the 125 rows
    learner.observe(f[125:], obs[125:], kept=[False] * 5)  # not kept: no row changed
    assert learner.reservoir.stored == 125 and not learner.due()


def test_once_full_refits_come_after_half_the_rows_changed_so_ever_fewer_requests_cost_one():
    config = LearnConfig(capacity=40, first_fit=10, refit_every=5, ngram_dim=0)
    learner = OnlineLearner(config)
    f, obs = _stream(1, seed=6)
    refits_at, stored_at = [], []
    for n in range(1, 4001):
        learner.observe(f, obs)
        if learner.due():
            learner.refit()
            refits_at.append(n)
            stored_at.append(learner.reservoir.stored)
    assert learner.reservoir.seen == 4000 and learner.fitted_on == 40
    # growing: a quarter of the last fit's rows (at least refit_every) new; full (40 rows): half of them, 20
    assert stored_at[:4] == [10, 15, 20, 25] and refits_at[:4] == [10, 15, 20, 25]
    full = [i for i, n in enumerate(refits_at) if n > 40]
    assert (np.diff(stored_at)[full[1] - 1:] == 20).all(), stored_at
    late = np.diff(refits_at)[-3:]  # 20 new rows take about 20 x n / 40 requests
    assert len(refits_at) < 25 and (late > 300).all(), refits_at


def test_refit_is_the_offline_fit_of_the_reservoir_and_swaps_a_new_head_in():
    learner = OnlineLearner(LearnConfig(capacity=30, first_fit=10, ngram_dim=0))
    f, obs = _stream(50)
    learner.observe(f[:20], obs[:20])
    old = learner.refit()
    old_weight = old.weight.copy()
    learner.observe(f[20:], obs[20:])
    new = learner.refit()
    assert learner.head is new and new is not old
    np.testing.assert_array_equal(old.weight, old_weight)  # a reader holding the old head keeps a whole one
    x, y = learner.reservoir.arrays()
    i = DEFAULT_ALPHAS.index(old.alpha)  # a refit tries the last penalty and its neighbours
    direct = fit_head_features(x, y.reshape(-1, LAYERS, EXPERTS), K, DEFAULT_ALPHAS[max(i - 1, 0): i + 2])
    assert new.alpha == direct.alpha
    np.testing.assert_allclose(new.from_features(f), direct.from_features(f), rtol=1e-5, atol=1e-6)


def test_once_full_the_learner_searches_its_penalty_every_fourth_refit_and_reuses_it_between():
    from moe_cohort.train.online import SEARCH_EVERY

    learner = OnlineLearner(LearnConfig(capacity=30, first_fit=10, ngram_dim=0))
    f, obs = _stream(200, seed=5)
    learner.observe(f[:10], obs[:10])
    learner.refit()  # the first fit tries every penalty
    tried = []
    for i in range(10, 200, 10):
        learner.observe(f[i: i + 10], obs[i: i + 10])
        alphas, last = learner._alphas(), learner.head.alpha
        tried.append(len(alphas))
        new = learner.refit()
        x, y = learner.reservoir.arrays()
        direct = fit_head_features(x, y.reshape(-1, LAYERS, EXPERTS), K, alphas)
        assert new.alpha == direct.alpha and (len(alphas) > 1 or new.alpha == last)
        np.testing.assert_allclose(new.from_features(f), direct.from_features(f), rtol=1e-5, atol=1e-6)
    # refits 2..20 (the first fit is 1): the 2nd still grows (20 rows); once full the 5th, 9th, 13th, 17th search
    searched = [t > 1 for t in tried]
    assert SEARCH_EVERY == 4 and searched == [True] + [n % 4 == 1 for n in range(3, 21)], tried


def test_the_learned_head_predicts_each_kind_and_its_live_fit_beats_the_mean():
    learner = OnlineLearner(LearnConfig(capacity=100, first_fit=30, ngram_dim=0))
    f, obs = _stream(80, seed=3)
    learner.observe(f[:40], obs[:40])
    learner.refit()
    assert learner.live_fit() is None  # nothing unseen yet
    learner.observe(f[40:], obs[40:])
    head_fit, mean_fit, count = learner.live_fit()
    assert count == 40 and head_fit > 0.9 and mean_fit < 0.5
    predicted = learner.head.from_features(f[40:]).reshape(-1, LAYERS, EXPERTS)
    truth = np.stack([o.profile() for o in obs[40:]])
    assert np.abs(predicted - truth).max() < 0.2


def test_a_restart_keeps_the_reservoir_the_head_and_the_sampling(tmp_path):
    config = LearnConfig(capacity=20, first_fit=10, ngram_dim=0)
    f, obs = _stream(60, seed=4)
    straight = OnlineLearner(config, key="enc")
    straight.observe(f[:40], obs[:40])
    straight.refit()
    straight.save(tmp_path)
    back = OnlineLearner.load(tmp_path, config, key="enc")
    assert (back.observed, back.fitted_on, back.shape) == (40, 20, (LAYERS, EXPERTS, K))  # 20 rows kept of 40
    np.testing.assert_allclose(back.head.from_features(f), straight.head.from_features(f), atol=1e-3)
    straight.observe(f[40:], obs[40:])
    back.observe(f[40:], obs[40:])  # the random replacement goes on where it stopped
    np.testing.assert_allclose(back.reservoir.arrays()[0], straight.reservoir.arrays()[0], atol=1e-2)


def test_state_saved_by_an_older_version_is_not_loaded(tmp_path):
    import json

    learner = OnlineLearner(LearnConfig(capacity=20, first_fit=10, ngram_dim=0), key="enc")
    learner.observe(*_stream(12))
    learner.save(tmp_path)
    with np.load(tmp_path / "reservoir.npz") as z:
        arrays = dict(z)
    meta = json.loads(str(arrays["meta"]))
    del meta["coin"]  # what the reservoir saved before it decided on arrival
    np.savez(tmp_path / "reservoir.npz", **{**arrays, "meta": np.array(json.dumps(meta))})
    assert OnlineLearner.load(tmp_path, learner.config, key="enc").observed == 0


def test_state_learned_with_another_encoder_is_not_loaded(tmp_path):
    f, obs = _stream(12)
    learner = OnlineLearner(LearnConfig(first_fit=10, ngram_dim=0), key="static")
    learner.observe(f, obs)
    learner.refit()
    learner.save(tmp_path)
    fresh = OnlineLearner.load(tmp_path, LearnConfig(first_fit=10, ngram_dim=0), key="BAAI/bge-small-en-v1.5")
    assert fresh.observed == 0 and fresh.head is None


def test_an_observation_of_another_model_is_refused():
    learner = OnlineLearner(LearnConfig(ngram_dim=0))
    f, obs = _stream(2)
    learner.observe(f[:1], obs[:1])
    other = Observed(np.zeros((3, EXPERTS), np.int64), np.ones((3, EXPERTS), np.int64), 1, 1)  # 3 layers, not 2
    with pytest.raises(ValueError, match="a different model"):
        learner.observe(f[1:], [other])


def test_settings_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="first_fit"):
        LearnConfig(capacity=5, first_fit=10)


def test_experts_seen_later_widen_the_learner_before_its_first_head_and_are_refused_after():
    learner = OnlineLearner(LearnConfig(capacity=50, first_fit=10, ngram_dim=0))
    f, obs = _stream(30)
    decode = np.zeros((LAYERS, 4), np.int64)
    decode[:, :2] = 10
    narrow = [Observed(np.zeros_like(decode), decode, 4, 10)] * 30  # the first kind: its ids name experts < 4 only
    learner.observe(f[:1], narrow[:1])
    assert learner.shape[1] == 4
    learner.observe(f[1:20], obs[1:20])
    assert learner.shape == (LAYERS, EXPERTS, K)
    np.testing.assert_array_equal(learner.reservoir.profiles[0].reshape(LAYERS, EXPERTS)[:, 4:], 0)
    learner.refit()
    learner.observe(f[20:21], narrow[20:21])  # narrower: padded
    wider = Observed(np.zeros((LAYERS, 9), np.int64), np.ones((LAYERS, 9), np.int64), 1, 1)
    with pytest.raises(ValueError, match="a different model"):
        learner.observe(f[21:22], [wider])


def test_a_pruning_policy_picking_fewer_experts_per_token_is_the_same_model():
    learner = OnlineLearner(LearnConfig(ngram_dim=0))
    f, obs = _stream(2)
    pruned = Observed(obs[1].prompt, obs[1].decode // 2, 4, 10)  # one expert per token and layer, not two
    learner.observe(f, [obs[0], pruned])
    assert learner.shape == (LAYERS, EXPERTS, K) and learner.reservoir.size == 2

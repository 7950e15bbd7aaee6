"""The profile objective: its targets and loss against brute force, and training on planted topics."""

import numpy as np
import pytest
import torch

from moe_cohort.traces.split import split_requests
from moe_cohort.traces.synthetic import synthetic_traces
from moe_cohort.train.finetune import TrainConfig, train_encoder
from moe_cohort.train.profile_head import fit_profile_head
from moe_cohort.train.profile_loss import ProfileLoss, profile_targets
from moe_cohort.train.targets import profiles

CONFIG = TrainConfig(loss="profile", epochs=1, max_pairs=960, batch_size=32, learning_rate=3e-3, holdout=0.25,
                     save_steps=1000, seed=0)


def load(path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu")


def test_targets_make_each_layer_a_distribution_and_keep_empty_layers_empty():
    prof = np.array([[[0.5, 1.0, 0.5], [0.0, 0.0, 0.0]]])  # [1, 2, 3]
    t = profile_targets(prof)
    np.testing.assert_allclose(t[0, 0], [0.25, 0.5, 0.25])
    np.testing.assert_array_equal(t[0, 1], 0.0)


def test_the_untrained_loss_is_the_cross_entropy_of_the_mean_profile(tiny_model_dir):
    model = load(tiny_model_dir)
    rng = np.random.default_rng(0)
    target = profile_targets(rng.random((6, 2, 5)))  # [6, 2, 5]
    mean = target.mean(axis=0)
    loss = ProfileLoss(model, mean)
    features = model.tokenize(["sum product integer", "recipe bake flour", "guitar song", "flight hotel", "war king", "stock"])
    got = loss([features], torch.tensor(target.reshape(6, -1))).item()
    brute = -np.mean([sum(target[i, l] @ np.log(mean[l]) for l in range(2)) / 2 for i in range(6)])
    assert got == pytest.approx(brute, rel=1e-5)


def _heldout_profile_error(ts, model) -> float:
    """Mean squared error of the ridge head fitted on the training side's embeddings, on the held-out side."""
    train, held = split_requests(len(ts), CONFIG.holdout, CONFIG.seed, groups=ts.texts)
    x = model.encode(ts.texts.tolist(), normalize_embeddings=True)
    prof = profiles(ts)
    head = fit_profile_head(x[train], prof[train], ts.top_k, mix=0.0)
    return float(((head.predict(x[held]) - prof[held]) ** 2).mean())


def test_training_on_profiles_lowers_the_heads_heldout_error(tiny_model_dir, tmp_path):
    ts = synthetic_traces(160, topic_strength=0.9, seed=11)
    before = _heldout_profile_error(ts, load(tiny_model_dir))
    result = train_encoder(ts, load(tiny_model_dir), tmp_path, CONFIG, progress=False)
    after = _heldout_profile_error(ts, load(tmp_path))
    print(f"held-out profile MSE of the head: before {before:.5f}, after {after:.5f}")
    assert after < 0.8 * before, (before, after)
    assert result.pair_counts == {"requests": len(result.train_ids)}
    assert not (tmp_path / "checkpoints").exists()

"""The expert-profile head: prediction contract, save/load (its compact wire form: tests/admission/test_wire.py)."""

import numpy as np
import pytest

from moe_cohort.encoder.profile import ProfileHead, load_profile_head


def _head(dim=4, layers=2, experts=5, seed=0):
    rng = np.random.default_rng(seed)
    return ProfileHead(weight=rng.normal(size=(dim, layers * experts)).astype(np.float32),
                       bias=rng.normal(size=layers * experts).astype(np.float32), num_layers=layers,
                       num_experts=experts, top_k=2, alpha=0.3)


def test_predict_is_the_clipped_linear_map_reshaped_to_layers_and_experts():
    head = _head()
    x = np.random.default_rng(1).normal(size=(3, 4)).astype(np.float32)
    got = head.predict(x)
    assert got.shape == (3, 2, 5)
    for i in range(3):
        want = np.clip(x[i] @ head.weight + head.bias, 0, 1).reshape(2, 5)
        np.testing.assert_allclose(got[i], want, rtol=1e-6)
    np.testing.assert_allclose(head.predict(x[0]), got[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="dimension"):
        head.predict(np.zeros((1, 3)))


def test_save_and_load_round_trip(tmp_path):
    head = _head()
    assert load_profile_head(tmp_path) is None
    head.save(tmp_path)
    back = load_profile_head(tmp_path)
    np.testing.assert_array_equal(back.weight, head.weight)
    np.testing.assert_array_equal(back.bias, head.bias)
    assert (back.num_layers, back.num_experts, back.top_k, back.alpha) == (2, 5, 2, 0.3)


def test_the_neighbour_part_is_the_softmax_weighted_mean_of_the_nearest_profiles(tmp_path):
    rng = np.random.default_rng(4)
    mem_x = rng.normal(size=(12, 4))
    mem_x /= np.linalg.norm(mem_x, axis=1, keepdims=True)
    mem_y = rng.random((12, 10)).astype(np.float16)
    base = _head()
    head = ProfileHead(**{**base.__dict__, "memory_x": mem_x.astype(np.float32), "memory_y": mem_y, "neighbours": 3,
                          "temperature": 5.0, "mix": 0.4})
    x = rng.normal(size=(2, 4)).astype(np.float32)
    for i in range(2):
        cos = mem_x @ (x[i] / np.linalg.norm(x[i]))
        near = np.argsort(-cos)[:3]
        w = np.exp(5.0 * cos[near])
        knn = (w / w.sum()) @ mem_y[near].astype(np.float64)
        want = np.clip(0.6 * (x[i] @ base.weight + base.bias) + 0.4 * knn, 0, 1).reshape(2, 5)
        np.testing.assert_allclose(head.predict(x)[i], want, rtol=1e-4, atol=1e-5)
    head.save(tmp_path)
    loaded = load_profile_head(tmp_path)
    np.testing.assert_allclose(loaded.predict(x), head.predict(x), rtol=1e-6)
    assert loaded.memory_y.dtype == np.float32  # saved as float16, converted once (not per request)


def test_a_head_that_reads_ngrams_saves_and_loads_them(tmp_path):
    from moe_cohort.encoder.ngrams import hashed_ngrams

    rng = np.random.default_rng(5)
    base = _head()
    head = ProfileHead(**{**base.__dict__, "weight": rng.normal(size=(4 + 16, 10)).astype(np.float32), "ngram_dim": 16})
    x, texts = rng.normal(size=(2, 4)).astype(np.float32), ["write a poem", "solve 2 + 2"]
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    features = np.hstack([unit, hashed_ngrams(texts, 16)]) / np.sqrt(2)  # [2, 20]
    want = np.clip(features @ head.weight + head.bias, 0, 1).reshape(2, 2, 5)
    np.testing.assert_allclose(head.predict(x, texts), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(head.predict(x[0], texts[0]), want[0], rtol=1e-5, atol=1e-6)
    assert head.dim == 4
    head.save(tmp_path)
    np.testing.assert_allclose(load_profile_head(tmp_path).predict(x, texts), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="one text per embedding"):
        head.predict(x, texts[:1])


@pytest.mark.parametrize("ngrams", [512, 32])  # 32: a batch uses over half the features (the dense path)
def test_a_prediction_reads_only_the_features_a_prompt_uses_and_equals_the_dense_products(ngrams):
    from moe_cohort.encoder.profile import head_features

    rng = np.random.default_rng(9)
    dim, layers, experts, memory = 8, 3, 6, 40
    texts = [f"prompt {i} about " + " ".join(rng.choice(["rust", "soup", "proof", "loop", "tax"], 4)) for i in range(60)]
    x = rng.normal(size=(60, dim)).astype(np.float32)
    f = head_features(x, texts, ngrams)  # [60, F]
    head = ProfileHead(weight=rng.normal(size=(dim + ngrams, layers * experts)).astype(np.float32),
                       bias=rng.normal(size=layers * experts).astype(np.float32), num_layers=layers,
                       num_experts=experts, top_k=2, memory_x=f[:memory], memory_y=rng.random((memory, layers * experts)),
                       neighbours=4, temperature=10.0, mix=0.5, ngram_dim=ngrams)
    if ngrams == 512:
        assert (f[0] != 0).sum() < (dim + ngrams) // 4  # what makes it pay: a prompt sets few n-gram buckets
    else:
        assert 2 * f.any(axis=0).sum() > dim + ngrams

    def dense(rows):  # the same head by whole products
        sim = rows / np.linalg.norm(rows, axis=1, keepdims=True) @ f[:memory].T  # [n, M]
        out = []
        for i, s in enumerate(sim):
            near = np.argsort(-s)[:4]
            w = np.exp(10.0 * (s[near] - s.max()))
            out.append(0.5 * (rows[i] @ head.weight + head.bias) + 0.5 * (w / w.sum()) @ head.memory_y[near])
        return np.clip(np.array(out), 0, 1)

    for rows in (f[memory:memory + 1], f[memory:], f):  # one request (sparse path), a batch, one past half (dense)
        np.testing.assert_allclose(head.from_features(rows), dense(rows), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(head.predict(x[45], texts[45]).reshape(-1), dense(f[45:46])[0], rtol=1e-5, atol=1e-5)

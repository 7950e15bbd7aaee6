"""The profile head's ridge fit against a direct solve and scikit-learn's, its leave-one-out choice against refits."""

import numpy as np
import pytest

from moe_cohort.encoder.profile import load_profile_head
from moe_cohort.traces.split import split_requests
from moe_cohort.traces.synthetic import synthetic_traces
from moe_cohort.train.profile_head import _Columns, _loo_error, _spectrum, fit_profile_head, train_profile_head
from moe_cohort.train.targets import profiles


def _ridge(x, y, alpha):
    """Ridge with an unpenalised intercept, by the normal equations on centred data."""
    xm, ym = x.mean(0), y.mean(0)
    xc = x - xm
    w = np.linalg.solve(xc.T @ xc + alpha * np.eye(x.shape[1]), xc.T @ (y - ym))
    return w, ym - xm @ w


@pytest.mark.parametrize("n, d", [(40, 6), (12, 30)])  # the SVD; the Gram matrix's eigenvectors (fewer requests)
def test_fit_equals_the_normal_equations_for_its_chosen_penalty(n, d):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, d))
    prof = np.clip(rng.random((n, 2, 3)) + x[:, :1, None] * 0.1, 0, 1)
    head = fit_profile_head(x, prof, top_k=1, alphas=(0.5,))
    w, b = _ridge(x, prof.reshape(n, -1), 0.5)
    np.testing.assert_allclose(head.weight, w, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(head.bias, b, rtol=1e-4, atol=1e-5)


def _with_sparse_columns(x, rng):
    """x with its last columns mostly zero, as hashed n-grams are."""
    x = x.copy()
    tail = x[:, x.shape[1] // 3:]
    tail[rng.random(tail.shape) < 0.85] = 0.0
    return x


@pytest.mark.parametrize("alphas", [(0.5,), (0.05, 0.5, 5.0)])  # a Cholesky solve; the spectrum and leave-one-out
def test_fit_on_sparse_features_equals_the_normal_equations_on_either_path(alphas):
    rng = np.random.default_rng(2)
    x = _with_sparse_columns(rng.normal(size=(14, 45)), rng)
    prof = np.clip(rng.random((14, 2, 3)) + x[:, :1, None] * 0.1, 0, 1)
    head = fit_profile_head(x, prof, top_k=1, alphas=alphas)
    w, b = _ridge(x, prof.reshape(14, -1), head.alpha)
    np.testing.assert_allclose(head.weight, w, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(head.bias, b, rtol=1e-4, atol=1e-5)


def test_the_centred_products_equal_the_dense_ones():
    rng = np.random.default_rng(3)
    x = _with_sparse_columns(rng.normal(size=(20, 30)), rng)
    c = rng.normal(size=(20, 4))
    xc = x - x.mean(0)
    cols = _Columns.of(x)
    assert cols.sparse.sum() == 20  # the mostly-zero ones go through scipy.sparse
    np.testing.assert_allclose(cols.centred_gram(), xc @ xc.T, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(cols.centred_t_dot(c), xc.T @ c, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("n, d", [(15, 4), (9, 20)])
def test_leave_one_out_error_equals_refitting_without_each_request(n, d):
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(n, d)), rng.normal(size=(n, 3))
    u, s2 = _spectrum(_Columns.of(x))
    yc = y - y.mean(0)
    for alpha in (0.1, 2.0):
        errors = []
        for i in range(n):
            keep = np.arange(n) != i
            w, b = _ridge(x[keep], y[keep], alpha)
            errors.append(((y[i] - (x[i] @ w + b)) ** 2).mean())
        np.testing.assert_allclose(_loo_error(u, s2, u.T @ yc, yc, alpha), np.mean(errors), rtol=1e-8)


@pytest.mark.parametrize("n, d", [(40, 6), (14, 45)])  # the SVD; the Gram matrix's eigenvectors (sparse columns)
def test_fit_and_its_leave_one_out_errors_equal_scikit_learns_ridge_cv_and_the_closed_form(n, d):
    """RidgeCV(alphas): sklearn's efficient leave-one-out, one penalty for all targets. Its error for each
    penalty, its choice and its coefficients are the hand-written fit's, and both are the direct solve's."""
    from sklearn.linear_model import Ridge, RidgeCV

    rng = np.random.default_rng(4)
    x = _with_sparse_columns(rng.normal(size=(n, d)), rng)
    y = x[:, :3] @ rng.normal(size=(3, 6)) + rng.normal(size=(n, 6))  # [n, 6] a signal in a few columns, and noise
    prof = y.reshape(n, 2, 3)
    alphas = (0.01, 0.3, 3.0, 30.0, 300.0)
    u, s2 = _spectrum(_Columns.of(x))
    yc = y - y.mean(0)
    for a in alphas:
        np.testing.assert_allclose(_loo_error(u, s2, u.T @ yc, yc, a), -RidgeCV(alphas=[a]).fit(x, y).best_score_,
                                   rtol=1e-8)
    ref = RidgeCV(alphas=alphas).fit(x, y)
    assert alphas[0] < ref.alpha_ < alphas[-1]  # an inner choice: the search decides it
    head = fit_profile_head(x, prof, top_k=1, alphas=alphas, mix=0.0)
    assert head.alpha == ref.alpha_
    w, b = _ridge(x, y, ref.alpha_)
    for weight, bias in ((head.weight, head.bias), (ref.coef_.T, ref.intercept_)):
        np.testing.assert_allclose(weight, w, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(bias, b, rtol=1e-4, atol=1e-5)
    one = fit_profile_head(x, prof, top_k=1, alphas=(0.3,), mix=0.0)  # one penalty: the Cholesky solve
    chol = Ridge(alpha=0.3, solver="cholesky").fit(x, y)
    np.testing.assert_allclose(one.weight, chol.coef_.T, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(one.bias, chol.intercept_, rtol=1e-4, atol=1e-5)


def test_train_profile_head_fits_the_training_side_only_and_saves_beside_the_encoder(tmp_path):
    ts = synthetic_traces(80, seed=2)
    seen = []

    def embed(texts):
        seen.extend(texts)
        return np.random.default_rng(len(texts)).normal(size=(len(texts), 8))

    head, path = train_profile_head(ts, embed, tmp_path, holdout=0.25, seed=3)
    train_idx, held_idx = split_requests(len(ts), 0.25, 3, groups=ts.texts)
    assert sorted(seen) == sorted(ts.texts[train_idx].tolist())
    assert not set(seen) & set(ts.texts[held_idx].tolist())
    saved = load_profile_head(tmp_path)
    assert path.parent == tmp_path and saved.weight.shape == (8 + saved.ngram_dim, ts.num_layers * ts.num_experts)
    assert saved.ngram_dim > 0 and saved.dim == 8  # it reads the texts' n-grams beside the embeddings
    assert head.predict(np.zeros(8), "a prompt").shape == profiles(ts).shape[1:]


def test_the_ngram_features_carry_what_the_embedding_misses():
    """Profiles that follow a word the embedding does not see: the head with n-grams predicts them, without
    them it cannot, and it needs the texts to predict."""
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2, size=120)  # [N] which of two words the prompt holds
    texts = [f"please answer {'briefly' if w else 'verbosely'} now" for w in words]
    prof = np.where(words[:, None, None] == 1, [[1.0, 1.0, 0.0, 0.0]], [[0.0, 0.0, 1.0, 1.0]]).astype(np.float32)  # [N, 1, 4]
    x = rng.normal(size=(120, 6)).astype(np.float32)  # embeddings that know nothing of the word
    with_ngrams = fit_profile_head(x[:100], prof[:100], 2, texts=texts[:100], mix=0.0)
    without = fit_profile_head(x[:100], prof[:100], 2, mix=0.0)
    err = lambda p: np.abs(p - prof[100:]).mean()  # noqa: E731
    assert err(with_ngrams.predict(x[100:], texts[100:])) < 0.1 < err(without.predict(x[100:]))
    with pytest.raises(ValueError, match="reads the prompt texts"):
        with_ngrams.predict(x[100:])

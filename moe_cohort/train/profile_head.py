"""Fit the expert-profile head (encoder.profile.ProfileHead): ridge regression embedding -> [L, E].

Targets are the requests' expert profiles (train.targets.profiles: per layer, the fraction of
the request's decode tokens, or prompt tokens after BOS for prompt-only traces, that pick each
expert). Features are the encoder's unit embeddings and, when the texts are given, their hashed
word n-grams beside them (encoder.ngrams; encoder.profile.head_features): the words say how a
prompt will be answered where its embedding says what it is about (docs/results.md compares the
two). Ridge with an unpenalised intercept, closed form through the spectrum of the centred features
(`_spectrum`; with one penalty, a Cholesky solve); the penalty is chosen from `alphas` by exact
leave-one-out error (for ridge, the LOO residual is the residual over 1 - h_ii, with h the hat
matrix), so no request is ever scored by a fit that saw it. Only the training side of
the project's split (traces.split) is ever passed in. The fitted requests are also kept as the
head's neighbour memory (unit embeddings and float16 profiles): a ridge fit regresses every
profile toward the mean, the neighbours' real profiles keep how concentrated a request's
experts are, and the blend of both admits better than either (bench_continuous).

The same fit as scikit-learn's RidgeCV(alphas) (efficient leave-one-out, one penalty for all targets) and
Ridge(alpha, solver="cholesky") (tests/train/test_profile_head.py checks it against them), kept by hand
because the online learner refits it while the proxy serves: the n-gram columns, mostly zero, enter
the Gram matrix as a sparse product, where scikit-learn centres and multiplies them dense.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import scipy.linalg
import scipy.sparse

from moe_cohort.encoder.ngrams import DEFAULT_NGRAM_DIM
from moe_cohort.encoder.profile import ProfileHead, head_features
from moe_cohort.traces.format import TraceSet
from moe_cohort.traces.split import split_requests
from moe_cohort.train.targets import profiles

log = logging.getLogger(__name__)

DEFAULT_ALPHAS = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
DEFAULT_MIX, DEFAULT_NEIGHBOURS, DEFAULT_TEMPERATURE = 0.5, 10, 20.0


def fit_profile_head(x: np.ndarray, prof: np.ndarray, top_k: int, alphas: Sequence[float] = DEFAULT_ALPHAS, *,
                     mix: float = DEFAULT_MIX, neighbours: int = DEFAULT_NEIGHBOURS,
                     temperature: float = DEFAULT_TEMPERATURE, texts: Sequence[str] | None = None,
                     ngram_dim: int = DEFAULT_NGRAM_DIM) -> ProfileHead:
    """Ridge from embeddings x [N, D] (with `texts`, one per row: and their hashed n-grams, `ngram_dim`
    of them) to profiles prof [N, L, E], penalty by leave-one-out error, blended (weight `mix`) with the
    profiles of the `neighbours` nearest of these requests."""
    ngram_dim = ngram_dim if texts is not None else 0
    f = head_features(np.asarray(x, np.float32), texts, ngram_dim)  # [N, F]
    return fit_head_features(f, prof, top_k, alphas, mix=mix, neighbours=neighbours, temperature=temperature,
                             ngram_dim=ngram_dim)


def fit_head_features(f: np.ndarray, prof: np.ndarray, top_k: int, alphas: Sequence[float] = DEFAULT_ALPHAS, *,
                      mix: float = DEFAULT_MIX, neighbours: int = DEFAULT_NEIGHBOURS,
                      temperature: float = DEFAULT_TEMPERATURE, ngram_dim: int = 0) -> ProfileHead:
    """`fit_profile_head` on what the head reads, f [N, F] (encoder.profile.head_features with `ngram_dim`)."""
    n, layers, experts = prof.shape
    x = np.asarray(f)  # [N, F], float32 from the learner (the products run in float64: _Columns)
    y = prof.reshape(n, -1).astype(np.float64)  # [N, L*E]
    y_mean = y.mean(axis=0)
    cols = _Columns.of(x)
    alpha, coef = _ridge_coefficients(cols, y - y_mean, alphas)  # [N, L*E]
    weight = cols.centred_t_dot(coef)  # [F, L*E] = xc^T coef
    bias = y_mean - cols.mean @ weight  # [L*E]
    log.info("profile head: %d requests, dim %d -> %d x %d, alpha %g", n, x.shape[1], layers, experts, alpha)
    unit = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)  # [N, F] in x's dtype
    return ProfileHead(weight=weight.astype(np.float32), bias=bias.astype(np.float32), num_layers=layers,
                       num_experts=experts, top_k=top_k, alpha=float(alpha),
                       memory_x=unit.astype(np.float32) if mix > 0 else None,
                       memory_y=y.astype(np.float16) if mix > 0 else None,
                       neighbours=neighbours, temperature=temperature, mix=mix, ngram_dim=ngram_dim)


def _ridge_coefficients(cols: _Columns, yc: np.ndarray, alphas: Sequence[float]) -> tuple[float, np.ndarray]:
    """(alpha, coef [N, P]) with the ridge weight = xc^T coef, xc = x - its mean: the penalty of least
    leave-one-out error among `alphas` through the spectrum, or with one penalty a Cholesky solve of the
    centred Gram matrix (no spectrum: the online learner's refits between searches)."""
    if len(alphas) == 1 and cols.rows <= cols.features:
        gram = cols.centred_gram()  # [N, N]
        gram[np.diag_indices_from(gram)] += alphas[0]
        return alphas[0], scipy.linalg.cho_solve(scipy.linalg.cho_factor(gram), yc)
    u, s2 = _spectrum(cols)  # [N, r], [r]: xc = u diag(sqrt(s2)) v^T
    uty = u.T @ yc  # [r, P]
    alpha = min(alphas, key=lambda a: _loo_error(u, s2, uty, yc, a)) if len(alphas) > 1 else alphas[0]
    return alpha, u @ (uty / (s2 + alpha)[:, None])  # v diag(s / (s2 + alpha)) u^T y = xc^T of this


def _spectrum(cols: _Columns) -> tuple[np.ndarray, np.ndarray]:
    """The left singular vectors u [N, r] and squared singular values s2 [r] of the centred features. With
    fewer requests than features (the online learner's reservoir), from the eigenvectors of the centred
    Gram matrix [N, N] (cheaper than the SVD there; its null direction, the centring's, has s2 = 0 and so
    no weight); else the thin SVD."""
    if cols.rows <= cols.features:
        s2, u = np.linalg.eigh(cols.centred_gram())
        return u, np.maximum(s2, 0.0)
    u, s, _ = np.linalg.svd(cols.x - cols.mean, full_matrices=False)
    return u, s**2


@dataclass(frozen=True)
class _Columns:
    """Features x [N, F] and their mean, split once for the products a fit needs: the mostly-zero columns
    (a prompt sets few of the hashed n-grams) as a scipy.sparse matrix, the rest dense. The centred
    products are taken without forming x - mean, or x in float64: only the dense columns and the sparse
    part's nonzeros are converted."""

    dense: np.ndarray  # [N, F_dense] float64
    sparse_part: scipy.sparse.csr_matrix  # [N, F_sparse] float64
    sparse: np.ndarray  # [F] bool: the column is mostly zero
    mean: np.ndarray  # [F] float64

    @classmethod
    def of(cls, x: np.ndarray) -> _Columns:
        sparse = np.count_nonzero(x, axis=0) * 2 < len(x)  # [F]
        part = scipy.sparse.csr_matrix(x[:, sparse]).astype(np.float64)  # from x's own dtype: nonzeros only
        dense = np.asarray(x[:, ~sparse], dtype=np.float64)
        mean = np.empty(x.shape[1])
        mean[~sparse], mean[sparse] = dense.mean(axis=0), np.asarray(part.mean(axis=0)).ravel()
        return cls(dense, part, sparse, mean)

    @property
    def rows(self) -> int:
        return self.dense.shape[0]

    @property
    def features(self) -> int:
        return self.sparse.size

    @property
    def x(self) -> np.ndarray:  # [N, F] float64, formed on demand (the SVD of more requests than features)
        out = np.empty((self.rows, self.features))
        out[:, ~self.sparse], out[:, self.sparse] = self.dense, self.sparse_part.toarray()
        return out

    def centred_gram(self) -> np.ndarray:  # [N, N] (x - mean)(x - mean)^T
        gram = self.dense @ self.dense.T + (self.sparse_part @ self.sparse_part.T).toarray()
        r = self.dense @ self.mean[~self.sparse] + self.sparse_part @ self.mean[self.sparse]  # [N] x @ mean
        return gram - r[:, None] - r[None, :] + self.mean @ self.mean

    def centred_t_dot(self, coef: np.ndarray) -> np.ndarray:  # [N, P] -> [F, P] (x - mean)^T coef
        out = np.empty((self.features, coef.shape[1]))
        out[~self.sparse] = self.dense.T @ coef
        out[self.sparse] = self.sparse_part.T @ coef
        return out - np.outer(self.mean, coef.sum(axis=0))


def _loo_error(u: np.ndarray, s2: np.ndarray, uty: np.ndarray, yc: np.ndarray, alpha: float) -> float:
    """Mean squared leave-one-out residual of the ridge fit with penalty `alpha` (intercept included)."""
    shrink = s2 / (s2 + alpha)  # [r]
    fitted = u @ (shrink[:, None] * uty)  # [N, L*E]
    h = (u**2) @ shrink + 1.0 / len(u)  # [N] hat diagonal, the intercept's 1/N included
    return float((((yc - fitted) / (1.0 - h)[:, None]) ** 2).mean())


def train_profile_head(ts: TraceSet, embed: Callable[[Sequence[str]], np.ndarray], output_dir: str | Path, *,
                       holdout: float = 0.2, seed: int = 0) -> tuple[ProfileHead, Path]:
    """Fit the head on the training side of the split of `ts` with `embed` (texts -> [n, D]); save it."""
    if ts.texts is None:
        raise ValueError("the traces carry no prompt texts; the profile head is fitted from text")
    train_idx, _ = split_requests(len(ts), holdout, seed, groups=ts.texts)
    prof = profiles(ts)  # [N, L, E]
    train_idx = train_idx[prof[train_idx].sum(axis=(1, 2)) > 0]  # requests with counted tokens only
    texts = [str(t) for t in ts.texts[train_idx]]
    head = fit_profile_head(embed(texts), prof[train_idx], ts.top_k, texts=texts)
    return head, head.save(output_dir)

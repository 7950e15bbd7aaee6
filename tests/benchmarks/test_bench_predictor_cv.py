"""benchmarks.bench_predictor_cv: folds of the training side only, every predictor fitted without its fold,
and a fine-tuned encoder per fold that saw the other folds only."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from benchmarks.bench_predictor_cv import measure_cv, parse_variant, training_folds
from benchmarks.heldout import HeldOut
from moe_cohort.traces.synthetic import synthetic_traces
from moe_cohort.train.finetune import REPORT_FILE


def _topic_embed(ts):
    """[N, C] one-hot of each request's planted topic: what a perfect topic encoder would give."""
    topics = sorted(set(ts.categories))
    return lambda texts, enc: np.eye(len(topics), dtype=np.float32)[[topics.index(c) for c in ts.categories]]


def _noise_embed(texts, enc):
    return np.random.default_rng(5).normal(size=(len(texts), 8)).astype(np.float32)


def test_folds_split_the_training_side_only_and_keep_a_text_in_one_fold():
    ts = synthetic_traces(120, num_experts=16, top_k=2, seed=3)
    texts = ts.texts.copy()
    texts[60:120] = texts[0:60]  # every prompt twice
    ts = dataclasses.replace(ts, texts=texts)
    folds = training_folds(ts, 4)
    together = np.concatenate(folds)
    assert len(together) == len(np.unique(together)) and set(together) == set(HeldOut.of(ts).train_idx)
    fold_of = {int(i): f for f, part in enumerate(folds) for i in part}
    assert all(fold_of[i] == fold_of[i + 60] for i in range(60) if i in fold_of)
    assert len({fold_of[i] for i in fold_of}) == 4


def test_a_topic_encoder_captures_more_of_the_reference_than_noise(tmp_path):
    ts = synthetic_traces(240, num_experts=32, num_layers=3, top_k=2, topic_strength=0.9, seed=4)
    ts = dataclasses.replace(ts, texts=np.array([f"request {i}" for i in range(len(ts))]))  # n-grams tell nothing
    lines = []
    topic = measure_cv(ts, ["topic"], {}, [8], 3, _topic_embed(ts), tmp_path, report=lines.append)
    noise = measure_cv(ts, ["noise"], {}, [8], 3, _noise_embed, tmp_path, report=lines.append)
    assert topic["reference"][8]["capture"] == pytest.approx(1.0) and len(topic["reference"][8]["fold_savings"]) == 4
    assert topic["text-profile-topic"][8]["capture"] > 0.6 > noise["text-profile-noise"][8]["capture"]
    assert any(line.startswith("text-profile-topic") for line in lines)


def test_variants_override_the_training_config_by_field():
    assert parse_variant("ft") == ("ft", {})
    assert parse_variant("ft128:max_seq_length=128,learning_rate=1e-4,loss=cosent") == (
        "ft128", {"max_seq_length": 128, "learning_rate": 1e-4, "loss": "cosent"})
    assert parse_variant("full:max_seq_length=none") == ("full", {"max_seq_length": None})
    with pytest.raises(ValueError, match="'epoch' is not a TrainConfig field"):
        parse_variant("x:epoch=2")


@pytest.mark.integration  # trains a tiny sentence encoder per fold
def test_each_folds_encoder_is_trained_on_the_other_folds_only(tmp_path):
    from tests.train.conftest import build_tiny_model

    base = tmp_path / "base"
    build_tiny_model(tmp_path / "hf").save(str(base))
    ts = synthetic_traces(60, num_experts=8, num_layers=2, top_k=2, seed=6)
    embed = lambda texts, enc: _noise_embed(texts, enc) if enc is None else _encode(enc, texts)  # noqa: E731
    got = measure_cv(ts, [], {"ft": {"max_pairs": 32, "batch_size": 16}}, [4], 1, embed, tmp_path / "cv",
                     folds=2, base=str(base), report=lambda line: None)
    assert set(got) == {"random", "text-profile-ft", "reference"}
    folds = training_folds(ts, 2)
    for f, fold in enumerate(folds):
        report = json.loads((tmp_path / "cv" / f"fold{f}" / "ft" / REPORT_FILE).read_text())
        assert set(report["train_ids"]) == set(ts.request_ids[folds[1 - f]]) and not report["heldout_ids"]


def _encode(folder, texts):
    from sentence_transformers import SentenceTransformer

    return np.asarray(SentenceTransformer(folder, device="cpu").encode(texts, normalize_embeddings=True))

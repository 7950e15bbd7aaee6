"""The held-out setup (benchmarks.heldout): the split, the reference profiles the replay would read, a head
that sees training requests only, the embedding cache, and the data folder setting."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import heldout as heldout_module
from benchmarks.heldout import DATA_ENV, HeldOut, data_dir, data_path, embeddings, prompt_texts
from moe_cohort.eval.replay import decode_profiles, decode_tokens
from moe_cohort.traces.split import heldout_split
from tests.conftest import random_traces


@pytest.mark.parametrize("max_decode", [0, 5])  # prompt-only traces (the decode proxy) and generated tokens
def test_reference_is_what_the_replay_reads_of_the_heldout_side(max_decode):
    ts = random_traces(40, max_prompt=6, max_decode=max_decode, seed=3)
    data = HeldOut.of(ts)
    train, held = heldout_split(ts)
    np.testing.assert_array_equal(data.train_idx, train)
    np.testing.assert_array_equal(data.held_idx, held)
    assert data.held.request_ids.tolist() == ts.request_ids[held].tolist()
    np.testing.assert_array_equal(data.reference, decode_profiles(decode_tokens(data.held), data.held))


def test_the_fitted_head_sees_training_requests_with_tokens_only():
    ts = random_traces(60, max_prompt=6, max_decode=4, seed=1)
    data = HeldOut.of(ts)
    x = np.random.default_rng(0).normal(size=(len(ts), 8)).astype(np.float32)
    head = data.fit_head(x)
    seen = data.train_idx[ts.num_decode_tokens[data.train_idx] > 0]
    unseen = np.setdiff1d(np.arange(len(ts)), seen)
    assert len(seen) and len(unseen) > len(data.held_idx)  # some training requests have no decode token
    moved = x.copy()
    moved[unseen] += 5.0
    probe, texts = x[:5], list(ts.texts[:5])
    np.testing.assert_array_equal(data.fit_head(moved).predict(probe, texts), head.predict(probe, texts))
    moved[seen[0]] += 5.0  # a request it fits on does change it
    assert not np.array_equal(data.fit_head(moved).predict(probe, texts), head.predict(probe, texts))


def test_head_prefers_the_one_saved_beside_the_encoder(tmp_path):
    ts = random_traces(30, max_decode=3, seed=2)
    data = HeldOut.of(ts)
    x = np.random.default_rng(1).normal(size=(len(ts), 4)).astype(np.float32)
    other = data.fit_head(x[::-1].copy())
    other.save(tmp_path)
    np.testing.assert_array_equal(data.head(x, tmp_path).weight, other.weight)
    np.testing.assert_array_equal(data.head(x, tmp_path / "missing").weight, data.fit_head(x).weight)
    np.testing.assert_array_equal(data.head(x).weight, data.fit_head(x).weight)


def test_embeddings_are_cached_by_encoder_and_texts(tmp_path, monkeypatch):
    calls = []

    def fake(texts, *, encoder=None, **_):
        calls.append((encoder, tuple(texts)))
        return np.full((len(texts), 2), len(calls), np.float32)

    monkeypatch.setattr("moe_cohort.encoder.embed_texts", fake)
    first = embeddings(["a", "b"], None, tmp_path)
    np.testing.assert_array_equal(embeddings(["a", "b"], None, tmp_path), first)
    assert len(calls) == 1
    embeddings(["a", "c"], None, tmp_path)
    embeddings(["a", "b"], "some/hub-model", tmp_path)
    embeddings(["a", "b"], None)  # no cache: always embeds
    assert len(calls) == 4


def test_data_dir_reads_cohort_data_else_the_shared_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(DATA_ENV, str(tmp_path))
    assert data_dir() == tmp_path
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "mixed.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in "abcdeabcde"))
    assert prompt_texts() == list("abcdeabcde")
    held = prompt_texts(heldout=True)
    assert held and set(held) < set("abcde") and all(held.count(t) == 2 for t in set(held))  # duplicates together
    with pytest.raises(FileNotFoundError, match=DATA_ENV):
        data_path(heldout_module.TRACES)
    monkeypatch.setenv(DATA_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=DATA_ENV):
        data_dir()
    monkeypatch.delenv(DATA_ENV)
    (tmp_path / "repo").mkdir()
    (tmp_path / "shared" / "data").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "repo")
    assert data_dir().resolve() == (tmp_path / "shared" / "data").resolve()


def test_a_limited_head_fits_a_seeded_subset_of_the_training_side():
    ts = random_traces(60, max_prompt=0, max_decode=5, seed=4)
    data = HeldOut.of(ts)
    x = np.random.default_rng(2).normal(size=(len(ts), 5)).astype(np.float32)
    small = data.fit_head(x, limit=12)
    assert len(small.memory_x) == 12
    np.testing.assert_array_equal(data.fit_head(x, limit=12).weight, small.weight)  # seeded
    assert not np.array_equal(data.fit_head(x, limit=12, seed=1).weight, small.weight)
    np.testing.assert_array_equal(data.fit_head(x, limit=10_000).weight, data.fit_head(x).weight)

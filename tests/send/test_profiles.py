"""send/profiles.py: the serving process's encoder threads."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.integration
def test_limit_threads_caps_torch_the_blas_and_the_tokenizer():
    # a process of its own: the limits are process-wide; before them torch and the BLAS use every core
    code = ("import os, torch, numpy; from threadpoolctl import threadpool_info; from moe_cohort.send.profiles import limit_threads; "
            "limit_threads(1); print(torch.get_num_threads(), max(i['num_threads'] for i in threadpool_info()), "
            "os.environ['TOKENIZERS_PARALLELISM'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.split() == ["1", "1", "false"]


def test_the_default_encoder_is_the_static_distillation_of_the_packaged_model(tmp_path, monkeypatch):
    import numpy as np
    from tokenizers import Tokenizer

    from moe_cohort.encoder.embedding import resolve_model
    from moe_cohort.encoder.static import save_static
    from moe_cohort.send.profiles import make_predictor
    from moe_cohort.send.settings import Settings

    packaged = resolve_model(None)
    tokenizer = Tokenizer.from_file(str(Path(packaged) / "tokenizer.json"))
    weights = np.random.default_rng(0).standard_normal((tokenizer.get_vocab_size(), 8)).astype(np.float32)  # [V, 8]
    small = save_static(tokenizer, weights, tmp_path / "static")  # stands in for the ~1 min distillation
    asked = []
    monkeypatch.setattr("moe_cohort.encoder.static.static_model_dir", lambda source, **kw: asked.append(source) or small)
    predictor = make_predictor(Settings())
    assert asked == [packaged]  # distilled from the packaged MiniLM (once: then from the cache)
    (prediction,) = predictor.predict(["How do I sort a list in Python?"])
    assert predictor.kind == "embedding" and prediction.vector.shape == (8,) and prediction.compact is None  # no head
    assert predictor.deadline_s == 0.05  # a static encoder's prediction is waited for 50 ms at most


def test_a_folder_with_a_head_that_reads_ngrams_predicts_profiles_from_the_texts(tmp_path):
    """`cohort train`'s heads read the prompt's hashed n-grams beside the embedding: the proxy passes the texts."""
    import numpy as np
    from tokenizers import Tokenizer

    from moe_cohort.admission.wire import expand
    from moe_cohort.encoder.embedding import resolve_model
    from moe_cohort.encoder.profile import ProfileHead
    from moe_cohort.encoder.static import save_static
    from moe_cohort.send.profiles import make_predictor
    from moe_cohort.send.settings import Settings

    tokenizer = Tokenizer.from_file(str(Path(resolve_model(None)) / "tokenizer.json"))
    weights = np.random.default_rng(0).standard_normal((tokenizer.get_vocab_size(), 8)).astype(np.float32)  # [V, 8]
    folder = save_static(tokenizer, weights, tmp_path / "enc")
    layers, experts, ngrams = 2, 4, 16
    weight = np.zeros((8 + ngrams, layers * experts), np.float32)  # [F, L*E]: the n-gram part alone decides
    weight[8:, 0] = 4.0  # any n-gram of the text puts expert 0 of layer 0 on
    ProfileHead(weight, np.zeros(layers * experts, np.float32), layers, experts, top_k=1, ngram_dim=ngrams).save(folder)
    predictor = make_predictor(Settings(encoder=str(folder)))
    (prediction,) = predictor.predict(["How do I sort a list in Python?"])
    assert predictor.kind == "profile" and prediction.vector.shape == (layers * experts,)
    assert prediction.vector[0] > 0 and expand(prediction.compact, layers, experts)[0, 0] > 0


def test_a_predictor_that_follows_learning_waits_for_its_head_unless_learning_is_off(tmp_path):
    """Following the proxy's learning: no prediction (first come, first served) while learning is undecided or on
    without a head; embeddings once it is off; the learned head's profiles once there is one."""
    from types import SimpleNamespace

    import numpy as np
    from tokenizers import Tokenizer

    from moe_cohort.admission.resident import ResidentEmbedding, ResidentExperts
    from moe_cohort.encoder.embedding import resolve_model
    from moe_cohort.encoder.ngrams import DEFAULT_NGRAM_DIM
    from moe_cohort.encoder.profile import ProfileHead
    from moe_cohort.encoder.static import save_static
    from moe_cohort.send.profiles import make_predictor
    from moe_cohort.send.settings import Settings

    tokenizer = Tokenizer.from_file(str(Path(resolve_model(None)) / "tokenizer.json"))
    weights = np.random.default_rng(0).standard_normal((tokenizer.get_vocab_size(), 8)).astype(np.float32)  # [V, 8]
    predictor = make_predictor(Settings(encoder=str(save_static(tokenizer, weights, tmp_path / "enc"))))
    texts = ["How do I sort a list in Python?"]
    assert predictor.kind == "embedding" and predictor.mode() == "embeddings" and predictor.ready()
    learning = SimpleNamespace(head=None, on=None)
    predictor.follow(learning)

    def state():
        return (predictor.kind, predictor.mode(), predictor.ready(), type(predictor.resident_factory(8)),
                [None if p is None else p.vector.shape for p in predictor.predict(texts)])

    waiting = ("profile", "first come, first served until the first learned head", False, ResidentExperts, [None])
    assert state() == waiting  # not decided yet
    learning.on = True
    assert state() == waiting
    learning.on = False
    assert state() == ("profile", "embeddings", True, ResidentEmbedding, [(8,)])
    layers, experts = 2, 4
    learning.on, learning.head = True, ProfileHead(
        np.zeros((8 + DEFAULT_NGRAM_DIM, layers * experts), np.float32), np.zeros(layers * experts, np.float32),
        layers, experts, top_k=1, ngram_dim=DEFAULT_NGRAM_DIM)
    assert state() == ("profile", "learned head", True, ResidentExperts, [(layers * experts,)])

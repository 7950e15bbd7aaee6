"""proxy/profiles.py: the serving process's encoder threads."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.integration
def test_limit_threads_caps_torch_the_blas_and_the_tokenizer():
    # a process of its own: the limits are process-wide; before them torch and the BLAS use every core
    code = ("import os, torch, numpy; from threadpoolctl import threadpool_info; from moe_cohort.proxy.profiles import limit_threads; "
            "limit_threads(1); print(torch.get_num_threads(), max(i['num_threads'] for i in threadpool_info()), "
            "os.environ['TOKENIZERS_PARALLELISM'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.split() == ["1", "1", "false"]


def test_the_default_encoder_is_the_static_distillation_of_the_packaged_model(tmp_path, monkeypatch):
    import numpy as np
    from tokenizers import Tokenizer

    from moe_cohort.encoder.embedding import resolve_model
    from moe_cohort.encoder.static import save_static
    from moe_cohort.proxy.profiles import make_predictor
    from moe_cohort.proxy.settings import Settings

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

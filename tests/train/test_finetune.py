"""Training on a tiny synthetic trace set with planted topics, with a tiny model built in the test."""

import json

import numpy as np
import pytest

from moe_cohort.traces.synthetic import synthetic_traces
from moe_cohort.train.finetune import PAIRS_FILE, REPORT_FILE, TrainConfig, TrainDataError, check_traces, train_encoder

CONFIG = TrainConfig(loss="cosent", epochs=2, max_pairs=192, batch_size=32, learning_rate=3e-3, holdout=0.25,
                     save_steps=1000, seed=0)


def load(path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu")


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    ts = synthetic_traces(160, topic_strength=0.9, seed=11)
    out = tmp_path_factory.mktemp("run") / "model"
    result = train_encoder(ts, load(tiny_model_dir), out, CONFIG, progress=False)
    return ts, out, result


def test_training_raises_the_heldout_correlation_of_the_planted_topics(trained):
    _, _, result = trained
    before, after = result.spearman_before["all_pairs"], result.spearman_after["all_pairs"]
    print(f"held-out Spearman before {before:.3f}, after {after:.3f}")
    assert after > before + 0.1, (before, after)
    assert after > 0.4


def test_the_saved_folder_reloads_and_embeds_identically(trained, tiny_model_dir):
    ts, out, _ = trained
    texts = ts.texts[:20].tolist()
    first, second = load(out), load(out)
    np.testing.assert_allclose(first.encode(texts), second.encode(texts), atol=1e-6)
    assert not np.allclose(first.encode(texts), load(tiny_model_dir).encode(texts), atol=1e-3)  # weights did change
    assert not (out / "checkpoints").exists()


def test_the_planners_embedder_loads_the_saved_folder(trained):
    from moe_cohort.encoder.embedding import Embedder

    ts, out, _ = trained
    texts = ts.texts[:10].tolist()
    np.testing.assert_allclose(Embedder(out).encode(texts), load(out).encode(texts, normalize_embeddings=True), atol=1e-5)


def test_the_report_records_the_split_and_no_pair_touches_the_heldout_side(trained):
    ts, out, result = trained
    report = json.loads((out / REPORT_FILE).read_text())
    assert not set(report["train_ids"]) & set(report["heldout_ids"])
    assert report["config"]["max_pairs"] == CONFIG.max_pairs
    with np.load(out / PAIRS_FILE) as z:
        used = set(ts.request_ids[z["pairs"].ravel()].tolist())
    assert used <= set(report["train_ids"])
    assert sum(result.pair_counts.values()) == CONFIG.max_pairs


@pytest.mark.parametrize("loss", ["cosent", "profile"])
def test_an_interrupted_run_resumes_from_its_checkpoint(tiny_model_dir, tmp_path, loss):
    from transformers import TrainerCallback

    class Crash(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 6:
                raise KeyboardInterrupt

    class Record(TrainerCallback):
        first_step = None

        def on_step_begin(self, args, state, control, **kwargs):
            if Record.first_step is None:
                Record.first_step = state.global_step

    ts = synthetic_traces(80, seed=2)
    config = TrainConfig(loss=loss, epochs=1, max_pairs=224, batch_size=32, save_steps=5, holdout=0.2, hard_frac=0.0)
    with pytest.raises(KeyboardInterrupt):
        train_encoder(ts, load(tiny_model_dir), tmp_path, config, progress=False, callbacks=[Crash()])
    assert (tmp_path / "checkpoints" / "checkpoint-5").exists() and not (tmp_path / REPORT_FILE).exists()
    with pytest.raises(FileExistsError, match="--resume"):
        train_encoder(ts, load(tiny_model_dir), tmp_path, config, progress=False)
    with pytest.raises(TrainDataError, match="other settings"):
        train_encoder(ts, load(tiny_model_dir), tmp_path, TrainConfig(max_pairs=100), resume=True, progress=False)
    result = train_encoder(ts, load(tiny_model_dir), tmp_path, config, resume=True, progress=False, callbacks=[Record()])
    assert Record.first_step == 5
    assert (tmp_path / REPORT_FILE).exists() and result.spearman_after
    with pytest.raises(FileExistsError, match="finished"):
        train_encoder(ts, load(tiny_model_dir), tmp_path, config, resume=True, progress=False)


def test_traces_without_texts_are_rejected_before_training():
    ts = synthetic_traces(20, seed=0)
    no_text = type(ts)(**{**ts.__dict__, "texts": None})
    with pytest.raises(TrainDataError, match="no prompt texts"):
        check_traces(no_text)
    empty = type(ts)(**{**ts.__dict__, "texts": np.array([""] + ts.texts[1:].tolist())})
    with pytest.raises(TrainDataError, match="empty text"):
        check_traces(empty)
    with pytest.raises(TrainDataError, match="at least"):
        check_traces(ts.subset([0, 1, 2]))

"""The static student: windows of the training texts, the fit against a known answer, and `cohort train --student`."""

import numpy as np
import pytest

from moe_cohort.cli import main
from moe_cohort.traces.format import save_traces
from moe_cohort.traces.synthetic import synthetic_traces
from moe_cohort.train.static_student import StudentConfig, fit_student, with_windows


def _spans(text):
    """Whitespace token spans, as a fast tokenizer's offsets would give them."""
    spans, at = [], 0
    for word in text.split():
        start = text.index(word, at)
        spans.append((start, start + len(word)))
        at = start + len(word)
    return spans


def test_windows_are_spans_of_their_own_text_of_a_quarter_or_more():
    texts = ["a b c d e f g h i j k l m n o p", "short text", "a b c d e f g h i j k l m n o p", "q r s t u v w x"]
    rows, parents = with_windows(texts, [_spans(t) for t in texts], windows=5, seed=3)
    assert rows[0] == texts[0] and set(texts) <= set(rows)
    assert len(rows) == len(set(rows)) and len(rows) == len(parents)
    for row, parent in zip(rows, parents):
        source = texts[int(parent)]
        assert row in source  # a contiguous piece of the text it came from
        assert row == source or len(row.split()) >= max(4, len(source.split()) // 4)
    assert not any(p == 1 and r != "short text" for r, p in zip(rows, parents))  # < 8 tokens: no windows
    assert {int(p) for r, p in zip(rows, parents) if r != texts[int(p)]} == {0, 2, 3}  # text 2 repeats text 0: its own windows, the text itself once


def test_the_student_recovers_token_vectors_whose_mean_is_the_target_direction():
    rng = np.random.default_rng(0)
    vocab, dim = 40, 8
    truth = rng.normal(size=(vocab, dim))  # [V, D]; token 39 is never used
    ids = [list(rng.integers(0, vocab - 1, size=rng.integers(2, 9))) for _ in range(600)]
    means = np.stack([truth[i].mean(0) for i in ids])
    targets = means / np.linalg.norm(means, axis=1, keepdims=True)  # [M, D] unit, like a teacher's
    parents = np.arange(len(ids))
    weights, val_cos = fit_student(ids, targets, parents, vocab, StudentConfig(steps=300, learning_rate=0.05, pull=0.0))
    idle, _ = fit_student(ids, targets, parents, vocab, StudentConfig(steps=0, pull=0.0))
    brute = np.stack([weights[i].mean(0) for i in ids])  # the student's embedding, by hand
    cos = (brute * targets).sum(1) / np.linalg.norm(brute, axis=1)
    assert val_cos > 0.97 and cos.mean() > 0.97
    before = np.stack([idle[i].mean(0) for i in ids])
    assert ((before * targets).sum(1) / np.linalg.norm(before, axis=1)).mean() < 0.5  # all at the mean: far off
    np.testing.assert_allclose(weights[vocab - 1], targets[parents[~_validation(parents)]].mean(0), rtol=1e-5, atol=1e-6)
    start = rng.normal(size=(vocab, dim))  # a given start (the teacher's token-alone embeddings in the product)
    started, _ = fit_student(ids, targets, parents, vocab, StudentConfig(steps=50, learning_rate=0.05), start)
    np.testing.assert_allclose(started[vocab - 1], start[vocab - 1], rtol=1e-6)  # never used: stays where it started
    assert not np.allclose(started[0], start[0])


def _validation(parents, share=0.1, seed=0):
    return (np.random.default_rng(seed).random(int(parents.max()) + 1) < share)[parents]


def test_cohort_train_student_saves_a_static_folder_with_its_head(tmp_path, capsys, tiny_model_dir):
    from moe_cohort.encoder.embedding import Embedder
    from moe_cohort.encoder.profile import load_profile_head

    ts = synthetic_traces(60, seed=1)
    path = save_traces(tmp_path / "t.npz", ts)
    code = main(["train", "--traces", str(path), "--base", str(tiny_model_dir), "--output", str(tmp_path / "s"),
                 "--student", "static"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "saved the static student" in out and "saved the expert-profile head" in out
    student, teacher = Embedder(tmp_path / "s"), Embedder(tiny_model_dir)
    assert student.static and student.dim == teacher.dim == 32
    assert load_profile_head(tmp_path / "s").dim == 32
    texts = sorted(set(map(str, ts.texts)))[:10]
    agreement = (student.encode(texts) * teacher.encode(texts)).sum(1).mean()
    assert agreement > 0.9  # the student points where its teacher does


@pytest.mark.parametrize("argv", [["--student", "dynamic"]])
def test_an_unknown_student_is_refused(tmp_path, capsys, argv):
    with pytest.raises(SystemExit):
        main(["train", "--traces", "x", "--output", str(tmp_path / "o"), *argv])
    assert "invalid choice: 'dynamic'" in capsys.readouterr().err

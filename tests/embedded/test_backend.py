"""embedded/backend.py: where the embedded backend's model lives, and that a model folder given is served as it is."""

import subprocess
import sys
from pathlib import Path

import pytest

from moe_cohort.embedded import backend as embedded


def test_the_cache_folder_follows_cohort_cache_dir_then_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.delenv("COHORT_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert embedded.default_model_dir() == Path.home() / ".cache" / "moe-cohort" / "trained-tiny-moe-model"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert embedded.default_model_dir() == tmp_path / "xdg" / "moe-cohort" / "trained-tiny-moe-model"
    monkeypatch.setenv("COHORT_CACHE_DIR", str(tmp_path / "cohort"))
    assert embedded.default_model_dir() == tmp_path / "cohort" / "trained-tiny-moe-model"


def test_a_folder_with_a_model_is_served_as_it_is_and_an_empty_one_is_trained(monkeypatch, tmp_path):
    trained = []

    def train(out_dir, cache_dir):  # the recipe's own training is tested in tests/devtools, the child below
        trained.append((out_dir, cache_dir))
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "config.json").write_text("{}")

    monkeypatch.setenv("COHORT_CACHE_DIR", str(tmp_path / "cache"))
    given = tmp_path / "mine"
    given.mkdir()
    (given / "config.json").write_text('{"model_type": "qwen3_moe"}')
    assert embedded.ensure_trained_model(given, train=train) == given and trained == []
    assert embedded.ensure_trained_model(tmp_path / "new", train=train) == tmp_path / "new"
    assert trained == [(tmp_path / "new", tmp_path / "cache" / "trained-tiny-moe")]
    assert embedded.ensure_trained_model(None, train=train) == tmp_path / "cache" / "trained-tiny-moe-model"
    assert len(trained) == 2 and embedded.ensure_trained_model(None, train=train) and len(trained) == 2  # once


@pytest.mark.integration
def test_training_runs_in_a_child_that_leaves_torch_out_of_the_caller(tmp_path):
    """The serving process asks for the model; torch (and the Triton it loads, whose shutdown prints noise)
    is imported only by the child that trains (the small "ci" recipe here)."""
    code = ("import sys, pathlib; from moe_cohort.embedded.backend import train_apart; "
            "train_apart(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), recipe='ci'); "
            "print(sorted(m for m in ('torch', 'triton', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m"), str(tmp_path / "cache")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]" and "nanobind" not in done.stderr
    assert embedded.has_model(tmp_path / "m")

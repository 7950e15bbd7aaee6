"""embedded/backend.py: where the embedded backend's model lives, and that a model folder given is served as it is."""

from pathlib import Path

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
    from moe_cohort.devtools import train_moe

    trained = []

    def train(out_dir, args, cache_dir=None):  # the recipe's own training is tested in tests/devtools
        trained.append((Path(out_dir), args, Path(cache_dir)))
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "config.json").write_text("{}")
        return Path(out_dir)

    monkeypatch.setattr(train_moe, "train_tiny_moe", train)
    monkeypatch.setenv("COHORT_CACHE_DIR", str(tmp_path / "cache"))
    given = tmp_path / "mine"
    given.mkdir()
    (given / "config.json").write_text('{"model_type": "qwen3_moe"}')
    assert embedded.ensure_trained_model(given) == given and trained == []
    assert embedded.ensure_trained_model(tmp_path / "new") == tmp_path / "new"
    assert trained == [(tmp_path / "new", train_moe.RECIPES["full"], tmp_path / "cache" / "trained-tiny-moe")]
    assert embedded.ensure_trained_model(None) == tmp_path / "cache" / "trained-tiny-moe-model"
    assert len(trained) == 2 and embedded.ensure_trained_model(None) and len(trained) == 2  # once

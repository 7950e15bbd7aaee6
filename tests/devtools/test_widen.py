"""Widened experts: same logits, config and summary say the width, new down columns zero, new gate/up rows not."""

import hashlib
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402

from moe_cohort.cli import main  # noqa: E402
from moe_cohort.devtools import widen  # noqa: E402
from moe_cohort.devtools.tiny_moe import TinyMoeArgs, make_tiny_moe  # noqa: E402
from moe_cohort.devtools.widen import expert_size_bytes, widen_experts  # noqa: E402

ARGS = TinyMoeArgs(num_layers=2, num_experts=8, top_k=2, moe_intermediate_size=32)
WIDTH = 96


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(source, widened) folders: a small random qwen3_moe and its experts widened from 32 to 96."""
    root = tmp_path_factory.mktemp("widen")
    src = make_tiny_moe(root / "src", ARGS)
    return src, widen_experts(src, root / "wide", WIDTH, seed=0)


def _tensors(model_dir):
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def _logits(model_dir, sequences):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(sequences)).logits  # [B, T, V]


def test_widened_model_has_the_same_logits(models):
    src, wide = models
    gen = torch.Generator().manual_seed(1)
    sequences = torch.randint(3, ARGS.vocab_size // 2, (3, 12), generator=gen).tolist()
    # Weights are bf16 on disk and loaded as float32 (exactly), so the forward pass runs in float32. The
    # new neurons add terms act * 0.0 == +-0.0 to each down-projection sum, which change no partial sum;
    # only the summation order may differ (a longer dot product can be blocked otherwise): float32
    # rounding, about 1e-7 relative, far below the 1e-5 allowed. In bf16 such a reordering could flip
    # the rounding of an activation (one bf16 ulp, 0.4%) and the flip would propagate; hence float32.
    # Observed: equal to the bit. New down columns of 0.01 instead of 0 move logits by 5e-2 (the test fails).
    torch.testing.assert_close(_logits(wide, sequences), _logits(src, sequences), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["mixtral", "olmoe"])
def test_other_architectures_keep_their_logits(tmp_path, arch):
    src = make_tiny_moe(tmp_path / "src", TinyMoeArgs(arch=arch, num_layers=1, num_experts=8, top_k=2))
    wide = widen_experts(src, tmp_path / "wide", 64)
    assert json.loads((wide / "config.json").read_text())["intermediate_size"] == 64
    sequences = [[5, 17, 40, 9, 33, 100, 7, 8]]
    torch.testing.assert_close(_logits(wide, sequences), _logits(src, sequences), rtol=1e-5, atol=1e-5)


def test_config_and_summary_record_the_width(models):
    src, wide = models
    config, before = json.loads((wide / "config.json").read_text()), json.loads((src / "config.json").read_text())
    assert config["moe_intermediate_size"] == WIDTH
    assert {k: v for k, v in config.items() if k != "moe_intermediate_size"} == \
           {k: v for k, v in before.items() if k != "moe_intermediate_size"}
    summary = json.loads((wide / "cohort_tiny_moe.json").read_text())
    assert summary["expert_width"] == WIDTH and summary["expert_width_before"] == 32
    added = ARGS.num_layers * ARGS.num_experts * 3 * ARGS.hidden_size * (WIDTH - 32)
    assert summary["num_parameters"] == json.loads((src / "cohort_tiny_moe.json").read_text())["num_parameters"] + added
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (wide / name).read_bytes() == (src / name).read_bytes()
    assert expert_size_bytes(wide) == (3 * ARGS.hidden_size * WIDTH * 2, WIDTH, ARGS.num_layers * ARGS.num_experts)


def test_new_down_columns_zero_new_gate_up_rows_not(models):
    src, wide = models
    old, new = _tensors(src), _tensors(wide)
    assert old.keys() == new.keys()
    for name, w in new.items():
        assert w.dtype == old[name].dtype == torch.bfloat16
        if ".experts." not in name:
            assert torch.equal(w, old[name]), name
        elif name.endswith("down_proj.weight"):
            assert w.shape == (ARGS.hidden_size, WIDTH)  # [H, N]
            assert torch.equal(w[:, :32], old[name]) and not w[:, 32:].any()
        else:
            assert w.shape == (WIDTH, ARGS.hidden_size)  # [N, H]
            assert torch.equal(w[:32], old[name])
            extra = w[32:].float()
            assert (extra != 0).float().mean() > 0.95
            assert 0.5 < extra.std() / old[name].float().std() < 2  # the scale of the existing rows


def test_deterministic_and_seeded(models, tmp_path):
    src, wide = models

    def digest(d):
        return hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()

    assert digest(widen_experts(src, tmp_path / "again", WIDTH, seed=0)) == digest(wide)
    assert digest(widen_experts(src, tmp_path / "seed1", WIDTH, seed=1)) != digest(wide)


def test_refuses_a_narrower_width_and_other_architectures(models, tmp_path):
    src, _ = models
    with pytest.raises(ValueError, match="below the model's current expert size 32"):
        widen_experts(src, tmp_path / "narrow", 16)
    config = json.loads((src / "config.json").read_text())
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**config, "model_type": "deepseek_v3"}))
    with pytest.raises(ValueError, match="supports model types .*'qwen3_moe'.*not 'deepseek_v3'"):
        widen_experts(other, tmp_path / "out", WIDTH)


def test_cli_widens_the_random_and_the_trained_model(tmp_path, capsys, monkeypatch):
    assert main(["make-tiny-moe", str(tmp_path / "r"), "--num-layers", "1", "--expert-width", "64"]) == 0
    out = capsys.readouterr().out
    assert "experts widened from 32 to 64: 0.012 MB -> 0.025 MB each" in out and "wrote qwen3_moe" in out
    assert json.loads((tmp_path / "r" / "config.json").read_text())["moe_intermediate_size"] == 64
    assert main(["make-tiny-moe", str(tmp_path / "n"), "--num-layers", "1", "--expert-width", "8"]) == 2
    assert "below the model's current expert size 32" in capsys.readouterr().out

    from moe_cohort.devtools import train_moe

    def fake_train(out_dir, recipe, cache_dir=None, use_cache=True):  # training takes minutes: a stand-in
        out = make_tiny_moe(out_dir, TinyMoeArgs(num_layers=1))
        summary = json.loads((out / "cohort_tiny_moe.json").read_text())
        summary.update(train_tokens=1, train_seconds=1.0, train_cpu_seconds=1.0, peak_rss_mb=1.0, lm_losses=[1.0],
                       size_on_disk_bytes=1)
        (out / "cohort_tiny_moe.json").write_text(json.dumps(summary))
        return out

    monkeypatch.setattr(train_moe, "train_tiny_moe", fake_train)
    assert main(["make-tiny-moe", "--trained", str(tmp_path / "t"), "--expert-width", "128"]) == 0
    assert "experts widened from 32 to 128" in capsys.readouterr().out
    summary = json.loads((tmp_path / "t" / "cohort_tiny_moe.json").read_text())
    assert summary["expert_width"] == 128 and summary["size_on_disk_bytes"] > 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no scratch folder left


def test_layouts_cover_the_tiny_architectures():
    from moe_cohort.devtools.tiny_moe import ARCHITECTURES

    assert set(ARCHITECTURES) <= set(widen.EXPERT_LAYOUTS)

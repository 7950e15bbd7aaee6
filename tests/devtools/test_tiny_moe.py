"""`cohort make-tiny-moe`: deterministic, loadable by transformers, chat template, decisive routing."""

import hashlib
import json

import pytest
import torch

from moe_cohort.devtools.tiny_moe import TinyMoeArgs, make_tiny_moe
from moe_cohort.cli import main

transformers = pytest.importorskip("transformers")


def _digest(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_cli_writes_identical_files_twice(tmp_path, capsys):
    assert main(["make-tiny-moe", str(tmp_path / "a"), "--num-layers", "2"]) == 0
    assert main(["make-tiny-moe", str(tmp_path / "b"), "--num-layers", "2"]) == 0
    assert "wrote qwen3_moe" in capsys.readouterr().out
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    files = set(_digest(tmp_path / "a"))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files


def test_another_seed_gives_other_weights(tmp_path):
    make_tiny_moe(tmp_path / "a", TinyMoeArgs(num_layers=1))
    make_tiny_moe(tmp_path / "b", TinyMoeArgs(num_layers=1, seed=1))
    assert _digest(tmp_path / "a")["model.safetensors"] != _digest(tmp_path / "b")["model.safetensors"]


def test_cli_rejects_head_dim_below_32(tmp_path, capsys):
    assert main(["make-tiny-moe", str(tmp_path), "--head-dim", "16"]) == 2
    assert "head_dim must be >= 32" in capsys.readouterr().out


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe"])
def test_model_loads_and_routes_decisively(tmp_path, arch):
    out = make_tiny_moe(tmp_path, TinyMoeArgs(arch=arch, num_layers=2))
    config = json.loads((out / "config.json").read_text())
    assert config["num_experts_per_tok"] == 4 and config.get("head_dim", 64 // 2) >= 32
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok("The quick brown fox jumps over the lazy dog", return_tensors="pt").input_ids
    with torch.no_grad():
        router_logits = model(ids, output_router_logits=True).router_logits  # L x [T, E]
    assert len(router_logits) == 2
    for logits in router_logits:
        top = logits.reshape(ids.shape[1], -1).float().topk(5, dim=-1).values  # [T, 5]
        gap = top[:, 3] - top[:, 4]  # between the 4th and 5th expert
        assert gap.median() > 1e-2  # top-k choices do not hinge on rounding noise


def test_chat_template_and_special_tokens(tmp_path):
    out = make_tiny_moe(tmp_path, TinyMoeArgs(num_layers=1))
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>"
    assert tok.decode(tok("def add(a, b):").input_ids) == "def add(a, b):"

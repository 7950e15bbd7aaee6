"""The trained tiny MoE: routes by content (CI recipe, from scratch), cached, deterministic, loadable."""

import dataclasses
import hashlib
import json
from collections import defaultdict

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from benchmarks.routing_mi import chat_prompt, model_category_mi  # noqa: E402
from moe_cohort.cli import main  # noqa: E402
from moe_cohort.devtools import train_moe  # noqa: E402
from moe_cohort.devtools.corpus import CorpusArgs, build_corpus  # noqa: E402
from moe_cohort.devtools.tiny_moe import TinyMoeArgs, build_config, build_model  # noqa: E402
from moe_cohort.devtools.train_moe import RECIPES, TrainArgs, train_tiny_moe  # noqa: E402

MICRO = TrainArgs(model=TinyMoeArgs(hidden_size=32, num_layers=1, num_heads=1, num_kv_heads=1, num_experts=8, top_k=2,
                                    moe_intermediate_size=16, vocab_size=300, router_scale=1.0),
                  corpus=CorpusArgs(prompts_path=None, max_code_files=2), steps=3, batch_size=2, seq_len=32,
                  warmup=1, log_every=1)


def _weights_digest(model_dir):
    return hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def ci_model(tmp_path_factory):
    """The CI recipe trained from scratch, with no cache."""
    return train_tiny_moe(tmp_path_factory.mktemp("ci-moe") / "model", RECIPES["ci"], use_cache=False)


def _heldout_by_kind(corpus, per_kind=40):
    by_kind = defaultdict(list)
    for doc in corpus.heldout:
        by_kind[doc.kind].append(doc)
    docs = [d for kind in sorted(by_kind) for d in by_kind[kind][:per_kind]]
    texts = [d.text if d.category in ("stdlib", "pydoc") else chat_prompt(d.text) for d in docs]
    return texts, [d.kind for d in docs]


def test_ci_model_routes_by_content_twice_the_random_model(ci_model):
    args = RECIPES["ci"]
    tok = transformers.AutoTokenizer.from_pretrained(ci_model)
    trained = transformers.AutoModelForCausalLM.from_pretrained(ci_model, dtype=torch.float32)
    rnd_args = dataclasses.replace(args.model, router_scale=TinyMoeArgs().router_scale)  # make-tiny-moe's default
    random_model = build_model(build_config(rnd_args, len(tok), tok.eos_token_id, tok.pad_token_id), rnd_args).float()
    texts, kinds = _heldout_by_kind(build_corpus(args.corpus))
    assert len(set(kinds)) >= 2
    mi_trained = model_category_mi(trained, tok, texts, kinds)  # [L] bits
    mi_random = model_category_mi(random_model, tok, texts, kinds)
    assert len(mi_trained) == args.model.num_layers
    assert (mi_trained >= 2 * mi_random).all(), (mi_trained, mi_random)


def test_ci_model_is_a_servable_chat_model(ci_model):
    config = json.loads((ci_model / "config.json").read_text())
    summary = json.loads((ci_model / "cohort_tiny_moe.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config.get("num_local_experts", config.get("num_experts")) == 32  # transformers 5 renames the key
    assert config["head_dim"] >= 32 and summary["trained"] and summary["size_on_disk_bytes"] > 0
    assert summary["lm_losses"][-1] < summary["lm_losses"][0]  # it learned something
    tok = transformers.AutoTokenizer.from_pretrained(ci_model)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == chat_prompt("hi") and tok.eos_token == "<|im_end|>"
    sample = "def read_config(path):\n    return json.loads(open(path).read())  # the settings"
    assert len(sample) / len(tok(sample).input_ids) > 1.8  # BPE learned merges (bytes alone: about 1)


def test_same_seed_same_weights_other_seed_other_weights(tmp_path):
    a = train_tiny_moe(tmp_path / "a", MICRO, use_cache=False)
    b = train_tiny_moe(tmp_path / "b", MICRO, use_cache=False)
    c = train_tiny_moe(tmp_path / "c", dataclasses.replace(MICRO, seed=1), use_cache=False)
    assert _weights_digest(a) == _weights_digest(b) != _weights_digest(c)


def test_cache_is_reused_and_keyed_by_recipe(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    first = train_tiny_moe(tmp_path / "a", MICRO, cache_dir=cache)
    assert len(list(cache.iterdir())) == 1

    def no_training(*args, **kwargs):
        raise AssertionError("trained again although the recipe is cached")

    monkeypatch.setattr(train_moe, "_train_into", no_training)
    monkeypatch.setitem(train_moe.RECIPES, "ci", MICRO)
    assert main(["make-tiny-moe", str(tmp_path / "b"), "--trained", "--recipe", "ci", "--cache-dir", str(cache)]) == 0
    assert "wrote trained qwen3_moe (ci)" in capsys.readouterr().out
    assert _weights_digest(tmp_path / "b") == _weights_digest(first)
    with pytest.raises(AssertionError, match="trained again"):
        train_tiny_moe(tmp_path / "c", dataclasses.replace(MICRO, steps=4), cache_dir=cache)


def test_training_text_keeps_to_the_prompt_kind():
    docs = build_corpus(CorpusArgs(prompts_path=None, max_code_files=2)).train
    texts = train_moe.training_texts(docs)
    assert set(texts) == {"code", "prose", "math", "chat"}  # templated prompts stand in for the prompt set
    assert all(t.endswith("<|endoftext|>") for t in texts["prose"])
    assert all(t.startswith(train_moe.USER) for t in texts["math"] + texts["chat"])

"""A tiny random Mixture-of-Experts checkpoint, built locally, for tests and benchmarks.

`make_tiny_moe(out_dir)` writes a Hugging Face model directory (config, safetensors weights,
tokenizer with a ChatML chat template, generation config) that vLLM's CPU build loads. It needs
no hub access and is deterministic: the same arguments give byte-identical files.

- Architectures: Qwen3-MoE (default), Mixtral, OLMoE.
- Tokenizer: byte-level BPE trained on a small built-in corpus, plus the special tokens
  `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`.
- head_dim >= 32, because vLLM's CPU attention supports head sizes 32, 64, 80, ... only.
- Router weights are scaled up (`router_scale`) so that routing is decisive: random router
  logits of an untrained model are nearly uniform, which makes top-k choices hinge on rounding
  noise. With scaled routers the choices are stable across implementations (vLLM vs
  transformers), so recorded traces can be checked against a reference forward pass.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ARCHITECTURES = ("qwen3_moe", "mixtral", "olmoe")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A mixture of experts routes every token to a few experts.
def add(a, b):
    return a + b
for i in range(10): print(i * i)
Question: what is 12 plus 30? Answer: 42. Solve 3x + 5 = 20, so x = 5.
Write a short poem about the sea, the wind and the moon over the harbour at night.
Translate to French: good morning, how are you today? Bonjour, comment allez-vous?
SELECT name, count(*) FROM users GROUP BY name ORDER BY 2 DESC;
The capital of France is Paris; the capital of Japan is Tokyo; Berlin is in Germany.
import numpy as np; x = np.arange(16).reshape(4, 4); print(x.T @ x)
Explain why the sky is blue in simple words for a child of seven years.
1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000 3.14159 2.71828
"""


@dataclass(frozen=True)
class TinyMoeArgs:
    """Shape of the tiny model. Defaults: 4 MoE layers, 16 experts, top-4, hidden 64."""

    arch: str = "qwen3_moe"
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 32
    num_experts: int = 16
    top_k: int = 4
    moe_intermediate_size: int = 32
    vocab_size: int = 512  # upper bound; BPE training may stop earlier
    max_position_embeddings: int = 4096
    router_scale: float = 8.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"arch must be one of {ARCHITECTURES}, got {self.arch!r}")
        if self.head_dim < 32:
            raise ValueError(f"head_dim must be >= 32 (vLLM CPU attention), got {self.head_dim}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must lie in [1, num_experts={self.num_experts}], got {self.top_k}")


def build_tokenizer(vocab_size: int = 512, texts=None):
    """A byte-level BPE tokenizer (transformers `PreTrainedTokenizerFast`) with a ChatML template,
    trained on `texts` (an iterable of strings; default: the small built-in corpus)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS.splitlines() if texts is None else texts, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token="<|endoftext|>", bos_token=None,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build_config(args: TinyMoeArgs, vocab_size: int, eos_token_id: int, pad_token_id: int):
    """The transformers config of `args.arch` with the tiny shape."""
    import transformers

    common = dict(
        vocab_size=vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
        max_position_embeddings=args.max_position_embeddings, tie_word_embeddings=False,
        eos_token_id=eos_token_id, pad_token_id=pad_token_id, bos_token_id=None,
        num_experts_per_tok=args.top_k,
    )
    if args.arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common, head_dim=args.head_dim, intermediate_size=4 * args.hidden_size,
            moe_intermediate_size=args.moe_intermediate_size, num_experts=args.num_experts,
            norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1,
        )
    if args.arch == "mixtral":
        return transformers.MixtralConfig(
            **common, head_dim=args.head_dim, intermediate_size=args.moe_intermediate_size,
            num_local_experts=args.num_experts,
        )
    if args.hidden_size // args.num_heads != args.head_dim:
        raise ValueError("olmoe derives head_dim = hidden_size / num_heads; choose them to match head_dim")
    return transformers.OlmoeConfig(
        **common, intermediate_size=args.moe_intermediate_size, num_experts=args.num_experts,
        norm_topk_prob=False,
    )


def build_model(config, args: TinyMoeArgs):
    """Random weights from `args.seed`; router weights scaled by `args.router_scale`."""
    import torch
    import transformers

    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight") or name.endswith("block_sparse_moe.gate.weight"):
                param.mul_(args.router_scale)
    return model.to(torch.bfloat16).eval()


def make_tiny_moe(out_dir: str | Path, args: TinyMoeArgs = TinyMoeArgs()) -> Path:
    """Write the tiny model, its tokenizer and a `cohort_tiny_moe.json` summary to `out_dir`.

    Files are written to a scratch folder beside `out_dir` and moved in one by one, `config.json`
    last, so a folder with a `config.json` always holds a complete model (even after a crash).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(args.vocab_size)
    config = build_config(args, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    model = build_model(config, args)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    summary = {**asdict(args), "vocab_size": len(tokenizer),
               "num_parameters": sum(p.numel() for p in model.parameters())}
    write_model_dir(out, model, tokenizer, summary)
    log.info("wrote tiny %s (%d params, vocab %d) to %s", args.arch, summary["num_parameters"], len(tokenizer), out)
    return out


def write_model_dir(out: Path, model, tokenizer, summary: dict) -> Path:
    """Save `model`, `tokenizer` and `summary` (as cohort_tiny_moe.json) into `out`, `config.json` last."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".tiny-moe-", dir=out.parent) as tmp:
        scratch = Path(tmp)
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        (scratch / "cohort_tiny_moe.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        for path in sorted(scratch.iterdir(), key=lambda p: p.name == "config.json"):
            os.replace(path, out / path.name)
    return out

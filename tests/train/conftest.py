"""A tiny sentence-transformers model built in the test (word-level tokenizer, 2-layer BERT), so
training tests run in seconds and need no downloaded weights."""

from __future__ import annotations

import pytest

from moe_cohort.traces.synthetic import TOPICS


def build_tiny_model(folder, seed: int = 0):
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    words = sorted({w for text in TOPICS.values() for w in text.split()})
    vocab = {tok: i for i, tok in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                            sep_token="[SEP]", model_max_length=32).save_pretrained(folder)
    torch.manual_seed(seed)
    BertModel(BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=64)).save_pretrained(folder)
    transformer = Transformer(str(folder), max_seq_length=32)
    model = SentenceTransformer(modules=[transformer, Pooling(32, "mean"), Normalize()], device="cpu")
    return model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A saved tiny sentence-transformers folder; load it afresh in each test (training mutates models)."""
    folder = tmp_path_factory.mktemp("tiny-st")
    build_tiny_model(folder / "hf").save(str(folder / "st"))
    return folder / "st"


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny models gain nothing from threads, and OpenMP spinning on a busy 2-core machine costs 10x."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

"""Long prompts cut to a character prefix before tokenisation, where that changes no token the model sees.

An encoder that keeps a text's first N tokens still tokenises the whole text first: a long prompt
costs tokenizer time in proportion to its length for the same N tokens of input, and a static
model's whole cost is that tokenizer pass. For a BERT-style tokenizer the first tokens of a text
are those of any prefix that ends at whitespace: BertNormalizer works per character (clean-up,
CJK spacing, accents, case), BertPreTokenizer splits words at whitespace and punctuation, and
WordPiece splits each word on its own. So `Clipper.clip` cuts a long text at the last whitespace
within CHARS_PER_TOKEN * N characters and keeps the cut only if the prefix alone yields at least N
tokens (one tokenizer pass over the prefix); otherwise (long unbroken words, no whitespace) the
text stays whole. The model input is unchanged either way. Other tokenizers are left alone: their
pre-tokenisation need not be local.
"""

from __future__ import annotations

import re
from typing import Sequence

CHARS_PER_TOKEN = 8
_SPACE = re.compile(r"\s")


class Clipper:
    """`clip(texts)`: each text, or a prefix of it with the same first `max_tokens` tokens."""

    def __init__(self, tokenizer, max_tokens: int):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_str(tokenizer.to_str())  # a copy: its own padding and truncation state
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_tokens)
        self.max_tokens, self.window = max_tokens, CHARS_PER_TOKEN * max_tokens

    @classmethod
    def of(cls, tokenizer, max_tokens: int | None) -> Clipper | None:
        """A clipper for a `tokenizers.Tokenizer` that is BERT-style, else None."""
        if max_tokens is None or tokenizer is None:
            return None
        bert = (type(tokenizer.pre_tokenizer).__name__ == "BertPreTokenizer"
                and type(tokenizer.normalizer).__name__ in ("BertNormalizer", "NoneType"))
        return cls(tokenizer, max_tokens) if bert else None

    def clip(self, texts: Sequence[str]) -> list[str]:
        out = list(texts)
        cuts = {}  # index -> prefix
        for i, text in enumerate(out):
            if len(text) > self.window:
                m = _SPACE.search(text[self.window - 1 :: -1])  # the last whitespace within the window
                if m is not None:
                    cuts[i] = text[: self.window - 1 - m.start()]
        if cuts:
            counts = [len(e.ids) for e in self.tokenizer.encode_batch(list(cuts.values()), add_special_tokens=False)]
            for (i, prefix), n in zip(cuts.items(), counts):
                if n >= self.max_tokens:  # the model keeps at most max_tokens, all from whole words of the prefix
                    out[i] = prefix
        return out

"""The sentence encoder on ONNX Runtime, int8: the same model, exported once, cheaper per prompt (docs/results.md).

`--encoder onnx` is the packaged all-MiniLM-L6-v2, `--encoder onnx:SPEC` any sentence-transformers
model SPEC names (a folder such as a `cohort train` output, or a hub name). The transformer is
exported with `torch.onnx.export`, its MatMul weights quantised to int8 per output channel
(`onnxruntime.quantization.quantize_dynamic`; per-tensor int8 moves the embeddings of short texts
too far from the torch model's, per channel keeps them close), and run by plain `onnxruntime` on token
ids from the fast `tokenizers` encoder (sentence-transformers' own tokenisation costs as much as
the model at these sizes). Pooling (mean or CLS) and normalisation are done in numpy.
Dynamic int8 quantises activations with one scale per call, over every row and pad of the batch,
so a text's embedding would depend on its batch-mates; Embedder feeds one text per call, which
keeps the embedding a function of the text (the cache relies on it) and cost no more CPU here
than batches of 64 (docs/results.md, "Which encoder").
Not `SentenceTransformer(backend="onnx")`: that needs optimum, which downgrades transformers.

The export lives in $COHORT_CACHE_DIR (encoder.static.cache_root), in a folder named after the
source and a digest of its weights (a retrained folder is exported again). The source's
expert-profile head (encoder.profile) is copied beside it whenever the source's copy changes, so
the proxy finds the head of a fine-tuned encoder in the ONNX folder as it does in the original.
"""

from __future__ import annotations

import filecmp
import hashlib
import json
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np

from moe_cohort.encoder.static import cache_root

log = logging.getLogger(__name__)

ONNX_NAME = "onnx"
CONFIG_FILE = "onnx_config.json"
MODEL_FILE = "model.onnx"
HEAD_FILE = "expert_profile_head.npz"  # encoder.profile.HEAD_FILE
_PROBES = ["How do I sort a list of dictionaries by a key in Python?", "Écris un POÈME sur la mer.", "hi"]


def is_onnx_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / CONFIG_FILE).is_file() and (Path(path) / MODEL_FILE).is_file()


def onnx_model_dir(source: str, *, quantize: bool = True, root: Path | None = None) -> Path:
    """The folder of the ONNX export of `source` (a resolved folder or hub name), built once."""
    out = (root or cache_root()) / f"onnx-{Path(source).name}-{_digest(source)}-{'int8' if quantize else 'fp32'}"
    if not is_onnx_dir(out):
        log.info("exporting %s to ONNX%s into %s; this happens once", source, " (int8)" if quantize else "", out)
        export(source, out, quantize=quantize)
    _sync_head(Path(source), out)
    return out


def _digest(source: str) -> str:
    """Source and its weight files' sizes and times: a changed model gets a new folder."""
    h = hashlib.blake2b(str(source).encode(), digest_size=6)
    folder = Path(source)
    if folder.is_dir():
        for f in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def _sync_head(source: Path, out: Path) -> None:
    src, dst = source / HEAD_FILE, out / HEAD_FILE
    if not src.is_file():
        dst.unlink(missing_ok=True)
        return
    if dst.is_file() and filecmp.cmp(src, dst, shallow=False):
        return
    tmp = out / f".{HEAD_FILE}.{os.getpid()}"
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def export(source: str, out: Path, *, quantize: bool = True) -> Path:
    """Export the sentence-transformers model `source` to the ONNX folder `out` (complete or absent)."""
    import torch
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(source, device="cpu")
    config = _config(st, source, quantize)
    transformer = st[0].auto_model.eval()
    names = config["input_names"]
    example = {k: torch.ones(2, 8, dtype=torch.long) if k != "token_type_ids" else torch.zeros(2, 8, dtype=torch.long)
               for k in names}

    class Hidden(torch.nn.Module):  # the transformer, positional inputs -> last hidden state [B, T, H]
        def __init__(self):
            super().__init__()
            self.model = transformer

        def forward(self, *inputs):
            return self.model(**dict(zip(names, inputs))).last_hidden_state

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".onnx-", dir=out.parent) as tmp:
        raw = Path(tmp) / ("fp32.onnx" if quantize else MODEL_FILE)
        axes = {k: {0: "batch", 1: "tokens"} for k in [*names, "last_hidden_state"]}
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tracer warnings about shape-dependent branches: axes stay dynamic
            torch.onnx.export(Hidden(), tuple(example[k] for k in names), str(raw), input_names=names,
                              output_names=["last_hidden_state"], dynamic_axes=axes, opset_version=17, dynamo=False)
        if quantize:
            from onnxruntime.quantization import QuantType, quantize_dynamic

            quantize_dynamic(str(raw), str(Path(tmp) / MODEL_FILE), op_types_to_quantize=["MatMul"], per_channel=True,
                             weight_type=QuantType.QInt8)
            raw.unlink()
        st.tokenizer.backend_tokenizer.save(str(Path(tmp) / "tokenizer.json"))
        (Path(tmp) / CONFIG_FILE).write_text(json.dumps(config, indent=1))
        _check_tokenizer(st, Path(tmp))
        shutil.rmtree(out, ignore_errors=True)  # an incomplete earlier attempt
        os.replace(tmp, out)
        os.makedirs(tmp)  # TemporaryDirectory removes what it made
    return out


def _config(st, source: str, quantize: bool) -> dict:
    kinds = [type(m).__name__ for m in st]
    if kinds[0] != "Transformer" or len(kinds) < 2 or kinds[1] != "Pooling" or kinds[2:] not in ([], ["Normalize"]):
        raise ValueError(f"encoder {source!r}: ONNX export needs a Transformer + Pooling (+ Normalize) model, "
                         f"this one is {' + '.join(kinds)}; use it without `onnx:`")
    pooling = st[1].pooling_mode
    pooling = pooling[0] if isinstance(pooling, (tuple, list)) and len(pooling) == 1 else pooling
    if pooling not in ("mean", "cls"):
        raise ValueError(f"encoder {source!r}: ONNX export supports mean or CLS pooling, not {pooling!r}; "
                         f"use it without `onnx:`")
    names = [n for n in ("input_ids", "attention_mask", "token_type_ids") if n in st.tokenizer.model_input_names]
    return {"source": str(source), "pooling": pooling, "max_seq_length": int(st.max_seq_length),
            "dim": int(st[1].get_embedding_dimension()),
            "input_names": names, "quantized": quantize}


def _check_tokenizer(st, folder: Path) -> None:
    """The raw tokenizer must give the ids sentence-transformers gives (lower-casing flags and the like)."""
    mine = OnnxSentenceModel.load_tokenizer(folder, int(st.max_seq_length))
    theirs = st.tokenizer(_PROBES, truncation=True, max_length=st.max_seq_length)["input_ids"]
    if [e.ids for e in mine.encode_batch(_PROBES)] != [list(ids) for ids in theirs]:
        raise ValueError(f"encoder {st}: its fast tokenizer does not reproduce sentence-transformers' tokenisation; "
                         f"use it without `onnx:`")


class OnnxSentenceModel:
    """An exported folder: `tokenize(texts) -> id lists`, `embed(id lists) -> unit float32 [B, D]`."""

    def __init__(self, folder: str | os.PathLike, *, threads: int | None = None):
        import onnxruntime as ort

        self.folder = Path(folder)
        self.config = json.loads((self.folder / CONFIG_FILE).read_text())
        self.dim, self.pooling = int(self.config["dim"]), self.config["pooling"]
        self.input_names = list(self.config["input_names"])
        self._max = int(self.config["max_seq_length"])
        self.tokenizer = self.load_tokenizer(self.folder, self._max)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = (threads or 0), 1  # 0: ORT's default, one per core
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")  # idle threads leave the CPU to others
        self.session = ort.InferenceSession(str(self.folder / MODEL_FILE), opts, providers=["CPUExecutionProvider"])

    @staticmethod
    def load_tokenizer(folder: Path, max_len: int):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
        tok.no_padding()  # sentence-transformers' tokenizer files may pad to a fixed length; batches pad here
        tok.enable_truncation(max_len)
        return tok

    @property
    def max_seq_length(self) -> int:
        return self._max

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        self._max = int(value)
        self.tokenizer.enable_truncation(self._max)

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, with special tokens, cut to `max_seq_length`."""
        return [e.ids for e in self.tokenizer.encode_batch(list(texts))]

    def embed(self, ids: Sequence[Sequence[int]]) -> np.ndarray:
        """Unit embeddings [B, D] float32 of token-id lists (padded here to the longest)."""
        lengths = np.array([len(i) for i in ids])  # [B]
        mask = (np.arange(max(lengths.max(initial=0), 1))[None, :] < lengths[:, None]).astype(np.int64)  # [B, T]
        input_ids = np.zeros(mask.shape, dtype=np.int64)  # [B, T]
        for row, seq in enumerate(ids):
            input_ids[row, : len(seq)] = seq
        feeds = {"input_ids": input_ids, "attention_mask": mask, "token_type_ids": np.zeros_like(input_ids)}
        hidden = self.session.run(None, {k: feeds[k] for k in self.input_names})[0]  # [B, T, H]
        if self.pooling == "cls":
            x = hidden[:, 0]  # [B, H]
        else:
            w = mask[:, :, None].astype(np.float32)  # [B, T, 1]
            x = (hidden * w).sum(axis=1) / np.maximum(w.sum(axis=1), 1e-9)  # [B, H]
        return (x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)).astype(np.float32)

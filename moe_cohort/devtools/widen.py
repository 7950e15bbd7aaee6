"""Widen every routed expert of a MoE model folder with inert neurons: experts of real size, same logits.

`widen_experts(src_dir, out_dir, width)` writes a copy of the model in `src_dir` whose experts have
intermediate size `width` (N) instead of their current one (I), N >= I:

- gate and up projections [I, H] -> [N, H]: the I rows kept, the N - I new rows drawn from a seeded
  normal with the standard deviation of that matrix's own weights, so they are not zero and a kernel
  really reads and multiplies them;
- down projection [H, I] -> [H, N]: the I columns kept, the N - I new columns exactly zero, so every new
  neuron's activation is multiplied by 0 and the expert's output, hence the model's logits, are the
  source's (exactly in exact arithmetic; in floating point up to the order in which a kernel sums the
  down projection's now longer dot products).

The router, attention, norms and embeddings are copied unchanged, so routing is the same; weights keep
their dtype. The config's expert size (`EXPERT_LAYOUTS`) becomes N, the `cohort_tiny_moe.json` summary,
where there is one, records the width, and every other file (tokenizer, generation config, chat template)
is copied. Deterministic: the same source, width and seed give byte-identical files. Reads and writes
safetensors with the `safetensors` package (one or several shards, per-expert tensors as transformers
saves them); no vLLM import.

Use: on a small CPU model every expert costs the same few microseconds, so a kernel's time does not
depend on how many distinct experts a step loads; widened, it does, while the model's outputs (and the
traces, routing and text) stay those of the original.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SUMMARY = "cohort_tiny_moe.json"
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class ExpertLayout:
    """Where an architecture keeps its expert size and how it names an expert's three projections."""

    config_key: str  # the config.json field holding the experts' intermediate size
    gate: str
    up: str
    down: str


EXPERT_LAYOUTS = {
    "qwen3_moe": ExpertLayout("moe_intermediate_size", "gate_proj", "up_proj", "down_proj"),
    "olmoe": ExpertLayout("intermediate_size", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ExpertLayout("intermediate_size", "w1", "w3", "w2"),
}


def expert_layout(config: dict) -> ExpertLayout:
    """The layout of `config`'s model_type; a ValueError names the supported ones otherwise."""
    model_type = config.get("model_type")
    if model_type not in EXPERT_LAYOUTS:
        raise ValueError(f"widening experts supports model types {sorted(EXPERT_LAYOUTS)}, not {model_type!r}")
    return EXPERT_LAYOUTS[model_type]


def widen_experts(src_dir: str | Path, out_dir: str | Path, width: int, seed: int = 0) -> Path:
    """Write `src_dir`'s model with every expert widened to intermediate size `width` into `out_dir`.

    Raises ValueError when `width` is below the current expert size, when the model type is not in
    `EXPERT_LAYOUTS`, or when the weights hold no per-expert projections of the configured size.
    Files go to a scratch folder beside `out_dir` and are moved in with `config.json` last, so a folder
    with a config.json holds a complete model. `out_dir` must not be `src_dir`.
    """
    src, out = Path(src_dir), Path(out_dir)
    config = json.loads((src / "config.json").read_text())
    layout = expert_layout(config)
    current = int(config[layout.config_key])
    if width < current:
        raise ValueError(f"expert width {width} is below the model's current expert size {current} "
                         f"({layout.config_key}): widening only adds neurons")
    if out.resolve() == src.resolve():
        raise ValueError("out_dir must differ from src_dir: the source model is kept as it is")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".widen-", dir=out.parent) as tmp:
        scratch = Path(tmp)
        added = _write_weights(src, scratch, layout, current, width, seed)
        _copy_other_files(src, scratch)
        config[layout.config_key] = width
        (scratch / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _write_summary(src, scratch, current, width, seed, added)
        for path in sorted(scratch.iterdir(), key=lambda p: p.name == "config.json"):
            os.replace(path, out / path.name)
    log.info("widened the experts of %s from %d to %d (%d parameters added) into %s", src, current, width, added, out)
    return out


def _write_weights(src: Path, scratch: Path, layout: ExpertLayout, current: int, width: int, seed: int) -> int:
    """Widen the experts of every safetensors shard of `src` into `scratch`; the parameters added."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    pattern = re.compile(rf"\.experts\.\d+\.({layout.gate}|{layout.up}|{layout.down})\.weight$")
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"no *.safetensors weights in {src}")
    added = widened = 0
    for shard in shards:
        tensors = {}
        with safe_open(str(shard), framework="pt") as f:
            metadata = f.metadata()
            for name in f.keys():
                tensor = f.get_tensor(name)
                match = pattern.search(name)
                if match:
                    is_down = match.group(1) == layout.down
                    tensor = widen_projection(tensor, current, width, is_down, _tensor_seed(seed, name))
                    added += (tensor.numel() // width) * (width - current)
                    widened += 1
                tensors[name] = tensor
        save_file(tensors, str(scratch / shard.name), metadata=metadata)
    if not widened:
        raise ValueError(f"no per-expert '{layout.gate}/{layout.up}/{layout.down}' weights in {src} "
                         "(a fused expert layout is not supported)")
    return added


def widen_projection(weight, current: int, width: int, is_down: bool, seed: int):
    """One expert projection widened from `current` to `width` neurons, in its own dtype.

    gate/up: [I, H] -> [N, H], new rows ~ Normal(0, std of `weight`) from `seed` (1/sqrt(H) if std is 0).
    down:    [H, I] -> [H, N], new columns zero.
    """
    import torch

    if is_down:
        if weight.shape[1] != current:
            raise ValueError(f"down projection of shape {tuple(weight.shape)} does not have {current} columns")
        extra = weight.new_zeros(weight.shape[0], width - current)  # [H, N - I]
        return torch.cat([weight, extra], dim=1).contiguous()  # [H, N]
    if weight.shape[0] != current:
        raise ValueError(f"gate/up projection of shape {tuple(weight.shape)} does not have {current} rows")
    hidden = weight.shape[1]
    std = float(weight.float().std()) if weight.numel() > 1 else 0.0
    std = std if std > 0 else hidden ** -0.5
    gen = torch.Generator().manual_seed(seed)
    extra = torch.randn(width - current, hidden, generator=gen, dtype=torch.float32) * std  # [N - I, H]
    return torch.cat([weight, extra.to(weight.dtype)], dim=0).contiguous()  # [N, H]


def _tensor_seed(seed: int, name: str) -> int:
    """A seed per tensor from the run's seed and the tensor's name: independent of the order of reading."""
    return zlib.crc32(f"{seed}:{name}".encode())


def _copy_other_files(src: Path, scratch: Path) -> None:
    """Copy every file that is not weights, config or summary; the shard index gets its new total size."""
    skip = {"config.json", SUMMARY, INDEX}
    for path in sorted(src.iterdir()):
        if path.is_file() and path.suffix != ".safetensors" and path.name not in skip:
            shutil.copy2(path, scratch / path.name)
    if (src / INDEX).is_file():
        index = json.loads((src / INDEX).read_text())
        index.setdefault("metadata", {})["total_size"] = _tensor_bytes(scratch)
        (scratch / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _tensor_bytes(folder: Path) -> int:
    """The bytes of the tensors in `folder`'s safetensors files (as a shard index counts them)."""
    from safetensors import safe_open

    total = 0
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                numel = 1
                for dim in sl.get_shape():
                    numel *= dim
                total += numel * _DTYPE_BYTES[sl.get_dtype()]
    return total


_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                "F8_E4M3": 1, "F8_E5M2": 1}


def _write_summary(src: Path, scratch: Path, current: int, width: int, seed: int, added: int) -> None:
    """The source's cohort_tiny_moe.json, if any, with the new width, parameter count and size on disk."""
    if not (src / SUMMARY).is_file():
        return
    summary = json.loads((src / SUMMARY).read_text())
    summary.update(moe_intermediate_size=width, expert_width=width, expert_width_before=current,
                   expert_width_seed=seed)
    if "num_parameters" in summary:
        summary["num_parameters"] += added
    path = scratch / SUMMARY
    path.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    if "size_on_disk_bytes" in summary:
        summary["size_on_disk_bytes"] = sum(p.stat().st_size for p in scratch.iterdir())
        path.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")


def expert_size_bytes(model_dir: str | Path) -> tuple[int, int, int]:
    """(bytes of one expert's three projections, its intermediate size, number of experts in the model),
    read from the config and the weights' dtype."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    layout = expert_layout(config)
    width, hidden = int(config[layout.config_key]), int(config["hidden_size"])
    pattern = re.compile(rf"\.experts\.\d+\.{layout.gate}\.weight$")
    count, itemsize = 0, None
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                if pattern.search(name):
                    count += 1
                    itemsize = itemsize or _DTYPE_BYTES[f.get_slice(name).get_dtype()]
    if not count:
        raise ValueError(f"no per-expert '{layout.gate}' weights in {model_dir}")
    return 3 * hidden * width * itemsize, width, count

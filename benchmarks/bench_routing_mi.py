"""Does routing follow content? Category/expert mutual information per layer, trained vs random.

    python -m benchmarks.bench_routing_mi --model TRAINED_DIR [--per-category 40]

Held-out prompts of $COHORT_DATA/prompts/mixed.jsonl (the side the trained model never saw,
traces.split), as the server sees them (a ChatML user turn), labelled by their mixed.jsonl
category; and held-out package text plus those prompts labelled by kind (code, math, chat,
prose). At most --per-category texts per label, so labels weigh alike. Models: the trained one,
a random-weight model of the same shape (make-tiny-moe's router scale), and make-tiny-moe's
default random model (16 experts, top-4). Prints one row per model and labelling.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from collections import defaultdict
from pathlib import Path

from benchmarks.heldout import PROMPTS, data_location
from benchmarks.routing_mi import chat_prompt, model_category_mi
from moe_cohort.devtools.corpus import CorpusArgs, build_corpus
from moe_cohort.devtools.tiny_moe import TinyMoeArgs, build_config, build_model, make_tiny_moe


def capped(docs, label, per_label: int):
    groups = defaultdict(list)
    for d in docs:
        groups[label(d)].append(d)
    return [d for key in sorted(groups) for d in groups[key][:per_label]]


def as_served(doc) -> str:
    return doc.text if doc.category in ("stdlib", "pydoc") else chat_prompt(doc.text)


def models(trained_dir: Path, tmp: Path):
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(trained_dir)
    trained = transformers.AutoModelForCausalLM.from_pretrained(trained_dir, dtype=torch.float32)
    shape = json.loads((trained_dir / "cohort_tiny_moe.json").read_text())
    fields = {f.name for f in dataclasses.fields(TinyMoeArgs)}
    rnd_args = TinyMoeArgs(**{k: v for k, v in shape.items() if k in fields and k not in ("router_scale", "vocab_size")})
    random_same = build_model(build_config(rnd_args, len(tok), tok.eos_token_id, tok.pad_token_id), rnd_args).float()
    default_dir = make_tiny_moe(tmp / "default")
    default = transformers.AutoModelForCausalLM.from_pretrained(default_dir, dtype=torch.float32)
    default_tok = transformers.AutoTokenizer.from_pretrained(default_dir)
    return [("trained", trained, tok), ("random, same shape", random_same, tok), ("make-tiny-moe default", default, default_tok)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="trained model folder (cohort make-tiny-moe --trained)")
    parser.add_argument("--per-category", type=int, default=40)
    args = parser.parse_args(argv)
    corpus = build_corpus(CorpusArgs(prompts_path=str(data_location() / PROMPTS)))
    prompts = [d for d in corpus.heldout if d.category not in ("stdlib", "pydoc")]
    by_category = capped(prompts, lambda d: d.category, args.per_category)
    by_kind = capped(corpus.heldout, lambda d: d.kind, args.per_category)
    print(f"held-out texts: {len(by_category)} prompts in {len({d.category for d in by_category})} categories; "
          f"{len(by_kind)} texts in {len({d.kind for d in by_kind})} kinds")
    with tempfile.TemporaryDirectory() as tmp:
        for name, model, tok in models(Path(args.model), Path(tmp)):
            for label, docs, key in (("category", by_category, lambda d: d.category), ("kind", by_kind, lambda d: d.kind)):
                mi = model_category_mi(model, tok, [as_served(d) for d in docs], [key(d) for d in docs])
                print(f"{name:24s} by {label:8s} MI bits per layer: " + " ".join(f"{x:.3f}" for x in mi)
                      + f"   mean {mi.mean():.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Training text for the trained tiny MoE: code, math word problems, chat/instructions and prose.

Sources (read in place, never copied into the repository):

- code:  the Python standard library's own top-level modules (`sysconfig` stdlib path);
- prose: `pydoc_data.topics` (the Python language reference, shipped with Python);
- math, chat and more code: the prompt set `prompts/mixed.jsonl` of $COHORT_DATA (GSM8K test,
  HumanEval, MT-Bench, Vicuna-bench; licenses beside the file), when it is at hand; else prompts made
  from templates (`devtools.templated_prompts`) of the same kinds.

Every source is split by request with the project's one held-out split (`traces.split.
split_requests`, its defaults, grouped by text); only the training side is ever trained
on, and the held-out side is what routing is measured on. For mixed.jsonl the split is applied to
the file's requests in file order, so held-out prompts never appear in the training text.

    corpus = build_corpus(CorpusArgs(prompts_path="DATA_DIR/prompts/mixed.jsonl"))
    corpus.train, corpus.heldout   # lists of Doc(kind, text, category)
    corpus.digest()                # sha256 of every text, for cache keys
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from moe_cohort.devtools.templated_prompts import templated_prompts
from moe_cohort.traces.split import split_requests

log = logging.getLogger(__name__)

KINDS = ("code", "math", "chat", "prose")
DATA_ENV = "COHORT_DATA"  # the data folder; unset: templated prompts instead of its prompt set
PROMPTS = "prompts/mixed.jsonl"  # the prompt set inside the data folder


def default_prompts_path() -> str | None:
    """$COHORT_DATA/prompts/mixed.jsonl when $COHORT_DATA is set, else None (templated prompts instead)."""
    folder = os.environ.get(DATA_ENV)
    return str(Path(folder) / PROMPTS) if folder else None


@dataclass(frozen=True)
class Doc:
    """One training or evaluation text; `kind` is one of KINDS, `category` the finer source label."""

    kind: str
    text: str
    category: str


@dataclass(frozen=True)
class CorpusArgs:
    """Which text goes in. `prompts_path` None or missing: templated prompts stand in for the prompt set."""

    prompts_path: str | None = field(default_factory=default_prompts_path)
    max_code_files: int = 400  # stdlib top-level modules, in name order
    code_chunk_lines: int = 40
    prose_chunk_chars: int = 1200
    holdout: float = 0.2
    seed: int = 0


@dataclass
class Corpus:
    train: list[Doc] = field(default_factory=list)
    heldout: list[Doc] = field(default_factory=list)

    def digest(self) -> str:
        """sha256 over every (side, kind, category, text), in order: the corpus's identity."""
        h = hashlib.sha256()
        for side, docs in (("train", self.train), ("heldout", self.heldout)):
            for d in docs:
                h.update(json.dumps([side, d.kind, d.category, d.text]).encode())
        return h.hexdigest()


def build_corpus(args: CorpusArgs = CorpusArgs()) -> Corpus:
    """Package code and prose, plus mixed.jsonl when present (else templated prompts), each split into train /
    held out."""
    corpus = Corpus()
    for docs in (stdlib_code(args), pydoc_prose(args), mixed_prompts(args) or templated(args)):
        train_idx, held_idx = split_requests(len(docs), args.holdout, args.seed, groups=[d.text for d in docs])
        corpus.train += [docs[i] for i in train_idx]
        corpus.heldout += [docs[i] for i in held_idx]
    log.info("corpus: %d training docs, %d held out (%s)", len(corpus.train), len(corpus.heldout),
             ", ".join(f"{k} {sum(d.kind == k for d in corpus.train)}" for k in KINDS))
    return corpus


def stdlib_code(args: CorpusArgs) -> list[Doc]:
    """Chunks of `code_chunk_lines` non-blank-led lines of the stdlib's top-level .py files."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[: args.max_code_files]
    docs = []
    for path in files:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        for start in range(0, len(lines), args.code_chunk_lines):
            text = "\n".join(lines[start : start + args.code_chunk_lines]).strip()
            if len(text) > 80:
                docs.append(Doc("code", text, "stdlib"))
    return docs


def pydoc_prose(args: CorpusArgs) -> list[Doc]:
    """Paragraph-aligned chunks of about `prose_chunk_chars` of the language reference topics."""
    from pydoc_data.topics import topics

    docs = []
    for name in sorted(topics):
        chunk = ""
        for para in topics[name].split("\n\n"):
            chunk = f"{chunk}\n\n{para}" if chunk else para
            if len(chunk) >= args.prose_chunk_chars:
                docs.append(Doc("prose", chunk.strip(), "pydoc"))
                chunk = ""
        if len(chunk.strip()) > 80:
            docs.append(Doc("prose", chunk.strip(), "pydoc"))
    return docs


def mixed_prompts(args: CorpusArgs) -> list[Doc]:
    """mixed.jsonl's prompts in file order, as Doc(kind, text, category); [] when the file is absent."""
    if not args.prompts_path or not Path(args.prompts_path).exists():
        log.info("no prompt set at %s: templated prompts stand in for it", args.prompts_path)
        return []
    rows = read_prompts(args.prompts_path)
    return [Doc(prompt_kind(r["category"]), r["text"], r["category"]) for r in rows]


def templated(args: CorpusArgs) -> list[Doc]:
    """Prompts made from templates (devtools.templated_prompts), standing in for a prompt set: math, code and
    chat requests (every other instruction is chat, as in `prompt_kind`)."""
    return [Doc(kind if kind in KINDS else "chat", text, f"templated-{kind}")
            for kind, text in templated_prompts(seed=args.seed)]


def read_prompts(path: str | Path) -> list[dict]:
    """The records {"id", "source", "category", "text"} of a prompt set, in file order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def prompt_kind(category: str) -> str:
    """The coarse kind of a mixed.jsonl category: math, code, or chat (every other instruction)."""
    if category == "math":
        return "math"
    if category in ("code", "coding"):
        return "code"
    return "chat"


def split_prompts(rows: list[dict], holdout: float = 0.2, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, heldout) records of a prompt set under the project's split (what build_corpus uses)."""
    train_idx, held_idx = split_requests(len(rows), holdout, seed, groups=[r["text"] for r in rows])
    return [rows[i] for i in train_idx], [rows[i] for i in held_idx]

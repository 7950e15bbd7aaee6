"""The training corpus: package text plus a prompt set, split with the project's one held-out split."""

import json

from moe_cohort.devtools.corpus import CorpusArgs, build_corpus, prompt_kind, read_prompts, split_prompts
from moe_cohort.devtools.train_moe import training_texts
from moe_cohort.traces.split import split_requests


def _prompt_file(tmp_path, n=60):
    cats = ["math", "code", "writing", "coding", "roleplay"]
    rows = [{"id": f"p{i:05d}", "source": "fixture", "category": cats[i % len(cats)],
             "text": f"prompt number {i} about {cats[i % len(cats)]} with words {i * 7919 % 1000}"} for i in range(n)]
    rows.append(dict(rows[3], id="p99999"))  # a duplicate text must stay on its twin's side
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_heldout_prompts_never_reach_the_training_text(tmp_path):
    path = _prompt_file(tmp_path)
    corpus = build_corpus(CorpusArgs(prompts_path=str(path), max_code_files=2))
    held = {d.text for d in corpus.heldout if d.category not in ("stdlib", "pydoc")}
    assert held
    trained_on = "\n".join(t for texts in training_texts(corpus.train).values() for t in texts)
    assert not [t for t in held if t in trained_on]


def test_prompt_split_is_the_projects_split(tmp_path):
    rows = read_prompts(_prompt_file(tmp_path))
    train, held = split_prompts(rows)
    want_train, want_held = split_requests(len(rows), 0.2, 0, groups=[r["text"] for r in rows])
    assert [r["id"] for r in train] == [rows[i]["id"] for i in want_train]
    assert [r["id"] for r in held] == [rows[i]["id"] for i in want_held]
    sides = {r["id"]: side for side, part in (("t", train), ("h", held)) for r in part}
    assert sides["p00003"] == sides["p99999"]


def test_kinds_and_package_sources(tmp_path):
    corpus = build_corpus(CorpusArgs(prompts_path=str(_prompt_file(tmp_path)), max_code_files=2))
    kinds = {d.kind for d in corpus.train + corpus.heldout}
    assert kinds == {"code", "math", "chat", "prose"}
    assert [prompt_kind(c) for c in ("math", "code", "coding", "writing")] == ["math", "code", "code", "chat"]
    assert build_corpus(CorpusArgs(prompts_path=None, max_code_files=2)).digest() != corpus.digest()
    assert any("def " in d.text for d in corpus.train if d.category == "stdlib")


def test_without_a_prompt_set_templated_prompts_of_every_kind_stand_in(tmp_path):
    corpus = build_corpus(CorpusArgs(prompts_path=str(tmp_path / "absent.jsonl"), max_code_files=2))
    templated = [d for d in corpus.train + corpus.heldout if d.category.startswith("templated-")]
    assert {d.kind for d in templated} == {"math", "code", "chat"}
    assert {d.kind for d in corpus.train + corpus.heldout} == {"code", "math", "chat", "prose"}
    held = {d.text for d in corpus.heldout if d.category.startswith("templated-")}
    assert held and not held & {d.text for d in corpus.train}  # the split keeps identical texts on one side
    assert build_corpus(CorpusArgs(prompts_path=None, max_code_files=2)).digest() == corpus.digest()

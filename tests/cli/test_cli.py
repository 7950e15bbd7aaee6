"""What every `cohort` subcommand shares: -v at any level, one flag name and one encoder default per setting,
help texts that name no source file."""

import logging
import re

import pytest

from moe_cohort.cli import SUBCOMMANDS, main
from moe_cohort.send.settings import DEFAULT_ENCODER, SECTIONS, Settings
from tests.helpers.cli_parsers import parsers


@pytest.mark.parametrize("argv, level", [
    (["traces", "info", "sample", "-v"], logging.INFO),
    (["traces", "info", "sample", "-vv"], logging.DEBUG),
    (["traces", "-v", "info", "sample"], logging.INFO),
    (["traces", "-v", "info", "sample", "--verbose"], logging.DEBUG),
    (["traces", "info", "sample"], logging.WARNING),
    (["traces", "import", "sample", "-o", "t.npz", "-v"], logging.INFO),
    (["batch", "run", "--input", "in.jsonl", "--output", "out.jsonl", "-v"], logging.INFO),
    (["eval", "--traces", "nope.npz", "--batch-size", "4", "-v"], logging.INFO),
])
def test_verbose_is_taken_after_the_leaf_subcommand_too(monkeypatch, tmp_path, capsys, argv, level):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("COHORT_BACKENDS", raising=False)
    levels = []
    monkeypatch.setattr(logging, "basicConfig", lambda **kwargs: levels.append(kwargs["level"]))
    main(argv)  # the batch and eval runs stop at their missing backend or traces: the level was set before
    assert levels == [level]


def test_one_flag_name_per_setting_across_commands():
    """A Settings field that two commands set has one flag name in both."""
    seen: dict[str, tuple[str, str]] = {}
    for parser in parsers():
        for action in parser._actions:
            if action.dest in Settings.__dataclass_fields__ and action.option_strings:
                flag = action.option_strings[-1].replace("--no-", "--")
                first = seen.setdefault(action.dest, (flag, parser.prog))
                assert first[0] == flag, f"{action.dest}: {first[0]} in {first[1]}, {flag} in {parser.prog}"
    assert seen["default_policy"][0] == "--default-policy" and seen["max_in_flight"][0] == "--max-in-flight"


def test_renamed_flags_are_gone_without_aliases(capsys):
    for argv, old in ((["plan", "--input", "x", "--output", "y", "--batch-size", "2", "--rejects", "r"], "--rejects"),
                      (["train", "--traces", "t", "--output", "o", "--max-seq-length", "8"], "--max-seq-length"),
                      (["train", "--traces", "t", "--output", "o", "--holdout", "0.1"], "--holdout"),
                      (["eval", "--traces", "t", "--batch-size", "2", "--heldout"], "--heldout"),
                      (["batch", "run", "--input", "x", "--output", "y", "--concurrency", "2"], "--concurrency"),
                      (["batch", "run", "--input", "x", "--output", "y", "--policy", "topk"], "--policy"),
                      (["batch", "run", "--input", "x", "--output", "y", "--max-line-bytes", "9"], "--max-line-bytes"),
                      (["replay", "--traces", "t", "--max-wait", "3"], "--max-wait"),
                      (["serve", "--max-queue-ms", "5"], "--max-queue-ms"),  # settings off the command line
                      (["serve", "--backend-wait-s", "0"], "--backend-wait-s")):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2 and f"unrecognized arguments: {old}" in capsys.readouterr().err


def test_every_encoder_flag_defaults_to_the_proxys_encoder():
    assert Settings().encoder == DEFAULT_ENCODER == "static"
    defaults = {}
    for parser in parsers():
        for action in parser._actions:
            if "--encoder" in action.option_strings:
                defaults[parser.prog] = action.default
            if "--base" in action.option_strings:  # `cohort train` fine-tunes a transformer: its help says why
                assert "'static'" in action.help and "fine-tune" in action.help
    # serve and batch leave it to the settings (flag > COHORT_ENCODER > config file > Settings' default)
    assert defaults == {"cohort serve": None, "cohort batch run": None, "cohort eval": DEFAULT_ENCODER,
                        "cohort replay": DEFAULT_ENCODER, "cohort plan": DEFAULT_ENCODER}


SOURCE = re.compile(r"\.py\b|\b(?:moe_cohort|eval|traces|train|encoder|proxy|engine|cli|admission|devtools|benchmarks)"
                    r"\.(?!npz|jsonl|json|md|png)[a-z_]{2,}")


def test_no_help_text_names_a_source_file_or_module():
    texts = [(f"{SECTIONS} section", about) for about, _ in SECTIONS.values()]
    for parser in parsers():
        texts.append((parser.prog, parser.description or ""))
        texts += [(f"{parser.prog} {g.title}", g.description or "") for g in parser._action_groups]
        texts += [(f"{parser.prog} {a.option_strings or a.dest}", a.help or "") for a in parser._actions]
    named = [(where, text) for where, text in texts if SOURCE.search(text)]
    assert not named, named


def test_train_says_what_its_default_objective_does():
    from moe_cohort.train.finetune import TrainConfig

    assert TrainConfig().loss == "profile"
    assert "predict each request's expert profile" in SUBCOMMANDS["train"][1] and "cosine" not in SUBCOMMANDS["train"][1]


def test_serve_help_groups_its_flags_by_the_settings_sections(capsys):
    parser = next(p for p in parsers() if p.prog == "cohort serve")
    groups = {g.title: g for g in parser._action_groups}
    assert list(SECTIONS) == [t for t in groups if t in SECTIONS]
    for name, (_, fields) in SECTIONS.items():
        dests = {a.dest for a in groups[name]._group_actions}
        assert dests and all(d in fields or d not in Settings.__dataclass_fields__ for d in dests), (name, dests)
    listed = {a.dest for g in parser._action_groups if g.title in SECTIONS for a in g._group_actions}
    assert {a.dest for a in parser._actions if a.dest in Settings.__dataclass_fields__} <= listed
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert all(f"\n{name}:\n" in out for name in SECTIONS)
    learning = out.index("\nlearning:\n")
    assert learning < out.index("--learn, --no-learn", learning) < out.index("\nbatches:\n")
    assert "--learn-capacity" not in out and "docs/configuration.md" in out  # the rest: variables and the file

"""One name per setting: every command's flags and every COHORT_* variable the code reads, read against the
settings table (send/settings.py). A flag that sets a setting is that setting's one flag; a flag or variable
for the same thing outside the table has the setting's name (in another unit: the same stem, its own unit);
no other flag or variable takes a setting's name. `cohort serve --help` shows the few settings a user sets;
docs/configuration.md lists every one, made from the table."""

import argparse
import ast
import re
from pathlib import Path

from moe_cohort.cli import config_reference
from moe_cohort.cli.config_reference import OTHER_VARIABLES
from moe_cohort.cli.setting_flags import flag_overrides
from moe_cohort.send.setting_sources import CONFIG_VARIABLE, load_settings
from moe_cohort.send.settings import ENGINE_READS, Settings, flag_of, variable_of
from tests.helpers.cli_parsers import parsers

ROOT = Path(__file__).resolve().parents[2]
SERVE_FLAGS_AT_MOST = 14  # -h/--help aside
UNITS = ("_ms", "_s", "_steps", "_bytes")
# flags outside the settings table for a setting's concept: (command, flag) -> the setting
SAME_CONCEPT = {
    ("cohort replay", "--max-queue-steps"): "max_queue_ms",  # the fairness bound in engine steps
    ("cohort replay", "--replica-routing"): "replica_routing",
    ("cohort compare", "--backend"): "backends",  # the vLLM server the proxy fronts
    ("cohort compare", "--api-key"): "api_keys",  # one of the proxy's keys
    ("cohort plan", "--max-seq-len"): "encoder_max_seq_len",
    ("cohort train", "--max-seq-len"): "encoder_max_seq_len",
}
# the settings vLLM's process reads too, and the engine module that reads each
ENGINE_MODULES = {"default_policy": "engine/vllm_plugin.py", "max_queue_ms": "engine/scheduler.py",
                  "max_passed": "engine/scheduler.py"}


def _stem(name: str) -> str:
    """A name without its unit: max_queue_ms -> max_queue."""
    return next((name.removesuffix(u) for u in UNITS if name.endswith(u)), name)


def _options():
    """(command, flag, dest) of every option of every command (a --x/--no-x pair once, as --x)."""
    for parser in parsers():
        for action in parser._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                flag = action.option_strings[-1 if isinstance(action, argparse.BooleanOptionalAction) else 0]
                yield parser.prog, flag.replace("--no-", "--"), action.dest


def test_a_flag_that_sets_a_setting_is_its_one_flag_and_no_other_flag_takes_a_settings_name():
    settings = set(Settings.__dataclass_fields__)
    names = {flag_of(n): n for n in settings} | {"--" + n.replace("_", "-"): n for n in settings}
    stems = {_stem(n): n for n in settings}
    problems, seen = [], set()
    for prog, flag, dest in _options():
        name = flag.lstrip("-").replace("-", "_")
        concept = dest if dest in settings else SAME_CONCEPT.get((prog, flag))
        seen.add((prog, flag))
        if concept is None:
            if flag in names or _stem(name) in stems:
                problems.append(f"{prog} {flag} ({dest}) takes the name of the setting "
                                f"{names.get(flag) or stems[_stem(name)]}")
            continue
        unit_free = "--" + _stem(concept).replace("_", "-")
        if flag != flag_of(concept) and not (flag.startswith(unit_free + "-") and name.endswith(UNITS)):
            problems.append(f"{prog} {flag} sets {concept}, whose flag is {flag_of(concept)}")
    problems += [f"{prog} has no {flag}" for prog, flag in SAME_CONCEPT if (prog, flag) not in seen]
    assert not problems, problems


def test_every_cohort_variable_the_code_reads_is_a_settings_or_documented_and_the_engine_reads_the_settings():
    variables = {variable_of(n) for n in Settings.__dataclass_fields__} | {CONFIG_VARIABLE}
    named: dict[str, set[str]] = {}
    for path in (ROOT / "moe_cohort").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for var in re.findall(r"\bCOHORT_[A-Z][A-Z0-9_]*\b", node.value):
                    named.setdefault(var, set()).add(str(path.relative_to(ROOT)))
    unknown = {v: sorted(p) for v, p in named.items() if v not in variables and v not in OTHER_VARIABLES}
    assert not unknown, f"COHORT_* variables that are no setting and not in OTHER_VARIABLES: {unknown}"
    assert set(OTHER_VARIABLES) <= set(named), sorted(set(OTHER_VARIABLES) - set(named))
    for var in OTHER_VARIABLES:  # another concept: no setting's name in it
        suffix = var.removeprefix("COHORT_").lower()
        clash = [n for n in Settings.__dataclass_fields__ if re.search(rf"(^|_){_stem(n)}(_|$)", suffix)]
        assert not clash, f"{var} names the setting {clash[0]}: read {variable_of(clash[0])} instead"
    assert set(ENGINE_MODULES) == set(ENGINE_READS)
    for name, module in ENGINE_MODULES.items():
        assert variable_of(name) in named and f"moe_cohort/{module}" in named[variable_of(name)], name


def test_serve_shows_at_most_a_dozen_flags_and_the_reference_lists_every_setting():
    serve = next(p for p in parsers() if p.prog == "cohort serve")
    shown = [a for a in serve._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    assert len(shown) <= SERVE_FLAGS_AT_MOST, [a.option_strings for a in shown]
    text = (ROOT / "docs" / "configuration.md").read_text()
    block = text.split("<!-- settings: begin -->\n")[1].split("<!-- settings: end -->")[0]
    assert block == config_reference.reference(), "docs/configuration.md: python -m moe_cohort.cli.config_reference"
    for name in Settings.__dataclass_fields__:
        assert f"| `{name}` | `{variable_of(name)}`" in block, name
    assert all(f"| `{var}` |" in block for var in OTHER_VARIABLES)


def test_the_settings_commands_say_each_flags_variable_once_made_from_the_table():
    commands = config_reference.command_flags()
    for parser in parsers():
        for action in parser._actions:
            said = re.findall(r"env (COHORT_[A-Z_]+)", action.help or "")
            if parser.prog in commands and action.dest in Settings.__dataclass_fields__:
                assert said == [variable_of(action.dest)], (parser.prog, action.option_strings, said)
                assert flag_of(action.dest) in commands[parser.prog]
            else:  # a variable named by hand is the option's own
                assert said in ([], [variable_of(action.dest)], [CONFIG_VARIABLE]), (parser.prog, action.dest, said)


def _batch_settings(argv, environ=None):
    from moe_cohort.cli import batch

    parser = argparse.ArgumentParser()
    batch.add_arguments(parser)
    args = parser.parse_args(["run", "--input", "in.jsonl", "--output", "out.jsonl", *argv])
    return load_settings(flag_overrides(args, batch._FLAGS), environ=environ or {}, flags=batch._FLAGS)


def test_batch_run_takes_max_in_flight_and_backend_as_serve_does():
    settings = _batch_settings(["--backend", "http://127.0.0.1:8000", "--max-in-flight", "16"])
    assert (settings.backends, settings.max_in_flight, settings.max_in_flight_for_batches) == (("http://127.0.0.1:8000",), 16, 16)
    repeated = _batch_settings(["--backend", "http://a:1", "--backend", "http://b:2"])
    assert repeated.backends == ("http://a:1", "http://b:2")
    assert _batch_settings(["--backend", "http://a:1,http://b:2"]).backends == ("http://a:1", "http://b:2")
    from_env = _batch_settings([], {"COHORT_MAX_IN_FLIGHT": "8", "COHORT_BACKENDS": "http://a:1, http://b:2"})
    assert (from_env.max_in_flight, from_env.backends) == (8, ("http://a:1", "http://b:2"))

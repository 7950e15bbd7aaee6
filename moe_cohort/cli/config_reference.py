"""The config reference (docs/configuration.md): every setting with its config key, variable, flag and the
commands that take it, default and meaning, then the COHORT_* variables that are no setting; made from the
settings table (proxy/settings.py) and the commands' flag tables. `python -m moe_cohort.cli.config_reference`
prints it."""

from __future__ import annotations

from moe_cohort.cli import batch, serve
from moe_cohort.proxy.settings import (ENGINE_READS, OTHER_VARIABLES, SECTIONS, FlagTable, Settings, flag_of,
                                       meaning_of, variable_of)


def command_flags() -> dict[str, FlagTable]:
    """The flag table of every command that takes settings: {"cohort serve": its table, ...}."""
    return {"cohort serve": serve._FLAGS, "cohort batch run": batch._FLAGS}


def reference() -> str:
    """The config reference in Markdown: one table per section (every setting: its config key, variable, flag
    and the commands that take it, default, meaning), then the COHORT_* variables that are no setting."""
    taken: dict[str, list[str]] = {}
    for command, table in command_flags().items():
        for dest, _, _ in table.values():
            taken.setdefault(dest, []).append(command.removeprefix("cohort "))
    lines = []
    for section, (about, names) in SECTIONS.items():
        lines += [f"### {section}: {about}", "", "| setting | variable | flag | default | meaning |",
                  "|---|---|---|---|---|"]
        for name in names:
            variable = f"`{variable_of(name)}`" + (" (vLLM too)" if name in ENGINE_READS else "")
            flag = f"`{flag_of(name)}` ({', '.join(taken[name])})" if name in taken else "-"
            default = Settings.__dataclass_fields__[name].default
            lines.append(f"| `{name}` | {variable} | {flag} | `{_shown(default)}` | {_cell(meaning_of(name))} |")
        lines.append("")
    lines += ["### other variables", "", "| variable | what it sets |", "|---|---|"]
    lines += [f"| `{name}` | {_cell(text)} |" for name, text in OTHER_VARIABLES.items()]
    return "\n".join(lines) + "\n"


def _shown(default: object) -> str:
    """A default as a config file writes it."""
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, tuple):
        return "[" + ", ".join(default) + "]"
    return '""' if default == "" else str(default)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


if __name__ == "__main__":
    print(reference(), end="")

"""The `cohort` commands' flags for the proxy's settings, made from the settings table (send/settings.py).

A command's flag table names the few settings a user sets there (`flag_table`); each flag is the setting's one
flag (`flag_of`), its help the setting's meaning (or the command's own words for it) with its default and its
variable, and it defaults to None so that an unset flag leaves the setting to its variable, the config file and
its default (send/setting_sources.py). Every other setting is a variable and a config key only, listed in the
config reference: `python -m moe_cohort.cli.config_reference` prints its tables (docs/configuration.md holds them).
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Iterable, Mapping

from moe_cohort.send.settings import SECTIONS, FlagTable, Settings, flag_of, meaning_of, variable_of

KINDS = {"int": int, "float": float, "str": str}


def flag_table(names: Iterable[str], helps: Mapping[str, str] | None = None) -> FlagTable:
    """{flag: (field, kind, help)} for the settings `names`, in their order: each setting's one flag, the kind its
    type asks for (bool: --x/--no-x; several values: list, the flag repeated), its meaning unless `helps` words
    it for the command."""
    table: FlagTable = {}
    for name in names:
        field = Settings.__dataclass_fields__[name]
        type_name = str(field.type).removesuffix(" | None")
        kind = list if type_name.startswith("tuple") or field.metadata["many"] else \
            bool if type_name == "bool" else KINDS[type_name]
        table[flag_of(name)] = (name, kind, (helps or {}).get(name) or meaning_of(name))
    return table


def section_groups(parser) -> dict[str, object]:
    """One argparse argument group per section of SECTIONS, in its order: {field: its section's group}."""
    groups: dict[str, object] = {}
    for name, (about, names) in SECTIONS.items():
        group = parser.add_argument_group(name, about)
        groups.update(dict.fromkeys(names, group))
    return groups


def add_setting_flags(parser, flags: FlagTable, groups: Mapping[str, object] | None = None) -> None:
    """Add one argparse option per flag (to `groups[field]` where given, else to `parser`), defaulting to
    None so unset flags fall back to env, config and defaults; the help ends with the default (unless it says
    its own) and the variable."""
    for flag, (dest, kind, help_text) in flags.items():
        default = Settings.__dataclass_fields__[dest].default
        shown = "" if "default" in help_text or default in ("", None) else f"default {default!r}; "
        kind_args = {"action": argparse.BooleanOptionalAction} if kind is bool else \
            {"action": "append"} if kind is list else {"type": kind}
        if kind is not bool:
            kind_args["metavar"] = flag.lstrip("-").replace("-", "_").upper()
        (groups or {}).get(dest, parser).add_argument(
            flag, dest=dest, default=None, **kind_args,
            help=f"{help_text} ({shown}env {variable_of(dest)})".replace("%", "%%"))


def flag_overrides(args, flags: FlagTable) -> dict[str, object]:
    """The Settings overrides that the parsed `args` carry for `flags` (None where not given). A repeated flag
    gives a tuple setting its values, each a value or a comma list (--backend A --backend B, --backend A,B), and a
    text setting its values joined by commas."""
    tuples = {f.name for f in fields(Settings) if str(f.type).startswith("tuple")}
    values = {dest: getattr(args, dest) for dest, _, _ in flags.values()}
    return {dest: (_items(v) if dest in tuples else ",".join(v)) if isinstance(v, list) else v
            for dest, v in values.items()}


def _items(values: list[str]) -> tuple[str, ...]:
    return tuple(item.strip() for value in values for item in value.split(","))  # an empty one is refused later

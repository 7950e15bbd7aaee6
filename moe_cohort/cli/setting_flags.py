"""The `cohort` commands' flags for the proxy's settings: one argparse option per setting a command exposes,
grouped by the settings' sections, defaulting to None so that an unset flag leaves the setting to its variable,
the config file and its default (proxy/setting_sources.py)."""

from __future__ import annotations

from dataclasses import fields
from typing import Mapping

from moe_cohort.proxy.settings import ENV_PREFIX, SECTIONS, FlagTable, Settings


def section_groups(parser) -> dict[str, object]:
    """One argparse argument group per section of SECTIONS, in its order: {field: its section's group}."""
    groups: dict[str, object] = {}
    for name, (about, names) in SECTIONS.items():
        group = parser.add_argument_group(name, about)
        groups.update(dict.fromkeys(names, group))
    return groups


def add_setting_flags(parser, flags: FlagTable, groups: Mapping[str, object] | None = None) -> None:
    """Add one argparse option per flag (to `groups[field]` where given, else to `parser`), defaulting to
    None so unset flags fall back to env, config and defaults; the help shows the Settings default and the
    variable."""
    defaults = {f.name: f.default for f in fields(Settings)}
    for flag, (dest, kind, help_text) in flags.items():
        shown = "" if "default" in help_text else f"default {defaults[dest]!r}; " if defaults[dest] != "" else ""
        kind_args = {"action": "append"} if kind is list else {"type": kind}  # list: repeatable, joined by commas
        (groups or {}).get(dest, parser).add_argument(
            flag, dest=dest, metavar=flag.lstrip("-").replace("-", "_").upper(), **kind_args, help=f"{help_text} ({shown}env {ENV_PREFIX}{dest.upper()})".replace("%", "%%"))


def flag_overrides(args, flags: FlagTable) -> dict[str, object]:
    """The Settings overrides that the parsed `args` carry for `flags` (None where not given). A repeated flag
    gives a tuple setting its values, and a text setting its values joined by commas (--backend A --backend B)."""
    tuples = {f.name for f in fields(Settings) if str(f.type).startswith("tuple")}
    values = {dest: getattr(args, dest) for dest, _, _ in flags.values()}
    return {dest: (tuple(v) if dest in tuples else ",".join(v)) if isinstance(v, list) else v
            for dest, v in values.items()}

"""Where the proxy's Settings come from, and in which order: CLI flags > `COHORT_*` variables > a config file
> the defaults of send/settings.py.

    load_settings(overrides, flags=...)   # the one Settings object of a process

Variables are `COHORT_<FIELD>` upper-cased (`COHORT_MAX_QUEUE_MS=5000`, `COHORT_API_KEYS=k1,k2`). A config file
(`--config FILE` or `COHORT_CONFIG`) is YAML (.yaml, .yml) or TOML (.toml), keys = Settings field names
(docs/configuration.md lists them all):

    # cohort.yaml (or the same keys in cohort.toml)
    backends: [http://127.0.0.1:8000]
    port: 9000
    default_policy: "xshare;m=24"
    api_keys: [alice-key, bob-key]

Values keep their YAML/TOML types and must match the field's type (an integer for `port`, a list of strings or
one comma-separated string for `api_keys`). Every mistake is one short line: an unknown key, override or
misspelt variable names its nearest setting; a bad value names the flag, the variable and the config key it
may have come from. A key setting given but empty is refused, never read as "no key": an unset secret in a
template must not start an open proxy.
"""

from __future__ import annotations

import difflib
import logging
import os
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Mapping

from moe_cohort.send.settings import ENV_PREFIX, FlagTable, Settings, SettingsError, variable_of

log = logging.getLogger(__name__)

# how close (difflib's ratio) a COHORT_* variable must be to a setting's variable to be taken for a misspelling
MISSPELT_CUTOFF = 0.8
KEY_SETTINGS = ("api_keys", "backend_api_key")  # given but empty: refused
CONFIG_VARIABLE = ENV_PREFIX + "CONFIG"  # the config file's path, where no --config gives one


def load_settings(overrides: Mapping[str, object] | None = None, environ: Mapping[str, str] | None = None, *,
                  config: str | Path | None = None, flags: FlagTable | None = None) -> Settings:
    """Defaults, then the `config` file (else $COHORT_CONFIG, if set), then `COHORT_*` variables from
    `environ` (os.environ), then non-None `overrides`. A SettingsError names the field's flag (from
    `flags`), its variable, and its key in the config file."""
    environ = os.environ if environ is None else environ
    config = config or environ.get(CONFIG_VARIABLE) or None
    types = {f.name: f.type for f in fields(Settings)}
    values: dict[str, object] = {}
    if config:
        try:
            values.update(_no_empty_keys(read_config(config, types), lambda name: f"{name!r} in {config}"))
        except ConfigFileError as exc:
            raise SettingsError(str(exc)) from None
    for name, type_name in types.items():
        raw = environ.get(variable_of(name))
        if raw is not None:
            values.update(_no_empty_keys({name: _convert(name, type_name, raw)}, variable_of))
    _warn_misspelt_variables(environ, types)
    flag_of = {dest: flag for flag, (dest, _, _) in (flags or {}).items()}
    values.update(_no_empty_keys({k: v for k, v in (overrides or {}).items() if v is not None},
                                 lambda name: flag_of.get(name, name)))
    unknown = sorted(set(values) - set(types))
    if unknown:
        raise SettingsError(unknown_setting(repr(unknown[0]), unknown[0], types, more=len(unknown) - 1))
    try:
        return Settings(**values)
    except SettingsError as exc:
        if exc.field is None:
            raise
        raise SettingsError(f"{setting_names(exc.field, flags, config)} {exc.detail}", field=exc.field,
                            detail=exc.detail) from None


# an old name -> its setting now, named in the error
RENAMED = {"batch_concurrency": "batch_max_in_flight", "routing": "replica_routing", "backend_url": "backends"}


def unknown_setting(what: str, name: str, names, *, more: int = 0, spell=lambda name: name) -> str:
    """One short line for `what`, a setting `name` that is none of `names`: the nearest valid name (as
    `spell(name)` writes it), never the whole list."""
    close = [RENAMED[name.lower()]] if name.lower() in RENAMED else difflib.get_close_matches(name.lower(), list(names), 1)
    hint = f"did you mean {spell(close[0])!r}?" if close else "every setting is in docs/configuration.md"
    others = f" (and {more} more unknown)" if more else ""
    return f"{what} is no setting{others}; {hint}"


def _warn_misspelt_variables(environ: Mapping[str, str], names) -> None:
    """A COHORT_* variable that is no setting but close to one: one warning line naming the setting's variable.
    Other COHORT_* variables (the engine's, the tools') are far from every setting and left alone."""
    for var in environ:
        name = var[len(ENV_PREFIX):].lower()
        if var.startswith(ENV_PREFIX) and name not in names and var != CONFIG_VARIABLE and \
                (name in RENAMED or difflib.get_close_matches(name, list(names), 1, cutoff=MISSPELT_CUTOFF)):
            log.warning("%s (ignored)", unknown_setting(var, name, names, spell=variable_of))


def _no_empty_keys(values: dict[str, object], where) -> dict[str, object]:
    """`values`, unless a key setting among them is given but empty: a SettingsError naming it (`where(name)`)."""
    for name in KEY_SETTINGS:
        if name in values and not values[name]:
            what = ("would start the proxy without keys, open to anyone; give at least one key, or leave the "
                    "setting out for an open proxy") if name == "api_keys" else \
                   "give the backend's key, or leave the setting out to send none"
            raise SettingsError(f"{where(name)} is given but empty: {what}", field=name)
    return values


def setting_names(field: str, flags: FlagTable | None = None, config: str | Path | None = None) -> str:
    """How a user sets `field`: "--port (env COHORT_PORT, 'port' in cohort.yaml)"."""
    flag = next((f for f, (dest, _, _) in (flags or {}).items() if dest == field), field)
    where = [f"env {variable_of(field)}"] + ([f"{field!r} in {config}"] if config else [])
    return f"{flag} ({', '.join(where)})"


def _convert(name: str, type_name: str, raw: str) -> object:
    type_name = type_name.removesuffix(" | None")  # an unset variable is None already: a given one has the type
    try:
        if type_name == "int":
            return int(raw)
        if type_name == "float":
            return float(raw)
        if type_name == "bool":
            if raw.lower() not in {"1", "true", "yes", "0", "false", "no", ""}:
                raise ValueError(raw)
            return raw.lower() in {"1", "true", "yes"}
        if type_name.startswith("tuple"):
            return tuple(s.strip() for s in raw.split(",") if s.strip())
        return raw
    except ValueError:
        raise SettingsError(f"{variable_of(name)}={raw!r}: expected {type_name}") from None


class ConfigFileError(ValueError):
    """The config file cannot be read, or one of its keys or values is wrong; the message names it."""


def read_config(path: str | Path, field_types: Mapping[str, str]) -> dict[str, object]:
    """{field: value} of the file at `path`, each value checked against `field_types` (field -> type name)."""
    path = Path(path)
    data = _load(path)
    unknown = [key for key in data if key not in field_types]
    if unknown:
        raise ConfigFileError(unknown_setting(f"{path}: key {unknown[0]!r}", str(unknown[0]), field_types,
                                              more=len(unknown) - 1))
    return {key: _checked(path, key, field_types[key], value) for key, value in data.items()}


def _load(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigFileError(f"cannot read the config file {path}: {exc}") from None
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            raise ConfigFileError(f"config file {path}: name it .yaml, .yml or .toml (its suffix picks the format)")
    except (tomllib.TOMLDecodeError, ValueError) as exc:
        if isinstance(exc, ConfigFileError):
            raise
        raise ConfigFileError(f"config file {path} is not valid {path.suffix[1:].upper()}: {exc}") from None
    except Exception as exc:  # yaml.YAMLError: PyYAML is imported only for YAML files
        raise ConfigFileError(f"config file {path} is not valid YAML: {' '.join(str(exc).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"config file {path}: expected keys and values at the top level, got {type(data).__name__}")
    return data


def _checked(path: Path, key: str, type_name: str, value: object) -> object:
    type_name = type_name.removesuffix(" | None")  # a key given has the type; leaving it out is None
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
    }.get(type_name)
    if type_name.startswith("tuple"):
        if isinstance(value, str):
            return tuple(s.strip() for s in value.split(",") if s.strip())
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        value = tuple(value) if ok else value
    if not ok:
        wanted = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}.get(
            type_name, "a list of strings")
        raise ConfigFileError(f"{path}: {key!r} must be {wanted}, got {type(value).__name__} {value!r}")
    return float(value) if type_name == "float" else value

"""A config file for the proxy's Settings: YAML (.yaml, .yml) or TOML (.toml), keys = Settings field names.

    # cohort.yaml (or the same keys in cohort.toml)
    backend_url: http://127.0.0.1:8000
    port: 9000
    default_policy: "xshare;m=24"
    api_keys: [alice-key, bob-key]

Values keep their YAML/TOML types and must match the field's type (an integer for `port`, a list of
strings or one comma-separated string for `api_keys`); an unknown key or a value of the wrong type
is a ConfigFileError, one line naming the file and the key (an unknown one with its nearest setting).
proxy/settings.py decides the precedence.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Mapping


class ConfigFileError(ValueError):
    """The config file cannot be read, or one of its keys or values is wrong; the message names it."""


def read_config(path: str | Path, field_types: Mapping[str, str]) -> dict[str, object]:
    """{field: value} of the file at `path`, each value checked against `field_types` (field -> type name)."""
    path = Path(path)
    data = _load(path)
    unknown = [key for key in data if key not in field_types]
    if unknown:
        from moe_cohort.proxy.settings import unknown_setting

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

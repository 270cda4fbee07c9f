"""Reading detector settings from people: a file, environment variables, `--set` flags.

Generic over the frozen settings dataclasses of the detectors (analyzer/config.py lists
them): values are parsed to each field's declared type here, then the settings class's own
`__post_init__` checks ranges. Every error is one ValueError naming `section.field` and
where the value came from, so a typo in a file or an env var is a message, not a traceback
and never a silently ignored setting.
"""

from __future__ import annotations

import json
import math
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

ENV_PREFIX = "TRAINVITALS_ANALYZER__"  # TRAINVITALS_ANALYZER__STRAGGLER__WINDOW=20


def read_file(path: str | Path) -> dict[str, dict[str, Any]]:
    """{section: {field: value}} from a TOML (`[straggler]` tables) or JSON file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ValueError(f"analyzer config {str(p)!r}: cannot read it ({e.strerror})") from e
    try:
        doc = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        kind = "JSON" if p.suffix == ".json" else "TOML"
        raise ValueError(f"analyzer config {str(p)!r}: not valid {kind}: {e}") from e
    if not isinstance(doc, dict) or not all(isinstance(v, dict) for v in doc.values()):
        raise ValueError(
            f"analyzer config {str(p)!r}: expected sections of settings, e.g. "
            "[straggler] then window = 20"
        )
    return {section: dict(values) for section, values in doc.items()}


def read_env(environ: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """{section: {field: text}} from TRAINVITALS_ANALYZER__<SECTION>__<FIELD> variables."""
    out: dict[str, dict[str, str]] = {}
    for name, text in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        parts = name[len(ENV_PREFIX) :].lower().split("__")
        if len(parts) != 2 or not all(parts):
            raise ValueError(
                f"environment variable {name}: expected {ENV_PREFIX}<SECTION>__<FIELD>"
            )
        out.setdefault(parts[0], {})[parts[1]] = text
    return out


def read_overrides(items: list[str]) -> dict[str, dict[str, str]]:
    """{section: {field: text}} from `section.field=value` flags."""
    out: dict[str, dict[str, str]] = {}
    for item in items:
        key, eq, text = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not (eq and dot and section and name):
            raise ValueError(
                f"--set {item!r}: expected SECTION.FIELD=VALUE, e.g. straggler.window=20"
            )
        out.setdefault(section, {})[name] = text.strip()
    return out


def merged(*layers: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Later layers override earlier ones, field by field."""
    out: dict[str, dict[str, Any]] = {}
    for layer in layers:
        for section, values in layer.items():
            out.setdefault(section, {}).update(values)
    return out


def build(cls: type, section: str, values: dict[str, Any], source: str) -> Any:
    """An instance of the settings dataclass `cls` with `values` parsed to its field types."""
    assert is_dataclass(cls), cls
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls) if f.init}
    unknown = sorted(set(values) - known)
    if unknown:
        listed = ", ".join(sorted(known))
        known_text = f"known in [{section}]: {listed}" if known else f"[{section}] has none"
        raise ValueError(f"{source}: {section}.{unknown[0]} is not a setting ({known_text})")
    parsed = {k: _parse(hints[k], v, f"{section}.{k}", source) for k, v in values.items()}
    try:
        return cls(**parsed)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {e}") from e


def _parse(hint: Any, value: Any, name: str, source: str) -> Any:
    """`value` (text from env/flags, or a TOML/JSON value) as the field's type."""
    target = _base_type(hint)
    try:
        if target is bool:
            return _parse_bool(value)
        if target is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if target is float:
            if isinstance(value, bool):
                raise ValueError
            out = float(value)
            if math.isnan(out):
                raise ValueError
            return out
        if target is str:
            return str(value)
    except (TypeError, ValueError):
        kind = {bool: "true or false", int: "an integer", float: "a number"}[target]
        raise ValueError(f"{source}: {name} must be {kind}, got {value!r}") from None
    raise ValueError(f"{source}: {name} cannot be set from a file or flag")


def _base_type(hint: Any) -> type:
    """int for `int`, float for `float | None` and the like."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError


def as_dict(settings: Any) -> dict[str, Any]:
    """A settings dataclass's fields, as they would be written in a file."""
    return {f.name: getattr(settings, f.name) for f in fields(settings) if f.init}

"""The machinery every config section shares: fields with docs, TOML, values from the CLI.

A section is a frozen dataclass whose fields are `knob`s: a default, a one-line doc and,
optionally, the values it accepts. `build_section` turns a raw dict (from TOML, a preset or
`--section.key value` overrides) into that dataclass, converting command-line strings with
the field's annotated type and naming the full dotted key in every error. Every number is
checked here once, whatever its key: NaN never passes, infinity only where a field says it
means "never" (`knob(..., inf_ok=True)`), and an integer must fit in 64 bits (sizes, counts
and seeds all end up in int64 tensors). `dumps_toml` prints a whole job back as TOML with
the docs as comments.

This module knows no section: `hyperloom.config.job` puts them together.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import sys
import types
import typing
from dataclasses import field
from pathlib import Path
from typing import Any

import tomli_w

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


# The largest integer a config key may hold: int64, what torch sizes and seeds are.
INT_LIMIT = 2**63 - 1


class ConfigError(ValueError):
    """A configuration problem the user can fix; `problems` lists each one.

    One problem reads as one line (`invalid configuration: train.lr ...`); several as a list.
    """

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            super().__init__(f"invalid configuration: {self.problems[0]}")
        else:
            super().__init__(
                "invalid configuration:\n" + "\n".join(f"  - {p}" for p in self.problems)
            )


def knob(
    default: Any = dataclasses.MISSING,
    doc: str = "",
    *,
    factory=None,
    choices=None,
    inf_ok: bool = False,
):
    """A config field with its one-line doc and, optionally, the values it accepts.

    `inf_ok`: a float field for which infinity is meaningful ("never"); NaN never is.
    """
    meta = {"doc": doc, "choices": tuple(choices) if choices else None, "inf_ok": inf_ok}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def positive(key: str, value: float) -> list[str]:
    """The problem of a value that must be positive, if it is not."""
    return [] if value > 0 else [f"{key} must be positive, got {value}"]


def type_hints(cls: type) -> dict[str, Any]:
    """A dataclass's field annotations, resolved (the modules use postponed annotations)."""
    return dict(_type_hints(cls))


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    # Resolving postponed annotations compiles each one: most of the time of loading a job.
    return typing.get_type_hints(cls)


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain nested dicts (TOML-serialisable)."""
    return dataclasses.asdict(cfg)


def deep_merge(base: dict, extra: dict) -> dict:
    """`extra` layered over `base`, tables merged key by key."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def suggest(name: str, known: list[str], prefix: str = "") -> str:
    """The " (did you mean 'x'?)" hint naming the known name closest to a misspelt one."""
    close = difflib.get_close_matches(name, known, n=1)
    full = f"{prefix}.{close[0]}" if close and prefix else (close[0] if close else "")
    return f" (did you mean '{full}'?)" if close else ""


class CliValue(str):
    """A string that came from the command line (so '200' may become an int)."""


def _number(value: float, key: str, inf_ok: bool) -> float:
    """A float that is a number: NaN never, infinity only where `inf_ok`."""
    if math.isnan(value):
        raise ConfigError(f"{key} must be a number, got nan")
    if math.isinf(value) and not inf_ok:
        raise ConfigError(f"{key} must be finite, got {value}")
    return value


def _integer(value: int, key: str) -> int:
    if abs(value) > INT_LIMIT:
        raise ConfigError(f"{key} = {value} is out of range: integers lie within +-(2**63 - 1)")
    return value


def _convert(value: Any, typ: Any, key: str, inf_ok: bool = False) -> Any:
    """Check or convert one value against its annotated type; raise with the key named."""
    origin = typing.get_origin(typ)
    from_cli = isinstance(value, CliValue)
    if dataclasses.is_dataclass(typ):  # an entry of a list of tables, e.g. [[data.blend]]
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table {{key = value, ...}}, got {value!r}")
        return build_section(typ, value, key)
    if origin in (list, tuple):
        (item,) = typing.get_args(typ)[:1]
        if from_cli:
            text = str(value).strip()
            if text.startswith("["):
                try:
                    value = tomllib.loads(f"v = {text}")["v"]
                except tomllib.TOMLDecodeError as exc:
                    raise ConfigError(f"{key}: cannot read {text!r} as a list ({exc})") from None
            else:
                value = [v for v in text.split(",") if v]
            value = [CliValue(v) if isinstance(v, str) else v for v in value]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return [_convert(v, item, f"{key}[{i}]", inf_ok) for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        raise TypeError(f"unsupported config annotation for {key}: {typ}")  # programming error
    if typ is bool:
        if from_cli:
            low = value.lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
            raise ConfigError(f"{key}: expected true or false, got {str(value)!r}")
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if typ is int:
        if from_cli:
            try:
                number = int(value.replace("_", ""))
            except ValueError:
                raise ConfigError(f"{key}: expected an integer, got {str(value)!r}") from None
            return _integer(number, key)
        if isinstance(value, int) and not isinstance(value, bool):
            return _integer(value, key)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if typ is float:
        if from_cli:
            try:
                number = float(value)
            except ValueError:
                raise ConfigError(f"{key}: expected a number, got {str(value)!r}") from None
            return _number(number, key, inf_ok)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an integer beyond the float range
                raise ConfigError(f"{key} must be finite, got {value}") from None
            return _number(number, key, inf_ok)
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if typ is str:
        if isinstance(value, str):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise TypeError(f"unsupported config annotation for {key}: {typ}")


def build_section(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    """Build one section dataclass from a raw dict, reporting every problem with its key."""
    if not isinstance(raw, dict):
        raise ConfigError(f"[{prefix}] must be a table, got {raw!r}")
    hints = type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    problems: list[str] = []
    kwargs: dict[str, Any] = {}
    for name, value in raw.items():
        key = f"{prefix}.{name}"
        if name not in fields:
            problems.append(
                f"unknown key '{key}'{suggest(name, list(fields), prefix)}; "
                f"[{prefix}] accepts: {', '.join(fields)}"
            )
            continue
        try:
            converted = _convert(value, hints[name], key, fields[name].metadata.get("inf_ok"))
        except ConfigError as exc:
            problems.extend(exc.problems)
            continue
        choices = fields[name].metadata.get("choices")
        if choices and converted not in choices:
            problems.append(f"{key} = {converted!r} is not one of: {', '.join(map(repr, choices))}")
            continue
        kwargs[name] = converted
    if problems:
        raise ConfigError(problems)
    return cls(**kwargs)


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    """Read a TOML file, turning I/O and syntax errors into `ConfigError`."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file '{p}' is a directory; give a TOML file")
    if not p.is_file():
        raise ConfigError(f"config file '{p}' does not exist")
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file '{p}' is not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file '{p}' is not UTF-8 text (byte {exc.start}: {exc.reason}); "
            f"TOML files are UTF-8"
        ) from None
    except OSError as exc:
        raise ConfigError(f"config file '{p}' cannot be read: {exc.strerror or exc}") from None


def dumps_toml(cfg: Any) -> str:
    """The resolved config as TOML, every key followed by its doc as a comment."""
    lines: list[str] = []
    for section in dataclasses.fields(cfg):
        value = getattr(cfg, section.name)
        lines.append(f"[{section.name}]  # {type(value).__doc__.strip().splitlines()[0]}")
        for f in dataclasses.fields(value):
            rendered = f"{f.name} = {_inline_toml(getattr(value, f.name))}"
            doc = f.metadata.get("doc", "")
            lines.append(f"{rendered:<40} # {doc}" if doc else rendered)
        lines.append("")
    return "\n".join(lines)


def _inline_toml(value: Any) -> str:
    """One value on one line: lists inline, a list's tables (dataclasses) as inline tables,
    so a key stays in its section's table whatever it holds."""
    if dataclasses.is_dataclass(value):
        items = (
            f"{f.name} = {_inline_toml(getattr(value, f.name))}" for f in dataclasses.fields(value)
        )
        return "{" + ", ".join(items) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_inline_toml(v) for v in value) + "]"
    return tomli_w.dumps({"v": value}).split("=", 1)[1].strip()


def dump_toml_file(cfg: Any, path: str | os.PathLike) -> None:
    Path(path).write_text(dumps_toml(cfg))

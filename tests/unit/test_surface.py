"""The user-facing surface of hyperloom, frozen in tests/unit/surface.json.

A refactor must not silently drop or change a command-line option or a config key. This test
collects the live surface and compares it with the committed snapshot:

- every sub-command path of `hyperloom` (walking `hyperloom.cli.build_parser()`, which the
  sub-CLIs of the planner, the pipeline, the converter and the drills register into), each
  with its options and positionals: option strings, action, nargs, type, default (where it is
  a plain value), choices and whether it is required;
- every `[section] key` of the job config (`dataclasses.fields` of `JobConfig` and its section
  types): its annotation, default and choices. `hyperloom train CONFIG --section.key value`
  overrides are these keys, so they cover what argparse does not parse;
- the names of the model presets in the registry.

A removed or changed entry fails the test: keep the surface, or change it on purpose. An added
entry fails too, so that every change to the surface is a deliberate, reviewed edit of the
snapshot. To accept the live surface, regenerate the snapshot and commit it:

    python tests/unit/test_surface.py --update
    # or: UPDATE_SURFACE=1 python -m pytest tests/unit/test_surface.py
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import typing
from pathlib import Path
from typing import Any

SNAPSHOT = Path(__file__).with_name("surface.json")
UPDATE_COMMAND = "python tests/unit/test_surface.py --update"

# --------------------------------------------------------------------------- collecting


def _plain(value: Any) -> Any:
    """A JSON-ready copy of `value` if it is plain data; otherwise a placeholder naming its type."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        items = [_plain(v) for v in value]
        return items
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _plain(v) for k, v in value.items()}
    return f"<{type(value).__name__}>"


def _action_names(parser: argparse.ArgumentParser) -> dict[type, str]:
    # argparse's registry of action names ("store_true" -> class); private, but stable.
    return {cls: name for name, cls in parser._registries["action"].items() if name is not None}


def _type_name(typ: Any) -> str | None:
    if typ is None:
        return None
    return getattr(typ, "__name__", repr(typ))


def _option_key(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"<{action.dest}>"
    longs = [s for s in action.option_strings if s.startswith("--")]
    return (longs or action.option_strings)[0]


def cli_surface(parser: argparse.ArgumentParser | None = None) -> dict[str, dict[str, Any]]:
    """'hyperloom train --nproc' -> what the option is; 'hyperloom train' -> the command."""
    if parser is None:
        from hyperloom.cli import build_parser

        parser = build_parser()
    names = _action_names(parser)
    out: dict[str, dict[str, Any]] = {}

    def walk(p: argparse.ArgumentParser, path: str) -> None:
        subcommands: list[str] = []
        for action in p._actions:  # argparse keeps no public list of a parser's arguments
            if isinstance(action, argparse._HelpAction):
                continue
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    subcommands.append(name)
                    walk(sub, f"{path} {name}")
                continue
            out[f"{path} {_option_key(action)}"] = {
                "option_strings": list(action.option_strings),
                "dest": action.dest,
                "action": names.get(type(action), type(action).__name__),
                "nargs": action.nargs,
                "type": _type_name(action.type),
                "default": _plain(action.default),
                "choices": _plain(list(action.choices)) if action.choices is not None else None,
                "required": bool(action.required),
            }
        # set_defaults values that are data (accepts_overrides), not the handler functions
        defaults = {k: _plain(v) for k, v in sorted(p._defaults.items()) if not callable(v)}
        out[path] = {"subcommands": sorted(subcommands), "defaults": defaults}

    walk(parser, parser.prog)
    return out


def _annotation(field: dataclasses.Field) -> str:
    """The field's annotation as written (a string under postponed annotations)."""
    typ = field.type
    if isinstance(typ, str):
        return typ
    if isinstance(typ, type) and not typing.get_args(typ):
        return typ.__name__
    return repr(typ).replace("typing.", "")


def config_surface() -> dict[str, dict[str, Any]]:
    """'[train] steps' -> its annotation, default and choices; '[train]' -> the section."""
    from hyperloom.config import JobConfig

    out: dict[str, dict[str, Any]] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            name = f"{prefix}.{f.name}" if prefix else f.name
            if dataclasses.is_dataclass(hints[f.name]):
                out[f"[{name}]"] = {"type": _annotation(f)}
                walk(hints[f.name], name)
                continue
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = "<required>"
            choices = f.metadata.get("choices")
            out[f"[{prefix}] {f.name}"] = {
                "type": _annotation(f),
                "default": _plain(default),
                "choices": _plain(list(choices)) if choices else None,
            }

    walk(JobConfig, "")
    return out


def preset_names() -> list[str]:
    """The registry's preset names: beside the model config, or (before issue 28) in models."""
    import hyperloom.config

    if hasattr(hyperloom.config, "preset_names"):
        return list(hyperloom.config.preset_names())
    from hyperloom.models.registry import preset_names

    return list(preset_names())


def live_surface() -> dict[str, Any]:
    return {"cli": cli_surface(), "config": config_surface(), "presets": sorted(preset_names())}


# --------------------------------------------------------------------------- comparing


def _flatten(surface: dict[str, Any]) -> dict[str, Any]:
    flat = {f"cli: {k}": v for k, v in surface.get("cli", {}).items()}
    flat.update({f"config: {k}": v for k, v in surface.get("config", {}).items()})
    flat.update({f"preset: {name}": {} for name in surface.get("presets", [])})
    return flat


@dataclasses.dataclass
class SurfaceDiff:
    removed: list[str]
    changed: list[str]  # "key: field old -> new"
    added: list[str]

    def __bool__(self) -> bool:
        return bool(self.removed or self.changed or self.added)

    def report(self) -> str:
        lines = [f"the CLI/config surface differs from {SNAPSHOT.name}:"]
        if self.removed:
            lines.append("REMOVED (users rely on these; keep them):")
            lines += [f"  - {k}" for k in self.removed]
        if self.changed:
            lines.append("CHANGED:")
            lines += [f"  ~ {k}" for k in self.changed]
        if self.added:
            lines.append("ADDED:")
            lines += [f"  + {k}" for k in self.added]
        lines.append(
            f"If the change is deliberate, regenerate the snapshot with `{UPDATE_COMMAND}` "
            "(or UPDATE_SURFACE=1 python -m pytest tests/unit/test_surface.py) and commit "
            f"tests/unit/{SNAPSHOT.name} with the change."
        )
        return "\n".join(lines)


def diff_surface(snapshot: dict[str, Any], live: dict[str, Any]) -> SurfaceDiff:
    old, new = _flatten(snapshot), _flatten(live)
    changed = []
    for key in sorted(old.keys() & new.keys()):
        if old[key] != new[key]:
            fields = sorted(old[key].keys() | new[key].keys())
            for f in fields:
                a, b = old[key].get(f, "<absent>"), new[key].get(f, "<absent>")
                if a != b:
                    changed.append(f"{key}: {f} {json.dumps(a)} -> {json.dumps(b)}")
    return SurfaceDiff(
        removed=sorted(old.keys() - new.keys()),
        changed=changed,
        added=sorted(new.keys() - old.keys()),
    )


def dumps(surface: dict[str, Any]) -> str:
    """JSON with one line per entry, so that a change to the surface is a one-line diff."""
    parts = []
    for part in sorted(surface):
        value = surface[part]
        if isinstance(value, dict):
            rows = [
                f"  {json.dumps(k)}: {json.dumps(value[k], sort_keys=True)}" for k in sorted(value)
            ]
        else:
            rows = [f"  {json.dumps(v)}" for v in value]
        brackets = "{}" if isinstance(value, dict) else "[]"
        parts.append(
            f" {json.dumps(part)}: {brackets[0]}\n" + ",\n".join(rows) + f"\n {brackets[1]}"
        )
    return "{\n" + ",\n".join(parts) + "\n}\n"


def write_snapshot() -> None:
    SNAPSHOT.write_text(dumps(live_surface()))


# --------------------------------------------------------------------------- tests


def test_surface_matches_the_snapshot():
    if os.environ.get("UPDATE_SURFACE"):
        write_snapshot()
    snapshot = json.loads(SNAPSHOT.read_text())
    diff = diff_surface(snapshot, live_surface())
    assert not diff, diff.report()


def test_snapshot_is_canonical():
    """The committed file is what `--update` writes, so regenerating it shows only real changes."""
    text = SNAPSHOT.read_text()
    assert text == dumps(json.loads(text)), f"rewrite it with `{UPDATE_COMMAND}`"


def test_the_surface_covers_each_part():
    live = live_surface()
    cli, config = live["cli"], live["config"]
    assert cli["hyperloom train --nproc"]["default"] == 1
    assert cli["hyperloom train"]["defaults"] == {"accepts_overrides": True}
    assert cli["hyperloom schedule <kind>"]["choices"]  # a sub-CLI's positional with choices
    assert cli["hyperloom schedule --microbatches"]["option_strings"] == ["--microbatches", "-m"]
    assert "hyperloom plan --fix" in cli and "hyperloom drill <kind>" in cli
    assert "hyperloom model info <name>" in cli and "hyperloom config show --nproc" in cli
    assert config["[train] steps"] == {"type": "int", "default": 300, "choices": None}
    assert config["[parallel] zero"]["choices"] == [0, 1, 3]
    assert config["[model]"] == {"type": "ModelConfig"}
    assert "tiny" in live["presets"]


def test_diff_reports_removed_changed_and_added_entries():
    snapshot = json.loads(SNAPSHOT.read_text())
    live = copy.deepcopy(snapshot)
    del live["cli"]["hyperloom generate --top-k"]  # a refactor dropped an option
    live["cli"]["hyperloom train --nproc"]["default"] = 2  # ... changed a default
    del live["config"]["[train] lr"]  # ... dropped a config key
    live["config"]["[parallel] zero"]["choices"] = [0, 1]  # ... narrowed a key's choices
    live["config"]["[train] new_knob"] = {"type": "int", "default": 0, "choices": None}
    live["presets"] = [p for p in live["presets"] if p != "tiny"]
    diff = diff_surface(snapshot, live)
    assert diff.removed == [
        "cli: hyperloom generate --top-k",
        "config: [train] lr",
        "preset: tiny",
    ]
    assert diff.changed == [
        "cli: hyperloom train --nproc: default 1 -> 2",
        "config: [parallel] zero: choices [0, 1, 3] -> [0, 1]",
    ]
    assert diff.added == ["config: [train] new_knob"]
    report = diff.report()
    assert "REMOVED" in report and "- cli: hyperloom generate --top-k" in report
    assert "~ config: [parallel] zero: choices [0, 1, 3] -> [0, 1]" in report
    assert "+ config: [train] new_knob" in report and UPDATE_COMMAND in report
    assert not diff_surface(snapshot, copy.deepcopy(snapshot))


def test_cli_walk_of_a_small_parser():
    parser = argparse.ArgumentParser(prog="tool")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run")
    p.add_argument("kind", choices=["a", "b"])
    p.add_argument("--steps", "-n", type=int, default=3)
    p.add_argument("--fast", action="store_true")
    p.set_defaults(func=print, accepts_overrides=True)
    surface = cli_surface(parser)
    assert set(surface) == {
        "tool",
        "tool run",
        "tool run <kind>",
        "tool run --steps",
        "tool run --fast",
    }
    assert surface["tool"]["subcommands"] == ["run"]
    assert surface["tool run"]["defaults"] == {"accepts_overrides": True}
    assert surface["tool run --steps"] == {
        "option_strings": ["--steps", "-n"],
        "dest": "steps",
        "action": "store",
        "nargs": None,
        "type": "int",
        "default": 3,
        "choices": None,
        "required": False,
    }
    assert surface["tool run --fast"]["action"] == "store_true"
    assert surface["tool run <kind>"]["choices"] == ["a", "b"]


if __name__ == "__main__":
    if "--update" in sys.argv[1:]:
        write_snapshot()
        print(f"wrote {SNAPSHOT}")
    else:
        found = diff_surface(json.loads(SNAPSHOT.read_text()), live_surface())
        print(found.report() if found else "the surface matches the snapshot")
        sys.exit(1 if found else 0)

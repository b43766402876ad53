"""docs/config.md is what scripts/config_reference.py prints from the config dataclasses, so
the reference cannot go stale: change a key, a default or a doc and this test says to
regenerate the page."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from hyperloom.config import JobConfig

ROOT = Path(__file__).resolve().parents[2]


def _reference_module():
    spec = importlib.util.spec_from_file_location(
        "config_reference", ROOT / "scripts" / "config_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_config_reference_is_the_generated_one():
    generated = _reference_module().render()
    committed = (ROOT / "docs" / "config.md").read_text()
    assert committed == generated, (
        "docs/config.md is out of date: run `python scripts/config_reference.py > docs/config.md`"
    )


def test_reference_names_every_key_with_its_doc():
    page = _reference_module().render()
    job = JobConfig()
    for section in dataclasses.fields(job):
        for f in dataclasses.fields(getattr(job, section.name)):
            assert f"| `{section.name}.{f.name}` |" in page
            assert f.metadata.get("doc"), f"{section.name}.{f.name} has no doc"

"""The package layering of hyperloom, checked by parsing every module's imports.

Lower layers never import higher ones: `LEVELS` below is the agreed table. Every module under
hyperloom/ is parsed with `ast`; its imports are collected wherever they are -- at module
level, inside functions, under `if TYPE_CHECKING` -- with relative imports resolved, and so
are string imports (`importlib.import_module("hyperloom...")`, `__import__`, and a string
constant naming a hyperloom module, such as a lazy-attribute map). Each import is then checked
against the rules below. No module is imported, so the check takes well under a second.

Rules (each violation is printed as file:line, importer -> imported, and the rule):

- layer: a module may import its own package and any package of a lower level in `LEVELS`;
  same-level packages may not import each other except the pairs in `SAME_LEVEL_ALLOWED`.
- config-isolated: `hyperloom.config` imports nothing else from hyperloom.
- no-cycles: the package-level import graph has no cycle.
- no-model-family-in-parallel: `hyperloom/parallel/` imports nothing from a model family
  (`hyperloom.models.llama`, `hyperloom.models.deepseek`); families hand it plans.
- planner-not-trainer: no module under `hyperloom/planner/` imports `hyperloom.train`; the
  trainer hands the planner its measurements.
- light-root: `hyperloom/__init__.py` imports nothing (a bare `import hyperloom` stays cheap).
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from collections import defaultdict
from pathlib import Path

import pytest

# Package -> level. A package may import packages of a lower level (and itself), never one of
# a higher level; packages of one level are independent of each other. A top-level module
# (hyperloom/cli.py, hyperloom/accelerator.py, ...) is a package of its own name here, and so
# is a top-level package (hyperloom/config/, hyperloom/checkpoint/) however its files are split.
LEVELS: dict[str, int] = {
    # 0: foundations, importing nothing above them
    "config": 0,
    "accelerator": 0,
    # 1: numerics and kernels, no process groups
    "engine": 1,
    # 2: single-device model code and the model registry
    "models": 2,
    # 3: what is applied to a model or feeds it
    "parallel": 3,
    "data": 3,
    # 4: what runs or stores a parallelized model (the pipeline runs the parallelize recipe
    # per chunk; checkpoints gather and slice a layout's tensors through its handle)
    "pipeline": 4,
    "checkpoint": 4,
    # 5: what drives a run or predicts one
    "planner": 5,
    "resilience": 5,
    "train": 5,
    # 6: entry points
    "cli": 6,
    "inference": 6,
    "__main__": 6,
}

# (importer, imported) packages of one level that may import each other, in that direction.
SAME_LEVEL_ALLOWED: set[tuple[str, str]] = {
    ("train", "planner"),  # the trainer hands its measurements to the planner
    ("train", "resilience"),  # the trainer drives anomaly checks, rollback and the watchdog
    ("__main__", "cli"),  # `python -m hyperloom` is `hyperloom.cli.main`
    ("cli", "inference"),  # `hyperloom generate` and the sample after `hyperloom train`
}

# Model families: hyperloom/parallel/ may import none of them.
MODEL_FAMILIES = ("hyperloom.models.llama", "hyperloom.models.deepseek", "hyperloom.models.vlm")

ROOT = Path(__file__).resolve().parents[2] / "hyperloom"


# --------------------------------------------------------------------------- collecting


@dataclasses.dataclass(frozen=True)
class Import:
    """One import of a hyperloom module found in a source file."""

    importer: str  # module name, e.g. hyperloom.train.trainer
    imported: str  # module name, e.g. hyperloom.planner.selfcheck
    path: str  # file, relative to the repository root
    line: int
    how: str  # "import", "in def f", "TYPE_CHECKING", "importlib", "string reference"


def module_name(path: Path, root: Path) -> str:
    """hyperloom/engine/fp8/gemm.py -> hyperloom.engine.fp8.gemm; .../__init__.py -> the package."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve_relative(importer: str, is_package: bool, level: int, module: str | None) -> str:
    """The absolute name of `from {'.' * level}{module} import ...` written in `importer`."""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


class _ImportVisitor(ast.NodeVisitor):
    """Collects every hyperloom import of one module with its line and context."""

    def __init__(self, importer: str, is_package: bool, known: set[str]):
        self.importer, self.is_package, self.known = importer, is_package, known
        self.found: list[tuple[str, int, str]] = []
        self._context: list[str] = []
        self._docstrings: set[int] = set()

    def _how(self) -> str:
        return self._context[-1] if self._context else "import"

    def _add(self, name: str, line: int, how: str | None = None) -> None:
        if name == "hyperloom" or name.startswith("hyperloom."):
            self.found.append((name, line, how or self._how()))

    def _module_of(self, dotted: str) -> str | None:
        """The longest prefix of `dotted` that is a hyperloom module (not the bare root)."""
        parts = dotted.split(".")
        for n in range(len(parts), 1, -1):
            if ".".join(parts[:n]) in self.known:
                return ".".join(parts[:n])
        return None

    # -- contexts

    def _visit_scope(self, node: ast.AST, label: str) -> None:
        body = getattr(node, "body", [])
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            self._docstrings.add(id(body[0].value))
        self._context.append(label)
        self.generic_visit(node)
        self._context.pop()

    def visit_Module(self, node: ast.Module) -> None:
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            self._docstrings.add(id(body[0].value))
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._visit_scope(node, f"in def {node.name}")

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._visit_scope(node, f"in def {node.name}")

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            self._docstrings.add(id(body[0].value))
        self.generic_visit(node)

    def visit_If(self, node: ast.If) -> None:
        test = ast.unparse(node.test)
        if test in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            self._context.append("TYPE_CHECKING")
            for child in node.body:
                self.visit(child)
            self._context.pop()
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    # -- imports

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = _resolve_relative(self.importer, self.is_package, node.level, node.module)
        else:
            base = node.module or ""
        if not (base == "hyperloom" or base.startswith("hyperloom.")):
            return
        for alias in node.names:
            # `from hyperloom.models import llama` imports the module hyperloom.models.llama
            sub = f"{base}.{alias.name}"
            self._add(sub if sub in self.known else base, node.lineno)

    def visit_Call(self, node: ast.Call) -> None:
        func = ast.unparse(node.func)
        if func.endswith("import_module") or func == "__import__":
            target = self._string_arg(node)
            if target is not None:
                if target.startswith("."):  # import_module(".x", package="hyperloom.y")
                    package = next((k.value for k in node.keywords if k.arg == "package"), None)
                    if isinstance(package, ast.Constant) and isinstance(package.value, str):
                        level = len(target) - len(target.lstrip("."))
                        target = _resolve_relative(
                            package.value, True, level, target.lstrip(".") or None
                        )
                self._add(self._module_of(target) or target, node.lineno, "importlib")
            for arg in node.args:  # the string is an import, not a string reference
                self._docstrings.add(id(arg))
        elif func.endswith("getLogger"):  # logger names look like module names
            for arg in node.args:
                self._docstrings.add(id(arg))
        self.generic_visit(node)

    @staticmethod
    def _string_arg(node: ast.Call) -> str | None:
        """The first argument as text: a literal, or an f-string's constant head up to a dot."""
        if not node.args:
            return None
        arg = node.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
        if isinstance(arg, ast.JoinedStr) and arg.values:
            head = arg.values[0]
            if isinstance(head, ast.Constant) and isinstance(head.value, str):
                return head.value.rsplit(".", 1)[0]
        return None

    def visit_Constant(self, node: ast.Constant) -> None:
        # A string naming a hyperloom module (a lazy-attribute map, a subprocess entry point).
        if (
            isinstance(node.value, str)
            and id(node) not in self._docstrings
            and node.value.startswith("hyperloom.")
            and " " not in node.value
        ):
            module = self._module_of(node.value)
            if module is not None:
                self._add(module, node.lineno, "string reference")


def collect_imports(sources: dict[str, tuple[str, str, bool]]) -> list[Import]:
    """Imports of hyperloom modules in `sources`: module name -> (path, text, is_package)."""
    known = set(sources)
    out: list[Import] = []
    for importer, (path, text, is_package) in sorted(sources.items()):
        visitor = _ImportVisitor(importer, is_package, known)
        visitor.visit(ast.parse(text, filename=path))
        out += [Import(importer, name, path, line, how) for name, line, how in visitor.found]
    return list(dict.fromkeys(out))  # `from m import a, b` is one import of m


def tree_sources(root: Path = ROOT) -> dict[str, tuple[str, str, bool]]:
    """Every module under `root` (the hyperloom package folder)."""
    return {
        module_name(p, root): (
            str(p.relative_to(root.parent)),
            p.read_text(encoding="utf-8"),
            p.name == "__init__.py",
        )
        for p in sorted(root.rglob("*.py"))
    }


# --------------------------------------------------------------------------- checking


def package_of(module: str) -> str | None:
    """hyperloom.engine.fp8.gemm -> engine; hyperloom.cli -> cli; hyperloom -> None (root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


@dataclasses.dataclass(frozen=True)
class Violation:
    rule: str
    importer: str
    imported: str
    where: str  # file:line (how), or the cycle's evidence
    why: str

    @property
    def pair(self) -> tuple[str, str]:
        return (self.importer, self.imported)

    def __str__(self) -> str:
        return f"{self.where}: {self.importer} -> {self.imported}  [{self.rule}] {self.why}"


def _import_violations(imp: Import) -> list[Violation]:
    where = f"{imp.path}:{imp.line} ({imp.how})"
    out: list[Violation] = []

    def flag(rule: str, why: str) -> None:
        out.append(Violation(rule, imp.importer, imp.imported, where, why))

    src, dst = package_of(imp.importer), package_of(imp.imported)
    if src is None:
        flag("light-root", "hyperloom/__init__.py imports nothing, so `import hyperloom` is cheap")
        return out
    if dst is None or src == dst:
        return out
    for pkg in (src, dst):
        if pkg not in LEVELS:
            flag("layer", f"package '{pkg}' has no level: add it to LEVELS in this test")
    if src not in LEVELS or dst not in LEVELS:
        return out
    if src == "config":  # (the layer rule would say so as well: once is enough)
        flag("config-isolated", "config imports nothing else from hyperloom")
    elif LEVELS[dst] > LEVELS[src]:
        flag("layer", f"{src} (level {LEVELS[src]}) imports higher {dst} (level {LEVELS[dst]})")
    elif LEVELS[dst] == LEVELS[src] and (src, dst) not in SAME_LEVEL_ALLOWED:
        flag("layer", f"{src} and {dst} share level {LEVELS[src]}: neither imports the other")
    if src == "parallel" and any(
        imp.imported == f or imp.imported.startswith(f + ".") for f in MODEL_FAMILIES
    ):
        flag(
            "no-model-family-in-parallel", "parallel/ knows no model family; families hand it plans"
        )
    if src == "planner" and dst == "train":
        flag(
            "planner-not-trainer",
            "the planner never imports the trainer; it is handed measurements",
        )
    return out


def _layer_ok(src: str, dst: str) -> bool:
    """Whether the layer rule lets package `src` import package `dst`."""
    if src not in LEVELS or dst not in LEVELS:
        return False
    return LEVELS[dst] < LEVELS[src] or (src, dst) in SAME_LEVEL_ALLOWED


def _cycle_violations(imports: list[Import]) -> list[Violation]:
    """The package-level edges that close a cycle, each with the cycle it closes.

    An edge closes a cycle when its target leads back to its source. Of a cycle's edges the
    ones reported are those the layer rule forbids (the edges to undo); a cycle made only of
    allowed edges (SAME_LEVEL_ALLOWED pairs that loop) is reported edge by edge.
    """
    edges: dict[tuple[str, str], list[Import]] = defaultdict(list)
    for imp in imports:
        src, dst = package_of(imp.importer), package_of(imp.imported)
        if src and dst and src != dst:
            edges[(src, dst)].append(imp)
    graph: dict[str, set[str]] = defaultdict(set)
    for src, dst in edges:
        graph[src].add(dst)

    def path(start: str, goal: str) -> list[str] | None:
        """A shortest package path start -> ... -> goal, or None."""
        previous: dict[str, str] = {}
        todo, seen = [start], {start}
        while todo:
            here = todo.pop(0)
            if here == goal:
                out = [goal]
                while out[-1] != start:
                    out.append(previous[out[-1]])
                return out[::-1]
            for nxt in sorted(graph[here]):
                if nxt not in seen:
                    seen.add(nxt)
                    previous[nxt] = here
                    todo.append(nxt)
        return None

    closing = {}
    for src, dst in sorted(edges):
        back = path(dst, src)
        if back is not None:
            closing[(src, dst)] = [src, *back]
    out = []
    for (src, dst), cycle in closing.items():
        loop_edges = list(zip(cycle, cycle[1:], strict=False))
        if _layer_ok(src, dst) and any(not _layer_ok(a, b) for a, b in loop_edges):
            continue  # another edge of this cycle is the one to undo
        evidence = edges[(src, dst)]
        more = f" and {len(evidence) - 1} more" if len(evidence) > 1 else ""
        out.append(
            Violation(
                "no-cycles",
                f"hyperloom.{src}",
                f"hyperloom.{dst}",
                f"{evidence[0].path}:{evidence[0].line}{more}",
                "closes the cycle " + " -> ".join(cycle),
            )
        )
    return out


def find_violations(imports: list[Import]) -> list[Violation]:
    out = [v for imp in imports for v in _import_violations(imp)]
    return out + _cycle_violations(imports)


def _report(violations: list[Violation]) -> str:
    by_rule: dict[str, list[Violation]] = defaultdict(list)
    for v in violations:
        by_rule[v.rule].append(v)
    lines = []
    for rule in sorted(by_rule):
        lines.append(f"{rule}:")
        lines += [f"  {v}" for v in by_rule[rule]]
    return "\n".join(lines)


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def live() -> list[Violation]:
    return find_violations(collect_imports(tree_sources()))


def test_every_package_has_a_level():
    packages = {package_of(m) for m in tree_sources()} - {None}
    missing = sorted(packages - set(LEVELS))
    assert not missing, f"packages without a level in LEVELS: {missing}"


def test_layering(live):
    """No module breaks a rule; each violation is listed with its file and line."""
    assert not live, f"{len(live)} layering violations:\n{_report(live)}"


def _check(files: dict[str, str]) -> list[Violation]:
    sources = {
        module_name(Path(p), Path("hyperloom")): (p, text, p.endswith("__init__.py"))
        for p, text in files.items()
    }
    return find_violations(collect_imports(sources))


def test_checker_catches_violations_in_synthetic_sources():
    files = {
        "hyperloom/__init__.py": "",
        "hyperloom/config/__init__.py": "from hyperloom.accelerator import device\n",
        "hyperloom/accelerator.py": "",
        "hyperloom/engine/__init__.py": "",
        "hyperloom/engine/ops.py": "from . import rmsnorm\nfrom ..models import registry\n",
        "hyperloom/engine/rmsnorm.py": "from hyperloom.config import JobConfig\n",
        "hyperloom/models/__init__.py": "",
        "hyperloom/models/registry.py": "import hyperloom.engine.ops\n",
        "hyperloom/models/llama/__init__.py": "",
        "hyperloom/models/llama/model.py": "",
        "hyperloom/parallel/__init__.py": "",
        "hyperloom/parallel/tp.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from hyperloom.models.llama.model import Llama\n"
            "def f():\n"
            "    import importlib\n"
            "    return importlib.import_module('hyperloom.data.loader')\n"
        ),
        "hyperloom/data/__init__.py": "",
        "hyperloom/data/loader.py": "",
        "hyperloom/planner/__init__.py": "",
        "hyperloom/planner/fit.py": "def g():\n    from hyperloom.train import trainer\n",
        "hyperloom/train/__init__.py": "",
        "hyperloom/train/trainer.py": (
            '"""Mentions hyperloom.cli in a docstring, which is no import."""\n'
            "from hyperloom.planner import fit\n"
            "from hyperloom.resilience import guard\n"
            "LAZY = {'Thing': 'hyperloom.cli'}\n"
        ),
        "hyperloom/resilience/__init__.py": "",
        "hyperloom/resilience/guard.py": "",
        "hyperloom/cli.py": "import logging\nlog = logging.getLogger('hyperloom.cli')\n",
        "hyperloom/inference.py": "",
    }
    found = {(v.rule, v.importer, v.imported) for v in _check(files)}
    expected = {
        ("config-isolated", "hyperloom.config", "hyperloom.accelerator"),
        ("layer", "hyperloom.engine.ops", "hyperloom.models.registry"),
        ("no-cycles", "hyperloom.engine", "hyperloom.models"),  # not models -> engine: allowed
        ("no-model-family-in-parallel", "hyperloom.parallel.tp", "hyperloom.models.llama.model"),
        ("layer", "hyperloom.parallel.tp", "hyperloom.data.loader"),
        ("layer", "hyperloom.planner.fit", "hyperloom.train.trainer"),
        ("planner-not-trainer", "hyperloom.planner.fit", "hyperloom.train.trainer"),
        ("no-cycles", "hyperloom.planner", "hyperloom.train"),  # train -> planner is allowed
        ("layer", "hyperloom.train.trainer", "hyperloom.cli"),
    }
    assert found == expected, _report(_check(files))
    # what each import was, for the message
    hows = {(v.importer, v.imported): v.where for v in _check(files)}
    assert hows[("hyperloom.parallel.tp", "hyperloom.models.llama.model")].endswith(
        ":3 (TYPE_CHECKING)"
    )
    assert hows[("hyperloom.parallel.tp", "hyperloom.data.loader")].endswith(":6 (importlib)")
    assert hows[("hyperloom.planner.fit", "hyperloom.train.trainer")].endswith(":2 (in def g)")
    assert hows[("hyperloom.train.trainer", "hyperloom.cli")].endswith(":4 (string reference)")


def test_checker_flags_a_heavy_root_and_an_unknown_package():
    files = {
        "hyperloom/__init__.py": "from hyperloom.engine import ops\n",
        "hyperloom/engine/__init__.py": "",
        "hyperloom/engine/ops.py": "from hyperloom.tools import helper\n",
        "hyperloom/tools/__init__.py": "",
        "hyperloom/tools/helper.py": "",
    }
    found = {(v.rule, v.importer, v.imported) for v in _check(files)}
    assert found == {
        ("light-root", "hyperloom", "hyperloom.engine.ops"),
        ("layer", "hyperloom.engine.ops", "hyperloom.tools.helper"),
    }
    assert "package 'tools' has no level" in _report(_check(files))
    cycle = {
        "hyperloom/planner/__init__.py": "from hyperloom.train import loop\n",
        "hyperloom/train/__init__.py": "",
        "hyperloom/train/loop.py": "from hyperloom.planner import cost\n",
        "hyperloom/planner/cost.py": "",
    }
    assert "closes the cycle planner -> train -> planner" in _report(_check(cycle))


def test_relative_imports_resolve():
    assert _resolve_relative("hyperloom.engine.fp8.gemm", False, 1, "formats") == (
        "hyperloom.engine.fp8.formats"
    )
    assert _resolve_relative("hyperloom.engine.fp8", True, 2, "ops") == "hyperloom.engine.ops"
    assert _resolve_relative("hyperloom.engine.fp8.gemm", False, 3, None) == "hyperloom"


if __name__ == "__main__":  # print today's violations: python tests/unit/test_layering.py
    violations = find_violations(collect_imports(tree_sources()))
    print(_report(violations) or "no violations")
    sys.exit(0)

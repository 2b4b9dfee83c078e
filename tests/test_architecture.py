"""The package's dependency rules, checked on the source with `ast` (nothing is imported).

- no import cycles between modules (imports inside functions count: they run too);
- layers: cxrdr.common and cxrdr.teachers import neither stage nor the experiments; cxrdr.reinforce
  (stage 1) and cxrdr.train (stage 2) never import each other; only cxrdr.experiments and the composition
  root cxrdr/cli.py import both stages;
- imports of cxrdr modules sit at module top; only CLI modules (files named cli.py) may import inside
  functions (third-party imports may be lazy, e.g. ray);
- no function longer than MAX_FUNCTION_LINES.
"""
from __future__ import annotations

import ast
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "cxrdr"
MAX_FUNCTION_LINES = 80
# layer -> the layers it may import ("" is the root package, "cli" the composition root cxrdr/cli.py)
ALLOWED = {
    "": {"common", "teachers"},
    "common": {"common", "teachers"},
    "teachers": {"common", "teachers"},
    "reinforce": {"common", "teachers", "reinforce"},
    "train": {"common", "teachers", "train"},
    "experiments": {"common", "teachers", "reinforce", "train", "experiments"},
    "cli": {"common", "teachers", "reinforce", "train", "experiments"},
}


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported cxrdr module (the longest module name the import names)
    path: Path
    line: int
    at_top: bool  # a statement of the module body itself (not in a function, class, if or try)


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under ``root`` (a package named like the folder)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name,) + path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _known(name: str, mods: dict[str, Path]) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


@functools.lru_cache(maxsize=None)  # six tests read the package's: parsed once (~2 s of a test worker less)
def imports(root: Path = PACKAGE) -> tuple[Import, ...]:
    """Every import of a module of the package, with where it sits."""
    mods = modules(root)
    found = []
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        top = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node, module, path.name == "__init__.py")
                names = [f"{base}.{alias.name}" for alias in node.names]  # a submodule, or a name in base
            else:
                continue
            for name in names:
                target = _known(name, mods)
                if target and target != module:
                    found.append(Import(module, target, path, node.lineno, id(node) in top))
    return tuple(found)


def cycles(found: Sequence[Import]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    edges: dict[str, set[str]] = {}
    for imp in found:
        edges.setdefault(imp.source, set()).add(imp.target)
        edges.setdefault(imp.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(groups)


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_violations(found: Sequence[Import]) -> list[str]:
    bad = []
    for imp in found:
        src, dst = layer(imp.source), layer(imp.target)
        if src not in ALLOWED:
            bad.append(f"{imp.source}: layer {src!r} is not in ALLOWED (add it with the layers it may import)")
        elif dst not in ALLOWED[src]:
            bad.append(f"{imp.source} -> {imp.target} ({imp.path.name}:{imp.line})")
    return sorted(set(bad))


def lazy_imports(found: Sequence[Import]) -> list[str]:
    return sorted({f"{imp.source} -> {imp.target} ({imp.path.name}:{imp.line})"
                   for imp in found if not imp.at_top and imp.path.name != "cli.py"})


def long_functions(root: Path = PACKAGE, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """'file:function:lines' of every function (methods and nested ones too) longer than ``limit``."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    out.append(f"{path.relative_to(root.parent)}:{node.name}:{length}")
    return out


# --------------------------------------------------------------------------- the checks on cxrdr/


def test_no_import_cycles():
    found = cycles(imports())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(group) for group in found)


def test_layers():
    bad = layer_violations(imports())
    assert not bad, "imports across the layers:\n" + "\n".join(bad)


def test_cxrdr_imports_at_module_top_outside_cli_modules():
    bad = lazy_imports(imports())
    assert not bad, "cxrdr imports inside functions (move them to module top):\n" + "\n".join(bad)


HEAVY_STAGE_2 = ("open_clip", "timm", "torchvision")


def top_level_closure(module: str, found: Sequence[Import]) -> set[str]:
    """The package's modules that importing ``module`` runs: its module-top imports, transitively (each package on
    the way, whose __init__ runs first, included)."""
    edges: dict[str, set[str]] = {}
    for imp in found:
        if imp.at_top:
            edges.setdefault(imp.source, set()).add(imp.target)
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
        for m in [name, *parents]:
            if m not in seen:
                seen.add(m)
                todo.extend(edges.get(m, ()))
    return seen


def third_party_at_top(module: str, mods: dict[str, Path]) -> set[str]:
    """Top-level packages outside cxrdr that ``module``'s body imports."""
    tree = ast.parse(mods[module].read_text())
    names = [a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in tree.body if isinstance(n, ast.ImportFrom) and not n.level and n.module]
    return {name.split(".")[0] for name in names} - {"cxrdr"}


def test_the_reinforce_command_imports_neither_stage_2_nor_its_models():
    """`reinforce` (cxrdr.reinforce.cli:main) starts without the training side, the experiments or the model
    libraries they load (timm and torchvision's dynamo, open_clip: ~4 s of a 2-core box before any stage-1 work)."""
    mods = modules()
    closure = top_level_closure("cxrdr.reinforce.cli", imports())
    assert "cxrdr.reinforce.build" in closure  # the walk follows the imports
    assert not {m for m in closure if layer(m) in ("train", "experiments") or m == "cxrdr.cli"}
    assert not {(m, pkg) for m in closure if m in mods for pkg in third_party_at_top(m, mods) if pkg in HEAVY_STAGE_2}


def test_no_long_functions():
    bad = long_functions()
    assert not bad, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(bad)


def test_experiments_and_composition_root_follow_the_rules():
    """The part that holds today everywhere it is owned: the experiments package and cxrdr/cli.py."""
    found = [imp for imp in imports() if layer(imp.source) in ("experiments", "cli")]
    assert not layer_violations(found) and not lazy_imports(found)
    grouped = {m for group in cycles(imports()) for m in group}
    assert not {m for m in grouped if layer(m) in ("experiments", "cli")}
    assert not [f for f in long_functions() if f.startswith(("cxrdr/experiments/", "cxrdr/cli.py"))]


# --------------------------------------------------------------------------- the checker itself


def test_checker_finds_what_it_should(tmp_path):
    pkg = tmp_path / "cxrdr"
    for folder in ("common", "train", "reinforce"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "common" / "a.py").write_text("from . import b\n")
    (pkg / "common" / "b.py").write_text("def f():\n    from cxrdr.common.a import x\n")
    (pkg / "train" / "loop.py").write_text("import os\n\ndef g():\n    import ray\n" + "    pass\n" * 90)
    (pkg / "train" / "cli.py").write_text("def main():\n    from cxrdr.train import loop\n")
    (pkg / "reinforce" / "build.py").write_text("from cxrdr.train.loop import g\n")
    found = imports(pkg)
    assert cycles(found) == [["cxrdr.common.a", "cxrdr.common.b"]]  # through a function-level import
    assert layer_violations(found) == ["cxrdr.reinforce.build -> cxrdr.train.loop (build.py:1)"]
    assert lazy_imports(found) == ["cxrdr.common.b -> cxrdr.common.a (b.py:2)"]  # not ray, not the CLI's
    assert long_functions(pkg) == ["cxrdr/train/loop.py:g:92"]

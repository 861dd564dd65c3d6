"""House rules for the product code, read from the source with `ast`, nothing of it imported:

- a file has at most 400 lines and a class at most 300: past that a module or a class does several jobs and is hard
  to review. What was over the limit when the rule came is listed below with its count then, and the lists may only
  shrink: a listed file or class may not grow, and an entry that is back within the limit, or gone, must be removed;
- no import cycles between product modules at import time: with one, what works depends on which module is imported
  first, and a partly initialised module fails with a confusing ImportError or AttributeError.

The product code is the six top-level folders that install as tokenweir.* (pyproject's package-dir), not tests/,
loadtests/, scripts/ or deploy/. Each check is a function of the repository root, so that the last tests can show on
a small fake tree that it fails where it should.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# folder -> the package it installs as ([tool.setuptools.package-dir] in pyproject.toml)
PACKAGES = {name: f"tokenweir.{name}" for name in ("gateway", "engine", "kernels", "policies", "common", "migrations")}
MAX_FILE_LINES = 400
MAX_CLASS_LINES = 300

# Files over MAX_FILE_LINES when the rule came: path -> its line count then, a ceiling that may only come down.
LONG_FILES: dict[str, int] = {}
# Classes over MAX_CLASS_LINES then: "path:Class" ("path:Outer.Inner" when nested) -> their line count then.
LONG_CLASSES: dict[str, int] = {}
# Import cycles there were then, each the set of modules that import one another in a ring. None: the modules that
# need each other import lazily or under TYPE_CHECKING (counting those, 5 rings would show, in common/http,
# gateway/request, gateway/state and gateway/process).
IMPORT_CYCLES: set[frozenset[str]] = set()


def product_files(root: Path) -> Iterator[tuple[str, Path]]:
    """(path relative to root, as the lists spell it; the file) for every product Python file."""
    for folder in PACKAGES:
        for path in sorted((root / folder).rglob("*.py")):
            yield path.relative_to(root).as_posix(), path


def _classes(body: list[ast.stmt], prefix: str = "") -> Iterator[tuple[str, ast.ClassDef]]:
    """Every class with its qualified name, nested ones too (one defined in a function is named after it)."""
    for node in body:
        if isinstance(node, ast.ClassDef):
            yield prefix + node.name, node
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _classes(node.body, f"{prefix}{node.name}.")


def _limit_problems(kind: str, sizes: dict[str, int], limit: int, allowed: dict[str, int], table: str) -> list[str]:
    problems = []
    for name, count in sizes.items():
        if count > limit and name not in allowed:
            problems.append(
                f"{name}: {count} lines, over the {limit}-line limit for a {kind}. Split it; {table} lists only what "
                f"was over the limit when the rule came, and may only shrink."
            )
        elif count > limit and count > allowed[name]:
            problems.append(
                f"{name}: {count} lines, more than the {allowed[name]} {table} records (limit {limit}). It was already "
                f"too long: move code out of it rather than into it."
            )
        elif count <= limit and name in allowed:
            problems.append(f"{name}: {count} lines, within the {limit}-line limit now: remove its entry from {table}.")
    # An entry for what is gone (renamed, split, deleted) would let a new one of that name grow unchecked.
    problems += [f"{name}: no such {kind} any more: remove its entry from {table}." for name in allowed.keys() - sizes]
    return problems


def size_problems(root: Path, long_files: dict[str, int], long_classes: dict[str, int]) -> list[str]:
    files: dict[str, int] = {}
    classes: dict[str, int] = {}
    for rel, path in product_files(root):
        text = path.read_text(encoding="utf-8")
        files[rel] = len(text.splitlines())  # what `wc -l` says of a file that ends with a newline
        for qualname, node in _classes(ast.parse(text, rel).body):
            # From the `class` line to the body's last: lineno is the `class` line, so decorators are not counted
            # (they are not what makes a class too big).
            classes[f"{rel}:{qualname}"] = (node.end_lineno or node.lineno) - node.lineno + 1
    return _limit_problems("file", files, MAX_FILE_LINES, long_files, "LONG_FILES") + _limit_problems(
        "class", classes, MAX_CLASS_LINES, long_classes, "LONG_CLASSES"
    )


def _module_name(rel: str) -> str:
    folder, _, rest = rel.removesuffix(".py").partition("/")
    return ".".join([PACKAGES[folder], *rest.split("/")]).removesuffix(".__init__")


def _import_time_imports(nodes: Iterable[ast.AST]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports that run when the module is imported: at module level and in class bodies, under if/try/with."""
    for node in nodes:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            # An import in a function is lazy: it runs at the first call, after both modules are loaded, so it cannot
            # meet a half-initialised module. That is the usual way to break a cycle, so it must not count as one.
            continue
        elif isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            yield from _import_time_imports(node.orelse)  # only the type checker runs the body
        else:
            yield from _import_time_imports(ast.iter_child_nodes(node))


def _within(name: str, modules: set[str]) -> str | None:
    """The product module that importing `name` runs: itself, or the nearest package above it (a name in it)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the product modules it imports at import time (an edge to a package is one to its __init__). One
    graph for all six packages: it finds the cycles within each, and would find one across them too (the import
    contracts in pyproject.toml forbid those already)."""
    sources = {_module_name(rel): path for rel, path in product_files(root)}
    modules = set(sources)
    graph: dict[str, set[str]] = {}
    for module, path in sources.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[str | None] = set()
        for node in _import_time_imports(ast.parse(path.read_text(encoding="utf-8"), str(path)).body):
            if isinstance(node, ast.Import):
                targets |= {_within(alias.name, modules) for alias in node.names}
                continue
            base = node.module or ""
            if node.level:  # relative: `from .x import y` in package p means p.x; each further dot goes one up
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            # `from p import m` imports the submodule p.m when there is one, else a name of p
            targets |= {_within(f"{base}.{alias.name}", modules) or _within(base, modules) for alias in node.names}
        graph[module] = {target for target in targets if target and target != module}
    return graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += graph.get(module, ())
    return seen


def import_cycles(graph: dict[str, set[str]]) -> dict[frozenset[str], list[str]]:
    """The sets of modules that each reach all the others (strongly connected), each with one ring through them."""
    reach = {module: _reachable(graph, module) for module in graph}  # ~200 modules: quadratic is still milliseconds
    components = {frozenset({m} | {t for t in reach[m] if m in reach.get(t, ())}) for m in graph if m in reach[m]}
    return {component: _ring(graph, component) for component in components}


def _ring(graph: dict[str, set[str]], component: frozenset[str]) -> list[str]:
    """A shortest ring from the component's first module back to it, for the message."""
    start = min(component)
    paths = {start: [start]}
    queue = [start]
    for module in queue:
        for target in sorted(graph[module] & component):
            if target == start:
                return [*paths[module], start]
            if target not in paths:
                paths[target] = [*paths[module], target]
                queue.append(target)
    raise AssertionError(f"no ring through {start}")  # a strongly connected component always has one


def cycle_problems(root: Path, allowed: set[frozenset[str]]) -> list[str]:
    cycles = import_cycles(import_graph(root))
    problems = [
        f"import cycle: {' -> '.join(ring)}. Break it: move what both need into a module of its own, or import "
        f"lazily in the function that needs it (under `if TYPE_CHECKING:` when only annotations do). IMPORT_CYCLES "
        f"lists only the cycles there were when the rule came (if this one grew from one of them, that entry is stale)."
        for members, ring in sorted(cycles.items(), key=lambda item: item[1])
        if members not in allowed
    ]
    problems += [
        f"IMPORT_CYCLES entry {sorted(members)} is not a cycle any more (broken or changed): remove it."
        for members in sorted(allowed - cycles.keys(), key=sorted)
    ]
    return problems


def test_product_files_and_classes_stay_within_the_size_limits() -> None:
    assert any(rel == "gateway/config/__init__.py" for rel, _ in product_files(ROOT)), f"no product files under {ROOT}"
    problems = size_problems(ROOT, LONG_FILES, LONG_CLASSES)
    assert not problems, "\n".join(problems)


def test_product_modules_import_one_another_without_cycles() -> None:
    problems = cycle_problems(ROOT, IMPORT_CYCLES)
    assert not problems, "\n".join(problems)


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    return root


def test_the_size_check_reports_long_files_and_classes_growth_and_stale_entries(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "common/__init__.py": "",
            "common/long.py": "x = 1\n" * 401,
            "common/klass.py": "class Big:\n" + "    x = 1\n" * 300,
            "common/fits.py": "@decorator\nclass Fits:\n" + "    x = 1\n" * 299,  # 301 lines with its decorator
        },
    )
    unlisted = size_problems(root, {}, {})
    assert len(unlisted) == 2
    assert unlisted[0].startswith("common/long.py: 401 lines, over the 400-line limit for a file. Split it")
    assert unlisted[1].startswith("common/klass.py:Big: 301 lines, over the 300-line limit for a class. Split it")
    assert size_problems(root, {"common/long.py": 401}, {"common/klass.py:Big": 301}) == []
    grown = size_problems(root, {"common/long.py": 400}, {"common/klass.py:Big": 300})
    assert len(grown) == 2
    assert grown[0].startswith("common/long.py: 401 lines, more than the 400 LONG_FILES records (limit 400).")
    assert grown[1].startswith("common/klass.py:Big: 301 lines, more than the 300 LONG_CLASSES records (limit 300).")
    stale = size_problems(
        root,
        {"common/long.py": 401, "common/fits.py": 301, "common/gone.py": 500},
        {"common/klass.py:Big": 301, "common/fits.py:Fits": 301, "common/klass.py:Gone": 400},
    )
    assert sorted(stale) == [
        "common/fits.py: 301 lines, within the 400-line limit now: remove its entry from LONG_FILES.",
        "common/fits.py:Fits: 300 lines, within the 300-line limit now: remove its entry from LONG_CLASSES.",
        "common/gone.py: no such file any more: remove its entry from LONG_FILES.",
        "common/klass.py:Gone: no such class any more: remove its entry from LONG_CLASSES.",
    ]


def test_the_cycle_check_reports_rings_at_import_time_and_stale_entries(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "engine/__init__.py": "",
            "engine/a.py": "from tokenweir.engine import b\n",  # a <-> b, the way back relative
            "engine/b.py": "from . import a\n",
            "engine/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import D\n",
            "engine/d.py": "from .c import C\n\ndef f():\n    from .c import late\n",  # no ring: lazy, typing
            "engine/e.py": "try:\n    import tokenweir.engine.f\nexcept ImportError:\n    pass\n",
            "engine/f.py": "class F:\n    from tokenweir.engine.e import x\n",  # a class body runs at import
            "engine/sub/__init__.py": "",
            "engine/sub/g.py": "from ..h import y\n",
            "engine/h.py": "from .sub.g import z\nimport json\n",
        },
    )
    ab, ef, gh = (frozenset(f"tokenweir.engine.{m}" for m in pair) for pair in ("ab", "ef", ("sub.g", "h")))
    assert set(import_cycles(import_graph(root))) == {ab, ef, gh}
    assert cycle_problems(root, {ab, ef, gh}) == []
    problems = cycle_problems(root, {ab, ef, frozenset({"tokenweir.engine.c", "tokenweir.engine.d"})})
    assert problems[0].startswith("import cycle: tokenweir.engine.h -> tokenweir.engine.sub.g -> tokenweir.engine.h.")
    assert problems[1:] == [
        "IMPORT_CYCLES entry ['tokenweir.engine.c', 'tokenweir.engine.d'] is not a cycle any more (broken or "
        "changed): remove it."
    ]

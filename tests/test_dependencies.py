"""The package's imports and its declared dependencies agree, both ways.

Every module imported anywhere under ``supervisor/r1sup`` (read with ``ast``) is the standard
library (``sys.stdlib_module_names``), r1sup itself, or the import name of a distribution declared in
``pyproject.toml``'s ``dependencies``; an optional one (an extra) is imported only inside a function,
so ``import r1sup.x`` works without it. vLLM and torch belong to the engine's environment
(``server.python``): r1sup never imports them, it runs that interpreter. Every declared dependency is
imported somewhere (no stale declarations).
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "supervisor" / "r1sup"
ENGINE = frozenset({"vllm", "torch"})
# import name -> distribution, for the ones whose names differ (read from the installed metadata where
# the distribution is installed; this table covers the rest, e.g. tomli on Python 3.11)
KNOWN = {"pynvml": "nvidia-ml-py", "prometheus_client": "prometheus-client", "tomli": "tomli"}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> tuple[dict[str, Requirement], dict[str, set[str]]]:
    """(base dependencies, extra -> distributions) from pyproject.toml."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    base = {normalize(r.name): r for r in map(Requirement, project["dependencies"])}
    extras = {
        extra: {normalize(Requirement(r).name) for r in reqs}
        for extra, reqs in project.get("optional-dependencies", {}).items()
    }
    return base, extras


@functools.cache
def installed_distributions() -> dict[str, list[str]]:
    return dict(metadata.packages_distributions())


def distributions_of(module: str) -> set[str]:
    installed = installed_distributions().get(module, [])
    names = {normalize(d) for d in installed}
    if module in KNOWN:
        names.add(normalize(KNOWN[module]))
    return names or {normalize(module)}


def imports(sources: dict[str, str]) -> list[tuple[str, str, bool]]:
    """(top-level module, file, imported at module level) of every absolute import."""
    found: list[tuple[str, str, bool]] = []
    for name, text in sources.items():
        tree = ast.parse(text, filename=name)
        nested: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                nested.update(id(n) for n in ast.walk(node) if n is not node)
        for node in ast.walk(tree):
            modules: list[str] = []
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            for module in modules:
                found.append((module.split(".", 1)[0], name, id(node) not in nested))
    return found


def problems(sources: dict[str, str]) -> list[str]:
    base, extras = declared()
    optional = {dist for dists in extras.values() for dist in dists} - set(base)
    out: list[str] = []
    used: set[str] = set()
    for module, where, top_level in imports(sources):
        if module in sys.stdlib_module_names or module == "r1sup":
            continue
        if module in ENGINE:
            out.append(f"{where}: imports {module}, which belongs to server.python's environment")
            continue
        dists = distributions_of(module)
        used |= dists
        if dists & set(base):
            continue
        if dists & optional:
            if top_level:
                out.append(f"{where}: imports optional {module} at module level")
            continue
        out.append(f"{where}: imports {module}, which no dependency declares")
    for dist in sorted(set(base) - used):
        out.append(f"pyproject.toml: {dist} is declared but never imported")
    return out


def package_sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_import_is_declared_and_every_declaration_imported() -> None:
    assert len(package_sources()) > 20
    assert problems(package_sources()) == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import requests\n", "imports requests, which no dependency declares"),
        ("from vllm import LLM\n", "imports vllm, which belongs to server.python's environment"),
        ("import tokenizers\n", "imports optional tokenizers at module level"),
    ],
)
def test_the_check_catches_what_it_is_for(source: str, expected: str) -> None:
    sources = {**package_sources(), "supervisor/r1sup/extra.py": source}
    assert f"supervisor/r1sup/extra.py: {expected}" in problems(sources)


def test_optional_imports_inside_functions_are_allowed() -> None:
    sources = {**package_sources(), "supervisor/r1sup/extra.py": "def f():\n    import tokenizers\n"}
    assert problems(sources) == []


def test_lower_bounds_are_declared() -> None:
    base, _ = declared()
    unbounded = [name for name, req in base.items() if not any(s.operator == ">=" for s in req.specifier)]
    assert unbounded == []


def test_a_missing_optional_dependency_is_one_line(tmp_path: Path) -> None:
    """``r1sup tiny-model`` without tokenizers (here: a tokenizers that cannot be imported, first on
    the path) says which extra to install, in one line, without a traceback."""
    import os
    import subprocess

    shadow = tmp_path / "shadow" / "tokenizers"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("import r1sup_test_missing_dependency\n")
    env = {**os.environ, "PYTHONPATH": str(shadow.parent)}
    proc = subprocess.run(
        [sys.executable, "-m", "r1sup.cli.app", "tiny-model", str(tmp_path / "model")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("r1sup: error: tiny-model: needs the tokenizers package")
    assert proc.stderr.count("\n") == 1 and "pip install 'r1sup[tiny-model]'" in proc.stderr


# The modules tests/ holds, by import name: its files, and its packages' modules (read whole).
LOCAL = {p.stem: p for p in (ROOT / "tests").glob("*.py")} | {
    p.parent.name: p.parent for p in (ROOT / "tests").glob("*/__init__.py")
}


def wheel_test_files() -> list[Path]:
    """The test files make test-wheel runs (WHEEL_TESTS and WHEEL_TESTS_LOWEST in the Makefile), with
    conftest and the modules of tests/ they import (test modules, helpers, packages such as the fake
    engine), followed to the end."""
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8").replace("\\\n", " ")
    named = re.findall(r"^WHEEL_TESTS(?:_LOWEST)? \?= (.*)$", makefile, flags=re.MULTILINE)
    todo = [ROOT / p for line in named for p in line.split()] + [ROOT / "tests" / "conftest.py"]
    seen: dict[Path, None] = {}
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen[path] = None
        if path.is_dir():
            todo.extend(path.rglob("*.py"))
            continue
        for module, _, _ in imports({str(path): path.read_text(encoding="utf-8")}):
            if module in LOCAL:
                todo.append(LOCAL[module])
    return list(seen)


def test_the_wheel_tests_import_only_what_the_wheel_installs() -> None:
    """make test-wheel installs the wheel, pytest and pytest-timeout in a venv of their own: a module it
    runs (or one such a module imports) that needs a test extra at module level fails collection there
    (hypothesis, imported by test_profiles.py, which test_status_cli.py imports, failed CI once)."""
    files = wheel_test_files()
    assert len(files) >= 7, files
    base, _ = declared()
    allowed = set(base) | {"pytest", "pluggy", "packaging", "pytest-timeout", "iniconfig"}
    sources = {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in files}
    wrong = sorted(
        f"{name}: {module}"
        for module, name, top in imports(sources)
        if top
        and module not in sys.stdlib_module_names
        and module not in {"r1sup", "_pytest"}
        and module not in LOCAL
        and not distributions_of(module) & allowed
    )
    assert wrong == []

"""The layers: the package's folders are its architecture, and this test keeps them so.

``supervisor/r1sup/`` has five layers, bottom to top: ``core`` (pure), ``adapters`` (what touches the
world), ``state`` (what r1sup remembers), ``supervision`` (the loop and what it drives) and ``cli``.
A module may import its own layer and any layer below it, never one above; the core imports nothing of
r1sup outside the core and does no I/O. Every import is read with ``ast``: at module level, inside
functions and under ``if TYPE_CHECKING:`` alike, because a lazy import is still an arrow.
"""

from __future__ import annotations

import ast
import functools
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "supervisor" / "r1sup"
LAYERS = ("core", "adapters", "state", "supervision", "cli")  # bottom to top
RANK = {layer: rank for rank, layer in enumerate(LAYERS)}
TOP = len(LAYERS) - 1  # r1sup/__main__.py (``python -m r1sup``) is the command line too

# What the core may not import, and why. The core's promise is "plain data in, plain data out": the
# same inputs give the same result on any machine, at any time, in a test without a fixture. So none
# of what starts or talks to processes (subprocess, multiprocessing, concurrent, pty), threads and
# event loops (threading, _thread, asyncio, sched: a core function never waits), the network (socket,
# ssl, selectors, select, http, urllib, httpx, openai, requests), the machine and its devices (psutil,
# pynvml, ctypes, resource, platform, fcntl, mmap, termios, pwd, grp, getpass), files (pathlib, io,
# shutil, tempfile, glob, tokenizers), the clock and chance (time, datetime, random, secrets, uuid),
# or the shell's sinks and policies (logging, structlog, prometheus_client, tenacity, queue: a blocking
# hand-off between threads). ``os``, ``sys`` and ``signal`` are allowed only for their pure parts,
# checked attribute by attribute below. Parsing text is pure (json, tomllib, re, ast, difflib).
FORBIDDEN = frozenset(
    {
        "subprocess", "multiprocessing", "concurrent", "pty", "threading", "_thread", "asyncio", "sched",
        "socket", "ssl", "selectors", "select", "http", "urllib", "httpx", "openai", "requests",
        "psutil", "pynvml", "ctypes", "resource", "platform", "fcntl", "mmap", "termios", "pwd", "grp",
        "getpass", "pathlib", "io", "shutil", "tempfile", "glob", "tokenizers", "time", "datetime",
        "random", "secrets", "uuid", "logging", "structlog", "prometheus_client", "tenacity", "queue",
    }
)  # fmt: skip
# os.path's string functions only (abspath reads the working directory, nothing else); exists, isfile,
# getsize, realpath and the rest of os (environ, open, kill, getpid, ...) touch the machine.
OS_PATH_PURE = frozenset(
    {"join", "split", "splitext", "basename", "dirname", "commonpath", "commonprefix", "relpath",
     "normpath", "abspath", "isabs", "sep"}
)  # fmt: skip
OS_PURE = frozenset({"sep", "PathLike", "fspath"})  # a constant, a type, a conversion
SYS_PURE = frozenset({"version_info", "hexversion", "maxsize", "float_info", "byteorder"})
# signal's names are data (SIGTERM, Signals(n).name); signal.signal, alarm, pthread_kill ... act.
BUILTIN_IO = frozenset({"open", "print", "input", "breakpoint"})

# The core's documented exceptions: module -> (what it may use beyond the rules, why). An exception
# that is no longer used fails the test, so the list only ever shrinks.
EXCEPTIONS: dict[str, tuple[frozenset[str], str]] = {
    "r1sup.core.config": (
        frozenset({"pathlib", "threading", "os.open", "os.fstat", "os.read", "os.close", "os.environ",
                   "os.O_RDONLY", "os.O_NONBLOCK", "os.O_CLOEXEC"}),
        "the settings' declarations are pure, but read_toml/load/load_bounded read the one config file "
        "(bounded, in a thread) and the environment; splitting them into an adapter moves every "
        "caller's cfg.load: left for a change of its own",
    ),
    "r1sup.core.events": (
        frozenset({"queue", "signal.signal"}),
        "the event types are plain data; EventQueue beside them is the loop's inbox (a queue.Queue "
        "whose get takes the caller's timeout) and installs the handlers that only append signals",
    ),
}  # fmt: skip


@dataclass(frozen=True)
class Source:
    module: str  # r1sup.core.search
    path: str  # supervisor/r1sup/core/search.py, for the message
    text: str


def sources(package: Path = PACKAGE) -> list[Source]:
    out = []
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        shown = str(path.relative_to(package.parent.parent)) if package == PACKAGE else str(path)
        out.append(Source(".".join(parts), shown, path.read_text(encoding="utf-8")))
    return out


@functools.cache
def parse(text: str, path: str) -> ast.Module:
    return ast.parse(text, filename=path)


def layer_of(module: str) -> int | None:
    """The rank of a module's layer; None for the package root (``r1sup``: ``__version__``)."""
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in RANK:
        return RANK[parts[1]]
    if module == "r1sup.__main__":
        return TOP
    return None


def imported(src: Source) -> Iterator[tuple[int, str]]:
    """(line, module) of every import anywhere in the module, relative ones resolved; for
    ``from r1sup import x`` the module is ``r1sup.x``."""
    is_package = src.path.endswith("__init__.py")
    for node in ast.walk(parse(src.text, src.path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = src.module.split(".")
                keep = len(parts) - node.level + (1 if is_package else 0)
                base = ".".join(parts[:keep] + ([node.module] if node.module else []))
            if base == "r1sup" or base.count(".") == 1 and base.startswith("r1sup.") or not node.module:
                for alias in node.names:
                    yield node.lineno, f"{base}.{alias.name}"
            else:
                yield node.lineno, base


def arrow_problems(srcs: list[Source]) -> list[str]:
    out = []
    for src in srcs:
        mine = layer_of(src.module)
        if mine is None and src.module != "r1sup":
            out.append(f"{src.path}: {src.module} is in no layer; move it into one of {', '.join(LAYERS)}")
            continue
        for line, target in imported(src):
            if target != "r1sup" and not target.startswith("r1sup."):
                continue
            theirs = layer_of(target)
            where = f"{src.path}:{line}: {src.module} imports {target}"
            if mine == RANK["core"] and theirs != RANK["core"]:
                out.append(f"{where}: the core imports only the core")
            elif mine is not None and theirs is not None and theirs > mine:
                out.append(f"{where}: {LAYERS[mine]} may not import {LAYERS[theirs]}, a layer above it")
            elif mine is None and target != "r1sup":
                out.append(f"{where}: the package root imports nothing")
    return out


def _names(tree: ast.AST) -> dict[str, str]:
    """Local name -> the module or module.attribute it stands for (``import os as o``, ``from os import
    environ``), for the modules whose attributes are checked one by one."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top in ("os", "sys", "signal"):  # import os.path binds os; import os.path as p binds p
                    bound[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom) and node.module in ("os", "os.path", "sys", "signal"):
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


def _allowed(use: str) -> bool:
    """Is this use of os, sys or signal (``os.path.join``, ``signal.SIGTERM``, ``os.environ``) pure?"""
    parts = use.split(".")
    if parts[0] == "os":
        if len(parts) == 1 or parts[1] in OS_PURE:
            return True
        return parts[1] == "path" and (len(parts) == 2 or parts[2] in OS_PATH_PURE)
    if parts[0] == "sys":
        return len(parts) == 1 or parts[1] in SYS_PURE
    if parts[0] == "signal":
        return len(parts) == 1 or parts[1].startswith("SIG") or parts[1] == "Signals"
    return True


def io_uses(src: Source) -> list[tuple[int, str]]:
    """(line, what) of every I/O a module's code names: forbidden imports, impure attributes of os,
    sys and signal, and the builtins that read or write (open, print, input, breakpoint)."""
    tree = parse(src.text, src.path)
    found: list[tuple[int, str]] = []
    forbidden = [(line, target) for line, target in imported(src) if target.split(".")[0] in FORBIDDEN]
    bound = _names(tree)
    inner_parts = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}  # a.b of a.b.c
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("os", "os.path", "sys", "signal"):
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Attribute) and id(node) not in inner_parts:
            chain: list[str] = []
            inner: ast.expr = node
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id in bound:
                found.append((node.lineno, ".".join([bound[inner.id], *reversed(chain)])))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in BUILTIN_IO:
            forbidden.append((node.lineno, f"{node.func.id}()"))
    return forbidden + [(line, _short(what)) for line, what in found if not _allowed(what)]


def _short(use: str) -> str:
    """``os.environ.get`` -> ``os.environ``; ``os.path.exists`` stays: what the exceptions name."""
    parts = use.split(".")
    return ".".join(parts[:3] if parts[:2] == ["os", "path"] else parts[:2])


def io_problems(srcs: list[Source]) -> list[str]:
    out = []
    core = [s for s in srcs if layer_of(s.module) == RANK["core"]]
    for src in core:
        allowed = EXCEPTIONS.get(src.module, (frozenset(), ""))[0]
        used = set()
        for line, what in sorted(set(io_uses(src))):
            if what in allowed:
                used.add(what)
                continue
            out.append(f"{src.path}:{line}: {src.module} uses {what}: the core does no I/O")
        for stale in sorted(allowed - used):
            out.append(f"{src.path}: the exception for {stale} is no longer used: remove it from EXCEPTIONS")
    for module in sorted(set(EXCEPTIONS) - {s.module for s in core}):
        out.append(f"EXCEPTIONS names {module}, which is not a core module")
    return out


# --- the package as it is --------------------------------------------------------------------------


def test_every_module_is_in_a_layer_and_every_arrow_points_down() -> None:
    srcs = sources()
    assert len(srcs) > 60
    assert {layer_of(s.module) for s in srcs} >= set(RANK.values())
    assert arrow_problems(srcs) == []


def test_the_core_does_no_io() -> None:
    assert io_problems(sources()) == []


def test_each_layer_says_what_it_holds_and_may_import() -> None:
    for layer in LAYERS:
        doc = ast.get_docstring(ast.parse((PACKAGE / layer / "__init__.py").read_text(encoding="utf-8")))
        assert doc and "import" in doc, f"r1sup/{layer}/__init__.py: a docstring saying what it may import"


# --- the checks catch what they are for: a bad import planted in a copy of the package ----------------


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    target = tmp_path / "r1sup"
    shutil.copytree(PACKAGE, target, ignore=shutil.ignore_patterns("__pycache__"))
    return target


def plant(package: Path, relative: str, code: str) -> None:
    path = package / relative
    path.write_text(path.read_text(encoding="utf-8") + "\n" + code + "\n", encoding="utf-8")


CORE_ONLY = "the core imports only the core"
TYPE_ONLY = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    "


@pytest.mark.parametrize(
    ("relative", "code", "expected"),
    [
        (
            "core/search.py",
            "from r1sup.adapters import devices",
            f"imports r1sup.adapters.devices: {CORE_ONLY}",
        ),
        (
            "core/flags.py",
            "def f():\n    from r1sup import supervision",
            f"imports r1sup.supervision: {CORE_ONLY}",
        ),
        ("core/memmodel.py", "import r1sup", f"r1sup.core.memmodel imports r1sup: {CORE_ONLY}"),
        (
            "core/logparse/reader.py",
            "from ...state import profiles",
            f"imports r1sup.state.profiles: {CORE_ONLY}",
        ),
        (
            "adapters/launcher.py",
            TYPE_ONLY + "from r1sup.supervision import runner",
            "adapters may not import su",
        ),
        (
            "adapters/preflight.py",
            "from r1sup.state import nofit",
            "adapters may not import state, a layer above",
        ),
        (
            "state/profiles.py",
            "def g():\n    import r1sup.cli.app",
            "imports r1sup.cli.app: state may not import cli",
        ),
        (
            "supervision/loop.py",
            "from r1sup.cli import report",
            "supervision may not import cli, a layer above it",
        ),
    ],
)
def test_an_upward_import_is_named(copy: Path, relative: str, code: str, expected: str) -> None:
    plant(copy, relative, code)
    problems = arrow_problems(sources(copy))
    assert len(problems) == 1 and expected in problems[0], problems
    assert f"{relative}:" in problems[0]


def test_a_module_outside_the_layers_is_named(copy: Path) -> None:
    (copy / "grabbag.py").write_text('"""new"""\n', encoding="utf-8")
    assert [p for p in arrow_problems(sources(copy)) if "grabbag" in p] == [
        f"{copy / 'grabbag.py'}: r1sup.grabbag is in no layer; move it into one of {', '.join(LAYERS)}"
    ]


@pytest.mark.parametrize(
    ("code", "what"),
    [
        ("import subprocess", "subprocess"),
        ("def f():\n    import time\n    time.sleep(1)", "time"),
        ("from urllib.request import urlopen", "urllib.request"),
        ("import os\ndef f():\n    return os.environ.get('X')", "os.environ"),
        ("import os.path\ndef f(p):\n    return os.path.exists(p)", "os.path.exists"),
        ("from os import kill", "os.kill"),
        ("import sys\ndef f():\n    sys.stdout.write('x')", "sys.stdout"),
        ("import signal as _sig\ndef f():\n    _sig.signal(_sig.SIGTERM, None)", "signal.signal"),
        ("def f(p):\n    return open(p).read()", "open()"),
        (TYPE_ONLY + "import psutil", "psutil"),
    ],
)
def test_io_in_the_core_is_named(copy: Path, code: str, what: str) -> None:
    plant(copy, "core/planner.py", code)
    problems = io_problems(sources(copy))
    assert [p for p in problems if f"r1sup.core.planner uses {what}: the core does no I/O" in p], problems
    assert all("core/planner.py" in p for p in problems), problems


def test_pure_uses_of_os_sys_and_signal_pass(copy: Path) -> None:
    plant(
        copy,
        "core/planner.py",
        "import os, signal, sys\n"
        "def f(p):\n    return os.path.join(os.path.dirname(p), 'x'), signal.Signals(2).name, signal.SIGTERM,"
        " sys.version_info",
    )
    assert io_problems(sources(copy)) == []


def test_a_stale_exception_is_named(copy: Path) -> None:
    (copy / "core" / "events.py").write_text('"""Only types now."""\n', encoding="utf-8")
    problems = io_problems(sources(copy))
    assert len(problems) == 2 and all("is no longer used: remove it from EXCEPTIONS" in p for p in problems)


# --- no import circles -------------------------------------------------------------------------------


def import_graph(srcs: list[Source]) -> dict[str, set[str]]:
    """module -> the r1sup modules it imports anywhere (``from r1sup.core.search import X`` is an arrow to
    ``r1sup.core.search``; a lazy import is an arrow too)."""
    known = {s.module for s in srcs}
    graph: dict[str, set[str]] = {}
    for src in srcs:
        targets = set()
        for _, target in imported(src):
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != src.module and target != "r1sup":
                targets.add(target)
        graph[src.module] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: each strongly connected set of two or more modules, sorted (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                members.append(top)
                if top == node:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_search_never_imports_the_plan() -> None:
    """The plan is the report of the search's recommendation: it imports the search, never the reverse."""
    graph = import_graph(sources())
    assert "r1sup.core.search" in graph["r1sup.core.planner"]
    assert "r1sup.core.planner" not in graph["r1sup.core.search"]


def test_no_module_imports_itself_round_a_circle() -> None:
    """No import circle anywhere in r1sup (the plan and the search were one; supervision's footing, runner,
    session, subscribers and world another): each module can be read, and tested, above what it imports."""
    assert circles(import_graph(sources())) == []


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}}, [["a", "b", "c"]]),
    ],
)
def test_a_circle_is_named(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert circles(graph) == expected


# --- one of each: twins that were merged or named apart stay so ---------------------------------------

# each defined once in the package (a class, a function or a module-level name)
ONCE = (
    "Facts",  # the search's input (r1sup.core.search); the blind branch's figures are BlindFacts
    "BlindFacts",
    "GiveUp",
    "CUDA_BLOCK_SIZE",  # the KV block sizes, the memory model's
    "CPU_BLOCK_SIZE",
    "free_allows",  # "the utilization that what is free allows", the CUDA context an argument
    "startable_utilization",
    "margin_bytes",
    "utc_now_iso",  # the timestamps (r1sup.adapters.statefiles)
    "utc_name_stamp",
    "parse_iso",
    "result_capacity",  # a verified capacity read from a tune result, a run record, a profile
    "record_capacity",
    "profile_capacity",
)
# defined nowhere: a twin's old name, or dead code that was removed
GONE = (
    "capacity_of",
    "BLOCK_SIZE",
    "abandon",
    "device_memory_free",
    "gpu_platform",
    "env_overrides",
    "predict_kv_tokens",  # test-only wrappers of memmodel.evaluate
    "predict_max_model_len",
)
STAMP_HOME = "r1sup.adapters.statefiles"  # the only module that writes a timestamp's text


def definitions(srcs: list[Source]) -> dict[str, list[str]]:
    """name -> the modules that define it: classes, functions and methods anywhere, and names assigned
    at module level."""
    found: dict[str, list[str]] = {}
    for src in srcs:
        tree = parse(src.text, src.path)
        names = [
            n.name
            for n in ast.walk(tree)
            if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        for node in tree.body:
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            names += [t.id for t in targets if isinstance(t, ast.Name)]
        for name in names:
            found.setdefault(name, []).append(src.module)
    return found


def twin_problems(srcs: list[Source]) -> list[str]:
    found = definitions(srcs)
    problems = [
        f"{name} is defined {len(where)} times: {', '.join(where) or 'nowhere'}"
        for name in ONCE
        if len(where := found.get(name, [])) != 1
    ]
    problems += [f"{name} is back in {', '.join(found[name])}" for name in GONE if name in found]
    return problems


def stamp_problems(srcs: list[Source]) -> list[str]:
    """A module other than the stamps' home that formats a time itself (``strftime``, ``isoformat``) or
    spells UTC's ``+00:00``."""
    problems = []
    for src in srcs:
        if src.module == STAMP_HOME:
            continue
        for node in ast.walk(parse(src.text, src.path)):
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            if call and node.func.attr in ("strftime", "isoformat"):  # type: ignore[union-attr]
                problems.append(f"{src.path}:{node.lineno}: {node.func.attr}: use {STAMP_HOME}'s stamps")  # type: ignore[union-attr]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "+00:00" in node.value:
                problems.append(f"{src.path}:{node.lineno}: +00:00: use {STAMP_HOME}'s stamps")
    return problems


def test_each_of_the_merged_twins_is_defined_once() -> None:
    assert twin_problems(sources()) == []


def test_only_the_state_files_write_a_timestamp() -> None:
    assert stamp_problems(sources()) == []


def test_the_search_has_no_first() -> None:
    tree = ast.parse((PACKAGE / "core" / "search.py").read_text(encoding="utf-8"))
    search = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Search")
    assert "first" not in {n.name for n in search.body if isinstance(n, ast.FunctionDef)}


@pytest.mark.parametrize(
    ("relative", "code", "expected"),
    [
        (
            "core/bounds.py",
            "class Facts:\n    pass",
            "Facts is defined 2 times: r1sup.core.bounds, r1sup.core.search",
        ),
        (
            "cli/report.py",
            "def capacity_of(record):\n    return None",
            "capacity_of is back in r1sup.cli.report",
        ),
        ("core/logparse/figures.py", "BLOCK_SIZE = 16", "BLOCK_SIZE is back in r1sup.core.logparse.figures"),
        ("adapters/launcher.py", "class L:\n    def abandon(self):\n        pass", "abandon is back in"),
    ],
)
def test_a_twin_planted_is_named(copy: Path, relative: str, code: str, expected: str) -> None:
    plant(copy, relative, code)
    assert [p for p in twin_problems(sources(copy)) if expected in p], twin_problems(sources(copy))


@pytest.mark.parametrize(
    "code",
    [
        "import datetime\ndef f():\n    return datetime.datetime.now().strftime('%Y-%m-%dT%H:%M:%SZ')",
        "def f(at):\n    return at.isoformat()",
        "def f(text):\n    return text + '+00:00'",
    ],
)
def test_a_stamp_written_elsewhere_is_named(copy: Path, code: str) -> None:
    plant(copy, "cli/commands/status.py", code)
    problems = stamp_problems(sources(copy))
    assert len(problems) == 1 and "status.py" in problems[0], problems

"""The one event vocabulary (r1sup.core.events), read with ast: it is a leaf that imports nothing of r1sup's
shell, every event is a frozen dataclass defined there, and every event the bus, the search and the
loop's queue carry (published, put, matched by a subscriber) is one of them. No process is started."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import sys
import typing
from pathlib import Path

import pytest

from r1sup.core import events as E

PACKAGE = Path(E.__file__).parents[1]  # supervisor/r1sup
# the core's value types an event may carry; they import nothing of r1sup but one another
CORE_TYPES = frozenset(
    {
        "r1sup.core.capacity",
        "r1sup.core.failure",
        "r1sup.core.figures",
        "r1sup.core.flags",
        "r1sup.core.hardware",
        "r1sup.core.liveness",
        "r1sup.core.probing",
        "r1sup.core.slo",
    }
)
# what travels: a call of one of these takes an event as its argument
CARRIERS = frozenset({"publish", "put", "_on_search"})


def imported_modules(source: str) -> set[str]:
    """Every module an import statement names (``from a import b`` names ``a``), at any depth."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                found.add("." * node.level + (node.module or ""))
            else:
                found.add(node.module or "")
    return found


def foreign_imports(source: str, allowed: frozenset[str] = CORE_TYPES) -> list[str]:
    """The imports that are neither the standard library nor ``allowed`` (relative ones included)."""
    out = []
    for module in sorted(imported_modules(source)):
        top = module.split(".")[0]
        if module in allowed or (top and top in sys.stdlib_module_names):
            continue
        out.append(module)
    return out


def test_the_import_check_finds_what_a_leaf_must_not_import():
    source = """
import queue
from dataclasses import dataclass
from r1sup.core.flags import EngineFlags
from r1sup.supervision import tuner
import r1sup.supervision.bus
from .runner import Launch
def f():
    import structlog
"""
    assert foreign_imports(source) == [".runner", "r1sup.supervision", "r1sup.supervision.bus", "structlog"]


def _source(module: str) -> str:
    return (PACKAGE / (module.removeprefix("r1sup.").replace(".", "/") + ".py")).read_text(encoding="utf-8")


def test_events_imports_only_the_standard_library_and_the_cores_value_types():
    assert foreign_imports(_source("r1sup.core.events")) == []


@pytest.mark.parametrize("module", sorted(CORE_TYPES))
def test_the_core_types_events_carry_import_nothing_of_r1sup(module: str):
    assert foreign_imports(_source(module)) == []


def _defined_events() -> dict[str, type]:
    """The frozen dataclasses r1sup.core.events defines (the vocabulary)."""
    return {
        name: obj
        for name, obj in vars(E).items()
        if isinstance(obj, type) and obj.__module__ == E.__name__ and dataclasses.is_dataclass(obj)
    }


def test_every_event_is_a_frozen_dataclass():
    events = _defined_events()
    assert len(events) >= 40
    assert [name for name, cls in events.items() if not cls.__dataclass_params__.frozen] == []  # type: ignore[attr-defined]


@pytest.mark.parametrize("union", ["QueueEvent", "SearchEvent", "DaemonEvent"])
def test_each_union_is_made_of_events_defined_here(union: str):
    members = typing.get_args(getattr(E, union))
    assert members and {cls.__module__ for cls in members} == {E.__name__}


def test_the_bus_carries_the_search_events_and_every_daemon_event():
    carried = set(typing.get_args(E.DaemonEvent))
    assert set(typing.get_args(E.SearchEvent)) <= carried
    queue_only = set(typing.get_args(E.QueueEvent)) | {E.Signalled, E.ReloadRequested}
    assert carried | queue_only == set(_defined_events().values())


def _resolve(module: object, chain: list[str]) -> object:
    obj = module
    for name in chain:
        obj = getattr(obj, name)
    return obj


def _dotted(node: ast.expr) -> list[str]:
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return [node.id, *reversed(names)] if isinstance(node, ast.Name) else []


def event_classes_used(module_name: str) -> dict[str, object]:
    """What a module publishes, puts on the queue or hands the search's observer (the class of each
    ``publish(X(...))``, ``put(X(...))``), and the classes its ``match`` cases name, resolved in the
    module's own namespace: dotted name -> the object it names."""
    module = importlib.import_module(module_name)
    used: dict[str, object] = {}
    for node in ast.walk(ast.parse(Path(module.__file__ or "").read_text(encoding="utf-8"))):
        chains: list[list[str]] = []
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Call):
            func = _dotted(node.func)
            if func and func[-1] in CARRIERS:
                chains.append(_dotted(node.args[0].func))
        elif isinstance(node, ast.MatchClass):
            chains.append(_dotted(node.cls))
        for chain in chains:
            if chain:
                used[".".join(chain)] = _resolve(module, chain)
    return used


def test_the_usage_check_resolves_what_a_module_publishes_and_matches(tmp_path: Path, monkeypatch):
    (tmp_path / "carrier_of_strangers.py").write_text(
        """
from dataclasses import dataclass
from r1sup.core import events as E
from r1sup.supervision.loop import Done

@dataclass(frozen=True)
class Homemade:
    text: str

def run(bus, queue, event):
    bus.publish(Homemade("x"))
    queue.put(E.ChildEOF(1))
    match event:
        case Done():
            pass
""",
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    strangers = event_classes_used("carrier_of_strangers")
    assert set(strangers) == {"Homemade", "E.ChildEOF", "Done"} and strangers["E.ChildEOF"] is E.ChildEOF

    used = event_classes_used("r1sup.supervision.subscribers")
    assert used["StateChanged"] is E.StateChanged and used["SearchStepped"] is E.SearchStepped
    daemon = event_classes_used("r1sup.supervision.daemon")
    assert daemon["B.Serving"] is E.Serving  # the daemon's alias of r1sup.core.events


@pytest.mark.parametrize(
    "module",
    [
        "r1sup.supervision.subscribers",
        "r1sup.supervision.daemon",
        "r1sup.supervision.tuner",
        "r1sup.supervision.runner",
        "r1sup.adapters.launcher",
    ],
)
def test_what_travels_is_an_event_defined_in_r1sup_events(module: str):
    vocabulary = set(_defined_events().values())
    used = event_classes_used(module)
    assert used, f"{module} carries no event: the check reads nothing"
    assert {name: cls for name, cls in used.items() if cls not in vocabulary} == {}


def test_the_bus_and_its_subscribers_take_their_events_from_r1sup_events_alone():
    for module in ("r1sup.supervision.bus", "r1sup.supervision.subscribers"):
        imported = {m for m in imported_modules(_source(module)) if m.startswith("r1sup")}
        assert "r1sup.supervision.tuner" not in imported and "r1sup.supervision.loop" not in imported, module
    assert {m for m in imported_modules(_source("r1sup.supervision.bus")) if m.startswith("r1sup")} == {
        "r1sup.core.events"
    }

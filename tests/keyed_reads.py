"""The lines of a piece of source that read a typed value as if it were a dict: what the guards of
``tests/test_failure_numbers.py`` and ``tests/test_probe_types.py`` look for in the package."""

from __future__ import annotations

import ast
from collections.abc import Callable

MAPPING_READS = frozenset({"get", "items", "keys", "values", "__getitem__"})


def mapping_reads(scope: ast.AST, is_typed: Callable[[ast.expr], bool]) -> list[int]:
    """The lines in ``scope`` where an expression ``is_typed`` accepts is subscripted, has a mapping's
    method called on it (``.get``, ``.items``, ...) or is passed to ``dict(...)``."""
    lines = []
    for node in ast.walk(scope):
        if isinstance(node, ast.Subscript) and is_typed(node.value):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call):
            func = node.func
            if (isinstance(func, ast.Attribute) and func.attr in MAPPING_READS and is_typed(func.value)) or (
                isinstance(func, ast.Name) and func.id == "dict" and any(is_typed(a) for a in node.args)
            ):
                lines.append(node.lineno)
    return lines

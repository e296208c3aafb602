"""Giving up: the one :class:`GiveUp` of the search (its model branch and its blind branch) and of the plan.

Pure: plain data in, plain data out."""

from __future__ import annotations

from dataclasses import dataclass

from r1sup.core.errors import EXIT_NO_WORKING_CONFIG


@dataclass(frozen=True)
class GiveUp:
    """Nothing more to launch: why, the ways out (one line each), the exit code, and the bound that blocks
    (a ``[ladder]`` or ``[target]`` setting) when one does."""

    reason: str
    ways_out: tuple[str, ...] = ()
    exit_code: int = EXIT_NO_WORKING_CONFIG
    bound: str = ""

    @property
    def suggestions(self) -> tuple[str, ...]:
        return self.ways_out

"""The daemon's state table (``states.TRANSITIONS``): complete as a graph, its ends without a way out."""

from __future__ import annotations

from r1sup.supervision.states import LEGAL, TRANSITIONS, State


def _reachable(start: State) -> set[State]:
    seen, todo = {start}, [start]
    while todo:
        for new in LEGAL[todo.pop()]:
            if new not in seen:
                seen.add(new)
                todo.append(new)
    return seen


def test_every_state_is_reachable_from_planning() -> None:
    assert _reachable(State.PLANNING) == set(State)


def test_every_state_but_the_ends_can_still_stop_and_fail() -> None:
    for state in State:
        if state in (State.STOPPED, State.FAILED):
            continue
        assert State.STOPPED in _reachable(state), f"{state.value} cannot reach stopped"
        assert State.FAILED in _reachable(state), f"{state.value} cannot reach failed"


def test_the_ends_have_no_way_out() -> None:
    assert [pair for pair in TRANSITIONS if pair[0] in (State.STOPPED, State.FAILED)] == []

"""Where the daemon is (:class:`State`), what happens (:class:`Cause`) and the state table that says which
state follows (:data:`TRANSITIONS`; :data:`LEGAL`, the pairs it allows), as supervisord's ``transition()``
and gunicorn's arbiter dispatch. :class:`r1sup.supervision.daemon.Daemon` advances along it.
"""

from __future__ import annotations

import enum


class State(enum.Enum):
    PLANNING = "planning"
    LAUNCHING = "launching"
    PROBING = "probing"
    SERVING = "serving"
    DRAINING = "draining"  # a stop r1sup chose waits for the requests in flight; vLLM still serves them
    BACKOFF = "backoff"
    STOPPING = "stopping"
    FAILED = "failed"
    STOPPED = "stopped"


class Cause(enum.Enum):
    """What happened: the daemon names it, :data:`TRANSITIONS` says which state follows."""

    PLANNED = "planned"  # a plan begins: at the start, and after the stop a reload or a re-tune chose
    LAUNCH_STARTED = "launch_started"
    PROBE_STARTED = "probe_started"
    READY = "ready"  # the load probe passed (or the engine is ready where no probe runs): it serves
    RETRYING = "retrying"  # an attempt failed without a cause that changes the flags: again after a wait
    CRASHED = "crashed"  # serving ended in a transient failure within the restart budget: a restart waits
    DRAIN_REQUESTED = "drain_requested"  # a stop r1sup chose (reload, re-tune, shutdown) waits for requests
    STOP_REQUESTED = "stop_requested"  # the daemon's shutdown (a stop signal): vLLM is stopped, r1sup exits
    ENGINE_STOPPED = "engine_stopped"  # the shutdown's stop of vLLM is over
    GAVE_UP = "gave_up"  # no way to serve (no fit, a fatal failure, the budget spent, r1sup's own fault)


_S, _C = State, Cause
_ALIVE = (_S.PLANNING, _S.LAUNCHING, _S.PROBING, _S.SERVING, _S.DRAINING, _S.BACKOFF)
# the state table: (where the daemon is, what happened) -> where it goes; a pair not here is a bug
TRANSITIONS: dict[tuple[State, Cause], State] = {
    (_S.PLANNING, _C.PLANNED): _S.PLANNING,  # the first plan: its status line
    # a reload or a re-tune: after its drain, or at once when there was nothing to drain
    (_S.SERVING, _C.PLANNED): _S.PLANNING,
    (_S.DRAINING, _C.PLANNED): _S.PLANNING,
    # the search launches: the first flags, its next step, a retry, or new flags after a serving failure
    **{(s, _C.LAUNCH_STARTED): _S.LAUNCHING for s in (_S.PLANNING, _S.LAUNCHING, _S.PROBING, _S.SERVING)},
    (_S.BACKOFF, _C.LAUNCH_STARTED): _S.LAUNCHING,
    (_S.LAUNCHING, _C.PROBE_STARTED): _S.PROBING,
    (_S.LAUNCHING, _C.READY): _S.SERVING,
    (_S.PROBING, _C.READY): _S.SERVING,
    (_S.LAUNCHING, _C.RETRYING): _S.BACKOFF,
    (_S.PROBING, _C.RETRYING): _S.BACKOFF,
    (_S.SERVING, _C.CRASHED): _S.BACKOFF,
    (_S.SERVING, _C.DRAIN_REQUESTED): _S.DRAINING,
    **{(s, _C.STOP_REQUESTED): _S.STOPPING for s in _ALIVE},
    (_S.STOPPING, _C.ENGINE_STOPPED): _S.STOPPED,
    **{(s, _C.GAVE_UP): _S.FAILED for s in (*_ALIVE, _S.STOPPING)},
}

# the (from, to) pairs the table allows, for readers that ask where a state may go
LEGAL: dict[State, frozenset[State]] = {
    state: frozenset(new for (old, _), new in TRANSITIONS.items() if old is state) for state in State
}
TERMINAL = frozenset(state for state, targets in LEGAL.items() if not targets)


# states in which systemd's start timeout is extended while the loop turns: loading and probing, and
# planning, which includes a wait for another replica's tune (state.profile_wait_s)
EXTENDING = frozenset({_S.PLANNING, _S.LAUNCHING, _S.PROBING})


class IllegalTransition(RuntimeError):
    pass

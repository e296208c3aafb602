"""What no choice of flags fixes: the rules the search applies before it looks for flags. Pure.

- ``none``: nothing failed, nothing to do (exit 4 if asked).
- ``internal_error``: r1sup's own fault: no flag change, no relaunch (exit 1).
- fatal classes (``port_in_use``, ``model_not_found``, a ``config_error`` the search cannot fix): stop at
  once (exit 4); the same flags would fail the same way.
- ``probe_rejected``: vLLM answered the load probe's own request with a 4xx (a prompt or an output
  longer than the context): the probe's configuration, not the engine's; no relaunch (exit 2).
- transient classes (``cuda_error``, ``engine_dead``, ``hang``, ``probe_connection``,
  ``probe_server_error``, ``probe_timeout``): one retry of the same flags after a backoff; the same class
  again stops (exit 4). The probe's first two (its connection lost, or a 5xx that is not vLLM's
  engine-dead reply, while vLLM's ``/health`` answered) come only after each failed request was sent
  again (:mod:`r1sup.adapters.probe`); ``probe_timeout`` (requests that got no answer within
  ``probe.request_timeout_s`` while ``/health`` answered and vLLM's counters moved: a busy engine) is
  never the engine's death. ``run`` takes a stop on any of the three as a restart within its budget
  (:data:`PROBE_TRANSIENT`, exit 5 once spent), never as its end.
- ``search.max_attempts`` launches: stop (exit 3).

Everything else is a memory failure, evidence for the search (:mod:`r1sup.core.search`).
"""

from __future__ import annotations

from dataclasses import dataclass

from r1sup.core import failure as F
from r1sup.core.errors import EXIT_CONFIG, EXIT_FATAL_FAILURE, EXIT_INTERNAL, EXIT_NO_WORKING_CONFIG
from r1sup.core.failure import Failure

TRANSIENT = frozenset(
    {F.CUDA_ERROR, F.ENGINE_DEAD, F.HANG, F.PROBE_CONNECTION, F.PROBE_SERVER_ERROR, F.PROBE_TIMEOUT}
)
# transient faults of the probe's path to the engine, or of its patience, not of the engine (its /health
# answered): ``run`` backs off and tries the same flags again within its restart budget rather than exit
PROBE_TRANSIENT = frozenset({F.PROBE_CONNECTION, F.PROBE_SERVER_ERROR, F.PROBE_TIMEOUT})
FATAL = frozenset({F.PORT_IN_USE, F.MODEL_NOT_FOUND, F.CONFIG_ERROR})


@dataclass(frozen=True)
class Stop:
    """No relaunch: why, and the exit code."""

    reason: str
    exit_code: int


@dataclass(frozen=True)
class Retry:
    """The same flags once more (a transient class), after a backoff."""

    reason: str


def fatal_reason(failure: Failure) -> str:
    what = {
        F.PORT_IN_USE: "the port is taken",
        F.MODEL_NOT_FOUND: "the model cannot be found or accessed",
        F.CONFIG_ERROR: "vLLM rejected the configuration",
    }.get(failure.cls, failure.cls)
    detail = failure.evidence or failure.detail
    return f"{what}; no flag change fixes that: {detail}" if detail else what


def decide(
    failure: Failure, *, retried: frozenset[str], attempts: int, max_attempts: int, fixable: bool = False
) -> Stop | Retry | None:
    """The policy's answer to ``failure`` after ``attempts`` launches (counting it), or None when it is
    the search's to answer. ``retried``: the transient classes already retried once; ``fixable``: a
    config error the search knows a fix for (a context above the model's limit, more sequences than
    batched tokens)."""
    if failure.cls == F.NONE:
        return Stop("nothing failed", EXIT_FATAL_FAILURE)
    if failure.cls == F.INTERNAL_ERROR:
        return Stop(f"internal error in {failure.detail or 'r1sup'}: {failure.evidence}", EXIT_INTERNAL)
    if failure.cls == F.PROBE_REJECTED:
        detail = failure.evidence or failure.detail
        return Stop(
            "vLLM rejected the load probe's own request, a probe configuration problem (check "
            f"probe.prompt_tokens, probe.output_tokens and the context): {detail}",
            EXIT_CONFIG,
        )
    if failure.cls in FATAL and not fixable:
        return Stop(fatal_reason(failure), EXIT_FATAL_FAILURE)
    if failure.cls in TRANSIENT:
        if failure.cls in retried:
            said = failure.evidence or failure.detail
            if failure.cls in PROBE_TRANSIENT and failure.detail and failure.evidence:
                said = f"{failure.detail}: {failure.evidence}"  # what it was not (the engine's death)
            return Stop(f"{failure.cls} again after a retry: {said}", EXIT_FATAL_FAILURE)
        if attempts >= max_attempts:
            return Stop(f"search.max_attempts ({max_attempts}) reached", EXIT_NO_WORKING_CONFIG)
        return Retry(f"{failure.cls} is often transient: one retry with the same flags")
    if attempts >= max_attempts:
        return Stop(f"search.max_attempts ({max_attempts}) reached", EXIT_NO_WORKING_CONFIG)
    return None

"""The policy: what no choice of flags fixes (fatal, transient, internal, the attempt budget)."""

from __future__ import annotations

import pytest

from r1sup.core import failure as F
from r1sup.core import policy as P
from r1sup.core.errors import EXIT_CONFIG, EXIT_FATAL_FAILURE, EXIT_INTERNAL, EXIT_NO_WORKING_CONFIG
from r1sup.core.failure import Failure


@pytest.mark.parametrize(
    ("cls", "retried", "attempts", "fixable", "expected"),
    [
        (F.NONE, frozenset(), 1, False, ("stop", EXIT_FATAL_FAILURE)),
        (F.INTERNAL_ERROR, frozenset(), 1, False, ("stop", EXIT_INTERNAL)),
        (F.PORT_IN_USE, frozenset(), 1, False, ("stop", EXIT_FATAL_FAILURE)),
        (F.MODEL_NOT_FOUND, frozenset(), 1, False, ("stop", EXIT_FATAL_FAILURE)),
        (F.CONFIG_ERROR, frozenset(), 1, False, ("stop", EXIT_FATAL_FAILURE)),
        (F.CONFIG_ERROR, frozenset(), 1, True, None),  # the search knows the fix
        (F.HANG, frozenset(), 1, False, ("retry", None)),
        (F.CUDA_ERROR, frozenset({F.CUDA_ERROR}), 2, False, ("stop", EXIT_FATAL_FAILURE)),
        (F.ENGINE_DEAD, frozenset({F.HANG}), 2, False, ("retry", None)),  # another class: its own retry
        (F.ENGINE_DEAD, frozenset(), 8, False, ("stop", EXIT_NO_WORKING_CONFIG)),
        (F.OOM_RUNTIME, frozenset(), 3, False, None),  # memory: the search's to answer
        (F.KV_INSUFFICIENT, frozenset(), 8, False, ("stop", EXIT_NO_WORKING_CONFIG)),
        # the probe's own request rejected (4xx): its configuration, never a relaunch
        (F.PROBE_REJECTED, frozenset(), 1, False, ("stop", EXIT_CONFIG)),
        (F.PROBE_REJECTED, frozenset(), 8, False, ("stop", EXIT_CONFIG)),
        # the probe's connection failed while /health answered: transient, the same flags once more
        (F.PROBE_CONNECTION, frozenset(), 1, False, ("retry", None)),
        (F.PROBE_CONNECTION, frozenset({F.ENGINE_DEAD}), 2, False, ("retry", None)),
        # a 5xx that is not vLLM's engine-dead reply while /health answered: the same, never engine death
        (F.PROBE_SERVER_ERROR, frozenset(), 1, False, ("retry", None)),
        (F.PROBE_SERVER_ERROR, frozenset({F.ENGINE_DEAD}), 2, False, ("retry", None)),
        (F.PROBE_SERVER_ERROR, frozenset({F.PROBE_SERVER_ERROR}), 2, False, ("stop", EXIT_FATAL_FAILURE)),
        # requests that got no answer in time while /health answered and vLLM's counters moved: a busy
        # engine, the same flags once more, never engine death
        (F.PROBE_TIMEOUT, frozenset(), 1, False, ("retry", None)),
        (F.PROBE_TIMEOUT, frozenset({F.ENGINE_DEAD}), 2, False, ("retry", None)),
        (F.PROBE_TIMEOUT, frozenset({F.PROBE_TIMEOUT}), 2, False, ("stop", EXIT_FATAL_FAILURE)),
    ],
)
def test_decide(cls: str, retried: frozenset[str], attempts: int, fixable: bool, expected: object) -> None:
    got = P.decide(
        Failure(cls, F.PHASE_SERVING, "evidence"),
        retried=retried,
        attempts=attempts,
        max_attempts=8,
        fixable=fixable,
    )
    if expected is None:
        assert got is None
    elif expected[0] == "retry":
        assert isinstance(got, P.Retry)
    else:
        assert isinstance(got, P.Stop) and got.exit_code == expected[1]


def test_a_fatal_reason_names_what_no_flag_fixes() -> None:
    failure = Failure(F.PORT_IN_USE, F.PHASE_STARTUP, "OSError: [Errno 98] Address already in use")
    assert P.fatal_reason(failure) == (
        "the port is taken; no flag change fixes that: OSError: [Errno 98] Address already in use"
    )


def test_a_rejected_probe_request_names_the_probe_settings_and_vllms_answer() -> None:
    said = "request 0: rejected (HTTP 400): This model's maximum context length is 2048 tokens."
    failure = Failure(F.PROBE_REJECTED, F.PHASE_SERVING, said)
    got = P.decide(failure, retried=frozenset(), attempts=1, max_attempts=8)
    assert isinstance(got, P.Stop)
    assert "probe.output_tokens" in got.reason and said in got.reason and "\n" not in got.reason


def test_the_probes_transient_fault_again_says_what_it_was_and_what_it_was_not() -> None:
    detail = (
        "1 probe request(s) answered with a 5xx that is not vLLM's engine-dead reply; vLLM's /health answers"
    )
    evidence = "request 0: InternalServerError: Error code: 503"
    failure = Failure(F.PROBE_SERVER_ERROR, F.PHASE_SERVING, evidence, detail=detail)
    got = P.decide(failure, retried=frozenset({F.PROBE_SERVER_ERROR}), attempts=2, max_attempts=8)
    assert isinstance(got, P.Stop) and got.exit_code == EXIT_FATAL_FAILURE
    assert got.reason == f"probe_server_error again after a retry: {detail}: {evidence}"


def test_run_restarts_after_a_probe_timeout_within_its_budget() -> None:
    # run's daemon takes a stop on these as a restart within daemon.restart_budget, never its end
    assert F.PROBE_TIMEOUT in P.PROBE_TRANSIENT

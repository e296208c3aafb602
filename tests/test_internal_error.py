"""r1sup's own failures are r1sup's: ``internal_error``, never blamed on vLLM, never a relaunch.

The end-to-end tests break the probe for real: its child process runs with a ``httpx`` package first
on its path whose import fails (a dependency that cannot be imported, as in a fresh install that lacked
one). r1sup must launch once, stop the engine cleanly, exit 1 with one line naming the module and the
exception, print no traceback, and leave no process behind.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from r1sup.adapters.probe import child_failure, error_line, request_error, request_fault
from r1sup.core import failure as F
from r1sup.core import search as S
from r1sup.core.bounds import BlindFacts, Bounds
from r1sup.core.errors import InternalError
from r1sup.core.flags import EngineFlags
from r1sup_proc import R1sup, engine_processes, kill_engine_processes, write_config
from test_tune_fake import QWEN_7B, engine_records, fake_body, fake_env, fake_scenario

# vLLM V1's EngineDeadError, as it answers a request or ends a stream once its engine core died
ENGINE_DEAD_TEXT = "EngineCore encountered an issue. See stack trace (above) for the root cause."

MISSING = "r1sup_test_missing_dependency"


def broken_httpx(tmp_path: Path) -> Path:
    """A directory to put first on the path: its ``httpx`` imports a module that does not exist."""
    pkg = tmp_path / "broken" / "httpx"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"import {MISSING}\n")
    return pkg.parent


# --- the pieces ---------------------------------------------------------------------------------


def test_where_an_unexpected_exception_was_raised() -> None:
    try:
        EngineFlags.from_dict({"no_such_flag": 1})  # data a caller should never pass: a bug's shape
    except ValueError as exc:
        fault = InternalError.from_exception(exc)
    assert fault.where.startswith("r1sup.core.flags (from_dict, line ")
    assert str(fault).startswith("internal error in r1sup.core.flags (from_dict, line ")
    assert str(fault).endswith("ValueError: unknown flag(s): no_such_flag")
    assert "Traceback" in fault.trace and "\n" not in str(fault)


def test_a_probe_child_traceback_names_the_module_and_the_exception() -> None:
    import r1sup.adapters.probe

    stderr = (
        "Traceback (most recent call last):\n"
        '  File "/usr/lib/python3.11/asyncio/runners.py", line 118, in run\n'
        "    return self._loop.run_until_complete(task)\n"
        f'  File "{r1sup.adapters.probe.__file__}", line 170, in _run\n'
        "    import httpx\n"
        '  File "/tmp/broken/httpx/__init__.py", line 1, in <module>\n'
        f"    import {MISSING}\n"
        f"ModuleNotFoundError: No module named '{MISSING}'\n"
    )
    assert child_failure(stderr, 1) == (
        "r1sup.adapters.probe (_run, line 170)",
        f"ModuleNotFoundError: No module named '{MISSING}'",
    )
    assert child_failure("", -9) == ("r1sup.adapters.probe (the probe child)", "killed by SIGKILL")


def test_transport_errors_are_the_requests_and_bugs_are_the_probes() -> None:
    import httpx
    import openai

    request = httpx.Request("POST", "http://127.0.0.1:1/v1/chat/completions")
    assert request_error(openai.APIConnectionError(request=request))
    assert request_error(httpx.RemoteProtocolError("peer closed connection", request=request))
    assert request_error(ConnectionResetError(104, "reset"))
    assert not request_error(KeyError("choices"))
    assert not request_error(AttributeError("'NoneType' object has no attribute 'usage'"))


@pytest.mark.parametrize("strategy", ["smart", "naive"])
def test_the_search_never_steps_for_an_internal_error(strategy: str) -> None:
    failure = F.Failure(
        F.INTERNAL_ERROR, evidence="KeyError: 'x'", detail="r1sup.adapters.probe (_run, line 1)"
    )
    flags = EngineFlags(max_model_len=8192)
    device = BlindFacts(total_gib=24.0).device()
    search = S.Search(S.Facts(arch=None, device=device, user=flags, bounds=Bounds(strategy=strategy)))
    decision = search.after(S.Outcome(flags, failure))
    assert isinstance(decision, S.GiveUp) and decision.exit_code == 1
    assert "r1sup.adapters.probe" in decision.reason and not failure.memory


def test_an_unexpected_exception_in_a_command_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from r1sup.cli import app as cli
    from r1sup.cli.commands import status

    def broken(args: object) -> int:
        return {}["state"]  # type: ignore[no-any-return]

    monkeypatch.setattr(status, "main", broken)
    assert cli.main(["status", "--state-dir", "/nonexistent"]) == 1
    err = capsys.readouterr().err
    assert err == "r1sup: error: internal error in r1sup.cli.app (main, line " + err.split("line ", 1)[1]
    assert err.count("\n") == 1 and "KeyError: 'state'" in err and "Traceback" not in err


# --- end to end: a probe that cannot import --------------------------------------------------------


def broken_probe_run(tmp_path: Path, command: str) -> tuple[R1sup, Path]:
    scenario = fake_scenario(tmp_path)
    env = fake_env(scenario)
    env["PYTHONPATH"] = os.pathsep.join([str(broken_httpx(tmp_path)), env["PYTHONPATH"]])
    daemon = {"backoff_initial_s": 0.1, "backoff_max_s": 0.5, "liveness_interval_s": 3600.0}
    config = write_config(tmp_path / "r1sup.toml", fake_body(tmp_path, model=QWEN_7B, daemon=daemon))
    proc = R1sup(command, "--config", str(config), env=env)
    try:
        proc.wait(120)
    finally:
        proc.kill()
        left = engine_processes(config)
        kill_engine_processes(config)
    assert not left, f"engine processes left behind: {left}"
    return proc, config


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("command", ["tune", "run"])
def test_a_probe_that_cannot_import_is_r1sups_failure_not_the_engines(tmp_path: Path, command: str) -> None:
    proc, _ = broken_probe_run(tmp_path, command)
    assert proc.proc.returncode == 1, proc.tail()
    said = [line for line in proc.stderr if not line.startswith("{")]  # stderr less the JSON log events
    assert len(said) == 1, said
    line = said[0]
    assert line.startswith("r1sup: error: internal error in r1sup.adapters.probe (_import_client, line "), (
        line
    )
    assert line.rstrip().endswith(f"ModuleNotFoundError: No module named '{MISSING}'"), line
    assert proc.lines == []  # no result on stdout
    # among the log events only vLLM's own relayed teardown lines may hold a traceback (during_stop)
    assert all(e["event"] == "vllm" for e in proc.events if "Traceback" in json.dumps(e))
    # one launch, stopped by r1sup; no relaunch, no ladder step, no retry
    records = engine_records(tmp_path)
    assert len(records) == 1 and len(proc.named("launch_started")) == 1
    assert [r["outcome"] for r in records] == ["ready"]  # it started fine: the probe is what broke
    assert [r["reason"] for r in engine_records(tmp_path, "stop")] == ["signal"]  # r1sup's SIGTERM
    (stopped,) = proc.named("engine_stopped")
    assert stopped["reason"] == "internal error" and not stopped["escalated"]
    assert not proc.named("search_step") and not proc.named("retry_backoff")
    classified = [e["failure_class"] for e in proc.named("failure_classified")]
    assert classified == ["internal_error"]
    assert proc.named("engine_stopped") and proc.named("internal_error")
    if command == "run":
        state = json.loads((tmp_path / "state" / "status.json").read_text())
        assert state["state"] == "failed" and state["child_pid"] is None
        assert state["last_failure"]["class"] == "internal_error"
        assert MISSING in state["last_failure"]["evidence"]
    assert (
        not list((tmp_path / "state" / "profiles").glob("*.json")) if (tmp_path / "state").exists() else True
    )


def test_a_server_that_cuts_a_response_short_is_the_servers_failure_not_r1sups() -> None:
    """Since an exception in a check thread is now r1sup's own failure, the checks must turn everything
    the server can do into a failed check: here a body cut short (http.client.IncompleteRead)."""
    import socket
    import threading

    from r1sup.adapters import health

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]

        def answer() -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nff\r\n{"choices": [')

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        ok, status, detail = health.tiny_completion(
            health.Endpoint("127.0.0.1", port, None), "r1", timeout=10
        )
        thread.join(timeout=10)
    assert not ok and status == 0 and "unreachable" in detail


@pytest.mark.parametrize(
    ("status", "body", "fault"),
    [
        # vLLM's EngineDeadError (V1) and AsyncEngineDeadError (V0): the engine's own word
        (
            500,
            {"message": "EngineCore encountered an issue. See stack trace (above) for the root cause."},
            "engine",
        ),
        (500, {"message": "Background loop has errored already."}, "engine"),
        # a 5xx without it (issue 34): vLLM shutting down its executor, a proxy's page; /health decides
        (500, {"message": "cannot schedule new futures after shutdown"}, "server"),
        (503, "<html><head><title>503 Service Unavailable</title></head></html>", "server"),
        (502, None, "server"),
        (400, {"message": "This model's maximum context length is 2048 tokens."}, "rejected"),
    ],
)
def test_a_5xx_is_the_engines_death_only_with_vllms_engine_dead_reply(
    status: int, body: Any, fault: str
) -> None:
    import httpx
    import openai

    request = httpx.Request("POST", "http://127.0.0.1:1/v1/chat/completions")
    response = httpx.Response(status, request=request)
    message = f"Error code: {status} - {body}"
    exc = openai.APIStatusError(message, response=response, body=body)
    assert request_fault(exc) == fault


@pytest.mark.parametrize(
    ("body", "fault", "line"),
    [
        # what vLLM 0.32 sends after the 200 when the engine died during the request: its EngineDeadError
        (
            {"message": ENGINE_DEAD_TEXT, "type": "InternalServerError", "param": None, "code": 500},
            "engine",
            f"error in the stream (500 InternalServerError): {ENGINE_DEAD_TEXT}",
        ),
        # a request that failed in generation (its GenerationError): no evidence, sent again
        (
            {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500},
            "server",
            "error in the stream (500 InternalServerError): Internal server error",
        ),
        # an error of the request's own (a ValueError in generation is vLLM's 400)
        (
            {"message": "bad logits processor", "type": "BadRequestError", "param": None, "code": 400},
            "rejected",
            "rejected (HTTP 400, in the stream): bad logits processor",
        ),
        # another server's event without a code, or a code as text: the server's fault (a 5xx)
        ({"message": "upstream went away"}, "server", "error in the stream (500): upstream went away"),
        ({"message": "overloaded", "code": "503"}, "server", "error in the stream (503): overloaded"),
    ],
)
def test_an_error_event_in_the_middle_of_a_stream_is_classed_by_what_it_says(
    body: dict[str, Any], fault: str, line: str
) -> None:
    # issue 34: the openai client raises the event as a bare APIError, which was "engine" whatever it said
    import httpx
    import openai

    request = httpx.Request("POST", "http://127.0.0.1:1/v1/chat/completions")
    exc = openai.APIError(str(body["message"]), request, body=body)
    assert request_fault(exc) == fault
    assert error_line(exc) == line


def test_a_request_timeout_is_its_own_fault_never_the_engines() -> None:
    # issue 34: a request that got no answer within probe.request_timeout_s was "engine", the engine's
    # death; a busy engine times requests out as a hung one does, so what it did meanwhile decides
    import asyncio

    import httpx
    import openai

    request = httpx.Request("POST", "http://127.0.0.1:1/v1/chat/completions")
    for exc in (
        openai.APITimeoutError(request=request),  # before the answer's headers
        httpx.ReadTimeout("timed out", request=request),  # no next chunk of the stream in time
        httpx.PoolTimeout("no connection free"),
        asyncio.TimeoutError(),
        TimeoutError(),
    ):
        assert request_error(exc)
        assert request_fault(exc) == "timeout", exc

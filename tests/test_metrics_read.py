"""The serving phase's read of vLLM's ``/metrics`` (r1sup.adapters.watch.read_metrics) against a real local
server that answers, dribbles its answer, or takes the connection and says nothing: the read's timeout
bounds the whole exchange, and one that runs out is a sample without figures that says it timed out
(issue 34: a read that had not come back for 67 s was neither an error nor a sample)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from r1sup.adapters import health, watch
from r1sup.core import liveness

pytestmark = pytest.mark.timeout(60)

BODY = (
    "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
    'vllm:num_requests_running{engine="0",model_name="tiny"} 1.0\n'
    'vllm:num_requests_waiting{engine="0",model_name="tiny"} 20.0\n'
    'vllm:generation_tokens_total{engine="0",model_name="tiny"} 16177.0\n'
    'vllm:prompt_tokens_total{engine="0",model_name="tiny"} 1500.0\n'
    'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 8.0\n'
)
HEAD = f"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {len(BODY)}\r\n\r\n"


@contextmanager
def server(answer: Callable[[socket.socket, threading.Event], None]) -> Iterator[tuple[int, threading.Event]]:
    """A one-connection server on 127.0.0.1; ``answer`` handles the connection until it is done or the
    test ends (the event is set then). Yields the port and an event set once ``answer`` has returned."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    ending, answered = threading.Event(), threading.Event()

    def serve() -> None:
        listener.settimeout(10)
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            conn.recv(4096)  # the request
            with contextlib.suppress(OSError):  # the client went away
                answer(conn, ending)
            answered.set()
            ending.wait(10)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield port, answered
    finally:
        ending.set()
        listener.close()
        thread.join(15)


def whole(conn: socket.socket, ending: threading.Event) -> None:
    conn.sendall((HEAD + BODY).encode())


def dribbled(conn: socket.socket, ending: threading.Event) -> None:
    """The headers at once, then the body a few bytes every 0.2 s (about 15 s in all): each socket read
    gets bytes long before a timeout of 1 s, the exchange never ends within it."""
    conn.sendall(HEAD.encode())
    data = BODY.encode()
    for i in range(0, len(data), 5):
        if ending.wait(0.2):
            return
        conn.sendall(data[i : i + 5])


def silent(conn: socket.socket, ending: threading.Event) -> None:
    ending.wait(10)


def test_an_answer_within_the_timeout_is_a_sample_with_vllms_figures():
    with server(whole) as (port, _):
        sample = watch.read_metrics(health.Endpoint("127.0.0.1", port), 5.0, at=12.0)
    assert sample.error == "" and sample.at == 12.0
    assert sample.figures == liveness.Figures(1.0, 20.0, 1500.0, 16177.0, 8.0)


@pytest.mark.parametrize("answer", [dribbled, silent], ids=["dribbled", "silent"])
def test_a_read_that_outlasts_its_timeout_is_recorded_as_timed_out(answer):
    with server(answer) as (port, answered):
        sample = watch.read_metrics(health.Endpoint("127.0.0.1", port), 1.0, at=12.0)
        still_answering = not answered.is_set()
    assert sample.figures is None and sample.at == 12.0
    assert sample.error == "/metrics timed out after 1s"
    assert still_answering  # cut at its deadline, not read to the end


def test_a_port_nobody_listens_on_is_unanswered_not_timed_out():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: the connection is refused
        sample = watch.read_metrics(health.Endpoint("127.0.0.1", port), 1.0, at=1.0)
    assert sample.figures is None and sample.error == "/metrics unanswered"

"""r1sup's own HTTP endpoint, on the metrics listener: ``/livez``, ``/readyz``, ``/status``, ``/metrics``.

For container platforms and load balancers, which cannot read systemd's READY=1:

- ``/livez``: 200 while the supervisor's loop turns. The daemon stamps a monotonic heartbeat at each
  turn of its loop (launching, probing, serving, backing off); the check fails when the last stamp is
  older than the longest the loop may legitimately block, which is a stop of vLLM (grace period plus
  the wait for memory and port) with a margin. An HTTP thread that still answers while the loop is
  wedged therefore says 503, and the platform restarts the container.
- ``/readyz``: 200 only in the ``serving`` state, which the daemon enters after start-up and the load
  probe passed; 503 in every other state (planning, launching, probing, draining, backoff, stopping,
  and any state added later), so no traffic is routed to an engine that is loading, being re-tuned or
  going away. While ``draining`` (a stop r1sup chose waits for the requests in flight) vLLM still
  finishes those, but a load balancer that reads ``/readyz`` sends it no new ones.
- ``/status``: the ``status.json`` document, secrets masked (its ``status`` line says what a drain
  waits for: ``draining: 3 running, 0 waiting``).
- ``/metrics``: the Prometheus text, as before.

The verdicts are pure functions of a :class:`View`; the server only renders them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit

from r1sup.adapters.logs import get_logger

SERVING = "serving"
# What the loop may block for beyond a stop's own bounds (reaping, the orphan guard, the reader thread,
# the interpreter query of a fingerprint): the stop escalation adds up to about 25 s, the version query
# of the vLLM environment is bounded at 30 s.
LOOP_MARGIN_S = 60.0
JSON_TYPE = "application/json"


@dataclass(frozen=True)
class View:
    """What the endpoint needs from the daemon, read at each request."""

    state: str
    loop_age_s: float  # seconds since the loop's last turn
    loop_limit_s: float  # a loop quiet for longer than this is wedged
    status: dict[str, Any] | None  # the status.json document, as last written


def loop_limit_s(stop_timeout_s: float, memory_release_timeout_s: float) -> float:
    """The longest the daemon's loop may go without a turn: a stop of vLLM, whose bounds the config
    sets (SIGTERM grace, then the wait for memory and port), plus :data:`LOOP_MARGIN_S`."""
    return stop_timeout_s + memory_release_timeout_s + LOOP_MARGIN_S


def live(view: View) -> bool:
    return view.loop_age_s <= view.loop_limit_s


def ready(view: View) -> bool:
    return view.state == SERVING


def route(
    path: str, view: View | None, metrics: Callable[[], tuple[str, bytes]] | None
) -> tuple[int, str, bytes]:
    """(HTTP status, content type, body) for ``path``; ``view`` None: the daemon is not attached."""
    if path == "/metrics" and metrics is not None:
        content_type, text = metrics()
        return 200, content_type, text
    if view is None or path not in ("/livez", "/readyz", "/status"):
        return 404, JSON_TYPE, _small_json("error", f"not found: {path}")
    if path == "/livez":
        ok = live(view)
        said = _small_json(
            "live",
            ok,
            "state",
            view.state,
            "loop_age_s",
            round(view.loop_age_s, 3),
            "loop_limit_s",
            view.loop_limit_s,
        )
        return (200 if ok else 503), JSON_TYPE, said
    if path == "/readyz":
        ok = ready(view)
        return (200 if ok else 503), JSON_TYPE, _small_json("ready", ok, "state", view.state)
    if view.status is None:
        return 503, JSON_TYPE, _small_json("error", "no status yet", "state", view.state)
    return 200, JSON_TYPE, _json(view.status)


def _mask_strings(value: Any, mask: Callable[[str], str]) -> Any:
    """``value`` with ``mask`` applied to every string in it (keys too), structure kept."""
    if isinstance(value, str):
        return mask(value)
    if isinstance(value, dict):
        return {mask(str(k)): _mask_strings(v, mask) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_mask_strings(v, mask) for v in value]
    return value


def _json(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1, default=str) + "\n").encode("utf-8")


@functools.lru_cache(maxsize=256, typed=True)  # typed: True, 1 and 1.0 are told apart
def _small_json(*pairs: Any) -> bytes:
    """:func:`_json` of the flat object of ``pairs`` (key, value, key, value, ...), remembered: the
    answers of probes and errors repeat, and under a churn of thousands of connections a second the
    encoder (pure Python, for the indent) was a third of what each connection cost (issue 34)."""
    return _json(dict(zip(pairs[::2], pairs[1::2], strict=True)))


# --- the listener: one thread, one selector, bounded in every way -----------------------------------
#
# Probes and scrapers send one small GET and read one small answer; nothing else needs serving. So the
# listener is event-driven: one thread waits on a selector for every connection, a request head must
# arrive whole within REQUEST_TIMEOUT_S and within MAX_HEAD_BYTES, each answer closes its connection,
# and at most MAX_CONNECTIONS are open at once (the oldest is closed to make room for a new one: a
# flood of idle or slowloris connections cannot keep a probe out, nor take the file descriptors the
# daemon needs). Whatever fails in here (accept out of file descriptors, a broken view) is answered,
# logged at most once a minute, and survived: the endpoint never stops the daemon or vLLM.

MAX_CONNECTIONS = 64
REQUEST_TIMEOUT_S = 5.0  # for the whole request head, and again for the whole answer
MAX_HEAD_BYTES = 8192
BACKLOG = 4096  # the kernel caps it at net.core.somaxconn (4096 by default since Linux 5.4)
ACCEPTS_PER_TURN = 256
ACCEPT_PAUSE_S = 0.1  # after accept failed for want of file descriptors
# Linux: the kernel queues a connection for accept only once its first bytes arrived (or after about
# this many seconds), so connections that send nothing (closed at once, held idle) never reach this
# thread, and what it accepts is mostly a whole request, answered at once. Under a churn of thousands of
# connections that halved what waits in the accept queue ahead of a probe (issue 34).
DEFER_ACCEPT_S = 5
EVICT_GRACE_S = 0.01  # one this young that sent nothing yet is not closed to make room: it may be sending
WARN_EVERY_S = 60.0
METRICS_REUSE_S = 0.5  # a /metrics text rendered this recently answers the next /metrics request


@dataclass
class _Conn:
    sock: socket.socket
    deadline: float
    accepted: float = 0.0
    head: bytearray = dataclasses.field(default_factory=bytearray)
    out: bytes = b""
    writing: bool = False


def _response(code: int, content_type: str, payload: bytes, *, body: bool, extra: str = "") -> bytes:
    head = (
        f"HTTP/1.1 {code} {HTTPStatus(code).phrase}\r\n"
        f"Server: r1sup\r\nContent-Type: {content_type}\r\nContent-Length: {len(payload)}\r\n"
        f"Cache-Control: no-store\r\nConnection: close\r\n{extra}\r\n"
    ).encode("latin-1")
    return head + payload if body else head


# The whole answer to a small payload (a probe's, an error's), remembered like its body: see _small_json.
_small_response = functools.lru_cache(maxsize=256)(_response)
SMALL_PAYLOAD_BYTES = 1024


def parse_request(head: bytes) -> tuple[int, str, str]:
    """(status, method, path) of a request head: status 0 when it can be answered from ``path``, else
    the error to answer with (400 not HTTP, 405 not GET/HEAD)."""
    return _parse_line(head.split(b"\n", 1)[0])


@functools.lru_cache(maxsize=256)  # a probe's request line repeats (a path and its query)
def _parse_line(first: bytes) -> tuple[int, str, str]:
    line = first.strip()
    try:
        method, target, version = line.decode("ascii").split(" ")
    except (UnicodeDecodeError, ValueError):
        return 400, "", ""
    if not version.startswith("HTTP/") or not target:
        return 400, method, ""
    if method not in ("GET", "HEAD"):
        return 405, method, ""
    return 0, method, urlsplit(target).path.rstrip("/") or "/"


class _Listener:
    """The listening socket and its connections, served from one thread."""

    def __init__(self, endpoint: Endpoint, host: str, port: int, clock: Callable[[], float]) -> None:
        self.endpoint = endpoint
        self.clock = clock
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, address = infos[0]
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind(address)
            self.sock.listen(BACKLOG)
            if hasattr(socket, "TCP_DEFER_ACCEPT"):
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, DEFER_ACCEPT_S)
            self.sock.setblocking(False)
        except OSError:
            self.sock.close()
            raise
        self.port = int(self.sock.getsockname()[1])
        self.selector = selectors.DefaultSelector()
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.selector.register(self.sock, selectors.EVENT_READ, None)
        self.selector.register(self.wake_r, selectors.EVENT_READ, None)
        self.conns: OrderedDict[int, _Conn] = OrderedDict()  # by file descriptor, oldest first
        self.accepting = True
        self.resume_at = 0.0
        self.stopping = False
        self.warned: dict[str, float] = {}
        self.evicted = 0

    # --- the loop ---

    def run(self) -> None:
        while not self.stopping:
            try:
                self._turn()
            except Exception as exc:  # noqa: BLE001 - the endpoint must not end; the daemon goes on
                self._warn("endpoint_error", error=f"{type(exc).__name__}: {exc}")
                time.sleep(0.05)
        self._close_all()

    def _turn(self) -> None:
        now = self.clock()
        if not self.accepting and now >= self.resume_at:
            self.selector.register(self.sock, selectors.EVENT_READ, None)
            self.accepting = True
        wait = min([c.deadline for c in self.conns.values()] + [now + 1.0]) - now
        if not self.accepting:
            wait = min(wait, self.resume_at - now)
        for key, events in self.selector.select(max(0.0, wait)):
            if key.fileobj is self.sock:
                self._accept()
            elif key.fileobj is self.wake_r:
                self.stopping = True
                return
            else:
                conn = self.conns.get(key.fd)
                if conn is None:
                    continue
                try:
                    if events & selectors.EVENT_WRITE:
                        self._write(conn)
                    elif events & selectors.EVENT_READ:
                        self._read(conn)
                except OSError:
                    self._drop(conn)
        now = self.clock()
        for conn in [c for c in self.conns.values() if c.deadline <= now]:
            if conn.writing:
                self._drop(conn)  # a reader that does not read its answer
            else:
                self._answer(conn, _response(408, JSON_TYPE, _json({"error": "request timeout"}), body=True))

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_TURN):
            try:
                sock, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS: wait in the backlog, make room
                self._warn("endpoint_accept_failed", error=exc.strerror or str(exc), open=len(self.conns))
                if self.conns:
                    self._drop(next(iter(self.conns.values())))
                self.selector.unregister(self.sock)
                self.accepting = False
                self.resume_at = self.clock() + ACCEPT_PAUSE_S
                return
            now = self.clock()
            conn = self._answer_at_once(sock, now)
            if conn is None:
                continue
            try:
                sock.setblocking(False)
                events = selectors.EVENT_WRITE if conn.writing else selectors.EVENT_READ
                self.selector.register(sock, events, None)
            except (OSError, ValueError):
                sock.close()
                continue
            self.conns[sock.fileno()] = conn
            if len(self.conns) > MAX_CONNECTIONS and not self._make_room(now):
                return

    def _answer_at_once(self, sock: socket.socket, now: float) -> _Conn | None:
        """Serve a connection just accepted without the selector: a request that is already there (a
        probe's, a scraper's: the usual case) is answered and the connection closed, one that is gone is
        closed; None then. Else the connection to keep, reading its head or writing its answer. Under a
        churn of thousands of connections each one costs a few system calls, so the accept queue, where a
        probe waits behind them all, drains fast (issue 34)."""
        try:
            data = sock.recv(4096, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return _Conn(sock, now + REQUEST_TIMEOUT_S, accepted=now)  # nothing yet: it waits, under the cap
        except OSError:
            sock.close()
            return None
        if not data:
            sock.close()
            return None
        out = self._respond(data)
        if out is None:
            return _Conn(sock, now + REQUEST_TIMEOUT_S, accepted=now, head=bytearray(data))
        try:
            sent = sock.send(out, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            sock.close()
            return None
        if sent < len(out):
            return _Conn(sock, now + REQUEST_TIMEOUT_S, accepted=now, out=out[sent:], writing=True)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)
        sock.close()
        return None

    def _make_room(self, now: float) -> bool:
        """Close the oldest connections still waiting for their request, down to the cap; False (and
        accepting paused until the oldest is old enough) when the oldest arrived within EVICT_GRACE_S
        and has sent nothing yet: a burst of real clients gets the time to send, a flood of idle ones
        does not keep the cap. One that sent part of a head and no more gets no grace: with deferred
        accepts (Linux) a client's request is there whole when its connection is accepted, and a pause
        here makes every connection behind it in the accept queue wait, a probe's included (a churn of
        half-sent heads paused accepting a dozen times in a burst, about 10 ms each: issue 34)."""
        while len(self.conns) > MAX_CONNECTIONS:
            oldest = next(iter(self.conns.values()))
            if not oldest.head and not oldest.writing and now - oldest.accepted < EVICT_GRACE_S:
                self.selector.unregister(self.sock)
                self.accepting = False
                self.resume_at = oldest.accepted + EVICT_GRACE_S
                return False
            self.evicted += 1
            self._drop(oldest)
            self._warn("endpoint_connections_capped", limit=MAX_CONNECTIONS)
        return True

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(4096)
        except (BlockingIOError, InterruptedError):  # an event meant for an earlier socket of this number
            return
        if not data:
            self._drop(conn)
            return
        conn.head += data
        out = self._respond(conn.head)
        if out is not None:
            self._answer(conn, out)

    def _respond(self, head: bytes | bytearray) -> bytes | None:
        """The answer to a request head received so far; None while it is not whole yet."""
        end = max(head.find(b"\r\n\r\n"), head.find(b"\n\n"))
        if end < 0:
            if len(head) > MAX_HEAD_BYTES:
                payload = _json({"error": f"request head over {MAX_HEAD_BYTES} bytes"})
                return _response(431, JSON_TYPE, payload, body=True)
            return None
        status, method, path = parse_request(bytes(head[:end]))
        if status == 405:
            payload = _json({"error": f"method {method[:20]} not allowed"})
            return _response(405, JSON_TYPE, payload, body=True, extra="Allow: GET, HEAD\r\n")
        if status:
            return _response(status, JSON_TYPE, _json({"error": "bad request"}), body=True)
        try:
            code, content_type, payload = self.endpoint.answer(path)
        except Exception as exc:  # noqa: BLE001 - a probe gets an answer, never a dropped connection
            code, content_type, payload = 500, JSON_TYPE, _json({"error": f"{type(exc).__name__}: {exc}"})
        if len(payload) <= SMALL_PAYLOAD_BYTES:
            return _small_response(code, content_type, payload, body=method == "GET")
        return _response(code, content_type, payload, body=method == "GET")

    def _answer(self, conn: _Conn, data: bytes) -> None:
        conn.out, conn.writing = data, True
        conn.deadline = self.clock() + REQUEST_TIMEOUT_S
        self.selector.modify(conn.sock, selectors.EVENT_WRITE, None)
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        if not conn.writing:
            return
        try:
            sent = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        conn.out = conn.out[sent:]
        if not conn.out:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_WR)
            self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        self.conns.pop(fd, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self.selector.unregister(conn.sock)
        with contextlib.suppress(OSError):
            conn.sock.close()

    def _warn(self, event: str, **fields: Any) -> None:
        now = self.clock()
        if now - self.warned.get(event, -WARN_EVERY_S) >= WARN_EVERY_S:
            self.warned[event] = now
            with contextlib.suppress(Exception):
                get_logger().warning(event, **fields)

    # --- from other threads ---

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.wake_w.send(b"x")

    def _close_all(self) -> None:
        for conn in list(self.conns.values()):
            self._drop(conn)
        with contextlib.suppress(Exception):
            self.selector.close()
        for sock in (self.sock, self.wake_r, self.wake_w):
            with contextlib.suppress(OSError):
                sock.close()


class Endpoint:
    """The listener: one thread serving requests, each answered from a fresh :class:`View`; ``/metrics``
    from a text rendered at most once per ``METRICS_REUSE_S`` (:meth:`_metrics`)."""

    def __init__(
        self,
        view: Callable[[], View] | None = None,
        metrics: Callable[[], tuple[str, bytes]] | None = None,
        mask: Callable[[str], str] = lambda text: text,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.view = view
        self.metrics = metrics
        self.mask = mask
        self.clock = clock
        self._rendered: tuple[float, tuple[str, bytes]] | None = None  # (when, what) of the last render
        self._listener: _Listener | None = None
        self._thread: threading.Thread | None = None

    def answer(self, path: str) -> tuple[int, str, bytes]:
        view = self.view() if self.view is not None else None
        if view is not None and view.status is not None and path == "/status":
            view = dataclasses.replace(view, status=_mask_strings(view.status, self.mask))
        return route(path, view, self._metrics if self.metrics is not None else None)

    def _metrics(self) -> tuple[str, bytes]:
        """The Prometheus text, rendered again only when the last render is ``METRICS_REUSE_S`` old: a
        flood of ``/metrics`` requests (thousands a second) then costs a send each, not a render each
        (a few milliseconds of the one thread that also answers ``/livez`` and ``/readyz``: in a real
        daemon under a churn of 3,000 connections asking ``/metrics``, the probes' answers took 0.3 s
        at the median and 0.8 s at most). A scraper reads figures at most that much older."""
        assert self.metrics is not None
        now = self.clock()
        last = self._rendered
        if last is None or not 0 <= now - last[0] < METRICS_REUSE_S:
            last = (now, self.metrics())
            self._rendered = last
        return last[1]

    def serve(self, host: str, port: int) -> None:
        """Listen on ``host:port`` (OSError when it cannot) and answer from a daemon thread."""
        self._listener = _Listener(self, host, port, time.monotonic)
        self._thread = threading.Thread(target=self._listener.run, name="r1sup-endpoint", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int | None:
        return self._listener.port if self._listener is not None else None

    def close(self) -> None:
        if self._listener is not None:
            self._listener.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self._listener = None

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

import dataclasses
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

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
        return 404, JSON_TYPE, _json({"error": f"not found: {path}"})
    if path == "/livez":
        ok = live(view)
        said = {
            "live": ok,
            "state": view.state,
            "loop_age_s": round(view.loop_age_s, 3),
            "loop_limit_s": view.loop_limit_s,
        }
        return (200 if ok else 503), JSON_TYPE, _json(said)
    if path == "/readyz":
        ok = ready(view)
        return (200 if ok else 503), JSON_TYPE, _json({"ready": ok, "state": view.state})
    if view.status is None:
        return 503, JSON_TYPE, _json({"error": "no status yet", "state": view.state})
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


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "r1sup"
    sys_version = ""

    def do_GET(self) -> None:  # noqa: N802 - the http.server protocol
        self._answer(body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(body=False)

    def _answer(self, *, body: bool) -> None:
        path = urlsplit(self.path).path.rstrip("/") or "/"
        try:
            code, content_type, payload = self.server.endpoint.answer(path)
        except Exception as exc:  # noqa: BLE001 - a probe gets an answer, never a dropped connection
            code, content_type, payload = 500, JSON_TYPE, _json({"error": f"{type(exc).__name__}: {exc}"})
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if body:
            self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """Probes come every few seconds; they are not worth a line on stderr each."""


class Endpoint:
    """The listener: one thread serving requests, each answered from a fresh :class:`View`."""

    def __init__(
        self,
        view: Callable[[], View] | None = None,
        metrics: Callable[[], tuple[str, bytes]] | None = None,
        mask: Callable[[str], str] = lambda text: text,
    ) -> None:
        self.view = view
        self.metrics = metrics
        self.mask = mask
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def answer(self, path: str) -> tuple[int, str, bytes]:
        view = self.view() if self.view is not None else None
        if view is not None and view.status is not None and path == "/status":
            view = dataclasses.replace(view, status=_mask_strings(view.status, self.mask))
        return route(path, view, self.metrics)

    def serve(self, host: str, port: int) -> None:
        """Listen on ``host:port`` (OSError when it cannot) and answer from a daemon thread."""
        self._server = _Server((host, port), self)
        self._thread = threading.Thread(target=self._server.serve_forever, name="r1sup-endpoint", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int | None:
        return int(self._server.server_address[1]) if self._server is not None else None

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

"""Readiness and liveness over HTTP, with the standard library only (cheap to import, no pools)."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    api_key: str | None = None

    @property
    def address(self) -> str:
        """The host to connect to (a wildcard bind address is reached on loopback)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return "::1" if host == "::" else host

    @property
    def base(self) -> str:
        host = self.address
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def request(
        self, path: str, body: dict[str, Any] | None = None, timeout: float = 5.0
    ) -> tuple[int, bytes]:
        """(HTTP status, body). Status 0 when the server could not be reached."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.base + path, data=data, method="POST" if data is not None else "GET"
        )
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - http to our own child
                return resp.status, resp.read(4 * 1024 * 1024)
        except urllib.error.HTTPError as exc:
            try:
                payload = exc.read(64 * 1024)
            except OSError:
                payload = b""
            return exc.code, payload
        except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
            return 0, b""  # unreachable, reset, or cut short (IncompleteRead): the server's side


def check_ready(ep: Endpoint, served_name: str, timeout: float = 2.0) -> tuple[bool, str]:
    """Ready: /health answers 200 and /v1/models lists the served model."""
    status, _ = ep.request("/health", timeout=timeout)
    if status != 200:
        return False, f"/health {status or 'unreachable'}"
    status, body = ep.request("/v1/models", timeout=timeout)
    if status != 200:
        return False, f"/v1/models {status or 'unreachable'}"
    try:
        ids = [m.get("id") for m in json.loads(body).get("data", [])]
    except (ValueError, AttributeError):
        return False, "/v1/models: not JSON"
    if served_name not in ids:
        return False, f"/v1/models does not list {served_name!r} (lists {ids})"
    return True, "ready"


def check_health(ep: Endpoint, timeout: float = 5.0) -> tuple[bool, str]:
    status, _ = ep.request("/health", timeout=timeout)
    return status == 200, f"/health {status or 'unreachable'}"


def tiny_completion(ep: Endpoint, served_name: str, timeout: float = 30.0) -> tuple[bool, int, str]:
    """A real one-token chat completion: (answered, HTTP status or 0, detail with vLLM's error text).

    ``/health`` can answer while the engine is dead; the status and the body tell an engine-dead
    error (HTTP 500, EngineDeadError) from a refused or unanswered request.
    """
    body = {
        "model": served_name,
        "messages": [{"role": "user", "content": "ping"}],
        "max_tokens": 1,
        "temperature": 0,
    }
    status, payload = ep.request("/v1/chat/completions", body, timeout=timeout)
    if status != 200:
        text = payload[:600].decode("utf-8", "replace")
        return False, status, f"completion {status or 'unreachable'}: {text}"
    try:
        choices = json.loads(payload)["choices"]
    except (ValueError, KeyError, TypeError):
        return False, status, "completion: malformed response"
    return bool(choices), status, "completion ok"


def get_within(
    ep: Endpoint, path: str, seconds: float, limit: int = 4 * 1024 * 1024
) -> tuple[int, bytes, str]:
    """GET ``path`` with the whole exchange (connect, request, headers, body) bounded by ``seconds``:
    (HTTP status, body, "") or (0, b"", why: "timed out after Ns" or "unanswered").

    A socket timeout bounds each read, not the exchange: a server that takes the connection and then
    answers slowly, or a little at a time, could hold the caller for minutes. At the deadline a timer
    shuts the socket down, which ends the read that waits on it.
    """
    conn = http.client.HTTPConnection(ep.address, ep.port, timeout=seconds)
    lock = threading.Lock()
    state = {"finished": False, "cut": False}

    def cut() -> None:
        with lock:
            if state["finished"]:
                return
            state["cut"] = True
            sock = conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):  # already closed
                sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(seconds, cut)
    timer.daemon = True
    timer.start()
    status, body, why = 0, b"", "unanswered"
    try:
        with lock:
            if state["cut"]:  # the connect alone took the whole deadline
                raise TimeoutError
        headers = {"Authorization": f"Bearer {ep.api_key}"} if ep.api_key else {}
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        body = resp.read(limit)
        status, why = resp.status, ""
    except (OSError, ValueError, http.client.HTTPException):
        status, body = 0, b""  # unreachable, reset, cut short, or cut at the deadline (below)
    finally:
        with lock:
            state["finished"] = True
            cut_off = state["cut"]
        timer.cancel()
        conn.close()
    if cut_off:
        return 0, b"", f"timed out after {seconds:g}s"
    return status, body, why


def fetch_metrics(ep: Endpoint, timeout: float = 5.0) -> tuple[int, str, str]:
    """``/metrics`` as text, the read bounded by ``timeout`` as a whole: (HTTP status or 0, body, why
    it has no status: "timed out after Ns" or "unanswered"). vLLM serves it without the API key."""
    status, payload, why = get_within(ep, "/metrics", timeout)
    return status, payload.decode("utf-8", "replace") if status == 200 else "", why

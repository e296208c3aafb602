"""The reads behind :mod:`r1sup.core.liveness` while vLLM serves; each one returns an observation.

``read_metrics`` and ``send_probe`` block (HTTP with a timeout; the metrics read's bounds the whole
exchange) and run on check threads; the process watch reads ``/proc`` through psutil, cheap enough for
the loop itself. Nothing here decides.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import psutil

from r1sup.adapters import health
from r1sup.core import liveness

VLLM_PROCESS_PREFIX = "VLLM::"  # vLLM's process titles: VLLM::EngineCore(_DP0), VLLM::Worker(_TP1), ...


def read_metrics(ep: health.Endpoint, timeout: float, at: float | None = None) -> liveness.MetricsSample:
    """One read of ``/metrics``, stamped with the time it was asked for (``at``: the time it was due,
    so that samples on a fixed grid are exactly one interval apart). ``timeout`` bounds the whole read;
    one that runs out is a sample without figures whose error says so."""
    at = time.monotonic() if at is None else at
    status, text, why = health.fetch_metrics(ep, timeout)
    if status != 200:
        return liveness.MetricsSample(
            at, None, f"/metrics {status or why or 'unanswered'}", answered=bool(status)
        )
    figures = liveness.parse_metrics(text)
    if figures is None:
        return liveness.MetricsSample(
            at, None, "/metrics has no vLLM figures (--disable-log-stats?)", answered=True
        )
    return liveness.MetricsSample(at, figures)


def send_probe(ep: health.Endpoint, served_name: str, timeout: float) -> liveness.ProbeResult:
    """The one-token completion; the result carries vLLM's status and error text."""
    ok, status, detail = health.tiny_completion(ep, served_name, timeout)
    return liveness.ProbeResult(time.monotonic(), ok, status, detail, detail)


@dataclass
class ProcessWatch:
    """vLLM's engine processes (named ``VLLM::...``) under the API server; one that ends is news.

    vLLM 0.32 exits its API server within a second of losing the engine core, but the API server can
    stay up (``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH``, other versions): then the engine is dead while
    ``/health`` may still answer. The processes seen are checked at each call (one ``/proc`` read
    each); the API server's descendants are listed anew (a scan of every process) every
    ``rescan_every`` calls only.
    """

    pid: int
    rescan_every: int = 10
    seen: dict[int, tuple[str, float]] = field(default_factory=dict)  # pid -> (title, create time)
    calls: int = 0

    def check(self) -> str | None:
        """A line naming the engine process that ended, or None while all seen ones live."""
        for pid, (title, created) in self.seen.items():
            if not _alive(pid, created):
                return f"{title} (pid {pid}) ended while the API server runs"
        if self.calls % self.rescan_every == 0:
            self._scan()
        self.calls += 1
        return None

    def _scan(self) -> None:
        try:
            children = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return  # the API server itself is gone: its exit is handled as such
        for child in children:
            try:
                title = _title(child)
                if child.status() != psutil.STATUS_ZOMBIE and title.startswith(VLLM_PROCESS_PREFIX):
                    self.seen.setdefault(child.pid, (title, child.create_time()))
            except psutil.Error:
                continue


def _alive(pid: int, created: float) -> bool:
    """The same process (pid and start time) is still there and not a zombie."""
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and abs(proc.create_time() - created) < 0.01
    except psutil.Error:
        return False


def _title(proc: psutil.Process) -> str:
    """The process title vLLM sets (setproctitle rewrites argv; the kernel name is cut at 15 bytes)."""
    cmdline = proc.cmdline()
    head = cmdline[0].strip() if cmdline else ""
    return head if head.startswith(VLLM_PROCESS_PREFIX) else proc.name()

"""The reads behind :mod:`r1sup.liveness` while vLLM serves; each one returns an observation.

``read_metrics`` and ``send_probe`` block (HTTP with a timeout) and run on check threads; the
process watch reads ``/proc`` through psutil, cheap enough for the loop itself. Nothing here decides.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import psutil

from r1sup import health, liveness

VLLM_PROCESS_PREFIX = "VLLM::"  # vLLM's process titles: VLLM::EngineCore(_DP0), VLLM::Worker(_TP1), ...


def read_metrics(ep: health.Endpoint, timeout: float, at: float | None = None) -> liveness.MetricsSample:
    """One read of ``/metrics``, stamped with the time it was asked for (``at``: the time it was due,
    so that samples on a fixed grid are exactly one interval apart)."""
    at = time.monotonic() if at is None else at
    status, text = health.fetch_metrics(ep, timeout)
    if status != 200:
        return liveness.MetricsSample(at, None, f"/metrics {status or 'unanswered'}")
    figures = liveness.parse_metrics(text)
    if figures is None:
        return liveness.MetricsSample(at, None, "/metrics has no vLLM figures (--disable-log-stats?)")
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
    ``/health`` may still answer.
    """

    pid: int
    seen: dict[int, tuple[str, float]] = field(default_factory=dict)  # pid -> (title, create time)

    def check(self) -> str | None:
        """A line naming the engine process that ended, or None while all seen ones live."""
        try:
            children = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return None  # the API server itself is gone: its exit is handled as such
        live: set[int] = set()
        for child in children:
            try:
                title = _title(child)
                if child.status() == psutil.STATUS_ZOMBIE or not title.startswith(VLLM_PROCESS_PREFIX):
                    continue
                self.seen.setdefault(child.pid, (title, child.create_time()))
                live.add(child.pid)
            except psutil.Error:
                continue
        for pid, (title, _) in self.seen.items():
            if pid not in live:
                return f"{title} (pid {pid}) ended while the API server runs"
        return None


def _title(proc: psutil.Process) -> str:
    """The process title vLLM sets (setproctitle rewrites argv; the kernel name is cut at 15 bytes)."""
    cmdline = proc.cmdline()
    head = cmdline[0].strip() if cmdline else ""
    return head if head.startswith(VLLM_PROCESS_PREFIX) else proc.name()

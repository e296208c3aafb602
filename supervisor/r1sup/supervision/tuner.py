"""The bring-up: launch, classify, ask the search (:mod:`r1sup.core.search`) for the next flags, until
start-up and the load probe pass.

Used by ``r1sup tune`` (stop the server at the end, print a report) and by ``r1sup run`` (keep it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace
from typing import Any

from r1sup.core import bounds as B
from r1sup.core import failure as F
from r1sup.core.capacity import Reduction
from r1sup.core.config import Config
from r1sup.core.errors import EXIT_NO_WORKING_CONFIG, EXIT_OK
from r1sup.core.events import (
    AttemptFailed,
    CapacityShort,
    ColdCacheAhead,
    ColdCacheRelaunch,
    ConfigReduced,
    DeviceProbeFailed,
    EstimateUnavailable,
    FirstFlags,
    Launching,
    Probing,
    Retrying,
    SearchEvent,
    SearchGaveUp,
    SearchRefined,
    SearchStepped,
    SearchSucceeded,
)
from r1sup.core.failure import Failure
from r1sup.core.figures import EMPTY as NO_FIGURES
from r1sup.core.figures import Figures
from r1sup.core.flags import EngineFlags
from r1sup.core.knowledge import (
    ModelKnowledge,
    explain_first,
    ladder_facts,
    launch_calibration,
    new_search,
    planner_suggestions,
)
from r1sup.core.probing import ProbeResult
from r1sup.supervision.footing import plan_first_decision
from r1sup.supervision.loop import Phase
from r1sup.supervision.runner import Launch, Runner
from r1sup.supervision.subscribers import logging_bus


@dataclass
class Attempt:
    number: int
    flags: dict[str, Any]
    outcome: str  # ok, failed
    failure_class: str
    phase: str
    evidence: str
    seconds: float
    change: str = ""  # what the search did next, and why
    where: str = ""  # where the root cause was seen (process, pid, line of vLLM's output)
    why: str = ""  # why these flags were launched (the plan, the previous failure, a saved profile)
    phase_seconds: dict[str, float] = field(default_factory=dict)  # loading phases (r1sup.core.progress)
    memory: list[dict[str, Any]] = field(default_factory=list)  # per GPU, predicted and measured

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass
class TuneResult:
    ok: bool
    exit_code: int
    launches: int = 0
    flags: EngineFlags | None = None
    probe: ProbeResult | None = None
    # the saved profile's full probe that a short probe with short prompts stands on (Launch.stands_on)
    stands_on: ProbeResult | None = None
    command: list[str] = field(default_factory=list)
    figures: Figures = NO_FIGURES  # what vLLM printed at the launch that passed
    attempts: list[Attempt] = field(default_factory=list)
    failure: Failure | None = None
    reason: str = ""
    suggestions: list[str] = field(default_factory=list)
    profile_path: str | None = None
    live: Launch | None = None  # the running server, when asked to keep it
    history: Any = None  # the search (r1sup.core.search.Search) with its evidence, to continue from
    # what each change against the user's flags costs (search.Search.costs), and, when the flags give up
    # more than half the asked context or serve fewer sequences than asked, why and the ways out
    # (search.Search.reduction)
    costs: list[str] = field(default_factory=list)
    reduced: Reduction | None = None
    slo: Any = None  # r1sup.core.slo.SloResult: the service level proven on the running server ([slo])

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "exit_code": self.exit_code,
            "launches": self.launches,
            "flags": self.flags.to_dict() if self.flags else None,
            "probe": self.probe.to_dict() if self.probe is not None else None,
            **({"stands_on": self.stands_on.to_dict()} if self.stands_on is not None else {}),
            "profile_path": self.profile_path,
            "command": self.command,
            "observations": self.figures.to_dict(),
            "attempts": [a.to_dict() for a in self.attempts],
            "reason": self.reason,
            "suggestions": self.suggestions,
            "last_failure": self.failure.to_dict() if self.failure else None,
            "costs": self.costs,
            "reduced": self.reduced.to_dict() if self.reduced is not None else None,
            **({"slo": self.slo.to_dict()} if self.slo is not None else {}),
        }


class Tuner:
    def __init__(
        self,
        config: Config,
        runner: Runner,
        log: Any,
        know: ModelKnowledge | None = None,
        publish: Callable[[SearchEvent], None] | None = None,
        record: Any = None,
    ) -> None:
        self.config = config
        # what the search reports goes as events: to the daemon's bus, else to a bus that logs them
        self.publish = publish or logging_bus(log).publish
        self.runner = runner
        self.log = log
        self.know = know if know is not None else runner.world.knowledge(config, log)
        self.bounds = B.Bounds.from_config(config)
        self.record = record  # r1sup.state.runrecord.RunLog: every attempt for `r1sup report`

    def refresh_device(self) -> Generator[Phase, Any, None]:
        """What the device has free now (NVML: a check off the loop's thread); a probe that fails is
        reported and the last facts kept."""
        probe = self.runner.world.device

        def look(cancelled: Any) -> tuple[Any, str]:
            try:
                return probe(), ""
            except Exception as exc:  # noqa: BLE001 - the search goes on with the last facts
                return None, f"{type(exc).__name__}: {exc}"

        device, error = yield from self.runner.off_loop("devices", look)
        if error:
            self.publish(DeviceProbeFailed(error, search=True))
        else:
            self.know.device = device

    def run(
        self,
        start: EngineFlags | None = None,
        *,
        keep_running: bool = False,
        history: Any = None,
        why: str = "",
        calibration: Any = None,
    ) -> Generator[Phase, Any, TuneResult]:
        """``history``: the search of an earlier run to continue (its evidence), or None for a new one.
        Its waits (each launch, probe, stop and backoff) are yielded to the loop's script."""
        from r1sup.core import search as S

        result = TuneResult(ok=False, exit_code=EXIT_NO_WORKING_CONFIG)
        search = history if isinstance(history, S.Search) else new_search(self.config, self.know, calibration)
        if start is None:
            start, why, give_up = plan_first_decision(self.config, self.know, search, self.log)
            if give_up is not None:  # r1sup plan's exit 3: nothing within the bounds is predicted to fit
                result.history = search
                result.exit_code, result.reason = give_up.exit_code, give_up.reason
                result.suggestions = list(give_up.suggestions)
                suggested = tuple(give_up.suggestions)
                self.publish(SearchGaveUp(F.NONE, give_up.reason, suggested, give_up.exit_code, launches=0))
                if self.record is not None:
                    self.record.finish(result.to_dict(), final=True)
                return result
            why = explain_first(why, self.know)
            self.publish(FirstFlags(start, why))
        flags = start
        good: EngineFlags | None = None  # flags that passed before a refined launch
        attempt = 0
        warmed = False  # a proven profile's cold start has been relaunched on the cache it filled
        while True:
            result.history = search
            attempt += 1
            self.runner.check_signals()
            t0 = time.monotonic()
            if attempt == 1:
                self._cold_start_check(flags)
            self.publish(Launching(attempt, flags))
            launch = yield from self.runner.launch(flags, attempt=attempt)
            result.launches += 1 if launch.started_engine else 0
            result.command = list(launch.spec.display)
            failure = launch.failure
            if failure.cls == F.NONE and launch.ready:
                failure = self.runner.capacity_failure(launch) or F.NO_FAILURE
                if failure.cls != F.NONE:
                    self.publish(CapacityShort(attempt, failure))
                elif self.config.probe.enabled:
                    self.publish(Probing(attempt, flags))
                    failure = yield from self.runner.probe(launch)
            figures = launch.figures
            calibration = launch_calibration(self.know, flags, figures) or calibration
            record = self.attempt_of(attempt, flags, launch, failure, t0, why)
            result.attempts.append(record)
            better = search.refine(flags, figures) if failure.cls == F.NONE and good is None else None
            if better is not None:
                # it passed, and what it printed says a longer context fits: once more with that, and
                # back to these flags should that fail
                good = flags
                record.change = (
                    f"{flags.describe_change(better)} (this launch's figures: a longer context fits)"
                )
                self._record(record, None)
                yield from self.runner.stop(launch, reason="refined by its own figures")
                self.publish(SearchRefined(flags, better))
                why = f"attempt {attempt} passed; its figures say a longer context fits"
                flags = better
                continue
            if failure.cls != F.NONE and good is not None and flags != good:
                record.change = f"back to the flags that passed ({flags.describe_change(good)})"
                self._record(record, None)
                yield from self.runner.stop(launch, reason=f"failed: {failure.cls}")
                why = f"attempt {attempt} failed ({failure.cls}): back to the flags that passed"
                flags = good
                continue
            if failure.cls == F.NONE:
                result.ok, result.exit_code, result.flags = True, EXIT_OK, flags
                result.costs = search.costs(flags)
                result.reduced = search.reduction(flags)
                if result.reduced is not None:
                    self.publish(ConfigReduced(result.reduced))
                result.probe, result.stands_on = launch.probe, launch.stands_on
                # the figures of this launch alone: they calibrate the memory model for these flags
                result.figures = figures
                if keep_running:
                    result.live = launch
                else:
                    yield from self.runner.stop(launch, reason="tune finished")
                self.publish(SearchSucceeded(result.launches, flags))
                self._record(record, result)
                return result
            if not warmed and self._cold_start_of_warm_profile(flags, launch, failure):
                # proven on a warm torch.compile cache; this start compiled from nothing and its profile
                # run took more memory. The compile filled the cache: the same flags again, and the
                # search is not told (not a failure of the flags)
                warmed = True
                record.change = (
                    "the same flags again: proven on a warm torch.compile cache, this start compiled "
                    "from nothing (cold) and had less memory; the compile cache is warm now"
                )
                self._record(record, None)
                yield from self.runner.stop(launch, reason=f"cold compile cache: {failure.cls}")
                self.publish(ColdCacheRelaunch(attempt, failure.cls, flags, figures.kv_cache_gib))
                why = f"attempt {attempt} started on a cold compile cache ({failure.cls}): relaunched warm"
                continue
            yield from self.runner.stop(launch, reason=f"failed: {failure.cls}")
            result.failure = failure
            self.publish(AttemptFailed(attempt, failure))
            suggestions = (
                planner_suggestions(self.config, self.know, flags, calibration) if failure.memory else ()
            )
            search.facts = replace(
                search.facts,
                ladder_facts=ladder_facts(self.know, flags, suggestions),
                suggestions=suggestions,
                bounds=self.bounds,
            )
            # what is free now that this launch is gone (another tenant may have moved)
            yield from self.refresh_device()
            outcome = S.Outcome(flags, failure, figures, self.know.device)
            decision = search.after(outcome)
            if isinstance(decision, S.GiveUp):
                record.change = f"give up: {decision.reason}"
                result.exit_code = decision.exit_code
                result.reason = decision.reason
                result.suggestions = list(decision.suggestions)
                fatal = decision.exit_code != EXIT_NO_WORKING_CONFIG
                suggested = tuple(decision.suggestions)
                self.publish(SearchGaveUp(failure.cls, decision.reason, suggested, decision.exit_code, fatal))
                self._record(record, result)
                return result
            record.change = f"{flags.describe_change(decision.flags)} ({decision.reason})"
            new, reason = decision.flags, decision.reason
            self.publish(SearchStepped(attempt + 1, flags, new, failure.cls, failure.evidence, reason))
            self._record(record, None)
            why = f"attempt {attempt} failed ({failure.cls}): {decision.reason}"
            if decision.retry:
                delay = self.config.daemon.backoff_initial_s
                self.publish(Retrying(attempt + 1, delay, failure.cls))
                yield from self.runner.sleep(delay)
            flags = decision.flags

    def attempt_of(
        self, number: int, flags: EngineFlags, launch: Launch, failure: Failure, t0: float, why: str
    ) -> Attempt:
        """The run record's attempt for one launch (``t0``: when it began, monotonic)."""
        return Attempt(
            number=number,
            flags=flags.to_dict(),
            outcome="ok" if failure.cls == F.NONE else "failed",
            failure_class=failure.cls,
            phase=failure.phase,
            evidence=(failure.evidence or failure.detail)[:300],
            seconds=round(time.monotonic() - t0, 1),
            where=failure.detail[:200] if failure.cls != F.NONE else "",
            why=why or "as given",
            phase_seconds=launch.progress.durations(time.monotonic()) if launch.progress else {},
            memory=self._memory(flags, launch.figures),
        )

    def _proven_warm(self, flags: EngineFlags) -> bool:
        proven = self._proven()
        return proven is not None and proven.proven_warm and proven.flags == flags.to_dict()

    def _proven(self) -> Any:
        """The saved profile a launch of its flags stands on (:attr:`r1sup.supervision.prober.Prober.proven`);
        None for a runner without a prober (a test's)."""
        prober = getattr(self.runner, "prober", None)
        return prober.proven if prober is not None else None

    def _cold_start_of_warm_profile(self, flags: EngineFlags, launch: Any, failure: Failure) -> bool:
        """A memory failure of a proven profile's flags on a cold compile cache, the profile proven warm."""
        cold = getattr(launch, "compile_cache", None) == "cold"
        return failure.memory and cold and self._proven_warm(flags)

    def _cold_start_check(self, flags: EngineFlags) -> None:
        """Before a proven profile's launch on a cold compile cache, the profile proven on a warm one: the
        memory model's prediction for a cold start against the proven context (logged; vLLM decides, and
        a cold start that falls short is relaunched once the compile has filled the cache)."""
        from r1sup.adapters.launcher import engine_env
        from r1sup.core import memmodel
        from r1sup.state import profiles

        if not self._proven_warm(flags) or self.know.arch is None or self.know.device is None:
            return
        if profiles.compile_cache_state(engine_env(self.config)) != "cold":
            return
        proven = self._proven()
        assert proven is not None  # _proven_warm
        version = self.know.version().started(compile_cache="cold")
        try:
            calibration = memmodel.Calibration(
                flags=flags, figures=Figures(compile_cache_cold=0.0), version=version
            )
            est = memmodel.evaluate(self.know.arch, self.know.device, flags, version, calibration)
        except (ValueError, ZeroDivisionError) as exc:
            self.publish(EstimateUnavailable("compile_cache_check", str(exc)))
            return
        length = flags.max_model_len or self.know.arch.max_position_embeddings
        cold_context = est.max_model_len(self.know.arch.max_position_embeddings)
        fits = cold_context >= length
        self.publish(ColdCacheAhead(flags, proven.kv_cache_tokens, est.kv.gib, cold_context, fits))

    def _memory(self, flags: EngineFlags, figures: Figures) -> list[dict[str, Any]]:
        """Per GPU, the planner's prediction for ``flags`` and what vLLM printed; [] if not known."""
        from r1sup.state.runrecord import attempt_memory

        try:
            return attempt_memory(self.know, flags, self.config, figures)
        except Exception as exc:  # noqa: BLE001 - a picture is never worth a failed search
            self.publish(EstimateUnavailable("memory_chart", f"{type(exc).__name__}: {exc}"))
            return []

    def _record(self, attempt: Attempt, result: TuneResult | None) -> None:
        if self.record is None:
            return
        self.record.attempt(attempt.to_dict())
        if result is not None:
            self.record.finish(result.to_dict(), final=result.live is None)

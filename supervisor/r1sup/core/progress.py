"""Where a launch is while the model loads: phases, vLLM's own percent, elapsed time and an ETA.

Pure: the log reader's progress kinds and monotonic times go in, plain values come out. The runner
feeds one :class:`LoadProgress` per launch; the console line, ``status``, ``status.json`` and systemd's
``STATUS=`` all show its :class:`Snapshot`. The seconds each phase took are kept with the attempt (and
so in the profile), and the next launch of the same model on the same box uses them for its ETA.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# The phases of a start-up, in order; a launch only ever moves forward through them.
STARTING = "starting"  # the process starts, vLLM imports, reads the config, spawns the engine core
WEIGHTS = "weights"  # "Starting to load model ...", the checkpoint shards
PROFILING = "profiling"  # compile and profile run (GPU), warm-up (CPU)
KV_CACHE = "kv_cache"  # KV cache sized and allocated
GRAPHS = "graphs"  # CUDA graphs captured
API = "api"  # engine ready, the HTTP server starts
PROBE = "probe"  # r1sup's own load probe
PHASES = (STARTING, WEIGHTS, PROFILING, KV_CACHE, GRAPHS, API, PROBE)

LABELS = {
    STARTING: "starting vLLM",
    WEIGHTS: "loading weights",
    PROFILING: "profiling memory",
    KV_CACHE: "allocating the KV cache",
    GRAPHS: "capturing CUDA graphs",
    API: "starting the API server",
    PROBE: "load probe",
}

# The log reader's progress kinds (r1sup.core.logparse) and the phase each one starts; None: no change.
KIND_PHASE: dict[str, str | None] = {
    "engine_config": None,
    "weights_start": WEIGHTS,
    "weights_progress": WEIGHTS,
    "weights_loaded": PROFILING,
    "profiling_start": PROFILING,
    "memory_profile": KV_CACHE,
    "kv_cache_available": KV_CACHE,
    "cudagraph_estimate": KV_CACHE,
    "kv_cache_size": KV_CACHE,
    "kv_blocks": KV_CACHE,
    "auto_fit": KV_CACHE,
    "graph_capture": GRAPHS,
    "cudagraph_memory": GRAPHS,
    "memory_breakdown": None,
    "engine_init": API,
    "api_start": API,
    "server_ready": API,
}
# kinds that carry vLLM's own percent of a phase, and the number holding it
PERCENT_KEYS = {"weights_progress": "weights_percent", "graph_capture": "graphs_percent"}
PERCENT_LOG_STEP = 10.0  # without a terminal line, a percent is logged when it moved this much


@dataclass(frozen=True)
class Snapshot:
    """What a person should see now."""

    phase: str
    percent: float | None
    elapsed_s: float  # since the launch started
    phase_elapsed_s: float
    eta_s: float | None  # until ready and probed, from an earlier launch's timings; None: unknown

    @property
    def label(self) -> str:
        return LABELS.get(self.phase, self.phase)

    def text(self) -> str:
        """``loading weights 45%, 0:32 elapsed, ETA 1:10``."""
        head = self.label + (f" {self.percent:.0f}%" if self.percent is not None else "")
        parts = [head, f"{clock(self.elapsed_s)} elapsed"]
        if self.eta_s is not None:
            parts.append(f"ETA {clock(self.eta_s)}" if self.eta_s >= 1 else "ETA any moment")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "label": self.label,
            "percent": None if self.percent is None else round(self.percent, 1),
            "elapsed_s": round(self.elapsed_s, 1),
            "phase_elapsed_s": round(self.phase_elapsed_s, 1),
            "eta_s": None if self.eta_s is None else round(self.eta_s, 1),
        }


@dataclass(frozen=True)
class Step:
    """What a progress line changed: a new phase (log it), or only a percent (show it)."""

    phase_changed: bool
    percent_changed: bool
    snapshot: Snapshot
    numbers: Mapping[str, float] = field(default_factory=dict)  # gathered since the last logged step
    previous_phase: str | None = None
    previous_phase_s: float | None = None  # how long the phase just left took


class LoadProgress:
    """The phases of one launch. ``expected``: seconds per phase from an earlier launch (for the ETA)."""

    def __init__(self, started: float, expected: Mapping[str, float] | None = None) -> None:
        self.started = started
        self.expected = {p: float(s) for p, s in (expected or {}).items() if p in PHASES and s >= 0}
        self.phase = STARTING
        self.phase_started = started
        self.percent: float | None = None
        self._logged_percent: float | None = None
        self._durations: dict[str, float] = {}
        self._pending: dict[str, float] = {}
        self._reported: dict[str, float] = {}
        self._ended: float | None = None

    # --- feeding ---------------------------------------------------------------------------------

    def observe(self, kind: str, numbers: Mapping[str, float], now: float) -> Step | None:
        """One progress item of the log reader. None when it changed nothing worth showing."""
        target = KIND_PHASE.get(kind)
        percent_key = PERCENT_KEYS.get(kind)
        for key, value in numbers.items():
            if percent_key is not None and key in (percent_key, *_COUNTER_KEYS):
                continue
            if self._reported.get(key) != value:  # another rank's or another line's same figure
                self._pending[key] = value
        previous, previous_s = self.phase, now - self.phase_started
        if target is not None and _after(target, self.phase):
            self._enter(target, now)
            if percent_key is not None:
                self.percent = numbers.get(percent_key)
            return Step(True, False, self.snapshot(now), self._take(), previous, round(previous_s, 1))
        if percent_key is not None and target == self.phase and numbers.get(percent_key) is not None:
            value = float(numbers[percent_key])
            if self.percent is not None and value <= self.percent:
                return None  # another rank's bar, or the same line again
            self.percent = value
            return Step(False, True, self.snapshot(now))
        return None

    def enter(self, phase: str, now: float) -> Step | None:
        """r1sup's own phases (the probe), or a phase vLLM printed nothing for. None if not forward."""
        if not _after(phase, self.phase):
            return None
        previous, previous_s = self.phase, now - self.phase_started
        self._enter(phase, now)
        return Step(True, False, self.snapshot(now), self._take(), previous, round(previous_s, 1))

    def finish(self, now: float) -> dict[str, float]:
        """The launch is over (ready and probed, or failed): stop the clock, return the numbers not
        yet reported."""
        if self._ended is None:
            self._durations[self.phase] = round(now - self.phase_started, 1)
            self._ended = now
        return self._take()

    @property
    def ended(self) -> bool:
        return self._ended is not None

    def should_log_percent(self, step: Step) -> bool:
        """Without a terminal line, a percent is worth a log line every PERCENT_LOG_STEP points."""
        pct = step.snapshot.percent
        if not step.percent_changed or pct is None:
            return False
        if self._logged_percent is None or pct - self._logged_percent >= PERCENT_LOG_STEP or pct >= 100:
            self._logged_percent = pct
            return True
        return False

    # --- reading ---------------------------------------------------------------------------------

    def snapshot(self, now: float) -> Snapshot:
        end = self._ended if self._ended is not None else now
        return Snapshot(
            phase=self.phase,
            percent=self.percent,
            elapsed_s=max(0.0, end - self.started),
            phase_elapsed_s=max(0.0, end - self.phase_started),
            eta_s=self.eta(now),
        )

    def eta(self, now: float) -> float | None:
        """Seconds until ready and probed: what is left of this phase (by vLLM's own percent when it
        prints one, else by the earlier launch's time for it) plus the earlier times of the phases
        after it. None without earlier timings, or once the launch is over."""
        if not self.expected or self._ended is not None:
            return None
        spent = now - self.phase_started
        pct = self.percent
        if pct is not None and pct >= 10 and self.phase in (WEIGHTS, GRAPHS):
            left = spent * (100.0 - pct) / pct
        else:
            left = max(0.0, self.expected.get(self.phase, 0.0) - spent)
        later = PHASES[PHASES.index(self.phase) + 1 :]
        return left + sum(self.expected.get(p, 0.0) for p in later)

    def durations(self, now: float) -> dict[str, float]:
        """Seconds spent in each phase so far (the current one up to ``now``)."""
        out = dict(self._durations)
        if self._ended is None:
            out[self.phase] = round(now - self.phase_started, 1)
        return {p: out[p] for p in PHASES if p in out}

    # --- internals -------------------------------------------------------------------------------

    def _enter(self, phase: str, now: float) -> None:
        self._durations[self.phase] = round(now - self.phase_started, 1)
        # phases vLLM skipped (no graphs with --enforce-eager or on the CPU) took no time
        for skipped in PHASES[PHASES.index(self.phase) + 1 : PHASES.index(phase)]:
            self._durations.setdefault(skipped, 0.0)
        self.phase, self.phase_started = phase, now
        self.percent = None
        self._logged_percent = None

    def _take(self) -> dict[str, float]:
        out, self._pending = self._pending, {}
        self._reported.update(out)
        return out


_COUNTER_KEYS = ("shards_done", "shards_total", "graphs_done", "graphs_total")


def _after(phase: str, current: str) -> bool:
    return phase in PHASES and PHASES.index(phase) > PHASES.index(current)


def clock(seconds: float) -> str:
    """``72`` -> ``1:12``; ``3725`` -> ``1:02:05``."""
    total = max(0, int(round(seconds)))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def expected_timings(attempt_lists: Iterable[Iterable[Mapping[str, Any]]]) -> dict[str, float]:
    """Seconds per phase of the newest launch that started and passed, from profiles' attempt records
    (most relevant profile first): what an ETA is computed from. {} when none was timed."""
    for attempts in attempt_lists:
        for attempt in reversed(list(attempts)):
            timed = attempt.get("phase_seconds")
            if attempt.get("outcome") == "ok" and isinstance(timed, Mapping) and timed:
                out = {
                    p: float(s)
                    for p, s in timed.items()
                    if p in PHASES and isinstance(s, (int, float)) and not isinstance(s, bool) and s >= 0
                }
                if out:
                    return out
    return {}

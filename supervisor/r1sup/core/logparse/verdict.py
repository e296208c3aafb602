"""The verdict: from what a log showed (plain data) to one :class:`~r1sup.core.failure.Failure`.

Pure: :func:`decide` takes a :class:`Collected` (the findings, the frames' phases, the figures and
milestones, the open tracebacks) and an exit status, and returns the failure class, phase, evidence,
numbers and the line of the evidence. Nothing here reads a line.

How a verdict is reached: every message that names a cause is kept (the earliest per class) and the
verdict takes the most specific class, not the last line: ``Engine core initialization failed`` or
``EngineDeadError`` decide the class only when nothing else explains the failure. The phase comes
from the traceback frames of the finding, from frames seen anywhere in the log, from whether readiness
was reached, and last from the start-up milestones passed (``r1sup.core.failure.STARTUP_MILESTONES``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from r1sup.core.failure import (
    CONFIG_ERROR,
    CUDA_ERROR,
    ENGINE_DEAD,
    FREE_MEM_BELOW_UTIL,
    HANG,
    HOST_OOM,
    KV_INSUFFICIENT,
    MODEL_NOT_FOUND,
    NO_KV_MEMORY,
    NONE,
    OOM_CUDAGRAPH,
    OOM_KV_ALLOC,
    OOM_PROFILE,
    OOM_RUNTIME,
    OOM_WEIGHTS,
    PHASE_CUDA_GRAPH,
    PHASE_KV_CACHE,
    PHASE_LOAD_WEIGHTS,
    PHASE_PROFILE,
    PHASE_SERVING,
    PHASE_STARTUP,
    PORT_IN_USE,
    Failure,
    Numbers,
    phase_after,
)
from r1sup.core.logparse.families import CONFIG_LIKE, HANG_LIKE, OOM, P_HOST, P_NATIVE
from r1sup.core.logparse.tracebacks import WEAK_PHASE, Traceback, best_key, best_phase, phase_rank
from r1sup.core.memmodel import CUDA_BLOCK_SIZE

# Exit statuses of a process that was asked to stop (SIGTERM, SIGINT): after a shutdown line, no failure
REQUESTED_STOP_EXITS = frozenset({0, -15, 143, -2, 130})

OOM_BY_PHASE = {
    PHASE_LOAD_WEIGHTS: OOM_WEIGHTS,
    PHASE_PROFILE: OOM_PROFILE,
    PHASE_KV_CACHE: OOM_KV_ALLOC,
    PHASE_CUDA_GRAPH: OOM_CUDAGRAPH,
    PHASE_SERVING: OOM_RUNTIME,
}


@dataclass
class Finding:
    """A line (or joined message) that names a cause, with where the log was when it came."""

    cls: str  # a class, an OOM marker (phase decides), or an exception name for unexplained ones
    prio: int
    fixed_phase: str | None
    text: str
    numbers: dict[str, float]
    line_no: int
    process: str | None
    pid: int | None
    frame_phase: str | None
    hint: bool
    request: bool
    after_ready: bool
    after_shutdown: bool
    reached: int  # the start-up milestone passed when it was seen (r1sup.core.failure.STARTUP_MILESTONES)
    header: bool  # the line was the exception line itself (preferred as evidence)


@dataclass(frozen=True)
class Collected:
    """What the reader gathered from a log, as the verdict needs it."""

    findings: Mapping[str, Finding]  # the best finding per class
    unknown: Finding | None = None  # the first exception that no family explains
    frame_phases: Mapping[str, int] = field(default_factory=dict)  # phase keys of every traceback
    observations: Mapping[str, float] = field(default_factory=dict)  # the success path's figures
    open_tracebacks: Sequence[Traceback] = ()  # tracebacks that never reached their exception line
    reached: int = 0  # the start-up milestone passed
    ready_line: int | None = None  # "Application startup complete"
    ready_text: str | None = None
    marked_ready_line: int | None = None  # the supervisor saw readiness at this line
    shutdown_line: int | None = None
    serving_death_line: int | None = None  # the engine died in its serving loop
    blocks_line: int | None = None  # where v0 printed "# GPU blocks"
    block_size: int = CUDA_BLOCK_SIZE
    traffic_line: int | None = None  # the first line of request traffic of the last run (logparse.phase)

    @property
    def ready(self) -> bool:
        return self.ready_line is not None or self.marked_ready_line is not None

    @property
    def serving(self) -> bool:
        """The log shows the server ready or answering requests."""
        return self.ready or self.traffic_line is not None

    def served_at(self, finding: Finding) -> bool:
        """Whether request traffic places a finding in the serving phase: traffic came before it, or
        after it while its own traceback names no start-up step (a request answered 500 after the OOM
        that failed it)."""
        if self.traffic_line is None:
            return False
        if self.traffic_line <= finding.line_no:
            return True
        return finding.frame_phase is None or finding.frame_phase == PHASE_SERVING

    def ready_after(self, line_no: int) -> int | None:
        """The line where readiness was reached after ``line_no`` (None when it was not)."""
        for ready in (self.ready_line, self.marked_ready_line):
            if ready is not None and ready > line_no:
                return ready
        return None


@dataclass(frozen=True)
class Diagnosis:
    """A verdict with where it comes from: what ``r1sup diagnose`` reports."""

    failure: Failure
    line: int | None  # 1-based line of the input holding the evidence; None when no line carries it
    vllm_log: bool  # a line was recognised as vLLM output, or the verdict names a failure
    lines: int  # lines read


@dataclass(frozen=True)
class Decision:
    """A verdict and the 1-based input line of its evidence (None when no line carries it)."""

    failure: Failure
    line: int | None


def decide(c: Collected, exit_code: int | None = None) -> Decision:
    """The verdict on a log from what was collected, and the process's exit status (None: running)."""
    specific = _best(c, lambda f: f.prio > P_NATIVE)
    if specific is not None:
        return Decision(_build(c, specific, specific.cls), specific.line_no)
    host = _best(c, lambda f: f.cls == HOST_OOM and f.prio >= P_HOST)
    if host is not None:
        return Decision(_build(c, host, HOST_OOM), host.line_no)
    if exit_code in (-9, 137):
        return Decision(
            _bare(
                c,
                HOST_OOM,
                f"exit status {exit_code} (SIGKILL) and no other cause in the log",
                "killed by SIGKILL: on Linux usually the kernel's OOM killer (host RAM)",
            ),
            None,
        )
    native = _best(c, lambda f: f.prio == P_NATIVE and not f.after_shutdown)
    dead = _best(c, lambda f: f.cls == ENGINE_DEAD and not f.after_shutdown)
    unknown = c.unknown
    if unknown is not None and c.ready_after(unknown.line_no) is not None:
        unknown = None  # vLLM became ready after it: it was not fatal
    cut = _cut_traceback(c)
    requested_stop = c.shutdown_line is not None and exit_code in REQUESTED_STOP_EXITS
    nonzero = exit_code is not None and exit_code != 0 and not requested_stop
    startup_unknown = unknown is not None and not unknown.after_ready and not c.ready
    maybe_host = _best(c, lambda f: f.cls == HOST_OOM and f.prio < P_HOST)
    if (
        native is None
        and dead is None
        and maybe_host is None
        and not nonzero
        and not startup_unknown
        and cut is None
    ):
        failure = Failure(
            NONE,
            phase=PHASE_SERVING if c.serving else PHASE_STARTUP,
            evidence=c.ready_text or "",
            numbers=Numbers.from_dict(c.observations),
        )
        return Decision(failure, c.ready_line if c.ready_text else None)
    inferred = _infer_v0_kv(c)
    if inferred is not None:
        return Decision(inferred, c.blocks_line)
    if native is None and maybe_host is not None:
        return Decision(_build(c, maybe_host, HOST_OOM), maybe_host.line_no)  # Ray's likeliest cause
    if native is not None and (unknown is None or native.line_no < unknown.line_no):
        return Decision(_build(c, native, CUDA_ERROR), native.line_no)  # the earliest unexplained event
    if unknown is not None:
        if unknown.cls in CONFIG_LIKE and not unknown.after_ready:
            return Decision(_build(c, unknown, CONFIG_ERROR), unknown.line_no)
        if unknown.cls in HANG_LIKE:
            return Decision(_build(c, unknown, HANG), unknown.line_no)
        return Decision(_build(c, unknown, ENGINE_DEAD), unknown.line_no)
    if dead is not None:
        return Decision(_build(c, dead, ENGINE_DEAD), dead.line_no)
    if cut is not None:
        phase = best_phase(cut.phases) or best_phase(c.frame_phases) or phase_after(c.reached)
        where = (cut.process or "main") + (f" pid {cut.pid}" if cut.pid is not None else "")
        failure = Failure(
            ENGINE_DEAD,
            phase=phase,
            evidence=f"the log ends inside a traceback; last frame: {cut.last_frame}",
            numbers=Numbers.from_dict(c.observations),
            detail=f"{where}, traceback from line {cut.start_line}",
        )
        return Decision(failure, cut.start_line)
    return Decision(_bare(c, ENGINE_DEAD, f"exit status {exit_code} and no cause in the log", ""), None)


def _rank(finding: Finding) -> tuple[int, bool, int]:
    """Priority, then the more specific message of a class (a fixed phase), then the earliest."""
    return finding.prio, finding.fixed_phase is not None, -finding.line_no


def _best(c: Collected, keep: Callable[[Finding], bool]) -> Finding | None:
    """The most specific live finding: highest priority, earliest on a tie.

    A finding seen before vLLM became ready did not stop it (a logged, survived error), except a
    port clash, which uvicorn reports after ``Application startup complete``.
    """
    best: Finding | None = None
    for finding in c.findings.values():
        if not keep(finding) or c.ready_after(finding.line_no) is not None:
            continue
        if best is None or _rank(finding) > _rank(best):
            best = finding
    return best


def _cut_traceback(c: Collected) -> Traceback | None:
    """A start-up traceback that never reached its exception line (a cut or truncated log)."""
    if c.ready or c.shutdown_line is not None:
        return None
    cut: Traceback | None = None
    for tb in c.open_tracebacks:
        if tb.request or not tb.last_frame:
            continue
        if cut is None or tb.start_line < cut.start_line:
            cut = tb
    return cut


def _phase_of(c: Collected, finding: Finding) -> tuple[str, bool]:
    """The phase of a finding, and whether only the milestones passed said it (no frame, no fixed phase)."""
    if finding.after_ready and finding.cls not in (PORT_IN_USE, MODEL_NOT_FOUND, FREE_MEM_BELOW_UTIL):
        return PHASE_SERVING, False
    if finding.fixed_phase is not None:
        return finding.fixed_phase, False
    if finding.request or c.serving_death_line is not None or c.served_at(finding):
        # logged by a request handler, the engine died in its serving loop, or requests were being served
        return PHASE_SERVING, False
    key = finding.frame_phase
    union = best_key(c.frame_phases)
    if union is not None and (key is None or (key in WEAK_PHASE and phase_rank(union) > phase_rank(key))):
        key = union  # the traceback of another process (a worker) shows the step that failed
    if key is not None:
        return WEAK_PHASE.get(key, key), False
    return phase_after(finding.reached), True


def _build(c: Collected, finding: Finding, cls: str) -> Failure:
    phase, from_milestones = _phase_of(c, finding)
    if cls.startswith(OOM):
        if from_milestones and phase in (PHASE_STARTUP, PHASE_LOAD_WEIGHTS) and finding.hint:
            phase = PHASE_PROFILE  # no frame names the step, but the traceback shows a forward pass
        elif phase == PHASE_STARTUP:
            phase = PHASE_LOAD_WEIGHTS  # no frame and no milestone: the first step that takes memory
        cls = OOM_BY_PHASE[phase]
    numbers = dict(c.observations)
    if cls in OOM_BY_PHASE.values():
        for other in c.findings.values():  # the torch message under vLLM's (sampler, weights)
            if other is not finding and other.cls.startswith(OOM):
                numbers.update(other.numbers)
    numbers.update(finding.numbers)
    detail = (finding.process or "main") + (f" pid {finding.pid}" if finding.pid is not None else "")
    detail += f", line {finding.line_no}"
    return Failure(cls, phase=phase, evidence=finding.text, numbers=Numbers.from_dict(numbers), detail=detail)


def _bare(c: Collected, cls: str, evidence: str, detail: str) -> Failure:
    phase = PHASE_SERVING if c.serving else (best_phase(c.frame_phases) or phase_after(c.reached))
    return Failure(
        cls, phase=phase, evidence=evidence, numbers=Numbers.from_dict(c.observations), detail=detail
    )


def _infer_v0_kv(c: Collected) -> Failure | None:
    """v0 prints ``# GPU blocks: N`` before it checks them: enough to explain a death without the line."""
    blocks = c.observations.get("gpu_blocks")
    if blocks is None or c.ready:
        return None
    numbers = Numbers.from_dict(c.observations)
    if blocks <= 0:
        return Failure(
            NO_KV_MEMORY,
            phase=PHASE_KV_CACHE,
            evidence="# GPU blocks: 0",
            numbers=numbers,
            detail="inferred from the block count: no room for the KV cache",
        )
    capacity = blocks * c.block_size
    max_len = c.observations.get("max_model_len")
    if max_len is None or capacity >= max_len:
        return None
    return Failure(
        KV_INSUFFICIENT,
        phase=PHASE_KV_CACHE,
        evidence=f"# GPU blocks: {int(blocks)} x {c.block_size} tokens = {int(capacity)} tokens "
        f"< max_model_len {int(max_len)}",
        numbers=replace(numbers, kv_capacity_tokens=int(capacity)),
        detail="inferred from the block count",
    )

"""The log reader: the composition of the parts, line by line, and the verdict on demand.

:class:`LogReader` reads vLLM's output (stdout and stderr merged) and keeps a bounded state per
process: the open traceback (:mod:`~r1sup.core.logparse.tracebacks`), the open message
(:mod:`~r1sup.core.logparse.joining`), the findings named by the message families
(:mod:`~r1sup.core.logparse.families`) and the success path's figures (:mod:`~r1sup.core.logparse.figures`);
:meth:`LogReader.verdict` hands what it collected to :func:`~r1sup.core.logparse.verdict.decide`.

Lines that vLLM logged at INFO/DEBUG/WARNING are *quiet*: they can only carry progress, never a
failure, so ``If out-of-memory error occurs ...`` is harmless. Other lines (ERROR, CRITICAL, raw
stderr) are matched against the families. Most lines of a log change nothing:
:meth:`LogReader.feed_chunks` and :meth:`LogReader.feed_lines` read the commonest ones (quiet records,
Python warnings and the source lines under them, progress bars, short raw lines holding no word the
reader looks for) in one loop, and only the others through the full path; tests check that both read
every fixture and collected excerpt alike.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace

from r1sup.core.failure import (
    CONFIG_ERROR,
    CUDA_ERROR,
    ENGINE_DEAD,
    HANG,
    HOST_OOM,
    MODEL_NOT_FOUND,
    Failure,
    phase_after,
)
from r1sup.core.figures import Figures
from r1sup.core.logparse.events import EVENT_MARK, launched_flags, parse_event, relayed_line
from r1sup.core.logparse.families import (
    BENIGN_RE,
    CONFIG_DUMP_RE,
    EXC_HEADER_RE,
    NOT_A_CAUSE,
    OOM,
    P_DEAD,
    SERVING_DEATH_RE,
    gate,
    match_families,
)
from r1sup.core.logparse.figures import FigureCollector, Progress
from r1sup.core.logparse.heads import (
    ACCESS_GROUP,
    COLLAPSED_ALERT_RE,
    COLLAPSED_LONG,
    DEFAULT_MAX_LINE_CHARS,
    EVIDENCE_CHARS,
    KW_GROUP,
    QUIET_INITIALS,
    QUIET_LAST,
    RAW_PROGRESS_RE,
    STAMP_RE,
    STAMP_WINDOW,
    STAMPED,
    UNSTAMPED,
    LogLine,
    fast_line,
    kind_of,
    line_batches,
    message,
    parse_line,
    segments,
    serving_stamp_re,
)
from r1sup.core.logparse.joining import JOIN_CHARS, PENDING_WINDOW, WRAP_MIN_WIDTH, Pending, continues, extend
from r1sup.core.logparse.origin import (
    FOREIGN_SERVER,
    SCRIPT,
    foreign_frame,
    foreign_line,
    vllm_frame,
    vllm_message,
    vllm_process,
    vllm_stamp,
    vllm_stamp_in,
)
from r1sup.core.logparse.phase import ACCESS_MARK, FAILED_STEP_PREFIX, STALL_PREFIX, TRAFFIC_TAILS, traffic
from r1sup.core.logparse.tracebacks import (
    FRAME_RE,
    HINT_RE,
    INLINE_FRAME_RE,
    PHASE_RANK,
    Traceback,
    best_key,
    method_phase,
    phase_rank,
)
from r1sup.core.logparse.triage import BAR_RE, BORING_MEMO, GLOG_QUIET_RE, PYWARN_RE, boring_text
from r1sup.core.logparse.verdict import Collected, Diagnosis, Finding, decide

_DRIVER_RE = re.compile(r"cudaDriverVersion (?P<cuda_driver_version>\d+)")  # NCCL's INFO record
_REPEATED_COUNT_RE = re.compile(r"\[repeated (?P<repeated_across_cluster>\d+)x across cluster\]")
COLLAPSED_TAIL = 20  # text after a frame's function name beyond this: more records on the same line
_BATCH_LINES = 4096  # lines LogReader.feed_lines gathers before reading them in one loop
MAX_PROCESSES = 256  # per-process states kept (oldest dropped)


@dataclass
class _Proc:
    """The state of one process of the engine (its lines carry its tag; untagged lines share one)."""

    tb: Traceback | None = None
    pending: Pending | None = None
    method_phase: str | None = None  # from "Error executing method X", for the traceback that follows
    warning_line: int = -1  # the line of its last Python warning (the warning's source line follows it)


# What named the cause (LogReader._cause_named): errors any PyTorch program prints, which a traceback
# through a script and never through vLLM leaves to that script; vLLM's own messages
_GENERIC_CAUSE = 1
_OWN_CAUSE = 2
GENERIC = frozenset({CUDA_ERROR, HOST_OOM, HANG})

_NO_PROCESS: tuple[str | None, int | None] = (None, None)  # the key of lines without a process tag
_NO_PROCESS_LINE = LogLine(text="")


class LogReader:
    """Streaming reader of vLLM output (stdout and stderr merged): relay lines, progress, verdict.

    State is bounded whatever the input: one finding per class, the first unexplained exception,
    per-process traceback frames (at most ``MAX_PROCESSES`` processes) and the numbers seen.
    """

    def __init__(self, max_line_chars: int = DEFAULT_MAX_LINE_CHARS) -> None:
        if max_line_chars < 256:
            raise ValueError("max_line_chars must be at least 256")
        self._max = max_line_chars
        self._line_no = 0
        self._recognised = False  # a line was recognised as vLLM's (logparse.origin)
        self._vllm_frame = False  # a traceback frame was in vLLM's package
        # an exception line or ERROR record named a cause (vLLM's, unless ...): _GENERIC_CAUSE for the
        # errors every PyTorch program prints (out of memory, CUDA, NCCL, Gloo), _OWN_CAUSE for the others
        self._cause_named = 0
        self._foreign = False  # ... another server's code or log printed it (logparse.origin)
        self._script = False  # a frame was in a script outside any installed package
        self._in_event = False  # reading a line relayed in r1sup's own event log
        self._start_launch()

    def _start_launch(self) -> None:
        """The state of one launch's log (all of it but the line count and whether vLLM was seen)."""
        self._procs: dict[tuple[str | None, int | None], _Proc] = {}
        self._pending_count = 0  # open messages, speculative ones included
        self._spec_count = 0  # of which speculative
        self._spec_line = 0  # the last line a speculative message was opened or continued on
        self._findings: dict[str, Finding] = {}
        self._unknown: Finding | None = None
        self._all_phases: dict[str, int] = {}  # the phases of every traceback's frames
        self._figures = FigureCollector()
        self._marked_ready_line: int | None = None
        self._last_pending: tuple[_Proc, int, int] | None = None  # (process, line, its width)
        self._serving_death_line: int | None = None
        self._boring: dict[str, bool] = {}  # short unstamped lines read: whether boring_text holds
        # a hard-wrapped "File ..." line: (process, line, text so far, wrap width)
        self._partial_frame: tuple[_Proc, int, str, int] | None = None

    # -- public API ---------------------------------------------------------------------------

    def feed(self, raw_line: str) -> list[LogLine | Progress]:
        """Read one raw line (it may hold carriage returns); return its relay line and any progress."""
        self._line_no += 1
        if len(raw_line) > self._max:
            raw_line = raw_line[: self._max]
        events: list[LogLine | Progress] = []
        last = LogLine(text="")
        for seg in segments(raw_line):
            last = parse_line(seg)
            self._handle(seg, last, events)
        events.insert(0, last)
        return events

    def feed_lines(self, raw_lines: Iterable[str]) -> None:
        """Read many lines without building relay values (``diagnose`` and replays use this).

        The state changes are those of :meth:`feed` on each line.
        """
        batch: list[str] = []
        for raw in raw_lines:
            if "\r" in raw or "\x1b" in raw or "\x00" in raw or raw.endswith("\n") or len(raw) > self._max:
                if batch:
                    self._feed_plain(batch)
                    batch = []
                self._line_no += 1
                for seg in segments(raw[: self._max]):
                    self._handle(seg, None, None)
                continue
            batch.append(raw)
            if len(batch) >= _BATCH_LINES:
                self._feed_plain(batch)
                batch = []
        if batch:
            self._feed_plain(batch)

    def feed_chunks(self, chunks: Iterable[bytes]) -> None:
        """Read a byte stream in chunks (invalid UTF-8 replaced), as :meth:`feed_lines` reads its lines."""
        for lines, plain in line_batches(chunks, self._max):
            if plain:
                self._feed_plain(lines)
            else:
                self.feed_lines(lines)

    def _feed_plain(self, raw_lines: list[str]) -> None:
        """:meth:`feed_lines` of lines without a carriage return, an escape, a NUL or a newline, none
        longer than the line limit.

        The loop reads the commonest lines itself, as ``_handle`` would: a quiet (INFO/DEBUG/WARNING)
        vLLM line that no progress pattern matches changes nothing; a Python warning, the source line
        printed under it and a short unstamped line holding no word the reader looks for change only the
        entry of unprefixed lines (the tests in ``_handle``, repeated here to spare a call per line).
        """
        watching = STAMP_RE.search
        window = STAMP_WINDOW
        quiet_last = QUIET_LAST
        kw_group = KW_GROUP
        traffic_tails = TRAFFIC_TAILS
        access_group = ACCESS_GROUP
        figures = self._figures
        quiet_initials = QUIET_INITIALS
        progress = self._progress
        pywarn = PYWARN_RE.match
        seen = self._boring.get
        procs = self._procs
        handle = self._handle
        first = self._line_no + 1
        n = first - 1
        known = self._recognised  # a line was vLLM's own (the stamp test is made until one is)
        watch = figures.traffic_line is None  # the run's request traffic is not seen yet
        # (the traffic keywords matter until a run's first traffic)
        stamp = watching if watch else serving_stamp_re().search
        for n, raw in enumerate(raw_lines, first):
            m = stamp(raw, 0, window)
            if m is not None:
                last = m.lastindex
                if last <= quiet_last:  # type: ignore[operator]
                    if len(raw) <= COLLAPSED_LONG:
                        if not known:
                            known = vllm_stamp(m)
                        continue
                elif last == kw_group and raw[m.start()] in quiet_initials and len(raw) <= COLLAPSED_LONG:
                    kw = m.group("kw")
                    if not known:
                        known = vllm_stamp(m)
                    if kw[-4:] in traffic_tails and not watch:
                        continue  # only the first traffic line of a run changes anything
                    self._line_no = n
                    progress(message(raw, m.start("kw")), None, kw)
                    watch = figures.traffic_line is None  # (a new start-up resets the run's traffic)
                    stamp = watching if watch else serving_stamp_re().search
                    continue
                elif last == access_group and raw[m.start()] in quiet_initials and len(raw) <= COLLAPSED_LONG:
                    if watch:  # uvicorn's access log of a request: the run's first traffic
                        figures.saw_traffic(raw, n)
                        watch = figures.traffic_line is None
                        stamp = watching if watch else serving_stamp_re().search
                    continue
            elif "Warning: " in raw and pywarn(raw) is not None:
                np = procs.get(_NO_PROCESS)
                if np is None:
                    np = self._proc(_NO_PROCESS_LINE)
                np.warning_line = n
                continue
            elif raw[:2] == "  " and (np := procs.get(_NO_PROCESS)) is not None and np.warning_line == n - 1:
                if raw[2:3].strip():  # the source line Python prints under a warning
                    continue
            elif (
                len(raw) < WRAP_MIN_WIDTH
                and self._pending_count == self._spec_count
                and self._spec_line != n - 1
                and self._partial_frame is None
                and ((boring := seen(raw)) or (boring is None and self._learn_boring(raw)))
                and ((np := procs.get(_NO_PROCESS)) is None or np.tb is None)
            ):
                if np is None:
                    self._proc(_NO_PROCESS_LINE)
                elif np.pending is not None:
                    self._drop_pending(np)
                continue
            self._line_no = n
            handle(raw, None, None, m)
            known = known or self._recognised
            watch = figures.traffic_line is None
            stamp = watching if watch else serving_stamp_re().search
        self._line_no = n
        if known:
            self._recognised = True

    def mark_ready(self) -> None:
        """The supervisor saw readiness (health 200 and the model listed): later failures are serving."""
        if self._marked_ready_line is None:
            self._marked_ready_line = self._line_no
            self._forget_survived()

    def _forget_survived(self) -> None:
        """vLLM became ready: what it logged before did not stop it, and frees the slot of its class."""
        self._findings = {cls: f for cls, f in self._findings.items() if f.line_no >= self._line_no}
        if self._unknown is not None and self._unknown.line_no < self._line_no:
            self._unknown = None

    @property
    def ready_seen(self) -> bool:
        """vLLM printed ``Application startup complete.`` (or uvicorn's running line)."""
        return self._figures.ready_line is not None

    @property
    def figures(self) -> Figures:
        """The success path's figures gathered so far (weights, KV cache, the memory breakdown ...)."""
        return Figures.from_dict(self._figures.obs)

    @property
    def startup_phase(self) -> str:
        """The phase the start-up is in after the milestones its log passed (``r1sup.core.failure``'s order):
        where a hang without a traceback is."""
        return phase_after(self._figures.reached)

    @property
    def engine_version(self) -> str | None:
        """The vLLM version the log printed ("Initializing a V1 LLM engine (v0.19.0)")."""
        return self._figures.engine_version

    @property
    def engine_device(self) -> str | None:
        """``cuda`` or ``cpu`` as the engine's config line printed it (None: not seen)."""
        return self._figures.engine_device

    @property
    def block_size(self) -> int:
        """The KV block size in tokens the engine's config line printed (vLLM's default when not seen)."""
        return self._figures.block_size

    @property
    def engine_args(self) -> dict[str, object]:
        """The arguments vLLM printed as "non-default args: {...}" (plain literals only), over the memory
        flags of its config line; a launch's flags where r1sup's own event log is read. {} if none."""
        return self._figures.arguments()

    def collected(self) -> Collected:
        """What the reader gathered so far, as :func:`~r1sup.core.logparse.verdict.decide` takes it: a copy
        that later lines leave as it is."""
        figures = self._figures
        snapshot = Collected(
            findings=self._findings,
            unknown=self._unknown,
            frame_phases=self._all_phases,
            observations=figures.obs,
            open_tracebacks=[proc.tb for proc in self._procs.values() if proc.tb is not None],
            reached=figures.reached,
            ready_line=figures.ready_line,
            ready_text=figures.ready_text,
            marked_ready_line=self._marked_ready_line,
            shutdown_line=figures.shutdown_line,
            serving_death_line=self._serving_death_line,
            blocks_line=figures.blocks_line,
            block_size=figures.block_size,
            traffic_line=figures.traffic_line,
        )
        return copy.deepcopy(snapshot)

    def verdict(self, exit_code: int | None = None) -> Failure:
        """The failure class (or ``none``), phase, evidence and numbers. Callable mid-stream."""
        return decide(self.collected(), exit_code).failure

    def diagnose(self, exit_code: int | None = None) -> Diagnosis:
        """The verdict with the line of its evidence and whether the input was vLLM output at all."""
        decision = decide(self.collected(), exit_code)
        return Diagnosis(
            failure=decision.failure,
            line=decision.line,
            vllm_log=self._vllm_output(),
            lines=self._line_no,
        )

    def _vllm_output(self) -> bool:
        """Whether the input was vLLM's output (logparse.origin): one of vLLM's formats or messages; a frame
        in its package unless another server's code printed the traceback; an exception line naming a cause
        unless another server printed it or the traceback runs through a script and never through vLLM (a
        training script's ``torch.OutOfMemoryError``)."""
        if self._recognised or self._figures.matched:
            return True
        if self._foreign:
            return False
        if self._vllm_frame or self._cause_named == _OWN_CAUSE:
            return True
        return self._cause_named == _GENERIC_CAUSE and not self._script

    # -- line handling ------------------------------------------------------------------------

    def _is_ready(self) -> bool:
        return self._figures.ready_line is not None or self._marked_ready_line is not None

    def _progress(self, text: str, events: list[LogLine | Progress] | None, kw: str) -> None:
        """A message starting with the progress keyword ``kw``: its figures (and readiness)."""
        if kw[0] == "F" and kw.startswith(FAILED_STEP_PREFIX):
            self._failed_step(text)
        elif kw[0] == "N" and kw.startswith(STALL_PREFIX):
            self._stalled(text)
        elif self._figures.read(text, events, kw, self._line_no):
            self._forget_survived()

    def _failed_step(self, text: str) -> None:
        """vLLM's WARNING "Failed to pickle inputs of failed execution: <error>": a model step failed while
        serving, and the error it names is a cause like an exception line's (a quiet level, not a quiet
        message)."""
        self._figures.saw_traffic(text, self._line_no)
        cause = text[len(FAILED_STEP_PREFIX) :].lstrip(": ")
        fam = match_families(cause) if gate(cause) else None
        if fam is None:
            return
        cls, prio, fixed, numbers = fam
        self._record(self._new_finding(cls, prio, fixed, cause, numbers, _NO_PROCESS_LINE, None, True))

    def _stalled(self, text: str) -> None:
        """vLLM's message queue found no free block for a minute (logged at INFO or WARNING): its readers are
        stuck. A hang unless the log goes on to readiness or names another cause."""
        fam = match_families(text)
        if fam is None or fam[0] != HANG or HANG in self._findings:
            return
        cls, prio, fixed, numbers = fam
        self._record(self._new_finding(cls, prio, fixed, text, numbers, _NO_PROCESS_LINE, None, True))

    def _handle(
        self,
        seg: str,
        line: LogLine | None,
        events: list[LogLine | Progress] | None,
        stamp: re.Match[str] | None | bool = False,
    ) -> None:
        """One line (a segment of one) with its stamp search, when the caller already made it."""
        if EVENT_MARK in seg and not self._in_event and self._event(seg, events):
            return
        m = STAMP_RE.search(seg, 0, STAMP_WINDOW) if stamp is False else stamp
        kind, kw = kind_of(m if isinstance(m, re.Match) else None)
        if kind != UNSTAMPED:
            if not self._recognised:
                assert isinstance(m, re.Match)
                self._recognised = vllm_stamp(m)
            if kind != STAMPED and (
                len(seg) <= COLLAPSED_LONG
                or (("ERROR" not in seg and "Traceback" not in seg) or COLLAPSED_ALERT_RE.search(seg) is None)
            ):  # a long quiet line may hold more records pasted onto it: an error after the quiet first
                if kw is not None:
                    assert isinstance(m, re.Match)
                    self._progress(message(seg, m.start("kw")), events, kw)
                elif ACCESS_MARK in seg and self._figures.traffic_line is None:
                    self._figures.saw_traffic(seg, self._line_no)  # uvicorn's access log
                return
        elif "Warning: " in seg and PYWARN_RE.match(seg) is not None:
            # a Python warning: never the failure, whatever words it holds (the entry of unprefixed
            # lines made as the full path makes it)
            warned = self._procs.get(_NO_PROCESS) or self._proc(_NO_PROCESS_LINE)
            warned.warning_line = self._line_no
            return
        elif (
            seg[:2] == "  "
            and seg[2:3].strip()
            and (unprefixed := self._procs.get(_NO_PROCESS)) is not None
            and unprefixed.warning_line == self._line_no - 1
        ):
            return  # the source line Python prints under a warning, indented by two spaces: the warning's
        elif " NCCL INFO " in seg or (seg[:1] in "[IW" and GLOG_QUIET_RE.match(seg) is not None):
            if "cudaDriverVersion " in seg and (dm := _DRIVER_RE.search(seg)) is not None:
                self._figures.obs["cuda_driver_version"] = int(dm.group("cuda_driver_version"))
            return  # torch's own INFO/WARNING records and NCCL's: as quiet as vLLM's
        elif "%" in seg and len(seg) <= COLLAPSED_LONG and BAR_RE.match(seg) is not None:
            self._bar(seg, events)
            return
        elif (
            self._pending_count == self._spec_count
            and self._spec_line != self._line_no - 1
            and self._partial_frame is None
            and ((np := self._procs.get(_NO_PROCESS)) is None or np.tb is None)
            and boring_text(seg)
        ):
            # nothing the reader looks for, and no open message or traceback the line could continue:
            # it changes only what the full path would (see _boring_line)
            self._boring_line(seg, line, np)
            return
        if line is None:
            if kind == STAMPED:
                assert isinstance(m, re.Match)
                line = fast_line(seg, m.start())
            if line is None:
                line = parse_line(seg)
        self._full_line(seg, line, events)

    def _full_line(self, seg: str, line: LogLine, events: list[LogLine | Progress] | None) -> None:
        """A line that may matter: its process's open message and traceback, its frames, its cause."""
        if not self._recognised:
            self._recognised = vllm_process(line.process) or (line.level is not None and vllm_stamp_in(seg))
            if not self._foreign and foreign_line(seg):
                self._foreign = True
        text = line.text
        stripped = text.lstrip()
        if self._figures.traffic_line is None and traffic(text):
            self._figures.traffic_line = self._line_no
        if "cudaDriverVersion " in seg and (dm := _DRIVER_RE.search(seg)) is not None:
            # NCCL's INFO record inside a line pasted collapsed
            self._figures.obs["cuda_driver_version"] = int(dm.group("cuda_driver_version"))
        if "across cluster]" in seg and (rm := _REPEATED_COUNT_RE.search(seg)) is not None:
            # Ray folded the same line of other workers into this one: how many printed it
            count = int(rm.group("repeated_across_cluster"))
            obs = self._figures.obs
            obs["repeated_across_cluster"] = max(count, int(obs.get("repeated_across_cluster", 0)))
        if line.level is None:
            pm = RAW_PROGRESS_RE.match(text)
            if pm is not None:  # progress bars and v0's multi-line summaries come unstamped
                self._progress(text, events, pm.group("kw"))
        proc = self._proc(line)
        if "Warning: " in stripped and PYWARN_RE.match(stripped) is not None:
            proc.warning_line = self._line_no
            return  # a Python warning: never the failure, whatever words it holds
        if proc.warning_line == self._line_no - 1 and text[:2] == "  " and text[2:3].strip():
            return  # the warning's source line
        if self._pending_count:
            self._expire_pending()
        if self._partial_frame is not None and self._wrapped_frame(proc, stripped, line, len(seg)):
            return
        if self._continued(proc, stripped, line, len(seg)):
            return
        if not stripped:
            return
        first = stripped[0]
        collapsed = False  # a whole traceback on one line (pasted with its newlines turned to spaces)
        if first == "F" and stripped.startswith("File"):
            fm = FRAME_RE.match(stripped)
            if fm is not None:
                self._frame(proc, fm.group("func"), fm.group("file") or "", stripped, line)
                if len(stripped) - fm.end() <= COLLAPSED_TAIL:
                    return
                collapsed = True
            elif len(seg) >= WRAP_MIN_WIDTH:
                self._partial_frame = (proc, self._line_no, stripped[:JOIN_CHARS], len(seg))
                return
        elif ('File "' in stripped or ".py:" in stripped) and (
            fm := INLINE_FRAME_RE.search(stripped)
        ) is not None:
            # a frame behind another prefix, or pytest's and rich's form: the rest of the line tells
            # whether it is only a frame or records pasted together
            self._frame(
                proc,
                fm.group("func") or fm.group("pfunc"),
                fm.group("file") or fm.group("pfile"),
                stripped,
                line,
            )
            if len(stripped) - fm.end() <= COLLAPSED_TAIL:
                return
            collapsed = True
        elif first == "T" and stripped.startswith(("Traceback", "The above exception")):
            if stripped[1] == "r":
                fresh = Traceback(
                    self._line_no, last_frame=stripped[:300], process=line.process, pid=line.pid
                )
                if proc.method_phase is not None:
                    fresh.phases[proc.method_phase] = PHASE_RANK[proc.method_phase]
                    proc.method_phase = None
                proc.tb = fresh
            if len(stripped) <= COLLAPSED_TAIL + 35:
                return
            collapsed = True
        if collapsed or len(stripped) > COLLAPSED_LONG:
            self._inline_frames(proc, stripped, line)
        elif first == "D" and stripped.startswith("During handling of the above"):
            return
        header = EXC_HEADER_RE.match(stripped) if first.isalpha() else None
        if (
            header is None
            and not collapsed
            and len(text) - len(stripped) >= 4
            and len(stripped) <= COLLAPSED_LONG
            and not stripped.startswith(("raise ", "assert "))
        ):
            # a source line of a traceback: it may show a forward pass or the call of the next frame
            if proc.tb is not None:
                proc.tb.source_line(text, self._all_phases)
            elif text.startswith("    ") and HINT_RE.search(text) is not None:
                proc.tb = Traceback(
                    self._line_no, hint=True, process=line.process, pid=line.pid
                )  # header cut off
            return
        self._cause(seg, line, proc, header)

    def _cause(self, seg: str, line: LogLine, proc: _Proc, header: re.Match[str] | None) -> None:
        """A message line (an exception line, or one a family may match): what failure it names."""
        text = line.text
        stripped = text.lstrip()
        gated = gate(text)
        if (gated or header is not None) and BENIGN_RE.search(text) is not None:
            if proc.tb is not None:
                proc.tb.request = True  # a per-request error: the server stays up
            return
        if "[serving" in seg[:400]:  # logged by an OpenAI request handler (serving_chat.py ...)
            if proc.tb is None:
                proc.tb = Traceback(self._line_no, request=True, process=line.process, pid=line.pid)
            else:
                proc.tb.request = True
        fam = match_families(text) if gated else None
        if not self._recognised:
            # vLLM's own message; or the exception line (or ERROR record) that ends one of its failures and
            # names a cause (not a death notice alone, not a keyword in prose), which counts unless another
            # program printed it (_vllm_output)
            self._recognised = vllm_message(stripped)
            if (
                self._cause_named != _OWN_CAUSE
                and fam is not None
                and fam[1] > P_DEAD
                and (
                    header is not None or line.level in ("ERROR", "CRITICAL") or stripped.startswith("Fatal ")
                )
            ):
                generic = fam[0].startswith(OOM) or fam[0] in GENERIC
                self._cause_named = _GENERIC_CAUSE if generic else _OWN_CAUSE
        if fam is not None and fam[0] == CONFIG_ERROR and CONFIG_DUMP_RE.search(text) is not None:
            fam = None  # the engine's configuration printed without its stamp: trust_remote_code=True ...
        if "ing method" in text:  # "Error executing method X", "... while processing method X"
            phase = method_phase(text)
            if phase is not None:
                proc.method_phase = phase
                self._all_phases[phase] = PHASE_RANK[phase]
        if fam is None and header is None:
            if len(seg) >= WRAP_MIN_WIDTH:
                # a long message line: a terminal may have wrapped it, the next piece completes it
                self._open_pending(proc, None, stripped, None, 0, len(seg), speculative=True)
            return
        if (
            fam is not None
            and fam[0] == ENGINE_DEAD
            and self._serving_death_line is None
            and SERVING_DEATH_RE.search(text) is not None
        ):
            self._serving_death_line = self._line_no
        tb = proc.tb
        finding: Finding | None = None
        if fam is not None:
            cls, prio, fixed, numbers = fam
            finding = self._new_finding(cls, prio, fixed, stripped, numbers, line, tb, header is not None)
            self._record(finding)
        elif header is not None:
            name = header.group("name")
            if name == "KeyboardInterrupt" and self._figures.shutdown_line is None:
                self._figures.shutdown_line = self._line_no  # stopped from the terminal
            if (
                self._unknown is None
                and name not in NOT_A_CAUSE
                and not (tb is not None and tb.request)
                and self._figures.shutdown_line is None
            ):
                self._unknown = self._new_finding(name, 0, None, stripped, {}, line, tb, True)
        if header is not None:
            proc.tb = None  # the exception line ends its traceback
        self._open_pending(proc, finding, stripped, tb, len(text) - len(stripped), len(seg))

    def _event(self, seg: str, events: list[LogLine | Progress] | None) -> bool:
        """A line of r1sup's own JSON event log (logparse.events); False when the line is not one.

        A launch's start begins a new verdict, with the launch's flags as the engine's arguments; a
        relayed vLLM line is read as vLLM printed it; r1sup's other events change nothing.
        """
        event = parse_event(seg)
        if event is None:
            return False
        flags = launched_flags(event)
        if flags is not None:
            self._start_launch()
            self._figures.engine_args = flags
            return True
        relayed = relayed_line(event)
        if relayed is not None:
            self._recognised = True
            self._in_event = True
            try:
                self._handle(relayed, None, events)
            finally:
                self._in_event = False
        return True

    def _learn_boring(self, text: str) -> bool:
        """:func:`boring_text`, remembered by the text: tools print the same raw lines over and over (once
        per process, rank or restart), and the test costs several times a search for the stamp. At most
        ``BORING_MEMO`` texts are kept."""
        boring = boring_text(text)
        if len(self._boring) >= BORING_MEMO:
            self._boring.clear()
        self._boring[text] = boring
        return boring

    def _bar(self, seg: str, events: list[LogLine | Progress] | None) -> None:
        """A progress bar: a milestone when its description names one. No message goes on in a bar (a
        terminal does not wrap into one) and none starts in it: the open one of its process ends."""
        pm = RAW_PROGRESS_RE.match(seg)
        if pm is not None:  # the bar alone on its line
            proc = self._procs.get(_NO_PROCESS) or self._proc(_NO_PROCESS_LINE)
            text = message(seg, 0)
        else:  # behind a process tag or another wrapper
            line = parse_line(seg)
            if not self._recognised:
                self._recognised = vllm_process(line.process)
            proc = self._proc(line)
            text = line.text
            pm = RAW_PROGRESS_RE.match(text)
        if self._pending_count:
            self._expire_pending()
        self._partial_frame = None
        self._drop_pending(proc)
        if pm is not None:
            self._progress(text, events, pm.group("kw"))

    def _boring_line(self, seg: str, line: LogLine | None, proc: _Proc | None) -> None:
        """What the full path does with an unprefixed line holding no word the reader looks for.

        It makes the entry of unprefixed lines and ends their stale speculative message; a long one
        (not a source line) opens the speculative message a terminal's wrap may continue.
        """
        if len(seg) < WRAP_MIN_WIDTH:
            if proc is None:
                self._proc(_NO_PROCESS_LINE)
            elif proc.pending is not None:
                self._drop_pending(proc)
            return
        if line is None:
            line = parse_line(seg)
        text = line.text
        stripped = text.lstrip()
        proc = self._proc(line)
        if "Warning: " in stripped and PYWARN_RE.match(stripped) is not None:
            proc.warning_line = self._line_no
            return
        if proc.pending is not None:
            self._drop_pending(proc)
        if not stripped:
            return
        if (
            len(text) - len(stripped) >= 4
            and len(stripped) <= COLLAPSED_LONG
            and not stripped.startswith(("raise ", "assert "))
        ):
            if text.startswith("    ") and HINT_RE.search(text) is not None:
                proc.tb = Traceback(self._line_no, hint=True, process=line.process, pid=line.pid)
            return
        self._open_pending(proc, None, stripped, None, 0, len(seg), speculative=True)

    def _open_pending(
        self,
        proc: _Proc,
        finding: Finding | None,
        stripped: str,
        tb: Traceback | None,
        indent: int,
        width: int,
        speculative: bool = False,
    ) -> None:
        if proc.pending is not None:
            self._drop_pending(proc)
        self._pending_count += 1
        proc.pending = Pending(
            finding,
            stripped,
            stripped,
            0,
            self._line_no,
            tb,
            indent,
            speculative=speculative,
            last_line=self._line_no,
        )
        if speculative:
            self._spec_count += 1
            self._spec_line = self._line_no
        self._last_pending = (proc, self._line_no, width)

    def _drop_pending(self, proc: _Proc) -> None:
        pending = proc.pending
        if pending is None:
            return
        proc.pending = None
        self._pending_count -= 1
        if pending.speculative:
            self._spec_count -= 1

    def _inline_frames(self, proc: _Proc, stripped: str, line: LogLine) -> None:
        """Frames inside one long line (a collapsed paste) still tell the phase."""
        if 'File "' not in stripped and ".py:" not in stripped:
            return
        for fm in INLINE_FRAME_RE.finditer(stripped):
            if proc.tb is None:
                proc.tb = Traceback(self._line_no, process=line.process, pid=line.pid)
            self._frame(
                proc,
                fm.group("func") or fm.group("pfunc"),
                fm.group("file") or fm.group("pfile"),
                fm.group(0),
                line,
            )

    def _wrapped_frame(self, proc: _Proc, stripped: str, line: LogLine, width: int) -> bool:
        """Rejoin a frame line that a terminal hard-wrapped; True when this line was a piece of it."""
        assert self._partial_frame is not None
        owner, at, head, wrap_width = self._partial_frame
        self._partial_frame = None
        if at != self._line_no - 1 or not (line.process is None or owner is proc) or not stripped:
            return False
        joined = head + stripped
        if width == wrap_width and line.process is None and line.level is None and len(joined) < JOIN_CHARS:
            self._partial_frame = (owner, self._line_no, joined, wrap_width)  # full width: the line goes on
            return True
        fm = FRAME_RE.match(joined)
        if fm is None:
            return False
        self._frame(owner, fm.group("func"), fm.group("file") or "", joined, line)
        return True

    def _continued(self, proc: _Proc, stripped: str, line: LogLine, width: int) -> bool:
        """Join the line to an open exception message when it continues one (multi-line or wrapped)."""
        if line.process is None and line.level is None and self._last_pending is not None:
            # a hard-wrapped piece of the previous (full-width) line carries no prefix: it continues it
            owner, at, prev_width = self._last_pending
            if (
                at == self._line_no - 1
                and prev_width >= WRAP_MIN_WIDTH
                and owner.pending is not None
                and continues(line.text, stripped, owner.pending, wrapped=True)
            ):
                owner.pending.wrapped = True
                self._extend(owner.pending, stripped, line)
                self._last_pending = (owner, self._line_no, width)
                return True
        pending = proc.pending
        if pending is None:
            return False
        if (not pending.speculative or pending.last_line == self._line_no - 1) and continues(
            line.text, stripped, pending
        ):
            self._extend(pending, stripped, line)
            self._last_pending = (proc, self._line_no, width)
            return True
        self._drop_pending(proc)
        return False

    def _proc(self, line: LogLine) -> _Proc:
        key = (line.process, line.pid)
        proc = self._procs.get(key)
        if proc is None:
            if len(self._procs) >= MAX_PROCESSES:
                self._drop_pending(self._procs.pop(next(iter(self._procs))))
            proc = self._procs[key] = _Proc()
        return proc

    def _frame(self, proc: _Proc, func: str, file: str, text: str, line: LogLine) -> None:
        if vllm_frame(file):
            self._vllm_frame = True
        elif not self._foreign:
            origin = foreign_frame(file)
            if origin == FOREIGN_SERVER:
                self._foreign = True
            elif origin == SCRIPT:
                self._script = True
        if proc.tb is None:
            proc.tb = Traceback(self._line_no, process=line.process, pid=line.pid)  # header cut off
        proc.tb.frame(func, file, text, self._all_phases)

    def _extend(self, pending: Pending, stripped: str, line: LogLine) -> None:
        """Join a line to an open message; record the finding when the joined text names its cause."""
        if pending.speculative:
            self._spec_line = self._line_no
        more = extend(pending, stripped, self._line_no)
        if more is None:
            return
        (cls, prio, fixed, numbers), joined = more
        old = pending.finding
        if old is not None and self._findings.get(old.cls) is old:
            del self._findings[old.cls]
        if old is None:
            finding = self._new_finding(cls, prio, fixed, joined, numbers, line, pending.tb, True)
            finding.line_no = pending.opened_at
        else:
            finding = replace(
                old, cls=cls, prio=prio, fixed_phase=fixed, text=joined[:EVIDENCE_CHARS], numbers=numbers
            )
        pending.finding = finding
        if pending.speculative:  # a cause showed in the joined text: a message like any other now
            pending.speculative = False
            self._spec_count -= 1
        self._record(finding)

    def _expire_pending(self) -> None:
        for proc in self._procs.values():
            p = proc.pending
            if p is not None and self._line_no - p.opened_at > PENDING_WINDOW:
                self._drop_pending(proc)

    def _new_finding(
        self,
        cls: str,
        prio: int,
        fixed: str | None,
        text: str,
        numbers: dict[str, float],
        line: LogLine,
        tb: Traceback | None,
        header: bool,
    ) -> Finding:
        return Finding(
            cls=cls,
            prio=prio,
            fixed_phase=fixed,
            text=text[:EVIDENCE_CHARS],
            numbers=numbers,
            line_no=self._line_no,
            process=line.process,
            pid=line.pid,
            frame_phase=best_key(tb.phases) if tb is not None else None,
            hint=tb.hint if tb is not None else False,
            request=tb.request if tb is not None else False,
            after_ready=self._is_ready(),
            after_shutdown=self._figures.shutdown_line is not None,
            reached=self._figures.reached,
            header=header,
        )

    def _record(self, finding: Finding) -> None:
        if finding.request and finding.cls in (CONFIG_ERROR, MODEL_NOT_FOUND):
            return  # a per-request error: the server stays up
        current = self._findings.get(finding.cls)
        if current is None:
            self._findings[finding.cls] = finding
            return
        if finding.header and not current.header and finding.line_no - current.line_no <= 50:
            # the exception line itself beats the raise statement shown just above it
            finding.line_no = current.line_no
            self._findings[finding.cls] = finding
            finding, current = current, finding
        if phase_rank(finding.frame_phase) > phase_rank(current.frame_phase):
            # the same failure reported by another process, whose traceback shows the deeper step
            current.frame_phase = finding.frame_phase


def diagnose_text(lines: Iterable[str], exit_code: int | None = None) -> tuple[Failure, Figures]:
    """Read a whole log and return the verdict and the success path's figures."""
    reader = LogReader()
    reader.feed_lines(lines)
    return reader.verdict(exit_code), reader.figures

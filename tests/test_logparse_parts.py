"""The log reader's parts on their own: heads, figures, families, tracebacks, joining, and the pure
``decide()`` (plain data in, verdict out); and the one order of start-up milestones."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator

import pytest

from r1sup.core import failure as fl
from r1sup.core.logparse import (
    Collected,
    Finding,
    LogLine,
    LogReader,
    Progress,
    decide,
    families,
    figures,
    heads,
    joining,
    reader,
    tracebacks,
    triage,
    verdict,
)
from r1sup.core.logparse.tracebacks import Traceback

STAMP = "INFO 03-18 09:12:40 [gpu_model_runner.py:1110] "

# --------------------------------------------------------------------------------------------
# Named groups everywhere


def _patterns() -> Iterator[tuple[str, re.Pattern[str]]]:
    for module in (heads, triage, figures, families, tracebacks, joining, verdict, reader):
        for name, value in vars(module).items():
            if isinstance(value, re.Pattern):
                yield f"{module.__name__}.{name}", value
    for kind, _, rx in figures.PROGRESS_RULES:
        yield f"progress rule {kind}", rx
    for cls, _, _, rx in families._FAMILIES:
        yield f"family {cls}", rx


def test_every_capturing_group_of_the_reader_has_a_name() -> None:
    patterns = list(_patterns())
    assert len(patterns) > 60
    unnamed = [name for name, rx in patterns if rx.groups != len(rx.groupindex)]
    assert unnamed == []


# --------------------------------------------------------------------------------------------
# Heads


def test_a_worker_tag_behind_a_kubernetes_prefix() -> None:
    line = heads.parse_line(
        "2025-04-02T07:15:01.204311Z stderr F (Worker_TP1 pid=798) ERROR 03-18 09:13:02 "
        "[multiproc_executor.py:470] WorkerProc failed to start."
    )
    assert (line.process, line.rank, line.pid, line.level) == ("Worker_TP1", 1, 798, "ERROR")
    assert line.text == "WorkerProc failed to start."


@pytest.mark.parametrize(
    ("line", "kind"),
    [
        (STAMP + "Starting to load model /m...", "progress"),
        (STAMP + "Resolved architecture: Qwen2ForCausalLM", "quiet"),
        ("ERROR 03-18 09:13:02 [core.py:1] EngineCore failed to start.", "stamped"),
        ("torch.OutOfMemoryError: CUDA out of memory.", "unstamped"),
    ],
)
def test_the_first_stamp_says_what_a_line_can_carry(line: str, kind: str) -> None:
    got, keyword = heads.kind_of(heads.STAMP_RE.search(line, 0, heads.STAMP_WINDOW))
    names = {heads.UNSTAMPED: "unstamped", heads.STAMPED: "stamped"}
    assert names.get(got, "progress" if keyword else "quiet") == kind
    assert (keyword == "Starting to load model") == (kind == "progress")


def test_carriage_returns_split_a_line_and_escapes_go() -> None:
    assert heads.segments("\x1b[32mLoading: 10%\rLoading: 20%\r\n") == ["Loading: 10%", "Loading: 20%"]


# --------------------------------------------------------------------------------------------
# Families: the class and the numbers, each by its name


@pytest.mark.parametrize(
    ("text", "cls", "numbers"),
    [
        (
            "ValueError: To serve at least one request with the models's max seq len (32768), (4.0 GiB KV "
            "cache is needed, which is larger than the available KV cache memory (0.5 GiB). Based on the "
            "available memory, the estimated maximum model length is 4096.",
            fl.KV_INSUFFICIENT,
            {
                "max_model_len": 32768,
                "kv_needed_gib": 4.0,
                "kv_available_gib": 0.5,
                "estimated_max_model_len": 4096,
            },
        ),
        (
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has a total "
            "capacity of 23.54 GiB of which 1024.00 KiB is free. Process 7 has 23.52 GiB memory in use.",
            families.OOM,
            {
                "tried_to_allocate_mib": 512.0,
                "device_index": 0,
                "device_total_gib": 23.54,
                "device_free_mib": 1.0,
                "process_in_use_gib": 23.52,
            },
        ),
        (
            "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 1; 79.35 GiB total capacity; "
            "76.10 GiB already allocated; 1.50 GiB free; 77.00 GiB reserved in total by PyTorch)",
            families.OOM,
            {
                "tried_to_allocate_mib": 2048.0,
                "device_index": 1,
                "device_total_gib": 79.35,
                "device_allocated_gib": 76.1,
                "device_free_mib": 1536.0,
            },
        ),
        (
            "ValueError: Free memory on device (7.34/139.72 GiB) on startup is less than desired GPU memory "
            "utilization (0.9, 125.75 GiB).",
            fl.FREE_MEM_BELOW_UTIL,
            {
                "free_gib": 7.34,
                "total_gib": 139.72,
                "gpu_memory_utilization": 0.9,
                "requested_gib": 125.75,
                "shortfall_gib": 118.41,  # requested less free: what other processes must give back
            },
        ),
        (
            "ValueError: User-specified max_model_len (65536) is greater than the derived max_model_len "
            "(max_position_embeddings=32768 or model_max_length=None in model's config.json).",
            fl.CONFIG_ERROR,
            {"max_model_len": 65536, "derived_max_model_len": 32768},
        ),
        (
            "ValueError: type fp8e4nv not supported in this architecture. The supported fp8 dtypes are "
            "('fp8e4b15', 'fp8e5'). Your GPU has compute capability 75.",
            fl.FP8_UNSUPPORTED,
            {"compute_capability": 7.5},
        ),
        (
            "ERROR: [Errno 98] error while attempting to bind on address ('0.0.0.0', 8000)",
            fl.PORT_IN_USE,
            {"port": 8000},
        ),
        ("Bind for 0.0.0.0:8001 failed: port is already allocated", fl.PORT_IN_USE, {"port": 8001}),
        (
            "zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:5570')",
            fl.PORT_IN_USE,
            {"port": 5570},
        ),
    ],
)
def test_a_family_names_the_class_and_its_figures(text: str, cls: str, numbers: dict[str, float]) -> None:
    fam = families.match_families(text)
    assert fam is not None and fam[0] == cls
    assert fam[3] == pytest.approx(numbers)
    assert families.gate(text)


def test_the_more_specific_family_wins() -> None:
    text = "RuntimeError: CUDA error: out of memory"  # both a CUDA error and an out-of-memory
    fam = families.match_families(text)
    assert fam is not None and fam[0] == families.OOM


# --------------------------------------------------------------------------------------------
# Tracebacks


def test_frames_and_source_lines_note_the_step_in_the_traceback_and_the_log() -> None:
    seen: dict[str, int] = {}
    tb = Traceback(1)
    tb.frame("load_model", "/v/vllm/v1/worker/gpu_worker.py", 'File "...", line 1, in load_model', seen)
    assert tracebacks.best_phase(tb.phases) == fl.PHASE_LOAD_WEIGHTS
    other = Traceback(9)
    other.source_line('    self.collective_rpc("initialize_cache", args=(blocks,))', seen)
    assert tracebacks.best_phase(other.phases) == fl.PHASE_KV_CACHE  # a weak step stands for its phase
    assert tracebacks.best_phase(seen) == fl.PHASE_LOAD_WEIGHTS  # the deeper step of the two
    graphs = Traceback(20)
    graphs.frame("__exit__", "/v/torch/cuda/graphs.py", 'File "...", line 1, in __exit__', seen)
    assert tracebacks.best_phase(graphs.phases) == fl.PHASE_CUDA_GRAPH
    assert tracebacks.best_phase(seen) == fl.PHASE_CUDA_GRAPH


def test_a_request_handler_frame_marks_the_traceback_as_a_request() -> None:
    tb = Traceback(1)
    tb.frame("create_chat_completion", "serving_chat.py", "in create_chat_completion", {})
    assert tb.request and tracebacks.best_phase(tb.phases) == fl.PHASE_SERVING


def test_a_failed_worker_method_names_its_step() -> None:
    assert (
        tracebacks.method_phase("Error executing method 'determine_num_available_blocks'.")
        == fl.PHASE_PROFILE
    )
    assert tracebacks.method_phase("Error executing method 'start_profile'.") is None


# --------------------------------------------------------------------------------------------
# Joining


def _pending(text: str, finding: Finding | None = None) -> joining.Pending:
    return joining.Pending(finding, text, text, 0, 1)


def test_a_message_names_its_cause_once_joined() -> None:
    pending = _pending("ValueError: type fp8")
    pending.wrapped = True  # a terminal's wrap: the pieces join without a space
    assert families.match_families(pending.text_space) is None
    assert joining.continues(
        "e4nv not supported in this architecture.",
        "e4nv not supported in this architecture.",
        pending,
        wrapped=True,
    )
    more = joining.extend(pending, "e4nv not supported in this architecture.", 2)
    assert more is not None
    fam, joined = more
    assert (
        fam[0] == fl.FP8_UNSUPPORTED
        and joined == "ValueError: type fp8e4nv not supported in this architecture."
    )
    assert (pending.lines, pending.last_line) == (1, 2)


def test_what_does_not_continue_a_message() -> None:
    pending = _pending("torch.OutOfMemoryError: CUDA out of memory.")
    for line in ("Traceback (most recent call last):", 'File "/v/x.py", line 3, in f', "RuntimeError: other"):
        assert not joining.continues(line, line, pending)
    assert not joining.continues(
        "        self.forward(x)", "self.forward(x)", pending
    )  # a deeper source line
    assert joining.continues("Tried to allocate 2.00 GiB.", "Tried to allocate 2.00 GiB.", pending)


# --------------------------------------------------------------------------------------------
# Figures


def test_figures_gather_numbers_milestones_and_readiness() -> None:
    figs = figures.FigureCollector()
    events: list[LogLine | Progress] = []
    read = [
        ("Initializing a V1 LLM engine (v0.11.0) with config: model='m', device_config=cuda, block_size=32, "
         "max_seq_len=4096", "Initializing a V1 LLM engine"),
        ("Starting to load model /m...", "Starting to load model"),
        ("Model loading took 14.99 GiB and 6.0 seconds", "Model loading took"),
        ("# GPU blocks: 100, # CPU blocks: 10", "# GPU blocks"),
        ("Application startup complete.", "Application startup complete"),
    ]  # fmt: skip
    ready = [figs.read(text, events, kw, n) for n, (text, kw) in enumerate(read, 1)]
    assert ready == [False, False, False, False, True]
    assert figs.engine_version == "0.11.0" and figs.engine_device == "cuda" and figs.block_size == 32
    assert figs.obs["weights_gib"] == 14.99 and figs.obs["max_model_len"] == 4096
    assert figs.obs["kv_cache_tokens"] == 3200 and figs.blocks_line == 4  # blocks x the printed block size
    assert figs.reached == fl.milestone("kv_sized") and figs.ready_line == 5
    assert [e.kind for e in events if isinstance(e, Progress)] == [
        "engine_config",
        "weights_start",
        "weights_loaded",
        "kv_blocks",
        "server_ready",
    ]
    assert figs.read("Application startup complete.", None, "Application startup complete", 6) is False


# --------------------------------------------------------------------------------------------
# decide(): plain data in, the verdict out


def finding(cls: str, prio: int, line_no: int = 10, **kw: object) -> Finding:
    values: dict[str, object] = {
        "fixed_phase": None,
        "text": f"{cls} at {line_no}",
        "numbers": {},
        "process": None,
        "pid": None,
        "frame_phase": None,
        "hint": False,
        "request": False,
        "after_ready": False,
        "after_shutdown": False,
        "reached": 0,
        "header": True,
    }
    values.update(kw)
    return Finding(cls=cls, prio=prio, line_no=line_no, **values)


P_OOM = families._P_OOM
P_KV = families._P_KV
OOM_CASES = [
    # (frame phase, milestone reached, forward pass in the traceback) -> class
    ("cuda_graph", 0, False, fl.OOM_CUDAGRAPH),
    (None, fl.milestone("launched"), False, fl.OOM_WEIGHTS),
    (None, fl.milestone("launched"), True, fl.OOM_PROFILE),
    (None, fl.milestone("weights_started"), False, fl.OOM_WEIGHTS),
    (None, fl.milestone("weights_started"), True, fl.OOM_PROFILE),
    (None, fl.milestone("weights_loaded"), False, fl.OOM_PROFILE),
    (None, fl.milestone("kv_sized"), False, fl.OOM_KV_ALLOC),
    (None, fl.milestone("capture_started"), False, fl.OOM_CUDAGRAPH),
    (None, fl.milestone("captured"), False, fl.OOM_PROFILE),
    ("load_weights", fl.milestone("captured"), True, fl.OOM_WEIGHTS),  # a frame beats the milestones
]


@pytest.mark.parametrize(("frame", "reached", "hint", "cls"), OOM_CASES)
def test_decide_gives_an_out_of_memory_its_step(
    frame: str | None, reached: int, hint: bool, cls: str
) -> None:
    oom = finding(
        families.OOM,
        P_OOM,
        frame_phase=frame,
        reached=reached,
        hint=hint,
        numbers={"tried_to_allocate_mib": 20.0},
    )
    got = decide(Collected(findings={families.OOM: oom}, observations={"weights_gib": 14.0}), 1)
    assert got.failure.cls == cls and got.line == 10
    assert got.failure.numbers.to_dict() == {"weights_gib": 14.0, "tried_to_allocate_mib": 20.0}


def test_decide_takes_the_most_specific_finding_not_the_last() -> None:
    dead = finding(fl.ENGINE_DEAD, families.P_DEAD, line_no=50)
    kv = finding(
        fl.KV_INSUFFICIENT, P_KV, line_no=20, fixed_phase=fl.PHASE_KV_CACHE, numbers={"max_model_len": 8192}
    )
    got = decide(Collected(findings={fl.ENGINE_DEAD: dead, fl.KV_INSUFFICIENT: kv}), 1)
    assert (got.failure.cls, got.failure.phase, got.line) == (fl.KV_INSUFFICIENT, fl.PHASE_KV_CACHE, 20)
    assert got.failure.evidence == kv.text and got.failure.numbers.to_dict() == {"max_model_len": 8192}


def test_decide_a_finding_vllm_survived_is_no_failure() -> None:
    oom = finding(families.OOM, P_OOM, line_no=10)
    got = decide(
        Collected(findings={families.OOM: oom}, ready_line=30, ready_text="Application startup complete."),
        None,
    )
    assert (got.failure.cls, got.failure.phase, got.line) == (fl.NONE, fl.PHASE_SERVING, 30)


@pytest.mark.parametrize(
    ("collected", "exit_code", "cls", "phase", "line"),
    [
        (Collected(findings={}), None, fl.NONE, fl.PHASE_STARTUP, None),
        (
            Collected(findings={}, reached=fl.milestone("weights_loaded")),
            137,
            fl.HOST_OOM,
            fl.PHASE_PROFILE,
            None,
        ),
        (
            Collected(findings={}, reached=fl.milestone("kv_sized")),
            1,
            fl.ENGINE_DEAD,
            fl.PHASE_KV_CACHE,
            None,
        ),
        (Collected(findings={}, shutdown_line=40), -15, fl.NONE, fl.PHASE_STARTUP, None),
        (Collected(findings={}, marked_ready_line=5), 1, fl.ENGINE_DEAD, fl.PHASE_SERVING, None),
        (
            Collected(findings={}, unknown=finding("ValueError", 0, line_no=7)),
            1,
            fl.CONFIG_ERROR,
            fl.PHASE_STARTUP,
            7,
        ),
        (
            Collected(
                findings={}, unknown=finding("RuntimeError", 0, line_no=7, reached=fl.milestone("kv_sized"))
            ),
            1,
            fl.ENGINE_DEAD,
            fl.PHASE_KV_CACHE,
            7,
        ),
        (
            Collected(
                findings={},
                open_tracebacks=[
                    Traceback(12, phases={fl.PHASE_CUDA_GRAPH: 8}, last_frame="File x, in capture_model")
                ],
            ),
            1,
            fl.ENGINE_DEAD,
            fl.PHASE_CUDA_GRAPH,
            12,
        ),
        (
            Collected(findings={}, observations={"gpu_blocks": 10, "max_model_len": 1000}, blocks_line=3),
            1,
            fl.KV_INSUFFICIENT,
            fl.PHASE_KV_CACHE,
            3,
        ),
        (
            Collected(findings={}, observations={"gpu_blocks": 0}, blocks_line=3),
            1,
            fl.NO_KV_MEMORY,
            fl.PHASE_KV_CACHE,
            3,
        ),
    ],
)
def test_decide_without_a_named_cause(
    collected: Collected, exit_code: int | None, cls: str, phase: str, line: int | None
) -> None:
    got = decide(collected, exit_code)
    assert (got.failure.cls, got.failure.phase, got.line) == (cls, phase, line)


def test_decide_reads_only() -> None:
    oom = finding(families.OOM, P_OOM, frame_phase="kv_cache_weak")
    collected = Collected(
        findings={families.OOM: oom},
        frame_phases={fl.PHASE_PROFILE: 7},
        observations={"kv_cache_gib": 1.0},
        open_tracebacks=[Traceback(3, last_frame="File x")],
    )
    before = copy.deepcopy(collected)
    first = decide(collected, 1)
    assert first.failure.cls == fl.OOM_PROFILE  # a worker's traceback shows the deeper step
    assert decide(collected, 1) == first
    assert collected == before


def test_the_reader_hands_decide_what_it_collected() -> None:
    lines = [
        "(EngineCore pid=5) " + STAMP + "Starting to load model /m...",
        "(EngineCore pid=5) ERROR 03-18 09:13:02 [core.py:1] torch.OutOfMemoryError: CUDA out of memory.",
    ]
    r = LogReader()
    r.feed_lines(lines)
    collected = r.collected()
    assert list(collected.findings) == [families.OOM]
    assert collected.reached == fl.milestone("weights_started")
    assert decide(collected, 1).failure == r.verdict(1)
    assert r.verdict(1).cls == fl.OOM_WEIGHTS
    r.feed_lines(["(EngineCore pid=5) " + STAMP + "Model loading took 1.0 GiB and 2.0 seconds"])
    assert collected.reached == fl.milestone("weights_started")  # a copy: later lines leave it as it was
    assert r.collected().reached == fl.milestone("weights_loaded")


# --------------------------------------------------------------------------------------------
# One order of start-up milestones: the reader's frameless phase and the hang's phase agree

# Cases where runner._NEXT_PHASE (the phase of a hang, by the last progress line) and
# logparse._phase_from_stage (the phase of a failure without frames) used to disagree:
DISAGREED = [
    # (the progress lines a start-up printed, the one phase now, runner's old answer, logparse's old answer)
    (["Starting to load model /m..."], fl.PHASE_LOAD_WEIGHTS, fl.PHASE_LOAD_WEIGHTS, fl.PHASE_STARTUP),
    (
        ["Model loading took 1.0 GiB and 2.0 seconds", "GPU KV cache size: 1,000 tokens"],
        fl.PHASE_KV_CACHE,
        fl.PHASE_CUDA_GRAPH,
        fl.PHASE_KV_CACHE,
    ),
    (
        ["Model loading took 1.0 GiB", "# GPU blocks: 100, # CPU blocks: 10"],
        fl.PHASE_KV_CACHE,
        fl.PHASE_CUDA_GRAPH,
        fl.PHASE_KV_CACHE,
    ),
    (
        ["Auto-fit max_model_len: reduced from 32768 to 4096"],
        fl.PHASE_KV_CACHE,
        fl.PHASE_CUDA_GRAPH,
        fl.PHASE_STARTUP,
    ),
    (
        ["GPU KV cache size: 1,000 tokens", "Graph capturing finished in 5 secs, took 0.50 GiB"],
        fl.PHASE_PROFILE,
        fl.PHASE_STARTUP,
        fl.PHASE_PROFILE,
    ),
    (
        [
            "Graph capturing finished in 5 secs, took 0.50 GiB",
            "init engine (profile, create kv cache, warmup model) took 9.0 seconds",
        ],
        fl.PHASE_PROFILE,
        fl.PHASE_STARTUP,
        fl.PHASE_PROFILE,
    ),
]


@pytest.mark.parametrize(("progress", "phase", "old_runner", "old_logparse"), DISAGREED)
def test_a_hang_and_a_failure_without_frames_are_in_the_same_phase(
    progress: list[str], phase: str, old_runner: str, old_logparse: str
) -> None:
    assert old_runner != old_logparse  # the case shows the former disagreement
    lines = [STAMP + text for text in progress]
    hung = LogReader()
    hung.feed_lines(lines)
    assert hung.verdict(None).cls == fl.NONE
    assert hung.startup_phase == phase  # what the runner reports for a hang here
    died = LogReader()
    died.feed_lines([*lines, "RuntimeError: something went wrong"])
    failure = died.verdict(1)
    assert (failure.cls, failure.phase) == (fl.ENGINE_DEAD, phase)


def test_the_milestones_are_in_start_up_order() -> None:
    phases = [fl.phase_after(i) for i in range(len(fl.MILESTONES))]
    assert phases[0] == fl.PHASE_STARTUP
    steps = [fl.PHASES.index(p) for p in phases[:-1]]  # up to the capture they follow fl.PHASES' order
    assert steps == sorted(steps)
    assert phases[-1] == fl.PHASE_PROFILE  # then the sampler warm-up
    assert set(figures.KIND_MILESTONE.values()) == set(range(1, len(fl.MILESTONES)))

"""The plan: a model's architecture + the device + engine flags + the vLLM version -> predicted memory and
the first flags to launch. Pure: plain data in, plain data out (no ``os``, no clock, no I/O).

Every figure comes from the memory model (:mod:`r1sup.core.memmodel`: weights, non-torch memory, the profile
run's activation peak, CUDA graphs, KV bytes per token, blocks and the null block, vLLM's batch
defaults, valid tensor-parallel sizes, each a function of the vLLM version), calibrated by what earlier
launches on the same box printed (:class:`r1sup.core.memmodel.Calibration`). This module decides what to
recommend with those figures:

* "fits": vLLM starts with these flags (free memory, one request of ``max_model_len`` in the KV cache)
  and the KV cache holds the target, with a margin kept spare for the parts that are estimated, not
  measured (:func:`_margin`);
* the recommendation: the longest context up to the requested one, then the fewest and mildest changes
  (fp8 KV, more utilization within bounds, fewer sequences for a known target, eager mode last), over
  the GPUs present (tensor-parallel sizes vLLM accepts) and fp8 weights when allowed;
* ways out with their figures when nothing within the bounds fits.

On the CPU backend an unpinned KV cache is ``ceil(utilization x node memory) - RSS`` of the worker;
the RSS is weights plus the runtime (``memmodel.CPU_RUNTIME_GIB``, measured: 0.75 GiB with the tiny
model at utilization 0.35 of an 8.59 GiB node). ``--kv-cache-memory-bytes`` pins the KV size exactly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from r1sup.core import memmodel as M
from r1sup.core.bounds import Bounds
from r1sup.core.capacity import Reduction
from r1sup.core.flags import FP8_KV_DTYPES, EngineFlags
from r1sup.core.hardware import GIB, DeviceFacts
from r1sup.core.memmodel import (
    CPU_BLOCK_SIZE,
    CUDA_BLOCK_SIZE,
    FOUR_BIT_METHODS,
    FP8_PER_TENSOR_SPELLING,
    FP8_WEIGHT_METHODS,
    Calibration,
    ModelArch,
    Version,
    arch_from_config,
    cdiv,
    estimated_max_model_len,
    margin_bytes,
    request_blocks,
    startable_utilization,
    weight_method,
)

__all__ = [
    "CPU_BLOCK_SIZE",
    "CUDA_BLOCK_SIZE",
    "Breakdown",
    "Calibration",
    "ModelArch",
    "Plan",
    "Suggestion",
    "arch_from_config",
    "fewer_seqs",
    "fp8_kv_choice",
    "plan",
    "predict_kv_tokens",
    "predict_max_model_len",
]

TARGET_SEQS_FLOOR = 16  # fewest sequences per batch the planner sets to make room (vLLM captures 1..2x of it)

# --- the breakdown -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Breakdown:
    """Memory of one GPU (or of the CPU backend's NUMA node), in GiB.

    ``budget_gib`` is what vLLM may use (utilization x total, or weights + overheads + the pinned KV);
    ``kv_gib`` is what is left of it for the KV cache (negative: the shortfall). ``cudagraph_gib`` is the
    CUDA-graph pool vLLM captures; ``cudagraph_charged_gib`` the part of it the KV budget pays for (vLLM's
    estimate from 0.20.0 on, nothing before). ``context_gib`` is the CUDA context/NCCL memory outside the
    budget that must also be free at start-up.
    """

    weights_gib: float
    non_torch_gib: float
    activation_gib: float
    cudagraph_gib: float
    kv_gib: float
    budget_gib: float
    total_gib: float
    context_gib: float = 0.0
    free_gib: float | None = None
    cudagraph_estimate_gib: float = 0.0
    cudagraph_charged_gib: float = 0.0
    sources: tuple[tuple[str, str], ...] = ()  # (part, "estimate" | "measured" | ...)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            k: (round(v, 3) if isinstance(v, float) else v)
            for k, v in dataclasses.asdict(self).items()
            if k != "sources"
        }
        out["sources"] = dict(self.sources)
        return out


def _breakdown(est: M.Estimate, device: DeviceFacts) -> Breakdown:
    free = device.free_bytes
    return Breakdown(
        weights_gib=est.weights.gib,
        non_torch_gib=est.non_torch.gib,
        activation_gib=est.activation.gib,
        cudagraph_gib=est.cudagraph.gib,
        kv_gib=est.kv.gib,
        budget_gib=est.budget / GIB,
        total_gib=device.total_bytes / GIB,
        context_gib=est.context.gib,
        free_gib=free / GIB if free else None,
        cudagraph_estimate_gib=est.cudagraph_estimate.gib,
        cudagraph_charged_gib=est.cudagraph_charged / GIB,
        sources=tuple(est.sources().items()),
    )


# --- one configuration, evaluated ----------------------------------------------------------------


@dataclass(frozen=True)
class Evaluation:
    """The memory model's estimate of one configuration, with the margin the planner keeps spare: what
    every verdict of :func:`plan` rests on (does it start, how long a context, how many requests)."""

    est: M.Estimate
    margin: int = 0  # bytes of KV kept spare for errors of the estimated parts (see _margin)

    @property
    def flags(self) -> EngineFlags:
        return self.est.flags

    @property
    def kv(self) -> int:
        return self.est.kv.bytes

    @property
    def weights(self) -> int:
        return self.est.weights.bytes

    @property
    def block(self) -> int:
        return self.est.block_size

    @property
    def kv_bpt(self) -> int:
        return self.est.kv_bytes_per_token

    @property
    def bytes_per_block(self) -> int:
        return self.est.bytes_per_block

    @property
    def num_blocks(self) -> int:
        return self.est.num_blocks

    @property
    def startup_ok(self) -> bool:
        return self.est.startup_problem is None

    @property
    def max_num_seqs(self) -> int:
        return self.est.batch.max_num_seqs

    def usable_blocks(self, margin: bool) -> int:
        """Blocks left for requests (V1 holds one back as the null block): the search's arithmetic."""
        return request_blocks(self.est, self.kv - self.margin if margin else self.kv)

    def context_for(self, concurrency: int, cap: int, margin: bool) -> int:
        """Largest block-aligned context where ``concurrency`` requests fit at once (0 if none)."""
        per_request = self.usable_blocks(margin) // max(1, concurrency)
        return max(0, min(cap, per_request * self.block))

    def fits_context(self, context: int, concurrency: int, margin: bool) -> bool:
        """``concurrency`` requests of ``context`` tokens each fit at once (and vLLM starts)."""
        return self.startup_ok and self.usable_blocks(margin) >= concurrency * cdiv(context, self.block)

    def holds(self, context: int, concurrency: int, per_request: int, margin: bool) -> bool:
        """vLLM starts with ``max_model_len`` = ``context`` (one request of it fits) and the KV cache holds
        ``concurrency`` requests of ``per_request`` tokens at once: issue 6's reading of a target."""
        return self.fits_context(context, 1, margin) and self.fits_context(per_request, concurrency, margin)

    def longest_context(self, concurrency: int, per_request: int, cap: int, margin: bool) -> int:
        """The longest block-aligned ``max_model_len`` (up to ``cap``) for :meth:`holds`; 0 if none."""
        if not self.fits_context(per_request, concurrency, margin):
            return 0
        return max(0, min(cap, self.usable_blocks(margin) * self.block))

    def breakdown(self, device: DeviceFacts) -> Breakdown:
        return _breakdown(self.est, device)


def evaluate(
    arch: ModelArch,
    device: DeviceFacts,
    flags: EngineFlags,
    version: Version,
    calibration: Calibration | None = None,
) -> Evaluation:
    """``flags`` on ``device`` as the planner judges them: the memory model's estimate (with
    ``calibration``, a saved launch's figures, when there is one) and the margin kept for its error."""
    est = M.evaluate(arch, device, flags, version, calibration)
    return Evaluation(est, _margin(est, calibration is not None))


def _margin(est: M.Estimate, calibrated: bool = False) -> int:
    """KV bytes the recommended flags keep spare for the memory model's error: the search's margin
    (:func:`r1sup.core.memmodel.margin_bytes`), for a search that starts from ``calibration`` when one is
    given."""
    return margin_bytes(est, calibrated=int(calibrated))


# --- predictions ---------------------------------------------------------------------------------


def predict_kv_tokens(
    arch: ModelArch,
    device: DeviceFacts,
    flags: EngineFlags,
    version: Version | str | None = None,
    calibration: Calibration | None = None,
) -> int:
    """KV cache capacity in tokens for these flags (``num_blocks x block_size``)."""
    return M.evaluate(arch, device, flags, version, calibration).kv_capacity_tokens


def predict_max_model_len(
    arch: ModelArch,
    device: DeviceFacts,
    flags: EngineFlags,
    version: Version | str | None = None,
    calibration: Calibration | None = None,
) -> int:
    """vLLM's "estimated maximum model length" (and ``--max-model-len -1`` auto-fit) for these flags."""
    est = M.evaluate(arch, device, flags, version, calibration)
    return est.max_model_len(arch.max_position_embeddings)


# --- suggestions and the plan ------------------------------------------------------------------


@dataclass(frozen=True)
class Suggestion:
    """A way to fit: one change to the flags (named by ``title``), with the figures of exactly its command.

    ``context`` is the ``--max-model-len`` of the command (the one asked for, capped at the model's limit,
    or a shorter one the title names); ``kv_capacity_tokens`` the KV cache those flags hold;
    ``concurrency`` how many requests of ``context`` fit in it at once; ``max_context`` the longest
    ``--max-model-len`` these flags would start with (vLLM's "estimated maximum model length").
    ``pipeline_parallel_size`` > 1: the command spans ``nodes`` nodes of ``gpus_per_node`` GPUs
    (tensor parallel inside a node, pipeline parallel across nodes) and the figures are per GPU of its
    fullest pipeline stage. Re-planned as given (:func:`plan` with these flags, the same target and the
    model split the same way) it fits.
    """

    kind: str  # utilization, fp8_kv, fp8_weights, four_bit, tensor_parallel, pipeline_parallel, ...
    title: str
    flags: EngineFlags
    fits: bool
    weights_gib: float
    kv_gib: float
    kv_capacity_tokens: int
    max_context: int
    requires: str | None = None
    note: str | None = None
    context: int = 0
    concurrency: float = 0.0
    pipeline_parallel_size: int = 1
    nodes: int = 1
    gpus_per_node: int | None = None

    @property
    def argv(self) -> list[str]:
        """vLLM's arguments for this way out (``--pipeline-parallel-size`` beside the managed flags)."""
        pp = self.pipeline_parallel_size
        return self.flags.to_argv() + (["--pipeline-parallel-size", str(pp)] if pp > 1 else [])

    @property
    def figures(self) -> str:
        """The figures of exactly this command, as one phrase."""
        return (
            f"weights {self.weights_gib:.2f} GiB, KV {self.kv_gib:.2f} GiB = {self.kv_capacity_tokens:,} "
            f"tokens: {self.concurrency:g} requests of {self.context:,} tokens at once"
        )

    @property
    def summary(self) -> str:
        """One line for logs and the tune report."""
        extra = f" (needs {self.requires})" if self.requires else ""
        return f"{self.title}{extra}: {' '.join(self.argv)} -> {self.figures}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "title": self.title,
            "flags": self.flags.to_dict(),
            "argv": self.argv,
            "fits": self.fits,
            "weights_gib": round(self.weights_gib, 2),
            "kv_gib": round(self.kv_gib, 2),
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "max_context": self.max_context,
            "context": self.context,
            "concurrency": self.concurrency,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "requires": self.requires,
            "note": self.note,
            "summary": self.summary,
        }


@dataclass(frozen=True)
class PlanDevice:
    """The device a plan is for, as ``plan`` shows it: one GPU's memory (the NUMA node's on the CPU
    backend) and what is free of it (None when nothing was probed), its compute capability as
    ``"8.9"``, and the tensor-parallel size the plan spreads the model over."""

    backend: str
    source: str  # DeviceFacts.source: probe, catalog or manual
    name: str
    count: int
    total_gib: float
    free_gib: float | None
    compute_capability: str | None
    tensor_parallel_size: int
    notes: tuple[str, ...] = ()

    @classmethod
    def of(cls, device: DeviceFacts, flags: EngineFlags) -> PlanDevice:
        cc = device.compute_capability
        return cls(
            backend=device.backend,
            source=device.source,
            name=device.gpus[0].name if device.gpus else (device.cpu_model or "host"),
            count=device.count,
            total_gib=round(device.total_bytes / GIB, 2),
            free_gib=round(device.free_bytes / GIB, 2) if device.free_bytes else None,
            compute_capability=f"{cc[0]}.{cc[1]}" if cc else None,
            tensor_parallel_size=flags.tensor_parallel_size,
            notes=tuple(device.notes),
        )

    def to_dict(self) -> dict[str, Any]:
        """``plan --json``'s ``device``."""
        return {
            "backend": self.backend,
            "source": self.source,
            "name": self.name,
            "count": self.count,
            "total_gib": self.total_gib,
            "free_gib": self.free_gib,
            "compute_capability": self.compute_capability,
            "tensor_parallel_size": self.tensor_parallel_size,
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class Layout:
    """The GPUs a plan's flags span: tensor parallel inside a node, pipeline stages across nodes, and the
    layers of each stage (vLLM's split)."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    gpus_per_node: int
    stage_layers: tuple[int, ...]

    @property
    def gpus(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def nodes(self) -> int:
        return cdiv(self.gpus, self.gpus_per_node)

    def to_dict(self) -> dict[str, Any]:
        """``plan --json``'s ``layout`` (the plan adds its stages' breakdowns)."""
        return {
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "gpus": self.gpus,
            "gpus_per_node": self.gpus_per_node,
            "nodes": self.nodes,
            "stage_layers": list(self.stage_layers),
        }


@dataclass(frozen=True)
class Beside:
    """One term of the prediction beside what the calibrating launch measured of it, in GiB to 0.001 (as
    ``plan --json`` reports them), and where the predicted value came from (``estimate``, ``measured``,
    ``measured, scaled``, ...)."""

    predicted_gib: float
    measured_gib: float
    source: str

    @classmethod
    def of(cls, term: M.Term, measured_gib: float) -> Beside:
        return cls(round(term.gib, 3), round(measured_gib, 3), term.source)

    def to_dict(self) -> dict[str, Any]:
        return {"predicted_gib": self.predicted_gib, "measured_gib": self.measured_gib, "source": self.source}


@dataclass(frozen=True)
class Calibrated:
    """The prediction beside a launch's figures, term by term (None: the launch did not measure it), and
    the flags and vLLM version of that launch."""

    flags: EngineFlags
    vllm_version: str | None = None
    weights: Beside | None = None
    non_torch: Beside | None = None
    activation: Beside | None = None
    cudagraph: Beside | None = None
    cudagraph_estimate: Beside | None = None
    kv: Beside | None = None

    def to_dict(self) -> dict[str, Any]:
        """The ``measured`` object of ``plan --json``: the measured terms in the memory model's order,
        then the launch's flags and version."""
        terms = (
            ("weights", self.weights),
            ("non_torch", self.non_torch),
            ("activation", self.activation),
            ("cudagraph", self.cudagraph),
            ("cudagraph_estimate", self.cudagraph_estimate),
            ("kv", self.kv),
        )
        out: dict[str, Any] = {name: b.to_dict() for name, b in terms if b is not None}
        out["flags"] = self.flags.to_dict()
        out["vllm_version"] = self.vllm_version
        return out


@dataclass(frozen=True)
class Plan:
    fits: bool
    breakdown: Breakdown
    kv_capacity_tokens: int
    max_context: int
    max_context_for_target: int | None
    weights_gib: float
    kv_bytes_per_token: int
    recommended: EngineFlags | None
    suggestions: list[Suggestion]
    notes: list[str]
    model: ModelArch
    device: PlanDevice
    layout: Layout  # GPUs, nodes, pipeline stages
    assumed_defaults: M.Batch  # the batch limits the prediction assumed
    model_fits: bool = False
    startup_problem: str | None = None
    starts_as_given: bool = False
    meets_target: bool = False
    num_blocks: int = 0
    block_size: int = CUDA_BLOCK_SIZE
    max_model_len: int = 0
    target_concurrency: int | None = None
    target_context: int | None = None
    recommended_breakdown: Breakdown | None = None
    recommended_kv_capacity_tokens: int | None = None
    recommended_concurrency: float | None = None
    recommended_margin_gib: float | None = None  # KV kept spare by the recommended flags for estimate errors
    flags: EngineFlags = field(default_factory=EngineFlags)
    vllm_version: str = str(M.NEWEST_KNOWN)
    version_note: str | None = None
    engine: str = "V1"
    measured: Calibrated | None = None  # predicted beside measured, per term (None: no calibration)
    estimate: dict[str, Any] = field(default_factory=dict)  # the memory model's terms and their sources
    verdict: str = "does_not_fit"  # one of VERDICTS
    verdict_reason: str = ""  # why not as given (or, when it fits, what the KV cache holds)
    stage_breakdowns: tuple[Breakdown, ...] = ()  # one GPU of each pipeline stage (a split model only)
    # what each recommended change costs the user (search.Search.costs), and, when the recommended flags
    # give up more than half the asked context or serve fewer sequences, why and the ways out
    # (search.Search.reduction; the same as tune's result)
    costs: list[str] = field(default_factory=list)
    reduced: Reduction | None = None

    @property
    def exit_code(self) -> int:
        """``r1sup plan``'s exit status: 0 fits as given, 7 only with the recommended flags, 3 not within
        the bounds (see :data:`VERDICTS`)."""
        return VERDICTS[self.verdict]

    def to_dict(self) -> dict[str, Any]:
        """The ``r1sup plan --json`` object."""
        return {
            "weights_gib": round(self.weights_gib, 2),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "fits": self.fits,
            "model_fits": self.model_fits,
            "starts_as_given": self.starts_as_given,
            "startup_problem": self.startup_problem,
            "meets_target": self.meets_target,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "max_context": self.max_context,
            "max_context_for_target": self.max_context_for_target,
            "target": {"concurrency": self.target_concurrency, "context": self.target_context},
            "recommended": self.recommended.to_dict() if self.recommended else None,
            "recommended_argv": self.recommended.to_argv() if self.recommended else None,
            "recommended_prediction": (
                {
                    "breakdown": self.recommended_breakdown.to_dict(),
                    "kv_capacity_tokens": self.recommended_kv_capacity_tokens,
                    "concurrency": self.recommended_concurrency,
                    "margin_gib": self.recommended_margin_gib,
                }
                if self.recommended_breakdown is not None
                else None
            ),
            "suggestions": [s.to_dict() for s in self.suggestions],
            "breakdown": self.breakdown.to_dict(),
            "flags": self.flags.to_dict(),
            "model": self.model.summary(),
            "device": self.device.to_dict(),
            "notes": list(self.notes),
            "vllm_version": self.vllm_version,
            "version_note": self.version_note,
            "engine": self.engine,
            "assumed_defaults": _assumed_defaults(self.assumed_defaults),
            "measured": self.measured.to_dict() if self.measured else {},
            "estimate": self.estimate,
            "verdict": {"status": self.verdict, "reason": self.verdict_reason, "exit_code": self.exit_code},
            "layout": {
                **self.layout.to_dict(),
                "stage_breakdowns": [sb.to_dict() for sb in self.stage_breakdowns],
            },
            "costs": list(self.costs),
            "reduced": self.reduced.to_dict() if self.reduced is not None else None,
        }


MAX_TP_SUGGESTED = 8  # the largest tensor-parallel size the ways out propose (one 8-GPU box)

# The plan's verdicts and ``r1sup plan``'s exit status for each: 0 as given, 7 only with the
# recommended flags (scripts: ``r1sup plan ... && deploy`` deploys only what fits as written), 3 nothing
# within the ladder's bounds (r1sup's code for "no working configuration").
VERDICTS = {"fits": 0, "fits_with_changes": 7, "does_not_fit": 3}


def fp8_kv_choice(device: DeviceFacts) -> str:
    """``fp8`` (e4m3) from compute capability 8.9 and on the CPU backend, else ``fp8_e5m2``."""
    if device.backend == "cpu":
        return "fp8"
    cc = device.compute_capability
    return "fp8" if cc is not None and cc >= (8, 9) else "fp8_e5m2"


def _e4m3(dtype: str) -> bool:
    return dtype in ("fp8", "fp8_e4m3")


@dataclass(frozen=True)
class _Choice:
    ev: Evaluation
    context: int


def _recommend(
    arch: ModelArch,
    device: DeviceFacts,
    flags: EngineFlags,
    *,
    concurrency: int,
    requested_context: int,
    min_context: int,
    version: Version,
    calibration: Calibration | None,
    bounds: Bounds,
    target_concurrency: int | None = None,
    per_request: int | None = None,
) -> _Choice | None:
    """The best configuration predicted to start with a margin, or None.

    It must hold (:meth:`Evaluation.holds`, with the margin) one request of its ``max_model_len`` and
    ``concurrency`` requests of ``per_request`` tokens at once (None: requests of the full context).
    Preference (issues 4 and 6): the longest context up to the requested one, then the fewest and mildest
    changes: as given, then with fp8 KV when allowed, then at the highest allowed utilization (with and
    without fp8 KV), then, when a target concurrency is given and ``max_num_seqs`` is vLLM's default,
    with fewer sequences per batch (:func:`fewer_seqs`). When none keeps the requested context: the
    longest block-aligned context one request fits with all of those levers, never below ``min_context``,
    or without CUDA graphs when that keeps the requested context or gives a clearly longer one
    (``memmodel.EAGER_MIN_GAIN``).
    """
    base = flags.replace(max_model_len=requested_context)
    cc = device.compute_capability
    if device.backend != "cpu" and _e4m3(base.kv_cache_dtype) and cc is not None and cc < (8, 9):
        base = base.replace(kv_cache_dtype="fp8_e5m2")
    start_max = startable_utilization(device, base.tensor_parallel_size, version)
    lo, hi = bounds.min_gpu_memory_utilization, bounds.max_gpu_memory_utilization
    pinned = base.kv_cache_memory_bytes is not None
    if not pinned and base.gpu_memory_utilization > start_max:
        util = min(start_max, hi)
        if util < lo:
            return None
        base = base.replace(gpu_memory_utilization=util)

    def judged(f: EngineFlags) -> Evaluation:
        return evaluate(arch, device, f, version, calibration)

    def keeps(ev: Evaluation) -> bool:
        return ev.holds(requested_context, concurrency, per_request or requested_context, margin=True)

    def shrink(ev: Evaluation) -> _Choice | None:
        if per_request is None:  # requests of the full context: it shrinks with them
            context = ev.context_for(concurrency, requested_context, margin=True)
        else:
            context = ev.longest_context(concurrency, per_request, requested_context, margin=True)
        if context <= 0 or context < min_context:
            return None
        return _Choice(judged(ev.flags.replace(max_model_len=context)), context)

    # the ways to keep the requested context, the fewest and mildest changes first
    keep = [base]
    fp8_ok = bounds.allow_fp8_kv and device.fp8_kv_supported is not False
    if fp8_ok and base.kv_cache_dtype not in FP8_KV_DTYPES:
        keep.append(base.replace(kv_cache_dtype=fp8_kv_choice(device)))
    top_util = min(hi, start_max)
    if not pinned and top_util > base.gpu_memory_utilization:
        keep += [f.replace(gpu_memory_utilization=top_util) for f in list(keep)]
    seqs = fewer_seqs(arch, device, base, target_concurrency, version)
    if seqs is not None:
        keep.append(keep[-1].replace(max_num_seqs=seqs))
    evals = [judged(f) for f in keep]
    for ev in evals:
        if keeps(ev):
            return _Choice(ev, requested_context)
    primary = evals[-1]  # every lever but eager mode: the most KV, so the longest context
    choice = shrink(primary)
    if bounds.allow_eager and not base.enforce_eager and device.backend != "cpu":
        # without CUDA graphs: their pool (and, from vLLM 0.20, the estimate vLLM charges to the KV
        # budget) goes to the KV cache; taken when that keeps the context or lengthens it by EAGER_MIN_GAIN
        ev = judged(primary.flags.replace(enforce_eager=True))
        if keeps(ev):
            return _Choice(ev, requested_context)
        eager = shrink(ev)
        if eager is not None and (choice is None or eager.context >= M.EAGER_MIN_GAIN * choice.context):
            return eager
    return choice


def fewer_seqs(
    arch: ModelArch,
    device: DeviceFacts,
    flags: EngineFlags,
    target_concurrency: int | None,
    version: Version | str | None = None,
) -> int | None:
    """``max_num_seqs`` for a known target concurrency, when vLLM's default is larger; else None.

    vLLM sizes the sampler warm-up (``max_num_seqs`` dummy requests of vocabulary-wide logits) and the
    CUDA-graph captures (batch sizes up to ``min(2 x max_num_seqs, 512)``, vllm/config/vllm.py) from
    ``max_num_seqs``; its API-server default (256, or 1024 on large GPUs) is far above most targets,
    and both come out of the KV budget. The planner sets the target concurrency (at least
    ``TARGET_SEQS_FLOOR``, a multiple of 8 like vLLM's capture sizes) only when the user left the flag
    unset, so decoding keeps CUDA graphs for every batch the target needs.
    """
    if target_concurrency is None or flags.max_num_seqs is not None or device.backend == "cpu":
        return None
    seqs = max(TARGET_SEQS_FLOOR, cdiv(target_concurrency, 8) * 8)
    default = M.resolve_batch(arch, device, flags, M.as_version(version)).max_num_seqs
    return seqs if seqs < default else None


def plan(
    arch: ModelArch,
    device: DeviceFacts,
    flags: EngineFlags,
    *,
    target_concurrency: int | None = None,
    target_context: int | None = None,
    calibration: Calibration | None = None,
    bounds: Bounds | None = None,
    version: Version | str | None = None,
    gpus_per_node: int | None = None,
) -> Plan:
    """Predict the memory of ``flags`` on ``device`` and recommend first flags (see the module doc).

    The target (issue 6): ``target_concurrency`` requests of ``target_context`` tokens must fit in the KV
    cache at once; the context vLLM runs with is not multiplied by the concurrency (one request of it
    must fit, vLLM's own start-up check). Without ``target_context`` the requests are of the full context;
    without a target, one request of the full context.
    ``fits``: vLLM would start with exactly these flags (``starts_as_given``), the context is at least the
    target context and the KV cache holds the target (``meets_target``), both with the margin kept for
    estimate errors (:func:`_margin`).
    ``model_fits``: the weights and overheads fit and leave KV room for at least one request of the
    smallest acceptable context (``min_max_model_len``, or the target context), so some context works.
    ``recommended``: the best configuration predicted to start and hold the target with that margin
    spare, within ``bounds`` (the longest context up to the requested one, then the fewest changes);
    None when nothing does. ``max_context_for_target`` is for information only: the longest context at
    which ``target_concurrency`` requests of the full context would fit at once.
    ``version``: the vLLM release to size for (default: the newest the memory model knows);
    ``calibration``: what a launch on this box printed (its terms replace the estimates).
    A tensor-parallel size vLLM refuses (heads not divisible) is never recommended nor proposed.
    A model split over pipeline stages (:func:`r1sup.core.memmodel.pipelined`) is sized per GPU of its
    fullest stage; ``gpus_per_node`` (default 8, or more GPUs when tensor parallel asks for more) sizes
    the multi-node way out ("2 nodes of 8 x H100 80GB: tensor parallel 8 x pipeline parallel 2").
    The verdict (:data:`VERDICTS`): "fits" (as given, exit 0), "fits_with_changes" (only with the
    recommended flags, exit 7), "does_not_fit" (nothing within the bounds, exit 3), with the reason.
    """
    b = bounds if bounds is not None else Bounds()
    v = M.as_version(version)
    flags = _normalize_flags(flags)
    stages = M.pipeline_stages(arch)
    ev = evaluate(arch, device, flags, v, calibration)
    auto_fit = flags.max_model_len == -1
    concurrency = max(1, target_concurrency or 1)
    requested_context = ev.est.batch.max_model_len
    if target_context and target_context > requested_context and flags.max_model_len in (None, -1):
        requested_context = min(target_context, arch.max_position_embeddings)
    min_context = min(b.min_max_model_len, requested_context)
    if target_context:
        min_context = max(min_context, min(target_context, requested_context))
    cap = arch.max_position_embeddings

    notes: list[str] = []
    note = M.version_note(v)
    if note:
        notes.append(note)
    notes += list(arch.approximations)
    notes += _flag_notes(arch, device, flags, v)
    notes += list(ev.est.notes)
    refused = M.tp_refusal(arch, flags.tensor_parallel_size)
    if refused:
        notes.append(f"vLLM refuses this configuration: {refused}")
    if ev.est.startup_problem:
        notes.append(f"vLLM would stop at start-up: {ev.est.startup_problem}")

    max_context = estimated_max_model_len(ev.num_blocks, ev.block, cap, v)
    usable = ev.usable_blocks(margin=False)
    if auto_fit:
        starts = ev.startup_ok and max_context > 0
    else:
        starts = ev.startup_ok and ev.num_blocks > 0 and usable >= cdiv(requested_context, ev.block)
    model_fits = ev.startup_ok and ev.num_blocks > 0 and usable >= cdiv(min_context, ev.block)
    above_limit = requested_context > cap
    if refused or above_limit:
        starts = False
    max_for_target = (
        ev.context_for(concurrency, cap, margin=False) if target_concurrency is not None else None
    )
    # The target holds when ``concurrency`` requests of ``each`` tokens fit in the KV cache at once (the
    # target context; without one, the context vLLM runs with, which auto-fit sizes itself); never when
    # vLLM would not start with these flags.
    each = target_context or (max_context if auto_fit else requested_context)
    meets_target = each > 0 and ev.fits_context(each, concurrency, margin=False) and not refused
    short_of_target = bool(target_context and not auto_fit and requested_context < target_context)
    if short_of_target:
        meets_target = False
        notes.append(f"max_model_len {requested_context} is shorter than the target context {target_context}")
    fits = starts and meets_target
    in_margin = fits and not auto_fit and not ev.holds(requested_context, concurrency, each, margin=True)
    if in_margin:
        fits = False
        notes.append(
            f"as given it is predicted to fit by less than the {ev.margin / GIB:.2f} GiB kept spare for "
            "errors of the estimated parts (non-torch, activation, CUDA graphs)"
        )
    # what vLLM would do with these flags: the first reason they do not fit as given
    why = _why_not(
        ev,
        arch,
        requested_context=requested_context,
        auto_fit=auto_fit,
        refused=refused,
        starts=starts,
        short_of_target=short_of_target,
        meets_target=meets_target,
        concurrency=concurrency,
        each=each,
        in_margin=in_margin,
    )
    # changes never go above the model's limit
    asked_context = requested_context
    requested_context = min(requested_context, cap)
    min_context = min(min_context, requested_context)

    def recommend(f: EngineFlags, conc: int) -> _Choice | None:
        return _recommend(
            arch,
            device,
            f,
            concurrency=conc,
            requested_context=requested_context,
            min_context=min_context,
            version=v,
            calibration=calibration,
            bounds=b,
            target_concurrency=target_concurrency,
            per_request=target_context,
        )

    tp = flags.tensor_parallel_size
    found_by = _search_recommendation(
        arch, device, flags, b, v, calibration, target_concurrency, target_context, len(stages), auto_fit
    )
    costs: list[str] = []
    reduced: Reduction | None = None
    if found_by is not None:
        search, searched = found_by
        if searched.verdict != "does_not_fit":
            costs, reduced = search.costs(searched.flags), search.reduction(searched.flags)
        # the search answers "which flags" (the first launch of tune and run, the same code path)
        recommended = searched.flags if searched.verdict != "does_not_fit" else None
        choice: _Choice | None = None
        if recommended is not None:
            context = recommended.max_model_len or requested_context
            choice = _Choice(evaluate(arch, device, recommended, v, calibration), context)
            if context < requested_context:
                notes.append(
                    f"one request of {requested_context} tokens does not fit with "
                    f"{choice.ev.margin / GIB:.2f} GiB kept spare; recommended --max-model-len {context}"
                )
            if recommended.kv_cache_dtype != flags.kv_cache_dtype and recommended.fp8_kv:
                notes.append(
                    f"recommended KV cache dtype {recommended.kv_cache_dtype}: half the KV bytes per token"
                )
        else:
            notes.append("nothing within the bounds is predicted to fit; see the ways out")
        verdict = searched.verdict
        fits = verdict == "fits"
        reason = why or searched.reason
        if verdict == "does_not_fit" and why:
            reason = f"{why}; {searched.reason}"
    else:
        # The planner's own branch (CPU backend, pipeline stages, auto-fit). Levers beyond the flags
        # themselves: more of the GPUs present, then fp8 weights. A tensor-parallel size vLLM refuses is
        # replaced by the sizes it accepts up to the same GPU count.
        tp = flags.tensor_parallel_size
        variants = [flags] if not refused else []
        if refused:
            variants += [flags.replace(tensor_parallel_size=t) for t in reversed(M.valid_tp_sizes(arch, tp))]
        if b.allow_tensor_parallel and device.source == "probe" and device.count > tp:
            variants += [
                flags.replace(tensor_parallel_size=t) for t in M.valid_tp_sizes(arch, device.count) if t > tp
            ]
        if b.allow_weight_quantization and weight_method(arch, flags) is None:
            variants.append(flags.replace(quantization="fp8"))

        # the longest context (the requested one when a variant keeps it), then the fewest changed flags,
        # then the earlier variant (fewer GPUs)
        found = [c for c in (recommend(variant, concurrency) for variant in variants) if c is not None]
        choice = min(
            found,
            key=lambda c: (-min(c.context, requested_context), _changed(c.ev.flags, flags)),
            default=None,
        )
        target_missed = False
        if choice is None and concurrency > 1:
            for variant in variants:
                choice = recommend(variant, 1)
                if choice is not None:
                    target_missed = True
                    each = target_context or choice.context
                    served = choice.ev.usable_blocks(True) // cdiv(each, choice.ev.block)
                    notes.append(
                        f"the target of {concurrency} requests of {each} tokens at once is not met; the "
                        f"recommended flags hold {served} of them at once"
                    )
                    break

        recommended = choice.ev.flags if choice else None
        if choice is not None:
            if choice.context < requested_context:
                notes.append(
                    f"one request of {requested_context} tokens does not fit"
                    + ("" if target_context else f" {concurrency} times" if concurrency > 1 else "")
                    + f" with {choice.ev.margin / GIB:.2f} GiB kept spare; "
                    f"recommended --max-model-len {choice.context}"
                )
            if choice.ev.flags.kv_cache_dtype != flags.kv_cache_dtype and choice.ev.flags.fp8_kv:
                dtype = choice.ev.flags.kv_cache_dtype
                notes.append(f"recommended KV cache dtype {dtype}: half the KV bytes per token")
        else:
            notes.append("nothing within the bounds is predicted to fit; see the ways out")

        if fits:
            verdict, reason = "fits", why
        elif recommended is not None and not target_missed:
            verdict, reason = "fits_with_changes", why
        else:
            verdict = "does_not_fit"
            reason = why
            if target_missed and choice is not None:
                served = choice.ev.usable_blocks(True) // cdiv(
                    target_context or choice.context, choice.ev.block
                )
                reason += (
                    f"; within the bounds the target is not met (the recommended flags hold {served} of the "
                    f"{concurrency} requests at once)"
                )

    needs_way_out = not fits or recommended is None
    # ways out start from a tensor-parallel size vLLM accepts (the largest up to the one asked for)
    out_flags = flags.replace(tensor_parallel_size=max(M.valid_tp_sizes(arch, tp))) if refused else flags
    suggestions = (
        _suggestions(
            arch,
            device,
            out_flags,
            concurrency,
            requested_context,
            min_context,
            v,
            calibration,
            target_context=target_context,
            gpus_per_node=gpus_per_node or max(MAX_TP_SUGGESTED, tp),
        )
        if needs_way_out
        else []
    )
    return Plan(
        fits=fits,
        model_fits=model_fits,
        startup_problem=ev.est.startup_problem or (f"vLLM refuses it: {refused}" if refused else None),
        breakdown=ev.breakdown(device),
        kv_capacity_tokens=ev.num_blocks * ev.block,
        max_context=max_context,
        max_context_for_target=max_for_target,
        weights_gib=ev.weights / GIB,
        kv_bytes_per_token=ev.kv_bpt,
        recommended=recommended,
        suggestions=suggestions,
        notes=notes,
        starts_as_given=starts,
        meets_target=meets_target,
        num_blocks=ev.num_blocks,
        block_size=ev.block,
        max_model_len=asked_context,
        target_concurrency=target_concurrency,
        target_context=target_context,
        recommended_breakdown=choice.ev.breakdown(device) if choice else None,
        recommended_kv_capacity_tokens=choice.ev.num_blocks * choice.ev.block if choice else None,
        recommended_concurrency=(
            round(choice.ev.num_blocks / cdiv(choice.context, choice.ev.block), 2) if choice else None
        ),
        recommended_margin_gib=round(choice.ev.margin / GIB, 3) if choice else None,
        model=arch,
        device=PlanDevice.of(device, flags),
        flags=flags,
        vllm_version=str(v),
        version_note=note,
        engine=ev.est.rules.engine,
        assumed_defaults=ev.est.batch,
        measured=_measured(ev.est, calibration, v),
        estimate=ev.est.to_dict(),
        verdict=verdict,
        verdict_reason=reason,
        layout=_layout(arch, flags, gpus_per_node or max(MAX_TP_SUGGESTED, tp)),
        stage_breakdowns=(
            tuple(_breakdown(e, device) for e in M.evaluate_stages(arch, device, flags, v))
            if len(stages) > 1
            else ()
        ),
        costs=costs,
        reduced=reduced,
    )


def _search_recommendation(
    arch: ModelArch,
    device: DeviceFacts,
    flags: EngineFlags,
    bounds: Bounds,
    version: Version,
    calibration: Calibration | None,
    target_concurrency: int | None,
    target_context: int | None,
    stages: int,
    auto_fit: bool,
) -> Any:
    """(the search, its recommendation) (:meth:`r1sup.core.search.Search.recommend`) for these flags on a GPU
    box, as the first launch of ``tune`` and ``run`` gets it; None where the planner's own branches answer:
    the CPU backend, a model split over pipeline stages, ``--max-model-len -1`` (vLLM's auto-fit)."""
    from r1sup.core import search as S

    if device.backend == "cpu" or not device.gpus or stages > 1 or auto_fit:
        return None
    limits = replace(bounds, target_concurrency=target_concurrency, target_context=target_context)
    facts = S.Facts(
        arch=arch, device=device, user=flags, bounds=limits, version=version, calibration=calibration
    )
    search = S.Search(facts)
    return search, search.recommend()


def _layout(arch: ModelArch, flags: EngineFlags, gpus_per_node: int) -> Layout:
    """The GPUs these flags span: tensor parallel inside a node, pipeline stages across nodes."""
    return Layout(
        tensor_parallel_size=max(1, flags.tensor_parallel_size),
        pipeline_parallel_size=arch.pipeline_parallel_size,
        gpus_per_node=gpus_per_node,
        stage_layers=tuple(s.layers for s in M.pipeline_stages(arch)),
    )


def _why_not(
    ev: Evaluation,
    arch: ModelArch,
    *,
    requested_context: int,
    auto_fit: bool,
    refused: str | None,
    starts: bool,
    short_of_target: bool,
    meets_target: bool,
    concurrency: int,
    each: int,
    in_margin: bool,
) -> str:
    """The first reason vLLM would not run these flags as asked (what it checks first comes first), or
    what they hold when they fit."""
    cap = arch.max_position_embeddings
    est = ev.est
    if refused:
        return f"vLLM refuses it: {refused}"
    if requested_context > cap:
        return (
            f"vLLM refuses it: max_model_len {requested_context:,} is above the model's limit of {cap:,} "
            "tokens (max_position_embeddings)"
        )
    if est.startup_problem:
        return f"vLLM would not start: {est.startup_problem}"
    if est.flags.kv_cache_memory_bytes is None and ev.weights > est.budget:
        return (
            f"the weights alone ({ev.weights / GIB:.2f} GiB per GPU) exceed vLLM's budget "
            f"({est.budget / GIB:.2f} GiB)"
        )
    if ev.kv <= 0:
        return (
            f"vLLM would stop at start-up: no memory is left for the KV cache ({ev.kv / GIB:.2f} GiB after "
            "weights and overheads)"
        )
    if not starts:
        if auto_fit:
            return "vLLM would stop at start-up: not one block of KV cache fits"
        need = (cdiv(requested_context, ev.block) + 1) * ev.bytes_per_block
        return (
            f"vLLM would stop at start-up: one request of {requested_context:,} tokens needs "
            f"{need / GIB:.2f} GiB of KV cache and {max(0, ev.kv) / GIB:.2f} GiB is left (its estimated "
            f"maximum model length would be {est.max_model_len(cap):,})"
        )
    if short_of_target:
        return f"max_model_len {requested_context:,} is shorter than the target context"
    held = ev.usable_blocks(False) // max(1, cdiv(each, ev.block))
    if not meets_target:
        return (
            f"vLLM starts, but its KV cache holds {held} request(s) of {each:,} tokens at once where the "
            f"target is {concurrency}"
        )
    if in_margin:
        return (
            f"vLLM would start, but with less than the {ev.margin / GIB:.2f} GiB kept spare for errors of "
            "the estimated parts (non-torch, activation, CUDA graphs)"
        )
    return (
        f"KV cache holds {ev.num_blocks * ev.block:,} tokens ({ev.num_blocks:,} blocks): {held} request(s) "
        f"of {each:,} tokens at once"
    )


def origin(default: bool) -> str:
    """Where a batch limit the plan assumed comes from: vLLM's ``default``, or the ``flag``."""
    return "default" if default else "flag"


def _assumed_defaults(batch: M.Batch) -> dict[str, Any]:
    """``plan --json``'s ``assumed_defaults``: the batch limits the prediction assumed, vLLM's defaults for
    this GPU and version, and whether each limit is the default or the flag's."""
    return {
        "max_num_seqs": batch.max_num_seqs,
        "max_num_batched_tokens": batch.max_num_batched_tokens,
        "max_num_seqs_from": origin(batch.seqs_default),
        "max_num_batched_tokens_from": origin(batch.tokens_default),
        "defaults": batch.defaults.to_dict(),
    }


def _measured(est: M.Estimate, calibration: Calibration | None, version: Version) -> Calibrated | None:
    """Predicted beside measured, per term, where a calibration measured it."""
    if calibration is None:
        return None
    m = calibration.measured(version)

    def beside(term: M.Term, measured_gib: float | None) -> Beside | None:
        return None if measured_gib is None else Beside.of(term, measured_gib)

    return Calibrated(
        flags=calibration.flags,
        vllm_version=str(calibration.version) if calibration.version else None,
        weights=beside(est.weights, m.weights),
        non_torch=beside(est.non_torch, m.non_torch),
        activation=beside(est.activation, m.activation),
        cudagraph=beside(est.cudagraph, m.cudagraph),
        cudagraph_estimate=beside(est.cudagraph_estimate, m.cudagraph_estimate),
        kv=beside(est.kv, m.kv),
    )


def _changed(new: EngineFlags, old: EngineFlags) -> int:
    """How many flags other than the context differ: the recommendation's measure of "fewest changes"."""
    return sum(
        1
        for f in dataclasses.fields(EngineFlags)
        if f.name != "max_model_len" and getattr(new, f.name) != getattr(old, f.name)
    )


def _normalize_flags(flags: EngineFlags) -> EngineFlags:
    changes: dict[str, Any] = {}
    if flags.quantization is not None and flags.quantization.lower() == "none":
        changes["quantization"] = None
    dtype = (flags.kv_cache_dtype or "auto").lower()
    aliases = {"bf16": "bfloat16", "fp16": "float16"}
    if dtype in aliases:
        changes["kv_cache_dtype"] = aliases[dtype]
    return flags.replace(**changes) if changes else flags


def fp8_weights_note(version: Version) -> str | None:
    """How ``version`` reads ``--quantization fp8`` on a 16-bit checkpoint, where it has its own spelling."""
    if version < FP8_PER_TENSOR_SPELLING:
        return None
    return (
        f"vLLM {version} runs --quantization fp8 on a 16-bit checkpoint as its online fp8_per_tensor and "
        "logs that this spelling is deprecated for it (use --quantization fp8_per_tensor); both start"
    )


def _flag_notes(arch: ModelArch, device: DeviceFacts, flags: EngineFlags, version: Version) -> list[str]:
    notes: list[str] = []
    cc = device.compute_capability
    if device.backend != "cpu" and _e4m3((flags.kv_cache_dtype or "auto").lower()):
        if cc is not None and cc < (8, 9):
            notes.append(
                f"fp8 e4m3 KV is not recommended below compute capability 8.9 (this GPU: {cc[0]}.{cc[1]}); "
                "use --kv-cache-dtype fp8_e5m2"
            )
        elif cc is None:
            notes.append("compute capability unknown: below 8.9 use --kv-cache-dtype fp8_e5m2 instead of fp8")
    method = weight_method(arch, flags)
    if flags.quantization and flags.quantization.lower() == "fp8" and arch.quantization is None:
        note = fp8_weights_note(version)
        if note:
            notes.append(note)
    if method in FOUR_BIT_METHODS and arch.quantization not in FOUR_BIT_METHODS:
        notes.append(f"--quantization {method} needs a 4-bit {method.upper()} checkpoint of this model")
    if flags.max_model_len not in (None, -1) and int(flags.max_model_len) > arch.max_position_embeddings:
        notes.append(
            f"max_model_len {flags.max_model_len} is above the model's max_position_embeddings "
            f"({arch.max_position_embeddings}); vLLM refuses it unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"
        )
    if device.backend == "cuda" and device.count and flags.tensor_parallel_size > device.count:
        notes.append(
            f"tensor_parallel_size {flags.tensor_parallel_size} needs more GPUs than the "
            f"{device.count} present"
        )
    if flags.cpu_offload_gb:
        notes.append(
            f"--cpu-offload-gb {flags.cpu_offload_gb:g} keeps that much of the weights in host memory per "
            "GPU (slower: they cross PCIe every step)"
        )
    if device.backend == "cpu" and flags.kv_cache_memory_bytes is None:
        notes.append(
            "CPU backend: the KV cache is utilization x the NUMA node's memory minus the worker's RSS; "
            "pin it with --kv-cache-memory-bytes for a predictable size"
        )
    return notes


def _way_out(
    arch: ModelArch,
    device: DeviceFacts,
    flags: EngineFlags,
    *,
    concurrency: int,
    context: int,
    min_context: int,
    version: Version,
    calibration: Calibration | None,
    per_request: int | None,
) -> _Choice | None:
    """Exactly ``flags`` (no other lever) at ``context``, else at the longest block-aligned context down
    to ``min_context`` that holds; each with the margin kept for estimate errors. None: it does not fit.

    What it returns is what :func:`plan` says of these flags as given: they start, hold one request of
    the context and ``concurrency`` requests of ``per_request`` tokens (None: of the context) at once."""

    def at(length: int) -> Evaluation:
        return evaluate(arch, device, flags.replace(max_model_len=length), version, calibration)

    def holds(ev: Evaluation, length: int) -> bool:
        return ev.holds(length, concurrency, per_request or length, margin=True)

    ev = at(context)
    if holds(ev, context):
        return _Choice(ev, context)
    if not ev.startup_ok:
        return None
    if per_request is None:
        length = ev.context_for(concurrency, context, margin=True)
    else:
        length = ev.longest_context(concurrency, per_request, context, margin=True)
    # the context can change the batch vLLM profiles: check the shorter one itself, a block less at a time
    for _ in range(8):
        if length <= 0 or length < min_context:
            return None
        ev = at(length)
        if holds(ev, length):
            return _Choice(ev, length)
        length -= ev.block
    return None


def _suggestion(
    kind: str,
    title: str,
    choice: _Choice,
    arch: ModelArch,
    asked: int,
    requires: str | None = None,
    note: str | None = None,
    nodes: int = 1,
    gpus_per_node: int | None = None,
) -> Suggestion:
    ev = choice.ev
    if kind == "shorter_context":
        title = f"a shorter context ({choice.context:,} of the {asked:,} tokens asked)"
    elif choice.context < asked:
        title += f", context {choice.context:,} (of the {asked:,} asked)"
    return Suggestion(
        kind=kind,
        title=title,
        flags=ev.flags,
        fits=True,
        weights_gib=ev.weights / GIB,
        kv_gib=ev.kv / GIB,
        kv_capacity_tokens=ev.num_blocks * ev.block,
        max_context=ev.est.max_model_len(arch.max_position_embeddings),
        requires=requires,
        note=note,
        context=choice.context,
        concurrency=round(ev.usable_blocks(False) / cdiv(choice.context, ev.block), 2),
        pipeline_parallel_size=arch.pipeline_parallel_size,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
    )


def _at_util(at_util: str, flags: EngineFlags) -> str:
    """A way out's "at --gpu-memory-utilization U (what is free)", with the utilization it runs at."""
    return f" at --gpu-memory-utilization {flags.gpu_memory_utilization:g} (what is free)" if at_util else ""


MAX_PP_SUGGESTED = 8  # the most nodes (pipeline stages) a way out proposes


def _suggestions(
    arch: ModelArch,
    device: DeviceFacts,
    flags: EngineFlags,
    concurrency: int,
    context: int,
    min_context: int,
    version: Version,
    calibration: Calibration | None,
    target_context: int | None = None,
    gpus_per_node: int = MAX_TP_SUGGESTED,
) -> list[Suggestion]:
    """Ways out that fit, each one change to ``flags`` that its title names, with the figures of exactly
    its command (:func:`_way_out`). They ignore the ladder's allow_* bounds (a person decides);
    tensor-parallel sizes are only those vLLM accepts for this model (:func:`r1sup.core.memmodel.tp_refusal`),
    at most ``gpus_per_node``; beyond one node, pipeline stages over several nodes of that many GPUs.

    On a device with less free memory than ``flags`` ask for, every way out runs at the highest
    utilization that can start (the first way out, when that alone fits), and its title says so.
    """
    out: list[Suggestion] = []
    pinned = flags.kv_cache_memory_bytes is not None
    start_max = startable_utilization(device, flags.tensor_parallel_size, version)
    at_util = ""
    if not pinned and device.free_bytes and flags.gpu_memory_utilization > start_max:
        if start_max <= 0:
            return []
        flags = flags.replace(gpu_memory_utilization=start_max)
        at_util = f" at --gpu-memory-utilization {start_max:g} (what is free)"

    def fit(f: EngineFlags, a: ModelArch = arch) -> _Choice | None:
        if at_util and f.tensor_parallel_size != flags.tensor_parallel_size:
            # more GPUs, more CUDA context and communication memory on each: what is free allows less
            util = startable_utilization(device, f.tensor_parallel_size, version)
            f = f.replace(gpu_memory_utilization=min(f.gpu_memory_utilization, util))
        return _way_out(
            a,
            device,
            f,
            concurrency=concurrency,
            context=context,
            min_context=min_context,
            version=version,
            calibration=calibration,
            per_request=target_context,
        )

    def add(
        kind: str, title: str, f: EngineFlags, requires: str | None = None, note: str | None = None
    ) -> None:
        choice = fit(f)
        if choice is not None:
            out.append(_suggestion(kind, title + at_util, choice, arch, context, requires, note))

    if at_util:
        choice = fit(flags)
        if choice is not None:  # the utilization that can start is enough: no other lever needed
            note = "other processes hold the rest of the GPU; stopping them gives it back"
            return [
                _suggestion("utilization", "use the memory that is free", choice, arch, context, note=note)
            ]
    else:
        choice = fit(flags)
        if choice is not None and choice.context < context:
            out.append(_suggestion("shorter_context", "a shorter context", choice, arch, context))

    method = weight_method(arch, flags) if device.backend != "cpu" else "cpu"
    if not flags.fp8_kv and device.fp8_kv_supported is not False:
        fp8 = fp8_kv_choice(device)
        add("fp8_kv", f"fp8 KV cache ({fp8})", flags.replace(kv_cache_dtype=fp8))
    if method is None:
        notes = [n for n in (fp8_weights_note(version),) if n]
        if device.compute_capability is not None and device.compute_capability < (8, 9):
            notes.append(
                "below compute capability 8.9 vLLM runs fp8 weights with the weight-only Marlin kernel"
            )
        fp8_note = "; ".join(notes) or None
        add(
            "fp8_weights",
            "fp8 weights (quantized on the fly)",
            flags.replace(quantization="fp8"),
            note=fp8_note,
        )
    if method is None or method in FP8_WEIGHT_METHODS:
        add(
            "four_bit",
            "a 4-bit AWQ/GPTQ checkpoint",
            flags.replace(quantization="awq"),
            requires="a 4-bit AWQ (or GPTQ) checkpoint of this model",
        )
    single_node_fits = False
    if device.backend != "cpu":
        have = device.count if device.source == "probe" else None
        found: list[tuple[int, _Choice]] = []
        for tp in M.valid_tp_sizes(arch, gpus_per_node):
            if tp <= flags.tensor_parallel_size:
                continue
            choice = fit(flags.replace(tensor_parallel_size=tp))
            if choice is not None:
                found.append((tp, choice))
                if choice.context >= context:
                    break
        if found:
            tp, choice = next(((t, c) for t, c in found if c.context >= context), found[0])
            requires = f"{tp} GPUs like this one" + (f" ({have} present)" if have is not None else "")
            title = f"tensor parallel over {tp} GPUs" + _at_util(at_util, choice.ev.flags)
            out.append(_suggestion("tensor_parallel", title, choice, arch, context, requires))
            single_node_fits = choice.context >= context
    offload = _offload_gib(
        arch, device, flags, version, calibration, concurrency, context, min_context, target_context
    )
    if offload is not None:
        add(
            "cpu_offload",
            f"offload {offload} GiB of weights to host memory",
            flags.replace(cpu_offload_gb=float(offload)),
            requires=f"{offload * max(1, flags.tensor_parallel_size)} GiB of free host memory",
            note="slow: offloaded weights cross PCIe at every forward pass",
        )
    if device.backend != "cpu" and not flags.enforce_eager:
        add(
            "enforce_eager",
            "no CUDA graphs (--enforce-eager)",
            flags.replace(enforce_eager=True),
            note="frees the CUDA-graph memory; decoding gets slower",
        )
    base_seqs = evaluate(arch, device, flags, version, calibration).max_num_seqs
    if device.backend != "cpu" and base_seqs > 64 and flags.max_num_seqs is None:
        add(
            "fewer_seqs",
            "fewer sequences per batch (--max-num-seqs 64)",
            flags.replace(max_num_seqs=64),
            note="shrinks the sampler warm-up and CUDA graphs",
        )
    # beyond one node: when tensor parallel over one node's GPUs does not hold the context as asked
    if device.backend != "cpu" and not single_node_fits:
        multi = _multi_node(arch, device, flags, fit, context, gpus_per_node, at_util)
        if multi is not None:
            out.append(multi)
    return out


def _multi_node(
    arch: ModelArch,
    device: DeviceFacts,
    flags: EngineFlags,
    fit: Callable[[EngineFlags, ModelArch], _Choice | None],
    context: int,
    gpus_per_node: int,
    at_util: str,
) -> Suggestion | None:
    """The fewest nodes of ``gpus_per_node`` GPUs like this one that hold the context: tensor parallel
    over a node's GPUs (the largest size vLLM accepts), pipeline stages across the nodes."""
    sizes = M.valid_tp_sizes(arch, gpus_per_node)
    tp = max(sizes)
    for pp in range(max(2, arch.pipeline_parallel_size + 1), MAX_PP_SUGGESTED + 1):
        if M.pp_refusal(arch, pp):
            break
        split = M.pipelined(dataclasses.replace(arch, pipeline_parallel_size=1), pp)
        choice = fit(flags.replace(tensor_parallel_size=tp), split)
        if choice is None or choice.context < context:
            continue
        nodes = cdiv(tp * pp, gpus_per_node)
        name = M.gpu_name(device) or "GPU"
        where = f"{nodes} nodes" if nodes > 1 else "one node"
        title = (
            f"{where} of {gpus_per_node} x {name}: tensor parallel {tp} x pipeline parallel {pp}"
            + _at_util(at_util, choice.ev.flags)
        )
        return _suggestion(
            "pipeline_parallel",
            title,
            choice,
            split,
            context,
            requires=f"{nodes} nodes of {gpus_per_node} GPUs like this one, Ray across them (vLLM's "
            "multi-node serving)",
            note="figures per GPU of the fullest pipeline stage",
            nodes=nodes,
            gpus_per_node=gpus_per_node,
        )
    return None


def _offload_gib(
    arch: ModelArch,
    device: DeviceFacts,
    flags: EngineFlags,
    version: Version,
    calibration: Calibration | None,
    concurrency: int,
    context: int,
    min_context: int,
    target_context: int | None = None,
) -> int | None:
    """Whole GiB of weights to offload so that exactly ``flags`` plus the offload hold one request of
    ``context`` (else of ``min_context``) and ``concurrency`` requests of ``target_context`` (default: of
    that context) at once. None: no need, or it would take more than the weights."""
    if device.backend == "cpu" or flags.kv_cache_memory_bytes is not None:
        return None
    for length in dict.fromkeys((context, min_context)):
        ev = evaluate(
            arch, device, flags.replace(max_model_len=length, cpu_offload_gb=None), version, calibration
        )
        if not ev.startup_ok:
            return None
        each = target_context or length
        blocks_needed = max(cdiv(length, ev.block), concurrency * cdiv(each, ev.block)) + 1
        shortfall = blocks_needed * ev.bytes_per_block + ev.margin - ev.kv
        if shortfall <= 0:
            return None
        gib = math.ceil(shortfall / GIB)
        # the estimate's margin follows the flags: step up until exactly these flags hold the context
        while gib * GIB < ev.weights:
            choice = _way_out(
                arch,
                device,
                flags.replace(cpu_offload_gb=float(gib)),
                concurrency=concurrency,
                context=context,
                min_context=length,
                version=version,
                calibration=calibration,
                per_request=target_context,
            )
            if choice is not None:
                return gib
            gib += 1
    return None

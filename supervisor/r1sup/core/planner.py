"""The plan: a model's architecture + the device + engine flags + the vLLM version -> predicted memory and
the first flags to launch. Pure: plain data in, plain data out (no ``os``, no clock, no I/O).

Every figure comes from the memory model (:mod:`r1sup.core.memmodel`: weights, non-torch memory, the profile
run's activation peak, CUDA graphs, KV bytes per token, blocks and the null block, vLLM's batch
defaults, valid tensor-parallel sizes, each a function of the vLLM version), calibrated by what earlier
launches on the same box printed (:class:`r1sup.core.memmodel.Calibration`). The search
(:func:`r1sup.core.search.assess`) decides what to recommend with those figures; this module reports it,
with the ways out:

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
from dataclasses import dataclass, field
from typing import Any

from r1sup.core import memmodel as M
from r1sup.core import search as S
from r1sup.core import vllmversion
from r1sup.core.bounds import Bounds
from r1sup.core.capacity import Reduction
from r1sup.core.flags import EngineFlags
from r1sup.core.hardware import GIB, DeviceFacts
from r1sup.core.memmodel import (
    CPU_BLOCK_SIZE,
    CUDA_BLOCK_SIZE,
    FP8_WEIGHT_METHODS,
    Calibration,
    cdiv,
    startable_utilization,
    weight_method,
)
from r1sup.core.modelarch import ModelArch, arch_from_config
from r1sup.core.search import Choice, Evaluation, evaluate, fewer_seqs, fp8_kv_choice, fp8_weights_note
from r1sup.core.vllmversion import Version

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
]


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
    vllm_version: str = str(vllmversion.NEWEST_KNOWN)
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
# within the search's bounds (r1sup's code for "no working configuration").
VERDICTS = {"fits": 0, "fits_with_changes": 7, "does_not_fit": 3}


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
    proven: EngineFlags | None = None,
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
    ``calibration``: what a launch on this box printed (its terms replace the estimates);
    ``proven``: the flags of the saved profile ``run`` launches now (issue 36: the recommendation, with
    the figures of ``calibration``, that profile's launch).
    A tensor-parallel size vLLM refuses (heads not divisible) is never recommended nor proposed.
    A model split over pipeline stages (:func:`r1sup.core.memmodel.pipelined`) is sized per GPU of its
    fullest stage; ``gpus_per_node`` (default 8, or more GPUs when tensor parallel asks for more) sizes
    the multi-node way out ("2 nodes of 8 x H100 80GB: tensor parallel 8 x pipeline parallel 2").
    The verdict (:data:`VERDICTS`): "fits" (as given, exit 0), "fits_with_changes" (only with the
    recommended flags, exit 7), "does_not_fit" (nothing within the bounds, exit 3), with the reason.
    """
    a = S.assess(
        arch,
        device,
        flags,
        target_concurrency=target_concurrency,
        target_context=target_context,
        calibration=calibration,
        bounds=bounds,
        version=version,
        proven=proven,
    )
    v = a.v
    flags = a.flags
    stages = a.stages
    ev = a.ev
    concurrency = a.concurrency
    requested_context = a.requested_context
    asked_context = a.asked_context
    min_context = a.min_context
    notes = a.notes
    note = a.note
    refused = a.refused
    max_context = a.max_context
    starts = a.starts
    model_fits = a.model_fits
    max_for_target = a.max_for_target
    meets_target = a.meets_target
    fits = a.fits
    choice = a.choice
    recommended = a.recommended
    verdict = a.verdict
    reason = a.reason
    costs = a.costs
    reduced = a.reduced
    tp = a.tp
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
            target_concurrency=target_concurrency,
            bounds=bounds,
        )
        if needs_way_out
        else []
    )
    rec_blocks = choice.ev.num_blocks if choice else 0
    seen = calibration.figures.kv_cache_tokens if calibration is not None else None
    if choice and seen and calibration is not None and calibration.flags == recommended:
        rec_blocks = seen // choice.ev.block  # the flags of the launch that calibrated: the KV it measured
    return Plan(
        fits=fits,
        model_fits=model_fits,
        startup_problem=ev.est.startup_problem or (f"vLLM refuses it: {refused}" if refused else None),
        breakdown=_breakdown(ev.est, device),
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
        recommended_breakdown=_breakdown(choice.ev.est, device) if choice else None,
        recommended_kv_capacity_tokens=rec_blocks * choice.ev.block if choice else None,
        recommended_concurrency=(
            round(rec_blocks / cdiv(choice.context, choice.ev.block), 2) if choice else None
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


def _layout(arch: ModelArch, flags: EngineFlags, gpus_per_node: int) -> Layout:
    """The GPUs these flags span: tensor parallel inside a node, pipeline stages across nodes."""
    return Layout(
        tensor_parallel_size=max(1, flags.tensor_parallel_size),
        pipeline_parallel_size=arch.pipeline_parallel_size,
        gpus_per_node=gpus_per_node,
        stage_layers=tuple(s.layers for s in M.pipeline_stages(arch)),
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
) -> Choice | None:
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
        return Choice(ev, context)
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
            return Choice(ev, length)
        length -= ev.block
    return None


def _suggestion(
    kind: str,
    title: str,
    choice: Choice,
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
    target_concurrency: int | None = None,
    bounds: Bounds | None = None,
) -> list[Suggestion]:
    """Ways out that fit, each one change to ``flags`` that its title names, with the figures of exactly
    its command (:func:`_way_out`). They ignore the search's allow_* bounds (a person decides);
    tensor-parallel sizes are only those vLLM accepts for this model (:func:`r1sup.core.memmodel.tp_refusal`),
    at most ``gpus_per_node``; beyond one node, pipeline stages over several nodes of that many GPUs.

    On a device with less free memory than ``flags`` ask for, every way out runs at the highest
    utilization that can start (the first way out, when that alone fits), and its title says so.

    The 4-bit checkpoint is a different checkpoint, not a flag r1sup can change for the user: when it
    alone does not hold the context (its weights still fill the card), its way out is what the search
    recommends for that checkpoint within ``bounds`` (:func:`r1sup.core.search.assess`), the other
    changes named in its title.
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

    def fit(f: EngineFlags, a: ModelArch = arch) -> Choice | None:
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
        four = flags.replace(quantization="awq")
        choice = fit(four)
        title = FOUR_BIT_TITLE
        if choice is None:
            # the search's first flags for that checkpoint within the bounds, as plan() assesses flags
            choice = S.assess(
                arch,
                device,
                four,
                target_concurrency=target_concurrency,
                target_context=target_context,
                calibration=calibration,
                bounds=bounds,
                version=version,
            ).choice
            if choice is not None and choice.ev.flags.replace(max_model_len=None) != four.replace(
                max_model_len=None
            ):
                title += ", with " + _extra_changes(four, choice.ev.flags)
        if choice is not None:
            out.append(
                _suggestion(
                    "four_bit", title + at_util, choice, arch, context, FOUR_BIT_REQUIRES, FOUR_BIT_NOTE
                )
            )
    single_node_fits = False
    if device.backend != "cpu":
        have = device.count if device.source == "probe" else None
        found: list[tuple[int, Choice]] = []
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


# The 4-bit way out (issue 36): AWQ or GPTQ, 4-bit linear layers with an fp16 scale and a packed zero point
# per group of 128 (vLLM's AWQ/GPTQ linear methods; about 4.16 bits a parameter), the embeddings and the
# LM head kept in the model's dtype (vLLM quantizes only the linear layers of such a checkpoint), the KV
# cache in the model's dtype: :func:`r1sup.core.memmodel.weight_bytes_per_param`.
FOUR_BIT_TITLE = "a 4-bit checkpoint (AWQ or GPTQ)"
FOUR_BIT_REQUIRES = (
    "a 4-bit AWQ or GPTQ checkpoint of this model in place of this one (--model pointing at it; "
    "vLLM reads its method from the checkpoint, --quantization awq or gptq only names it)"
)
FOUR_BIT_NOTE = "4-bit weights: a small loss of accuracy"


def _extra_changes(base: EngineFlags, new: EngineFlags) -> str:
    """The vLLM arguments ``new`` adds to ``base`` beside the context (``--enforce-eager
    --gpu-memory-utilization 0.95``)."""
    before = set(_argv_items(base.replace(max_model_len=new.max_model_len).to_argv()))
    return " ".join(item for item in _argv_items(new.to_argv()) if item not in before)


def _argv_items(argv: list[str]) -> list[str]:
    """``["--a", "1", "--b"]`` -> ``["--a 1", "--b"]``: each option with its value."""
    items: list[str] = []
    for arg in argv:
        if arg.startswith("--") or not items:
            items.append(arg)
        else:
            items[-1] += f" {arg}"
    return items


def _multi_node(
    arch: ModelArch,
    device: DeviceFacts,
    flags: EngineFlags,
    fit: Callable[[EngineFlags, ModelArch], Choice | None],
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


# The CPU-offload way out is offered only where the GPU still does the work: at most this share of the
# weights goes to host memory, the GPU keeps at least a fifth of them (issue 36: "offload 61 GiB of
# weights ... weights 0.06 GiB" is no way out).
OFFLOAD_MAX_SHARE = 0.8


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
    that context) at once. None: no need, or it would take more than :data:`OFFLOAD_MAX_SHARE` of the
    weights (the GPU would no longer do the work: each forward pass would wait on PCIe for nearly all
    of them)."""
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
        while gib * GIB <= OFFLOAD_MAX_SHARE * ev.weights:
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

"""What r1sup knows about the box and the model before a launch, and the search and planner built on it.

Pure (core): :class:`ModelKnowledge` (the probed device, the model's architecture, the versions; gathered
by :func:`r1sup.adapters.knowledge.gather`), the search of a bring-up (:func:`new_search`), the
first launch's flags (:func:`first_decision`) and its reason with the box in it, the planner's plan for a
launch's flags (:func:`plan_for`, the one call the tuner and the run records make), and a calibration from
a launch's figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from r1sup.core import bounds as B
from r1sup.core import memmodel as M
from r1sup.core import modelarch, planner, vllmversion
from r1sup.core import search as S
from r1sup.core.config import Config
from r1sup.core.figures import Figures
from r1sup.core.flags import EngineFlags
from r1sup.core.hardware import GIB, DeviceFacts


@dataclass
class ModelKnowledge:
    """What r1sup knows about the box and the model before launching (for the planner and the search)."""

    device: DeviceFacts | None = None
    arch: modelarch.ModelArch | None = None  # when the model's config.json was found
    config_hash: str | None = None
    notes: list[str] = field(default_factory=list)
    # of server.python's vLLM, from the preflight (vllm.__version__; else the fingerprint's: adopt_versions)
    vllm_version: str | None = None
    torch_version: str | None = None

    def versions(self) -> dict[str, str | None]:
        """As the fingerprint keys them."""
        return {"vllm": self.vllm_version, "torch": self.torch_version}

    def version(self) -> vllmversion.Version:
        """The vLLM version the memory model sizes for (the newest it knows if unknown)."""
        try:
            return vllmversion.as_version(self.vllm_version)
        except ValueError:
            return vllmversion.NEWEST_KNOWN


def ladder_facts(know: ModelKnowledge, flags: EngineFlags, suggestions: tuple[str, ...] = ()) -> B.BlindFacts:
    """The box and the model as the search's branch without the architecture reads them."""
    bpt = None
    if know.arch is not None:
        bpt = M.kv_bytes_per_token(know.arch, "auto", flags.tensor_parallel_size)
    return B.BlindFacts.of_device(
        know.device,
        kv_bytes_per_token=bpt,
        model_max_len=getattr(know.arch, "max_position_embeddings", None) if know.arch is not None else None,
        suggestions=suggestions,
        vllm_version=str(know.version()),
        arch=know.arch,
    )


def new_search(
    config: Config,
    know: ModelKnowledge,
    calibration: M.Calibration | None = None,
    suggestions: tuple[str, ...] = (),
) -> S.Search:
    """The search for this bring-up (r1sup.core.search.Search): the box, the model, the user's flags and
    bounds, and the calibration of an earlier launch on this box (memmodel.Calibration, or None)."""
    user = EngineFlags.from_start(config.start)
    return S.Search(
        S.Facts(
            arch=know.arch,
            device=know.device or DeviceFacts(backend="cpu"),
            user=user,
            bounds=B.Bounds.from_config(config),
            version=know.version(),
            calibration=calibration,
            ladder_facts=ladder_facts(know, user, suggestions),
            suggestions=suggestions,
        )
    )


def launch_calibration(know: ModelKnowledge, flags: EngineFlags, figures: Figures) -> M.Calibration | None:
    """A calibration from one launch's figures (None when it printed none of the memory terms)."""
    if not figures.measures_memory:
        return None
    return M.Calibration(flags=flags, figures=figures, version=know.version())


def plan_for(
    config: Config, know: ModelKnowledge, flags: EngineFlags, calibration: M.Calibration | None = None
) -> planner.Plan | None:
    """The planner's plan for ``flags`` on the box as probed, with the config's target and bounds (the
    one way the tuner and the run records ask it); None without the model's architecture or a probe."""
    if know.arch is None or know.device is None:
        return None
    return planner.plan(
        know.arch,
        know.device,
        flags,
        target_concurrency=config.target.concurrency,
        target_context=config.target.context,
        bounds=B.Bounds.from_config(config),
        calibration=calibration,
        version=know.version(),
    )


def planner_suggestions(
    config: Config, know: ModelKnowledge, flags: EngineFlags, calibration: M.Calibration | None = None
) -> tuple[str, ...]:
    """The planner's ways out for ``flags`` (for a give-up message); () when it cannot plan."""
    try:
        plan = plan_for(config, know, flags, calibration)
    except (ValueError, ZeroDivisionError):
        return ()
    if plan is None:
        return ()
    return tuple(str(getattr(s, "summary", s)) for s in plan.suggestions)


def explain_first(why: str, know: ModelKnowledge) -> str:
    """The first launch's reason with what the box looked like, e.g. ``planned: gpu_memory_utilization
    0.9 -> 0.72 (free 17.4 of 23.6 GiB; pid 4242 python holds 6.0 GiB)``."""
    device = know.device
    if device is None or not device.gpus:
        return why
    free, total = device.free_bytes / GIB, device.total_bytes / GIB
    facts = [f"free {free:.1f} of {total:.1f} GiB"]
    facts += [f"pid {p.pid} {p.name} holds {p.used_bytes / GIB:.1f} GiB" for p in device.processes[:3]]
    return f"{why} ({'; '.join(facts)})"


def adopt_versions(know: ModelKnowledge, vllm: str | None) -> None:
    """The vLLM version the fingerprint learned from ``server.python`` (``vllm``:
    :func:`r1sup.state.profiles.fingerprint_vllm`), when nothing better is known."""
    if know.vllm_version is None and vllm:
        know.vllm_version = vllm


def first_decision(
    config: Config, know: ModelKnowledge, search: S.Search
) -> tuple[EngineFlags, str, S.GiveUp | None, S.Recommendation | None]:
    """The first launch's flags and why: the user's (``search.first_launch = "as_configured"``), or the
    search's recommendation (:meth:`r1sup.core.search.Search.recommend`, the flags ``r1sup plan``
    recommends); with the search's GiveUp when nothing within the bounds is predicted to fit (``r1sup
    plan``'s exit 3: then nothing is launched), and the recommendation itself when the search was asked."""
    flags = EngineFlags.from_start(config.start)
    if config.search.first_launch != "planned" or know.arch is None or know.device is None:
        return flags, "as configured", None, None
    rec = search.recommend()
    if rec.verdict == "does_not_fit":
        return flags, "the plan: " + rec.reason, rec.give_up, rec
    if rec.flags == flags:
        return flags, "as configured", None, rec
    return rec.flags, "planned: " + flags.describe_change(rec.flags), None, rec

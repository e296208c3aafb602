"""``r1sup tune``: the search as a one-shot; prints a report (or one JSON object) and exits."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from r1sup import logs
from r1sup.cli import load_config
from r1sup.errors import EXIT_SIGINT, EXIT_SIGTERM
from r1sup.runner import StopRequested
from r1sup.session import open_session, save_profile
from r1sup.tuner import Tuner, TuneResult


def main(args: argparse.Namespace) -> int:
    config = load_config(args)
    session = open_session(args, config)
    session.events.install_signal_handlers()
    try:
        from r1sup import profiles
        from r1sup.flags import EngineFlags
        from r1sup.tuner import calibration

        tuner = Tuner(config, session.runner, session.log)
        fingerprint = profiles.current_fingerprint(config, device=tuner.know.device)
        store = profiles.ProfileStore(config.state.dir)
        measured = calibration(store, fingerprint, EngineFlags.from_start(config.start))
        if measured:
            session.log.info("planner_calibrated", **measured)
        try:
            result = tuner.run(observations=measured)
        except StopRequested as stop:
            session.runner.stop_current(reason="signal")
            session.log.warning("tune_interrupted", signal=stop.signum)
            sys.stderr.write("r1sup: interrupted; vLLM stopped\n")
            return EXIT_SIGINT if stop.signum == 2 else EXIT_SIGTERM
        if result.ok:
            result.profile_path = save_profile(session, result, fingerprint)
    finally:
        session.events.restore_signal_handlers()
    text = json.dumps(result.to_dict(), indent=2, default=str) + "\n" if args.json else report(result)
    sys.stdout.write(logs.mask(text))
    return result.exit_code


def report(result: TuneResult) -> str:
    lines = [
        "",
        "r1sup tune: " + ("found a working configuration" if result.ok else "no working configuration"),
        "",
    ]
    rows = [("#", "outcome", "class", "phase", "secs", "flags", "evidence / next step")]
    for a in result.attempts:
        rows.append(
            (
                str(a.number),
                a.outcome,
                a.failure_class,
                a.phase if a.outcome != "ok" else "-",
                f"{a.seconds:.0f}",
                _flags_short(a.flags),
                (a.evidence[:90] + (" | " + a.change if a.change else ""))
                if a.outcome != "ok"
                else "probe passed",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    for r in rows:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r[:6], widths, strict=False)) + "  " + r[6])
    lines.append("")
    lines.append(f"launches: {result.launches}")
    if result.ok and result.flags is not None:
        lines.append("flags: " + " ".join(result.flags.to_argv()))
        if result.probe:
            p = result.probe
            lines.append(
                f"probe: {p.get('succeeded')}/{p.get('requests')} ok at concurrency {p.get('concurrency')}, "
                f"prompts of {p.get('prompt_tokens')} tokens, TTFT p50 {_num(p.get('ttft_p50_s'))}s "
                f"p95 {_num(p.get('ttft_p95_s'))}s, {_num(p.get('output_tokens_per_s'))} output tok/s, "
                f"peak KV usage {_pct(p.get('peak_kv_usage'))}, preemptions {p.get('preemptions')}"
            )
        lines.append("vLLM command line:")
        lines.append("  " + " ".join(_quote(a) for a in result.command))
        lines.append(f"profile: {result.profile_path or 'NOT saved (see the log)'}")
    else:
        lines.append(f"why: {result.reason}")
        for s in result.suggestions:
            lines.append(f"  way out: {s}")
    lines.append("")
    return "\n".join(lines)


def _flags_short(flags: dict[str, Any]) -> str:
    parts = []
    if flags.get("max_model_len"):
        parts.append(f"ctx={flags['max_model_len']}")
    parts.append(f"util={flags.get('gpu_memory_utilization')}")
    if flags.get("kv_cache_dtype") not in (None, "auto"):
        parts.append(f"kv={flags['kv_cache_dtype']}")
    if flags.get("enforce_eager"):
        parts.append("eager")
    if flags.get("max_num_seqs"):
        parts.append(f"seqs={flags['max_num_seqs']}")
    if flags.get("max_num_batched_tokens"):
        parts.append(f"batched={flags['max_num_batched_tokens']}")
    if flags.get("quantization"):
        parts.append(f"q={flags['quantization']}")
    if flags.get("tensor_parallel_size", 1) != 1:
        parts.append(f"tp={flags['tensor_parallel_size']}")
    return " ".join(parts)


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)


def _pct(value: Any) -> str:
    return "-" if value is None else f"{value:.0%}"


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)

"""``r1sup tune``: the search as a one-shot; prints a report (or one JSON object) and exits.

The report is rendered from the run record (r1sup.state.runrecord) that ``r1sup report`` reads later, so the
two always tell the same story.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Generator
from dataclasses import replace
from typing import Any

from r1sup.adapters import logs
from r1sup.cli.app import load_config
from r1sup.core import failure as F
from r1sup.core import slo
from r1sup.core.errors import (
    EXIT_INTERNAL,
    EXIT_NO_WORKING_CONFIG,
    EXIT_SIGHUP,
    EXIT_SIGINT,
    EXIT_SIGTERM,
    InternalError,
    R1supError,
)
from r1sup.core.events import InternalFault, SloLevelMeasured, SloRelaunched, SloSearched, TuneInterrupted
from r1sup.core.multinode import check_leader
from r1sup.supervision.loop import Phase, StopRequested
from r1sup.supervision.session import Session, log_only, open_session
from r1sup.supervision.tuner import Tuner, TuneResult


def main(args: argparse.Namespace) -> int:
    from r1sup.cli import report

    config = load_config(args)
    check_leader(config.multinode, "tune")
    session = open_session(args, config)
    # SIGHUP (the terminal closed) stops a tune as SIGTERM does, vLLM first, unless it was ignored when
    # the tune started (nohup): a one-shot has no config to reload
    stops: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        stops += (signal.SIGHUP,)
    session.events.hangup_stops = True
    session.events.install_signal_handlers(stops)
    try:  # the whole tune in one run of the loop
        done: tuple[TuneResult, Any] | int = session.runner.loop.run(_script(session))
    finally:
        # stopped by a signal, vLLM already stopped: the stop signals are ignored from here (one more while
        # the process ends must not end it by the signal instead of 129/130/143); else the previous ones
        session.events.restore_signal_handlers()
    if isinstance(done, int):
        return done
    result, record = done
    # --json: the result, and what its probe proved (r1sup.core.capacity; null without a passed probe)
    verified = report.record_capacity(record.data) if result.ok else None
    doc = {**result.to_dict(), "capacity": verified.to_dict() if verified is not None else None}
    text = json.dumps(doc, indent=2, default=str) + "\n" if args.json else report.render_text(record.data)
    sys.stdout.write(logs.mask(text))
    if result.ok and not result.profile_path:  # found but not kept (full disk, read-only state): exit 1
        sys.stderr.write("r1sup: error: the working configuration was found but its profile was not saved\n")
        return EXIT_INTERNAL
    return result.exit_code


def _script(session: Session) -> Generator[Phase, Any, tuple[TuneResult, Any] | int]:
    """The tune's waits as the loop's script: the result and its run record, or the exit code of a
    stop signal (vLLM stopped); an error stops vLLM and goes on to the CLI."""
    try:
        return (yield from _tune(session))
    except StopRequested as stop:
        yield from session.runner.stop_current(reason="signal")
        log_only(session.log)(TuneInterrupted(stop.signum))
        sys.stderr.write("r1sup: interrupted; vLLM stopped\n")
        return (
            EXIT_SIGINT
            if stop.signum == signal.SIGINT
            else EXIT_SIGHUP
            if stop.signum == signal.SIGHUP
            else EXIT_SIGTERM
        )
    except InternalError as exc:
        yield from _internal(session, exc)
        raise
    except R1supError:  # the preflight's (nothing launched) and the like: the CLI prints the line
        yield from session.runner.stop_current(reason="failed")
        raise
    except Exception as exc:  # r1sup's own failure: stop vLLM cleanly, then one line and exit 1
        internal = InternalError.from_exception(exc)
        yield from _internal(session, internal)
        raise internal from None


def _internal(session: Session, fault: InternalError) -> Generator[Phase, Any, None]:
    log_only(session.log)(InternalFault(fault.where, fault.error, fault.trace))
    yield from session.runner.stop_current(reason="internal error")


def _tune(session: Session) -> Generator[Phase, Any, tuple[TuneResult, Any]]:
    """Preflight, knowledge, the search, the saved profile; returns the result and its run record."""
    from r1sup.core.flags import EngineFlags
    from r1sup.state import fleet, runrecord
    from r1sup.supervision import bringup
    from r1sup.supervision.footing import footing

    config = session.config
    publish = log_only(session.log)  # no daemon's bus: what the fleet and the footing tell, the log writes
    checked = yield from session.preflight()  # before any model load; raises with nothing launched
    know = session.runner.world.knowledge(config, session.log, engine=checked.engine)
    record = runrecord.RunLog(config.state.dir, "tune", config, None)
    tuner = Tuner(config, session.runner, session.log, know=know, record=record)
    record.device(know.device)
    base = footing(config, know)
    session.runner.expected_phases = base.expected_phases
    # the fleet's store: a profile tuned for this fingerprint elsewhere is checked with one launch and
    # the probe; without one this replica tunes, holding the key's lease until its profile is published
    shared = (
        (yield from session.runner.consult_fleet(base.key, publish))
        if config.state.profile_store
        else fleet.Consulted()
    )
    try:
        start = EngineFlags.from_dict(shared.profile.flags) if shared.profile is not None else None
        measured = None if start else base.calibration(publish)
        slo_on = config.slo.enabled and config.probe.enabled
        result = yield from tuner.run(start, calibration=measured, keep_running=slo_on)
        if result.ok and result.live is not None:  # [slo]: load levels on the server as it runs
            live, result.live = result.live, None
            try:
                result.slo = yield from _service_level(session, result.flags, live, config.slo)
            finally:
                yield from session.runner.stop(live, reason="tune finished")
            yield from _relaunch_step(session, tuner, result)
            if result.slo.verdict == slo.IMPOSSIBLE:
                result.exit_code, result.reason = EXIT_NO_WORKING_CONFIG, result.slo.reason
        if result.ok:  # kept with the box's conditions, as run keeps it (a degraded one beside the best)
            kept = bringup.keep(session, result, base.fingerprint, know, base.key, tell=publish)
            result.profile_path = kept.path
            record.finish(result.to_dict())
    finally:
        shared.release()
    return result, record


def _service_level(
    session: Session, flags: Any, live: Any, slo_config: Any
) -> Generator[Phase, Any, slo.SloResult]:
    """The ``[slo]`` search on the running server (r1sup.adapters.loadlevel), off the loop's thread: the
    highest concurrency that meets the targets, or the floor that one request at a time gets."""
    from r1sup.adapters import loadlevel

    config = session.config
    server = loadlevel.Server(
        base_url=session.runner.endpoint.base,
        model=live.spec.served_name,
        api_key=session.runner.api_key,
        request_timeout_s=config.probe.request_timeout_s,
    )
    cap = flags.max_num_seqs if flags is not None else None
    as_dict = flags.to_dict() if flags is not None else {}

    publish = log_only(session.log)

    def tell(level: slo.Level) -> None:
        publish(SloLevelMeasured(level))

    def work(cancelled: Any) -> slo.SloResult:
        return loadlevel.search(slo_config, server, flags=as_dict, cap=cap, check=cancelled, tell=tell)

    found: slo.SloResult = yield from session.runner.off_loop("slo", work)
    publish(SloSearched(found))
    return found


def _relaunch_step(session: Session, tuner: Tuner, result: TuneResult) -> Generator[Phase, Any, None]:
    """One relaunch with a flag changed where the levels say the flag, not the engine, bounded the proven
    capacity (r1sup.core.slo.relaunch_step); the better proven point is kept. The relaunch is checked
    as every launch is (the KV cache's room, the probe): one that fails is stopped and the first flags,
    proven to start, stay; nothing is left running either way. Bounded by what is left of
    ``slo.budget_s``. It is an attempt of the run record (and of the result) like the search's own, its
    ``why`` the levels' evidence and its ``change`` what its levels proved."""
    config = session.config
    first = result.slo
    if result.flags is None or first is None:
        return
    batched = _batched_tokens(tuner, result)
    step = slo.relaunch_step(
        first, result.flags.max_num_seqs, config.slo.max_concurrency, batched_tokens=batched
    )
    left = config.slo.budget_s - first.seconds
    if step is None or left <= 0:
        return
    publish = log_only(session.log)
    if step.flag == "max_num_seqs":
        flags = replace(result.flags, max_num_seqs=step.new)
    else:
        flags = replace(result.flags, max_num_batched_tokens=step.new)
    number = len(result.attempts) + 1
    t0 = time.monotonic()
    launch = yield from session.runner.launch(flags, attempt=number)
    result.launches += 1 if launch.started_engine else 0
    second: slo.SloResult | None = None
    try:
        failure = launch.failure
        if failure.cls == F.NONE and launch.ready:
            failure = session.runner.capacity_failure(launch) or F.NO_FAILURE
            if failure.cls == F.NONE:
                failure = yield from session.runner.probe(launch)
        if failure.cls == F.NONE:
            second = yield from _service_level(session, flags, launch, replace(config.slo, budget_s=left))
    finally:
        yield from session.runner.stop(launch, reason="slo relaunch measured")
    change = f"{step.flag} {step.old} -> {step.new} ({step.why})"
    if second is None:
        outcome = f"the relaunch failed ({failure.cls}): the first flags, proven, are kept"
    elif second.requests > first.requests:
        outcome = f"proved {second.requests} requests at once (was {first.requests}): kept"
    else:
        outcome = f"proved {second.requests} requests at once, no more than {first.requests}: the first kept"
    publish(SloRelaunched(step.flag, step.old, step.new, step.why, outcome))
    attempt = tuner.attempt_of(number, flags, launch, failure, t0, f"slo relaunch: {step.why}")
    attempt.change = outcome
    result.attempts.append(attempt)
    if tuner.record is not None:
        tuner.record.attempt(attempt.to_dict())
    if second is not None and second.requests > first.requests:
        result.flags = flags
        seconds = round(first.seconds + second.seconds, 2)
        result.slo = replace(second, launches=1, relaunch=f"{change}; {outcome}", seconds=seconds)
    else:
        result.slo = replace(first, launches=1, relaunch=f"{change}; {outcome}")


def _batched_tokens(tuner: Tuner, result: TuneResult) -> int | None:
    """The prefill budget the proven launch ran with: its flag, else what vLLM printed
    (``Chunked prefill is enabled with max_num_batched_tokens=N``), else vLLM's default for this device
    and release (r1sup.core.memmodel.resolve_batch); None when none of them is known."""
    from r1sup.core import memmodel

    flags = result.flags
    if flags is None:
        return None
    if flags.max_num_batched_tokens:
        return flags.max_num_batched_tokens
    if result.figures.max_num_batched_tokens:
        return int(result.figures.max_num_batched_tokens)
    know = tuner.know
    if know.arch is None or know.device is None:
        return None
    try:
        return memmodel.resolve_batch(know.arch, know.device, flags, know.version()).max_num_batched_tokens
    except (ValueError, ZeroDivisionError):
        return None

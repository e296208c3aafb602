"""``r1sup tune``: the search as a one-shot; prints a report (or one JSON object) and exits.

The report is rendered from the run record (r1sup.runrecord) that ``r1sup report`` reads later, so the
two always tell the same story.
"""

from __future__ import annotations

import argparse
import json
import sys

from r1sup import logs
from r1sup.cli import load_config
from r1sup.errors import EXIT_SIGINT, EXIT_SIGTERM
from r1sup.runner import StopRequested
from r1sup.session import open_session, save_profile
from r1sup.tuner import Tuner


def main(args: argparse.Namespace) -> int:
    config = load_config(args)
    session = open_session(args, config)
    session.events.install_signal_handlers()
    try:
        from r1sup import profiles, report, runrecord
        from r1sup.flags import EngineFlags
        from r1sup.tuner import calibration

        record = runrecord.RunLog(config.state.dir, "tune", config, None)
        tuner = Tuner(config, session.runner, session.log, record=record)
        record.device(tuner.know.device)
        fingerprint = profiles.current_fingerprint(config, device=tuner.know.device)
        store = profiles.ProfileStore(config.state.dir)
        measured = calibration(store, fingerprint, EngineFlags.from_start(config.start))
        if measured:
            session.log.info("planner_calibrated", **measured)
        session.runner.expected_phases = runrecord.expected_phases(store, fingerprint)
        try:
            result = tuner.run(observations=measured)
        except StopRequested as stop:
            session.runner.stop_current(reason="signal")
            session.log.warning("tune_interrupted", signal=stop.signum)
            sys.stderr.write("r1sup: interrupted; vLLM stopped\n")
            return EXIT_SIGINT if stop.signum == 2 else EXIT_SIGTERM
        if result.ok:
            result.profile_path = save_profile(session, result, fingerprint)
            record.finish(result.to_dict())
    finally:
        session.events.restore_signal_handlers()
    text = (
        json.dumps(result.to_dict(), indent=2, default=str) + "\n"
        if args.json
        else report.render_text(record.data)
    )
    sys.stdout.write(logs.mask(text))
    return result.exit_code

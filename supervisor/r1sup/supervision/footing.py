"""What a search starts from, the same for ``tune`` and ``run``: what is known of the device and the
model (gathered by :func:`r1sup.adapters.knowledge.gather`), the first launch's flags
(:func:`plan_first_decision`), this config's fingerprint on this box with its key and the profile store
(:class:`Footing`), and the memory model's calibration from an earlier launch. The decisions are the
core's (:mod:`r1sup.core.knowledge`), the lookup the state's (:mod:`r1sup.state.calibration`); this module
puts them together and says what it found as events (written by the log's sink:
:func:`r1sup.supervision.subscribers.logging_bus`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from r1sup.core.config import Config
from r1sup.core.events import PlanMade, PlannerCalibrated, Publish
from r1sup.core.flags import EngineFlags
from r1sup.core.knowledge import ModelKnowledge, adopt_versions, first_decision
from r1sup.supervision.subscribers import logging_bus


def plan_first_decision(
    config: Config, know: ModelKnowledge, search: Any, log: Any
) -> tuple[EngineFlags, str, Any]:
    """The first launch's flags, why, and the search's GiveUp when nothing within the bounds is predicted
    to fit (:func:`r1sup.core.knowledge.first_decision`); the search's recommendation, when it was asked,
    is published (``plan_made``)."""
    flags, why, give_up, rec = first_decision(config, know, search)
    if rec is not None:
        asked = EngineFlags.from_start(config.start)
        logging_bus(log).publish(PlanMade(rec.flags, rec.verdict, asked.describe_change(rec.flags)))
    return flags, why, give_up


@dataclass(frozen=True)
class Footing:
    """What a search starts from, the same for ``tune`` and ``run``: this config's fingerprint on this
    box, its key, the profile store, and the seconds per loading phase of this fingerprint's last launch
    (the runner's ETA takes them: ``runner.expected_phases``)."""

    fingerprint: dict[str, Any]
    key: str
    store: Any  # profiles.ProfileStore
    expected_phases: dict[str, float] = field(default_factory=dict)

    def calibration(self, publish: Publish) -> Any:
        """The planner's calibration from an earlier launch on this box (published), or None."""
        from r1sup.state.calibration import calibration

        measured = calibration(self.store, self.fingerprint)
        if measured is not None:
            publish(PlannerCalibrated(measured.flags, measured.figures.to_dict()))
        return measured


def footing(config: Config, know: ModelKnowledge) -> Footing:
    """The fingerprint (the vLLM version it learned adopted into ``know``), its key, the store and the
    phase times of this fingerprint's last launch (for the runner's ETA)."""
    from r1sup.state import profiles, runrecord

    fingerprint = profiles.current_fingerprint(config, device=know.device, versions=know.versions())
    adopt_versions(know, profiles.fingerprint_vllm(fingerprint))
    store = profiles.ProfileStore(config.state.dir)
    phases = runrecord.expected_phases(store, fingerprint)
    return Footing(fingerprint, profiles.fingerprint_key(fingerprint), store, phases)

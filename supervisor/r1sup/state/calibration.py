"""The memory model's calibration from the profile store: what an earlier launch of the same model on
the same box and vLLM version printed, with its flags (:class:`r1sup.core.memmodel.Calibration`)."""

from __future__ import annotations

from typing import Any

from r1sup.core import memmodel, vllmversion
from r1sup.core.flags import EngineFlags
from r1sup.state import profiles

CALIBRATION_KEYS = ("backend", "gpu", "cpu", "versions", "model")


def calibration(store: Any, fingerprint: dict[str, Any]) -> memmodel.Calibration | None:
    """The memory model's calibration from the newest profile of the same model on the same box and
    vLLM version (this fingerprint's, or one for another target or bounds): what that launch printed,
    with its flags (memmodel.Calibration), or None. The model moves each figure to other flags itself."""
    found = calibration_source(store, fingerprint)
    return found[0] if found is not None else None


def calibration_source(
    store: Any, fingerprint: dict[str, Any]
) -> tuple[memmodel.Calibration, profiles.Profile] | None:
    """:func:`calibration` with the profile it comes from (``r1sup plan`` says which), or None."""
    found = store.load(profiles.fingerprint_key(fingerprint))
    same = [found] if found is not None else []
    same += [
        p
        for p, _ in store.near_misses(fingerprint)
        if all(p.fingerprint.get(k) == fingerprint.get(k) for k in CALIBRATION_KEYS)
    ]
    for profile in same:  # this box's own profile first, then the newest
        figures = profile.observations
        if not figures:
            continue
        try:
            flags = EngineFlags.from_dict(profile.flags)
            version = vllmversion.as_version(profiles.fingerprint_vllm(profile.fingerprint))
        except (TypeError, ValueError):
            continue
        return memmodel.Calibration(flags=flags, figures=figures, version=version), profile
    return None

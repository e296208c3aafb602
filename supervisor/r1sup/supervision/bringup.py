"""What ``tune`` and ``run`` do with a configuration that passed, the same for both: the capacity its
probe proved (:func:`result_capacity`), the box's conditions it was found under, degraded when other
processes' memory made it worse than the box gives (:func:`found_conditions`), and the profile that keeps
it all (:func:`keep`: saved here, published to the fleet's store unless degraded; a degraded one is kept
beside the best under its own key).

Where the bring-up starts (the fingerprint, its key, the calibration) is :mod:`r1sup.supervision.footing`;
the search between is :class:`r1sup.supervision.tuner.Tuner`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from r1sup.core.capacity import Capacity, Reduction
from r1sup.core.events import ProfileDegraded, Publish
from r1sup.core.hardware import Conditions

if TYPE_CHECKING:
    from r1sup.core.knowledge import ModelKnowledge
    from r1sup.supervision.session import Session


@dataclass(frozen=True)
class Kept:
    """Where the profile of a passed configuration went (None: saving failed, logged) and, when other
    processes' memory made it worse than the box gives, why (the profile is then the degraded one)."""

    path: str | None
    degraded: str | None = None


def keep(
    session: Session,
    result: Any,
    fingerprint: dict[str, Any],
    know: ModelKnowledge | None,
    key: str,
    *,
    tell: Publish,
) -> Kept:
    """Save a passed configuration with the conditions it was found under (:func:`found_conditions`; a
    degraded one published as :class:`ProfileDegraded` under ``key``, the best profile's), what the store
    said going to ``tell``."""
    found = found_conditions(know, result)
    degraded = found.degraded if found is not None and found.degraded else None
    if degraded:
        tell(ProfileDegraded(key, degraded))
    return Kept(save_profile(session, result, fingerprint, found, tell=tell), degraded)


def found_conditions(know: ModelKnowledge | None, result: Any) -> Conditions | None:
    """The conditions a passed configuration was found under (:func:`r1sup.core.search.conditions`),
    marked ``degraded`` when other processes' memory made its flags worse than what the box gives
    without them (:func:`r1sup.core.profile_fit.degraded_by_others`); None without a GPU."""
    from r1sup.core import profile_fit, search

    found = search.conditions(know.device if know is not None else None)
    engine = result.history
    why = (
        profile_fit.degraded_by_others(engine, result.flags, found)
        if engine is not None and result.flags
        else None
    )
    return replace(found, degraded=why) if why and found is not None else found


def result_capacity(config: Any, result: Any) -> Capacity | None:
    """The verified capacity of a passed tune result (r1sup.core.capacity), with the search's own verdict
    on whether it is reduced when the result carries one."""
    from r1sup.core import capacity

    return capacity.verified(
        result.probe,
        result.flags.max_model_len if result.flags is not None else None,
        result.figures,
        capacity.asked(config),
        reduced=bool(getattr(result, "reduced", None)),
        stands_on=getattr(result, "stands_on", None),
    )


def save_profile(
    session: Session,
    result: Any,
    fingerprint: dict[str, Any],
    conditions: Conditions | None = None,
    *,
    tell: Publish,
) -> str | None:
    """Persist a passed configuration (and publish it to the fleet's store, if there is one, what the
    store said going to ``tell``, the caller's publish); returns the local path, or None when saving
    failed (logged). ``conditions`` (search.conditions) are saved
    with it (:func:`stored_conditions`); a profile they mark ``degraded`` is kept beside the best one under
    its own key (profiles.degraded_fingerprint) and never published."""
    from r1sup.state import profiles

    degraded = conditions is not None and bool(conditions.degraded)
    fp = profiles.degraded_fingerprint(fingerprint) if degraded else fingerprint
    profile = profiles.Profile.create(
        fingerprint=fp,
        model=session.config.model.name,
        served_name=session.config.served_name,
        flags=result.flags,
        command=list(result.command),
        probe=result.probe.to_dict() if result.probe is not None else None,
        observations=result.figures,
        attempts=[a.to_dict() for a in result.attempts],
    )
    stored = stored_conditions(conditions, getattr(result, "reduced", None))
    if stored:
        profile = replace(profile, conditions=stored)
    verified = result_capacity(session.config, result)
    if verified:
        profile = replace(profile, capacity=verified.to_dict())
    if getattr(result, "slo", None) is not None:
        profile = replace(profile, slo=result.slo.to_dict())
    path = profiles.ProfileStore(session.config.state.dir).save(profile)
    if session.config.state.profile_store and not degraded:
        from r1sup.state import fleet

        fleet.publish(session.config, profile, tell=tell)
    return str(path) if path is not None else None


def stored_conditions(conditions: Conditions | None, reduced: Reduction | None) -> dict[str, Any]:
    """A profile's ``conditions`` object: what the box looked like (:meth:`Conditions.to_dict`) and, when
    the flags give up more than half the asked context or serve fewer sequences than asked, ``reduced``
    (the search's reduction); {} when there is neither (the profile then holds no ``conditions``)."""
    stored = conditions.to_dict() if conditions is not None else {}
    if reduced is not None:
        stored["reduced"] = reduced.to_dict()
    return stored

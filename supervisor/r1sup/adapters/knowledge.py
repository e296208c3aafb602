"""What r1sup learns of the box and the model before a search (:func:`gather`): the device facts (NVML,
or the CPU backend's view) and the model's architecture from its ``config.json``, best effort. The
decisions made from them are the core's (:mod:`r1sup.core.knowledge`); what was missing is said as events.
"""

from __future__ import annotations

from typing import Any

from r1sup.core.config import Config
from r1sup.core.events import DeviceProbeFailed, PlannerNote, Publish
from r1sup.core.knowledge import ModelKnowledge


def gather(config: Config, publish: Publish, engine: Any = None) -> ModelKnowledge:
    """Device facts and the model's architecture, best effort: missing pieces only make the search blunter.

    ``engine`` is the preflight's :class:`r1sup.adapters.preflight.EngineEnv` (the versions of vLLM and
    torch); what could not be learned goes to ``publish`` (``device_probe_failed``, ``planner_note``)."""
    from r1sup.adapters import devices, modelinfo
    from r1sup.core import modelarch
    from r1sup.core.errors import ConfigError

    know = ModelKnowledge()
    if engine is not None:
        know.vllm_version, know.torch_version = engine.version, engine.torch_version
    try:
        know.device = devices.probe()
    except Exception as exc:  # noqa: BLE001 - device probing must never stop a launch
        publish(DeviceProbeFailed(f"{type(exc).__name__}: {exc}", search=True))
    try:
        model_config = modelinfo.load_model_config(config.model.name, config.model.revision)
        know.arch = modelarch.arch_from_config(model_config)
        know.config_hash = modelinfo.config_hash(model_config)
    except ConfigError as exc:
        know.notes.append(f"model architecture unknown ({exc.message}); the search uses vLLM's numbers only")
    except (ValueError, KeyError, TypeError) as exc:
        know.notes.append(f"model config.json not understood ({exc}); the search uses vLLM's numbers only")
    for note in know.notes:
        publish(PlannerNote(note))
    return know

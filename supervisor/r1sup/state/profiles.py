"""Persisted working configurations ("profiles"), keyed by a fingerprint of what makes them valid.

A profile holds the flags that started and passed the probe, the exact vLLM command line (API key
masked), the probe results, the measured memory breakdown and the history of attempts. Its key is a
hash of the fingerprint: GPU names, count, memory, compute capability and driver (or CPU model and
host memory), vLLM and torch versions, model id and config hash, the target and r1sup's major
version. Same key: launch once with the saved flags. Different key: re-tune.

Files live in ``<state dir>/profiles/<key>.json`` (0600, directory 0700) and are written with
:func:`r1sup.adapters.statefiles.atomic_write_json`. A path is only ever built from a validated key, never
from a profile's content.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from r1sup import __version__
from r1sup.adapters.logs import get_logger
from r1sup.adapters.statefiles import (
    SCHEMA_VERSION,
    StateWriteError,
    atomic_write_json,
    ensure_state_dir,
    ensure_subdir,
    inspect_json,
    parse_iso,
    remove_stale_temp_files,
    set_file_aside,
    utc_now_iso,
)
from r1sup.core.errors import ConfigError, PreflightError, R1supError
from r1sup.core.figures import EMPTY as NO_FIGURES
from r1sup.core.figures import FIELD_NAMES as FIGURE_NAMES
from r1sup.core.figures import Figures
from r1sup.core.figures import out_of_bounds as figure_out_of_bounds
from r1sup.core.flags import EngineFlags

if TYPE_CHECKING:  # the device probe's types: only for the fingerprint, not to read profiles
    from r1sup.core.hardware import DeviceFacts

_GIB = 1024**3

PROFILES_SUBDIR = "profiles"
KEY_RE = re.compile(r"^[0-9a-f]{8,64}$")
_FILE_RE = re.compile(r"^(?P<key>[0-9a-f]{8,64})\.json$")
MASK = "***"
_SECRET_FLAGS = ("--api-key",)


def compile_cache_dir(env: typing.Mapping[str, str]) -> Path:
    """Where vLLM keeps its ``torch.compile`` cache in this environment (vllm/envs.py): under
    ``VLLM_CACHE_ROOT``, else ``$XDG_CACHE_HOME/vllm``, else ``~/.cache/vllm``. Under systemd and in
    r1sup's image the cache root is in r1sup's state dir, so a new box, a wiped state dir or a new
    image starts cold."""
    root = env.get("VLLM_CACHE_ROOT")
    if not root:
        base = env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "vllm")
    return Path(os.path.expanduser(root)) / "torch_compile_cache"


def compile_cache_state(env: typing.Mapping[str, str]) -> str | None:
    """``"cold"`` when vLLM will compile from nothing (its compile cache is disabled, missing or empty),
    None when the cache holds something: perhaps this model's graphs, perhaps another's (vLLM's cache
    key hashes its whole config, which r1sup does not recompute). A successful start leaves it warm."""
    if env.get("VLLM_DISABLE_COMPILE_CACHE", "0").strip() not in ("", "0"):
        return "cold"
    folder = compile_cache_dir(env)
    try:
        return None if any(folder.iterdir()) else "cold"
    except OSError:
        return "cold"


def mask_command(argv: list[str]) -> list[str]:
    """``argv`` with the value of every ``--api-key`` replaced by ``***``."""
    out: list[str] = []
    mask_next = False
    for arg in argv:
        if mask_next:
            out.append(MASK)
            mask_next = False
            continue
        name, sep, _ = arg.partition("=")
        if name in _SECRET_FLAGS:
            if sep:
                out.append(f"{name}={MASK}")
            else:
                out.append(arg)
                mask_next = True
            continue
        out.append(arg)
    return out


@dataclass(frozen=True)
class Profile:
    """A working configuration and its evidence. ``flags`` is ``EngineFlags.to_dict()``."""

    key: str
    fingerprint: dict[str, Any]
    model: str
    served_name: str
    flags: dict[str, Any]
    command: list[str]
    probe: dict[str, Any] = field(default_factory=dict)
    observations: Figures = NO_FIGURES  # what vLLM printed: the measured memory breakdown
    attempts: list[dict[str, Any]] = field(default_factory=list)
    created_at: str = ""  # ISO 8601 UTC; ProfileStore.save fills empty timestamps
    updated_at: str = ""
    r1sup_version: str = __version__
    schema_version: int = SCHEMA_VERSION
    imported: dict[str, Any] | None = None  # set by a forced import: origin and differences
    # what the box looked like when this profile was found (search.conditions): free memory, other
    # processes holding GPU memory, and whether the profile is degraded by them (kept beside the best)
    conditions: dict[str, Any] = field(default_factory=dict)
    # what the probe proved it serves (r1sup.core.capacity.verified); empty in a profile saved before r1sup
    # recorded it (read as it is: an optional field, like conditions, not a new schema)
    capacity: dict[str, Any] = field(default_factory=dict)
    # the service level `tune` proved with these flags (r1sup.core.slo.SloResult.to_dict); empty without
    # an [slo] section or in a profile saved before r1sup measured one (optional, like capacity)
    slo: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "command", mask_command(list(self.command)))

    @classmethod
    def create(
        cls,
        *,
        fingerprint: dict[str, Any],
        model: str,
        served_name: str,
        flags: EngineFlags | dict[str, Any],
        command: list[str],
        probe: dict[str, Any] | None = None,
        observations: Figures = NO_FIGURES,
        attempts: list[dict[str, Any]] | None = None,
    ) -> Profile:
        """A new profile whose key is computed from ``fingerprint``."""
        flag_dict = flags.to_dict() if isinstance(flags, EngineFlags) else _check_flags(flags)
        return cls(
            key=fingerprint_key(fingerprint),
            fingerprint=fingerprint,
            model=model,
            served_name=served_name,
            flags=flag_dict,
            command=command,
            probe=dict(probe or {}),
            observations=observations,
            attempts=list(attempts or []),
        )

    @property
    def engine_flags(self) -> EngineFlags:
        return EngineFlags.from_dict(self.flags)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema_version": self.schema_version,
            "key": self.key,
            "fingerprint": self.fingerprint,
            "model": self.model,
            "served_name": self.served_name,
            "flags": self.flags,
            "command": list(self.command),
            "probe": self.probe,
            "observations": self.observations.to_dict(),
            "attempts": self.attempts,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "r1sup_version": self.r1sup_version,
        }
        if self.imported is not None:
            out["imported"] = self.imported
        if self.conditions:
            out["conditions"] = self.conditions
        if self.capacity:
            out["capacity"] = self.capacity
        if self.slo:
            out["slo"] = self.slo
        return out

    @property
    def slo_result(self) -> Any:
        """The saved service level as :class:`r1sup.core.slo.SloResult`, or None."""
        from r1sup.core.slo import SloResult

        return SloResult.from_dict(self.slo) if self.slo else None

    @classmethod
    def from_dict(cls, data: Any) -> Profile:
        """Validate and build; raises ValueError naming the first bad field (:func:`validate`)."""
        return cls(**validate(data))


# --- validation: a profile is untrusted input (a local file, an import, the fleet's store) --------
#
# One check for every source, so that nothing a neighbour wrote can reach vLLM's command line or crash
# r1sup: each flag against what ``[start]`` accepts (r1sup.core.config: vLLM's choices and ranges), every
# number finite, the figures r1sup computes with of the right type. A field of the dataclass without
# a check in FIELD_CHECKS (one added later) is taken leniently: any JSON value without NaN or Infinity.

MAX_JSON_INT = 2**63 - 1  # what vLLM's integer flags and r1sup's arithmetic can take
# observations: keys whose values are token counts (positive integers, as vLLM prints them)
_TOKEN_KEYS = frozenset({"kv_cache_tokens", "max_model_len", "kv_capacity_tokens"})
# observation keys read as numbers: these suffixes, and the names listed
_NUMBER_SUFFIXES = ("_gib", "_mib", "_bytes", "_tokens", "_s", "_pct", "_perc")
_NUMBER_KEYS = frozenset(
    {"max_concurrency", "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens"}
)
# probe record: counts that must be non-negative integers
_PROBE_COUNTS = ("requests", "succeeded", "concurrency", "prompt_tokens", "output_tokens")


def validate(data: Any) -> dict[str, Any]:
    """The constructor arguments of a :class:`Profile` from ``data`` (a parsed JSON object), every field
    checked; raises ValueError naming the first bad field. Unknown top-level fields are refused."""
    if not isinstance(data, dict):
        raise ValueError("a profile must be a JSON object")
    known = {f.name: f for f in dataclasses.fields(Profile)}
    unknown = sorted(str(k) for k in set(data) - set(known))
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(unknown)}")
    schema = _require(data, "schema_version", int)
    if schema != SCHEMA_VERSION:
        raise ValueError(f"schema_version {schema}, this r1sup reads {SCHEMA_VERSION}")
    out: dict[str, Any] = {"schema_version": schema}
    for name, f in known.items():
        if name == "schema_version":
            continue
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if name not in data:
            if required or name in _REQUIRED_WITH_DEFAULT:
                raise ValueError(f"missing field {name}")
            continue
        check = FIELD_CHECKS.get(name, _lenient)
        out[name] = check(name, data[name])
    if fingerprint_key(out["fingerprint"]) != out["key"]:
        raise ValueError("key does not match the fingerprint (edited or damaged)")
    if not out["model"] or not out["served_name"]:
        raise ValueError("model and served_name must not be empty")
    cannot = cannot_serve(out["flags"], out["probe"])
    if cannot is not None:
        raise ValueError(cannot)
    return out


def cannot_serve(flags: dict[str, Any], probe: dict[str, Any]) -> str | None:
    """Why a launch with these flags could serve no request its probe proved (None: it could): a context
    shorter than one prompt token and one output token, or than the measured prompt and output the passing
    probe sent through it. A profile saying so was damaged or edited: vLLM would refuse every request, or the
    launch itself, on every start."""
    length = flags.get("max_model_len")
    if not isinstance(length, int) or length == -1:
        return None  # vLLM's default context: the model's
    need, why = 2, "one prompt token and one output token"
    counts = [probe.get(k) for k in ("prompt_tokens", "output_tokens")]
    measured = probe.get("ok") is True and probe.get("prompt_tokens_estimated") is not True
    if measured and all(isinstance(c, int) and not isinstance(c, bool) for c in counts):
        sent = sum(typing.cast(list[int], counts))
        if sent > need:
            need, why = sent, f"the {counts[0]} + {counts[1]} tokens of the probe it passed"
    if length < need:
        return f"flags.max_model_len {length} cannot hold {why}"
    return None


def _finite(value: Any, where: str, depth: int = 0) -> None:
    """No NaN or Infinity anywhere in ``value`` (Python's JSON reader accepts both), nor an integer
    past :data:`MAX_JSON_INT`, nor nesting deeper than 32."""
    if depth > 32:
        raise ValueError(f"{where}: nested too deeply")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: {value} is not a finite number")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_JSON_INT:
        raise ValueError(f"{where}: {value} is out of range")
    if isinstance(value, dict):
        for k, v in value.items():
            _finite(v, f"{where}.{_key_shown(k)}", depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _finite(v, f"{where}[{i}]", depth + 1)


def _key_shown(key: Any) -> str:
    """A key of a saved file as a reason line may name it: a name as it is, anything else (a line break,
    a terminal escape, a long text) quoted with its escapes, within 40 characters."""
    text = str(key)
    if text.isidentifier() and len(text) <= 40:
        return text
    quoted = json.dumps(text)
    return quoted if len(quoted) <= 40 else quoted[:36] + '..."'


def _lenient(name: str, value: Any) -> Any:
    _finite(value, name)
    return value


def _typed(tp: type) -> Callable[[str, Any], Any]:
    def check(name: str, value: Any) -> Any:
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise ValueError(f"{name} must be {tp.__name__}, got {type(value).__name__}")
        _finite(value, name)
        return value

    return check


def _check_key(name: str, value: Any) -> str:
    key = _typed(str)(name, value)
    if not KEY_RE.match(key):
        raise ValueError(f"key {key[:80]!r} is not 8-64 lowercase hex digits")
    return str(key)


def _check_command(name: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(a, str) for a in value):
        raise ValueError("command must be a non-empty list of strings")
    return value


def _check_attempts(name: str, value: Any) -> list[dict[str, Any]]:
    _typed(list)(name, value)
    if not all(isinstance(a, dict) for a in value):
        raise ValueError("attempts must be a list of objects")
    return list(value)


def _check_stamp(name: str, value: Any) -> str:
    text = _typed(str)(name, value)
    try:
        parse_iso(text)
    except ValueError:
        raise ValueError(f"{name} {text[:40]!r} is not an ISO 8601 timestamp") from None
    return str(text)


def _check_observations(name: str, value: Any) -> Figures:
    """vLLM's figures r1sup computes with: numbers (finite, not booleans); token counts positive
    integers (an integral float, as the log reader stores them, counts). The figures r1sup knows are
    kept (:class:`r1sup.core.figures.Figures`); other keys are left out."""
    obs = _typed(dict)(name, value)
    for key, v in obs.items():
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        if number and key in FIGURE_NAMES and (why := figure_out_of_bounds(key, v)) is not None:
            raise ValueError(f"{name}.{key}: {why}")
        numeric = key in _NUMBER_KEYS or key in _TOKEN_KEYS or str(key).endswith(_NUMBER_SUFFIXES)
        if not numeric:
            continue
        if v is None:
            continue
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise ValueError(f"{name}.{key} must be a number, got {type(v).__name__}")
        if key in _TOKEN_KEYS and (v < 1 or v != int(v)):
            raise ValueError(f"{name}.{key} must be a positive whole number of tokens, got {v}")
    return Figures.from_dict(obs)


def _check_probe(name: str, value: Any) -> dict[str, Any]:
    """A probe record: its counts non-negative integers; a sizing record bounded, so that rebuilding
    its prompts cannot take unbounded memory."""
    probe = _typed(dict)(name, value)
    for key in _PROBE_COUNTS:
        v = probe.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ValueError(f"{name}.{key} must be a non-negative integer, got {v!r}")
    sizing = probe.get("sizing")
    if sizing is not None:
        if not isinstance(sizing, dict):
            raise ValueError(f"{name}.sizing must be an object")
        target = sizing.get("prompt_tokens")
        entries = sizing.get("prompts")
        if not isinstance(target, int) or isinstance(target, bool) or not 0 < target <= 1 << 24:
            raise ValueError(f"{name}.sizing.prompt_tokens must be a positive integer, got {target!r}")
        if not isinstance(entries, list) or len(entries) > 1 << 16:
            raise ValueError(f"{name}.sizing.prompts must be a list")
        for i, entry in enumerate(entries):
            words = entry.get("words") if isinstance(entry, dict) else None
            if isinstance(words, int) and words > 8 * target + 64:
                raise ValueError(f"{name}.sizing.prompts[{i}].words {words} is too many for {target} tokens")
    return dict(probe)


def _check_optional_dict(name: str, value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object")
    _finite(value, name)
    return value


def _check_conditions(name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object")
    _finite(value, name)
    return value


def _check_capacity(name: str, value: Any) -> dict[str, Any]:
    """What the probe proved it serves (:func:`r1sup.core.capacity.check`), every number finite."""
    from r1sup.core import capacity as C

    _finite(value, name)
    return C.check(value)


def _check_slo(name: str, value: Any) -> dict[str, Any]:
    """The service level `tune` proved (:meth:`r1sup.core.slo.SloResult.from_dict`), every number finite."""
    from r1sup.core.slo import SloResult

    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object")
    _finite(value, name)
    try:
        SloResult.from_dict(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    return value


def _check_flags_field(name: str, value: Any) -> dict[str, Any]:
    return _check_flags(_typed(dict)(name, value))


# fields a profile must hold although the dataclass gives them a default
_REQUIRED_WITH_DEFAULT = frozenset(
    {"probe", "observations", "attempts", "created_at", "updated_at", "r1sup_version"}
)
# one check per field; a field without one is checked by _lenient
FIELD_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "key": _check_key,
    "fingerprint": _typed(dict),
    "model": _typed(str),
    "served_name": _typed(str),
    "flags": _check_flags_field,
    "command": _check_command,
    "probe": _check_probe,
    "observations": _check_observations,
    "attempts": _check_attempts,
    "created_at": _check_stamp,
    "updated_at": _check_stamp,
    "r1sup_version": _typed(str),
    "imported": _check_optional_dict,
    "conditions": _check_conditions,
    "capacity": _check_capacity,
    "slo": _check_slo,
}


def _require(data: dict[str, Any], name: str, tp: type) -> Any:
    if name not in data:
        raise ValueError(f"missing field {name}")
    value = data[name]
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ValueError(f"{name} must be {tp.__name__}, got {type(value).__name__}")
    return value


def _check_flags(flags: dict[str, Any]) -> dict[str, Any]:
    """The flags as a full ``EngineFlags.to_dict()``, each value type-checked and checked against what
    ``[start]`` accepts for it (:func:`r1sup.core.config.check_start_value`: vLLM's choices and ranges)."""
    from r1sup.core.config import check_start_value

    hints = typing.get_type_hints(EngineFlags)
    names = {f.name for f in dataclasses.fields(EngineFlags)}
    for name, value in flags.items():
        if name not in names:
            raise ValueError(f"flags: unknown flag {name}")
        allowed = _allowed_types(hints[name])
        ok = (value is None and type(None) in allowed) or (
            value is not None
            and any(isinstance(value, t) for t in allowed if t is not type(None))
            and not (isinstance(value, bool) and bool not in allowed)
        )
        if not ok:
            raise ValueError(f"flags.{name}: unexpected value {str(value)[:80]!r}")
        _finite(value, f"flags.{name}")
        try:
            check_start_value(f"flags.{name}", name, value)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
    return EngineFlags.from_dict(dict(flags)).to_dict()


def _allowed_types(tp: Any) -> tuple[type, ...]:
    args = typing.get_args(tp) or (tp,)
    out: list[type] = []
    for t in args:
        out.append(t)
        if t is float:
            out.append(int)  # JSON writes 1.0 as 1 in some tools
    return tuple(out)


# --- fingerprint (pure) ------------------------------------------------------------------------


def fingerprint(
    *,
    model: str,
    model_config_hash: str | None,
    device: DeviceFacts,
    versions: dict[str, Any],
    target: dict[str, Any],
    tensor_parallel_size: int,
    r1sup_version: str,
    request: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What makes a working configuration valid, as plain JSON data.

    ``request`` is what the search started from (the config's ``[start]`` and ``[search]``): a profile
    found for other wishes or other bounds is not reused when they change (a SIGHUP after editing
    ``[start]``, or a restart with an edited config, searches again).

    GPU memory is rounded to 0.1 GiB and host memory to 1 GiB, so that a few MiB of driver or kernel
    noise do not change it; of the driver only its branch counts, of r1sup only its major version.
    """
    fp: dict[str, Any] = {"backend": device.backend}
    if device.gpus:
        cc = device.compute_capability
        fp["gpu"] = {
            "names": [g.name for g in device.gpus],
            "count": device.count,
            "memory_gib": [round(g.total_bytes / _GIB, 1) for g in device.gpus],
            "compute_capability": f"{cc[0]}.{cc[1]}" if cc else None,
            "driver": driver_branch(device.driver),
        }
    else:
        # the machine's RAM, not NUMA node 0's figure, which moves on VMs whose memory is hot-plugged
        memory = device.machine_memory_bytes or device.host_total_bytes
        fp["cpu"] = {"model": device.cpu_model, "memory_gib": round(memory / _GIB)}
    fp["versions"] = {"vllm": versions.get("vllm"), "torch": versions.get("torch")}
    fp["model"] = {"id": model, "config_hash": model_config_hash}
    fp["target"] = dict(target)
    fp["tensor_parallel_size"] = tensor_parallel_size
    fp["r1sup_major"] = _major(r1sup_version)
    if request is not None:
        fp["request"] = request
    return fp


def fingerprint_vllm(fp: typing.Mapping[str, Any]) -> str | None:
    """The vLLM version a fingerprint names (None: unknown). The one reader of that part of it: a
    fingerprint is plain JSON because it is hashed into the key and kept in profile files, so one from a
    file (an import, the fleet's store) may hold anything there."""
    versions = fp.get("versions")
    vllm = versions.get("vllm") if isinstance(versions, dict) else None
    return vllm if isinstance(vllm, str) and vllm else None


def driver_branch(version: str | None) -> str | None:
    """The driver's branch (``550`` of ``550.54.14``): patch releases of a branch do not move the
    memory vLLM sees, so boxes of a fleet that differ only there share profiles."""
    if not version:
        return None
    head = version.strip().split(".", 1)[0]
    return head if head.isdigit() else version.strip()


def _major(version: str) -> int | str:
    head = version.strip().split(".", 1)[0]
    return int(head) if head.isdigit() else head


def fingerprint_key(fp: dict[str, Any]) -> str:
    """16 hex digits of the SHA-256 of the fingerprint's canonical JSON."""
    import hashlib  # here: reading profiles (``status``) needs no key, and OpenSSL's load is not free

    canonical = json.dumps(fp, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


DEGRADED_MARK = "degraded_by_other_processes"


def degraded_fingerprint(fp: dict[str, Any]) -> dict[str, Any]:
    """The fingerprint a profile degraded by other processes is kept under, beside the best one (its
    own key: it never overwrites the best profile, and the fleet's store never sees it)."""
    return {**fp, DEGRADED_MARK: True}


def diff_fingerprints(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Human lines for each differing leaf, e.g. ``gpu.names: ['RTX 4090'] -> ['RTX 3090']``."""
    flat_a, flat_b = _flatten(a), _flatten(b)
    names = list(flat_a) + [n for n in flat_b if n not in flat_a]
    lines = []
    for name in names:
        va, vb = flat_a.get(name, _ABSENT), flat_b.get(name, _ABSENT)
        if va != vb or type(va) is not type(vb):
            lines.append(f"{name}: {_show(va)} -> {_show(vb)}")
    return lines


_ABSENT = object()


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, name + "."))
        else:
            out[name] = v
    return out


def _show(value: Any) -> str:
    if value is _ABSENT:
        return "(absent)"
    if value is None:
        return "(unknown)"
    if isinstance(value, str):
        return value
    return repr(value)


# --- the environment side of the fingerprint ---------------------------------------------------


def current_fingerprint(
    config: Any, *, device: DeviceFacts | None = None, versions: dict[str, str | None] | None = None
) -> dict[str, Any]:
    """The fingerprint of this box for ``config`` (a :class:`r1sup.core.config.Config`).

    Probes the devices unless ``device`` is given, reads the model's config.json (an unknown model
    gives ``config_hash`` None, logged) and, unless ``versions`` (the preflight's) are given, asks the
    vLLM environment for its versions the way the preflight does. Those modules are imported here,
    not at import time.
    """
    from r1sup.adapters import devices, modelinfo, preflight

    facts = device if device is not None else devices.probe()
    config_hash: str | None
    try:
        model_config = modelinfo.load_model_config(config.model.name, config.model.revision)
        config_hash = modelinfo.config_hash(model_config)
    except (R1supError, OSError, ValueError) as exc:
        get_logger().warning("model_config_unavailable", model=config.model.name, error=str(exc))
        config_hash = None
    if versions is None:
        try:
            versions = preflight.engine_versions(config)
        except PreflightError as exc:  # the fingerprint says "unknown": no profile matches it by chance
            get_logger().warning("engine_versions_failed", field=exc.field, error=exc.message)
            versions = {"vllm": None, "torch": None}
    return fingerprint(
        model=config.model.name,
        model_config_hash=config_hash,
        device=facts,
        versions=versions,
        target={"concurrency": config.target.concurrency, "context": config.target.context},
        tensor_parallel_size=config.start.tensor_parallel_size,
        r1sup_version=__version__,
        # [search] under its 0.1 name: the key of every saved and shared profile is a hash of this
        request={"start": dataclasses.asdict(config.start), "ladder": dataclasses.asdict(config.search)},
    )


# --- the store ---------------------------------------------------------------------------------


class ProfileStore:
    """Profiles in ``<state_dir>/profiles``. Reading works on a missing directory; the directory is
    created (0700) on the first write. ``repair=False`` (read-only callers such as ``r1sup status``)
    reports unusable files instead of moving them aside."""

    def __init__(self, state_dir: str | os.PathLike[str], *, repair: bool = True) -> None:
        self.state_dir = Path(state_dir)
        self.repair = repair
        self._dir: Path | None = None  # the checked, created directory, after the first write

    @property
    def directory(self) -> Path:
        return self._dir if self._dir is not None else self.state_dir / PROFILES_SUBDIR

    def path_for(self, key: str) -> Path:
        if not isinstance(key, str) or not KEY_RE.match(key):
            raise ConfigError(
                "profile", f"invalid profile key {str(key)[:80]!r} (expected 8-64 lowercase hex digits)"
            )
        return self.directory / f"{key}.json"

    def load(self, key: str) -> Profile | None:
        """The profile stored under ``key``, or None (missing, or unusable and set aside)."""
        path = self.path_for(key)
        if self._check_dir() is not None:
            return None
        profile, _ = self._load(path, key)
        return profile

    def lookup(self, fp: dict[str, Any]) -> Profile | None:
        """The profile for this fingerprint: launch once with its flags; None means tune."""
        return self.load(fingerprint_key(fp))

    def near_misses(self, fp: dict[str, Any]) -> list[tuple[Profile, list[str]]]:
        """Profiles of the same model for another fingerprint, with what differs (why re-tune)."""
        key = fingerprint_key(fp)
        model = fp.get("model", {}).get("id") if isinstance(fp.get("model"), dict) else None
        return [
            (p, diff_fingerprints(p.fingerprint, fp)) for p in self.all() if p.key != key and p.model == model
        ]

    def scan(self) -> tuple[list[Profile], list[tuple[Path, str]]]:
        """All usable profiles (newest first) and the unusable files found with their reason."""
        profiles: list[Profile] = []
        problems: list[tuple[Path, str]] = []
        dir_problem = self._check_dir()
        if dir_problem is not None:
            return profiles, [(self.state_dir / PROFILES_SUBDIR, dir_problem)]
        try:
            names = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return profiles, problems
        except OSError as exc:
            problems.append((self.directory, f"cannot be listed: {exc.strerror}"))
            return profiles, problems
        for name in names:
            m = _FILE_RE.match(name)
            if not m:
                continue
            profile, problem = self._load(self.directory / name, m.group("key"))
            if profile is not None:
                profiles.append(profile)
            elif problem is not None:
                problems.append((self.directory / name, problem))
        profiles.sort(key=lambda p: p.updated_at, reverse=True)
        return profiles, problems

    def all(self) -> list[Profile]:
        return self.scan()[0]

    def _check_dir(self) -> str | None:
        """None when the profiles directory is usable or absent; a symlink there is never followed
        (with ``repair`` it is moved aside like any unusable file)."""
        if self._dir is not None:
            return None
        path = self.state_dir / PROFILES_SUBDIR
        if not os.path.islink(path):
            return None
        problem = "a symlink (r1sup does not follow symlinks in its state directory)"
        if self.repair:
            set_file_aside(path, problem, kind="profiles directory")
        else:
            get_logger().warning(
                "state_file_invalid", path=str(path), reason=problem, kind="profiles directory"
            )
        return problem

    def _load(self, path: Path, key: str) -> tuple[Profile | None, str | None]:
        data, problem = inspect_json(path)
        if data is None and problem is None:
            return None, None
        if data is not None:
            try:
                profile = Profile.from_dict(data)
            except ValueError as exc:
                problem = f"malformed profile: {exc}"
            else:
                if profile.key == key:
                    return profile, None
                problem = f"holds the profile of key {profile.key}, not {key}"
        assert problem is not None
        if self.repair:
            set_file_aside(path, problem, kind="profile")
        else:
            get_logger().warning("state_file_invalid", path=str(path), reason=problem, kind="profile")
        return None, problem

    def save(self, profile: Profile) -> Path | None:
        """Write ``profile`` atomically. On failure log ``profile_save_failed`` and return None: the
        old file stays intact, serving goes on, and the next start tries again."""
        try:
            return self._write(profile)
        except (StateWriteError, ConfigError) as exc:
            get_logger().error("profile_save_failed", key=profile.key, error=str(exc))
            return None

    def _write(self, profile: Profile) -> Path:
        """Write ``profile``; raises StateWriteError or ConfigError."""
        if not KEY_RE.match(profile.key) or fingerprint_key(profile.fingerprint) != profile.key:
            raise StateWriteError(f"profile key {profile.key!r} does not match its fingerprint")
        if self._dir is None:
            self._check_dir()
            state = ensure_state_dir(self.state_dir)
            self._dir = ensure_subdir(state, PROFILES_SUBDIR)
            remove_stale_temp_files(self._dir)
        path = self.path_for(profile.key)
        existing, problem = self._load(path, profile.key)  # an unusable file is set aside first
        if existing is None and os.path.lexists(path):
            raise StateWriteError(f"{path} is unusable ({problem}) and could not be set aside")
        now = utc_now_iso()
        created = profile.created_at or (existing.created_at if existing else "") or now
        stamped = dataclasses.replace(profile, created_at=created, updated_at=now)
        atomic_write_json(path, stamped.to_dict())
        get_logger().info("profile_saved", key=profile.key, path=str(path), model=profile.model)
        return path

    def export(self, key: str, dest: Path) -> Path:
        """Write the profile ``key`` to ``dest`` (atomically, 0600). ConfigError when there is none."""
        profile = self.load(key)
        if profile is None:
            raise ConfigError("profile", f"no saved profile with key {key} in {self.directory}")
        dest = Path(dest)
        atomic_write_json(dest, profile.to_dict())
        get_logger().info("profile_exported", key=key, path=str(dest))
        return dest

    def import_file(
        self, src: Path, current_fingerprint: dict[str, Any], force: bool = False
    ) -> tuple[Profile, list[str]]:
        """Validate ``src``, compare its fingerprint with this box's and save it into the store.

        Returns ``(profile as saved, differences)``. A malformed file, or a differing fingerprint
        without ``force``, is a ConfigError (the message lists the differences). A forced import is
        stored under the current fingerprint and records its origin in ``imported``.
        """
        src = Path(src)
        data, problem = inspect_json(src, follow_symlinks=True)
        if data is None:
            raise ConfigError("profile", f"{src}: {problem or 'file not found'}")
        try:
            profile = Profile.from_dict(data)
        except ValueError as exc:
            raise ConfigError("profile", f"{src}: malformed profile: {exc}") from None
        differences = diff_fingerprints(profile.fingerprint, current_fingerprint)
        if differences and not force:
            raise ConfigError(
                "profile",
                f"{src} was tuned for another box or config; differences (profile -> this box):\n  "
                + "\n  ".join(differences)
                + "\nre-tune here, or import anyway with --force",
            )
        if differences:
            profile = dataclasses.replace(
                profile,
                key=fingerprint_key(current_fingerprint),
                fingerprint=current_fingerprint,
                imported={"from": str(src), "original_key": profile.key, "differences": differences},
            )
        path = self._write(profile)
        get_logger().info("profile_imported", key=profile.key, path=str(path), differences=len(differences))
        saved = self.load(profile.key)
        return (saved if saved is not None else profile), differences

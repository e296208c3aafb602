"""The "does not fit" verdict, remembered per fingerprint in the state directory.

When ``r1sup run`` gives up with exit 3 (no working configuration within the bounds), it writes
``STATE_DIR/no-fit.json``: the profile key (the fingerprint of GPUs, driver branch, vLLM and torch
versions, model, target, ``[start]`` and ``[search]``), the reason and the GPU memory that was free. A
restarted process (a pod in CrashLoopBackOff, a systemd restart) with the same key and no more free memory
gives the same verdict at once, without a second search: a changed config, image (vLLM or torch) or GPU
changes the key and clears it, and so does more free memory (another tenant gone). A run that serves
removes the file.

:func:`still_holds` is the pure decision; :func:`load`, :func:`remember` and :func:`forget` touch the
file (atomic writes, validated reads: an unusable file is set aside and ignored).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FILE_NAME = "no-fit.json"
# free memory may differ this much between two starts on the same box and still be "no more"
FREE_GIB_TOLERANCE = 0.5


@dataclass(frozen=True)
class NoFit:
    key: str
    reason: str
    free_gib: float | None  # GPU memory free when the search gave up (None: unknown, e.g. no NVML)
    written_at: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "reason": self.reason,
            "free_gib": self.free_gib,
            "written_at": self.written_at,
        }


def still_holds(verdict: NoFit, key: str, free_gib: float | None) -> bool:
    """Whether a remembered verdict answers for this start: the same fingerprint, and no more memory free
    than when it was given (within :data:`FREE_GIB_TOLERANCE`)."""
    if verdict.key != key:
        return False
    if verdict.free_gib is None or free_gib is None:
        return verdict.free_gib is None and free_gib is None
    return free_gib <= verdict.free_gib + FREE_GIB_TOLERANCE


def path_in(state_dir: str | os.PathLike[str]) -> Path:
    return Path(state_dir) / FILE_NAME


def load(state_dir: str | os.PathLike[str]) -> NoFit | None:
    """The remembered verdict, or None (none, or an unusable file: set aside with a warning)."""
    from r1sup.adapters import statefiles

    path = path_in(state_dir)
    if not path.exists():
        return None
    obj = statefiles.read_json(path, kind="no-fit verdict")
    if obj is None:
        return None
    key, reason, free, written = (obj.get(k) for k in ("key", "reason", "free_gib", "written_at"))
    if not (isinstance(key, str) and isinstance(reason, str) and isinstance(written, str)):
        statefiles.set_file_aside(path, "key, reason or written_at missing", kind="no-fit verdict")
        return None
    if free is not None and (isinstance(free, bool) or not isinstance(free, (int, float))):
        statefiles.set_file_aside(path, "free_gib is not a number", kind="no-fit verdict")
        return None
    return NoFit(key, reason, None if free is None else float(free), written)


def remember(state_dir: str | os.PathLike[str], key: str, reason: str, free_gib: float | None) -> NoFit:
    """Write the verdict (atomic); StateWriteError when it cannot be written."""
    from r1sup.adapters import statefiles

    verdict = NoFit(key, reason, free_gib, statefiles.utc_now_iso())
    directory = statefiles.ensure_state_dir(state_dir)
    statefiles.atomic_write_json(
        directory / FILE_NAME, {"schema_version": statefiles.SCHEMA_VERSION, **verdict.to_dict()}
    )
    return verdict


def forget(state_dir: str | os.PathLike[str]) -> None:
    with contextlib.suppress(FileNotFoundError):
        path_in(state_dir).unlink()

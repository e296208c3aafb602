"""``r1sup profile export FILE`` / ``r1sup profile import FILE [--force]``: reuse a tuned profile on
identical boxes. Import checks the fingerprint against this box and says what differs.
``r1sup profile gate [--store DIR]``: the upgrade gate (r1sup.core.gate) of a profile tuned on a new image."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from r1sup.cli.app import load_config
from r1sup.core.errors import EXIT_GATE_FAILED, ConfigError
from r1sup.state import profiles


def main(args: argparse.Namespace) -> int:
    config = load_config(args)
    store = profiles.ProfileStore(config.state.dir)
    current = profiles.current_fingerprint(config)
    if args.profile_command == "export":
        return _export(store, current, Path(args.file))
    if args.profile_command == "gate":
        return _gate(store, current, args.store or config.state.profile_store)
    return _import(store, current, Path(args.file), force=bool(args.force))


def _export(store: profiles.ProfileStore, current: dict[str, object], dest: Path) -> int:
    key = profiles.fingerprint_key(current)
    if store.load(key) is None:
        lines = [
            f"no saved profile for this box and config (key {key}) in {store.directory}; run r1sup tune first"
        ]
        for other, differences in store.near_misses(current):
            lines.append(f"  profile {other.key} of the same model differs: " + "; ".join(differences))
        raise ConfigError("profile", "\n".join(lines))
    store.export(key, dest)
    sys.stdout.write(f"exported profile {key} to {dest}\n")
    return 0


def _import(store: profiles.ProfileStore, current: dict[str, object], src: Path, *, force: bool) -> int:
    profile, differences = store.import_file(src, current, force=force)
    if differences:
        sys.stdout.write("fingerprint differs (profile -> this box), imported because of --force:\n")
        for line in differences:
            sys.stdout.write(f"  {line}\n")
    else:
        sys.stdout.write("fingerprint matches this box\n")
    sys.stdout.write(
        f"imported profile {profile.key} ({profile.model}) into {store.path_for(profile.key)}\n"
        f"flags: {_flags(profile)}\n"
    )
    return 0


def _gate(store: profiles.ProfileStore, current: dict[str, object], location: str | None) -> int:
    """This box's profile (tuned on the new image) against the store's newest profile of the same box and
    config on another image: published when its capacity holds, else exit 8."""
    from r1sup.core import gate
    from r1sup.state import fleet

    if not location or fleet.is_url(location):
        raise ConfigError("--store", "the fleet's store must be a directory (state.profile_store or --store)")
    key = profiles.fingerprint_key(current)
    new = store.load(key)
    if new is None:
        raise ConfigError(
            "profile", f"no tuned profile for this box and config (key {key}); run r1sup tune first"
        )
    from r1sup.adapters.logs import get_logger
    from r1sup.supervision.session import log_only

    fleet_store = fleet.DirectoryStore(location, tell=log_only(get_logger()))
    old = _previous_image(Path(location) / fleet.PROFILES, key, current)
    verdict = gate.decide(
        gate.profile_capacity(old.to_dict()) if old else None, gate.profile_capacity(new.to_dict())
    )
    old_label = _image(old.fingerprint) if old else "no old profile"
    sys.stdout.write(verdict.table(old_label, _image(new.fingerprint)) + "\n")
    if not verdict.ok:
        sys.stderr.write(
            f"r1sup: error: gate: profile {key} verifies less than {old.key if old else '-'} "
            f"({', '.join(r.name for r in verdict.rows if not r.ok)}); not published\n"
        )
        return EXIT_GATE_FAILED
    published = fleet_store.publish(new)
    sys.stdout.write(f"{'published' if published else 'already in the store:'} profile {key} to {location}\n")
    return 0


def _previous_image(directory: Path, key: str, current: dict[str, Any]) -> profiles.Profile | None:
    """The store's newest profile of this box and config on another image (None: a first rollout). Fails
    closed: an entry that may be that profile but cannot be read, or is dated in the future (no replica
    wrote it), is a ConfigError naming the file, never "no old profile" nor the newest baseline. Files
    not named like a profile (``notes.json``) are not profiles and are passed over."""
    from r1sup.adapters.statefiles import inspect_json, parse_iso
    from r1sup.core import gate
    from r1sup.state import fleet

    latest = time.time() + fleet.CLOCK_SKEW_S
    old: profiles.Profile | None = None
    for path in sorted(directory.glob("*.json")):
        if not profiles.KEY_RE.match(path.stem) or path.stem == key:
            continue
        data, problem = inspect_json(path)
        if data is None and problem is None:
            continue  # gone meanwhile
        fp = data.get("fingerprint") if data is not None else None
        if isinstance(fp, dict) and not gate.same_but_image(fp, current):
            continue  # another box's or config's, damaged or not: not the baseline
        candidate = None
        if problem is None:
            try:
                candidate = fleet.checked_profile(data, path.stem)
            except ValueError as exc:
                problem = str(exc)
        if candidate is None:
            raise ConfigError(
                "--store",
                f"{path} may be the previous image's profile but is unusable ({_clip(problem)}); "
                "the gate cannot compare: repair or remove it",
            )
        if not gate.same_but_image(candidate.fingerprint, current):
            continue
        stamp = parse_iso(candidate.updated_at).timestamp()
        if stamp > latest:
            raise ConfigError(
                "--store",
                f"{path} is dated {candidate.updated_at}, in the future: no replica wrote it; "
                "the gate cannot compare: repair or remove it",
            )
        if old is None or stamp > parse_iso(old.updated_at).timestamp():
            old = candidate
    return old


def _clip(text: str | None, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


def _image(fingerprint: dict[str, Any]) -> str:
    vllm = profiles.fingerprint_vllm(fingerprint)
    return f"vLLM {vllm}" if vllm else "unknown vLLM"


def _flags(profile: profiles.Profile) -> str:
    return " ".join(profile.engine_flags.to_argv())

"""``r1sup profile export FILE`` / ``r1sup profile import FILE [--force]``: reuse a tuned profile on
identical boxes. Import checks the fingerprint against this box and says what differs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from r1sup import profiles
from r1sup.cli import load_config
from r1sup.errors import ConfigError


def main(args: argparse.Namespace) -> int:
    config = load_config(args)
    store = profiles.ProfileStore(config.state.dir)
    current = profiles.current_fingerprint(config)
    if args.profile_command == "export":
        return _export(store, current, Path(args.file))
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


def _flags(profile: profiles.Profile) -> str:
    return " ".join(profile.engine_flags.to_argv())

"""A model's ``config.json``: from a local directory, the Hugging Face cache, or the built-in catalog.

Offline by design: only files are read, never the network. The architecture parsing itself is pure
and lives in :mod:`r1sup.core.planner` (re-exported here).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from r1sup.core import catalog
from r1sup.core.errors import ConfigError
from r1sup.core.planner import ModelArch, arch_from_config

__all__ = [
    "ModelArch",
    "ModelSource",
    "arch_from_config",
    "config_hash",
    "find_in_hf_cache",
    "hf_cache_dirs",
    "load_arch",
    "load_model_config",
    "locate_model_config",
]


@dataclass(frozen=True)
class ModelSource:
    config: dict[str, Any]
    kind: str  # "local", "hf-cache" or "catalog"
    where: str  # the file read, or the catalog id

    def describe(self) -> str:
        return {"local": "local directory", "hf-cache": "Hugging Face cache", "catalog": "built-in catalog"}[
            self.kind
        ] + f" ({self.where})"


def config_hash(config: Mapping[str, Any]) -> str:
    """A stable sha256 of the canonical JSON of a config (sorted keys, no spaces)."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def hf_cache_dirs(environ: Mapping[str, str] | None = None) -> list[Path]:
    """The hub cache directories huggingface_hub would use, most specific first (existing or not)."""
    env = os.environ if environ is None else environ
    dirs: list[Path] = []
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE"):
        if env.get(key):
            dirs.append(Path(env[key]).expanduser())
    if env.get("HF_HOME"):
        dirs.append(Path(env["HF_HOME"]).expanduser() / "hub")
    if env.get("XDG_CACHE_HOME"):
        dirs.append(Path(env["XDG_CACHE_HOME"]).expanduser() / "huggingface" / "hub")
    home = env.get("HOME")
    base = Path(home) if home else Path.home()
    dirs.append(base / ".cache" / "huggingface" / "hub")
    unique: list[Path] = []
    for d in dirs:
        if d not in unique:
            unique.append(d)
    return unique


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError("model.name", f"cannot read {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError("model.name", f"{path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError("model.name", f"{path} does not hold a JSON object")
    return data


def _snapshot_config(repo_dir: Path, revision: str | None) -> Path | None:
    snapshots = repo_dir / "snapshots"
    if not snapshots.is_dir():
        return None
    wanted = revision or "main"
    ref = repo_dir / "refs" / wanted
    commit = None
    if ref.is_file():
        try:
            commit = ref.read_text(encoding="utf-8").strip()
        except OSError:
            commit = None
    for candidate in (commit, wanted):
        if candidate and (snapshots / candidate / "config.json").is_file():
            return snapshots / candidate / "config.json"
    if revision:
        return None  # a named revision that is not in the cache
    found = sorted(
        (p for p in snapshots.glob("*/config.json") if p.is_file()),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    return found[0] if found else None


def find_in_hf_cache(
    name: str, revision: str | None, environ: Mapping[str, str] | None = None
) -> Path | None:
    """The config.json of Hugging Face id ``name`` in the local hub cache, or None (offline)."""
    if name.count("/") != 1:
        return None
    repo = "models--" + name.replace("/", "--")
    for cache in hf_cache_dirs(environ):
        repo_dir = cache / repo
        if repo_dir.is_dir():
            found = _snapshot_config(repo_dir, revision)
            if found is not None:
                return found
    return None


def locate_model_config(
    name_or_path: str, revision: str | None = None, environ: Mapping[str, str] | None = None
) -> ModelSource:
    """Find a model's config.json: local directory, then the HF cache, then the catalog. Offline."""
    name = name_or_path.strip()
    if not name:
        raise ConfigError("model.name", "must not be empty")
    path = Path(name).expanduser()
    if path.is_file() and path.name.endswith(".json"):
        return ModelSource(_read_json(path), "local", str(path))
    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ConfigError("model.name", f"directory {path} has no config.json")
        return ModelSource(_read_json(config_file), "local", str(config_file))
    if name.startswith(("/", "./", "../", "~")):
        raise ConfigError("model.name", f"model directory not found: {name}")

    found = find_in_hf_cache(name, revision, environ)
    if found is not None:
        return ModelSource(_read_json(found), "hf-cache", str(found))

    entry = catalog.find_model(name)
    if entry is not None:
        model_id, config = entry
        return ModelSource(config, "catalog", model_id)
    known = ", ".join(m.split("/", 1)[1] for m in catalog.MODELS)
    raise ConfigError(
        "model.name",
        f"{name!r}: no local directory, no config.json in the Hugging Face cache "
        f"({', '.join(str(d) for d in hf_cache_dirs(environ)[:2])}), and not in the built-in catalog "
        f"(deepseek-ai/{{{known}}}){catalog.did_you_mean(catalog.suggest_model(name))}; r1sup never "
        "downloads, so fetch the config first (huggingface-cli download MODEL config.json)",
    )


def load_model_config(
    name_or_path: str, revision: str | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The model's config.json as a dict (see :func:`locate_model_config`)."""
    return locate_model_config(name_or_path, revision, environ).config


def load_arch(
    name_or_path: str, revision: str | None = None, environ: Mapping[str, str] | None = None
) -> tuple[ModelArch, ModelSource]:
    """The parsed architecture and where its config came from; unusable configs are ConfigErrors."""
    source = locate_model_config(name_or_path, revision, environ)
    label = source.where if source.kind == "catalog" else name_or_path
    try:
        return arch_from_config(source.config, name=label), source
    except ValueError as exc:
        raise ConfigError("model.name", f"{source.where}: {exc}") from None

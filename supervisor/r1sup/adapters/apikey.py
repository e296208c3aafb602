"""The API key vLLM requires: from a file named in the config or from the environment, never inline.

It reaches vLLM through ``VLLM_API_KEY`` in the child's environment (never the command line, which
every user can read in the process table) and is masked in every log event.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from r1sup.core.config import Config
from r1sup.core.errors import ConfigError

SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL)", re.IGNORECASE)
MAX_KEY_FILE_BYTES = 4096


def load_api_key(config: Config, environ: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if environ is None else environ
    path = config.server.api_key_file
    if not path:
        return env.get("VLLM_API_KEY") or None
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not block the start
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ConfigError("server.api_key_file", f"{p} is not a regular file")
            data = os.read(fd, MAX_KEY_FILE_BYTES + 1)
        finally:
            os.close(fd)
    except FileNotFoundError:
        raise ConfigError("server.api_key_file", f"file not found: {p}") from None
    except OSError as exc:
        raise ConfigError("server.api_key_file", f"cannot read {p}: {exc.strerror}") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise ConfigError(
            "server.api_key_file", f"{p} is larger than {MAX_KEY_FILE_BYTES} bytes; not a key file"
        )
    try:
        key = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError("server.api_key_file", f"{p} is not UTF-8 text") from None
    if not key or any(ch.isspace() for ch in key):
        raise ConfigError("server.api_key_file", f"{p} must hold one key on one line")
    return key


def permission_warnings(config: Config) -> list[dict[str, Any]]:
    """Files others can read (key file, a config with secret-looking env) or write (the config)."""
    warnings: list[dict[str, Any]] = []
    if config.server.api_key_file:
        mode = _mode(config.server.api_key_file)
        if mode is not None and mode & (stat.S_IRWXG | stat.S_IRWXO):
            warnings.append(
                {"file": config.server.api_key_file, "mode": oct(mode), "why": "key file readable by others"}
            )
    if config.source:
        mode = _mode(config.source)
        if mode is not None:
            if mode & (stat.S_IWGRP | stat.S_IWOTH):
                warnings.append(
                    {"file": config.source, "mode": oct(mode), "why": "config writable by others"}
                )
            if mode & (stat.S_IRGRP | stat.S_IROTH) and secret_env_names(config):
                warnings.append(
                    {
                        "file": config.source,
                        "mode": oct(mode),
                        "why": f"config readable by others holds {', '.join(secret_env_names(config))}",
                    }
                )
    return warnings


def secret_env_names(config: Config) -> list[str]:
    return sorted(k for k in config.server.env if SECRET_NAME.search(k))


def secret_values(config: Config, api_key: str | None) -> list[str]:
    """Everything to mask in logs: the key and secret-looking values of server.env, each also in the
    escaped forms a program prints it in (vLLM logs its arguments as a Python repr; JSON escapes),
    longest first so that an escaped form is masked whole."""
    values = [api_key] if api_key else []
    values += [config.server.env[k] for k in secret_env_names(config) if len(config.server.env[k]) >= 4]
    forms = {form for value in values for form in escaped_forms(value)}
    return sorted(forms, key=len, reverse=True)


def escaped_forms(secret: str) -> list[str]:
    """``secret`` as it reads inside a Python repr (either quote) and inside a JSON string."""
    import json

    backslashed = secret.replace("\\", "\\\\")
    forms = [
        secret,
        json.dumps(secret)[1:-1],
        json.dumps(secret, ensure_ascii=False)[1:-1],
        repr(secret)[1:-1],
        backslashed.replace("'", "\\'"),
        backslashed.replace('"', '\\"'),
        backslashed,
    ]
    return list(dict.fromkeys(f for f in forms if f))


def _mode(path: str) -> int | None:
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return None

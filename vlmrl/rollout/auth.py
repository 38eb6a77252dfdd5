"""The run's engine key: only the run drives its engines.

A rollout engine's HTTP port takes weights, memory commands and process-group joins, so a run
draws one secret (`run_key`) and hands it to every engine it starts and every client it makes:
SGLang gets it as `--api-key` and `--admin-api-key` (it then refuses any call but /health* and
/metrics without `Authorization: Bearer <key>`: SGLang's `utils/auth.py`), the embedded server
checks it the same way (`authorized`), and `HTTPEngine` sends it on every request.

The secret stays out of the config (so out of the saved config, Hydra's output and wandb), out
of metrics and out of vlmrl's logs (`redact` for command lines). It lives in the run directory,
readable by its owner only, so that a resumed run speaks to engines with the same key.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from pathlib import Path

KEY_FILE = "engine.key"
# paths every caller may reach without the key, as in SGLang (liveness probes, metrics)
OPEN_PREFIXES = ("/health", "/metrics")
_SECRET_FLAGS = ("--api-key", "--admin-api-key")


def new_key() -> str:
    return secrets.token_urlsafe(32)


def run_key(run_dir: str | os.PathLike) -> str:
    """The run's engine key: read from `run_dir/engine.key`, or drawn and written there
    (mode 0600, created exclusively, so two starts never hold different keys)."""
    path = Path(run_dir) / KEY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_key(path)
    key = new_key()
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


def read_key(path: str | os.PathLike) -> str:
    """A key file's key; ValueError if the file is empty or others may read it."""
    path = Path(path)
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise ValueError(f"{path} is readable by others (mode {mode:o}); the engine key must be the owner's "
                         f"only: chmod 600 {path}")
    key = path.read_text().strip()
    if not key:
        raise ValueError(f"{path} holds no key")
    return key


def bearer(key: str | None) -> dict[str, str]:
    """The request header that carries `key` (none without a key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def authorized(path: str, header: str | None, key: str | None) -> bool:
    """Whether a request for `path` with Authorization `header` may pass a server holding
    `key` (no key: every request; /health* and /metrics: always; else a Bearer token equal
    to the key, compared in constant time)."""
    if not key or path.startswith(OPEN_PREFIXES):
        return True
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), key.encode())


def redact(cmd: Sequence[str]) -> list[str]:
    """A command line fit for a log: the value of each key flag (`--flag value` or
    `--flag=value`) replaced by ***."""
    out = list(cmd)
    for i, arg in enumerate(out):
        flag, eq, _ = arg.partition("=")
        if eq and flag in _SECRET_FLAGS:
            out[i] = f"{flag}=***"
        elif arg in _SECRET_FLAGS and i + 1 < len(out):
            out[i + 1] = "***"
    return out

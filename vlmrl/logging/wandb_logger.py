"""The wandb side of `MetricsLogger`: a thin wrapper that can never stop the run.

wandb is imported lazily (it costs about 0.6 s), the run id is kept in
`<run_dir>/wandb_id.txt` so a resumed job continues the same wandb run, and every call
into wandb is guarded: the first failure (init, log or finish) is reported once with
`warnings.warn` and wandb is switched off for the rest of the run, while `metrics.jsonl`
keeps being written by the caller.
"""

from __future__ import annotations

import os
import secrets
import warnings
from pathlib import Path
from typing import Any

WANDB_ID_FILE = "wandb_id.txt"
VALID_MODES = ("online", "offline", "disabled", "shared")


def resolve_mode(configured: str | None) -> str:
    """The wandb mode to use.

    An explicit `logger.wandb_mode` wins. Otherwise a `WANDB_MODE` already set in the
    environment is honoured (the test suite and CI set it to "offline"), and failing that
    the mode is "online" when `WANDB_API_KEY` is set, else "offline".
    """
    if configured:
        return configured
    env_mode = os.environ.get("WANDB_MODE")
    if env_mode:
        return env_mode
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def stable_run_id(run_dir: str | os.PathLike[str]) -> str:
    """The wandb run id of this run directory, created on first use and then reused."""
    path = Path(run_dir) / WANDB_ID_FILE
    try:
        existing = path.read_text().strip()
    except FileNotFoundError:
        existing = ""
    if existing:
        return existing
    run_id = secrets.token_hex(8)  # lowercase hex: none of wandb's forbidden characters
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(run_id + "\n")
    os.replace(tmp, path)
    return run_id


class WandbLogger:
    """One wandb run for one run directory; all methods are no-ops once disabled."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        project: str,
        group: str | None,
        name: str,
        mode: str | None,
        config: dict[str, Any] | None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.mode = resolve_mode(mode)
        self.run_id: str | None = None
        self.run: Any = None
        self._failed = False
        try:
            self.run_id = stable_run_id(self.run_dir)
            import wandb

            self.run = wandb.init(
                project=project,
                group=group if group is not None else self.run_dir.resolve().name,
                name=name,
                dir=str(self.run_dir),
                mode=self.mode,  # type: ignore[arg-type]
                config=config,
                resume="allow",
                id=self.run_id,
            )
        except Exception as exc:  # wandb must never stop the run
            self._fail("init", exc)

    @property
    def active(self) -> bool:
        return self.run is not None and not self._failed

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.active:
            return
        try:
            self.run.log(metrics, step=step)
        except Exception as exc:
            self._fail("log", exc)

    def log_table(self, step: int, key: str, rows: list[dict[str, Any]]) -> None:
        """`rows` (dicts) as one wandb Table under `key` at `step`: a column per key, in the
        order keys first appear; a row without a key has None there."""
        if not self.active or not rows:
            return
        try:
            import wandb

            columns = list(dict.fromkeys(k for row in rows for k in row))
            table = wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])
            self.run.log({key: table}, step=step)
        except Exception as exc:
            self._fail("log", exc)

    def finish(self) -> None:
        run, self.run = self.run, None
        if run is None or self._failed:
            return
        try:
            run.finish()
        except Exception as exc:
            self._fail("finish", exc)

    def _fail(self, what: str, exc: BaseException) -> None:
        if not self._failed:
            warnings.warn(
                f"wandb {what} failed ({type(exc).__name__}: {exc}); wandb logging is off for the "
                f"rest of this run, metrics.jsonl continues",
                RuntimeWarning,
                stacklevel=3,
            )
        self._failed = True
        self.run = None

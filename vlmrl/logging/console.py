"""Keep library notices off the screen: they go to the run dir's log, real warnings stay.

`quiet_libraries(log_path)` is called once in the driver and in every Ray actor. In that
process:

- Python warnings that are known library notices (TransformerEngine / Apex not installed,
  Megatron's deprecations of settings vlmrl does not use, transformers telling that a
  kernel package is absent) are appended to `log_path` instead of printed; every other
  warning is printed as Python prints it (once per place), so a real problem still shows;
- megatron-core's and matplotlib's INFO logging and transformers' notices of the same kind
  go to `log_path`; their warnings and errors still reach the screen;
- transformers' per-checkpoint progress bars ("Loading weights", "Writing model shards")
  are turned off.

Nothing here imports torch, megatron or transformers unless they are already imported or
installed (the dry-run path stays light); the handlers attach to the loggers by name.
"""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path

# (warning category name or "log", message pattern): notices about the environment that a
# user of vlmrl cannot act on and that do not change what vlmrl computes
NOTICES = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"full scope is deprecated",
    r"is falling back to its reference PyTorch implementation",
    r"Detected Megatron Core, using Megatron-FSDP",
    r"Using Megatron-FSDP without Transformer Engine",
    r"Guessing device ID based on global rank",
    r"To copy construct from a tensor, it is recommended",
)
_NOTICE = re.compile("|".join(NOTICES))
_installed: Path | None = None
LOG_ENV = "VLMRL_LIBRARY_LOG"  # the log file of a run, for the processes it starts


def library_log(run_dir: str | Path) -> Path:
    """Where a run's library notices go: `<run_dir>/logs/libraries.log`."""
    return Path(run_dir).resolve() / "logs" / "libraries.log"


def quiet_from_env() -> None:
    """`quiet_libraries` with the run's log named by the environment (Ray actors)."""
    import os

    if os.environ.get(LOG_ENV):
        quiet_libraries(os.environ[LOG_ENV])


class _NotNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _NOTICE.search(record.getMessage())


def quiet_libraries(log_path: str | Path | None) -> None:
    """Route library notices of this process to `log_path` (None: drop them). Idempotent."""
    import sys

    global _installed
    path = Path(log_path) if log_path else None
    if _installed is not None and _installed == path:
        return
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        sink: logging.Handler = logging.FileHandler(path, delay=True)
    else:
        sink = logging.NullHandler()
    sink.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    sink._vlmrl = True  # type: ignore[attr-defined]

    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
        if _NOTICE.search(str(message)):
            if _installed is not None:
                with open(_installed, "a") as f:
                    f.write(f"{category.__name__}: {message} ({filename}:{lineno})\n")
            return
        show(message, category, filename, lineno, file, line)

    if not getattr(warnings.showwarning, "_vlmrl", False):
        showwarning._vlmrl = True  # type: ignore[attr-defined]
        warnings.showwarning = showwarning

    # megatron-core and matplotlib: INFO and notices to the file, other warnings to the screen
    for name in ("megatron", "matplotlib"):
        logger = logging.getLogger(name)
        for h in [h for h in logger.handlers if getattr(h, "_vlmrl", False)]:
            logger.removeHandler(h)
        screen = logging.StreamHandler(sys.stderr)
        screen.setLevel(logging.WARNING)
        screen.addFilter(_NotNotice())
        screen._vlmrl = True  # type: ignore[attr-defined]
        logger.addHandler(sink)
        logger.addHandler(screen)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    # transformers keeps its own handler: notices leave it for the file
    _quiet_transformers()
    hf = logging.getLogger("transformers")
    for h in [h for h in hf.handlers if getattr(h, "_vlmrl", False)]:
        hf.removeHandler(h)
    for h in hf.handlers:
        if not any(isinstance(f, _NotNotice) for f in h.filters):
            h.addFilter(_NotNotice())
    hf.addHandler(sink)
    _installed = path


def _quiet_transformers() -> None:
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return
    from transformers.utils import logging as hf_logging

    hf_logging.get_logger("transformers")  # its handler exists from here on
    hf_logging.disable_progress_bar()

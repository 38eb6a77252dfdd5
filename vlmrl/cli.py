"""Shared start-up of vlmrl's Hydra entrypoints (train, plan, parity).

Only the standard library, Hydra and vlmrl.config are imported here, so `--cfg job`,
`--help` and the plan print in well under two seconds.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from .config import CONF_DIR, UnknownKeyError, check_overrides, register_configs

# A tool that only reads the config (plan, parity) leaves no run dir or log files behind.
NO_OUTPUT_DIR = ("hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=disabled",
                 "hydra/hydra_logging=disabled")


def hydra_entry(task: Callable[[Any], Any], *, config_name: str = "config",
                writes_run_dir: bool = True) -> Callable[[], Any]:
    """Wrap `task(cfg: DictConfig)` into a console entrypoint reading sys.argv.

    Override keys are checked against the schema first, so a typo fails with the valid
    keys listed; then Hydra composes and calls `task`.
    """
    import hydra

    register_configs()
    app = hydra.main(config_path=CONF_DIR, config_name=config_name, version_base=None)(task)

    def main() -> Any:
        try:
            check_overrides([a for a in sys.argv[1:] if not a.startswith("-")])
        except UnknownKeyError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        if not writes_run_dir:
            sys.argv.extend(NO_OUTPUT_DIR)
        if "--cfg" in sys.argv[1:] or "-c" in sys.argv[1:]:
            if "--resolve" not in sys.argv:
                sys.argv.append("--resolve")  # a dry run shows the values the job would get
        return app()

    return main


def job_output_dir(cfg: Any) -> str:
    """The run dir of this job: Hydra's output dir (one per job in a sweep)."""
    from hydra.core.hydra_config import HydraConfig

    try:
        return HydraConfig.get().runtime.output_dir
    except ValueError:  # composed outside a Hydra app (tests)
        return str(cfg.run_dir)

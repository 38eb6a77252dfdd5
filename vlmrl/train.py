"""The entrypoint: `python -m vlmrl.train [group=option ...] [key=value ...]`.

Composes the Hydra config, converts it once into frozen dataclasses, validates it, then
hands it to the loop. `--cfg job` prints the resolved config without importing torch,
megatron, ray or sglang; `-m` sweeps run one job after another, each in its own run dir.
"""

from __future__ import annotations

import sys
from typing import Any

from .cli import hydra_entry, job_output_dir


def run(cfg: Any) -> dict[str, Any] | None:
    from omegaconf import open_dict

    from .config import ConfigError, to_dataclass, validate

    with open_dict(cfg):
        cfg.run_dir = job_output_dir(cfg)
    try:
        config = validate(to_dataclass(cfg))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)

    if config.dry_run:
        return dry_run(cfg, config)

    from .envcheck import check_environment

    check_environment()
    from .loop import train

    return train(config)


def dry_run(cfg: Any, config: Any) -> dict[str, Any]:
    """What the job would run, printed; nothing is started (no torch, ray or megatron)."""
    from pathlib import Path

    from omegaconf import OmegaConf

    group = config.logger.group or Path(config.run_dir).name
    print(OmegaConf.to_yaml(cfg, resolve=True), end="")
    print(f"# dry run: valid; run dir {config.run_dir}; reward {config.reward.name}; wandb group {group}")
    return {"run_dir": config.run_dir, "reward": config.reward.name, "group": group}


main = hydra_entry(run)

if __name__ == "__main__":
    main()

"""Configuration: typed schema, Hydra registration, validation, rank layout.

Standard library and Hydra/OmegaConf only: this package is on the dry-run path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .layout import Layout, compute_layout
from .overrides import UnknownKeyError, check_key, check_overrides
from .schema import GROUPS, VlmrlConfig
from .store import register_configs, to_dataclass
from .validate import ConfigError, Violation, check, config_notes, validate

# the Hydra tree: `conf/` at the top of the repository, reached through the package's `conf`
# link in a checkout; a built wheel carries the tree itself there
CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")

__all__ = [
    "CONF_DIR",
    "GROUPS",
    "ConfigError",
    "Layout",
    "UnknownKeyError",
    "Violation",
    "VlmrlConfig",
    "check",
    "config_notes",
    "check_key",
    "check_overrides",
    "compose",
    "compute_layout",
    "load",
    "register_configs",
    "to_dataclass",
    "validate",
]


def compose(overrides: list[str] | tuple[str, ...] = ()) -> Any:
    """Compose the root config as Hydra would from the command line (no app run).

    For tests and tools; `hydra:` interpolations are unavailable here, so run_dir falls back
    to runs/<run_name>.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    check_overrides(list(overrides))
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return hydra_compose(config_name="config", overrides=list(overrides))


def load(overrides: list[str] | tuple[str, ...] = (), *, check_rules: bool = True) -> VlmrlConfig:
    """compose + convert to frozen dataclasses + validate."""
    cfg = to_dataclass(compose(overrides))
    return validate(cfg) if check_rules else cfg

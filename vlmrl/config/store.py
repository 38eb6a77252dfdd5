"""Registers the schema in Hydra's ConfigStore and converts composed configs to dataclasses."""

from __future__ import annotations

from typing import Any

from .schema import GROUPS, VlmrlConfig, seal

SCHEMA_NAME = "vlmrl_schema"


def _structured(cls: type) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.structured(cls)


def register_configs() -> None:
    """Root schema (`vlmrl_schema`, first in config.yaml's defaults) plus one per group.

    Each group option starts with `defaults: [_schema]`, so an option is typed even when it
    is composed outside the root config (e.g. by a test), and a key the schema lacks is an
    error in the option file itself.
    """
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name=SCHEMA_NAME, node=_structured(VlmrlConfig))
    for group, cls in GROUPS.items():
        cs.store(group=group, name="_schema", node=_structured(cls))


def to_dataclass(cfg: Any) -> VlmrlConfig:
    """Resolve interpolations and convert a composed DictConfig into frozen dataclasses."""
    from omegaconf import OmegaConf

    cfg = cfg.copy()
    OmegaConf.resolve(cfg)
    for key in ("hydra",):
        if key in cfg:
            with _open(cfg):
                del cfg[key]
    _cut_layer_pattern(cfg)
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, VlmrlConfig), type(obj)
    return seal(obj)


def _cut_layer_pattern(cfg: Any) -> None:
    """`model.lm.num_layers=N` below a model preset's `layer_types` keeps the model's first N
    layers: a list longer than num_layers that repeats every `full_attention_interval` layers
    (as published Qwen3.5 configs describe theirs) is cut to its first N entries. Any other
    mismatch is left for validation to name."""
    from ..contracts.sglang_layers import full_attention_interval

    lm = cfg.model.lm
    if not lm.get("layer_types"):
        return
    types, n = list(lm.layer_types), int(lm.num_layers)
    if 0 < n < len(types) and full_attention_interval(types) is not None:
        lm.layer_types = types[:n]


class _open:
    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    def __enter__(self) -> None:
        from omegaconf import OmegaConf

        self._was = OmegaConf.is_struct(self.cfg)
        OmegaConf.set_struct(self.cfg, False)

    def __exit__(self, *exc: object) -> None:
        from omegaconf import OmegaConf

        OmegaConf.set_struct(self.cfg, self._was)

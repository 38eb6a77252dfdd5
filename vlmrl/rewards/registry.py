"""Verifier presets by name, and construction from a ``reward/`` config entry."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any

from vlmrl.rewards.base import Verifier
from vlmrl.rewards.control import CoinFlipVerifier, ConstantVerifier
from vlmrl.rewards.geo3k import Geo3kVerifier
from vlmrl.rewards.math import MathVerifier

_PRESETS: dict[str, tuple[type[Verifier], dict[str, Any]]] = {
    "math": (MathVerifier, {}),
    "geo3k_tol05": (Geo3kVerifier, {"tolerance": 0.05}),
    "geo3k_strict": (Geo3kVerifier, {"tolerance": 0.0}),
    "coin_flip": (CoinFlipVerifier, {}),
    "constant": (ConstantVerifier, {}),
}

VERIFIER_NAMES: tuple[str, ...] = tuple(_PRESETS)


def get_verifier(name: str, **overrides: Any) -> Verifier:
    """The preset verifier ``name``, with any of its parameters overridden.

    Raises:
        ValueError: ``name`` is not a preset; the message lists the valid names.
    """
    try:
        cls, params = _PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown verifier {name!r}; valid names: {', '.join(VERIFIER_NAMES)}") from None
    return cls(**{"name": name, **params, **overrides})


def build_verifier(cfg: Mapping[str, Any]) -> Verifier:
    """Build a verifier from a ``reward/`` config entry (a dict or a DictConfig).

    With ``_target_`` (a dotted path to a :class:`Verifier` subclass) the other keys are
    its keyword arguments, as Hydra's ``instantiate`` would pass them; without it,
    ``name`` selects a preset and the other keys override its parameters.
    """
    params = dict(cfg)
    target = params.pop("_target_", None)
    if target is None:
        if "name" not in params:
            raise ValueError(f"reward config needs `_target_` or `name`, got keys {sorted(params)}")
        return get_verifier(**params)
    cls = _import_class(target)
    if not (isinstance(cls, type) and issubclass(cls, Verifier)):
        raise TypeError(f"reward `_target_` {target!r} is not a vlmrl.rewards.base.Verifier subclass")
    return cls(**params)


def _import_class(dotted_path: str) -> object:
    module_name, _, attribute = dotted_path.rpartition(".")
    if not module_name:
        raise ValueError(f"reward `_target_` must be a dotted path, got {dotted_path!r}")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"cannot import reward `_target_` {dotted_path!r}: {error}") from error


def verifier_params(reward: Any) -> dict[str, Any]:
    """The `reward` section (vlmrl.config.schema.RewardConfig) as keyword arguments of its
    `_target_` class.

    The schema carries every verifier's parameters; a key the target does not take must
    keep its schema default (e.g. `tolerance` with the math verifier), else it is an error.
    """
    from vlmrl.config.schema import RewardConfig

    params = dataclasses.asdict(reward)
    params.pop("eval_target")  # a loop setting, not a verifier parameter
    module, _, name = reward._target_.rpartition(".")
    accepted = {f.name for f in dataclasses.fields(getattr(importlib.import_module(module), name))}
    defaults = RewardConfig()
    out = {"_target_": params.pop("_target_")}
    for key, value in params.items():
        if key in accepted:
            out[key] = value
        elif value != getattr(defaults, key):
            raise ValueError(f"reward.{key}={value!r} is not a parameter of {reward._target_}")
    return out


def eval_verifier(train: Verifier, eval_target: str | None) -> Verifier | None:
    """What evaluations score with: correctness, so the training verifier `train` without its
    format requirement, or the class `eval_target` names; None when `train` itself serves."""
    if eval_target:
        return build_verifier({"_target_": eval_target, "name": "eval"})
    if train.format_pattern is not None:
        return dataclasses.replace(train, format_pattern=None)
    return None

"""Checks command-line override keys against the schema before Hydra composes.

Hydra's struct mode already rejects an unknown key; this check runs first so that the
error also lists the valid keys at that level (and suggests the closest one).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any

from .schema import GROUPS, VlmrlConfig


class UnknownKeyError(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message otherwise
        return str(self.args[0])


def _fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _dataclass_of(tp: Any) -> type | None:
    if dataclasses.is_dataclass(tp):
        return tp  # type: ignore[return-value]
    for arg in typing.get_args(tp):
        if dataclasses.is_dataclass(arg):
            return arg  # type: ignore[return-value]
    return None


def _is_open_dict(tp: Any) -> bool:
    return tp is dict or typing.get_origin(tp) is dict or tp is Any


def check_key(key: str) -> None:
    """Raise UnknownKeyError if the dotted `key` does not exist in the schema."""
    cls: type | None = VlmrlConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        assert cls is not None
        fields = _fields(cls)
        if part not in fields:
            where = ".".join(parts[:i]) or "the root config"
            valid = sorted(fields)
            close = difflib.get_close_matches(part, valid, n=1)
            hint = f" Did you mean '{'.'.join([*parts[:i], close[0]])}'?" if close else ""
            raise UnknownKeyError(
                f"Unknown config key '{key}': '{part}' is not a key of {where}.{hint}\n"
                f"Valid keys of {where}: {', '.join(valid)}"
            )
        tp = fields[part]
        if _is_open_dict(tp):
            return  # pass-through dicts (trainer.megatron, rollout.sglang.server_args)
        cls = _dataclass_of(tp)
        if cls is None:
            if i < len(parts) - 1:
                raise UnknownKeyError(f"Unknown config key '{key}': '{'.'.join(parts[: i + 1])}' is a value, "
                                      "not a section")
            return


def check_overrides(overrides: list[str]) -> None:
    """Validate the keys of `key=value` overrides (group choices and hydra.* pass)."""
    for item in overrides:
        if "=" not in item or item.startswith(("hydra.", "hydra/", "~", "+")):
            continue
        key = item.split("=", 1)[0].lstrip("+")
        if key in GROUPS or "/" in key or key in ("experiment",):
            continue  # a group choice: Hydra lists the options itself
        if key.startswith("++"):
            continue
        check_key(key)

"""What SGLang builds from a checkpoint's config.json, checked before any engine starts.

SGLang does not read a Qwen3.5 checkpoint with transformers' config classes but with its
own, whose defaults differ from what the checkpoint's weights describe where a key is
missing. Two such differences break a run late and badly, so vlmrl refuses them up front:

- the language model's layer kinds: SGLang's Qwen3.5 text config derives them from one
  `full_attention_interval` (layer l is full attention when (l + 1) % interval == 0) and
  ignores `layer_types`; without the key it cannot build the model, and with a value that
  disagrees with `layer_types` it builds other layers than the weights belong to;
- the vision tower's deepstack features: SGLang's Qwen3.5 vision config defaults
  `deepstack_visual_indexes` to Qwen3-VL's [8, 16, 24] and then reserves deepstack input
  for each of them per image token; the Qwen3.5 tower has no deepstack mergers, nothing is
  captured, and every request with an image kills SGLang's scheduler.

SGLang's classes, defaults and required attributes are read from its source, not typed
here: `model_configs` is the `model_configs` section of vlmrl's SGLang contract
(`vlmrl.contracts.sglang_contract`), {model_type: {"text" | "vision": {"class": name,
"defaults": {init parameter: literal value or {"source": text}}, "required": [attribute
the class reads that no __init__ assigns]}}}.

Import-light (the config validation imports it): no torch, no transformers at module scope.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..config.schema import ModelConfig
from ..contracts.sglang_layers import (  # noqa: F401  (the layer rule's functions, used here and by callers)
    FULL,
    LINEAR,
    closest_interval,
    full_attention_interval,
    layer_types_override,
    sglang_layer_types,
)

QWEN3_5_FAMILIES = ("qwen3_5", "qwen3_5_moe")
SECTIONS = {"text": "text_config", "vision": "vision_config"}

# what published Qwen3.5 configs carry beyond transformers' own fields: keys SGLang reads
# (the tiny maker writes them; `mtp_num_hidden_layers` is the tiny models' own: no MTP weights)
QWEN3_5_TEXT_KEYS = {"attn_output_gate": True, "mamba_ssm_dtype": "float32", "output_gate_type": "swish",
                     "mtp_num_hidden_layers": 0, "mtp_use_dedicated_embeddings": False}
QWEN3_5_VISION_KEYS = {"deepstack_visual_indexes": []}


def _differences(derived: Sequence[str], types: Sequence[str], limit: int = 4) -> str:
    diff = [f"layer {i}: {a} where the weights are {b}" for i, (a, b) in enumerate(zip(derived, types)) if a != b]
    more = f" (and {len(diff) - limit} more)" if len(diff) > limit else ""
    return "; ".join(diff[:limit]) + more


# --------------------------------------------------------------------------- the check
def _default(spec: Mapping[str, Any], key: str) -> tuple[bool, Any, str]:
    """(known, value, text) of the default SGLang's class gives `key` (value: when literal)."""
    value = dict(spec.get("defaults") or {}).get(key)
    if isinstance(value, Mapping) and set(value) == {"source"}:
        try:
            value = ast.literal_eval(value["source"])
        except (ValueError, SyntaxError):
            return False, None, str(value["source"])
    return True, value, json.dumps(value)


def sglang_config_problems(config: Mapping[str, Any], family: str, model_configs: Mapping[str, Any], *,
                           file: str = "config.json") -> list[str]:
    """What SGLang would get wrong building a model from the checkpoint config `config` (the
    dict of its config.json, at `file`) of the vlmrl model family `family`: one line per
    problem, naming the key, the file, SGLang's default and what SGLang would do. Empty when
    SGLang builds what the checkpoint describes (and for families SGLang's contract has no
    own config class of: those it reads with transformers, as vlmrl does)."""
    model_type = config.get("model_type")
    entry = model_configs.get(model_type) if isinstance(model_type, str) else None
    if entry is None:
        if family in QWEN3_5_FAMILIES:
            return [f"{file}: model_type={model_type!r} has no config class in vlmrl's SGLang contract (it knows "
                    f"{sorted(model_configs)}): what SGLang builds from this checkpoint cannot be checked"]
        return []
    out: list[str] = []
    subs: dict[str, Mapping[str, Any]] = {}
    for section, key in SECTIONS.items():
        spec = entry.get(section)
        if spec is None:
            continue
        sub = config.get(key)
        if not isinstance(sub, Mapping):
            out.append(f"{key} is missing from {file}: SGLang builds it with {spec['class']}")
            continue
        subs[section] = sub
        for attr in spec.get("required") or ():
            if attr in sub or (section == "text" and attr == "full_attention_interval"):
                continue  # (full_attention_interval: its own message below)
            out.append(f"{key}.{attr} is missing from {file}: SGLang's {spec['class']} reads it and has no "
                       "default for it, so SGLang cannot build the model")
    if family in QWEN3_5_FAMILIES:
        if "text" in subs:
            out += _layer_kind_problems(subs["text"], entry["text"], file)
        if "vision" in subs:
            out += _deepstack_problems(subs["vision"], entry["vision"], file)
    return out


def _layer_kind_problems(text: Mapping[str, Any], spec: Mapping[str, Any], file: str) -> list[str]:
    cls = spec["class"]
    reads = "full_attention_interval" in (spec.get("required") or ()) or "full_attention_interval" in dict(
        spec.get("defaults") or {})
    if not reads:
        return []  # an SGLang that derives layer kinds some other way
    n = text.get("num_hidden_layers")
    types = text.get("layer_types")
    if types is not None and n is not None and len(types) != n:
        return [f"text_config.layer_types in {file} has {len(types)} entries for num_hidden_layers={n}"]
    rule = "layer l is full attention when (l + 1) % full_attention_interval == 0; it ignores layer_types"
    if "full_attention_interval" not in text:
        known, default, shown = _default(spec, "full_attention_interval")
        if "full_attention_interval" in (spec.get("required") or ()) or (known and default is None):
            what = "has no default for it and cannot build the model"
        else:
            what = f"defaults it to {shown}"
        fix = ""
        if types is not None:
            k = full_attention_interval(types)
            fix = (f"; add \"full_attention_interval\": {k} to text_config (the interval of its layer_types)"
                   if k is not None else f"; its layer_types {list(types)} follow no interval, so SGLang cannot "
                   "serve this checkpoint")
        return [f"text_config.full_attention_interval is missing from {file}: SGLang's {cls} {what} "
                f"({rule}){fix}"]
    k = text["full_attention_interval"]
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        return [f"text_config.full_attention_interval={k!r} in {file} must be an integer >= 1 ({cls}: {rule})"]
    if types is None or n is None:
        return []  # transformers derives layer_types from the same interval
    derived = sglang_layer_types(k, n)
    if derived == list(types):
        return []
    good = full_attention_interval(types)
    fix = (f"set it to {good}" if good is not None
           else f"its layer_types {list(types)} follow no interval, so SGLang cannot serve this checkpoint")
    return [f"text_config.full_attention_interval={k} in {file} disagrees with text_config.layer_types: SGLang's "
            f"{cls} ({rule}) would build {_differences(derived, list(types))}; {fix}"]


def _deepstack_problems(vision: Mapping[str, Any], spec: Mapping[str, Any], file: str) -> list[str]:
    cls, key = spec["class"], "deepstack_visual_indexes"
    fix = f"set \"{key}\": [] in vision_config, as published Qwen3.5 checkpoints do"
    crash = ("SGLang reserves deepstack input for {n} vision layer(s) per image token, but the Qwen3.5 vision "
             "tower (transformers', the one vlmrl trains) has no deepstack mergers and captures nothing, so every "
             "request with an image kills SGLang's scheduler (a masked_scatter size check)")
    if key in vision:
        value = vision[key]
        if isinstance(value, list) and not value:
            return []
        n = len(value) if isinstance(value, list) else "some"
        return [f"vision_config.{key}={json.dumps(value)} in {file}: {crash.format(n=n)}; {fix}"]
    if key not in dict(spec.get("defaults") or {}) and key not in (spec.get("required") or ()):
        return []  # an SGLang that does not read it
    known, default, shown = _default(spec, key)
    if known and isinstance(default, list) and not default:
        return []
    n = len(default) if known and isinstance(default, list) else "some"
    what = ("has no default for it and cannot build the model" if key in (spec.get("required") or ())
            else f"defaults it to {shown}: {crash.format(n=n)}")
    return [f"vision_config.{key} is missing from {file}: SGLang's {cls} {what}; {fix}"]


# --------------------------------------------------------------------------- entry point
def read_config_json(path: str) -> tuple[dict[str, Any], str]:
    """(the dict of config.json, where it was read) of a checkpoint: a local directory or a hub id."""
    local = Path(path) / "config.json"
    if not local.exists():
        from transformers.utils import cached_file

        local = Path(cached_file(path, "config.json"))
    return json.loads(local.read_text()), str(local)


def contract_model_configs(version: str | None = None) -> Mapping[str, Any]:
    """The `model_configs` section of vlmrl's SGLang contract of `version` (None: the newest
    release vlmrl has a contract for)."""
    from ..contracts.sglang_contract import load_contract

    contract = load_contract(version)
    if "model_configs" not in contract:
        raise RuntimeError(f"vlmrl's SGLang {contract.get('sglang_version', version)} contract has no model_configs "
                           "section (SGLang's model config classes): regenerate it with `make sglang-contract`")
    return contract["model_configs"]


def check_sglang_checkpoint(model: ModelConfig, path: str, model_configs: Mapping[str, Any] | None = None, *,
                            sglang_version: str | None = None) -> None:
    """Raise ValueError listing every problem `sglang_config_problems` finds in the checkpoint
    at `path` (a local directory or a hub id) for `model` (rollout=sglang; call it before any
    engine starts). `model_configs`: SGLang's config classes; default: those of vlmrl's SGLang
    contract of `sglang_version` (default: the contract's default release)."""
    config, file = read_config_json(path)
    configs = contract_model_configs(sglang_version) if model_configs is None else model_configs
    problems = sglang_config_problems(config, model.family, configs, file=file)
    if problems:
        raise ValueError(f"SGLang would not build the model of the checkpoint {path} (model={model.name}, "
                         f"rollout=sglang) as its weights describe it; fix {file}:\n  - " + "\n  - ".join(problems))

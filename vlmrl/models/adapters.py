"""Weights between HF checkpoints and the Megatron Qwen-VL model, in both directions.

HF names here are the checkpoint names (`vlmrl.models.names`, per family: Qwen2.5-VL's
`model.layers.0...` / `visual.blocks.0...`, Qwen3.5's `model.language_model.layers.0...` /
`model.visual...` with one tensor per routed expert); in-memory transformers state dicts
are accepted on input too.

Only the language model changes layout. Per Megatron parameter a `Rule`
(`vlmrl.models.rules`, given by the model's family) says which HF tensors it comes from and
how tensor parallelism cuts it: copy, rows, cols, qkv, qkv_gated, gate_up, gdn_qkv, and the
routed experts (experts_gate_up / experts_down), which are cut over expert parallelism
instead. Pipeline stages own consecutive layers: Megatron's local layer j on a stage whose
first layer is `offset` is HF layer offset + j; expert-parallel rank r of E_local experts
holds experts [r * E_local, (r + 1) * E_local).

Pure functions (`hf_to_megatron`, `megatron_to_hf`) convert state dicts of one rank /
all TP shards without any process group; `load_hf_weights` and `iter_hf_weights` apply
them to live model chunks, gathering across TP, EP and PP ranks for export and weight sync.
All conversions are views, cuts and concatenations: the round trip is bitwise lossless.
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..config.schema import ModelConfig
from . import families
from .rules import Rule

LM = "language_model."
_LAYER = re.compile(r"^language_model\.decoder\.layers\.(\d+)\.(.+)$")


def rule_for(model: ModelConfig, megatron_name: str, *, layer_offset: int, experts: range | None = None) -> Rule:
    """How the Megatron parameter `megatron_name` (a QwenVLModel chunk's name) maps to HF.

    experts: the global indices of the routed experts the parameter holds (expert-parallel
    shard); all of the model's experts when None."""
    family = families.get(model.family)
    if megatron_name.startswith("visual."):
        return Rule("copy", (family.VISION_PREFIX + megatron_name[len("visual."):],))
    if experts is None:
        experts = range(model.lm.num_experts)
    if megatron_name.startswith(LM):
        rest = megatron_name[len(LM):]
        m = _LAYER.match(megatron_name)
        rule = (family.layer_rule(model, layer_offset + int(m.group(1)), m.group(2), experts) if m
                else family.top_rule(model, rest))
        if rule is not None:
            return rule
    raise KeyError(f"no HF mapping for Megatron parameter {megatron_name!r} (family {model.family})")


# --------------------------------------------------------------------------- tensor cuts
def _qkv_fuse(model: ModelConfig, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    lm = model.lm
    g, hd = lm.num_query_groups, lm.head_dim
    per = lm.num_attention_heads // g
    tail = q.shape[1:]
    qg = q.reshape(g, per * hd, *tail)
    kg = k.reshape(g, hd, *tail)
    vg = v.reshape(g, hd, *tail)
    return torch.cat([qg, kg, vg], dim=1).reshape(g * (per + 2) * hd, *tail)


def _qkv_split(model: ModelConfig, fused: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    lm = model.lm
    g, hd = lm.num_query_groups, lm.head_dim
    per = lm.num_attention_heads // g
    tail = fused.shape[1:]
    x = fused.reshape(g, (per + 2) * hd, *tail)
    q, k, v = x.split([per * hd, hd, hd], dim=1)
    return (q.reshape(g * per * hd, *tail), k.reshape(g * hd, *tail), v.reshape(g * hd, *tail))


def _qkv_gated_fuse(model: ModelConfig, q_gate: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """HF q_proj rows [query_h; gate_h] per head, k_proj, v_proj -> Megatron rows per query
    group g: [queries of g; gates of g; k_g; v_g]."""
    lm = model.lm
    g, hd = lm.num_query_groups, lm.head_dim
    per = lm.num_attention_heads // g
    tail = q_gate.shape[1:]
    qg = q_gate.reshape(g, per, 2, hd, *tail)
    q, gate = qg[:, :, 0].reshape(g, per * hd, *tail), qg[:, :, 1].reshape(g, per * hd, *tail)
    return torch.cat([q, gate, k.reshape(g, hd, *tail), v.reshape(g, hd, *tail)], dim=1).reshape(-1, *tail)


def _qkv_gated_split(model: ModelConfig, fused: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    lm = model.lm
    g, hd = lm.num_query_groups, lm.head_dim
    per = lm.num_attention_heads // g
    tail = fused.shape[1:]
    q, gate, k, v = fused.reshape(g, (2 * per + 2) * hd, *tail).split([per * hd, per * hd, hd, hd], dim=1)
    q_gate = torch.stack([q.reshape(g, per, hd, *tail), gate.reshape(g, per, hd, *tail)], dim=2)
    return q_gate.reshape(-1, *tail), k.reshape(g * hd, *tail), v.reshape(g * hd, *tail)


def _gdn_dims(model: ModelConfig) -> tuple[int, int, int, int]:
    lm = model.lm
    return lm.linear_num_key_heads, lm.linear_key_head_dim, lm.linear_num_value_heads, lm.linear_value_head_dim


def _gdn_group(model: ModelConfig, flat: Tensor) -> Tensor:
    """HF rows [all q; all k; all v] -> per key head h: [q_h; k_h; v of value heads of h]."""
    hk, dk, hv, dv = _gdn_dims(model)
    tail = flat.shape[1:]
    q, k, v = flat.split([hk * dk, hk * dk, hv * dv], dim=0)
    parts = [q.reshape(hk, dk, *tail), k.reshape(hk, dk, *tail), v.reshape(hk, hv // hk * dv, *tail)]
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def _gdn_ungroup(model: ModelConfig, grouped: Tensor) -> Tensor:
    hk, dk, hv, dv = _gdn_dims(model)
    tail = grouped.shape[1:]
    q, k, v = grouped.reshape(hk, 2 * dk + hv // hk * dv, *tail).split([dk, dk, hv // hk * dv], dim=1)
    return torch.cat([q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)])


def to_megatron(model: ModelConfig, rule: Rule, hf: Sequence[Tensor], tp_rank: int, tp_size: int) -> Tensor:
    """This TP rank's Megatron tensor from the full HF tensor(s) of `rule`."""
    if rule.kind == "copy":
        return hf[0]
    if rule.kind == "rows":
        return _cut(hf[0], 0, tp_rank, tp_size)
    if rule.kind == "cols":
        return _cut(hf[0], 1, tp_rank, tp_size)
    if rule.kind == "qkv":
        return _cut(_qkv_fuse(model, *hf), 0, tp_rank, tp_size)
    if rule.kind == "gate_up":
        return torch.cat([_cut(hf[0], 0, tp_rank, tp_size), _cut(hf[1], 0, tp_rank, tp_size)])
    if rule.kind == "qkv_gated":
        return _cut(_qkv_gated_fuse(model, *hf), 0, tp_rank, tp_size)
    if rule.kind == "gdn_qkv":
        return _cut(_gdn_group(model, hf[0]), 0, tp_rank, tp_size)
    if rule.kind == "experts_gate_up":  # (gate_e0, up_e0, gate_e1, up_e1, ...) -> [E, 2I, H], one copy
        stacked = torch.stack(list(hf))
        return stacked.reshape(len(hf) // 2, 2 * stacked.shape[1], *stacked.shape[2:])
    if rule.kind == "experts_down":
        return torch.stack(list(hf))
    raise ValueError(rule.kind)


def to_hf(model: ModelConfig, rule: Rule, shards: Sequence[Tensor]) -> list[Tensor]:
    """The full HF tensor(s) of `rule` from the Megatron tensors of all TP ranks (rank order).
    With one shard nothing is joined: the results may be (views of) the shard itself."""
    if rule.kind == "copy":
        return [shards[0]]
    if rule.kind == "rows":
        return [_join(shards, 0)]
    if rule.kind == "cols":
        return [_join(shards, 1)]
    if rule.kind == "qkv":
        return list(_qkv_split(model, _join(shards, 0)))
    if rule.kind == "gate_up":
        halves = [s.chunk(2, 0) for s in shards]
        return [_join([h[0] for h in halves], 0), _join([h[1] for h in halves], 0)]
    if rule.kind == "qkv_gated":
        return list(_qkv_gated_split(model, _join(shards, 0)))
    if rule.kind == "gdn_qkv":
        return [_gdn_ungroup(model, _join(shards, 0))]
    if rule.kind == "experts_gate_up":  # shards: expert-parallel ranks in order, [E_r, 2I, H] each
        experts = _join(shards, 0)  # -> [gate_0, up_0, gate_1, up_1, ...] in one unbind
        return list(experts.reshape(2 * experts.shape[0], experts.shape[1] // 2, *experts.shape[2:]).unbind(0))
    if rule.kind == "experts_down":
        return list(_join(shards, 0).unbind(0))
    raise ValueError(rule.kind)


def fused_expert_name(model: ModelConfig, rule: Rule) -> str:
    """transformers' in-memory name of the fused tensor that holds every routed expert of an
    `experts_gate_up` / `experts_down` rule ([E, 2I, H]: each expert's gate rows, then its up
    rows; [E, H, I]), as vlmrl's expert parameters hold them."""
    if rule.kind not in ("experts_gate_up", "experts_down"):
        raise ValueError(f"{rule.kind!r} is not a routed-expert rule")
    return families.get(model.family).module_slot(rule.hf[0])[0]


def _join(shards: Sequence[Tensor], dim: int) -> Tensor:
    """The shards end to end along `dim`; one shard as it is (no copy)."""
    return shards[0] if len(shards) == 1 else torch.cat(list(shards), dim)


def _cut(t: Tensor, dim: int, rank: int, size: int) -> Tensor:
    if t.shape[dim] % size:
        raise ValueError(f"dimension {dim} of shape {tuple(t.shape)} does not split over {size} TP ranks")
    return t.chunk(size, dim)[rank]


# --------------------------------------------------------------------------- pure state dicts
def hf_to_megatron(model: ModelConfig, hf: Mapping[str, Tensor], megatron_names: Sequence[str], *,
                   tp_rank: int = 0, tp_size: int = 1, layer_offset: int = 0,
                   experts: range | None = None) -> dict[str, Tensor]:
    """Megatron tensors of one rank's chunk (its parameter names given) from an HF state dict.

    experts: the routed experts this rank holds (expert parallelism); all when None."""
    hf = canonical(hf, model)
    return {n: _megatron_tensor(model, hf, n, tp_rank, tp_size, layer_offset, experts) for n in megatron_names}


def _megatron_tensor(model: ModelConfig, hf: Mapping[str, Tensor], name: str, tp_rank: int, tp_size: int,
                     layer_offset: int, experts: range | None) -> Tensor:
    """`hf_to_megatron` for one parameter of a canonical (checkpoint-named) `hf`."""
    rule = rule_for(model, name, layer_offset=layer_offset, experts=experts)
    return to_megatron(model, rule, [_get(hf, h) for h in rule.hf], tp_rank, tp_size)


def megatron_to_hf(model: ModelConfig, shards: Sequence[Mapping[str, Tensor]], *,
                   layer_offset: int = 0) -> dict[str, Tensor]:
    """HF tensors from the state dicts of all TP ranks (rank order) of one pipeline stage
    (no expert parallelism: each state dict holds every expert)."""
    out: dict[str, Tensor] = {}
    for n in shards[0]:
        rule = rule_for(model, n, layer_offset=layer_offset)
        if rule.export:
            parts = [shards[0][n]] if rule.expert else [s[n] for s in shards]
            out.update(zip(rule.hf, to_hf(model, rule, parts)))
    return out


def megatron_names(model: ModelConfig, *, num_layers: int, pre_process: bool, post_process: bool,
                   vision_names: Sequence[str] = ()) -> list[str]:
    """Parameter names of one QwenVLModel chunk of a dense full-attention model (Qwen2.5-VL),
    without building it. For offline conversion and tests; live chunks report their own names.
    `vision_names`: the vision tower's parameter names (Megatron side: `visual.*`)."""
    lm = model.lm
    if lm.layer_types and set(lm.layer_types) != {"full_attention"} or lm.num_experts:
        raise ValueError("megatron_names lists dense full-attention layers only; build the model for others")
    out = [n for n in vision_names] if pre_process else []
    if pre_process:
        out.append(LM + "embedding.word_embeddings.weight")
    layer = ["input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
             "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    if lm.add_qkv_bias:
        layer.insert(2, "self_attention.linear_qkv.bias")
    if lm.qk_layernorm:
        layer += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
    out += [f"{LM}decoder.layers.{j}.{x}" for j in range(num_layers) for x in layer]
    if post_process:
        out.append(LM + "decoder.final_layernorm.weight")
        if not (lm.tie_word_embeddings and pre_process):
            out.append(LM + "output_layer.weight")
    return out


def canonical(hf: Mapping[str, Tensor], model: ModelConfig) -> Mapping[str, Tensor]:
    """An HF state dict keyed by checkpoint names (in-memory transformers names converted)."""
    if isinstance(hf, SafetensorsDir):
        return hf
    return families.get(model.family).to_checkpoint(dict(hf))


def _get(hf: Mapping[str, Tensor], name: str) -> Tensor:
    if name in hf:
        return hf[name]
    if name == "lm_head.weight":
        raise KeyError("lm_head.weight is missing and the model does not tie word embeddings")
    raise KeyError(f"HF weight {name!r} is missing")


class SafetensorsDir(Mapping):
    """Lazy read-only mapping over the safetensors files of an HF checkpoint directory, keyed
    by checkpoint names: in-memory names are converted, and a routed-expert tensor stored
    fused ([E, 2I, H] / [E, H, I]) appears as its per-expert slices."""

    def __init__(self, path: str | Path, family: str) -> None:
        self.path = Path(path)
        self.family = families.get(family)
        self._files: dict[Path, Any] = {}  # each file opened once, for its keys and its tensors
        self._fused: tuple[Path, str, Tensor] | None = None  # the last fused tensor read
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            files = {k: self.path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            files = {}
            found = sorted(self.path.glob("*.safetensors"))
            if not found:
                raise FileNotFoundError(f"no safetensors files in {self.path}")
            for f in found:
                files.update({k: f for k in self._file(f).keys()})
        # checkpoint name -> (file, stored key, index into the stored tensor or None)
        self._where: dict[str, tuple[Path, str, tuple | None]] = {}
        for key, f in files.items():
            name = self.family.to_checkpoint_name(key)
            if not self.family.is_fused(name):
                self._where[name] = (f, key, None)
                continue
            num = self._file(f).get_slice(key).get_shape()[0]  # a fused tensor: one entry per slice
            for part, index in self.family.fused_parts(name, num):
                self._where[part] = (f, key, index)

    def _file(self, f: Path) -> Any:
        from safetensors import safe_open

        if f not in self._files:
            self._files[f] = safe_open(f, "pt")
        return self._files[f]

    def __getitem__(self, name: str) -> Tensor:
        f, key, index = self._where[name]
        if index is None:
            return self._file(f).get_tensor(key)
        # a fused tensor's slices are asked for one after another: it is read once for all
        if self._fused is None or self._fused[:2] != (f, key):
            self._fused = (f, key, self._file(f).get_tensor(key))
        return self.family.take(self._fused[2], index).clone()

    def __contains__(self, name: object) -> bool:  # Mapping's own would read the tensor
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


# --------------------------------------------------------------------------- live models
def _coords() -> tuple[int, int]:
    from megatron.core import parallel_state as mps

    return mps.get_tensor_model_parallel_rank(), mps.get_tensor_model_parallel_world_size()


def _local_experts(model: ModelConfig) -> range | None:
    """The global indices of the routed experts this rank holds (None: a dense model)."""
    if not model.lm.num_experts:
        return None
    from megatron.core import parallel_state as mps

    size = mps.get_expert_model_parallel_world_size()
    per = model.lm.num_experts // size
    rank = mps.get_expert_model_parallel_rank()
    return range(rank * per, (rank + 1) * per)


def _chunk_offset(chunk: Any) -> int:
    from .bridge import stage_layers

    return stage_layers(chunk.config, vp_stage=chunk.vp_stage)[0]


@torch.no_grad()
def load_hf_weights(chunks: Sequence[Any], model: ModelConfig, source: str | Path | Mapping[str, Tensor], *,
                    language_model_only: bool = False) -> int:
    """Copy HF weights (a checkpoint directory or a state dict) into this rank's chunks;
    returns how many tensors were copied. `language_model_only`: the vision tower keeps its
    weights (a text model's state dict, under the checkpoint's `model.language_model.` names).

    Every tensor keeps the dtype of the parameter it lands in (float32 `A_log` and GDN norm
    weights stay float32 when the rest trains in bf16)."""
    hf = SafetensorsDir(source, model.family) if isinstance(source, (str, Path)) else canonical(source, model)
    tp_rank, tp_size = _coords()
    experts = _local_experts(model)
    copied = 0
    for chunk in chunks:
        params = {n: p for n, p in chunk.named_parameters() if not (language_model_only and "visual" in n)}
        offset = _chunk_offset(chunk)
        for n, p in params.items():  # one tensor at a time: the host never holds the whole model
            v = _megatron_tensor(model, hf, n, tp_rank, tp_size, offset, experts)
            if v.shape != p.shape:
                raise ValueError(f"{n}: HF gives shape {tuple(v.shape)}, the model has {tuple(p.shape)}")
            p.copy_(v)
        copied += len(params)
    return copied


def _grad_of(p: Tensor) -> Tensor:
    g = getattr(p, "main_grad", None)
    if g is None:
        g = p.grad
    return torch.zeros_like(p) if g is None else g


@torch.no_grad()
def iter_hf_weights(chunks: Sequence[Any], model: ModelConfig, *, bucket_bytes: int = 512 << 20,
                    grads: bool = False, dtype: torch.dtype | None = None,
                    compact: bool = True, fused_experts: bool = False) -> Iterator[list[tuple[str, Tensor]]]:
    """Yield the full model as (hf_name, tensor) buckets of about `bucket_bytes` each.

    Collective over the tensor-, expert- and pipeline-parallel groups: every rank of a model
    replica calls it and receives the same buckets (all stages, all TP shards and all
    experts gathered). `grads=True` exports gradients (`main_grad` under Megatron DDP, else
    `.grad`) instead of weights; under pipeline parallelism with tied embeddings the first
    stage's embedding gradient must already include the output layer's (Megatron's
    finalize_model_grads). `dtype` casts floating tensors; float32 ones kept float32 by the
    model (`A_log`, the GDN norm) are cast like the rest.

    Tensors may be views into the parameters (or into larger tensors): with `compact` each
    such view is copied into storage of its own size (`_compact`), for consumers that would
    otherwise move its base's bytes. A consumer that copies every tensor anyway (the
    flattened bucket of the colocated sync) passes compact=False and saves a copy and a
    launch per view: for a MoE, every expert's gate, up and down matrix.

    `fused_experts`: each layer's routed experts as one tensor under transformers' in-memory
    name (`...mlp.experts.gate_up_proj` [E, 2I, H], `...mlp.experts.down_proj` [E, H, I];
    `fused_expert_name`) instead of one per expert and matrix under checkpoint names: for
    engines that load a layer's experts in one copy (`vlmrl_sglang_loader`).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as mps

    get = _grad_of if grads else (lambda p: p.data)
    tp_group = mps.get_tensor_model_parallel_group()
    tp_size = mps.get_tensor_model_parallel_world_size()
    ep_group = mps.get_expert_model_parallel_group() if model.lm.num_experts else None
    ep_size = mps.get_expert_model_parallel_world_size() if model.lm.num_experts else 1
    pp_group = mps.get_pipeline_model_parallel_group()
    pp_size = mps.get_pipeline_model_parallel_world_size()
    pp_rank = mps.get_pipeline_model_parallel_rank()

    def gather(t: Tensor, size: int, group: Any) -> list[Tensor]:
        if size == 1:
            return [t]
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return parts

    def local_entries() -> Iterator[tuple[str, Tensor]]:
        for chunk in chunks:
            rules = _chunk_rules(chunk, model)  # experts: all of them, after the gather
            for n, p in chunk.named_parameters():
                rule = rules[n]
                if not rule.export:
                    continue
                t = get(p).detach()
                if rule.expert:
                    shards = gather(t, ep_size, ep_group)
                    if fused_experts:
                        yield fused_expert_name(model, rule), _join(shards, 0)
                        continue
                elif rule.kind == "copy":
                    shards = [t]
                else:
                    shards = gather(t, tp_size, tp_group)
                yield from zip(rule.hf, to_hf(model, rule, shards))

    def stage_entries() -> Iterator[tuple[str, Tensor]]:
        if pp_size == 1:
            yield from local_entries()
            return
        mine = list(local_entries())
        meta = [(n, tuple(t.shape), t.dtype) for n, t in mine]
        every: list[Any] = [None] * pp_size
        dist.all_gather_object(every, meta, group=pp_group)
        ranks = dist.get_process_group_ranks(pp_group)
        for stage in range(pp_size):
            for j, (n, shape, dt) in enumerate(every[stage]):
                t = mine[j][1].contiguous() if stage == pp_rank else \
                    torch.empty(shape, dtype=dt, device=mine[0][1].device if mine else None)
                dist.broadcast(t, src=ranks[stage], group=pp_group)
                yield n, t

    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for n, t in stage_entries():
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        if compact:
            t = _compact(t)
        bucket.append((n, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


_RULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _chunk_rules(chunk: Any, model: ModelConfig) -> dict[str, Rule]:
    """`rule_for` of every parameter of `chunk`, worked out once per chunk and model config:
    every weight sync walks all of them, and name matching costs 5-15 us per parameter on the
    host (a few ms per sync of a real model)."""
    hit = _RULES.get(chunk)
    if hit is None or hit[0] is not model:
        offset = _chunk_offset(chunk)
        hit = (model, {n: rule_for(model, n, layer_offset=offset) for n, _ in chunk.named_parameters()})
        _RULES[chunk] = hit
    return hit[1]


def _compact(t: Tensor) -> Tensor:
    """`t` in storage of its own size: a view into a larger tensor (an expert of the fused
    experts, q of the fused qkv) is copied, so that sending or pickling it moves its own
    bytes, not its base's."""
    if t.untyped_storage().nbytes() > t.numel() * t.element_size():
        return t.clone()
    return t


def export_hf_state_dict(chunks: Sequence[Any], model: ModelConfig, *, grads: bool = False,
                         dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """The whole model as one HF state dict (checkpoint names), on every calling rank."""
    out: dict[str, Tensor] = {}
    for bucket in iter_hf_weights(chunks, model, grads=grads, dtype=dtype, bucket_bytes=1 << 62):
        out.update((n, t.clone()) for n, t in bucket)
    return out

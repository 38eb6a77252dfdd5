"""Weights between HF checkpoints and the Megatron Qwen-VL model, in both directions.

HF names here are the checkpoint names (`vlmrl.models.names`: `model.layers.0...`,
`visual.blocks.0...`, `lm_head.weight`); in-memory transformers names
(`model.language_model...`, `model.visual...`) are accepted on input too.

Only the language model changes layout. Per Megatron parameter a `Rule` says which HF
tensors it comes from and how tensor parallelism cuts it:
- qkv: q/k/v projections fused per query group ([q heads of group g; k_g; v_g] for each
  g), cut by groups (column parallel);
- gate_up: [gate_r; up_r] on TP rank r (column parallel, SwiGLU fused);
- rows: cut along dim 0 (column-parallel linears, vocab-parallel embedding/output);
- cols: cut along dim 1 (row-parallel o_proj and down_proj);
- copy: replicated (norms; every vision parameter, at its unchanged HF name).
Pipeline stages own consecutive layers: Megatron's local layer j on a stage whose first
layer is `offset` is HF layer offset + j.

Pure functions (`hf_to_megatron`, `megatron_to_hf`) convert state dicts of one rank /
all TP shards without any process group; `load_hf_weights` and `iter_hf_weights` apply
them to live model chunks, gathering across TP and PP ranks for export and weight sync.
All conversions are views, cuts and concatenations: the round trip is bitwise lossless.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..config.schema import ModelConfig
from . import names

LM = "language_model."
_LAYER = re.compile(r"^language_model\.decoder\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Rule:
    kind: str  # copy | rows | cols | qkv | gate_up
    hf: tuple[str, ...]
    export: bool = True  # False: a copy of a tensor exported elsewhere (tied output layer)


def _layer_rules(lm: Any, i: int, rest: str) -> Rule | None:
    p = f"model.layers.{i}."
    table = {
        "input_layernorm.weight": Rule("copy", (p + "input_layernorm.weight",)),
        "pre_mlp_layernorm.weight": Rule("copy", (p + "post_attention_layernorm.weight",)),
        "self_attention.linear_qkv.weight": Rule("qkv", tuple(p + f"self_attn.{x}_proj.weight" for x in "qkv")),
        "self_attention.linear_qkv.bias": Rule("qkv", tuple(p + f"self_attn.{x}_proj.bias" for x in "qkv")),
        "self_attention.linear_proj.weight": Rule("cols", (p + "self_attn.o_proj.weight",)),
        "self_attention.q_layernorm.weight": Rule("copy", (p + "self_attn.q_norm.weight",)),
        "self_attention.k_layernorm.weight": Rule("copy", (p + "self_attn.k_norm.weight",)),
        "mlp.linear_fc1.weight": Rule("gate_up", (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")),
        "mlp.linear_fc2.weight": Rule("cols", (p + "mlp.down_proj.weight",)),
    }
    return table.get(rest)


def rule_for(model: ModelConfig, megatron_name: str, *, layer_offset: int) -> Rule:
    """How the Megatron parameter `megatron_name` (a QwenVLModel chunk's name) maps to HF."""
    if megatron_name.startswith("visual."):
        return Rule("copy", (megatron_name,))
    tied = model.lm.tie_word_embeddings
    if megatron_name == LM + "embedding.word_embeddings.weight":
        return Rule("rows", ("model.embed_tokens.weight",))
    if megatron_name == LM + "output_layer.weight":
        # tied weights under PP: the last stage's copy of the embeddings
        return Rule("rows", ("model.embed_tokens.weight",), export=False) if tied else Rule("rows", ("lm_head.weight",))
    if megatron_name == LM + "decoder.final_layernorm.weight":
        return Rule("copy", ("model.norm.weight",))
    m = _LAYER.match(megatron_name)
    if m:
        rule = _layer_rules(model.lm, layer_offset + int(m.group(1)), m.group(2))
        if rule is not None:
            return rule
    raise KeyError(f"no HF mapping for Megatron parameter {megatron_name!r}")


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
    raise ValueError(rule.kind)


def to_hf(model: ModelConfig, rule: Rule, shards: Sequence[Tensor]) -> list[Tensor]:
    """The full HF tensor(s) of `rule` from the Megatron tensors of all TP ranks (rank order)."""
    if rule.kind == "copy":
        return [shards[0]]
    if rule.kind == "rows":
        return [torch.cat(list(shards), 0)]
    if rule.kind == "cols":
        return [torch.cat(list(shards), 1)]
    if rule.kind == "qkv":
        return list(_qkv_split(model, torch.cat(list(shards), 0)))
    if rule.kind == "gate_up":
        halves = [s.chunk(2, 0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    raise ValueError(rule.kind)


def _cut(t: Tensor, dim: int, rank: int, size: int) -> Tensor:
    if t.shape[dim] % size:
        raise ValueError(f"dimension {dim} of shape {tuple(t.shape)} does not split over {size} TP ranks")
    return t.chunk(size, dim)[rank]


# --------------------------------------------------------------------------- pure state dicts
def hf_to_megatron(model: ModelConfig, hf: Mapping[str, Tensor], megatron_names: Sequence[str], *,
                   tp_rank: int = 0, tp_size: int = 1, layer_offset: int = 0) -> dict[str, Tensor]:
    """Megatron tensors of one rank's chunk (its parameter names given) from an HF state dict."""
    hf = canonical(hf)
    return {n: to_megatron(model, r, [_get(hf, h) for h in r.hf], tp_rank, tp_size)
            for n in megatron_names for r in [rule_for(model, n, layer_offset=layer_offset)]}


def megatron_to_hf(model: ModelConfig, shards: Sequence[Mapping[str, Tensor]], *,
                   layer_offset: int = 0) -> dict[str, Tensor]:
    """HF tensors from the state dicts of all TP ranks (rank order) of one pipeline stage."""
    out: dict[str, Tensor] = {}
    for n in shards[0]:
        rule = rule_for(model, n, layer_offset=layer_offset)
        if rule.export:
            out.update(zip(rule.hf, to_hf(model, rule, [s[n] for s in shards])))
    return out


def megatron_names(model: ModelConfig, *, num_layers: int, pre_process: bool, post_process: bool,
                   vision_names: Sequence[str] = ()) -> list[str]:
    """Parameter names of one QwenVLModel chunk (full-attention dense layers), without building it.

    For offline conversion and tests; live chunks report their own names.
    """
    lm = model.lm
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


def canonical(hf: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    """An HF state dict keyed by checkpoint names (in-memory transformers names converted)."""
    if any(k.startswith(("model.language_model.", "model.visual.")) for k in hf):
        return {names.to_checkpoint_name(k): v for k, v in hf.items()}
    return hf


def _get(hf: Mapping[str, Tensor], name: str) -> Tensor:
    if name in hf:
        return hf[name]
    if name == "lm_head.weight":
        raise KeyError("lm_head.weight is missing and the model does not tie word embeddings")
    raise KeyError(f"HF weight {name!r} is missing")


class SafetensorsDir(Mapping):
    """Lazy read-only mapping over the safetensors files of an HF checkpoint directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._where = {k: self.path / f for k, f in weight_map.items()}
        else:
            from safetensors import safe_open

            self._where = {}
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no safetensors files in {self.path}")
            for f in files:
                with safe_open(f, "pt") as st:
                    self._where.update({k: f for k in st.keys()})
        self._where = {names.to_checkpoint_name(k) if k.startswith("model.language_model.") or
                       k.startswith("model.visual.") else k: f for k, f in self._where.items()}

    def __getitem__(self, name: str) -> Tensor:
        from safetensors import safe_open

        f = self._where[name]
        with safe_open(f, "pt") as st:
            for key in (name, names.to_module_name(name)):
                if key in st.keys():
                    return st.get_tensor(key)
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


# --------------------------------------------------------------------------- live models
def _coords() -> tuple[int, int]:
    from megatron.core import parallel_state as mps

    return mps.get_tensor_model_parallel_rank(), mps.get_tensor_model_parallel_world_size()


def _chunk_offset(chunk: Any) -> int:
    from .bridge import stage_layers

    return stage_layers(chunk.config, vp_stage=chunk.vp_stage)[0]


@torch.no_grad()
def load_hf_weights(chunks: Sequence[Any], model: ModelConfig, source: str | Path | Mapping[str, Tensor]) -> None:
    """Copy HF weights (a checkpoint directory or a state dict) into this rank's chunks."""
    hf = SafetensorsDir(source) if isinstance(source, (str, Path)) else canonical(source)
    tp_rank, tp_size = _coords()
    for chunk in chunks:
        params = dict(chunk.named_parameters())
        values = hf_to_megatron(model, hf, list(params), tp_rank=tp_rank, tp_size=tp_size,
                                layer_offset=_chunk_offset(chunk))
        for n, p in params.items():
            v = values[n]
            if v.shape != p.shape:
                raise ValueError(f"{n}: HF gives shape {tuple(v.shape)}, the model has {tuple(p.shape)}")
            p.copy_(v)


def _grad_of(p: Tensor) -> Tensor:
    g = getattr(p, "main_grad", None)
    if g is None:
        g = p.grad
    return torch.zeros_like(p) if g is None else g


@torch.no_grad()
def iter_hf_weights(chunks: Sequence[Any], model: ModelConfig, *, bucket_bytes: int = 512 << 20,
                    grads: bool = False, dtype: torch.dtype | None = None) -> Iterator[list[tuple[str, Tensor]]]:
    """Yield the full model as (hf_name, tensor) buckets of about `bucket_bytes` each.

    Collective over the tensor- and pipeline-parallel groups: every rank of a model
    replica calls it and receives the same buckets (all stages, all TP shards gathered).
    `grads=True` exports gradients (`main_grad` under Megatron DDP, else `.grad`) instead of
    weights; under pipeline parallelism with tied embeddings the first stage's embedding
    gradient must already include the output layer's (Megatron's finalize_model_grads).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as mps

    get = _grad_of if grads else (lambda p: p.data)
    tp_group = mps.get_tensor_model_parallel_group()
    tp_size = mps.get_tensor_model_parallel_world_size()
    pp_group = mps.get_pipeline_model_parallel_group()
    pp_size = mps.get_pipeline_model_parallel_world_size()
    pp_rank = mps.get_pipeline_model_parallel_rank()

    def local_entries() -> Iterator[tuple[str, Tensor]]:
        for chunk in chunks:
            offset = _chunk_offset(chunk)
            for n, p in chunk.named_parameters():
                rule = rule_for(model, n, layer_offset=offset)
                if not rule.export:
                    continue
                t = get(p).detach()
                if rule.kind == "copy" or tp_size == 1:
                    shards = [t]
                else:
                    shards = [torch.empty_like(t) for _ in range(tp_size)]
                    dist.all_gather(shards, t.contiguous(), group=tp_group)
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
        if dtype is not None:
            t = t.to(dtype)
        bucket.append((n, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def export_hf_state_dict(chunks: Sequence[Any], model: ModelConfig, *, grads: bool = False,
                         dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """The whole model as one HF state dict (checkpoint names), on every calling rank."""
    out: dict[str, Tensor] = {}
    for bucket in iter_hf_weights(chunks, model, grads=grads, dtype=dtype, bucket_bytes=1 << 62):
        out.update((n, t.clone()) for n, t in bucket)
    return out


"""The bridge from vlmrl's model config to Megatron: TransformerConfig, layer specs, model.

- `transformer_config(model, parallel, ...)`: megatron-core TransformerConfig of the
  language model (RMSNorm, SwiGLU, GQA, ...), the family's own fields (zero-centred norms,
  output gate, MoE router) and the caller's verbatim `trainer.megatron` overrides.
- `layer_spec(model, layer_type, ...)`: the ModuleSpec of ONE layer type, as the model's
  family (`vlmrl.models.families`) wires it. Layers are built from the per-layer list
  (`model.lm.layer_types`), so hybrid models mix types (full attention, Gated DeltaNet).
- `block_spec(...)`: this pipeline stage's slice of the per-layer specs.
- `build_model(...)`: the `QwenVLModel` chunk(s) of this rank (one per virtual stage).
- `hf_config(model)` / `model_config_from_hf(hf_config)`: the HF config of a vlmrl model
  config and back (random HF models for parity checks; configs of downloaded checkpoints).

Only the language model is converted to Megatron; the vision tower stays HF (`qwen_vl`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ..config.layout import megatron_parallel_sizes
from ..config.schema import ModelConfig, ParallelConfig
from . import compat, families

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def layer_types(model: ModelConfig) -> list[str]:
    lm = model.lm
    return list(lm.layer_types) if lm.layer_types else ["full_attention"] * lm.num_layers


# --------------------------------------------------------------------------- config
def transformer_config(model: ModelConfig, parallel: ParallelConfig, *, params_dtype: torch.dtype = torch.float32,
                       overrides: Mapping[str, Any] | None = None, num_layers: int | None = None,
                       fused_kernels: bool = False, moe_aux_loss_coeff: float = 0.0) -> Any:
    """megatron-core TransformerConfig of `model.lm` under `parallel` (+ verbatim overrides).

    fused_kernels: megatron-core's torch.compile'd SwiGLU (forward and backward).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    lm = model.lm
    family = families.get(model.family)
    half = params_dtype in (torch.bfloat16, torch.float16)
    kwargs: dict[str, Any] = dict(
        num_layers=num_layers if num_layers is not None else lm.num_layers,
        hidden_size=lm.hidden_size,
        ffn_hidden_size=lm.ffn_hidden_size,
        num_attention_heads=lm.num_attention_heads,
        num_query_groups=lm.num_query_groups,
        kv_channels=lm.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=lm.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=lm.add_qkv_bias,
        qk_layernorm=lm.qk_layernorm,
        attention_output_gate=lm.attention_output_gate,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **megatron_parallel_sizes(parallel),
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # packed micro-batches differ in length: pipeline stages exchange shapes
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # the allgather dispatcher rejects variable lengths
        recompute_granularity=parallel.recompute_granularity,
        recompute_method=parallel.recompute_method if parallel.recompute_granularity == "full" else None,
        recompute_num_layers=parallel.recompute_num_layers if parallel.recompute_granularity == "full" else None,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
    )
    if half:
        kwargs["autocast_dtype"] = params_dtype
    if lm.num_experts:
        kwargs.update(num_moe_experts=lm.num_experts, moe_router_topk=lm.moe_router_topk,
                      moe_ffn_hidden_size=lm.moe_ffn_hidden_size,
                      moe_shared_expert_intermediate_size=lm.shared_expert_ffn_hidden_size or None,
                      # the auxiliary load-balancing loss is off unless asked for (trainer.moe_aux_loss_coeff)
                      moe_router_load_balancing_type="aux_loss" if moe_aux_loss_coeff > 0 else "none",
                      moe_aux_loss_coeff=moe_aux_loss_coeff)
    kwargs.update(family.megatron_kwargs(model))
    kwargs.update(compat.megatron_config_defaults())
    # megatron-core's compiled SwiGLU; the bias-dropout-add fusion stays off: with no bias and
    # no dropout the residual add is one kernel already, and the compiled version would trace
    # dropout(p=0) into a random mask
    kwargs["bias_activation_fusion"] = fused_kernels
    kwargs.update(dict(overrides or {}))
    return TransformerConfig(**kwargs)


# --------------------------------------------------------------------------- specs
def layer_spec(model: ModelConfig, layer_type: str, *, attention_backend: str = "sdpa",
               fused_kernels: bool = False, gdn_backend: str = "torch") -> Any:
    """ModuleSpec of one transformer layer of the given type, as the model's family wires it
    (`fused_kernels`: the compiled dense layer of `vlmrl.models.fused_layer`, and the
    Inductor-compiled norms and rotary of `vlmrl.models.kernels` where it falls back to
    Megatron's forward; `gdn_backend`: torch | fla for Gated DeltaNet layers)."""
    return families.get(model.family).layer_spec(model, layer_type, attention_backend=attention_backend,
                                                 fused_kernels=fused_kernels, gdn_backend=gdn_backend)


def stage_layers(config: Any, *, pp_rank: int | None = None, vp_stage: int | None = None) -> tuple[int, int]:
    """(offset, count): global index of this stage's first layer and its number of layers."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return offset, count


def block_spec(model: ModelConfig, config: Any, *, attention_backend: str = "sdpa",
               pp_rank: int | None = None, vp_stage: int | None = None, fused_kernels: bool = False,
               gdn_backend: str = "torch") -> Any:
    """TransformerBlockSubmodules with the layer specs of this pipeline stage only."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from .norm import RMSNorm

    types = layer_types(model)[: config.num_layers]
    offset, count = stage_layers(config, pp_rank=pp_rank, vp_stage=vp_stage)
    specs = {t: layer_spec(model, t, attention_backend=attention_backend, fused_kernels=fused_kernels,
                           gdn_backend=gdn_backend)
             for t in set(types)}
    return TransformerBlockSubmodules(layer_specs=[specs[t] for t in types[offset:offset + count]],
                                      layer_norm=ModuleSpec(module=RMSNorm, params={"fused": fused_kernels}))


# --------------------------------------------------------------------------- model
def build_model(model: ModelConfig, parallel: ParallelConfig, *, params_dtype: torch.dtype | None = None,
                attention_backend: str = "sdpa", vision_attn_implementation: str = "sdpa",
                megatron_overrides: Mapping[str, Any] | None = None, num_layers: int | None = None,
                hf_vision_config: Any = None, fused_kernels: bool = False, gdn_backend: str = "torch",
                moe_aux_loss_coeff: float = 0.0, cuda_graphs: bool = False) -> list[Any]:
    """This rank's model chunks (one per virtual pipeline stage), on the current device.

    Needs Megatron's parallel state (`vlmrl.training.parallel_state.init_parallel_state`).
    `num_layers` truncates the language model (parity checks of big configs). `cuda_graphs`
    (with `fused_kernels`): the compiled layers replay as CUDA graphs in training
    (`vlmrl.models.kernels.use_cuda_graphs`).
    """
    from megatron.core import parallel_state as mps

    from .mrope import MRopeSpec
    from .qwen_vl import QwenVLModel

    dtype = params_dtype or DTYPES[model.dtype]
    config = transformer_config(model, parallel, params_dtype=dtype, overrides=megatron_overrides,
                                num_layers=num_layers, fused_kernels=fused_kernels,
                                moe_aux_loss_coeff=moe_aux_loss_coeff)
    vision_cfg = hf_vision_config if hf_vision_config is not None else hf_config(model).vision_config
    rope = MRopeSpec.from_lm_config(model.lm)
    vpp = parallel.vpp or 1
    dev = compat.device()
    chunks = []
    for vp in range(vpp):
        vp_stage = vp if parallel.vpp else None
        pre = mps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = mps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        spec = block_spec(model, config, attention_backend=attention_backend, vp_stage=vp_stage,
                          fused_kernels=fused_kernels, gdn_backend=gdn_backend)
        # made, and randomly initialised, where they will run: modules that allocate on the
        # default device (the HF-shaped experts and Gated DeltaNet projections, the HF vision
        # tower) drew 2.4B random numbers on one host core for the scaled Qwen3.5-MoE, then
        # copied them up: part of a 62.5 s build on the H200 (bench/results/trainer_steps.md)
        with dev:
            chunk = QwenVLModel(config, spec, vocab_size=model.lm.vocab_size,
                                max_sequence_length=model.lm.max_position_embeddings, rope=rope,
                                hf_vision_config=vision_cfg, tie_word_embeddings=model.lm.tie_word_embeddings,
                                pre_process=pre, post_process=post, vp_stage=vp_stage,
                                vision_attn_implementation=vision_attn_implementation,
                                vision_tower_class=families.get(model.family).vision_tower_class(vision_cfg))
        if model.lm.num_experts:
            from .moe import use_local_dispatch

            use_local_dispatch(chunk, compiled=fused_kernels)
        chunk = chunk.to(dev)
        if cuda_graphs and fused_kernels:
            from .kernels import use_cuda_graphs

            use_cuda_graphs(chunk)
        chunks.append(chunk)
    return chunks


# --------------------------------------------------------------------------- HF configs
def hf_config(model: ModelConfig) -> Any:
    """The transformers config of a vlmrl model config (random HF models, parity checks)."""
    return families.get(model.family).hf_config(model)


def model_config_from_hf(hf: Any, *, name: str = "hf") -> ModelConfig:
    """vlmrl ModelConfig (architecture fields) of a transformers config of a supported family."""
    return families.get(families.family_of_hf(hf)).model_config_from_hf(hf, name)


# architecture fields a config must share with the checkpoint it loads (vision: the tower's shape)
_VISION_KEYS = ("depth", "hidden_size", "intermediate_size", "num_heads", "patch_size", "temporal_patch_size",
                "spatial_merge_size", "in_channels", "out_hidden_size", "window_size", "fullatt_block_indexes",
                "num_position_embeddings")


def checkpoint_mismatches(model: ModelConfig, hf: Any) -> list[str]:
    """The config keys of `model` that disagree with the checkpoint's HF config, each as
    "model.<key>: config X, checkpoint Y" (empty when they agree)."""
    ckpt = model_config_from_hf(hf, name=model.name)
    out = []
    if ckpt.family != model.family:
        out.append(f"model.family: config {model.family}, checkpoint {ckpt.family}")
    for f in dataclasses.fields(model.lm):
        if f.name == "max_position_embeddings":
            continue
        a, b = getattr(model.lm, f.name), getattr(ckpt.lm, f.name)
        if (list(a) if isinstance(a, (list, tuple)) else a) != (list(b) if isinstance(b, (list, tuple)) else b):
            out.append(f"model.lm.{f.name}: config {a}, checkpoint {b}")
    for key in _VISION_KEYS:
        a, b = getattr(model.vision, key), getattr(ckpt.vision, key)
        if (list(a) if isinstance(a, (list, tuple)) else a) != (list(b) if isinstance(b, (list, tuple)) else b):
            out.append(f"model.vision.{key}: config {a}, checkpoint {b}")
    for key in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
        if getattr(model, key) != getattr(ckpt, key):
            out.append(f"model.{key}: config {getattr(model, key)}, checkpoint {getattr(ckpt, key)}")
    return out


def check_checkpoint(model: ModelConfig, path: str) -> None:
    """Raise ValueError naming every key where `model` and the checkpoint at `path` (a local
    directory or a hub id) disagree: the Megatron model is built from the config and the
    weights come from the checkpoint, so they must describe the same architecture. (What SGLang
    builds from the checkpoint, with rollout=sglang: `sglang_checkpoint.check_sglang_checkpoint`.)"""
    from transformers import AutoConfig

    bad = checkpoint_mismatches(model, AutoConfig.from_pretrained(path))
    if bad:
        raise ValueError(f"model={model.name} does not describe the checkpoint {path}; fix these overrides "
                         "(or pick the model option of this checkpoint):\n  " + "\n  ".join(bad))


def hf_model_class(model: ModelConfig) -> type:
    """The transformers *ForConditionalGeneration class of `model`'s family."""
    return families.get(model.family).hf_model_class(model)


def with_layers(model: ModelConfig, num_layers: int) -> ModelConfig:
    """A copy of `model` with the language model cut to `num_layers` layers."""
    lm = dataclasses.replace(model.lm, num_layers=num_layers,
                             layer_types=list(model.lm.layer_types[:num_layers]))
    return dataclasses.replace(model, lm=lm)


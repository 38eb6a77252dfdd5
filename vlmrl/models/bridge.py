"""The bridge from vlmrl's model config to Megatron: TransformerConfig, layer specs, model.

- `transformer_config(model, parallel, ...)`: megatron-core TransformerConfig of the
  language model (RMSNorm, SwiGLU, GQA, qkv bias, ...), plus the caller's verbatim
  `trainer.megatron` overrides.
- `layer_spec(model, layer_type, ...)`: the ModuleSpec of ONE layer type. Layers are
  built from a per-layer list (`model.lm.layer_types`), so hybrid models mix types:
  "full_attention" is wired now (packed SDPA core attention with M-RoPE); Gated DeltaNet
  ("linear_attention") and MoE MLPs plug in here with the Qwen3.5 work.
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

from ..config.schema import LanguageModelConfig, ModelConfig, ParallelConfig, VisionConfig
from ..training import compat

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def layer_types(model: ModelConfig) -> list[str]:
    lm = model.lm
    return list(lm.layer_types) if lm.layer_types else ["full_attention"] * lm.num_layers


# --------------------------------------------------------------------------- config
def transformer_config(model: ModelConfig, parallel: ParallelConfig, *, params_dtype: torch.dtype = torch.float32,
                       overrides: Mapping[str, Any] | None = None, num_layers: int | None = None,
                       fused_kernels: bool = False) -> Any:
    """megatron-core TransformerConfig of `model.lm` under `parallel` (+ verbatim overrides).

    fused_kernels: megatron-core's torch.compile'd SwiGLU (forward and backward).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    lm = model.lm
    if model.family not in ("qwen2_5_vl", "qwen3_5_moe"):
        raise ValueError(f"unknown model family {model.family!r}")
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
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp,
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
                      moe_shared_expert_intermediate_size=lm.shared_expert_ffn_hidden_size or None)
    kwargs.update(compat.megatron_config_defaults())
    # megatron-core's compiled SwiGLU; the bias-dropout-add fusion stays off: with no bias and
    # no dropout the residual add is one kernel already, and the compiled version would trace
    # dropout(p=0) into a random mask
    kwargs["bias_activation_fusion"] = fused_kernels
    kwargs.update(dict(overrides or {}))
    return TransformerConfig(**kwargs)


# --------------------------------------------------------------------------- specs
def layer_spec(model: ModelConfig, layer_type: str, *, attention_backend: str = "sdpa",
               fused_kernels: bool = False) -> Any:
    """ModuleSpec of one transformer layer of the given type (`fused_kernels`: the
    compiled dense layer of `vlmrl.models.fused_layer`, and the Inductor-compiled norms and
    rotary of `vlmrl.models.kernels` where it falls back to Megatron's forward)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from .attention import PackedSelfAttentionCore
    from .norm import RMSNorm

    lm = model.lm
    backend = LocalSpecProvider()
    norm = qk_norm = ModuleSpec(module=RMSNorm, params={"fused": fused_kernels})
    if lm.num_experts:
        raise NotImplementedError("MoE MLP layers come with the Qwen3.5 bridge")
    mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=backend.column_parallel_linear(),
                                                          linear_fc2=backend.row_parallel_linear()))
    if layer_type == "full_attention":
        if attention_backend == "local":
            attention_backend = "eager"  # stock local attention cannot do packed sequences
        mixer = ModuleSpec(
            module=SelfAttention,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(
                linear_qkv=backend.column_parallel_linear(),
                core_attention=ModuleSpec(module=PackedSelfAttentionCore,
                                          params={"backend": attention_backend, "fused": fused_kernels}),
                linear_proj=backend.row_parallel_linear(),
                q_layernorm=qk_norm if lm.qk_layernorm else IdentityOp,
                k_layernorm=qk_norm if lm.qk_layernorm else IdentityOp,
            ),
        )
    elif layer_type == "linear_attention":
        raise NotImplementedError("Gated DeltaNet (linear_attention) layers come with the Qwen3.5 bridge")
    else:
        raise ValueError(f"unknown layer type {layer_type!r}")
    layer = TransformerLayer
    if fused_kernels:
        from .fused_layer import FusedTransformerLayer

        layer = FusedTransformerLayer
    return ModuleSpec(
        module=layer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=mixer,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def stage_layers(config: Any, *, pp_rank: int | None = None, vp_stage: int | None = None) -> tuple[int, int]:
    """(offset, count): global index of this stage's first layer and its number of layers."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return offset, count


def block_spec(model: ModelConfig, config: Any, *, attention_backend: str = "sdpa",
               pp_rank: int | None = None, vp_stage: int | None = None, fused_kernels: bool = False) -> Any:
    """TransformerBlockSubmodules with the layer specs of this pipeline stage only."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from .norm import RMSNorm

    types = layer_types(model)[: config.num_layers]
    offset, count = stage_layers(config, pp_rank=pp_rank, vp_stage=vp_stage)
    specs = {t: layer_spec(model, t, attention_backend=attention_backend, fused_kernels=fused_kernels)
             for t in set(types)}
    return TransformerBlockSubmodules(layer_specs=[specs[t] for t in types[offset:offset + count]],
                                      layer_norm=ModuleSpec(module=RMSNorm, params={"fused": fused_kernels}))


# --------------------------------------------------------------------------- model
def build_model(model: ModelConfig, parallel: ParallelConfig, *, params_dtype: torch.dtype | None = None,
                attention_backend: str = "sdpa", vision_attn_implementation: str = "sdpa",
                megatron_overrides: Mapping[str, Any] | None = None, num_layers: int | None = None,
                hf_vision_config: Any = None, fused_kernels: bool = False) -> list[Any]:
    """This rank's model chunks (one per virtual pipeline stage), on the current device.

    Needs Megatron's parallel state (`vlmrl.training.parallel_state.init_parallel_state`).
    `num_layers` truncates the language model (parity checks of big configs).
    """
    from megatron.core import parallel_state as mps

    from .mrope import MRopeSpec
    from .qwen_vl import QwenVLModel

    dtype = params_dtype or DTYPES[model.dtype]
    config = transformer_config(model, parallel, params_dtype=dtype, overrides=megatron_overrides,
                                num_layers=num_layers, fused_kernels=fused_kernels)
    vision_cfg = hf_vision_config if hf_vision_config is not None else hf_config(model).vision_config
    rope = MRopeSpec.from_lm_config(model.lm)
    vpp = parallel.vpp or 1
    chunks = []
    for vp in range(vpp):
        vp_stage = vp if parallel.vpp else None
        pre = mps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = mps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        spec = block_spec(model, config, attention_backend=attention_backend, vp_stage=vp_stage,
                          fused_kernels=fused_kernels)
        chunk = QwenVLModel(config, spec, vocab_size=model.lm.vocab_size,
                            max_sequence_length=model.lm.max_position_embeddings, rope=rope,
                            hf_vision_config=vision_cfg, tie_word_embeddings=model.lm.tie_word_embeddings,
                            pre_process=pre, post_process=post, vp_stage=vp_stage,
                            vision_attn_implementation=vision_attn_implementation)
        chunks.append(chunk.to(compat.device()))
    return chunks


# --------------------------------------------------------------------------- HF configs
def hf_config(model: ModelConfig) -> Any:
    """The transformers config of a vlmrl model config (random HF models, parity checks)."""
    if model.family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        lm, v = model.lm, model.vision
        if lm.head_dim * lm.num_attention_heads != lm.hidden_size:
            raise ValueError("Qwen2.5-VL needs head_dim * num_attention_heads == hidden_size")
        return Qwen2_5_VLConfig(
            text_config=dict(
                vocab_size=lm.vocab_size, hidden_size=lm.hidden_size, intermediate_size=lm.ffn_hidden_size,
                num_hidden_layers=lm.num_layers, num_attention_heads=lm.num_attention_heads,
                num_key_value_heads=lm.num_query_groups, max_position_embeddings=lm.max_position_embeddings,
                rms_norm_eps=lm.rms_norm_eps,
                rope_parameters={"rope_type": "default", "mrope_section": list(lm.mrope_section),
                                 "rope_theta": lm.rope_theta},
                tie_word_embeddings=lm.tie_word_embeddings,
                bos_token_id=None, eos_token_id=None, pad_token_id=None,
            ),
            vision_config=dict(
                depth=v.depth, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                num_heads=v.num_heads, patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
                spatial_merge_size=v.spatial_merge_size, in_channels=v.in_channels,
                out_hidden_size=v.out_hidden_size, window_size=v.window_size,
                fullatt_block_indexes=list(v.fullatt_block_indexes),
            ),
            image_token_id=model.image_token_id,
            video_token_id=model.image_token_id + 1,  # Qwen's <|video_pad|> follows <|image_pad|>
            vision_start_token_id=model.vision_start_token_id,
            vision_end_token_id=model.vision_end_token_id,
            tie_word_embeddings=lm.tie_word_embeddings,
        )
    raise NotImplementedError(f"HF config of family {model.family!r} is not wired yet")


def model_config_from_hf(hf: Any, *, name: str = "hf") -> ModelConfig:
    """vlmrl ModelConfig (architecture fields) of a transformers Qwen2.5-VL config."""
    if getattr(hf, "model_type", "") != "qwen2_5_vl":
        raise NotImplementedError(f"model_type {getattr(hf, 'model_type', None)!r} is not wired yet")
    t, v = hf.text_config, hf.vision_config
    rope = dict(t.rope_parameters or {})
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    lm = LanguageModelConfig(
        num_layers=t.num_hidden_layers, hidden_size=t.hidden_size, ffn_hidden_size=t.intermediate_size,
        num_attention_heads=t.num_attention_heads, num_query_groups=t.num_key_value_heads, head_dim=head_dim,
        vocab_size=t.vocab_size, max_position_embeddings=t.max_position_embeddings,
        rope_theta=float(rope.get("rope_theta", 1_000_000.0)), mrope_section=list(rope["mrope_section"]),
        rms_norm_eps=t.rms_norm_eps, tie_word_embeddings=bool(hf.tie_word_embeddings), add_qkv_bias=True,
    )
    vision = VisionConfig(
        depth=v.depth, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size, num_heads=v.num_heads,
        patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
        spatial_merge_size=v.spatial_merge_size, in_channels=v.in_channels, out_hidden_size=v.out_hidden_size,
        window_size=v.window_size, fullatt_block_indexes=list(v.fullatt_block_indexes),
    )
    return ModelConfig(name=name, family="qwen2_5_vl", dtype="float32", lm=lm, vision=vision,
                       image_token_id=hf.image_token_id, vision_start_token_id=hf.vision_start_token_id,
                       vision_end_token_id=hf.vision_end_token_id)


def with_layers(model: ModelConfig, num_layers: int) -> ModelConfig:
    """A copy of `model` with the language model cut to `num_layers` layers."""
    lm = dataclasses.replace(model.lm, num_layers=num_layers,
                             layer_types=list(model.lm.layer_types[:num_layers]))
    return dataclasses.replace(model, lm=lm)


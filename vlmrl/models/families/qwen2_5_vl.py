"""Qwen2.5-VL: dense language model (GQA with qkv bias, SwiGLU), windowed ViT vision tower.

Checkpoint names: `model.layers.N.*`, `model.embed_tokens.weight`, `model.norm.weight`,
`lm_head.weight` and `visual.*` (what Qwen2.5-VL checkpoints store and SGLang loads);
transformers 5 holds them in memory as `model.language_model.*` and `model.visual.*`.
"""

from __future__ import annotations

from typing import Any

from ...config.schema import LanguageModelConfig, ModelConfig, VisionConfig
from ..rules import Rule

FAMILIES = ("qwen2_5_vl",)
MODEL_TYPES = {"qwen2_5_vl": "qwen2_5_vl"}
PROCESSOR_CLASS = "Qwen2_5_VLProcessor"
VISION_PREFIX = "visual."

# (checkpoint prefix, in-memory prefix), most specific first.
_PREFIXES = (("visual.", "model.visual."), ("model.", "model.language_model."))


def hf_config(model: ModelConfig) -> Any:
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


def model_config_from_hf(hf: Any, name: str = "hf") -> ModelConfig:
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


def hf_model_class(model: ModelConfig) -> type:
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration


def vision_tower_class(hf_vision_config: Any) -> type:
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    return Qwen2_5_VisionTransformerPretrainedModel


def megatron_kwargs(model: ModelConfig) -> dict[str, Any]:
    return {}


def layer_spec(model: ModelConfig, layer_type: str, *, attention_backend: str = "sdpa", fused_kernels: bool = False,
               gdn_backend: str = "torch") -> Any:
    from .. import specs

    if layer_type != "full_attention":
        raise ValueError(f"Qwen2.5-VL has full_attention layers only, not {layer_type!r}")
    return specs.layer(specs.attention(model, backend=attention_backend, fused=fused_kernels), specs.mlp(),
                       fused=fused_kernels)


def top_rule(model: ModelConfig, name: str) -> Rule | None:
    tied = model.lm.tie_word_embeddings
    if name == "embedding.word_embeddings.weight":
        return Rule("rows", ("model.embed_tokens.weight",))
    if name == "output_layer.weight":
        # tied weights under PP: the last stage's copy of the embeddings
        return Rule("rows", ("model.embed_tokens.weight",), export=False) if tied else Rule("rows", ("lm_head.weight",))
    if name == "decoder.final_layernorm.weight":
        return Rule("copy", ("model.norm.weight",))
    return None


def layer_rule(model: ModelConfig, i: int, rest: str, experts: range) -> Rule | None:
    p = f"model.layers.{i}."
    table = {
        "input_layernorm.weight": Rule("copy", (p + "input_layernorm.weight",)),
        "pre_mlp_layernorm.weight": Rule("copy", (p + "post_attention_layernorm.weight",)),
        "self_attention.linear_qkv.weight": Rule("qkv", tuple(p + f"self_attn.{x}_proj.weight" for x in "qkv")),
        "self_attention.linear_qkv.bias": Rule("qkv", tuple(p + f"self_attn.{x}_proj.bias" for x in "qkv")),
        "self_attention.linear_proj.weight": Rule("cols", (p + "self_attn.o_proj.weight",)),
        "mlp.linear_fc1.weight": Rule("gate_up", (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")),
        "mlp.linear_fc2.weight": Rule("cols", (p + "mlp.down_proj.weight",)),
    }
    return table.get(rest)


def to_checkpoint(state: dict[str, Any]) -> dict[str, Any]:
    """An HF state dict (in-memory or checkpoint names) keyed by checkpoint names."""
    return {to_checkpoint_name(k): v for k, v in state.items()}


def is_fused(name: str) -> bool:
    return False


def fused_parts(name: str, num: int) -> list[tuple[str, tuple]]:
    raise ValueError(f"{name} is not a fused tensor")


def take(tensor: Any, index: tuple) -> Any:
    raise ValueError("Qwen2.5-VL has no fused tensors")


def to_checkpoint_name(name: str) -> str:
    for ckpt, mem in _PREFIXES:
        if name.startswith(mem):
            return ckpt + name[len(mem):]
    return name


def to_module_name(name: str) -> str:
    for ckpt, mem in _PREFIXES:
        if name.startswith(ckpt) and not name.startswith(mem):
            return mem + name[len(ckpt):]
    return name


def module_slot(name: str) -> tuple[str, tuple | None]:
    """(in-memory parameter name, index into it or None) of a checkpoint tensor name."""
    return to_module_name(name), None

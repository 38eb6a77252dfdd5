"""Qwen3.5 (`qwen3_5`, dense MLP) and Qwen3.5-MoE (`qwen3_5_moe`): hybrid language models.

Layers follow the per-layer `layer_types` list: `linear_attention` is a Gated DeltaNet mixer
(`vlmrl.models.gdn`), `full_attention` is attention with a sigmoid output gate (HF's
q_proj emits [query; gate] per head), q/k norms and partial rotary (0.25) with interleaved
M-RoPE. Every norm but the GDN's gated one is zero-centred (scale 1 + w). The MLP is a
dense SwiGLU (`qwen3_5`) or Megatron's MoELayer with HF-shaped experts, a softmax top-k
router renormalised over the chosen experts, and a shared expert with a sigmoid gate
(`qwen3_5_moe`). The vision tower is transformers' Qwen3.5 ViT (learned, interpolated
position embeddings; LayerNorms; no windows), kept at its HF names.

Checkpoint names are transformers' own: `model.language_model.*`, `model.visual.*`,
`lm_head.weight`; routed experts as `mlp.experts.{e}.{gate,up,down}_proj.weight` on disk
(transformers fuses them in memory into `mlp.experts.gate_up_proj` [E, 2I, H] and
`mlp.experts.down_proj` [E, H, I]). SGLang's Qwen3.5 loader takes the per-expert names.
"""

from __future__ import annotations

import re
from typing import Any

from ...config.schema import LanguageModelConfig, ModelConfig, VisionConfig
from ..rules import Rule

FAMILIES = ("qwen3_5", "qwen3_5_moe")
MODEL_TYPES = {"qwen3_5": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe"}
PROCESSOR_CLASS = "Qwen3VLProcessor"
VISION_PREFIX = "model.visual."
LM = "model.language_model."

_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _is_moe(model: ModelConfig) -> bool:
    return model.family == "qwen3_5_moe"


def hf_config(model: ModelConfig) -> Any:
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    lm, v = model.lm, model.vision
    text = dict(
        vocab_size=lm.vocab_size, hidden_size=lm.hidden_size, num_hidden_layers=lm.num_layers,
        num_attention_heads=lm.num_attention_heads, num_key_value_heads=lm.num_query_groups, head_dim=lm.head_dim,
        max_position_embeddings=lm.max_position_embeddings, rms_norm_eps=lm.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": lm.rope_theta,
                         "mrope_section": list(lm.mrope_section), "mrope_interleaved": bool(lm.mrope_interleaved),
                         "partial_rotary_factor": lm.partial_rotary_factor},
        attention_bias=lm.add_qkv_bias, tie_word_embeddings=lm.tie_word_embeddings,
        layer_types=list(lm.layer_types) or None,
        linear_conv_kernel_dim=lm.linear_conv_kernel_dim, linear_key_head_dim=lm.linear_key_head_dim,
        linear_value_head_dim=lm.linear_value_head_dim, linear_num_key_heads=lm.linear_num_key_heads,
        linear_num_value_heads=lm.linear_num_value_heads,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    if _is_moe(model):
        text.update(num_experts=lm.num_experts, num_experts_per_tok=lm.moe_router_topk,
                    moe_intermediate_size=lm.moe_ffn_hidden_size,
                    shared_expert_intermediate_size=lm.shared_expert_ffn_hidden_size)
        cls = Qwen3_5MoeConfig
    else:
        text.update(intermediate_size=lm.ffn_hidden_size)
        cls = Qwen3_5Config
    vision = dict(depth=v.depth, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                  num_heads=v.num_heads, in_channels=v.in_channels, patch_size=v.patch_size,
                  spatial_merge_size=v.spatial_merge_size, temporal_patch_size=v.temporal_patch_size,
                  out_hidden_size=v.out_hidden_size, num_position_embeddings=v.num_position_embeddings or 2304)
    return cls(text_config=text, vision_config=vision, image_token_id=model.image_token_id,
               video_token_id=model.image_token_id + 1, vision_start_token_id=model.vision_start_token_id,
               vision_end_token_id=model.vision_end_token_id, tie_word_embeddings=lm.tie_word_embeddings)


def model_config_from_hf(hf: Any, name: str = "hf") -> ModelConfig:
    t, v = hf.text_config, hf.vision_config
    family = MODEL_TYPES[hf.model_type]
    rope = dict(t.rope_parameters or {})
    partial = float(rope.get("partial_rotary_factor", getattr(t, "partial_rotary_factor", 0.25)))
    moe = family == "qwen3_5_moe"
    lm = LanguageModelConfig(
        num_layers=t.num_hidden_layers, hidden_size=t.hidden_size,
        ffn_hidden_size=t.moe_intermediate_size if moe else t.intermediate_size,
        num_attention_heads=t.num_attention_heads, num_query_groups=t.num_key_value_heads, head_dim=t.head_dim,
        vocab_size=t.vocab_size, max_position_embeddings=t.max_position_embeddings,
        rope_theta=float(rope.get("rope_theta", 10_000_000.0)), partial_rotary_factor=partial,
        mrope_section=list(rope.get("mrope_section", [11, 11, 10])),
        mrope_interleaved=bool(rope.get("mrope_interleaved", True)),
        rms_norm_eps=t.rms_norm_eps, tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        add_qkv_bias=bool(getattr(t, "attention_bias", False)), qk_layernorm=True, attention_output_gate=True,
        layer_types=list(t.layer_types),
        linear_num_key_heads=t.linear_num_key_heads, linear_num_value_heads=t.linear_num_value_heads,
        linear_key_head_dim=t.linear_key_head_dim, linear_value_head_dim=t.linear_value_head_dim,
        linear_conv_kernel_dim=t.linear_conv_kernel_dim,
        num_experts=t.num_experts if moe else 0, moe_router_topk=t.num_experts_per_tok if moe else 0,
        moe_ffn_hidden_size=t.moe_intermediate_size if moe else 0,
        shared_expert_ffn_hidden_size=t.shared_expert_intermediate_size if moe else 0,
        shared_expert_gate=moe,
    )
    vision = VisionConfig(
        depth=v.depth, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size, num_heads=v.num_heads,
        patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size, spatial_merge_size=v.spatial_merge_size,
        in_channels=v.in_channels, out_hidden_size=v.out_hidden_size, window_size=0, fullatt_block_indexes=[],
        num_position_embeddings=v.num_position_embeddings,
    )
    return ModelConfig(name=name, family=family, dtype="float32", lm=lm, vision=vision,
                       image_token_id=hf.image_token_id, vision_start_token_id=hf.vision_start_token_id,
                       vision_end_token_id=hf.vision_end_token_id)


def hf_model_class(model: ModelConfig) -> type:
    from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration

    return Qwen3_5MoeForConditionalGeneration if _is_moe(model) else Qwen3_5ForConditionalGeneration


def vision_tower_class(hf_vision_config: Any) -> type:
    if getattr(hf_vision_config, "model_type", "") == "qwen3_5_moe_vision":
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

        return Qwen3_5MoeVisionModel
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    return Qwen3_5VisionModel


def megatron_kwargs(model: ModelConfig) -> dict[str, Any]:
    """Zero-centred norms, gated attention with q/k norms; the MoE router as HF's."""
    out: dict[str, Any] = dict(layernorm_zero_centered_gamma=True, attention_output_gate=True, qk_layernorm=True)
    if len(set(model.lm.layer_types)) > 1:
        # layers of different kinds hold different parameters: checkpoint each layer under
        # its own key instead of stacking same-named tensors along a layer axis
        out["hetereogenous_dist_checkpoint"] = True
    if _is_moe(model):
        out.update(
            moe_router_score_function="softmax",
            moe_router_pre_softmax=False,  # softmax over the top-k logits = HF's renormalised top-k
            moe_router_dtype="fp32",
            moe_shared_expert_gate=bool(model.lm.shared_expert_gate),
            moe_grouped_gemm=False,
            moe_permute_fusion=False,
            moe_router_fusion=False,
        )
    return out


def layer_spec(model: ModelConfig, layer_type: str, *, attention_backend: str = "sdpa", fused_kernels: bool = False,
               gdn_backend: str = "torch") -> Any:
    from .. import specs

    if layer_type == "full_attention":
        mixer = specs.attention(model, backend=attention_backend, fused=fused_kernels)
    elif layer_type == "linear_attention":
        mixer = specs.gdn(model, backend=gdn_backend, fused=fused_kernels)
    else:
        raise ValueError(f"unknown layer type {layer_type!r} (full_attention | linear_attention)")
    mlp = specs.moe(model) if _is_moe(model) else specs.mlp()
    return specs.layer(mixer, mlp, fused=fused_kernels)


def top_rule(model: ModelConfig, name: str) -> Rule | None:
    tied = model.lm.tie_word_embeddings
    if name == "embedding.word_embeddings.weight":
        return Rule("rows", (LM + "embed_tokens.weight",))
    if name == "output_layer.weight":
        return (Rule("rows", (LM + "embed_tokens.weight",), export=False) if tied
                else Rule("rows", ("lm_head.weight",)))
    if name == "decoder.final_layernorm.weight":
        return Rule("copy", (LM + "norm.weight",))
    return None


def layer_rule(model: ModelConfig, i: int, rest: str, experts: range) -> Rule | None:
    p = f"{LM}layers.{i}."
    a, g = p + "self_attn.", p + "linear_attn."
    m = p + "mlp."
    table = {
        "input_layernorm.weight": Rule("copy", (p + "input_layernorm.weight",)),
        "pre_mlp_layernorm.weight": Rule("copy", (p + "post_attention_layernorm.weight",)),
        # gated attention
        "self_attention.linear_qkv.weight": Rule("qkv_gated", (a + "q_proj.weight", a + "k_proj.weight",
                                                               a + "v_proj.weight")),
        "self_attention.linear_qkv.bias": Rule("qkv_gated", (a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias")),
        "self_attention.linear_proj.weight": Rule("cols", (a + "o_proj.weight",)),
        "self_attention.q_layernorm.weight": Rule("copy", (a + "q_norm.weight",)),
        "self_attention.k_layernorm.weight": Rule("copy", (a + "k_norm.weight",)),
        # Gated DeltaNet (the mixer sits in Megatron's self_attention slot)
        "self_attention.in_proj_qkv.weight": Rule("gdn_qkv", (g + "in_proj_qkv.weight",)),
        "self_attention.conv1d.weight": Rule("gdn_qkv", (g + "conv1d.weight",)),
        "self_attention.in_proj_z.weight": Rule("rows", (g + "in_proj_z.weight",)),
        "self_attention.in_proj_b.weight": Rule("rows", (g + "in_proj_b.weight",)),
        "self_attention.in_proj_a.weight": Rule("rows", (g + "in_proj_a.weight",)),
        "self_attention.dt_bias": Rule("rows", (g + "dt_bias",)),
        "self_attention.A_log": Rule("rows", (g + "A_log",)),
        "self_attention.norm.weight": Rule("copy", (g + "norm.weight",)),
        "self_attention.out_proj.weight": Rule("cols", (g + "out_proj.weight",)),
        # dense MLP
        "mlp.linear_fc1.weight": Rule("gate_up", (m + "gate_proj.weight", m + "up_proj.weight")),
        "mlp.linear_fc2.weight": Rule("cols", (m + "down_proj.weight",)),
        # MoE
        "mlp.router.weight": Rule("copy", (m + "gate.weight",)),
        "mlp.experts.gate_up_proj": Rule("experts_gate_up", tuple(
            m + f"experts.{e}.{w}_proj.weight" for e in experts for w in ("gate", "up"))),
        "mlp.experts.down_proj": Rule("experts_down", tuple(m + f"experts.{e}.down_proj.weight" for e in experts)),
        "mlp.shared_experts.linear_fc1.weight": Rule("gate_up", (m + "shared_expert.gate_proj.weight",
                                                                 m + "shared_expert.up_proj.weight")),
        "mlp.shared_experts.linear_fc2.weight": Rule("cols", (m + "shared_expert.down_proj.weight",)),
        "mlp.shared_experts.gate_weight": Rule("copy", (m + "shared_expert_gate.weight",)),
    }
    return table.get(rest)


# --------------------------------------------------------------------------- names
def is_fused(name: str) -> bool:
    """Whether `name` is transformers' fused tensor of a layer's routed experts."""
    return _FUSED.match(name) is not None


def fused_parts(name: str, num_experts: int) -> list[tuple[str, tuple]]:
    """The per-expert checkpoint names of a fused expert tensor, each with its index into it
    ((expert, half): half 0 = gate rows, 1 = up rows, None = the expert's whole down_proj)."""
    base, which = _FUSED.match(name).groups()  # type: ignore[union-attr]
    if which == "gate_up_proj":
        return [(f"{base}.{e}.{w}_proj.weight", (e, h)) for e in range(num_experts)
                for h, w in enumerate(("gate", "up"))]
    return [(f"{base}.{e}.down_proj.weight", (e, None)) for e in range(num_experts)]


def take(tensor: Any, index: tuple) -> Any:
    """The slice `index` (from `fused_parts` / `module_slot`) of a fused expert tensor."""
    e, half = index
    return tensor[e] if half is None else tensor[e].chunk(2, dim=0)[half]


def to_checkpoint(state: dict[str, Any]) -> dict[str, Any]:
    """An HF state dict keyed by checkpoint names: fused in-memory experts split per expert."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if is_fused(k):
            out.update((part, take(v, index)) for part, index in fused_parts(k, v.shape[0]))
        else:
            out[k] = v
    return out


def to_checkpoint_name(name: str) -> str:
    return name


def module_slot(name: str) -> tuple[str, tuple | None]:
    """(in-memory parameter name, index into it or None) of a checkpoint tensor name: a routed
    expert's tensor is a slice of transformers' fused expert parameter, (expert, half) where
    half is 0 (gate), 1 (up) or None (down_proj: the whole [H, I] of the expert)."""
    m = _PER_EXPERT.match(name)
    if m is None:
        return name, None
    base, e, which = m.groups()
    if which == "down_proj":
        return f"{base}.down_proj", (int(e), None)
    return f"{base}.gate_up_proj", (int(e), 0 if which == "gate_proj" else 1)

"""Megatron ModuleSpecs of the layer parts the model families compose.

Each function returns the spec of one part; `vlmrl.models.families.*` put them together
per layer type (`layer_spec`), and `vlmrl.models.bridge` builds the stage's block from the
per-layer list. Parts:

- `attention`: Megatron's SelfAttention (`GroupedSelfAttention`: its output gate cut like
  the queries when TP is wider than the KV groups) with the packed (THD) core attention of
  `vlmrl.models.attention` (M-RoPE from the packed positions), q/k norms when the model has
  them; the output gate is Megatron's `attention_output_gate` (a TransformerConfig flag);
- `gdn`: the Gated DeltaNet mixer (`vlmrl.models.gdn`);
- `mlp`: the dense SwiGLU MLP (column-parallel fc1 [gate; up], row-parallel fc2);
- `moe`: Megatron's MoELayer with the HF-shaped experts of `vlmrl.models.moe`, the router
  that can replay the engine's experts (`vlmrl.models.routing`) and, when the model has
  one, the shared expert with its sigmoid gate;
- `layer`: a TransformerLayer (or the fused dense layer) around a mixer and an MLP.
"""

from __future__ import annotations

from typing import Any

from ..config.schema import ModelConfig


def norm(fused: bool = False) -> Any:
    from megatron.core.transformer.spec_utils import ModuleSpec

    from .norm import RMSNorm

    return ModuleSpec(module=RMSNorm, params={"fused": fused})


def attention(model: ModelConfig, *, backend: str = "sdpa", fused: bool = False) -> Any:
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.attention import SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    from .attention import GroupedSelfAttention, PackedSelfAttentionCore

    local = LocalSpecProvider()
    if backend == "local":
        backend = "eager"  # stock local attention cannot do packed sequences
    qk = norm(fused) if model.lm.qk_layernorm else IdentityOp
    return ModuleSpec(
        module=GroupedSelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=local.column_parallel_linear(),
            core_attention=ModuleSpec(module=PackedSelfAttentionCore, params={"backend": backend, "fused": fused}),
            linear_proj=local.row_parallel_linear(),
            q_layernorm=qk,
            k_layernorm=qk,
        ),
    )


def gdn(model: ModelConfig, *, backend: str = "torch", fused: bool = False) -> Any:
    from megatron.core.transformer.spec_utils import ModuleSpec

    from .gdn import GatedDeltaNet

    lm = model.lm
    return ModuleSpec(module=GatedDeltaNet, params={
        "num_key_heads": lm.linear_num_key_heads, "num_value_heads": lm.linear_num_value_heads,
        "key_head_dim": lm.linear_key_head_dim, "value_head_dim": lm.linear_value_head_dim,
        "conv_kernel": lm.linear_conv_kernel_dim, "backend": backend, "fused": fused})


def mlp() -> Any:
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    local = LocalSpecProvider()
    return ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=local.column_parallel_linear(),
                                                           linear_fc2=local.row_parallel_linear()))


def moe(model: ModelConfig) -> Any:
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.moe_layer import MoESubmodules
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    from .moe import HFExperts, LocalMoELayer
    from .routing import EngineRoutedRouter

    local = LocalSpecProvider()
    shared = None
    if model.lm.shared_expert_ffn_hidden_size:
        shared = ModuleSpec(module=SharedExpertMLP, submodules=MLPSubmodules(
            linear_fc1=local.column_parallel_linear(), linear_fc2=local.row_parallel_linear()))
    return ModuleSpec(module=LocalMoELayer, submodules=MoESubmodules(experts=ModuleSpec(module=HFExperts),
                                                                shared_experts=shared, router=EngineRoutedRouter))


def layer(mixer: Any, mlp_spec: Any, *, fused: bool = False) -> Any:
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    module = TransformerLayer
    if fused:
        from .fused_layer import FusedTransformerLayer

        module = FusedTransformerLayer
    return ModuleSpec(
        module=module,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm(fused),
            self_attention=mixer,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm(fused),
            mlp=mlp_spec,
            mlp_bda=get_bias_dropout_add,
        ),
    )

"""Parameter counts and a per-GPU memory estimate, from the model and parallel config.

Pure arithmetic (standard library only) used by the plan command. The estimate follows
Megatron's layout: dense weights split over TP and PP stages, experts over EP x ETP,
distributed-optimizer state over the data-parallel group (expert state over the expert
data-parallel group), and activations for one micro-batch per layer (Korthikanti et al.'s
34*s*h bytes per layer for a transformer layer with flash/SDPA attention, divided by TP
with sequence parallel; full recompute keeps only each layer's input).
"""

from __future__ import annotations

from dataclasses import dataclass

from .layout import compute_layout, is_moe_model
from .schema import LanguageModelConfig, VisionConfig, VlmrlConfig

GIB = 1024**3


@dataclass(frozen=True)
class ParamCounts:
    embedding: int  # input embedding (vocab x hidden)
    output: int  # untied output layer (0 when tied)
    attention_layers: int  # all full-attention layers' attention blocks
    linear_attention_layers: int  # all Gated DeltaNet blocks
    dense_mlp: int  # dense MLPs
    experts: int  # routed experts (all layers)
    shared: int  # router, shared experts, norms: dense parameters of MoE blocks
    norms: int
    vision: int
    active_experts: int  # routed expert parameters used per token (top-k of each layer)

    @property
    def language_model(self) -> int:
        return (self.embedding + self.output + self.attention_layers + self.linear_attention_layers
                + self.dense_mlp + self.experts + self.shared + self.norms)

    @property
    def total(self) -> int:
        return self.language_model + self.vision

    @property
    def active(self) -> int:
        """Parameters touched per token (routed experts counted top-k only)."""
        return self.total - self.experts + self.active_experts


def _full_attention_params(lm: LanguageModelConfig) -> int:
    h, nh, ng, hd = lm.hidden_size, lm.num_attention_heads, lm.num_query_groups, lm.head_dim
    q_out = nh * hd * (2 if lm.attention_output_gate else 1)  # the output gate doubles q_proj
    n = h * q_out + 2 * h * ng * hd + nh * hd * h
    if lm.add_qkv_bias:
        n += q_out + 2 * ng * hd
    if lm.qk_layernorm:
        n += 2 * hd
    return n


def _gdn_params(lm: LanguageModelConfig) -> int:
    h = lm.hidden_size
    nk, nv, dk, dv = (lm.linear_num_key_heads, lm.linear_num_value_heads, lm.linear_key_head_dim,
                      lm.linear_value_head_dim)
    qkv = 2 * nk * dk + nv * dv
    n = h * (qkv + nv * dv)  # q, k, v and the output gate z
    n += h * 2 * nv  # beta and the decay input a
    n += qkv * lm.linear_conv_kernel_dim  # depthwise short convolution
    n += 2 * nv  # dt_bias, A_log
    n += dv  # gated RMSNorm on the output
    n += nv * dv * h  # out_proj
    return n


def _vision_params(v: VisionConfig, family: str) -> int:
    vh, vi = v.hidden_size, v.intermediate_size
    patch = v.in_channels * v.temporal_patch_size * v.patch_size**2 * vh
    if family == "qwen2_5_vl":
        block = 3 * vh * vh + 3 * vh + vh * vh + vh + 3 * vh * vi + 2 * vi + vh + 2 * vh  # RMSNorm x2
        norm_q = vh
        patch_bias = 0
    else:  # Qwen3.5 / Qwen3-VL style: LayerNorms with bias, plain GELU MLP, learned positions
        block = 3 * vh * vh + 3 * vh + vh * vh + vh + 2 * vh * vi + vi + vh + 4 * vh
        norm_q = 2 * vh
        patch_bias = vh
    merged = vh * v.spatial_merge_size**2
    merger = norm_q + merged * merged + merged + merged * v.out_hidden_size + v.out_hidden_size
    pos = (v.num_position_embeddings or 0) * vh
    return patch + patch_bias + v.depth * block + merger + pos


def count_params(cfg: VlmrlConfig) -> ParamCounts:
    lm, m = cfg.model.lm, cfg.model
    h = lm.hidden_size
    types = list(lm.layer_types) or ["full_attention"] * lm.num_layers
    n_full = types.count("full_attention")
    n_gdn = types.count("linear_attention")
    if is_moe_model(cfg):
        experts = lm.num_layers * lm.num_experts * 3 * h * lm.moe_ffn_hidden_size
        active = lm.num_layers * lm.moe_router_topk * 3 * h * lm.moe_ffn_hidden_size
        shared = lm.num_layers * (h * lm.num_experts + 3 * h * lm.shared_expert_ffn_hidden_size
                                  + (h if lm.shared_expert_gate else 0))
        dense = 0
    else:
        experts = active = shared = 0
        dense = lm.num_layers * 3 * h * lm.ffn_hidden_size
    return ParamCounts(
        embedding=lm.vocab_size * h,
        output=0 if lm.tie_word_embeddings else lm.vocab_size * h,
        attention_layers=n_full * _full_attention_params(lm),
        linear_attention_layers=n_gdn * _gdn_params(lm) if n_gdn else 0,
        dense_mlp=dense,
        experts=experts,
        shared=shared,
        norms=lm.num_layers * 2 * h + h,
        vision=_vision_params(m.vision, m.family),
        active_experts=active,
    )


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU of the most loaded trainer rank (pipeline stage 0)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    tokens_per_micro_batch: int
    rollout_pool: float  # SGLang's static pool (weights + KV cache) while generating
    # tp wider than the KV groups: the gathered fused QKV projections of the attention layers
    # held for backward (included in `activations`); 0 otherwise
    qkv_gather: float = 0.0

    @property
    def train_total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations


def sequence_length(cfg: VlmrlConfig) -> int:
    return cfg.data.max_prompt_length + cfg.rollout.max_new_tokens


def estimate_memory(cfg: VlmrlConfig) -> MemoryEstimate:
    p, lm = cfg.parallel, cfg.model.lm
    layout = compute_layout(cfg)
    counts = count_params(cfg)
    bf16 = cfg.hardware.train_dtype == "bfloat16"
    h = lm.hidden_size
    layers_per_stage = lm.num_layers / p.pp

    # Weights held by stage 0: its share of the layers, the embedding (and the output layer
    # when pp == 1), the vision tower (replicated over TP, first stage only).
    per_layer_dense = (counts.attention_layers + counts.linear_attention_layers + counts.dense_mlp
                       + counts.shared + counts.norms) / lm.num_layers
    dense = (per_layer_dense * layers_per_stage + counts.embedding
             + (counts.output if p.pp == 1 else 0)) / p.tp
    experts = counts.experts / lm.num_layers * layers_per_stage / (p.ep * p.etp)
    vision = counts.vision
    weights = dense + experts + vision

    weight_bytes = 2 if bf16 else 4
    params = weights * weight_bytes
    grads = weights * 4  # Megatron accumulates main grads in fp32
    state_per_param = (4 + 8) if bf16 else 8  # fp32 master copy (bf16 only) + Adam moments
    if cfg.trainer.use_distributed_optimizer:
        optimizer = ((dense + vision) / layout.dp + experts / layout.expert_dp) * state_per_param
    else:
        optimizer = weights * state_per_param

    if p.use_dynamic_batch_size:
        tokens = p.max_tokens_per_gpu
    else:
        tokens = p.micro_batch_size * sequence_length(cfg)
    tokens_cp = tokens / p.cp
    act_bytes = 2 if bf16 else 4
    sp = p.tp if p.sequence_parallel else 1
    layer_full = 34 * tokens_cp * h * act_bytes / 2 / sp  # 34*s*h bytes at 2 bytes per value
    if is_moe_model(cfg):
        # dispatched tokens through top-k experts (fc1 output, activation, fc2 input)
        layer_full += tokens_cp * lm.moe_router_topk * (h + 3 * lm.moe_ffn_hidden_size) * act_bytes / p.etp
    layer_input = tokens_cp * h * act_bytes / sp
    if p.recompute_granularity == "full":
        activations = layers_per_stage * layer_input + layer_full
    else:
        activations = layers_per_stage * layer_full
    activations *= p.pp  # 1F1B: stage 0 holds up to pp micro-batches in flight
    logits = 2 * tokens_cp * lm.vocab_size / p.tp * 4  # fp32 logits and their gradient
    activations += logits
    qkv_gather = 0.0
    if p.tp > lm.num_query_groups:
        rows = (lm.num_attention_heads * (2 if lm.attention_output_gate else 1) + 2 * lm.num_query_groups) * lm.head_dim
        types = list(lm.layer_types) or ["full_attention"] * lm.num_layers
        attn_layers = types.count("full_attention") / p.pp
        held = 1 if p.recompute_granularity == "full" else attn_layers
        # the whole sequence (sequence parallel gathers it first), all heads' rows
        qkv_gather = held * tokens_cp * rows * act_bytes * p.pp
        activations += qkv_gather

    gpu = cfg.hardware.gpu_memory_gb * GIB
    pool = cfg.rollout.sglang.mem_fraction_static * gpu if cfg.rollout.name == "sglang" else 0.0
    return MemoryEstimate(params, grads, optimizer, activations, int(tokens), pool, qkv_gather)

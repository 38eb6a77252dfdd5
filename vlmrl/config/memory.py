"""Parameter counts, a per-GPU memory estimate and the peak of each phase of a step.

Pure arithmetic (standard library only) used by the plan command. The estimate follows
Megatron's layout: dense weights split over TP and PP stages, experts over EP x ETP,
distributed-optimizer state over the data-parallel group (expert state over the expert
data-parallel group), and activations for one micro-batch: what each layer's code keeps for
its backward, per part (norms, Gated DeltaNet or attention, MLP or MoE block) and per token,
counted from the code and held to the real layers' saved tensors by a CPU test, plus the
backward's own peak (the last MoE block's gradients, or the logits' gradient); full
recompute keeps only each layer's input.

`phase_memory` adds, for layouts where trainer and engines share GPUs, the peak of each
phase of a step on one GPU (rollout, logprob recompute, train, weight sync), each as its
named parts; `compare_phase_memory` holds a run's measurements against them. The few figures
the config cannot give (a process's CUDA context, an engine's working memory beside its
static pool) are the constants below, named as parts wherever they count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from .layout import compute_layout, engine_batch_requests, is_moe_model
from .schema import LanguageModelConfig, VisionConfig, VlmrlConfig

GIB = 1024**3

# Device memory of one process that computes on a GPU whatever it holds: the CUDA context,
# cuBLAS workspaces (measured on one GPU, where every NCCL group is of one rank; the buffers of
# groups of several GPUs are NCCL_COMMUNICATOR_BYTES each). A released engine and an offloaded
# trainer keep this much each.
PROCESS_BYTES = 1.5 * GIB
# One NCCL communicator's device buffers where its group spans two or more GPUs of a node, at
# NCCL's default buffer size and channel count: 544-688 MB a communicator, measured through
# PyTorch on four NVLink A100s (NVIDIA/nccl issue 964); more channels on Hopper can only add to
# it. NCCL allocates them outside torch's allocator at a group's first collective and keeps
# them until the group is destroyed: an offloaded trainer and a released engine keep theirs.
# No vlmrl run has had several GPUs yet, so no run has measured it (a one-GPU run's groups are
# of one rank and hold no buffers).
NCCL_COMMUNICATOR_BYTES = 0.65 * GIB
# What an SGLang engine holds outside the regions its memory saver releases, whether it is
# generating or released (measured on the H200 with SGLang 0.5.17, bench/results/sglang.md,
# 2026-12-04 third session): a fixed part (its tokenizer process's CUDA context and the 1 GiB it
# reserves for multimodal features over CUDA IPC, attention workspaces, torch's cache of
# activations) and index arrays that grow with the KV cache's token count (about 64 bytes a
# token, created at start and again by the cache flush of each release).
SGLANG_OUTSIDE_POOL_BYTES = 3.0 * GIB
SGLANG_BYTES_PER_KV_TOKEN = 64
# Host memory of the run's processes themselves, resident beyond the trainer's pinned offload
# copies, as the node's used memory showed it on one H100 at real width with SGLang colocated
# (bench/results/real-width.md, sections 2 and 4): the driver with Ray's daemons, once a node;
# an engine's server, per engine GPU; a trainer rank. The weights live on the GPUs, so these
# hardly grow with the model. On a node of several GPUs they are counted per GPU, which no run
# has measured yet.
HOST_DRIVER_BYTES = 2.3 * GIB
HOST_ENGINE_PER_GPU_BYTES = 4.8 * GIB
HOST_TRAINER_RANK_BYTES = 5.8 * GIB
# SGLang's split of a hybrid model's pool between recurrent (Gated DeltaNet) states and the
# attention layers' KV cache: `--mamba-full-memory-ratio`, its default.
SGLANG_MAMBA_FULL_MEMORY_RATIO = 0.9
# The embedded engine's working memory beyond its weights while it generates: the KV cache of
# a batch and the activations of its forward passes.
ENGINE_RUNTIME_BYTES = 4.0 * GIB
# the share of a GPU every phase of a step is planned within (the micro-batch budget, the pool at
# which engines can stay, the run's note on an over-full phase): allocator caches and fragmentation
# take the rest
PHASE_FRACTION = 0.9
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


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
    # a forward without backward (the logprob recompute): one layer's working set and the
    # logits of one micro-batch with their float32 log-softmax
    forward_activations: float = 0.0
    # parameters (counts) of the rank's two gradient buffers: dense (with the vision tower) and
    # routed experts; the distributed optimizer shards them over dp and expert dp
    dense_weights: float = 0.0
    expert_weights: float = 0.0

    @property
    def state(self) -> float:
        """What the trainer keeps between steps: weights, gradients, optimizer state."""
        return self.params + self.grads + self.optimizer

    @property
    def train_total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations


def sequence_length(cfg: VlmrlConfig) -> int:
    return cfg.data.max_prompt_length + cfg.rollout.max_new_tokens


# --------------------------------------------------------------------------- activations
# What each part of a decoder layer keeps for its backward, in bytes per token of a
# micro-batch: the tensors its eager code saves (autograd's saved tensors), counted from the
# code and measured on the real layers in bf16 (tests/integration/test_activation_memory.py
# holds these formulas to the layers' saved tensors). F32 is the float32 of the parts that
# compute in float32 whatever the train dtype: RMSNorm statistics, the torch Gated DeltaNet
# recurrence, its gated norm, the router, the log-softmax.
F32 = 4


# the torch Gated DeltaNet path's largest chunk
GDN_MAX_CHUNK = 64


def gdn_chunk_size(longest: int) -> int:
    """The chunk the torch Gated DeltaNet path picks for packed samples whose longest has
    `longest` tokens: 16..64, small for short samples (less padding, smaller C x C systems).
    The one definition of the rule: `vlmrl.models.gated_delta` chunks by it and the plan
    counts by it."""
    return min(GDN_MAX_CHUNK, max(16, 1 << max(int(longest / 8) - 1, 1).bit_length()))


@dataclass(frozen=True)
class LayerActivations:
    """Bytes per token one decoder layer keeps for its backward, as named parts."""

    norms: float  # the input and pre-MLP RMSNorms
    mixer: float  # the Gated DeltaNet or attention block, projections included
    mlp: float  # the dense MLP, or the MoE block: router, routed experts, shared expert

    @property
    def total(self) -> float:
        return self.norms + self.mixer + self.mlp


def _act_bytes(cfg: VlmrlConfig) -> int:
    return 2 if cfg.hardware.train_dtype == "bfloat16" else 4


def rms_norm_activation_bytes(cfg: VlmrlConfig) -> float:
    """One RMSNorm (`vlmrl.models.norm.rms_norm`) per token: its float32 input and the
    normalised values (zero-centred weight, Qwen3.5) or the normalised values cast back to the
    train dtype (plain weight), and the float32 inverse RMS."""
    h, a = cfg.model.lm.hidden_size, _act_bytes(cfg)
    zero_centered = cfg.model.family.startswith("qwen3_5")  # Qwen3.5 and Qwen3.5-MoE
    return h * F32 + (h * F32 if zero_centered else h * a) + F32


def gdn_activation_bytes(cfg: VlmrlConfig, longest: int | None = None) -> float:
    """One Gated DeltaNet block (`vlmrl.models.gdn`) per token of this rank (heads split over
    TP): projections, short convolution, the gated delta rule and the gated norm.

    `hardware.gdn_backend=torch` (`chunk_gated_delta_rule`, float32): per key head (Hk, dk)
    and value head (Hv, dv) of a chunk of C tokens (`gdn_chunk_size` of `longest`, the longest
    packed sample, by default the configured sequence length), the normalised q and k, the
    C x C systems and decay masks, the solved corrections, the chunk-start states
    (dk x dv per value head and chunk: Hv*dk*dv/C a token) and the per-chunk products. Packed
    samples are padded to the longest, rounded up to C; the count assumes that padding is
    small (samples of similar length). `fla`: the kernels keep q, k, v, the decays and one
    C x C matrix per value head and recompute the rest (counted from fla's saved inputs, not
    measured here)."""
    lm, a = cfg.model.lm, _act_bytes(cfg)
    tp = cfg.parallel.tp
    h = lm.hidden_size
    hk, hv = lm.linear_num_key_heads / tp, lm.linear_num_value_heads / tp
    dk, dv = lm.linear_key_head_dim, lm.linear_value_head_dim
    conv = 2 * hk * dk + hv * dv  # the short convolution's channels: q, k, v
    c = gdn_chunk_size(longest or sequence_length(cfg))
    # the block's input (shared by the four projections) and out_proj's input
    n = h * a + hv * dv * a
    # decay (float32 softplus) and write strength (sigmoid)
    n += 2 * hv * F32 + hv * a
    # gated RMSNorm of the output: float32 input, normalised values, gate and SiLU(gate), the
    # scaled values in the train dtype, the inverse RMS
    n += 4 * hv * dv * F32 + hv * dv * a + hv * F32
    if cfg.hardware.gdn_backend == "fla":
        n += conv * a  # the Triton convolution keeps its input
        n += conv * a + 2 * hv * F32 + hv * c * F32  # q, k, v, g, beta and the intra-chunk matrix
        return n
    n += 2 * conv * a  # the torch convolution: the padded input and the SiLU's input
    n += 2 * hk * dk * F32 + 2 * hk * F32  # l2-normalised q and k (float32) and their inverse norms
    # the chunked recurrence, float32: q, k operands of the two C x C products and q, k as
    # used by the right-hand side and the output decay (6 Hk dk); v and the solved corrections
    # (3 Hv dv, 3 Hv dk counting the per-chunk operands expanded over the value heads); the
    # C x C products per key head (2 Hk C) and per value head (decay, masked products, the
    # system: 4 Hv C); the state at every chunk start (Hv dk dv / C); the cumulative decays
    n += (6 * hk * dk + 3 * hv * dv + 3 * hv * dk + 2 * hk * c + 4 * hv * c + hv * dk * dv / c + 5 * hv) * F32
    return n


def attention_activation_bytes(cfg: VlmrlConfig) -> float:
    """One attention block (Megatron's SelfAttention with `vlmrl.models.attention`'s core) per
    token of this rank: the fused QKV projection's input and output, q/k RMSNorms (float32),
    the rotated q and k, the attention output with its log-sum-exp, the output gate, and
    out_proj's input. Counted as SDPA keeps them with GQA (V a view of the projection's
    output); where CUDA repeats K and V to the query heads first (cuDNN's path), the kernel
    keeps the repeated copies instead of the projection's output: about as many bytes for
    Qwen3.5's gated attention (2 x 16 heads against 36 rows of 256)."""
    lm, a, tp = cfg.model.lm, _act_bytes(cfg), cfg.parallel.tp
    h, hd = lm.hidden_size, lm.head_dim
    nh, ng = lm.num_attention_heads / tp, max(lm.num_query_groups / tp, 1)
    gate = 2 if lm.attention_output_gate else 1
    n = h * a  # linear_qkv's input
    n += (gate * nh + 2 * ng) * hd * a  # its output, which V stays a view of
    if lm.qk_layernorm:
        n += 2 * (nh + ng) * hd * F32 + (nh + ng) * F32
    n += (nh + ng) * hd * a  # q and k after rotary embedding
    n += nh * hd * a + nh * F32  # the attention output and its log-sum-exp
    if lm.attention_output_gate:
        n += 2 * nh * hd * a  # output and sigmoid(gate)
    n += nh * hd * a  # out_proj's input
    return n


def mlp_activation_bytes(cfg: VlmrlConfig) -> float:
    """The MLP of one layer per token of this rank. Dense SwiGLU: input, fc1's output,
    SiLU(gate), the activation (fc2's input). MoE (`vlmrl.models.moe`): the router's float32
    probabilities and routing indices; per routed token (top-k of them, EP moves them but not
    their count) its dispatched input, fc1's output [gate; up], SiLU(gate), the activation and
    the activation scaled by its router weight (fc2's input), i.e. H + 5 I values; and the
    shared expert, a SwiGLU MLP with a sigmoid gate on its own copy of the input."""
    lm, a = cfg.model.lm, _act_bytes(cfg)
    p = cfg.parallel
    h = lm.hidden_size
    if not is_moe_model(cfg):
        return h * a + 5 * lm.ffn_hidden_size / p.tp * a
    k, e = lm.moe_router_topk, lm.num_experts
    n = e * F32 + k * (4 * 8 + F32)  # router: probabilities, top-k indices and weights, sort maps
    n += k * (h + 5 * lm.moe_ffn_hidden_size / p.etp) * a + k * F32
    if lm.shared_expert_ffn_hidden_size:
        n += h * a + 5 * lm.shared_expert_ffn_hidden_size / p.tp * a
        if lm.shared_expert_gate:
            n += h * a + a
    return n


def layer_activation_bytes(cfg: VlmrlConfig, kind: str, longest: int | None = None) -> LayerActivations:
    """Bytes per token one decoder layer of `kind` ("linear_attention" or "full_attention")
    keeps for its backward: the sum of the parts above (norms replicated over TP unless
    sequence parallel splits the tokens)."""
    p = cfg.parallel
    sp = p.tp if p.sequence_parallel else 1
    mixer = gdn_activation_bytes(cfg, longest) if kind == "linear_attention" else attention_activation_bytes(cfg)
    return LayerActivations(norms=2 * rms_norm_activation_bytes(cfg) / sp, mixer=mixer, mlp=mlp_activation_bytes(cfg))


def moe_backward_bytes(cfg: VlmrlConfig, tokens: float) -> float:
    """What the backward of one MoE block allocates beyond what its forward kept, at its peak,
    for `tokens` tokens of this rank (0 for dense models): the gradient of the local experts'
    fused [gate; up] weights in their dtype, one [E, 2 I, H] tensor (the grouped GEMM's;
    Megatron adds it into its float32 gradient buffer and frees it), with the gradients of
    fc1's output and of the dispatched tokens (top-k rows per token) live beside it. The
    training peak is reached here, in the last layer's MoE block, the logits' gradients gone."""
    if not is_moe_model(cfg):
        return 0.0
    lm, p, a = cfg.model.lm, cfg.parallel, _act_bytes(cfg)
    h, ffn, k = lm.hidden_size, lm.moe_ffn_hidden_size / p.etp, lm.moe_router_topk
    return lm.num_experts / p.ep * 2 * ffn * h * a + tokens * k * (h + 2 * ffn) * a


def head_activation_bytes(cfg: VlmrlConfig) -> float:
    """The final RMSNorm, the output layer's input and the loss per token of this rank: the
    float32 log-softmax over the vocabulary slice and its exponent (the entropy's), i.e.
    2 x V x 4 bytes."""
    lm, p = cfg.model.lm, cfg.parallel
    sp = p.tp if p.sequence_parallel else 1
    return rms_norm_activation_bytes(cfg) / sp + lm.hidden_size * _act_bytes(cfg) + 2 * lm.vocab_size / p.tp * F32


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
    # what each layer keeps for its backward (`layer_activation_bytes`), stage 0 holding its
    # share of each kind of layer
    types = list(lm.layer_types) or ["full_attention"] * lm.num_layers
    per_kind = {t: layer_activation_bytes(cfg, t).total * tokens_cp for t in set(types)}
    layers = sum(per_kind[t] for t in types) / lm.num_layers * layers_per_stage
    layer_full = max(per_kind.values())  # the largest layer's
    layer_input = tokens_cp * h * act_bytes / sp
    if p.recompute_granularity == "full":
        activations = layers_per_stage * layer_input + layer_full
    else:
        activations = layers
    activations *= p.pp  # 1F1B: stage 0 holds up to pp micro-batches in flight
    # the backward's peak beyond what the layers keep: as it starts, the head (final norm, the
    # output layer's input, the float32 log-softmax) with the float32 gradient of the logits
    # and the logits' own gradient in the train dtype; or later, the head freed, the last MoE
    # block's backward (`moe_backward_bytes`), whichever is larger
    logits_grad = tokens_cp * lm.vocab_size / p.tp * (F32 + act_bytes)
    activations += max(head_activation_bytes(cfg) * tokens_cp + logits_grad, moe_backward_bytes(cfg, tokens_cp))
    # forward only: each part frees its intermediates as it goes, so one part's working set is
    # live at a time, at most what it would keep for a backward (the largest part's bytes: the
    # torch Gated DeltaNet block keeps 358 KB a token at the scaled 2.88B shape, its forward
    # without autograd peaked at 331 on the CPU); the logits (train dtype) and their float32
    # log-softmax stay for the micro-batch
    largest_part = max(max(part.norms / 2, part.mixer, part.mlp)
                       for part in (layer_activation_bytes(cfg, t) for t in set(types)))
    forward_activations = largest_part * tokens_cp + tokens_cp * lm.vocab_size / p.tp * (act_bytes + F32)
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
    return MemoryEstimate(params, grads, optimizer, activations, int(tokens), pool, qkv_gather, forward_activations,
                          dense_weights=dense + vision, expert_weights=experts)


# --------------------------------------------------------------------------- offload
def engines_stay(cfg: VlmrlConfig) -> bool:
    """Whether colocated engines keep their memory through the whole step
    (`cluster.release_engines=false` on GPUs): nothing is released, offloaded or resumed, and
    every phase holds the engines' pool beside the trainer's whole state."""
    return bool(cfg.cluster.colocate and not cfg.cluster.release_engines and cfg.hardware.device == "cuda")


def trainer_offload(cfg: VlmrlConfig) -> bool:
    """Whether the trainer's weights, gradients and optimizer state leave the GPU while the
    engines generate: `trainer.offload`, and where that is null, exactly when the trainer
    shares its GPUs with engines that release their memory while it trains (`cluster.colocate`
    on hardware with GPUs, `cluster.release_engines`)."""
    if cfg.trainer.offload is not None:
        return bool(cfg.trainer.offload)
    return bool(cfg.cluster.colocate and cfg.hardware.device == "cuda" and cfg.cluster.release_engines)


def offload_config_problems(cfg: VlmrlConfig) -> list[str]:
    """What is wrong with `trainer.offload` in `cfg` (empty when nothing): offloading moves
    the trainer's state from GPU memory to host memory, so `trainer.offload=true` on hardware
    without GPUs is refused rather than ignored."""
    t = cfg.trainer
    out = []
    if t.offload and cfg.hardware.device != "cuda":
        out.append(f"trainer.offload=true needs GPUs, and hardware.device={cfg.hardware.device!r} "
                   f"(hardware={cfg.hardware.name}): the trainer's state is in host memory already; "
                   "set trainer.offload=null (on exactly when colocated on GPUs) or false")
    if t.offload and engines_stay(cfg):
        out.append("trainer.offload=true with cluster.release_engines=false: the engines keep their pool through the "
                   "step, so moving the trainer's state off the GPUs while they generate frees nothing they use; "
                   "set trainer.offload=null (off then) or false, or cluster.release_engines=true")
    if t.resident_gib is not None and not t.resident_gib >= 0:
        out.append(f"trainer.resident_gib={t.resident_gib}: GiB of trainer state kept on each GPU while the engines "
                   "generate, 0 or more (null: what fits in trainer.resident_budget of the GPU)")
    if not 0 < t.resident_budget <= 1:
        out.append(f"trainer.resident_budget={t.resident_budget}: the share of a GPU that the rollout phase may fill "
                   "with the trainer's resident state beside the engines, in (0, 1]")
    return out


@dataclass(frozen=True)
class OffloadSplit:
    """Where each part of a trainer GPU's state is while the engines generate (colocated with
    offload), in bytes: `resident` stays on the GPU, `moved` goes to pinned host memory and
    back, `dropped` (the gradients, which every step zeroes first) is freed without a copy.
    Weights stay before optimizer state: the forward needs them first, while the optimizer
    state is read only by the optimizer step, after the backward (`trainer.offload_overlap`
    brings it back meanwhile). Weights stay whole or move whole (they live in a few large DDP
    buffers; the KL term's reference weights count with them); optimizer state is split tensor
    by tensor."""

    resident: tuple[tuple[str, float], ...]
    moved: tuple[tuple[str, float], ...]
    dropped: float
    budget: float  # the bytes that were allowed to stay

    @property
    def resident_bytes(self) -> float:
        return sum(b for _, b in self.resident)

    @property
    def moved_bytes(self) -> float:
        return sum(b for _, b in self.moved)

    def part(self, name: str, where: str = "resident") -> float:
        return sum(b for n, b in getattr(self, where) if n == name)


def _offload_parts(cfg: VlmrlConfig, mem: MemoryEstimate) -> tuple[tuple[str, float], ...]:
    """The trainer state an offload may move, in the order it stays: the weights (the KL term's
    reference model with the policy's: the trainer holds both as parameters it never moves once
    built), then the optimizer state."""
    return (("weights", mem.params * (2 if cfg.algo.uses_reference else 1)), ("optimizer state", mem.optimizer))


def nothing_kept(cfg: VlmrlConfig, mem: MemoryEstimate) -> OffloadSplit:
    """The split that keeps nothing on the GPU (the rollout phase before anything stays)."""
    return OffloadSplit((), _offload_parts(cfg, mem), mem.grads, 0.0)


def offload_split(cfg: VlmrlConfig, mem: MemoryEstimate | None = None) -> OffloadSplit:
    """The trainer's state split by where it spends the rollout (`OffloadSplit`). Without
    offload everything is resident. With it, `trainer.resident_gib` bytes may stay, or where
    that is null, what keeps the rollout phase within `trainer.resident_budget` of the GPU: the
    budget less the rollout phase with nothing kept (the engines' peak, the trainer's process,
    communicators and CUDA graph pools)."""
    mem = mem or estimate_memory(cfg)
    parts = _offload_parts(cfg, mem)
    if cfg.hardware.device != "cuda" or not trainer_offload(cfg):
        return OffloadSplit(parts, (), 0.0, float("inf"))
    t = cfg.trainer
    if t.resident_gib is not None:
        budget = float(t.resident_gib) * GIB
    elif not cfg.cluster.colocate:  # offload asked for on GPUs of the trainer's own: it frees them whole
        budget = 0.0
    else:
        rollout = next(ph for ph in phase_memory(cfg, mem, split=nothing_kept(cfg, mem)) if ph.phase == "rollout")
        budget = max(t.resident_budget * cfg.hardware.gpu_memory_gb * GIB - rollout.total, 0.0)
    resident, moved, left = [], [], budget
    for name, b in parts:
        keep = min(b, left) if name == "optimizer state" else (b if b <= left else 0.0)
        if keep:
            resident.append((name, keep))
            left -= keep
        if b - keep:
            moved.append((name, b - keep))
    return OffloadSplit(tuple(resident), tuple(moved), mem.grads, budget)


def training_cuda_graphs(cfg: VlmrlConfig) -> tuple[bool, str | None]:
    """(whether the trainer replays its compiled layers as CUDA graphs, why not where
    `hardware.cuda_graphs` asks for them but the layout rules them out). CUDA graph trees
    cannot hold a micro-batch's activations until its backward under pipeline parallelism
    (several micro-batches in flight) or activation recompute (forwards inside the backward),
    and tensor-parallel layers never take the compiled fast path."""
    hw, p = cfg.hardware, cfg.parallel
    if not (hw.cuda_graphs and hw.fused_kernels and hw.device == "cuda"):
        return False, None
    why = ("pipeline parallel" if p.pp > 1 or p.vpp else
           f"activation recompute ({p.recompute_granularity})" if p.recompute_granularity else
           "tensor parallel (its layers run Megatron's own forward, not the compiled graphs)" if p.tp > 1 else None)
    return why is None, why


# --------------------------------------------------------------------------- phases
@dataclass(frozen=True)
class PhaseMemory:
    """The peak device bytes of one GPU during one phase of a step, as named parts."""

    phase: str  # rollout | logprob | train | sync
    where: str  # which GPUs: "shared" (colocated), "trainer" or "engine" (separate)
    parts: tuple[tuple[str, float], ...]

    @property
    def total(self) -> float:
        return sum(b for _, b in self.parts)


def engine_weight_bytes(cfg: VlmrlConfig) -> float:
    """The weights one engine GPU holds: the whole model in its dtype, split over the
    engine's GPUs (SGLang shards attention, Gated DeltaNet, the vocabulary and, with
    `ep_size`, the experts over them)."""
    per = _DTYPE_BYTES.get(cfg.model.dtype, 2)
    return count_params(cfg).total * per / max(cfg.rollout.gpus_per_engine, 1)


def largest_sync_tensor_bytes(cfg: VlmrlConfig) -> tuple[float, float]:
    """(the largest tensor a weight sync sends, the largest gathered expert tensor; bytes in the
    model's dtype). A bucket closes once it reaches `rollout.weight_update_bucket_mb`, so it
    can hold up to one tensor more. Engines that take a layer's routed experts in one copy
    (SGLang with vlmrl's loader) get them fused, [E, 2I, H] for gate and up; others one matrix
    an expert. The embedding and the output layer are vocabulary x hidden each."""
    lm, per = cfg.model.lm, _DTYPE_BYTES.get(cfg.model.dtype, 2)
    vocab = lm.vocab_size * lm.hidden_size * per
    if not lm.num_experts:
        return float(vocab), 0.0
    fused = cfg.rollout.name == "sglang" and cfg.rollout.sglang.weight_loader == "vlmrl"
    expert = 2 * lm.moe_ffn_hidden_size * lm.hidden_size * per * (lm.num_experts if fused else 1)
    return float(max(vocab, expert)), float(expert)


def sync_transient_bytes(cfg: VlmrlConfig) -> list[tuple[str, float]]:
    """What a trainer GPU holds for the weight sync beyond its state (`phase_memory`'s sync
    phase): two buckets in flight (the one the engines load and the next one), each up to one
    tensor over `rollout.weight_update_bucket_mb` (and never more than the model); under expert
    parallelism each expert tensor is gathered over the expert group, its parts and their join
    held together."""
    largest, expert = largest_sync_tensor_bytes(cfg)
    bucket = min(max(int(cfg.rollout.weight_update_bucket_mb), 1) * 1024**2 + largest, engine_weight_bytes(cfg))
    out = [(f"weight-sync buckets (2 x {cfg.rollout.weight_update_bucket_mb} MB, each up to one tensor over)",
            2 * bucket)]
    if cfg.parallel.ep * cfg.parallel.etp > 1 and expert:
        out.append(("weight-sync expert gather (parts and their join)", 2 * expert))
    return out


def sglang_kv_tokens(cfg: VlmrlConfig) -> float:
    """The tokens one SGLang engine GPU's KV cache holds: its static pool
    (`mem_fraction_static` x GPU memory) less the engine's weights; for a hybrid model the
    attention layers' share of it (SGLang gives the recurrent states `mamba_full_memory_ratio`
    as much as the KV cache); divided by the KV bytes of one token over the full-attention
    layers (KV heads shard over the engine's GPUs, a head replicated where there are more GPUs
    than heads)."""
    r, lm = cfg.rollout, cfg.model.lm
    free = max(r.sglang.mem_fraction_static * cfg.hardware.gpu_memory_gb * GIB - engine_weight_bytes(cfg), 0.0)
    types = list(lm.layer_types) or ["full_attention"] * lm.num_layers
    full = types.count("full_attention")
    if full == 0:
        return 0.0
    if "linear_attention" in types:
        ratio = float(dict(r.sglang.server_args).get("mamba_full_memory_ratio", SGLANG_MAMBA_FULL_MEMORY_RATIO))
        free /= 1.0 + ratio
    heads = max(lm.num_query_groups // max(r.gpus_per_engine, 1), 1)
    per_token = full * heads * lm.head_dim * 2 * _DTYPE_BYTES.get(cfg.model.dtype, 2)
    return free / per_token


def trainer_nccl_groups(cfg: VlmrlConfig) -> list[tuple[str, int]]:
    """The process groups of more than one GPU that a trainer rank's step runs collectives
    over, as (name, size), one NCCL communicator each, distinct groups over the same ranks
    included (megatron-core makes a communicator per group): world (barriers, the step's
    metrics and, under the distributed optimizer, the gradient norm), tensor, context and
    pipeline parallel, data parallel (gradients and the optimizer's shards), model parallel
    (the gradient norm without the distributed optimizer), expert parallel (the tokens'
    all-to-all), expert tensor and expert data parallel, and the weight-sync broadcast from
    rank 0 to engines on GPUs of their own. Empty on CPU ranks (gloo) and on one GPU."""
    if cfg.hardware.device != "cuda":
        return []
    p, layout = cfg.parallel, compute_layout(cfg)
    groups = [("world", layout.trainer_world_size), ("tensor", p.tp), ("context", p.cp), ("pipeline", p.pp),
              ("data", layout.dp * p.cp)]
    if not cfg.trainer.use_distributed_optimizer:
        groups.append(("model", p.tp * p.pp * p.cp))
    if is_moe_model(cfg):
        groups += [("expert", p.ep), ("expert tensor", p.etp), ("expert data", layout.expert_dp)]
    if not cfg.cluster.colocate:
        groups.append(("weight sync", 1 + layout.rollout_devices))
    return [(name, size) for name, size in groups if size > 1]


def engine_nccl_groups(cfg: VlmrlConfig) -> list[tuple[str, int]]:
    """An SGLang engine GPU's process groups of more than one GPU: its tensor-parallel group, and
    the weight-sync broadcast where the engines have GPUs of their own."""
    if cfg.hardware.device != "cuda" or cfg.rollout.name != "sglang":
        return []
    groups = [("tensor", cfg.rollout.gpus_per_engine)]
    if not cfg.cluster.colocate:
        groups.append(("weight sync", 1 + compute_layout(cfg).rollout_devices))
    return [(name, size) for name, size in groups if size > 1]


def _nccl_part(holder: str, groups: list[tuple[str, int]]) -> list[tuple[str, float]]:
    """`holder`'s communicators as one part, named by group and size ("world 8, tensor 2")."""
    if not groups:
        return []
    names = ", ".join(f"{name} {size}" for name, size in groups)
    return [(f"{holder} NCCL communicators ({len(groups)} x {NCCL_COMMUNICATOR_BYTES / GIB:.2f} GiB: {names})",
             len(groups) * NCCL_COMMUNICATOR_BYTES)]


def _engine_outside_pool(cfg: VlmrlConfig) -> list[tuple[str, float]]:
    """What an SGLang engine keeps beside its static pool, generating or released."""
    tokens = sglang_kv_tokens(cfg)
    return [("engine process", PROCESS_BYTES), *_nccl_part("engine", engine_nccl_groups(cfg)),
            ("engine memory beside its pool (multimodal buffer, workspaces, cached activations)",
             SGLANG_OUTSIDE_POOL_BYTES),
            (f"engine KV index arrays ({SGLANG_BYTES_PER_KV_TOKEN} B x {tokens / 1e6:.1f}M tokens)",
             SGLANG_BYTES_PER_KV_TOKEN * tokens)]


def _engine_generating(cfg: VlmrlConfig) -> list[tuple[str, float]]:
    r, gpu = cfg.rollout, cfg.hardware.gpu_memory_gb * GIB
    if r.name == "sglang":
        return [(f"engine static pool (weights + KV cache: mem_fraction_static "
                 f"{r.sglang.mem_fraction_static:g} x {_gib_text(gpu)})", r.sglang.mem_fraction_static * gpu),
                *_engine_outside_pool(cfg)]
    if _engine_on_host(cfg):
        return []
    return [("engine weights", engine_weight_bytes(cfg)), ("engine activations", ENGINE_RUNTIME_BYTES),
            ("engine process", PROCESS_BYTES)]


def _engine_released(cfg: VlmrlConfig) -> list[tuple[str, float]]:
    """What a released engine keeps: SGLang what lies outside its memory saver's regions, the
    embedded engine its process."""
    if cfg.rollout.name == "sglang":
        return [(f"released {name}", b) for name, b in _engine_outside_pool(cfg)]
    if _engine_on_host(cfg):
        return []
    return [("released engine process", PROCESS_BYTES)]


def _engine_on_host(cfg: VlmrlConfig) -> bool:
    """An embedded engine on the host's CPU beside GPU trainers takes no GPU memory."""
    from .layout import embedded_engine_device

    return cfg.rollout.name == "embedded" and embedded_engine_device(cfg) == "cpu"


def _gib_text(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def phase_memory(cfg: VlmrlConfig, mem: MemoryEstimate | None = None,
                 split: OffloadSplit | None = None) -> list[PhaseMemory]:
    """The peak of each phase of a step on the most loaded GPU (pipeline stage 0).

    Colocated (trainer and engines on the same GPUs; `where` "shared"):

    - rollout: the engines generate with everything they hold (static pool =
      `mem_fraction_static` x GPU memory, plus their CUDA graphs and activations); the trainer
      keeps its process and, with offload, what `offload_split` leaves resident (without it:
      its weights, gradients and optimizer state). CUDA graph trees of the trainer keep their
      pools either way.
    - logprob: the trainer's state and a forward's activations; the released engines keep
      their processes.
    - train: the trainer's state and the activations of a training micro-batch.
    - sync: the trainer's state, the engines' weights (resumed, KV cache and graphs still
      released) and two buckets in flight (`sync_transient_bytes`).
    - save (only where a checkpoint's save gathers on the device, `checkpoint_device_bytes`):
      the trainer's state and the gather, the engines released.

    Colocated with the engines staying (`cluster.release_engines=false`, `engines_stay`): every
    phase holds the engines' whole footprint and the trainer's whole state; logprob adds a
    forward's activations, train a training micro-batch's, the sync its buckets (the trainer
    trims its cached activations when training ends).

    Separate GPUs: "train" and "logprob" on the trainer's GPUs, "rollout" on the engines'.
    No phases on CPU ranks (empty list)."""
    if cfg.hardware.device != "cuda":
        return []
    mem = mem or estimate_memory(cfg)
    offload = trainer_offload(cfg)
    graphs, _ = training_cuda_graphs(cfg)
    state = [("trainer weights", mem.params), ("trainer gradients", mem.grads),
             ("trainer optimizer state", mem.optimizer)]
    if cfg.algo.uses_reference:
        state.append(("reference model weights", mem.params))
    trainer_process = [("trainer process", PROCESS_BYTES), *_nccl_part("trainer", trainer_nccl_groups(cfg))]
    # with CUDA graphs the training activations live in the graph trees' pools, which stay
    trainer_graphs = [("trainer CUDA graph pools", mem.activations)] if graphs else []
    train_acts = [] if graphs else [("trainer activations (training micro-batch)", mem.activations)]
    fwd_acts = [("trainer activations (forward only)", mem.forward_activations)]
    released_engine = _engine_released(cfg)
    gather = checkpoint_device_bytes(cfg, mem)
    save_gather = [("checkpoint save's optimizer-state gather (fully_reshardable)", gather)] if gather else []
    if not cfg.cluster.colocate:
        on_trainer = [*state, *trainer_process, *trainer_graphs]
        return [PhaseMemory("rollout", "engine", tuple(_engine_generating(cfg))),
                PhaseMemory("logprob", "trainer", tuple(on_trainer + fwd_acts)),
                PhaseMemory("train", "trainer", tuple(on_trainer + train_acts)),
                *([PhaseMemory("save", "trainer", tuple(on_trainer + save_gather))] if gather else [])]
    if engines_stay(cfg):
        both = _engine_generating(cfg) + state + trainer_process + trainer_graphs
        return [PhaseMemory("rollout", "shared", tuple(both)),
                PhaseMemory("logprob", "shared", tuple(both + fwd_acts)),
                PhaseMemory("train", "shared", tuple(both + train_acts)),
                PhaseMemory("sync", "shared", tuple(both + sync_transient_bytes(cfg))),
                *([PhaseMemory("save", "shared", tuple(both + save_gather))] if gather else [])]
    if offload:
        split = split or offload_split(cfg, mem)
        kept = [(f"trainer {name} kept on the GPU (trainer.resident_gib)", b) for name, b in split.resident]
    else:
        kept = state
    return [
        PhaseMemory("rollout", "shared", tuple(_engine_generating(cfg) + kept + trainer_process + trainer_graphs)),
        PhaseMemory("logprob", "shared", tuple(state + trainer_process + trainer_graphs + fwd_acts + released_engine)),
        PhaseMemory("train", "shared", tuple(state + trainer_process + trainer_graphs + train_acts + released_engine)),
        PhaseMemory("sync", "shared", tuple(state + trainer_process + trainer_graphs + [
            *([] if _engine_on_host(cfg) else [("engine weights (resumed)", engine_weight_bytes(cfg))]),
            *sync_transient_bytes(cfg),
            *[(name.removeprefix("released "), b) for name, b in released_engine]])),
        *([PhaseMemory("save", "shared", tuple(state + trainer_process + trainer_graphs + save_gather + released_engine))]
          if gather else []),
    ]


def rollout_kv_need(cfg: VlmrlConfig) -> int:
    """KV-cache tokens one engine needs to hold every request of a step's round at once, each at
    the longest sequence and sharing no prefix with the others (`engine_batch_requests` x
    `sequence_length`): an upper bound, SGLang's radix cache shares each prompt's prefix."""
    return engine_batch_requests(cfg) * sequence_length(cfg)


@dataclass(frozen=True)
class StayingPool:
    """The largest SGLang pool at which colocated engines may keep their memory through the step
    (`largest_staying_pool`)."""

    mem_fraction_static: float
    peak: float  # bytes: the highest phase's peak per GPU at that pool
    kv_tokens: float  # what the pool's KV cache holds then
    kv_need: int  # what a step's round may hold at most (`rollout_kv_need`)


def largest_staying_pool(cfg: VlmrlConfig, fraction: float = PHASE_FRACTION, step: float = 0.01) -> StayingPool | None:
    """The largest `rollout.sglang.mem_fraction_static` (a multiple of `step`) at which, with the
    engines staying (`cluster.release_engines=false`), every phase of a colocated step fits in
    `fraction` of the GPU and the pool still holds a whole round's KV cache (`rollout_kv_need`).
    None where that pool does not exist, or the run is not colocated SGLang on GPUs."""
    if not (cfg.cluster.colocate and cfg.rollout.name == "sglang" and cfg.hardware.device == "cuda"):
        return None
    budget, need = fraction * cfg.hardware.gpu_memory_gb * GIB, rollout_kv_need(cfg)
    stay = replace(cfg, cluster=replace(cfg.cluster, release_engines=False),
                   trainer=replace(cfg.trainer, offload=None))
    mem = estimate_memory(stay)
    for i in range(int(round(1 / step)) - 1, 0, -1):
        trial = replace(stay, rollout=replace(stay.rollout, sglang=replace(stay.rollout.sglang,
                                                                           mem_fraction_static=i * step)))
        peak = max(ph.total for ph in phase_memory(trial, mem))
        if peak > budget:
            continue
        kv = sglang_kv_tokens(trial)
        return StayingPool(round(i * step, 6), peak, kv, need) if kv >= need else None
    return None


def step_tokens_per_rank(cfg: VlmrlConfig) -> int:
    """The most tokens one trainer GPU gets for one optimizer step: its data-parallel group's
    share of `trainer.global_batch_size` samples at the longest sequence, split over cp (the
    unit of `parallel.max_tokens_per_gpu`). No micro-batch holds more."""
    samples = -(-cfg.trainer.global_batch_size // compute_layout(cfg).dp)
    return -(-samples * sequence_length(cfg) // cfg.parallel.cp)


def largest_micro_batch_tokens(cfg: VlmrlConfig, fraction: float = PHASE_FRACTION, granularity: int = 1024,
                               limit: int | None = None) -> tuple[int, float] | None:
    """The largest `parallel.max_tokens_per_gpu` (a multiple of `granularity`, at most `limit`,
    by default a rank's whole share of an optimizer step, `step_tokens_per_rank` rounded up) at
    which every phase of a step fits in `fraction` of one GPU, with that budget's highest phase
    peak in bytes. Fewer, larger micro-batches mean fewer per-micro-batch costs in a step (each
    adds a forward, a backward and a full fp32 gradient accumulation). None on CPU ranks, with
    a fixed micro-batch size (`use_dynamic_batch_size=false`), or where not even `granularity`
    tokens fit."""
    p = cfg.parallel
    if cfg.hardware.device != "cuda" or not p.use_dynamic_batch_size or granularity < 1:
        return None
    if limit is None:
        limit = -(-step_tokens_per_rank(cfg) // granularity) * granularity
    budget = fraction * cfg.hardware.gpu_memory_gb * GIB

    def peak(tokens: int) -> float:
        trial = replace(cfg, parallel=replace(p, max_tokens_per_gpu=tokens))
        mem = estimate_memory(trial)
        # the offloaded trainer's resident state fills what the rollout leaves of its own budget
        # (`offload_split`): count the rollout with nothing kept, so that it bounds no micro-batch
        split = nothing_kept(trial, mem) if trainer_offload(trial) else None
        return max(ph.total for ph in phase_memory(trial, mem, split=split))

    lo, hi = 0, limit // granularity  # in units of granularity; the peak grows with the tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if peak(mid * granularity) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return (lo * granularity, peak(lo * granularity)) if lo else None


def offload_host_bytes(cfg: VlmrlConfig, mem: MemoryEstimate | None = None) -> float:
    """Pinned host memory per trainer GPU that holds the offloaded state: what of the weights
    (and the reference model's) and optimizer state does not stay on the GPU (`offload_split`);
    gradients are dropped, not copied (every step zeroes them first). 0 where the trainer does
    not offload."""
    if cfg.hardware.device != "cuda" or not trainer_offload(cfg):
        return 0.0
    return offload_split(cfg, mem).moved_bytes


def trainer_ranks_per_node(cfg: VlmrlConfig) -> int:
    """Trainer ranks that share one node's host memory."""
    layout = compute_layout(cfg)
    return max(min(layout.devices_per_node, layout.trainer_world_size), 1)


def checkpoint_host_bytes(cfg: VlmrlConfig, mem: MemoryEstimate | None = None) -> float:
    """Host memory one trainer rank takes at the peak of a checkpoint's save, beyond what it
    holds anyway (its pinned offload copy, `offload_host_bytes`). GPU ranks only: a CPU rank's
    state is in host memory already, and its save writes it from there.

    megatron-core's writer stages everything a rank writes in host memory before writing it.
    With the distributed optimizer that depends on `trainer.checkpoint_format`:

    - dp_reshardable: the rank's own optimizer shard as it holds it (fp32 main parameters and
      two Adam moments, `mem.optimizer`) and its weights: the rank's state once, no gather;
    - fully_reshardable: the optimizer state of the rank's tensor/pipeline/expert slice is
      first gathered over its data-parallel group, in float32 host buffers of 12 B a parameter
      (main parameter, two Adam moments): the rank's contiguous shards (12 B; one bucket holds
      the whole buffer), the gathered world buffers (12 B), and while each of the three is
      copied in, its gathered copy and their concatenation (2 x 4 B): 32 B a parameter. The
      write then keeps the world buffers, a copy of each parameter's slice of them (12 B) and
      the weights staged from the device, less than the gather's peak.

    Without the distributed optimizer the writer stages the state and the weights once. The
    KL term's reference model (`algo.kl_coef` > 0) is staged beside the weights: checkpoints
    keep it once it is the policy after the warm-up."""
    if cfg.hardware.device != "cuda":
        return 0.0
    mem = mem or estimate_memory(cfg)
    weight_bytes = 2 if cfg.hardware.train_dtype == "bfloat16" else 4
    weights = mem.params / weight_bytes
    staged = weight_bytes * (2 if cfg.algo.uses_reference else 1)
    state = 3 * F32  # main parameter (or the fp32 parameter itself) and two Adam moments
    if not cfg.trainer.use_distributed_optimizer:
        return weights * (state + staged)
    if cfg.trainer.checkpoint_format == "dp_reshardable":
        return mem.optimizer + weights * staged
    return weights * max(2 * state + 2 * F32, 2 * state + staged)


def engine_gpus_per_node(cfg: VlmrlConfig) -> int:
    """The most engine GPUs on one node (0 on CPU ranks)."""
    layout = compute_layout(cfg)
    per_node: dict[int, int] = {}
    for slot in layout.engines(cfg):
        per_node[slot.node] = per_node.get(slot.node, 0) + len(slot.devices)
    return max(per_node.values(), default=0)


def process_host_bytes_per_node(cfg: VlmrlConfig) -> list[tuple[str, float]]:
    """The processes' own host memory on the busiest node, by part (`HOST_DRIVER_BYTES` and
    the figures beside it). Empty on CPU ranks, whose state is in host memory anyway."""
    if cfg.hardware.device != "cuda":
        return []
    ranks, engines = trainer_ranks_per_node(cfg), engine_gpus_per_node(cfg)
    return [("driver and Ray", HOST_DRIVER_BYTES),
            (f"engine servers ({engines} GPU(s))", engines * HOST_ENGINE_PER_GPU_BYTES),
            (f"trainer ranks ({ranks})", ranks * HOST_TRAINER_RANK_BYTES)]


def host_bytes_per_node(cfg: VlmrlConfig, mem: MemoryEstimate | None = None) -> dict[str, float]:
    """The host memory one node uses at the peak of each phase of the run (GPU ranks only;
    bytes, every process of the node together): `offload`, the pinned copies that hold the
    trainer's offloaded state between steps; `save`, a checkpoint's save beside those copies
    (a resume's load is planned alike; it measured far less, bench/results/real-width.md), where
    the node has room for both; `save_copies_freed`, the same where it lacks that room and the
    save or load frees the copies first (`vlmrl.training.checkpoint.save_checkpoint`; the next
    offload pins them again): what the run needs at least. Each includes `processes`, the
    processes' own memory (`process_host_bytes_per_node`). Empty on CPU ranks."""
    if cfg.hardware.device != "cuda":
        return {}
    mem = mem or estimate_memory(cfg)
    ranks = trainer_ranks_per_node(cfg)
    procs = sum(b for _, b in process_host_bytes_per_node(cfg))
    copy, save = offload_host_bytes(cfg, mem), checkpoint_host_bytes(cfg, mem)
    return {"offload": procs + ranks * copy, "save": procs + ranks * (copy + save),
            "save_copies_freed": procs + ranks * max(copy, save), "processes": procs}


def checkpoint_device_bytes(cfg: VlmrlConfig, mem: MemoryEstimate | None = None) -> float:
    """Device memory a checkpoint's save takes beyond the trainer's state, on one GPU rank.
    `fully_reshardable` under the distributed optimizer gathers each gradient buffer's fp32
    state over its data-parallel group through NCCL one key at a time: the rank's shard sent
    from the device and the whole buffer received there (4 B a parameter each), for the larger
    of the dense and the expert buffer. `dp_reshardable` and a plain optimizer copy what they
    write to the host tensor by tensor: nothing of note."""
    if (cfg.hardware.device != "cuda" or not cfg.trainer.use_distributed_optimizer
            or cfg.trainer.checkpoint_format != "fully_reshardable"):
        return 0.0
    mem = mem or estimate_memory(cfg)
    layout = compute_layout(cfg)
    return F32 * max(mem.dense_weights * (1 + 1 / layout.dp), mem.expert_weights * (1 + 1 / layout.expert_dp))


def phase_estimates(cfg: VlmrlConfig) -> dict[str, float]:
    """Each phase's estimated peak bytes on one GPU (the totals of `phase_memory`), keyed by
    phase: what `compare_phase_memory` takes as `estimate`. Separate GPUs key the engines'
    rollout and the trainer's phases the same way: each is on its own GPUs."""
    return {p.phase: p.total for p in phase_memory(cfg)}


def measured_phase_peak(stats: Mapping[str, float]) -> float:
    """One GPU's peak during a phase, from the trainer rank's `memory_stats()` read at the
    phase's end, before anything moves for the next phase (the read resets the peak it
    reports, so the next read covers the next phase):
    the device memory in use then, as `torch.cuda.mem_get_info` sees it (every process on the
    GPU: the trainer and the colocated engine), with the trainer's own transient peak put
    back (its peak reserved bytes in place of its reserved bytes now)."""
    return float(stats["device_used"]) - float(stats["reserved"]) + float(stats["peak_reserved"])


def measured_phase_split(stats: Mapping[str, float]) -> dict[str, float]:
    """`measured_phase_peak` split by who holds it: `trainer`, this rank's physical peak in the
    phase (its peak reserved bytes less the offloaded regions, which stay reserved but have no
    memory behind them), and `others`, every other process on the GPU at the phase's end (a
    colocated engine, CUDA contexts); `total` is their sum, `measured_phase_peak(stats)`."""
    offloaded = float(stats.get("offloaded", 0.0))
    trainer = float(stats["peak_reserved"]) - offloaded
    others = float(stats["device_used"]) - float(stats["reserved"]) + offloaded
    return {"total": trainer + others, "trainer": trainer, "others": others}


def is_engine_part(name: str) -> bool:
    """Whether a `PhaseMemory` part is held by an engine's process (the rest is the trainer's)."""
    return name.startswith(("engine", "released engine"))


def phase_estimate_split(cfg: VlmrlConfig) -> dict[str, dict[str, float]]:
    """Each phase's estimate split as `measured_phase_split` splits a measurement: `trainer`
    (the trainer's parts) and `others` (the engines' parts)."""
    out = {}
    for p in phase_memory(cfg):
        engine = sum(b for name, b in p.parts if is_engine_part(name))
        out[p.phase] = {"total": p.total, "trainer": p.total - engine, "others": engine}
    return out


def compare_phase_memory(estimate: dict[str, float], measured: dict[str, float],
                         tolerance: float = 0.10) -> list[str]:
    """The problems of a run's measured phase peaks against the plan's estimate (empty when
    every measured phase is within `tolerance` of its estimate, relative to the estimate).

    `estimate`: bytes per phase, `phase_estimates(cfg)`. `measured`: bytes per phase, the
    largest over the trainer's GPUs of `measured_phase_peak(memory_stats())` read at the end
    of that phase, i.e. the device memory used on that GPU by every process on it (the
    trainer and a colocated engine, from `torch.cuda.mem_get_info`), with the trainer's peak
    within the phase in place of what it held at the end. Phases measured but not estimated
    are problems; phases estimated but not measured are not."""
    problems = []
    for phase, got in measured.items():
        want = estimate.get(phase)
        if want is None:
            problems.append(f"{phase}: measured {_gib_text(got)} but the plan has no estimate for this phase "
                            f"(phases: {sorted(estimate)})")
            continue
        if want <= 0:
            problems.append(f"{phase}: the estimate is {want} bytes; nothing to compare against")
            continue
        rel = (got - want) / want
        if abs(rel) > tolerance:
            side = "more" if rel > 0 else "less"
            problems.append(f"{phase}: measured {_gib_text(got)}, {abs(rel):.0%} {side} than the estimated "
                            f"{_gib_text(want)} (tolerance {tolerance:.0%})")
    return problems


def phase_memory_metrics(plan: Mapping[str, Mapping[str, float]],
                         measured: Mapping[str, Mapping[str, float]]) -> tuple[dict[str, float], list[str]]:
    """A step's `memory/` metrics (GiB) and the plan's problems with it. `plan`: bytes per
    phase and holder (`phase_estimate_split`); `measured`: the same for the phases measured
    (`measured_phase_split` of the most loaded GPU). Per phase: the whole GPU, the trainer's
    part and the rest (`memory/<phase>_gib`, `_trainer_gib`, `_others_gib`), the plan's three
    beside them (`memory/<phase>_plan_gib`, ...), and `memory/plan_problems`, the number of
    phases off by more than 10% (`compare_phase_memory`)."""
    out: dict[str, float] = {}
    for k, m in measured.items():
        out.update({f"memory/{k}_gib": m["total"] / GIB, f"memory/{k}_trainer_gib": m["trainer"] / GIB,
                    f"memory/{k}_others_gib": m["others"] / GIB})
        if k in plan:
            out.update({f"memory/{k}_plan_gib": plan[k]["total"] / GIB,
                        f"memory/{k}_plan_trainer_gib": plan[k]["trainer"] / GIB,
                        f"memory/{k}_plan_others_gib": plan[k]["others"] / GIB})
    problems = compare_phase_memory({k: v["total"] for k, v in plan.items()},
                                    {k: m["total"] for k, m in measured.items()})
    out["memory/plan_problems"] = float(len(problems))
    return out, problems

"""The typed configuration schema.

Every key a user can override is declared here. `register_configs()` puts the schema into
Hydra's ConfigStore (as the base of the root config and of every option in every group),
so struct mode rejects a misspelt key with the list of valid ones. `train.py` turns the
composed DictConfig into these dataclasses once (`to_dataclass`); components receive
their own section as a frozen dataclass and never see the root config.

This module imports only the standard library: it is on the dry-run path.
"""

from __future__ import annotations

from dataclasses import FrozenInstanceError, dataclass, field, fields, is_dataclass
from typing import Any

MISSING = "???"


class Sealable:
    """Base of every config dataclass: mutable while Hydra composes, frozen once sealed.

    OmegaConf marks frozen dataclasses read-only, which Hydra cannot merge overrides into,
    so the schema classes stay plain dataclasses and `seal` freezes the converted objects.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_sealed_", False):
            raise FrozenInstanceError(f"cannot assign to field '{name}': configs are frozen after conversion")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self.__dict__.get("_sealed_", False):
            raise FrozenInstanceError(f"cannot delete field '{name}': configs are frozen after conversion")
        object.__delattr__(self, name)


def seal(obj: Any) -> Any:
    """Freeze a config dataclass and every dataclass inside it, in place; returns obj."""
    if is_dataclass(obj) and isinstance(obj, Sealable):
        for f in fields(obj):
            value = getattr(obj, f.name)
            if isinstance(value, list):
                object.__setattr__(obj, f.name, tuple(value))
            seal(value)
        obj.__dict__["_sealed_"] = True
    return obj


# --------------------------------------------------------------------------- model
@dataclass
class VisionConfig(Sealable):
    """The HF vision tower. It keeps its HuggingFace parameter names end to end."""

    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_heads: int = 16
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    out_hidden_size: int = 2048
    window_size: int = 112
    fullatt_block_indexes: list[int] = field(default_factory=lambda: [7, 15, 23, 31])
    num_position_embeddings: int | None = None  # Qwen3.5: learned position embeddings
    deepstack_visual_indexes: list[int] = field(default_factory=list)


@dataclass
class LanguageModelConfig(Sealable):
    """Architecture of the language model (converted to a Megatron model by the bridge)."""

    num_layers: int = 36
    hidden_size: int = 2048
    ffn_hidden_size: int = 11008
    num_attention_heads: int = 16
    num_query_groups: int = 2
    head_dim: int = 128
    vocab_size: int = 151936
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    partial_rotary_factor: float = 1.0
    mrope_section: list[int] = field(default_factory=lambda: [16, 24, 24])
    mrope_interleaved: bool = False
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    add_qkv_bias: bool = True
    qk_layernorm: bool = False
    attention_output_gate: bool = False
    # Hybrid models: one entry per layer, "full_attention" or "linear_attention" (Gated
    # DeltaNet). Empty means every layer is full attention.
    layer_types: list[str] = field(default_factory=list)
    # Gated DeltaNet ("linear_attention") layers
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    # Mixture of experts (num_experts == 0: dense MLP)
    num_experts: int = 0
    moe_router_topk: int = 0
    moe_ffn_hidden_size: int = 0
    shared_expert_ffn_hidden_size: int = 0
    shared_expert_gate: bool = False


@dataclass
class ModelConfig(Sealable):
    name: str = MISSING
    # "qwen2_5_vl" (dense LM, windowed ViT), "qwen3_5" (hybrid Gated DeltaNet + gated attention,
    # dense MLP) or "qwen3_5_moe" (the same with MoE MLPs); see vlmrl.models.families
    family: str = "qwen2_5_vl"
    # A HuggingFace hub id or a local directory loaded with from_pretrained. For the tiny
    # model, an empty path means "build it in code under cache_dir on first use".
    path: str = ""
    cache_dir: str = "${oc.env:VLMRL_CACHE,${oc.env:HOME}/.cache/vlmrl}"
    dtype: str = "float32"  # float32 | bfloat16: parameter dtype of trainer and engines
    lm: LanguageModelConfig = field(default_factory=LanguageModelConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    # Special token ids (from the checkpoint's config; used by validation and the bridge).
    image_token_id: int = 151655
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653


# --------------------------------------------------------------------------- parallel
@dataclass
class ParallelConfig(Sealable):
    name: str = MISSING
    tp: int = 1  # tensor parallel
    pp: int = 1  # pipeline parallel
    vpp: int | None = None  # virtual pipeline stages per rank (interleaved schedule)
    cp: int = 1  # context parallel (zigzag over packed sequences)
    ep: int = 1  # expert parallel
    etp: int = 1  # expert tensor parallel
    sequence_parallel: bool = False
    micro_batch_size: int = 1
    # Dynamic batching packs samples into micro-batches of at most max_tokens_per_gpu tokens.
    use_dynamic_batch_size: bool = False
    max_tokens_per_gpu: int = 8192
    recompute_granularity: str | None = None  # null | selective | full
    recompute_method: str = "uniform"  # uniform | block (full recompute only)
    recompute_num_layers: int = 1


# --------------------------------------------------------------------------- reward
@dataclass
class RewardConfig(Sealable):
    """A verifier: `_target_` is instantiated with the remaining keys (name excepted)."""

    name: str = MISSING
    _target_: str = MISSING
    tolerance: float = 0.0
    relative: bool = False
    # reward of a well-formed boxed answer that is wrong, in [0, 1); no answer, or one
    # offering more values than the label, still scores 0; a match scores 1
    format_score: float = 0.0
    # a regular expression the whole reply must match to earn any training reward (null: none);
    # evaluations score the answer alone
    format_pattern: str | None = None
    timeout_s: float = 1.0
    num_workers: int = 2  # worker processes scoring off the critical path; 0 = inline
    # the verifier of evaluations (`_target_` of a Verifier with its defaults); null: the
    # training reward's (a control reward that ignores correctness names one that does not)
    eval_target: str | None = None


# --------------------------------------------------------------------------- hardware
@dataclass
class HardwareConfig(Sealable):
    name: str = MISSING
    device: str = "cpu"  # cpu | cuda
    gpu_memory_gb: float = 0.0
    peak_bf16_tflops: float = 0.0  # dense, for MFU and the plan
    dist_backend: str = "gloo"  # gloo | nccl
    # FlashAttention 3 exists for Hopper only (not Blackwell, not CPU).
    fa3_supported: bool = False
    # SGLang's --mm-attention-backend for the vision tower inside the engine.
    sglang_mm_attention_backend: str | None = None
    # attn_implementation of the HF vision tower in the trainer.
    vision_attn_implementation: str = "sdpa"
    # attention of the Megatron language model: "sdpa" (torch SDPA: cuDNN's kernels per sample,
    # or torch's varlen flash kernel for many samples), "flash4" (FlashAttention 4's varlen
    # kernels, package flash-attn-4, Hopper / Blackwell: inside each attention layer's compiled
    # graph, no repeated K / V; the h100 / h200 default) or "local" (explicit softmax)
    lm_attention_backend: str = "sdpa"
    # Inductor-compiled (torch.compile) RMSNorm, M-RoPE and log-softmax plus megatron-core's
    # compiled SwiGLU in the trainer (vlmrl.models.kernels); needs a compiler toolchain
    # (Triton on GPUs), so off on CPU.
    fused_kernels: bool = False
    train_dtype: str = "float32"  # float32 | bfloat16 (mixed precision on GPUs)
    # Gated DeltaNet layers: "torch" (chunked, float32 inside; runs everywhere) or "fla"
    # (flash-linear-attention / FlashQLA kernels; checked against torch before training)
    gdn_backend: str = "torch"
    # Replay the language model's compiled layer graphs (and the MoE block) as CUDA graphs,
    # forward and backward (torch's CUDA graph trees), with each micro-batch padded to one of
    # a few token-count buckets (`vlmrl.models.packing.graph_bucket`) so that a run records a
    # bounded number of graphs. Needs fused_kernels on a GPU; the trainer keeps it off where
    # it cannot hold or does nothing (pipeline / tensor parallel, activation recompute) and says so.
    cuda_graphs: bool = False
    # Add each micro-batch's bf16 gradients into Megatron's float32 main gradients with one
    # vectorised Triton kernel per parameter instead of torch's casting add (the same sums,
    # bit for bit; `vlmrl.training.grad_accumulation`). CUDA only: elsewhere torch's add runs.
    # Off until measured on a GPU.
    fused_grad_accumulation: bool = False
    # where every process of a run keeps the kernels its compilers build (Inductor, Triton,
    # TileLang's FlashQLA kernels, FlashAttention 4's CuTe DSL kernels, whose disk cache is off
    # unless asked for): a later run, on this node or any node sharing the path, loads them
    # instead of compiling again. "" leaves each library its own default. Variables already
    # set in the environment win (`vlmrl.models.kernels.compile_cache_env`).
    compile_cache_dir: str = "${model.cache_dir}/compile"


# --------------------------------------------------------------------------- data
@dataclass
class SyntheticDataConfig(Sealable):
    num_train: int = 2048
    num_test: int = 256
    seed: int = 1234
    # pixels per side; null: 4 merged image tokens of the model's vision tower per side
    # (112 for 14 px patches merged 2x2, 128 for 16 px ones), one dot per token cell
    image_size: int | None = None
    # where built splits are kept (keyed by these settings, the split, the image size and the
    # generator's code), so a later run loads them instead of drawing them again; "" builds
    # every time
    cache_dir: str = ""


@dataclass
class DataConfig(Sealable):
    name: str = MISSING
    # "synthetic": the procedural task built in code; "hf": a hub name, a local parquet /
    # arrow / jsonl path, or a dataset already in the HF cache.
    source: str = "hf"
    path: str = ""
    train_split: str = "train"
    test_split: str = "test"
    prompt_key: str = "problem"
    answer_key: str = "answer"
    image_key: str = "images"
    # Appended to the user message, e.g. to ask for the final answer in \boxed{}.
    instruction: str = ""
    # Image pixel bounds: identical in rollout and training (same image token counts).
    min_pixels: int = 3136
    max_pixels: int = 1_003_520
    max_prompt_length: int = 2048
    max_image_megapixels: float = 50.0  # larger images are skipped as bad rows
    image_cache_dir: str = "${model.cache_dir}/images"
    image_fetch_timeout_s: float = 10.0
    # transient fetch failures (timeouts, 429/5xx) are retried with backoff; a row whose
    # images still fail is skipped for that draw only, and for good after 3 such draws
    image_fetch_retries: int = 3
    shuffle: bool = True
    seed: int = 42
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)


# --------------------------------------------------------------------------- algo
@dataclass
class AlgoConfig(Sealable):
    name: str = MISSING  # grpo | sft
    advantage_estimator: str = "grpo"  # grpo | dr_grpo
    n_samples_per_prompt: int = 8
    reward_dtype: str = "float64"
    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    policy_loss: str = "ppo"  # ppo | gspo
    # token_mean (GRPO/DAPO) | seq_mean_token_sum | seq_mean_token_mean | token_sum_norm (Dr.GRPO)
    loss_agg_mode: str = "token_mean"
    kl_coef: float = 0.0
    kl_type: str = "low_var_kl"  # k1 | k2 | k3 | low_var_kl
    # the policy the KL term holds RL to: warmup (the policy at the end of the SFT warm-up, the
    # start checkpoint without one) | initial (the start checkpoint, also after a warm-up)
    kl_reference: str = "warmup"
    entropy_coef: float = 0.0
    # Truncated importance sampling against the rollout engine's logprobs.
    tis: bool = False
    tis_cap: float = 2.0
    # Masked importance sampling: tokens (token) or whole sequences (sequence, by the geometric
    # mean) whose trainer/engine ratio exp(old - rollout) leaves [mis_low, mis_high] are masked
    # out of the loss; none: off. Composes with TIS.
    mis: str = "none"
    mis_low: float = 0.5
    mis_high: float = 2.0
    # Routing replay (MoE): none | rollout. rollout: the trainer routes every token to the
    # experts the rollout engine chose for it, in the old-logprob and training passes; the
    # router's weights over those experts still come from the trainer's logits.
    routing_replay: str = "none"
    # Which prompt groups a step trains on (vlmrl.algo.advantages.keeps_group): none | equal_reward
    # (drop the groups whose rewards are all equal: no advantage, no gradient; DAPO's dynamic
    # sampling). With rollout.oversample / rollout.max_rounds the step draws more prompts to
    # make up for the dropped groups.
    filter_groups: str = "none"
    # SFT warm-up steps run before RL (algo=grpo) or the SFT step count (algo=sft).
    sft_steps: int = 0
    sft_batch_size: int = 32

    @property
    def uses_reference(self) -> bool:
        """Whether the trainer keeps a reference model: an RL run with a KL term (algo=sft
        has no KL term, whatever kl_coef the config carries)."""
        return self.kl_coef > 0 and self.name != "sft"


# --------------------------------------------------------------------------- trainer
@dataclass
class OptimConfig(Sealable):
    optimizer: str = "adam"
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_decay_style: str = "constant"  # constant | linear | cosine
    lr_warmup_steps: int = 0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-8
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    # The RL phase's peak learning rate after an SFT warm-up (`algo.sft_steps`): the warm-up then
    # decays `lr` over its own steps, and RL starts a schedule of its own at `rl_lr` (same decay
    # style, over `num_steps`). null: one schedule from `lr` spans warm-up and RL.
    rl_lr: float | None = None


@dataclass
class TrainerConfig(Sealable):
    global_batch_size: int = 16  # samples per optimizer step
    optim: OptimConfig = field(default_factory=OptimConfig)
    use_distributed_optimizer: bool = True
    # How checkpoints hold the distributed optimizer's state (GPU ranks; CPU ranks run a plain
    # optimizer, saved per parameter and loadable under any layout):
    # dp_reshardable: each rank writes its own shard as it holds it, no gather; the save stages
    #   the rank's state once in host memory (its weights and 12 B a parameter of its optimizer
    #   shard). Loads under another data-parallel size, not another TP / PP / EP layout.
    # fully_reshardable: one tensor per parameter and moment, gathered over data parallelism in
    #   float32 host buffers (32 B a parameter of the rank's slice at the peak). Loads under any
    #   layout: save with it to change the model-parallel layout between runs.
    checkpoint_format: str = "dp_reshardable"
    # Colocated on GPUs: the trainer's weights, gradients and optimizer state leave the GPU
    # (torch_memory_saver keeps their addresses, so compiled CUDA graphs stay valid) while the
    # engines generate, and come back for training and the weight sync; null: on exactly when
    # the trainer shares its GPUs with the engines (cluster.colocate on hardware with GPUs)
    offload: bool | None = None
    # With offload: GiB of the trainer's state (its weights first, then optimizer state) that
    # stay on each GPU while the engines generate and so never cross PCIe; null: what fits in
    # `resident_budget` of the GPU beside the engines' rollout peak (`python -m vlmrl.plan`
    # prints the split); 0: everything leaves (gradients always do: they are dropped, not copied)
    resident_gib: float | None = None
    resident_budget: float = 0.9
    # With offload: the optimizer state that moves comes back on a side stream while the
    # forward and backward run (the optimizer step waits for it) and goes out while the weight
    # sync runs; false: both copies are made inside the onload and the offload, in the open
    offload_overlap: bool = True
    # The replies to one prompt in a micro-batch run the prompt once: each reply attends to
    # the prompt's tokens and starts from its Gated DeltaNet state, instead of each repeating
    # it (`vlmrl.training.batch`); the same losses and gradients, fewer tokens. Not with
    # context parallelism; Gated DeltaNet on the torch path only. null: on for CPU ranks
    # (`vlmrl.config.layout.shares_prompts`); on GPUs opt-in (there each reply's attention is
    # a masked SDPA call, not yet measured against the varlen / FlashAttention 4 kernels)
    share_prompts: bool | None = None
    # MoE auxiliary load-balancing loss (Megatron's aux_loss); 0 = off (the default)
    moe_aux_loss_coeff: float = 0.0
    # MoE router logits: fp32 (Megatron's float32 router) | engine (in the model's dtype, as
    # transformers and SGLang compute them: in bf16 the two pick other experts at near-ties)
    moe_router_precision: str = "fp32"
    # Passed verbatim to Megatron's TransformerConfig (not re-declared one by one).
    megatron: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- rollout
@dataclass
class SpeculativeConfig(Sealable):
    algorithm: str | None = None  # e.g. EAGLE, EAGLE3, NEXTN; null = off
    draft_model_path: str | None = None
    num_steps: int = 3
    eagle_topk: int = 1
    num_draft_tokens: int = 4


@dataclass
class SGLangConfig(Sealable):
    ep_size: int = 1
    mem_fraction_static: float = 0.7
    cuda_graph_max_bs: int | None = None
    cuda_graph_bs: list[int] = field(default_factory=list)
    use_router: bool = False
    router_port: int = 30000
    base_port: int = 15000
    log_level: str = "warning"
    startup_timeout_s: float = 900.0
    # the SGLang release the engines run; null: read from the installed package of
    # `python` at launch. vlmrl speaks each release's protocol from the contract generated
    # from its source (vlmrl/contracts) and refuses a release it has none for.
    version: str | None = None
    # the interpreter that runs `-m sglang.launch_server` (SGLang pins its own torch and
    # transformers, so it may live in an environment of its own); null: the trainer's
    python: str | None = None
    # extra environment of the server processes (e.g. PYTHONPATH of that environment)
    env: dict[str, str] = field(default_factory=dict)
    # before releasing an engine's memory: wait at most this long for its requests to end
    # (SGLang refuses a release while any request runs)
    drain_timeout_s: float = 300.0
    # SGLang samples with each request's sampling_seed only under its deterministic
    # inference mode (slower kernels); without it the same seed does not give the same
    # samples, so rollouts are not reproducible and a resumed run draws new ones
    deterministic_inference: bool = False
    # how the colocated weight sync loads into the servers: "vlmrl" starts them with vlmrl's
    # loader (vlmrl/rollout/sglang_plugin: a layer's routed experts in one copy where the
    # engine's layout allows); "sglang": SGLang's own loaders, flattened buckets
    weight_loader: str = "vlmrl"
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # Passed verbatim to SGLang's ServerArgs (flag names as in ServerArgs fields).
    server_args: dict[str, Any] = field(default_factory=dict)


@dataclass
class EmbeddedEngineConfig(Sealable):
    max_batch_size: int = 64
    # true: the loop drives the engine over SGLang's HTTP protocol, through the client, the
    # weight sync (per-rank payloads, or a broadcast group over gloo) and the memory calls
    # that SGLang servers get; false: direct Ray calls
    serve_http: bool = False
    host: str = "127.0.0.1"  # where the HTTP server listens ("auto": the actor's node address)
    port: int = 0  # 0: a free port
    # the SGLang release whose protocol the HTTP server speaks (its contract in
    # vlmrl/contracts); null: the newest one vlmrl has a contract for
    sglang_version: str | None = None
    # where the engine computes: auto (the GPU of its placement bundle when the run has GPUs,
    # in model.dtype; else the CPU) | cuda | cpu (on a GPU machine: the host's CPU beside GPU
    # trainers, an explicit choice)
    device: str = "auto"


@dataclass
class EvalConfig(Sealable):
    n_samples_per_prompt: int = 1
    temperature: float = 0.0
    max_new_tokens: int | None = None  # null: rollout.max_new_tokens
    max_prompts: int | None = None  # null: the whole test split


@dataclass
class RolloutConfig(Sealable):
    name: str = MISSING  # embedded | sglang
    batch_size: int = 8  # prompts per rollout step (each sampled n_samples_per_prompt times)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 1024
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    num_gpus: int = 0  # GPUs of all rollout engines together
    gpus_per_engine: int = 1  # tensor parallel size of one engine
    max_in_flight: int = 256  # requests in flight across engines
    request_timeout_s: float = 600.0
    max_retries: int = 3
    weight_update_bucket_mb: int = 512
    # the engines report the experts each token was routed to (MoE; SGLang's
    # return_routed_experts), and the trainer measures per layer how often its own router
    # picks others (moe/route_mismatch); null: exactly when algo.routing_replay needs them
    return_routed_experts: bool | None = None
    # Dynamic sampling (with algo.filter_groups): a step wants batch_size groups that the filter
    # keeps. Each round draws ceil(missing x oversample) prompts, and stops their generation as
    # soon as the first `missing` kept groups in draw order are complete (the rest are aborted
    # on the engines); up to max_rounds rounds and max_prompts prompts a step (null:
    # batch_size x oversample x max_rounds). A step that hits a bound trains on what it has.
    oversample: float = 1.0
    max_rounds: int = 1
    max_prompts: int | None = None
    eval: EvalConfig = field(default_factory=EvalConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    embedded: EmbeddedEngineConfig = field(default_factory=EmbeddedEngineConfig)


# --------------------------------------------------------------------------- cluster
@dataclass
class ClusterConfig(Sealable):
    name: str = MISSING  # local | external
    address: str | None = None  # Ray address of an external cluster
    num_nodes: int = 1
    num_gpus: int = 0  # GPUs in the job (trainer + rollout); 0 on CPU
    # On CPU: number of trainer processes (gloo ranks).
    num_cpu_ranks: int = 1
    colocate: bool = False  # trainer and rollout engines share GPUs
    # colocated: the engines give their memory back while the trainer runs and take it back at
    # the weight sync (true); false keeps the engines' pool and the trainer's whole state on the
    # GPUs through the step, so that nothing moves but the weights (every phase must fit beside
    # the pool: `python -m vlmrl.plan` says whether it does and the largest
    # rollout.sglang.mem_fraction_static that would)
    release_engines: bool = True
    trainer_gpus: int | None = None  # separate mode: GPUs for the trainer (rest: rollout)
    async_rollout: bool = False  # overlap the next rollout with training (one step off-policy)
    dashboard: bool = False
    cpus_per_actor: float = 0.5
    # torch threads of each CPU actor; null: the machine's cores shared by the actors that
    # compute at the same moment (vlmrl.cluster.placement.cpu_threads)
    cpu_threads: int | None = None


# --------------------------------------------------------------------------- logger
@dataclass
class LoggerConfig(Sealable):
    name: str = MISSING
    wandb: bool = True  # offline unless WANDB_API_KEY is set
    wandb_mode: str | None = None  # null: online with an API key, else offline
    project: str = "vlmrl"
    group: str | None = None  # null: the run name (sweeps give each job its own)
    progress: bool = True
    plots: bool = True
    jsonl: bool = True
    # samples.jsonl in the run dir (and wandb tables): every sample of the first `sample_groups`
    # prompt groups of each RL step, and the first `eval_samples` replies of each evaluation (0: none)
    sample_groups: int = 1
    eval_samples: int = 8


# --------------------------------------------------------------------------- root
@dataclass
class VlmrlConfig(Sealable):
    model: ModelConfig = MISSING  # type: ignore[assignment]
    parallel: ParallelConfig = MISSING  # type: ignore[assignment]
    reward: RewardConfig = MISSING  # type: ignore[assignment]
    hardware: HardwareConfig = MISSING  # type: ignore[assignment]
    data: DataConfig = MISSING  # type: ignore[assignment]
    algo: AlgoConfig = MISSING  # type: ignore[assignment]
    rollout: RolloutConfig = MISSING  # type: ignore[assignment]
    cluster: ClusterConfig = MISSING  # type: ignore[assignment]
    logger: LoggerConfig = MISSING  # type: ignore[assignment]
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    run_name: str = "default"
    run_dir: str = "runs/${run_name}"
    seed: int = 1234
    num_steps: int = 100  # rollout steps (GRPO) or optimizer steps (SFT)
    eval_interval: int = 20  # 0: no periodic eval
    save_interval: int = 0  # 0: save only at the end
    # a checkpoint at the end of the run (false: only every save_interval steps, e.g. for benchmark
    # runs whose checkpoints would not fit the disk)
    save_final: bool = True
    resume: str = "auto"  # auto | never | a checkpoint directory
    save_hf: bool = False  # export an HF checkpoint at the end
    max_train_seconds: float | None = None  # stop RL after this much training wall time
    # RL steps (1-based) traced from the step's start to the end of its weight sync, into
    # run_dir/profile/rl_step_<n>/: every trainer rank with torch.profiler (rank<r>.json.gz, a
    # Chrome trace; rank<r>.txt, the costliest operators) and the driver's loop with cProfile
    # (driver.prof, driver.txt); empty: none
    profile_steps: list[int] = field(default_factory=list)
    # Validate, print the resolved config and the job's run dir, and stop (works with -m).
    dry_run: bool = False


GROUPS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "reward": RewardConfig,
    "hardware": HardwareConfig,
    "data": DataConfig,
    "algo": AlgoConfig,
    "rollout": RolloutConfig,
    "cluster": ClusterConfig,
    "logger": LoggerConfig,
}

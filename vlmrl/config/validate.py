"""Cross-field validation, run before any process or GPU is touched.

Each rule has a short name; a violation names the rule and the values involved. All
violations of a config are reported together.

vlmrl does not rewrite the user's choice: a config that cannot work fails with the override
that fixes it (e.g. MoE layers under tensor parallelism need sequence parallelism, as in
Megatron: each TP rank routes its own slice of the tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..contracts.sglang_flags import load_flags
from ..contracts.sglang_layers import (
    closest_interval,
    full_attention_interval,
    layer_types_override,
    sglang_layer_types,
)
from ..contracts.sglang_server import SERVER_ENV, SGLANG_KEY_ARGS, VLM_CACHE_ENV
from .layout import compute_layout, is_gdn_model, is_moe_model
from .schema import VlmrlConfig


def sglang_choices(field: str) -> tuple[str, ...]:
    """The values SGLang accepts for a ServerArgs field, from the committed flag list
    (`vlmrl/contracts/sglang-<version>.flags.txt`, generated from SGLang's source); empty: free."""
    return load_flags().fields[field].choices

VISION_ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")

ENUMS: dict[str, tuple[object, ...]] = {
    "model.family": ("qwen2_5_vl", "qwen3_5", "qwen3_5_moe"),
    "model.dtype": ("float32", "bfloat16"),
    "hardware.device": ("cpu", "cuda"),
    "hardware.dist_backend": ("gloo", "nccl"),
    "hardware.train_dtype": ("float32", "bfloat16"),
    "hardware.lm_attention_backend": ("sdpa", "flash4", "local"),
    "hardware.gdn_backend": ("torch", "fla"),
    "hardware.vision_attn_implementation": VISION_ATTN_IMPLEMENTATIONS,
    "data.source": ("synthetic", "hf"),
    "algo.name": ("grpo", "sft"),
    "algo.advantage_estimator": ("grpo", "dr_grpo"),
    "algo.reward_dtype": ("float64", "float32"),
    "algo.policy_loss": ("ppo", "gspo"),
    "algo.loss_agg_mode": ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "token_sum_norm"),
    "algo.kl_type": ("k1", "k2", "k3", "low_var_kl"),
    "algo.kl_reference": ("warmup", "initial"),
    "algo.mis": ("none", "token", "sequence"),
    "algo.routing_replay": ("none", "rollout"),
    "algo.filter_groups": ("none", "equal_reward"),
    "trainer.moe_router_precision": ("fp32", "engine"),
    "trainer.checkpoint_format": ("dp_reshardable", "fully_reshardable"),
    "trainer.optim.optimizer": ("adam",),
    "trainer.optim.lr_decay_style": ("constant", "linear", "cosine"),
    "parallel.recompute_granularity": (None, "selective", "full"),
    "parallel.recompute_method": ("uniform", "block"),
    "rollout.name": ("embedded", "sglang"),
    "rollout.sglang.weight_loader": ("vlmrl", "sglang"),
    "rollout.embedded.device": ("auto", "cuda", "cpu"),
    "cluster.name": ("local", "external"),
}


def _routing_rules(cfg: VlmrlConfig, fail: Any) -> None:
    """Routing replay and the engines' routed experts (`vlmrl.models.routing`)."""
    from .layout import returns_routed_experts

    a, p = cfg.algo, cfg.parallel
    if a.routing_replay != "none" and cfg.rollout.return_routed_experts is False:
        fail("routing-replay", f"algo.routing_replay={a.routing_replay} replays the experts the engines report: "
             "it needs rollout.return_routed_experts=true (or null)")
    if returns_routed_experts(cfg) and not is_moe_model(cfg):
        fail("routing-replay", f"model={cfg.model.name} has no experts: algo.routing_replay=none and "
             "rollout.return_routed_experts=false (or null)")
    if (a.routing_replay != "none" and p.pp > 1 and p.recompute_granularity == "full"):
        fail("routing-replay", "routing replay with pipeline parallelism (parallel.pp>1) and full activation "
             "recompute: a recomputed layer would route by a later micro-batch's experts (use "
             "parallel.recompute_granularity=null or selective, or parallel.pp=1)")


@dataclass(frozen=True)
class Violation:
    rule: str
    message: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.message}"


class ConfigError(ValueError):
    def __init__(self, violations: list[Violation]):
        self.violations = violations
        lines = "\n".join(f"  - {v}" for v in violations)
        super().__init__(f"invalid configuration ({len(violations)} problem(s)):\n{lines}")

    @property
    def rules(self) -> list[str]:
        return [v.rule for v in self.violations]


def _get(cfg: object, dotted: str) -> object:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def check(cfg: VlmrlConfig) -> list[Violation]:
    """Every violated rule of `cfg` (empty when valid)."""
    out: list[Violation] = []

    def fail(rule: str, message: str) -> None:
        out.append(Violation(rule, message))

    for key, allowed in ENUMS.items():
        value = _get(cfg, key)
        if value not in allowed:
            fail("enum", f"{key}={value!r} is not one of {list(allowed)}")

    m, lm, p, hw, c, r, a = (cfg.model, cfg.model.lm, cfg.parallel, cfg.hardware, cfg.cluster,
                             cfg.rollout, cfg.algo)
    for key in ("tp", "pp", "cp", "ep", "etp", "micro_batch_size", "max_tokens_per_gpu"):
        if getattr(p, key) < 1:
            fail("positive", f"parallel.{key}={getattr(p, key)} must be >= 1")
    if any(not isinstance(s, int) or s < 1 for s in cfg.profile_steps):
        fail("positive", f"profile_steps={list(cfg.profile_steps)} must list RL steps >= 1")
    if out:
        return out  # sizes below divide by these

    # --- model architecture
    rotary_dims = int(lm.head_dim * lm.partial_rotary_factor)
    if sum(lm.mrope_section) * 2 != rotary_dims:
        fail("mrope-section", f"sum(model.lm.mrope_section)={sum(lm.mrope_section)} must equal "
             f"head_dim * partial_rotary_factor / 2 = {lm.head_dim} * {lm.partial_rotary_factor} / 2")
    if lm.layer_types:
        if len(lm.layer_types) != lm.num_layers:
            fail("layer-types", f"len(model.lm.layer_types)={len(lm.layer_types)} != "
                 f"model.lm.num_layers={lm.num_layers}")
        bad = sorted(set(lm.layer_types) - {"full_attention", "linear_attention"})
        if bad:
            fail("layer-types", f"model.lm.layer_types has unknown types {bad}")
    if is_gdn_model(cfg) and min(lm.linear_num_key_heads, lm.linear_num_value_heads,
                                 lm.linear_key_head_dim, lm.linear_value_head_dim,
                                 lm.linear_conv_kernel_dim) <= 0:
        fail("gdn-shape", "linear_attention layers need model.lm.linear_num_key_heads, "
             "linear_num_value_heads, linear_key_head_dim, linear_value_head_dim and "
             "linear_conv_kernel_dim > 0")
    if is_moe_model(cfg) and not 0 < lm.moe_router_topk <= lm.num_experts:
        fail("moe-topk", f"model.lm.moe_router_topk={lm.moe_router_topk} must be in "
             f"[1, num_experts={lm.num_experts}]")
    if is_moe_model(cfg) and m.family != "qwen3_5_moe":
        fail("model-family", f"model.lm.num_experts={lm.num_experts} needs model.family=qwen3_5_moe "
             f"(got {m.family})")
    if m.family == "qwen3_5_moe" and not is_moe_model(cfg):
        fail("model-family", "model.family=qwen3_5_moe needs model.lm.num_experts > 0 (dense: qwen3_5)")
    if m.family in ("qwen3_5", "qwen3_5_moe") and not (lm.attention_output_gate and lm.qk_layernorm):
        fail("model-family", f"model.family={m.family} has gated attention with q/k norms: set "
             "model.lm.attention_output_gate=true and model.lm.qk_layernorm=true")
    if m.family == "qwen2_5_vl" and (lm.attention_output_gate or lm.qk_layernorm):
        fail("model-family", "model.family=qwen2_5_vl has neither an attention output gate nor q/k norms")
    if is_gdn_model(cfg) and m.family == "qwen2_5_vl":
        fail("model-family", "linear_attention (Gated DeltaNet) layers need model.family=qwen3_5 or qwen3_5_moe")
    if is_gdn_model(cfg) and lm.linear_num_key_heads > 0 and lm.linear_num_value_heads % lm.linear_num_key_heads:
        fail("gdn-shape", f"model.lm.linear_num_value_heads={lm.linear_num_value_heads} must be a multiple of "
             f"linear_num_key_heads={lm.linear_num_key_heads}")

    # --- hardware and devices
    on_gpu = hw.device == "cuda"
    if on_gpu and c.num_gpus < 1:
        fail("hardware-devices", f"hardware={hw.name} (cuda) needs cluster.num_gpus >= 1, got {c.num_gpus}")
    if not on_gpu:
        if c.num_gpus != 0:
            fail("hardware-devices", f"hardware={hw.name} (cpu) runs without GPUs: cluster.num_gpus must "
                 f"be 0, got {c.num_gpus}")
        if hw.dist_backend != "gloo":
            fail("hardware-backend", f"hardware.device=cpu needs dist_backend=gloo, got {hw.dist_backend}")
        if r.name == "sglang":
            fail("hardware-backend", "rollout=sglang needs GPUs: use rollout=embedded on hardware=cpu")
        if hw.train_dtype != "float32":
            fail("hardware-backend", f"hardware.train_dtype={hw.train_dtype} needs cuda; CPU trains in float32")
    elif hw.dist_backend != "nccl":
        fail("hardware-backend", f"hardware.device=cuda needs dist_backend=nccl, got {hw.dist_backend}")
    if not 0.0 <= cfg.reward.format_score < 1.0:
        fail("reward-format-score", f"reward.format_score={cfg.reward.format_score} must be in [0, 1): the reward of "
             "a well-formed wrong answer stays below a correct one's")
    mm_backends = sglang_choices("mm_attention_backend")
    if hw.sglang_mm_attention_backend not in (None, *mm_backends):
        fail("hardware-attention", f"hardware.sglang_mm_attention_backend={hw.sglang_mm_attention_backend!r} "
             f"is not one of SGLang's {list(mm_backends)}")
    if not hw.fa3_supported:
        if hw.sglang_mm_attention_backend == "fa3":
            fail("hardware-attention", f"hardware={hw.name} has no FlashAttention 3: "
                 "set hardware.sglang_mm_attention_backend=sdpa")
        if hw.vision_attn_implementation == "flash_attention_3":
            fail("hardware-attention", f"hardware={hw.name} has no FlashAttention 3: "
                 "set hardware.vision_attn_implementation=flash_attention_2 (or sdpa)")
    if not on_gpu and hw.gdn_backend == "fla":
        fail("hardware-gdn", "hardware.gdn_backend=fla runs flash-linear-attention's GPU kernels: "
             "use hardware.gdn_backend=torch on CPU")
    if not on_gpu and hw.lm_attention_backend == "flash4":
        fail("hardware-attention", "hardware.lm_attention_backend=flash4 runs FlashAttention 4's GPU kernels "
             "(Hopper / Blackwell): use hardware.lm_attention_backend=sdpa on CPU")
    if hw.cuda_graphs and not (on_gpu and hw.fused_kernels):
        fail("hardware-cuda-graphs", "hardware.cuda_graphs replays the compiled layers (hardware.fused_kernels=true) "
             "on a GPU: set hardware.cuda_graphs=false" + ("" if on_gpu else " on CPU"))
    if not on_gpu and hw.vision_attn_implementation.startswith("flash_attention"):
        fail("hardware-attention", f"hardware.vision_attn_implementation={hw.vision_attn_implementation} "
             "needs a GPU: use sdpa on CPU")

    # --- shared prompts
    if cfg.trainer.share_prompts:  # asked for (null: on where it runs as it is, `shares_prompts`)
        if p.cp > 1:
            fail("share-prompts", f"trainer.share_prompts runs a group's prompt once, which context parallelism "
                 f"(parallel.cp={p.cp}) cannot split: set trainer.share_prompts=false or parallel.cp=1")
        if is_gdn_model(cfg) and hw.gdn_backend != "torch":
            fail("share-prompts", f"trainer.share_prompts runs Gated DeltaNet layers on the torch path only "
                 f"(hardware.gdn_backend={hw.gdn_backend}): set hardware.gdn_backend=torch or "
                 "trainer.share_prompts=false")

    # --- dynamic sampling
    if r.oversample < 1.0 or r.max_rounds < 1:
        fail("dynamic-sampling", f"rollout.oversample={r.oversample} must be >= 1 and rollout.max_rounds="
             f"{r.max_rounds} >= 1")
    if (r.oversample > 1.0 or r.max_rounds > 1) and a.filter_groups == "none":
        fail("dynamic-sampling", f"rollout.oversample={r.oversample} / rollout.max_rounds={r.max_rounds} draw "
             "prompts to replace the groups algo.filter_groups drops; with filter_groups=none there are none "
             "(set algo.filter_groups=equal_reward, or oversample=1 max_rounds=1)")
    if r.max_prompts is not None and r.max_prompts < r.batch_size:
        fail("dynamic-sampling", f"rollout.max_prompts={r.max_prompts} must be >= rollout.batch_size="
             f"{r.batch_size} (or null)")

    # --- placement and colocation
    if c.cpu_threads is not None and c.cpu_threads < 1:
        fail("cpu-threads", f"cluster.cpu_threads={c.cpu_threads} must be >= 1 (or null: automatic)")
    if c.name == "external" and not c.address:
        fail("cluster-address", "cluster=external needs cluster.address (or RAY_ADDRESS)")
    if c.colocate and not on_gpu:
        fail("colocate", "cluster.colocate=true shares GPUs between trainer and engines; "
             f"hardware={hw.name} has none (set cluster.colocate=false)")
    if c.colocate and c.async_rollout:
        fail("colocate", "cluster.async_rollout=true overlaps rollout with training and cannot "
             "share GPUs: set cluster.colocate=false or cluster.async_rollout=false")
    from .memory import offload_config_problems

    for problem in offload_config_problems(cfg):
        fail("offload", problem)
    if on_gpu:
        if c.colocate and r.num_gpus != c.num_gpus:
            fail("colocate", f"colocated engines span every GPU: rollout.num_gpus={r.num_gpus} != "
                 f"cluster.num_gpus={c.num_gpus}")
        if not c.colocate:
            trainer = c.trainer_gpus if c.trainer_gpus is not None else c.num_gpus - r.num_gpus
            if trainer < 1 or r.num_gpus < 1 or trainer + r.num_gpus != c.num_gpus:
                fail("separate-gpus", f"separate GPUs need cluster.trainer_gpus ({trainer}) + "
                     f"rollout.num_gpus ({r.num_gpus}) = cluster.num_gpus ({c.num_gpus}), both >= 1")
        if r.gpus_per_engine < 1 or r.num_gpus % r.gpus_per_engine:
            fail("engine-gpus", f"rollout.num_gpus={r.num_gpus} is not a multiple of "
                 f"rollout.gpus_per_engine={r.gpus_per_engine}")
        if c.num_nodes > 1 and c.num_gpus % c.num_nodes:
            fail("engine-gpus", f"cluster.num_gpus={c.num_gpus} does not split over "
                 f"cluster.num_nodes={c.num_nodes}")
    if r.name == "embedded" and r.gpus_per_engine != 1:
        fail("engine-gpus", f"the embedded engine runs on one device: rollout.gpus_per_engine="
             f"{r.gpus_per_engine} must be 1")
    if r.name == "embedded" and r.embedded.device == "cuda" and not on_gpu:
        fail("engine-device", f"rollout.embedded.device=cuda needs GPUs; hardware={hw.name} has none "
             "(use rollout.embedded.device=auto or cpu)")
    if r.name == "sglang":
        ep = r.sglang.ep_size
        if ep < 1 or r.gpus_per_engine % ep:
            fail("engine-gpus", f"rollout.sglang.ep_size={ep} must divide rollout.gpus_per_engine="
                 f"{r.gpus_per_engine}")
        if ep > 1 and not is_moe_model(cfg):
            fail("engine-gpus", f"rollout.sglang.ep_size={ep} needs an MoE model; model={m.name} is dense")
        if not 0 < r.sglang.mem_fraction_static < 1:
            fail("engine-memory", f"rollout.sglang.mem_fraction_static={r.sglang.mem_fraction_static} "
                 "must be in (0, 1)")
        if m.family in ("qwen3_5", "qwen3_5_moe") and len(lm.layer_types) == lm.num_layers:
            if full_attention_interval(lm.layer_types) is None:
                k = closest_interval(lm.layer_types)
                full = [i for i, t in enumerate(lm.layer_types) if t == "full_attention"]
                fail("sglang-layer-types", f"model.lm.layer_types (full attention at layers {full} of "
                     f"{lm.num_layers}) follows no interval: SGLang "
                     "builds Qwen3.5 layers from one full_attention_interval (layer l is full attention when "
                     "(l + 1) % interval == 0) and would serve other layers than the trainer's. Set "
                     f"{layer_types_override(sglang_layer_types(k, lm.num_layers))} (interval {k}), or use "
                     "rollout=embedded")
        for key in SGLANG_KEY_ARGS:
            if key in dict(r.sglang.server_args):
                fail("sglang-args", f"rollout.sglang.server_args.{key}: the run sets it (its engine key, drawn "
                     "at start and kept in the run directory); leave it out")
        if r.sglang.use_router:
            fail("sglang-router", "rollout.sglang.use_router=true: a router in front of engines that require "
                 "the run's engine key is planned, not supported yet; the run spreads requests over the "
                 "engines itself (rollout.max_in_flight)")

        cache = dict(r.sglang.env).get(VLM_CACHE_ENV, SERVER_ENV[VLM_CACHE_ENV])
        if str(cache).strip() not in ("0", ""):
            fail("sglang-env", f"rollout.sglang.env.{VLM_CACHE_ENV}={cache}: SGLang would reuse each image's "
                 "vision-tower features across weight syncs (no update or flush clears them), and the vision "
                 f"tower trains; leave it unset ({VLM_CACHE_ENV}=0)")
        flags = load_flags()
        for key, value in dict(r.sglang.server_args).items():
            try:
                flags.check_value(key, value)
            except (KeyError, ValueError) as e:
                fail("sglang-args", f"rollout.sglang.server_args.{key}: {e.args[0]}")
    if out:
        return out  # the layout below assumes sane device counts

    # --- parallel sizes against the world and the model
    layout = compute_layout(cfg)
    world = layout.trainer_world_size
    model_parallel = p.tp * p.pp * p.cp
    if world < 1 or world % model_parallel:
        fail("world-size", f"trainer world size {world} is not a multiple of tp*pp*cp = "
             f"{p.tp}*{p.pp}*{p.cp} = {model_parallel} (world = dp*tp*pp*cp)")
    if lm.num_attention_heads % p.tp:
        fail("tp-heads", f"parallel.tp={p.tp} does not divide model.lm.num_attention_heads="
             f"{lm.num_attention_heads}")
    g = lm.num_query_groups
    if p.tp <= g and g % p.tp:
        fail("tp-kv-groups", f"parallel.tp={p.tp} does not divide model.lm.num_query_groups={g}: "
             f"up to {g}, tp must divide the KV groups")
    if p.tp > g:
        # Megatron's scheme for tp wider than the KV groups: each rank holds 1/tp of the fused
        # QKV rows, all-gathers the projections and keeps its group's K/V and its queries
        rows = (lm.num_attention_heads * (2 if lm.attention_output_gate else 1) + 2 * g) * lm.head_dim
        if p.tp % g or rows % p.tp:
            fail("tp-kv-groups", f"parallel.tp={p.tp} is wider than model.lm.num_query_groups={g}: it must be a "
                 f"multiple of them ({p.tp} % {g}) and divide the fused QKV rows ({rows})")
    if is_gdn_model(cfg):
        for key in ("linear_num_key_heads", "linear_num_value_heads"):
            if getattr(lm, key) % p.tp:
                fail("tp-gdn-heads", f"parallel.tp={p.tp} does not divide model.lm.{key}={getattr(lm, key)}: "
                     "Gated DeltaNet layers shard their heads over TP")
        if p.cp > 1 and (lm.linear_num_key_heads // p.tp) % p.cp:
            fail("cp-gdn-heads", f"context parallel trades sequence for Gated DeltaNet heads: parallel.cp={p.cp} "
                 f"must divide the key heads of one TP rank (model.lm.linear_num_key_heads / tp = "
                 f"{lm.linear_num_key_heads} / {p.tp})")
    if p.sequence_parallel and p.tp == 1:
        fail("sp-needs-tp", "parallel.sequence_parallel=true needs parallel.tp > 1")
    stages = p.pp * (p.vpp or 1)
    if lm.num_layers % stages:
        fail("pp-layers", f"model.lm.num_layers={lm.num_layers} is not divisible by pp*vpp={stages}")
    if p.vpp is not None and p.pp == 1:
        fail("pp-layers", "parallel.vpp needs parallel.pp > 1")
    if is_moe_model(cfg):
        if lm.num_experts % p.ep:
            fail("ep-experts", f"parallel.ep={p.ep} does not divide model.lm.num_experts={lm.num_experts}")
        per_stage = world // p.pp if world % p.pp == 0 else 0
        if per_stage == 0 or per_stage % (p.ep * p.etp):
            fail("ep-world", f"ep*etp={p.ep}*{p.etp} must divide the ranks of one pipeline stage "
                 f"(world/pp = {world}/{p.pp})")
        if p.etp != 1:
            fail("etp", f"parallel.etp={p.etp}: vlmrl's experts are not tensor-parallel; set parallel.etp=1 "
                 "(shard experts with parallel.ep)")
        if p.tp > 1 and not p.sequence_parallel:
            fail("moe-tp-sp", f"MoE layers under tensor parallelism (parallel.tp={p.tp}) need "
                 "parallel.sequence_parallel=true: each TP rank routes its own slice of the tokens")
    elif p.ep != 1 or p.etp != 1:
        fail("ep-experts", f"parallel.ep={p.ep}, parallel.etp={p.etp} need an MoE model; "
             f"model={m.name} has no experts")

    # --- batch arithmetic
    gbs = cfg.trainer.global_batch_size
    if a.name == "grpo" and r.temperature <= 0:
        fail("rollout-temperature", f"rollout.temperature={r.temperature} samples greedily: every reply of a "
             "prompt's group is the same, so every advantage is 0 and GRPO learns nothing (greedy decoding is "
             "for evaluation: rollout.eval.temperature=0)")
    if a.name == "grpo":
        if a.n_samples_per_prompt < 2:
            fail("grpo-group", f"algo.n_samples_per_prompt={a.n_samples_per_prompt}: GRPO normalises "
                 "within a prompt's group and needs at least 2 samples")
        samples = r.batch_size * a.n_samples_per_prompt
        if gbs < 1 or samples % gbs:
            fail("batch-size", f"rollout.batch_size*algo.n_samples_per_prompt = {r.batch_size}*"
                 f"{a.n_samples_per_prompt} = {samples} is not a multiple of trainer.global_batch_size={gbs}")
    if not p.use_dynamic_batch_size and gbs % (p.micro_batch_size * layout.dp):
        fail("batch-size", f"trainer.global_batch_size={gbs} is not a multiple of "
             f"micro_batch_size*dp = {p.micro_batch_size}*{layout.dp}")
    if a.policy_loss == "gspo" and a.loss_agg_mode != "seq_mean_token_mean":
        fail("gspo-agg", f"algo.policy_loss=gspo optimises a per-sequence objective: set "
             f"algo.loss_agg_mode=seq_mean_token_mean (got {a.loss_agg_mode})")
    if p.cp > 1 and (a.loss_agg_mode != "token_mean" or a.policy_loss != "ppo"):
        fail("cp-loss", f"context parallel (parallel.cp={p.cp}) splits sequences over ranks: it supports "
             f"algo.policy_loss=ppo with algo.loss_agg_mode=token_mean (got {a.policy_loss}, {a.loss_agg_mode})")
    if a.mis != "none" and not 0 < a.mis_low < 1 < a.mis_high:
        fail("mis-band", f"algo.mis={a.mis} keeps ratios in [algo.mis_low, algo.mis_high]: need 0 < mis_low < 1 "
             f"< mis_high (got {a.mis_low}, {a.mis_high})")
    _routing_rules(cfg, fail)
    if p.cp > 1 and a.mis == "sequence":
        fail("cp-loss", f"context parallel (parallel.cp={p.cp}) splits sequences over ranks: algo.mis=sequence "
             "needs each sequence whole (use algo.mis=token)")
    if a.eps_clip <= 0 or a.eps_clip_high < a.eps_clip:
        fail("clip-range", f"need 0 < algo.eps_clip ({a.eps_clip}) <= algo.eps_clip_high ({a.eps_clip_high})")
    if cfg.data.min_pixels > cfg.data.max_pixels:
        fail("pixels", f"data.min_pixels={cfg.data.min_pixels} > data.max_pixels={cfg.data.max_pixels}")
    if r.max_new_tokens < 1:
        fail("positive", f"rollout.max_new_tokens={r.max_new_tokens} must be >= 1")
    for key in ("sample_groups", "eval_samples"):
        if getattr(cfg.logger, key) < 0:
            fail("positive", f"logger.{key}={getattr(cfg.logger, key)} must be >= 0 (0: log none)")
    rl_lr = cfg.trainer.optim.rl_lr
    if rl_lr is not None and (rl_lr <= 0 or a.name == "sft"):
        fail("rl-lr", f"trainer.optim.rl_lr={rl_lr}: the RL phase's peak learning rate must be > 0, and "
             "algo=sft has no RL phase (its schedule is trainer.optim.lr's)")
    return out


def config_notes(cfg: VlmrlConfig) -> list[str]:
    """Facts about a valid config that change what a run means (the plan and the start of
    a run print them)."""
    notes = []
    from .layout import embedded_engine_device

    if cfg.rollout.name == "embedded" and cfg.hardware.device == "cuda" and embedded_engine_device(cfg) == "cpu":
        notes.append("rollout.embedded.device=cpu: the embedded engine generates on the host's CPU beside GPU "
                     f"trainers, in model.dtype={cfg.model.dtype}")
    if cfg.rollout.name == "sglang" and not cfg.rollout.sglang.deterministic_inference:
        notes.append("SGLang ignores the per-sample seeds unless rollout.sglang.deterministic_inference=true: "
                     "rollouts are not reproducible and a resumed run does not redraw the same samples")
    notes.extend(memory_notes(cfg))
    return notes


def memory_notes(cfg: VlmrlConfig) -> list[str]:
    """A phase of a step whose planned peak is over 90% of the GPU, with the micro-batch budget
    (or engine pool) that fits. Notes, not rules: the plan is an estimate, and a run within the
    device may still work."""
    from .memory import GIB, PHASE_FRACTION, largest_micro_batch_tokens, phase_estimates

    gpu = cfg.hardware.gpu_memory_gb * GIB
    if cfg.hardware.device != "cuda" or gpu <= 0:
        return []
    # the resident trainer state fills the rollout phase to the fraction exactly: not over it
    over = {ph: b for ph, b in phase_estimates(cfg).items() if b > PHASE_FRACTION * gpu * (1 + 1e-3)}
    if not over:
        return []
    phase, peak = max(over.items(), key=lambda kv: kv[1])
    r = cfg.rollout
    # the engine's pool, which no micro-batch moves, set the rollout phase's peak
    frac = math.floor((r.sglang.mem_fraction_static - (peak - PHASE_FRACTION * gpu) / gpu) * 100) / 100
    largest = largest_micro_batch_tokens(cfg) if phase != "rollout" else None
    if phase == "rollout" and r.name == "sglang" and frac >= 0.05:
        fix = f"rollout.sglang.mem_fraction_static={frac:.2f} or less brings it within {PHASE_FRACTION:.0%}"
    elif largest is not None and largest[0] < cfg.parallel.max_tokens_per_gpu:
        fix = f"parallel.max_tokens_per_gpu={largest[0]} keeps every phase within {PHASE_FRACTION:.0%}"
    elif phase == "rollout":
        fix = "a smaller engine pool, or more of the trainer offloaded (trainer.resident_budget), would lower it"
    else:  # the trainer's state (and in the sync the engines' weights beside it) sets the peak
        fix = ("no micro-batch budget fits: the trainer's state needs more GPUs (parallel.tp, pp, ep, or data "
               "parallelism with trainer.use_distributed_optimizer) or a smaller model")
    verdict = ("more than the GPU holds: the run cannot allocate it" if peak > gpu
               else f"over {PHASE_FRACTION:.0%}: the run may fail to allocate")
    return [f"the {phase} phase's planned peak, {peak / GIB:.1f} GiB, is {peak / gpu:.0%} of the "
            f"{cfg.hardware.gpu_memory_gb:g} GiB GPU ({verdict}); {fix} (python -m vlmrl.plan)"]


def validate(cfg: VlmrlConfig) -> VlmrlConfig:
    """Raise ConfigError listing every violated rule; return cfg unchanged when valid."""
    violations = check(cfg)
    if violations:
        raise ConfigError(violations)
    return cfg

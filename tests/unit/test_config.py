"""The config tree: every option composes and validates, invalid configs are rejected by
rule, override typos list the valid keys, and the layout/memory arithmetic is right."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from vlmrl.config import CONF_DIR, ConfigError, UnknownKeyError, check_key, compose, compute_layout, load
from vlmrl.config.memory import count_params, estimate_memory
from vlmrl.config.schema import GROUPS

GPU = ["hardware=h200", "rollout=sglang", "cluster.num_gpus=8", "cluster.colocate=true"]
GPU_DENSE = [*GPU, "model=qwen2_5_vl_3b"]
REFERENCE = ["experiment=geo3k_qwen35"]

# The context in which each option must validate (CPU default unless listed).
CONTEXT: dict[tuple[str, str], list[str]] = {
    ("model", "qwen2_5_vl_3b"): GPU_DENSE,
    ("model", "qwen2_5_vl_7b"): [*GPU, "model=qwen2_5_vl_7b"],
    ("model", "qwen3_5_35b_a3b"): REFERENCE,
    ("parallel", "tp2_sp"): [*GPU_DENSE, "parallel.use_dynamic_batch_size=true"],
    ("parallel", "moe_ep8"): REFERENCE,
    ("hardware", "h100"): GPU_DENSE,
    ("hardware", "h200"): GPU_DENSE,
    ("hardware", "b200"): GPU_DENSE,
    ("rollout", "sglang"): GPU_DENSE,
    ("cluster", "external"): GPU_DENSE,
    ("data", "geo3k"): [],
}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))


ALL_OPTIONS = [(g, o) for g in [*GROUPS, "experiment"] for o in options(g)]


def test_every_group_has_options():
    for group in GROUPS:
        assert options(group), f"conf/{group}/ has no options"


@pytest.mark.parametrize(("group", "option"), ALL_OPTIONS, ids=[f"{g}={o}" for g, o in ALL_OPTIONS])
def test_every_option_composes_and_validates(group, option):
    overrides = list(CONTEXT.get((group, option), []))
    if f"{group}={option}" not in overrides and group != "experiment":
        overrides.append(f"{group}={option}")
    if group == "experiment":
        overrides = [f"experiment={option}"]
    cfg = load(overrides)
    section = getattr(cfg, group) if group != "experiment" else cfg
    assert section is not None
    if group != "experiment":
        assert section.name == option


def test_config_is_frozen():
    cfg = load([])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.parallel.tp = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 1  # type: ignore[misc]


def test_the_embedded_default_is_the_measured_learning_settings():
    """The embedded default's GRPO is the settings whose three-seed runs raised greedy accuracy
    on both miniatures (bench/results/make_train.md, learning-qwen35.md): 16 samples a prompt,
    one optimizer step per rollout, a KL term to the policy after the SFT warm-up.
    `experiment=tiny_qwen35_moe` is that loop with the Qwen3.5-MoE miniature."""
    cfg = load([])
    assert (cfg.algo.name, cfg.algo.kl_coef, cfg.algo.n_samples_per_prompt) == ("grpo", 0.2, 16)
    assert cfg.algo.kl_reference == "warmup" and cfg.algo.sft_steps == 60 and cfg.algo.uses_reference
    assert cfg.rollout.batch_size * cfg.algo.n_samples_per_prompt == cfg.trainer.global_batch_size  # one update a step
    assert cfg.hardware.device == "cpu" and cfg.rollout.name == "embedded"
    # run_name defaults to the composition's clock time: pin it, or a second boundary between the
    # two compositions makes them differ
    pinned = ["run_name=same"]
    assert load(["experiment=tiny_qwen35_moe", *pinned]) == load(["model=tiny_qwen3_5_moe", *pinned])
    # the SFT control keeps no reference model, whatever kl_coef it inherits
    sft = load(["algo=sft", "num_steps=140"])
    assert sft.algo.kl_coef == 0.2 and not sft.algo.uses_reference
    # the reference recipe states its own: no KL term
    assert load(REFERENCE, check_rules=False).algo.kl_coef == 0.0


def test_the_moe_miniature_recipe_is_the_same_on_every_engine():
    """`experiment=tiny_qwen35_moe` runs one recipe whichever engine generates: SGLang on a GPU
    samples as the embedded engine on a CPU does (the rollout group's own reply budget, 1024
    tokens for SGLang, would let replies that miss their end token fill the loss)."""
    pinned = ["experiment=tiny_qwen35_moe", "run_name=same"]
    cpu = load(pinned)
    gpu = load([*pinned, "rollout=sglang", "hardware=h200", "cluster.num_gpus=1", "cluster.colocate=true"])
    recipe = ("batch_size", "temperature", "top_p", "top_k", "max_new_tokens", "stop", "stop_token_ids", "eval")
    assert {k: getattr(gpu.rollout, k) for k in recipe} == {k: getattr(cpu.rollout, k) for k in recipe}
    assert cpu.rollout.max_new_tokens == 24
    assert (gpu.algo, gpu.trainer.optim, gpu.data) == (cpu.algo, cpu.trainer.optim, cpu.data)


def test_reference_recipe_values():
    cfg = load(REFERENCE)
    assert cfg.model.name == "qwen3_5_35b_a3b"
    lm, v = cfg.model.lm, cfg.model.vision
    assert (lm.num_layers, lm.hidden_size, lm.num_attention_heads, lm.num_query_groups, lm.head_dim) == (
        40, 2048, 16, 2, 256)
    assert lm.layer_types.count("linear_attention") == 30 and lm.layer_types.count("full_attention") == 10
    assert all(t == "full_attention" for t in lm.layer_types[3::4])
    assert (lm.linear_num_key_heads, lm.linear_num_value_heads, lm.linear_key_head_dim,
            lm.linear_conv_kernel_dim) == (16, 32, 128, 4)
    assert (lm.num_experts, lm.moe_router_topk, lm.moe_ffn_hidden_size, lm.shared_expert_ffn_hidden_size) == (
        256, 8, 512, 512)
    assert lm.shared_expert_gate and lm.attention_output_gate and lm.qk_layernorm
    assert (lm.vocab_size, lm.partial_rotary_factor, lm.rope_theta) == (248320, 0.25, 1e7)
    assert list(lm.mrope_section) == [11, 11, 10] and lm.mrope_interleaved
    assert (v.patch_size, v.temporal_patch_size, v.spatial_merge_size) == (16, 2, 2)
    # the recipe
    assert cfg.rollout.batch_size == 64 and cfg.algo.n_samples_per_prompt == 8
    assert cfg.trainer.global_batch_size == 512
    o = cfg.trainer.optim
    assert (o.lr, o.lr_decay_style, o.adam_beta1, o.adam_beta2, o.weight_decay) == (1e-6, "constant", 0.9, 0.98, 0.1)
    assert cfg.rollout.temperature == 0.8 and cfg.rollout.max_new_tokens == 4096
    assert cfg.eval_interval == 20 and cfg.rollout.eval.n_samples_per_prompt == 1 and cfg.data.test_split == "test"
    p = cfg.parallel
    assert (p.tp, p.sequence_parallel, p.ep, p.etp, p.recompute_granularity, p.micro_batch_size) == (
        2, True, 8, 1, "full", 1)
    assert cfg.cluster.colocate and cfg.cluster.num_gpus == 8
    assert cfg.rollout.name == "sglang" and cfg.rollout.num_gpus == 8 and cfg.rollout.sglang.ep_size == 8
    assert cfg.rollout.sglang.mem_fraction_static == 0.7
    assert cfg.algo.eps_clip == 0.2 and cfg.algo.eps_clip_high == 0.28
    assert cfg.data.path == "chenhegu/geo3k_imgurl"


def test_b200_uses_sdpa_and_fa2():
    cfg = load([*REFERENCE, "hardware=b200"])
    assert cfg.hardware.sglang_mm_attention_backend == "sdpa"
    assert cfg.hardware.vision_attn_implementation == "flash_attention_2"
    for name in ("h100", "h200"):
        hw = load([*REFERENCE, f"hardware={name}"]).hardware
        assert hw.sglang_mm_attention_backend == "fa3" and hw.vision_attn_implementation == "flash_attention_3"


def test_dataset_name_env_override(monkeypatch):
    monkeypatch.setenv("VLMRL_DATASET_NAME", "/data/geo3k_local")
    assert load(["data=geo3k"]).data.path == "/data/geo3k_local"


# 40 Qwen3.5 layer kinds with full attention at layers 0, 4, ...: no full-attention interval
# (layer l is full attention when (l + 1) % interval == 0) describes them; every 4th layer does
NO_INTERVAL = ",".join((["full_attention"] + ["linear_attention"] * 3) * 10)
EVERY_4TH = ",".join((["linear_attention"] * 3 + ["full_attention"]) * 10)

INVALID = [
    ([*REFERENCE, "parallel.tp=3"], "world-size", "tp*pp*cp"),
    ([*REFERENCE, "model.lm.num_attention_heads=12", "model.lm.num_query_groups=3"], "tp-kv-groups",
     "num_query_groups=3"),
    ([*REFERENCE, "parallel.tp=4", "model.lm.num_attention_heads=12", "model.lm.num_query_groups=3"],
     "tp-kv-groups", "multiple of them"),
    ([*GPU_DENSE, "parallel.tp=8", "model.lm.num_attention_heads=12", "model.lm.num_query_groups=8"],
     "tp-heads", "num_attention_heads=12"),
    ([*REFERENCE, "parallel.ep=3"], "ep-experts", "num_experts=256"),
    ([*GPU_DENSE, "parallel.ep=2"], "ep-experts", "has no experts"),
    ([*REFERENCE, "parallel.ep=16"], "ep-world", "world/pp"),
    (["parallel.sequence_parallel=true"], "sp-needs-tp", "tp > 1"),
    ([*REFERENCE, "parallel.sequence_parallel=false"], "moe-tp-sp", "sequence_parallel=true"),
    ([*REFERENCE, "parallel.etp=2"], "etp", "parallel.etp=1"),
    ([*REFERENCE, "parallel.tp=1", "parallel.sequence_parallel=false", "parallel.cp=32", "cluster.num_gpus=64",
      "rollout.num_gpus=64", "parallel.ep=8"], "cp-gdn-heads", "key heads of one TP rank"),
    ([*REFERENCE, "model.lm.linear_num_value_heads=24"], "gdn-shape", "multiple of linear_num_key_heads"),
    (["model.family=qwen3_5"], "model-family", "attention_output_gate=true"),
    (["model=tiny_qwen3_5", "model.family=qwen2_5_vl"], "model-family", "qwen3_5 or qwen3_5_moe"),
    (["model=tiny_qwen3_5_moe", "model.family=qwen3_5"], "model-family", "qwen3_5_moe"),
    (["hardware.gdn_backend=fla"], "hardware-gdn", "gdn_backend=torch"),
    (["hardware.cuda_graphs=true"], "hardware-cuda-graphs", "hardware.cuda_graphs=false on CPU"),
    (["hardware.lm_attention_backend=flash4"], "hardware-attention", "lm_attention_backend=sdpa on CPU"),
    ([*REFERENCE, "parallel.pp=3"], "pp-layers", "num_layers=40"),
    (["hardware=h200"], "hardware-devices", "num_gpus >= 1"),
    (["cluster.num_gpus=2"], "hardware-devices", "must be 0"),
    (["rollout=sglang"], "hardware-backend", "rollout=sglang needs GPUs"),
    ([*REFERENCE, "hardware=b200", "hardware.sglang_mm_attention_backend=fa3"], "hardware-attention",
     "no FlashAttention 3"),
    ([*REFERENCE, "hardware=b200", "hardware.vision_attn_implementation=flash_attention_3"],
     "hardware-attention", "flash_attention_2"),
    ([*REFERENCE, "hardware.sglang_mm_attention_backend=flash"], "hardware-attention", "SGLang's"),
    (["cluster.colocate=true"], "colocate", "has none"),
    (["trainer.offload=true"], "offload", "trainer.offload=true needs GPUs"),
    (["cluster.cpu_threads=0"], "cpu-threads", "must be >= 1"),
    ([*REFERENCE, "cluster.async_rollout=true"], "colocate", "async_rollout"),
    ([*REFERENCE, "rollout.num_gpus=4"], "colocate", "rollout.num_gpus=4"),
    ([*GPU_DENSE, "cluster.colocate=false", "rollout.num_gpus=8"], "separate-gpus", "trainer_gpus"),
    ([*REFERENCE, "rollout.gpus_per_engine=3"], "engine-gpus", "gpus_per_engine=3"),
    ([*REFERENCE, "rollout.sglang.ep_size=3"], "engine-gpus", "ep_size=3"),
    ([*REFERENCE, "rollout.sglang.mem_fraction_static=1.5"], "engine-memory", "(0, 1)"),
    ([*REFERENCE, "+rollout.sglang.env.SGLANG_VLM_CACHE_SIZE_MB=100"], "sglang-env", "SGLANG_VLM_CACHE_SIZE_MB=0"),
    ([*REFERENCE, "+rollout.sglang.server_args.api_key=abc"], "sglang-args", "the run sets it"),
    ([*REFERENCE, "rollout.sglang.use_router=true"], "sglang-router", "planned"),
    ([*REFERENCE, f"model.lm.layer_types=[{NO_INTERVAL}]"], "sglang-layer-types",
     f"model.lm.layer_types=[{EVERY_4TH}] (interval 4)"),
    (["algo.n_samples_per_prompt=1"], "grpo-group", "at least 2"),
    (["rollout.batch_size=3", "trainer.global_batch_size=32"], "batch-size", "global_batch_size=32"),
    (["algo.eps_clip_high=0.1"], "clip-range", "eps_clip_high"),
    (["model.lm.mrope_section=[8,8,8]"], "mrope-section", "head_dim * partial_rotary_factor"),
    (["algo.kl_type=k9"], "enum", "k9"),
    (["algo.kl_reference=final"], "enum", "final"),
    (["logger.eval_samples=-1"], "positive", "logger.eval_samples=-1"),
    (["profile_steps=[2,0]"], "positive", "profile_steps=[2, 0]"),
    (["algo.mis=tokens"], "enum", "tokens"),
    (["algo.mis=token", "algo.mis_high=0.9"], "mis-band", "0 < mis_low < 1 < mis_high"),
    (["rollout.temperature=0"], "rollout-temperature", "GRPO learns nothing"),
    (["trainer.optim.rl_lr=0"], "rl-lr", "must be > 0"),
    (["algo=sft", "trainer.optim.rl_lr=1e-5"], "rl-lr", "no RL phase"),
    (["algo.routing_replay=rollout"], "routing-replay", "has no experts"),
    (["rollout.return_routed_experts=true"], "routing-replay", "has no experts"),
    (["model=tiny_qwen3_5_moe", "algo.routing_replay=rollout", "rollout.return_routed_experts=false"],
     "routing-replay", "rollout.return_routed_experts=true"),
    (["model=tiny_qwen3_5_moe", "algo.routing_replay=rollout", "parallel.pp=2", "cluster.num_cpu_ranks=2",
      "parallel.recompute_granularity=full"], "routing-replay", "full activation recompute"),
    (["algo.routing_replay=always"], "enum", "routing_replay"),
    (["trainer.moe_router_precision=bf16"], "enum", "moe_router_precision"),
    (["parallel.cp=2", "cluster.num_cpu_ranks=2", "algo.mis=sequence"], "cp-loss", "algo.mis=token"),
    (["algo.policy_loss=gspo"], "gspo-agg", "seq_mean_token_mean"),
    (["parallel.cp=2", "cluster.num_cpu_ranks=2", "algo.loss_agg_mode=seq_mean_token_sum"], "cp-loss", "token_mean"),
    (["data.min_pixels=100000"], "pixels", "min_pixels"),
    (["cluster=external", "cluster.address=null", *GPU_DENSE], "cluster-address", "cluster.address"),
    (["hardware.train_dtype=bfloat16"], "hardware-backend", "CPU trains in float32"),
    (["rollout.embedded.device=cuda"], "engine-device", "rollout.embedded.device=auto or cpu"),
    (["rollout.embedded.device=gpu"], "enum", "gpu"),
    (["algo.filter_groups=equal"], "enum", "filter_groups"),
    (["rollout.oversample=2"], "dynamic-sampling", "algo.filter_groups=equal_reward"),
    (["algo.filter_groups=equal_reward", "rollout.oversample=0.5"], "dynamic-sampling", "must be >= 1"),
    (["algo.filter_groups=equal_reward", "rollout.max_rounds=3", "rollout.max_prompts=2"], "dynamic-sampling",
     "rollout.max_prompts=2"),
    (["trainer.share_prompts=true", "parallel.cp=2", "cluster.num_cpu_ranks=2"], "share-prompts", "parallel.cp=2"),
    ([*REFERENCE, "trainer.share_prompts=true"], "share-prompts", "hardware.gdn_backend=fla"),
]


@pytest.mark.parametrize(("overrides", "rule", "text"), INVALID, ids=[f"{r}-{i}" for i, (_, r, _) in enumerate(INVALID)])
def test_invalid_configs_are_rejected_by_rule(overrides, rule, text):
    with pytest.raises(ConfigError) as err:
        load(overrides)
    assert rule in err.value.rules, str(err.value)
    msgs = [str(v) for v in err.value.violations if v.rule == rule]
    assert any(text in m for m in msgs), msgs


def test_tp_wider_than_the_kv_groups_is_valid():
    """The reference model has 2 KV groups: TP4 and TP8 are valid (each rank keeps its group's
    K/V), and the plan shows the gathered projections."""
    from vlmrl.plan import render_plan

    for tp in (4, 8):
        cfg = load([*REFERENCE, f"parallel.tp={tp}", "hardware=b200"])
        assert cfg.parallel.tp == tp and cfg.model.lm.num_query_groups == 2
        text = render_plan(cfg)
        assert f"tp {tp} > 2 KV groups" in text and f"{16 // tp} query heads" in text


@pytest.mark.parametrize("model", ["tiny_qwen3_5", "tiny_qwen3_5_moe"])
def test_sglang_needs_qwen35_layer_kinds_of_one_interval(model):
    """SGLang derives Qwen3.5 layer kinds from one full-attention interval: other layouts are
    refused under rollout=sglang, with the override of the nearest interval; the embedded
    engine (transformers, which reads layer_types) takes them."""
    layout = "model.lm.layer_types=[full_attention,linear_attention,linear_attention,linear_attention]"
    with pytest.raises(ConfigError) as err:
        load([*GPU, f"model={model}", layout])
    assert err.value.rules == ["sglang-layer-types"], str(err.value)
    msg = str(err.value)
    assert "full attention at layers [0] of 4" in msg and "rollout=embedded" in msg
    assert "model.lm.layer_types=[linear_attention,linear_attention,linear_attention,full_attention] (interval 4)" in msg
    assert load([f"model={model}", layout]).rollout.name == "embedded"
    load([*GPU, f"model={model}"])  # the option's own layout: every 4th layer


def test_all_violations_reported_together():
    with pytest.raises(ConfigError) as err:
        load([*REFERENCE, "parallel.tp=3", "parallel.etp=2"])
    assert {"world-size", "tp-heads", "etp"} <= set(err.value.rules)


@pytest.mark.parametrize("key", ["model.lm.num_layerz", "parallel.tpp", "rollout.sglang.mem_fraction",
                                 "trainr.global_batch_size", "algo.eps_clip.x"])
def test_unknown_override_keys_name_valid_keys(key):
    with pytest.raises(UnknownKeyError) as err:
        check_key(key)
    assert "Unknown config key" in str(err.value)
    if not key.endswith(".x"):
        assert "Valid keys" in str(err.value)


def test_typo_suggests_closest_key():
    with pytest.raises(UnknownKeyError, match="Did you mean 'parallel.tp'"):
        check_key("parallel.tpp")


def test_passthrough_dicts_accept_any_key():
    check_key("trainer.megatron.moe_token_dispatcher_type")
    check_key("rollout.sglang.server_args.enable_dp_attention")
    cfg = load(["+trainer.megatron.moe_token_dispatcher_type=alltoall",
                "+rollout.sglang.server_args.chunked_prefill_size=4096"])
    assert cfg.trainer.megatron["moe_token_dispatcher_type"] == "alltoall"
    assert cfg.rollout.sglang.server_args["chunked_prefill_size"] == 4096


def test_struct_mode_rejects_unknown_keys_in_compose():
    with pytest.raises(Exception, match="num_layerz"):
        compose(["model.lm.num_layerz=3"])


def test_layout_of_reference_recipe():
    cfg = load(REFERENCE)
    layout = compute_layout(cfg)
    assert (layout.trainer_world_size, layout.dp, layout.expert_dp, layout.num_engines) == (8, 4, 1, 1)
    coords = layout.coords(cfg)
    assert [c.tp for c in coords] == [0, 1] * 4
    assert [c.dp for c in coords] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [c.ep for c in coords] == list(range(8))
    assert layout.engines(cfg)[0].devices == tuple(range(8))


def test_layout_pipeline_and_separate_engines():
    cfg = load([*GPU_DENSE, "cluster.colocate=false", "cluster.trainer_gpus=4", "rollout.num_gpus=4",
                "rollout.gpus_per_engine=2", "parallel.pp=2", "trainer.global_batch_size=32"])
    layout = compute_layout(cfg)
    assert (layout.trainer_world_size, layout.dp, layout.num_engines) == (4, 2, 2)
    assert [c.pp for c in layout.coords(cfg)] == [0, 0, 1, 1]
    assert [e.devices for e in layout.engines(cfg)] == [(4, 5), (6, 7)]


def test_param_counts_of_reference_model():
    counts = count_params(load(REFERENCE))
    assert 34.5e9 < counts.total < 36e9  # "35B"
    assert 3e9 < counts.active < 4.5e9  # "A3B"


def test_param_counts_match_transformers_for_tiny(tiny_checkpoint, tiny_config):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_checkpoint)
    counts = count_params(tiny_config)
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert counts.vision == sum(p.numel() for n, p in model.named_parameters() if "visual" in n)


def test_param_counts_match_transformers_for_qwen35_moe():
    import torch
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    types = ["linear_attention"] * 3 + ["full_attention"]
    cfg = load([*REFERENCE, "model.lm.num_layers=4", f"model.lm.layer_types=[{','.join(types)}]",
                "model.lm.num_experts=8", "model.lm.moe_router_topk=2", "model.lm.vocab_size=1000",
                "model.vision.depth=2"], check_rules=False)
    hf = Qwen3_5MoeConfig(text_config=dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2,
                                           vocab_size=1000, layer_types=types),
                          vision_config=dict(depth=2, out_hidden_size=2048))
    with torch.device("meta"):
        model = Qwen3_5MoeForConditionalGeneration(hf)
    assert count_params(cfg).total == sum(p.numel() for p in model.parameters())


def test_memory_estimate_scales_with_parallelism():
    base = estimate_memory(load(REFERENCE))
    no_tp = estimate_memory(load([*REFERENCE, "parallel.tp=1", "parallel.sequence_parallel=false"]))
    assert no_tp.params > base.params and no_tp.activations > base.activations
    no_recompute = estimate_memory(load([*REFERENCE, "parallel.recompute_granularity=null"]))
    assert no_recompute.activations > base.activations
    assert base.rollout_pool == pytest.approx(0.7 * 141 * 1024**3)


def test_cpu_threads_share_the_cores_among_concurrent_actors():
    from vlmrl.cluster.placement import cpu_threads
    from vlmrl.config import load

    cfg = load([])
    # synchronous: training and rollout alternate, each gets every core
    assert cpu_threads(cfg, "trainer", 8) == 8 and cpu_threads(cfg, "engine", 8) == 8
    two = load(["cluster.num_cpu_ranks=2"])
    assert cpu_threads(two, "trainer", 8) == 4 and cpu_threads(two, "engine", 8) == 8
    overlap = load(["cluster.num_cpu_ranks=2", "cluster.async_rollout=true"])
    assert cpu_threads(overlap, "trainer", 8) == 2 and cpu_threads(overlap, "engine", 8) == 2
    assert cpu_threads(overlap, "trainer", 2) == 1  # never below one
    assert cpu_threads(load(["cluster.cpu_threads=3"]), "engine", 8) == 3
    assert cpu_threads(load(["experiment=geo3k_qwen35"]), "trainer", 8) is None  # GPUs: left alone


def test_trainer_keeps_cuda_graphs_off_where_they_cannot_hold(capsys):
    """`hardware.cuda_graphs` on the reference recipe's GPU hardware: on without recompute and
    pipeline stages at TP 1, off (and said) otherwise; the recipe itself runs TP 2 with full
    recompute (parallel=moe_ep8)."""
    from vlmrl.training.trainer import cuda_graphs_in_training

    base = [*REFERENCE, "hardware.cuda_graphs=true", "parallel.recompute_granularity=null", "parallel.tp=1",
            "parallel.sequence_parallel=false"]
    assert cuda_graphs_in_training(load(base))
    assert not cuda_graphs_in_training(load([*base, "hardware.cuda_graphs=false"]))
    assert not cuda_graphs_in_training(load([*base, "parallel.pp=2", "parallel.ep=4"]))
    assert "pipeline parallel" in capsys.readouterr().out
    assert not cuda_graphs_in_training(load([*base, "parallel.tp=2", "parallel.sequence_parallel=true"]))
    assert "tensor parallel" in capsys.readouterr().out
    assert not cuda_graphs_in_training(load([*REFERENCE, "hardware.cuda_graphs=true"]))
    assert "activation recompute (full)" in capsys.readouterr().out


def test_engines_bind_loopback_on_one_local_machine_only():
    from vlmrl.config import load
    from vlmrl.config.layout import engine_bind_host

    assert engine_bind_host(load(["experiment=geo3k_qwen35"])) == "127.0.0.1"
    assert engine_bind_host(load(["experiment=geo3k_qwen35", "cluster=external"], check_rules=False)) == "auto"
    assert engine_bind_host(load(["experiment=geo3k_qwen35", "cluster.num_nodes=2"], check_rules=False)) == "auto"


GPU_EMBEDDED = ["model=tiny_qwen3_5_moe", "hardware=h200", "cluster.num_gpus=1", "cluster.colocate=true",
                "rollout.num_gpus=1"]


def test_the_embedded_engine_computes_on_the_gpus_of_the_run():
    from vlmrl.config import config_notes
    from vlmrl.config.layout import embedded_engine_device
    from vlmrl.config.memory import phase_memory

    assert embedded_engine_device(load([])) == "cpu"
    gpu = load(GPU_EMBEDDED)
    assert embedded_engine_device(gpu) == "cuda"
    assert not any("embedded" in n for n in config_notes(gpu))
    # the host's CPU beside GPU trainers only when asked, said at start, and out of the GPU plan
    host = load([*GPU_EMBEDDED, "rollout.embedded.device=cpu"])
    assert embedded_engine_device(host) == "cpu"
    assert any("rollout.embedded.device=cpu" in n for n in config_notes(host))

    def engine_parts(cfg):
        return {name for ph in phase_memory(cfg) for name, _ in ph.parts if "engine" in name}

    assert "engine weights" in engine_parts(gpu)
    assert not engine_parts(host)


def test_the_lr_schedule_spans_the_steps_the_run_takes():
    from vlmrl.config.layout import scheduled_steps

    # GRPO: the SFT warm-up, then the RL steps
    assert scheduled_steps(load(["num_steps=40", "algo.sft_steps=60"])) == 100
    # SFT alone runs num_steps supervised steps; algo/sft.yaml's sft_steps is not run
    cfg = load(["algo=sft", "num_steps=140"])
    assert cfg.algo.sft_steps > 0 and scheduled_steps(cfg) == 140


def test_fewer_layers_of_a_model_preset_keep_its_first_layers():
    """`model=qwen3_5_35b_a3b model.lm.num_layers=4` is the reference model's first four layers
    (three Gated DeltaNet, one gated attention) at every other published width; a layer list
    that follows no full-attention interval is not cut but refused by validation."""
    cfg = load(["model=qwen3_5_35b_a3b", "model.lm.num_layers=4"])
    assert cfg.model.lm.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.model.lm.num_experts == 256 and cfg.model.lm.vocab_size == 248320 and cfg.model.vision.depth == 27
    with pytest.raises(ConfigError, match="layer-types"):
        load(["model=tiny_qwen3_5_moe", "model.lm.num_layers=2",
              "model.lm.layer_types=[full_attention,linear_attention,linear_attention]"])


def test_prompts_are_shared_on_cpu_ranks_unless_told_otherwise():
    """`trainer.share_prompts` null: on for CPU ranks without CP, off on GPUs (opt-in there)."""
    from vlmrl.config.layout import shares_prompts

    assert shares_prompts(load([]))
    assert not shares_prompts(load(["trainer.share_prompts=false"]))
    assert not shares_prompts(load(["parallel.cp=2", "cluster.num_cpu_ranks=2"]))
    assert not shares_prompts(load(REFERENCE))
    assert shares_prompts(load([*GPU_DENSE, "trainer.share_prompts=true"]))

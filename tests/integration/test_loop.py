"""The RL loop end to end on CPU: real Ray, Megatron over gloo, the embedded engine.

Short runs of the loop's variants (parallel layouts, SGLang's protocol, faults, async,
colocation, SFT); the default run's own outputs (summary, metrics, plots, checkpoint, HF
export) are checked on the learning run in test_learning.py. The weight-sync parity check
drives the trainer and engine directly.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

SHORT = [
    # SFT batches of 8, not the default 32: the warm-up only has to run (a full-recompute
    # micro-batch-1 layout takes seconds per SFT sample on two cores)
    "num_steps=2", "algo.sft_steps=2", "algo.sft_batch_size=8", "eval_interval=0", "rollout.eval.max_prompts=8",
    "rollout.batch_size=4", "algo.n_samples_per_prompt=4", "trainer.global_batch_size=8",
    "rollout.max_new_tokens=12", "logger.wandb=false", "logger.progress=false", "save_hf=true",
    "data.synthetic.num_train=64", "data.synthetic.num_test=16",
]

# where a sync's time went, as rank 0's transport timed it (SGLang's protocol only)
SYNC_PHASES = [f"perf/update_weights_{p}_s" for p in ("gather_convert", "serialize", "engines", "barrier")]


def _config(tmp: Path, cache_dir: str, extra: list[str]) -> object:
    from vlmrl.config import load

    return load([f"run_dir={tmp}", f"model.cache_dir={cache_dir}", *SHORT, *extra])


# Qwen2.5-VL's case is slow (the suite's time budget): the default run checks its engine
# against the trainer after every sync and loads its HF export (test_learning.py)
@pytest.mark.parametrize("model", [pytest.param("tiny", marks=pytest.mark.slow), "tiny_qwen3_5_moe"])
def test_weight_sync_gives_engine_the_trainer_logprobs(tmp_path, cache_dir, model):
    """After SFT steps change the weights and a sync, the engine's logprobs of what it
    generates equal the trainer's on the same tokens (fp32 CPU, <= 1e-5); the HF export
    (`save_hf`) loads with transformers' class of the family, with the family's processor
    class, and gives the same logprobs."""
    import ray

    from vlmrl.cluster.placement import create_placement
    from vlmrl.cluster.ray_cluster import ray_cluster
    from vlmrl.cluster.trainer_group import TrainerGroup
    from vlmrl.config.layout import compute_layout
    from vlmrl.experience import rollout_prompt, sft_samples, train_samples
    from vlmrl.loop import Loop

    cfg = _config(tmp_path, cache_dir, ["logger.jsonl=false", f"model={model}"])
    loop = Loop(cfg)
    loop._setup()
    with ray_cluster(cfg, tmp_path):
        # every worker keeps its compiled kernels in the run's compile cache (unless the user set one)
        worker_env = ray.get(ray.remote(lambda: {k: os.environ.get(k) for k in (
            "TORCHINDUCTOR_CACHE_DIR", "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED")}).remote())
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) == default_cache_dir():
            assert worker_env == {"TORCHINDUCTOR_CACHE_DIR": f"{cfg.model.cache_dir}/compile/inductor",
                                  "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1"}
        loop.placement = create_placement(cfg, compute_layout(cfg))
        loop._start_engines()
        # not waited for: the first collective call waits for the ranks' start-up
        trainer = TrainerGroup(cfg, loop.model_path, total_steps=4, placement=loop.placement, wait=False)
        loop.trainer = trainer
        for _ in range(2):
            trainer.sft_step(sft_samples(loop.processor, loop.train_data.sample_batch(8)))
        loop._sync_weights("after-sft")
        prompts = loop.train_data.sample_batch(3)
        batch = loop.rollout.run([rollout_prompt(p) for p in prompts], step=0)
        samples, _ = train_samples(loop.processor, {p.index: p for p in prompts}, batch.records,
                                   [0.0] * len(batch.records))
        assert samples
        trainer_lp = trainer.logprobs(samples)
        engine_lp = [torch.tensor(s.rollout_logprobs) for s in samples]
        diff = max(float((a - b).abs().max()) for a, b in zip(trainer_lp, engine_lp))
        assert diff <= 1e-5, diff
        loop._save_hf()
        export_lp = _hf_logprobs(tmp_path / "hf", samples, cfg)
        diff = max(float((a - b).abs().max()) for a, b in zip(trainer_lp, export_lp))
        assert diff <= 1e-5, diff
        trainer.shutdown()
        ray.get([a.close.remote() for a in loop.engine_group.sync_targets])
    loop.pool.close()
    # the cluster's short socket-path link in /tmp went with it
    ray_dir = str((tmp_path / "ray").resolve())
    assert not [p for p in Path("/tmp").glob("vlmrl-ray-*") if p.is_symlink() and os.readlink(p) == ray_dir]


def _hf_logprobs(path: Path, samples: list, cfg) -> list[torch.Tensor]:
    """Teacher-forced logprobs of the loss-masked tokens under an exported HF checkpoint."""
    from transformers import AutoModelForImageTextToText

    from vlmrl.models import families
    from vlmrl.models.processor import load_processor

    expected = families.get(cfg.model.family).PROCESSOR_CLASS
    assert json.loads((path / "processor_config.json").read_text())["processor_class"] == expected
    assert type(load_processor(str(path))).__name__ == expected
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    assert isinstance(hf, families.get(cfg.model.family).hf_model_class(cfg.model))
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.input_ids])
            kwargs = {}
            if s.pixel_values is not None:
                kwargs = dict(pixel_values=s.pixel_values, image_grid_thw=s.image_grid_thw,
                              mm_token_type_ids=(ids == cfg.model.image_token_id).long())
            logits = hf(input_ids=ids, **kwargs).logits[0, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
            out.append(logp[torch.tensor(s.loss_mask[1:]) > 0])
    return out


def test_sft_algorithm_runs_through_the_same_entry(tmp_path, cache_dir):
    from vlmrl.loop import train

    summary = train(_config(tmp_path, cache_dir, ["algo=sft", "num_steps=2", "save_hf=false"]))
    assert summary["sft_steps"] == 2 and summary["rl_steps"] == 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "sft/loss" in r] == [1, 2]


def test_placement_bundles_follow_the_layout():
    from vlmrl.cluster.placement import bundles
    from vlmrl.config import compute_layout, load

    cfg = load(["experiment=geo3k_qwen35"])
    spec, trainer, engines = bundles(cfg, compute_layout(cfg))
    assert len(spec) == 8 and all(b == {"GPU": 1.0, "CPU": 1.0} for b in spec)
    assert trainer == list(range(8)) and engines == [0]
    cfg = load(["hardware=h200", "rollout=sglang", "model=qwen2_5_vl_3b", "cluster.num_gpus=8",
                "cluster.trainer_gpus=4", "rollout.num_gpus=4", "rollout.gpus_per_engine=2",
                "trainer.global_batch_size=32"])
    spec, trainer, engines = bundles(cfg, compute_layout(cfg))
    assert trainer == [0, 1, 2, 3] and engines == [4, 6]
    cfg = load(["cluster.num_cpu_ranks=2"])
    spec, trainer, engines = bundles(cfg, compute_layout(cfg))
    assert spec == [{"CPU": 0.5}] * 3 and trainer == [0, 1] and engines == [2]


# TP2 and CP2 are slow (`make test-all`): the default suite runs the loop under TP2 + SP in
# the reference recipe's run below, and both layouts' numerics against HF in the parity
# tests; PP2's loop run has no other default-suite test and stays
@pytest.mark.parametrize("layout", [pytest.param(["parallel.tp=2"], marks=pytest.mark.slow), ["parallel.pp=2"],
                                    pytest.param(["parallel.cp=2"], marks=pytest.mark.slow)],
                         ids=["tp2", "pp2", "cp2"])
def test_loop_with_model_parallel_trainer(tmp_path, cache_dir, layout):
    """Two trainer ranks that split the model (TP, PP) or the sequence (CP): the loop trains, the gathered
    weights reach the engine (its logprobs equal the trainer's after each sync) and the
    sharded checkpoint is written. The second step is traced on both ranks
    (`profile_steps`)."""
    from vlmrl.logging.metrics import read_metrics
    from vlmrl.loop import train
    from vlmrl.training.checkpoint import find_latest

    summary = train(_config(tmp_path, cache_dir, ["cluster.num_cpu_ranks=2", "save_hf=false", "save_interval=2",
                                                  "profile_steps=[2]", *layout]))
    # the traced step alone, each rank's trace naming the trainer's phases, and its operator table
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["rl_step_2"]
    from vlmrl.bench.step_trace import summarize

    for rank in (0, 1):
        with gzip.open(tmp_path / "profile" / "rl_step_2" / f"rank{rank}.json.gz", "rt") as f:
            stages = [r["stage"] for r in summarize(json.load(f)["traceEvents"])["stages"]]
        assert {"step", "vlmrl.forward_backward", "vlmrl.optimizer_step"} <= set(stages), rank  # as step-trace reads it
        assert "Self CPU" in (tmp_path / "profile" / "rl_step_2" / f"rank{rank}.txt").read_text()
    # the driver's loop: the step's stages in its stats, the step itself at the top of its table
    import pstats

    driver = {fn for _, _, fn in pstats.Stats(str(tmp_path / "profile" / "rl_step_2" / "driver.prof")).stats}
    assert {"rl_step", "_rollout", "_experience", "_train", "_sync_weights"} <= driver
    assert "(rl_step)" in (tmp_path / "profile" / "rl_step_2" / "driver.txt").read_text()
    assert summary["rl_steps"] == 2
    # rank 0's start, part by part, in the summary (and its file)
    start = json.loads((tmp_path / "summary.json").read_text())["trainer_start_s"]
    assert {"imports", "build", "check_gdn", "check_attention", "load_weights", "ddp", "optimizer"} <= set(start)
    assert all(v >= 0 for v in start.values()) and start["build"] > 0
    rl = [r for r in read_metrics(tmp_path) if "rl_step" in r]
    assert [r["rl_step"] for r in rl] == [1, 2]
    assert all(r["train/train_rollout_logprob_abs_diff"] <= 1e-5 for r in rl), rl
    assert all(r["train/grad_norm"] >= 0 for r in rl)  # zero when every group's rewards tie
    assert find_latest(tmp_path / "checkpoints") is not None


def test_colocated_loop_order(tmp_path, cache_dir, monkeypatch):
    """The colocated step's order: engines release weights and KV cache before training,
    take the weights back for the sync and the KV cache after it. The embedded engine
    refuses weight updates while its weights are released and generation while anything
    is, so a wrong order fails the run. Colocation is a GPU mode (the config rules refuse
    it with hardware=cpu); this run skips the rules to drive the same loop code on CPU.

    The engine's process is killed twice (SIGKILL), with direct Ray calls to its actor:
    - mid-way through step 1's rollout: the manager sees it down, the loop starts a new engine,
      which gives back its KV cache while the trainer comes onto the GPU to sync it the current
      weights and leaves again; the lost requests are retried there and every group completes;
    - the restarted process in its second memory release (step 1's move into training), as
      SGLang's scheduler has: the group restarts it, makes it give back what the others gave
      back, and the loop syncs it the trainer's weights before it generates again.
    Every sample still matches the trainer's logprobs (none came from stale or initial weights)
    and carries the synced weight version; both restarts and the retries are counted in step 1.
    The same over SGLang's protocol, with a sync that dies too, is a test below."""
    from vlmrl.config import load
    from vlmrl.config.memory import trainer_offload
    from vlmrl.logging.metrics import read_metrics
    from vlmrl.loop import train
    from vlmrl.rollout.faults import KILL_ENGINE_ENV, KILL_ENGINE_ON_RELEASE_ENV

    in_release, mid_rollout = tmp_path / "killed-in-release", tmp_path / "killed-mid-rollout"
    monkeypatch.setenv(KILL_ENGINE_ON_RELEASE_ENV, f"2:{in_release}")
    # 8 eval requests come first; the 12th is in step 1's rollout of 4 x 4
    monkeypatch.setenv(KILL_ENGINE_ENV, f"12:{mid_rollout}")
    # trainer.offload=true: the loop makes every trainer move of a GPU run (the copy out staged
    # before the sync, offload, onload) through the Ray workers; a CPU rank answers "off"
    cfg = load([f"run_dir={tmp_path / 'run'}", f"model.cache_dir={cache_dir}", *SHORT, "save_hf=false",
                "cluster.colocate=true", "trainer.offload=true", "rollout.max_retries=4"], check_rules=False)
    assert cfg.cluster.colocate and trainer_offload(cfg)
    summary = train(cfg)
    assert in_release.exists() and mid_rollout.exists()  # the engine did die, twice
    assert in_release.read_text() != mid_rollout.read_text()  # (two processes: their pids)
    assert summary["rl_steps"] == 2
    rl = [r for r in read_metrics(tmp_path / "run") if "rl_step" in r]
    assert [r["rollout/engine_restarts"] for r in rl] == [2, 0] and rl[0]["rollout/retries"] >= 1, rl
    for r in rl:
        assert r["train/train_rollout_logprob_abs_diff"] <= 1e-5, rl
        assert r["rollout/dropped_groups"] == 0 and r["rollout/stale_samples"] == 0, rl
        assert r["rollout/prompt_mismatch_samples"] == 0, rl
        # the sync's phases are timed by the HTTP transport only (the SGLang-protocol test below)
        assert not any(k in r for k in [*SYNC_PHASES, "perf/update_weights_buckets"]), r
    # every step moved the trainer in for training and staged its copy out before the sync; the second
    # step moved it out before its rollout (the first found it out: the evaluation after the warm-up
    # had moved it, and a step's row holds the moves made in the step)
    assert all(r["perf/onload_time"] > 0 and r["perf/offload_stage_time"] > 0 for r in rl), rl
    assert rl[0]["perf/offload_time"] == 0 and rl[1]["perf/offload_time"] > 0, rl
    # the same moves by the phase they entered, which splits each step into generation, training and
    # the rest (`python -m vlmrl.bench step-phases`)
    from vlmrl.bench.step_phases import main as step_phases
    from vlmrl.bench.step_phases import split

    for r in rl:
        s = split(r)
        assert s["move_generate"] >= r["perf/offload_time"] and s["move_train"] >= r["perf/onload_time"], (s, r)
        assert s["move_sync"] >= r["perf/offload_stage_time"], (s, r)
        assert 0 < s["generate"] <= r["perf/rollout_time"] and 0 < s["train"] < r["perf/train_time"], (s, r)
        assert s["experience"] > 0 and s["loop"] >= 0, (s, r)
        assert abs(s["generate"] + s["train"] + s["outside"] - s["step"]) < 1e-9, (s, r)
    assert step_phases([str(tmp_path / "run"), "--out", str(tmp_path / "phases.md")]) == 0
    assert (tmp_path / "phases.md").read_text().count("\n| ") == 2 + len(rl)  # header, steps, the mean


def test_colocated_engines_that_stay_move_nothing(tmp_path, cache_dir):
    """cluster.release_engines=false: the engines keep their memory and the trainer its state
    through the step. No release, resume, offload or onload in any step, the engine never
    restarted, and the weights it serves are the trainer's after each sync, written in place
    (the embedded engine's samples match the trainer's logprobs). Driven on CPU as the test
    above is, the config rules skipped."""
    from vlmrl.config import load
    from vlmrl.logging.metrics import read_metrics
    from vlmrl.loop import train

    short = [o for o in SHORT if not o.startswith(("num_steps=", "algo.sft_steps=", "save_hf="))]
    cfg = load([f"run_dir={tmp_path / 'run'}", f"model.cache_dir={cache_dir}", *short, "num_steps=2",
                "algo.sft_steps=1", "save_hf=false", "save_final=false", "cluster.colocate=true",
                "cluster.release_engines=false"], check_rules=False)
    summary = train(cfg)
    assert summary["rl_steps"] == 2
    rl = [r for r in read_metrics(tmp_path / "run") if "rl_step" in r]
    assert len(rl) == 2
    for key in ("perf/engine_release_time", "perf/engine_resume_time", "perf/offload_time", "perf/onload_time"):
        assert all(not r.get(key) for r in rl), (key, rl)
    assert all(r["train/train_rollout_logprob_abs_diff"] <= 1e-5 and not r["rollout/engine_restarts"] for r in rl), rl


RECIPE_ON_CPU = ["experiment=geo3k_qwen35", "model=tiny_qwen3_5_moe", "hardware=cpu", "rollout=embedded",
                 "data=synthetic", "cluster.num_gpus=0", "cluster.colocate=false", "cluster.num_cpu_ranks=2",
                 "rollout.num_gpus=0", "rollout.gpus_per_engine=1", "parallel.ep=2", "save_interval=2",
                 "save_hf=false", "eval_interval=2", "rollout.eval.max_prompts=4"]


# TP4 runs four trainer ranks on CI's two cores (about 90 s): slow, so `make test-all` runs
# it; the default suite keeps TP4's numerics and bitwise weight round trip
# (test_qwen35_parity.py::test_tp_wider_than_the_kv_groups) and the recipe's own TP2. CP2 is
# slow too (the suite's time budget): its numerics against HF and its trainer step (both
# families) stay in the default suite, in the parity and trainer tests.
@pytest.mark.parametrize("layout", [["algo.routing_replay=rollout"],
                                    pytest.param(["parallel.tp=1", "parallel.sequence_parallel=false",
                                                      "parallel.cp=2"], marks=pytest.mark.slow),
                                    pytest.param(["parallel.tp=4", "cluster.num_cpu_ranks=4"],
                                                 marks=pytest.mark.slow)],
                         ids=["tp2+sp+ep2+replay", "cp2+ep2", "tp4+sp+ep2"])
def test_reference_recipe_in_miniature(tmp_path, cache_dir, layout):
    """`experiment=geo3k_qwen35` with the tiny Qwen3.5-MoE on CPU ranks: the recipe's layout
    (TP2 + SP, EP2 for the experts, full recompute, micro-batch 1), a CP2 run, and TP4 (wider
    than the model's 2 KV groups, as `parallel.tp=4` on the full model) on four ranks. Each
    does rollout, rewards, training, weight sync (engine logprobs equal the trainer's after
    every sync), evaluation and a checkpoint, and reports the MoE routing metrics. The first
    also replays the engine's experts (`algo.routing_replay=rollout`): the engine reports them
    with every sample, and the trainer measures its own router's disagreement (none here: the
    same fp32 weights on both sides)."""
    from vlmrl.config import load
    from vlmrl.logging.metrics import read_metrics
    from vlmrl.loop import train
    from vlmrl.training.checkpoint import find_latest

    cfg = load([f"run_dir={tmp_path}", f"model.cache_dir={cache_dir}", *RECIPE_ON_CPU, *SHORT, "save_hf=false",
                *layout])
    assert cfg.parallel.name == "moe_ep8" and cfg.parallel.recompute_granularity == "full"
    assert cfg.reward.name == "geo3k_tol05" and cfg.model.family == "qwen3_5_moe"
    summary = train(cfg)
    assert summary["rl_steps"] == 2
    rows = read_metrics(tmp_path)
    rl = [r for r in rows if "rl_step" in r]
    assert all(r["train/train_rollout_logprob_abs_diff"] <= 1e-5 for r in rl), rl
    assert any("eval/synthetic" in r for r in rows)
    for r in rl:
        layers = [k for k in r if k.startswith("moe/imbalance/layer_")]
        assert len(layers) == cfg.model.lm.num_layers, layers
        assert all(1.0 <= r[k] <= cfg.model.lm.num_experts / cfg.model.lm.moe_router_topk + 1e-9 for k in layers)
        assert r["moe/dropped_frac"] == 0.0  # no capacity factor: nothing dropped
        assert r["perf/fwd_gdn_s"] > 0 and r["perf/fwd_attention_s"] > 0 and r["perf/fwd_moe_s"] > 0
        replayed = cfg.algo.routing_replay == "rollout"
        assert ("moe/route_mismatch_mean" in r) == replayed
        if replayed:
            assert r["rollout/bad_routed_experts_samples"] == 0
            assert len([k for k in r if k.startswith("moe/route_mismatch/layer_")]) == cfg.model.lm.num_layers
            assert r["moe/route_mismatch_max"] <= 0.01, r["moe/route_mismatch_max"]
    assert find_latest(tmp_path / "checkpoints") is not None


# eight ranks on CI's two cores (minutes): `make test-all` runs it
@pytest.mark.slow
def test_reference_recipe_layout_on_eight_cpu_ranks(tmp_path, cache_dir, monkeypatch):
    """The recipe's own layout, not a miniature of it: eight gloo processes, TP2 + SP, EP8 (the
    tiny model's eight experts, one a rank: the expert group spans all four data-parallel
    ranks), full recompute, micro-batch 1. The step's samples are split over the data-parallel
    ranks by tokens, so the ranks' micro-batch counts differ from step to step: each rank runs
    as many (fillers where it has fewer). The engine is killed in the middle of step 1's rollout
    with no retries, so that step loses the groups in flight and trains on what is left (the
    engine restarted and synced). Two GRPO steps after the SFT warm-up with a checkpoint, the
    engine's logprobs equal to the trainer's after every sync, then a resume to step 3."""
    from vlmrl.config import compute_layout, load
    from vlmrl.logging.metrics import read_metrics
    from vlmrl.loop import train
    from vlmrl.rollout.faults import KILL_ENGINE_ENV

    marker = tmp_path / "engine-killed"
    # 8 eval requests after the warm-up come first, four at a time; the 14th request is in the
    # last wave of step 1's rollout of 4 x 4: the groups in flight then are lost, the others kept
    monkeypatch.setenv(KILL_ENGINE_ENV, f"14:{marker}")
    args = [f"run_dir={tmp_path / 'run'}", f"model.cache_dir={cache_dir}", *RECIPE_ON_CPU, *SHORT, "save_hf=false",
            "cluster.num_cpu_ranks=8", "parallel.ep=8", "rollout.max_retries=0", "rollout.max_in_flight=4"]
    cfg = load(args)
    layout = compute_layout(cfg)
    assert (layout.trainer_world_size, layout.dp, cfg.parallel.tp, cfg.parallel.ep) == (8, 4, 2, 8)
    assert train(cfg)["rl_steps"] == 2
    assert marker.exists()
    assert train(load([*args, "num_steps=3"]))["rl_steps"] == 3
    rl = [r for r in read_metrics(tmp_path / "run") if "rl_step" in r]
    assert [r["rl_step"] for r in rl] == [1, 2, 3]
    assert rl[0]["rollout/dropped_groups"] >= 1 and rl[0]["rollout/engine_restarts"] == 1, rl[0]
    assert all(r["train/train_rollout_logprob_abs_diff"] <= 1e-5 for r in rl), rl
    assert all(r["perf/micro_batches"] >= 1 for r in rl)


def test_control_rewards_are_evaluated_for_correctness(tmp_path, cache_dir):
    """`reward=coin_flip` trains on coin flips but evaluates with the math verifier: an
    evaluation scored by the training reward would measure the coin."""
    from vlmrl.loop import Loop
    from vlmrl.rewards.control import CoinFlipVerifier
    from vlmrl.rewards.math import MathVerifier

    loop = Loop(_config(tmp_path, cache_dir, ["reward=coin_flip"]))
    loop._setup()
    try:
        assert isinstance(loop.pool.scorer, CoinFlipVerifier)
        assert isinstance(loop.eval_pool.scorer, MathVerifier)
        assert loop.eval_pool.score(["Answer: \\boxed{4}"] * 8, ["4"] * 8) == [1.0] * 8
    finally:
        loop.pool.close()


def test_a_format_requirement_shapes_the_training_reward_not_the_evaluation(tmp_path, cache_dir):
    """`reward=answer_only` gives a junk-prefixed right answer 0 in training; evaluations
    still score the answer (an evaluation under the format rule would measure the format)."""
    from vlmrl.loop import Loop

    loop = Loop(_config(tmp_path, cache_dir, ["reward=answer_only"]))
    loop._setup()
    try:
        replies, labels = ["Answer: \\boxed{4}", "Answer 146Answer: \\boxed{4}"], ["4", "4"]
        assert loop.pool.score(replies, labels) == [1.0, 0.0]
        assert loop.eval_pool.score(replies, labels) == [1.0, 1.0]
        assert loop.eval_pool.scorer.format_pattern is None
    finally:
        loop.pool.close()



def test_engine_killed_in_a_sync_and_mid_rollout_over_sglangs_protocol_under_tensor_parallelism(
        tmp_path, cache_dir, monkeypatch):
    """The loop over SGLang's protocol (rollout.embedded.serve_http), as with SGLang servers:
    generation, memory calls and the weight sync through the SGLang client, from two TP ranks
    over the broadcast group engines on their own devices use, in 1 MB buckets. Its engine
    process is killed twice (kill -9):

    - at the warm-up sync's second bucket. Each bucket is gathered over the TP group before
      rank 0 sends it, so rank 1 must not go on to the next bucket's gather while rank 0 has
      left the sync: every rank stops at that bucket, rank 0's failure reaches both, the engine
      is restarted, the whole sync is sent again, and training goes on. (Before, rank 1 waited
      in the next gather while rank 0 waited in the error's broadcast; before that, the sync's
      error ended the run.)
    - by its restarted process mid-way through step 1's rollout: restarted and synced again,
      the lost requests retried, nothing dropped.

    Both engines after a restart generate from the synced weights (their logprobs are the
    trainer's); both restarts are counted in step 1. The engines refuse a caller without the
    run's key, which is kept out of every file of the run but its own."""
    import urllib.error
    import urllib.request

    from vlmrl.logging.metrics import read_metrics
    from vlmrl.loop import Loop, train
    from vlmrl.rollout.faults import KILL_ENGINE_ENV, KILL_ENGINE_ON_SYNC_ENV

    refused = []
    start = Loop._start_engines

    def start_and_probe(self):  # a caller without the run's engine key, as soon as the engines are up
        start(self)
        for url in self.engine_group.sync_targets:
            for path in ("/release_memory_occupation", "/update_weights_from_tensor", "/generate"):
                req = urllib.request.Request(url + path, data=b"{}", headers={"Content-Type": "application/json"})
                try:
                    urllib.request.urlopen(req, timeout=30)
                except urllib.error.HTTPError as e:
                    refused.append(e.code)

    monkeypatch.setattr(Loop, "_start_engines", start_and_probe)
    in_sync, mid_rollout = tmp_path / "killed-in-sync", tmp_path / "killed-mid-rollout"
    monkeypatch.setenv(KILL_ENGINE_ON_SYNC_ENV, f"2:{in_sync}")  # the warm-up sync's second bucket
    # the restarted process: 8 eval requests first; the 12th is in step 1's rollout of 4 x 4
    monkeypatch.setenv(KILL_ENGINE_ENV, f"12:{mid_rollout}")
    run = tmp_path / "run"
    train(_config(run, cache_dir, ["rollout.embedded.serve_http=true", "cluster.num_cpu_ranks=2", "parallel.tp=2",
                                   "rollout.weight_update_bucket_mb=1", "rollout.max_retries=4", "save_hf=false"]))
    assert in_sync.exists() and mid_rollout.exists()  # both engine processes did die
    assert in_sync.read_text() != mid_rollout.read_text()  # (their pids)
    rows = [r for r in read_metrics(run) if "rl_step" in r]
    assert [r["rl_step"] for r in rows] == [1, 2]
    assert [r["rollout/engine_restarts"] for r in rows] == [2, 0]
    assert rows[0]["rollout/retries"] >= 1
    for r in rows:
        assert r["rollout/dropped_groups"] == 0 and r["rollout/stale_samples"] == 0
        assert r["rollout/prompt_mismatch_samples"] == 0
        assert r["train/train_rollout_logprob_abs_diff"] < 1e-4
        # where the sync's time went, as rank 0's transport timed it
        assert r["perf/update_weights_buckets"] >= 3 and all(r[k] >= 0 for k in SYNC_PHASES)
        assert sum(r[k] for k in SYNC_PHASES) <= r["perf/update_weights_time"]
    assert refused == [401, 401, 401]  # the engine refused the keyless caller and the run went on
    from vlmrl.rollout.auth import KEY_FILE

    key_file = run / KEY_FILE
    assert oct(key_file.stat().st_mode & 0o777) == "0o600"
    key = key_file.read_text().strip()
    leaks = [p for p in run.rglob("*") if p.is_file() and p != key_file and key.encode() in p.read_bytes()]
    assert not leaks, leaks  # not in the config, the metrics, the logs or the checkpoints


def test_all_equal_groups_leave_the_policy_exactly_where_it_was(tmp_path, cache_dir, tiny_checkpoint):
    """reward=constant scores every response 0.9 (a format score: well-formed and wrong), so
    every group is all-equal. Through the whole loop (reward pool, float64 advantages, packed
    micro-batches, the policy loss, Adam) nothing may move: the policy loss and gradient
    are exactly zero and the exported weights are the starting checkpoint's, bit for bit."""
    from safetensors.torch import load_file

    from vlmrl.logging.metrics import read_metrics
    from vlmrl.loop import train

    train(_config(tmp_path, cache_dir, ["reward=constant", "algo.sft_steps=0", "num_steps=2",
                                        "trainer.global_batch_size=8"]))  # two optimizer steps per rollout
    rows = [r for r in read_metrics(tmp_path) if "rl_step" in r]
    assert [r["rl_step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/raw_reward"] == pytest.approx(0.9) and r["rollout/accuracy"] == 0.0
        assert r["train/pg_loss"] == 0.0 and r["train/grad_norm"] == 0.0
    start = load_file(str(Path(tiny_checkpoint) / "model.safetensors"))
    end = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert start.keys() == end.keys()
    moved = [k for k in start if not torch.equal(start[k], end[k])]
    assert not moved, moved[:5]


def test_async_rollout_with_dynamic_sampling_trains_off_policy_and_resumes_its_draws(tmp_path, cache_dir,
                                                                                      monkeypatch):
    """With cluster.async_rollout the next rollout overlaps training: from step 2 on the
    samples come from the weights before the last update. PPO's old policy is recomputed by
    the trainer (so one optimizer step per rollout stays exactly on-policy: ppo_kl 0), and
    the off-policy gap shows where it belongs: the train/rollout logprob mismatch and the
    TIS weights move off the values of the run's first step, whose rollout had no training
    to overlap (synchronous: the default run keeps those values at every step, test_learning),
    and masked importance sampling (algo.mis) drops tokens only then.

    Dynamic sampling in the same run (the next step's rounds are drawn while this step trains):
    each step trains on rollout.batch_size kept groups drawn over up to three rounds, logs its
    sampling figures, and the groups it trains on are the informative ones. A run resumed from
    the checkpoint after step 1 starts step 2's rollout where the uninterrupted run did (the
    overlapped rollout had drawn past it): the same prompts first. The reward is the coin-flip
    control, scored inline, so about one group in eight of four replies is all-equal."""
    from vlmrl.data.prompts import PromptDataset
    from vlmrl.logging.metrics import read_metrics
    from vlmrl.loop import Loop, train

    draws: list[tuple[int, list[int]]] = []  # (step the rollout is for, rows drawn), per round
    rollout, sample_batch = Loop._rollout, PromptDataset.sample_batch
    current: list[int] = []

    def spy_rollout(self, step):
        current.append(step)
        return rollout(self, step)

    def spy_draw(self, n):
        out = sample_batch(self, n)
        if self.split == "train" and current:
            draws.append((current[-1], [p.index for p in out]))
        return out

    monkeypatch.setattr(Loop, "_rollout", spy_rollout)
    monkeypatch.setattr(PromptDataset, "sample_batch", spy_draw)
    # one optimizer step a rollout (16 samples); a full SFT batch of 32 makes the warm-up's Adam
    # moments large enough for the off-policy gap to show; no KL term, whose pull back to the
    # warm-up policy would shrink that gap
    dynamic = ["reward=coin_flip", "reward.num_workers=0", "algo.filter_groups=equal_reward",
               "rollout.oversample=1.5", "rollout.max_rounds=3", "cluster.async_rollout=true", "save_hf=false",
               "save_interval=1", "num_steps=3", "trainer.global_batch_size=16", "algo.kl_coef=0", "algo.sft_steps=1",
               "algo.sft_batch_size=32", "algo.tis=true", "algo.mis=token", "algo.mis_low=0.9",
               "algo.mis_high=1.1"]
    straight = tmp_path / "straight"
    train(_config(straight, cache_dir, dynamic))
    rows = [r for r in read_metrics(straight) if "rl_step" in r]
    assert [r["rl_step"] for r in rows] == [1, 2, 3]
    assert all(r["train/ppo_kl"] == 0.0 for r in rows)
    diff = [r["train/train_rollout_logprob_abs_diff"] for r in rows]
    tis = [abs(r["train/tis_mean"] - 1.0) for r in rows]
    # step 1, engine vs trainer numerics only: the same weights generated and scored
    assert diff[0] < 1e-5 and tis[0] < 1e-3, (diff, tis)
    # one step off-policy: the rollout's weights are one update behind the trainer's, and the TIS
    # weights move off 1 (their mean: weights above and below 1 partly cancel; 8e-8 on-policy,
    # 7.5e-4 to 4.8e-3 off it on two machines' thread counts)
    assert min(diff[1:]) > 1e-3, diff
    assert min(tis[1:]) > 1e-4, tis
    # MIS with a band of +-10% (the coin-flip reward trains every step, so the policy moves far): nothing
    # masked on-policy, the farthest tokens masked off-policy
    mis = [r["train/mis_masked_frac"] for r in rows]
    assert mis[0] == 0.0 and min(mis[1:]) > 0.0 and max(mis) < 1.0, mis
    # the engines report the weight version of each sample: staleness is tracked
    samples = 4 * 4  # rollout.batch_size x n_samples_per_prompt
    assert [r["rollout/stale_samples"] for r in rows] == [0, samples, samples]
    for r in rows:
        assert r["rollout/kept_groups"] == 4 and r["rollout/sampling_bound_hit"] == 0, r
        assert r["rollout/prompts_drawn"] >= 6 and 1 <= r["rollout/sampling_rounds"] <= 3, r
        assert r["rollout/filtered_groups"] + r["rollout/kept_groups"] + r["rollout/surplus_groups"] \
            <= r["rollout/prompts_drawn"], r
        assert r["train/loss"] == r["train/loss"] and r["rollout/dropped_groups"] == 0
    trained = [json.loads(x) for x in (straight / "samples.jsonl").read_text().splitlines()]
    by_group: dict[tuple[int, int], set[float]] = {}
    for s in trained:
        if s["kind"] == "rollout":
            by_group.setdefault((s["step"], s["group"]), set()).add(s["reward"])
    assert by_group and all(len(rewards) > 1 for rewards in by_group.values())  # no all-equal group trained on
    first_of_step2 = next(rows_ for step, rows_ in draws if step == 1)
    assert sum(len(x) for _, x in draws) == sum(r["rollout/prompts_drawn"] for r in rows)

    draws.clear()
    current.clear()
    resumed = tmp_path / "resumed"
    checkpoint = straight / "checkpoints" / "step_000002"  # 1 SFT step + RL step 1
    train(_config(resumed, cache_dir, [*dynamic, f"resume={checkpoint}"]))
    assert [r["rl_step"] for r in read_metrics(resumed) if "rl_step" in r] == [2, 3]
    assert draws[0] == (1, first_of_step2)

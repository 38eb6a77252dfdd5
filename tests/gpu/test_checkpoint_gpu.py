"""A checkpoint of the trainer as it runs on GPUs: the bf16 Qwen3.5-MoE miniature (its Gated
DeltaNet decays and gated norm kept in float32) under Megatron's DistributedOptimizer (NCCL),
saved after a step in each of the optimizer-state formats and loaded into a fresh trainer, which then holds the same weights and
Adam moments and takes the same next step. The float32 parameters move in that step."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))


def _state(trainer) -> dict:
    # one torch Adam per DistributedOptimizer of the chain (dense and expert parameters apart)
    inners = [c.optimizer for c in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])]
    return {"params": [p.detach().float().cpu() for c in trainer.chunks for p in c.parameters()],
            "moments": [inner.state[p][k].detach().cpu() for inner in inners for g in inner.param_groups
                        for p in g["params"] for k in ("exp_avg", "exp_avg_sq")],
            "steps": sorted({float(inner.state[p]["step"]) for inner in inners for g in inner.param_groups
                             for p in g["params"] if "step" in inner.state[p]})}


def _worker(rank: int, world: int, cfg, path: str, ckpt: str) -> dict:
    from test_trainer import _sft_samples

    from vlmrl.training.checkpoint import load_checkpoint, save_checkpoint
    from vlmrl.training.trainer import MegatronTrainer

    samples = _sft_samples(cfg, path)
    first = MegatronTrainer(cfg, path)
    assert first.distributed_optimizer
    fp32 = {n: p.detach().clone() for c in first.chunks for n, p in c.named_parameters() if p.dtype == torch.float32}
    first.sft_step(samples)
    moved = {n: float((p.detach() - fp32[n]).abs().max()) for c in first.chunks for n, p in c.named_parameters()
             if n in fp32}
    save_checkpoint(first, ckpt)
    saved = _state(first)
    next_loss = first.sft_step(samples)["loss"]
    first.observer.close()
    del first
    second = MegatronTrainer(cfg, path)
    load_checkpoint(second, ckpt)
    loaded = _state(second)
    return {"params": max(float((a - b).abs().max()) for a, b in zip(saved["params"], loaded["params"])),
            "moments": max(float((a - b).abs().max()) for a, b in zip(saved["moments"], loaded["moments"])),
            "n_moments": len(loaded["moments"]), "next_loss": next_loss, "fp32_moved": moved,
            "steps": (saved["steps"], loaded["steps"]),
            "next_loss_loaded": second.sft_step(samples)["loss"]}


@pytest.mark.parametrize("fmt", ["dp_reshardable", "fully_reshardable"])
def test_distributed_optimizer_checkpoint_round_trip(tiny_moe_config, tiny_moe_checkpoint, tmp_path, fmt):
    from vlmrl.training.parallel_state import spawn_local

    hw = dataclasses.replace(tiny_moe_config.hardware, name="h200", device="cuda", dist_backend="nccl",
                             train_dtype="bfloat16", fused_kernels=False, cuda_graphs=False,
                             lm_attention_backend="sdpa", vision_attn_implementation="sdpa", gpu_memory_gb=141)
    model = dataclasses.replace(tiny_moe_config.model, dtype="bfloat16")
    cfg = dataclasses.replace(tiny_moe_config, hardware=hw, model=model,
                              trainer=dataclasses.replace(tiny_moe_config.trainer, checkpoint_format=fmt))
    res = spawn_local(_worker, 1, cfg, tiny_moe_checkpoint, str(tmp_path / "step_1"), backend="nccl",
                      timeout_s=600)[0]
    print(res)
    assert res["n_moments"] > 0
    # the float32 parameters of the bf16 model (Gated DeltaNet decays, its gated norm) take
    # part in the distributed optimizer's step
    moved = res["fp32_moved"]
    assert any(n.endswith("A_log") for n in moved) and all(v > 0 for v in moved.values()), moved
    assert res["params"] == 0.0 and res["moments"] == 0.0
    assert res["steps"][0] == res["steps"][1] == [1.0], res["steps"]  # torch Adam's counters come back
    assert res["next_loss_loaded"] == pytest.approx(res["next_loss"], rel=1e-3)


def test_host_memory_a_save_stages_is_given_back():
    """megatron-core's writer copies each tensor to the host with `.to("cpu", non_blocking=True)`:
    pinned blocks of torch's caching host allocator, which stay cached (resident and pinned) once
    freed. The real-width save on an H100 (bench/results/real-width.md) left the node's used host
    memory 42 GiB above where it was before the save until the process ended. After
    `release_host_memory` the process holds no more than before the copy."""
    import psutil

    from vlmrl.training.offload import release_host_memory

    proc, gib = psutil.Process(), float(1 << 30)
    x = torch.ones(1 << 30, dtype=torch.uint8, device="cuda")
    release_host_memory()
    before = proc.memory_info().rss
    staged = x.to("cpu", non_blocking=True)
    torch.cuda.synchronize()
    assert staged.is_pinned()
    del staged
    held = proc.memory_info().rss - before
    release_host_memory()
    kept = proc.memory_info().rss - before
    assert held > 0.9 * gib, held / gib  # the cache keeps the freed block
    assert kept < 0.1 * gib, kept / gib

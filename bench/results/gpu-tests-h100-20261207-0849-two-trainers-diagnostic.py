"""Diagnostic (not a project test): two trainers in one process on the GPU, the second built after an offloaded first."""
import dataclasses
import gc
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))


def _worker(rank, world, order, path, base):
    from test_trainer import _sft_samples

    from vlmrl.training.trainer import MegatronTrainer
    out, samples = [], None
    for name, tkw, hkw in order:
        cfg = dataclasses.replace(base, trainer=dataclasses.replace(base.trainer, **tkw),
                                  hardware=dataclasses.replace(base.hardware, **hkw))
        try:
            t = MegatronTrainer(cfg, path)
            samples = samples or _sft_samples(cfg, path)
            t.sft_step(samples)
            if tkw.get("offload"):
                t.stage_offload()
                t.offload()
                t.onload()
            t.sft_step(samples)
            t.observer.close()
            del t
            gc.collect()
            torch.cuda.empty_cache()
            out.append((name, "ok", torch.cuda.memory_reserved()))
        except Exception as e:  # noqa: BLE001
            out.append((name, f"FAILED {type(e).__name__}: {str(e)[:300]}", None))
            break
    return out


@pytest.mark.parametrize("graphs", [True, False])
def test_two_trainers(tiny_config, tiny_checkpoint, graphs):
    from vlmrl.training.parallel_state import spawn_local

    hw = dataclasses.replace(tiny_config.hardware, name="h200", device="cuda", dist_backend="nccl",
                             train_dtype="bfloat16", fused_kernels=True, cuda_graphs=graphs,
                             lm_attention_backend="sdpa", gpu_memory_gb=141)
    base = dataclasses.replace(tiny_config, hardware=hw)
    order = [("offload1", dict(offload=True, resident_gib=0.0, offload_overlap=False), {}),
             ("plain", dict(offload=False), {}),
             ("offload2", dict(offload=True, resident_gib=0.0, offload_overlap=True), {})]
    res = spawn_local(_worker, 1, order, tiny_checkpoint, base, backend="nccl", timeout_s=300)[0]
    print(f"graphs={graphs}:", res)

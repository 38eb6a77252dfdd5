"""The trainer's offload and memory figures on CPU ranks (gloo), and the optimizer state that
the offload creates at build time instead of at the first step.

On a CPU rank the state is in host memory already: `offload()` / `onload()` move nothing and
say why, `memory_stats()` reports zeros for device "cpu", and training goes on as before. The
optimizer state made up front (`init_optimizer_state`, which the GPU offload needs so that the
state exists inside its region) must give the same step, bit for bit, as torch's own lazy
creation at the first step, on Megatron's real optimizer.
"""

from __future__ import annotations

import dataclasses

from vlmrl.training.parallel_state import spawn_local


def _cpu_offload_worker(rank: int, world: int, cfg, path: str) -> dict:
    import torch
    from test_trainer import _sft_samples

    from vlmrl.training.offload import init_optimizer_state, optimizer_tensors
    from vlmrl.training.trainer import MegatronTrainer

    samples = _sft_samples(cfg, path)
    out: dict = {}
    lazy = MegatronTrainer(cfg, path)
    out["state_before_step"] = sum(len(s) for s in lazy.optimizer.optimizer.state.values())
    out["offload"] = lazy.offload()
    out["onload"] = lazy.onload()
    out["stats"] = lazy.memory_stats()
    out["initial"] = [p.detach().clone() for p in lazy.chunks[0].parameters()]
    first = lazy.sft_step(samples)
    second = lazy.sft_step(samples)
    out["lazy"] = ([first["loss"], second["loss"], first["grad_norm"], second["grad_norm"]],
                   [p.detach().clone() for p in lazy.chunks[0].parameters()])

    eager = MegatronTrainer(cfg, path)  # same seed, same checkpoint: same weights
    out["eager_initialised"] = init_optimizer_state(eager.optimizer)
    out["eager_state"] = {k: [float(v.abs().sum()) if torch.is_tensor(v) else v for v in s.values()]
                          for k, s in list(enumerate(eager.optimizer.optimizer.state.values()))[:1]}
    out["eager_tensors"] = sum(1 for _ in optimizer_tensors(eager.optimizer))
    first = eager.sft_step(samples)
    second = eager.sft_step(samples)
    out["eager"] = ([first["loss"], second["loss"], first["grad_norm"], second["grad_norm"]],
                    [p.detach().clone() for p in eager.chunks[0].parameters()])
    return out


def test_cpu_trainer_reports_offload_off_and_eager_optimizer_state_matches_lazy(tiny_config, tiny_checkpoint):
    # trainer.offload=true is refused by the config rules on CPU hardware; the trainer itself
    # still says, rather than pretends, where it gets one
    cfg = dataclasses.replace(tiny_config, trainer=dataclasses.replace(tiny_config.trainer, offload=True))
    res = spawn_local(_cpu_offload_worker, 1, cfg, tiny_checkpoint)[0]

    for key in ("offload", "onload"):
        figures = res[key]
        assert figures["bytes"] == 0 and figures["seconds"] == 0 and figures["gb_per_s"] == 0, figures
        assert figures["offload"].startswith("off: ") and "CPU" in figures["offload"], figures
    stats = res["stats"]
    assert stats["device"] == "cpu"
    assert {k: v for k, v in stats.items() if k != "device"} == dict.fromkeys(
        ("allocated", "reserved", "peak_allocated", "peak_reserved", "offloaded", "device_used", "device_total"), 0.0)

    # torch creates Adam's state at the first step; made up front it has the same fields
    assert res["state_before_step"] == 0
    assert res["eager_initialised"] > 0
    (fields,) = res["eager_state"].values()
    assert len(fields) == 3 and all(v == 0 for v in fields)  # step 0, zero moments
    assert res["eager_tensors"] == res["eager_initialised"] * 4  # param + step + two moments each

    # ... and the same two steps, bit for bit
    lazy_metrics, lazy_params = res["lazy"]
    eager_metrics, eager_params = res["eager"]
    assert lazy_metrics == eager_metrics
    assert len(lazy_params) == len(eager_params)
    for a, b in zip(lazy_params, eager_params):
        assert a.equal(b)
    assert sum(not a.equal(b) for a, b in zip(lazy_params, res["initial"])) > len(lazy_params) // 2  # it trained

"""Where every process goes: trainer ranks, their parallel coordinates, rollout engines.

Pure functions of the config (standard library only): validation, the plan command and
the Ray placement all read the same numbers from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .schema import ParallelConfig, VlmrlConfig

# Megatron's default rank order: tp varies fastest, then cp, ep/dp, pp.
RANK_ORDER = "tp-cp-ep-dp-pp"


def megatron_parallel_sizes(parallel: ParallelConfig) -> dict[str, int | None]:
    """`parallel`'s sizes under the keyword names Megatron-core gives them: the same in
    `initialize_model_parallel` and `TransformerConfig`, which both take this mapping."""
    return {
        "tensor_model_parallel_size": parallel.tp,
        "pipeline_model_parallel_size": parallel.pp,
        "virtual_pipeline_model_parallel_size": parallel.vpp,
        "context_parallel_size": parallel.cp,
        "expert_model_parallel_size": parallel.ep,
        "expert_tensor_parallel_size": parallel.etp,
    }


@dataclass(frozen=True)
class RankCoord:
    rank: int
    node: int
    local_device: int  # GPU index on its node (or CPU process index)
    tp: int
    cp: int
    dp: int
    pp: int
    ep: int
    etp: int
    edp: int


@dataclass(frozen=True)
class EngineSlot:
    index: int
    node: int
    devices: tuple[int, ...]  # GPU indices on the node; empty on CPU


@dataclass(frozen=True)
class Layout:
    on_gpu: bool
    trainer_world_size: int
    dp: int
    expert_dp: int
    rollout_devices: int
    num_engines: int
    trainer_devices: tuple[int, ...]  # global GPU indices of trainer ranks
    rollout_device_offset: int  # first global GPU index of the engines
    devices_per_node: int

    def coords(self, cfg: VlmrlConfig) -> list[RankCoord]:
        return rank_coords(cfg, self)

    def engines(self, cfg: VlmrlConfig) -> list[EngineSlot]:
        return engine_slots(cfg, self)


def is_gdn_model(cfg: VlmrlConfig) -> bool:
    return "linear_attention" in cfg.model.lm.layer_types


def shares_prompts(cfg: VlmrlConfig) -> bool:
    """Whether the trainer runs a prompt once for its replies in a micro-batch
    (`trainer.share_prompts`; null: on CPU ranks, where it needs no other setting)."""
    if cfg.trainer.share_prompts is not None:
        return bool(cfg.trainer.share_prompts)
    return cfg.hardware.device == "cpu" and cfg.parallel.cp == 1


def is_moe_model(cfg: VlmrlConfig) -> bool:
    return cfg.model.lm.num_experts > 0


def returns_routed_experts(cfg: VlmrlConfig) -> bool:
    """Whether the rollout engines report each token's experts (`rollout.return_routed_experts`;
    null: exactly when `algo.routing_replay` replays them)."""
    flag = cfg.rollout.return_routed_experts
    return cfg.algo.routing_replay != "none" if flag is None else bool(flag)


def compute_layout(cfg: VlmrlConfig) -> Layout:
    """Sizes only; validity is checked by `validate` (which calls this with guards)."""
    c, p, r = cfg.cluster, cfg.parallel, cfg.rollout
    on_gpu = cfg.hardware.device == "cuda"
    if not on_gpu:
        world = c.num_cpu_ranks
        rollout_devices, trainer_devices, offset = 0, tuple(range(world)), 0
    elif c.colocate:
        world = c.num_gpus
        rollout_devices, trainer_devices, offset = r.num_gpus, tuple(range(world)), 0
    else:
        world = c.trainer_gpus if c.trainer_gpus is not None else c.num_gpus - r.num_gpus
        rollout_devices = r.num_gpus
        trainer_devices, offset = tuple(range(world)), world
    model_parallel = p.tp * p.pp * p.cp
    dp = max(world // model_parallel, 1) if model_parallel else 1
    expert_grid = p.ep * p.etp
    per_stage = max(world // p.pp, 1)
    expert_dp = max(per_stage // expert_grid, 1) if expert_grid else 1
    if on_gpu:
        num_engines = rollout_devices // max(r.gpus_per_engine, 1)
    else:
        num_engines = 1
    per_node = max(c.num_gpus // max(c.num_nodes, 1), 1) if on_gpu else max(world, 1)
    return Layout(
        on_gpu=on_gpu,
        trainer_world_size=world,
        dp=dp,
        expert_dp=expert_dp,
        rollout_devices=rollout_devices,
        num_engines=num_engines,
        trainer_devices=trainer_devices,
        rollout_device_offset=offset,
        devices_per_node=per_node,
    )


def embedded_engine_device(cfg: VlmrlConfig) -> str:
    """Where the embedded engine computes: "cuda" (the GPU of its placement bundle) or "cpu".
    `rollout.embedded.device=auto` follows the run: its GPU when the run has GPUs, else the
    CPU; `cpu` keeps it on the host beside GPU trainers (an explicit choice)."""
    wanted = cfg.rollout.embedded.device
    if wanted != "auto":
        return wanted
    return "cuda" if cfg.hardware.device == "cuda" else "cpu"


LOOPBACK = "127.0.0.1"


def engine_bind_host(cfg: VlmrlConfig) -> str:
    """Where the rollout engines' HTTP servers listen: the loopback address when every caller
    (the driver, the trainer's rank 0, the engines' own actors) runs on the one machine of a
    local cluster; else "auto", each engine node's own address, which other nodes reach
    (callers then need the run's engine key, as they always do)."""
    if cfg.cluster.name == "local" and cfg.cluster.num_nodes <= 1:
        return LOOPBACK
    return "auto"


def engine_batch_requests(cfg: VlmrlConfig) -> int:
    """The most generation requests one engine holds at once in a training step: a round's
    prompts (`rollout.batch_size`, times `rollout.oversample` under dynamic sampling) times
    `algo.n_samples_per_prompt`, at most `rollout.max_in_flight` across the engines, shared
    by them. SGLang captures its decode CUDA graphs for batches up to this (rounded up to a
    multiple of 8) when `rollout.sglang.cuda_graph_max_bs` is null; a larger batch, such as a
    whole test split's evaluation, runs without them."""
    r = cfg.rollout
    per_step = math.ceil(r.batch_size * max(r.oversample, 1.0)) * cfg.algo.n_samples_per_prompt
    in_flight = min(per_step, max(r.max_in_flight, 1))
    engines = max(compute_layout(cfg).num_engines, 1)
    return max(-(-in_flight // engines), 1)


def rank_coords(cfg: VlmrlConfig, layout: Layout) -> list[RankCoord]:
    """Parallel coordinates of each trainer rank, in Megatron's rank order.

    Dense parameters: rank = tp + TP * (cp + CP * (dp + DP * pp)).
    Expert parameters regroup the ranks of one pipeline stage as etp x ep x edp.
    """
    p = cfg.parallel
    out = []
    for rank in range(layout.trainer_world_size):
        tp = rank % p.tp
        cp = (rank // p.tp) % p.cp
        dp = (rank // (p.tp * p.cp)) % layout.dp
        pp = rank // (p.tp * p.cp * layout.dp)
        in_stage = rank % (layout.trainer_world_size // p.pp)
        etp = in_stage % p.etp
        ep = (in_stage // p.etp) % p.ep
        edp = in_stage // (p.etp * p.ep)
        device = layout.trainer_devices[rank]
        node, local = divmod(device, layout.devices_per_node)
        out.append(RankCoord(rank, node, local, tp, cp, dp, pp, ep, etp, edp))
    return out


def engine_slots(cfg: VlmrlConfig, layout: Layout) -> list[EngineSlot]:
    if not layout.on_gpu:
        return [EngineSlot(0, 0, ())]
    g = cfg.rollout.gpus_per_engine
    slots = []
    for i in range(layout.num_engines):
        first = layout.rollout_device_offset + i * g
        node, local = divmod(first, layout.devices_per_node)
        slots.append(EngineSlot(i, node, tuple(range(local, local + g))))
    return slots


def scheduled_steps(cfg: VlmrlConfig) -> int:
    """The optimizer steps the learning-rate schedule spans: `num_steps` supervised steps with
    `algo=sft` (its `sft_steps` is the warm-up of an RL run, which it does not run), else the
    SFT warm-up and then `num_steps` RL steps; with `trainer.optim.rl_lr` the warm-up alone (RL
    then starts a schedule of its own, `vlmrl.loop.Loop.run`)."""
    if cfg.algo.name == "sft":
        return cfg.num_steps
    if cfg.trainer.optim.rl_lr is not None:
        return max(cfg.algo.sft_steps, 1)
    return cfg.num_steps + cfg.algo.sft_steps

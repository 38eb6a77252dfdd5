"""The plan: `python -m vlmrl.plan [overrides]` prints what a run would put where.

Validates the config, then prints the model's parameter counts, the trainer's rank layout
(which GPU holds which TP/PP/CP/DP and EP/ETP shard), where the rollout engines go, a
per-GPU memory estimate and, on GPUs, the peak of each phase of a step (rollout, logprob
recompute, train, weight sync) with its parts. Nothing is started and no
torch/megatron/ray is imported.
"""

from __future__ import annotations

import sys
from typing import Any

from .cli import hydra_entry
from .config import ConfigError, VlmrlConfig, compute_layout, config_notes, to_dataclass, validate
from .config.layout import LOOPBACK, RANK_ORDER, embedded_engine_device, engine_bind_host
from .config.memory import (
    GIB,
    checkpoint_host_bytes,
    count_params,
    engines_stay,
    estimate_memory,
    host_bytes_per_node,
    largest_micro_batch_tokens,
    largest_staying_pool,
    offload_host_bytes,
    offload_split,
    phase_memory,
    process_host_bytes_per_node,
    sequence_length,
    step_tokens_per_rank,
    trainer_offload,
    trainer_ranks_per_node,
)
from .rollout.auth import KEY_FILE


def _b(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def engine_exposure(cfg: VlmrlConfig) -> str:
    """Where the engines listen and who may call them (one line of the plan)."""
    r = cfg.rollout
    if r.name == "embedded" and not r.embedded.serve_http:
        return "engine endpoints: none (the run calls its engine through Ray)"
    host = engine_bind_host(cfg) if r.name == "sglang" else r.embedded.host
    where = ("127.0.0.1 (this machine only)" if host == LOOPBACK else
             "each engine node's address (other nodes reach them)" if host == "auto" else host)
    return (f"engine endpoints: HTTP on {where}; every call but /health needs the run's engine key "
            f"(drawn at start, kept in the run directory's {KEY_FILE}, mode 600)")


def render_plan(cfg: VlmrlConfig) -> str:
    """The plan as text (what the command prints)."""
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    out = StringIO()
    console = Console(file=out, width=120, force_terminal=False, color_system=None)
    layout = compute_layout(cfg)
    p, lm, r = cfg.parallel, cfg.model.lm, cfg.rollout
    counts = count_params(cfg)
    device = "GPU" if layout.on_gpu else "CPU rank"

    console.print(f"[bold]model[/] {cfg.model.name} ({cfg.model.family}): {_b(counts.total)} parameters "
                  f"({_b(counts.active)} active per token), language model {_b(counts.language_model)}, "
                  f"vision tower {_b(counts.vision)}")
    layer_kinds = list(lm.layer_types) or ["full_attention"] * lm.num_layers
    console.print(f"  {lm.num_layers} layers: {layer_kinds.count('full_attention')} full attention, "
                  f"{layer_kinds.count('linear_attention')} Gated DeltaNet; "
                  + (f"{lm.num_experts} experts top-{lm.moe_router_topk}" if lm.num_experts else "dense MLP"))
    console.print(f"[bold]trainer[/] world {layout.trainer_world_size} = tp {p.tp} x pp {p.pp} x cp {p.cp} "
                  f"x dp {layout.dp}; experts: ep {p.ep} x etp {p.etp} x edp {layout.expert_dp} per stage; "
                  f"sequence parallel {'on' if p.sequence_parallel else 'off'}; recompute "
                  f"{p.recompute_granularity or 'off'}; {cfg.hardware.name} ({cfg.hardware.train_dtype})")

    table = Table(title=f"trainer ranks (Megatron order {RANK_ORDER})")
    for col in ("rank", "node", device, "tp", "cp", "dp", "pp", "ep", "etp", "edp", "also hosts"):
        table.add_column(col, justify="right")
    engines = layout.engines(cfg)
    owner = {}
    if cfg.cluster.colocate:
        for e in engines:
            for d in e.devices:
                owner[(e.node, d)] = f"engine {e.index}"
    for c in layout.coords(cfg):
        table.add_row(*map(str, (c.rank, c.node, c.local_device, c.tp, c.cp, c.dp, c.pp, c.ep, c.etp, c.edp)),
                      owner.get((c.node, c.local_device), ""))
    console.print(table)

    mode = "colocated with the trainer" if cfg.cluster.colocate else "on their own devices"
    if layout.on_gpu and r.name == "embedded" and embedded_engine_device(cfg) == "cpu":
        console.print(f"[bold]rollout[/] {r.name}: 1 engine in a Ray actor on the host's CPU "
                      "(rollout.embedded.device=cpu), beside the GPU trainer")
    elif layout.on_gpu:
        console.print(f"[bold]rollout[/] {r.name}: {layout.num_engines} engine(s) x {r.gpus_per_engine} GPU(s) "
                      f"(ep {r.sglang.ep_size}), {mode}"
                      + ("; async (one step off-policy)" if cfg.cluster.async_rollout else ""))
        for e in engines:
            console.print(f"  engine {e.index}: node {e.node}, GPUs {list(e.devices)}")
    else:
        console.print(f"[bold]rollout[/] {r.name}: 1 engine in a Ray actor on the CPU")
    console.print("  " + engine_exposure(cfg))
    n = cfg.algo.n_samples_per_prompt
    console.print(f"[bold]step[/] {r.batch_size} prompts x {n} samples = {r.batch_size * n} samples, "
                  f"global batch {cfg.trainer.global_batch_size} -> "
                  f"{max(r.batch_size * n // max(cfg.trainer.global_batch_size, 1), 1)} optimizer step(s) per rollout; "
                  f"max sequence {sequence_length(cfg)} tokens")

    mem = estimate_memory(cfg)
    mt = Table(title=f"memory estimate per {device} (most loaded rank: pipeline stage 0)")
    for col in ("params", "grads", "optimizer", "activations", "train total", "rollout pool", "device"):
        mt.add_column(col, justify="right")
    total_dev = cfg.hardware.gpu_memory_gb * GIB
    mt.add_row(_gib(mem.params), _gib(mem.grads), _gib(mem.optimizer), _gib(mem.activations),
               _gib(mem.train_total), _gib(mem.rollout_pool) if mem.rollout_pool else "-",
               _gib(total_dev) if total_dev else "-")
    console.print(mt)
    console.print(f"  activations for {mem.tokens_per_micro_batch} tokens per micro-batch"
                  + (", split over cp" if p.cp > 1 else ""))
    largest = largest_micro_batch_tokens(cfg)
    if largest is not None:
        tokens, peak = largest
        whole = tokens >= step_tokens_per_rank(cfg)
        console.print(f"  micro-batch budget: parallel.max_tokens_per_gpu={p.max_tokens_per_gpu}; every phase fits "
                      f"90% of the GPU up to {tokens} tokens (peak {_gib(peak)})"
                      + (", a rank's whole optimizer step in one micro-batch" if whole else "")
                      + ". Fewer, larger micro-batches cost less per step (each is a forward, a backward and "
                      "a gradient accumulation)")
    if p.tp > lm.num_query_groups:
        console.print(f"  attention: tp {p.tp} > {lm.num_query_groups} KV groups: each rank holds 1/{p.tp} of the fused "
                      f"QKV weights and all-gathers their projections, then keeps its KV group "
                      f"({p.tp // lm.num_query_groups} ranks per group) and its {lm.num_attention_heads // p.tp} "
                      f"query heads: {_gib(mem.qkv_gather)} of gathered projections in the activations")
    if total_dev and cfg.cluster.colocate and engines_stay(cfg):
        console.print("  colocated, the engines staying (cluster.release_engines=false): their pool and the trainer's "
                      "whole state share each GPU through the step; nothing moves but the weights the sync sends")
    elif total_dev and cfg.cluster.colocate and mem.rollout_pool:
        console.print("  colocated: engines release their pool while the trainer runs and resume it "
                      "after the weight sync; the two phases do not overlap")
    _print_staying_pool(console, cfg)
    if total_dev and mem.train_total > 0.95 * total_dev:
        console.print(f"  [bold]warning[/]: the training phase needs about {_gib(mem.train_total)} "
                      f"of {_gib(total_dev)}")
    _print_phases(console, cfg, mem)
    for note in config_notes(cfg):
        console.print(f"[bold]note[/] {note}")
    return out.getvalue()


def _print_staying_pool(console: Any, cfg: VlmrlConfig) -> None:
    """Colocated SGLang: the largest pool at which the engines could keep their memory through
    the step, where one exists, and where the configured pool is larger than it."""
    pool = largest_staying_pool(cfg)
    if pool is None:
        return
    fraction = cfg.rollout.sglang.mem_fraction_static
    fits = (f"rollout.sglang.mem_fraction_static={pool.mem_fraction_static:g} (its KV cache holds "
            f"{pool.kv_tokens / 1e6:.2f}M tokens; a round's requests need at most {pool.kv_need / 1e6:.2f}M) every "
            f"phase fits 90% of the GPU with the engines staying (peak {_gib(pool.peak)})")
    if not engines_stay(cfg):
        console.print(f"  the engines could stay: at {fits}; cluster.release_engines=false then moves nothing but "
                      "the weights in a step")
    elif fraction > pool.mem_fraction_static:
        console.print(f"  [bold]warning[/]: mem_fraction_static={fraction:g} is too large for engines that stay: at most "
                      f"{fits}")


_WHERE = {"shared": "every GPU (shared)", "trainer": "trainer GPUs", "engine": "engine GPUs"}


def _print_phases(console: Any, cfg: VlmrlConfig, mem: Any) -> None:
    """The peak of each phase of a step on one GPU, with its parts."""
    from rich.table import Table

    phases = phase_memory(cfg, mem)
    if not phases:
        return
    total_dev = cfg.hardware.gpu_memory_gb * GIB
    if cfg.cluster.colocate and engines_stay(cfg):
        mode = "engines and trainer keep their memory through the step (cluster.release_engines=false)"
    elif cfg.cluster.colocate:
        mode = ("trainer offloaded while the engines generate (trainer.offload)" if trainer_offload(cfg)
                else "trainer stays on the GPUs while the engines generate (trainer.offload=false)")
    else:
        mode = "trainer and engines on separate GPUs"
    t = Table(title=f"peak per GPU in each phase of a step: {mode}")
    for col, justify in (("phase", "left"), ("GPUs", "left"), ("peak", "right"), ("of device", "right"),
                         ("parts", "left")):
        t.add_column(col, justify=justify)
    for ph in phases:
        share = f"{ph.total / total_dev:.0%}" if total_dev else "-"
        parts = "; ".join(f"{name} {_gib(b)}" for name, b in ph.parts)
        t.add_row(ph.phase, _WHERE.get(ph.where, ph.where), _gib(ph.total), share, parts)
    console.print(t)
    host = offload_host_bytes(cfg, mem)
    if cfg.cluster.colocate and trainer_offload(cfg):
        split = offload_split(cfg, mem)
        t = cfg.trainer
        why = (f"trainer.resident_gib={t.resident_gib:g}" if t.resident_gib is not None else
               f"what fits in trainer.resident_budget {t.resident_budget:g} of the GPU beside the rollout: "
               f"{_gib(split.budget)}")
        kept = ", ".join(f"{name} {_gib(b)}" for name, b in split.resident) or "nothing"
        moved = ", ".join(f"{name} {_gib(b)}" for name, b in split.moved) or "nothing"
        moves = (f"moves {moved} to pinned host memory ({_gib(host * len(compute_layout(cfg).trainer_devices))} "
                 "for all trainer GPUs) and back" if split.moved else "moves nothing")
        console.print(f"  while the engines generate, each trainer GPU keeps {kept} ({why}); {moves}; drops its "
                      f"gradients ({_gib(split.dropped)}) without a copy")
        if split.part("optimizer state", "moved") and t.offload_overlap:
            weights = " (the weights that move: within the offload and the onload)" if split.part("weights", "moved") else ""
            console.print("  the optimizer state that moves comes back while the forward and backward run and leaves "
                          f"while the weight sync runs (trainer.offload_overlap){weights}")
    ckpt = checkpoint_host_bytes(cfg, mem)
    if ckpt:
        per_node = trainer_ranks_per_node(cfg)
        node = host_bytes_per_node(cfg, mem)
        fmt = (f"optimizer state as {cfg.trainer.checkpoint_format}" if cfg.trainer.use_distributed_optimizer
               else "plain optimizer")
        console.print(f"  checkpoint save ({fmt}): about {_gib(ckpt)} of host memory per trainer GPU"
                      + (" beside its pinned copy" if host else ""))
        procs = "; ".join(f"{name} {_gib(b)}" for name, b in process_host_bytes_per_node(cfg))
        if host:
            console.print(f"  host memory per node ({per_node} trainer GPU(s)), every phase: at most "
                          f"[bold]{_gib(node['save'])}[/] (a checkpoint's save or load beside the pinned copies, "
                          f"where the node has that); the run needs [bold]{_gib(node['save_copies_freed'])}[/]: "
                          "where the node lacks room, the save or load frees the copies first (the next offload "
                          f"pins them again). Both include the processes' own {_gib(node['processes'])} ({procs}; "
                          "measured on one GPU, counted per GPU)")
        else:
            console.print(f"  host memory per node ({per_node} trainer GPU(s)), every phase: at most "
                          f"[bold]{_gib(node['save'])}[/] (a checkpoint's save or load; the processes' own "
                          f"{_gib(node['processes'])} included: {procs})")
    for ph in phases:
        if total_dev and ph.total > total_dev:
            hint = (" (trainer.offload=true moves the trainer's state off the GPUs while the engines generate)"
                    if ph.phase == "rollout" and cfg.cluster.colocate and not trainer_offload(cfg)
                    and not engines_stay(cfg) else "")
            console.print(f"  [bold]warning[/]: the {ph.phase} phase needs about {_gib(ph.total)} of "
                          f"{_gib(total_dev)} per GPU{hint}")


def run(cfg: Any) -> None:
    try:
        config = validate(to_dataclass(cfg))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(render_plan(config), end="")


main = hydra_entry(run, writes_run_dir=False)

if __name__ == "__main__":
    main()

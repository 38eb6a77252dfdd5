"""Parity of the Megatron model with HF transformers and across parallel layouts.

One check = one HF model of the configured architecture (random weights, or a local
checkpoint's), one packed batch of samples with images of different grids, one sample with
two images, a text-only sample and, for Gated DeltaNet models, a text sample of 520 tokens
trained at its end (half of the heads decaying slowly enough that its start still counts
there), and one forward + backward pass of a simple loss (mean next-token cross entropy
over the loss-masked tokens):

- HF reference: the family's `*ForConditionalGeneration`, one sample at a time, fp32
  (transformers' own Gated DeltaNet ignores packing, so it only ever sees one sample);
- "single": the Megatron model without model parallelism (run as data-parallel replicas
  in the same processes as the layouts under test), which also runs every sample alone:
  a sample inside the pack must equal the same sample alone (no state leaks between
  packed samples: attention, convolution, recurrence);
- each layout under test (e.g. tp=2, pp=2, cp=2, ep=2), in the same processes.

Every 1-D parameter of the HF model is perturbed first (norm weights start at one or zero,
biases at zero: a swapped norm or a misplaced bias would go unnoticed otherwise). Logits are
gathered to the full vocabulary and the whole (un-CP-split) sequence; gradients are
gathered back to HF checkpoint names (`adapters.iter_hf_weights(grads=True)`) after the
reductions Megatron's DDP would do, divided by the number of data-parallel replicas.

CLI (Hydra overrides composed with vlmrl's config; checks the configured layout). With
`model.path` naming a local checkpoint, its shapes come from its config.json (whatever
`model=` says) and its weights are used when its safetensors are there;
`model.lm.num_layers=N` truncates the language model:

    python -m vlmrl.parity model=tiny_qwen3_5_moe parallel.tp=2 parallel.sequence_parallel=true parallel.ep=2
    python -m vlmrl.parity model.path=/path/to/checkpoint parallel.cp=2
    python -m vlmrl.parity model=tiny_qwen3_5_moe algo.routing_replay=rollout parallel.ep=2

With `algo.routing_replay=rollout` (MoE) every token of the batch carries random "engine"
experts; the single process must route exactly by them (every layer, every token the engine
routed) and each layout must then match it, while the single process without replay must
not (the replay changes the routing).

prints a table of max |diff| figures with PASS/FAIL against the bounds and exits non-zero
on a failure.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from typing import Any

from .config.schema import ModelConfig, ParallelConfig

# a long sample crosses many Gated DeltaNet chunks (64 tokens), and its decays are slow
# enough (`make_hf_model`) that the state carried from its start still moves its last logits
LONG_SAMPLE = 520
SLOW_DECAY = (1e-3, 1e-2)  # exp(A_log) of half of the Gated DeltaNet heads

# bounds (fp32, CPU)
LOGITS_VS_HF = 1e-4
LOGITS_VS_SINGLE = 1e-5
GRADS_VS_SINGLE = 1e-5
GRADS_VS_HF = 1e-4
PACK_VS_ALONE = 1e-5


@dataclass
class ParityBatch:
    """The packed samples (whole sequence), their images and loss targets."""

    samples: list[Any]  # PackSample
    pixel_values: Any  # [sum(t*h*w), C*T*P*P]
    image_grid_thw: Any  # [n_images, 3]
    targets: Any  # [T] next-token targets (whole packed sequence, unpadded layout)
    seed: int


@dataclass
class RunResult:
    name: str
    logits: list[Any] = field(default_factory=list)  # per sample [L_i, V]
    grads: dict[str, Any] = field(default_factory=dict)  # HF checkpoint names
    # max |HF weights - weights exported back from the loaded Megatron model| (0: bitwise)
    roundtrip: float = float("nan")
    buckets: int = 0  # buckets of 256 KiB the weights came in (iter_hf_weights)
    fast_path_layers: int = 0  # layers built for the compiled fast path (fused_kernels, FusedTransformerLayer)
    # max |logits of a sample inside the pack - logits of the same sample alone| ("single" only)
    pack_vs_alone: float = float("nan")
    num_parameters: int = 0  # parameters held by global rank 0 (the whole model under "single")
    # routing replay: (layer, token) pairs whose routed experts differ from the engine's, summed
    # over the ranks (-1: not replayed)
    replay_misses: int = -1


def make_batch(model: ModelConfig, *, seed: int = 0, grids: tuple[tuple[int, int, int], ...] = ((1, 4, 4), (1, 6, 4)),
               text_only: int = 1,
               multi_image: tuple[tuple[int, int, int], ...] = ((1, 4, 6), (1, 4, 4)),
               long_text: int | None = None) -> ParityBatch:
    """Samples with one image each (grids given), one sample holding every image of
    `multi_image` with text between them (M-RoPE positions resume after each image), plus
    `text_only` samples without images, and one text sample of `long_text` tokens (None:
    `LONG_SAMPLE` for models with Gated DeltaNet layers, whose kernels work in chunks of 64
    tokens and carry a state across them; 0: none)."""
    import torch

    from .models.packing import PackSample

    v, lm = model.vision, model.lm
    g = torch.Generator().manual_seed(seed)
    # text ids above every special id (image, video, vision start/end)
    low = max(model.image_token_id + 1, model.vision_start_token_id, model.vision_end_token_id) + 1
    if low >= lm.vocab_size:
        raise ValueError(f"no ordinary token ids above the special ids in a vocabulary of {lm.vocab_size}")

    def text(n: int) -> list[int]:
        return torch.randint(low, lm.vocab_size, (n,), generator=g).tolist()

    samples = []
    merge = v.spatial_merge_size
    for k, (t, h, w) in enumerate(grids):
        ids = text(3 + k) + [model.vision_start_token_id] + [model.image_token_id] * (t * h * w // merge**2) \
            + [model.vision_end_token_id] + text(6 + 2 * k)
        mask = [0.0] * (len(ids) - 5) + [1.0] * 5
        samples.append(PackSample(torch.tensor(ids), torch.tensor(mask), torch.tensor([[t, h, w]])))
    if multi_image:
        ids = text(2)
        for t, h, w in multi_image:
            ids += [model.vision_start_token_id] + [model.image_token_id] * (t * h * w // merge**2) \
                + [model.vision_end_token_id] + text(3)
        ids += text(5)
        mask = [0.0] * (len(ids) - 6) + [1.0] * 6
        samples.append(PackSample(torch.tensor(ids), torch.tensor(mask), torch.tensor([list(x) for x in multi_image])))
    for k in range(text_only):
        ids = text(7 + k)
        samples.append(PackSample(torch.tensor(ids), torch.ones(len(ids)), None))
    if long_text is None:
        long_text = LONG_SAMPLE if "linear_attention" in lm.layer_types else 0
    if long_text:
        ids = text(long_text)
        mask = torch.zeros(long_text)
        mask[-16:] = 1.0  # trained at the far end, where the carried state decides
        samples.append(PackSample(torch.tensor(ids), mask, None))
    grids = (*grids, *multi_image)  # in the order of the samples' images
    patch = v.in_channels * v.temporal_patch_size * v.patch_size**2
    n_patches = sum(t * h * w for t, h, w in grids)
    pixel_values = torch.randn(n_patches, patch, generator=g)
    total = sum(len(s.input_ids) for s in samples)
    targets = torch.randint(0, lm.vocab_size, (total,), generator=g)
    grid = torch.tensor([list(x) for x in grids]).view(-1, 3)
    return ParityBatch(samples, pixel_values, grid, targets, seed)


def with_engine_experts(model: ModelConfig, batch: ParityBatch, *, seed: int = 0) -> ParityBatch:
    """The batch with random engine experts on every sample's tokens but its last (as an
    engine reports them): distinct top-k ids per token and layer."""
    import torch

    g = torch.Generator().manual_seed(seed + 7)
    lm = model.lm
    samples = []
    for s in batch.samples:
        n = len(s.input_ids) - 1
        ids = torch.rand(n, lm.num_layers, lm.num_experts, generator=g).argsort(-1)[..., :lm.moe_router_topk]
        samples.append(dataclasses.replace(s, routed_experts=ids.to(torch.int16)))
    return dataclasses.replace(batch, samples=samples)


def use_transformers_torch_paths() -> None:
    """Make transformers' Qwen3.5 models run their own torch Gated DeltaNet and convolution,
    also where flash-linear-attention is installed (transformers binds fla's kernels at import
    when it finds them): the reference is transformers' implementation, not a kernel library's."""
    import importlib
    import inspect

    for name in ("qwen3_5", "qwen3_5_moe"):
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        for fn in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                   "causal_conv1d_update"):
            f = getattr(module, fn, None)
            if f is not None:
                setattr(module, fn, inspect.unwrap(f))


def make_hf_model(model: ModelConfig, *, seed: int = 0, weights: str | None = None) -> Any:
    """An HF model of `model`'s architecture (random weights, or those of the checkpoint
    directory `weights`), fp32, eval mode, SDPA, every 1-D parameter perturbed."""
    import torch

    from .models.bridge import hf_config, hf_model_class

    use_transformers_torch_paths()
    torch.manual_seed(seed)
    cls = hf_model_class(model)
    if weights:
        net = cls.from_pretrained(weights, dtype=torch.float32, attn_implementation="sdpa").eval()
    else:
        cfg = hf_config(model)
        cfg._attn_implementation = "sdpa"
        net = cls(cfg).float().eval()
    # HF initialises norm weights to one and biases to zero: a swapped norm or a misplaced
    # bias would go unnoticed. Perturb every 1-D parameter.
    with torch.no_grad():
        for p in net.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
        # HF's A_log starts at log U(0, 16): decays that forget a state within tens of tokens,
        # so a wrongly carried state would barely show. Every other head decays slowly instead.
        for name, p in net.named_parameters():
            if name.endswith("linear_attn.A_log") and not weights:
                lo, hi = SLOW_DECAY
                p[::2] = torch.empty_like(p[::2]).uniform_(lo, hi).log()
    return net


def _loss(logits: Any, targets: Any, mask: Any, total: float) -> Any:
    import torch.nn.functional as F

    per_token = F.cross_entropy(logits.float(), targets, reduction="none")
    return (per_token * mask).sum() / total


def hf_reference(net: Any, batch: ParityBatch, model: ModelConfig) -> RunResult:
    """HF logits per sample and gradients (checkpoint names) of the parity loss."""
    import torch

    from .models import names

    net.zero_grad(set_to_none=True)
    net.config.text_config.use_cache = False
    logits, masks = [], []
    start = 0
    img = 0
    patch_start = 0
    for s in batch.samples:
        ids = s.input_ids.view(1, -1)
        kwargs: dict[str, Any] = {}
        if s.image_grid_thw is not None:
            grid = s.image_grid_thw
            n_patch = int(grid.prod(-1).sum())
            kwargs = dict(pixel_values=batch.pixel_values[patch_start:patch_start + n_patch], image_grid_thw=grid,
                          mm_token_type_ids=(ids == model.image_token_id).int())
            patch_start += n_patch
            img += len(grid)
        out = net(input_ids=ids, use_cache=False, **kwargs)
        logits.append(out.logits[0])
        masks.append(s.loss_mask)
        start += ids.shape[1]
    mask = torch.cat(masks)
    total = float(mask.sum())
    loss = _loss(torch.cat(logits), batch.targets, mask, total)
    loss.backward()
    grads = names.to_checkpoint({n: p.grad.detach().clone() for n, p in net.named_parameters()
                                 if p.grad is not None}, model.family)
    return RunResult("hf", [x.detach() for x in logits], grads)


# --------------------------------------------------------------------------- megatron side
def run_megatron(model: ModelConfig, parallel: ParallelConfig, hf_state: dict[str, Any], batch: ParityBatch,
                 *, name: str, attention_backend: str = "sdpa", fused_kernels: bool = False,
                 gdn_backend: str = "torch", replay: bool = False) -> RunResult | None:
    """Forward + backward of the parity loss under `parallel`; the result on global rank 0.
    With `replay`, the routers replay the batch's engine experts (`with_engine_experts`).

    Collective over the whole default process group (the layout must cover it).
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mps
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from .models import adapters, compat, families, packing, routing
    from .models.bridge import build_model
    from .rollout.weights import flatten_bucket, unflatten_bucket
    from .training.parallel_state import destroy_parallel_state, init_parallel_state

    info = init_parallel_state(parallel, seed=batch.seed)
    try:
        overrides = {"calculate_per_token_loss": True,
                     **routing.megatron_overrides(model, precision="fp32", replay=replay)}
        chunks = build_model(model, parallel, params_dtype=torch.float32, attention_backend=attention_backend,
                             megatron_overrides=overrides, fused_kernels=fused_kernels, gdn_backend=gdn_backend)
        misses: list[Any] = []
        for c in chunks:
            routing.configure(c, replay=replay)
            if replay:
                for r in routing.routers(c):
                    r.register_forward_hook(_count_replay_misses(misses))
        adapters.load_hf_weights(chunks, model, hf_state)
        exported = {k: v.cpu() for k, v in adapters.export_hf_state_dict(chunks, model).items()}
        expected = dict(adapters.canonical(hf_state, model))
        if model.lm.tie_word_embeddings:
            expected.pop("lm_head.weight", None)
        roundtrip = max_abs_diff(exported, expected)
        # the same weights in small buckets (weight sync): same names, same tensors
        bucketed: dict[str, Any] = {}
        buckets = 0
        for bucket in adapters.iter_hf_weights(chunks, model, bucket_bytes=256 << 10):
            buckets += 1
            bucketed.update((n, t.cpu()) for n, t in bucket)
        roundtrip = max(roundtrip, max_abs_diff(bucketed, expected))
        # the colocated sync's payload: uncompacted views, flattened into one tensor per bucket
        flattened: dict[str, Any] = {}
        for bucket in adapters.iter_hf_weights(chunks, model, bucket_bytes=256 << 10, compact=False):
            flattened.update((n, t.cpu()) for n, t in unflatten_bucket(flatten_bucket(bucket)))
        roundtrip = max(roundtrip, max_abs_diff(flattened, expected))
        # SGLang with vlmrl's loader: each layer's routed experts as one tensor, split back here
        fused: dict[str, Any] = {}
        for bucket in adapters.iter_hf_weights(chunks, model, bucket_bytes=256 << 10, compact=False,
                                               fused_experts=True):
            fused.update((n, t.cpu()) for n, t in unflatten_bucket(flatten_bucket(bucket)))
        family = families.get(model.family)
        if model.lm.num_experts and not any(family.is_fused(n) for n in fused):
            raise AssertionError("iter_hf_weights(fused_experts=True) sent no fused expert tensor")
        roundtrip = max(roundtrip, max_abs_diff(family.to_checkpoint(fused), expected))
        for c in chunks:
            c.train()  # dropout is off; train mode exercises the training code paths
        cp = info.cp_size
        multiple = (2 * cp if cp > 1 else 1) * (info.tp_size if parallel.sequence_parallel else 1)
        samples = batch.samples if replay else [dataclasses.replace(s, routed_experts=None) for s in batch.samples]
        whole = packing.pack(samples, image_token_id=model.image_token_id,
                             spatial_merge_size=model.vision.spatial_merge_size, pad_multiple=multiple)
        local = packing.split_for_cp(whole, cp, info.cp_rank)
        # targets/mask in the padded layout of `whole`, then this rank's share
        targets = torch.zeros(whole.num_tokens, dtype=torch.long)
        mask = torch.zeros(whole.num_tokens)
        off = 0
        for i, s in enumerate(batch.samples):
            a = int(whole.cu_seqlens_padded[i])
            n = whole.seq_lens[i]
            targets[a:a + n] = batch.targets[off:off + n]
            mask[a:a + n] = s.loss_mask
            off += n
        dev = compat.device()
        targets, mask = targets[local.token_index].to(dev), mask[local.token_index].to(dev)
        total = float(whole.loss_mask.sum())
        store: dict[str, Any] = {}

        def loss_func(logits: Any) -> tuple[Any, Any, dict]:
            store["logits"] = logits.detach().clone()  # the vocab-parallel CE edits its input in place
            per_token = tensor_parallel.vocab_parallel_cross_entropy(logits.float().unsqueeze(1),
                                                                     targets.unsqueeze(1)).squeeze(1)
            loss = (per_token * mask).sum() / total
            return loss, torch.tensor(1, dtype=torch.int), {}

        def forward_step(data_iterator: Any, chunk: Any) -> tuple[Any, Any]:
            return chunk(local, batch.pixel_values), loss_func

        for c in chunks:
            c.zero_grad(set_to_none=True)
        fb = get_forward_backward_func()
        fb(forward_step_func=forward_step, data_iterator=[iter([0]) for _ in chunks] if len(chunks) > 1 else iter([0]),
                    model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=1,
                    seq_length=local.num_tokens, micro_batch_size=1, forward_only=False)
        _reduce_grads(chunks, model)
        alone = _pack_vs_alone(chunks[0], model, batch, store["logits"], whole) \
            if name == "single" and len(chunks) == 1 and info.pp_size == 1 else float("nan")

        # logits: full vocabulary, whole sequence, per sample (real tokens)
        logits = None
        if mps.is_pipeline_last_stage(ignore_virtual=True):
            local_logits = store["logits"]
            if info.tp_size > 1:
                parts = [torch.empty_like(local_logits) for _ in range(info.tp_size)]
                dist.all_gather(parts, local_logits.contiguous(), group=mps.get_tensor_model_parallel_group())
                local_logits = torch.cat(parts, dim=-1)
            if cp > 1:
                parts = [torch.empty_like(local_logits) for _ in range(cp)]
                dist.all_gather(parts, local_logits.contiguous(), group=mps.get_context_parallel_group())
                local_logits = packing.cp_merge(parts, whole.padded_lens)
            logits = [x.cpu() for x in packing.unpack(local_logits, whole)]
        grads = {k: v.cpu() for k, v in adapters.export_hf_state_dict(chunks, model, grads=True).items()}
        # the last pipeline stage holds the logits: bring them to global rank 0
        payload = logits if logits is not None and info.tp_rank == 0 and info.cp_rank == 0 \
            and info.dp_rank == 0 else None
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (payload, int(sum(misses))))
        if dist.get_rank() != 0:
            return None
        logits = next(p for p, _ in gathered if p is not None)
        # data-parallel replicas route the same tokens: count one replica's misses
        missed = sum(m for _, m in gathered) // max(info.dp_size, 1) if replay else -1
        fast = sum(bool(getattr(layer, "fast_path", False))
                   for c in chunks for layer in c.language_model.decoder.layers)
        held = sum(p.numel() for c in chunks for p in c.parameters())
        return RunResult(name, logits, grads, roundtrip, buckets, fast, alone, held, missed)
    finally:
        destroy_parallel_state()


def _count_replay_misses(out: list[Any]) -> Any:
    """A router forward hook adding to `out` the tokens whose routed experts differ from the
    engine's rows it was handed (tokens the engine routed; the router's own slice of them)."""
    def hook(router: Any, args: Any, output: Any) -> None:
        routing_map = output[1]
        rows = router._rows(routing_map.shape[0])
        if rows is None:
            return
        known = rows[:, 0] >= 0
        chosen = routing_map.int().topk(router.topk, dim=1).indices
        from .models.routing import topk_sets_differ

        out.append(int((topk_sets_differ(chosen, rows) & known).sum()))
    return hook


def _pack_vs_alone(chunk: Any, model: ModelConfig, batch: ParityBatch, packed_logits: Any, whole: Any) -> float:
    """max |logits of each sample inside the pack - its logits run alone| (one process, no CP/TP)."""
    import torch

    from .models import packing

    merge = model.vision.spatial_merge_size
    per_sample = packing.unpack(packed_logits, whole)
    worst = 0.0
    patch = 0
    with torch.no_grad():
        for s, in_pack in zip(batch.samples, per_sample):
            alone = packing.pack([s], image_token_id=model.image_token_id, spatial_merge_size=merge)
            n_patch = int(torch.as_tensor(s.image_grid_thw).prod(-1).sum()) if s.image_grid_thw is not None else 0
            pixels = batch.pixel_values[patch:patch + n_patch] if n_patch else None
            patch += n_patch
            logits = chunk(alone, pixels)
            worst = max(worst, float((logits.double().cpu() - in_pack.double().cpu()).abs().max()))
    return worst


def _reduce_grads(chunks: list[Any], model: ModelConfig) -> None:
    """The gradient reductions of Megatron's DDP and finalize_model_grads, then the mean over
    data-parallel replicas (every replica ran the same batch):

    - TP sums of parameters replicated over TP whose gradient each rank holds a part of:
      sequence-parallel norms and the router (`sequence_parallel`), q/k norms (heads are
      sharded), vlmrl's head-shared parameters (`vlmrl_tp_sum`);
    - dense parameters summed over the data x context parallel ranks, expert parameters
      (`allreduce=False`) over the expert data-parallel ranks;
    - the tied embedding gradient across the first and last pipeline stage;
    - everything divided by the number of data-parallel replicas.
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mps

    params = [p for c in chunks for p in c.parameters()]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if mps.get_tensor_model_parallel_world_size() > 1:
        tp = mps.get_tensor_model_parallel_group()
        for c in chunks:
            for n, p in c.named_parameters():
                qk = model.lm.qk_layernorm and ("q_layernorm" in n or "k_layernorm" in n)
                if getattr(p, "sequence_parallel", False) or qk or getattr(p, "vlmrl_tp_sum", False):
                    dist.all_reduce(p.grad, group=tp)
    dense = mps.get_data_parallel_group(with_context_parallel=True)
    expert = mps.get_expert_data_parallel_group() if model.lm.num_experts else None
    for p in params:
        group = dense if getattr(p, "allreduce", True) else expert
        if dist.get_world_size(group) > 1:
            dist.all_reduce(p.grad, group=group)
    if model.lm.tie_word_embeddings and mps.get_pipeline_model_parallel_world_size() > 1:
        if mps.is_rank_in_embedding_group(ignore_virtual=True):
            first = mps.is_pipeline_first_stage(ignore_virtual=True)
            chunk = chunks[0] if first else chunks[-1]
            weight = chunk.language_model.shared_embedding_or_output_weight()
            dist.all_reduce(weight.grad, group=mps.get_embedding_group())
    dp = mps.get_data_parallel_world_size()
    if dp > 1:
        for p in params:
            p.grad.div_(dp)


def single_layout(world_size: int) -> ParallelConfig:
    """No model parallelism: every process is a data-parallel replica."""
    return ParallelConfig(tp=1, pp=1, cp=1)


def layout_name(p: ParallelConfig) -> str:
    parts = [f"{k}{getattr(p, k)}" for k in ("tp", "pp", "cp", "ep") if getattr(p, k) > 1]
    if p.vpp:
        parts.append(f"vpp{p.vpp}")
    if p.sequence_parallel:
        parts.append("sp")
    return "+".join(parts) or "single"


def worker(rank: int, world_size: int, model: ModelConfig, layouts: list[ParallelConfig], seed: int,
           with_hf: bool = True, fused_kernels: bool = False, weights: str | None = None,
           gdn_backend: str = "torch", replay: bool = False) -> dict[str, Any] | None:
    """Per-process body (`parallel_state.spawn_local`): HF reference, then each layout
    (`fused_kernels`: with the Inductor-fused kernels of `hardware.fused_kernels`; `weights`:
    a checkpoint directory to take the weights from instead of random ones). With `replay`
    (MoE) the layouts replay random engine experts and "single" also runs without replay,
    as "single-own-routing"."""
    import torch

    # an fp32 check: no TF32 in matmuls or convolutions on GPUs
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    net = make_hf_model(model, seed=seed, weights=weights)
    batch = make_batch(model, seed=seed)
    if replay:
        batch = with_engine_experts(model, batch, seed=seed)
    hf_state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    results: dict[str, Any] = {}
    if with_hf and rank == 0:
        results["hf"] = hf_reference(net, batch, model)
    del net
    torch.manual_seed(seed)
    for layout in layouts:
        res = run_megatron(model, layout, hf_state, batch, name=layout_name(layout), fused_kernels=fused_kernels,
                           gdn_backend=gdn_backend, replay=replay)
        if rank == 0:
            results[res.name] = res
    if replay:
        res = run_megatron(model, single_layout(world_size), hf_state, batch, name="single-own-routing",
                           fused_kernels=fused_kernels, gdn_backend=gdn_backend)
        if rank == 0:
            results[res.name] = res
    return results if rank == 0 else None


def max_abs_diff(a: Any, b: Any) -> float:
    """max |a - b| over tensors, lists of tensors or dicts of tensors (same keys)."""
    if isinstance(a, dict):
        if set(a) != set(b):
            raise KeyError(f"different names: only in a {sorted(set(a) - set(b))[:5]}, "
                           f"only in b {sorted(set(b) - set(a))[:5]}")
        return max((max_abs_diff(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, (list, tuple)):
        return max((max_abs_diff(x, y) for x, y in zip(a, b, strict=True)), default=0.0)
    if a.shape != b.shape:
        raise ValueError(f"shape {tuple(a.shape)} != {tuple(b.shape)}")
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def rel_l2_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """||a - b|| / ||b|| over all tensors together (the relative error of a whole gradient).

    Per-tensor maxima are not used: a gradient that is a sum of many cancelling terms (a
    decay rate over a whole sequence) is 100x smaller than its terms, so fp32 rounding of the
    terms alone makes its own relative error large whichever implementation is right."""
    if set(a) != set(b):
        raise KeyError(f"different names: only in a {sorted(set(a) - set(b))[:5]}, only in b {sorted(set(b) - set(a))[:5]}")
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    den = sum(float(b[k].double().pow(2).sum()) for k in a)
    return (num / den) ** 0.5 if den > 0 else num ** 0.5


@dataclass
class Check:
    what: str
    value: float
    bound: float

    @property
    def ok(self) -> bool:
        return self.value <= self.bound


def compare(results: dict[str, RunResult]) -> list[Check]:
    """The parity table: single vs HF, every layout vs single (logits and gradients)."""
    checks = []
    single = results["single"]
    replayed = single.replay_misses >= 0  # HF routes by its own router: no HF checks then
    if "hf" in results and not replayed:
        hf = results["hf"]
        checks.append(Check("logits  single vs HF", max_abs_diff(single.logits, hf.logits), LOGITS_VS_HF))
        checks.append(Check("grads   single vs HF", max_abs_diff(single.grads, hf.grads), GRADS_VS_HF))
        checks.append(Check("grads   single vs HF (relative L2)", rel_l2_diff(single.grads, hf.grads), GRADS_VS_HF))
    if single.pack_vs_alone == single.pack_vs_alone:  # not NaN: measured
        checks.append(Check("logits  in pack vs alone", single.pack_vs_alone, PACK_VS_ALONE))
    own = results.get("single-own-routing")
    if own is not None:
        # 0 when replaying the engine's experts changed the logits (the check has teeth)
        same = max_abs_diff(own.logits, single.logits) <= 1e-3
        checks.append(Check("replay changes the routing (0: yes)", float(same), 0.0))
    for name, res in results.items():
        if name in ("hf", "single-own-routing"):
            continue
        checks.append(Check(f"weights HF->{name}->HF", res.roundtrip, 0.0))
        if res.replay_misses >= 0:
            checks.append(Check(f"routing {name} vs engine (tokens)", float(res.replay_misses), 0.0))
        if name == "single":
            continue
        checks.append(Check(f"logits  {name} vs single", max_abs_diff(res.logits, single.logits), LOGITS_VS_SINGLE))
        checks.append(Check(f"grads   {name} vs single", max_abs_diff(res.grads, single.grads), GRADS_VS_SINGLE))
    return checks


def format_table(checks: list[Check]) -> str:
    lines = [f"{'check':<38} {'max|diff|':>10} {'bound':>8}  result"]
    for c in checks:
        lines.append(f"{c.what:<38} {c.value:>10.2e} {c.bound:>8.0e}  {'PASS' if c.ok else 'FAIL'}")
    return "\n".join(lines)


def world_size_for(layouts: list[ParallelConfig]) -> int:
    """The fewest processes that hold every layout (tp*cp*pp ranks, experts over ep*etp*pp)."""
    world = 1
    for p in layouts:
        world = math.lcm(world, math.lcm(p.tp * p.cp, p.ep * p.etp) * p.pp)
    return world


def run_parity(model: ModelConfig, layouts: list[ParallelConfig], *, seed: int = 0, timeout_s: float = 900.0,
               fused_kernels: bool = False, weights: str | None = None, replay: bool = False) -> list[Check]:
    """Spawn the gloo processes, run HF + single + `layouts` (with `replay`: replaying random
    engine experts), return the checks."""
    from .training.parallel_state import spawn_local

    world = world_size_for(layouts)
    results = spawn_local(worker, world, model, [single_layout(world), *layouts], seed, not replay, fused_kernels,
                          weights, "torch", replay, timeout_s=timeout_s)[0]
    return compare(results)


# the validation rules about the model and its parallel layout (vlmrl.config.validate)
LAYOUT_RULES = {"positive", "mrope-section", "layer-types", "gdn-shape", "moe-topk", "model-family", "tp-heads",
                "tp-kv-groups", "tp-gdn-heads", "cp-gdn-heads", "sp-needs-tp", "pp-layers", "ep-experts",
                "ep-world", "etp", "moe-tp-sp", "cp-loss"}


def model_from_checkpoint(path: str, overrides: list[str]) -> tuple[ModelConfig, str | None]:
    """The ModelConfig of a local checkpoint (shapes from its config.json; `model.lm.num_layers`
    and `model.vision.depth` overrides truncate) and the directory to take weights from (None
    when truncated or without safetensors: random weights)."""
    from pathlib import Path

    from transformers import AutoConfig

    from .models.bridge import model_config_from_hf, with_layers

    hf = AutoConfig.from_pretrained(path)
    model = model_config_from_hf(hf, name=Path(path).name)
    given = dict(o.split("=", 1) for o in overrides if "=" in o)
    truncated = False
    if "model.lm.num_layers" in given:
        model, truncated = with_layers(model, int(given["model.lm.num_layers"])), True
    if "model.vision.depth" in given:
        model = dataclasses.replace(model, vision=dataclasses.replace(model.vision,
                                                                      depth=int(given["model.vision.depth"])))
        truncated = True
    weights = None if truncated or not any(Path(path).glob("*.safetensors")) else path
    return model, weights


def main(argv: list[str] | None = None) -> int:
    from pathlib import Path

    from . import config as vconfig
    from .config.validate import check

    overrides = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in overrides):  # Hydra overrides only: the module's guide
        print(__doc__.strip())
        return 0
    cfg = vconfig.load(overrides, check_rules=False)
    model, parallel = cfg.model, cfg.parallel
    weights = None
    if model.path and (Path(model.path) / "config.json").exists():
        model, weights = model_from_checkpoint(model.path, overrides)
    model = dataclasses.replace(model, dtype="float32")
    layouts = [] if parallel.tp * parallel.pp * parallel.cp * parallel.ep == 1 else [dataclasses.replace(parallel)]
    world = world_size_for(layouts)
    probe = dataclasses.replace(cfg, model=model, cluster=dataclasses.replace(cfg.cluster, num_cpu_ranks=world))
    bad = [v for v in check(probe) if v.rule in LAYOUT_RULES]
    if bad:
        print("the layout cannot run this model:\n" + "\n".join(f"  - {v}" for v in bad), file=sys.stderr)
        return 2
    fused = cfg.hardware.fused_kernels
    replay = cfg.algo.routing_replay != "none"
    if replay and not model.lm.num_experts:
        print(f"algo.routing_replay={cfg.algo.routing_replay}: model={model.name} has no experts", file=sys.stderr)
        return 2
    checks = run_parity(model, layouts, seed=cfg.seed, fused_kernels=fused, weights=weights, replay=replay)
    print(f"model={model.name} family={model.family} layers={model.lm.num_layers} "
          f"vision_depth={model.vision.depth} layout={layout_name(parallel)} processes={world} "
          f"weights={'checkpoint' if weights else 'random'} fused_kernels={fused} "
          f"routing_replay={cfg.algo.routing_replay} (fp32, CPU/gloo)")
    print(format_table(checks))
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())

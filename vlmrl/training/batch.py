"""Training samples, micro-batches and their packed tensors (pure functions).

A `TrainSample` is one prompt + response as token ids with the response marked in
`loss_mask` (on the tokens themselves). For next-token prediction the logits at position t
score token t+1, so `shift` moves masks, rollout logprobs and targets one position left
within each sample. Samples are then split over data-parallel ranks and packed into
micro-batches without padding between samples (dynamic batching by a token budget, or a
fixed number of samples).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from ..models.packing import PackedSequence, PackSample, graph_bucket, pack, share_images, split_for_cp


@dataclass
class TrainSample:
    input_ids: list[int]  # prompt + response
    loss_mask: list[float]  # 1 on tokens that are trained on (response / assistant tokens)
    pixel_values: Tensor | None = None  # [patches, C*T*P*P] of this sample's images
    image_grid_thw: Tensor | None = None  # [n_images, 3]
    advantage: float = 0.0
    # Logprobs the rollout engine reported for the loss-masked tokens, in order.
    rollout_logprobs: list[float] | None = None
    # Logprobs of the policy that generated the rollout, recomputed by the trainer before
    # the rollout's first optimizer step (PPO's "old" policy), same alignment.
    old_logprobs: list[float] | None = None
    # The experts the engine routed each token to, [rows, layers, top-k] for the first rows
    # (<= num_tokens) tokens: the routing replay's input (`vlmrl.models.routing`)
    routed_experts: Tensor | None = None

    def __post_init__(self) -> None:
        if len(self.loss_mask) != len(self.input_ids):
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries for {len(self.input_ids)} tokens")
        n = int(sum(1 for m in self.loss_mask if m))
        for name in ("rollout_logprobs", "old_logprobs"):
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise ValueError(f"{len(values)} {name} for {n} loss-masked tokens")
        if self.routed_experts is not None and (self.routed_experts.dim() != 3
                                                or self.routed_experts.shape[0] > len(self.input_ids)):
            raise ValueError(f"routed_experts shaped {list(self.routed_experts.shape)} for "
                             f"{len(self.input_ids)} tokens (want [<= tokens, layers, top-k])")

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def prompt_len(self) -> int:
        """Tokens before the first trained one: the prompt, where image placeholders live. What
        follows was generated (or is the answer) and is text to the model, as to the engines
        that decoded it, even where it holds the image token's id."""
        return next((i for i, m in enumerate(self.loss_mask) if m), len(self.loss_mask))


@dataclass
class MicroBatch:
    """One packed micro-batch, this rank's CP share, with per-token training targets.

    Every per-token tensor is aligned with `packed.input_ids` (position t holds what the
    logits at t are trained against: target token t+1 of the sample).
    """

    packed: PackedSequence
    pixel_values: Tensor | None
    targets: Tensor  # [T] long
    loss_mask: Tensor  # [T] float
    advantages: Tensor  # [T] float
    rollout_logp: Tensor  # [T] float (0 where unknown)
    has_rollout_logp: bool
    num_samples: int
    whole: PackedSequence  # the whole packed micro-batch (all CP shares), for unpacking
    extras: dict[str, Tensor] = field(default_factory=dict)  # e.g. old / ref logprobs
    # a filler: run so that every rank runs as many micro-batches, trained on nothing
    # (`even_micro_batches`)
    filler: bool = False
    staged_cu_seqlens: Tensor | None = None  # the loss's copy of cu_seqlens on the device (`staged`)

    @property
    def cu_seqlens(self) -> Tensor:
        return self.staged_cu_seqlens if self.staged_cu_seqlens is not None else self.packed.local_cu_seqlens

    def staged(self, device: torch.device) -> MicroBatch:
        """This micro-batch with the loss's per-token tensors and sample offsets on `device`
        (the model's inputs stay with `packed`). On CUDA they go through pinned memory
        without blocking: copied from pageable memory inside the loss, after each forward,
        every copy waited for the GPU's queue to drain."""
        from ..models.compat import to_device

        return replace(self, targets=to_device(self.targets, device), loss_mask=to_device(self.loss_mask, device),
                       advantages=to_device(self.advantages, device),
                       rollout_logp=to_device(self.rollout_logp, device),
                       extras={k: to_device(v, device) for k, v in self.extras.items()},
                       staged_cu_seqlens=to_device(self.packed.local_cu_seqlens, device))


def _place(values: list[float] | None, mask: Tensor) -> Tensor:
    """Per-masked-token values moved to the positions whose logits score those tokens."""
    out = torch.zeros_like(mask)
    if values is not None:
        where = torch.nonzero(mask > 0).view(-1)  # positions of masked tokens
        out[where - 1] = torch.as_tensor(values, dtype=torch.float32)
    return out


def shifted(sample: TrainSample) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(targets, mask, rollout_logp, old_logp) of one sample, shifted for next-token
    prediction: position t holds what the logits at t are trained against."""
    ids = torch.as_tensor(sample.input_ids, dtype=torch.long)
    mask = torch.as_tensor(sample.loss_mask, dtype=torch.float32)
    if mask[0] > 0:
        raise ValueError("the first token of a sample cannot be trained on (nothing predicts it)")
    targets = torch.zeros_like(ids)
    targets[:-1] = ids[1:]
    out_mask = torch.zeros_like(mask)
    out_mask[:-1] = mask[1:]
    return targets, out_mask, _place(sample.rollout_logprobs, mask), _place(sample.old_logprobs, mask)


def split_by_tokens(samples: Sequence[TrainSample], parts: int) -> list[list[int]]:
    """Indices of `samples` for each of `parts` ranks, balancing token counts (greedy LPT)."""
    order = sorted(range(len(samples)), key=lambda i: -samples[i].num_tokens)
    loads = [0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in order:
        r = min(range(parts), key=lambda k: (loads[k], len(out[k])))
        out[r].append(i)
        loads[r] += samples[i].num_tokens
    return [sorted(x) for x in out]


def micro_batches(lengths: Sequence[int], *, max_tokens: int | None, micro_batch_size: int) -> list[list[int]]:
    """Group sample indices into micro-batches: by a token budget (first fit in order, a
    sample longer than the budget alone) or `micro_batch_size` samples at a time."""
    if max_tokens is None:
        return [list(range(i, min(i + micro_batch_size, len(lengths))))
                for i in range(0, len(lengths), micro_batch_size)]
    groups: list[list[int]] = []
    sizes: list[int] = []
    for i, n in enumerate(lengths):
        for g, size in enumerate(sizes):
            if size + n <= max_tokens:
                groups[g].append(i)
                sizes[g] += n
                break
        else:
            groups.append([i])
            sizes.append(n)
    return groups


FILLER_TOKENS = 16  # a filler sample's length (padded further to the CP / SP multiple)


def filler_sample(pad_token_id: int = 0, tokens: int = FILLER_TOKENS) -> TrainSample:
    """A sample with nothing to train on: `tokens` pad tokens, no loss mask, no image. It only
    gives a rank a micro-batch to run (`even_micro_batches`)."""
    return TrainSample(input_ids=[pad_token_id] * tokens, loss_mask=[0.0] * tokens)


def even_micro_batches(samples: Sequence[TrainSample], groups: list[list[int]], count: int, *,
                       pad_token_id: int = 0) -> tuple[list[TrainSample], list[list[int]], int]:
    """`count` micro-batches from this rank's `groups` (indices into `samples`, fewer than or
    exactly `count`): every rank of a step must run as many where MoE layers exchange tokens
    between data-parallel ranks (expert parallelism), since each micro-batch's forward and
    backward is an all-to-all over the expert group, and a rank that ran out would wait in its
    gradient reduce while the others wait in the all-to-all.

    First the groups of several samples are split in two, the largest first (no added work);
    then each missing micro-batch is a filler sample (`filler_sample`, appended to the samples)
    that the loss functions count as nothing. Returns the samples, the groups and how many
    fillers were added."""
    if len(groups) > count:
        raise ValueError(f"{len(groups)} micro-batches on this rank, more than the {count} asked for")
    groups = [list(g) for g in groups]
    while len(groups) < count:
        splittable = [i for i, g in enumerate(groups) if len(g) > 1]
        if not splittable:
            break
        i = max(splittable, key=lambda k: sum(samples[j].num_tokens for j in groups[k]))
        g = groups[i]
        half = len(g) // 2
        groups[i:i + 1] = [g[:half], g[half:]]
    samples = list(samples)
    fillers = count - len(groups)
    for _ in range(fillers):
        groups.append([len(samples)])
        samples.append(filler_sample(pad_token_id))
    return samples, groups, fillers


def image_owners(samples: Sequence[TrainSample]) -> list[int | None]:
    """For each sample, the first sample whose images are its own: the same pixel tensor (a
    prompt's replies share their prompt's encoding) or equal grids and pixels; itself where no
    earlier sample has them, None where it has no image. A rollout step's micro-batch then
    runs the vision tower once per prompt instead of once per reply (`share_images`)."""
    owners: list[int | None] = []
    by_object: dict[tuple, int] = {}  # (the pixel tensor's id, grid) -> owner
    # (grid, shape, 256 pixels spread over the tensor) -> the distinct samples with them: only those are compared whole
    by_key: dict[tuple, list[int]] = {}
    for i, s in enumerate(samples):
        px = s.pixel_values
        if px is None or s.image_grid_thw is None:
            owners.append(None)
            continue
        grid = tuple(torch.as_tensor(s.image_grid_thw).reshape(-1).tolist())
        o = by_object.get((id(px), grid))
        if o is None:
            flat = px.reshape(-1)
            key = (grid, tuple(px.shape), tuple(flat[:: max(1, flat.numel() // 256)].tolist()))
            same = by_key.setdefault(key, [])
            o = next((j for j in same if torch.equal(samples[j].pixel_values, px)), i)
            if o == i:
                same.append(i)
            by_object[(id(px), grid)] = o
        owners.append(o)
    return owners


def build_micro_batch(samples: Sequence[TrainSample], *, image_token_id: int, spatial_merge_size: int,
                      cp_size: int = 1, cp_rank: int = 0, sp_size: int = 1, pad_token_id: int = 0,
                      bucket: bool = False) -> MicroBatch:
    """Pack `samples` (the whole micro-batch) and keep this CP rank's share.

    Each sample is padded to a multiple of 2*cp (zigzag chunks) times the sequence-parallel
    size (the sequence is split evenly over TP ranks); padding is masked out of the loss.
    With `bucket` (CUDA graphs) the last sample is padded further, to the token count
    `graph_bucket` gives."""
    parts = [shifted(s) for s in samples]
    multiple = (2 * cp_size if cp_size > 1 else 1) * sp_size
    pad_to = None
    if bucket:
        pad_to = graph_bucket(sum(-(-s.num_tokens // multiple) * multiple for s in samples), multiple)
    whole = pack([PackSample(s.input_ids, p[1], s.image_grid_thw, s.prompt_len, s.routed_experts)
                  for s, p in zip(samples, parts)],
                 image_token_id=image_token_id, spatial_merge_size=spatial_merge_size,
                 pad_multiple=multiple, pad_token_id=pad_token_id, pad_to=pad_to)
    total = whole.num_tokens
    targets = torch.zeros(total, dtype=torch.long)
    adv, lp, old = torch.zeros(total), torch.zeros(total), torch.zeros(total)
    for i, (s, (t, _, r, o)) in enumerate(zip(samples, parts)):
        a, n = int(whole.cu_seqlens_padded[i]), whole.seq_lens[i]
        targets[a:a + n] = t
        adv[a:a + n] = float(s.advantage)
        lp[a:a + n] = r
        old[a:a + n] = o
    owners = image_owners(samples)
    if any(o is not None and o != i for i, o in enumerate(owners)):
        whole = share_images(whole, owners)
    local = split_for_cp(whole, cp_size, cp_rank) if cp_size > 1 else whole
    idx = local.token_index
    pixels = [s.pixel_values for i, s in enumerate(samples) if s.pixel_values is not None and owners[i] == i]
    mb = MicroBatch(
        packed=local,
        pixel_values=torch.cat(pixels) if pixels else None,
        targets=targets[idx],
        loss_mask=local.loss_mask,
        advantages=adv[idx],
        rollout_logp=lp[idx],
        has_rollout_logp=all(s.rollout_logprobs is not None for s in samples),
        num_samples=len(samples),
        whole=whole,
    )
    if all(s.old_logprobs is not None for s in samples):
        mb.extras["old_logp"] = old[idx]
    return mb

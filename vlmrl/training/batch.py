"""Training samples, micro-batches and their packed tensors (pure functions).

A `TrainSample` is one prompt + response as token ids with the response marked in
`loss_mask` (on the tokens themselves). For next-token prediction the logits at position t
score token t+1, so `shift` moves masks, rollout logprobs and targets one position left
within each sample. Samples are then split over data-parallel ranks and packed into
micro-batches without padding between samples (dynamic batching by a token budget, or a
fixed number of samples).

With `share_prompts` (`trainer.share_prompts`) the replies of one prompt in a micro-batch run
the prompt once: it is packed as a segment of its own and each reply as a segment that
continues it (`PackSample.parent`). The loss then reads the model's outputs through
`MicroBatch.logit_index`: one row per position of each sample that predicts one of its
response tokens (the prompt's last row for the first, shared by the group), so every
per-token tensor of the loss (targets, masks, advantages, logprobs) and its sample offsets
are those of the samples as they were, minus their prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from ..models.packing import (
    PackedSequence,
    PackSample,
    cumulative_lengths,
    graph_bucket,
    mrope_position_ids,
    pack,
    share_images,
    split_for_cp,
)


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
    # shared prompts: the rows of the model's output the per-token tensors above are read from
    # ([T_loss] long), and the samples' offsets in those tensors ([n+1] int32); None: the
    # per-token tensors are aligned with `packed` itself
    logit_index: Tensor | None = None
    loss_cu_seqlens: Tensor | None = None
    shared_prompt_tokens: int = 0  # prompt tokens the model did not run again (`share_prompts`)

    @property
    def cu_seqlens(self) -> Tensor:
        """The samples' offsets in the per-token loss tensors."""
        if self.staged_cu_seqlens is not None:
            return self.staged_cu_seqlens
        return self.loss_cu_seqlens if self.loss_cu_seqlens is not None else self.packed.local_cu_seqlens

    def outputs(self, logits: Tensor) -> Tensor:
        """The model's per-token outputs (logits [T, ...]) aligned with the loss tensors."""
        return logits if self.logit_index is None else logits.index_select(0, self.logit_index.to(logits.device))

    def sample_values(self, values: Tensor) -> list[Tensor]:
        """Per-token values aligned with the loss tensors (whole sequence) -> each sample's
        values at its loss-masked positions, in sample order."""
        if self.loss_cu_seqlens is not None:
            cu = self.loss_cu_seqlens.tolist()
            return [values[a:b][self.loss_mask[a:b].cpu() > 0] for a, b in zip(cu[:-1], cu[1:])]
        whole = self.whole
        out = []
        for j in range(whole.num_samples):
            a, n = int(whole.cu_seqlens_padded[j]), whole.seq_lens[j]
            out.append(values[a:a + n][whole.loss_mask[a:a + n] > 0])
        return out

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
                       staged_cu_seqlens=to_device(self.loss_cu_seqlens if self.loss_cu_seqlens is not None
                                                   else self.packed.local_cu_seqlens, device),
                       logit_index=None if self.logit_index is None else to_device(self.logit_index, device))


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


def split_by_tokens(samples: Sequence[TrainSample], parts: int, keep_prompts: bool = False) -> list[list[int]]:
    """Indices of `samples` for each of `parts` ranks, balancing token counts (greedy LPT).
    `keep_prompts` (`trainer.share_prompts`): a prompt's samples go to one rank together,
    costed at the tokens they run there (the prompt once), where there are at least as many
    prompts as ranks; fewer, and the samples are split one by one."""
    units = [[i] for i in range(len(samples))]
    cost = [samples[i].num_tokens for i in range(len(samples))]
    if keep_prompts and parts > 1:
        groups = prompt_groups(samples)
        if len(groups) >= parts:
            units = groups
            cost = [sum(samples[i].num_tokens for i in g) - (len(g) - 1) * samples[g[0]].prompt_len for g in groups]
    order = sorted(range(len(units)), key=lambda u: -cost[u])
    loads = [0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for u in order:
        r = min(range(parts), key=lambda k: (loads[k], len(out[k])))
        out[r].extend(units[u])
        loads[r] += cost[u]
    return [sorted(x) for x in out]


def micro_batches(lengths: Sequence[int], *, max_tokens: int | None, micro_batch_size: int,
                  prompts: Sequence[tuple[int, int]] | None = None) -> list[list[int]]:
    """Group sample indices into micro-batches: by a token budget (first fit in order, a
    sample longer than the budget alone) or `micro_batch_size` samples at a time.

    `prompts` (shared prompts): each sample's (prompt group, prompt length), `prompt_groups`'
    numbering; a sample joining a micro-batch that already holds its prompt costs only its
    reply, as the shared layout runs it."""
    if max_tokens is None:
        return [list(range(i, min(i + micro_batch_size, len(lengths))))
                for i in range(0, len(lengths), micro_batch_size)]
    groups: list[list[int]] = []
    sizes: list[int] = []
    held: list[set[int]] = []  # the prompt groups each micro-batch holds
    for i, n in enumerate(lengths):
        key, prompt = prompts[i] if prompts is not None else (-1, 0)
        for g, size in enumerate(sizes):
            cost = n - prompt if key in held[g] else n
            if size + cost <= max_tokens:
                groups[g].append(i)
                sizes[g] += cost
                held[g].add(key)
                break
        else:
            groups.append([i])
            sizes.append(n)
            held.append({key})
    return groups


def shared_prompt_keys(samples: Sequence[TrainSample]) -> list[tuple[int, int]]:
    """Each sample's (prompt group, prompt length) for `micro_batches`: the samples of a group of
    `prompt_groups` share its number; a sample alone has a group of its own."""
    out: list[tuple[int, int]] = [(-1, 0)] * len(samples)
    for k, g in enumerate(prompt_groups(samples)):
        for i in g:
            out[i] = (k, samples[i].prompt_len if len(g) > 1 else 0)
    return out


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


def prompt_groups(samples: Sequence[TrainSample], owners: Sequence[int | None] | None = None) -> list[list[int]]:
    """Indices of `samples` grouped by their prompt, in order of first appearance: the same
    tokens before the first trained one and the same images (`image_owners`). A group of one
    is a sample no other shares its prompt with."""
    owners = image_owners(samples) if owners is None else owners
    by_key: dict[tuple, int] = {}
    groups: list[list[int]] = []
    for i, s in enumerate(samples):
        n = s.prompt_len
        key = (n, owners[i], tuple(s.input_ids[:n]))
        if n >= s.num_tokens:  # nothing after its prompt: it stays whole
            groups.append([i])
            continue
        g = by_key.get(key)
        if g is None:
            by_key[key] = len(groups)
            groups.append([i])
        else:
            groups[g].append(i)
    return groups


def build_micro_batch(samples: Sequence[TrainSample], *, image_token_id: int, spatial_merge_size: int,
                      cp_size: int = 1, cp_rank: int = 0, sp_size: int = 1, pad_token_id: int = 0,
                      bucket: bool = False, share_prompts: bool = False) -> MicroBatch:
    """Pack `samples` (the whole micro-batch) and keep this CP rank's share.

    Each sample is padded to a multiple of 2*cp (zigzag chunks) times the sequence-parallel
    size (the sequence is split evenly over TP ranks); padding is masked out of the loss.
    With `bucket` (CUDA graphs) the last sample is padded further, to the token count
    `graph_bucket` gives. With `share_prompts` (no CP) samples with the same prompt run it
    once (`build_shared_micro_batch`) where any two do."""
    if share_prompts:
        if cp_size > 1:
            raise ValueError("shared prompts need cp_size 1 (context parallelism splits every sample)")
        owners = image_owners(samples)
        groups = prompt_groups(samples, owners)
        if any(len(g) > 1 for g in groups):
            return build_shared_micro_batch(samples, groups, owners, image_token_id=image_token_id,
                                            spatial_merge_size=spatial_merge_size, sp_size=sp_size,
                                            pad_token_id=pad_token_id, bucket=bucket)
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


def build_shared_micro_batch(samples: Sequence[TrainSample], groups: Sequence[Sequence[int]],
                             owners: Sequence[int | None], *, image_token_id: int, spatial_merge_size: int,
                             sp_size: int = 1, pad_token_id: int = 0, bucket: bool = False) -> MicroBatch:
    """The micro-batch of `samples` with each group of `groups` (indices sharing a prompt,
    `prompt_groups`) packed as its prompt followed by its members' responses, each response
    a segment continuing the prompt's (`PackSample.parent`); a group of one stays one
    segment. The packed sequence's own loss mask is zero (the loss reads its own tensors).
    Segments are not padded (a parent's state ends at its last real token); the
    last is padded so that the total is a multiple of `sp_size` (or the CUDA-graph bucket).

    The loss tensors hold, per sample in order, its positions P-1 .. n-2 (P its prompt
    length, n its tokens): the positions whose logits score its response tokens, read from
    the packed rows `logit_index` gives (position P-1 is the prompt segment's last row)."""
    segs: list[PackSample] = []
    seg_pixels: list[Tensor] = []
    row_of: list[Tensor] = [torch.empty(0)] * len(samples)  # each sample's tokens -> packed rows
    offset = 0
    # a group's replies in an order of their own (their tokens), not the batch's: a prompt and its
    # replies attend in one call on CPU, whose sums follow the keys' order, so a reply's logprobs do
    # not change with the order the samples come in (the old-policy pass and a shuffled update agree)
    groups = [sorted(g, key=lambda i: (samples[i].input_ids[samples[i].prompt_len:], i)) for g in groups]
    group_of = {i: k for k, g in enumerate(groups) for i in g}
    # the group whose segment holds each group's images: the one of the images' owner (`image_owners`)
    image_group = [None if owners[g[0]] is None else group_of[owners[g[0]]] for g in groups]
    for k, g in enumerate(groups):
        first = samples[g[0]]
        full_pos = [mrope_position_ids(torch.as_tensor(samples[i].input_ids), samples[i].image_grid_thw,
                                       image_token_id=image_token_id, spatial_merge_size=spatial_merge_size,
                                       sample_index=i, prompt_len=samples[i].prompt_len) for i in g]
        if len(g) == 1:
            i = g[0]
            segs.append(PackSample(first.input_ids, [0.0] * first.num_tokens, first.image_grid_thw, first.prompt_len,
                                   first.routed_experts, position_ids=full_pos[0]))
            if first.pixel_values is not None and image_group[k] == k:
                seg_pixels.append(first.pixel_values)
            row_of[i] = torch.arange(offset, offset + first.num_tokens)
            offset += first.num_tokens
            continue
        p_len = first.prompt_len
        prompt_rows = None if first.routed_experts is None else first.routed_experts[:p_len]
        parent = len(segs)
        segs.append(PackSample(first.input_ids[:p_len], [0.0] * p_len, first.image_grid_thw, p_len, prompt_rows,
                               position_ids=full_pos[0][:, :p_len]))
        if first.pixel_values is not None and image_group[k] == k:
            seg_pixels.append(first.pixel_values)
        prompt_at = offset
        offset += p_len
        for m, i in enumerate(g):
            s = samples[i]
            r = s.num_tokens - p_len
            rows = None if s.routed_experts is None else s.routed_experts[p_len:]
            segs.append(PackSample(s.input_ids[p_len:], [0.0] * r, None, 0, rows if rows is None or len(rows) else None,
                                   parent=parent, position_ids=full_pos[m][:, p_len:]))
            row_of[i] = torch.cat([torch.arange(prompt_at, prompt_at + p_len), torch.arange(offset, offset + r)])
            offset += r
    total = offset
    pad_to = graph_bucket(total, sp_size) if bucket else -(-total // sp_size) * sp_size
    whole = pack(segs, image_token_id=image_token_id, spatial_merge_size=spatial_merge_size,
                 pad_token_id=pad_token_id, pad_to=pad_to if pad_to != total else None)
    seg_owners = _segment_owners(groups, image_group)
    if any(o is not None and o != i for i, o in enumerate(seg_owners)):
        whole = share_images(whole, seg_owners)
    # the loss layout: per sample, its positions prompt_len - 1 .. n - 2
    index, targets, masks, adv, lp, old, lens = [], [], [], [], [], [], []
    for i, s in enumerate(samples):
        t, m, r, o = shifted(s)
        a, b = s.prompt_len - 1, s.num_tokens - 1
        if a < 0:
            raise ValueError(f"sample {i}: a response needs a prompt token before it")
        index.append(row_of[i][a:b])
        targets.append(t[a:b])
        masks.append(m[a:b])
        lp.append(r[a:b])
        old.append(o[a:b])
        adv.append(torch.full((b - a,), float(s.advantage)))
        lens.append(b - a)
    loss_mask = torch.cat(masks)
    mb = MicroBatch(
        packed=whole,
        pixel_values=torch.cat(seg_pixels) if seg_pixels else None,
        targets=torch.cat(targets),
        loss_mask=loss_mask,
        advantages=torch.cat(adv),
        rollout_logp=torch.cat(lp),
        has_rollout_logp=all(s.rollout_logprobs is not None for s in samples),
        num_samples=len(samples),
        whole=whole,
        logit_index=torch.cat(index),
        loss_cu_seqlens=cumulative_lengths(lens),
        shared_prompt_tokens=sum((len(g) - 1) * samples[g[0]].prompt_len for g in groups if len(g) > 1),
    )
    if all(s.old_logprobs is not None for s in samples):
        mb.extras["old_logp"] = torch.cat(old)
    return mb


def _segment_owners(groups: Sequence[Sequence[int]], image_group: Sequence[int | None]) -> list[int | None]:
    """The image owner of each packed segment (`share_images`): a group's prompt segment (or
    whole sample) reads its images from the segment of the group that holds them
    (`image_group`, itself where it does); replies hold none."""
    seg_of_group: list[int] = []
    out: list[int | None] = []
    for g, o in zip(groups, image_group, strict=True):
        seg_of_group.append(len(out))
        out.append(o)  # a group index for now
        if len(g) > 1:
            out.extend([None] * len(g))
    return [None if o is None else seg_of_group[o] for o in out]

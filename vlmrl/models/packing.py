"""THD packing of variable-length samples, per-sample M-RoPE positions, CP zigzag split.

Pure tensor functions (torch only, no process groups):

- `mrope_position_ids`: the [3, T] positions of one sample, as HF's `get_rope_index` for
  Qwen2.5-VL computes them (text advances all axes; image tokens take t/h/w grid positions).
  Image placeholders live in the prompt: a generated token is text whatever its id, as the
  engines decode it (embedded as a word, one position further), so a response that holds the
  image token's id claims no image features.
- `pack`: samples -> one flat sequence with `cu_seqlens`, no padding between samples
  (unless each sample must be a multiple of `pad_multiple`, e.g. 2*cp for context
  parallelism); positions are rebuilt per sample and concatenated.
- `split_for_cp`: the zigzag share of CP rank r: every sample (padded to a multiple of
  2*cp) is cut into 2*cp chunks and rank r keeps chunks r and 2*cp-1-r, with its token
  ids, positions, loss mask, the engine's experts of its tokens (routing replay) and the
  rows of the image features it needs.
- `share_images`: samples whose images are another sample's (a prompt's group of replies)
  read that sample's image features: the vision tower runs on each distinct image once.
- `unpack` / `cp_merge`: per-token outputs back to samples / to the unsplit order.
- Shared prompts (`PackSample.parent`): a segment may continue another one, its parent,
  instead of starting afresh: a group's prompt is packed once and each reply is a segment
  whose tokens attend to the prompt's (attention) or start from its final state (Gated
  DeltaNet), with the positions they have after the prompt. One level only: a parent has
  no parent. `vlmrl.training.batch` builds such layouts (`trainer.share_prompts`).

Layout conventions (those of TransformerEngine's THD format): `cu_seqlens` are the cumulative
real lengths, `cu_seqlens_padded` the cumulative padded lengths, i.e. the sample offsets in
the unsplit packed tensor. On a CP rank every sample holds `padded_len / cp` tokens, so its
local offsets are `cu_seqlens_padded // cp`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor


@dataclass
class PackSample:
    """One sample to pack: its token ids, optional loss mask and the grids of its images."""

    input_ids: Tensor | Sequence[int]
    loss_mask: Tensor | Sequence[float] | None = None  # None: all ones
    image_grid_thw: Tensor | Sequence[Sequence[int]] | None = None  # [n_images, 3] patch grids
    # tokens [0, prompt_len) may be image placeholders; the rest (what an engine generated) are
    # text whatever their ids. None: the whole sample is prompt.
    prompt_len: int | None = None
    # the experts the rollout engine routed each token to, [n_rows <= T, layers, top-k] for the
    # sample's first n_rows tokens (engines report all but the last); None: not known
    routed_experts: Tensor | None = None
    # the index of an earlier sample this one continues (a reply after its group's prompt,
    # which is packed once as that sample): its tokens come after the parent's real tokens,
    # with `position_ids` as they are there; None: the sample starts afresh
    parent: int | None = None
    # [3, n] M-RoPE positions of the sample's tokens (a continuation's, after its parent);
    # None: computed from the sample alone (`mrope_position_ids`)
    position_ids: Tensor | None = None


@dataclass
class PackedSequence:
    """One packed (THD) sequence, whole or one CP rank's share of it."""

    input_ids: Tensor  # [T] long
    position_ids: Tensor  # [3, T] long
    loss_mask: Tensor  # [T] float
    seq_lens: list[int]  # real length of each sample
    padded_lens: list[int]  # padded length of each sample (whole sequence)
    cu_seqlens: Tensor  # [n+1] int32, cumulative real lengths
    cu_seqlens_padded: Tensor  # [n+1] int32, sample offsets in the whole packed sequence
    image_grid_thw: Tensor  # [n_images, 3] long, every image of every sample in order
    images_per_sample: list[int]
    image_tokens_per_sample: list[int]  # image placeholder tokens of each sample (whole sample)
    # For every image placeholder token held here, its row in the concatenated image features.
    image_token_index: Tensor  # [n_image_tokens_here] long
    # True on the image placeholder tokens held here (the image token's id in a prompt; the
    # same id in a response is text)
    image_mask: Tensor  # [T] bool
    # For every token held here, its index in the whole packed sequence.
    token_index: Tensor  # [T] long
    image_token_id: int = -1
    cp_size: int = 1
    cp_rank: int = 0
    # the engine's experts of every token held here [T, layers, top-k] (-1: not known, e.g. a
    # sample's last token or padding); None: no sample carries them (`vlmrl.models.routing`)
    routed_experts: Tensor | None = None
    # the grids of the images the vision tower runs, in the order of its features, where samples
    # share images (`share_images`); None: every image of every sample (`image_grid_thw`)
    vision_grid_thw: Tensor | None = None
    # per sample: the index of the sample it continues (its tokens attend to that sample's
    # real tokens and start from its state), -1 where it starts afresh; None: every sample
    # starts afresh. Parents are unpadded and come before their children.
    parents: list[int] | None = None

    @property
    def num_samples(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def total_padded(self) -> int:
        return int(self.cu_seqlens_padded[-1])

    @property
    def max_seqlen(self) -> int:
        return max(self.padded_lens) if self.padded_lens else 0

    @property
    def local_cu_seqlens(self) -> Tensor:
        """Sample offsets in the tensors held here (whole sequence: cu_seqlens_padded)."""
        return self.cu_seqlens_padded // self.cp_size

    @property
    def num_image_tokens(self) -> int:
        return sum(self.image_tokens_per_sample)

    @property
    def vision_grids(self) -> Tensor:
        """[n, 3]: the grids of the images the vision tower runs for this sequence."""
        return self.image_grid_thw if self.vision_grid_thw is None else self.vision_grid_thw

    def to(self, device: torch.device | str) -> PackedSequence:
        moved = {k: getattr(self, k).to(device) for k in
                 ("input_ids", "position_ids", "loss_mask", "cu_seqlens", "cu_seqlens_padded",
                  "image_grid_thw", "image_token_index", "image_mask", "token_index")}
        for k in ("routed_experts", "vision_grid_thw"):
            if getattr(self, k) is not None:
                moved[k] = getattr(self, k).to(device)
        return replace(self, **moved)


def image_token_count(grid_thw: Tensor, spatial_merge_size: int) -> Tensor:
    """Placeholder tokens of each image: t*h*w / merge^2 (patches merged into one token)."""
    return grid_thw.long().prod(-1) // (spatial_merge_size ** 2)


def image_placeholders(input_ids: Tensor, image_token_id: int, prompt_len: int | None = None) -> Tensor:
    """[T] bool: the image placeholder tokens of one sample, i.e. the image token's id within its
    first `prompt_len` tokens (None: anywhere). Beyond the prompt an engine generated the tokens
    and embedded each as text, the image token's id included."""
    ids = torch.as_tensor(input_ids).long().view(-1)
    is_image = ids == image_token_id
    if prompt_len is not None:
        is_image[max(int(prompt_len), 0):] = False
    return is_image


def mrope_position_ids(input_ids: Tensor, image_grid_thw: Tensor | None, *, image_token_id: int,
                       spatial_merge_size: int, sample_index: int | None = None,
                       prompt_len: int | None = None) -> Tensor:
    """[3, T] M-RoPE positions of one sample (Qwen2.5-VL rules, images only).

    Each image's placeholder tokens must be contiguous and number t*h*w/merge^2; the images'
    grids are consumed in order. Placeholders are the image token's id in the first
    `prompt_len` tokens (`image_placeholders`); later tokens advance as text. A mismatch raises
    ValueError naming `sample_index`.
    """
    ids = torch.as_tensor(input_ids).long().view(-1)
    n = ids.shape[0]
    where = f"sample {sample_index}: " if sample_index is not None else ""
    is_image = image_placeholders(ids, image_token_id, prompt_len)
    image_pos = torch.nonzero(is_image).view(-1)
    grids = (torch.zeros(0, 3, dtype=torch.long) if image_grid_thw is None
             else torch.as_tensor(image_grid_thw).long().view(-1, 3).cpu())
    counts = image_token_count(grids, spatial_merge_size) if len(grids) else torch.zeros(0, dtype=torch.long)
    if int(counts.sum()) != image_pos.numel():
        raise ValueError(f"{where}{image_pos.numel()} image tokens in the sequence but its "
                         f"{len(grids)} image grid(s) {grids.tolist()} need {int(counts.sum())}")
    out = torch.empty(3, n, dtype=torch.long)
    cursor = 0  # next token to place
    pos = 0  # next text position
    taken = 0  # image tokens consumed
    for k in range(len(grids)):
        count = int(counts[k])
        start = int(image_pos[taken])
        if count and int(image_pos[taken + count - 1]) - start != count - 1:
            raise ValueError(f"{where}the {count} placeholder tokens of image {k} are not contiguous")
        text = start - cursor
        out[:, cursor:start] = torch.arange(pos, pos + text).expand(3, -1)
        pos += text
        t, h, w = (int(x) for x in grids[k])
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        tt = torch.arange(t).view(-1, 1, 1).expand(t, gh, gw)
        hh = torch.arange(gh).view(1, -1, 1).expand(t, gh, gw)
        ww = torch.arange(gw).view(1, 1, -1).expand(t, gh, gw)
        out[:, start:start + count] = torch.stack([tt, hh, ww]).reshape(3, -1) + pos
        pos += max(gh, gw)
        cursor = start + count
        taken += count
    out[:, cursor:] = torch.arange(pos, pos + n - cursor).expand(3, -1)
    return out


def graph_bucket(num_tokens: int, multiple: int = 1, per_octave: int = 8) -> int:
    """The token count a packed micro-batch of `num_tokens` is padded to when its layers
    replay CUDA graphs (`hardware.cuda_graphs`): the next multiple of 2^(k-3) for
    2^k <= num_tokens < 2^(k+1) (`per_octave` = 8 buckets per doubling, at most 12.5% padding,
    at least 64 tokens), and of `multiple` (the per-sample padding for CP / SP)."""
    if num_tokens < 1 or multiple < 1 or per_octave < 1 or per_octave & (per_octave - 1):
        raise ValueError(f"graph_bucket({num_tokens}, multiple={multiple}, per_octave={per_octave}): "
                         "needs positive sizes and a power-of-two per_octave")
    step = max(64, (1 << (num_tokens.bit_length() - 1)) // per_octave)
    step = math.lcm(step, multiple)
    return -(-num_tokens // step) * step


def pack(samples: Sequence[PackSample], *, image_token_id: int, spatial_merge_size: int,
         pad_multiple: int = 1, pad_token_id: int = 0, pad_to: int | None = None) -> PackedSequence:
    """Concatenate samples into one THD sequence with per-sample M-RoPE positions.

    With `pad_multiple > 1` each sample is padded at its end to a multiple of it (pad
    tokens: `pad_token_id`, loss mask 0, text positions continuing the sample's). Causal
    attention keeps real tokens blind to their sample's padding. `pad_to` (a multiple of
    `pad_multiple`, at least the packed length) pads the last sample further so that the
    sequence has exactly that many tokens (`graph_bucket`); the number of samples, and so
    every per-sample normaliser, stays the same.
    """
    if not samples:
        raise ValueError("pack needs at least one sample")
    if pad_to is not None and pad_to % pad_multiple:
        raise ValueError(f"pad_to={pad_to} is not a multiple of pad_multiple={pad_multiple}")
    ids_l, pos_l, mask_l, grids_l, image_l = [], [], [], [], []
    seq_lens, padded_lens, n_images, n_image_tokens = [], [], [], []
    for i, s in enumerate(samples):
        ids = torch.as_tensor(s.input_ids).long().view(-1)
        n = ids.shape[0]
        if n == 0:
            raise ValueError(f"sample {i} is empty")
        grid = (torch.zeros(0, 3, dtype=torch.long) if s.image_grid_thw is None
                else torch.as_tensor(s.image_grid_thw).long().view(-1, 3))
        if s.position_ids is not None:
            pos = torch.as_tensor(s.position_ids).long()
            if tuple(pos.shape) != (3, n):
                raise ValueError(f"sample {i}: position_ids shaped {list(pos.shape)} for {n} tokens (want [3, {n}])")
        else:
            pos = mrope_position_ids(ids, grid, image_token_id=image_token_id,
                                     spatial_merge_size=spatial_merge_size, sample_index=i, prompt_len=s.prompt_len)
        is_image = image_placeholders(ids, image_token_id, s.prompt_len)
        mask = (torch.ones(n) if s.loss_mask is None else torch.as_tensor(s.loss_mask).float().view(-1))
        if mask.shape[0] != n:
            raise ValueError(f"sample {i}: loss_mask has {mask.shape[0]} entries for {n} tokens")
        padded = -(-n // pad_multiple) * pad_multiple
        if pad_to is not None and i == len(samples) - 1:
            padded_before = sum(padded_lens)
            if padded_before + padded > pad_to:
                raise ValueError(f"pad_to={pad_to} is shorter than the {padded_before + padded} packed tokens")
            padded = pad_to - padded_before
        if padded > n:
            extra = padded - n
            ids = torch.cat([ids, torch.full((extra,), pad_token_id, dtype=torch.long)])
            nxt = int(pos.max()) + 1
            pos = torch.cat([pos, torch.arange(nxt, nxt + extra).expand(3, -1)], dim=1)
            mask = torch.cat([mask, torch.zeros(extra)])
            is_image = torch.cat([is_image, torch.zeros(extra, dtype=torch.bool)])
        ids_l.append(ids)
        image_l.append(is_image)
        pos_l.append(pos)
        mask_l.append(mask)
        grids_l.append(grid)
        seq_lens.append(n)
        padded_lens.append(padded)
        n_images.append(len(grid))
        n_image_tokens.append(int(image_token_count(grid, spatial_merge_size).sum()) if len(grid) else 0)
    input_ids = torch.cat(ids_l)
    total = input_ids.shape[0]
    routed = _pack_routed_experts(samples, padded_lens, total)
    parents = _parents(samples, seq_lens, padded_lens)
    return PackedSequence(
        input_ids=input_ids,
        position_ids=torch.cat(pos_l, dim=1),
        loss_mask=torch.cat(mask_l),
        seq_lens=seq_lens,
        padded_lens=padded_lens,
        cu_seqlens=cumulative_lengths(seq_lens),
        cu_seqlens_padded=cumulative_lengths(padded_lens),
        image_grid_thw=torch.cat(grids_l) if grids_l else torch.zeros(0, 3, dtype=torch.long),
        images_per_sample=n_images,
        image_tokens_per_sample=n_image_tokens,
        image_token_index=torch.arange(sum(n_image_tokens)),
        image_mask=torch.cat(image_l),
        token_index=torch.arange(total),
        image_token_id=image_token_id,
        routed_experts=routed,
        parents=parents,
    )


def _parents(samples: Sequence[PackSample], seq_lens: list[int], padded_lens: list[int]) -> list[int] | None:
    """Each sample's parent (-1: none), checked: an earlier sample, unpadded (its children
    start from its last real token), that continues nothing itself; a child brings no images
    (they belong to the prompt). None where no sample has a parent."""
    if all(s.parent is None for s in samples):
        return None
    out = []
    for i, s in enumerate(samples):
        p = -1 if s.parent is None else int(s.parent)
        if p >= 0:
            if not p < i:
                raise ValueError(f"sample {i}: its parent {p} does not come before it")
            if samples[p].parent is not None:
                raise ValueError(f"sample {i}: its parent {p} continues sample {samples[p].parent} (one level only)")
            if padded_lens[p] != seq_lens[p]:
                raise ValueError(f"sample {i}: its parent {p} is padded ({seq_lens[p]} -> {padded_lens[p]} tokens); "
                                 "a parent's state must end at its last real token")
            if s.image_grid_thw is not None and len(torch.as_tensor(s.image_grid_thw).view(-1, 3)):
                raise ValueError(f"sample {i} continues sample {p} but has images of its own")
        out.append(p)
    return out


def _pack_routed_experts(samples: Sequence[PackSample], padded_lens: list[int], total: int) -> Tensor | None:
    """[total, layers, k] of the samples' engine experts at their packed rows, -1 elsewhere
    (None when no sample has any). Samples must agree on layers and k."""
    given = [(i, s.routed_experts) for i, s in enumerate(samples) if s.routed_experts is not None]
    if not given:
        return None
    shape = tuple(given[0][1].shape[1:])
    out = torch.full((total, *shape), -1, dtype=torch.int16)
    offsets = [0]
    for n in padded_lens:
        offsets.append(offsets[-1] + n)
    for i, rows in given:
        rows = torch.as_tensor(rows)
        if rows.dim() != 3 or tuple(rows.shape[1:]) != shape:
            raise ValueError(f"sample {i}: engine experts shaped {list(rows.shape)}, the batch's first "
                             f"[rows, {shape[0]}, {shape[1]}]")
        n = int(torch.as_tensor(samples[i].input_ids).numel())
        if rows.shape[0] > n:
            raise ValueError(f"sample {i}: engine experts for {rows.shape[0]} tokens, the sample has {n}")
        out[offsets[i]:offsets[i] + rows.shape[0]] = rows.to(torch.int16)
    return out


def cumulative_lengths(lengths: Sequence[int]) -> Tensor:
    """[n+1] int32 offsets of back-to-back pieces of `lengths` (0 first)."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if lengths:
        out[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0).to(torch.int32)
    return out


def share_images(packed: PackedSequence, owners: Sequence[int | None]) -> PackedSequence:
    """The whole packed sequence with each sample's image placeholders reading the image
    features of `owners[i]`, the first sample whose images are sample i's own (i itself where
    no sample before it has them; None for a sample without images). The vision tower then
    runs once per distinct sample's images (`vision_grid_thw`, in sample order) and
    `image_token_index` maps every placeholder to its row among those features. Features
    depend on the pixels and the grid alone, so this is the same computation as running every
    sample's copy: in the backward, the gradients of the samples that share an image add up
    before the vision tower instead of after it."""
    if packed.cp_size != 1:
        raise ValueError("share_images takes the whole packed sequence")
    n = packed.num_samples
    if len(owners) != n:
        raise ValueError(f"share_images: {len(owners)} owners for {n} samples")
    first_grid = [0]
    for k in packed.images_per_sample:
        first_grid.append(first_grid[-1] + k)
    grids = [packed.image_grid_thw[first_grid[i]:first_grid[i + 1]] for i in range(n)]
    row: dict[int, int] = {}  # distinct sample -> its first feature row
    kept, index, rows = [], [], 0
    for i, o in enumerate(owners):
        has = packed.images_per_sample[i] > 0
        if o is None:
            if has:
                raise ValueError(f"sample {i} has {packed.images_per_sample[i]} images but no owner")
            continue
        if not 0 <= o <= i or (o != i and owners[o] != o):
            raise ValueError(f"sample {i}: owner {o} is not a sample before it that owns its images")
        if not has or not torch.equal(grids[o], grids[i]):
            raise ValueError(f"sample {i}: its image grids {grids[i].tolist()} are not those of its owner, "
                             f"sample {o} ({grids[o].tolist()})")
        if o == i:
            row[i] = rows
            rows += packed.image_tokens_per_sample[i]
            kept.append(grids[i])
        index.append(torch.arange(row[o], row[o] + packed.image_tokens_per_sample[i]))
    return replace(packed,
                   image_token_index=torch.cat(index) if index else torch.zeros(0, dtype=torch.long),
                   vision_grid_thw=torch.cat(kept) if kept else torch.zeros(0, 3, dtype=torch.long))


def check_image_tokens(packed: PackedSequence) -> None:
    """Raise ValueError naming the first sample whose image placeholder count differs from the
    feature count its image grids give (whole sequences only: a CP share holds parts of samples)."""
    if packed.cp_size != 1:
        raise ValueError("check_image_tokens takes the whole packed sequence")
    offsets = packed.cu_seqlens_padded.tolist()
    is_image = packed.image_mask
    for i, want in enumerate(packed.image_tokens_per_sample):
        have = int(is_image[offsets[i]:offsets[i + 1]].sum())
        if have != want:
            raise ValueError(f"sample {i}: {have} image tokens but its image grids give {want} features")


def zigzag_index(padded_lens: Sequence[int], cp_size: int, cp_rank: int) -> Tensor:
    """Indices (into the whole packed sequence) of the tokens CP rank `cp_rank` holds.

    Sample i (padded length L, a multiple of 2*cp) is cut into 2*cp chunks of L/(2*cp);
    the rank keeps chunks `cp_rank` and `2*cp-1-cp_rank`, in that order.
    """
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} outside [0, {cp_size})")
    parts = []
    offset = 0
    for i, length in enumerate(padded_lens):
        if length % (2 * cp_size):
            raise ValueError(f"sample {i}: padded length {length} is not a multiple of 2*cp = {2 * cp_size} "
                             f"(pack with pad_multiple={2 * cp_size})")
        chunk = length // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            parts.append(torch.arange(offset + c * chunk, offset + (c + 1) * chunk))
        offset += length
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def split_for_cp(packed: PackedSequence, cp_size: int, cp_rank: int) -> PackedSequence:
    """The share of CP rank `cp_rank` of a whole packed sequence (positions carried along)."""
    if packed.cp_size != 1:
        raise ValueError("split_for_cp takes the whole packed sequence")
    if cp_size == 1:
        return packed
    if packed.parents is not None:
        raise ValueError("context parallelism does not split shared-prompt layouts (samples with parents)")
    idx = zigzag_index(packed.padded_lens, cp_size, cp_rank)
    # ordinal of each image token among all image tokens of the whole sequence
    is_image = packed.image_mask
    ordinal = torch.cumsum(is_image.long(), 0) - 1
    local_is_image = is_image[idx]
    return replace(
        packed,
        input_ids=packed.input_ids[idx],
        position_ids=packed.position_ids[:, idx],
        loss_mask=packed.loss_mask[idx],
        image_token_index=packed.image_token_index[ordinal[idx][local_is_image]],
        image_mask=local_is_image,
        token_index=packed.token_index[idx],
        cp_size=cp_size,
        cp_rank=cp_rank,
        routed_experts=None if packed.routed_experts is None else packed.routed_experts[idx],
    )


def unpack(values: Tensor, packed: PackedSequence, *, dim: int = 0) -> list[Tensor]:
    """Per-token values of the whole packed sequence -> one tensor per sample (real tokens)."""
    if packed.cp_size != 1:
        raise ValueError("unpack takes whole-sequence values; merge CP shares with cp_merge first")
    offsets = packed.cu_seqlens_padded.tolist()
    return [values.narrow(dim, offsets[i], packed.seq_lens[i]) for i in range(packed.num_samples)]


def cp_merge(shares: Sequence[Tensor], padded_lens: Sequence[int], *, dim: int = 0) -> Tensor:
    """Per-token values held by each CP rank (rank order) -> values in the whole sequence."""
    cp_size = len(shares)
    total = sum(padded_lens)
    first = shares[0].movedim(dim, 0)
    out = first.new_empty((total, *first.shape[1:]))
    for r, share in enumerate(shares):
        out[zigzag_index(padded_lens, cp_size, r).to(out.device)] = share.movedim(dim, 0)
    return out.movedim(0, dim)

"""THD packing: per-sample M-RoPE positions, cu_seqlens, CP zigzag split, unpack."""

from __future__ import annotations

import pytest
import torch

from vlmrl.models.packing import (
    PackSample,
    cp_merge,
    graph_bucket,
    mrope_position_ids,
    pack,
    split_for_cp,
    unpack,
    zigzag_index,
)

IMG, START, END = 5, 3, 4
MERGE = 2


def _sample(prefix: int, grids: list[list[int]], suffix: int, seed: int) -> PackSample:
    g = torch.Generator().manual_seed(seed)
    ids: list[int] = torch.randint(10, 100, (prefix,), generator=g).tolist()
    for t, h, w in grids:
        ids += [START] + [IMG] * (t * h * w // MERGE**2) + [END]
        ids += torch.randint(10, 100, (2,), generator=g).tolist()
    ids += torch.randint(10, 100, (suffix,), generator=g).tolist()
    mask = [0.0] * (len(ids) - suffix) + [1.0] * suffix
    return PackSample(torch.tensor(ids), torch.tensor(mask), torch.tensor(grids).view(-1, 3) if grids else None)


def test_text_only_positions_are_arange():
    pos = mrope_position_ids(torch.arange(7) + 10, None, image_token_id=IMG, spatial_merge_size=MERGE)
    assert torch.equal(pos, torch.arange(7).expand(3, -1))


def test_image_positions_by_hand():
    # 2 text, image grid (1, 4, 6) -> 2x3 merged tokens, 2 text
    ids = torch.tensor([10, 11] + [IMG] * 6 + [12, 13])
    pos = mrope_position_ids(ids, torch.tensor([[1, 4, 6]]), image_token_id=IMG, spatial_merge_size=MERGE)
    assert pos[:, :2].tolist() == [[0, 1]] * 3
    assert pos[0, 2:8].tolist() == [2] * 6  # temporal
    assert pos[1, 2:8].tolist() == [2, 2, 2, 3, 3, 3]  # rows
    assert pos[2, 2:8].tolist() == [2, 3, 4, 2, 3, 4]  # columns
    # text resumes at image start + max(h, w) / merge = 2 + 3
    assert pos[:, 8:].tolist() == [[5, 6]] * 3


def test_positions_match_hf_get_rope_index():
    from types import SimpleNamespace

    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    cfg = Qwen2_5_VLConfig(vision_config=dict(spatial_merge_size=MERGE), image_token_id=IMG,
                           vision_start_token_id=START, vision_end_token_id=END)
    fake = SimpleNamespace(config=cfg)
    fake.get_vision_position_ids = lambda *a, **k: Qwen2_5_VLModel.get_vision_position_ids(fake, *a, **k)
    for s in (_sample(3, [[1, 4, 4], [1, 6, 4]], 5, 0), _sample(1, [[1, 2, 8]], 3, 1), _sample(4, [], 2, 2)):
        ids = s.input_ids.view(1, -1)
        ours = mrope_position_ids(s.input_ids, s.image_grid_thw, image_token_id=IMG, spatial_merge_size=MERGE)
        if s.image_grid_thw is None:
            assert torch.equal(ours, torch.arange(ids.shape[1]).expand(3, -1))
            continue
        mm = (ids == IMG).int()
        ref, _ = Qwen2_5_VLModel.get_rope_index(fake, ids, mm_token_type_ids=mm, image_grid_thw=s.image_grid_thw)
        assert torch.equal(ours, ref[:, 0])


def test_pack_layout_and_per_sample_positions():
    samples = [_sample(3, [[1, 4, 4]], 4, 0), _sample(2, [], 3, 1), _sample(1, [[1, 6, 4], [1, 2, 2]], 2, 2)]
    p = pack(samples, image_token_id=IMG, spatial_merge_size=MERGE)
    lens = [len(s.input_ids) for s in samples]
    assert p.seq_lens == lens and p.padded_lens == lens
    assert p.cu_seqlens.tolist() == [0, lens[0], lens[0] + lens[1], sum(lens)]
    assert torch.equal(p.cu_seqlens, p.cu_seqlens_padded) and p.cu_seqlens.dtype == torch.int32
    assert p.num_tokens == sum(lens)
    assert torch.equal(p.input_ids, torch.cat([s.input_ids for s in samples]))
    assert p.images_per_sample == [1, 0, 2]
    assert p.image_tokens_per_sample == [4, 0, 7]
    assert p.image_grid_thw.tolist() == [[1, 4, 4], [1, 6, 4], [1, 2, 2]]
    for i, s in enumerate(samples):  # positions restart in every sample
        a, b = p.cu_seqlens[i], p.cu_seqlens[i + 1]
        single = mrope_position_ids(s.input_ids, s.image_grid_thw, image_token_id=IMG, spatial_merge_size=MERGE)
        assert torch.equal(p.position_ids[:, a:b], single)
        assert torch.equal(p.loss_mask[a:b], s.loss_mask)
    parts = unpack(p.input_ids, p)
    assert [x.tolist() for x in parts] == [s.input_ids.tolist() for s in samples]


def test_pack_pads_each_sample_to_multiple():
    samples = [_sample(3, [[1, 4, 4]], 4, 0), _sample(2, [], 3, 1)]
    p = pack(samples, image_token_id=IMG, spatial_merge_size=MERGE, pad_multiple=4, pad_token_id=0)
    assert all(n % 4 == 0 for n in p.padded_lens)
    assert p.cu_seqlens_padded[-1] == sum(p.padded_lens)
    for i, s in enumerate(samples):
        a = int(p.cu_seqlens_padded[i])
        n, padded = p.seq_lens[i], p.padded_lens[i]
        assert torch.equal(p.input_ids[a:a + n], s.input_ids)
        assert (p.input_ids[a + n:a + padded] == 0).all()
        assert (p.loss_mask[a + n:a + padded] == 0).all()
        # padding continues text positions
        pad_pos = p.position_ids[:, a + n:a + padded]
        assert (pad_pos[0] == pad_pos[1]).all() and (pad_pos[0] > p.position_ids[:, a:a + n].max()).all()
    assert [x.tolist() for x in unpack(p.input_ids, p)] == [s.input_ids.tolist() for s in samples]


def test_graph_buckets_bound_padding_and_count():
    sizes = range(1, 20000)
    buckets = {n: graph_bucket(n) for n in sizes}
    assert all(b >= n and b % 64 == 0 for n, b in buckets.items())
    assert all(b - n < 64 or (b - n) / n <= 0.125 for n, b in buckets.items())  # 8 per doubling
    assert len({b for n, b in buckets.items() if 2048 <= n <= 4096}) == 9  # 2048..4096 step 256
    assert graph_bucket(4096) == 4096 and graph_bucket(4097) == 4608
    assert graph_bucket(1000, multiple=6) % 6 == 0 and graph_bucket(1000, multiple=6) % 64 == 0
    with pytest.raises(ValueError, match="per_octave"):
        graph_bucket(100, per_octave=3)


def test_pack_pad_to_pads_the_last_sample_only():
    samples = [_sample(3, [[1, 4, 4]], 4, 0), _sample(2, [], 3, 1)]
    plain = pack(samples, image_token_id=IMG, spatial_merge_size=MERGE, pad_multiple=2)
    p = pack(samples, image_token_id=IMG, spatial_merge_size=MERGE, pad_multiple=2, pad_to=64)
    assert p.num_tokens == 64 and p.seq_lens == plain.seq_lens and len(p.padded_lens) == 2
    assert p.padded_lens[0] == plain.padded_lens[0] and p.padded_lens[1] == 64 - plain.padded_lens[0]
    n = plain.num_tokens
    assert torch.equal(p.input_ids[:n], plain.input_ids) and torch.equal(p.position_ids[:, :n], plain.position_ids)
    assert torch.equal(p.loss_mask[:n], plain.loss_mask) and (p.loss_mask[n:] == 0).all()
    with pytest.raises(ValueError, match="shorter than"):
        pack(samples, image_token_id=IMG, spatial_merge_size=MERGE, pad_to=10)
    with pytest.raises(ValueError, match="multiple"):
        pack(samples, image_token_id=IMG, spatial_merge_size=MERGE, pad_multiple=4, pad_to=66)


def test_image_token_count_mismatch_names_the_sample():
    good = _sample(2, [[1, 4, 4]], 2, 0)
    bad = _sample(2, [[1, 4, 4]], 2, 1)
    bad.image_grid_thw = torch.tensor([[1, 6, 4]])
    with pytest.raises(ValueError, match="sample 1"):
        pack([good, bad], image_token_id=IMG, spatial_merge_size=MERGE)


def test_check_image_tokens_names_the_sample():
    from dataclasses import replace

    from vlmrl.models.packing import check_image_tokens

    p = pack([_sample(2, [[1, 4, 4]], 2, 0), _sample(2, [[1, 6, 4]], 2, 1)], image_token_id=IMG,
             spatial_merge_size=MERGE)
    check_image_tokens(p)
    bad = replace(p, image_tokens_per_sample=[4, 5])
    with pytest.raises(ValueError, match="sample 1: 6 image tokens"):
        check_image_tokens(bad)


@pytest.mark.parametrize("cp", [1, 2])
def test_shared_images_map_each_placeholder_to_its_owners_features(cp):
    """A prompt's replies share its image: their placeholders read the first reply's feature
    rows, the vision tower takes each distinct image's grid once, and a CP share keeps the rows
    its placeholders need."""
    from vlmrl.models.packing import share_images

    a = _sample(3, [[1, 4, 4]], 5, 0)  # 4 image tokens
    text = _sample(2, [], 3, 1)
    b = _sample(1, [[1, 6, 4]], 2, 2)  # 6
    a2 = PackSample(torch.cat([torch.as_tensor(a.input_ids), torch.tensor([60, 61])]), None, a.image_grid_thw)
    samples = [a, text, b, a2, a]
    whole = pack(samples, image_token_id=IMG, spatial_merge_size=MERGE, pad_multiple=2 * cp)
    shared = share_images(whole, [0, None, 2, 0, 0])
    assert shared.vision_grid_thw.tolist() == [[1, 4, 4], [1, 6, 4]]
    assert shared.image_grid_thw.tolist() == whole.image_grid_thw.tolist()  # positions still per sample
    assert shared.image_token_index.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 0, 1, 2, 3]
    assert whole.vision_grid_thw is None and torch.equal(whole.vision_grids, whole.image_grid_thw)
    # the features the model would place: the owner's, row for row
    feats = torch.randn(10, 3)  # the vision tower's output for the two distinct images
    placed = feats[shared.image_token_index]
    alone = torch.cat([feats[:4], feats[4:], feats[:4], feats[:4]])
    assert torch.equal(placed, alone)
    for r in range(cp):
        share = split_for_cp(shared, cp, r)
        ordinal = torch.cumsum(shared.image_mask.long(), 0) - 1
        idx = zigzag_index(shared.padded_lens, cp, r) if cp > 1 else torch.arange(shared.num_tokens)
        assert torch.equal(share.image_token_index, shared.image_token_index[ordinal[idx][shared.image_mask[idx]]])
        assert torch.equal(share.vision_grid_thw, shared.vision_grid_thw)
    with pytest.raises(ValueError, match="sample 2: its image grids"):  # another image's size
        share_images(whole, [0, None, 0, 0, 0])
    with pytest.raises(ValueError, match="sample 4: owner 3"):  # an owner that reads another's
        share_images(whole, [0, None, 2, 0, 3])
    with pytest.raises(ValueError, match="sample 0 has 1 images but no owner"):
        share_images(whole, [None, None, 2, 0, 0])


def test_zigzag_index_chunks():
    # one sample of 8 tokens, cp=2: chunks of 2; rank 0 -> chunks 0,3; rank 1 -> chunks 1,2
    assert zigzag_index([8], 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_index([8], 2, 1).tolist() == [2, 3, 4, 5]
    # two samples, second offset by 8
    assert zigzag_index([8, 4], 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    with pytest.raises(ValueError, match="multiple of 2\\*cp"):
        zigzag_index([6], 2, 0)


@pytest.mark.parametrize("cp", [2, 3])
def test_cp_split_carries_positions_and_images(cp):
    samples = [_sample(3, [[1, 4, 4]], 5, 0), _sample(2, [], 3, 1), _sample(1, [[1, 6, 4]], 2, 2)]
    whole = pack(samples, image_token_id=IMG, spatial_merge_size=MERGE, pad_multiple=2 * cp)
    shares = [split_for_cp(whole, cp, r) for r in range(cp)]
    seen = torch.cat([s.token_index for s in shares])
    assert sorted(seen.tolist()) == list(range(whole.num_tokens))  # a partition of the tokens
    image_rows = torch.arange(whole.num_image_tokens)
    for r, s in enumerate(shares):
        assert s.cp_size == cp and s.cp_rank == r
        assert s.num_tokens == whole.num_tokens // cp
        idx = zigzag_index(whole.padded_lens, cp, r)
        assert torch.equal(s.token_index, idx)
        assert torch.equal(s.input_ids, whole.input_ids[idx])
        assert torch.equal(s.position_ids, whole.position_ids[:, idx])
        assert torch.equal(s.loss_mask, whole.loss_mask[idx])
        assert torch.equal(s.local_cu_seqlens, whole.cu_seqlens_padded // cp)
        # the image feature rows of this rank's placeholders, in order of appearance
        ordinal = torch.cumsum((whole.input_ids == IMG).long(), 0) - 1
        expect = image_rows[ordinal[idx][s.input_ids == IMG]]
        assert torch.equal(s.image_token_index, expect)
        assert s.image_token_index.numel() == int((s.input_ids == IMG).sum())
    merged = cp_merge([s.position_ids for s in shares], whole.padded_lens, dim=1)
    assert torch.equal(merged, whole.position_ids)
    merged_ids = cp_merge([s.input_ids for s in shares], whole.padded_lens)
    assert torch.equal(merged_ids, whole.input_ids)


def test_generated_image_token_ids_are_text():
    """A response may hold the image token's id (a sampled token, which the engines embedded as
    a word one position further): only the prompt's placeholders claim image features."""
    prompt = _sample(2, [[1, 4, 6]], 0, 0)
    n = len(prompt.input_ids)
    reply = [IMG, 20, START, IMG, IMG, END, 21]
    ids = torch.cat([torch.as_tensor(prompt.input_ids), torch.tensor(reply)])
    mask = torch.tensor([0.0] * n + [1.0] * len(reply))
    with pytest.raises(ValueError, match="9 image tokens in the sequence"):  # all of them taken as placeholders
        pack([PackSample(ids, mask, prompt.image_grid_thw)], image_token_id=IMG, spatial_merge_size=MERGE)
    whole = pack([PackSample(ids, mask, prompt.image_grid_thw, prompt_len=n)], image_token_id=IMG,
                 spatial_merge_size=MERGE, pad_multiple=4)
    alone = mrope_position_ids(torch.as_tensor(prompt.input_ids), prompt.image_grid_thw, image_token_id=IMG,
                               spatial_merge_size=MERGE)
    nxt = int(alone.max()) + 1
    assert torch.equal(whole.position_ids[:, :n], alone)
    assert torch.equal(whole.position_ids[:, n:n + len(reply)], torch.arange(nxt, nxt + len(reply)).expand(3, -1))
    assert whole.image_mask[:n].sum() == whole.num_image_tokens == 6
    assert not whole.image_mask[n:].any()
    shares = [split_for_cp(whole, 2, r) for r in range(2)]
    assert sum(s.image_token_index.numel() for s in shares) == 6
    assert torch.equal(cp_merge([s.image_mask for s in shares], whole.padded_lens), whole.image_mask)


def test_cp_split_of_one_is_identity():
    whole = pack([_sample(2, [], 3, 0)], image_token_id=IMG, spatial_merge_size=MERGE)
    assert split_for_cp(whole, 1, 0) is whole


def test_split_samples_gives_each_sample_and_its_gradient_with_gaps():
    from vlmrl.models.attention import split_samples

    x = torch.randn(20, 3, requires_grad=True)
    offsets, lens = [2, 7, 7, 15], [5, 0, 6, 3]  # a leading gap, an empty sample, a gap, a tail
    parts = split_samples(x, offsets, lens)
    assert [p.shape[0] for p in parts] == lens
    for p, a, n in zip(parts, offsets, lens):
        assert torch.equal(p, x[a:a + n])
    w = torch.randn(20, 3)
    sum((p * w[a:a + n]).sum() for p, a, n in zip(parts, offsets, lens)).backward()
    expected = torch.zeros(20, 3)
    for a, n in zip(offsets, lens):
        expected[a:a + n] = w[a:a + n]
    assert torch.equal(x.grad, expected)  # gaps get zero gradient


def test_split_samples_rejects_overlap_and_overrun():
    from vlmrl.models.attention import split_samples

    x = torch.zeros(10, 2)
    with pytest.raises(ValueError, match="overlap or are out of order at offset 3"):
        split_samples(x, [0, 3], [4, 2])
    with pytest.raises(ValueError, match="past the 10 tokens"):
        split_samples(x, [0, 6], [6, 5])



def test_continuations_keep_their_positions_and_name_a_bad_parent():
    """`PackSample.parent`: a reply packed after its prompt keeps the positions it has after
    it (given), and the layout lists each sample's parent; a parent must come first, stand
    alone, end unpadded, and hold the images."""
    prompt = _sample(3, [[1, 4, 4]], 0, seed=0)
    n = len(prompt.input_ids)
    reply_pos = torch.arange(10, 13).expand(3, -1)
    reply = PackSample([40, 41, 42], None, None, 0, parent=0, position_ids=reply_pos)
    packed = pack([prompt, reply, _sample(2, [], 2, seed=1)], image_token_id=IMG, spatial_merge_size=MERGE)
    assert packed.parents == [-1, 0, -1]
    assert torch.equal(packed.position_ids[:, n:n + 3], reply_pos)
    assert pack([prompt], image_token_id=IMG, spatial_merge_size=MERGE).parents is None
    with pytest.raises(ValueError, match="sample 0: its parent 1 does not come before it"):
        pack([PackSample([1, 2], parent=1), prompt], image_token_id=IMG, spatial_merge_size=MERGE)
    with pytest.raises(ValueError, match="sample 2: its parent 1 continues sample 0"):
        pack([prompt, reply, PackSample([7], parent=1)], image_token_id=IMG, spatial_merge_size=MERGE)
    with pytest.raises(ValueError, match="its parent 0 is padded"):
        pack([prompt, reply], image_token_id=IMG, spatial_merge_size=MERGE, pad_multiple=64)
    with pytest.raises(ValueError, match="sample 1 continues sample 0 but has images"):
        pack([prompt, PackSample(prompt.input_ids, None, prompt.image_grid_thw, parent=0)],
             image_token_id=IMG, spatial_merge_size=MERGE)
    with pytest.raises(ValueError, match=r"position_ids shaped \[3, 2\] for 3 tokens"):
        pack([prompt, PackSample([40, 41, 42], parent=0, position_ids=reply_pos[:, :2])],
             image_token_id=IMG, spatial_merge_size=MERGE)
    with pytest.raises(ValueError, match="does not split shared-prompt layouts"):
        split_for_cp(packed, 2, 0)

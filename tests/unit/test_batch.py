"""Training samples -> shifted targets, DP shards and micro-batches (pure functions)."""

from __future__ import annotations

import pytest
import torch

from vlmrl.training.batch import TrainSample, build_micro_batch, micro_batches, shifted, split_by_tokens


def sample(n_prompt: int, n_resp: int, adv: float = 0.0, offset: int = 10) -> TrainSample:
    ids = list(range(offset, offset + n_prompt + n_resp))
    return TrainSample(ids, [0.0] * n_prompt + [1.0] * n_resp, advantage=adv,
                       rollout_logprobs=[-0.1 * (i + 1) for i in range(n_resp)])


def test_shift_aligns_targets_masks_and_logprobs():
    s = sample(3, 2)
    targets, mask, rollout, old = shifted(s)
    # logits at position t score token t+1: positions 2 and 3 score the two response tokens
    assert mask.tolist() == [0, 0, 1, 1, 0]
    assert targets[2].item() == s.input_ids[3] and targets[3].item() == s.input_ids[4]
    assert rollout.tolist()[2:4] == pytest.approx([-0.1, -0.2])
    assert old.abs().sum() == 0  # no old logprobs given


def test_bad_lengths_and_untrainable_first_token_are_errors():
    with pytest.raises(ValueError, match="loss_mask has 2 entries for 3 tokens"):
        TrainSample([1, 2, 3], [0.0, 1.0])
    with pytest.raises(ValueError, match="1 rollout_logprobs for 2 loss-masked tokens"):
        TrainSample([1, 2, 3], [0.0, 1.0, 1.0], rollout_logprobs=[-1.0])
    with pytest.raises(ValueError, match="first token"):
        shifted(TrainSample([1, 2], [1.0, 1.0]))


def test_split_by_tokens_balances_and_keeps_every_sample():
    samples = [sample(5, n) for n in (1, 9, 3, 7, 2, 8)]
    parts = split_by_tokens(samples, 2)
    assert sorted(i for p in parts for i in p) == list(range(6))
    loads = [sum(samples[i].num_tokens for i in p) for p in parts]
    assert abs(loads[0] - loads[1]) <= max(s.num_tokens for s in samples)


def test_split_keeps_a_prompts_samples_on_one_rank_when_prompts_are_shared():
    prompts = [list(range(100 * p, 100 * p + 5 + p)) for p in range(4)]
    samples = [TrainSample(prompts[p] + [7] * (1 + (i % 3)), [0.0] * len(prompts[p]) + [1.0] * (1 + (i % 3)))
               for i in range(16) for p in [i % 4]]
    parts = split_by_tokens(samples, 2, keep_prompts=True)
    assert sorted(i for part in parts for i in part) == list(range(16))
    on = [{i % 4 for i in part} for part in parts]
    assert not on[0] & on[1] and len(on[0]) == len(on[1]) == 2  # every prompt whole on one rank, two a rank
    # fewer prompts than ranks: split one by one, as without sharing
    assert split_by_tokens(samples[:4], 8, keep_prompts=True) == split_by_tokens(samples[:4], 8)


def test_a_token_budget_counts_a_shared_prompt_once():
    """With shared prompts a reply whose prompt is already in the micro-batch costs its own
    tokens only: 4 replies of 3 tokens to one 10-token prompt take 22 tokens, not 52."""
    from vlmrl.training.batch import shared_prompt_keys

    samples = [TrainSample(list(range(10)) + [50 + i] * 3, [0.0] * 10 + [1.0] * 3) for i in range(4)]
    samples.append(sample(6, 4, offset=80))
    lengths = [s.num_tokens for s in samples]
    keys = shared_prompt_keys(samples)
    assert keys == [(0, 10)] * 4 + [(1, 0)]
    assert micro_batches(lengths, max_tokens=32, micro_batch_size=1, prompts=keys) == [[0, 1, 2, 3, 4]]
    assert micro_batches(lengths, max_tokens=32, micro_batch_size=1) == [[0, 1], [2, 3], [4]]
    mb = build_micro_batch(samples, image_token_id=999, spatial_merge_size=2, share_prompts=True)
    assert mb.packed.num_tokens == 22 + 10 <= 32


def test_micro_batches_by_budget_and_by_count():
    assert micro_batches([5, 5, 5], max_tokens=None, micro_batch_size=2) == [[0, 1], [2]]
    groups = micro_batches([6, 3, 5, 2, 9], max_tokens=10, micro_batch_size=1)
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 3, 4]
    lens = [6, 3, 5, 2, 9]
    assert all(sum(lens[i] for i in g) <= 10 for g in groups)
    assert micro_batches([12], max_tokens=10, micro_batch_size=1) == [[0]]  # too long: alone


def test_micro_batch_packs_per_token_targets():
    a, b = sample(3, 2, adv=1.0), sample(2, 3, adv=-0.5, offset=40)
    mb = build_micro_batch([a, b], image_token_id=999, spatial_merge_size=2)
    assert mb.packed.num_tokens == a.num_tokens + b.num_tokens
    assert mb.loss_mask.sum() == 5
    assert mb.advantages[mb.loss_mask > 0].tolist() == [1.0, 1.0, -0.5, -0.5, -0.5]
    assert mb.rollout_logp[mb.loss_mask > 0].tolist() == pytest.approx([-0.1, -0.2, -0.1, -0.2, -0.3])
    assert "old_logp" not in mb.extras


def test_bucketed_micro_batch_keeps_every_per_sample_quantity():
    """`hardware.cuda_graphs`' padding: same samples, targets and masks, same loss normalisers
    in every aggregation mode (the padding joins the last sample, adds no sequence)."""
    from vlmrl.algo.losses import AGG_MODES, loss_normaliser

    samples = [TrainSample(list(range(10, 10 + n)), [0.0] * 3 + [1.0] * (n - 3)) for n in (40, 70, 25)]
    plain = build_micro_batch(samples, image_token_id=999, spatial_merge_size=2)
    padded = build_micro_batch(samples, image_token_id=999, spatial_merge_size=2, bucket=True)
    n = plain.packed.num_tokens
    assert (n, padded.packed.num_tokens) == (135, 192) and padded.num_samples == 3
    assert torch.equal(padded.targets[:n], plain.targets) and torch.equal(padded.loss_mask[:n], plain.loss_mask)
    assert padded.loss_mask[n:].sum() == 0
    for mode in AGG_MODES:
        assert loss_normaliser(padded.loss_mask, padded.cu_seqlens, mode, 100) == \
            loss_normaliser(plain.loss_mask, plain.cu_seqlens, mode, 100)


def _image_sample(pixels: torch.Tensor, grid: list[int], reply: list[int]) -> TrainSample:
    n = grid[0] * grid[1] * grid[2] // 4  # placeholders of a 2x2 merge
    ids = [10, 11] + [999] * n + [12] + reply
    return TrainSample(ids, [0.0] * (len(ids) - len(reply)) + [1.0] * len(reply), pixels, torch.tensor([grid]))


def test_a_micro_batch_runs_each_distinct_image_once():
    """A prompt's replies hold its pixel tensor (or, after a copy, equal pixels): the micro-batch
    carries each distinct image once and every reply's placeholders read its rows; an image of
    the same size with other pixels, or the same pixels at another grid, stays its own."""
    from vlmrl.training.batch import image_owners

    g = torch.Generator().manual_seed(0)
    img, other = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
    wide = img.clone()  # the same values laid out as another grid: another image
    white = torch.ones(16, 32)
    white_but_one = white.clone()
    white_but_one[5, 3] = 0.0  # not among the 256 values the quick key reads: told apart by the whole comparison
    samples = [_image_sample(img, [1, 4, 4], [20, 21]), _image_sample(img, [1, 4, 4], [22]),
               TrainSample([10, 11, 12, 30], [0.0, 0.0, 0.0, 1.0]),
               _image_sample(img.clone(), [1, 4, 4], [23, 24, 25]), _image_sample(other, [1, 4, 4], [26]),
               _image_sample(wide, [1, 2, 8], [27]), _image_sample(white, [1, 4, 4], [28]),
               _image_sample(white_but_one, [1, 4, 4], [29]), _image_sample(white.clone(), [1, 4, 4], [31])]
    assert image_owners(samples) == [0, 0, None, 0, 4, 5, 6, 7, 6]
    mb = build_micro_batch(samples, image_token_id=999, spatial_merge_size=2)
    assert torch.equal(mb.pixel_values, torch.cat([img, other, wide, white, white_but_one]))
    assert mb.packed.vision_grid_thw.tolist() == [[1, 4, 4]] * 2 + [[1, 2, 8]] + [[1, 4, 4]] * 2
    rows = mb.packed.image_token_index.tolist()
    assert rows == [0, 1, 2, 3] * 3 + [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 12, 13, 14, 15]
    # without a shared image nothing changes: every sample's own rows, in order
    alone = build_micro_batch([samples[0], samples[4]], image_token_id=999, spatial_merge_size=2)
    assert alone.packed.vision_grid_thw is None and alone.packed.image_token_index.tolist() == list(range(8))
    assert torch.equal(alone.pixel_values, torch.cat([img, other]))


def test_context_parallel_split_keeps_every_trained_token_once():
    samples = [sample(5, 6), sample(4, 7, offset=50)]
    whole = build_micro_batch(samples, image_token_id=999, spatial_merge_size=2)
    shares = [build_micro_batch(samples, image_token_id=999, spatial_merge_size=2, cp_size=2, cp_rank=r)
              for r in range(2)]
    assert sum(float(s.loss_mask.sum()) for s in shares) == float(whole.loss_mask.sum())
    picked = torch.cat([s.targets[s.loss_mask > 0] for s in shares]).sort().values
    assert torch.equal(picked, whole.targets[whole.loss_mask > 0].sort().values)


def test_untrainable_samples_are_left_out_and_counted_by_reason(monkeypatch):
    from types import SimpleNamespace

    import vlmrl.experience
    from vlmrl.experience import train_samples

    # the prompt encoding belongs to the data layer (tested there): fixed prompt ids here
    monkeypatch.setattr(vlmrl.experience, "encode_prompt", lambda processor, prompt: {
        "input_ids": [1, 2, 3], "pixel_values": None, "image_grid_thw": None})

    def record(i: int, ids: list[int], prompt_ids: list[int] | None = None) -> SimpleNamespace:
        return SimpleNamespace(prompt_index=0, group_index=0, sample_index=i, response_ids=ids, prompt_ids=prompt_ids,
                               logprobs=[-1.0] * len(ids))

    # the engine cut the image into more tokens than the trainer (other pixel bounds): the
    # sample is skipped and counted, the run goes on; an empty response has nothing to train;
    # a response holding the image token's id (5 here) is text and is kept
    records = [record(0, [7, 8]), record(1, [7, 5, 8]), record(2, []), record(3, [7], prompt_ids=[1, 2, 2, 3]),
               record(4, [9], prompt_ids=[1, 2, 3])]
    samples, skipped = train_samples(None, {0: object()}, records, [0.5, -0.5, 0.0, 1.0, 0.25])
    assert skipped == {"prompt_mismatch": 1, "bad_routed_experts": 0, "no_routed_experts": 0} and len(samples) == 3
    assert samples[0].input_ids == [1, 2, 3, 7, 8] and samples[0].loss_mask == [0, 0, 0, 1, 1]
    assert samples[1].input_ids == [1, 2, 3, 7, 5, 8] and samples[1].prompt_len == 3
    assert samples[2].input_ids == [1, 2, 3, 9] and samples[2].advantage == 0.25


def test_samples_log_keeps_whole_groups_with_their_rewards_and_advantages():
    from types import SimpleNamespace

    from vlmrl.experience import sample_rows
    from vlmrl.rollout.manager import SampleRecord

    def record(group: int, i: int, text: str) -> SampleRecord:
        return SampleRecord(prompt_index=10 + group, sample_index=i, group_index=group, prompt_ids=None,
                            response_ids=[1] * len(text), text=text, logprobs=None, finish_reason="stop",
                            truncated=False, answer=str(group), weight_version="step-3")

    records = [record(g, i, f"g{g}s{i}") for g in (0, 1, 2) for i in range(2)]
    rewards, advantages = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0], [0.7, -0.7, 0.0, 0.0, 0.0, 0.0]
    prompts = {10 + g: SimpleNamespace(prompt_text=f"how many sides? ({g})") for g in (0, 1, 2)}
    rows = sample_rows(records, rewards, groups=2, advantages=advantages, prompts=prompts)
    assert [(r["group"], r["sample"], r["response"]) for r in rows] == [
        (0, 0, "g0s0"), (0, 1, "g0s1"), (1, 0, "g1s0"), (1, 1, "g1s1")]
    assert [r["reward"] for r in rows] == [1.0, 0.0, 0.0, 0.0] and rows[1]["advantage"] == -0.7
    assert rows[0]["prompt"] == "how many sides? (0)" and "prompt" not in rows[1]  # once a group
    assert rows[2]["answer"] == "1" and rows[2]["weight_version"] == "step-3"
    assert rows[0]["response_tokens"] == 4 and rows[0]["kind"] == "rollout"
    # an evaluation: no advantages; groups=0 keeps nothing
    ev = sample_rows(records[::2], rewards[::2], groups=1, kind="eval")
    assert len(ev) == 1 and ev[0]["kind"] == "eval" and "advantage" not in ev[0] and "prompt" not in ev[0]
    assert sample_rows(records, rewards, groups=0) == []


def test_verifier_params_reject_parameters_the_verifier_does_not_take():
    import dataclasses

    from vlmrl.config import load
    from vlmrl.rewards.registry import verifier_params

    cfg = load([])
    assert verifier_params(cfg.reward) == {"_target_": "vlmrl.rewards.math.MathVerifier", "name": "math",
                                           "timeout_s": 1.0, "num_workers": 2, "format_score": 0.0,
                                           "format_pattern": None}
    geo = load(["reward=geo3k_tol05"]).reward
    assert verifier_params(geo)["tolerance"] == 0.05
    bad = dataclasses.replace(cfg.reward, tolerance=0.05)
    with pytest.raises(ValueError, match="reward.tolerance=0.05 is not a parameter"):
        verifier_params(bad)


def test_engine_experts_travel_with_their_samples(monkeypatch):
    """Routed experts as an engine reports them (base64 int32 [tokens - 1, layers, k]) become
    the sample's tensor; ones of the wrong size, or none while replaying, skip the sample and
    are counted; the packed micro-batch holds them at each sample's rows (-1 on its last token
    and padding), and the context-parallel shares hold every row once."""
    from types import SimpleNamespace

    import vlmrl.experience
    from vlmrl.experience import train_samples
    from vlmrl.rollout.protocol import encode_routed_experts

    monkeypatch.setattr(vlmrl.experience, "encode_prompt", lambda processor, prompt: {
        "input_ids": [1, 2, 3], "pixel_values": None, "image_grid_thw": None})
    layers, k = 2, 2

    def record(i: int, ids: list[int], rows: int | None) -> SimpleNamespace:
        experts = None if rows is None else encode_routed_experts(range(rows * layers * k))
        return SimpleNamespace(prompt_index=0, group_index=0, sample_index=i, response_ids=ids, prompt_ids=None,
                               logprobs=[-1.0] * len(ids), routed_experts=experts)

    records = [record(0, [7, 8], 4), record(1, [7, 8, 9], 3), record(2, [7], None), record(3, [9, 9, 9], 5)]
    samples, skipped = train_samples(None, {0: object()}, records, [1.0] * 4, routing=(layers, k), replay=True)
    assert skipped == {"prompt_mismatch": 0, "bad_routed_experts": 1, "no_routed_experts": 1}
    assert [s.routed_experts.shape for s in samples] == [(4, layers, k), (5, layers, k)]
    assert all(s.routed_experts.dtype == torch.int16 for s in samples)
    assert samples[0].routed_experts.flatten().tolist() == list(range(16))
    kept, _ = train_samples(None, {0: object()}, records[2:3], [1.0], routing=(layers, k), replay=False)
    assert len(kept) == 1 and kept[0].routed_experts is None  # measuring only: kept without them
    # built as the group completed (`group_inputs`, in the rollout): used as they are, the
    # prompt not encoded again, the same samples and the same reasons
    prepared = {0: vlmrl.experience.group_inputs(None, object(), records, routing=(layers, k))}
    assert isinstance(prepared[0].experts[1], ValueError) and prepared[0].experts[2] is None

    def encode_again(processor, prompt):
        raise AssertionError("the prompt was encoded again")

    monkeypatch.setattr(vlmrl.experience, "encode_prompt", encode_again)
    again, again_skipped = train_samples(None, {0: object()}, records, [1.0] * 4, routing=(layers, k), replay=True,
                                         prepared=prepared)
    assert again_skipped == skipped and len(again) == len(samples)
    assert all(torch.equal(a.routed_experts, b.routed_experts) for a, b in zip(again, samples))

    mb = build_micro_batch(samples, image_token_id=999, spatial_merge_size=2, cp_size=1, sp_size=2)
    rows, offsets = mb.packed.routed_experts, mb.packed.cu_seqlens_padded.tolist()
    assert rows.shape == (mb.packed.num_tokens, layers, k)
    for s, a, b in zip(samples, offsets, offsets[1:]):
        n = s.routed_experts.shape[0]
        assert torch.equal(rows[a:a + n], s.routed_experts) and bool((rows[a + n:b] == -1).all())
    shares = [build_micro_batch(samples, image_token_id=999, spatial_merge_size=2, cp_size=2, cp_rank=r)
              for r in range(2)]
    whole = build_micro_batch(samples, image_token_id=999, spatial_merge_size=2, cp_size=2, cp_rank=0).whole
    for share in shares:
        assert torch.equal(share.packed.routed_experts, whole.routed_experts[share.packed.token_index])
    assert sorted(torch.cat([x.packed.token_index for x in shares]).tolist()) == list(range(whole.num_tokens))
    with pytest.raises(ValueError, match="routed_experts"):
        TrainSample(input_ids=[1, 2], loss_mask=[0.0, 1.0], routed_experts=torch.zeros(3, 1, 1))


# ------------------------------------------------------------ as many micro-batches on every rank
def _samples(*lengths: int):
    from vlmrl.training.batch import TrainSample

    return [TrainSample(list(range(n)), [0.0] + [1.0] * (n - 1)) for n in lengths]


def test_even_micro_batches_splits_groups_before_adding_fillers():
    from vlmrl.training.batch import even_micro_batches

    samples = _samples(10, 40, 20, 30)
    # one group of four: split the largest group in halves until there are three
    out, groups, fillers = even_micro_batches(samples, [[0, 1, 2, 3]], 3)
    assert fillers == 0 and out == samples
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 3] and len(groups) == 3
    assert all(g for g in groups)
    # nothing left to split: the rest are fillers, appended after the real samples
    out, groups, fillers = even_micro_batches(samples[:1], [[0]], 3)
    assert fillers == 2 and groups == [[0], [1], [2]] and out[0] is samples[0]
    assert all(not any(s.loss_mask) for s in out[1:])
    # a rank with no samples at all still runs the step's count
    out, groups, fillers = even_micro_batches([], [], 2)
    assert fillers == 2 and len(out) == 2 and groups == [[0], [1]]
    # already there: unchanged
    assert even_micro_batches(samples, [[0, 1], [2, 3]], 2)[1] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="more than the 1"):
        even_micro_batches(samples, [[0], [1]], 1)


def test_a_filler_micro_batch_trains_on_nothing():
    from vlmrl.training.batch import build_micro_batch, filler_sample

    mb = build_micro_batch([filler_sample()], image_token_id=5, spatial_merge_size=2, sp_size=2)
    assert mb.loss_mask.sum() == 0 and mb.pixel_values is None
    assert mb.packed.num_tokens % 2 == 0


def test_shared_prompts_pack_a_prompt_once_and_keep_every_samples_loss_tensors():
    """`share_prompts`: the replies of one prompt (the same tokens and image) run it once; the
    loss tensors are each sample's response-predicting positions, as in the plain layout, read
    from the packed rows `logit_index` gives; the layout knows each reply's parent."""
    from vlmrl.algo.losses import AGG_MODES, loss_normaliser
    from vlmrl.training.batch import prompt_groups

    img, other = torch.randn(16, 32), torch.randn(16, 32)
    samples = [_image_sample(img, [1, 4, 4], [20, 21]), _image_sample(other, [1, 4, 4], [22]),
               _image_sample(img, [1, 4, 4], [23, 24, 25]), _image_sample(img.clone(), [1, 4, 4], [26]),
               TrainSample([10, 11, 12, 30], [0.0, 0.0, 0.0, 1.0])]
    for i, s in enumerate(samples):
        s.advantage = float(i)
        s.old_logprobs = [-0.5 * (i + 1)] * int(sum(s.loss_mask))
    assert prompt_groups(samples) == [[0, 2, 3], [1], [4]]
    plain = build_micro_batch(samples, image_token_id=999, spatial_merge_size=2)
    mb = build_micro_batch(samples, image_token_id=999, spatial_merge_size=2, share_prompts=True)
    prompt = samples[0].prompt_len
    # the prompt once (with its image), its three replies, then the two samples alone
    assert mb.packed.seq_lens == [prompt, 2, 3, 1, samples[1].num_tokens, 4]
    assert mb.packed.parents == [-1, 0, 0, 0, -1, -1]
    assert mb.shared_prompt_tokens == 2 * prompt
    assert torch.equal(mb.pixel_values, torch.cat([img, other]))  # each distinct image once
    # each sample's loss tensors are its plain ones at positions prompt_len - 1 .. n - 2
    per = [(s.prompt_len - 1, s.num_tokens - 1) for s in samples]
    offs = plain.packed.cu_seqlens_padded.tolist()
    for name in ("targets", "loss_mask", "advantages", "rollout_logp"):
        want = torch.cat([getattr(plain, name)[o + a:o + b] for o, (a, b) in zip(offs, per)])
        assert torch.equal(getattr(mb, name), want), name
    assert torch.equal(mb.extras["old_logp"], torch.cat([plain.extras["old_logp"][o + a:o + b]
                                                        for o, (a, b) in zip(offs, per)]))
    assert mb.cu_seqlens.tolist() == [0, 2, 1 + 2, 3 + 3, 6 + 1, 7 + 1]
    for mode in AGG_MODES:
        assert loss_normaliser(mb.loss_mask, mb.cu_seqlens, mode, 100) == \
            loss_normaliser(plain.loss_mask, plain.cu_seqlens, mode, 100)
    # the rows scoring each sample's replies: the prompt's last row for the first token (shared by
    # the group), then the reply's own rows; the packed tokens there are the plain ones
    rows = mb.logit_index.tolist()
    assert rows[:2] == [prompt - 1, prompt] and rows[3:6] == [prompt - 1, prompt + 2, prompt + 3]
    plain_rows = torch.cat([torch.arange(o + a, o + b) for o, (a, b) in zip(offs, per)])
    assert torch.equal(mb.packed.input_ids[mb.logit_index], plain.packed.input_ids[plain_rows])
    assert torch.equal(mb.packed.position_ids[:, mb.logit_index], plain.packed.position_ids[:, plain_rows])
    # per-sample values back out in sample order (the trainer's logprobs)
    values = torch.arange(float(mb.targets.numel()))
    assert [v.tolist() for v in mb.sample_values(values)] == [[0.0, 1.0], [2.0], [3.0, 4.0, 5.0], [6.0], [7.0]]
    # nothing shared: the plain layout, whatever the option
    alone = build_micro_batch(samples[:2], image_token_id=999, spatial_merge_size=2, share_prompts=True)
    assert alone.logit_index is None and alone.packed.parents is None
    with pytest.raises(ValueError, match="cp_size 1"):
        build_micro_batch(samples, image_token_id=999, spatial_merge_size=2, share_prompts=True, cp_size=2)


def test_shared_prompt_layouts_pad_only_their_end():
    """Under sequence parallelism (or CUDA-graph buckets) the whole is padded at its end, never
    a prompt: its replies start from its last real token."""
    samples = [sample(5, n) for n in (3, 2, 4)]  # one prompt, three replies (packed in their tokens' order)
    mb = build_micro_batch(samples, image_token_id=999, spatial_merge_size=2, sp_size=4, share_prompts=True)
    assert mb.packed.seq_lens == [5, 2, 3, 4] and mb.packed.padded_lens == [5, 2, 3, 6]
    assert mb.packed.num_tokens % 4 == 0
    bucketed = build_micro_batch(samples, image_token_id=999, spatial_merge_size=2, share_prompts=True, bucket=True)
    assert bucketed.packed.padded_lens[:3] == [5, 2, 3] and bucketed.packed.num_tokens == 64


def test_a_shared_layout_does_not_follow_the_order_the_samples_come_in():
    """The old-policy pass scores the step's samples in their order, the update in a shuffled
    one: each prompt's replies are packed in an order of their own, so each group's segments
    (what one attention call reads on CPU) are the same either way."""
    img = torch.randn(16, 32)
    samples = [_image_sample(img, [1, 4, 4], reply) for reply in ([20, 21], [23], [22, 24, 25], [21])]
    samples.append(_image_sample(torch.randn(16, 32), [1, 4, 4], [30]))
    samples.append(_image_sample(samples[-1].pixel_values, [1, 4, 4], [31, 32]))
    a = build_micro_batch(samples, image_token_id=999, spatial_merge_size=2, share_prompts=True)
    order = [5, 2, 0, 4, 3, 1]
    b = build_micro_batch([samples[i] for i in order], image_token_id=999, spatial_merge_size=2, share_prompts=True)
    def groups(mb):  # each prompt with its replies, in the order they are packed
        segs = mb.packed.input_ids.split(mb.packed.padded_lens)
        out: dict[int, list] = {}
        for j, p in enumerate(mb.packed.parents):
            out.setdefault(j if p < 0 else p, []).append(segs[j].tolist())
        return sorted(out.values())
    assert groups(a) == groups(b)
    # each sample still reads its own rows, in the order given
    assert torch.equal(a.targets.split(a.cu_seqlens.diff().tolist())[0], b.targets.split(b.cu_seqlens.diff().tolist())[2])
    assert torch.equal(b.pixel_values, torch.cat([samples[5].pixel_values, img]))

"""Gated DeltaNet maths on packed sequences (vlmrl.models.gated_delta) against its definition
and against transformers' Qwen3.5 functions run one sample at a time."""

from __future__ import annotations

import pytest
import torch

from vlmrl.models import gated_delta as gd

LENS = (37, 70, 5, 64)


def packed_inputs(lens=LENS, hk=2, hv=4, dk=16, dv=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    q = torch.randn(total, hk, dk, generator=g, dtype=dtype)
    k = torch.randn(total, hk, dk, generator=g, dtype=dtype)
    v = torch.randn(total, hv, dv, generator=g, dtype=dtype)
    decay = -torch.rand(total, hv, generator=g, dtype=dtype) * 2
    beta = torch.rand(total, hv, generator=g, dtype=dtype)
    offsets = [0]
    for n in lens[:-1]:
        offsets.append(offsets[-1] + n)
    return q, k, v, decay, beta, gd.segment_bounds(offsets, total)


def test_segment_bounds_give_a_trailing_pad_its_own_segment():
    assert gd.segment_bounds([0, 5], 9) == [(0, 5), (5, 9)]
    assert gd.segment_bounds([0, 5, 9], 12) == [(0, 5), (5, 9), (9, 12)]
    assert gd.segment_bounds([5], 9) == [(0, 5), (5, 9)]
    assert gd.segment_bounds([0, 4, 4], 8) == [(0, 4), (4, 8)]  # empty segments dropped


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_rule_equals_the_token_by_token_recurrence(chunk):
    q, k, v, decay, beta, bounds = packed_inputs()
    got = gd.chunk_gated_delta_rule(q, k, v, decay, beta, bounds, chunk=chunk).double()
    want = gd.recurrent_gated_delta_rule(q, k, v, decay, beta, bounds).double()
    assert (got - want).abs().max() < 1e-5  # float32 inside


def test_chunked_rule_gradients_equal_the_recurrence():
    q, k, v, decay, beta, bounds = packed_inputs(lens=(20, 13), dtype=torch.float32)
    grads = []
    for fn in (lambda *a: gd.chunk_gated_delta_rule(*a, bounds, chunk=8),
               lambda *a: gd.recurrent_gated_delta_rule(*a, bounds)):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, decay, beta)]
        fn(*leaves).pow(2).sum().backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        assert (a - b).abs().max() / b.abs().max() < 1e-4


def test_rule_matches_transformers_per_sample():
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import torch_recurrent_gated_delta_rule

    q, k, v, decay, beta, bounds = packed_inputs(dtype=torch.float32)
    got = gd.chunk_gated_delta_rule(q, k, v, decay, beta, bounds)
    for a, b in bounds:
        want, _ = torch_recurrent_gated_delta_rule(q[None, a:b], k[None, a:b], v[None, a:b], decay[None, a:b],
                                                   beta[None, a:b], use_qk_l2norm_in_kernel=True)
        assert (got[a:b] - want[0]).abs().max() < 1e-5


def test_no_state_leaks_between_packed_samples():
    """A sample inside a pack equals the same sample alone; treating the pack as one segment
    (the leak a kernel without cu_seqlens has) changes every later sample: the check has teeth."""
    q, k, v, decay, beta, bounds = packed_inputs()
    packed = gd.chunk_gated_delta_rule(q, k, v, decay, beta, bounds)
    leaky = gd.chunk_gated_delta_rule(q, k, v, decay, beta, [(0, q.shape[0])])
    for i, (a, b) in enumerate(bounds):
        alone = gd.chunk_gated_delta_rule(q[a:b], k[a:b], v[a:b], decay[a:b], beta[a:b], [(0, b - a)])
        assert (packed[a:b] - alone).abs().max() < 1e-6
        if i > 0:
            assert (leaky[a:b] - alone).abs().max() > 1e-2


def test_convolution_restarts_at_each_sample_and_matches_transformers():
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import causal_conv1d_fn

    _, _, _, _, _, bounds = packed_inputs()
    total = bounds[-1][1]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(total, 12, generator=g)
    w = torch.randn(12, 4, generator=g)
    got = gd.causal_conv1d(x, w, bounds)
    for a, b in bounds:
        want = causal_conv1d_fn(x[None, a:b].transpose(1, 2), w, None, activation="silu")[0].T
        assert (got[a:b] - want).abs().max() < 1e-5
    leaky = gd.causal_conv1d(x, w, [(0, total)])
    a = bounds[1][0]
    assert (leaky[a] - got[a]).abs().max() > 1e-3  # the first token of sample 1 sees sample 0 when leaking


def test_gated_norm_matches_transformers():
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNormGated

    norm = Qwen3_5MoeRMSNormGated(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    x, z = torch.randn(2, 9, 16), torch.randn(2, 9, 16)
    assert torch.allclose(gd.gated_rms_norm(x, z, norm.weight, 1e-6), norm(x, z), atol=1e-6)
    xb, zb = x.bfloat16(), z.bfloat16()
    assert torch.equal(gd.gated_rms_norm(xb, zb, norm.weight, 1e-6), norm(xb, zb))  # fp32 weight, bf16 input


def test_fast_path_check_refuses_a_wrong_kernel(monkeypatch):
    """The GPU fast path is compared with the torch path before use: a kernel whose output
    or gradients disagree is refused with an error that names what differs."""
    def bounds_of(offsets):
        cu = offsets.cu_host.tolist()
        return list(zip(cu[:-1], cu[1:]))

    def wrong_rule(q, k, v, g, beta, offsets):
        bounds = bounds_of(offsets)
        return gd.chunk_gated_delta_rule(q, k, v, g * 0.5, beta, bounds)

    def torch_conv(x, w, offsets):
        return gd.causal_conv1d(x, w, bounds_of(offsets))

    monkeypatch.setattr(gd, "packed_causal_conv1d", torch_conv)
    monkeypatch.setattr(gd, "fla_gated_delta_rule", wrong_rule)
    monkeypatch.setattr(gd, "_CHECKED", {})
    with pytest.raises(gd.FastPathError, match="output differs"):
        gd.check_fast_path(torch.device("cpu"), torch.float32, dk=16, dv=16)

    strides = []

    def right_rule(q, k, v, g, beta, offsets):
        strides.append((q.stride(1), k.stride(1)))
        return gd.chunk_gated_delta_rule(q, k, v, g, beta, bounds_of(offsets))

    monkeypatch.setattr(gd, "fla_gated_delta_rule", right_rule)
    assert gd.check_fast_path(torch.device("cpu"), torch.float32, dk=16, dv=16) == 0.0
    # q and k come as the model's views: rows grouped by key head, q, k, then the group's
    # values (2 x 16 + 2 x 16 wide for the default 2 key / 4 value heads), so the compiled
    # functions the check runs first are not compiled again for the model's strides
    assert strides == [(64, 64)]


def test_flash_qla_tile_counts_reach_every_tile_width():
    """One layout per tile width FlashQLA's forward picks from its grid (samples x value
    heads against its share of the SMs), the fewest samples for each: 32 value heads on an
    H200's 92 of 132 SMs take 32-wide tiles with one sample, 64 with two, 128 from three."""
    assert [gd.flash_qla_tile(n * 32, 92) for n in (1, 2, 3, 50)] == [32, 64, 128, 128]
    assert gd.flash_qla_tile_counts(32, 92) == [1, 2, 3]
    assert gd.flash_qla_tile_counts(16, 92) == [1, 3, 6]  # the heads of a TP2 rank
    assert gd.flash_qla_tile_counts(64, 92) == [1, 2]  # one sample already fills half the grid
    assert gd.flash_qla_tile_counts(128, 92) == [1]  # and here all of it
    for hv in range(1, 130):
        counts = gd.flash_qla_tile_counts(hv, 92)
        tiles = [gd.flash_qla_tile(n * hv, 92) for n in counts]
        assert tiles == sorted(set(tiles))  # one count per width, widths ascending
        # no width is reached with fewer samples than its count, and every width reachable is
        reach = {gd.flash_qla_tile(n * hv, 92) for n in range(1, 200)}
        assert set(tiles) == reach
        for n, t in zip(counts, tiles):
            assert all(gd.flash_qla_tile(m * hv, 92) != t for m in range(1, n))
    with pytest.raises(ValueError, match="value heads"):
        gd.flash_qla_tile_counts(0, 92)


def test_chunk_tiling_built_on_the_host():
    """The varlen chunk tiling the fla / FlashQLA kernels take: one row (sample, chunk within
    it) per started chunk of every sample, in order; an empty sample has none. The GPU test
    holds it against fla's own `prepare_chunk_indices`."""
    idx = gd.chunk_indices([2, 0, 5, 64, 65], 4)
    assert idx.dtype == torch.long and idx.shape == (1 + 0 + 2 + 16 + 17, 2)
    assert idx[:3].tolist() == [[0, 0], [2, 0], [2, 1]]
    assert idx[3:19, 0].eq(3).all() and idx[3:19, 1].tolist() == list(range(16))
    assert idx[19:, 0].eq(4).all() and idx[-1, 1] == 16
    assert gd.chunk_indices([], 64).shape == (0, 2)
    offsets = gd.PackedOffsets(gd.segment_bounds([0, 37, 167], 258), torch.device("cpu"))
    assert offsets.cu.tolist() == offsets.cu_host.tolist() == [0, 37, 167, 258]
    assert offsets.conv_chunks().tolist() == [[0, 0], [1, 0], [1, 1], [1, 2], [2, 0], [2, 1]]


def test_chunked_rule_from_given_states_gives_the_recurrences_final_states():
    q, k, v, decay, beta, bounds = packed_inputs(lens=(37, 9, 64))
    start = torch.randn(len(bounds), v.shape[1], k.shape[2], v.shape[2], dtype=torch.float64)
    got, got_final = gd.chunk_gated_delta_rule(q, k, v, decay, beta, bounds, chunk=16, initial_state=start,
                                               output_final_state=True)
    want, want_final = gd.recurrent_with_states(q, k, v, decay, beta, bounds, start)
    assert (got.double() - want).abs().max() < 1e-5
    assert (got_final.double() - want_final).abs().max() < 1e-5
    with pytest.raises(ValueError, match="initial_state shaped"):
        gd.chunk_gated_delta_rule(q, k, v, decay, beta, bounds, initial_state=start[:2])


def _shared_case(prompt=23, replies=(9, 30, 1), conv_k=4, dtype=torch.float64):
    """A prompt with its replies as whole samples (prompt + reply each, packed) and as a
    shared layout (the prompt once, then each reply continuing it), with a sample standing
    alone after them."""
    alone = 11
    lens = [prompt + r for r in replies] + [alone]
    q, k, v, decay, beta, _ = packed_inputs(lens=tuple(lens), dtype=dtype)
    whole_offsets = [0]
    for n in lens:
        whole_offsets.append(whole_offsets[-1] + n)
    # the shared layout's rows, taken from the first whole sample's prompt and each sample's reply
    rows = list(range(prompt))
    seg_offsets, parents = [0, prompt], [-1]
    for i, r in enumerate(replies):
        a = whole_offsets[i] + prompt
        rows += list(range(a, a + r))
        seg_offsets.append(seg_offsets[-1] + r)
        parents.append(0)
    rows += list(range(whole_offsets[-2], whole_offsets[-1]))
    seg_offsets.append(seg_offsets[-1] + alone)
    parents.append(-1)
    # every whole sample gets the first one's prompt, so the two layouts compute the same thing
    index = torch.tensor(rows)
    for x in (q, k, v, decay, beta):
        for i in range(1, len(replies)):
            x[whole_offsets[i]:whole_offsets[i] + prompt] = x[:prompt]
    real = [b - a for a, b in zip(seg_offsets[:-1], seg_offsets[1:])]
    layout = gd.SharedLayout(seg_offsets, real, parents, conv_k, torch.device("cpu"))
    whole_bounds = gd.segment_bounds(whole_offsets[:-1], whole_offsets[-1])
    return (q, k, v, decay, beta), index, layout, whole_bounds


def test_shared_prompt_recurrence_equals_each_reply_run_after_its_prompt():
    (q, k, v, decay, beta), index, layout, whole_bounds = _shared_case()
    want = gd.chunk_gated_delta_rule(q, k, v, decay, beta, whole_bounds, chunk=16)
    got = gd.shared_gated_delta_rule(*(x.index_select(0, index) for x in (q, k, v, decay, beta)), layout)
    assert (got.double() - want.index_select(0, index).double()).abs().max() < 1e-5


def test_shared_prompt_gradients_reach_the_prompt_through_its_state():
    """The replies' loss reaches the prompt's tokens only through the state they start from:
    the prompt's gradient is the sum over its whole samples' copies."""
    (q, k, v, decay, beta), index, layout, whole_bounds = _shared_case(replies=(9, 17), dtype=torch.float32)
    weights = torch.randn(q.shape[0], v.shape[1], v.shape[2])
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, decay, beta)]
    (gd.chunk_gated_delta_rule(*leaves, whole_bounds) * weights).sum().backward()
    # a shared prompt's row is every whole copy's row: its gradient is their sum
    whole_grads = [t.grad for t in leaves]
    shared = [x.index_select(0, index).clone().requires_grad_(True) for x in (q, k, v, decay, beta)]
    # the shared layout's loss: the same weights at the rows it holds, the prompt's weighted as often as it repeats
    w = weights.index_select(0, index).clone()
    prompt = 23
    w[:prompt] = sum(weights[a:a + prompt] for a, _ in whole_bounds[:2])
    (gd.shared_gated_delta_rule(*shared, layout) * w).sum().backward()
    for got, want in zip((t.grad for t in shared), whole_grads):
        want_rows = want.index_select(0, index).clone()
        want_rows[:prompt] = sum(want[a:a + prompt] for a, _ in whole_bounds[:2])
        assert (got - want_rows).abs().max() / want_rows.abs().max() < 1e-4


def test_shared_prompt_convolution_continues_the_prompts_window():
    (q, *_), index, layout, whole_bounds = _shared_case(conv_k=4)
    x = q.reshape(q.shape[0], -1)
    weight = torch.randn(x.shape[1], 4, dtype=x.dtype)
    want = gd.causal_conv1d(x, weight, whole_bounds).index_select(0, index)
    got = gd.shared_causal_conv1d(x.index_select(0, index), weight, layout)
    assert (got - want).abs().max() < 1e-12
    with pytest.raises(ValueError, match="parent 2 is not a segment before it"):
        gd.SharedLayout([0, 5, 9, 12], [5, 4, 3], [-1, 2, -1], 4, torch.device("cpu"))

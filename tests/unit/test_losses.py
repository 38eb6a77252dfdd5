"""Policy losses on the packed layout: hand-computed values, aggregation, micro-batch equivalence."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from vlmrl.algo.losses import (
    AGG_MODES,
    aggregate,
    broadcast_to_tokens,
    entropy_from_logits,
    gspo_loss,
    kl_penalty,
    loss_normaliser,
    mis_keep,
    policy_loss,
    ppo_clip_loss,
    seq_ids_from_cu_seqlens,
    sft_loss,
    tis_weights,
    token_logprobs_from_logits,
)
from vlmrl.config.schema import AlgoConfig

CFG = AlgoConfig(name="grpo")


def cu(*lengths: int) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def close(a, b, tol=1e-6) -> None:
    torch.testing.assert_close(torch.as_tensor(a).double(), torch.as_tensor(b).double(), atol=tol, rtol=tol)


# --------------------------------------------------------------------------- packing helpers
def test_broadcast_and_seq_ids() -> None:
    c = cu(2, 0, 3)
    assert seq_ids_from_cu_seqlens(c).tolist() == [0, 0, 2, 2, 2]
    assert broadcast_to_tokens(torch.tensor([1.0, 2.0, 3.0]), c).tolist() == [1, 1, 3, 3, 3]
    with pytest.raises(ValueError, match="ends at 5"):
        seq_ids_from_cu_seqlens(c, 6)
    with pytest.raises(ValueError, match="non-decreasing"):
        seq_ids_from_cu_seqlens(torch.tensor([0, 3, 2]))
    with pytest.raises(ValueError, match="num_seqs"):
        broadcast_to_tokens(torch.tensor([1.0, 2.0]), c)


# --------------------------------------------------------------------------- PPO
def test_ppo_clip_hand_computed_both_sides() -> None:
    # (advantage, ratio) -> per-token loss max(-A r, -A clip(r, 0.8, 1.28)), clipped?
    cases = [(1.0, 1.5, -1.28, True), (1.0, 0.5, -0.5, False), (-1.0, 1.5, 1.5, False),
             (-1.0, 0.5, 0.8, True), (1.0, 1.1, -1.1, False), (-2.0, 0.9, 1.8, False)]
    adv = torch.tensor([c[0] for c in cases] + [5.0])  # last token: masked prompt token
    ratio = torch.tensor([c[1] for c in cases] + [1.0])
    old = torch.full((7,), -1.0)
    logp = (old + ratio.log()).requires_grad_()
    with torch.no_grad():
        logp[-1] = -math.inf  # garbage at a masked position
    mask = torch.tensor([1.0] * 6 + [0.0])
    loss, m = ppo_clip_loss(logp, old, adv, mask, cu(3, 4), 0.2, 0.28, "token_mean")
    expected = sum(c[2] for c in cases) / 6
    close(loss, expected)
    close(m["pg_loss"], expected)
    close(m["pg_clipfrac"], 2 / 6)
    close(m["ppo_kl"], -ratio[:6].log().mean())
    loss.backward()
    grad_expected = torch.tensor([0.0 if c[3] else -c[0] * c[1] / 6 for c in cases] + [0.0])
    close(logp.grad, grad_expected)


def test_on_policy_first_step_is_the_policy_gradient() -> None:
    gen = torch.Generator().manual_seed(0)
    c = cu(3, 5, 2, 4)
    seq_adv = torch.tensor([1.5, -0.5, 0.0, -1.0])
    adv = broadcast_to_tokens(seq_adv, c)
    mask = torch.tensor([0, 1, 1, 0, 0, 1, 1, 1, 1, 1, 0, 1, 1, 1], dtype=torch.float32)
    logits = torch.randn(14, 11, generator=gen, requires_grad=True)
    targets = torch.randint(0, 11, (14,), generator=gen)
    logp = token_logprobs_from_logits(logits, targets)
    loss, m = ppo_clip_loss(logp, logp.detach(), adv, mask, c, agg_mode="token_mean")
    close(loss, -(adv * mask).sum() / mask.sum())
    assert m["pg_clipfrac"] == 0 and m["ppo_kl"] == 0
    (grad_logp,) = torch.autograd.grad(loss, logp, retain_graph=True)
    close(grad_logp, -adv * mask / mask.sum())
    # the REINFORCE estimator -(1/N) sum_t A_t grad log pi(y_t) on the logits
    (grad_logits,) = torch.autograd.grad(loss, logits, retain_graph=True)
    (reinforce,) = torch.autograd.grad(-(adv * mask * logp).sum() / mask.sum(), logits)
    close(grad_logits, reinforce)


def test_clip_validation() -> None:
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="eps_clip"):
        ppo_clip_loss(x, x, x, torch.ones(2), cu(2), 1.5, 0.2)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        ppo_clip_loss(x, x, x, torch.ones(2), cu(2), agg_mode="mean")
    with pytest.raises(ValueError, match="per token"):
        gspo_loss(x, x, torch.zeros(1), torch.ones(2), cu(2))


# --------------------------------------------------------------------------- GSPO
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_gspo_equals_ppo_for_one_token_sequences(mode: str) -> None:
    gen = torch.Generator().manual_seed(1)
    n = 9
    old = -torch.rand(n, generator=gen) * 3
    adv = torch.randn(n, generator=gen)
    mask = torch.ones(n)
    mask[4] = 0
    c = cu(*[1] * n)
    logp_a = (old + torch.randn(n, generator=gen) * 0.4).requires_grad_()
    logp_b = logp_a.detach().clone().requires_grad_()
    la, ma = ppo_clip_loss(logp_a, old, adv, mask, c, agg_mode=mode)
    lb, mb = gspo_loss(logp_b, old, adv, mask, c, agg_mode=mode)
    close(la, lb)
    assert 0 < ma["pg_clipfrac"] < 1
    for k in ma:
        close(ma[k], mb[k])
    la.backward()
    lb.backward()
    close(logp_a.grad, logp_b.grad)


def test_gspo_sequence_ratio_and_per_token_gradient() -> None:
    # seq 0: log-ratios 0.1, 0.3 (mean 0.2, inside the clip); seq 1: prompt token with a
    # huge log-ratio (masked), then 0.4, 0.6 (mean 0.5 > log 1.28: clipped for A > 0).
    old = torch.zeros(5)
    logp = torch.tensor([0.1, 0.3, 9.0, 0.4, 0.6], requires_grad=True)
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])
    adv = broadcast_to_tokens(torch.tensor([-1.0, 2.0]), cu(2, 3))
    loss, m = gspo_loss(logp, old, adv, mask, cu(2, 3), 0.2, 0.28)
    s0 = math.exp(0.2)
    close(loss, (s0 + (-2.0 * 1.28)) / 2)  # seq_mean_token_mean: mean over sequences
    close(m["pg_clipfrac"], 2 / 4)
    loss.backward()
    # d/dlogp_t of (1/2) * (1/|y_0|) * sum_t -A s_0: -A * s_0 / |y_0| / 2 per token
    close(logp.grad, torch.tensor([s0 / 4, s0 / 4, 0.0, 0.0, 0.0]))


# --------------------------------------------------------------------------- aggregation
RAGGED_X = torch.tensor([9.0, 1.0, 2.0, 3.0, 9.0, 4.0, 9.0, 9.0, 5.0, 6.0, 7.0, 8.0])
RAGGED_MASK = torch.tensor([0, 1, 1, 1, 0, 1, 0, 0, 1, 1, 1, 1], dtype=torch.float32)
RAGGED_CU = cu(4, 2, 2, 4)  # masked tokens per sequence: [1,2,3], [4], [], [5,6,7,8]


@pytest.mark.parametrize(("mode", "expected"), [
    ("token_mean", 36 / 8),
    ("seq_mean_token_sum", (6 + 4 + 26) / 3),  # the sequence without masked tokens is not counted
    ("seq_mean_token_mean", (2 + 4 + 6.5) / 3),
    ("token_sum_norm", 36 / (4 * 10)),  # every sequence counted, constant max_response_len
])
def test_aggregation_modes_on_ragged_sequences(mode: str, expected: float) -> None:
    x = RAGGED_X.clone().requires_grad_()
    out = aggregate(x, RAGGED_MASK, RAGGED_CU, mode, max_response_len=10)
    close(out, expected)
    out.backward()
    assert (x.grad[RAGGED_MASK == 0] == 0).all()


def test_token_sum_norm_is_independent_of_lengths_and_needs_max_len() -> None:
    assert float(loss_normaliser(RAGGED_MASK, RAGGED_CU, "token_sum_norm", 10)) == 40.0
    assert float(loss_normaliser(torch.ones(12), RAGGED_CU, "token_sum_norm", 10)) == 40.0
    with pytest.raises(ValueError, match="max_response_len"):
        aggregate(RAGGED_X, RAGGED_MASK, RAGGED_CU, "token_sum_norm")
    close(aggregate(RAGGED_X, RAGGED_MASK, RAGGED_CU, "token_sum_norm", normaliser=72.0), 0.5)


def test_empty_mask_gives_zero_loss_and_gradient() -> None:
    x = torch.randn(6, requires_grad=True)
    for mode in AGG_MODES:
        out = aggregate(x, torch.zeros(6), cu(2, 4), mode, max_response_len=4)
        assert float(out.detach()) == 0.0
        out.backward()
        assert (x.grad == 0).all()


def _batch(seed: int, lengths: list[int], vocab: int = 13):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    mask = torch.zeros(total)
    start = 0
    for n in lengths:  # a prompt of 1-2 tokens, then the response
        mask[start + 1 + (n % 2):start + n] = 1
        start += n
    return {
        "logits": torch.randn(total, vocab, generator=gen, dtype=torch.float32),
        "targets": torch.randint(0, vocab, (total,), generator=gen),
        "adv": broadcast_to_tokens(torch.randn(len(lengths), generator=gen), cu(*lengths)),
        "old": lambda lp: lp.detach() + 0.3 * torch.randn(total, generator=gen),
        "ref": -torch.rand(total, generator=gen) * 4,
        "rollout": -torch.rand(total, generator=gen) * 4,
        "mask": mask,
    }


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("pg", ["ppo", "gspo"])
def test_micro_batches_with_global_normaliser_reproduce_the_full_batch(mode: str, pg: str) -> None:
    lengths = [5, 3, 8, 2, 6, 7, 4]
    splits = [[0, 1], [2], [3, 4, 5, 6]]  # micro-batches of whole sequences (uneven sizes)
    b = _batch(7, lengths)
    c_full = cu(*lengths)
    logp0 = token_logprobs_from_logits(b["logits"], b["targets"])
    old = b["old"](logp0)
    cfg = replace(CFG, policy_loss=pg, loss_agg_mode=mode, kl_coef=0.05, kl_type="k3",
                  entropy_coef=0.01, tis=True, tis_cap=1.5, eps_clip=0.1, eps_clip_high=0.15)

    def run(rows: slice, seqs: list[int], normaliser):
        logits = b["logits"][rows].clone().requires_grad_()
        logp = token_logprobs_from_logits(logits, b["targets"][rows])
        loss, metrics = policy_loss(
            cfg, logp, old[rows], b["adv"][rows], b["mask"][rows], cu(*[lengths[i] for i in seqs]),
            ref_logp=b["ref"][rows], entropy=entropy_from_logits(logits), rollout_logp=b["rollout"][rows],
            normaliser=normaliser, max_response_len=8)
        loss.backward()
        return loss, logits.grad, metrics

    full_loss, full_grad, full_metrics = run(slice(None), list(range(len(lengths))), None)
    assert 0 < full_metrics["pg_clipfrac"] < 1
    bounds = [(int(c_full[s[0]]), int(c_full[s[-1] + 1])) for s in splits]
    mb_cu = [cu(*[lengths[i] for i in s]) for s in splits]
    total = sum(loss_normaliser(b["mask"][lo:hi], c, mode, 8) for (lo, hi), c in zip(bounds, mb_cu))
    close(total, loss_normaliser(b["mask"], c_full, mode, 8))
    losses, grads = [], []
    summed = dict.fromkeys(("loss", "pg_loss", "kl", "entropy"), 0.0)
    for (lo, hi), s in zip(bounds, splits):
        loss, grad, metrics = run(slice(lo, hi), s, total)
        losses.append(loss)
        grads.append(grad)
        for k in summed:
            summed[k] = summed[k] + metrics[k]
    close(sum(losses), full_loss)
    close(torch.cat(grads), full_grad)
    for k, v in summed.items():
        close(v, full_metrics[k])


# --------------------------------------------------------------------------- KL
def test_kl_values() -> None:
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.5, -1.0, -0.5])
    d = logp - ref  # 0.5, -1.0, 0.0
    close(kl_penalty(logp, ref, "k1"), d)
    close(kl_penalty(logp, ref, "k2"), 0.5 * d**2)
    k3 = torch.exp(-d) + d - 1
    close(kl_penalty(logp, ref, "k3"), k3)
    close(kl_penalty(logp, ref, "low_var_kl"), k3)
    close(kl_penalty(logp, ref, "k3")[2], 0.0)
    with pytest.raises(ValueError, match="kl_type"):
        kl_penalty(logp, ref, "k4")


def test_kl_non_negative_and_low_var_clamped() -> None:
    gen = torch.Generator().manual_seed(3)
    logp = torch.randn(1000, generator=gen) * 3
    ref = torch.randn(1000, generator=gen) * 3
    for kind in ("k2", "k3", "low_var_kl"):
        assert (kl_penalty(logp, ref, kind) >= 0).all()
    far = torch.tensor([-50.0], requires_grad=True)  # ref - logp = 50: k3 would be e^50
    out = kl_penalty(far, torch.tensor([0.0]), "low_var_kl")
    assert float(out.detach()) == 10.0
    out.backward()
    assert torch.isfinite(far.grad).all()


# --------------------------------------------------------------------------- entropy, logprobs, TIS
def test_entropy_matches_float64() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 50, generator=gen) * 8
    p = torch.softmax(logits.double(), -1)
    expected = -(p * p.log()).sum(-1)
    out = entropy_from_logits(logits)
    assert out.dtype == torch.float32
    close(out, expected, tol=1e-5)
    close(entropy_from_logits(logits.bfloat16()), -(torch.softmax(logits.bfloat16().double(), -1)
                                                      * torch.log_softmax(logits.bfloat16().double(), -1)).sum(-1),
          tol=1e-5)
    # large offsets and masked (-inf) vocabulary entries stay finite, gradients too
    masked = (logits + 1e4).clone()
    masked[:, 25:] = -math.inf
    masked.requires_grad_()
    h = entropy_from_logits(masked)
    p = torch.softmax(masked.detach()[:, :25].double(), -1)
    close(h, -(p * p.log()).sum(-1), tol=1e-5)
    h.sum().backward()
    assert torch.isfinite(masked.grad).all()
    close(entropy_from_logits(torch.zeros(3, 8)), torch.full((3,), math.log(8)))


def test_token_logprobs_match_manual_log_softmax() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 7, 30, generator=gen).bfloat16()
    targets = torch.randint(0, 30, (2, 7), generator=gen)
    for temp in (1.0, 0.7):
        manual = torch.log_softmax(logits.float() / temp, -1).gather(-1, targets[..., None])[..., 0]
        close(token_logprobs_from_logits(logits, targets, temp), manual)
    close(token_logprobs_from_logits(logits, targets, 0.0), token_logprobs_from_logits(logits, targets, 1.0))
    with pytest.raises(ValueError):
        token_logprobs_from_logits(logits, targets, -1.0)


def test_tis_weights_capped_and_detached() -> None:
    old = torch.tensor([-1.0, -1.0, -1.0, -1.0], requires_grad=True)
    rollout = torch.tensor([-1.0, -1.5, -3.0, -0.5])
    w = tis_weights(old, rollout, 2.0)
    assert not w.requires_grad
    close(w, [1.0, math.exp(0.5), 2.0, math.exp(-0.5)])
    assert float(w.max()) <= 2.0
    assert float(tis_weights(torch.tensor([0.0]), torch.tensor([-500.0]), 2.0)) == 2.0


def test_mis_keeps_tokens_or_sequences_inside_the_band() -> None:
    # ratios exp(old - rollout): seq 0 tokens 1, 3, 1/3 (geo mean 1); seq 1 tokens 1.5, 1.5 (geo 1.5);
    # seq 2 tokens 4, 4 (geo 4); the last token is a masked prompt token with a wild ratio
    old = torch.zeros(8, requires_grad=True)
    rollout = -torch.tensor([0.0, math.log(3), -math.log(3), math.log(1.5), math.log(1.5), math.log(4),
                             math.log(4), 50.0])
    mask = torch.tensor([1.0] * 7 + [0.0])
    c = cu(3, 2, 3)
    tok = mis_keep(old, rollout, mask, c, "token", 0.5, 2.0)
    assert not tok.requires_grad
    assert tok[:7].tolist() == [1, 0, 0, 1, 1, 0, 0]
    seq = mis_keep(old, rollout, mask, c, "sequence", 0.5, 2.0)
    assert seq[:7].tolist() == [1, 1, 1, 1, 1, 0, 0]  # seq 0's geometric mean is 1: kept whole
    assert mis_keep(old, rollout, mask, c, "none", 0.5, 2.0).tolist() == [1.0] * 8
    for bad in [("token", 1.0, 2.0), ("token", 0.5, 1.0), ("tokens", 0.5, 2.0)]:
        with pytest.raises(ValueError):
            mis_keep(old, rollout, mask, c, *bad)


def test_mis_masks_the_loss_and_composes_with_tis() -> None:
    b = _batch(8, [4, 6, 3])
    c = cu(4, 6, 3)
    logp = token_logprobs_from_logits(b["logits"], b["targets"]).requires_grad_()
    old = b["old"](logp)
    rollout = b["rollout"].clone()
    rollout[2] = old[2].detach() - 3.0  # one token far off-policy: ratio e^3
    for level in ("token", "sequence"):
        cfg = replace(CFG, tis=True, tis_cap=2.0, mis=level, mis_low=0.5, mis_high=2.0)
        loss, m = policy_loss(cfg, logp, old, b["adv"], b["mask"], c, rollout_logp=rollout)
        keep = mis_keep(old, rollout, b["mask"], c, level, 0.5, 2.0)
        w = tis_weights(old, rollout, 2.0) * keep
        close(loss, ppo_clip_loss(logp, old, b["adv"], b["mask"], c, 0.2, 0.28, token_weights=w)[0])
        sel = b["mask"] == 1
        close(m["mis_masked_frac"], (1 - keep)[sel].mean())
        assert float(m["mis_masked_frac"]) > 0
        if level == "token":
            assert keep[2] == 0
        else:  # one decision per sequence
            assert all(len(set(keep[a:e].tolist())) == 1 for a, e in zip(c[:-1].tolist(), c[1:].tolist()))
        grad = torch.autograd.grad(loss, logp, retain_graph=True)[0]
        dropped = (keep == 0) & (b["mask"] == 1)
        assert dropped.any() and bool((grad[dropped] == 0).all())  # masked-out tokens give no gradient
    with pytest.raises(ValueError, match="mis needs rollout_logp"):
        policy_loss(replace(CFG, mis="token"), logp, old, b["adv"], b["mask"], c)


# --------------------------------------------------------------------------- policy_loss, sft
def test_policy_loss_composition_and_metrics() -> None:
    b = _batch(8, [4, 6, 3])
    c = cu(4, 6, 3)
    logp = token_logprobs_from_logits(b["logits"], b["targets"])
    old = b["old"](logp)
    ent = entropy_from_logits(b["logits"])
    cfg = replace(CFG, kl_coef=0.1, kl_type="low_var_kl", entropy_coef=0.01, tis=True, tis_cap=2.0)
    loss, m = policy_loss(cfg, logp, old, b["adv"], b["mask"], c, ref_logp=b["ref"], entropy=ent,
                          rollout_logp=b["rollout"])
    w = tis_weights(old, b["rollout"], 2.0)
    pg, _ = ppo_clip_loss(logp, old, b["adv"], b["mask"], c, 0.2, 0.28, token_weights=w)
    kl = aggregate(kl_penalty(logp, b["ref"], "low_var_kl"), b["mask"], c, "token_mean")
    h = aggregate(ent, b["mask"], c, "token_mean")
    close(loss, pg + 0.1 * kl - 0.01 * h)
    assert set(m) == {"loss", "pg_loss", "pg_clipfrac", "ppo_kl", "kl", "entropy", "tis_mean",
                      "train_rollout_logprob_abs_diff"}
    sel = b["mask"] == 1
    close(m["train_rollout_logprob_abs_diff"], (old - b["rollout"])[sel].abs().mean())
    close(m["tis_mean"], w[sel].mean())
    close(m["kl"], kl)
    # plain GRPO: only the policy-gradient metrics
    loss2, m2 = policy_loss(CFG, logp, old, b["adv"], b["mask"], c)
    close(loss2, ppo_clip_loss(logp, old, b["adv"], b["mask"], c)[0])
    assert set(m2) == {"loss", "pg_loss", "pg_clipfrac", "ppo_kl"}


def test_policy_loss_rejects_missing_inputs_and_ignores_masked_garbage() -> None:
    x = torch.zeros(4)
    mask = torch.tensor([0.0, 1.0, 1.0, 0.0])
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(replace(CFG, kl_coef=0.1), x, x, x, mask, cu(4))
    with pytest.raises(ValueError, match="rollout_logp"):
        policy_loss(replace(CFG, tis=True), x, x, x, mask, cu(4))
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(replace(CFG, entropy_coef=0.1), x, x, x, mask, cu(4))
    with pytest.raises(ValueError, match="policy_loss"):
        policy_loss(replace(CFG, policy_loss="reinforce"), x, x, x, mask, cu(4))
    bad = torch.tensor([math.nan, -0.5, -1.0, -math.inf])
    for pg in ("ppo", "gspo"):
        logp = bad.clone().requires_grad_()
        cfg = replace(CFG, policy_loss=pg, kl_coef=0.1, kl_type="k3", entropy_coef=0.1, tis=True,
                      loss_agg_mode="seq_mean_token_mean")
        loss, m = policy_loss(cfg, logp, bad.flip(0), torch.ones(4), mask, cu(1, 3), ref_logp=bad,
                              entropy=bad, rollout_logp=bad)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
        assert all(torch.isfinite(v) for v in m.values())


def test_sft_loss_ignores_prompt_tokens() -> None:
    logp = torch.tensor([-9.0, -8.0, -1.0, -2.0, -7.0, -3.0])
    mask = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    c = cu(4, 2)
    close(sft_loss(logp, mask, c), 2.0)
    other = logp.clone()
    other[mask == 0] = -100.0
    close(sft_loss(other, mask, c), 2.0)
    close(sft_loss(logp, mask, c, normaliser=6.0), 1.0)

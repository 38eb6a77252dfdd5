"""Policy losses, KL penalties, entropy and log-probabilities as pure tensor functions.

Packed layout. The trainer packs samples without padding (THD), so every per-token
tensor here is flat: ``[T]``, the tokens of many samples concatenated. Two tensors
describe it:

- ``loss_mask`` ``[T]``: 1 for tokens that count (response tokens), 0 otherwise (prompt,
  image and padding tokens). Values at masked-out positions of every other input are
  never read: they may be garbage (``-inf``, NaN) without reaching the loss or its
  gradient.
- ``cu_seqlens`` ``[num_seqs + 1]`` int: cumulative sample lengths in these tensors,
  ``cu_seqlens[0] == 0`` and ``cu_seqlens[-1] == T`` (the offsets of the tensors given, so
  padded offsets when samples were padded). Every sample's tokens must all be present:
  sequences split over context-parallel ranks need their per-sequence statistics reduced
  first (not supported here).

Per-token advantages are the sample's advantage repeated over its tokens
(`broadcast_to_tokens`).

Aggregation and global normalisers. A loss is ``numerator / normaliser`` where the
numerator is a sum over tokens or sequences of the micro-batch and the normaliser depends
on ``loss_agg_mode`` (see `aggregate`). Without ``normaliser`` the micro-batch's own is used
(``loss_normaliser``). For gradient accumulation and data parallelism, pass the GLOBAL
one: the sum of `loss_normaliser` over every micro-batch of the step on every DP rank.
Then the micro-batch losses of all micro-batches and ranks add up to the full-batch loss,
and so do their gradients. (Megatron's schedule divides a 2-tuple loss by the number of
micro-batches and DDP averages gradients over DP; with ``calculate_per_token_loss`` it
instead divides by the summed ``num_tokens`` itself, so ``normaliser=1`` with ``num_tokens
= loss_normaliser(...)`` gives the same global normalisation.)

Metrics are detached 0-d tensors (no device sync). ``loss``, ``pg_loss``, ``kl`` and
``entropy`` use the loss's normaliser, so they add up over micro-batches like the loss;
``pg_clipfrac``, ``ppo_kl``, ``tis_mean``, ``mis_masked_frac`` and
``train_rollout_logprob_abs_diff`` are means over the micro-batch's masked tokens.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

AGG_MODES = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "token_sum_norm")
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
POLICY_LOSSES = ("ppo", "gspo")

# Log-ratios are clamped to this range before exp so a far off-policy token cannot give
# inf (whose gradient through a clamp or min/max would be NaN).
_MAX_LOG_RATIO = 20.0
_LOW_VAR_KL_BOUND = 10.0


# --------------------------------------------------------------------------- packing helpers
def seq_ids_from_cu_seqlens(cu_seqlens: Tensor, num_tokens: int | None = None) -> Tensor:
    """``[T]`` long: the index of the sequence each token belongs to.

    Raises:
        ValueError: ``cu_seqlens`` is not 1-D, does not start at 0, decreases, or (when
            ``num_tokens`` is given) does not end at ``num_tokens``.
    """
    cu = torch.as_tensor(cu_seqlens)
    if cu.dim() != 1 or cu.numel() < 1 or cu.dtype.is_floating_point:
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [num_seqs + 1], got {tuple(cu.shape)} {cu.dtype}")
    lengths = cu[1:] - cu[:-1]
    total = int(cu[-1])
    if int(cu[0]) != 0 or bool((lengths < 0).any()):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu.tolist()}")
    if num_tokens is not None and total != num_tokens:
        raise ValueError(f"cu_seqlens ends at {total} but the per-token tensors have {num_tokens} tokens")
    ids = torch.arange(lengths.numel(), device=cu.device)
    return torch.repeat_interleave(ids, lengths.long(), output_size=total)


def broadcast_to_tokens(values_per_seq: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Repeat each sequence's value over its tokens: ``[num_seqs]`` -> ``[T]``."""
    values = torch.as_tensor(values_per_seq)
    cu = torch.as_tensor(cu_seqlens, device=values.device)
    if values.dim() != 1 or values.numel() != cu.numel() - 1:
        raise ValueError(f"values_per_seq must be [num_seqs] = [{cu.numel() - 1}], got {tuple(values.shape)}")
    return values[seq_ids_from_cu_seqlens(cu)]


def _segment_sum(x: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Per-sequence sums ``[num_seqs]`` of a ``[T]`` tensor (differentiable)."""
    ids = seq_ids_from_cu_seqlens(cu_seqlens.to(x.device), x.shape[0])
    return x.new_zeros(cu_seqlens.numel() - 1).index_add(0, ids, x)


def _mask(loss_mask: Tensor, like: Tensor) -> tuple[Tensor, Tensor]:
    """(valid bool, weight float) versions of ``loss_mask`` on ``like``'s device/dtype."""
    if loss_mask.shape != like.shape or like.dim() != 1:
        raise ValueError(f"per-token tensors must be flat [T] and match loss_mask {tuple(loss_mask.shape)}, "
                         f"got {tuple(like.shape)}")
    weight = loss_mask.to(device=like.device, dtype=like.dtype)
    return weight != 0, weight


def _masked_mean(x: Tensor, loss_mask: Tensor) -> Tensor:
    """Detached mean of ``x`` over masked tokens (0 when there are none)."""
    valid, weight = _mask(loss_mask, x)
    x = torch.where(valid, x.detach(), 0.0)
    return (x * weight).sum() / weight.sum().clamp_min(torch.finfo(weight.dtype).tiny)


# --------------------------------------------------------------------------- aggregation
def loss_normaliser(
    loss_mask: Tensor, cu_seqlens: Tensor, mode: str, max_response_len: int | None = None
) -> Tensor:
    """The denominator of `aggregate` for this micro-batch (0-d float32).

    - ``token_mean``: the number of masked tokens.
    - ``seq_mean_token_sum`` / ``seq_mean_token_mean``: the number of sequences with at
      least one masked token (a sequence with none has no mean and is not counted).
    - ``token_sum_norm``: ``num_seqs * max_response_len``, every sequence counted, so the
      normaliser is a constant of the batch shape (Dr.GRPO).

    Summed over all micro-batches and DP ranks it is the global normaliser.
    """
    _check_mode(mode)
    weight = loss_mask.detach().float()
    if mode == "token_mean":
        return weight.sum()
    if mode == "token_sum_norm":
        if max_response_len is None or max_response_len <= 0:
            raise ValueError("loss_agg_mode token_sum_norm needs max_response_len > 0 (or a normaliser)")
        num_seqs = torch.as_tensor(cu_seqlens).numel() - 1
        return torch.tensor(float(num_seqs * max_response_len), device=weight.device)
    counts = _segment_sum(weight, torch.as_tensor(cu_seqlens))
    return (counts > 0).sum().float()


def aggregate(
    per_token: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    mode: str,
    max_response_len: int | None = None,
    *,
    normaliser: Tensor | float | None = None,
) -> Tensor:
    """Reduce a per-token loss ``[T]`` to a scalar over the masked tokens.

    - ``token_mean``: sum over masked tokens / number of masked tokens (long sequences
      weigh more; GRPO as implemented by DAPO and most frameworks).
    - ``seq_mean_token_sum``: per-sequence sum, mean over sequences.
    - ``seq_mean_token_mean``: per-sequence mean, mean over sequences (the GRPO paper).
    - ``token_sum_norm``: sum / (num_seqs * max_response_len), a constant normaliser
      independent of response lengths (Dr.GRPO).

    ``normaliser`` replaces the denominator (see the module docstring: pass the global one
    for gradient accumulation and data parallel). A zero denominator gives a loss of 0.
    """
    _check_mode(mode)
    valid, weight = _mask(loss_mask, per_token)
    x = torch.where(valid, per_token, 0.0) * weight
    if mode == "seq_mean_token_mean":
        cu = torch.as_tensor(cu_seqlens)
        seq_sum = _segment_sum(x, cu)
        seq_count = _segment_sum(weight, cu)
        numerator = torch.where(seq_count > 0, seq_sum / seq_count.clamp_min(1e-30), 0.0).sum()
    else:
        numerator = x.sum()
    if normaliser is None:
        normaliser = loss_normaliser(loss_mask, cu_seqlens, mode, max_response_len)
    if not torch.is_tensor(normaliser):  # a host number: no tensor to copy to the device
        return numerator / normaliser if normaliser > 0 else numerator
    denom = normaliser.to(dtype=numerator.dtype, device=numerator.device).detach()
    return numerator / torch.where(denom > 0, denom, torch.ones_like(denom))


def _check_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid: {', '.join(AGG_MODES)}")


# --------------------------------------------------------------------------- policy losses
def _clipped_surrogate(ratio: Tensor, advantages: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """Per-token ``max(-A r, -A clip(r, low, high))`` and where the clipped branch wins."""
    if advantages.shape != ratio.shape:
        raise ValueError(f"advantages must be per token {tuple(ratio.shape)} (see broadcast_to_tokens), "
                         f"got {tuple(advantages.shape)}")
    advantages = advantages.to(ratio.dtype)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(low, high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _check_clip(eps_clip: float, eps_clip_high: float) -> None:
    if not (0 <= eps_clip < 1) or eps_clip_high < 0:
        raise ValueError(f"need 0 <= eps_clip < 1 and eps_clip_high >= 0, got {eps_clip}, {eps_clip_high}")


def _pg_metrics(pg_loss: Tensor, is_clipped: Tensor, log_ratio: Tensor, loss_mask: Tensor) -> dict[str, Tensor]:
    return {
        "pg_loss": pg_loss.detach(),
        "pg_clipfrac": _masked_mean(is_clipped.to(log_ratio.dtype), loss_mask),
        "ppo_kl": _masked_mean(-log_ratio, loss_mask),
    }


def _clipped_loss(ratio: Tensor, log_ratio: Tensor, advantages: Tensor, loss_mask: Tensor, cu_seqlens: Tensor,
                  eps_clip: float, eps_clip_high: float, agg_mode: str, token_weights: Tensor | None,
                  normaliser: Tensor | float | None, max_response_len: int | None) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped surrogate of per-token `ratio`s, weighted, aggregated, with its metrics
    (shared by PPO's token ratios and GSPO's sequence ratios)."""
    per_token, is_clipped = _clipped_surrogate(ratio, advantages, 1.0 - eps_clip, 1.0 + eps_clip_high)
    if token_weights is not None:
        per_token = per_token * token_weights.detach().to(per_token.dtype)
    loss = aggregate(per_token, loss_mask, cu_seqlens, agg_mode, max_response_len, normaliser=normaliser)
    return loss, _pg_metrics(loss, is_clipped, log_ratio, loss_mask)


def ppo_clip_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: float = 0.28,
    agg_mode: str = "token_mean",
    *,
    token_weights: Tensor | None = None,
    normaliser: Tensor | float | None = None,
    max_response_len: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with DAPO's clip-higher, per token, aggregated by ``agg_mode``.

    ``ratio = exp(logp - old_logp)`` is clipped to ``[1 - eps_clip, 1 + eps_clip_high]``;
    the per-token loss is ``max(-A * ratio, -A * clip(ratio))``. ``advantages`` are per
    token ``[T]`` (`broadcast_to_tokens`). ``token_weights`` (e.g. `tis_weights`) multiply
    the per-token loss. Metrics: ``pg_loss``, ``pg_clipfrac`` (share of masked tokens
    where the clipped branch is active) and ``ppo_kl`` (mean ``old_logp - logp``).
    """
    _check_clip(eps_clip, eps_clip_high)
    valid, _ = _mask(loss_mask, logp)
    log_ratio = torch.where(valid, logp - old_logp.detach(), 0.0)
    ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    return _clipped_loss(ratio, log_ratio, advantages, loss_mask, cu_seqlens, eps_clip, eps_clip_high, agg_mode,
                         token_weights, normaliser, max_response_len)


def gspo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: float = 0.28,
    agg_mode: str = "seq_mean_token_mean",
    *,
    token_weights: Tensor | None = None,
    normaliser: Tensor | float | None = None,
    max_response_len: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: one importance ratio per sequence, clipped per sequence.

    ``s_i = exp(mean over the sequence's masked tokens of (logp - old_logp))``. Each token
    carries ``s_i,t = sg[s_i] * exp(logp_t - sg[logp_t])`` (GSPO-token form): its value is
    ``s_i`` and its gradient ``s_i * grad logp_t``, so with ``seq_mean_token_mean`` (the
    default, GSPO's per-sequence objective) the gradient is exactly the sequence-level
    one. The clip range is the same asymmetric one as `ppo_clip_loss` (GSPO's paper uses
    far smaller ranges than PPO's, e.g. 3e-4 / 4e-4). Same metrics as `ppo_clip_loss`.
    """
    _check_clip(eps_clip, eps_clip_high)
    valid, weight = _mask(loss_mask, logp)
    log_ratio = torch.where(valid, logp - old_logp.detach(), 0.0)
    cu = torch.as_tensor(cu_seqlens)
    seq_sum = _segment_sum(log_ratio.detach() * weight, cu)
    seq_count = _segment_sum(weight, cu)
    seq_mean = torch.where(seq_count > 0, seq_sum / seq_count.clamp_min(1e-30), 0.0)
    token_seq_mean = seq_mean[seq_ids_from_cu_seqlens(cu.to(logp.device), logp.shape[0])]
    seq_log_ratio = token_seq_mean + (log_ratio - log_ratio.detach())
    ratio = torch.exp(seq_log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    return _clipped_loss(ratio, log_ratio, advantages, loss_mask, cu_seqlens, eps_clip, eps_clip_high, agg_mode,
                         token_weights, normaliser, max_response_len)


# --------------------------------------------------------------------------- KL, entropy, TIS
def kl_penalty(logp: Tensor, ref_logp: Tensor, kl_type: str) -> Tensor:
    """Per-token KL estimate of the policy from the reference policy (samples from the policy).

    - ``k1``: ``logp - ref_logp`` (unbiased, can be negative).
    - ``k2``: ``0.5 * (logp - ref_logp) ** 2`` (non-negative).
    - ``k3``: ``exp(ref - logp) - (ref - logp) - 1`` (unbiased, non-negative).
    - ``low_var_kl``: k3 with the log-ratio clamped to [-20, 20] and the result to
      [-10, 10], as commonly done for stability.
    """
    if kl_type not in KL_TYPES:
        raise ValueError(f"unknown kl_type {kl_type!r}; valid: {', '.join(KL_TYPES)}")
    diff = logp - ref_logp
    if kl_type == "k1":
        return diff
    if kl_type == "k2":
        return 0.5 * diff.square()
    log_ratio = -diff  # log(pi_ref / pi)
    if kl_type == "low_var_kl":
        log_ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return (torch.exp(log_ratio) - log_ratio - 1).clamp(-_LOW_VAR_KL_BOUND, _LOW_VAR_KL_BOUND)
    return torch.exp(log_ratio) - log_ratio - 1


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy ``-sum p log p`` of ``softmax(logits)`` over the last dim, in float32.

    Computed as ``logsumexp(z) - sum(softmax(z) * z)`` with ``z = x - max(x)``: both terms
    stay small, so large logit offsets do not cancel catastrophically in float32; ``-inf``
    logits (masked vocabulary entries) are fine. Differentiable (for an entropy bonus; the
    entropy does not depend on the shift, so the detached max is exact).
    A vocab-parallel variant would all-reduce the max, the sum of exp and the sum of
    ``exp * x`` over the tensor-parallel group.
    """
    x = logits.float()
    x = x - x.detach().amax(dim=-1, keepdim=True)
    lse = torch.logsumexp(x, dim=-1)
    probs = torch.softmax(x, dim=-1)
    x = x.masked_fill(probs == 0, 0.0)  # 0 * -inf would be NaN
    return lse - (probs * x).sum(dim=-1)


def tis_weights(old_logp: Tensor, rollout_logp: Tensor, cap: float) -> Tensor:
    """Truncated importance sampling weights ``min(exp(old_logp - rollout_logp), cap)``, detached.

    They correct for the rollout engine's distribution differing from the trainer's
    (``old_logp`` recomputed by the trainer, ``rollout_logp`` reported by the engine).
    """
    if not cap > 0:
        raise ValueError(f"tis cap must be > 0, got {cap}")
    return torch.exp((old_logp.detach() - rollout_logp.detach()).clamp(max=math.log(cap))).clamp(max=cap)


MIS_LEVELS = ("none", "token", "sequence")


def mis_keep(old_logp: Tensor, rollout_logp: Tensor, loss_mask: Tensor, cu_seqlens: Tensor, level: str,
             low: float, high: float) -> Tensor:
    """Masked importance sampling: ``[T]`` float, 1 for the tokens the loss keeps, 0 for those
    masked out because the trainer's and the engine's distributions disagree too much.

    The ratio ``rho = exp(old_logp - rollout_logp)`` (trainer over engine) must lie in
    ``[low, high]``: per token (``level="token"``: only the tokens outside the band are
    dropped), or as each sequence's geometric mean over its masked tokens
    (``level="sequence"``: a sequence outside the band is dropped whole). Detached; the
    loss keeps its normaliser, so a masked token counts as one that contributed nothing.
    """
    if level not in MIS_LEVELS:
        raise ValueError(f"unknown MIS level {level!r}; valid: {', '.join(MIS_LEVELS)}")
    if not 0 < low < 1 < high:
        raise ValueError(f"MIS needs 0 < low < 1 < high, got low={low}, high={high}")
    valid, weight = _mask(loss_mask, old_logp)
    log_rho = torch.where(valid, (old_logp - rollout_logp).detach().float(), 0.0)
    if level == "none":
        return torch.ones_like(log_rho)
    if level == "sequence":
        cu = torch.as_tensor(cu_seqlens)
        w = weight.float()
        seq_mean = _segment_sum(log_rho * w, cu) / _segment_sum(w, cu).clamp_min(1e-30)
        log_rho = seq_mean[seq_ids_from_cu_seqlens(cu.to(log_rho.device), log_rho.shape[0])]
    keep = (log_rho >= math.log(low)) & (log_rho <= math.log(high))
    return keep.to(old_logp.dtype)


def token_logprobs_from_logits(logits: Tensor, target_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """``log_softmax(logits.float() / temperature)`` at ``target_ids``: ``[..., V]`` -> ``[...]``.

    The same contract as the rollout engine's reported logprobs: a temperature of 0
    (greedy decoding) means 1.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    x = logits.float()
    if temperature not in (0, 1):
        x = x / temperature
    picked = x.gather(-1, target_ids.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(x, dim=-1)


# --------------------------------------------------------------------------- combined
def policy_loss(
    cfg: Any,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    *,
    ref_logp: Tensor | None = None,
    entropy: Tensor | None = None,
    rollout_logp: Tensor | None = None,
    normaliser: Tensor | float | None = None,
    max_response_len: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The RL loss driven by an ``AlgoConfig``-like ``cfg`` (duck-typed).

    ``loss = agg(pg * w) + kl_coef * agg(kl) - entropy_coef * agg(entropy)``, every term
    aggregated with ``cfg.loss_agg_mode`` and the same ``normaliser``. ``pg`` is PPO's
    clipped surrogate or GSPO's (``cfg.policy_loss``), ``w`` the TIS weights when
    ``cfg.tis`` times the MIS mask when ``cfg.mis`` is ``token`` or ``sequence``
    (`mis_keep`, band ``[cfg.mis_low, cfg.mis_high]``). ``entropy`` is per token
    (`entropy_from_logits`).

    Metrics: ``loss``, ``pg_loss``, ``pg_clipfrac``, ``ppo_kl``, and when computed ``kl``
    (``ref_logp`` given), ``entropy`` (``entropy`` given), ``tis_mean`` (``cfg.tis``),
    ``mis_masked_frac`` (``cfg.mis``: the share of loss tokens masked out) and
    ``train_rollout_logprob_abs_diff`` (``rollout_logp`` given).

    Raises:
        ValueError: unknown mode/type names, or a configured term without its input
            (``kl_coef > 0`` without ``ref_logp``, ``tis`` without ``rollout_logp``,
            ``entropy_coef > 0`` without ``entropy``): a silently dropped term would
            train a different objective than the config says.
    """
    if cfg.policy_loss not in POLICY_LOSSES:
        raise ValueError(f"unknown policy_loss {cfg.policy_loss!r}; valid: {', '.join(POLICY_LOSSES)}")
    if cfg.kl_coef > 0 and ref_logp is None:
        raise ValueError("kl_coef > 0 needs ref_logp")
    mis = getattr(cfg, "mis", "none")
    if (cfg.tis or mis != "none") and rollout_logp is None:
        raise ValueError(f"{'tis' if cfg.tis else 'mis'} needs rollout_logp")
    if cfg.entropy_coef != 0 and entropy is None:
        raise ValueError("entropy_coef != 0 needs the per-token entropy")
    valid, _ = _mask(loss_mask, logp)

    def clean(t: Tensor) -> Tensor:  # garbage at masked-out tokens never reaches a gradient
        return torch.where(valid, t.to(logp.dtype), 0.0)

    logp, old_logp = clean(logp), clean(old_logp)
    agg = {"loss_mask": loss_mask, "cu_seqlens": cu_seqlens, "max_response_len": max_response_len,
           "normaliser": normaliser}
    metrics: dict[str, Tensor] = {}
    weights = None
    if rollout_logp is not None:
        rollout_logp = clean(rollout_logp)
        metrics["train_rollout_logprob_abs_diff"] = _masked_mean((old_logp - rollout_logp).abs(), loss_mask)
        if cfg.tis:
            weights = tis_weights(old_logp, rollout_logp, cfg.tis_cap)
            metrics["tis_mean"] = _masked_mean(weights, loss_mask)
        if mis != "none":
            keep = mis_keep(old_logp, rollout_logp, loss_mask, cu_seqlens, mis, cfg.mis_low, cfg.mis_high)
            metrics["mis_masked_frac"] = _masked_mean(1.0 - keep, loss_mask)
            weights = keep if weights is None else weights * keep
    pg_fn = ppo_clip_loss if cfg.policy_loss == "ppo" else gspo_loss
    loss, pg_metrics = pg_fn(logp, old_logp, advantages, loss_mask, cu_seqlens, cfg.eps_clip,
                             cfg.eps_clip_high, cfg.loss_agg_mode, token_weights=weights,
                             normaliser=normaliser, max_response_len=max_response_len)
    metrics.update(pg_metrics)
    if ref_logp is not None:
        kl = aggregate(kl_penalty(logp, clean(ref_logp).detach(), cfg.kl_type), mode=cfg.loss_agg_mode, **agg)
        metrics["kl"] = kl.detach()
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl
    if entropy is not None:
        ent = aggregate(clean(entropy), mode=cfg.loss_agg_mode, **agg)
        metrics["entropy"] = ent.detach()
        if cfg.entropy_coef != 0:
            loss = loss - cfg.entropy_coef * ent
    metrics["loss"] = loss.detach()
    return loss, metrics


def sft_loss(
    logp: Tensor, loss_mask: Tensor, cu_seqlens: Tensor, normaliser: Tensor | float | None = None
) -> Tensor:
    """Negative log-likelihood of the masked (assistant) tokens, token_mean.

    ``normaliser``: the global number of masked tokens for gradient accumulation / DP.
    """
    return -aggregate(logp, loss_mask, cu_seqlens, "token_mean", normaliser=normaliser)

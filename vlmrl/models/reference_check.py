"""The comparison behind the trainer's startup checks of fast kernels against their reference
maths (`gated_delta.check_fast_path`, `attention.check_attention_backend`)."""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor


def worst_relative(pairs: Iterable[tuple[str, Tensor, Tensor]], tol: float) -> tuple[float, tuple[str, float] | None]:
    """For each (name, got, want): the largest |got - want| relative to want's largest magnitude.
    Returns the worst of them up to the first beyond `tol` (NaN counts as beyond), and that
    one as (name, relative difference), or None where all are within."""
    worst = 0.0
    for name, got, want in pairs:
        rel = float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
        if not rel <= tol:
            return rel, (name, rel)
        worst = max(worst, rel)
    return worst, None

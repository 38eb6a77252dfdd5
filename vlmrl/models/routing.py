"""The rollout engine's expert choices inside the trainer: routing replay and its mismatch metric.

An MoE policy trained on its own samples sees two routers: the engine's, which chose each
token's experts while sampling, and the trainer's, which recomputes them. Where the two pick
different experts (bf16 near-ties, kernels that sum in another order, weights a sync behind),
the trainer's logprobs belong to another network than the one that sampled, and that gap is
off-policy noise in every step. The engines report each token's experts (SGLang's
`return_routed_experts`, the embedded engine likewise; `vlmrl.rollout.protocol`), the loop
packs them with the samples (`PackedSequence.routed_experts`, [T, layers, top-k], -1 where the
engine has none: the last token of a sample, padding), and `EngineRoutedRouter`, Megatron's
TopKRouter given to every MoE layer, then

- measures, per layer, the fraction of tokens whose top-k set differs from the engine's
  (reported to the step observer: `moe/route_mismatch/layer_<n>`), and
- with replay on (`algo.routing_replay=rollout`), routes each token to the engine's experts
  through megatron-core's `RouterReplay`: the weights of the chosen experts still come from
  the trainer's own logits (softmax over the chosen ones), so the router keeps its gradient.
  Tokens the engine did not route keep the trainer's own choice.

The compiled MoE block (`vlmrl.models.moe.moe_forward`, `hardware.fused_kernels`) does both
itself, inside its graph, from the same rows (`LocalMoELayer.block_args`).

Rows are this model chunk's tokens in packed order (a context-parallel rank's zigzag share);
under sequence parallelism each tensor-parallel rank routes a contiguous slice of them, which
the router cuts itself. Expert ids are global, so expert parallelism needs nothing more. A
layer takes column `layer_number - 1` (the engines report every decoder layer).

`trainer.moe_router_precision=engine` computes the router's logits in the model's dtype, as
transformers and SGLang do, instead of float32 (`families.qwen3_5.megatron_kwargs`).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction
from torch import Tensor


def topk_sets_differ(a: Tensor, b: Tensor) -> Tensor:
    """[N] bool: whether rows of two [N, k] expert-id tensors hold different sets."""
    return (a.sort(dim=-1).values != b.to(a.dtype).sort(dim=-1).values).any(dim=-1)


class EngineRoutedRouter(TopKRouter):
    """Megatron's TopKRouter told the engine's experts for the tokens of the current forward
    (module docstring). `replay` (class default False, set per model by `configure`) routes
    by them; `engine_rows` holds the chunk's [T, layers, k] rows between forwards, so an
    activation recompute in the backward routes as the forward did."""

    replay = False

    def __init__(self, config: Any, pg_collection: Any = None) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        self.engine_rows: Tensor | None = None

    def _rows(self, num_tokens: int) -> Tensor | None:
        """This layer's engine experts [num_tokens, k] for the tokens being routed, or None."""
        rows = self.engine_rows
        if rows is None:
            return None
        layer = int(self.layer_number or 0) - 1
        if not 0 <= layer < rows.shape[1]:
            raise ValueError(f"the engine reported experts for {rows.shape[1]} layers; this router is "
                             f"layer {layer + 1}")
        if rows.shape[2] != self.topk:
            raise ValueError(f"the engine reported {rows.shape[2]} experts a token; the model routes to {self.topk}")
        col = rows[:, layer]
        if col.shape[0] != num_tokens:
            tp = self.tp_group.size() if self.tp_group is not None else 1
            if col.shape[0] != num_tokens * tp:
                raise ValueError(f"engine experts for {col.shape[0]} tokens; this router routes {num_tokens} "
                                 f"(tensor parallel {tp})")
            rank = self.tp_group.rank()
            col = col[rank * num_tokens:(rank + 1) * num_tokens]
        return col.to(device=self.weight.device, dtype=torch.long)

    def routing(self, logits: Tensor, padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        flat = logits.reshape(-1, self.config.num_moe_experts)
        rows = self._rows(flat.shape[0])
        if rows is None:
            return super().routing(logits, padding_mask=padding_mask)
        known = rows[:, 0] >= 0
        with torch.no_grad():
            own = torch.topk(flat, self.topk, dim=1).indices
            differ = topk_sets_differ(own, rows) & known
        self._report(differ, known)
        if not self.replay:
            return super().routing(logits, padding_mask=padding_mask)
        replay = self.router_replay
        if replay is None:
            raise RuntimeError("routing replay needs the model built with moe_enable_routing_replay")
        replay.set_target_indices(torch.where(known.unsqueeze(1), rows, own))
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        try:
            return super().routing(logits, padding_mask=padding_mask)
        finally:
            replay.clear_indices()
            replay.clear_router_replay_action()

    def _report(self, differ: Tensor, known: Tensor) -> None:
        sink = getattr(self, "vlmrl_mismatch_sink", None)
        if sink is not None:
            sink(self, differ.sum(), known.sum())


def megatron_overrides(model: Any, *, precision: str, replay: bool) -> dict[str, Any]:
    """TransformerConfig fields of a MoE model's router under `trainer.moe_router_precision`
    (fp32: Megatron's float32 logits; engine: the model's dtype, as the engines compute them)
    and routing replay (Megatron's `RouterReplay` on every router). Nothing for a dense model."""
    if precision not in ("fp32", "engine"):
        raise ValueError(f"trainer.moe_router_precision={precision!r}: fp32 | engine")
    if not model.lm.num_experts:
        return {}
    out: dict[str, Any] = {"moe_enable_routing_replay": bool(replay)}
    if precision == "engine":
        out["moe_router_dtype"] = None
    return out


def routers(module: torch.nn.Module) -> list[EngineRoutedRouter]:
    return [m for m in module.modules() if isinstance(m, EngineRoutedRouter)]


def configure(module: torch.nn.Module, *, replay: bool) -> int:
    """Set routing replay on (or off) for every engine-routed router of `module`; returns
    how many routers it set."""
    found = routers(module)
    for r in found:
        r.replay = bool(replay)
    return len(found)


def set_engine_rows(module: torch.nn.Module, rows: Tensor | None) -> None:
    """Hand the engine's experts of the coming forward's tokens ([T, layers, k], -1 where
    unknown; None: none) to every engine-routed router of `module`."""
    for r in routers(module):
        r.engine_rows = rows


def has_engine_rows(module: torch.nn.Module) -> bool:
    return any(r.engine_rows is not None for r in routers(module))

"""What a hybrid MoE model's user watches during a step, recorded by forward hooks.

`StepObserver` attaches to a rank's model chunks and records, during training forwards:

- MoE routing: for every MoE layer, the tokens each expert received (the router's routing
  map, after any token dropping) and the tokens routed. Reduced over all ranks of a pipeline
  stage, this gives per layer the load imbalance (largest expert load / mean load: 1 is
  perfectly even, E / top-k is everything on the top-k experts) and the fraction of routed
  token slots dropped by a capacity limit (0 without `moe_expert_capacity_factor`).
- Routing against the rollout engine's: where a batch carries the engine's experts
  (`vlmrl.models.routing`), the fraction of tokens each MoE layer routes to another top-k
  set than the engine did (before any replay).
- Forward time per mixer kind: Gated DeltaNet layers, attention layers and MoE blocks
  (wall time on CPUs, CUDA events on GPUs, read once at the end of the step). Backward is
  not split (autograd runs the layers' backward interleaved); with recompute the forward
  counts twice.

`collect()` is collective over all trainer ranks and returns the same flat metrics
everywhere: `moe/imbalance/layer_<n>` (1-based global layer number), `moe/imbalance_max`,
`moe/imbalance_mean`, `moe/dropped_frac`, `moe/route_mismatch/layer_<n>`,
`moe/route_mismatch_mean`, `moe/route_mismatch_max`, `perf/fwd_<kind>_s`.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch


class StepObserver:
    def __init__(self, chunks: list[Any]) -> None:
        from megatron.core.transformer.attention import SelfAttention
        from megatron.core.transformer.moe.moe_layer import MoELayer
        from megatron.core.transformer.moe.router import TopKRouter

        from ..models.fused_layer import FusedTransformerLayer
        from ..models.gdn import GatedDeltaNet

        self._counts: dict[int, torch.Tensor] = {}  # layer -> tokens per expert
        self._routed: dict[int, int] = defaultdict(int)  # layer -> token slots routed (tokens * top-k)
        self._mismatch: dict[int, torch.Tensor] = {}  # layer -> [tokens routed unlike the engine, tokens compared]
        self._events: dict[str, list[Any]] = defaultdict(list)
        self._handles = []
        self._sinks: list[Any] = []
        kinds = {GatedDeltaNet: "gdn", SelfAttention: "attention", MoELayer: "moe"}
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    self._handles.append(module.register_forward_hook(self._routing_hook))
                    # the compiled MoE block (vlmrl.models.moe.LocalMoELayer) routes without
                    # calling the router module and reports its counts here instead
                    module.vlmrl_routing_sink = self._record_routing
                    module.vlmrl_mismatch_sink = self._record_mismatch
                    self._sinks.append(module)
                if isinstance(module, FusedTransformerLayer) and module.fast_path:
                    # the compiled layer runs its mixer without calling the mixer module and
                    # reports the mixer's span here instead
                    module.vlmrl_span_sink = self._record_span
                    self._sinks.append(module)
                for cls, kind in kinds.items():
                    if isinstance(module, cls):
                        self._handles.append(module.register_forward_pre_hook(self._start(kind)))
                        self._handles.append(module.register_forward_hook(self._stop(kind)))

    @property
    def active(self) -> bool:
        return bool(self._handles)

    # ------------------------------------------------------------------ hooks
    def _routing_hook(self, module: Any, args: Any, output: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        routing_map = output[1]
        self._record_routing(module, routing_map.sum(0), int(routing_map.shape[0]))

    def _record_routing(self, router: Any, counts: torch.Tensor, tokens: int) -> None:
        """Tokens each expert of `router`'s layer received in one forward (device tensor [E])."""
        if not (router.training and torch.is_grad_enabled()):
            return
        layer = int(getattr(router, "layer_number", 0) or 0)
        counts = counts.detach().to(torch.float64)
        prev = self._counts.get(layer)
        self._counts[layer] = counts if prev is None else prev + counts
        self._routed[layer] += tokens * int(router.topk)

    def _record_mismatch(self, router: Any, differ: torch.Tensor, known: torch.Tensor) -> None:
        """Tokens of `router`'s layer whose top-k set differs from the engine's, of `known`
        tokens the engine reported (device scalars)."""
        if not (router.training and torch.is_grad_enabled()):
            return
        layer = int(getattr(router, "layer_number", 0) or 0)
        pair = torch.stack((differ.detach(), known.detach())).to(torch.float64)
        prev = self._mismatch.get(layer)
        self._mismatch[layer] = pair if prev is None else prev + pair

    def _record_span(self, module: Any, kind: str, edge: str) -> None:
        """One edge ("start" / "stop") of a `kind` forward: from the module hooks, or from a
        compiled layer (`FusedTransformerLayer`) that runs its mixer without calling it."""
        if not (module.training and torch.is_grad_enabled()):
            return
        marks = self._events[kind]
        if edge == "start":
            marks.append(["start", _mark()])
        elif marks and marks[-1][0] == "start":
            marks[-1][0] = "done"
            marks[-1].append(_mark())

    def _start(self, kind: str) -> Any:
        return lambda module, args: self._record_span(module, kind, "start")

    def _stop(self, kind: str) -> Any:
        return lambda module, args, output: self._record_span(module, kind, "stop")

    # ------------------------------------------------------------------ results
    def collect(self) -> dict[str, float]:
        """Reduce this step's records over the trainer ranks (collective) and reset them."""
        import torch.distributed as dist
        from megatron.core import parallel_state as mps

        local: dict[str, Any] = {"layers": {}, "time": {}, "mismatch": {}}
        for layer, counts in self._counts.items():
            local["layers"][layer] = (counts.cpu(), self._routed[layer])
        for layer, pair in self._mismatch.items():
            local["mismatch"][layer] = pair.cpu()
        self._mismatch.clear()
        for kind, marks in self._events.items():
            local["time"][kind] = sum(_elapsed(m[1], m[2]) for m in marks if m[0] == "done")
        self._counts.clear()
        self._routed.clear()
        self._events.clear()
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, local)
        # one pipeline's ranks of data replica 0 measure the times; every rank of a stage
        # routes its own tokens, so the counts add up over all ranks
        counts: dict[int, torch.Tensor] = {}
        routed: dict[int, int] = defaultdict(int)
        for rec in every:
            for layer, (c, n) in rec["layers"].items():
                counts[layer] = c if layer not in counts else counts[layer] + c
                routed[layer] += n
        out: dict[str, float] = {}
        imbalances = []
        dropped = kept = 0.0
        for layer in sorted(counts):
            c = counts[layer]
            mean = float(c.mean())
            if mean > 0:
                imbalance = float(c.max()) / mean
                out[f"moe/imbalance/layer_{layer}"] = imbalance
                imbalances.append(imbalance)
            kept += float(c.sum())
            dropped += routed[layer] - float(c.sum())
        mismatch: dict[int, torch.Tensor] = {}
        for rec in every:
            for layer, pair in rec["mismatch"].items():
                mismatch[layer] = pair if layer not in mismatch else mismatch[layer] + pair
        fractions = []
        for layer in sorted(mismatch):
            differ, known = mismatch[layer].tolist()
            if known > 0:
                out[f"moe/route_mismatch/layer_{layer}"] = differ / known
                fractions.append(differ / known)
        if fractions:
            out["moe/route_mismatch_mean"] = sum(fractions) / len(fractions)
            out["moe/route_mismatch_max"] = max(fractions)
        if imbalances:
            out["moe/imbalance_max"] = max(imbalances)
            out["moe/imbalance_mean"] = sum(imbalances) / len(imbalances)
            out["moe/dropped_frac"] = dropped / max(dropped + kept, 1.0)
        pp = mps.get_pipeline_model_parallel_world_size()
        stage_of = [r // max(dist.get_world_size() // pp, 1) for r in range(dist.get_world_size())]
        first_of_stage = {s: stage_of.index(s) for s in set(stage_of)}
        for kind in ("gdn", "attention", "moe"):
            total = sum(every[r]["time"].get(kind, 0.0) for r in first_of_stage.values())
            if any(kind in every[r]["time"] for r in first_of_stage.values()):
                out[f"perf/fwd_{kind}_s"] = total
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for module in self._sinks:
            for name in ("vlmrl_routing_sink", "vlmrl_mismatch_sink", "vlmrl_span_sink"):
                if name in module.__dict__:
                    delattr(module, name)
        self._sinks.clear()


def _mark() -> Any:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        from ..models import compat

        if compat.cuda_available():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
    return time.perf_counter()


def _elapsed(a: Any, b: Any) -> float:
    if isinstance(a, float):
        return b - a
    b.synchronize()
    return a.elapsed_time(b) / 1e3

"""Routed experts of the Qwen3.5-MoE layers, held in HF's fused shapes, for Megatron's MoELayer.

The MoE block itself is megatron-core's `MoELayer`: its top-k router (softmax over the
top-k logits = HF's softmax-then-renormalise, in float32), its all-to-all token dispatcher
(expert parallelism) and its `SharedExpertMLP` with the sigmoid gate. Megatron's only
experts module without TransformerEngine or the grouped_gemm package is a Python loop of
per-expert MLPs; `HFExperts` replaces it with two parameters shaped like HF's:

    gate_up_proj [E_local, 2 * I, H]   rows [gate; up] of each expert (SwiGLU)
    down_proj    [E_local, H, I]

so the conversion from a checkpoint is a stack of per-expert tensors and the compute is one
grouped GEMM per projection on GPUs (`torch._grouped_mm`, bf16 on Hopper and newer) or a
loop over the experts that received tokens elsewhere. Expert parallelism shards axis 0
(this rank holds experts [ep_rank * E_local, (ep_rank + 1) * E_local)); expert tensor
parallelism is not supported (validation asks for parallel.etp=1).

The router's output weight of each token scales its SwiGLU activation, before the down
projection, as Megatron's own grouped experts apply their probabilities. HF scales the down
projection's output instead; the projection is linear without a bias, so the maths is the
same, with one bf16 rounding fewer here, and the weights' gradient is a sum over the expert
width (512 in Qwen3.5-35B-A3B) instead of the hidden width (2048).

Where every expert of a MoE layer lives on this rank (expert parallel size 1, expert tensor
parallel size 1, any TP/SP/CP/DP around it), `use_local_dispatch` gives Megatron's MoELayer
one change: its tokens are dispatched by `LocalTokenDispatcher`, a stable sort by expert on the device whose
split sizes stay on the device too. Megatron's all-to-all dispatcher copies them to the host
in every MoE layer, forward and backward, which stalls the host until the GPU has caught up
and leaves the step bound by kernel launches. With expert parallelism Megatron's dispatcher
is kept.

With `hardware.fused_kernels=true` such a layer (`LocalMoELayer`, Megatron's MoELayer with
one more forward) runs router, dispatch, grouped experts, combine and the gated shared
expert as ONE Inductor-compiled graph, `moe_forward`, forward and backward, instead of about
forty eager kernels and their Python: on one GPU the MoE blocks are otherwise bound by the
host's kernel launches. The graph takes the weights as arguments, so all MoE layers share it.
On `FusedTransformerLayer`'s fast path the same function runs inside the layer's output
graph instead (`block_args`, `report_routing`), and the module itself is not called.
It is used where its maths is Megatron's configuration exactly (`compiled_path_problem`
names what rules it out: top-k softmax routing in float32 or the model's dtype without auxiliary losses, expert
bias, grouping or capacity; bf16 activations on Hopper or newer, or on the CPU in tests);
everything else goes through Megatron's forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from .kernels import fused


def _can_group(x: Tensor, w: Tensor) -> bool:
    return (x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
            and hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(x.device)[0] >= 9)


def expert_mlp(x: Tensor, tokens_per_expert: list[int] | Tensor, gate_up: Tensor, down: Tensor,
               probs: Tensor | None = None, *, grouped: bool | None = None) -> Tensor:
    """SwiGLU experts on tokens sorted by expert: x [N, H] (the first tokens_per_expert[0]
    rows go to expert 0, ...) -> [N, H], each row scaled by its router weight `probs` [N]
    (applied to the SwiGLU activation, before the down projection: module docstring).

    grouped: torch's grouped GEMM (one kernel per projection for all experts); None picks it
    where it runs (CUDA, bf16, Hopper or newer), else a loop over the experts with tokens.
    """
    if grouped is None:
        grouped = _can_group(x, gate_up)
    if grouped:
        counts = torch.as_tensor(tokens_per_expert, device=x.device)
        offs = counts.cumsum(0).to(torch.int32)
        h = torch._grouped_mm(x, gate_up.transpose(1, 2), offs=offs)
        return torch._grouped_mm(_weighted_swiglu(h, probs), down.transpose(1, 2), offs=offs)
    else:
        counts = tokens_per_expert.tolist() if isinstance(tokens_per_expert, Tensor) else list(tokens_per_expert)
        parts = []
        start = 0
        # unbind, not gate_up[e]: the backward of one unbind stacks the experts' gradients
        # once, where each indexing's backward would write a zero-filled [E, ...] tensor
        gate_ups, downs = gate_up.unbind(0), down.unbind(0)
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = x[start:start + n]
            act = _weighted_swiglu(F.linear(rows, gate_ups[e]), None if probs is None else probs[start:start + n])
            parts.append(F.linear(act, downs[e]))
            start += n
        out = torch.cat(parts) if parts else x.new_zeros(0, down.shape[1])
        if start != x.shape[0]:
            raise ValueError(f"tokens_per_expert sums to {start}, the input has {x.shape[0]} rows")
    return out


def _weighted_swiglu(h: Tensor, probs: Tensor | None) -> Tensor:
    """silu(gate) * up of the fused [gate; up] rows h [N, 2I], each row scaled by its router
    weight probs [N] (float32) where given, in h's dtype: the down projection's input."""
    g, u = h.chunk(2, dim=-1)
    act = F.silu(g) * u
    if probs is None:
        return act
    return (act * probs.unsqueeze(-1)).to(h.dtype)


class HFExperts(MegatronModule):
    """The `experts` submodule of Megatron's MoELayer (see the module docstring)."""

    def __init__(self, num_local_experts: int, config: TransformerConfig, pg_collection: Any = None,
                 submodules: Any = None, **_: Any) -> None:
        super().__init__(config=config)
        if config.expert_tensor_parallel_size != 1:
            raise ValueError("HF-shaped experts support expert_tensor_parallel_size=1 (parallel.etp=1)")
        self.num_local_experts = num_local_experts
        self.ep_group = getattr(pg_collection, "ep", None)
        self.expt_dp_group = getattr(pg_collection, "expt_dp", None)
        h, ffn = config.hidden_size, config.moe_ffn_hidden_size
        std = config.init_method_std
        self.gate_up_proj = torch.nn.Parameter(torch.randn(num_local_experts, 2 * ffn, h, dtype=config.params_dtype) * std)
        self.down_proj = torch.nn.Parameter(torch.randn(num_local_experts, h, ffn, dtype=config.params_dtype) * std)
        from megatron.core import tensor_parallel

        for p in (self.gate_up_proj, self.down_proj):
            # expert parameters: gradients reduced over the expert-data-parallel group, which
            # also spans the TP ranks when experts are not TP-sharded (etp=1)
            p.allreduce = False  # type: ignore[attr-defined]
            # never a "TP duplicate": the grad norm counts each rank's experts (it is reduced
            # over the expert-parallel ranks); Megatron's own expert linears are marked alike
            tensor_parallel.set_tensor_model_parallel_attributes(p, is_parallel=True, dim=0, stride=1)

    def forward(self, permuted_local_hidden_states: Tensor, tokens_per_expert: Tensor,
                permuted_probs: Tensor) -> tuple[Tensor, None]:
        out = expert_mlp(permuted_local_hidden_states, tokens_per_expert, self.gate_up_proj, self.down_proj,
                         permuted_probs)
        return out, None

    def backward_dw(self) -> None:  # Megatron's delayed weight-gradient hook: nothing delayed here
        pass

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """Local experts as the slice [ep_rank * E_local, ...) of global [E, ...] tensors."""
        from megatron.core import parallel_state as mps

        ep_rank = self.ep_group.rank() if self.ep_group is not None else mps.get_expert_model_parallel_rank()
        ep_size = self.ep_group.size() if self.ep_group is not None else mps.get_expert_model_parallel_world_size()
        dp_rank = (self.expt_dp_group.rank() if self.expt_dp_group is not None
                   else mps.get_expert_data_parallel_rank())
        prepend = len(sharded_offsets)
        out = {}
        for name in ("gate_up_proj", "down_proj"):
            tensor = getattr(self, name)
            out[f"{prefix}{name}"] = ShardedTensor.from_rank_offsets(
                f"{prefix}{name}", tensor, *sharded_offsets, (prepend, ep_rank, ep_size),
                replica_id=(0, 0, dp_rank), prepend_axis_num=prepend)
        return out


def _mm_f32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b with a float32 result: on CUDA one bf16 GEMM accumulating in float32
    (`torch.mm(..., out_dtype=)`), elsewhere a float32 GEMM of the upcast inputs."""
    if a.is_cuda and a.dtype == torch.bfloat16:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def _bf16_pair(g: Tensor) -> Tensor:
    """A float32 tensor as two bf16 terms [hi, lo] stacked on a new first axis, hi + lo = g to
    about 2^-16 of each entry (bf16 keeps 8 significant bits, each term one byte of g's 24)."""
    hi = g.to(torch.bfloat16)
    return torch.stack((hi, (g - hi.float()).to(torch.bfloat16)))


class _RouterLogits(torch.autograd.Function):
    """x [N, H] @ w [E, H]^T in float32 from bf16 x and w, on tensor cores.

    Megatron's router (`moe_router_dtype=fp32`) upcasts both to float32 first, and float32
    GEMMs run on the SIMT cores: 0.8 ms a step in the Qwen3.5-MoE bench's eight layers on an
    H200, a tenth of the grouped experts' time. The forward here is the same sum: products of
    bf16 numbers are exact in float32, so a bf16 GEMM accumulating in float32 computes what
    the float32 GEMM does, up to the order of the additions. The backward's incoming gradient
    is float32; it enters each GEMM as two bf16 terms (`_bf16_pair`), one GEMM with the terms
    side by side along the summed axis for x's gradient and one with them stacked for w's,
    exact to about 2^-16 of each entry. Both gradients are then rounded to bf16 (the dtype of x
    and w), which keeps 2^-8."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return _mm_f32(x, w.t())

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        x, w = ctx.saved_tensors
        pair = _bf16_pair(grad.float())  # [2, N, E]
        num_experts = w.shape[0]
        dx = _mm_f32(torch.cat((pair[0], pair[1]), dim=1), torch.cat((w, w)))  # [N, 2E] @ [2E, H]
        dw = _mm_f32(pair.transpose(1, 2).reshape(2 * num_experts, -1), x)  # [2E, N] @ [N, H]
        return dx.to(x.dtype), (dw[:num_experts] + dw[num_experts:]).to(w.dtype)


def router_logits(x: Tensor, w: Tensor) -> Tensor:
    """The router's float32 logits x [N, H] @ w [E, H]^T: `_RouterLogits` for bf16 x and w,
    else a float32 GEMM of the upcast inputs (Megatron's `moe_router_dtype=fp32`)."""
    if x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16:
        return _RouterLogits.apply(x, w)
    return F.linear(x.float(), w.float())


def _spread(x: Tensor, index: Tensor, repeat: int) -> Tensor:
    """rows[p] = x[index[p] // repeat]: each token's row once per chosen expert, by expert."""
    return x.index_select(0, index.div(repeat, rounding_mode="floor") if repeat > 1 else index)


def _gather_sum(x: Tensor, index: Tensor, repeat: int) -> Tensor:
    """out[t] = sum over j < repeat of x[index[t * repeat + j]], summed in float32 and cast
    back once: the `repeat` expert rows of each token put back in token order and added.

    Inside a compiled graph the sum is written out as `repeat` gathers added together, which
    Inductor makes one elementwise kernel reading whole rows; written as a gather and a sum
    over the `repeat` axis, it becomes a reduction kernel whose scattered reads ran at about
    0.6 TB/s on an H200 (0.2 ms per MoE layer and direction at 4096 tokens, top-8)."""
    if repeat == 1:
        return x.index_select(0, index)
    if torch.compiler.is_compiling():
        pairs = index.view(-1, repeat)
        acc = x.index_select(0, pairs[:, 0]).float()
        for j in range(1, repeat):
            acc = acc + x.index_select(0, pairs[:, j]).float()
        return acc.to(x.dtype)
    return x.index_select(0, index).view(-1, repeat, *x.shape[1:]).sum(1)


class _Regroup(torch.autograd.Function):
    """Expert rows regrouped by a permutation `index` of [N * repeat] with its inverse:
    `_spread` (each token's row once per chosen expert, by expert) or `_gather_sum` (each
    token's expert rows back in token order, added), each the other's backward.

    Both directions gather: no backward scatters. torch's index_select backward is an
    index_add into zeros, which with repeated rows (every token once per chosen expert) is
    bf16 atomics on colliding addresses: 0.58 ms per MoE layer at 4096 tokens on an H200, a
    tenth of the MoE step.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, index: Tensor, inverse: Tensor, repeat: int, spread: bool) -> Tensor:
        ctx.save_for_backward(inverse)
        ctx.repeat, ctx.spread = repeat, spread
        return (_spread if spread else _gather_sum)(x, index, repeat)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        (inverse,) = ctx.saved_tensors
        return (_gather_sum if ctx.spread else _spread)(grad, inverse, ctx.repeat), None, None, None, None


def spread_rows(x: Tensor, order: Tensor, inverse: Tensor, repeat: int) -> Tensor:
    """rows[p] = x[order[p] // repeat], differentiable (`_Regroup`)."""
    return _Regroup.apply(x, order, inverse, repeat, True)


def sum_rows(y: Tensor, inverse: Tensor, order: Tensor, repeat: int) -> Tensor:
    """out[t] = sum over j < repeat of y[inverse[t * repeat + j]], differentiable (`_Regroup`)."""
    return _Regroup.apply(y, inverse, order, repeat, False)


def _sort_key_dtype(num_experts: int) -> torch.dtype:
    """The narrowest integer dtype holding expert ids below `num_experts`: the radix sort makes
    one pass per byte of key (eight over int64 ids: 0.44 ms a step in the Qwen3.5-MoE bench's
    8 layers on an H200, 2026-12-02)."""
    if num_experts <= 256:
        return torch.uint8
    return torch.int16 if num_experts <= 2**15 else torch.int32


def _expert_order(flat: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """The stable sort of [N * k] expert ids below `num_experts` (tokens stay in order within
    an expert, as in Megatron's permutation) and its inverse permutation, both on the device."""
    order = torch.argsort(flat.to(_sort_key_dtype(num_experts)), stable=True)
    inverse = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=flat.device))
    return order, inverse


class LocalTokenDispatcher:
    """Token dispatcher of a MoE layer whose experts are all local (see the module docstring).

    dispatch: the k experts of each token (read from the router's routing map), a stable
    argsort of the [N * k] expert ids (tokens stay in order within an expert, as in
    Megatron's permutation), the rows gathered in that order with their router weights, and
    the per-expert counts as a device tensor (column sums of the routing map). combine: the expert outputs
    (already scaled by their weights) put back in token order and summed over the k choices.
    Both directions gather (`_Regroup`): no backward scatters with atomics.
    Every shape is fixed by N and k, so nothing waits for the GPU.
    """

    def __init__(self, num_local_experts: int, config: TransformerConfig) -> None:
        self.config = config
        self.num_experts = num_local_experts
        self.topk = config.moe_router_topk
        self.shared_experts = None

    def set_shared_experts(self, shared_experts: Any) -> None:
        self.shared_experts = shared_experts

    def dispatch_preprocess(self, hidden_states: Tensor, routing_map: Tensor, probs: Tensor) -> tuple[Tensor, Tensor]:
        self.hidden_shape = hidden_states.shape
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        k = self.topk
        experts = routing_map.to(torch.uint8).topk(k, dim=1).indices  # [N, k], the k routed experts
        weights = probs.gather(1, experts)
        self.order, self.inverse = _expert_order(experts.reshape(-1), routing_map.shape[1])
        # counts from the routing map: torch.bincount would read the largest id back to the host
        self.tokens_per_expert = routing_map.sum(0)
        return (spread_rows(x, self.order, self.inverse, k),
                spread_rows(weights.reshape(-1), self.order, self.inverse, 1))

    def token_dispatch(self, hidden_states: Tensor, probs: Tensor) -> tuple[Tensor, Tensor]:
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states: Tensor, probs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return hidden_states, self.tokens_per_expert, probs

    def combine_preprocess(self, hidden_states: Tensor) -> Tensor:
        return hidden_states

    def token_combine(self, hidden_states: Tensor) -> Tensor:
        return hidden_states

    def combine_postprocess(self, expert_output: Tensor) -> Tensor:
        out = sum_rows(expert_output, self.inverse, self.order, self.topk)
        self.order = self.inverse = self.tokens_per_expert = None
        return out.view(self.hidden_shape)


def moe_forward(x: Tensor, router_w: Tensor, topk: int, gate_up: Tensor, down: Tensor,
                shared_fc1: Tensor | None, shared_fc2: Tensor | None, shared_gate: Tensor | None,
                round_logits: bool = False, engine: Tensor | None = None,
                replay: bool = False) -> tuple[Tensor, Tensor]:
    """The whole all-local MoE block on normed tokens x [N, H] -> (output [N, H], routing
    statistics [E + 2]: tokens per expert, then the tokens routed unlike the engine and the
    tokens the engine routed, both 0 without `engine`).

    Megatron's maths for this configuration (see `compiled_path_problem`): router logits in
    float32 (`router_logits`; with `round_logits`, rounded to x's dtype first, as Megatron's
    `moe_router_dtype=None`, transformers and SGLang compute them, and the weights rounded
    likewise), the top-k logits' softmax as the weights, tokens stably sorted
    by expert (token order within an expert), one grouped GEMM per projection, each row's
    SwiGLU activation scaled by its weight, rows put back in token order and summed over the k choices, plus the
    shared expert's SwiGLU scaled by the sigmoid of its gate. Shapes depend on N only: no host sync.

    `engine` [N, k] holds the rollout engine's experts of each token (-1: none reported;
    `vlmrl.models.routing`): the block counts where its own top-k set differs, and with
    `replay` routes the reported tokens to the engine's experts, weighted by the softmax of its
    own logits at them, as Megatron's RouterReplay does.
    """
    num_experts = gate_up.shape[0]
    logits = router_logits(x, router_w)
    if round_logits:
        logits = logits.to(x.dtype).float()
    top, experts = torch.topk(logits, topk, dim=1)
    mismatch = torch.zeros(2, dtype=torch.int32, device=x.device)
    if engine is not None:
        engine = engine.long()
        known = engine[:, 0] >= 0
        differ = (experts.sort(dim=-1).values != engine.sort(dim=-1).values).any(dim=-1) & known
        mismatch = torch.stack((differ.sum(), known.sum())).to(torch.int32)
        if replay:
            experts = torch.where(known.unsqueeze(1), engine, experts)
            top = logits.gather(1, experts)
    weights = torch.softmax(top, dim=-1, dtype=torch.float32)
    if round_logits:
        weights = weights.to(x.dtype).float()
    flat = experts.reshape(-1)
    order, inverse = _expert_order(flat, num_experts)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0).to(torch.int32)
    rows = spread_rows(x, order, inverse, topk)  # each token once per chosen expert, by expert
    h = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offs)
    act = _weighted_swiglu(h, spread_rows(weights.reshape(-1), order, inverse, 1))
    y = torch._grouped_mm(act, down.transpose(1, 2), offs=offs)
    out = sum_rows(y, inverse, order, topk)  # back in token order, summed over the k choices
    if shared_fc1 is not None:
        sg, su = F.linear(x, shared_fc1).chunk(2, dim=-1)
        shared = F.linear(F.silu(sg) * su, shared_fc2)
        if shared_gate is not None:
            shared = shared * torch.sigmoid(F.linear(x, shared_gate))
        out = out + shared
    return out, torch.cat((counts, mismatch))


class LocalMoELayer(MoELayer):
    """Megatron's MoELayer; with `compiled` set (`use_local_dispatch(..., compiled=True)`) a
    bf16 forward runs as the one compiled graph `moe_forward` (module docstring).

    The router's routing counts still reach `vlmrl_routing_sink` when an observer set one on
    the router (`vlmrl.training.observe`), as Megatron's path reports them by the router's
    forward hook."""

    compiled = False
    cuda_graphs = False  # the compiled block replayed as CUDA graphs (`kernels.use_cuda_graphs`)

    @property
    def graphs_eligible(self) -> bool:
        return self.compiled

    def forward(self, hidden_states: Tensor, intermediate_tensors: Any = None,
                padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        if not (intermediate_tensors is None and padding_mask is None and self.compiles(hidden_states)):
            return super().forward(hidden_states, intermediate_tensors, padding_mask)
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        out, stats = fused(moe_forward, self.cuda_graphs)(x, *self.block_args(x.shape[0]))
        self.report_routing(stats, x.shape[0])
        return out.view(hidden_states.shape), None

    def compiles(self, x: Tensor) -> bool:
        """Whether a forward on activations like `x` runs the compiled block."""
        return self.compiled and _groupable(x)

    def block_args(self, num_tokens: int) -> tuple[Any, ...]:
        """`moe_forward`'s arguments after the `num_tokens` tokens: the router, the experts and
        the shared expert's weights (None where the layer has no shared expert or no gate), the
        router's precision, and the engine's experts of those tokens with the replay switch
        (`vlmrl.models.routing.EngineRoutedRouter`)."""
        shared = self.shared_experts
        rows = self.router._rows(num_tokens) if hasattr(self.router, "_rows") else None
        return (self.router.weight, self.router.topk, self.experts.gate_up_proj, self.experts.down_proj,
                shared.linear_fc1.weight if shared is not None else None,
                shared.linear_fc2.weight if shared is not None else None,
                shared.gate_weight if shared is not None and shared.use_shared_expert_gate else None,
                self.config.moe_router_dtype is None, rows, bool(getattr(self.router, "replay", False)))

    def report_routing(self, stats: Tensor, tokens: int) -> None:
        """Hand the compiled block's tokens per expert, and where the engine's experts came with
        the tokens its disagreement with them, to the router's observer, if one is set."""
        counts, mismatch = stats[:-2], stats[-2:]
        sink = getattr(self.router, "vlmrl_routing_sink", None)
        if sink is not None:
            sink(self.router, counts, tokens)
        if getattr(self.router, "engine_rows", None) is not None:
            report = getattr(self.router, "_report", None)
            if report is not None:
                report(mismatch[0], mismatch[1])


def _groupable(x: Tensor) -> bool:
    """torch's grouped GEMM runs here: bf16 on Hopper or newer (or its CPU fallback)."""
    if x.dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return False
    return not x.is_cuda or torch.cuda.get_device_capability(x.device)[0] >= 9


def compiled_path_problem(module: MoELayer) -> str | None:
    """Why `moe_forward` would not compute what Megatron's forward computes for this layer
    (None: it does)."""
    c = module.config
    r = module.router
    checks = {
        "experts are not all local (expert parallel)": module.num_local_experts != c.num_moe_experts,
        "expert tensor parallel": (c.expert_tensor_parallel_size or 1) != 1,
        "tensor parallel": c.tensor_model_parallel_size != 1 or c.sequence_parallel,
        "experts are not HFExperts": not isinstance(module.experts, HFExperts),
        "router score function is not softmax after top-k": (c.moe_router_score_function != "softmax"
                                                             or c.moe_router_pre_softmax),
        "router dtype is neither fp32 nor the model's": c.moe_router_dtype not in ("fp32", None),
        "auxiliary / z losses": (c.moe_router_load_balancing_type not in ("none", None)
                                 or bool(c.moe_z_loss_coeff) or bool(c.moe_aux_loss_coeff)),
        "router input jitter": bool(c.moe_input_jitter_eps),
        "expert capacity": c.moe_expert_capacity_factor is not None or c.moe_pad_expert_input_to_capacity,
        "top-k scaling / expert bias / group-limited routing": (
            c.moe_router_topk_scaling_factor is not None or c.moe_router_enable_expert_bias
            or c.moe_router_num_groups is not None),
        "router bias": getattr(r, "bias", None) is not None,
        "selective recompute": c.recompute_granularity == "selective",
        "activation is not SwiGLU": not c.gated_linear_unit or c.activation_func is not F.silu or c.add_bias_linear,
        "shared expert overlap": bool(module.shared_expert_overlap),
    }
    return next((why for why, bad in checks.items() if bad), None)


def use_local_dispatch(model: torch.nn.Module, compiled: bool = False) -> int:
    """Give every MoE layer of `model` whose experts are all local the `LocalTokenDispatcher`
    and, with `compiled` (hardware.fused_kernels), the compiled block where `compiled_path_problem`
    finds nothing (see the module docstring); returns how many layers took the dispatcher."""
    n = 0
    for module in model.modules():
        if not isinstance(module, MoELayer):
            continue
        cfg = module.config
        local = module.num_local_experts == cfg.num_moe_experts and (cfg.expert_tensor_parallel_size or 1) == 1
        if local and not module.shared_expert_overlap:
            module.token_dispatcher = LocalTokenDispatcher(module.num_local_experts, cfg)
            n += 1
            if compiled and isinstance(module, LocalMoELayer) and compiled_path_problem(module) is None:
                module.compiled = True
    return n

"""Run a function in N local gloo processes (spawned; this one serves their rendezvous), collect results.

A thin test-side wrapper over `vlmrl.training.parallel_state.spawn_local` (the same helper
the parity CLI uses): `fn(rank, world_size, *args)` must live at module level in an
importable module (not a test file) and return something picklable; rank failures come
back as RuntimeError with the failing rank's traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def run_in_processes(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    from vlmrl.training.parallel_state import spawn_local

    return spawn_local(fn, world_size, *args, backend="gloo", timeout_s=timeout_s)


def parity_runs_worker(rank: int, world_size: int, runs: list[tuple]) -> list[Any]:
    """`vlmrl.parity.worker` once per argument tuple of `runs`, one after the other in the same
    processes (one process start and one import of Megatron for all of them)."""
    from vlmrl import parity

    return [parity.worker(rank, world_size, *args) for args in runs]


def gather_payloads_worker(rank: int, world_size: int, cases: list[tuple[list[list[int]], list[int]]]) -> Any:
    """For each case (sources, senders), in one process group: each sending rank serializes its
    own bucket (a tensor holding its rank) in the embedded server's host format; rank 0 collects
    them per engine. Per case, rank 0 returns the values per engine or the error it raised."""
    import torch

    from vlmrl.rollout.weights import decode_torch_payload, gather_rank_payloads, serialize_payload

    out: list[Any] = []
    for sources, senders in cases:
        mine = serialize_payload([("w", torch.full((2,), float(rank)))], "torch_save") if rank in senders else None
        try:  # rank 0 raises after the collective: the other ranks are not left waiting
            per_engine = gather_rank_payloads(mine, sources)
        except RuntimeError as e:
            out.append(f"RuntimeError: {e}")
            continue
        out.append(None if per_engine is None else
                   [[float(decode_torch_payload(p)[0][1][0]) for p in payloads] for payloads in per_engine])
    return out


def compiled_moe_worker(rank: int, world_size: int, tokens: int, device: str = "cpu") -> dict[str, Any]:
    """One MoE layer of the Qwen3.5-MoE miniature: Megatron's forward (with the local
    dispatcher) against `vlmrl.models.moe.moe_forward`, eager in float32 and compiled in bf16
    (the `hardware.fused_kernels` path). Returns the worst differences and the compiled
    path's routing counts against the router's."""
    import torch

    from vlmrl.config import load
    from vlmrl.config.schema import ParallelConfig
    from vlmrl.models.bridge import build_model
    from vlmrl.models.moe import LocalMoELayer, moe_forward
    from vlmrl.training.parallel_state import init_parallel_state

    # a gloo rank is a CPU rank (vlmrl.models.compat): on CUDA the process group is NCCL
    init_parallel_state(ParallelConfig(), backend="nccl" if device == "cuda" else "gloo", seed=0)
    model = load(["model=tiny_qwen3_5_moe"], check_rules=False).model
    chunk = build_model(model, ParallelConfig(), params_dtype=torch.float32, fused_kernels=True,
                        megatron_overrides={"moe_enable_routing_replay": True})[0]
    layer = next(m for m in chunk.modules() if isinstance(m, LocalMoELayer)).to(device).train()
    assert layer.compiled, "the miniature's MoE layers take the compiled path"
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the shared expert's gate and the router away from their init
        for p in layer.parameters():
            p.add_((torch.randn(p.shape, generator=gen) * 0.1).to(p.device))
    x0 = torch.randn(tokens, 1, layer.config.hidden_size, generator=gen).to(device)
    r = torch.randn(tokens, 1, layer.config.hidden_size, generator=gen).to(device)
    params = [p for p in layer.parameters() if p.requires_grad]

    def run(fn, dtype):
        layer.to(dtype)
        x = x0.to(dtype).requires_grad_()
        out = fn(x)
        grads = torch.autograd.grad((out.float() * r).sum(), [x, *params])
        return out.float(), [g.float() for g in grads]

    def megatron(x):
        layer.compiled = False
        try:
            return layer(x)[0]
        finally:
            layer.compiled = True

    def eager(x):
        s = layer.shared_experts
        out, _ = moe_forward(x.view(tokens, -1), layer.router.weight, layer.router.topk, layer.experts.gate_up_proj,
                             layer.experts.down_proj, s.linear_fc1.weight, s.linear_fc2.weight, s.gate_weight)
        return out.view_as(x)

    seen: dict[str, Any] = {}
    def router_hook(module: Any, args: Any, out: Any) -> None:
        seen["router"] = out[1].sum(0).tolist()
        seen["router_map"] = out[1].detach()

    layer.router.register_forward_hook(router_hook)
    layer.router.vlmrl_routing_sink = lambda router, counts, n: seen.__setitem__("sink", (counts.tolist(), n))

    def worst(a, b):
        oa, ga = a
        ob, gb = b
        scale = [max(float(t.detach().abs().max()), 1e-6) for t in (ob, *gb)]
        return max(float((u - v).detach().abs().max()) / s for u, v, s in zip((oa, *ga), (ob, *gb), scale))

    from vlmrl.models.moe import compiled_path_problem

    problems = {"none": compiled_path_problem(layer)}
    for key, value in (("moe_aux_loss_coeff", 0.01), ("moe_router_enable_expert_bias", True),
                       ("moe_router_pre_softmax", True), ("moe_expert_capacity_factor", 1.0)):
        old = getattr(layer.config, key)
        setattr(layer.config, key, value)
        problems[key] = compiled_path_problem(layer)
        setattr(layer.config, key, old)

    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32
    m32 = run(megatron, torch.float32)
    # torch's grouped GEMM takes float32 on the CPU only (bf16 on CUDA)
    e32 = run(eager, torch.float32) if device == "cpu" else None
    m16 = run(megatron, torch.bfloat16)
    c16 = run(lambda x: layer(x)[0], torch.bfloat16)
    # the router in the engines' precision (trainer.moe_router_precision=engine): logits rounded
    # to bf16 in both paths, so both route alike
    lm = model.lm
    layer.config.moe_router_dtype = None
    try:
        engine_problem = compiled_path_problem(layer)
        m16e = run(megatron, torch.bfloat16)
        megatron_counts = seen["router"]
        megatron_rows = seen["router_map"].float().topk(lm.moe_router_topk, dim=-1).indices
        c16e = run(lambda x: layer(x)[0], torch.bfloat16)
        engine_counts_match = float(seen["sink"][0] == megatron_counts)
        # the tokens the compiled block routes unlike Megatron's bf16 router: Megatron's experts
        # given as the engine's (measured, not replayed)
        tied: list[list[int]] = []
        layer.router.vlmrl_mismatch_sink = lambda router, d, k: tied.append([int(d), int(k)])
        layer.router.engine_rows = megatron_rows[:, None, :].expand(-1, lm.num_layers, -1).contiguous()
        with torch.no_grad():
            layer.to(torch.bfloat16)(x0.to(torch.bfloat16))
        layer.router.engine_rows = None
        del layer.router.vlmrl_mismatch_sink
        # tokens whose bf16 logits at the k-th and (k+1)-th place lie within one bf16 ulp: two
        # GEMMs (or top-k tie-breaks) may order those either way
        with torch.no_grad():
            logits = torch.nn.functional.linear(x0.view(tokens, -1).to(torch.bfloat16),
                                                layer.router.weight.to(torch.bfloat16)).float()
            top = logits.topk(lm.moe_router_topk + 1, dim=-1).values
            kth, next_ = top[:, -2], top[:, -1]
            ulp = torch.finfo(torch.bfloat16).eps * kth.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
            near_ties = int(((kth - next_) <= ulp).sum())
    finally:
        layer.config.moe_router_dtype = "fp32"
    # the engine's experts (random, a few tokens unreported): measured and replayed alike
    rows = torch.rand(tokens, lm.num_layers, lm.num_experts, generator=gen).argsort(-1)[..., :lm.moe_router_topk]
    rows[-3:] = -1
    reported: list[list[int]] = []
    layer.router.vlmrl_mismatch_sink = lambda router, d, k: reported.append([int(d), int(k)])
    layer.router.engine_rows, layer.router.replay = rows.to(device), True
    try:
        m16r = run(megatron, torch.bfloat16)
        c16r = run(lambda x: layer(x)[0], torch.bfloat16)
        replay_counts = [seen["router"], seen["sink"][0]]
    finally:
        layer.router.engine_rows, layer.router.replay = None, False
    return {"replay_compiled_vs_megatron": float((c16r[0] - m16r[0]).detach().abs().max()),
            "replay_vs_own_routing": float((m16r[0] - m16[0]).detach().abs().max()),
            "replay_mismatch_reported": reported, "replay_counts": replay_counts,
            "engine_precision_problem": engine_problem, "engine_precision_counts_match": engine_counts_match,
            "engine_precision_compiled_vs_megatron": float((c16e[0] - m16e[0]).detach().abs().max()),
            "engine_precision_tokens_differ": tied[0][0] / max(tied[0][1], 1),
            "engine_precision_near_ties": near_ties / tokens,
            "engine_precision_vs_fp32_router": float((m16e[0] - m16[0]).detach().abs().max()),
            "eager_fp32_vs_megatron": worst(e32, m32) if e32 is not None else None,
            "compiled_bf16_vs_megatron_fp32": worst(c16, m32),
            "megatron_bf16_vs_megatron_fp32": worst(m16, m32),
            "counts_match": float(seen["sink"][0] == seen["router"] and seen["sink"][1] == tokens),
            "problems": problems, "compiled_graphs": _compiled_graphs(),
            "compiled_vs_megatron_bf16_output": float((c16[0] - m16[0]).detach().abs().max())}


def _compiled_graphs() -> int:
    import torch._dynamo.utils

    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def fused_layer_worker(rank: int, world_size: int, lens: tuple[int, ...], device: str = "cpu",
                       bf16_gdn_backend: str = "torch", bf16: bool = True) -> dict[str, Any]:
    """Each decoder layer kind of the Qwen3.5-MoE miniature (Gated DeltaNet, gated attention)
    with `hardware.fused_kernels`: `FusedTransformerLayer`'s compiled fast path against
    Megatron's forward of the same layer on a packed micro-batch of samples `lens`, in float32
    and in bf16 (where the MoE block is compiled too). Returns per kind the worst differences,
    scaled per tensor by the float32 reference, and the spans reported to a span sink.
    `bf16_gdn_backend="fla"` (CUDA): the bf16 runs take fla's Gated DeltaNet kernels;
    `bf16=False`: float32 only."""
    import torch

    from vlmrl.config import load
    from vlmrl.config.schema import ParallelConfig
    from vlmrl.models.bridge import build_model
    from vlmrl.models.fused_layer import FusedTransformerLayer
    from vlmrl.models.moe import use_local_dispatch
    from vlmrl.training.batch import TrainSample, build_micro_batch
    from vlmrl.training.parallel_state import init_parallel_state

    init_parallel_state(ParallelConfig(), backend="nccl" if device == "cuda" else "gloo", seed=0)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = load(["model=tiny_qwen3_5_moe"], check_rules=False).model
    chunk = build_model(model, ParallelConfig(), params_dtype=torch.float32, fused_kernels=True)[0].to(device)
    use_local_dispatch(chunk, compiled=True)
    gen = torch.Generator().manual_seed(0)
    first_plain = max(model.image_token_id, getattr(model, "vision_start_token_id", 0) or 0) + 16  # text tokens only
    samples = [TrainSample(input_ids=torch.randint(first_plain, model.lm.vocab_size, (n,), generator=gen).tolist(),
                           loss_mask=[0.0] + [1.0] * (n - 1)) for n in lens]
    packed = build_micro_batch(samples, image_token_id=model.image_token_id, spatial_merge_size=2).packed
    total, hidden = sum(lens), model.lm.hidden_size
    x0 = torch.randn(total, 1, hidden, generator=gen).to(device)
    r = torch.randn(total, 1, hidden, generator=gen).to(device)
    layers = [m for m in chunk.modules() if isinstance(m, FusedTransformerLayer)]
    out: dict[str, Any] = {"fast_path": [layer.fast_path for layer in layers]}
    spans: list[tuple[str, str]] = []

    def run(layer: Any, fast: bool, dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
        chunk.to(dtype)
        if layer.mixer_kind == "gdn":
            layer.self_attention.backend = bf16_gdn_backend if dtype == torch.bfloat16 else "torch"
        params = [p for p in layer.parameters() if p.requires_grad]
        p_seq = chunk.packed_seq_params(packed, torch.device(device))
        x = x0.to(dtype).requires_grad_()
        layer.fast_path = fast
        layer.vlmrl_span_sink = lambda module, k, edge: spans.append((k, edge))
        try:
            y, _ = layer(hidden_states=x, attention_mask=None, packed_seq_params=p_seq)
        finally:
            layer.fast_path = True
            del layer.vlmrl_span_sink
        grads = torch.autograd.grad((y.float() * r).sum(), [x, *params])
        return y.detach().float(), [g.float() for g in grads]

    def worst(a: Any, b: Any) -> float:
        pairs = [(a[0], b[0]), *zip(a[1], b[1], strict=True)]
        return max(float((u - v).abs().max()) / max(float(v.abs().max()), 1e-6) for u, v in pairs)

    for kind in ("gdn", "attention"):
        layer = next(m for m in layers if m.mixer_kind == kind).train()
        with torch.no_grad():  # norm weights, dt_bias, shared-expert gate ... away from their init
            for p in layer.parameters():
                p.add_((torch.randn(p.shape, generator=gen) * 0.05).to(p.device, p.dtype))
        spans.clear()
        m32, f32 = run(layer, False, torch.float32), run(layer, True, torch.float32)
        out[kind] = {"fp32": worst(f32, m32), "spans": list(spans),
                     "moe_compiled": bool(getattr(layer.mlp, "compiled", False))}
        if bf16:
            spans.clear()
            m16, f16 = run(layer, False, torch.bfloat16), run(layer, True, torch.bfloat16)
            out[kind].update(bf16_fast=worst(f16, m32), bf16_megatron=worst(m16, m32), bf16_spans=list(spans))

    # the trainer's step observer on the whole chunk: mixer spans from the fast path, MoE spans
    # from the module hooks, one each per layer; closing it takes the sinks away again
    from vlmrl.training.observe import StepObserver

    chunk.to(torch.float32).train()
    observer = StepObserver([chunk])
    chunk(packed)[0].float().sum().backward()
    out["observed_spans"] = {k: sum(m[0] == "done" for m in v) for k, v in observer._events.items()}
    observer.close()
    if bf16:  # the same in bf16, where the MoE block runs inside each layer's output graph
        chunk.to(torch.bfloat16)
        observer = StepObserver([chunk])
        chunk(packed)[0].float().sum().backward()
        out["observed_spans_bf16"] = {k: sum(m[0] == "done" for m in v) for k, v in observer._events.items()}
        out["routed_layers_bf16"] = {layer: float(c.sum()) for layer, c in observer._counts.items()}
        out["routed_expected"] = float(total * chunk.config.moe_router_topk)
        observer.close()
    out["sinks_left"] = sum(hasattr(m, "vlmrl_span_sink") for m in layers)
    out["compiled_graphs"] = _compiled_graphs()
    return out


def bench_weights_worker(rank: int, world_size: int) -> dict[str, Any]:
    """The Qwen3.5-MoE bench's weight sharing (`vlmrl.bench.train_gpu`) on the miniature, in
    float32 on the CPU: HF's seeded text model twice (the same weights), then copied into
    vlmrl's Megatron model; returns the worst logit difference on one sequence, and how
    many tensors were copied against the language model's parameter count."""
    import torch

    from vlmrl.bench import train_gpu
    from vlmrl.config import load
    from vlmrl.config.schema import ParallelConfig
    from vlmrl.models.bridge import build_model
    from vlmrl.training.batch import TrainSample, build_micro_batch
    from vlmrl.training.parallel_state import init_parallel_state

    init_parallel_state(ParallelConfig(), backend="gloo", seed=0)
    mcfg = load(["model=tiny_qwen3_5_moe"], check_rules=False).model
    model = build_model(mcfg, ParallelConfig(), params_dtype=torch.float32, gdn_backend="torch")[0].eval()
    hf = train_gpu.hf_qwen35_moe_model(mcfg).eval()
    again = train_gpu.hf_qwen35_moe_model(mcfg)
    same_init = all(torch.equal(a, b) for a, b in zip(hf.state_dict().values(), again.state_dict().values()))
    copied = train_gpu.load_hf_language_model(model, mcfg, hf)
    ids = torch.randint(0, min(mcfg.lm.vocab_size, mcfg.vision_start_token_id), (50,),
                        generator=torch.Generator().manual_seed(0))
    mb = build_micro_batch([TrainSample(input_ids=ids.tolist(), loss_mask=[0.0] + [1.0] * 49)],
                           image_token_id=mcfg.image_token_id, spatial_merge_size=2)
    with torch.no_grad():
        ours = model(mb.packed).reshape(50, -1)
        ref = hf(input_ids=ids.view(1, -1), use_cache=False).logits.reshape(50, -1)
    # the bench's equal work with --samples 5: vlmrl packs five samples, HF takes them as five rows
    samples, per = train_gpu.token_layout(ids, 5)
    mb = build_micro_batch([TrainSample(input_ids=ids[i * per:(i + 1) * per].tolist(),
                                        loss_mask=[0.0] + [1.0] * (per - 1)) for i in range(samples)],
                           image_token_id=mcfg.image_token_id, spatial_merge_size=2)
    with torch.no_grad():
        packed = model(mb.packed).reshape(50, -1)
        rows = hf(input_ids=ids.view(samples, per), use_cache=False).logits.reshape(50, -1)
    return {"same_init": same_init, "copied": copied,
            "lm_params": sum(1 for n, _ in model.named_parameters() if "visual" not in n),
            "max_diff": float((ours - ref).abs().max()), "scale": float(ref.abs().max()),
            "packed_max_diff": float((packed - rows).abs().max()), "packed_scale": float(rows.abs().max()),
            "packed_vs_one_row": float((packed - ref).abs().max())}


def replay_trainer_worker(rank: int, world_size: int, model_cfg: Any, path: str, samples: list[Any],
                          noise: float) -> dict[str, Any]:
    """The trainer's model of the checkpoint at `path` with its routers perturbed by `noise`
    (relative), routing `samples` (TrainSamples carrying an engine's experts) in training
    forwards with and without routing replay: per pass the tokens routed unlike the engine
    (router hooks) and the step observer's mismatch metrics."""
    import torch

    from vlmrl.config.schema import ParallelConfig
    from vlmrl.models import adapters, routing
    from vlmrl.models.bridge import build_model
    from vlmrl.training.batch import build_micro_batch
    from vlmrl.training.observe import StepObserver
    from vlmrl.training.parallel_state import init_parallel_state

    init_parallel_state(ParallelConfig(), backend="gloo", seed=0)
    overrides = {"calculate_per_token_loss": True,
                 **routing.megatron_overrides(model_cfg, precision="fp32", replay=True)}
    chunk = build_model(model_cfg, ParallelConfig(), params_dtype=torch.float32, megatron_overrides=overrides)[0]
    adapters.load_hf_weights([chunk], model_cfg, path)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for r in routing.routers(chunk):
            r.weight.add_(torch.randn(r.weight.shape, generator=gen) * noise * r.weight.std())
    misses: list[int] = []

    def hook(router: Any, args: Any, output: Any) -> None:
        rows = router._rows(output[1].shape[0])
        chosen = output[1].int().topk(router.topk, dim=1).indices
        known = rows[:, 0] >= 0
        misses.append(int((routing.topk_sets_differ(chosen, rows) & known).sum()))

    for r in routing.routers(chunk):
        r.register_forward_hook(hook)
    observer = StepObserver([chunk])
    mb = build_micro_batch(samples, image_token_id=model_cfg.image_token_id,
                           spatial_merge_size=model_cfg.vision.spatial_merge_size)
    chunk.train()
    out: dict[str, Any] = {"known": int((mb.packed.routed_experts[:, 0, 0] >= 0).sum())}  # tokens
    for replay in (False, True):
        routing.configure(chunk, replay=replay)
        misses.clear()
        chunk(mb.packed, mb.pixel_values).sum().backward()
        out[f"misses_replay={replay}"] = sum(misses)
        out[f"observed_replay={replay}"] = observer.collect()
    return out


def near_tie_router_worker(rank: int, world_size: int, tokens: int) -> dict[str, Any]:
    """The Qwen3.5-MoE miniature's first router in bf16, fed tokens whose logits tie once
    rounded to bf16 for many of them, under each `trainer.moe_router_precision`, against
    transformers' router of the family (the embedded engine's, which rounds its logits to bf16
    as SGLang does): per precision the tokens whose top-k set differs from transformers'."""
    import torch
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter

    from vlmrl.config import load
    from vlmrl.config.schema import ParallelConfig
    from vlmrl.models import routing
    from vlmrl.models.bridge import build_model
    from vlmrl.models.families import get as family
    from vlmrl.training.parallel_state import init_parallel_state

    init_parallel_state(ParallelConfig(), backend="gloo", seed=0)
    model = load(["model=tiny_qwen3_5_moe"], check_rules=False).model
    lm = model.lm
    gen = torch.Generator().manual_seed(3)
    # coarse weights and inputs: logits on a grid fine enough for float32, too fine for bf16
    w = (torch.randint(-8, 9, (lm.num_experts, lm.hidden_size), generator=gen) / 64).to(torch.bfloat16)
    x = (torch.randn(tokens, lm.hidden_size, generator=gen) * 0.25).to(torch.bfloat16)
    exact = torch.topk(x.float() @ w.float().t(), lm.moe_router_topk, dim=1).indices
    rounded = torch.topk((x.float() @ w.float().t()).to(torch.bfloat16).float(), lm.moe_router_topk, dim=1).indices
    out: dict[str, Any] = {"near_ties": int(routing.topk_sets_differ(exact, rounded).sum())}
    hf = Qwen3_5MoeTopKRouter(family(model.family).hf_config(model).text_config).to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(w)
        hf_experts = hf(x)[2]
    for precision in ("fp32", "engine"):
        overrides = routing.megatron_overrides(model, precision=precision, replay=False)
        chunk = build_model(model, ParallelConfig(), params_dtype=torch.bfloat16, megatron_overrides=overrides)[0]
        router = routing.routers(chunk)[0]
        with torch.no_grad():
            router.weight.copy_(w)
            _, routing_map = router(x.unsqueeze(1))
        chosen = routing_map.int().topk(lm.moe_router_topk, dim=1).indices
        out[precision] = int(routing.topk_sets_differ(chosen, hf_experts).sum())
    return out


def activation_bytes_worker(rank: int, world_size: int, overrides: list[str],
                            packs: list[tuple[int, ...]]) -> dict[str, Any]:
    """What the language model's layers keep for their backward, measured: for each packed
    micro-batch of sample lengths in `packs`, the bytes of the tensors autograd saves
    (`saved_tensors_hooks`; storages counted once, parameters not at all) per token, by layer
    kind and part ("linear_attention/mixer", "full_attention/norms", ..., averaged over the
    layers of a kind) and "head" (final norm, output layer, the trainer's log-softmax loss).
    Then one MoE block alone on the first pack: what its backward allocates beyond what was
    live when it started ("moe_backward", bytes, from the profiler's allocation events; each
    weight gradient dropped once accumulated, as Megatron's gradient buffer takes it)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from vlmrl.config import load
    from vlmrl.config.schema import ParallelConfig
    from vlmrl.models.bridge import DTYPES, build_model
    from vlmrl.training.batch import TrainSample, build_micro_batch
    from vlmrl.training.logprobs import logprobs_and_entropy
    from vlmrl.training.parallel_state import init_parallel_state

    init_parallel_state(ParallelConfig(), backend="gloo", seed=0)
    cfg = load(overrides, check_rules=False)
    model, dtype = cfg.model, DTYPES[cfg.hardware.train_dtype]
    chunk = build_model(model, ParallelConfig(), params_dtype=dtype, fused_kernels=cfg.hardware.fused_kernels,
                        gdn_backend=cfg.hardware.gdn_backend)[0].train()
    params = {p.untyped_storage().data_ptr() for p in chunk.parameters()}
    for p in chunk.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    types = list(model.lm.layer_types) or ["full_attention"] * model.lm.num_layers
    where = ["other"]

    def enter(name: str) -> Any:
        return lambda module, args: where.append(name)

    def leave(module: Any, args: Any, out: Any) -> None:
        where.pop()

    layers = chunk.language_model.decoder.layers
    for i, layer in enumerate(layers):
        for attr, part in (("input_layernorm", "norms"), ("pre_mlp_layernorm", "norms"),
                           ("self_attention", "mixer"), ("mlp", "mlp")):
            sub = getattr(layer, attr)
            sub.register_forward_pre_hook(enter(f"{types[i]}/{part}"))
            sub.register_forward_hook(leave)
    for sub in (chunk.language_model.decoder.final_layernorm, chunk.language_model.output_layer):
        sub.register_forward_pre_hook(enter("head"))
        sub.register_forward_hook(leave)

    gen = torch.Generator().manual_seed(0)
    first_plain = max(model.image_token_id, model.vision_start_token_id or 0, model.vision_end_token_id or 0) + 1
    out: dict[str, Any] = {"packs": []}
    for lens in packs:
        samples = [TrainSample(input_ids=torch.randint(first_plain, model.lm.vocab_size, (n,), generator=gen).tolist(),
                               loss_mask=[0.0] + [1.0] * (n - 1)) for n in lens]
        mb = build_micro_batch(samples, image_token_id=model.image_token_id, spatial_merge_size=2)
        total = sum(lens)
        seen: set[int] = set()
        saved: dict[str, float] = {}

        def pack(t: torch.Tensor, seen: set[int] = seen, saved: dict[str, float] = saved) -> torch.Tensor:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in params and ptr not in seen:
                seen.add(ptr)
                saved[where[-1]] = saved.get(where[-1], 0) + storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = chunk(mb.packed, None).reshape(total, -1)
            where.append("head")
            logp, entropy = logprobs_and_entropy(logits, mb.targets, with_entropy=True)
            loss = -(logp * mb.loss_mask).sum() - 0.01 * entropy.sum()
            where.pop()
        del logits
        loss.backward()
        per = {k: v / total / (types.count(k.split("/")[0]) if "/" in k else 1) for k, v in saved.items()}
        out["packs"].append({"lens": list(lens), "tokens": total, "per_token": per})

    moe = next(layer.mlp for layer in layers)
    x = torch.randn(sum(packs[0]), 1, model.lm.hidden_size, generator=gen).to(dtype).requires_grad_()
    grad = torch.randn(x.shape, generator=gen).to(dtype)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        y = moe(x)[0]
        with record_function("moe_backward"):
            y.backward(grad)
    events = list(prof.profiler.kineto_results.events())
    start = min(e.start_ns() for e in events if e.name() == "moe_backward")
    live, at_start, peak = 0, None, 0
    for e in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        if at_start is None and e.start_ns() >= start:
            at_start = peak = live
        live += e.nbytes()
        if at_start is not None:
            peak = max(peak, live)
    out["moe_backward"] = peak - at_start
    out["moe_tokens"] = x.shape[0]
    return out


def build_host_bytes_worker(rank: int, world_size: int, option: str) -> dict[str, Any]:
    """Build `model=<option>` with the compute device reported as `meta` (a stand-in for a
    GPU: nothing is computed) and count the bytes that tensor factories made on the host
    meanwhile, against the parameters' bytes."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from vlmrl.config import load
    from vlmrl.config.schema import ParallelConfig
    from vlmrl.models import bridge, compat
    from vlmrl.training.parallel_state import init_parallel_state

    init_parallel_state(ParallelConfig(), backend="gloo", seed=0)
    model = load([f"model={option}"], check_rules=False).model
    factories = {"empty", "empty_strided", "randn", "rand", "zeros", "ones", "full", "normal", "arange",
                 "empty_like", "zeros_like", "ones_like", "randn_like", "uniform"}

    class HostBytes(TorchDispatchMode):
        bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if func._schema.name.split("::")[-1].rstrip("_") in factories:
                for t in out if isinstance(out, (tuple, list)) else [out]:
                    if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                        self.bytes += t.numel() * t.element_size()
            return out

    compat.device = lambda: torch.device("meta")  # this process only (spawned)
    with HostBytes() as mode:
        chunk = bridge.build_model(model, ParallelConfig(), params_dtype=torch.bfloat16)[0]
    return {"host_bytes": mode.bytes, "param_bytes": sum(p.numel() * p.element_size() for p in chunk.parameters()),
            "devices": sorted({p.device.type for p in chunk.parameters()})}

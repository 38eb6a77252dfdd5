"""The one place that makes megatron-core 0.16 run on CPU processes over gloo.

Megatron assumes CUDA in a handful of spots that matter to us: tensors allocated on
`torch.cuda.current_device()`, the CUDA RNG state tracker behind
`model_parallel_cuda_manual_seed` and dropout forks, an undefined `te_general_gemm` in
the MoE router when TransformerEngine is absent, and the side stream on which the MoE
all-to-all dispatcher copies its split sizes to the host. `apply()` patches exactly those, and only
for CPU processes; on GPUs it changes nothing, so the same code runs with NCCL.
Keep every CUDA-only workaround in this module. On every device it also fills in what
megatron expects from TransformerEngine or apex where neither is installed: the router's
GEMM name, and multi-tensor norm / scale kernels whose local fallbacks sync the host.

A process computes on the CPU when no GPU is visible or when its process group is gloo
(`hardware=cpu` on a machine that has GPUs: the gloo ranks stay on the CPU).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

_APPLIED = False
_CPU_ONLY = False


def force_cpu() -> None:
    """Make this process a CPU rank even where GPUs are visible (gloo process groups)."""
    global _CPU_ONLY
    _CPU_ONLY = True


def cuda_available() -> bool:
    """Whether this process computes on CUDA: a GPU is visible and the process is not a
    gloo (CPU) rank."""
    if _CPU_ONLY or not torch.cuda.is_available():
        return False
    return not (dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo")


def device() -> torch.device:
    """The device this process computes on: its current CUDA device, else the CPU."""
    if cuda_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor (the packed layout, its offsets) on `device`. To a GPU through pinned
    memory and without blocking: a plain copy from pageable memory waits for the GPU to finish
    its queue (the previous micro-batch's backward), so the host could not run ahead."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class CpuRNGStatesTracker:
    """Megatron's CudaRNGStatesTracker with CPU generator states instead of CUDA ones.

    Same interface (reset/get_states/set_states/add/fork/is_initialized): named RNG streams
    (e.g. the tensor-parallel one used for dropout inside TP regions) that `fork` swaps in.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        gen = torch.Generator()
        gen.manual_seed(seed)
        self.states_[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


@contextlib.contextmanager
def _tensor_cuda_is_identity() -> Iterator[None]:
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]


class _CpuTorch:
    """`torch` as seen by a Megatron module on a CPU-only machine: tensor factories asked
    for `device="cuda"` allocate on the CPU; everything else is the real torch."""

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "empty_like", "zeros_like")

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        if name not in self._FACTORIES:
            return attr

        def factory(*args: Any, **kwargs: Any) -> Any:
            dev = kwargs.get("device")
            if dev is not None and str(dev).startswith("cuda"):
                kwargs["device"] = "cpu"
            return attr(*args, **kwargs)

        return factory


# Megatron modules that allocate small bookkeeping tensors with a literal device="cuda".
_CUDA_LITERAL_MODULES = (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.utils",
)


def _clip_grad_by_total_norm_cpu(parameters: Any, max_norm: float, total_norm: float,
                                 use_decoupled_grad: bool = False) -> None:
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [g.detach() for p in parameters if (g := getattr(p, attr, None)) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


class _HostEvent:
    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass


class _HostStream:
    """A CUDA stream stand-in for CPU processes: work is already ordered on the host."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _HostEvent:
        return _HostEvent()

    def synchronize(self) -> None:
        pass

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _HostStream)

    def __hash__(self) -> int:
        return 0


_HOST_STREAM = _HostStream()


def _host_split_sizes(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron's maybe_move_tensor_to_cpu for tensors that are already on the host."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def _without_transformer_engine() -> None:
    """On every device: the MoE router names te_general_gemm unconditionally; without
    TransformerEngine the name is undefined (0.16). None selects its plain torch.mm path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]


def foreach_l2_norm(chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]],
                    per_tensor: bool, *args: Any) -> tuple[torch.Tensor, None]:
    """megatron's multi-tensor L2 norm (the whole list's norm, a [1] float32 tensor) from
    torch's foreach norm, on the tensors' device. megatron's own fallback turns every
    tensor's norm into a Python float: one host sync per parameter (462 in a step of the
    scaled Qwen3.5-MoE on an H200)."""
    norms = torch._foreach_norm(tensor_lists[0], 2, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def foreach_scale(chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]], scale: float) -> None:
    """megatron's multi-tensor scale (dst = src * scale, casting to dst's dtype) as foreach
    ops: in place when src is dst, else without megatron's fallback's temporary per tensor."""
    src, dst = tensor_lists
    if src is dst:
        if scale != 1.0:
            torch._foreach_mul_(dst, scale)
        return
    torch._foreach_copy_(dst, src if scale == 1.0 else torch._foreach_mul(src, scale))


def _without_apex_multi_tensor() -> None:
    """On every device: where neither TransformerEngine nor apex provides megatron's
    multi-tensor kernels, its local fallbacks (grad norm, clipping, main -> model param
    copies) become the foreach versions above."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as moptimizer

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
    for module in (clip_grads, moptimizer):
        if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = foreach_scale


def apply() -> None:
    """Install the CPU shims (idempotent; on CUDA only the TransformerEngine / apex-absence
    fixes)."""
    global _APPLIED
    _without_transformer_engine()
    _without_apex_multi_tensor()
    if _APPLIED or cuda_available():
        return
    # 1. `torch.empty(..., device=torch.cuda.current_device())` and friends allocate on CPU.
    torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]
    # ... and there is no device work to wait for (the pipeline's p2p shape exchange and the
    # checkpoint writers synchronize first).
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]

    # 2. The CUDA RNG tracker: CPU generator states with the same interface; activation
    #    recompute saves and restores "the CUDA RNG state", which a CPU rank does not have
    #    (its CPU state is saved and restored beside it).
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker  # type: ignore[misc]
    mrandom.initialize_rng_tracker(force_reset=True)
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: None
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None

    # 3. Tied embeddings under pipeline parallelism: the last stage's copy of the word
    #    embeddings is moved with `.cuda()` before its all-reduce; keep it on the CPU.
    from megatron.core.models.common.language_module import language_module

    original = language_module.LanguageModule.setup_embeddings_and_output_layer
    if not getattr(original, "_vlmrl_cpu", False):
        def setup_embeddings_and_output_layer(self: Any) -> None:
            with _tensor_cuda_is_identity():
                original(self)

        setup_embeddings_and_output_layer._vlmrl_cpu = True  # type: ignore[attr-defined]
        language_module.LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer

    # 4. (the MoE router without TransformerEngine: `_without_transformer_engine`, every device)

    # 5. Literal device="cuda" allocations (optimizer scales, grad-norm buffers, the
    #    schedules' token counters) land on the CPU.
    import importlib

    for name in _CUDA_LITERAL_MODULES:
        module = importlib.import_module(name)
        if not isinstance(module.torch, _CpuTorch):
            module.torch = _CpuTorch(module.torch)

    # 6. Gradient clipping asserts `torch.cuda.FloatTensor` grads; the CPU version scales
    #    the same fp32 grads by the same coefficient.
    from megatron.core.optimizer import optimizer as moptimizer

    moptimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_cpu

    # 7. The MoE all-to-all dispatcher creates a CUDA side stream and copies split sizes to
    #    the host on it; on a CPU process a stream is a no-op stand-in.
    torch.cuda.Stream = _HostStream  # type: ignore[misc,assignment]
    torch.cuda.current_stream = lambda *args, **kwargs: _HOST_STREAM  # type: ignore[assignment]
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()  # type: ignore[assignment]
    #    Its split sizes become host arrays only when they were on a GPU; the collectives take
    #    arrays (or lists), not tensors.
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = _host_split_sizes
    _APPLIED = True


def megatron_config_defaults() -> dict[str, Any]:
    """TransformerConfig fields whose defaults need CUDA kernels (fusions, TE paths).

    Off everywhere without TransformerEngine/apex; on GPUs the caller may re-enable them
    through `trainer.megatron` overrides once the kernels exist.
    """
    on_gpu = cuda_available()
    return {
        "use_cpu_initialization": not on_gpu,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "apply_rope_fusion": False,
        "persist_layer_norm": False,
        "gradient_accumulation_fusion": False,
        # gloo has no coalesced send/recv
        "batch_p2p_comm": on_gpu,
    }

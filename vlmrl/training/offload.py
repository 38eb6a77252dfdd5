"""The trainer's device state leaves the GPU and comes back at the same addresses.

Colocated with rollout engines, a trainer rank gives its GPU memory to the engine while the
engine generates. What it keeps between steps, its weights, Megatron's DDP parameter and
gradient buffers and the optimizer's state (fp32 main parameters, Adam moments and step
counters), lives in regions of torch_memory_saver (package `torch-memory-saver`, its
in-process `hook_mode="torch"`: torch's pluggable allocator behind a memory pool, no
LD_PRELOAD). Pausing a region unmaps its physical memory and keeps its virtual addresses;
resuming maps new physical memory at the same addresses. Every tensor, view and compiled
CUDA graph that points into the region is valid again after `resume`, with no pointer
rewritten: the trainer's CUDA graphs read the weights in place (`use_cuda_graphs` marks the
parameters as static addresses), so their storage may never move once the graphs exist.

Two regions:

- state (weights, parameter buffers, main parameters, optimizer state): a pinned host copy
  is taken at `pause` and copied back at `resume`. The host copy is kept between pauses and
  allocated once, when the trainer is built (`allocate_host_copy`): pinning that much host
  memory takes far longer than the copies themselves. A checkpoint whose save needs that
  host memory drops it (`drop_host_copy`) and the next pause allocates it again;
- grads (the DDP gradient buffers): no host copy. Every step zeroes them before its first
  backward, so their contents between steps are never read; `resume` zeroes them anyway.

The storages are placed in the regions after Megatron built them (`adopt`): each one is
copied into region memory and the old block freed, with `UntypedStorage.resize_`, which
keeps every view of the storage (a parameter inside a DDP buffer, `param.main_grad`, a
bucket's slice) pointing into it. This happens before the first forward compiles anything.
Storages that appear later (optimizer state replaced by a checkpoint load) are adopted at the
next `pause`; a parameter whose storage moved after the build is refused, since the CUDA
graphs would read its old address.

torch_memory_saver is required on GPUs whenever `trainer.offload` is on: without it the
trainer refuses to start (`load_memory_saver`) rather than fall back to moving tensors to the
host, which would give them new addresses on the way back and invalidate the graphs. On CPU
ranks there is no offload.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

STATE_TAG = "vlmrl_trainer_state"
GRADS_TAG = "vlmrl_trainer_grads"
INSTALL_HINT = ("pip install 'torch-memory-saver>=0.0.10' in the trainer's environment (SGLang depends on it, so "
                "the project's `gpu` extra, pip install -e '.[gpu]', brings it along with sglang)")


@dataclass(frozen=True)
class Held:
    """A tensor whose storage goes with the trainer's device state.

    `keep`: its contents must survive a pause (host copy); `fixed`: its address must not
    change once the trainer is built (parameters and the buffers they live in)."""

    tensor: torch.Tensor
    keep: bool = True
    fixed: bool = False


def load_memory_saver() -> Any:
    """torch_memory_saver's process-wide saver, set to its in-process hook mode.

    Raises ImportError naming the package where it is missing, and RuntimeError where the
    allocator is configured with expandable segments (which the saver cannot hold)."""
    # megatron-core sets the saver's hook mode when its inference module is imported, and fails
    # once the saver is initialised: import it first, whichever of the two a process meets first
    import megatron.core  # noqa: F401

    try:
        from torch_memory_saver import torch_memory_saver as saver
    except ImportError as e:
        raise ImportError(
            f"trainer.offload on GPUs needs torch_memory_saver, which is not importable ({e}): {INSTALL_HINT}. "
            "Or set trainer.offload=false (colocated engines then share the GPU with the trainer's whole state)."
        ) from e
    import os

    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        raise RuntimeError("trainer.offload: torch_memory_saver cannot hold memory of an allocator with "
                           "expandable segments; remove expandable_segments:True from PYTORCH_CUDA_ALLOC_CONF")
    with contextlib.suppress(AssertionError, AttributeError):  # already set up by an earlier trainer
        saver.hook_mode = "torch"
    global _EXIT_HOOKED
    if not _EXIT_HOOKED:
        atexit.register(_release_at_exit, saver)
        _EXIT_HOOKED = True
    return saver


_EXIT_HOOKED = False


def _release_at_exit(saver: Any) -> None:
    """torch_memory_saver's torch hook mode accepts the release of its memory only while the
    releasing thread is inside a region, and ends the process with status 1 ("only support
    interesting region") otherwise; at interpreter exit torch releases the regions' pools
    outside any. Mark the thread as inside one (0.0.10's library call), so that a process that
    offloaded exits cleanly."""
    impl = getattr(saver, "_impl", None)
    cdll = getattr(getattr(impl, "_binary_wrapper", None), "cdll", None)
    if cdll is not None and hasattr(cdll, "tms_set_interesting_region"):
        cdll.tms_set_interesting_region(True)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as one uint8 tensor (shares its memory)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class DeviceStateOffload:
    """Places a trainer rank's device state in torch_memory_saver regions and pauses /
    resumes them. `held` lists what goes (it is called again at every pause, so state that
    appeared since is adopted then)."""

    def __init__(self, held: Callable[[], Iterable[Held]], device: torch.device, saver: Any = None) -> None:
        if device.type != "cuda":
            raise ValueError(f"device state offload needs a CUDA device, not {device}")
        self.saver = saver if saver is not None else load_memory_saver()
        self.device = device
        self._held = held
        # storages placed in the regions: data pointer -> (tag, bytes)
        self._placed: dict[int, tuple[str, int]] = {}
        self._built = False
        self.paused = False
        self._host_copy = False  # a pinned host copy is allocated and kept (see `drop_host_copy`)
        # keep the pinned host copy between pauses, so that only the first pause allocates it
        # (releases before 0.0.10 cannot: each of their pauses allocates it again)
        try:
            self.saver.retain_cpu_backup = True
            self.retains_host_copy = True
        except AttributeError:
            self.retains_host_copy = False

    # ------------------------------------------------------------------ placement
    @contextlib.contextmanager
    def _region(self, tag: str) -> Iterator[None]:
        kwargs: dict[str, Any] = {"tag": tag, "enable_cpu_backup": tag == STATE_TAG}
        if tag == STATE_TAG and "cpu_backup_backend" in inspect.signature(self.saver.region).parameters:
            kwargs["cpu_backup_backend"] = "pinned"  # page-locked: the fast copies (releases before 0.0.10: their default)
        with self.saver.region(**kwargs):
            yield

    def adopt(self) -> dict[str, int]:
        """Place every held storage that is not in its region yet; returns the number of
        storages and bytes moved. After `finish_build`, a fixed storage outside the regions
        is an error (its old address may be in compiled CUDA graphs)."""
        groups: dict[int, tuple[torch.UntypedStorage, bool, bool]] = {}
        for h in self._held():
            t = h.tensor
            if t is None or t.device.type != "cuda":
                continue
            s = t.untyped_storage()
            if s.nbytes() == 0:
                continue
            key = s.data_ptr()
            old = groups.get(key)
            groups[key] = (s, h.keep or (old is not None and old[1]), h.fixed or (old is not None and old[2]))
        moved = moved_bytes = 0
        for key, (s, keep, fixed) in groups.items():
            if key in self._placed:
                continue
            if fixed and self._built:
                raise RuntimeError(
                    f"trainer.offload: a parameter's storage ({s.nbytes()} bytes at {key:#x}) is not where the "
                    "trainer was built: something replaced it since (param.data = ...), and moving it now would "
                    "leave compiled CUDA graphs reading the old address; copy into parameters in place instead")
            self._place(s, STATE_TAG if keep else GRADS_TAG, keep)
            moved += 1
            moved_bytes += s.nbytes()
        # placements free the old blocks into torch's cache: give them back to the device
        torch.cuda.empty_cache()
        return {"storages": moved, "bytes": moved_bytes}

    def _place(self, storage: torch.UntypedStorage, tag: str, keep: bool) -> None:
        n = storage.nbytes()
        copy = _bytes_view(storage).clone() if keep else None
        storage.resize_(0)
        with self._region(tag):
            storage.resize_(n)
        if copy is not None:
            _bytes_view(storage).copy_(copy)
            del copy
        else:
            _bytes_view(storage).zero_()
        self._placed[storage.data_ptr()] = (tag, n)

    def finish_build(self) -> None:
        """From now on parameters must stay where they are (the CUDA graphs may record them)."""
        self._built = True

    def allocate_host_copy(self) -> float:
        """Pause and resume once, so that the pinned host copy exists before the first real
        pause (allocating and pinning host memory is far slower than the copies); returns the
        seconds it took. Nothing where the host copy is not kept between pauses."""
        if not self.retains_host_copy or self.paused:
            return 0.0
        t0 = time.perf_counter()
        self.pause()
        self.resume()
        return time.perf_counter() - t0

    @property
    def host_copy_bytes(self) -> int:
        """Pinned host bytes kept between pauses now (0 before the first pause, after
        `drop_host_copy`, and where the saver does not keep the copy)."""
        return self.held_bytes()[STATE_TAG] if self._host_copy else 0

    def drop_host_copy(self) -> dict[str, float]:
        """Free the pinned host copy kept between pauses, for whatever needs the host memory
        while the state is on the device (a checkpoint's save). torch_memory_saver frees a copy
        at a resume that does not retain it, so this is one pause and resume with retention
        off; the next pause allocates the copy again (seconds per 10 GB, `allocate_host_copy`).
        Returns `bytes` freed and `seconds`; nothing while paused or where no copy is kept."""
        if not self._host_copy or self.paused:
            return {"bytes": 0.0, "seconds": 0.0}
        n = self.host_copy_bytes
        t0 = time.perf_counter()
        self.saver.retain_cpu_backup = False
        try:
            self.pause()
            self.resume()
        finally:
            self.saver.retain_cpu_backup = True
        self._host_copy = False
        return {"bytes": float(n), "seconds": time.perf_counter() - t0}

    def held_bytes(self) -> dict[str, int]:
        """Bytes of the held storages now in each region."""
        out = {STATE_TAG: 0, GRADS_TAG: 0}
        for tag, n in self._placed.values():
            out[tag] += n
        return out

    def _prune(self) -> None:
        """Forget placed storages that are no longer held (replaced optimizer state)."""
        live = set()
        for h in self._held():
            if h.tensor is not None and h.tensor.device.type == "cuda":
                live.add(_storage_key(h.tensor))
        for key in [k for k in self._placed if k not in live]:
            del self._placed[key]

    # ------------------------------------------------------------------ moves
    def pause(self) -> dict[str, float]:
        """Free the physical memory of both regions (the state's contents go to pinned host
        memory) and return torch's cached blocks of everything else to the device."""
        if self.paused:
            return _figures(0, 0, 0.0, already=True)
        self.adopt()
        self._prune()
        held = self.held_bytes()
        torch.cuda.synchronize(self.device)
        free_before, _ = torch.cuda.mem_get_info(self.device)
        t0 = time.perf_counter()
        self.saver.pause(STATE_TAG)
        self.saver.pause(GRADS_TAG)
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        self.paused = True
        self._host_copy = self.retains_host_copy and bool(self.saver.retain_cpu_backup)
        torch.cuda.empty_cache()
        free_after, _ = torch.cuda.mem_get_info(self.device)
        out = _figures(held[STATE_TAG] + held[GRADS_TAG], held[STATE_TAG], seconds)
        out["device_freed_bytes"] = float(free_after - free_before)
        return out

    def resume(self) -> dict[str, float]:
        """Map the regions' memory again at the same addresses, copy the state back and zero
        the gradient buffers."""
        if not self.paused:
            return _figures(0, 0, 0.0, already=True)
        held = self.held_bytes()
        torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        self.saver.resume(STATE_TAG)
        self.saver.resume(GRADS_TAG)
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        self.paused = False
        for h in self._held():
            if not h.keep and h.tensor is not None and h.tensor.device.type == "cuda":
                h.tensor.zero_()
        return _figures(held[STATE_TAG] + held[GRADS_TAG], held[STATE_TAG], seconds)


def release_host_memory() -> None:
    """Give back to the OS the host memory that staged state and is free again. A checkpoint's
    save: megatron-core's writer copies every tensor to the host with `.to("cpu",
    non_blocking=True)`, pinned memory from torch's caching host allocator, which keeps freed
    blocks cached and pinned in the process (the whole staged state, for the rest of the run);
    emptying that cache returns them. A load or the start's weight read: glibc keeps freed
    pageable memory in its arenas; `malloc_trim` returns it."""
    import ctypes
    import gc

    gc.collect()
    if torch.cuda.is_available() and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _figures(total: int, copied: int, seconds: float, *, already: bool = False) -> dict[str, float]:
    """bytes: device bytes of the trainer's state that left (or came back); copied_bytes: the
    part with a host copy (the gradients have none); gb_per_s: copied bytes per second
    (1 GB = 1e9 bytes) over the pause or resume alone."""
    return {"bytes": float(total), "copied_bytes": float(copied), "seconds": seconds,
            "gb_per_s": copied / seconds / 1e9 if seconds > 0 else 0.0, "already": float(already)}


def init_optimizer_state(optimizer: Any) -> int:
    """Create the state that torch's Adam(W) makes lazily at its first step (step counter,
    first and second moments, and the running maximum under amsgrad), for every parameter of
    every torch optimizer under Megatron's `optimizer`, exactly as torch would: the first
    step then finds it and computes what it would have computed. Returns the number of
    parameters given state; other optimizers are left to their own first step."""
    n = 0
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        from torch.optim.optimizer import _get_scalar_dtype

        for group in inner.param_groups:
            fused, capturable = bool(group.get("fused")), bool(group.get("capturable"))
            for p in group["params"]:
                state = inner.state[p]
                if len(state) != 0:
                    continue
                state["step"] = (torch.zeros((), dtype=_get_scalar_dtype(is_fused=fused), device=p.device)
                                 if capturable or fused else torch.tensor(0.0, dtype=_get_scalar_dtype()))
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                n += 1
    return n


def optimizer_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    """The parameters the torch optimizers under Megatron's `optimizer` update (fp32 main
    parameters, or the model's own) and every tensor of their state."""
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            yield from group["params"]
        for state in inner.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    yield v

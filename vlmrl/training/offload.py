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

Two regions, neither with torch_memory_saver's own host copy:

- state (weights, parameter buffers, main parameters, optimizer state): vlmrl copies it to one
  pinned host buffer before `pause` and back after `resume`, with asynchronous copies. The host
  buffer is kept between pauses and allocated once, when the trainer is built
  (`allocate_host_copy`): pinning that much host memory takes far longer than the copies
  themselves. A checkpoint whose save needs that host memory drops it (`drop_host_copy`) and
  the next pause allocates it again;
- grads (the DDP gradient buffers): no host copy. Every step zeroes them before its first
  backward, so their contents between steps are never read; `resume` zeroes them anyway.

Not everything has to move (`vlmrl.config.memory.offload_split`): the weights, and optimizer
tensors up to a byte budget, can stay on the device while the engines generate (they are then
never placed in a region). Of what moves, the optimizer state is read by nothing but the
optimizer step: with `overlap` its copy back runs on a side stream while the forward and
backward run, and the step waits for it (`before_optimizer_step`). The copy out, of weights and
optimizer state alike (both final after the optimizer step), starts when the loop heads for the
weight sync (`stage_out`), so that the offload after the sync waits only for its rest. The
weights come back inside `resume`: the forward needs them first.

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
    change once the trainer is built (parameters and the buffers they live in); `optimizer`:
    optimizer state that nothing but the optimizer step reads (a storage held as anything else
    too, a parameter the optimizer updates in place, counts as weights)."""

    tensor: torch.Tensor
    keep: bool = True
    fixed: bool = False
    optimizer: bool = False  # read only by the optimizer step (may come back while the backward runs)


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


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as one uint8 tensor (shares its memory)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def storage_kind(keep: bool, fixed: bool, optimizer: bool) -> str:
    """What a held storage is for the offload: "grads" (no copy kept), "optimizer" (read by the
    optimizer step alone: its copy back may overlap the backward) or "weights" (everything
    else that is kept: parameters, their buffers, a parameter the optimizer updates in place)."""
    if not keep:
        return "grads"
    return "optimizer" if optimizer and not fixed else "weights"


def choose_resident(storages: Iterable[tuple[int, int, str]], *, resident_weights: bool,
                    optimizer_budget: float, optimizer_kept: float = 0.0) -> set[int]:
    """Which of `storages` ((key, bytes, kind), in the trainer's order) stay on the device while
    the engines generate: every weights storage where `resident_weights`, and optimizer
    storages in order while their bytes, with `optimizer_kept` already resident, stay within
    `optimizer_budget` (a storage that does not fit moves; later, smaller ones may still fit).
    Gradients never stay."""
    out, kept = set(), float(optimizer_kept)
    for key, n, kind in storages:
        if kind == "weights" and resident_weights:
            out.add(key)
        elif kind == "optimizer" and kept + n <= optimizer_budget:
            out.add(key)
            kept += n
    return out


def host_layout(storages: Iterable[tuple[int, int]], align: int = 512) -> tuple[dict[int, int], int]:
    """Offsets of the moved storages ((key, bytes)) in one host buffer, each `align`-byte
    aligned, and the buffer's size."""
    out, total = {}, 0
    for key, n in storages:
        out[key] = total
        total += -(-n // align) * align
    return out, total


class DeviceStateOffload:
    """Places a trainer rank's device state in torch_memory_saver regions and pauses /
    resumes them. `held` lists what goes (it is called again at every pause, so state that
    appeared since is adopted then).

    `resident_weights` and `resident_optimizer_bytes` (`vlmrl.config.memory.offload_split`)
    leave state on the device: the weights whole, optimizer tensors in the order `held` gives
    them while their bytes fit. With `overlap`, the optimizer state that moves is copied on a
    side stream: back in while the forward and backward run (`before_optimizer_step` makes the
    step wait for it) and out from `stage_out` on (the loop calls it before the weight sync), so
    that `pause` only waits for what is left of the copy."""

    def __init__(self, held: Callable[[], Iterable[Held]], device: torch.device, saver: Any = None, *,
                 resident_weights: bool = False, resident_optimizer_bytes: float = 0.0,
                 overlap: bool = False) -> None:
        if device.type != "cuda":
            raise ValueError(f"device state offload needs a CUDA device, not {device}")
        self.saver = saver if saver is not None else load_memory_saver()
        self.device = device
        self._held = held
        self.resident_weights = resident_weights
        self.resident_optimizer_bytes = float(resident_optimizer_bytes)
        self.overlap = overlap
        # storages placed in the regions: data pointer -> (tag, bytes, what: weights | optimizer | grads)
        self._placed: dict[int, tuple[str, int, str]] = {}
        # storages left on the device on purpose: data pointer -> (bytes, what)
        self._resident: dict[int, tuple[int, str]] = {}
        self._built = False
        self.paused = False
        # the pinned host copy (one buffer, registered with CUDA) and each moved storage's offset in it
        self._host: torch.Tensor | None = None
        self._offsets: dict[int, int] = {}
        self._stream: torch.cuda.Stream | None = None
        self.version = 0  # bumped by every write of the state (`changed`)
        self._out: tuple[int, Any, Any] | None = None  # (version copied, start event, end event) of the copy out
        self._host_version: int | None = None  # the version the host copy holds (None: none whole)
        self._in: tuple[Any, Any] | None = None  # (start, end) of the optimizer state's copy in, not yet waited for
        self.last_overlap: dict[str, float] = {}
        # the device's used bytes (every process's, as the driver counts them) at their highest
        # during the placements: a storage's old block and its region copy overlap by one storage
        self.placement_peak_bytes = 0

    # ------------------------------------------------------------------ placement
    @contextlib.contextmanager
    def _region(self, tag: str) -> Iterator[None]:
        with self.saver.region(tag=tag, enable_cpu_backup=False):
            yield

    def _groups(self) -> dict[int, tuple[torch.UntypedStorage, bool, bool, bool]]:
        """Held storages by data pointer: (storage, keep, fixed, optimizer-only)."""
        groups: dict[int, tuple[torch.UntypedStorage, bool, bool, bool]] = {}
        for h in self._held():
            t = h.tensor
            if t is None or t.device.type != "cuda":
                continue
            s = t.untyped_storage()
            if s.nbytes() == 0:
                continue
            key = s.data_ptr()
            old = groups.get(key)
            if old is None:
                groups[key] = (s, h.keep, h.fixed, h.optimizer)
            else:
                groups[key] = (s, h.keep or old[1], h.fixed or old[2], h.optimizer and old[3])
        return groups

    def adopt(self, groups: dict[int, tuple[torch.UntypedStorage, bool, bool, bool]] | None = None) -> dict[str, int]:
        """Place every held storage (of `groups`, by default `_groups()`) that is not in its
        region yet (or left resident); returns the number of storages and bytes moved. After
        `finish_build`, a fixed storage outside the regions is an error (its old address may be
        in compiled CUDA graphs)."""
        moved = moved_bytes = 0
        groups = self._groups() if groups is None else groups
        new = {key: (g[0], storage_kind(*g[1:]), g[2]) for key, g in groups.items()
               if key not in self._placed and key not in self._resident}
        stay = choose_resident(((k, s.nbytes(), kind) for k, (s, kind, _) in new.items()),
                               resident_weights=self.resident_weights and not self._built,
                               optimizer_budget=self.resident_optimizer_bytes,
                               optimizer_kept=self.resident_bytes()["optimizer"])
        for key, (s, what, fixed) in new.items():
            n = s.nbytes()
            if key in stay:
                self._resident[key] = (n, what)
                continue
            keep = what != "grads"
            if fixed and self._built:
                raise RuntimeError(
                    f"trainer.offload: a parameter's storage ({n} bytes at {key:#x}) is not where the "
                    "trainer was built: something replaced it since (param.data = ...), and moving it now would "
                    "leave compiled CUDA graphs reading the old address; copy into parameters in place instead")
            self._place(s, STATE_TAG if keep else GRADS_TAG, keep)
            self._placed[s.data_ptr()] = (STATE_TAG if keep else GRADS_TAG, n, what)
            moved += 1
            moved_bytes += n
        if moved:  # placements free the old blocks into torch's cache: give them back to the device
            torch.cuda.empty_cache()
        return {"storages": moved, "bytes": moved_bytes}

    def _place(self, storage: torch.UntypedStorage, tag: str, keep: bool) -> None:
        n = storage.nbytes()
        copy = _bytes_view(storage).clone() if keep else None
        storage.resize_(0)
        # the old block (and the last placement's copy) went to torch's cache, which the region's
        # own allocations cannot reuse: give it back to the device first, or placing a state holds
        # it twice (a 2.88B MoE's 32 GiB of optimizer state failed to allocate on an 80 GiB H100)
        torch.cuda.empty_cache()
        with self._region(tag):
            storage.resize_(n)
        free, total = torch.cuda.mem_get_info(self.device)
        self.placement_peak_bytes = max(self.placement_peak_bytes, total - free)
        if copy is not None:
            _bytes_view(storage).copy_(copy)
            del copy
        else:
            _bytes_view(storage).zero_()

    def finish_build(self) -> None:
        """From now on parameters must stay where they are (the CUDA graphs may record them)."""
        self._built = True

    # ------------------------------------------------------------------ the host copy
    def _layout(self) -> dict[int, int]:
        """Each moved storage's offset in the host copy (512-byte aligned), by data pointer."""
        return host_layout((k, n) for k, (tag, n, _) in self._placed.items() if tag == STATE_TAG)[0]

    def _host_buffer(self) -> torch.Tensor:
        """The pinned host copy, laid out for the storages placed now: allocated where it is
        missing or the placed storages changed (a checkpoint's load replaced optimizer state).
        One host allocation registered with CUDA (page-locked, so that copies run at the bus's
        rate and asynchronously): torch's pinned allocator would round it up to a power of two."""
        layout = self._layout()
        if self._host is not None and layout == self._offsets:
            return self._host
        self._free_host()
        _, total = host_layout((k, n) for k, (tag, n, _) in self._placed.items() if tag == STATE_TAG)
        host = torch.empty(max(total, 1), dtype=torch.uint8)
        if total:
            err = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), total, 0)
            if int(err) != 0:
                raise RuntimeError(f"trainer.offload: pinning {total / 2**30:.1f} GiB of host memory for the "
                                   f"offloaded state failed (cudaHostRegister error {int(err)})")
        self._host, self._offsets = host, layout
        return host

    def _free_host(self) -> None:
        if self._host is None:
            return
        self._settle()
        if self._offsets:
            torch.cuda.cudart().cudaHostUnregister(self._host.data_ptr())
        self._host, self._offsets, self._host_version = None, {}, None

    def allocate_host_copy(self) -> float:
        """Allocate and pin the host copy now (the trainer does when it is built: pinning that
        much host memory takes far longer than the copies); returns the seconds it took."""
        if self.paused:
            return 0.0
        t0 = time.perf_counter()
        self._refresh()
        self._host_buffer()
        return time.perf_counter() - t0

    @property
    def host_copy_bytes(self) -> int:
        """Pinned host bytes kept between pauses now (0 before the host copy is allocated and
        after `drop_host_copy`)."""
        return sum(self._placed[k][1] for k in self._offsets) if self._host is not None else 0

    def drop_host_copy(self) -> dict[str, float]:
        """Free the pinned host copy while the state is on the device, for whatever needs the
        host memory then (a checkpoint's save); the next pause allocates it again (seconds per
        10 GB, `allocate_host_copy`). Returns `bytes` freed and `seconds`; nothing while paused."""
        if self._host is None or self.paused:
            return {"bytes": 0.0, "seconds": 0.0}
        n = self.host_copy_bytes
        t0 = time.perf_counter()
        self._free_host()
        self._out = None
        return {"bytes": float(n), "seconds": time.perf_counter() - t0}

    def held_bytes(self) -> dict[str, int]:
        """Bytes of the held storages now in each region."""
        out = {STATE_TAG: 0, GRADS_TAG: 0}
        for tag, n, _ in self._placed.values():
            out[tag] += n
        return out

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of the held storages left on the device, by what they are (weights, optimizer)."""
        out = {"weights": 0, "optimizer": 0}
        for n, what in self._resident.values():
            out[what] += n
        return out

    def _prune(self, groups: dict[int, Any]) -> None:
        """Forget storages that are no longer held (replaced optimizer state)."""
        live = set(groups)
        for d in (self._placed, self._resident):
            for key in [k for k in d if k not in live]:
                del d[key]

    # ------------------------------------------------------------------ copies
    def _side(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _refresh(self) -> dict[int, Any]:
        """Forget what is no longer held and place what is new; returns the held storages by
        data pointer (one pass over the held tensors, two where something was placed)."""
        groups = self._groups()
        self._prune(groups)
        if self.adopt(groups)["storages"]:
            groups = self._groups()
        return {k: g[0] for k, g in groups.items()}

    def _host_current(self) -> bool:
        """The host copy is laid out for the placed storages and holds the state as it is (nothing
        wrote the state since the copy was made)."""
        return self._host is not None and self._offsets == self._layout() and self._host_version == self.version

    def _copies(self, what: set[str], out: bool, storages: dict[int, Any]) -> int:
        """Enqueue the copies of the moved storages of kinds `what` on the current stream,
        between the device and the host copy; returns the bytes."""
        host = self._host_buffer()
        n = 0
        for key, off in self._offsets.items():
            tag, size, kind = self._placed[key]
            if kind not in what:
                continue
            dev, h = _bytes_view(storages[key]), host[off:off + size]
            (h if out else dev).copy_(dev if out else h, non_blocking=True)
            n += size
        return n

    def changed(self) -> None:
        """The state was written (an optimizer step, a load): a copy out made before is stale."""
        self.version += 1

    def stage_out(self) -> dict[str, float]:
        """Start copying the moved state to the host copy on the side stream, after what the
        current stream has queued (the optimizer step); `pause` waits for it. Nothing without
        `overlap`, while paused, or where nothing moves."""
        if not self.overlap or self.paused or not any(t == STATE_TAG for t, _, _ in self._placed.values()):
            return {"bytes": 0.0}
        storages = self._refresh()
        if self._host_current():
            return {"bytes": 0.0}
        self._settle_in()
        self._host_buffer()
        side = self._side()
        side.wait_stream(torch.cuda.current_stream(self.device))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            start.record()
            n = self._copies({"weights", "optimizer"}, out=True, storages=storages)
            end.record()
        self._out = (self.version, start, end)
        return {"bytes": float(n)}

    def before_optimizer_step(self) -> None:
        """The current stream waits for the optimizer state's copy in (and for a copy out
        still reading what the step will write). Called right before the optimizer step."""
        cur = torch.cuda.current_stream(self.device)
        if self._in is not None:
            ready = torch.cuda.Event(enable_timing=True)
            ready.record(cur)  # the backward's end, in stream order
            cur.wait_event(self._in[1])
            self.last_overlap = {"_in_start": self._in[0], "_in_end": self._in[1], "_ready": ready}
            self._in = None
        if self._out is not None:
            cur.wait_event(self._out[2])

    def overlap_figures(self) -> dict[str, float]:
        """The last overlapped copy in, from CUDA events (`vlmrl.logging.keys`):
        perf/onload_overlapped_copy_time (its own length) and perf/onload_overlap_wait_time (how
        long the optimizer step waited for it after the backward ended); empty where nothing
        was overlapped since the last call."""
        f = self.last_overlap
        if not f:
            return {}
        self.last_overlap = {}
        f["_ready"].synchronize()
        f["_in_end"].synchronize()
        return {"perf/onload_overlapped_copy_time": f["_in_start"].elapsed_time(f["_in_end"]) / 1e3,
                "perf/onload_overlap_wait_time": max(f["_ready"].elapsed_time(f["_in_end"]) / 1e3, 0.0)}

    def _settle_in(self) -> None:
        """Wait (on the host) for a copy in that nothing has waited for yet."""
        if self._in is not None:
            self._in[1].synchronize()
            self._in = None

    def _settle(self) -> None:
        """Wait for every copy in flight (before the host copy or the regions go)."""
        self._settle_in()
        if self._out is not None:
            self._out[2].synchronize()

    def settle(self) -> None:
        """Make the state whole on the device for readers outside the step (a checkpoint's
        save or load): the copy in finished and waited for."""
        self._settle_in()

    # ------------------------------------------------------------------ moves
    def pause(self) -> dict[str, float]:
        """Free the physical memory of both regions (the state's contents go to the pinned
        host copy, or went there since `stage_out`) and return torch's cached blocks of
        everything else to the device."""
        if self.paused:
            return _figures(0, 0, 0.0, 0.0, already=True)
        storages = self._refresh()
        held = self.held_bytes()
        self._settle_in()
        torch.cuda.synchronize(self.device)
        free_before, _ = torch.cuda.mem_get_info(self.device)
        t0 = time.perf_counter()
        laid_out = self._host is not None and self._offsets == self._layout()
        current = laid_out and self._host_version == self.version  # `_host_current`, the layout read once
        staged = not current and laid_out and self._out is not None and self._out[0] == self.version
        copy_s = 0.0
        if not current:
            if not staged:
                self._host_buffer()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                self._copies({"weights", "optimizer"}, out=True, storages=storages)
                end.record()
                self._out = (self.version, start, end)
            _, start, end = self._out
            end.synchronize()
            copy_s = start.elapsed_time(end) / 1e3
            self._host_version = self.version
        self._out = None
        self.saver.pause(STATE_TAG)
        self.saver.pause(GRADS_TAG)
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        self.paused = True
        torch.cuda.empty_cache()
        free_after, _ = torch.cuda.mem_get_info(self.device)
        out = _figures(held[STATE_TAG] + held[GRADS_TAG], held[STATE_TAG], seconds, copy_s)
        out["device_freed_bytes"] = float(free_after - free_before)
        out["overlapped"] = float(staged)  # the copy started before the sync (stage_out)
        out["unchanged"] = float(current)  # nothing to copy: the host copy was current
        if current:
            out["copied_bytes"] = 0.0
        return out

    def resume(self) -> dict[str, float]:
        """Map the regions' memory again at the same addresses, copy the state back and zero
        the gradient buffers. With `overlap` the optimizer state's copy runs on the side stream
        after the weights' and is left in flight: `before_optimizer_step` waits for it."""
        if not self.paused:
            return _figures(0, 0, 0.0, 0.0, already=True)
        held = self.held_bytes()
        torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        self.saver.resume(STATE_TAG)
        self.saver.resume(GRADS_TAG)
        self.paused = False
        storages = {k: g[0] for k, g in self._groups().items()}
        cur = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(cur)
        self._copies({"weights"} if self.overlap else {"weights", "optimizer"}, out=False, storages=storages)
        for key, (tag, _, _) in self._placed.items():
            if tag == GRADS_TAG:
                _bytes_view(storages[key]).zero_()
        end.record(cur)
        later = 0
        if self.overlap:
            side = self._side()
            side.wait_stream(cur)
            s2, e2 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(side):
                s2.record()
                later = self._copies({"optimizer"}, out=False, storages=storages)
                e2.record()
            self._in = (s2, e2) if later else None
        end.synchronize()
        seconds = time.perf_counter() - t0
        out = _figures(held[STATE_TAG] + held[GRADS_TAG], held[STATE_TAG] - later, seconds,
                       start.elapsed_time(end) / 1e3)
        out["overlapped_bytes"] = float(later)
        return out


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


def _figures(total: int, copied: int, seconds: float, copy_seconds: float, *,
             already: bool = False) -> dict[str, float]:
    """bytes: device bytes of the trainer's state that left (or came back); copied_bytes: the
    part copied within the move (the gradients have no copy; an overlapped copy in is left out,
    `overlapped_bytes`); seconds: the move's host time; copy_seconds: the copies' own length
    (CUDA events; a copy out made during the sync counts whole, though only its rest was
    waited for); gb_per_s: copied bytes per second of copy_seconds (1 GB = 1e9 bytes)."""
    return {"bytes": float(total), "copied_bytes": float(copied), "seconds": seconds, "copy_seconds": copy_seconds,
            "gb_per_s": copied / copy_seconds / 1e9 if copy_seconds > 0 else 0.0, "already": float(already)}


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

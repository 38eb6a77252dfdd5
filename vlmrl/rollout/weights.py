"""Moving weights from the trainer to rollout engines: payloads and broadcast groups.

Pure transport, no HTTP (the client and the server both import this module; neither imports
the other):

* `/update_weights_from_tensor` payloads: SGLang's CUDA-IPC form (`serialize_ipc`: colocated
  engines read the trainer's GPU memory) and the embedded server's CPU form
  (`encode_torch_payload`: base64 of `torch.save(list[(name, tensor)])`).
* `/update_weights_from_distributed`: the trainer's rank 0 and every engine rank in one process
  group (`init_update_group` / `join_update_group`), each bucket broadcast tensor by tensor or
  flattened into one uint8 buffer (`broadcast_bucket` / `receive_bucket`);
  `init_weights_update_group_all` and `update_weights_distributed` drive the engines' HTTP
  calls and the trainer's side together. The same helpers run over gloo on CPU.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import io
from collections.abc import Iterable, Iterator, Sequence
from datetime import timedelta
from typing import Any

from .protocol import bucketize


def encode_torch_payload(named_tensors: list[tuple[str, Any]]) -> str:
    """The embedded server's `serialized_named_tensors` entry: base64(torch.save(list))."""
    import torch

    buf = io.BytesIO()
    torch.save([(n, t.detach().cpu().contiguous()) for n, t in named_tensors], buf)
    return base64.b64encode(buf.getvalue()).decode()


def _b64(entry: str | bytes) -> bytes:
    """The bytes of a base64 payload entry; ValueError saying it is not base64."""
    import binascii

    if not isinstance(entry, str):
        return bytes(entry)
    try:
        return base64.b64decode(entry, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"a serialized_named_tensors entry is not base64 ({len(entry)} characters): {e}") from None


def decode_torch_payload(entry: str | bytes) -> list[tuple[str, Any]]:
    import torch

    data = _b64(entry)
    try:
        obj = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 (torch raises several kinds for a broken archive)
        raise ValueError(f"a serialized_named_tensors entry is not a torch.save archive of (name, tensor) pairs "
                         f"({len(data)} bytes): {type(e).__name__}: {str(e)[:200]}") from None
    return [(str(n), t) for n, t in check_named_tensors(obj)]


def decode_payload(entry: str | bytes, flattened: bool = False) -> list[tuple[str, Any]]:
    """One entry of `serialized_named_tensors`, either format: torch.save's zip container
    (host tensors) or the pickled CUDA-IPC handles of `serialize_ipc` (tensors on this
    process's GPU, read in place): (name, tensor) pairs, or with `flattened`
    (`load_format="flattened_bucket"`, as SGLang reads it) a `flatten_bucket` dict."""
    import torch

    data = _b64(entry)
    if data[:2] == b"PK":  # torch.save's zip archive
        if flattened:
            raise ValueError("load_format 'flattened_bucket' needs a CUDA-IPC payload, not torch.save bytes")
        return decode_torch_payload(data)
    if not torch.cuda.is_available():
        raise ValueError("a CUDA-IPC weight payload (SGLang's default format) needs the engine on a GPU; "
                         "an engine on the CPU reads torch.save payloads")
    obj = load_ipc(data)
    if flattened != isinstance(obj, dict):
        raise ValueError("load_format 'flattened_bucket' and the payload disagree: "
                         + ("a flattened bucket needs load_format 'flattened_bucket'" if isinstance(obj, dict)
                            else "the payload is (name, tensor) pairs, not a flattened bucket"))
    if flattened:
        return unflatten_bucket(obj)
    return [(str(n), t) for n, t in obj]


def flat_layout(entries: Iterable[tuple[str, Any, Any]]) -> list[Any]:
    """Byte ranges of (name, shape, dtype) entries laid end to end in one uint8 buffer, as
    SGLang's flattened buckets describe them: `types.SimpleNamespace`s with name, shape, dtype,
    start_idx, end_idx, numel (bytes). SGLang's safe unpickler admits SimpleNamespace and its
    loader reads only these attributes."""
    import math
    import types

    import torch

    out, at = [], 0
    for name, shape, dtype in entries:
        size = math.prod(shape) * dtype.itemsize
        out.append(types.SimpleNamespace(name=name, shape=torch.Size(shape), dtype=dtype, start_idx=at,
                                         end_idx=at + size, numel=size))
        at += size
    return out


def _runs(layout: Sequence[Any]) -> Iterator[tuple[int, int]]:
    """[i, j) ranges of `layout` entries of one dtype laid end to end."""
    i, n = 0, len(layout)
    while i < n:
        j = i + 1
        while j < n and layout[j].dtype == layout[i].dtype and layout[j].start_idx == layout[j - 1].end_idx:
            j += 1
        yield i, j
        i = j


def _run_view(flat: Any, layout: Sequence[Any], i: int, j: int) -> Any:
    """The bytes of entries [i, j) of one `_runs` range, as one tensor of their dtype."""
    return flat[layout[i].start_idx:layout[j - 1].end_idx].view(layout[i].dtype)


def _flat_views(flat: Any, layout: Sequence[Any]) -> list[Any]:
    """A view of `flat` (uint8) for every entry of `layout` (`flat_layout`'s fields), each in
    its dtype and shape: one split per run of one dtype, then one reshape each. Raises
    (torch's error) when an entry's byte range does not fit its shape or is not aligned to
    its element size."""
    out: list[Any] = []
    for i, j in _runs(layout):
        dt = layout[i].dtype
        parts = _run_view(flat, layout, i, j).split([(m.end_idx - m.start_idx) // dt.itemsize for m in layout[i:j]])
        out.extend(part.view(m.shape) for m, part in zip(layout[i:j], parts))
    return out


def copy_grouped(dst: Sequence[Any], src: Sequence[Any]) -> None:
    """dst[i].copy_(src[i]) for every i, batched: torch's foreach copy per (dtype, device)
    group, so that pairs of contiguous tensors of one dtype go through one multi-tensor
    kernel instead of one launch (and one Python call) each; any other pair (a strided view,
    a cast, another device) takes foreach's per-tensor path, in C++."""
    import torch

    groups: dict[tuple[Any, ...], tuple[list[Any], list[Any]]] = {}
    for d, s in zip(dst, src, strict=True):
        fast = d.dtype == s.dtype and d.device == s.device and d.is_contiguous() and s.is_contiguous()
        key = (d.dtype, s.dtype, d.device, s.device, fast)
        group = groups.get(key)
        if group is None:
            group = groups[key] = ([], [])
        group[0].append(d)
        group[1].append(s)
    for ds, ss in groups.values():
        torch._foreach_copy_(ds, ss)


def _flat_bytes(tensors: Sequence[Any], layout: Sequence[Any] | None = None) -> Any:
    """The tensors' bytes end to end in one uint8 tensor (the layout of `flat_layout`): one
    concatenation per run of one dtype, written in place (a view is read as it is, a strided
    one copied once more by its reshape)."""
    import torch

    if layout is None:
        layout = flat_layout((f"{i}", t.shape, t.dtype) for i, t in enumerate(tensors))
    if not layout:
        return torch.empty(0, dtype=torch.uint8)
    flat = torch.empty(layout[-1].end_idx, dtype=torch.uint8, device=tensors[0].device)
    with torch.no_grad():
        for i, j in _runs(layout):
            torch.cat([t.reshape(-1) for t in tensors[i:j]], out=_run_view(flat, layout, i, j))
    return flat


def flatten_bucket(bucket: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """SGLang's flattened bucket (`load_format="flattened_bucket"`): the bucket's bytes in one
    uint8 tensor, largest element size first (every tensor's byte offset a multiple of its
    element size), and its `flat_layout`. One CUDA-IPC handle per bucket instead of one per
    tensor: opening a handle costs the engine far more than copying a tensor."""
    ordered = order_for_flattening(bucket)
    layout = flat_layout((n, t.shape, t.dtype) for n, t in ordered)
    return {"flattened_tensor": _flat_bytes([t for _, t in ordered], layout), "metadata": layout}


def unflatten_bucket(bucket: dict[str, Any]) -> list[tuple[str, Any]]:
    """Inverse of `flatten_bucket`: views into the flat tensor, no copies (the layout is
    checked first: `check_flat_layout`)."""
    meta = bucket["metadata"]
    check_flat_layout(bucket["flattened_tensor"], meta)
    return [(str(m.name), t) for m, t in zip(meta, _flat_views(bucket["flattened_tensor"], meta))]


def serialize_payload(bucket: Sequence[tuple[str, Any]], tensor_format: str, keep: list | None = None, *,
                      flattened: bool = True) -> str:
    """One entry of `serialized_named_tensors` in `tensor_format`: "ipc" (base64 of the CUDA
    IPC handle of this process's bucket, flattened: `flatten_bucket`, sent with
    `load_format="flattened_bucket"`) or "torch_save" (base64 of host copies).

    `flattened=False` (ipc): (name, tensor) pairs for a loader that takes pairs (SGLang's
    `load_format` null or a custom loader), each tensor a view into the one flattened copy,
    so that the engine still opens one IPC handle per bucket (torch's rebuild reuses an
    opened storage).

    keep: receives the flattened copy, which must stay alive until the engines have read it
    (torch also holds an IPC-shared block back from reuse until its readers let go)."""
    if tensor_format == "ipc":
        flat = flatten_bucket(bucket)
        if keep is not None:
            keep.append(flat)
        return base64.b64encode(serialize_ipc(flat if flattened else unflatten_bucket(flat))).decode()
    if tensor_format == "torch_save":
        return encode_torch_payload(list(bucket))
    raise ValueError(f"tensor_format must be 'ipc' or 'torch_save', not {tensor_format!r}")


def _device_uuid(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def serialize_ipc(named_tensors: Sequence[tuple[str, Any]] | dict[str, Any]) -> bytes:
    """Pickle (name, tensor) pairs, or a `flatten_bucket` dict, the way SGLang's
    /update_weights_from_tensor reads them:
    torch's multiprocessing reductions (CUDA tensors travel as IPC handles, not data), with
    the CUDA device index replaced by the device UUID, since the server process numbers
    its visible GPUs differently (SGLang's patched rebuild accepts a UUID there)."""
    from multiprocessing.reduction import ForkingPickler

    import torch
    from torch.multiprocessing import reductions

    reductions.init_reductions()

    def reduce_cuda(t: Any) -> Any:
        fn, args = reductions.reduce_tensor(t)
        if fn is reductions.rebuild_cuda_tensor:
            args = list(args)
            # rebuild_cuda_tensor(cls, size, stride, offset, storage_cls, dtype, device, ...)
            args[6] = _device_uuid(int(args[6]))
            args = tuple(args)
        return fn, args

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)  # its dispatch table is a per-instance copy
    pickler.dispatch_table[torch.Tensor] = reduce_cuda
    pickler.dispatch_table[torch.nn.Parameter] = reduce_cuda
    if isinstance(named_tensors, dict):
        pickler.dump(named_tensors)
    else:
        pickler.dump([(n, t.detach()) for n, t in named_tensors])
    return buf.getvalue()


# The globals a CUDA-IPC weight payload names (torch's reductions of CUDA tensors, and a
# flattened bucket's metadata), each by its exact module and name; torch's dtypes are admitted
# as the dtype objects they are. Nothing else is looked up, so nothing else can be called:
# SGLang's own unpickler admits whole module prefixes (`torch.`, `builtins.`), under which
# `torch.save`, `torch.load`, `torch.hub.load` or `torch.utils.cpp_extension.load_inline`
# would run code or touch files.
_REBUILD = ("torch.multiprocessing.reductions", "rebuild_cuda_tensor")
IPC_GLOBALS = frozenset({
    _REBUILD,
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch.storage", "TypedStorage"),
    ("torch.storage", "UntypedStorage"),
    ("types", "SimpleNamespace"),
})


@functools.cache
def _dtype_names() -> frozenset[str]:
    """The names under which torch exposes its dtypes (read from what torch has loaded: an
    unknown name is never looked up, which could import one of torch's lazy submodules)."""
    import torch

    return frozenset(n for n, v in vars(torch).items() if isinstance(v, torch.dtype))


def ipc_global(module: str, name: str) -> Any:
    """The object a weight payload's global (module, name) stands for, if it is one that
    `IPC_GLOBALS` admits or a torch dtype; else pickle.UnpicklingError naming it, before
    anything is imported or called."""
    import pickle

    import torch

    if module == "torch" and name in _dtype_names():
        return getattr(torch, name)
    if (module, name) not in IPC_GLOBALS:
        raise pickle.UnpicklingError(f"a weight payload may not refer to {module}.{name} (it admits only "
                                     "torch's CUDA tensor rebuild, tensor, size, storage and dtype objects, "
                                     "and SimpleNamespace for a flattened bucket's metadata)")
    if module == "types":
        import types

        return types.SimpleNamespace
    import importlib

    return getattr(importlib.import_module(module), name)


def load_ipc(data: bytes) -> Any:
    """Inverse of `serialize_ipc` in another process (what SGLang's server does): device
    UUIDs are mapped back to this process's CUDA device indices. Only the exact globals of
    `IPC_GLOBALS` (and torch dtypes) are admitted; the result is checked to be (name, tensor)
    pairs or a flattened bucket (`check_ipc_payload`)."""
    import pickle

    import torch

    by_uuid = {_device_uuid(i): i for i in range(torch.cuda.device_count())}

    def rebuild(*args: Any) -> Any:
        from torch.multiprocessing import reductions

        args = list(args)
        if len(args) < 7:
            raise pickle.UnpicklingError(f"rebuild_cuda_tensor takes 15 arguments, the payload gave {len(args)}")
        if isinstance(args[6], str):
            if args[6] not in by_uuid:
                raise pickle.UnpicklingError(f"the payload's tensor lives on GPU {args[6]}, not one of this "
                                             f"process's ({sorted(by_uuid)})")
            args[6] = by_uuid[args[6]]
        return reductions.rebuild_cuda_tensor(*args)

    class _Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            found = ipc_global(module, name)  # refuses any other global before it is looked up
            return rebuild if (module, name) == _REBUILD else found

    return check_ipc_payload(_Unpickler(io.BytesIO(data)).load())


def check_ipc_payload(obj: Any) -> Any:
    """`obj` if it is what a weight payload holds: a list of (str, tensor) pairs, or a
    flattened bucket ({"flattened_tensor": uint8 tensor, "metadata": [SimpleNamespace]}, whose
    layout `unflatten_bucket` checks before it reads it); else ValueError saying what it is."""
    if isinstance(obj, dict):
        if set(obj) != {"flattened_tensor", "metadata"}:
            raise ValueError(f"a flattened bucket has the keys flattened_tensor and metadata, not {sorted(obj)}")
        return obj
    return check_named_tensors(obj)


def check_named_tensors(obj: Any) -> Any:
    """`obj` if it is a list of (str, tensor) pairs; else ValueError naming the first entry
    that is not."""
    import torch

    if not isinstance(obj, (list, tuple)):
        raise ValueError(f"a weight payload is a list of (name, tensor) pairs or a flattened bucket, not "
                         f"{type(obj).__name__}")
    for i, pair in enumerate(obj):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], str)
                and isinstance(pair[1], torch.Tensor)):
            raise ValueError(f"entry {i} of the weight payload is not a (name, tensor) pair")
    return obj


def check_flat_layout(flat: Any, layout: Any) -> None:
    """ValueError naming the first entry of a flattened bucket's `layout` that does not
    describe bytes of `flat` (a 1-D uint8 tensor): a name that is not a string, a dtype that
    is not a torch dtype, a shape of negative or non-integer sizes, a byte range outside the
    buffer, of another size than its shape and dtype give, or not aligned to its element size."""
    import math

    import torch

    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError("a flattened bucket's flattened_tensor must be a 1-D uint8 tensor, not "
                         + (f"{flat.dtype} of shape {tuple(flat.shape)}" if isinstance(flat, torch.Tensor)
                            else type(flat).__name__))
    if not isinstance(layout, (list, tuple)):
        raise ValueError(f"a flattened bucket's metadata must be a list, not {type(layout).__name__}")
    size = flat.numel()
    for i, m in enumerate(layout):
        name = getattr(m, "name", None)
        where = f"metadata entry {i} ({name!r})"
        if not isinstance(name, str):
            raise ValueError(f"{where}: its name must be a string")
        dtype, shape = getattr(m, "dtype", None), getattr(m, "shape", None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{where}: dtype {dtype!r} is not a torch dtype")
        if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"{where}: shape {shape!r} is not a list of sizes")
        start, end = getattr(m, "start_idx", None), getattr(m, "end_idx", None)
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= size):
            raise ValueError(f"{where}: bytes [{start}, {end}) run outside the {size}-byte buffer")
        if end - start != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{where}: bytes [{start}, {end}) do not hold shape {list(shape)} of {dtype}")
        if start % dtype.itemsize:
            raise ValueError(f"{where}: offset {start} is not a multiple of {dtype}'s {dtype.itemsize} bytes")


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def bucket_metadata(bucket: Sequence[tuple[str, Any]]) -> tuple[list[str], list[str], list[list[int]]]:
    return ([n for n, _ in bucket], [dtype_name(t.dtype) for _, t in bucket], [list(t.shape) for _, t in bucket])


def order_for_flattening(bucket: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Largest element size first, so every tensor's byte offset in the flattened bucket is
    a multiple of its element size (the receiver checks alignment)."""
    return sorted(bucket, key=lambda nt: -nt[1].element_size())


def _new_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               backend: str, timeout_s: float, store: Any = None) -> Any:
    """A process group outside torch's default group, rendezvousing over TCP exactly like
    SGLang's `init_weights_update_group` (tcp:// store, keys prefixed by the group name).
    `store`: one this process already serves at `master_port` (`parallel_state.host_store`)."""
    import inspect

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    if store is None:
        url = f"tcp://{master_address}:{master_port}"
        store, rank, world_size = next(dist.rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = dist.PrefixStore(group_name, store)
    params = inspect.signature(c10d._new_process_group_helper).parameters
    kwargs: dict[str, Any] = {"group_name": group_name, "timeout": timeout}  # also a store key prefix
    kwargs["backend_options" if "backend_options" in params else "pg_options"] = None
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], dist.Backend(backend), store, **kwargs)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def init_update_group(master_address: str, master_port: int, world_size: int, *,
                      group_name: str = "weight_update_group", backend: str = "nccl",
                      timeout_s: float = 600.0, store: Any = None) -> Any:
    """Trainer side (rank 0) of the weight broadcast group; blocks until every engine rank
    has joined (run it while the engines' /init_weights_update_group calls are pending).
    `store`: the one `parallel_state.host_store` opened at `master_port`, else rank 0 serves one."""
    return _new_group(master_address, master_port, 0, world_size, group_name, backend, timeout_s, store)


def join_update_group(master_address: str, master_port: int, rank: int, world_size: int, *,
                      group_name: str = "weight_update_group", backend: str = "gloo",
                      timeout_s: float = 600.0) -> Any:
    """Engine side (used by the embedded server; SGLang has its own)."""
    return _new_group(master_address, master_port, rank, world_size, group_name, backend, timeout_s)


def _broadcast(t: Any, group: Any) -> None:
    import torch.distributed as dist

    dist.broadcast(t, group=group, group_src=0)


def broadcast_bucket(group: Any, bucket: Sequence[tuple[str, Any]], *, flattened: bool = False) -> None:
    """Trainer side: send one bucket from rank 0, in bucket order (one broadcast per tensor,
    or one uint8 broadcast of the concatenated bytes when `flattened`; pass the bucket
    through `order_for_flattening` first, and the same order to the engines)."""

    if flattened:
        _broadcast(_flat_bytes([t for _, t in bucket]), group)
        return
    for _, t in bucket:
        _broadcast(t.detach().contiguous(), group)


def receive_bucket(group: Any, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]], *,
                   flattened: bool = False, device: str = "cpu") -> list[tuple[str, Any]]:
    """Engine side of `broadcast_bucket`."""

    import torch

    dts = [getattr(torch, d) for d in dtypes]
    if flattened:
        layout = flat_layout(zip(names, shapes, dts))
        flat = torch.empty(layout[-1].end_idx if layout else 0, dtype=torch.uint8, device=device)
        _broadcast(flat, group)
        return [(n, t.clone()) for n, t in unflatten_bucket({"flattened_tensor": flat, "metadata": layout})]
    out = []
    for n, s, d in zip(names, shapes, dts):
        t = torch.empty(tuple(s), dtype=d, device=device)
        _broadcast(t, group)
        out.append((n, t))
    return out


def destroy_update_group(group: Any) -> None:
    import torch.distributed as dist

    try:
        dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001 (not registered with the default group's bookkeeping)
        pass


async def init_weights_update_group_all(engines: Sequence[Any], master_address: str, master_port: int | None = None,
                                        *, tp_sizes: Sequence[int] | None = None,
                                        group_name: str = "weight_update_group", backend: str = "nccl",
                                        timeout_s: float = 600.0) -> Any:
    """Trainer rank 0 + every engine's ranks in one group: engine i gets rank offset
    1 + sum(tp of engines before it). Returns the trainer's group handle. With no
    `master_port`, rank 0 serves the rendezvous on a port the OS gives it."""
    store = None
    if master_port is None:  # served before any engine is told the port: none can take it
        from ..training.parallel_state import host_store

        store = host_store(timeout_s)
        master_port = store.port
    tp_sizes = list(tp_sizes or [getattr(e, "tp_size", 1) for e in engines])
    world = 1 + sum(tp_sizes)
    offsets = [1 + sum(tp_sizes[:i]) for i in range(len(engines))]
    calls = [asyncio.ensure_future(e.init_weights_update_group(master_address, master_port, off, world,
                                                               group_name=group_name, backend=backend))
             for e, off in zip(engines, offsets)]
    group = await asyncio.to_thread(init_update_group, master_address, master_port, world, group_name=group_name,
                                    backend=backend, timeout_s=timeout_s, store=store)
    await asyncio.gather(*calls)
    return group


async def update_weights_distributed(engines: Sequence[Any], group: Any, named_tensors: Sequence[tuple[str, Any]], *,
                                     bucket_bytes: int | None, group_name: str = "weight_update_group",
                                     flattened: bool = False, weight_version: str | None = None,
                                     final: bool = True) -> None:
    """Per bucket: every engine's /update_weights_from_distributed call goes out, then the
    trainer broadcasts the bucket, then the calls are awaited. The last bucket of a `final`
    call flushes the engines' caches and sets their `weight_version` (a caller streaming
    one bucket per call passes final=False until the last)."""
    buckets = list(bucketize(named_tensors, bucket_bytes))
    for i, bucket in enumerate(buckets):
        if flattened:
            bucket = order_for_flattening(bucket)
        names, dtypes, shapes = bucket_metadata(bucket)
        last = final and i == len(buckets) - 1
        calls = [asyncio.ensure_future(e.update_weights_from_distributed(
            names, dtypes, shapes, group_name=group_name, flush_cache=last,
            weight_version=weight_version if last else None,
            load_format="flattened_bucket" if flattened else None)) for e in engines]
        try:
            await asyncio.to_thread(broadcast_bucket, group, bucket, flattened=flattened)
        finally:
            await asyncio.gather(*calls)


def with_last(items: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """(item, is_last) pairs, one item of lookahead: a streamed sync marks its last bucket
    (the one that flushes the cache and carries the weight version) without knowing the
    count in advance."""
    it = iter(items)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield prev, False
        prev = item
    yield prev, True


def payload_sources(trainer_devices: Sequence[int], rollout_device_offset: int, num_engines: int,
                    tp_size: int) -> list[list[int]]:
    """For colocated engines, the trainer rank that serializes each engine TP rank's payload:
    the rank on the same device (engine i's rank k sits on device offset + i * tp + k).
    Raises naming the device when an engine rank has no trainer rank beside it."""
    by_device = {d: r for r, d in enumerate(trainer_devices)}
    out = []
    for i in range(num_engines):
        ranks = []
        for k in range(tp_size):
            device = rollout_device_offset + i * tp_size + k
            if device not in by_device:
                raise ValueError(f"engine {i} rank {k} is on device {device}, where no trainer rank runs; "
                                 "colocated weight sync needs a trainer rank on every engine device")
            ranks.append(by_device[device])
        out.append(ranks)
    return out


def gather_rank_payloads(mine: str | None, sources: Sequence[Sequence[int]], group: Any = None) -> list[list[str]] | None:
    """Collective over `group` (default: the whole world): every rank passes its own
    serialized payload (None when no engine rank reads it); rank 0 gets, per engine, the
    payloads of `sources[i]` in TP-rank order, and every other rank None."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    if dist.get_world_size(group) == 1:  # nothing to gather (a gather of objects syncs the device)
        gathered: list[Any] | None = [mine]
    else:
        gathered = [None] * dist.get_world_size(group) if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0, group=group)
    if gathered is None:
        return None
    out = []
    for i, ranks in enumerate(sources):
        payloads = [gathered[r] for r in ranks]
        missing = [r for r, pl in zip(ranks, payloads) if pl is None]
        if missing:
            raise RuntimeError(f"engine {i}: trainer ranks {missing} sent no weight payload")
        out.append(payloads)
    return out

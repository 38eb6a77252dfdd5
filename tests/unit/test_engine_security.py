"""What an engine endpoint accepts as weights: payloads unpickled with exact globals only
(known gadgets refused before anything runs), flattened buckets whose metadata must describe
the buffer, payload bytes that are base64 of an archive."""

from __future__ import annotations

import os
import pickle
import pickletools
import types

import pytest
import torch

from vlmrl.rollout import weights
from vlmrl.rollout.weights import check_flat_layout, flatten_bucket, ipc_global, load_ipc, serialize_ipc


class _Gadget:
    """Pickles as a call of `fn(*args)`: what a hostile payload smuggles in."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _payload(gadget) -> bytes:
    return pickle.dumps([("model.norm.weight", gadget)])


def _raw(module: str, name: str, arg: str) -> bytes:
    """A protocol-0 pickle calling module.name(arg), named exactly as given (a hand-made
    payload need not use the name pickle would write for the object)."""
    return f"c{module}\n{name}\n(V{arg}\ntR.".encode()


def test_gadgets_are_refused_before_anything_runs(tmp_path):
    import torch.hub
    import torch.utils.cpp_extension

    marker = tmp_path / "ran"
    cases = {
        "torch.save": _payload(_Gadget(torch.save, {"x": 1}, str(marker))),
        "torch.load": _payload(_Gadget(torch.load, str(marker))),
        "load_inline": _payload(_Gadget(torch.utils.cpp_extension.load_inline, "evil", "int x;")),
        "torch.hub.load": _payload(_Gadget(torch.hub.load, "owner/repo", "model")),
        "os.system": _payload(_Gadget(os.system, f"touch {marker}")),
        "builtins.getattr": _raw("builtins", "getattr", "x"),
        "builtins.__import__": _raw("builtins", "__import__", "os"),
        "torch.save by its public name": _raw("torch", "save", str(marker)),
        "torch.storage.UntypedStorage.from_file": _raw("torch.storage", "UntypedStorage.from_file", str(marker)),
        "a torch attribute that is no dtype": _raw("torch", "_C", "x"),
    }
    for what, data in cases.items():
        with pytest.raises(pickle.UnpicklingError, match="a weight payload may not refer to"):
            load_ipc(data)
        assert not marker.exists(), what


def test_admitted_globals_only_build_tensors_and_their_metadata():
    assert ipc_global("torch", "bfloat16") is torch.bfloat16
    assert ipc_global("types", "SimpleNamespace") is types.SimpleNamespace
    with pytest.raises(pickle.UnpicklingError, match="torch.Generator"):
        ipc_global("torch", "Generator")
    # admitted globals in a shape no payload has: refused after unpickling, naming what it is
    with pytest.raises(ValueError, match="not dtype"):
        load_ipc(pickle.dumps(torch.bfloat16))
    with pytest.raises(ValueError, match="entry 0 of the weight payload is not a .name, tensor. pair"):
        load_ipc(pickle.dumps([("w", torch.Size([2]))]))


def test_a_real_ipc_payload_names_only_admitted_globals(monkeypatch):
    """serialize_ipc's bytes for a flattened bucket, with torch's CUDA reduction in place of
    the CPU one (what a GPU trainer sends): every global it names is admitted."""
    from torch.multiprocessing import reductions

    def cuda_reduction(t):
        storage = t._typed_storage()
        return reductions.rebuild_cuda_tensor, (
            type(t), t.size(), t.stride(), t.storage_offset(), type(storage), t.dtype, 0, b"h" * 64,
            storage.nbytes(), 0, t.requires_grad, b"r" * 16, 0, b"e" * 64, True)

    from multiprocessing.reduction import ForkingPickler

    # serialize_ipc registers torch's reductions with ForkingPickler, which would keep the CUDA
    # one for the rest of this process (a later spawn of a rank would pickle CPU tensors as
    # CUDA handles): the registrations go into a copy that the teardown drops
    monkeypatch.setattr(ForkingPickler, "_extra_reducers", dict(ForkingPickler._extra_reducers))
    monkeypatch.setattr(reductions, "reduce_tensor", cuda_reduction)
    monkeypatch.setattr(weights, "_device_uuid", lambda i: "GPU-00000000-0000-0000-0000-000000000000")
    bucket = [("a.weight", torch.randn(3, 4, dtype=torch.bfloat16)), ("b.bias", torch.randn(5)),
              ("c.index", torch.arange(4))]
    data = serialize_ipc(flatten_bucket(bucket))
    seen = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            found = ipc_global(module, name)  # raises for anything not admitted
            return (lambda *a: torch.empty(0, dtype=torch.uint8)) if name == "rebuild_cuda_tensor" else found

    Recorder(__import__("io").BytesIO(data)).load()
    assert ("torch.multiprocessing.reductions", "rebuild_cuda_tensor") in seen
    assert ("types", "SimpleNamespace") in seen
    assert any(op.name in ("GLOBAL", "STACK_GLOBAL") for op, _, _ in pickletools.genops(data))


def test_flattened_bucket_metadata_must_describe_the_buffer():
    bucket = flatten_bucket([("a", torch.randn(2, 3)), ("b", torch.ones(4, dtype=torch.bfloat16))])
    flat, meta = bucket["flattened_tensor"], bucket["metadata"]
    check_flat_layout(flat, meta)  # as made: fine

    def changed(i, **kw):
        m = [types.SimpleNamespace(**vars(x)) for x in meta]
        vars(m[i]).update(kw)
        return m

    bad = {
        "run outside the 32-byte buffer": changed(1, end_idx=40),
        "do not hold shape": changed(0, shape=torch.Size([3, 3])),
        "is not a torch dtype": changed(0, dtype="float32"),
        "its name must be a string": changed(0, name=7),
        "is not a list of sizes": changed(0, shape=[2, -3]),
        "is not a multiple of": changed(1, start_idx=23, end_idx=31),
    }
    for message, layout in bad.items():
        with pytest.raises(ValueError, match=message):
            check_flat_layout(flat, layout)
    with pytest.raises(ValueError, match="1-D uint8"):
        check_flat_layout(flat.view(torch.int16), meta)
    with pytest.raises(ValueError, match="run outside"):
        weights.unflatten_bucket({"flattened_tensor": flat[:10], "metadata": meta})


def test_truncated_or_foreign_payloads_are_named(tmp_path):
    from vlmrl.rollout.weights import decode_payload, encode_torch_payload

    good = encode_torch_payload([("w", torch.ones(2))])
    assert decode_payload(good)[0][0] == "w"
    with pytest.raises(ValueError, match="not base64"):
        decode_payload(good[:-3])
    with pytest.raises(ValueError, match="not a torch.save archive"):
        import base64

        decode_payload(base64.b64encode(base64.b64decode(good)[:200]).decode())

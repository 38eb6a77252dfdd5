"""Rollout on GPUs: the embedded engine on CUDA, CUDA IPC weight payloads and the NCCL weight
update group (the real SGLang server: test_sglang_gpu.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


def _prompt(proc, text: str, n_images: int) -> str:
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    return proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)


def _image() -> str:
    from PIL import Image, ImageDraw

    from vlmrl.data.images import encode_data_uri as encode_image_data_uri

    img = Image.new("RGB", (112, 84), (200, 30, 30))
    ImageDraw.Draw(img).rectangle([20, 20, 60, 60], fill=(20, 240, 20))
    return encode_image_data_uri(img)


@pytest.fixture(scope="module")
def cuda_engine(tiny_checkpoint, tiny_config):
    from vlmrl.rollout.embedded import EmbeddedEngine

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    d = tiny_config.data
    return EmbeddedEngine(tiny_checkpoint, device="cuda", dtype="float32", min_pixels=d.min_pixels,
                          max_pixels=d.max_pixels)


def test_embedded_cuda_logprobs_and_batch_invariance(cuda_engine):
    from vlmrl.rollout.embedded import load_image
    from vlmrl.rollout.protocol import GenerateRequest, SamplingParams

    e = cuda_engine
    img = _image()
    sp = SamplingParams(temperature=0.8, max_new_tokens=16, seed=1)
    reqs = [GenerateRequest(text=_prompt(e.processor, "How many squares?", 1), images=(img,), sampling=sp),
            GenerateRequest(text=_prompt(e.processor, "A longer text-only question about the triangle", 0),
                            sampling=sp)]
    out = e.generate_sync(reqs)
    for req, res in zip(reqs, out):
        images = [load_image(s) for s in req.images] or None
        enc = e.processor(text=[req.text], images=images, return_tensors="pt").to("cuda")
        full = torch.cat([enc["input_ids"], torch.tensor([res.output_ids[:-1]], device="cuda")], 1)
        kw = {}
        if req.images:
            kw = dict(pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"],
                      mm_token_type_ids=(full == e.image_token_id).long())
        e.model.model.rope_deltas = None
        with torch.no_grad():
            logits = e.model(input_ids=full, attention_mask=torch.ones_like(full), **kw).logits[0].float()
        L = enc["input_ids"].shape[1]
        ref = torch.log_softmax(logits[L - 1:] / 0.8, -1)
        ref = [float(ref[j, t]) for j, t in enumerate(res.output_ids)]
        assert max(abs(a - b) for a, b in zip(ref, res.logprobs)) <= 1e-4
        solo = e.generate_sync([req])[0]
        assert solo.output_ids == res.output_ids
        assert max(abs(a - b) for a, b in zip(solo.logprobs, res.logprobs)) <= 1e-4


def test_embedded_cuda_release_frees_the_weights(cuda_engine):
    """Colocated training's memory hand-over on a GPU: releasing the weights moves them off
    the device (its allocation drops by their size); resuming brings them back unchanged."""

    e = cuda_engine
    weights = sum(p.numel() * p.element_size() for p in e.model.parameters())
    before = {k: v.detach().clone() for k, v in e.model.state_dict().items()}
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    asyncio.run(e.release_memory_occupation())
    assert torch.cuda.memory_allocated() <= allocated - 0.9 * weights
    assert all(p.device.type == "cpu" for p in e.model.parameters())
    asyncio.run(e.resume_memory_occupation(["weights"]))
    asyncio.run(e.resume_memory_occupation(["cuda_graph", "kv_cache"]))
    assert all(p.device.type == "cuda" for p in e.model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in e.model.state_dict().items())
    assert asyncio.run(e.health())


_IPC_READER = """
import sys, torch
from vlmrl.rollout.weights import decode_payload, load_ipc
data = open(sys.argv[1], "rb").read()
named = decode_payload(data, flattened=True) if sys.argv[2] == "flat" else load_ipc(data)
print(len({t.untyped_storage().data_ptr() for _, t in named}), "storages")
print(";".join(f"{n}:{float(t.double().sum()):.6f}:{t.device}" for n, t in sorted(named)))
"""


@pytest.mark.parametrize("form", ["pairs", "flat", "views"])
def test_serialize_ipc_roundtrip_across_processes(tmp_path, form):
    """(name, tensor) pairs, the flattened bucket the loop sends to the embedded server and to
    SGLang's own loaders (one IPC handle per bucket, load_format 'flattened_bucket'), and the
    pairs of views into one flattened copy it sends to vlmrl's loader in SGLang (one storage
    opened by the reader), read by another process on the same GPU."""
    import base64

    from vlmrl.rollout.weights import flatten_bucket, serialize_ipc, serialize_payload

    dev = torch.cuda.device_count() - 1  # the reader sees this GPU as cuda:0
    a = torch.arange(12, dtype=torch.float32, device=f"cuda:{dev}").view(3, 4)
    b = torch.ones(5, dtype=torch.bfloat16, device=f"cuda:{dev}") * 2
    named = [("visual.x", b), ("model.layers.0.w", a)]
    path = tmp_path / "payload.bin"
    keep: list = []
    if form == "views":
        path.write_bytes(base64.b64decode(serialize_payload(named, "ipc", keep, flattened=False)))
    else:
        path.write_bytes(serialize_ipc(flatten_bucket(named) if form == "flat" else named))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(dev)}
    out = subprocess.run([sys.executable, "-c", _IPC_READER, str(path), form], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    storages, sums = out.stdout.strip().splitlines()[-2:]
    assert sums == "model.layers.0.w:66.000000:cuda:0;visual.x:10.000000:cuda:0"
    assert storages == ("2 storages" if form == "pairs" else "1 storages")


_RECEIVER = """
import sys, torch
from vlmrl.rollout.weights import join_update_group, receive_bucket
port = int(sys.argv[1])
torch.cuda.set_device(0)
g = join_update_group("127.0.0.1", port, 1, 2, group_name="vlmrl-gpu-test", backend="nccl", timeout_s=120)
for flat in (False, True):
    named = receive_bucket(g, ["a", "b"], ["float32", "bfloat16"], [[3, 4], [5]], flattened=flat, device="cuda")
    print(flat, ";".join(f"{n}:{float(t.double().sum()):.3f}" for n, t in named), flush=True)
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs")
def test_nccl_update_group_broadcast(tmp_path):
    from vlmrl.rollout.weights import broadcast_bucket, init_update_group, order_for_flattening
    from vlmrl.training.parallel_state import host_store

    store = host_store(120)  # rank 0 serves the rendezvous before the receiver hears its port
    port = store.port
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _RECEIVER, str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    torch.cuda.set_device(0)
    group = init_update_group("127.0.0.1", port, 2, group_name="vlmrl-gpu-test", backend="nccl", timeout_s=120,
                              store=store)
    bucket = [("a", torch.arange(12, dtype=torch.float32, device="cuda").view(3, 4)),
              ("b", torch.full((5,), 3.0, dtype=torch.bfloat16, device="cuda"))]
    broadcast_bucket(group, bucket)
    broadcast_bucket(group, order_for_flattening(bucket), flattened=True)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    assert out.splitlines() == ["False a:66.000;b:15.000", "True a:66.000;b:15.000"]

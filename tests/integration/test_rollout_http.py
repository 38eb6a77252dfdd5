"""The SGLang client driving the embedded engine's HTTP server on loopback (real HTTP):
generation with images and logprobs, SGLang's reply shapes, errors and retries, weight
updates through /update_weights_from_tensor and /update_weights_from_distributed (gloo),
memory release / resume, and `python -m vlmrl.rollout.serve` as a subprocess; and the server
speaking each SGLang release vlmrl has a contract for as that release does: its sampling
checks, /v1/loads and /server_info, weight-update sessions, and the calls SGLang dies on
(refused here, counted, and the server keeps serving)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import string
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

from vlmrl.contracts.sglang_contract import known_versions, load_contract
from vlmrl.contracts.sglang_contract import protocol as sglang_protocol
from vlmrl.data.images import encode_data_uri as encode_image_data_uri
from vlmrl.models.names import to_checkpoint_name
from vlmrl.rollout.client import HTTPEngine
from vlmrl.rollout.embedded import EmbeddedEngine
from vlmrl.rollout.protocol import MEMORY_TAGS, EngineError, GenerateRequest, SamplingParams
from vlmrl.rollout.server import ThreadedServer

VERSIONS = known_versions()

TOL = 1e-5


def _image(w: int, h: int, color: tuple[int, int, int]) -> str:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (w, h), color)
    ImageDraw.Draw(img).ellipse([w // 5, h // 5, w // 2, h // 2], fill=(30, 255 - color[1], 90))
    return encode_image_data_uri(img)


def _prompt(tokenizer_or_proc, text: str, n_images: int = 0) -> str:
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    return tokenizer_or_proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                 tokenize=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 60, headers: dict | None = None) -> tuple[int, dict | list | None]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw or b"null")
        except ValueError:  # aiohttp's own 404 page is text
            return e.code, {"text": raw.decode(errors="replace")}


def _get(url: str, timeout: float = 60, headers: dict | None = None) -> tuple[int, dict | list | None]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None


@pytest.fixture(scope="module")
def engine(tiny_checkpoint, tiny_config) -> EmbeddedEngine:
    d = tiny_config.data
    return EmbeddedEngine(tiny_checkpoint, min_pixels=d.min_pixels, max_pixels=d.max_pixels)


@pytest.fixture(scope="module")
def server(engine):
    with ThreadedServer(engine) as srv:
        yield srv


@pytest.fixture(scope="module")
def servers(engine):
    """One server per SGLang release vlmrl has a contract for, all fronting the same engine."""
    made = {v: ThreadedServer(engine, sglang_version=v) for v in VERSIONS}
    yield made
    for srv in made.values():
        srv.stop()


def _run(coro):
    return asyncio.run(coro)


async def _in_session(client: HTTPEngine, coro) -> None:
    """`coro` inside a weight-update session where the server's release has them."""
    async with client.weight_update_session():
        await coro


def test_client_generate_with_images_matches_engine(engine, server):
    img = _image(112, 84, (200, 20, 20))
    reqs = [GenerateRequest(text=_prompt(engine.processor, f"How many circles? {i}", 1), images=(img,),
                            sampling=SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=10, seed=i))
            for i in range(6)]

    async def go():
        client = HTTPEngine(server.url, max_concurrency=4, max_retries=1)
        try:
            return await client.generate(reqs)
        finally:
            await client.close()

    out = _run(go())
    local = engine.generate_sync(reqs)
    for a, b in zip(out, local):
        assert a.output_ids == b.output_ids and len(a.logprobs) == len(a.output_ids) == 10
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= TOL
        assert a.prompt_ids == b.prompt_ids and a.prompt_tokens == len(a.prompt_ids)
        assert a.finish_reason == "length" and a.truncated


def test_reply_shapes_single_and_batch(engine, server):
    img = _image(56, 56, (0, 200, 0))
    text = _prompt(engine.processor, "area?", 1)
    status, single = _post(server.url + "/generate", {
        "text": text, "image_data": img, "return_logprob": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 5, "stop_token_ids": [2]}})
    assert status == 200 and set(single) >= {"text", "output_ids", "meta_info"}
    meta = single["meta_info"]
    assert meta["completion_tokens"] == len(single["output_ids"]) == len(meta["output_token_logprobs"])
    assert all(len(e) == 3 and e[1] == t and e[2] is None and e[0] <= 0
               for e, t in zip(meta["output_token_logprobs"], single["output_ids"]))
    assert meta["finish_reason"]["type"] in ("stop", "length") and meta["prompt_tokens"] > 10

    status, batch = _post(server.url + "/generate", {
        "text": [text, _prompt(engine.processor, "no image")], "image_data": [[img], None],
        "return_logprob": [True, False], "sampling_params": {"temperature": 0, "max_new_tokens": 5}})
    assert status == 200 and isinstance(batch, list) and len(batch) == 2
    assert batch[0]["output_ids"] == single["output_ids"][:5]
    assert "output_token_logprobs" not in batch[1]["meta_info"]

    ids = engine.tokenizer(_prompt(engine.processor, "no image"))["input_ids"]
    status, by_ids = _post(server.url + "/generate", {"input_ids": ids, "sampling_params": {
        "temperature": 0, "max_new_tokens": 5}, "return_prompt_token_ids": True})
    assert status == 200 and by_ids["output_ids"] == batch[1]["output_ids"] and by_ids["prompt_token_ids"] == ids


def test_errors_are_not_retried_but_transport_failures_are(engine, server):
    async def go():
        client = HTTPEngine(server.url, max_retries=3, backoff_s=0.01)
        bad = GenerateRequest(text="no placeholder", images=(_image(28, 28, (1, 2, 3)),))
        with pytest.raises(EngineError) as ei:
            await client.generate([bad])
        assert ei.value.status == 400 and not ei.value.retryable and client.stats["retries"] == 0
        await client.close()

        dead = HTTPEngine(f"http://127.0.0.1:{_free_port()}", max_retries=2, backoff_s=0.01)
        with pytest.raises(EngineError) as ei:
            await dead.generate([GenerateRequest(text="x", sampling=SamplingParams(max_new_tokens=1))])
        assert ei.value.retryable and dead.stats["retries"] >= 2
        assert not await dead.health()
        await dead.close()

    _run(go())


def test_waiting_for_a_server_takes_a_health_answer_slower_than_the_poll():
    """SGLang 0.5.17 answers /health only once its scheduler has reported after the check came
    in, which it looks at once a second: the answer takes a second or more. A wait that gave
    each poll its poll interval (1 s) never saw a healthy server (a run on an H100, 2026-12-07,
    waited 9 minutes for a server that curl found up)."""
    from aiohttp import web

    async def go():
        calls = []

        async def health(request):
            calls.append(time.monotonic())
            await asyncio.sleep(1.3)  # SGLang's answer: after the next once-a-second look
            return web.Response(status=200)

        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        port = _free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        client = HTTPEngine(f"http://127.0.0.1:{port}", max_retries=0)
        try:
            t0 = time.monotonic()
            await client.wait_healthy(6.0, poll_s=0.5)
            assert time.monotonic() - t0 < 3.0 and len(calls) == 1, calls
        finally:
            await client.close()
            await runner.cleanup()

    _run(go())


def _perturbed_checkpoint(src: str, dst: Path) -> tuple[Path, list[tuple[str, torch.Tensor]]]:
    """A copy of the tiny checkpoint with new weights; returns (dir, named HF tensors)."""
    import transformers

    shutil.copytree(src, dst)
    model = transformers.AutoModelForImageTextToText.from_pretrained(src)
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    model.save_pretrained(dst)
    named = [(to_checkpoint_name(k), v.detach().clone()) for k, v in model.state_dict().items()]
    return dst, named


def test_weight_update_through_http_matches_fresh_model(engine, server, tiny_checkpoint, tiny_config, tmp_path):
    new_dir, named = _perturbed_checkpoint(tiny_checkpoint, tmp_path / "new")
    img = _image(84, 112, (30, 30, 220))
    reqs = [GenerateRequest(text=_prompt(engine.processor, "What is the value of x?", 1), images=(img,),
                            sampling=SamplingParams(temperature=0.0, max_new_tokens=8)),
            GenerateRequest(text=_prompt(engine.processor, "Compute the perimeter."),
                            sampling=SamplingParams(temperature=0.8, max_new_tokens=8, seed=5))]
    original = [(to_checkpoint_name(k), v.clone()) for k, v in engine.model.state_dict().items()]
    before = engine.generate_sync(reqs)

    async def update(tensors, version):
        client = HTTPEngine(server.url)
        try:
            await client.update_weights_from_tensor(tensors, bucket_bytes=256 << 10, weight_version=version)
            return await client.generate(reqs), (await client.get_model_info())["weight_version"]
        finally:
            await client.close()

    try:
        after, version = _run(update(named, "step-1"))
        assert version == "step-1" and all(r.weight_version == "step-1" for r in after)
        d = tiny_config.data
        fresh = EmbeddedEngine(str(new_dir), min_pixels=d.min_pixels, max_pixels=d.max_pixels)
        ref = fresh.generate_sync(reqs)
        for a, b, old in zip(after, ref, before):
            assert a.output_ids == b.output_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= TOL
            assert max(abs(x - y) for x, y in zip(a.logprobs, old.logprobs)) > 1e-3
    finally:
        _run(update(original, "0"))
    assert engine.generate_sync(reqs)[0].output_ids == before[0].output_ids


_TRAINER = """
import asyncio, sys
from safetensors.torch import load_file
from vlmrl.rollout.client import HTTPEngine
from vlmrl.rollout.weights import init_weights_update_group_all, update_weights_distributed

url, path, flattened = sys.argv[1], sys.argv[3], sys.argv[4] == "1"
port = int(sys.argv[2]) or None  # 0: rank 0 serves the rendezvous on a port the OS gives it
named = sorted(load_file(path).items())

async def main():
    client = HTTPEngine(url)
    group = await init_weights_update_group_all([client], "127.0.0.1", port, backend="gloo",
                                                group_name="vlmrl-test", timeout_s=60)
    async with client.weight_update_session():  # where the server's release has them
        await update_weights_distributed([client], group, named, bucket_bytes=512 << 10, group_name="vlmrl-test",
                                         flattened=flattened, weight_version="dist")
    await client.destroy_weights_update_group("vlmrl-test")
    await client.close()

asyncio.run(main())
print("trainer done")
"""


@pytest.mark.parametrize("flattened", [False, True], ids=["per-tensor", "flattened"])
def test_weight_update_from_distributed_over_gloo(engine, server, tiny_checkpoint, tmp_path, flattened):
    """The separate-GPU path, run over gloo on CPU: a trainer process (rank 0) and the
    embedded server (rank 1) form the group, then per bucket the server receives
    /update_weights_from_distributed while the trainer broadcasts."""
    from safetensors.torch import load_file

    from vlmrl.models.names import to_module_name

    new_dir, _ = _perturbed_checkpoint(tiny_checkpoint, tmp_path / "new")
    original = [(to_checkpoint_name(k), v.clone()) for k, v in engine.model.state_dict().items()]
    req = GenerateRequest(text=_prompt(engine.processor, "Find x."),
                          sampling=SamplingParams(temperature=0.0, max_new_tokens=6))
    before = engine.generate_sync([req])[0]
    try:
        # "0": trainer rank 0 serves the rendezvous on a port the OS gives it, as the run does
        proc = subprocess.run([sys.executable, "-c", _TRAINER, server.url, "0",
                               str(new_dir / "model.safetensors"), "1" if flattened else "0"],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "trainer done" in proc.stdout, proc.stdout + proc.stderr
        sd = engine.model.state_dict()
        sent = load_file(str(new_dir / "model.safetensors"))
        assert len(sent) > 50
        for n, t in sent.items():
            assert torch.equal(sd[to_module_name(n)], t), n
        assert engine.weight_version == "dist"
    finally:
        _run(engine.update_weights_from_tensor(original, weight_version="0"))
    assert engine.generate_sync([req])[0].output_ids == before.output_ids


def test_control_endpoints(engine, server):
    async def go():
        client = HTTPEngine(server.url, max_retries=0)
        try:
            assert await client.health() and await client.health_generate()
            info = await client.get_model_info()
            assert info["is_generation"] and info["model_path"] == engine.model_path
            await client.release_memory_occupation()
            # alive while released: asked through the load report, not SGLang's token-running /health
            assert await client.health() and _get(server.url + "/health")[0] == 503
            with pytest.raises(EngineError):
                await client.generate([GenerateRequest(text="x", sampling=SamplingParams(max_new_tokens=1))])
            # no tags released everything, CUDA graphs included (SGLang's default)
            assert engine.released_tags == set(MEMORY_TAGS) == {"weights", "kv_cache", "cuda_graph"}
            await client.resume_memory_occupation(["weights"])  # SGLang's tags, in its JSON body
            assert client.held == {"kv_cache", "cuda_graph"} and engine.released_tags == {"kv_cache", "cuda_graph"}
            assert _get(server.url + "/health")[0] == 503
            await client.resume_memory_occupation(["kv_cache"])
            assert _get(server.url + "/health")[0] == 503  # a graph replay would read freed memory: refused
            with pytest.raises(EngineError, match="released"):
                await client.generate([GenerateRequest(text="x", sampling=SamplingParams(max_new_tokens=1))])
            with pytest.raises(EngineError, match="not released"):  # resuming twice fails, as in SGLang
                await client.resume_memory_occupation(["kv_cache"])
            await client.resume_memory_occupation(["cuda_graph"])
            assert await client.health()
            await client.release_memory_occupation([])  # an empty list means all tags too
            assert engine.released_tags == set(MEMORY_TAGS)
            await client.resume_memory_occupation(None)
            assert await client.health()
            with pytest.raises(ValueError, match="unknown memory tags"):
                await client.release_memory_occupation(["activations"])
            req = urllib.request.Request(server.url + "/release_memory_occupation", method="POST",
                                         data=json.dumps({"tags": ["activations"]}).encode(),
                                         headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as err:  # the server checks them too
                await asyncio.to_thread(urllib.request.urlopen, req)
            assert err.value.code == 400 and engine.released_tags == set()
            await client.flush_cache()
        finally:
            await client.close()

    _run(go())


def test_serve_module_answers_generate_with_image(tiny_checkpoint, tiny_config, engine, tmp_path):
    """`python -m vlmrl.rollout.serve` with a key file: callers without the key get 401 (the
    liveness probe excepted), callers with it are served."""
    d = tiny_config.data
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    from vlmrl.rollout.auth import KEY_FILE, bearer, run_key

    key = run_key(tmp_path)
    auth = bearer(key)
    cmd = [sys.executable, "-m", "vlmrl.rollout.serve", "--model", tiny_checkpoint, "--port", "0",
           "--min-pixels", str(d.min_pixels), "--max-pixels", str(d.max_pixels), "--sglang-version", VERSIONS[0],
           "--api-key-file", str(tmp_path / KEY_FILE)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                            cwd=str(Path(__file__).resolve().parents[2]))
    try:
        deadline = time.monotonic() + 120
        lines = []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            lines.append(line)
            if "listening on" in line:
                break
        assert any("listening on" in x for x in lines), "".join(lines)
        assert f"(SGLang {VERSIONS[0]} protocol)" in lines[-1] and key not in "".join(lines)
        port = int(re.search(r"listening on http://127\.0\.0\.1:(\d+)", lines[-1]).group(1))  # its OS-given port
        assert _get(f"http://127.0.0.1:{port}/server_info")[0] == 401
        assert _get(f"http://127.0.0.1:{port}/health")[0] == 200
        assert _get(f"http://127.0.0.1:{port}/server_info", headers=auth)[1]["version"] == VERSIONS[0]
        status, reply = _post(f"http://127.0.0.1:{port}/generate", {
            "text": _prompt(engine.processor, "How many sides?", 1), "image_data": [_image(70, 70, (90, 0, 90))],
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 12, "sampling_seed": 3},
            "return_logprob": True}, headers=auth)
        assert status == 200, reply
        lps = reply["meta_info"]["output_token_logprobs"]
        assert len(reply["output_ids"]) == len(lps) == reply["meta_info"]["completion_tokens"] > 0
        assert all(isinstance(e[0], float) and e[0] <= 0 for e in lps)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_serve_module_binds_other_machines_only_with_a_key(tiny_checkpoint, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "vlmrl.rollout.serve", "--model", tiny_checkpoint, "--port", "0",
                           "--host", "0.0.0.0"], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "VLMRL_ENGINE_KEY"},
                          cwd=str(Path(__file__).resolve().parents[2]))
    assert proc.returncode == 2 and "give a key" in proc.stderr, proc.stderr
    loose = tmp_path / "key"
    loose.write_text("secret\n")
    loose.chmod(0o644)
    proc = subprocess.run([sys.executable, "-m", "vlmrl.rollout.serve", "--model", tiny_checkpoint, "--port", "0",
                           "--api-key-file", str(loose)], capture_output=True, text=True, timeout=120,
                          cwd=str(Path(__file__).resolve().parents[2]))
    assert proc.returncode == 2 and "readable by others" in proc.stderr, proc.stderr


def test_serve_module_refuses_a_release_without_contract(tiny_checkpoint):
    proc = subprocess.run([sys.executable, "-m", "vlmrl.rollout.serve", "--model", tiny_checkpoint, "--port", "0",
                           "--sglang-version", "0.0.1"], capture_output=True, text=True, timeout=120,
                          cwd=str(Path(__file__).resolve().parents[2]))
    assert proc.returncode == 2 and "make sglang-contract SGLANG_VERSION=0.0.1" in proc.stderr, proc.stderr


def test_weight_payloads_are_one_per_engine_rank(engine, server):
    """SGLang's TP rank i reads serialized_named_tensors[i]; CUDA-IPC payloads must each be
    made on the GPU that rank reads, so the client never replicates one IPC payload."""
    import torch

    from vlmrl.rollout.weights import payload_sources, serialize_payload

    bucket = [("model.norm.weight", torch.ones(4))]
    ipc = HTTPEngine(server.url, tensor_format="ipc", tp_size=2)
    with pytest.raises(ValueError, match="one payload per rank"):
        _run(ipc.update_weights_from_tensor(bucket))
    with pytest.raises(ValueError, match="same CUDA-IPC payload"):
        _run(ipc.update_weights_from_serialized(["aGFuZGxl", "aGFuZGxl"]))
    with pytest.raises(ValueError, match="1 serialized payloads for an engine of tp_size 2"):
        _run(ipc.update_weights_from_serialized(["aGFuZGxl"]))
    # colocated engines: each engine rank's payload comes from the trainer rank on its device
    assert payload_sources(range(4), 0, 2, 2) == [[0, 1], [2, 3]]
    assert payload_sources([3, 2, 1, 0], 0, 1, 4) == [[3, 2, 1, 0]]
    with pytest.raises(ValueError, match="engine 1 rank 0 is on device 4"):
        payload_sources(range(4), 2, 2, 2)
    # the embedded server is one rank: it loads entry 0, and the version rides on the call
    original = engine.model.model.language_model.norm.weight.detach().clone()
    client = HTTPEngine(server.url)

    async def update() -> None:
        async with client.weight_update_session():
            await client.update_weights_from_serialized([serialize_payload([("model.norm.weight", original * 2)],
                                                                           "torch_save")], weight_version="v-rank")
        await client.close()

    try:
        _run(update())
        assert engine.weight_version == "v-rank"
        assert torch.equal(engine.model.model.language_model.norm.weight, original * 2)
    finally:
        _run(engine.update_weights_from_tensor([("model.norm.weight", original)], weight_version="0"))


class _Payload:
    """A pickle that would run a shell command if its globals were trusted."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_ipc_payloads_unpickle_only_torch_objects(engine, server, tmp_path):
    """SGLang's default payload is a pickle (CUDA-IPC handles). The embedded server reads it on a
    GPU engine and unpickles torch's rebuild functions, storages and dtypes, nothing else; on a
    CPU engine it answers 400 naming the format it reads."""
    import base64
    import pickle

    import torch

    from vlmrl.rollout.weights import load_ipc

    marker = tmp_path / "ran"
    evil = pickle.dumps([("model.norm.weight", _Payload(marker))])
    with pytest.raises(pickle.UnpicklingError, match="may not refer to posix.system"):
        load_ipc(evil)
    assert not marker.exists()
    client = HTTPEngine(server.url)
    try:
        with pytest.raises(EngineError, match="needs the engine on a GPU" if not torch.cuda.is_available()
                           else "may not refer to posix.system"):
            _run(_in_session(client, client.update_weights_from_serialized([base64.b64encode(evil).decode()])))
    finally:
        _run(client.close())
    assert not marker.exists()


def test_rank_payloads_are_gathered_in_engine_rank_order():
    """Over gloo: every trainer rank serializes its own copy; rank 0 receives them per
    engine in TP-rank order (each from the rank on that engine rank's device), and names an
    engine's rank that sent nothing. Both cases in one process group (each gloo process
    imports Megatron: seconds apiece on a shared core)."""
    from _dist import gather_payloads_worker, run_in_processes

    out = run_in_processes(gather_payloads_worker, 3, [([[2, 0], [1]], [0, 1, 2]), ([[0, 1]], [0])], timeout_s=120)
    assert out[0][0] == [[2.0, 0.0], [1.0]] and out[1][0] is None and out[2][0] is None
    # rank 2 sends nothing either, but no engine reads it
    assert out[0][1] == "RuntimeError: engine 0: trainer ranks [1] sent no weight payload", out[0][1]
    assert out[1][1] is None and out[2][1] is None


def test_duplicate_request_ids_are_refused_like_sglang(engine, server):
    """SGLang answers 400 "Duplicate request ID" for an id already in flight (or repeated in
    one batch); the manager's ids stay unique when a batch draws the same row twice."""
    from vlmrl.rollout.manager import RolloutManager, RolloutPrompt

    text = _prompt(engine.processor, "Find x.")
    body = {"text": [text, text], "rid": ["same", "same"], "sampling_params": {"max_new_tokens": 2}}
    status, reply = _post(server.url + "/generate", body)
    assert status == 400 and "Duplicate request ID detected: same" in reply["error"]["message"]
    assert reply["error"]["retryable"] is False
    status, _ = _post(server.url + "/generate", {"text": text, "rid": "same", "sampling_params": {"max_new_tokens": 2}})
    assert status == 200  # the id was not left behind as in flight

    img = _image(84, 84, (10, 200, 10))
    row = RolloutPrompt(index=5, prompt_text=_prompt(engine.processor, "How long is AB?", 1), images=(img,))
    other = RolloutPrompt(index=6, prompt_text=_prompt(engine.processor, "Find the angle."))
    mgr = RolloutManager([HTTPEngine(server.url, max_retries=0)], n_samples=3, max_retries=0, progress=False,
                         sampling=SamplingParams(temperature=1.0, max_new_tokens=8))
    batch = mgr.run([row, other, row])  # an epoch boundary drew row 5 twice
    assert batch.stats.dropped_groups == 0 and batch.stats.completed_groups == 3
    groups = batch.groups()
    assert sorted(groups) == [0, 1, 2] and [g[0].prompt_index for g in groups.values()] == [5, 6, 5]
    first, second = ([tuple(r.response_ids) for r in groups[k]] for k in (0, 2))
    assert first != second  # the second draw of the row gets its own seeds


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def test_server_under_load_and_bad_input(engine):
    """256 concurrent /generate requests with images, a client that goes away mid-request,
    malformed JSON, unknown fields, a wrong image, an oversized body, an over-long prompt:
    each gets a clear 4xx or completes, the server keeps serving, and a second round of all
    of it leaves the process's memory where the first left it."""
    import gc
    import time

    images = [_image(56 + 14 * (k % 4), 56 + 14 * (k // 4), (40 * k % 255, 120, 200)) for k in range(8)]
    text = _prompt(engine.processor, "How many shapes?", 1)

    async def load_round(url: str) -> list:
        client = HTTPEngine(url, max_concurrency=256, max_retries=0, timeout_s=120)
        try:
            reqs = [GenerateRequest(text=text, images=(images[k % 8],), rid=f"load-{time.monotonic_ns()}-{k}",
                                    sampling=SamplingParams(temperature=1.0, max_new_tokens=4, seed=k))
                    for k in range(256)]
            return await client.generate(reqs)
        finally:
            await client.close()

    async def walk_away(url: str) -> None:
        import aiohttp

        # long enough to be in flight when the client leaves after 50 ms: a repeated prompt's
        # prefill is cached, and 64 tokens could finish inside the 50 ms on a fast host
        body = {"text": text, "image_data": images[0],
                "sampling_params": {"max_new_tokens": 512, "ignore_eos": True}}
        async with aiohttp.ClientSession() as s:
            with pytest.raises(asyncio.TimeoutError):
                await s.post(url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=0.05))
        reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"text\": \"half a bo")  # then hangs up mid-body
        await writer.drain()
        writer.close()

    def bad_inputs(url: str) -> None:
        def raw(data: bytes, headers: dict | None = None) -> tuple[int, dict]:
            req = urllib.request.Request(url + "/generate", data=data,
                                         headers={"Content-Type": "application/json", **(headers or {})})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read() or b"null")

        status, reply = raw(b'{"text": "unterminated')
        assert status == 400 and "not JSON" in reply["error"]["message"]
        status, reply = raw(b"[1, 2]")
        assert status == 400 and "JSON object" in reply["error"]["message"]
        ok = {"text": _prompt(engine.processor, "Find x."), "sampling_params": {"max_new_tokens": 2}}
        status, reply = _post(url + "/generate", {**ok, "not_a_field": 1})  # SGLang ignores unknown keys here
        assert status == 200 and 1 <= reply["meta_info"]["completion_tokens"] <= 2
        status, reply = _post(url + "/generate", {**ok, "sampling_params": {"max_new_tokens": 2, "temprature": 0.5}})
        assert status == 400 and "unknown sampling parameters ['temprature']" in reply["error"]["message"]
        status, reply = _post(url + "/generate", {**ok, "sampling_params": {"repetition_penalty": 1.3}})
        assert status == 400 and "not implemented by the embedded engine" in reply["error"]["message"]
        status, reply = _post(url + "/generate", {"text": text, "image_data": "data:image/png;base64,aGVsbG8="})
        assert status == 400 and "image" in reply["error"]["message"]
        status, reply = _post(url + "/generate", {"text": "x " * 3000, "sampling_params": {"max_new_tokens": 2}})
        assert status == 400 and "context is 2048" in reply["error"]["message"]

    with ThreadedServer(engine, max_generate_mb=1.0) as srv:
        # oversized: declared, and streamed without a length
        status, reply = _post(srv.url + "/generate", {"text": "x" * (2 << 20)})
        assert status == 413 and "1 MiB limit" in reply["error"]["message"]

        async def chunked() -> int:
            import aiohttp

            async def gen():
                for _ in range(3):
                    yield b" " * (1 << 20)
            async with aiohttp.ClientSession() as s, s.post(srv.url + "/generate", data=gen()) as r:
                return r.status
        assert _run(chunked()) == 413

        rss = []
        for _ in range(2):
            t0 = time.perf_counter()
            results = _run(load_round(srv.url))
            assert len(results) == 256 and all(1 <= len(r.output_ids) <= 4 for r in results)
            assert len({r.rid for r in results}) == 256
            _run(walk_away(srv.url))
            bad_inputs(srv.url)
            status, _ = _post(srv.url + "/generate", {"text": text, "image_data": images[3],
                                                      "sampling_params": {"max_new_tokens": 3}})
            assert status == 200  # still serving
            assert time.perf_counter() - t0 < 180
            _run(HTTPEngine(srv.url).flush_cache())
            gc.collect()
            rss.append(_rss_mib())
        assert rss[1] - rss[0] < 64, rss  # the second round leaves memory where the first did


def test_weight_sync_bench_verifies_the_sync(tmp_path):
    """`python -m vlmrl.bench weight-sync` on the CPU: the loop's TrainerWorker syncs a perturbed
    policy to an engine process over SGLang's protocol, and the engine's logprobs of its own
    completion then equal the trainer's (and lie far from what the weights before the sync
    give the same tokens); the bench exits 1 when they do not. The engine must
    end up with every bucket, the last one's version, although it loads each bucket while the
    trainer prepares the next."""
    import json

    from vlmrl.bench import weight_sync

    # 1 and 2 MB buckets: many of them, so the engine loads each while the next one is
    # prepared; both export modes and both sizes, alternating (the engine ends on the last
    # variant's last sync)
    assert weight_sync.main(["--model", "tiny", "--device", "cpu", "--repeats", "1", "--bucket-mb", "1,2",
                             "--compact-views", "both", "--out", str(tmp_path)]) == 0
    row = json.loads((tmp_path / "weight_sync_tiny.json").read_text())["row"]
    assert row["verified"] and row["weight_version"] == "v1c-2" and row["phases"]["buckets"] >= 5
    assert set(row["by_mode"]) == {f"{m}, {mb} MiB buckets" for m in ("views", "compact") for mb in (1, 2)}
    assert row["compact_views"] is False and row["bucket_mb"] == 1
    buckets = {k: m["phases"]["buckets"] for k, m in row["by_mode"].items()}
    assert buckets["views, 1 MiB buckets"] > buckets["views, 2 MiB buckets"]
    assert all(len(m["sync_s"]) == 1 and m["gb_per_s"] > 0 for m in row["by_mode"].values())
    assert row["logprob_max_abs_diff"] <= 1e-4 and row["bytes"] > 0
    # the engine moved to the new weights: far from what the old ones give the same tokens
    assert row["logprob_mean_abs_diff_old_weights"] > 100 * max(row["logprob_mean_abs_diff"], 1e-7)
    # the noise floor (both sides on the checkpoint) is rounding only in fp32
    assert 0 <= row["logprob_mean_abs_diff_same_weights"] <= 1e-5
    # where the sync's host time went: every phase timed, together within the sync's wall time
    phases = row["phases"]
    assert phases["buckets"] >= 1
    parts = [phases[k] for k in ("gather_convert_s", "serialize_s", "engines_s", "barrier_s")]
    assert all(p >= 0 for p in parts) and phases["engines_s"] > 0
    assert sum(parts) <= row["median_s"] * 1.01


def test_flattened_bucket_load_format_is_checked_against_the_payload(engine, server):
    """load_format 'flattened_bucket' (what vlmrl sends with CUDA-IPC payloads) with host bytes
    is refused with the reason, and nothing is loaded: the engine's weights are unchanged."""
    import torch

    from vlmrl.rollout.weights import encode_torch_payload

    name, before = next((n, p.detach().clone()) for n, p in engine.model.named_parameters())
    client = HTTPEngine(server.url, tensor_format="ipc")
    try:
        with pytest.raises(EngineError, match="flattened_bucket' needs a CUDA-IPC payload"):
            _run(_in_session(client, client.update_weights_from_serialized(
                [encode_torch_payload([(name, torch.zeros_like(before))])])))
    finally:
        _run(client.close())
    assert torch.equal(dict(engine.model.named_parameters())[name].detach(), before)


# --------------------------------------------------------------------------- one SGLang release each
# A request that breaks each check of SamplingParams.verify, by the check's condition as the
# contract records it (and nothing before it). A check a regenerated contract adds has no entry
# here, and the test below fails until one is written.
VIOLATING: dict[str, dict] = {
    "self.beam_width is not None and self.beam_width < 1": {"beam_width": 0},
    "not math.isfinite(self.temperature) or self.temperature < 0.0": {"temperature": -0.5},
    "not 0.0 < self.top_p <= 1.0": {"top_p": 1.5},
    "not 0.0 <= self.min_p <= 1.0": {"min_p": -0.1},
    "self.top_k < 1 or self.top_k == -1": {"top_k": 0},
    "not -2.0 <= self.frequency_penalty <= 2.0": {"frequency_penalty": 3.0},
    "not -2.0 <= self.presence_penalty <= 2.0": {"presence_penalty": -2.5},
    "not 0.0 < self.repetition_penalty <= 2.0": {"repetition_penalty": 0.0},
    "not 0 <= self.min_new_tokens": {"min_new_tokens": -1},
    "self.max_new_tokens < 0": {"max_new_tokens": -1},
    "not self.min_new_tokens <= self.max_new_tokens": {"min_new_tokens": 5, "max_new_tokens": 2},
    "not 0 <= int(token_id) < vocab_size": {"logit_bias": {"3": 0.5, "1000000000": 1.0}},
    "not isinstance(self.sampling_seed, int)": {"sampling_seed": "seven"},
    "not -2 ** 63 <= self.sampling_seed <= 2 ** 63 - 1": {"sampling_seed": 2 ** 64},
    "sum((x is not None for x in grammars)) > 1": {"json_schema": "{}", "regex": "[a-z]+"},
}


@pytest.mark.parametrize("version", VERSIONS)
def test_every_sampling_check_of_the_release_is_a_400(engine, servers, version):
    """Each check of the release's SamplingParams.verify, sent a value it refuses, is an HTTP
    400 whose message is SGLang's (it names the parameter); the server keeps serving."""
    rules = load_contract(version)["sampling_params"]["verify"]["rules"]
    missing = [r["condition"] for r in rules if r["condition"] not in VIOLATING]
    assert not missing, f"SGLang {version} has checks with no violating request in VIOLATING: {missing}"
    url = servers[version].url
    text = _prompt(engine.processor, "Find x.")
    for rule in rules:
        status, reply = _post(url + "/generate", {"text": text, "sampling_params": VIOLATING[rule["condition"]]})
        assert status == 400, (rule["condition"], status, reply)
        message = reply["error"]["message"]
        assert reply["error"]["retryable"] is False
        for literal, *_ in string.Formatter().parse(rule["message"]):  # SGLang's text around its values
            assert literal in message, (rule["message"], message)
        for name in rule["parameters"]:
            assert name in message, (name, message)
    status, reply = _post(url + "/generate", {"text": text, "sampling_params": {"max_new_tokens": 0, "top_k": -1,
                                                                                "temperature": 0}})
    assert status == 200 and reply["output_ids"] == [], reply  # in range: SGLang takes it, and so does this


@pytest.mark.parametrize("version", VERSIONS)
def test_server_info_and_loads_speak_the_release(engine, servers, version):
    """/server_info reports the emulated release; /v1/loads answers the contract's keys, with
    the requests being generated and those queued counted as they are."""
    import threading

    proto = sglang_protocol(version)
    url = servers[version].url
    status, info = _get(url + "/server_info")
    assert status == 200 and info["version"] == version and set(proto.server_info_keys) <= set(info)
    status, loads = _get(url + "/v1/loads?include=core")
    assert status == 200 and set(loads) == set(proto.loads_reply_keys) and loads["version"] == version
    (row,) = loads["loads"]
    assert list(row) == list(proto.loads_core_keys) and row["num_running_reqs"] == row["num_waiting_reqs"] == 0

    samples: list[tuple[int, int]] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            (r,) = _get(url + "/v1/loads")[1]["loads"]
            samples.append((r["num_running_reqs"], r["num_waiting_reqs"]))
            time.sleep(0.005)

    text = _prompt(engine.processor, "Count to one hundred.")
    body = {"text": [text] * 5, "sampling_params": {"max_new_tokens": 96, "ignore_eos": True, "temperature": 0}}
    old = engine.max_batch_size
    engine.max_batch_size = 2  # 5 requests: a batch of 2 runs while 3 wait, then 2 and 1, then 1
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        status, reply = _post(url + "/generate", body, timeout=300)
    finally:
        done.set()
        poller.join(10)
        engine.max_batch_size = old
    assert status == 200 and len(reply) == 5 and all(len(r["output_ids"]) == 96 for r in reply)
    seen = set(samples)
    assert (2, 3) in seen and (1, 0) in seen, sorted(seen)  # every sample a true count
    assert all(r <= 2 and r + w <= 5 for r, w in seen), sorted(seen)
    (row,) = _get(url + "/v1/loads")[1]["loads"]
    assert row["num_running_reqs"] == row["num_waiting_reqs"] == 0


@pytest.mark.parametrize("version", VERSIONS)
def test_weight_update_sessions_where_the_release_has_them(engine, servers, version):
    """Where the release has /begin_weight_update and /end_weight_update, tensor and
    distributed updates outside a session are refused (400, success false), begin twice and
    end without begin too, and inside a session the update lands; elsewhere both paths are
    404 and updates need no session."""
    from vlmrl.rollout.weights import serialize_payload

    srv = servers[version]
    url = srv.url
    proto = sglang_protocol(version)
    original = engine.model.model.language_model.norm.weight.detach().clone()
    update = {"serialized_named_tensors": [serialize_payload([("model.norm.weight", original * 3)], "torch_save")],
              "weight_version": f"s-{version}"}
    distributed = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [list(original.shape)],
                   "group_name": "no-such-group"}
    refused_before = srv.stats["update_refused_no_session"]
    try:
        if not proto.weight_update_session:
            assert _post(url + "/begin_weight_update", {})[0] == 404
            assert _post(url + "/end_weight_update", {})[0] == 404
            status, reply = _post(url + "/update_weights_from_tensor", update)
            assert status == 200 and reply["success"] and engine.weight_version == f"s-{version}"
            assert torch.equal(engine.model.model.language_model.norm.weight, original * 3)
            return
        for path, body in (("/update_weights_from_tensor", update), ("/update_weights_from_distributed", distributed)):
            status, reply = _post(url + path, body)
            assert status == 400 and reply["success"] is False and "/begin_weight_update" in reply["message"], reply
        assert srv.stats["update_refused_no_session"] == refused_before + 2
        assert not torch.equal(engine.model.model.language_model.norm.weight, original * 3)  # nothing loaded
        status, reply = _post(url + "/end_weight_update", {})
        assert status == 400 and reply["success"] is False  # no session open
        assert _post(url + "/begin_weight_update", {}) == (200, {"success": True, "message": "weight-update session opened"})
        status, reply = _post(url + "/begin_weight_update", {})
        assert status == 400 and reply["success"] is False  # one open already
        status, reply = _post(url + "/update_weights_from_tensor", update)
        assert status == 200 and reply["success"] and engine.weight_version == f"s-{version}"
        assert torch.equal(engine.model.model.language_model.norm.weight, original * 3)
        status, reply = _post(url + "/update_weights_from_distributed", distributed)  # past the session check
        assert status == 400 and "no weight update group" in reply["message"]
        assert _post(url + "/end_weight_update", {})[0] == 200
        assert _post(url + "/end_weight_update", {})[0] == 400
        assert srv.stats["update_refused_no_session"] == refused_before + 2
    finally:
        _run(engine.update_weights_from_tensor([("model.norm.weight", original)], weight_version="0"))


def _long_request_running(url: str, text: str, tokens: int) -> tuple[Any, dict[str, Any]]:
    """Post a greedy request of `tokens` tokens from another thread (another client) and wait
    until the server reports it running; returns the thread and the dict its reply lands in."""
    import threading

    long = {"text": text, "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0}}
    out: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: out.update(reply=_post(url + "/generate", long, timeout=300)), daemon=True)
    worker.start()
    deadline = time.monotonic() + 60
    while _get(url + "/v1/loads")[1]["loads"][0]["num_running_reqs"] < 1:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.005)
    return worker, out


@pytest.mark.parametrize("version", VERSIONS)
def test_release_while_busy_is_refused_counted_and_survived(engine, servers, version):
    """SGLang asserts it is idle on a memory release, and its scheduler dies when a request
    runs. The embedded server answers 500 with SGLang's assertion text instead, counts it,
    releases nothing and finishes the request; vlmrl's client, which drains first, is never
    refused."""
    srv = servers[version]
    url = srv.url
    before = srv.stats["release_refused_busy"]
    text = _prompt(engine.processor, "Describe a triangle.")
    worker, out = _long_request_running(url, text, 400)
    status, reply = _post(url + "/release_memory_occupation", {})
    assert status == 500, reply
    assert reply["error"]["message"] == load_contract(version)["memory"]["release_requires_idle"]["message"]
    assert srv.stats["release_refused_busy"] == before + 1 and engine.released_tags == set()
    worker.join(300)
    status, reply = out["reply"]
    assert status == 200 and len(reply["output_ids"]) == 400  # the request was not harmed

    async def drained_release() -> None:
        client = HTTPEngine(url, max_retries=0)
        try:
            pending = asyncio.ensure_future(client.generate([GenerateRequest(
                text=text, sampling=SamplingParams(temperature=0.0, max_new_tokens=200, ignore_eos=True))]))
            while not client._inflight:
                await asyncio.sleep(0.001)
            await client.release_memory_occupation()  # waits for the request, then releases
            assert pending.done() and len((await pending)[0].output_ids) == 200
            assert engine.released_tags == set(MEMORY_TAGS)
            await client.resume_memory_occupation()
        finally:
            await client.close()

    _run(drained_release())
    assert srv.stats["release_refused_busy"] == before + 1 and engine.released_tags == set()
    assert _post(url + "/generate", {"text": text, "sampling_params": {"max_new_tokens": 2}})[0] == 200


def test_generate_and_update_while_released_are_refused_counted_and_survived(engine, server):
    """A /generate while memory is released (SGLang 0.5.17 crashed on one) is refused with a
    503 and a weight update while the weights are released with a 400; both are counted and
    the server serves again once resumed."""
    from vlmrl.rollout.weights import serialize_payload

    url = server.url
    text = _prompt(engine.processor, "Find x.")
    stats = dict(engine.stats)
    assert _post(url + "/release_memory_occupation", {"tags": ["kv_cache", "weights"]})[0] == 200
    try:
        status, reply = _post(url + "/generate", {"text": [text, text], "sampling_params": {"max_new_tokens": 2}})
        assert status == 503 and "released" in reply["error"]["message"]
        assert engine.stats["refused_generate_released"] == stats["refused_generate_released"] + 2
        weight = engine.model.model.language_model.norm.weight.detach().clone()
        body = {"serialized_named_tensors": [serialize_payload([("model.norm.weight", weight * 2)], "torch_save")]}
        assert _post(url + "/begin_weight_update", {})[0] == 200
        status, reply = _post(url + "/update_weights_from_tensor", body)
        assert _post(url + "/end_weight_update", {})[0] == 200
        assert status == 400 and reply["success"] is False and "released" in reply["message"]
        assert engine.stats["refused_update_released"] == stats["refused_update_released"] + 1
        assert torch.equal(engine.model.model.language_model.norm.weight, weight)
        assert _get(url + "/server_info")[0] == 200  # still serving
    finally:
        assert _post(url + "/resume_memory_occupation", {"tags": ["kv_cache", "weights"]})[0] == 200
    assert _post(url + "/generate", {"text": text, "sampling_params": {"max_new_tokens": 2}})[0] == 200


def test_released_engine_gets_no_request_and_a_router_client_is_held(engine, server):
    """After a release the client refuses to generate without sending anything (SGLang 0.5.17
    died on a /generate while released); `hold` closes the same gate on a client that fronts
    released servers (a router's); resume and `unhold` open them again."""
    text = _prompt(engine.processor, "Find x.")
    req = GenerateRequest(text=text, sampling=SamplingParams(temperature=0.0, max_new_tokens=3))
    refused = engine.stats["refused_generate_released"]

    async def go():
        client, router = HTTPEngine(server.url, max_retries=0), HTTPEngine(server.url, max_retries=0)
        try:
            await client.release_memory_occupation(["kv_cache"])
            assert client.held == {"kv_cache"} and engine.released_tags == {"kv_cache"}
            with pytest.raises(EngineError, match="released") as err:
                await client.generate([req])
            assert not err.value.retryable
            router.hold(["kv_cache"])
            with pytest.raises(EngineError, match="released"):
                await router.generate([req])
            # SGLang's /health runs a token and its scheduler died on one while released: the
            # client asks the load report instead, and the server stays untouched
            health_refusals = server.stats["refused_health_released"]
            assert await client.health() and await router.health()
            assert server.stats["refused_health_released"] == health_refusals
            await client.resume_memory_occupation(["kv_cache"])
            router.unhold(["kv_cache"])
            assert not client.held and not router.held
            return (await client.generate([req]))[0], (await router.generate([req]))[0]
        finally:
            await client.close()
            await router.close()

    a, b = _run(go())
    assert a.output_ids == b.output_ids and len(a.output_ids) == 3
    assert engine.stats["refused_generate_released"] == refused  # nothing reached the server
    # the server itself, asked /health while released, refuses (503) and counts it
    before = server.stats["refused_health_released"]
    assert _post(server.url + "/release_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
    assert _get(server.url + "/health")[0] == 503 and server.stats["refused_health_released"] == before + 1
    assert _post(server.url + "/resume_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
    assert _get(server.url + "/health")[0] == 200


def test_drain_waits_for_requests_of_other_clients(engine, server):
    """A release waits until the server runs nothing, also requests this client never sent
    (another client's, or ones whose caller went away): the server's /v1/loads says when."""
    url = server.url
    before = server.stats["release_refused_busy"]
    _, out = _long_request_running(url, _prompt(engine.processor, "Describe a circle."), 300)

    async def release(timeout_s):
        client = HTTPEngine(url, max_retries=0, drain_timeout_s=timeout_s)
        try:
            await client.release_memory_occupation()
            return client.held
        finally:
            await client.close()

    with pytest.raises(EngineError, match="still runs 1 and queues 0"):
        _run(release(0.2))  # too short: nothing released, and the gate reopens
    assert engine.released_tags == set()
    assert _run(release(300)) == set(MEMORY_TAGS)
    assert "reply" in out and out["reply"][0] == 200 and len(out["reply"][1]["output_ids"]) == 300
    assert engine.released_tags == set(MEMORY_TAGS) and server.stats["release_refused_busy"] == before
    assert _post(url + "/resume_memory_occupation", {})[0] == 200


def test_a_client_for_broadcast_only_servers_sends_no_tensor_payload(engine, server):
    """SGLang on GPUs of its own takes weights from the NCCL group only (its safe unpickler
    refuses torch.save bytes): its client (tensor_format None) refuses tensor payloads before
    anything is sent."""
    weight = engine.model.model.language_model.norm.weight.detach().clone()

    async def go():
        client = HTTPEngine(server.url, tensor_format=None)
        try:
            with pytest.raises(ValueError, match="NCCL update group"):
                await client.update_weights_from_tensor([("model.norm.weight", weight * 2)])
            with pytest.raises(ValueError, match="NCCL update group"):
                await client.update_weights_from_serialized(["x"])
        finally:
            await client.close()

    _run(go())
    assert torch.equal(engine.model.model.language_model.norm.weight, weight)


def test_a_keyed_server_refuses_callers_without_the_key_and_keeps_serving(engine):
    """The run's engine key (vlmrl.rollout.auth): without it every call but /health is a 401
    and changes nothing (weights, memory, cache); the run's own client, holding it, is
    served; the refusals are counted."""
    from vlmrl.rollout.auth import bearer, new_key
    from vlmrl.rollout.weights import encode_torch_payload

    key = new_key()
    before = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    with ThreadedServer(engine, api_key=key) as srv:
        payload = encode_torch_payload([(to_checkpoint_name(k), torch.zeros_like(v)) for k, v in before.items()])
        for path, body in [("/update_weights_from_tensor", {"serialized_named_tensors": [payload]}),
                           ("/release_memory_occupation", {}), ("/flush_cache", {}),
                           ("/init_weights_update_group", {"master_address": "10.0.0.1", "master_port": 1,
                                                           "rank_offset": 1, "world_size": 2}),
                           ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}})]:
            for headers in (None, bearer("not-the-key"), {"Authorization": key}):
                status, reply = _post(srv.url + path, body, headers=headers)
                assert status == 401 and reply == {"error": "Unauthorized"}, (path, status, reply)
        assert _get(srv.url + "/health")[0] == 200
        assert _get(srv.url + "/server_info")[0] == 401
        assert srv.stats["unauthorized"] == 16
        assert not engine.released_tags
        after = engine.model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)

        async def served():
            client = HTTPEngine(srv.url, api_key=key)
            try:
                out = await client.generate([GenerateRequest(text=_prompt(engine.processor, "Count."),
                                                             sampling=SamplingParams(max_new_tokens=3, ignore_eos=True))])
                await client.flush_cache()
                return out
            finally:
                await client.close()

        assert len(_run(served())[0].output_ids) == 3
        assert srv.stats["unauthorized"] == 16


def test_bad_weight_payloads_are_400s_that_name_the_problem_and_change_nothing(engine, server):
    """Truncated base64, a broken archive, a tensor name the model lacks, a shape or dtype
    that does not fit: each is refused whole (good tensors sent beside a bad one are not
    applied) with a message naming the problem, and the engine keeps serving."""
    import base64

    from vlmrl.rollout.weights import encode_torch_payload

    before = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    name, value = next((to_checkpoint_name(k), v) for k, v in before.items() if v.dim() == 2)
    good = (name, torch.zeros_like(value))
    archive = encode_torch_payload([good])
    cases = {
        "not base64": archive[:-3],
        "not a torch.save archive": base64.b64encode(base64.b64decode(archive)[:300]).decode(),
        "unknown parameter 'model.no_such.weight'": encode_torch_payload([good, ("model.no_such.weight",
                                                                                 torch.zeros(2))]),
        f"shape mismatch for {name}": encode_torch_payload([(name, torch.zeros(value.shape[0] + 1, value.shape[1]))]),
        f"dtype mismatch for {name}": encode_torch_payload([(name, torch.zeros(value.shape, dtype=torch.int64))]),
    }
    for message, entry in cases.items():
        status, reply = _post(server.url + "/update_weights_from_tensor", {"serialized_named_tensors": [entry]})
        if status == 400 and "weight-update session" in str(reply):  # releases with sessions: open one
            _post(server.url + "/begin_weight_update", {})
            status, reply = _post(server.url + "/update_weights_from_tensor", {"serialized_named_tensors": [entry]})
            _post(server.url + "/end_weight_update", {})
        assert status == 400 and reply["success"] is False and message in reply["message"], (message, reply)
    after = engine.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    status, reply = _post(server.url + "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and len(reply["output_ids"]) == 2

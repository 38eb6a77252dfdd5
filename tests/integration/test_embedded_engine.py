"""The embedded engine, for each family: logprobs equal a teacher-forced HF forward, batch
invariance, seeded sampling, stop conditions, the Ray actor wrapper."""

from __future__ import annotations

import asyncio
import shutil
import tempfile

import pytest
import torch

from vlmrl.cluster.colocation import phase, plan
from vlmrl.data.images import encode_data_uri as encode_image_data_uri
from vlmrl.rollout.embedded import EmbeddedEngine
from vlmrl.rollout.protocol import EngineError, GenerateRequest, SamplingParams

# the colocated hand-over (without offload, so the engine's moves alone): released for
# training, weights back for the sync, CUDA graphs and KV cache once the sync is done
_GEN, _TRAIN, _SYNC = (phase(n, offload=False) for n in ("generate", "train", "sync"))
COLOCATED_RELEASE = dict(plan(_GEN, _TRAIN))["release"]
COLOCATED_RESUME_BEFORE_SYNC = dict(plan(_TRAIN, _SYNC))["resume"]
COLOCATED_RESUME_AFTER_SYNC = dict(plan(_SYNC, _GEN))["resume"]

TOL = 1e-5


def _image(w: int, h: int, color: tuple[int, int, int]) -> str:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (w, h), color)
    ImageDraw.Draw(img).rectangle([w // 4, h // 4, w // 2, h // 2], fill=(255 - color[0], 30, 200))
    return encode_image_data_uri(img)


def _prompt(engine: EmbeddedEngine, text: str, n_images: int = 0) -> str:
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    return engine.processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                tokenize=False)


@pytest.fixture(scope="module")
def engine(family_checkpoint) -> EmbeddedEngine:
    """One engine per family: Qwen2.5-VL (KV cache) and Qwen3.5-MoE (hybrid cache: Gated
    DeltaNet convolution and recurrent states beside attention KV)."""
    cfg, path = family_checkpoint
    d = cfg.data
    return EmbeddedEngine(path, min_pixels=d.min_pixels, max_pixels=d.max_pixels, max_batch_size=16)


@pytest.fixture(scope="module")
def images() -> list[str]:
    return [_image(112, 84, (200, 10, 10)), _image(56, 140, (10, 180, 40)), _image(98, 98, (20, 20, 220))]


def _requests(engine, images, sampling):
    return [
        GenerateRequest(text=_prompt(engine, "How many red triangles are in the figure?", 1), images=(images[0],),
                        sampling=sampling),
        GenerateRequest(text=_prompt(engine, "Find the area of the circle with radius 3 units, then give the "
                                             "final answer in a box.", 0), sampling=sampling),
        GenerateRequest(text=_prompt(engine, "x", 2), images=(images[1], images[2]), sampling=sampling),
        GenerateRequest(text=_prompt(engine, "What is the length of side", 1), images=(images[2],), sampling=sampling),
    ]


def _teacher_forced(engine: EmbeddedEngine, req: GenerateRequest, output_ids: list[int]) -> list[float]:
    """The reference: one HF forward over prompt + response (the model's own position
    logic), log_softmax(logits / T) at each response token."""
    proc = engine.processor
    images = None
    if req.images:
        from vlmrl.rollout.embedded import load_image

        images = [load_image(s) for s in req.images]
    enc = proc(text=[req.text], images=images, return_tensors="pt")
    prompt = enc["input_ids"]
    full = torch.cat([prompt, torch.tensor([output_ids[:-1]])], dim=1)
    kwargs = {}
    if images:
        kwargs = dict(pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"],
                      mm_token_type_ids=(full == engine.image_token_id).long())
    engine.model.model.rope_deltas = None
    with torch.no_grad():
        logits = engine.model(input_ids=full, attention_mask=torch.ones_like(full), **kwargs).logits[0].float()
    L = prompt.shape[1]
    logp = torch.log_softmax(logits[L - 1:] / req.sampling.logprob_temperature, dim=-1)
    return [float(logp[j, t]) for j, t in enumerate(output_ids)]


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0.0, max_new_tokens=12),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=40, max_new_tokens=16, seed=3),
], ids=["greedy", "sampled"])
def test_logprobs_equal_teacher_forced_forward(engine, images, sampling):
    reqs = _requests(engine, images, sampling)
    results = engine.generate_sync(reqs)
    worst = 0.0
    for req, res in zip(reqs, results):
        assert len(res.logprobs) == len(res.output_ids) > 0
        ref = _teacher_forced(engine, req, res.output_ids)
        worst = max(worst, max(abs(a - b) for a, b in zip(ref, res.logprobs)))
    assert worst <= TOL, worst


def test_greedy_is_batch_invariant(engine, images):
    sp = SamplingParams(temperature=0.0, max_new_tokens=8)
    reqs = _requests(engine, images, sp)
    solo = [engine.generate_sync([r])[0] for r in reqs]
    batches = [reqs[::-1], [reqs[2], reqs[0], reqs[2], reqs[1], reqs[3], reqs[0]]]
    for batch in batches:
        out = engine.generate_sync(batch)
        for req, res in zip(batch, out):
            ref = solo[reqs.index(req)]
            assert res.output_ids == ref.output_ids
            assert res.prompt_ids == ref.prompt_ids
            assert max(abs(a - b) for a, b in zip(res.logprobs, ref.logprobs)) <= TOL


def test_seeded_sampling_is_reproducible_in_any_batch(engine, images):
    base = _requests(engine, images, SamplingParams(temperature=1.0, max_new_tokens=12))
    reqs = [r.replace(sampling=SamplingParams(temperature=1.0, max_new_tokens=12, seed=100 + i))
            for i, r in enumerate(base)]
    a = engine.generate_sync(reqs)
    b = engine.generate_sync(reqs[::-1])[::-1]
    c = [engine.generate_sync([r])[0] for r in reqs]
    for x, y, z in zip(a, b, c):
        assert x.output_ids == y.output_ids == z.output_ids
    other = engine.generate_sync([reqs[0].replace(sampling=SamplingParams(temperature=1.0, max_new_tokens=12, seed=7))])
    assert other[0].output_ids != a[0].output_ids


def test_a_groups_samples_share_one_prefill_and_sample_as_they_would_alone(engine, images):
    """A GRPO group in one batch (one prompt, several seeded samples) is prefilled once, as
    SGLang serves it from one cached prefix: each sample gets the tokens, logprobs and (MoE)
    prompt experts it gets when it runs alone."""
    base = _requests(engine, images, SamplingParams(temperature=1.0, max_new_tokens=10))
    moe = bool(engine._routers)
    group = [base[1].replace(sampling=SamplingParams(temperature=1.0, max_new_tokens=10, seed=200 + i),
                             return_routed_experts=moe) for i in range(4)]
    other = base[0].replace(sampling=SamplingParams(temperature=1.0, max_new_tokens=10, seed=300),
                            return_routed_experts=moe)
    before = engine.stats["prefilled_prompts"]
    together = engine.generate_sync([group[0], other, *group[1:]])
    assert engine.stats["prefilled_prompts"] - before == 2  # the group's prompt once, the other prompt once
    alone = [engine.generate_sync([r])[0] for r in (group[0], other, *group[1:])]
    assert len({tuple(r.output_ids) for r in together[:1] + together[2:]}) > 1  # the samples differ
    for t, a in zip(together, alone):
        assert t.output_ids == a.output_ids and t.prompt_ids == a.prompt_ids
        assert max(abs(x - y) for x, y in zip(t.logprobs, a.logprobs)) <= TOL
        if moe:  # the prompt's experts from the shared prefill, each sample's own after it
            assert t.routed_experts == a.routed_experts


def test_stop_token_ids_stop_strings_and_length(engine, images):
    req = _requests(engine, images, SamplingParams(temperature=1.0, max_new_tokens=20, seed=11))[1]
    free = engine.generate_sync([req])[0]
    assert free.finish_reason == "length" and len(free.output_ids) == 20 and free.truncated

    stop_tok = free.output_ids[5]
    first = free.output_ids.index(stop_tok)
    r = engine.generate_sync([req.replace(sampling=SamplingParams(temperature=1.0, max_new_tokens=20, seed=11,
                                                                  stop_token_ids=(stop_tok,)))])[0]
    assert r.finish_reason == "stop" and r.matched_stop == stop_tok
    assert r.output_ids == free.output_ids[:first + 1]  # the stop token is kept in output_ids
    assert r.text == engine.tokenizer.decode(free.output_ids[:first], skip_special_tokens=True)

    full_text = free.text
    stop = full_text[len(full_text) // 2:len(full_text) // 2 + 3]
    assert stop and stop.strip()
    r = engine.generate_sync([req.replace(sampling=SamplingParams(temperature=1.0, max_new_tokens=20, seed=11,
                                                                  stop=(stop,)))])[0]
    assert r.finish_reason == "stop" and r.matched_stop == stop
    assert r.text == full_text[:full_text.find(stop)]
    assert free.output_ids[:len(r.output_ids)] == r.output_ids and len(r.output_ids) < 20

    eos = next(iter(engine.eos_token_ids))
    assert eos in engine.eos_token_ids and engine.tokenizer.convert_tokens_to_ids("<|im_end|>") in engine.eos_token_ids


def test_input_ids_with_placeholders_match_text(engine, images):
    sp = SamplingParams(temperature=0.0, max_new_tokens=6)
    text = _prompt(engine, "How many?", 1)
    by_text = engine.generate_sync([GenerateRequest(text=text, images=(images[0],), sampling=sp)])[0]
    ids = engine.tokenizer(text)["input_ids"]  # one <|image_pad|> per image: the engine expands it
    assert ids.count(engine.image_token_id) == 1
    by_ids = engine.generate_sync([GenerateRequest(input_ids=ids, images=(images[0],), sampling=sp)])[0]
    expanded = engine.generate_sync([GenerateRequest(input_ids=by_text.prompt_ids, images=(images[0],),
                                                     sampling=sp)])[0]
    assert by_ids.prompt_ids == by_text.prompt_ids == expanded.prompt_ids
    assert by_ids.output_ids == by_text.output_ids == expanded.output_ids


def test_bad_request_fails_alone(engine, images):
    sp = SamplingParams(temperature=0.0, max_new_tokens=4)
    good = GenerateRequest(text=_prompt(engine, "hi", 0), sampling=sp)
    bad = GenerateRequest(text=_prompt(engine, "hi", 0), images=(images[0],), sampling=sp)  # no placeholder
    out = engine.generate_sync([good, bad])
    assert out[0].output_ids and isinstance(out[1], Exception)

    async def both():
        return await asyncio.gather(engine.generate([good]), engine.generate([bad]), return_exceptions=True)

    a, b = asyncio.run(both())
    assert a[0].output_ids == out[0].output_ids and isinstance(b, Exception)


def test_async_calls_are_coalesced_and_equal_sync(engine, images):
    reqs = _requests(engine, images, SamplingParams(temperature=0.0, max_new_tokens=6))
    ref = engine.generate_sync(reqs)
    before = engine.stats["batches"]

    async def many():
        return await asyncio.gather(*(engine.generate([r]) for r in reqs * 3))

    out = asyncio.run(many())
    assert engine.stats["batches"] - before < len(reqs) * 3  # coalesced
    assert engine.load() == {"running": 0, "waiting": 0}  # every request counted out again
    for i, o in enumerate(out):
        assert o[0].output_ids == ref[i % len(reqs)].output_ids


def test_requests_arriving_a_few_ms_apart_share_a_batch(engine, images):
    """A rollout sends one call per request, a few ms apart at times: they join one batch as
    long as they keep coming (`batch_wait_s` of quiet ends the wait), instead of the first few
    running alone while the rest wait for a second batch."""
    reqs = _requests(engine, images, SamplingParams(temperature=0.0, max_new_tokens=4))
    before = engine.stats["batches"]

    async def trickle():
        calls = []
        for r in reqs + reqs[:2]:
            calls.append(asyncio.ensure_future(engine.generate([r])))
            await asyncio.sleep(0.005)
        return await asyncio.gather(*calls)

    out = asyncio.run(trickle())
    assert engine.stats["batches"] - before == 1
    assert all(not isinstance(o[0], BaseException) for o in out)


def test_every_torch_call_runs_on_the_engines_one_thread(engine, images, monkeypatch):
    """Batches (sync and async), weight copies, release and resume all run on the engine's
    torch thread: on a CPU, torch work started from a second thread keeps a second OpenMP
    thread team spinning on the same cores (a batch took 1.7x as long)."""
    import threading

    import vlmrl.rollout.embedded as embedded

    seen: list[tuple[str, int]] = []
    hook = engine.model.register_forward_pre_hook(lambda *_: seen.append(("forward", threading.get_ident())))
    copy = embedded.copy_grouped
    monkeypatch.setattr(embedded, "copy_grouped", lambda *a: (seen.append(("copy", threading.get_ident())), copy(*a)))
    for name in ("_release", "_resume"):
        method = getattr(engine, name)
        monkeypatch.setattr(engine, name, lambda tags, m=method, n=name: (seen.append((n, threading.get_ident())),
                                                                          m(tags))[1])
    req = _requests(engine, images, SamplingParams(temperature=0.0, max_new_tokens=3))[0]
    try:
        engine.generate_sync([req])
        asyncio.run(engine.generate([req]))
        asyncio.run(engine.release_memory_occupation(["kv_cache"]))
        asyncio.run(engine.resume_memory_occupation(["kv_cache"]))
        name, value = next((n, v) for n, v in engine.model.state_dict().items() if n.endswith("norm.weight"))
        from vlmrl.models import families
        from vlmrl.models.names import to_checkpoint

        ckpt = to_checkpoint({name: value}, families.family_of_hf(engine.model.config))
        asyncio.run(engine.update_weights_from_tensor(list(ckpt.items())))
    finally:
        hook.remove()
    assert {n for n, _ in seen} == {"forward", "copy", "_release", "_resume"}
    assert {t for _, t in seen} == {engine._torch_ident} != {threading.get_ident()}


def test_weight_update_release_resume(engine, images):
    """Updates come by checkpoint name (Qwen3.5-MoE: one tensor per routed expert, written into
    transformers' fused expert parameters)."""
    from vlmrl.models import families
    from vlmrl.models.names import to_checkpoint

    family = families.family_of_hf(engine.model.config)
    req = _requests(engine, images, SamplingParams(temperature=0.0, max_new_tokens=6))[0]
    before = engine.generate_sync([req])[0]
    sd = engine.model.state_dict()
    originals = [(n, v.clone()) for n, v in to_checkpoint(sd, family).items()]
    if family == "qwen3_5_moe":
        assert any(".mlp.experts.3.up_proj.weight" in n for n, _ in originals)
    refused = dict(engine.stats)
    try:
        asyncio.run(engine.release_memory_occupation())
        assert not asyncio.run(engine.health())
        assert isinstance(engine.generate_sync([req])[0], Exception)
        assert engine.stats["refused_generate_released"] == refused["refused_generate_released"] + 1
        assert engine.load() == {"running": 0, "waiting": 0}
        changed = [(n, v * 1.5) for n, v in originals if ".layers." in n]
        with pytest.raises(EngineError, match="resume"):  # weights released: no update
            asyncio.run(engine.update_weights_from_tensor(changed, weight_version="v1"))
        assert engine.stats["refused_update_released"] == refused["refused_update_released"] + 1
        # the colocated order: weights back, update, then the CUDA graphs and the KV cache
        asyncio.run(engine.resume_memory_occupation(list(COLOCATED_RESUME_BEFORE_SYNC)))
        asyncio.run(engine.update_weights_from_tensor(changed, bucket_bytes=64 << 10, weight_version="v1"))
        assert isinstance(engine.generate_sync([req])[0], EngineError)  # the KV cache is still released
        asyncio.run(engine.resume_memory_occupation(["kv_cache"]))
        assert isinstance(engine.generate_sync([req])[0], EngineError)  # so are the CUDA graphs
        assert set(COLOCATED_RELEASE) == {*COLOCATED_RESUME_BEFORE_SYNC, *COLOCATED_RESUME_AFTER_SYNC}
        asyncio.run(engine.resume_memory_occupation(["cuda_graph"]))
        assert asyncio.run(engine.health())
        with pytest.raises(ValueError, match="unknown memory tags"):
            asyncio.run(engine.release_memory_occupation(["activations"]))
        after = engine.generate_sync([req])[0]
        assert after.weight_version == "v1"
        assert after.logprobs != before.logprobs
    finally:
        asyncio.run(engine.update_weights_from_tensor(originals, weight_version="0"))
    restored = engine.generate_sync([req])[0]
    assert restored.output_ids == before.output_ids and restored.logprobs == before.logprobs


def test_weight_update_is_all_or_nothing_and_casts(engine):
    """A bucket naming an unknown tensor or a wrong shape anywhere in it is refused before any
    weight changes; a good bucket's tensors are copied by name (an fp32 value cast to the
    engine's dtype), a routed expert's into its slice of the fused parameter."""
    from vlmrl.models import families
    from vlmrl.models.names import to_checkpoint

    family = families.family_of_hf(engine.model.config)
    ckpt = to_checkpoint(engine.model.state_dict(), family)
    names = [n for n in ckpt if ".layers.0." in n][:4]
    if family == "qwen3_5_moe":
        names.append(next(n for n in ckpt if ".mlp.experts.1.down_proj.weight" in n))
    originals = {n: ckpt[n].clone() for n in names}
    new = [(n, torch.full(t.shape, 0.25 + i, dtype=torch.float32)) for i, (n, t) in enumerate(originals.items())]
    bad_shape = [*new[:-1], (new[-1][0], torch.zeros(*new[-1][1].shape, 2))]
    try:
        with pytest.raises(EngineError, match="shape mismatch"):
            asyncio.run(engine.update_weights_from_tensor(bad_shape))
        with pytest.raises(EngineError, match="unknown parameter"):
            asyncio.run(engine.update_weights_from_tensor([*new, ("model.no_such.weight", torch.zeros(1))]))
        now = to_checkpoint(engine.model.state_dict(), family)
        assert all(torch.equal(now[n], t) for n, t in originals.items())  # nothing copied
        asyncio.run(engine.update_weights_from_tensor(new))
        now = to_checkpoint(engine.model.state_dict(), family)
        for n, t in new:
            assert now[n].dtype == originals[n].dtype and torch.equal(now[n], t.to(now[n].dtype))
    finally:
        asyncio.run(engine.update_weights_from_tensor(list(originals.items())))


def test_fused_expert_tensors_load_like_their_per_expert_slices(engine):
    """A layer's routed experts may also come fused, under transformers' in-memory names
    (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`), which SGLang's Qwen3.5
    loader takes and vlmrl's loader in SGLang copies whole: the engine writes them into its
    fused parameters, exactly as the same values sent one expert at a time."""
    from vlmrl.models import families
    from vlmrl.models.names import to_checkpoint

    family = families.family_of_hf(engine.model.config)
    if family != "qwen3_5_moe":
        pytest.skip("no routed experts")
    sd = engine.model.state_dict()
    gate_up = next(n for n in sd if n.endswith(".mlp.experts.gate_up_proj"))
    names = (gate_up, gate_up.replace("gate_up_proj", "down_proj"))
    originals = {n: sd[n].clone() for n in names}
    gen = torch.Generator().manual_seed(3)
    new = {n: torch.randn(t.shape, generator=gen).to(t.dtype) for n, t in originals.items()}
    try:
        asyncio.run(engine.update_weights_from_tensor(list(new.items())))
        now = engine.model.state_dict()
        assert all(torch.equal(now[n], t) for n, t in new.items())
        asyncio.run(engine.update_weights_from_tensor(list(originals.items())))
        per_expert = to_checkpoint(new, family)
        assert len(per_expert) == 3 * engine.model.config.text_config.num_experts
        asyncio.run(engine.update_weights_from_tensor(list(per_expert.items())))
        now = engine.model.state_dict()
        assert all(torch.equal(now[n], t) for n, t in new.items())
    finally:
        asyncio.run(engine.update_weights_from_tensor(list(originals.items())))


def test_ray_actor(family_checkpoint, monkeypatch, engine, images):
    ray = pytest.importorskip("ray")
    from vlmrl.rollout.embedded import RayEngine, create_embedded_actor

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    # Ray's unix socket paths must stay under 108 bytes: pytest's tmp_path is too deep
    ray_dir = tempfile.mkdtemp(prefix="vlmrl-test-ray-", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=ray_dir, log_to_driver=False,
             configure_logging=False)
    try:
        cfg, path = family_checkpoint
        d = cfg.data
        with pytest.raises(ValueError, match="make sglang-contract SGLANG_VERSION=0.0.1"):
            create_embedded_actor(path, sglang_version="0.0.1")  # refused before any actor starts
        actor = create_embedded_actor(path, num_cpus=0.5, min_pixels=d.min_pixels,
                                      max_pixels=d.max_pixels, sglang_version="0.5.17")
        remote = RayEngine(actor, name="embedded-ray")
        reqs = _requests(engine, images, SamplingParams(temperature=0.0, max_new_tokens=6))

        async def go():
            assert await remote.health()
            return await remote.generate(reqs)

        out = asyncio.run(go())
        ref = engine.generate_sync(reqs)
        for a, b in zip(out, ref):
            assert a.output_ids == b.output_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= TOL
        # its HTTP server speaks the release it was given (rollout.embedded.sglang_version)
        import json
        import urllib.error
        import urllib.request

        url = ray.get(actor.start_http.remote())
        with urllib.request.urlopen(url + "/server_info", timeout=30) as r:
            assert json.loads(r.read())["version"] == "0.5.17"
        with pytest.raises(urllib.error.HTTPError) as e:  # 0.5.17 has no weight-update sessions
            urllib.request.urlopen(urllib.request.Request(url + "/begin_weight_update", data=b"{}"), timeout=30)
        assert e.value.code == 404
        stats = ray.get(actor.stats.remote())
        assert stats["requests"] >= len(reqs) and stats["release_refused_busy"] == 0
    finally:
        ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)

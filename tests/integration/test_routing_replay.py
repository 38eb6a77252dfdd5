"""Routing replay end to end on the CPU: the embedded engine reports the experts each token
was routed to, exactly as its routers chose them, and the trainer, its routers perturbed away
from the engine's, routes every token by them with replay on (and measures how often its own
router would have chosen others)."""

from __future__ import annotations

import pytest
import torch
from _dist import run_in_processes

from vlmrl.rollout.embedded import EmbeddedEngine, load_image, moe_routers
from vlmrl.rollout.protocol import GenerateRequest, SamplingParams, decode_routed_experts


@pytest.fixture(scope="module")
def engine(tiny_moe_config, tiny_moe_checkpoint) -> EmbeddedEngine:
    d = tiny_moe_config.data
    return EmbeddedEngine(tiny_moe_checkpoint, min_pixels=d.min_pixels, max_pixels=d.max_pixels, max_batch_size=8)


def _requests(engine: EmbeddedEngine) -> list[GenerateRequest]:
    from PIL import Image

    from vlmrl.data.images import encode_data_uri

    def prompt(text: str, n_images: int) -> str:
        content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
        return engine.processor.apply_chat_template([{"role": "user", "content": content}],
                                                    add_generation_prompt=True, tokenize=False)

    img = encode_data_uri(Image.new("RGB", (84, 112), (180, 40, 20)))
    sp = SamplingParams(temperature=0.8, max_new_tokens=10, seed=5)
    return [GenerateRequest(text=prompt("Find x.", 1), images=(img,), sampling=sp, return_routed_experts=True),
            GenerateRequest(text=prompt("What is 2 + 2? Answer in a box.", 0), sampling=sp,
                            return_routed_experts=True),
            GenerateRequest(text=prompt("Find x.", 0), sampling=sp)]


@pytest.fixture(scope="module")
def generated(engine):
    reqs = _requests(engine)
    return reqs, engine.generate_sync(reqs)


def _experts(engine: EmbeddedEngine, res) -> torch.Tensor:
    lm = engine.model.config.text_config
    n = len(res.prompt_ids) + len(res.output_ids)
    flat = decode_routed_experts(res.routed_experts, tokens=n, layers=lm.num_hidden_layers,
                                 topk=lm.num_experts_per_tok)
    return torch.tensor(flat).view(n - 1, lm.num_hidden_layers, lm.num_experts_per_tok)


def _inputs(engine: EmbeddedEngine, req: GenerateRequest) -> dict:
    images = [load_image(s) for s in req.images] or None
    return engine.processor(text=[req.text], images=images, return_tensors="pt")


def test_engine_reports_what_its_routers_chose(engine, generated):
    """[prompt + output - 1, layers, top-k] per request that asked (none for the one that did
    not), equal to the routers' choices in one teacher-forced forward of the same tokens."""
    reqs, results = generated
    assert results[2].routed_experts is None
    layers = [layer for layer, _ in moe_routers(engine.model)]
    assert layers == list(range(engine.model.config.text_config.num_hidden_layers))
    for req, res in zip(reqs[:2], results[:2]):
        experts = _experts(engine, res)
        enc = _inputs(engine, req)
        ids = torch.tensor([res.prompt_ids + res.output_ids[:-1]])
        assert enc["input_ids"][0].tolist() == res.prompt_ids
        seen: dict[int, torch.Tensor] = {}
        handles = [m.register_forward_hook(lambda mod, a, out, i=i, seen=seen: seen.__setitem__(i, out[-1]))
                   for i, m in moe_routers(engine.model)]
        kwargs = {}
        if req.images:
            kwargs = dict(pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"],
                          mm_token_type_ids=(ids == engine.image_token_id).long())
        engine.model.model.rope_deltas = None
        try:
            with torch.no_grad():
                engine.model(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
        finally:
            for h in handles:
                h.remove()
        forward = torch.stack([seen[i] for i in layers], dim=1)  # [tokens, layers, k]
        assert forward.shape == experts.shape
        assert torch.equal(forward.sort(-1).values, experts.long().sort(-1).values)


def test_trainer_replays_the_engine_even_with_perturbed_routers(engine, generated, tiny_moe_config,
                                                                tiny_moe_checkpoint):
    from vlmrl.training.batch import TrainSample

    reqs, results = generated
    samples = []
    for req, res in zip(reqs[:2], results[:2]):
        enc = _inputs(engine, req)
        n_prompt = len(res.prompt_ids)
        samples.append(TrainSample(
            input_ids=res.prompt_ids + res.output_ids,
            loss_mask=[0.0] * n_prompt + [1.0] * len(res.output_ids),
            pixel_values=enc.get("pixel_values"), image_grid_thw=enc.get("image_grid_thw"),
            routed_experts=_experts(engine, res).to(torch.int16)))
    out = run_in_processes(_dist_worker(), 1, tiny_moe_config.model, tiny_moe_checkpoint, samples, 0.5,
                           timeout_s=240)[0]
    layers = tiny_moe_config.model.lm.num_layers
    assert out["known"] == sum(len(s.input_ids) - 1 for s in samples)
    # perturbed routers pick other experts on their own, and the metric says how often
    own = out["observed_replay=False"]
    assert out["misses_replay=False"] > 0
    assert len([k for k in own if k.startswith("moe/route_mismatch/layer_")]) == layers
    assert own["moe/route_mismatch_mean"] == pytest.approx(out["misses_replay=False"] / (out["known"] * layers))
    # with replay every layer routes every token the engine routed as the engine did; the
    # metric still reports the router's own disagreement (the first layer sees the same
    # input either way; later ones see what the replayed layers made of it)
    assert out["misses_replay=True"] == 0
    replayed = out["observed_replay=True"]
    assert replayed["moe/route_mismatch/layer_1"] == own["moe/route_mismatch/layer_1"] > 0


def _dist_worker():
    from _dist import replay_trainer_worker

    return replay_trainer_worker

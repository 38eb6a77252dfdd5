"""The Megatron trainer's step: its gradient is the gradient of the per-token mean loss.

Megatron sums per-token losses and divides by the global token count only in
`finalize_model_grads` (which also all-reduces over DP): the step's reported gradient norm
must equal that of HF transformers' mean NLL over the same tokens, same weights.
"""

from __future__ import annotations

import dataclasses

import pytest

from vlmrl.training.parallel_state import spawn_local


def _sft_samples(cfg, path: str, shared: bool = False) -> list:
    """Three image + answer samples for an SFT step. `shared`: two more, with other answers, on
    the first two images, as a prompt's replies share its image: one holds the first sample's
    pixel tensor itself, the other an equal copy of the second's (the trainer runs the vision
    tower once per distinct image of a micro-batch, `vlmrl.models.packing.share_images`)."""
    from PIL import Image, ImageDraw

    from vlmrl.models.processor import load_processor
    from vlmrl.training.batch import TrainSample

    d = cfg.data
    proc = load_processor(path, min_pixels=d.min_pixels, max_pixels=d.max_pixels)
    samples = []
    for k, answer in enumerate(("3", "45", "720")):
        img = Image.new("RGB", (112, 112), "white")
        ImageDraw.Draw(img).ellipse((20 + 10 * k, 20, 60 + 10 * k, 60), fill="black")
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many points?"}]}]
        text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        enc = proc(text=[text], images=[img], return_tensors="pt")
        ids = enc["input_ids"][0].tolist()
        resp = proc.tokenizer(f"Answer: \\boxed{{{answer}}}<|im_end|>")["input_ids"]
        samples.append(TrainSample(ids + resp, [0.0] * len(ids) + [1.0] * len(resp), enc["pixel_values"],
                                   enc["image_grid_thw"]))
    if shared:
        for k, answer in ((0, "4"), (1, "46")):
            first = samples[k]
            prompt = first.input_ids[:first.prompt_len]
            resp = proc.tokenizer(f"Answer: \\boxed{{{answer}}}<|im_end|>")["input_ids"]
            pixels = first.pixel_values if k == 0 else first.pixel_values.clone()
            samples.append(TrainSample(prompt + resp, [0.0] * len(prompt) + [1.0] * len(resp), pixels,
                                       first.image_grid_thw))
    return samples


def _hf_grad_norm(cfg, path: str, samples: list) -> float:
    """Norm of the gradient of HF transformers' mean NLL over the samples' loss tokens."""
    import torch
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(path).float()
    nll, tokens = 0.0, 0
    for s in samples:
        ids = torch.tensor([s.input_ids])
        out = hf(input_ids=ids, pixel_values=s.pixel_values, image_grid_thw=s.image_grid_thw,
                 mm_token_type_ids=(ids == cfg.model.image_token_id).long())
        logp = torch.log_softmax(out.logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
        mask = torch.tensor(s.loss_mask[1:])
        nll = nll - (logp * mask).sum()
        tokens += int(mask.sum())
    (nll / tokens).backward()
    return torch.sqrt(sum(p.grad.double().pow(2).sum() for p in hf.parameters() if p.grad is not None)).item()


def _trainer_grad_norm(cfg, path: str, samples: list, bucket: bool = False) -> tuple[float, int]:
    """(the trainer's gradient norm of one SFT step, layers on the fast path); `bucket` packs
    the micro-batches padded to their CUDA-graph bucket (`hardware.cuda_graphs`' layout)."""
    from vlmrl.config.layout import shares_prompts
    from vlmrl.training.trainer import MegatronTrainer

    trainer = MegatronTrainer(cfg, path)  # (re)creates Megatron's process groups for cfg.parallel
    if bucket:
        trainer.cuda_graphs = True  # the padding only: the CPU has no CUDA graphs
    mbs = trainer._step_micro_batches(samples)
    shared = sum(mb.shared_prompt_tokens for mb in mbs)
    # two of the samples repeat another's prompt: on CPU ranks without CP they run it once unless told not to
    assert (shared > 0) == shares_prompts(cfg)
    real = sum(s.num_tokens for s in samples) - shared
    packed = sum(mb.whole.num_tokens for mb in mbs)
    assert packed > real if bucket else packed >= real
    metrics = trainer.sft_step(samples)
    # the step reports its micro-batches and the padding they carried
    assert metrics["perf/micro_batches"] == len(mbs) >= 1
    assert metrics["perf/pad_tokens"] == packed - real
    assert metrics["perf/shared_prompt_tokens"] == shared
    fast = sum(bool(getattr(layer, "fast_path", False))
               for c in trainer.chunks for layer in c.language_model.decoder.layers)
    return metrics["grad_norm"], fast


def _sft_grad_norms(rank: int, world: int, cfgs: dict, path: str, bucket: bool = False) -> dict:
    """HF's gradient norm ("hf") and the trainer's (norm, fast layers) under each of `cfgs`,
    one after the other in the same ranks (one process start for all the layouts)."""
    first = next(iter(cfgs.values()))  # the layouts differ in parallelism only: same samples, same HF model
    samples = _sft_samples(first, path, shared=True)  # HF runs each sample's image; the trainer each distinct one
    out = {"hf": _hf_grad_norm(first, path, samples)}
    for name, cfg in cfgs.items():
        out[name] = _trainer_grad_norm(cfg, path, samples, bucket)
    return out


def test_step_gradient_is_the_per_token_mean(family_checkpoint):
    """Both families; Qwen3.5's micro-batch padded to its CUDA-graph bucket, which must change
    nothing (its padding runs through Gated DeltaNet, gated attention and the MoE router).
    Again with `hardware.fused_grad_accumulation`: its DDP hook, here on the CPU where torch's
    add does the sum, still hands every gradient to Megatron's main gradients. With
    `trainer.share_prompts` (on by default on CPU ranks) the two replies that repeat a prompt
    run it once, attending to it (in Qwen3.5 also starting from its Gated DeltaNet state and
    convolution window), and the gradient is still HF's, which runs every sample whole;
    "single" and "fused accumulation" run every sample whole too (the model-parallel layouts
    below share, but under CP)."""
    cfg, path = family_checkpoint
    bucket = "linear_attention" in cfg.model.lm.layer_types
    single = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, share_prompts=False))
    fused = dataclasses.replace(single, hardware=dataclasses.replace(cfg.hardware, fused_grad_accumulation=True))
    res = spawn_local(_sft_grad_norms, 1, {"single": single, "fused accumulation": fused, "shared prompts": cfg},
                      path, bucket)[0]
    hf_norm = res["hf"]
    for name in ("single", "fused accumulation", "shared prompts"):
        assert abs(res[name][0] - hf_norm) <= 1e-4 * hf_norm, (name, res[name][0], hf_norm)


def _reply_logprobs(rank: int, world: int, cfg, path: str) -> dict:
    """Logprobs of replies that hold the image token's and the vision markers' ids: the
    trainer's, and HF's with the engines' semantics (image features in the prompt's
    placeholders only, every generated token embedded as a word at the next text position,
    as the embedded engine and SGLang decode it)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from vlmrl.models.packing import mrope_position_ids
    from vlmrl.training.batch import TrainSample
    from vlmrl.training.trainer import MegatronTrainer

    m = cfg.model
    merge = m.vision.spatial_merge_size
    replies = [[m.image_token_id, 40, 41], [42, m.vision_start_token_id, m.image_token_id, m.image_token_id,
                                            m.vision_end_token_id, 43]]
    samples = [TrainSample(s.input_ids + r, [0.0] * len(s.input_ids) + [1.0] * len(r), s.pixel_values,
                           s.image_grid_thw) for s, r in zip(_sft_samples(cfg, path), replies)]
    hf = AutoModelForImageTextToText.from_pretrained(path).float().eval()
    ref = []
    with torch.no_grad():
        for s, reply in zip(samples, replies):
            ids = torch.tensor(s.input_ids)
            n = s.prompt_len
            feats = hf.model.get_image_features(s.pixel_values, s.image_grid_thw)
            feats = torch.cat(list(feats.pooler_output if hasattr(feats, "pooler_output") else feats))
            emb = hf.get_input_embeddings()(ids[None])
            emb[0, torch.nonzero(ids[:n] == m.image_token_id).view(-1)] = feats
            pos = mrope_position_ids(ids[:n], s.image_grid_thw, image_token_id=m.image_token_id,
                                     spatial_merge_size=merge)
            nxt = int(pos.max()) + 1
            pos = torch.cat([pos, torch.arange(nxt, nxt + len(reply)).expand(3, -1)], 1)
            logits = hf(inputs_embeds=emb, position_ids=pos[:, None]).logits[0, :-1]
            logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[1:, None])[:, 0]
            ref.append(logp[n - 1:])
    trainer = MegatronTrainer(cfg, path)
    return {"trainer": [t.float() for t in trainer.logprobs(samples)], "hf": ref}


def test_generated_placeholder_ids_are_text_to_the_trainer(family_checkpoint):
    """A sampled reply may hold the image token's id (a random or young policy emits it): the
    trainer scores it as the engines decoded it, as a word, instead of claiming image features
    for it (which failed the batch, `N image tokens but the grids need M`)."""
    cfg, path = family_checkpoint
    res = spawn_local(_reply_logprobs, 1, cfg, path)[0]
    for got, want in zip(res["trainer"], res["hf"]):
        assert got.shape == want.shape
        assert float((got - want).abs().max()) <= 1e-4, (got, want)


DENSE_LAYOUTS = {"tp=2": {"tp": 2}, "pp=2": {"pp": 2}, "cp=2": {"cp": 2}, "tp=2+sp": {"tp": 2, "sequence_parallel": True}}


def _layout_results(base, layouts: dict, path: str, fused: tuple[str, ...] = ()) -> list[dict]:
    cfgs = {name: dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, **kw),
                                      hardware=dataclasses.replace(base.hardware, fused_kernels=name in fused))
            for name, kw in layouts.items()}
    return spawn_local(_sft_grad_norms, 2, cfgs, path, timeout_s=600)


@pytest.fixture(scope="module")
def dense_layouts(tiny_config, tiny_checkpoint):
    return _layout_results(tiny_config, DENSE_LAYOUTS, tiny_checkpoint)


@pytest.mark.parametrize("layout", list(DENSE_LAYOUTS))
def test_step_gradient_under_model_parallelism(dense_layouts, layout):
    """The same step split over two ranks (TP, PP, CP, TP with sequence parallelism): the
    distributed gradient norm and the reduced metrics equal HF's single-model figures."""
    hf_norm = dense_layouts[0]["hf"]
    for rank in dense_layouts:  # every rank reports the same global figures
        megatron_norm, _ = rank[layout]
        assert abs(megatron_norm - hf_norm) <= 1e-4 * hf_norm, (layout, megatron_norm, hf_norm)


# (TP2+SP and EP2 alone are in the parity tests; here the trainer's reductions on top).
# PP2 runs with hardware.fused_kernels (the GPU configs' setting; Inductor's CPU backend here)
# and full-layer recompute: every layer of both stages on FusedTransformerLayer's compiled path,
# again in the recomputed forward. It runs last: the eager layouts never see a compiled kernel.
MOE_LAYOUTS = {"cp=2": {"cp": 2}, "tp=2+sp+ep=2": {"tp": 2, "sequence_parallel": True, "ep": 2},
               "pp=2+fused+recompute": {"pp": 2, "recompute_granularity": "full"}}


@pytest.fixture(scope="module")
def moe_layouts(tiny_moe_config, tiny_moe_checkpoint):
    return _layout_results(tiny_moe_config, MOE_LAYOUTS, tiny_moe_checkpoint, fused=("pp=2+fused+recompute",))


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_moe_step_gradient_under_model_parallelism(tiny_moe_config, moe_layouts, layout):
    """The tiny Qwen3.5-MoE through the real trainer (Megatron DDP, finalize_model_grads with
    the TP sums of the Gated DeltaNet norm, expert-parallel gradients) on two ranks: the
    gradient norm equals HF's for the same batch."""
    hf_norm = moe_layouts[0]["hf"]
    fused = "fused" in layout
    for rank in moe_layouts:
        megatron_norm, fast = rank[layout]
        assert abs(megatron_norm - hf_norm) <= 1e-4 * hf_norm, (layout, megatron_norm, hf_norm)
        assert fast == (tiny_moe_config.model.lm.num_layers // 2 if fused else 0)


def _uneven_expert_parallel_steps(rank: int, world: int, cfgs: dict, path: str) -> dict:
    """Each layout's SFT step and logprobs with this rank's share of an uneven split (rank 0
    three samples, rank 1 two)."""
    from vlmrl.training.trainer import MegatronTrainer

    samples = _sft_samples(next(iter(cfgs.values())), path)
    mine = samples if rank == 0 else samples[:2]
    out = {}
    for name, cfg in cfgs.items():
        trainer = MegatronTrainer(cfg, path)
        logprobs = trainer.logprobs(mine)
        m = trainer.sft_step(mine)
        out[name] = {"grad_norm": m["grad_norm"], "micro": m["perf/micro_batches"],
                     "fillers": m["perf/filler_micro_batches"], "logprobs": [len(x) for x in logprobs],
                     "loss_tokens": [int(sum(1 for v in s.loss_mask if v)) for s in mine]}
    return out


def test_uneven_splits_under_expert_parallelism_run_as_many_micro_batches(tiny_moe_config, tiny_moe_checkpoint):
    """EP2 over two data-parallel ranks (TP1): the MoE layers' all-to-all spans both, and the
    ranks hold three and two samples. One sample a micro-batch: rank 1 runs a filler beside its
    two (before, rank 1 went on to the gradient reduce while rank 0 waited in the all-to-all:
    a hang). Two a micro-batch: rank 1 splits its one micro-batch in two instead. Either way the
    step's gradient is HF's over all five samples, and logprobs come back for every real one."""
    def layout(mbs: int):
        return dataclasses.replace(tiny_moe_config, parallel=dataclasses.replace(
            tiny_moe_config.parallel, ep=2, use_dynamic_batch_size=False, micro_batch_size=mbs))

    res = spawn_local(_uneven_expert_parallel_steps, 2, {"one": layout(1), "two": layout(2)}, tiny_moe_checkpoint,
                      timeout_s=300)
    samples = _sft_samples(tiny_moe_config, tiny_moe_checkpoint)
    hf = _hf_grad_norm(tiny_moe_config, tiny_moe_checkpoint, samples + samples[:2])
    for name, fillers in (("one", [0, 1]), ("two", [0, 0])):
        for rank, r in enumerate(res):
            got = r[name]
            assert abs(got["grad_norm"] - hf) <= 1e-4 * hf, (name, rank, got["grad_norm"], hf)
            assert got["micro"] == (3 if name == "one" else 2) and got["fillers"] == fillers[rank], (name, rank, got)
            assert got["logprobs"] == got["loss_tokens"], (name, rank, got)


def _tp_checkpoint(rank: int, world: int, cfg, path: str, ckpt: str, save: bool) -> dict | None:
    """save: one SFT step, save the checkpoint, one more step; else: load it, one more step.
    Returns the HF-named weights after the last step (rank 0)."""
    from vlmrl.models import adapters
    from vlmrl.training.checkpoint import load_checkpoint, save_checkpoint
    from vlmrl.training.trainer import MegatronTrainer

    samples = _sft_samples(cfg, path)
    trainer = MegatronTrainer(cfg, path)
    if save:
        trainer.sft_step(samples)
        save_checkpoint(trainer, ckpt)
    else:
        load_checkpoint(trainer, ckpt)
    trainer.sft_step(samples)
    weights = adapters.export_hf_state_dict(trainer.chunks, cfg.model)
    return {k: v.cpu() for k, v in weights.items()} if rank == 0 else None


# slow (four ranks on two cores, about 40 s): the default suite keeps TP4's numerics and
# bitwise HF weight round trip (test_qwen35_parity.py::test_tp_wider_than_the_kv_groups)
@pytest.mark.slow
def test_tp4_checkpoint_resumes_under_tp2(tiny_moe_config, tiny_moe_checkpoint, tmp_path):
    """Tensor parallelism wider than the KV groups (TP4 over 2 groups) on the tiny Qwen3.5-MoE:
    a checkpoint written under TP4 + SP + EP2 loads under TP2 + SP, and the next step (weights
    and Adam moments restored) gives the same weights as the TP4 run's next step."""
    import torch

    def layout(**kw):
        return dataclasses.replace(tiny_moe_config, parallel=dataclasses.replace(tiny_moe_config.parallel, **kw))

    ckpt = str(tmp_path / "ckpt")
    tp4 = spawn_local(_tp_checkpoint, 4, layout(tp=4, sequence_parallel=True, ep=2), tiny_moe_checkpoint, ckpt,
                      True, timeout_s=600)[0]
    tp2 = spawn_local(_tp_checkpoint, 2, layout(tp=2, sequence_parallel=True), tiny_moe_checkpoint, ckpt, False,
                      timeout_s=600)[0]
    assert tp4.keys() == tp2.keys()
    worst = max(float((tp4[k] - tp2[k]).abs().max()) for k in tp4)
    assert worst <= 1e-6, worst
    assert any(not torch.equal(tp4[k], v) for k, v in _base_weights(tiny_moe_checkpoint).items() if k in tp4)


# slow (two process starts, about 45 s on two cores): the default suite is over its time budget
@pytest.mark.slow
def test_checkpoint_resumes_under_another_data_parallel_size(tiny_moe_config, tiny_moe_checkpoint, tmp_path):
    """A checkpoint written by two data-parallel ranks (the same samples on each, so their
    mean gradient is one rank's) loads into one rank, and the next step gives the same
    weights as the two-rank run's next step: weights, Adam moments and step counters carry
    over a change of data-parallel size (CPU ranks: the plain optimizer's per-parameter
    state; the GPU's dp_reshardable format: tests/gpu/test_checkpoint_gpu.py on one GPU)."""
    ckpt = str(tmp_path / "ckpt")
    dp2 = spawn_local(_tp_checkpoint, 2, tiny_moe_config, tiny_moe_checkpoint, ckpt, True, timeout_s=600)[0]
    dp1 = spawn_local(_tp_checkpoint, 1, tiny_moe_config, tiny_moe_checkpoint, ckpt, False, timeout_s=600)[0]
    assert dp2.keys() == dp1.keys()
    worst = max(float((dp2[k] - dp1[k]).abs().max()) for k in dp2)
    assert worst <= 1e-6, worst


def _base_weights(path: str) -> dict:
    from vlmrl.models.adapters import SafetensorsDir

    src = SafetensorsDir(path, "qwen3_5_moe")
    return {k: src[k] for k in list(src)[:20]}


def _grpo_step_gain(rank: int, world: int, cfg, path: str) -> dict:
    """One GRPO step (PPO loss, on-policy) on replies of both advantage signs after the same
    prompts; per sample its advantage and the mean change of its reply's logprobs."""
    import dataclasses
    import random

    from vlmrl.training.trainer import MegatronTrainer

    optim = dataclasses.replace(cfg.trainer.optim, lr=1e-5, weight_decay=0.0)
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, optim=optim))
    trainer = MegatronTrainer(cfg, path)
    rng = random.Random(0)
    low = max(cfg.model.image_token_id, cfg.model.vision_end_token_id or 0) + 16  # ordinary text ids
    samples = []
    for s in _sft_samples(cfg, path):
        prompt = s.input_ids[:s.prompt_len]
        for k in range(4):
            reply = [rng.randrange(low, cfg.model.lm.vocab_size) for _ in range(6 + k)]
            samples.append(dataclasses.replace(
                s, input_ids=prompt + reply, loss_mask=[0.0] * len(prompt) + [1.0] * len(reply),
                advantage=1.0 if k % 2 == 0 else -1.0))
    before = trainer.logprobs(samples)
    trainer.train_step(samples)
    after = trainer.logprobs(samples)
    return {"advantages": [s.advantage for s in samples],
            "moved": [float((b - a).mean()) for a, b in zip(before, after)]}


def test_a_small_grpo_step_raises_the_reward_it_was_computed_on(family_checkpoint):
    """On-policy, a small step of the GRPO loss must move probability towards the replies with
    positive advantage and away from the others: sum_i A_i * (mean change of log pi(reply_i))
    is positive, and so is each reply's change times its advantage's sign, for each family. A
    sign or a normaliser wrong in the loss, the logprobs or the gradient would fail it."""
    cfg, path = family_checkpoint
    res = spawn_local(_grpo_step_gain, 1, cfg, path)[0]
    gain = sum(a * m for a, m in zip(res["advantages"], res["moved"]))
    print(cfg.model.family, "gain", gain, res["moved"])
    assert gain > 0
    assert all(a * m > 0 for a, m in zip(res["advantages"], res["moved"])), res


def _lr_schedule(rank: int, world: int, cfg, path: str) -> dict:
    """The learning rate each step used: two warm-up steps on `lr`'s schedule, then RL's own
    (`start_rl_schedule`), then that schedule's state through a checkpoint-style round trip."""
    from vlmrl.training.trainer import MegatronTrainer

    samples = _sft_samples(cfg, path)
    trainer = MegatronTrainer(cfg, path, total_steps=2)
    lrs = []
    for _ in range(2):
        lrs.append(trainer.optimizer.param_groups[0]["lr"])
        trainer.sft_step(samples)
    first = trainer.start_rl_schedule(4)
    for _ in range(2):
        lrs.append(trainer.optimizer.param_groups[0]["lr"])
        trainer.sft_step(samples)
    saved = trainer.scheduler.state_dict()
    fresh = MegatronTrainer(cfg, path, total_steps=2)  # a resumed run builds the warm-up's schedule...
    fresh.load_scheduler_state(saved)  # ...and its checkpoint's scheduler state restores RL's
    fresh.scheduler.step(increment=1)
    return {"lrs": lrs, "first": first, "resumed_next": fresh.optimizer.param_groups[0]["lr"]}


def test_rl_phase_starts_its_own_learning_rate_schedule(tiny_config, tiny_checkpoint):
    """`trainer.optim.rl_lr`: the SFT warm-up decays `lr` over its own steps; RL then starts at
    `rl_lr` and decays over its steps (linear here), and a checkpoint carries RL's schedule."""
    optim = dataclasses.replace(tiny_config.trainer.optim, lr=1e-3, rl_lr=2e-4, lr_decay_style="linear", min_lr=0.0)
    cfg = dataclasses.replace(tiny_config, trainer=dataclasses.replace(tiny_config.trainer, optim=optim))
    res = spawn_local(_lr_schedule, 1, cfg, tiny_checkpoint)[0]
    assert res["lrs"] == pytest.approx([1e-3, 5e-4, 2e-4, 1.5e-4]), res
    assert res["first"] == pytest.approx(2e-4)
    assert res["resumed_next"] == pytest.approx(5e-5), res  # RL step 4 of 4 after the restored state


def _kl_reference(rank: int, world: int, cfg, path: str, ckpt: str) -> dict:
    """The KL term's reference before and after `set_reference_to_policy`, through a checkpoint."""
    import dataclasses

    from vlmrl.models import adapters
    from vlmrl.training.checkpoint import load_checkpoint, save_checkpoint
    from vlmrl.training.trainer import MegatronTrainer

    cfg = dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, kl_coef=0.5))
    sft = _sft_samples(cfg, path)
    rl = [dataclasses.replace(s, advantage=1.0 if k % 2 else -1.0) for k, s in enumerate(sft)]
    trainer = MegatronTrainer(cfg, path)
    trainer.sft_step(sft)  # the warm-up moves the policy away from the start checkpoint
    kl_initial = trainer.train_step(rl)["kl"]
    trainer.set_reference_to_policy()
    kl_warmup = trainer.train_step(rl)["kl"]  # one optimizer step: every micro-batch sees the reference's weights
    save_checkpoint(trainer, ckpt)
    import psutil  # the save's writers are gone, and no Manager process was left serving their results

    children = [" ".join(c.cmdline()[:3]) for c in psutil.Process().children(recursive=True)]
    saved = adapters.export_hf_state_dict(trainer.ref_chunks, cfg.model)
    fresh = MegatronTrainer(cfg, path)
    started = adapters.export_hf_state_dict(fresh.ref_chunks, cfg.model)
    load_checkpoint(fresh, ckpt)
    loaded = adapters.export_hf_state_dict(fresh.ref_chunks, cfg.model)
    return {"kl_initial": kl_initial, "kl_warmup": kl_warmup, "reference": fresh.reference,
            "loaded_equal": all(bool((saved[k] == loaded[k]).all()) for k in saved),
            "moved": sum(not bool((saved[k] == started[k]).all()) for k in saved), "keys": len(saved),
            "children": children}


def test_kl_reference_is_the_policy_after_the_warm_up_and_checkpointed(tiny_config, tiny_checkpoint, tmp_path):
    """`algo.kl_reference=warmup`: after the warm-up the reference takes the policy's weights
    (the KL of the next on-policy step is 0; against the start checkpoint it is not), and a
    checkpoint carries that reference, which a resumed trainer loads instead of the start's."""
    res = spawn_local(_kl_reference, 1, tiny_config, tiny_checkpoint, str(tmp_path / "ckpt"))[0]
    assert res["kl_initial"] > 1e-4, res
    assert abs(res["kl_warmup"]) < 1e-6, res
    assert res["reference"] == "warmup" and res["loaded_equal"], res
    assert res["children"] == [], res
    assert res["moved"] > res["keys"] // 2, res  # the saved reference is the warmed-up policy, not the start

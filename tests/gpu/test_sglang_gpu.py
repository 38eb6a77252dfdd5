"""The real SGLang under vlmrl on one GPU: a server in its Ray actor and placement bundle,
driven by vlmrl's client and rollout manager, beside a Megatron trainer rank on the same GPU.

SGLang pins its own torch and transformers, so it usually lives in an environment of its own:
`VLMRL_SGLANG_PYTHON` (the interpreter; default this one) and `VLMRL_SGLANG_ENV` (JSON of extra
environment, e.g. `{"PYTHONPATH": "/opt/sglang-site"}`) say where, as `rollout.sglang.python`
and `rollout.sglang.env` do in a run. `VLMRL_SGLANG_SERVER_ARGS` (JSON) adds ServerArgs for the
machine (e.g. Triton attention where FlashAttention 3 is not installed). Without an SGLang
release vlmrl knows, these tests skip.

The model is the tiny Qwen3.5-MoE (Gated DeltaNet + gated attention + MoE, the Qwen3.5 vision
tower) in bfloat16, the prompts are the synthetic task's image prompts, as a run sends them.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

# bf16 logprobs of the same weights, engine against trainer: both round activations to bf16 at
# every layer but differ in kernels (SGLang's Triton attention and fused MoE, the trainer's
# SDPA and grouped GEMMs), so single tokens may differ by a few bf16 ulps of the logit scale;
# the mean over the sampled tokens stays near 1e-2 or below.
MEAN_LOGPROB_TOL = 2e-2
MAX_LOGPROB_TOL = 0.25


def _install() -> tuple[str, dict[str, str], str]:
    from vlmrl.contracts.sglang_contract import known_versions
    from vlmrl.rollout.sglang import installed_sglang_version

    python = os.environ.get("VLMRL_SGLANG_PYTHON") or sys.executable
    env = json.loads(os.environ.get("VLMRL_SGLANG_ENV") or "{}")
    try:
        version = installed_sglang_version(python, {**os.environ, **env})
    except RuntimeError as e:
        pytest.skip(str(e))
    if version not in known_versions():
        pytest.skip(f"sglang {version} has no contract in vlmrl")
    return python, env, version


def _dict_overrides(key: str, d: dict[str, object]) -> list[str]:
    return [f"+{key}.{k}={json.dumps(v)}" for k, v in d.items()]


def sglang_overrides(run_dir: str, cache_dir: str) -> list[str]:
    """The config of an SGLang run on one GPU with the tiny Qwen3.5-MoE (also used by the
    loop's GPU test)."""
    python, env, _ = _install()
    server_args = json.loads(os.environ.get("VLMRL_SGLANG_SERVER_ARGS") or "{}")
    out = [f"run_dir={run_dir}", f"model.cache_dir={cache_dir}", "model=tiny_qwen3_5_moe", "model.dtype=bfloat16",
           "hardware=h200", "rollout=sglang", "cluster.num_gpus=1", "cluster.colocate=true",
           f"rollout.sglang.python={python}", "logger.wandb=false", "logger.progress=false",
           # the tiny model needs none of the compiled kernels; their compile would dominate
           "hardware.fused_kernels=false", "hardware.cuda_graphs=false", "hardware.gdn_backend=torch",
           "hardware.lm_attention_backend=sdpa", "hardware.vision_attn_implementation=sdpa",
           "rollout.sglang.cuda_graph_max_bs=32",
           # no reference model: these tests passed on the H200 without one (the embedded
           # default's KL term came after; the loop's KL path is tested on the CPU)
           "algo.kl_coef=0"]
    return [*out, *_dict_overrides("rollout.sglang.env", env),
            *_dict_overrides("rollout.sglang.server_args", server_args)]


@pytest.fixture(scope="module")
def rig(tmp_path_factory, cache_dir):
    """Ray with the run's placement group, one SGLang engine in its bundle (0.3 of the GPU),
    a Megatron trainer rank in this process on the same GPU, and the test split's prompts."""
    from vlmrl.cluster.placement import create_placement
    from vlmrl.cluster.ray_cluster import ray_cluster
    from vlmrl.cluster.trainer_group import TrainerWorker
    from vlmrl.config import load
    from vlmrl.config.layout import compute_layout, returns_routed_experts
    from vlmrl.data.prompts import PromptDataset
    from vlmrl.loop import model_path
    from vlmrl.models.processor import load_processor
    from vlmrl.rollout.auth import new_key
    from vlmrl.rollout.sglang import launch_sglang_engines

    run_dir = tmp_path_factory.mktemp("sglang")
    # routing replay on: the trainer's routers can replay SGLang's experts where a sample
    # carries them (test_routed_experts_are_reported_and_replayed), the others route as usual
    cfg = load([*sglang_overrides(str(run_dir), cache_dir), "rollout.sglang.mem_fraction_static=0.3",
                "trainer.offload=false", "algo.routing_replay=rollout"])
    path = model_path(cfg)
    layout = compute_layout(cfg)
    with ray_cluster(cfg, run_dir):
        placement = create_placement(cfg, layout)
        t0 = time.perf_counter()
        key = new_key()  # the run's engine key: SGLang's --api-key / --admin-api-key
        engines = asyncio.run(launch_sglang_engines(cfg.rollout, cfg.hardware, cfg.model, layout.engines(cfg),
                                                    run_dir=run_dir, placement=placement, model_path=path,
                                                    colocate=True, data=cfg.data, api_key=key,
                                                    return_routed_experts=returns_routed_experts(cfg)))
        print(f"sglang {engines.version} healthy after {time.perf_counter() - t0:.1f} s")
        worker = TrainerWorker(cfg, 0, 1, "127.0.0.1", None)
        worker.init(path, 4)
        d = cfg.data
        processor = load_processor(path, min_pixels=d.min_pixels, max_pixels=d.max_pixels)
        prompts = list(PromptDataset(d, d.test_split, processor))[:8]
        try:
            yield {"cfg": cfg, "engines": engines, "path": path, "worker": worker, "processor": processor,
                   "prompts": prompts, "run_dir": run_dir, "key": key}
        finally:
            asyncio.run(engines.shutdown())
            _keep_logs(run_dir)


def _keep_logs(run_dir) -> None:
    """The servers' logs (startup phases, the loader's lines) into $OUT when the device tool
    runs the tests: the test's run folder is gone with the machine."""
    import shutil

    out = os.environ.get("OUT")
    if out:
        dest = Path(out) / "sglang-test-logs"
        dest.mkdir(parents=True, exist_ok=True)
        for log in (Path(run_dir) / "logs").glob("*.log"):
            shutil.copy(log, dest / log.name)


def _run(coro):
    from vlmrl.rollout.manager import close_sessions

    async def go():
        try:
            return await coro
        finally:
            await close_sessions(_CLIENTS)

    return asyncio.run(go())


_CLIENTS: list = []


def _client(rig):
    c = rig["engines"].engines[0]
    if c not in _CLIENTS:
        _CLIENTS.append(c)
    return c


def _request(prompt, *, max_new_tokens=24, temperature=0.0, images=True):
    from vlmrl.loop import rollout_prompt
    from vlmrl.rollout.protocol import GenerateRequest, SamplingParams

    rp = rollout_prompt(prompt)
    # without its images, the prompt loses their placeholders too (the chat template's vision block)
    text = rp.prompt_text if images else re.sub(r"<\|vision_start\|>.*?<\|vision_end\|>", "", rp.prompt_text)
    return GenerateRequest(text=text, images=rp.images if images else (),
                           sampling=SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens))


def _trainer_logprobs(rig, prompt, result):
    """The trainer's logprobs of the engine's sampled tokens (greedy: T = 1)."""
    from vlmrl.data.prompts import encode_prompt
    from vlmrl.training.batch import TrainSample

    enc = encode_prompt(rig["processor"], prompt)
    sample = TrainSample(input_ids=enc["input_ids"] + list(result.output_ids),
                         loss_mask=[0.0] * len(enc["input_ids"]) + [1.0] * len(result.output_ids),
                         pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"])
    return rig["worker"].logprobs([sample])[0].float().tolist()


def _gap(a, b):
    diffs = [abs(x - y) for x, y in zip(a, b)]
    assert len(a) == len(b) and diffs
    return sum(diffs) / len(diffs), max(diffs)


def _sync(rig, version):
    cfg = rig["cfg"]
    return rig["worker"].sync_weights([rig["engines"].engines[0].base_url],
                                      bucket_bytes=cfg.rollout.weight_update_bucket_mb << 20, weight_version=version,
                                      api_key=rig["key"])


def test_text_and_image_generate(rig):
    """Image prompts reach SGLang with the image-token count the trainer's processor makes (the
    prompt ids it reports equal the trainer's), the image changes what the model sees, and
    text-only prompts work beside them."""
    from vlmrl.data.prompts import encode_prompt

    client = _client(rig)
    p, q = rig["prompts"][0], rig["prompts"][1]

    async def go():
        return await client.generate([_request(p), _request(p, images=False), _request(q)])

    with_image, text_only, other = _run(go())
    assert with_image.prompt_ids == encode_prompt(rig["processor"], p)["input_ids"]
    assert rig["cfg"].model.image_token_id in with_image.prompt_ids
    assert rig["cfg"].model.image_token_id not in text_only.prompt_ids
    for r in (with_image, text_only, other):
        assert r.finish_reason in ("stop", "length") and len(r.logprobs) == len(r.output_ids) > 0
    # same words, another picture (the synthetic task's prompts can tokenise alike: the same
    # question, images of one size): what the model sees differs
    assert with_image.logprobs[0] != other.logprobs[0] or with_image.output_ids != other.output_ids


def test_callers_without_the_run_key_are_refused(rig):
    """SGLang started with the run's key answers 401 to a caller without it (the liveness
    probe excepted) and keeps serving the run's client, which sends it."""
    import urllib.error
    import urllib.request

    url = rig["engines"].engines[0].base_url
    assert url.startswith("http://127.0.0.1:")  # one machine: loopback only
    codes = []
    for path in ("/release_memory_occupation", "/update_weights_from_tensor", "/generate", "/flush_cache"):
        req = urllib.request.Request(url + path, data=b"{}", headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=30)
        except urllib.error.HTTPError as e:
            codes.append(e.code)
    assert codes == [401] * 4
    assert urllib.request.urlopen(url + "/health", timeout=60).status == 200
    out = _run(_client(rig).generate([_request(rig["prompts"][0], max_new_tokens=4)]))[0]
    assert len(out.output_ids) == 4


def test_weight_update_matches_the_trainer(rig):
    """The engine's logprobs after a sync equal the trainer's on the same tokens (bf16), before
    and after a training step changed the weights; each sample reports the synced version."""
    from vlmrl.loop import train_samples

    client = _client(rig)
    prompts = rig["prompts"][:4]
    sent = _sync(rig, "t0")
    assert sent > 0
    results = _run(client.generate([_request(p) for p in prompts]))
    assert {r.weight_version for r in results} == {"t0"}
    for p, r in zip(prompts, results):
        mean, worst = _gap(r.logprobs, _trainer_logprobs(rig, p, r))
        print(f"before the step: mean |diff| {mean:.2e}, max {worst:.2e}")
        assert mean < MEAN_LOGPROB_TOL and worst < MAX_LOGPROB_TOL
    # one GRPO-shaped step with large advantages, so the weights move visibly
    from vlmrl.rollout.manager import SampleRecord

    records = [SampleRecord(prompt_index=p.index, sample_index=0, group_index=i, prompt_ids=r.prompt_ids,
                            response_ids=r.output_ids, text=r.text, logprobs=r.logprobs, finish_reason=r.finish_reason,
                            truncated=r.truncated) for i, (p, r) in enumerate(zip(prompts, results))]
    samples, skipped = train_samples(rig["processor"], {p.index: p for p in prompts}, records,
                                     [1.0, -1.0, 1.0, -1.0])
    assert len(samples) == 4 and not any(skipped.values())
    for _ in range(3):
        rig["worker"].train_step(samples)
    stale = _run(client.generate([_request(prompts[0])]))[0]
    _sync(rig, "t1")
    fresh = _run(client.generate([_request(prompts[0])]))[0]
    assert fresh.weight_version == "t1"
    mean, worst = _gap(fresh.logprobs, _trainer_logprobs(rig, prompts[0], fresh))
    print(f"after the step: mean |diff| {mean:.2e}, max {worst:.2e}")
    assert mean < MEAN_LOGPROB_TOL and worst < MAX_LOGPROB_TOL
    assert stale.logprobs != fresh.logprobs  # the sync changed what the engine computes
    # vlmrl's loader (rollout.sglang.weight_loader=vlmrl) copied every layer's experts whole
    layers = rig["cfg"].model.lm.num_layers
    log = (rig["run_dir"] / "logs" / "sglang-0.log").read_text(errors="replace")
    assert f"vlmrl_sglang_loader: {layers} of {layers} MoE layers load their routed experts in one copy each" in log


def test_routed_experts_are_reported_and_replayed(rig):
    """SGLang reports each token's experts ([prompt + output - 1, layers, top-k], decoded as a
    run decodes them); the trainer's bf16 router (fp32 logits) picks the same top-k set for
    most tokens (the share that differs is printed per layer); replaying SGLang's experts
    routes every token by them and keeps the logprob gap within the bf16 bound."""
    import torch

    from vlmrl.data.prompts import encode_prompt
    from vlmrl.models import routing
    from vlmrl.rollout.protocol import decode_routed_experts
    from vlmrl.training.batch import TrainSample

    client = _client(rig)
    _sync(rig, "experts")
    lm = rig["cfg"].model.lm
    prompts = rig["prompts"][:4]
    results = _run(client.generate([_request(p, temperature=1.0).replace(return_routed_experts=True)
                                    for p in prompts]))
    trainer = rig["worker"].trainer
    routers = [r for c in trainer.chunks for r in routing.routers(c)]
    differ: dict[int, list[int]] = {}

    def sink(router, d, k):
        acc = differ.setdefault(int(router.layer_number), [0, 0])
        acc[0] += int(d)
        acc[1] += int(k)

    saved = [r.__dict__.get("vlmrl_mismatch_sink") for r in routers]
    try:
        for r in routers:
            r.vlmrl_mismatch_sink = sink
        for p, res in zip(prompts, results):
            n = len(res.prompt_ids) + len(res.output_ids)
            flat = decode_routed_experts(res.routed_experts, tokens=n, layers=lm.num_layers, topk=lm.moe_router_topk)
            experts = torch.tensor(flat).view(n - 1, lm.num_layers, lm.moe_router_topk)
            assert 0 <= int(experts.min()) and int(experts.max()) < lm.num_experts
            assert bool((experts.sort(-1).values.diff(dim=-1) > 0).all())  # k distinct experts a token
            enc = encode_prompt(rig["processor"], p)
            assert enc["input_ids"] == res.prompt_ids
            sample = TrainSample(input_ids=res.prompt_ids + list(res.output_ids),
                                 loss_mask=[0.0] * len(res.prompt_ids) + [1.0] * len(res.output_ids),
                                 pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"],
                                 routed_experts=experts.to(torch.int16))
            replayed = rig["worker"].logprobs([sample])[0].float().tolist()
            for c in trainer.chunks:
                routing.configure(c, replay=False)
            try:
                own = rig["worker"].logprobs([sample])[0].float().tolist()
            finally:
                for c in trainer.chunks:
                    routing.configure(c, replay=True)
            own_gap, replay_gap = _gap(res.logprobs, own), _gap(res.logprobs, replayed)
            print(f"logprob gap: own routing {own_gap[0]:.2e} (max {own_gap[1]:.2e}), "
                  f"replayed {replay_gap[0]:.2e} (max {replay_gap[1]:.2e})")
            assert replay_gap[0] < MEAN_LOGPROB_TOL and replay_gap[1] < MAX_LOGPROB_TOL
    finally:
        for r, old in zip(routers, saved):
            if old is None:
                r.__dict__.pop("vlmrl_mismatch_sink", None)
            else:
                r.vlmrl_mismatch_sink = old
    shares = {layer: d / k for layer, (d, k) in sorted(differ.items())}
    print("tokens routed unlike SGLang, by layer:", {k: round(v, 4) for k, v in shares.items()})
    assert len(shares) == lm.num_layers and max(shares.values()) < 0.25


def test_release_refuses_generation_and_resume_serves_again(rig):
    """After a release no request reaches the server (SGLang dies on one); the server stays up;
    after resume and a sync it answers as before."""
    from vlmrl.rollout.protocol import EngineError

    client = _client(rig)
    p = rig["prompts"][2]
    _sync(rig, "r0")
    before = _run(client.generate([_request(p)]))[0]
    _run(client.release_memory_occupation())
    with pytest.raises(EngineError, match="released"):
        _run(client.generate([_request(p)]))
    assert _run(client.health())
    _run(client.resume_memory_occupation(["weights"]))
    _sync(rig, "r1")  # released weights are not kept: the run always syncs after a resume
    _run(client.resume_memory_occupation(["cuda_graph", "kv_cache"]))
    after = _run(client.generate([_request(p)]))[0]
    assert after.output_ids == before.output_ids
    assert max(abs(a - b) for a, b in zip(after.logprobs, before.logprobs)) < 1e-3


def test_server_killed_mid_rollout_is_restarted_resynced_and_retried(rig):
    """SIGKILL of the SGLang server while a rollout runs: the manager sees the engine down,
    restarts it in its actor (same port), the trainer's weights are synced again, the lost
    requests are retried there, and every group completes."""
    import ray

    from vlmrl.rollout.manager import RolloutManager
    from vlmrl.rollout.protocol import SamplingParams

    engines = rig["engines"]
    client, actor = engines.engines[0], engines.actors[0]
    cfg = rig["cfg"]
    _sync(rig, "k0")
    reference = _run(client.generate([_request(rig["prompts"][3])]))[0]
    restarts = []

    async def restart(i: int) -> None:
        await client.close_session()
        await asyncio.to_thread(ray.get, actor.stop.remote())
        await asyncio.to_thread(ray.get, actor.start.remote())
        await asyncio.to_thread(ray.get, actor.wait_healthy.remote(cfg.rollout.sglang.startup_timeout_s))
        client.rebase(client.base_url)
        await asyncio.to_thread(_sync, rig, "k1")
        restarts.append(i)

    # long replies (32 of 1,024 tokens take seconds): the kill lands while they are generated
    manager = RolloutManager([client], n_samples=4, max_retries=3, backoff_s=0.2, progress=False,
                             sampling=SamplingParams(temperature=1.0, max_new_tokens=1024, ignore_eos=True),
                             restart_engine=restart)
    pid = ray.get(actor.pid.remote())

    async def go():
        task = asyncio.ensure_future(manager.generate([_as_rollout(p) for p in rig["prompts"]]))
        deadline = time.monotonic() + 30
        while (await client.load())["running"] == 0:  # wait until the server is generating
            assert time.monotonic() < deadline and not task.done(), "the rollout never reached the server"
            await asyncio.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        return await task

    batch = _run(go())
    assert restarts == [0]
    assert batch.stats.engine_restarts == 1 and batch.stats.retries >= 1
    assert batch.stats.dropped_groups == 0 and len(batch.records) == 4 * len(rig["prompts"])
    assert {r.weight_version for r in batch.records if r.attempts > 1} == {"k1"}
    again = _run(client.generate([_request(rig["prompts"][3])]))[0]
    assert again.output_ids == reference.output_ids  # the same weights came back


def _as_rollout(prompt):
    from vlmrl.loop import rollout_prompt

    return rollout_prompt(prompt)

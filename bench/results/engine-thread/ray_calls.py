import asyncio, glob, time, ray
from dataclasses import replace
from vlmrl.rollout.embedded import create_embedded_actor, RayEngine, EmbeddedEngine
from vlmrl.bench.rollout import _requests
path = glob.glob('/root/.cache/vlmrl/models/tiny-qwen3_5_moe-*')[0]
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
actor = create_embedded_actor(path, num_cpus=1, torch_threads=2, device="cpu", min_pixels=3136, max_pixels=16384, dtype="float32", max_batch_size=128)
eng = RayEngine(actor)
proc_eng = EmbeddedEngine.__new__(EmbeddedEngine)
from vlmrl.models.processor import load_processor
proc_eng.processor = load_processor(path, min_pixels=3136, max_pixels=16384)
reqs = _requests(proc_eng, 8, 24, with_image=True)
allr = [replace(r, sampling=replace(r.sampling, seed=k * 16 + j), rid=f"r{k}-{j}") for k, r in enumerate(reqs) for j in range(16)]
async def per_request():
    return await asyncio.gather(*(eng.generate([r]) for r in allr))
async def one_call():
    return await eng.generate(allr)
ray.get(actor.health.remote())
asyncio.run(one_call())
for name, f in (("per-request", per_request), ("one call", one_call), ("per-request", per_request), ("one call", one_call)):
    s0 = ray.get(actor.stats.remote())["batches"]
    t0 = time.perf_counter(); asyncio.run(f()); dt = time.perf_counter() - t0
    print(name, round(dt, 3), "batches", ray.get(actor.stats.remote())["batches"] - s0)

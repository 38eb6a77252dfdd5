import glob, time, sys
from dataclasses import replace
from concurrent.futures import ThreadPoolExecutor
import torch
torch.set_num_threads(2)
path = glob.glob('/root/.cache/vlmrl/models/tiny-qwen3_5_moe-*')[0]
from vlmrl.rollout.embedded import EmbeddedEngine
from vlmrl.bench.rollout import _requests
mode = sys.argv[1]
ex = ThreadPoolExecutor(1)
def build():
    e = EmbeddedEngine(path, device="cpu", dtype="float32", min_pixels=3136, max_pixels=16384, max_batch_size=128)
    reqs = _requests(e, 8, 24, with_image=True)
    allr = [replace(r, sampling=replace(r.sampling, seed=k * 16 + j)) for k, r in enumerate(reqs) for j in range(16)]
    e.generate_sync(allr[:4]) if mode == "main-warm" else None
    return e, allr
e, allr = ex.submit(build).result() if mode == "all-worker" else build()
def run():
    e._prompt_cache.clear()
    t0 = time.perf_counter(); e.generate_sync(allr); return round(time.perf_counter() - t0, 3)
print(mode, "worker", ex.submit(run).result(), ex.submit(run).result(), ex.submit(run).result())

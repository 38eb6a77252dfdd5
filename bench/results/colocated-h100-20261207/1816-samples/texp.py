# why building the trainer's samples took 0.3 s a step in the loop on the H100 host (0.04 s on the CPU machine): the same work alone
import time, random, base64, cProfile, pstats, os, sys
import numpy as np, torch, transformers
from vlmrl.config import load
from vlmrl.data.prompts import PromptDataset, encode_prompt
from vlmrl.models.processor import load_processor
from vlmrl.models.tiny import model_path
from vlmrl.rollout.manager import SampleRecord
from vlmrl.experience import train_samples, group_inputs
print("transformers", transformers.__version__, "torch", torch.__version__, "threads", torch.get_num_threads(), "cpus", os.cpu_count())
cfg = load(["model=tiny_qwen3_5_moe"], check_rules=False)
t = time.perf_counter(); path = model_path(cfg); print("tiny checkpoint", time.perf_counter() - t)
proc = load_processor(path, min_pixels=cfg.data.min_pixels, max_pixels=cfg.data.max_pixels)
print("processor", type(proc).__name__, type(proc.image_processor).__name__)
ds = PromptDataset(cfg.data, cfg.data.train_split, proc)
prompts = ds.sample_batch(8)
for i in range(3):
    t = time.perf_counter(); encs = [encode_prompt(proc, p) for p in prompts]; print("encode 8 prompts", round(time.perf_counter() - t, 4))
L, K = 12, 8
recs = []
for g, p in enumerate(prompts):
    ids = encs[g]["input_ids"]
    for s in range(8):
        re = np.random.randint(0, 64, size=(len(ids) + 128 - 1, L, K), dtype=np.int32)
        recs.append(SampleRecord(prompt_index=p.index, sample_index=s, group_index=g, prompt_ids=list(ids),
                                 response_ids=[random.randrange(100, 2000) for _ in range(128)], text="x" * 400,
                                 logprobs=[-1.0] * 128, finish_reason="length", truncated=True,
                                 routed_experts=base64.b64encode(re.tobytes()).decode()))
by_index = {p.index: p for p in prompts}
adv = [0.5] * len(recs)
for threads in (torch.get_num_threads(), 1):
    torch.set_num_threads(threads)
    for i in range(3):
        t = time.perf_counter(); train_samples(proc, by_index, recs, adv, routing=(L, K), replay=True)
        print(f"train_samples (threads {threads})", round(time.perf_counter() - t, 4))
cProfile.run("train_samples(proc, by_index, recs, adv, routing=(L, K), replay=True)", "/tmp/ts.prof")
pstats.Stats("/tmp/ts.prof").sort_stats("tottime").print_stats(12)

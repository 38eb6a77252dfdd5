"""One rank's GRPO train_step on make-train-shaped samples (8 prompts x 16 replies), shared or not, profiled."""
import sys, time
import torch


def run(rank, world, share, moe):
    from vlmrl.config import load
    from vlmrl.models.tiny import ensure_tiny_checkpoint
    from vlmrl.training.batch import TrainSample
    from vlmrl.training.trainer import MegatronTrainer
    from vlmrl.models.processor import load_processor
    from PIL import Image, ImageDraw
    cfg = load([f"trainer.share_prompts={share}"] + (["experiment=tiny_qwen35_moe"] if moe else []))
    d = cfg.data
    path = ensure_tiny_checkpoint(cfg.model, min_pixels=d.min_pixels, max_pixels=d.max_pixels)
    torch.set_num_threads(2)
    proc = load_processor(path, min_pixels=d.min_pixels, max_pixels=d.max_pixels)
    g = torch.Generator().manual_seed(0)
    samples = []
    for p in range(8):
        img = Image.new("RGB", (112, 112), "white"); ImageDraw.Draw(img).ellipse((10 + 5 * p, 20, 60, 70), fill="black")
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many points are on the circle? Answer in boxed form."}]}]
        text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        enc = proc(text=[text], images=[img], return_tensors="pt")
        ids = enc["input_ids"][0].tolist()
        for r in range(16):
            n = int(torch.randint(12, 30, (1,), generator=g))
            resp = torch.randint(100, 500, (n,), generator=g).tolist()
            samples.append(TrainSample(ids + resp, [0.0] * len(ids) + [1.0] * n, enc["pixel_values"], enc["image_grid_thw"],
                                       advantage=float(torch.randn(1, generator=g))))
    trainer = MegatronTrainer(cfg, path)
    trainer.set_reference_to_policy()
    print("prompt", len(ids), "tokens", sum(s.num_tokens for s in samples), flush=True)
    times = []
    for i in range(4):
        t = time.perf_counter(); m = trainer.train_step(samples); times.append(time.perf_counter() - t)
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.train_step(samples)
    return {"times": times, "table": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25),
            "shared": m.get("perf/shared_prompt_tokens")}


if __name__ == "__main__":
    from vlmrl.training.parallel_state import spawn_local
    share, moe = sys.argv[1], sys.argv[2] == "moe"
    res = spawn_local(run, 1, share, moe)[0]
    print(share, moe, [round(t, 2) for t in res["times"]], res["shared"])
    print(res["table"])

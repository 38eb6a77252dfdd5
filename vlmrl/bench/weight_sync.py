"""Weight sync, colocated: trainer to an engine process on the same device, through the loop's code.

The trainer is the loop's `TrainerWorker` (one Megatron rank, the GPU hardware config: fused
kernels, fla Gated DeltaNet); the engine is the embedded engine in its own process, served
over SGLang's HTTP protocol (`rollout.embedded.serve_http=true`, the protocol an SGLang server
speaks). A sync is `TrainerWorker.sync_weights`: HF-named buckets from the Megatron model,
each flattened into one uint8 tensor and sent as one CUDA-IPC handle (SGLang's
`flattened_bucket`; host bytes on CPU) to /update_weights_from_tensor, the engine copying the
tensors into its parameters, the last bucket carrying the weight version.

    python -m vlmrl.bench.weight_sync --model dense --device cuda --out $OUT
    python -m vlmrl.bench.weight_sync --model qwen35_moe --device cuda --out $OUT
    python -m vlmrl.bench.weight_sync --model dense --device cuda --compact-views both --out $OUT
                                    (views flattened as they are vs copied first, alternating)
    python -m vlmrl.bench.weight_sync --model dense --device cuda --bucket-mb 1024,2048,512 --out $OUT
                                    (bucket sizes, alternating)
    python -m vlmrl.bench.weight_sync --model tiny            (CPU: the script's own check)

Models (random weights, written as an HF checkpoint so both sides load it as the loop does):
- dense: Qwen2.5-VL with the 1.5B language model (hidden 1536, 28 layers, 12 heads / 2 KV
  groups, FFN 8960, vocab 151936, tied) and Qwen2.5-VL-3B's vision tower;
- qwen35_moe: Qwen3.5-35B-A3B's layer shapes with 8 layers (6 Gated DeltaNet + 2 gated
  attention) and 64 experts, and its vision tower;
- tiny, tiny_qwen3_5_moe: the tiny checkpoints (CPU).

First the noise floor: with both sides on the checkpoint they loaded, the engine samples a
completion and the trainer scores it; their mean |logprob difference| is what the two
implementations differ by on identical weights (0 up to rounding in fp32; in bf16 a MoE
model's routing flips at near-ties, up to ~0.5 at a token). Then the trainer's weights are
perturbed (Gaussian noise), so the first sync changes every tensor; after the syncs the
engine samples again and the trainer scores those tokens twice, with the synced (new)
weights and with the weights the engine started from (old). The sync is verified when the
engine agrees with the new weights: in fp32 to 1e-4 at every token; in bf16 as well as on
identical weights (mean difference at most FLOOR_FACTOR x the floor), and at least
STALE_RATIO times closer to the new weights than to the old ones (an engine that missed
tensors stays near the old weights). Effective GB/s = bytes of the synced tensors (in the
trainer's dtype) / wall seconds of one `sync_weights` call.

The mapping itself is checked exactly by `--model qwen35_moe_narrow --device cpu --bucket-mb 256`
(about 17 GiB of host memory): the 35B's layer layouts (64 experts, 16 / 32 Gated DeltaNet heads
of 128, gated attention with 16 / 2 heads of 256) at hidden 512 in fp32, where every logprob
must agree to 1e-4.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# fp32: |engine - trainer| at every token after a sync (the loop's own bound)
FP32_TOL = 1e-4
# bf16: mean |engine - new weights| may be this many times the noise floor (identical weights
# on both sides); the two means come from different sampled tokens, hence the margin
FLOOR_FACTOR = 2.0
# bf16: mean |engine - old weights| / mean |engine - new weights| must reach this
STALE_RATIO = 2.0
# completion tokens scored for each comparison
SAMPLE_TOKENS = 64
# relative size of the perturbation: large enough that old and new weights' logprobs differ
# well beyond bf16 rounding (a new policy, as after a few RL steps of a random model)
PERTURB = 0.1

DENSE = ["model=qwen2_5_vl_3b", "model.lm.hidden_size=1536", "model.lm.num_layers=28",
         "model.lm.num_attention_heads=12", "model.lm.num_query_groups=2", "model.lm.ffn_hidden_size=8960",
         "model.vision.out_hidden_size=1536"]
MOE = ["model=qwen3_5_35b_a3b", "model.lm.num_layers=8", "model.lm.num_experts=64",
       "model.lm.layer_types=[linear_attention,linear_attention,linear_attention,full_attention,"
       "linear_attention,linear_attention,linear_attention,full_attention]"]
# the same layer layouts at hidden 512 with a small vocabulary and vision tower: fits a CPU in fp32
MOE_NARROW = [*MOE, "model.lm.hidden_size=512", "model.lm.vocab_size=1024", "model.vision.depth=2",
              "model.vision.out_hidden_size=512"]
MODELS = {"dense": ("tiny", DENSE), "qwen35_moe": ("tiny_qwen3_5_moe", MOE),
          "qwen35_moe_narrow": ("tiny_qwen3_5_moe", MOE_NARROW), "tiny": ("tiny", None),
          "tiny_qwen3_5_moe": ("tiny_qwen3_5_moe", None)}


def perturb(params: list[Any], gen: Any) -> None:
    """Add Gaussian noise of `PERTURB` times each tensor's mean magnitude to every parameter
    (drawn from `gen` on the host, so the same on any device): a new policy, in which every
    tensor a sync must carry has changed."""
    import torch

    with torch.no_grad():
        for p in params:
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.device)
            p.add_((noise * PERTURB * p.float().abs().mean().clamp_min(1e-3)).to(p.dtype))


def write_checkpoint(model: str, out: Path, dtype: str) -> tuple[Path, list[str]]:
    """(checkpoint dir, config overrides): the tiny checkpoint for tiny models; else a random
    model of the shape, saved next to the tiny checkpoint's tokenizer and processor."""
    import torch

    from ..config import load
    from ..models.bridge import hf_model_class
    from ..models.tiny import SPECIAL_TOKENS, ensure_tiny_checkpoint, hf_config

    tiny_group, overrides = MODELS[model]
    tiny = load([f"model={tiny_group}"])
    tiny_path = ensure_tiny_checkpoint(tiny.model, min_pixels=tiny.data.min_pixels, max_pixels=tiny.data.max_pixels)
    if overrides is None:
        return Path(tiny_path), [f"model={tiny_group}"]
    ids = [f"model.image_token_id={SPECIAL_TOKENS.index('<|image_pad|>')}",
           f"model.vision_start_token_id={SPECIAL_TOKENS.index('<|vision_start|>')}",
           f"model.vision_end_token_id={SPECIAL_TOKENS.index('<|vision_end|>')}"]
    overrides = [*overrides, *ids, f"model.dtype={dtype}"]
    cfg = load(overrides, check_rules=False)
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(tiny_path).iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, out / f.name)
    torch.manual_seed(0)
    config = hf_config(cfg.model)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        net = hf_model_class(cfg.model)._from_config(config, dtype=getattr(torch, dtype))
    for p in net.parameters():  # a small init: random logits stay finite in bf16
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
    net.generation_config.eos_token_id = [SPECIAL_TOKENS.index("<|im_end|>")]
    net.save_pretrained(out, safe_serialization=True)
    del net
    return out, overrides


def trainer_overrides(device: str, dtype: str) -> list[str]:
    """The benches' trainer config: the GPU hardware config with one GPU shared by the trainer
    and the engine (the colocated layout), or the CPU one; no reference model."""
    hardware = (["hardware=h200", "cluster.num_gpus=1", "rollout.num_gpus=1"] if device == "cuda"
                else ["hardware=cpu"])
    if device == "cuda":
        from ..models import flash4

        why = flash4.missing()
        if why is not None:  # h200 trains attention with it; sdpa needs nothing
            print(f"{why}\nso the trainer runs hardware.lm_attention_backend=sdpa", file=sys.stderr)
            hardware.append("hardware.lm_attention_backend=sdpa")
    return [*hardware, f"hardware.train_dtype={dtype}", "algo.kl_coef=0", "hardware.vision_attn_implementation=sdpa"]


def serve(args: argparse.Namespace) -> int:
    """The engine process: the embedded engine behind SGLang's HTTP protocol, until the bench
    process that started it is gone (killed too: no engine is left holding memory)."""
    from ..rollout.embedded import EmbeddedEngine
    from ..rollout.server import ThreadedServer

    parent = os.getppid()
    engine = EmbeddedEngine(args.ckpt, device=args.device, dtype=args.dtype, max_batch_size=8)
    server = ThreadedServer(engine)
    Path(args.url_file).write_text(server.url)
    while os.getppid() == parent:
        time.sleep(1.0)
    return 0


def _engine(ckpt: Path, device: str, dtype: str, tmp: Path) -> tuple[subprocess.Popen, str]:
    url_file = tmp / "url"
    proc = subprocess.Popen([sys.executable, "-m", "vlmrl.bench.weight_sync", "serve", "--ckpt", str(ckpt),
                             "--device", device, "--dtype", dtype, "--url-file", str(url_file)])
    deadline = time.time() + 600
    while not url_file.exists():
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"the engine process did not start (exit {proc.poll()})")
        time.sleep(0.5)
    return proc, url_file.read_text()


def _sample(url: str, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float], str | None]:
    import asyncio

    from ..rollout.client import HTTPEngine
    from ..rollout.protocol import GenerateRequest, SamplingParams

    async def go() -> Any:
        eng = HTTPEngine(url, name="bench")
        try:
            req = GenerateRequest(input_ids=tuple(prompt), sampling=SamplingParams(
                temperature=1.0, max_new_tokens=new_tokens, seed=7, ignore_eos=True))
            return (await eng.generate([req]))[0]
        finally:
            await eng.close()

    r = asyncio.run(go())
    return list(r.output_ids), list(r.logprobs), r.weight_version


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", nargs="?", default="bench", choices=("bench", "serve"),
                    help="serve: the engine process the bench starts")
    ap.add_argument("--model", default="tiny", choices=sorted(MODELS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--bucket-mb", default="1024",
                    help="bucket size in MiB; several, comma-separated, alternate sync by sync in one run "
                         "(the row reports the first)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--gdn-backend", default=None, choices=("torch", "fla"),
                    help="the trainer's hardware.gdn_backend (default: the hardware config's); the sync "
                         "does not depend on it")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="more config overrides for the trainer (e.g. hardware.fused_kernels=false)")
    ap.add_argument("--compact-views", choices=("no", "yes", "both"), default="no",
                    help="colocated IPC: flatten views as they are (no, the trainer's default), copy each "
                         "first (yes), or both, alternating sync by sync in one run (the row reports 'no')")
    ap.add_argument("--ckpt")
    ap.add_argument("--url-file")
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.mode == "serve":
        return serve(args)

    import torch

    from ..cluster.trainer_group import TrainerWorker
    from ..config import load
    from ..training.batch import TrainSample

    tmp = Path(tempfile.mkdtemp(prefix="vlmrl-sync-"))
    proc = None
    try:
        t0 = time.perf_counter()
        ckpt, overrides = write_checkpoint(args.model, tmp / "ckpt", args.dtype)
        print(f"checkpoint {ckpt} in {time.perf_counter() - t0:.1f} s", flush=True)
        proc, url = _engine(ckpt, args.device, args.dtype, tmp)
        cfg = load([*overrides, *trainer_overrides(args.device, args.dtype), "cluster.colocate=true",
                    "rollout.embedded.serve_http=true",
                    *([f"hardware.gdn_backend={args.gdn_backend}"] if args.gdn_backend else []), *args.set],
                   check_rules=False)
        worker = TrainerWorker(cfg, 0, 1, "127.0.0.1", None)
        worker.init(str(ckpt), total_steps=1)
        trainer = worker.trainer

        prompt = [(7 * i + 3) % 200 + 10 for i in range(24)]

        def engine_vs_trainer() -> tuple[Any, Any, Any, str | None]:
            """The engine's completion of `prompt`: (sample, engine logprobs, trainer logprobs,
            the engine's weight version)."""
            ids, lp, version = _sample(url, prompt, SAMPLE_TOKENS)
            sample = TrainSample(input_ids=prompt + ids, loss_mask=[0.0] * len(prompt) + [1.0] * len(ids))
            return (sample, torch.tensor(lp, dtype=torch.float32), trainer.logprobs([sample])[0].float().cpu(),
                    version)

        _, lp_engine0, lp_trainer0, _ = engine_vs_trainer()  # the same checkpoint on both sides
        floor = float((lp_trainer0 - lp_engine0).abs().mean())
        gen = torch.Generator().manual_seed(1)
        params = [q for c in trainer.chunks for q in c.parameters()]
        old = [p.detach().clone() for p in params]  # what the engine holds before the sync
        perturb(params, gen)  # a new policy: every tensor the sync must carry changes

        sizes_mb = [int(x) for x in str(args.bucket_mb).split(",")]
        # variants (compact views?, bucket MiB), run in turn sync by sync
        modes = [(c, mb) for c in {"no": [False], "yes": [True], "both": [False, True]}[args.compact_views]
                 for mb in sizes_mb]
        times: dict[tuple, list[float]] = {m: [] for m in modes}
        phases: dict[tuple, list[dict]] = {m: [] for m in modes}
        sent, last = 0, ""
        for i in range(args.repeats + 1):  # the first sync (of each mode) is not timed: it opens the connection
            for m in modes:
                worker.compact_views = m[0]
                last = f"v{i}" + ("c" if m[0] else "") + f"-{m[1]}"
                if args.device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                sent = worker.sync_weights([url], m[1] << 20, weight_version=last)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                if i:
                    times[m].append(time.perf_counter() - t0)
                    phases[m].append(worker.last_sync_phases)

        def median_phases(m: tuple) -> dict:
            med_m = statistics.median(times[m])
            return phases[m][min(range(len(times[m])), key=lambda j: abs(times[m][j] - med_m))]

        by_mode = {f"{'compact' if m[0] else 'views'}, {m[1]} MiB buckets": {"sync_s": times[m], "median_s": statistics.median(times[m]),
                                                   "gb_per_s": sent / statistics.median(times[m]) / 1e9,
                                                   "phases": median_phases(m)} for m in modes}
        head = modes[0]
        sample, engine_t, lp_trainer, version = engine_vs_trainer()
        worker._drop_engine_links()
        with torch.no_grad():  # the same tokens under the weights the engine started from
            for p, o in zip(params, old):
                p.copy_(o)
        lp_old = trainer.logprobs([sample])[0].float().cpu()
        diff = float((lp_trainer - engine_t).abs().max())
        fresh = float((lp_trainer - engine_t).abs().mean())
        stale = float((lp_old - engine_t).abs().mean())
        med = statistics.median(times[head])
        row = {"model": args.model, "device": args.device, "dtype": args.dtype,
               "params": sum(p.numel() for p in params), "compact_views": head[0],
               "bytes": sent, "bucket_mb": head[1], "sync_s": times[head], "median_s": med,
               "gb_per_s": sent / med / 1e9, "weight_version": version,
               "logprob_max_abs_diff": diff,
               "logprob_mean_abs_diff": fresh, "logprob_mean_abs_diff_old_weights": stale,
               "logprob_mean_abs_diff_same_weights": floor,
               "criterion": (f"max <= {FP32_TOL}" if args.dtype == "float32" else
                             f"new <= {FLOOR_FACTOR} x same-weights floor and old >= {STALE_RATIO} x new"),
               # host seconds per phase of the median sync (TrainerWorker.last_sync_phases)
               "phases": median_phases(head), **({"by_mode": by_mode} if len(modes) > 1 else {})}
        close = (diff <= FP32_TOL if args.dtype == "float32"
                 else fresh <= FLOOR_FACTOR * floor and stale >= STALE_RATIO * fresh)
        ok = version == last and close
        row["verified"] = ok
        result = {"command": "python -m vlmrl.bench.weight_sync " + " ".join(sys.argv[1:] if argv is None else argv),
                  "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                  "device_name": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                  "torch": torch.__version__, "row": row}
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"weight_sync_{args.model}.json").write_text(json.dumps(result, indent=2))
        print(f"{args.model}: {sent / 1e9:.2f} GB in {med:.3f} s = {sent / med / 1e9:.1f} GB/s "
              f"(syncs {', '.join(f'{t:.3f}' for t in times[head])} s); engine vs trainer logprobs after the sync: "
              f"max |diff| {diff:.2e}, mean {fresh:.2e}; vs the old weights: mean {stale:.2e}; "
              f"on identical weights before the sync: mean {floor:.2e}; "
              f"version {version}; verified {ok}",
              flush=True)
        for name, r in (by_mode.items() if len(modes) > 1 else [("", {"phases": row["phases"]})]):
            if name:
                print(f"  {name} mode: {r['gb_per_s']:.1f} GB/s (syncs {', '.join(f'{t:.3f}' for t in r['sync_s'])} s)",
                      flush=True)
            print("  host seconds by phase (the median sync): "
                  + ", ".join(f"{k} {v:.4f}" if k.endswith("_s") else f"{k} {v}" for k, v in r["phases"].items()),
                  flush=True)
        return 0 if ok else 1
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

"""Rollout throughput: generated tokens per second of the embedded engine and of SGLang.

    python -m vlmrl.bench.rollout --batch-size 64 --max-new-tokens 64 --device cpu
        (the tiny model, built under $VLMRL_CACHE on first use; --family qwen3_5_moe for the
        tiny Qwen3.5-MoE)
    python -m vlmrl.bench.rollout --device cuda --dtype bfloat16 --family qwen3_5_moe \
        --engines embedded,sglang --repeats 3 --sglang-python python3 \
        --sglang-env '{"PYTHONPATH": "/opt/sglang-site"}' --sglang-server-args '{...}'
        (both engines on the same checkpoint, GPU and requests, timed alternately; the result
        gives SGLang's tokens/s as a ratio to the embedded engine's)
    python -m vlmrl.bench.rollout --model DIR ...
    python -m vlmrl.bench.rollout --device cuda --dtype bfloat16 --random-model qwen2_5_vl_3b \\
        [--hidden 2048 --layers 36 ...]
        (a random model of that config group's shape, built in code on the device; the tiny
        checkpoint's processor is reused, so the special token ids follow the tiny tokenizer)

Every request carries one image and samples (temperature 1, own seed) with ignore_eos, so
each generates exactly --max-new-tokens tokens. Results: bench/results/rollout-<tag>.json
and a row appended to bench/results/rollout.md, both with the exact command and the date.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parents[2] / "bench" / "results"


def _requests(engine: Any, batch_size: int, max_new_tokens: int, *, with_image: bool, seed: int = 0) -> list[Any]:
    from PIL import Image, ImageDraw

    from ..data.images import encode_data_uri as encode_image_data_uri
    from ..rollout.protocol import GenerateRequest, SamplingParams

    reqs = []
    for i in range(batch_size):
        content: list[dict[str, Any]] = [{"type": "text", "text": f"Find the area of triangle number {i}. "
                                                                  "Give the final answer in a box."}]
        images: tuple[str, ...] = ()
        if with_image:
            img = Image.new("RGB", (112, 112), (i * 37 % 256, 80, 160))
            ImageDraw.Draw(img).polygon([(10, 100), (60, 10 + i % 40), (100, 100)], fill=(250, 250, 250))
            images = (encode_image_data_uri(img),)
            content.insert(0, {"type": "image"})
        text = engine.processor.apply_chat_template([{"role": "user", "content": content}],
                                                    add_generation_prompt=True, tokenize=False)
        reqs.append(GenerateRequest(text=text, images=images, sampling=SamplingParams(
            temperature=1.0, max_new_tokens=max_new_tokens, seed=seed + i, ignore_eos=True)))
    return reqs


def bench_embedded(model_path: str | None, batch_size: int, max_new_tokens: int, device: str = "cpu", *,
                   dtype: str = "float32", with_image: bool = True, repeats: int = 2, engine: Any = None,
                   min_pixels: int = 3136, max_pixels: int = 12544) -> dict[str, Any]:
    """Generated tokens/s of `EmbeddedEngine` on one batch (best and mean of `repeats`
    timed runs after one warm-up run). Pass `engine` to reuse a built one."""
    import torch

    from ..rollout.embedded import EmbeddedEngine

    if engine is None:
        engine = EmbeddedEngine(str(model_path), device=device, dtype=dtype, min_pixels=min_pixels,
                                max_pixels=max_pixels, max_batch_size=batch_size)
    engine.max_batch_size = max(engine.max_batch_size, batch_size)
    reqs = _requests(engine, batch_size, max_new_tokens, with_image=with_image)

    def sync() -> None:
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)

    warm = engine.generate_sync(reqs[: min(4, batch_size)])
    errors = [r for r in warm if isinstance(r, BaseException)]
    if errors:
        raise errors[0]
    times, tokens = [], 0
    for _ in range(repeats):
        engine._prompt_cache.clear()  # include preprocessing, as a fresh rollout step would
        sync()
        t0 = time.perf_counter()
        out = engine.generate_sync(reqs)
        sync()
        times.append(time.perf_counter() - t0)
        bad = [r for r in out if isinstance(r, BaseException)]
        if bad:
            raise bad[0]
        tokens = sum(len(r.output_ids) for r in out)
        prompt_tokens = [r.prompt_tokens for r in out]
    n_params = sum(p.numel() for p in engine.model.parameters())
    return {
        "engine": "embedded",
        "model": str(model_path) if model_path else "in-memory",
        "parameters": n_params,
        "device": str(engine.device),
        "device_name": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else platform.processor() or platform.machine(),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "batch_size": batch_size,
        "max_new_tokens": max_new_tokens,
        "with_image": with_image,
        "prompt_tokens_mean": sum(prompt_tokens) / len(prompt_tokens),
        "generated_tokens": tokens,
        "seconds_best": min(times),
        "seconds_mean": sum(times) / len(times),
        "tokens_per_s": tokens / min(times),
        "tokens_per_s_mean": tokens / (sum(times) / len(times)),
        "repeats": repeats,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }


def bench_sglang(model_path: str, reqs: list[Any], *, family: str = "qwen2_5_vl", dtype: str = "bfloat16",
                 python: str | None = None, env: dict[str, str] | None = None,
                 server_args: dict[str, Any] | None = None, mem_fraction_static: float = 0.5,
                 run_dir: str | None = None) -> Any:
    """A generator: starts an SGLang server for `model_path` on GPU 0 as a run does (the
    launch arguments of `rollout=sglang hardware=h200` for the tiny model of `family`, through
    `SGLangServerActor` outside Ray: the interpreter's release read and checked, its flags),
    with `server_args` merged last; yields a function that times `reqs` once (all in flight
    together through vlmrl's client: (seconds, generated tokens, mean prompt tokens)) and the
    server's details, and stops the server when closed."""
    import asyncio
    import socket
    import tempfile

    from ..config import load
    from ..contracts.sglang_flags import load_flags
    from ..models.tiny import TINY_OPTIONS
    from ..rollout.client import HTTPEngine
    from ..rollout.sglang import SGLangServerActor, check_sglang_version
    from ..rollout.sglang import server_args as run_server_args

    cfg = load([f"model={TINY_OPTIONS[family]}", "rollout=sglang", "hardware=h200", f"model.dtype={dtype}",
                f"rollout.sglang.mem_fraction_static={mem_fraction_static}"], check_rules=False)
    server = SGLangServerActor((0,), log_path=str(Path(run_dir or tempfile.mkdtemp()) / "sglang-bench.log"),
                               python=python, env=env)
    version = check_sglang_version([server.sglang_version()], None)
    flags = load_flags(version)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = run_server_args(cfg.rollout, cfg.hardware, cfg.model, port=port, model_path=model_path, flags=flags,
                           data=cfg.data)
    args["max_running_requests"] = max(len(reqs), 1)
    args.update(server_args or {})
    for name, value in args.items():
        flags.check_value(name, value)
    t_start = time.perf_counter()
    server.start(args, version)

    async def run_once() -> tuple[float, int, float]:
        client = HTTPEngine(server.url(), max_concurrency=max(len(reqs), 1), tensor_format=None)
        try:
            t0 = time.perf_counter()
            out = await client.generate(reqs)
            dt = time.perf_counter() - t0
        finally:
            await client.close()
        return dt, sum(len(r.output_ids) for r in out), sum(r.prompt_tokens for r in out) / max(len(out), 1)

    try:
        asyncio.run(server.wait_healthy(900))  # raises with the end of the server's log
        startup = time.perf_counter() - t_start
        asyncio.run(run_once())  # warm-up
        yield (lambda: asyncio.run(run_once())), {"sglang_version": version, "startup_s": startup,
                                                   "server_args": args}
    finally:
        server.stop()


def compare_engines(model_path: str, batch_size: int, max_new_tokens: int, *, family: str, dtype: str, repeats: int,
                    min_pixels: int, max_pixels: int, sglang: dict[str, Any]) -> dict[str, Any]:
    """The embedded engine and SGLang on the same checkpoint, GPU and requests, timed
    alternately `repeats` times each; tokens/s of both and SGLang's ratio to the embedded one."""
    import torch

    from ..rollout.embedded import EmbeddedEngine

    engine = EmbeddedEngine(str(model_path), device="cuda", dtype=dtype, min_pixels=min_pixels,
                            max_pixels=max_pixels, max_batch_size=batch_size)
    reqs = _requests(engine, batch_size, max_new_tokens, with_image=True)
    engine.generate_sync(reqs[: min(4, batch_size)])  # warm-up
    runs: dict[str, list[float]] = {"embedded": [], "sglang": []}
    tokens: dict[str, int] = {}
    server = bench_sglang(model_path, reqs, family=family, dtype=dtype, **sglang)
    timed, info = next(server)
    try:
        for _ in range(repeats):
            engine._prompt_cache.clear()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = engine.generate_sync(reqs)
            torch.cuda.synchronize()
            runs["embedded"].append(time.perf_counter() - t0)
            tokens["embedded"] = sum(len(r.output_ids) for r in out)
            dt, n, _ = timed()
            runs["sglang"].append(dt)
            tokens["sglang"] = n
    finally:
        server.close()
    rate = {k: tokens[k] / min(v) for k, v in runs.items()}
    return {"engine": "embedded,sglang", "model": str(model_path), "dtype": dtype, "batch_size": batch_size,
            "max_new_tokens": max_new_tokens, "with_image": True, "device": "cuda",
            "device_name": torch.cuda.get_device_name(0), "repeats": repeats, "seconds": runs,
            "generated_tokens": tokens, "tokens_per_s_by_engine": rate,
            "sglang_over_embedded": rate["sglang"] / rate["embedded"],
            "parameters": sum(p.numel() for p in engine.model.parameters()),
            "tokens_per_s": rate["sglang"], "seconds_best": min(runs["sglang"]), "torch": torch.__version__,
            **{k: v for k, v in info.items() if k != "server_args"}, "sglang_server_args": info["server_args"]}


def random_model_engine(group: str, device: str, dtype: str, overrides: list[str], *, cache_dir: str | None = None,
                        max_batch_size: int = 64) -> Any:
    """An EmbeddedEngine over a random model shaped like config group `model=<group>`
    (with overrides), built in code on `device`, and the tiny checkpoint's processor."""
    import torch

    from ..config import load
    from ..models.bridge import hf_model_class
    from ..models.processor import load_processor
    from ..models.tiny import SPECIAL_TOKENS, ensure_tiny_checkpoint, hf_config
    from ..rollout.embedded import EmbeddedEngine, _dtype

    extra = [f"model.cache_dir={cache_dir}"] if cache_dir else []
    tiny = load(["model=tiny", *extra])
    tiny_path = ensure_tiny_checkpoint(tiny.model, min_pixels=tiny.data.min_pixels, max_pixels=tiny.data.max_pixels)
    ids = [f"model.image_token_id={SPECIAL_TOKENS.index('<|image_pad|>')}",
           f"model.vision_start_token_id={SPECIAL_TOKENS.index('<|vision_start|>')}",
           f"model.vision_end_token_id={SPECIAL_TOKENS.index('<|vision_end|>')}"]
    cfg = load([f"model={group}", *extra, *ids, *overrides], check_rules=False)
    config = hf_config(cfg.model)
    config.text_config.dtype = dtype
    torch_dtype = _dtype(dtype)
    with torch.device(device):
        model = hf_model_class(cfg.model)._from_config(config, dtype=torch_dtype)
    model.generation_config.eos_token_id = [SPECIAL_TOKENS.index("<|im_end|>")]
    processor = load_processor(tiny_path, min_pixels=tiny.data.min_pixels, max_pixels=tiny.data.max_pixels)
    return EmbeddedEngine(tiny_path, device=device, dtype=dtype, model=model, processor=processor,
                          max_batch_size=max_batch_size)


def _command(argv: list[str]) -> str:
    return "python -m vlmrl.bench.rollout " + " ".join(shlex.quote(a) for a in argv)


def write_results(result: dict[str, Any], out_dir: Path, tag: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    js = out_dir / f"rollout-{tag}.json"
    js.write_text(json.dumps(result, indent=2) + "\n")
    md = out_dir / "rollout.md"
    if not md.exists():
        md.write_text("# Rollout throughput (embedded engine)\n\n"
                      "| date (UTC) | device | dtype | model | params | batch | new tokens | tokens/s | "
                      "s/batch | command |\n|---|---|---|---|---|---|---|---|---|---|\n")
    row = (f"| {result['date']} | {result['device_name']} ({result['device']}) | {result['dtype']} | "
           f"{result['model_desc']} | {result['parameters'] / 1e6:.1f}M | {result['batch_size']} | "
           f"{result['max_new_tokens']} | {result['tokens_per_s']:.1f} | {result['seconds_best']:.2f} | "
           f"`{result['command']}` |\n")
    with md.open("a") as f:
        f.write(row)
    return js, md


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m vlmrl.bench.rollout", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: the tiny model of --family)")
    p.add_argument("--family", default="qwen2_5_vl", choices=["qwen2_5_vl", "qwen3_5", "qwen3_5_moe"],
                   help="the tiny model's family when --model is not given")
    p.add_argument("--engines", default="embedded", choices=["embedded", "embedded,sglang"],
                   help="embedded alone, or both on the same GPU and requests (needs --device cuda)")
    p.add_argument("--sglang-python", default=None, help="the interpreter with sglang (default: this one)")
    p.add_argument("--sglang-env", default="{}", help="JSON of extra environment for the SGLang server")
    p.add_argument("--sglang-server-args", default="{}", help="JSON of extra SGLang ServerArgs")
    p.add_argument("--sglang-mem-fraction", type=float, default=0.5)
    p.add_argument("--random-model", default=None,
                   help="config group of a random model built in code, e.g. qwen2_5_vl_3b (the suffix "
                        "'-shaped' is accepted)")
    p.add_argument("--hidden", type=int, help="model.lm.hidden_size of the random model")
    p.add_argument("--layers", type=int, help="model.lm.num_layers of the random model")
    p.add_argument("--heads", type=int, help="model.lm.num_attention_heads")
    p.add_argument("--kv-heads", type=int, help="model.lm.num_query_groups")
    p.add_argument("--ffn", type=int, help="model.lm.ffn_hidden_size")
    p.add_argument("--vision-depth", type=int, help="model.vision.depth")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--no-image", action="store_true", help="text-only prompts")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS_DIR))
    p.add_argument("--tag", default=None, help="result file suffix (default: device-model-date)")
    args = p.parse_args(argv)

    shown = None  # the results' description where it says more than the model
    if args.random_model:
        group = args.random_model.removesuffix("-shaped")
        over = []
        for flag, key in (("hidden", "model.lm.hidden_size"), ("layers", "model.lm.num_layers"),
                          ("heads", "model.lm.num_attention_heads"), ("kv_heads", "model.lm.num_query_groups"),
                          ("ffn", "model.lm.ffn_hidden_size"), ("vision_depth", "model.vision.depth")):
            if getattr(args, flag) is not None:
                over.append(f"{key}={getattr(args, flag)}")
        if args.hidden is not None:  # the vision merger projects into the LM's width
            over.append(f"model.vision.out_hidden_size={args.hidden}")
        engine = random_model_engine(group, args.device, args.dtype, over, max_batch_size=args.batch_size)
        model_path, desc = None, f"random {group}" + (f" ({', '.join(over)})" if over else "")
    else:
        engine = None
        model_path = args.model
        from ..models.tiny import TINY_OPTIONS

        desc = Path(args.model).name if args.model else TINY_OPTIONS[args.family]
        if model_path is None:
            from ..config import load
            from ..models.tiny import ensure_tiny_checkpoint

            cfg = load([f"model={TINY_OPTIONS[args.family]}"])
            model_path = ensure_tiny_checkpoint(cfg.model, min_pixels=cfg.data.min_pixels,
                                                max_pixels=cfg.data.max_pixels)
    if args.engines == "embedded,sglang":
        if args.device != "cuda" or engine is not None:
            p.error("--engines embedded,sglang needs --device cuda and a checkpoint (--model or --family)")
        sglang = {"python": args.sglang_python, "env": json.loads(args.sglang_env),
                  "server_args": json.loads(args.sglang_server_args), "mem_fraction_static": args.sglang_mem_fraction}
        from ..config import load

        data = load([f"model={TINY_OPTIONS[args.family]}"]).data  # the pixel bounds its checkpoint was made with
        result = compare_engines(model_path, args.batch_size, args.max_new_tokens, family=args.family,
                                 dtype=args.dtype, repeats=args.repeats, min_pixels=data.min_pixels,
                                 max_pixels=data.max_pixels, sglang=sglang)
        shown = (f"{desc}: SGLang {result['sglang_version']} "
                f"{result['tokens_per_s_by_engine']['sglang']:.0f} tok/s, embedded "
                f"{result['tokens_per_s_by_engine']['embedded']:.0f} ({result['sglang_over_embedded']:.2f}x)")
    else:
        result = bench_embedded(model_path, args.batch_size, args.max_new_tokens, args.device, dtype=args.dtype,
                                with_image=not args.no_image, repeats=args.repeats, engine=engine)
    now = _dt.datetime.now(_dt.UTC)
    result.update({"model_desc": shown or desc, "command": _command(argv), "date": now.strftime("%Y-%m-%d %H:%M")})
    tag = args.tag or f"{args.device.replace(':', '')}-{desc.split(' (')[0].replace(' ', '-')}-{now:%Y%m%d-%H%M}"
    js, md = write_results(result, Path(args.out), tag)
    keys = ("device", "dtype", "parameters", "batch_size", "max_new_tokens", "generated_tokens", "seconds_best",
            "tokens_per_s", "tokens_per_s_by_engine", "sglang_over_embedded", "sglang_version")
    print(json.dumps({k: result[k] for k in keys if k in result}, indent=2))
    print(f"wrote {js} and a row in {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

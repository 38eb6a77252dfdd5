"""Weight sync into a real SGLang server colocated with the trainer on one GPU: vlmrl's loader
(`rollout.sglang.weight_loader=vlmrl`: each layer's routed experts in one copy, pairs of views
into one flattened copy) against SGLang's own loaders (`=sglang`: flattened buckets of
per-expert tensors), alternating sync by sync against the same server in one run.

    python -m vlmrl.bench sglang-sync --out $OUT -- rollout.sglang.python=... +rollout.sglang.env.PYTHONPATH=...

The trailing overrides say where SGLang lives and how to start it (as in a run). The model is
the scaled Qwen3.5-MoE of bench/results/sglang.md (2.88B parameters: 12 layers, hidden 2048,
64 experts top-8 of 512, the Qwen3.5 vision tower; `--shape tiny`: the tiny Qwen3.5-MoE),
random weights in bf16, built as a run builds it. Both transports are the loop's
(`vlmrl.cluster.weight_transport.ColocatedTransport`, from the trainer's `iter_hf_weights`).

Check first (exact: the same bits on the same server): the trainer's weights are perturbed
(W), synced through SGLang's loaders, and the engine's greedy completion of a text prompt is
the reference; the trainer then moves to W' (another perturbation) and syncs it through SGLang's
loaders, goes back to W and syncs through vlmrl's loader. The engine must then give the
reference completion again (ids equal, logprobs within LOGPROB_TOL), while under W' it gave
another (a loader that skipped a tensor would leave W' there). Then `--repeats` timed syncs of
each loader, alternating; effective GB/s = bytes sent per sync / seconds of one
`ColocatedTransport.send`. The JSON result (the command, every time, the transport's phases)
goes to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# the same weights and request on the same server: only kernel nondeterminism may differ
LOGPROB_TOL = 1e-3
LAYER_TYPES = "[" + ",".join((["linear_attention"] * 3 + ["full_attention"]) * 3) + "]"
SHAPES = {
    "tiny": [],
    # bench/results/sglang.md's scaled Qwen3.5-MoE: 2.88B parameters
    "scaled": ["model.lm.num_layers=12", "model.lm.hidden_size=2048", "model.lm.ffn_hidden_size=512",
               "model.lm.num_attention_heads=16", "model.lm.num_query_groups=2", "model.lm.head_dim=256",
               "model.lm.vocab_size=8192", "model.lm.mrope_section=[11,11,10]", "model.lm.linear_num_key_heads=16",
               "model.lm.linear_num_value_heads=32", "model.lm.linear_key_head_dim=128",
               "model.lm.linear_value_head_dim=128", "model.lm.num_experts=64", "model.lm.moe_router_topk=8",
               "model.lm.moe_ffn_hidden_size=512", "model.lm.shared_expert_ffn_hidden_size=512",
               "model.vision.out_hidden_size=2048", f"model.lm.layer_types={LAYER_TYPES}"],
}


def _overrides(shape: str, run_dir: str, extra: list[str]) -> list[str]:
    return ["model=tiny_qwen3_5_moe", *SHAPES[shape], "model.dtype=bfloat16", "hardware=h200", "rollout=sglang",
            "cluster.num_gpus=1", "cluster.colocate=true", "trainer.offload=false", f"run_dir={run_dir}",
            "rollout.sglang.mem_fraction_static=0.3", "hardware.fused_kernels=false", "hardware.cuda_graphs=false",
            "hardware.gdn_backend=torch", "hardware.lm_attention_backend=sdpa",
            "hardware.vision_attn_implementation=sdpa", "logger.wandb=false", "algo.kl_coef=0", *extra]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="scaled", choices=sorted(SHAPES))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, default=None, help="default: rollout.weight_update_bucket_mb")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = ap.parse_args(argv)
    command = "python -m vlmrl.bench sglang-sync " + shlex.join([*argv, "--", *extra])

    import torch

    from ..cluster.placement import create_placement
    from ..cluster.ray_cluster import ray_cluster
    from ..cluster.trainer_group import TrainerWorker
    from ..cluster.weight_transport import ColocatedTransport
    from ..config import compute_layout, load
    from ..models.tiny import model_path
    from ..rollout.auth import new_key
    from ..rollout.manager import close_sessions
    from ..rollout.protocol import GenerateRequest, SamplingParams
    from ..rollout.sglang import launch_sglang_engines
    from .weight_sync import perturb

    run_dir = tempfile.mkdtemp(prefix="vlmrl-sglang-sync-")
    base = _overrides(args.shape, run_dir, extra)
    cfgs = {name: load([*base, f"rollout.sglang.weight_loader={name}"]) for name in ("sglang", "vlmrl")}
    cfg = cfgs["vlmrl"]  # the server is started with vlmrl's loader; SGLang's own stay available
    bucket = (args.bucket_mb or cfg.rollout.weight_update_bucket_mb) << 20
    layout = compute_layout(cfg)
    path = model_path(cfg)
    result: dict[str, Any] = {"command": command, "shape": args.shape, "bucket_mb": bucket >> 20,
                              "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                              "device": torch.cuda.get_device_name(0)}
    with ray_cluster(cfg, run_dir):
        placement = create_placement(cfg, layout)
        key = new_key()
        t0 = time.perf_counter()
        engines = asyncio.run(launch_sglang_engines(cfg.rollout, cfg.hardware, cfg.model, layout.engines(cfg),
                                                    run_dir=run_dir, placement=placement, model_path=path,
                                                    colocate=True, data=cfg.data, api_key=key))
        result["sglang"] = engines.version
        result["startup_s"] = time.perf_counter() - t0
        client = engines.engines[0]
        try:
            worker = TrainerWorker(cfg, 0, 1, "127.0.0.1", None)
            worker.init(path, 1)
            trainer = worker.trainer
            params = [p for c in trainer.chunks for p in c.parameters()]
            result["parameters"] = sum(p.numel() for p in params)
            transports = {name: ColocatedTransport(c, 0, [client.base_url], layout, api_key=key)
                          for name, c in cfgs.items()}

            def sync(name: str, version: str) -> tuple[float, int, dict[str, float]]:
                t = transports[name]
                t1 = time.perf_counter()
                sent = t.send(trainer.iter_hf_weights(bucket, compact=t.wants_compact(False),
                                                      fused_experts=t.fused_experts), version)
                torch.cuda.synchronize()
                return time.perf_counter() - t1, sent, dict(t.last_phases)

            prompt = tuple((7 * i + 3) % 200 + 10 for i in range(24))

            def complete() -> tuple[list[int], list[float]]:
                async def go() -> Any:
                    try:
                        req = GenerateRequest(input_ids=prompt, sampling=SamplingParams(
                            temperature=0.0, max_new_tokens=32, ignore_eos=True))
                        return (await client.generate([req]))[0]
                    finally:
                        await close_sessions([client])

                r = asyncio.run(go())
                return list(r.output_ids), list(r.logprobs)

            gen = torch.Generator().manual_seed(1)
            perturb(params, gen)
            w = [p.detach().clone() for p in params]
            sync("sglang", "w-sglang")
            ref_ids, ref_lp = complete()
            perturb(params, gen)
            sync("sglang", "w2-sglang")
            stale_ids, stale_lp = complete()
            with torch.no_grad():
                for p, q in zip(params, w):
                    p.copy_(q)
            del w
            sync("vlmrl", "w-vlmrl")
            ids, lp = complete()
            # logprob differences are compared where the ids agree (None where they do not)
            gap = max(abs(a - b) for a, b in zip(lp, ref_lp)) if ids == ref_ids else None
            stale_gap = (sum(abs(a - b) for a, b in zip(stale_lp, ref_lp)) / len(ref_lp)
                         if stale_ids == ref_ids else None)
            result["check"] = {"same_ids": ids == ref_ids, "max_logprob_diff": gap,
                               "stale_same_ids": stale_ids == ref_ids, "stale_mean_logprob_diff": stale_gap,
                               "tol": LOGPROB_TOL}
            ok = (gap is not None and gap <= LOGPROB_TOL
                  and (stale_gap is None or stale_gap > 10 * LOGPROB_TOL))
            print(f"check: vlmrl's loader gives SGLang's loaders' completion: {ok} {result['check']}", flush=True)

            runs: dict[str, list[dict[str, Any]]] = {"vlmrl": [], "sglang": []}
            for i in range(args.repeats):
                for name in ("vlmrl", "sglang") if i % 2 == 0 else ("sglang", "vlmrl"):
                    seconds, sent, phases = sync(name, f"{name}-{i}")
                    runs[name].append({"seconds": seconds, "bytes": sent, "gb_per_s": sent / seconds / 1e9,
                                       "phases": phases})
            result["runs"] = runs
            summary = {}
            for name, rows in runs.items():
                med = statistics.median(r["seconds"] for r in rows)
                summary[name] = {"median_s": med, "gb_per_s": rows[0]["bytes"] / med / 1e9,
                                 "range_gb_per_s": [min(r["gb_per_s"] for r in rows), max(r["gb_per_s"] for r in rows)]}
            summary["speedup"] = summary["sglang"]["median_s"] / summary["vlmrl"]["median_s"]
            result["summary"] = summary
            result["check_ok"] = ok
            print(json.dumps(summary, indent=1), flush=True)
            for t in transports.values():
                t.close()
        finally:
            log = Path(run_dir) / "logs" / "sglang-0.log"
            if log.exists():
                result["loader_log"] = [line for line in log.read_text(errors="replace").splitlines()
                                        if "vlmrl_sglang_loader" in line][-3:]
            asyncio.run(engines.shutdown())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M")
    dest = out / f"sglang-sync-h200-{stamp}-{args.shape}.json"
    dest.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {dest}")
    return 0 if result.get("check_ok") else 1


if __name__ == "__main__":
    sys.exit(main())

"""SGLang engines: the launch command, Ray actors that run the servers, the optional router,
and the `flags` command that regenerates the flag list.

SGLang is never imported here (it cannot be installed on the CPU machines, and even its
request dataclasses pull in GPU packages). Flags are checked against the committed list
of SGLang's ServerArgs fields of each release vlmrl speaks
(`vlmrl/contracts/sglang-<version>.flags.txt`), which this module writes by reading
SGLang's source with `ast` (no import):

    pip download --no-deps sglang==0.5.23 -d /tmp/sg
    python -m vlmrl.rollout.sglang flags --source /tmp/sg/sglang-0.5.23-*.whl

Launch: `server_args(...)` maps the config onto ServerArgs field names (model_path, tp_size
= rollout.gpus_per_engine, ep_size, mem_fraction_static, mm_attention_backend from the
hardware preset, CUDA-graph batch sizes, speculative decoding, port, host, log_level,
dtype, enable_memory_saver when colocated) and merges `rollout.sglang.server_args`
verbatim; every key must be a ServerArgs field. With `rollout.sglang.weight_loader=vlmrl`
(the default) the server also loads vlmrl's weight loader (`--custom-weight-loader
vlmrl_sglang_loader.load_weights`, from `vlmrl/rollout/sglang_plugin`, put on the server's
PYTHONPATH), which the colocated sync names. The same folder holds vlmrl's SGLang plugin
(`vlmrl_sglang_hooks`: the device synchronizes before a memory release unmaps a region),
which SGLang loads in every server process. `server_command` turns the dict into
`python -m sglang.launch_server --foo-bar v ...` (True booleans as bare flags). Values of
fields with a fixed set of choices in SGLang's source are checked against them.
`SGLangServerActor` starts that command on its engine slot's GPUs (CUDA_VISIBLE_DEVICES, the GPUs Ray
gave the slot's placement bundles)
and waits on /health; `launch_sglang_engines` starts one per slot plus, optionally,
`python -m sglang_router.launch_router --worker-urls ...` in front of them.

Weight sync (trainer side, CUDA IPC and the NCCL update group) lives in `weights.py`;
the flag list and its scanner in `sglang_flags.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..contracts.sglang_flags import (
    SGLangFlags,
    flags_file,
    format_flags,
    load_flags,
    scan_sglang_source,
)
from ..contracts.sglang_server import SERVER_ENV, SGLANG_KEY_ARGS, VLM_CACHE_ENV  # noqa: F401  (VLM_CACHE_ENV: callers)
from .auth import redact
from .manager import close_sessions
from .processes import ManagedProcess, wait_port_free
from .sglang_plugin import HOOKS, LOADER, PLUGIN_DIR

log = logging.getLogger(__name__)


# =========================================================================== command
_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


def server_args(
    rollout: Any,
    hardware: Any,
    model: Any,
    *,
    port: int,
    host: str = "127.0.0.1",
    model_path: str | None = None,
    colocate: bool = False,
    seed: int | None = None,
    flags: SGLangFlags | None = None,
    data: Any = None,
    api_key: str | None = None,
    return_routed_experts: bool | None = None,
    batch_requests: int | None = None,
) -> dict[str, Any]:
    """ServerArgs field -> value for one engine, from the rollout / hardware / model (and
    data: the image pixel bounds) sections; `rollout.sglang.server_args` is merged last
    (verbatim, it wins; validation keeps the key's fields out of it). `batch_requests`, the
    most requests the engine holds at once in a step (`config.layout.engine_batch_requests`),
    bounds the decode CUDA graphs SGLang captures at its start, rounded up to a multiple of 8,
    where `rollout.sglang.cuda_graph_max_bs` is null: SGLang's own bound is sized for serving
    (hundreds of requests), and each batch size captured costs start time and graph memory
    that a step never uses. `api_key`, the run's engine key, becomes both `api_key` and
    `admin_api_key` (`vlmrl.rollout.auth`). `return_routed_experts` (None: `rollout.return_routed_experts`; the run passes
    `config.layout.returns_routed_experts`) starts the server able to report each token's
    experts."""
    flags = flags or load_flags()
    sg = rollout.sglang
    args: dict[str, Any] = {
        "model_path": model_path or model.path,
        "tp_size": int(rollout.gpus_per_engine),
        "ep_size": int(sg.ep_size),
        "mem_fraction_static": float(sg.mem_fraction_static),
        "dtype": _DTYPES.get(str(model.dtype), str(model.dtype)),
        "host": host,
        "port": int(port),
        "log_level": sg.log_level,
    }
    if hardware.sglang_mm_attention_backend:
        args["mm_attention_backend"] = hardware.sglang_mm_attention_backend
    if sg.cuda_graph_max_bs is not None:
        args[flags.resolve("cuda_graph_max_bs", "cuda_graph_max_bs_decode")] = int(sg.cuda_graph_max_bs)
    elif batch_requests and not sg.cuda_graph_bs:
        args[flags.resolve("cuda_graph_max_bs", "cuda_graph_max_bs_decode")] = -(-int(batch_requests) // 8) * 8
    if sg.cuda_graph_bs:
        args[flags.resolve("cuda_graph_bs", "cuda_graph_bs_decode")] = [int(b) for b in sg.cuda_graph_bs]
    spec = sg.speculative
    if spec.algorithm:
        args["speculative_algorithm"] = spec.algorithm
        if spec.draft_model_path:
            args["speculative_draft_model_path"] = spec.draft_model_path
        args["speculative_num_steps"] = int(spec.num_steps)
        args["speculative_eagle_topk"] = int(spec.eagle_topk)
        args["speculative_num_draft_tokens"] = int(spec.num_draft_tokens)
    if colocate:
        args["enable_memory_saver"] = True  # needed by release/resume_memory_occupation
    if seed is not None:
        args["random_seed"] = int(seed)
    if return_routed_experts is None:
        return_routed_experts = bool(rollout.return_routed_experts)
    if return_routed_experts:
        args["enable_return_routed_experts"] = True
    if sg.deterministic_inference:  # SGLang honours a request's sampling_seed only then
        args["enable_deterministic_inference"] = True
    if data is not None and data.min_pixels is not None and data.max_pixels is not None:
        # the engine's processor must cut images into as many tokens as the trainer's
        args["mm_process_config"] = {"image": {"min_pixels": int(data.min_pixels),
                                               "max_pixels": int(data.max_pixels)}}
    args.update(dict(sg.server_args))
    if sg.weight_loader == "vlmrl":  # the colocated sync's loader (vlmrl/rollout/sglang_plugin), beside any of the user's
        args["custom_weight_loader"] = [LOADER, *(x for x in args.get("custom_weight_loader") or () if x != LOADER)]
    if api_key:
        args.update(dict.fromkeys(SGLANG_KEY_ARGS, api_key))
    for name, value in args.items():
        flags.check_value(name, value)
    return args


def to_cli(args: dict[str, Any], flags: SGLangFlags | None = None) -> list[str]:
    """`{"foo_bar": v}` -> `["--foo-bar", "v"]` with SGLang's own flag spelling; True
    booleans become bare flags, False / None are left out; lists expand; dicts as JSON; a
    value that starts with "-" is joined to its flag (`--api-key=-k...`)."""
    flags = flags or load_flags()
    out: list[str] = []
    for name, value in args.items():
        info = flags.check(name)
        if value is None:
            continue
        if info.kind == "bool" or isinstance(value, bool):
            if info.kind != "bool":
                out += [info.cli, str(value).lower()]
            elif value:
                out.append(info.cli)
            continue
        if isinstance(value, (list, tuple)):
            if info.kind == "list":
                out += [info.cli, *(str(v) for v in value)]
            else:
                out += [info.cli, json.dumps(list(value))]
        elif isinstance(value, dict):
            out += [info.cli, json.dumps(value)]
        elif str(value).startswith("-"):  # argparse would read "-x..." (a key, a negative number) as a flag
            out.append(f"{info.cli}={value}")
        else:
            out += [info.cli, str(value)]
    return out


def server_command(args: dict[str, Any], *, flags: SGLangFlags | None = None, python: str | None = None) -> list[str]:
    return [python or sys.executable, "-m", "sglang.launch_server", *to_cli(args, flags)]


def router_command(worker_urls: Sequence[str], *, host: str, port: int, policy: str = "cache_aware",
                   log_level: str | None = None, python: str | None = None) -> list[str]:
    cmd = [python or sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port),
           "--worker-urls", *worker_urls, "--policy", policy]
    if log_level:
        cmd += ["--log-level", log_level]
    return cmd


def engine_port(base_port: int, index: int) -> int:
    """HTTP port of engine `index` (gaps of 10 leave room for ports SGLang derives)."""
    return int(base_port) + 10 * int(index)


def cuda_visible_devices(devices: Sequence[int | str]) -> str:
    return ",".join(str(d) for d in devices)


VERSION_PROBE = "from importlib.metadata import version; print(version('sglang'))"


def installed_sglang_version(python: str | None = None, env: dict[str, str] | None = None) -> str:
    """The sglang release installed for `python` (None: this interpreter) under `env`, read
    from its package metadata without importing it."""
    python = python or sys.executable
    try:
        out = subprocess.run([python, "-c", VERSION_PROBE], env=env, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"could not ask {python} for its sglang version: {e}") from e
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"sglang is not installed for {python} (rollout.sglang.python; PYTHONPATH from "
                           f"rollout.sglang.env): {last}")
    return out.stdout.strip()




class SGLangServerActor:
    """Ray actor body: runs one SGLang server on its slot's GPUs.

    The actor sits in its engine's placement-group bundle and may hold a fraction of a GPU
    (colocation), so the GPUs the server uses are set explicitly from the engine slot through
    CUDA_VISIBLE_DEVICES. The server runs under `python` (rollout.sglang.python) with `env`
    (rollout.sglang.env) added to the actor's environment and to `SERVER_ENV`."""

    port_wait_s = 10.0  # how long a start waits for its port to be free (a killed server's may linger)

    def __init__(self, devices: Sequence[int | str], *, log_path: str, python: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.devices = tuple(str(d) for d in devices)
        self.log_path = log_path
        self.python = python or sys.executable
        self.extra_env = dict(env or {})
        self.args: dict[str, Any] = {}
        self.flags_version: str | None = None
        self.process: ManagedProcess | None = None
        self.started_at = time.monotonic()  # the last launch (`start`)

    def _env(self) -> dict[str, str]:
        env = {**os.environ, **SERVER_ENV, **self.extra_env}
        # vlmrl's weight loader (`--custom-weight-loader`) and SGLang plugin: their folder alone, after
        # the server's own path
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), PLUGIN_DIR) if p)
        allowed = [x.strip() for x in env.get("SGLANG_PLUGINS", "").split(",") if x.strip()]
        if allowed and HOOKS not in allowed:  # the user's allow-list of SGLang plugins, plus vlmrl's
            env["SGLANG_PLUGINS"] = ",".join([*allowed, HOOKS])
        return {**env, "CUDA_VISIBLE_DEVICES": cuda_visible_devices(self.devices)}

    def check_devices(self) -> None:
        """The actor sits in the bundle of its engine's first GPU: Ray must have given it that
        GPU, or the server would start on a GPU the job does not hold. Nothing to check where
        Ray gave the actor no GPU (CPU layouts, a process outside Ray)."""
        import ray

        own = [str(i) for i in ray.get_gpu_ids()] if ray.is_initialized() else []
        if own and self.devices[0] not in own:
            raise RuntimeError(f"SGLang engine on GPUs {list(self.devices)} (its placement bundles' GPUs), but Ray "
                               f"gave its actor GPU(s) {own}: the server would run on GPUs the job does not hold")

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def sglang_version(self) -> str:
        return installed_sglang_version(self.python, self._env())

    def start(self, args: dict[str, Any] | None = None, version: str | None = None) -> str:
        """Start the server (`args`: ServerArgs fields checked against the flags of `version`);
        without arguments, start it again as before (after `stop`)."""
        if args is not None:
            self.args, self.flags_version = dict(args), version
        if not self.args:
            raise RuntimeError("SGLangServerActor.start needs the server's arguments the first time")
        self.check_devices()
        if self.args.get("host") in (None, "", "auto"):
            self.args["host"] = self.node_ip()
        # a restart after a kill may find the port held for a moment; anything longer is another process
        wait_port_free(self.args["host"], self.args["port"], self.port_wait_s, moved_by="rollout.sglang.base_port=...")
        cmd = server_command(self.args, flags=load_flags(self.flags_version), python=self.python)
        log.info("starting SGLang on GPUs %s: %s", self.devices, " ".join(redact(cmd)))
        self.process = ManagedProcess(cmd, env=self._env(), log_path=self.log_path)
        self.started_at = time.monotonic()
        self.process.start()
        return self.url()

    def url(self) -> str:
        return f"http://{self.args['host']}:{self.args['port']}"

    async def wait_healthy(self, timeout_s: float) -> float:
        """Wait until the server answers /health; returns the seconds from its launch (`start`)
        to then (polled every 0.5 s)."""
        from .client import HTTPEngine

        client = HTTPEngine(self.url(), max_retries=0, api_key=self.args.get("api_key"))
        try:
            await client.wait_healthy(timeout_s, poll_s=0.5, is_alive=lambda: self.process is not None
                                      and self.process.alive())
            return time.monotonic() - self.started_at
        except Exception as e:
            raise RuntimeError(f"SGLang server on GPUs {list(self.devices)} did not become healthy: {e}\n"
                               f"--- the end of its log ({self.log_path}) ---\n{self.tail()}") from e
        finally:
            await client.close()

    def tail(self, n: int = 40) -> str:
        return self.process.tail(n) if self.process else ""

    def alive(self) -> bool:
        return self.process is not None and self.process.alive()

    def pid(self) -> int | None:
        return self.process.proc.pid if self.process is not None and self.process.proc is not None else None

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


@dataclass
class SGLangEngines:
    """Running SGLang engines: per-engine clients (admin calls, weight sync) and the clients
    generation should use (the router's when there is one)."""

    engines: list[Any]  # HTTPEngine per server
    actors: list[Any]
    version: str = ""
    placed: bool = True  # False while Ray may still be placing the actors (they answer nothing)
    router: ManagedProcess | None = None
    router_url: str | None = None
    generation: list[Any] = field(default_factory=list)
    start_seconds: list[float] = field(default_factory=list)  # each server's launch to its first healthy answer

    async def shutdown(self) -> None:
        import ray

        for e in self.engines + self.generation:
            await e.close()
        if self.router is not None:
            self.router.stop()
        # each server's own stop (its process group), bounded: an actor Ray never placed would
        # never answer; ray.kill then ends the actors (and cancels pending ones)
        try:
            if self.placed:
                await asyncio.wait_for(asyncio.gather(*(a.stop.remote() for a in self.actors),
                                                      return_exceptions=True), 60.0)
        except TimeoutError:
            log.warning("SGLang engine actors did not stop within 60 s; killing them")
        for a in self.actors:
            ray.kill(a)


def engine_gpu_request(rollout: Any, colocate: bool, gpu_fraction: float | None = None) -> float:
    """The GPU an engine actor asks Ray for in its bundle (one GPU each): a share when it sits
    beside a trainer rank, else the whole bundle. An engine wider than one GPU sits in the
    bundle of its first GPU; its server is pinned to all of them through CUDA_VISIBLE_DEVICES."""
    if gpu_fraction is not None:
        return float(gpu_fraction)
    return 0.2 if colocate else 1.0


def check_sglang_version(found: Sequence[str], wanted: str | None) -> str:
    """The one SGLang release every engine runs, known to vlmrl (a contract exists for it) and
    equal to `rollout.sglang.version` when set; ValueError otherwise."""
    from ..contracts.sglang_contract import known_versions

    versions = sorted(set(found))
    if len(versions) != 1:
        raise ValueError(f"the SGLang engines run different releases: {versions}")
    version = versions[0]
    if wanted and version != wanted:
        raise ValueError(f"rollout.sglang.version={wanted} but the engines' interpreter has sglang {version}")
    if version not in known_versions():
        raise ValueError(f"sglang {version} is not a release vlmrl has run or has a contract for; tested: "
                         f"{', '.join(known_versions())} (install one of them, or generate a contract with "
                         f"`make sglang-contract SGLANG_VERSION={version}` and test it)")
    return version


async def _within(awaitable: Any, timeout_s: float, what: str) -> Any:
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except TimeoutError as e:
        raise RuntimeError(f"{what} within {timeout_s:.0f} s") from e


async def launch_sglang_engines(
    rollout: Any,
    hardware: Any,
    model: Any,
    slots: Sequence[Any],
    *,
    run_dir: str | Path,
    placement: Any = None,
    model_path: str | None = None,
    colocate: bool = False,
    gpu_fraction: float | None = None,
    cpus_per_actor: float = 0.5,
    seed: int | None = None,
    router_host: str = "127.0.0.1",
    data: Any = None,
    host: str = "127.0.0.1",
    api_key: str | None = None,
    return_routed_experts: bool | None = None,
    batch_requests: int | None = None,
) -> SGLangEngines:
    """Start one `SGLangServerActor` per engine slot (Ray must be initialised) in the slot's
    bundle of `placement`, check that its interpreter runs an SGLang release vlmrl knows, start
    the servers with that release's flags, wait until every one is healthy (a server that
    dies or stays unhealthy raises with the end of its log), and put the router in front when
    `rollout.sglang.use_router`. Every wait is bounded by `rollout.sglang.startup_timeout_s`;
    on any failure the actors are stopped before the error is raised. The servers bind `host`
    ("auto": each actor's node address, for layouts where another node calls them) and, with
    `api_key` (the run's engine key), refuse any caller without it; the clients send it."""
    import ray

    from .client import HTTPEngine

    sg = rollout.sglang
    frac = engine_gpu_request(rollout, colocate, gpu_fraction)
    timeout = float(sg.startup_timeout_s)
    actor_cls = ray.remote(SGLangServerActor)
    actors = []
    for slot in slots:
        opts: dict[str, Any] = dict(num_cpus=cpus_per_actor, num_gpus=frac, max_concurrency=4)
        if placement is not None:
            opts["scheduling_strategy"] = placement.strategy(placement.engine_bundles[slot.index])
        gpus = placement.bundle_gpus if placement is not None else None
        actors.append(actor_cls.options(**opts).remote(
            [gpus[d] for d in slot.devices] if gpus else slot.devices, log_path=str(Path(run_dir) / "logs" / f"sglang-{slot.index}.log"),
            python=sg.python, env=dict(sg.env)))
    out = SGLangEngines(engines=[], actors=actors, placed=False)
    try:
        found = await _within(asyncio.gather(*(a.sglang_version.remote() for a in actors)), timeout,
                              f"Ray did not place the {len(actors)} SGLang engine actors (each asks for {frac} GPU "
                              f"and {cpus_per_actor} CPU in its bundle) or they could not read their sglang version")
        out.placed = True
        out.version = version = check_sglang_version(found, sg.version)
        flags = load_flags(version)
        starts = []
        for slot, actor in zip(slots, actors):
            args = server_args(rollout, hardware, model, port=engine_port(sg.base_port, slot.index), host=host,
                               model_path=model_path, colocate=colocate, seed=seed, flags=flags, data=data,
                               api_key=api_key, return_routed_experts=return_routed_experts,
                               batch_requests=batch_requests)
            starts.append(actor.start.remote(args, version))
        urls = await _within(asyncio.gather(*starts), timeout, "the SGLang servers did not start")
        # wait_healthy bounds itself and quotes the server's log when it fails
        out.start_seconds = list(await asyncio.gather(*(a.wait_healthy.remote(timeout) for a in actors)))
        common = dict(max_concurrency=max(1, rollout.max_in_flight), timeout_s=rollout.request_timeout_s,
                      max_retries=rollout.max_retries, tensor_format="ipc" if colocate else None,
                      tp_size=rollout.gpus_per_engine, drain_timeout_s=sg.drain_timeout_s, api_key=api_key)
        out.engines = [HTTPEngine(u, name=f"sglang-{s.index}", **common) for u, s in zip(urls, slots)]
        reported = await asyncio.gather(*(e.server_version() for e in out.engines))
        if set(reported) != {version}:
            raise RuntimeError(f"the SGLang servers report versions {sorted(set(reported))}, their package {version}")
        if sg.use_router and len(out.engines) > 1:
            cmd = router_command(urls, host=router_host, port=sg.router_port, log_level=sg.log_level,
                                 python=sg.python)
            out.router = ManagedProcess(cmd, env={**os.environ, **dict(sg.env)},
                                        log_path=Path(run_dir) / "logs" / "sglang-router.log")
            out.router.start()
            out.router_url = f"http://{router_host}:{sg.router_port}"
            router = HTTPEngine(out.router_url, name="sglang-router", **common)
            await router.wait_healthy(timeout, is_alive=out.router.alive)
            out.generation = [router]
        else:
            out.generation = list(out.engines)
        await close_sessions([*out.engines, *out.generation])  # opened on this event loop, which ends here
    except BaseException:
        await out.shutdown()
        raise
    return out


# =========================================================================== CLI
def _generated_by(cmd: str, source: str, out: str, version: str) -> str:
    """The command line a generated file records (paths relative to the project)."""
    shown = [f"python -m vlmrl.rollout.sglang {cmd}", "--source", Path(source).name, "--out",
             os.path.relpath(out, Path(__file__).resolve().parents[2])]
    return " ".join(shown) + f"   (wheel from: pip download --no-deps sglang=={version} -d DIR)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vlmrl.rollout.sglang")
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("flags", help="write an SGLang release's flag list from its wheel or package directory")
    f.add_argument("--source", required=True, help="sglang-*.whl (pip download --no-deps sglang) or site-packages dir")
    f.add_argument("--out", default=None, help="default: vlmrl/contracts/sglang-<version>.flags.txt")
    c = sub.add_parser("command", help="print the launch command of every engine for a config")
    c.add_argument("overrides", nargs="*")
    from ..contracts.sglang_contract import format_contract, scan_contract
    from ..contracts.sglang_flags import contract_file

    k = sub.add_parser("contract", help="write an SGLang release's HTTP contract from its wheel or package dir")
    k.add_argument("--source", required=True, help="sglang-*.whl (pip download --no-deps sglang) or site-packages dir")
    k.add_argument("--out", default=None, help="default: vlmrl/contracts/sglang-<version>.json")
    args = p.parse_args(argv)
    if args.cmd == "contract":
        contract = scan_contract(args.source)
        out = args.out or str(contract_file(contract["sglang_version"]))
        cmd = _generated_by("contract", args.source, out, contract["sglang_version"])
        Path(out).write_text(format_contract(contract, cmd))
        print(f"wrote {out}: {len(contract['endpoints'])} endpoints of sglang {contract['sglang_version']}")
        return 0
    if args.cmd == "flags":
        flags = scan_sglang_source(args.source)
        out = args.out or str(flags_file(flags.version))
        Path(out).write_text(format_flags(flags, _generated_by("flags", args.source, out, flags.version)))
        print(f"wrote {out}: {len(flags.fields)} fields of sglang {flags.version}")
        return 0
    from ..config import compute_layout, load
    from ..config.layout import engine_batch_requests, returns_routed_experts

    cfg = load(args.overrides)
    for slot in compute_layout(cfg).engines(cfg):
        a = server_args(cfg.rollout, cfg.hardware, cfg.model, port=engine_port(cfg.rollout.sglang.base_port, slot.index),
                        data=cfg.data, colocate=cfg.cluster.colocate,
                        return_routed_experts=returns_routed_experts(cfg), batch_requests=engine_batch_requests(cfg))
        print(f"CUDA_VISIBLE_DEVICES={cuda_visible_devices(slot.devices)}", " ".join(server_command(a, python="python")))
    return 0


if __name__ == "__main__":
    sys.exit(main())

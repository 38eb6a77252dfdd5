"""SGLang engines: the launch command, Ray actors that run the servers, the optional router,
and the trainer side of weight sync.

SGLang is never imported here (it cannot be installed on the CPU machines, and even its
request dataclasses pull in GPU packages). Flags are checked against the committed list
of SGLang's ServerArgs fields, `sglang_flags.txt`, which this module writes by reading
SGLang's source with `ast` (no import):

    pip download --no-deps sglang==0.5.23 -d /tmp/sg
    python -m vlmrl.rollout.sglang flags --source /tmp/sg/sglang-0.5.23-*.whl \\
        --out vlmrl/rollout/sglang_flags.txt

Launch: `server_args(...)` maps the config onto ServerArgs field names (model_path, tp_size
= rollout.gpus_per_engine, ep_size, mem_fraction_static, mm_attention_backend from the
hardware preset, CUDA-graph batch sizes, speculative decoding, port, host, log_level,
dtype, enable_memory_saver when colocated) and merges `rollout.sglang.server_args`
verbatim; every key must be a ServerArgs field. `server_command` turns the dict into
`python -m sglang.launch_server --foo-bar v ...` (True booleans as bare flags).
`SGLangServerActor` starts that command on its engine slot's GPUs (CUDA_VISIBLE_DEVICES)
and waits on /health; `launch_sglang_engines` starts one per slot plus, optionally,
`python -m sglang_router.launch_router --worker-urls ...` in front of them.

Weight sync:
* colocated (trainer and engine on the same GPUs): `HTTPEngine(tensor_format="ipc")`
  posts /update_weights_from_tensor with CUDA IPC handles (`serialize_ipc`), bucketed by
  rollout.weight_update_bucket_mb.
* separate GPUs: `init_update_group` (trainer, rank 0) + /init_weights_update_group on
  every engine (rank offsets 1, 1 + tp_0, ...), then per bucket
  /update_weights_from_distributed (names, dtypes, shapes) while the trainer runs
  `broadcast_bucket`; `update_weights_distributed` drives both. The same helpers run
  over gloo on CPU, which is how the embedded server's implementation is tested.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import difflib
import io
import json
import logging
import os
import signal
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from .protocol import bucketize

log = logging.getLogger(__name__)

FLAGS_FILE = Path(__file__).with_name("sglang_flags.txt")


# =========================================================================== flags
@dataclass(frozen=True)
class FlagInfo:
    field: str
    kind: str  # bool | list | value | action | nocli
    flags: tuple[str, ...]  # the CLI spelling first, then aliases
    choices: tuple[str, ...] = ()  # literal choices in SGLang's source (empty: free or dynamic)

    @property
    def cli(self) -> str:
        return self.flags[0]


@dataclass(frozen=True)
class SGLangFlags:
    """SGLang's ServerArgs fields and their command-line flags (one SGLang version)."""

    version: str
    fields: dict[str, FlagInfo]
    extra_flags: frozenset[str] = frozenset()  # flags registered by hand (not fields)
    header: tuple[str, ...] = ()

    def __contains__(self, name: str) -> bool:
        return name in self.fields

    def resolve(self, *candidates: str) -> str:
        """The first candidate that is a field (SGLang renames a few fields across versions,
        e.g. cuda_graph_max_bs -> cuda_graph_max_bs_decode in 0.5.2x)."""
        for c in candidates:
            if c in self.fields:
                return c
        raise UnknownSGLangArg(candidates[0], self)

    def check(self, name: str) -> FlagInfo:
        info = self.fields.get(name)
        if info is None:
            raise UnknownSGLangArg(name, self)
        if info.kind == "nocli":
            raise UnknownSGLangArg(name, self, reason="has no command-line flag")
        return info

    def cli_flags(self) -> set[str]:
        out = set(self.extra_flags)
        for info in self.fields.values():
            out.update(info.flags)
        return out


class UnknownSGLangArg(KeyError):
    def __init__(self, name: str, flags: SGLangFlags, reason: str = "is not a ServerArgs field") -> None:
        close = difflib.get_close_matches(name, list(flags.fields), n=5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        super().__init__(f"SGLang {flags.version}: {name!r} {reason}{hint} (see {FLAGS_FILE.name})")


def load_flags(path: str | Path = FLAGS_FILE) -> SGLangFlags:
    version = "unknown"
    fields: dict[str, FlagInfo] = {}
    extra: set[str] = set()
    header: list[str] = []
    for raw in Path(path).read_text().splitlines():
        line = raw.rstrip()
        if not line:
            continue
        if line.startswith("#"):
            header.append(line)
            if line.startswith("# sglang version:"):
                version = line.split(":", 1)[1].strip()
            continue
        parts = line.split("\t")
        if parts[0] == "@flag":
            extra.add(parts[1])
            continue
        name, kind = parts[0], parts[1]
        flags = tuple(parts[2].split(",")) if len(parts) > 2 and parts[2] else ()
        choices = tuple(parts[3].split(",")) if len(parts) > 3 and parts[3] else ()
        fields[name] = FlagInfo(name, kind, flags, choices)
    return SGLangFlags(version, fields, frozenset(extra), tuple(header))


def _sources(source: str | Path) -> tuple[dict[str, str], str]:
    """{relative path under sglang/srt: text} of the files the scan reads, and the version."""
    wanted = ("srt/server_args.py", "srt/arg_groups/fields/", "version.py")
    out: dict[str, str] = {}
    source = Path(source)
    if source.is_file() and zipfile.is_zipfile(source):
        with zipfile.ZipFile(source) as z:
            for n in z.namelist():
                if n.startswith("sglang/") and n.endswith(".py") and any(w in n[len("sglang/"):] for w in wanted):
                    out[n[len("sglang/"):]] = z.read(n).decode()
    else:
        root = source / "sglang" if (source / "sglang").is_dir() else source
        for p in root.rglob("*.py"):
            rel = p.relative_to(root).as_posix()
            if any(w in rel for w in wanted):
                out[rel] = p.read_text()
    return out, _version(source)


def _version(source: Path) -> str:
    """From the wheel's or the installed distribution's METADATA (else sglang/_version.py)."""
    import re

    texts: list[str] = []
    if source.is_file() and zipfile.is_zipfile(source):
        with zipfile.ZipFile(source) as z:
            names = z.namelist()
            texts += [z.read(n).decode() for n in names if n.endswith(".dist-info/METADATA")]
            texts += [z.read(n).decode() for n in names if n == "sglang/_version.py"]
    else:
        base = source.parent if source.name == "sglang" else source
        for p in list(base.glob("sglang-*.dist-info/METADATA")) + [base / "sglang" / "_version.py"]:
            if p.exists():
                texts.append(p.read_text())
    for text in texts:
        m = re.search(r"^Version:\s*(\S+)", text, re.M) or re.search(r"__version__\s*=\s*['\"]([^'\"]+)", text)
        if m:
            return m.group(1)
    return "unknown"


def _kind_of(annotation: ast.expr, arg: dict[str, Any]) -> str:
    if arg.get("no_cli"):
        return "nocli"
    if arg.get("action") is not None:
        return "action"
    text = ast.unparse(annotation)
    if arg.get("type_parser") is not None:
        return "value"
    inner = text.replace("Optional[", "").replace(" ", "")
    if inner.startswith("bool"):
        return "bool"
    if inner.startswith(("List[", "list[")) or arg.get("nargs"):
        return "list"
    return "value"


def _arg_meta(annotation: ast.expr) -> tuple[ast.expr, dict[str, Any]] | None:
    """For `A[T, Arg(...)]` or `A[T, "help"]`: (T, Arg keywords); None for other fields."""
    if not (isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name)
            and annotation.value.id in ("A", "Annotated")):
        return None
    elts = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
    if len(elts) < 2:
        return None
    typ, meta = elts[0], elts[1]
    if isinstance(meta, (ast.Constant, ast.JoinedStr, ast.BinOp)):
        return typ, {}
    if isinstance(meta, ast.Call) and isinstance(meta.func, ast.Name) and meta.func.id == "Arg":
        return typ, _literal_keywords(meta.keywords)
    return None


def _literal_keywords(keywords: list[ast.keyword]) -> dict[str, Any]:
    """A call's keyword arguments: literals evaluated, anything else as source text."""
    kw: dict[str, Any] = {}
    for k in keywords:
        if k.arg is None:
            continue
        try:
            kw[k.arg] = ast.literal_eval(k.value)
        except ValueError:
            kw[k.arg] = ast.unparse(k.value)
    return kw


def _choices(kw: dict[str, Any]) -> tuple[str, ...]:
    c = kw.get("choices")
    if isinstance(c, (list, tuple)) and c and all(isinstance(x, (str, int, float)) and "," not in str(x) for x in c):
        return tuple(str(x) for x in c)
    return ()


def _manual_flags(tree: ast.AST) -> list[tuple[list[str], dict[str, Any]]]:
    """`parser.add_argument("--x", ...)` calls: (flag strings, literal keywords)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if names:
                out.append((names, _literal_keywords(node.keywords)))
    return out


def scan_sglang_source(source: str | Path) -> SGLangFlags:
    """Read ServerArgs' fields and flags from an SGLang wheel or package directory, with
    `ast` only. Handles both layouts: fields declared on namespace classes under
    `srt/arg_groups/fields/` (0.5.2x, `A[T, Arg(...)]`, flags derived from field names) and
    the older single `ServerArgs` dataclass whose flags are added by hand in add_cli_args."""
    files, version = _sources(source)
    fields: dict[str, FlagInfo] = {}
    extra: set[str] = set()
    field_files = sorted(k for k in files if "arg_groups/fields/" in k)
    if field_files:
        for rel in field_files:
            tree = ast.parse(files[rel])
            for cls in [n for n in tree.body if isinstance(n, ast.ClassDef)]:
                if not any(isinstance(b, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_NS_PATH"
                                                             for t in b.targets) for b in cls.body):
                    continue
                for b in cls.body:
                    if not (isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name)):
                        continue
                    name = b.target.id
                    if name.startswith("_"):
                        continue
                    meta = _arg_meta(b.annotation)
                    if meta is None or meta[1].get("no_cli"):
                        fields[name] = FlagInfo(name, "nocli", ())
                        continue
                    typ, kw = meta
                    cli = kw.get("cli_name") or "--" + name.replace("_", "-")
                    aliases = kw.get("aliases") or []
                    fields[name] = FlagInfo(name, _kind_of(typ, kw), (cli, *aliases), _choices(kw))
        # fields registered by hand (dynamic choices); deprecated spellings stay extras
        tree = ast.parse(files.get("srt/server_args.py", ""))
        for names, kw in _manual_flags(tree):
            longs = [n for n in names if n.startswith("--")]
            if not longs:
                continue
            dest = kw.get("dest") or longs[0][2:].replace("-", "_")
            action = str(kw.get("action") or "")
            if "Deprecated" in action or dest not in fields or fields[dest].kind != "nocli":
                extra.update(longs)
                continue
            kind = "bool" if action in ("store_true", "store_false") else "action" if action else (
                "list" if kw.get("nargs") in ("+", "*") else "value")
            fields[dest] = FlagInfo(dest, kind, tuple(longs), _choices(kw))
    else:  # older layout: `class ServerArgs` dataclass + add_argument calls
        tree = ast.parse(files["srt/server_args.py"])
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ServerArgs")
        declared = [b.target.id for b in cls.body if isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name)]
        by_dest: dict[str, tuple[list[str], dict[str, Any]]] = {}
        for names, kw in _manual_flags(cls):
            longs = [n for n in names if n.startswith("--")]
            if not longs:
                continue
            dest = kw.get("dest") or longs[0][2:].replace("-", "_")
            by_dest.setdefault(dest, (longs, kw))
        for name in declared:
            if name.startswith("_"):
                continue
            if name not in by_dest:
                fields[name] = FlagInfo(name, "nocli", ())
                continue
            longs, kw = by_dest.pop(name)
            action = kw.get("action")
            kind = "bool" if action in ("store_true", "store_false") else "action" if action else (
                "list" if kw.get("nargs") in ("+", "*") else "value")
            fields[name] = FlagInfo(name, kind, tuple(longs), _choices(kw))
        for longs, _ in by_dest.values():
            extra.update(longs)
    extra -= {f for info in fields.values() for f in info.flags}
    return SGLangFlags(version, dict(sorted(fields.items())), frozenset(extra))


def format_flags(flags: SGLangFlags, command: str) -> str:
    lines = [
        "# SGLang ServerArgs fields and their command-line flags, read from SGLang's source with ast.",
        f"# sglang version: {flags.version}",
        f"# generated by: {command}",
        "# format: field<TAB>kind<TAB>--flag[,--alias...][<TAB>choice,...]",
        "#   kind: bool (bare flag) | list (nargs) | value |",
        "#   action (custom argparse action) | nocli (a field without a command-line flag)",
        "# '@flag' lines: flags registered by hand in ServerArgs.add_cli_args (not fields; often deprecated)",
    ]
    for info in flags.fields.values():
        line = f"{info.field}\t{info.kind}\t{','.join(info.flags)}"
        if info.choices:
            line += "\t" + ",".join(info.choices)
        lines.append(line)
    for f in sorted(flags.extra_flags):
        lines.append(f"@flag\t{f}")
    return "\n".join(lines) + "\n"


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
) -> dict[str, Any]:
    """ServerArgs field -> value for one engine, from the rollout / hardware / model
    sections; `rollout.sglang.server_args` is merged last (verbatim, it wins)."""
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
    args.update(dict(sg.server_args))
    for name in args:
        flags.check(name)
    return args


def to_cli(args: dict[str, Any], flags: SGLangFlags | None = None) -> list[str]:
    """`{"foo_bar": v}` -> `["--foo-bar", "v"]` with SGLang's own flag spelling; True
    booleans become bare flags, False / None are left out; lists expand; dicts as JSON."""
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


def cuda_visible_devices(devices: Sequence[int]) -> str:
    return ",".join(str(int(d)) for d in devices)


# =========================================================================== processes
class ManagedProcess:
    """A child process in its own session; `stop` ends that session only (our children)."""

    def __init__(self, command: list[str], *, env: dict[str, str] | None = None, log_path: str | Path | None = None):
        self.command = command
        self.env = env
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        out: Any = subprocess.DEVNULL
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            out = open(self.log_path, "ab")  # noqa: SIM115 (kept open for the child)
        self.proc = subprocess.Popen(self.command, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = os.getpgid(self.proc.pid)  # == pid: the session we created
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(10)

    def tail(self, n: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


class SGLangServerActor:
    """Ray actor body: runs one SGLang server on its slot's GPUs.

    Ray may give the actor a fractional GPU (colocation), so the GPUs the server uses are
    set explicitly from the engine slot through CUDA_VISIBLE_DEVICES."""

    def __init__(self, args: dict[str, Any], devices: Sequence[int], *, log_path: str,
                 flags_path: str | None = None, env: dict[str, str] | None = None) -> None:
        self.args = dict(args)
        self.devices = tuple(devices)
        self.log_path = log_path
        self.flags = load_flags(flags_path) if flags_path else load_flags()
        self.extra_env = dict(env or {})
        self.process: ManagedProcess | None = None

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def start(self) -> str:
        if self.args.get("host") in (None, "", "auto"):
            self.args["host"] = self.node_ip()
        env = {**os.environ, **self.extra_env, "CUDA_VISIBLE_DEVICES": cuda_visible_devices(self.devices)}
        cmd = server_command(self.args, flags=self.flags)
        log.info("starting SGLang on GPUs %s: %s", self.devices, " ".join(cmd))
        self.process = ManagedProcess(cmd, env=env, log_path=self.log_path)
        self.process.start()
        return f"http://{self.args['host']}:{self.args['port']}"

    async def wait_healthy(self, timeout_s: float) -> None:
        from .client import HTTPEngine

        client = HTTPEngine(f"http://{self.args['host']}:{self.args['port']}", max_retries=0)
        try:
            await client.wait_healthy(timeout_s, poll_s=2.0, is_alive=lambda: self.process is not None
                                      and self.process.alive())
        except Exception as e:
            tail = self.process.tail() if self.process else ""
            raise RuntimeError(f"SGLang server did not become healthy: {e}\n--- log tail ---\n{tail}") from e
        finally:
            await client.close()

    def alive(self) -> bool:
        return self.process is not None and self.process.alive()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


@dataclass
class SGLangEngines:
    """Running SGLang engines: per-engine clients (admin calls, weight sync) and the clients
    generation should use (the router's when there is one)."""

    engines: list[Any]  # HTTPEngine per server
    actors: list[Any]
    router: ManagedProcess | None = None
    router_url: str | None = None
    generation: list[Any] = field(default_factory=list)

    async def shutdown(self) -> None:
        import ray

        for e in self.engines + self.generation:
            await e.close()
        if self.router is not None:
            self.router.stop()
        await asyncio.gather(*(a.stop.remote() for a in self.actors), return_exceptions=True)
        for a in self.actors:
            ray.kill(a)


async def launch_sglang_engines(
    rollout: Any,
    hardware: Any,
    model: Any,
    slots: Sequence[Any],
    *,
    run_dir: str | Path,
    model_path: str | None = None,
    colocate: bool = False,
    gpu_fraction: float | None = None,
    cpus_per_actor: float = 0.5,
    seed: int | None = None,
    router_host: str = "127.0.0.1",
) -> SGLangEngines:
    """Start one `SGLangServerActor` per engine slot (Ray must be initialised), wait until
    every server is healthy, and put the router in front when `rollout.sglang.use_router`.

    Each actor asks Ray for `gpu_fraction` of a GPU (default: a whole one per slot GPU when
    separate, 0.2 when colocated with the trainer) and pins the server to the slot's GPUs."""
    import ray

    from .client import HTTPEngine

    sg = rollout.sglang
    flags = load_flags()
    frac = gpu_fraction if gpu_fraction is not None else (0.2 if colocate else float(rollout.gpus_per_engine))
    actor_cls = ray.remote(SGLangServerActor)
    actors, urls = [], []
    for slot in slots:
        args = server_args(rollout, hardware, model, port=engine_port(sg.base_port, slot.index), host="auto",
                           model_path=model_path, colocate=colocate, seed=seed, flags=flags)
        actor = actor_cls.options(num_cpus=cpus_per_actor, num_gpus=frac, max_concurrency=4).remote(
            args, slot.devices, log_path=str(Path(run_dir) / "logs" / f"sglang-{slot.index}.log"))
        actors.append(actor)
    urls = await asyncio.gather(*(a.start.remote() for a in actors))
    await asyncio.gather(*(a.wait_healthy.remote(sg.startup_timeout_s) for a in actors))
    fmt = "ipc" if colocate else "torch_save"
    common = dict(max_concurrency=max(1, rollout.max_in_flight), timeout_s=rollout.request_timeout_s,
                  max_retries=rollout.max_retries, tensor_format=fmt, tp_size=rollout.gpus_per_engine)
    engines = [HTTPEngine(u, name=f"sglang-{s.index}", **common) for u, s in zip(urls, slots)]
    out = SGLangEngines(engines=engines, actors=actors)
    if sg.use_router and len(engines) > 1:
        cmd = router_command(urls, host=router_host, port=sg.router_port, log_level=sg.log_level)
        out.router = ManagedProcess(cmd, log_path=Path(run_dir) / "logs" / "sglang-router.log")
        out.router.start()
        out.router_url = f"http://{router_host}:{sg.router_port}"
        router = HTTPEngine(out.router_url, name="sglang-router", **common)
        await router.wait_healthy(sg.startup_timeout_s, is_alive=out.router.alive)
        out.generation = [router]
    else:
        out.generation = list(engines)
    return out


# =========================================================================== weight sync
def _device_uuid(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def serialize_ipc(named_tensors: Sequence[tuple[str, Any]]) -> bytes:
    """Pickle (name, tensor) pairs the way SGLang's /update_weights_from_tensor reads them:
    torch's multiprocessing reductions (CUDA tensors travel as IPC handles, not data), with
    the CUDA device index replaced by the device UUID, since the server process numbers
    its visible GPUs differently (SGLang's patched rebuild accepts a UUID there)."""
    from multiprocessing.reduction import ForkingPickler

    import torch
    from torch.multiprocessing import reductions

    reductions.init_reductions()

    def reduce_cuda(t: Any) -> Any:
        fn, args = reductions.reduce_tensor(t)
        if fn is reductions.rebuild_cuda_tensor:
            args = list(args)
            # rebuild_cuda_tensor(cls, size, stride, offset, storage_cls, dtype, device, ...)
            args[6] = _device_uuid(int(args[6]))
            args = tuple(args)
        return fn, args

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)  # its dispatch table is a per-instance copy
    pickler.dispatch_table[torch.Tensor] = reduce_cuda
    pickler.dispatch_table[torch.nn.Parameter] = reduce_cuda
    pickler.dump([(n, t.detach()) for n, t in named_tensors])
    return buf.getvalue()


def load_ipc(data: bytes) -> list[tuple[str, Any]]:
    """Inverse of `serialize_ipc` in another process (what SGLang's server does): device
    UUIDs are mapped back to this process's CUDA device indices. For tests and tools."""
    import pickle

    import torch
    from torch.multiprocessing import reductions

    by_uuid = {_device_uuid(i): i for i in range(torch.cuda.device_count())}
    original = reductions.rebuild_cuda_tensor

    def rebuild(*args: Any) -> Any:
        args = list(args)
        if isinstance(args[6], str):
            args[6] = by_uuid[args[6]]
        return original(*args)

    class _Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if module == "torch.multiprocessing.reductions" and name == "rebuild_cuda_tensor":
                return rebuild
            return super().find_class(module, name)

    return _Unpickler(io.BytesIO(data)).load()


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def bucket_metadata(bucket: Sequence[tuple[str, Any]]) -> tuple[list[str], list[str], list[list[int]]]:
    return ([n for n, _ in bucket], [dtype_name(t.dtype) for _, t in bucket], [list(t.shape) for _, t in bucket])


def order_for_flattening(bucket: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Largest element size first, so every tensor's byte offset in the flattened bucket is
    a multiple of its element size (the receiver checks alignment)."""
    return sorted(bucket, key=lambda nt: -nt[1].element_size())


def _new_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               backend: str, timeout_s: float) -> Any:
    """A process group outside torch's default group, rendezvousing over TCP exactly like
    SGLang's `init_weights_update_group` (tcp:// store, keys prefixed by the group name)."""
    import inspect

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    url = f"tcp://{master_address}:{master_port}"
    store, rank, world_size = next(dist.rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = dist.PrefixStore(group_name, store)
    params = inspect.signature(c10d._new_process_group_helper).parameters
    kwargs: dict[str, Any] = {"group_name": group_name, "timeout": timeout}  # also a store key prefix
    kwargs["backend_options" if "backend_options" in params else "pg_options"] = None
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], dist.Backend(backend), store, **kwargs)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def init_update_group(master_address: str, master_port: int, world_size: int, *,
                      group_name: str = "weight_update_group", backend: str = "nccl",
                      timeout_s: float = 600.0) -> Any:
    """Trainer side (rank 0) of the weight broadcast group; blocks until every engine rank
    has joined (run it while the engines' /init_weights_update_group calls are pending)."""
    return _new_group(master_address, master_port, 0, world_size, group_name, backend, timeout_s)


def join_update_group(master_address: str, master_port: int, rank: int, world_size: int, *,
                      group_name: str = "weight_update_group", backend: str = "gloo",
                      timeout_s: float = 600.0) -> Any:
    """Engine side (used by the embedded server; SGLang has its own)."""
    return _new_group(master_address, master_port, rank, world_size, group_name, backend, timeout_s)


def _broadcast(t: Any, group: Any) -> None:
    import torch.distributed as dist

    dist.broadcast(t, group=group, group_src=0)


def broadcast_bucket(group: Any, bucket: Sequence[tuple[str, Any]], *, flattened: bool = False) -> None:
    """Trainer side: send one bucket from rank 0, in bucket order (one broadcast per tensor,
    or one uint8 broadcast of the concatenated bytes when `flattened`; pass the bucket
    through `order_for_flattening` first, and the same order to the engines)."""
    import torch

    if flattened:
        flat = torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for _, t in bucket])
        _broadcast(flat, group)
        return
    for _, t in bucket:
        _broadcast(t.detach().contiguous(), group)


def receive_bucket(group: Any, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]], *,
                   flattened: bool = False, device: str = "cpu") -> list[tuple[str, Any]]:
    """Engine side of `broadcast_bucket`."""
    import math

    import torch

    dts = [getattr(torch, d) for d in dtypes]
    if flattened:
        sizes = [math.prod(s) * torch.empty((), dtype=d).element_size() for s, d in zip(shapes, dts)]
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        _broadcast(flat, group)
        out, offset = [], 0
        for n, s, d, size in zip(names, shapes, dts, sizes):
            out.append((n, flat[offset:offset + size].view(d).view(*s).clone()))
            offset += size
        return out
    out = []
    for n, s, d in zip(names, shapes, dts):
        t = torch.empty(tuple(s), dtype=d, device=device)
        _broadcast(t, group)
        out.append((n, t))
    return out


def destroy_update_group(group: Any) -> None:
    import torch.distributed as dist

    try:
        dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001 (not registered with the default group's bookkeeping)
        pass


async def init_weights_update_group_all(engines: Sequence[Any], master_address: str, master_port: int, *,
                                        tp_sizes: Sequence[int] | None = None,
                                        group_name: str = "weight_update_group", backend: str = "nccl",
                                        timeout_s: float = 600.0) -> Any:
    """Trainer rank 0 + every engine's ranks in one group: engine i gets rank offset
    1 + sum(tp of engines before it). Returns the trainer's group handle."""
    tp_sizes = list(tp_sizes or [getattr(e, "tp_size", 1) for e in engines])
    world = 1 + sum(tp_sizes)
    offsets = [1 + sum(tp_sizes[:i]) for i in range(len(engines))]
    calls = [asyncio.ensure_future(e.init_weights_update_group(master_address, master_port, off, world,
                                                               group_name=group_name, backend=backend))
             for e, off in zip(engines, offsets)]
    group = await asyncio.to_thread(init_update_group, master_address, master_port, world, group_name=group_name,
                                    backend=backend, timeout_s=timeout_s)
    await asyncio.gather(*calls)
    return group


async def update_weights_distributed(engines: Sequence[Any], group: Any, named_tensors: Sequence[tuple[str, Any]], *,
                                     bucket_bytes: int | None, group_name: str = "weight_update_group",
                                     flattened: bool = False, weight_version: str | None = None) -> None:
    """Per bucket: every engine's /update_weights_from_distributed call goes out, then the
    trainer broadcasts the bucket, then the calls are awaited."""
    buckets = list(bucketize(named_tensors, bucket_bytes))
    for i, bucket in enumerate(buckets):
        if flattened:
            bucket = order_for_flattening(bucket)
        names, dtypes, shapes = bucket_metadata(bucket)
        last = i == len(buckets) - 1
        calls = [asyncio.ensure_future(e.update_weights_from_distributed(
            names, dtypes, shapes, group_name=group_name, flush_cache=last,
            weight_version=weight_version if last else None,
            load_format="flattened_bucket" if flattened else None)) for e in engines]
        try:
            await asyncio.to_thread(broadcast_bucket, group, bucket, flattened=flattened)
        finally:
            await asyncio.gather(*calls)


# =========================================================================== CLI
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vlmrl.rollout.sglang")
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("flags", help="write sglang_flags.txt from an SGLang wheel or package directory")
    f.add_argument("--source", required=True, help="sglang-*.whl (pip download --no-deps sglang) or site-packages dir")
    f.add_argument("--out", default=str(FLAGS_FILE))
    c = sub.add_parser("command", help="print the launch command of every engine for a config")
    c.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    if args.cmd == "flags":
        flags = scan_sglang_source(args.source)
        shown = ["python -m vlmrl.rollout.sglang flags", "--source", Path(args.source).name, "--out",
                 os.path.relpath(args.out, Path(__file__).resolve().parents[2])]
        cmd = " ".join(shown) + f"   (wheel from: pip download --no-deps sglang=={flags.version} -d DIR)"
        Path(args.out).write_text(format_flags(flags, cmd))
        print(f"wrote {args.out}: {len(flags.fields)} fields of sglang {flags.version}")
        return 0
    from ..config import compute_layout, load

    cfg = load(args.overrides)
    for slot in compute_layout(cfg).engines(cfg):
        a = server_args(cfg.rollout, cfg.hardware, cfg.model, port=engine_port(cfg.rollout.sglang.base_port, slot.index),
                        colocate=cfg.cluster.colocate)
        print(f"CUDA_VISIBLE_DEVICES={cuda_visible_devices(slot.devices)}", " ".join(server_command(a, python="python")))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""vlmrl's client, embedded server and launcher held against SGLang's HTTP contract
(vlmrl/rollout/sglang_contract.json, read from the SGLang wheel's source by
vlmrl.rollout.sglang_contract), and that scanner itself on a synthetic package.

No SGLang name is typed into this file: what vlmrl sends is captured from its own client
(`HTTPEngine._call` intercepted), what it serves is read from the embedded server's router,
and what it reads from a /generate reply is found in protocol.py's source with ast."""

from __future__ import annotations

import ast
import asyncio
import copy
import dataclasses
import inspect
import os
import re
import sys
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from vlmrl.rollout import protocol
from vlmrl.rollout.client import HTTPEngine
from vlmrl.rollout.protocol import MEMORY_TAGS, GenerateRequest, GenerateResult, SamplingParams, memory_tags
from vlmrl.rollout.sglang_contract import (
    CONTRACT_FILE,
    ContractScanError,
    format_contract,
    load_contract,
    parse_field,
    scan_contract,
)
from vlmrl.rollout.sglang_flags import load_flags

CONTRACT = load_contract()


def _request_struct(method: str, path: str) -> str | None:
    reqs = CONTRACT["endpoint_requests"]
    return reqs.get(path) or reqs.get(f"{method} {path}")


# --------------------------------------------------------------------------- the file itself
def test_contract_file_is_generated_and_matches_flags_version():
    text = CONTRACT_FILE.read_text()
    assert CONTRACT["generated_by"].startswith("python -m vlmrl.rollout.sglang contract --source sglang-")
    # written by format_contract (sorted keys): regenerating from the same wheel gives no diff
    body = {k: v for k, v in CONTRACT.items() if k != "generated_by"}
    assert format_contract(body, CONTRACT["generated_by"]) == text
    # the launcher's flag list and this contract come from one SGLang release
    assert load_flags().version == CONTRACT["sglang_version"] != "unknown"
    assert f"sglang=={CONTRACT['sglang_version']}" in CONTRACT["generated_by"]


@pytest.mark.skipif(not os.environ.get("VLMRL_SGLANG_WHEEL"), reason="set VLMRL_SGLANG_WHEEL=sglang-*.whl")
def test_contract_file_matches_a_fresh_scan_of_the_wheel():
    fresh = scan_contract(os.environ["VLMRL_SGLANG_WHEEL"])
    assert fresh == {k: v for k, v in CONTRACT.items() if k != "generated_by"}


# --------------------------------------------------------------------------- embedded server
def _embedded_routes() -> dict[str, set[str]]:
    from vlmrl.rollout.server import build_app

    app = build_app(object())  # handlers only close over the engine; none is called here
    routes: dict[str, set[str]] = defaultdict(set)
    for r in app.router.routes():
        routes[r.resource.canonical].add(r.method)
    return dict(routes)


def test_embedded_server_routes_are_sglang_routes():
    routes = _embedded_routes()
    assert routes
    for path, methods in sorted(routes.items()):
        assert path in CONTRACT["endpoints"], f"the embedded server serves {path}, SGLang {CONTRACT['sglang_version']} has no such route"
        theirs = set(CONTRACT["endpoints"][path])
        ours = set(methods)
        # the one documented superset: aiohttp's add_get also registers HEAD (allow_head=True);
        # SGLang's FastAPI GET routes do not answer HEAD
        if "GET" in ours and "HEAD" not in theirs:
            ours.discard("HEAD")
        assert ours == theirs, f"{path}: embedded server answers {sorted(methods)}, SGLang {sorted(theirs)}"


def _reply(res: GenerateResult) -> dict[str, Any]:
    return protocol.result_to_sglang(res, return_logprob=True, return_prompt_token_ids=True)


def test_embedded_reply_shape_is_sglang_shape():
    gen = CONTRACT["generate"]
    finish_keys = {v["type"]: set(v["keys"]) for v in gen["finish_reasons"].values()}
    for kind, matched in ((protocol.FINISH_STOP, 2), (protocol.FINISH_LENGTH, None)):
        out = _reply(GenerateResult(output_ids=[5, 2], text="x", logprobs=[-0.1, -0.2], finish_reason=kind,
                                    prompt_tokens=3, matched_stop=matched, prompt_ids=[1, 2, 3], rid="r",
                                    weight_version="v1"))
        assert set(out) <= set(gen["response_keys"]), set(out) - set(gen["response_keys"])
        meta = out["meta_info"]
        assert set(meta) <= set(gen["meta_info_keys"]), set(meta) - set(gen["meta_info_keys"])
        if CONTRACT["api_schema"]:
            assert set(meta) <= set(CONTRACT["api_schema"]["GenerateMetaInfo"]["fields"])
        assert set(meta["finish_reason"]) == finish_keys[kind], (kind, meta["finish_reason"])


# --------------------------------------------------------------------------- client
_IMG = "data:image/png;base64,iVBORw0KGgo="


def _all_sampling() -> SamplingParams:
    """A SamplingParams with every field off its default, so every key vlmrl can send is sent."""
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=4, stop=("\n",), stop_token_ids=(2,),
                        seed=7, ignore_eos=True)
    for f in dataclasses.fields(SamplingParams):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        assert getattr(sp, f.name) != default, f"set SamplingParams.{f.name} off its default in _all_sampling()"
    return sp


def _client_calls_plan() -> dict[str, list[tuple[tuple, dict]]]:
    import torch

    text_req = GenerateRequest(text="<image><image> how many?", images=(_IMG, _IMG), sampling=_all_sampling(), rid="r-1")
    ids_req = GenerateRequest(input_ids=(1, 2, 3), images=(_IMG,), sampling=SamplingParams(seed=3))
    return {
        "generate_one": [((text_req,), {}), ((ids_req,), {})],
        "generate": [(([text_req, ids_req],), {})],
        "update_weights_from_tensor": [(([("w", torch.ones(2, 3)), ("b", torch.zeros(3))],),
                                        {"bucket_bytes": 8, "weight_version": "v1"})],
        "update_weights_from_serialized": [((["payload"],), {"flush_cache": False, "weight_version": "v2"})],
        "init_weights_update_group": [(("10.0.0.1", 29500, 1, 2), {"group_name": "g", "backend": "nccl"})],
        "update_weights_from_distributed": [((["w"], ["float32"], [[2, 3]]), {"weight_version": "v3"}),
                                            ((["w"], ["float32"], [[2, 3]]), {"load_format": "flattened_bucket"})],
        "destroy_weights_update_group": [((), {}), (("g",), {})],
        "release_memory_occupation": [((), {}), ((None,), {}), ((list(MEMORY_TAGS),), {}), ((MEMORY_TAGS[:1],), {})],
        "resume_memory_occupation": [((), {}), ((None,), {}), ((list(MEMORY_TAGS),), {}), ((MEMORY_TAGS[:1],), {})],
        "wait_healthy": [((5.0,), {})],
    }


@pytest.fixture(scope="module")
def client_calls() -> list[tuple[str, str, Any]]:
    """(method, path, body) of every HTTP call HTTPEngine's public coroutines make."""
    calls: list[tuple[str, str, Any]] = []

    async def fake_call(method: str, path: str, body: Any = None, **_: Any) -> Any:
        calls.append((method, path, copy.deepcopy(body)))
        if path == "/generate":
            ids = [5, 2]
            return _reply(GenerateResult(output_ids=ids, text="x", logprobs=[-0.1] * len(ids),
                                         finish_reason=protocol.FINISH_LENGTH, prompt_tokens=3, rid=body.get("rid")))
        if method == "GET" and path != "/get_model_info":
            return ""
        return {} if path == "/get_model_info" else {"success": True, "message": "ok"}

    plan = _client_calls_plan()
    engine = HTTPEngine("http://sglang.invalid:1", tensor_format="torch_save")
    engine._call = fake_call  # type: ignore[method-assign]

    async def run() -> None:
        for name, fn in inspect.getmembers(HTTPEngine, inspect.iscoroutinefunction):
            if name.startswith("_"):
                continue
            if name not in plan:
                required = [p for p in list(inspect.signature(fn).parameters.values())[1:]
                            if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
                assert not required, f"HTTPEngine.{name} needs arguments: add it to _client_calls_plan()"
                plan[name] = [((), {})]
            for args, kwargs in plan[name]:
                await getattr(engine, name)(*args, **kwargs)

    asyncio.run(run())
    assert calls
    return calls


def test_client_paths_and_methods_exist_in_sglang(client_calls):
    for method, path, _ in client_calls:
        assert path in CONTRACT["endpoints"], f"HTTPEngine calls {method} {path}: not a route of SGLang {CONTRACT['sglang_version']}"
        assert method in CONTRACT["endpoints"][path], f"{path} answers {CONTRACT['endpoints'][path]}, HTTPEngine uses {method}"


def test_client_bodies_are_sglang_request_fields(client_calls):
    bad: list[str] = []
    for method, path, body in client_calls:
        if not body:
            continue
        struct = _request_struct(method, path)
        assert struct is not None, f"HTTPEngine sends a body to {path}, whose SGLang handler takes no request struct"
        fields = CONTRACT["request_structs"][struct]
        bad += [f"{path}: {key!r} is not a field of SGLang's {struct} (see request_structs in {CONTRACT_FILE.name})"
                for key in body if key not in fields]
        bad += [f"{path}: {struct}.{name} ({spec}) is required and missing" for name, spec in fields.items()
                if parse_field(spec)[1] and name not in body]
    assert not bad, "\n".join(sorted(set(bad)))


def test_generate_bodies_pass_sglang_json_schema_and_sampling_params(client_calls):
    bodies = [b for m, p, b in client_calls if p == "/generate"]
    assert bodies
    schema = CONTRACT["api_schema"]
    for body in bodies:
        sp = body["sampling_params"]
        unknown = set(sp) - set(CONTRACT["sampling_params"])
        assert not unknown, f"sampling_params keys {sorted(unknown)} are not SamplingParams fields"
        if schema:  # the JSON gate in front of /generate (SamplingParams rejects unknown keys: HTTP 400)
            assert set(body) <= set(schema["GenerateRequest"]["fields"]), set(body) - set(schema["GenerateRequest"]["fields"])
            assert set(sp) <= set(schema["SamplingParams"]["fields"]), set(sp) - set(schema["SamplingParams"]["fields"])
    # the checked bodies hold every sampling key vlmrl can send (every SamplingParams field set)
    assert _all_sampling().to_sglang() in [b["sampling_params"] for b in bodies]


def test_memory_tags_match_sglang(client_calls):
    mem = CONTRACT["memory"]
    assert set(MEMORY_TAGS) == set(mem["tags"].values())
    assert set(MEMORY_TAGS) == set(mem["all_types"])
    # no tags (null or []) means every tag, on release and on resume, in SGLang and in vlmrl
    for call, sites in mem["no_tags"].items():
        for site in sites:
            assert set(site["tags"]) == set(memory_tags(None)), f"{call} without tags covers {site['tags']} ({site['where']})"
    sent = [t for m, p, b in client_calls if p.endswith("_memory_occupation") and b for t in b.get("tags", [])]
    assert sent and set(sent) <= set(mem["tags"].values())


# --------------------------------------------------------------------------- what vlmrl reads from a reply
def _reply_reads() -> dict[tuple[str, ...], set[str]]:
    """Keys `result_from_sglang` reads, by where they sit in the reply: () the reply itself,
    ("meta_info",), ("meta_info", "finish_reason"), ... Found in protocol.py's source: a name
    bound to `x.get("k")` / `x["k"]` (or `... or {}`) of a tracked name is tracked one level
    deeper, and module functions it is passed to are followed."""
    tree = ast.parse(inspect.getsource(protocol))
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    reads: dict[tuple[str, ...], set[str]] = defaultdict(set)

    def key_of(node: ast.AST, env: dict[str, tuple[str, ...]]) -> tuple[tuple[str, ...], str] | None:
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and isinstance(node.func.value, ast.Name) and node.func.value.id in env and node.args
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            return env[node.func.value.id], node.args[0].value
        if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in env
                and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)):
            return env[node.value.id], node.slice.value
        return None

    def visit(fn: ast.FunctionDef, env: dict[str, tuple[str, ...]], seen: set[str]) -> None:
        env = dict(env)
        changed = True
        while changed:  # bind names to reply paths until nothing changes
            changed = False
            for node in ast.walk(fn):
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    value = node.value.values[0] if isinstance(node.value, ast.BoolOp) else node.value
                    if (hit := key_of(value, env)) is not None and env.get(node.targets[0].id) != hit[0] + (hit[1],):
                        env[node.targets[0].id] = hit[0] + (hit[1],)
                        changed = True
        for node in ast.walk(fn):
            if (hit := key_of(node, env)) is not None:
                reads[hit[0]].add(hit[1])
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in funcs
                    and node.func.id not in seen):
                callee = funcs[node.func.id]
                sub = {p.arg: env[a.id] for p, a in zip(callee.args.args, node.args)
                       if isinstance(a, ast.Name) and a.id in env}
                if sub:
                    visit(callee, sub, seen | {node.func.id})

    fn = funcs["result_from_sglang"]
    visit(fn, {fn.args.args[0].arg: ()}, {fn.name})
    return reads


def test_reply_keys_vlmrl_reads_are_sglang_keys():
    reads = _reply_reads()
    gen = CONTRACT["generate"]
    meta_path = ("meta_info",)
    finish_path = ("meta_info", "finish_reason")
    # the dataflow found each level (an empty level would make the checks below vacuous)
    assert reads[()] and reads[meta_path] and reads[finish_path], dict(reads)
    assert reads[()] <= set(gen["response_keys"]), reads[()] - set(gen["response_keys"])
    assert reads[meta_path] <= set(gen["meta_info_keys"]), reads[meta_path] - set(gen["meta_info_keys"])
    finish_keys = set().union(*(v["keys"] for v in gen["finish_reasons"].values()))
    assert reads[finish_path] <= finish_keys, reads[finish_path] - finish_keys
    if CONTRACT["api_schema"]:
        assert reads[meta_path] <= set(CONTRACT["api_schema"]["GenerateMetaInfo"]["fields"])
        assert reads[()] <= set(CONTRACT["api_schema"]["GenerateResponse"]["fields"])


# --------------------------------------------------------------------------- the scanner
_FAKE = {
    "_version.py": '__version__ = "9.9.9"\n',
    "srt/constants.py": """
        GPU_MEMORY_TYPE_KV_CACHE = "kv_cache"
        GPU_MEMORY_TYPE_WEIGHTS = "weights"
        GPU_MEMORY_ALL_TYPES = [GPU_MEMORY_TYPE_KV_CACHE, GPU_MEMORY_TYPE_WEIGHTS]
    """,
    "srt/entrypoints/http_server.py": """
        import os
        from typing import Annotated

        from fastapi import Body, FastAPI, Request

        from sglang.srt.entrypoints.loads import router as loads_router
        from sglang.srt.managers.io_struct import GenerateReqInput, ReleaseMemoryOccupationReqInput

        app = FastAPI()
        app.include_router(loads_router, prefix="/v1")

        @app.get("/health")
        @app.get("/health_generate")
        async def health_generate(request: Request):
            pass

        @app.api_route("/generate", methods=["POST", "PUT"])
        async def generate_request(obj: GenerateReqInput, request: Request):
            pass

        @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
        async def release(obj: Annotated[ReleaseMemoryOccupationReqInput, Body()], request: Request):
            pass

        @app.post(os.environ.get("MY_ROUTE", "/vertex_generate"))
        async def vertex(request: Request):
            pass

        if os.environ.get("DUMPER"):
            @app.websocket("/ws")
            async def ws(request: Request):
                pass

        root = os.environ.get("ROOT")

        @app.get(root)
        async def dynamic_root():
            pass
    """,
    "srt/entrypoints/loads.py": """
        from fastapi import APIRouter

        router = APIRouter()

        @router.get("/loads")
        async def loads():
            pass
    """,
    "srt/managers/io_struct.py": """
        from dataclasses import dataclass, field
        from typing import List, Optional

        import msgspec

        class BaseReq(msgspec.Struct, kw_only=True):
            rid: Optional[str] = None

        @dataclass
        class GenerateReqInput:
            rid: Optional[str] = field(default=None, kw_only=True)
            text: Optional[str] = None
            sampling_params: Optional[dict] = None
            labels: List[str] = field(default_factory=list)

        class ReleaseMemoryOccupationReqInput(BaseReq, kw_only=True):
            tags: Optional[List[str]] = None
            group: str

        class ReleaseMemoryOccupationReqOutput(BaseReq, kw_only=True):
            freed: int = 0
    """,
    "srt/sampling/sampling_params.py": """
        class SamplingParams:
            def __init__(self, max_new_tokens: int = 128, temperature: float = 1.0, sampling_seed=None):
                pass
    """,
    "srt/utils/versions.py": """
        def add_versions(info, spans):
            info["weight_version"] = spans[-1]
    """,
    "srt/managers/tokenizer_manager.py": """
        from sglang.srt.utils.versions import add_versions

        class TokenizerManager:
            def _handle_batch_output(self, recv_obj, rid, spans):
                meta_info = {"id": rid, "finish_reason": recv_obj.finish, "prompt_tokens": 3}
                meta_info["cached_tokens"] = 0
                meta_info.update({"completion_tokens": 1}, )
                meta_info.update(reasoning_tokens=0)
                self.add_logprobs(meta_info)
                add_versions(meta_info, spans)
                out_dict = {"text": "", "output_ids": [], "meta_info": meta_info}
                out_dict["prompt_token_ids"] = [1]
                return out_dict

            def add_logprobs(self, info):
                info["output_token_logprobs"] = []
    """,
    "srt/managers/schedule_batch.py": """
        class BaseFinishReason:
            def to_json(self):
                raise NotImplementedError()

        class FINISH_LENGTH(BaseFinishReason):
            def to_json(self):
                return {"type": "length", "length": self.length}

        class FINISH_ABORT(BaseFinishReason):
            def to_json(self):
                return {"type": "abort", "message": self.message}
    """,
    "srt/managers/scheduler.py": """
        from sglang.srt.constants import GPU_MEMORY_ALL_TYPES

        class Scheduler:
            def release_memory_occupation(self, recv_req):
                tags = recv_req.tags
                if tags is None or len(tags) == 0:
                    tags = GPU_MEMORY_ALL_TYPES

            def resume_memory_occupation(self, recv_req):
                tags = recv_req.tags
                if tags is None:
                    tags = ["weights"]
    """,
}

_API_TYPES = """
    import msgspec

    class SamplingParams(msgspec.Struct, kw_only=True, frozen=True):
        temperature: float = 1.0

    class GenerateRequest(msgspec.Struct, kw_only=True, frozen=True):
        text: str = ""

    def decode_SamplingParams(value):
        for key in value:
            if key != "temperature":
                raise _unknown_field(key, fields=("temperature",))

    def decode_GenerateRequest(value):
        return GenerateRequest(**value)
"""


def _fake_package(root: Path, files: dict[str, str | None]) -> Path:
    for rel, text in files.items():
        if text is None:
            continue
        p = root / "sglang" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return root


def _line(rel: str, needle: str) -> int:
    return next(i for i, line in enumerate(textwrap.dedent(_FAKE[rel]).splitlines(), 1) if needle in line)


def test_scanner_on_a_synthetic_package(tmp_path):
    c = scan_contract(_fake_package(tmp_path, _FAKE))
    assert c["sglang_version"] == "9.9.9"
    assert c["endpoints"] == {"/health": ["GET"], "/health_generate": ["GET"], "/generate": ["POST", "PUT"],
                              "/release_memory_occupation": ["GET", "POST"], "/vertex_generate": ["POST"],
                              "/ws": ["WEBSOCKET"], "/v1/loads": ["GET"]}
    http = "srt/entrypoints/http_server.py"
    assert c["unresolved_routes"] == [f"{http}:{_line(http, '@app.get(root)')} dynamic_root"]
    assert c["endpoint_handlers"]["/generate"] == [f"{http}:{_line(http, '/generate')} generate_request"]
    assert c["endpoint_requests"] == {"/generate": "GenerateReqInput",
                                      "/release_memory_occupation": "ReleaseMemoryOccupationReqInput"}
    assert c["request_structs"]["GenerateReqInput"] == {
        "rid": "Optional[str] = None", "text": "Optional[str] = None", "sampling_params": "Optional[dict] = None",
        "labels": "List[str] = list()"}
    release = c["request_structs"]["ReleaseMemoryOccupationReqInput"]
    assert release == {"rid": "Optional[str] = None", "tags": "Optional[List[str]] = None", "group": "str"}
    assert parse_field(release["group"]) == ("str", True, None)
    assert parse_field(release["tags"]) == ("Optional[List[str]]", False, "None")
    assert c["response_structs"] == {"ReleaseMemoryOccupationReqOutput": {"rid": "Optional[str] = None",
                                                                          "freed": "int = 0"}}
    assert c["sampling_params"] == {"max_new_tokens": "int = 128", "temperature": "float = 1.0",
                                    "sampling_seed": "Any = None"}
    gen = c["generate"]
    assert gen["meta_info_keys"] == sorted({"id", "finish_reason", "prompt_tokens", "cached_tokens",
                                            "completion_tokens", "reasoning_tokens", "output_token_logprobs",
                                            "weight_version"})
    assert "srt/utils/versions.py:add_versions" in gen["meta_info_sources"]
    assert gen["response_keys"] == ["meta_info", "output_ids", "prompt_token_ids", "text"]
    assert gen["finish_reasons"] == {"FINISH_LENGTH": {"keys": ["length", "type"], "type": "length"},
                                     "FINISH_ABORT": {"keys": ["message", "type"], "type": "abort"}}
    mem = c["memory"]
    assert mem["tags"] == {"GPU_MEMORY_TYPE_KV_CACHE": "kv_cache", "GPU_MEMORY_TYPE_WEIGHTS": "weights"}
    assert mem["all_types"] == ["kv_cache", "weights"]
    assert mem["no_tags"]["release_memory_occupation"] == [
        {"value": "GPU_MEMORY_ALL_TYPES", "tags": ["kv_cache", "weights"],
         "where": f"srt/managers/scheduler.py:{_line('srt/managers/scheduler.py', 'tags = GPU_MEMORY_ALL_TYPES')}"}]
    assert mem["no_tags"]["resume_memory_occupation"][0]["tags"] == ["weights"]
    assert c["api_schema"] is None  # no api/v1/api_types.py (SGLang before the JSON schema)

    c = scan_contract(_fake_package(tmp_path, {"api/v1/api_types.py": _API_TYPES}))
    assert c["api_schema"] == {
        "SamplingParams": {"fields": {"temperature": "float = 1.0"}, "unknown_keys": "rejected"},
        "GenerateRequest": {"fields": {"text": "str = ''"}, "unknown_keys": "ignored"}}


_BROKEN = {
    "no http server": ("srt/entrypoints/http_server.py", None, "http_server.py is not in the source"),
    "no FastAPI app": ("srt/entrypoints/http_server.py", "app = make_app()\n", "FastAPI"),
    "no /generate": ("srt/entrypoints/http_server.py", "from fastapi import FastAPI\napp = FastAPI()\n", "/generate"),
    "no meta_info": ("srt/managers/tokenizer_manager.py", "def f(out):\n    out['x'] = 1\n", "meta_info"),
    "no finish reasons": ("srt/managers/schedule_batch.py", "class A:\n    pass\n", "finish reasons"),
    "no memory tags": ("srt/constants.py", "X = 1\n", "GPU_MEMORY_TYPE_"),
    "no all types": ("srt/constants.py", 'GPU_MEMORY_TYPE_WEIGHTS = "weights"\n', "GPU_MEMORY_ALL_TYPES"),
    "no tags default": ("srt/managers/scheduler.py", "def release_memory_occupation(tags):\n    pass\n",
                        "tags is None"),
    "no sampling params": ("srt/sampling/sampling_params.py", "class Other:\n    pass\n", "SamplingParams"),
    "schema without structs": ("api/v1/api_types.py", "X = 1\n", "api schema"),
}


@pytest.mark.parametrize("case", sorted(_BROKEN))
def test_scanner_fails_loudly_when_a_piece_is_missing(tmp_path, case):
    rel, text, message = _BROKEN[case]
    files = {**_FAKE, rel: text}
    if text is None:
        files.pop(rel)
    with pytest.raises(ContractScanError, match=re.escape(message)):
        scan_contract(_fake_package(tmp_path, files))


def test_contract_command_writes_the_file_deterministically(tmp_path, capsys):
    from vlmrl.rollout.sglang import main

    src = _fake_package(tmp_path / "pkg", _FAKE)
    out = tmp_path / "contract.json"
    assert main(["contract", "--source", str(src), "--out", str(out)]) == 0
    first = out.read_text()
    assert main(["contract", "--source", str(src), "--out", str(out)]) == 0
    assert out.read_text() == first
    c = load_contract(out)
    assert c["generated_by"].startswith("python -m vlmrl.rollout.sglang contract --source pkg --out ")
    assert c["sglang_version"] == "9.9.9" and "/generate" in c["endpoints"]
    assert "7 endpoints of sglang 9.9.9" in capsys.readouterr().out


def _bucket() -> list[tuple[str, Any]]:
    import torch

    return [("model.layers.0.mlp.down_proj.weight", torch.arange(15, dtype=torch.bfloat16).view(3, 5)),
            ("model.layers.0.linear_attn.A_log", torch.linspace(-1, 1, 7, dtype=torch.float32)),
            ("model.norm.weight", torch.ones(3, dtype=torch.bfloat16)),
            ("model.layers.0.linear_attn.norm.weight", torch.full((2, 2), 0.5, dtype=torch.float32))]


def test_flattened_bucket_roundtrip_is_aligned_views():
    """The CUDA-IPC payload is one flat uint8 tensor per bucket (SGLang's flattened bucket):
    every tensor comes back equal, as a view into it, its byte offset a multiple of its
    element size (float32 tensors first), with SGLang's metadata fields."""
    import torch

    from vlmrl.rollout.weights import flatten_bucket, unflatten_bucket

    flat = flatten_bucket(_bucket())
    meta = flat["metadata"]
    assert [m.dtype for m in meta] == [torch.float32, torch.float32, torch.bfloat16, torch.bfloat16]
    assert all(m.start_idx % m.dtype.itemsize == 0 and m.end_idx - m.start_idx == m.numel for m in meta)
    assert flat["flattened_tensor"].dtype == torch.uint8 and flat["flattened_tensor"].numel() == meta[-1].end_idx
    back = dict(unflatten_bucket(flat))
    for name, t in _bucket():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t)
        assert back[name].untyped_storage().data_ptr() == flat["flattened_tensor"].untyped_storage().data_ptr()
    assert set(vars(meta[0])) == {"name", "shape", "dtype", "start_idx", "end_idx", "numel"}


def test_unflatten_reads_a_layout_it_did_not_write():
    """Another producer's flattened bucket may order its tensors differently and leave gaps
    between them: every tensor is read from its own byte range, and a range that does not
    fit its shape is refused."""
    import types

    import torch

    from vlmrl.rollout.weights import unflatten_bucket

    a = torch.arange(6, dtype=torch.bfloat16).view(2, 3)
    b = torch.linspace(-1, 1, 3, dtype=torch.float32)
    c = torch.ones(2, dtype=torch.bfloat16)
    flat = torch.zeros(40, dtype=torch.uint8)
    spans = [("a", a, 0), ("b", b, 16), ("c", c, 28)]  # gaps at 12-16 and 32-40; bf16, fp32, bf16
    meta = []
    for name, t, at in spans:
        size = t.numel() * t.element_size()
        flat[at:at + size] = t.reshape(-1).view(torch.uint8)
        meta.append(types.SimpleNamespace(name=name, shape=t.shape, dtype=t.dtype, start_idx=at,
                                          end_idx=at + size, numel=size))
    back = dict(unflatten_bucket({"flattened_tensor": flat, "metadata": meta}))
    for name, t, _ in spans:
        assert back[name].shape == t.shape and torch.equal(back[name], t)
    meta[1].end_idx -= 4
    with pytest.raises(RuntimeError):
        unflatten_bucket({"flattened_tensor": flat, "metadata": meta})


def test_copy_grouped_is_copy_per_pair():
    """The batched copy (weight sync's engine side) does what copy_ does pair by pair: strided
    sources, casts and mixed dtypes in one call."""
    import torch

    from vlmrl.rollout.weights import copy_grouped

    base = torch.randn(8, 6)
    src = [torch.randn(3, 4), base[:, :3], base.t(), torch.randn(5, dtype=torch.bfloat16), torch.randn(2, 2)]
    dst = [torch.zeros(3, 4), torch.zeros(8, 3), torch.zeros(6, 8), torch.zeros(5, dtype=torch.bfloat16),
           torch.zeros(2, 2, dtype=torch.bfloat16)]
    copy_grouped(dst, src)
    for d, s in zip(dst, src):
        assert torch.equal(d, s.to(d.dtype))
    with pytest.raises(ValueError):  # a pair missing
        copy_grouped(dst, src[:-1])


@pytest.mark.skipif(not os.environ.get("VLMRL_SGLANG_WHEEL"), reason="set VLMRL_SGLANG_WHEEL=sglang-*.whl")
def test_flattened_bucket_is_what_sglang_reconstructs():
    """SGLang's own FlattenedTensorBucket (read from the wheel) rebuilds vlmrl's flattened
    bucket from the metadata's attributes; its safe unpickler admits the metadata's class; its
    weight updater takes load_format 'flattened_bucket' from /update_weights_from_tensor."""
    import types
    import zipfile

    import torch

    from vlmrl.rollout.weights import flatten_bucket

    with zipfile.ZipFile(os.environ["VLMRL_SGLANG_WHEEL"]) as whl:
        bucket_src = whl.read("sglang/srt/weight_sync/tensor_bucket.py").decode()
        common = whl.read("sglang/srt/utils/common.py").decode()
        updater = whl.read("sglang/srt/model_executor/model_runner_components/weight_updater.py").decode()
    mod = types.ModuleType("sglang_tensor_bucket")
    sys.modules[mod.__name__] = mod  # dataclasses look their module up
    try:
        exec(compile(bucket_src, "tensor_bucket.py", "exec"), mod.__dict__)  # torch + dataclasses only
    finally:
        del sys.modules[mod.__name__]
    ours = flatten_bucket(_bucket())
    theirs = mod.FlattenedTensorBucket(flattened_tensor=ours["flattened_tensor"], metadata=[
        mod.FlattenedTensorMetadata(m.name, m.shape, m.dtype, m.start_idx, m.end_idx, m.numel) for m in ours["metadata"]])
    rebuilt = dict(theirs.reconstruct_tensors())
    for name, t in _bucket():
        assert torch.equal(rebuilt[name], t)
    assert '("types", "SimpleNamespace")' in common
    assert 'load_format == "flattened_bucket"' in updater and "meta.name" in updater


def test_flattened_payload_names_only_globals_sglang_unpickles(monkeypatch):
    """The pickle of a flattened bucket (host tensors here, shared through files; on a GPU the
    same structure with CUDA-IPC handles) refers to torch's rebuild functions, torch.Size,
    dtypes and types.SimpleNamespace only: globals SGLang's SafeUnpickler admits (checked
    against the wheel's allowlist when VLMRL_SGLANG_WHEEL is set) and that vlmrl's own
    restricted unpickler reads back into the same tensors."""
    import io
    import pickle
    import zipfile

    import torch
    import torch.multiprocessing as tmp

    from vlmrl.rollout.weights import flatten_bucket, load_ipc, serialize_ipc, unflatten_bucket

    old = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        data = serialize_ipc(flatten_bucket(_bucket()))
        seen: set[tuple[str, str]] = set()

        class Recorder(pickle.Unpickler):
            def find_class(self, module: str, name: str) -> Any:
                seen.add((module, name))
                return super().find_class(module, name)

        Recorder(io.BytesIO(data)).load()
        # a shared host storage is opened once: a second payload for vlmrl's reader
        back = dict(unflatten_bucket(load_ipc(serialize_ipc(flatten_bucket(_bucket())))))
    finally:
        tmp.set_sharing_strategy(old)
    for name, t in _bucket():
        assert torch.equal(back[name], t)
    assert ("types", "SimpleNamespace") in seen
    assert all(m == "torch" or m.startswith("torch.") or (m, n) == ("types", "SimpleNamespace") for m, n in seen), seen
    if os.environ.get("VLMRL_SGLANG_WHEEL"):
        with zipfile.ZipFile(os.environ["VLMRL_SGLANG_WHEEL"]) as whl:
            common = whl.read("sglang/srt/utils/common.py").decode()
        allowed = set(re.findall(r'\("([\w.]+)", "(\w+)"\)', common))
        assert seen <= allowed | {("torch.storage", "_load_from_bytes")}, seen - allowed

"""vlmrl's client, embedded server and launcher held against SGLang's HTTP contract of every
release vlmrl speaks (vlmrl/contracts/sglang-<version>.json, read from the SGLang
wheel's source by vlmrl.contracts.sglang_contract), and that scanner itself on a synthetic
package.

No SGLang name is typed into this file: what vlmrl sends is captured from its own client
(`HTTPEngine._call` intercepted), what it serves is read from the embedded server's router,
and what it reads from a /generate reply is found in protocol.py's source with ast."""

from __future__ import annotations

import ast
import asyncio
import copy
import dataclasses
import inspect
import json
import os
import re
import sys
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from vlmrl.contracts.sglang_contract import (
    ContractScanError,
    UnknownSGLangVersion,
    format_contract,
    known_versions,
    load_contract,
    parse_field,
    scan_contract,
    verify_sampling_params,
)
from vlmrl.contracts.sglang_contract import protocol as sglang_protocol
from vlmrl.contracts.sglang_flags import contract_file, flags_file, load_flags
from vlmrl.rollout import protocol
from vlmrl.rollout.client import HTTPEngine
from vlmrl.rollout.protocol import MEMORY_TAGS, GenerateRequest, GenerateResult, SamplingParams, memory_tags

VERSIONS = known_versions()
CONTRACT = load_contract()  # the newest


@pytest.fixture(params=VERSIONS)
def contract(request) -> dict[str, Any]:
    return load_contract(request.param)


def _request_struct(contract: dict[str, Any], method: str, path: str) -> str | None:
    reqs = contract["endpoint_requests"]
    return reqs.get(path) or reqs.get(f"{method} {path}")


# --------------------------------------------------------------------------- the files themselves
def test_contracts_are_known_by_version_and_unknown_ones_are_refused():
    assert len(VERSIONS) >= 2 and list(VERSIONS) == sorted(VERSIONS, key=lambda v: tuple(map(int, v.split("."))))
    assert CONTRACT["sglang_version"] == VERSIONS[-1] == sglang_protocol().version == load_flags().version
    for v in VERSIONS:
        assert contract_file(v).is_file() and flags_file(v).is_file()
    with pytest.raises(UnknownSGLangVersion) as e:
        load_contract("0.0.1")
    message = str(e.value)
    assert "0.0.1" in message and all(v in message for v in VERSIONS)
    assert "make sglang-contract SGLANG_VERSION=0.0.1" in message
    for fn in (sglang_protocol, load_flags):
        with pytest.raises(ValueError, match="make sglang-contract SGLANG_VERSION=0.0.1"):
            fn("0.0.1")


def test_contract_file_is_generated_and_matches_flags_version(contract):
    version = contract["sglang_version"]
    text = contract_file(version).read_text()
    assert contract["generated_by"].startswith("python -m vlmrl.rollout.sglang contract --source sglang-")
    assert f"--out vlmrl/contracts/sglang-{version}.json" in contract["generated_by"]
    # written by format_contract (sorted keys): regenerating from the same wheel gives no diff
    body = {k: v for k, v in contract.items() if k != "generated_by"}
    assert format_contract(body, contract["generated_by"]) == text
    # the launcher's flag list and this contract come from one SGLang release
    assert load_flags(version).version == version != "unknown"
    assert f"sglang=={version}" in contract["generated_by"]


@pytest.mark.skipif(not os.environ.get("VLMRL_SGLANG_WHEEL"), reason="set VLMRL_SGLANG_WHEEL=sglang-*.whl")
def test_contract_file_matches_a_fresh_scan_of_the_wheel():
    fresh = scan_contract(os.environ["VLMRL_SGLANG_WHEEL"])
    committed = load_contract(fresh["sglang_version"])
    assert fresh == {k: v for k, v in committed.items() if k != "generated_by"}


def test_protocol_is_read_from_each_contract(contract):
    p = sglang_protocol(contract["sglang_version"])
    endpoints = contract["endpoints"]
    assert p.version == contract["sglang_version"]
    assert p.weight_update_session == ("/begin_weight_update" in endpoints and "/end_weight_update" in endpoints)
    assert p.loads == ("/v1/loads" in endpoints) and p.server_info == ("/server_info" in endpoints)
    assert p.session_required <= set(endpoints) and (not p.session_required or p.weight_update_session)
    assert p.release_requires_idle == contract["memory"]["release_requires_idle"]["message"]
    assert {"num_running_reqs", "num_waiting_reqs"} <= set(p.loads_core_keys)
    assert p.server_info_version and "version" in p.server_info_keys and "loads" in p.loads_reply_keys
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.version = "x"  # type: ignore[misc]


def test_the_two_releases_differ_as_measured_on_the_gpu():
    """DESIGN.md: 0.5.23 refuses /update_weights_from_tensor outside /begin_weight_update ...
    /end_weight_update; 0.5.17 has neither endpoint."""
    old, new = sglang_protocol("0.5.17"), sglang_protocol("0.5.23")
    assert not old.weight_update_session and not old.session_required
    assert new.weight_update_session and "/update_weights_from_tensor" in new.session_required
    assert load_contract("0.5.17")["api_schema"] is None and load_contract("0.5.23")["api_schema"] is not None


def test_model_configs_record_what_broke_the_tiny_models(contract):
    """SGLang's Qwen3.5 vision config defaults deepstack_visual_indexes to [8, 16, 24] (every
    image request of a tiny model failed on it) and its text config reads
    full_attention_interval with no default (a checkpoint must carry it)."""
    for model_type in ("qwen3_5", "qwen3_5_moe"):
        cfg = contract["model_configs"][model_type]
        assert cfg["vision"]["defaults"]["deepstack_visual_indexes"] == [8, 16, 24]
        assert "full_attention_interval" in cfg["text"]["required"]
        assert "full_attention_interval" not in cfg["text"]["defaults"]
        assert cfg["text"]["defaults"]["num_hidden_layers"] == 48 and cfg["vision"]["required"] == []
        assert "PretrainedConfig" in cfg["text"]["bases_outside"] and len(cfg["text"]["chain"]) >= 2


def test_sampling_verify_rules_hold_sglang_checks(contract):
    verify = contract["sampling_params"]["verify"]
    by_param = defaultdict(list)
    for rule in verify["rules"]:
        for name in rule["parameters"]:
            by_param[name].append(rule)
        assert rule["message"] and rule["where"].startswith("srt/sampling/sampling_params.py:")
    for name in ("temperature", "top_p", "top_k", "min_p", "max_new_tokens", "min_new_tokens", "logit_bias"):
        assert by_param[name], name
    # before verify, __post_init__ turns None into defaults and temperature 0 into greedy
    v = contract["sglang_version"]
    assert verify_sampling_params({"temperature": 0, "top_k": -1, "max_new_tokens": None}, version=v) is None
    assert verify_sampling_params({"max_new_tokens": -1}, version=v) == "max_new_tokens must be at least 0, got -1."
    assert verify_sampling_params({"top_k": 0}, version=v).startswith("top_k must be")
    # a rule reading the vocabulary size is skipped without one
    assert verify_sampling_params({"logit_bias": {"99": 1.0}}, version=v) is None
    assert "logit_bias" in verify_sampling_params({"logit_bias": {"99": 1.0}}, version=v, vocab_size=10)
    # a value of the wrong type is refused, naming the parameter
    assert "temperature" in verify_sampling_params({"temperature": "hot"}, version=v)


# --------------------------------------------------------------------------- embedded server
def _embedded_routes(version: str) -> dict[str, set[str]]:
    from vlmrl.rollout.server import build_app

    app = build_app(object(), sglang_version=version)  # handlers only close over the engine; none is called here
    routes: dict[str, set[str]] = defaultdict(set)
    for r in app.router.routes():
        routes[r.resource.canonical].add(r.method)
    return dict(routes)


def test_vlmrls_loader_in_the_server_holds_to_each_release(contract):
    """vlmrl's loader (vlmrl/rollout/sglang_plugin) against what each release's source does:
    the weight updater calls a loader named in custom_weight_loaders with the model and the
    pairs; the fused-MoE parameters it copies into exist under those names; Qwen3.5's loader
    maps the names the sync sends onto them (its fallback); and every attribute the release's
    UnquantizedFusedMoEMethod sets is one the loader has classified (a new one may change the
    experts' layout: classify it in LAYOUT_FLAGS or OTHER_ATTRIBUTES after reading its source)."""
    from vlmrl.rollout.sglang_plugin import vlmrl_sglang_loader as loader

    wl = contract["weight_loader"]
    assert wl["custom_loader"]["call"] == "custom_loader(self.get_model(), named_tensors)"
    moe = wl["unquantized_moe"]
    assert set(loader.ENGINE_PARAM.values()) <= set(moe["parameters"])
    mapping = {tuple(p) for p in wl["qwen3_5_fused_experts"]}
    assert {(f"experts.{param}", f"experts.{name}") for name, param in loader.ENGINE_PARAM.items()} <= mapping
    unknown = set(moe["init_attributes"]) - set(loader.LAYOUT_FLAGS) - set(loader.OTHER_ATTRIBUTES)
    assert not unknown, f"sglang {contract['sglang_version']}: UnquantizedFusedMoEMethod sets {sorted(unknown)}"


def test_embedded_server_routes_are_sglang_routes(contract):
    version = contract["sglang_version"]
    routes = _embedded_routes(version)
    assert routes
    for path, methods in sorted(routes.items()):
        assert path in contract["endpoints"], f"the embedded server serves {path}, SGLang {version} has no such route"
        theirs = set(contract["endpoints"][path])
        ours = set(methods)
        # the one documented superset: aiohttp's add_get also registers HEAD (allow_head=True);
        # SGLang's FastAPI GET routes do not answer HEAD
        if "GET" in ours and "HEAD" not in theirs:
            ours.discard("HEAD")
        assert ours == theirs, f"{path}: embedded server answers {sorted(methods)}, SGLang {sorted(theirs)}"
    # what the release offers and vlmrl uses is served: sessions, loads, server info
    p = sglang_protocol(version)
    wanted = {"/server_info", "/v1/loads"} | (set(("/begin_weight_update", "/end_weight_update"))
                                               if p.weight_update_session else set())
    assert wanted <= set(routes), wanted - set(routes)
    if not p.weight_update_session:
        assert "/begin_weight_update" not in routes and "/end_weight_update" not in routes


def test_embedded_server_refuses_a_release_it_has_no_contract_for():
    from vlmrl.rollout.server import build_app

    with pytest.raises(UnknownSGLangVersion, match="0.0.1"):
        build_app(object(), sglang_version="0.0.1")


def _reply(res: GenerateResult) -> dict[str, Any]:
    return protocol.result_to_sglang(res, return_logprob=True, return_prompt_token_ids=True)


def test_embedded_reply_shape_is_sglang_shape(contract):
    gen = contract["generate"]
    finish_keys = {v["type"]: set(v["keys"]) for v in gen["finish_reasons"].values()}
    for kind, matched in ((protocol.FINISH_STOP, 2), (protocol.FINISH_LENGTH, None)):
        out = _reply(GenerateResult(output_ids=[5, 2], text="x", logprobs=[-0.1, -0.2], finish_reason=kind,
                                    prompt_tokens=3, matched_stop=matched, prompt_ids=[1, 2, 3], rid="r",
                                    weight_version="v1"))
        assert set(out) <= set(gen["response_keys"]), set(out) - set(gen["response_keys"])
        meta = out["meta_info"]
        assert set(meta) <= set(gen["meta_info_keys"]), set(meta) - set(gen["meta_info_keys"])
        if contract["api_schema"]:
            assert set(meta) <= set(contract["api_schema"]["GenerateMetaInfo"]["fields"])
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
        "abort_requests": [((["r-1", "r-2"],), {})],
    }


@pytest.fixture(scope="module", params=VERSIONS)
def client_calls(request) -> tuple[dict[str, Any], list[tuple[str, str, Any]]]:
    """(the contract, (method, path, body) of every HTTP call HTTPEngine's public coroutines
    make) against a server of each release (its /server_info reports that version)."""
    contract = load_contract(request.param)
    calls: list[tuple[str, str, Any]] = []

    async def fake_call(method: str, path: str, body: Any = None, **_: Any) -> Any:
        calls.append((method, path.split("?")[0], copy.deepcopy(body)))
        if path == "/generate":
            ids = [5, 2]
            return _reply(GenerateResult(output_ids=ids, text="x", logprobs=[-0.1] * len(ids),
                                         finish_reason=protocol.FINISH_LENGTH, prompt_tokens=3, rid=body.get("rid")))
        if path == "/server_info":
            return {"version": contract["sglang_version"]}
        if path.startswith("/v1/loads"):
            return {"loads": [{"num_running_reqs": 0, "num_waiting_reqs": 0}]}
        if method == "GET" and path not in ("/get_model_info", "/model_info"):
            return ""
        return {} if path in ("/get_model_info", "/model_info") else {"success": True, "message": "ok"}

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
    return contract, calls


def test_client_paths_and_methods_exist_in_sglang(client_calls):
    contract, calls = client_calls
    version = contract["sglang_version"]
    for method, path, _ in calls:
        assert path in contract["endpoints"], f"HTTPEngine calls {method} {path}: not a route of SGLang {version}"
        assert method in contract["endpoints"][path], f"{path} answers {contract['endpoints'][path]}, HTTPEngine uses {method}"
    # a release with weight-update sessions gets one around the tensor updates
    paths = [p for _, p, _ in calls]
    if sglang_protocol(version).weight_update_session:
        first = paths.index("/update_weights_from_tensor")
        assert "/begin_weight_update" in paths[:first] and "/end_weight_update" in paths[first:]


def test_client_bodies_are_sglang_request_fields(client_calls):
    contract, calls = client_calls
    bad: list[str] = []
    for method, path, body in calls:
        if not body:
            continue
        struct = _request_struct(contract, method, path)
        assert struct is not None, f"HTTPEngine sends a body to {path}, whose SGLang handler takes no request struct"
        fields = contract["request_structs"][struct]
        where = contract_file(contract["sglang_version"]).name
        bad += [f"{path}: {key!r} is not a field of SGLang's {struct} (see request_structs in {where})"
                for key in body if key not in fields]
        bad += [f"{path}: {struct}.{name} ({spec}) is required and missing" for name, spec in fields.items()
                if parse_field(spec)[1] and name not in body]
    assert not bad, "\n".join(sorted(set(bad)))


def test_generate_bodies_pass_sglang_json_schema_and_sampling_params(client_calls):
    contract, calls = client_calls
    bodies = [b for m, p, b in calls if p == "/generate"]
    assert bodies
    schema = contract["api_schema"]
    for body in bodies:
        sp = body["sampling_params"]
        unknown = set(sp) - set(contract["sampling_params"]["fields"])
        assert not unknown, f"sampling_params keys {sorted(unknown)} are not SamplingParams fields"
        if schema:  # the JSON gate in front of /generate (SamplingParams rejects unknown keys: HTTP 400)
            assert set(body) <= set(schema["GenerateRequest"]["fields"]), set(body) - set(schema["GenerateRequest"]["fields"])
            assert set(sp) <= set(schema["SamplingParams"]["fields"]), set(sp) - set(schema["SamplingParams"]["fields"])
        # and every check of SamplingParams.verify passes
        refused = verify_sampling_params(sp, version=contract["sglang_version"], vocab_size=1 << 20)
        assert refused is None, (sp, refused)
    # the checked bodies hold every sampling key vlmrl can send (every SamplingParams field set)
    assert _all_sampling().to_sglang() in [b["sampling_params"] for b in bodies]


def test_memory_tags_match_sglang(client_calls):
    contract, calls = client_calls
    mem = contract["memory"]
    assert set(MEMORY_TAGS) == set(mem["tags"].values())
    assert set(MEMORY_TAGS) == set(mem["all_types"])
    # no tags (null or []) means every tag, on release and on resume, in SGLang and in vlmrl
    for call, sites in mem["no_tags"].items():
        for site in sites:
            assert set(site["tags"]) == set(memory_tags(None)), f"{call} without tags covers {site['tags']} ({site['where']})"
    sent = [t for m, p, b in calls if p.endswith("_memory_occupation") and b for t in b.get("tags", [])]
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


ON_REQUEST_META = {"routed_experts"}  # `return_routed_experts`


def test_reply_keys_vlmrl_reads_are_sglang_keys(contract):
    reads = _reply_reads()
    gen = contract["generate"]
    meta_path = ("meta_info",)
    finish_path = ("meta_info", "finish_reason")
    # the dataflow found each level (an empty level would make the checks below vacuous)
    assert reads[()] and reads[meta_path] and reads[finish_path], dict(reads)
    assert reads[()] <= set(gen["response_keys"]), reads[()] - set(gen["response_keys"])
    assert reads[meta_path] <= set(gen["meta_info_keys"]), reads[meta_path] - set(gen["meta_info_keys"])
    finish_keys = set().union(*(v["keys"] for v in gen["finish_reasons"].values()))
    assert reads[finish_path] <= finish_keys, reads[finish_path] - finish_keys
    if contract["api_schema"]:
        meta_schema = contract["api_schema"]["GenerateMetaInfo"]
        # keys present only when a request asks for them: written by the tokenizer manager
        # (meta_info_keys, checked above), left out of the documented schema, which lets
        # unknown keys through
        undocumented = reads[meta_path] - set(meta_schema["fields"])
        assert undocumented <= ON_REQUEST_META and meta_schema["unknown_keys"] == "ignored", undocumented
        assert reads[()] <= set(contract["api_schema"]["GenerateResponse"]["fields"])


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

        @app.get("/server_info")
        async def server_info():
            state = {"internal_states": []}
            return to_builtins({**state, "version": "9.9.9"})

        @app.post("/begin_weight_update")
        async def begin_weight_update():
            pass

        @app.post("/end_weight_update")
        async def end_weight_update():
            pass

        @app.post("/update_weights_from_tensor")
        async def update_weights_from_tensor():
            pass
    """,
    "srt/entrypoints/loads.py": """
        from fastapi import APIRouter

        router = APIRouter()

        @router.get("/loads")
        async def loads():
            rows = []
            return {"version": "9.9.9", "loads": rows}
    """,
    "srt/managers/load_snapshot.py": """
        from typing import ClassVar, Optional

        import msgspec

        _SECTION_FIELDS = frozenset({"memory"})

        class LoadSnapshot(msgspec.Struct):
            dp_rank: int = 0
            num_running_reqs: int = 0
            num_waiting_reqs: int = 0
            memory: Optional[dict] = None
            KIND: ClassVar[str] = "load"
            VALID = frozenset({"core", "memory"})
    """,
    "srt/managers/updater.py": """
        class Updater:
            def begin_weight_update(self, req):
                if self._open is not None:
                    return False
                self._open = req

            def end_weight_update(self, req):
                self._open = None

            def update_weights_from_tensor(self, req):
                if self._open is None:
                    return False

            def update_weights_from_distributed(self, req):
                if self._open is None:
                    return False

            def update_weights_from_disk(self, req):
                return True
    """,
    "srt/model_executor/weight_updater.py": """
        class WeightUpdater:
            def update_weights_from_tensor(self, named_tensors, load_format=None):
                if load_format == "direct":
                    pass
                elif load_format in self.custom_weight_loaders:
                    custom_loader = dynamic_import(load_format)
                    custom_loader(self.get_model(), named_tensors)
    """,
    "srt/layers/quantization/unquant.py": """
        class UnquantizedFusedMoEMethod:
            def __init__(self, use_triton_kernels=False):
                self.use_triton_kernels = use_triton_kernels
                self.with_bias: bool = False

            def create_weights(self, layer, num_experts):
                layer.register_parameter("w13_weight", w13)
                layer.register_parameter(name, other)
    """,
    "srt/models/qwen3_5.py": """
        class Qwen3_5MoeForCausalLM:
            def load_weights(self, weights):
                fused_expert_params_mapping = [
                    ("experts.w13_weight", "experts.gate_up_proj", 0, "w1"),
                    (f"experts.{n}", "experts.down_proj", 0, "w2"),
                ]
    """,
    "srt/configs/base.py": """
        from transformers import PretrainedConfig

        class BaseText(PretrainedConfig):
            def __init__(self, layers=4, hidden=8, **kwargs):
                super().__init__(**kwargs)
                self.layers = layers
                self.hidden = hidden

            @property
            def kinds(self):
                return [self.interval for _ in range(self.layers)]

            def helper(self):
                return self.kinds + self.other()

            def other(self):
                return [self.hidden]
    """,
    "srt/configs/fam.py": """
        from transformers import PretrainedConfig

        from sglang.srt.configs.base import BaseText

        ACT = "gelu"

        class FamVision(PretrainedConfig):
            model_type = "fam"

            def __init__(self, depth=2, indexes=[1, 2], act=ACT, **kwargs):
                super().__init__(**kwargs)
                self.depth = depth
                self.indexes = indexes

        class FamText(BaseText):
            model_type = "fam_text"

            def __init__(self, hidden=16, **kwargs):
                rope = kwargs.pop("rope_parameters", None)
                super().__init__(hidden=hidden, **kwargs)
                self.rope = rope

        class FamConfig(PretrainedConfig):
            model_type = "qwen3_5"
            sub_configs = {"vision_config": FamVision, "text_config": FamText}

        class FamMoeConfig(FamConfig):
            model_type = "qwen3_5_moe"
            sub_configs = {"vision_config": FamVision, "text_config": FamText}
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
        import math

        _EPS = 1e-6
        TOP = 1 << 30
        LIMIT: int = 10

        class SamplingParams:
            def __init__(self, max_new_tokens: int = 128, temperature: float = 1.0, sampling_seed=None,
                         top_k: int = TOP, logit_bias=None, regex=None, ebnf=None, is_normalized=False):
                pass

            def __post_init__(self):
                \"\"\"Defaults and greedy.\"\"\"
                if self.is_normalized:
                    return
                self.temperature = self.temperature if self.temperature is not None else 1.0
                if 0 <= self.temperature < _EPS:
                    self.temperature = 1.0
                    self.top_k = 1
                elif self.top_k == -1:
                    self.top_k = TOP
                helper(self)

            def verify(self, vocab_size):
                if not math.isfinite(self.temperature) or self.temperature < 0.0:
                    raise ValueError(
                        "temperature must be finite, "
                        f"got {self.temperature!r}."
                    )
                if self.max_new_tokens is not None:
                    if self.max_new_tokens < 0:
                        raise ValueError(f"max_new_tokens < 0: {self.max_new_tokens}")
                    elif self.max_new_tokens > LIMIT:
                        raise ValueError("at most {LIMIT} tokens")
                if self.logit_bias is not None:
                    for token_id in self.logit_bias:
                        if not 0 <= int(token_id) < vocab_size:
                            raise ValueError(f"bad key {token_id}, vocabulary {vocab_size - 1:d}")
                check_more(self)
                grammars = [self.regex, self.ebnf]
                if sum(x is not None for x in grammars) > 1:
                    raise ValueError("one grammar only")
                if self.top_k == 0:
                    raise TypeError("not a ValueError: not recorded")
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
                assert self.idle(), "release only when idle."
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
                              "/ws": ["WEBSOCKET"], "/v1/loads": ["GET"], "/server_info": ["GET"],
                              "/begin_weight_update": ["POST"], "/end_weight_update": ["POST"],
                              "/update_weights_from_tensor": ["POST"]}
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
    sp = "srt/sampling/sampling_params.py"
    assert c["sampling_params"]["fields"] == {
        "max_new_tokens": "int = 128", "temperature": "float = 1.0", "sampling_seed": "Any = None",
        "top_k": "int = TOP", "logit_bias": "Any = None", "regex": "Any = None", "ebnf": "Any = None",
        "is_normalized": "Any = False"}
    verify = c["sampling_params"]["verify"]
    assert verify["arguments"] == ["vocab_size"] and verify["where"] == f"{sp}:SamplingParams.verify"
    rules = verify["rules"]
    assert [r["condition"] for r in rules] == [  # ValueErrors only, in source order
        "not math.isfinite(self.temperature) or self.temperature < 0.0", "self.max_new_tokens < 0",
        "self.max_new_tokens > LIMIT", "not 0 <= int(token_id) < vocab_size", "sum((x is not None for x in grammars)) > 1"]
    assert rules[0] == {"condition": rules[0]["condition"], "guards": [], "locals": [], "parameters": ["temperature"],
                        "message": "temperature must be finite, got {self.temperature!r}.",
                        "where": f"{sp}:{_line(sp, 'raise ValueError(') }"}
    assert rules[1]["guards"] == [{"if": "self.max_new_tokens is not None"}]
    assert rules[2]["guards"] == [{"if": "self.max_new_tokens is not None"}, {"if": "not (self.max_new_tokens < 0)"}]
    assert rules[2]["message"] == "at most {{LIMIT}} tokens"  # a plain string: its braces are text
    assert rules[3]["guards"] == [{"if": "self.logit_bias is not None"}, {"for": "token_id", "in": "self.logit_bias"}]
    assert rules[3]["message"] == "bad key {token_id}, vocabulary {vocab_size - 1:d}"
    assert rules[4]["locals"] == [["grammars", "[self.regex, self.ebnf]"]]
    assert rules[4]["parameters"] == ["ebnf", "regex"]
    assert verify["unfollowed_calls"] == [f"{sp}:{_line(sp, 'check_more(self)')} check_more(self)"]
    assert verify["constants"] == [["_EPS", "1e-06"], ["TOP", "1 << 30"], ["LIMIT", "10"]]
    post = verify["post_init"]
    assert post["skipped"] == [f"{sp}:{_line(sp, 'helper(self)')} helper(self)"]
    assert post["steps"][0] == {"if": "self.is_normalized", "then": [{"return": True}], "else": []}
    assert post["steps"][2]["else"] == [{"if": "self.top_k == -1", "then": [{"set": "self.top_k", "value": "TOP"}],
                                         "else": []}]
    # replayed: defaults, __post_init__, then the rules in order, with SGLang's messages
    from vlmrl.contracts.sglang_contract import _Verifier

    def check(params: dict[str, Any], vocab_size: int | None = 5) -> str | None:
        return _Verifier(c["sampling_params"]).check({"max_new_tokens": 4, **params}, {"vocab_size": vocab_size})

    assert check({}) is None
    assert check({"max_new_tokens": 11}) == "at most {LIMIT} tokens"  # the default (128) is over LIMIT too
    assert check({"temperature": 0, "top_k": 0}) is None  # greedy: top_k 1
    assert check({"temperature": -1.5}) == "temperature must be finite, got -1.5."
    assert check({"logit_bias": {"1": 0.5, "7": 1}}) == "bad key 7, vocabulary 4"
    assert check({"logit_bias": {"7": 1}}, vocab_size=None) is None
    assert check({"regex": "a", "ebnf": "b"}) == "one grammar only"
    assert check({"is_normalized": True, "temperature": None}).startswith(
        "invalid sampling parameters ['temperature']: TypeError")  # __post_init__ returned early
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
    sched = "srt/managers/scheduler.py"
    assert mem["release_requires_idle"] == {"condition": "self.idle()", "message": "release only when idle.",
                                            "where": f"{sched}:{_line(sched, 'assert self.idle()')}"}
    assert c["loads"] == {"endpoint": True, "core_keys": ["dp_rank", "num_running_reqs", "num_waiting_reqs"],
                          "sections": ["memory"], "reply_keys": ["loads", "version"], "server_info": True,
                          "server_info_keys": ["version"], "server_info_version": True}  # not **state's
    assert c["weight_update"] == {"session": True, "session_required": ["/update_weights_from_tensor"],
                                  "where": "srt/managers/updater.py:Updater"}
    assert c["weight_loader"] == {
        "custom_loader": {"where": "srt/model_executor/weight_updater.py:update_weights_from_tensor",
                          "call": "custom_loader(self.get_model(), named_tensors)"},
        "unquantized_moe": {"where": "srt/layers/quantization/unquant.py:UnquantizedFusedMoEMethod",
                            "init_attributes": ["use_triton_kernels", "with_bias"], "parameters": ["w13_weight"]},
        "qwen3_5_fused_experts": [["experts.w13_weight", "experts.gate_up_proj"]]}  # f-strings are not read
    text = {"class": "FamText", "chain": ["srt/configs/fam.py:FamText", "srt/configs/base.py:BaseText"],
            "bases_outside": ["PretrainedConfig"], "defaults": {"layers": 4, "hidden": 16, "rope_parameters": None},
            "required": ["interval"]}
    vision = {"class": "FamVision", "chain": ["srt/configs/fam.py:FamVision"], "bases_outside": ["PretrainedConfig"],
              "defaults": {"depth": 2, "indexes": [1, 2], "act": {"source": "ACT"}}, "required": []}
    assert c["model_configs"] == {
        "qwen3_5": {"class": "FamConfig", "where": "srt/configs/fam.py:FamConfig", "text": text, "vision": vision},
        "qwen3_5_moe": {"class": "FamMoeConfig", "where": "srt/configs/fam.py:FamMoeConfig", "text": text,
                        "vision": vision}}
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
    "no verify": ("srt/sampling/sampling_params.py", "class SamplingParams:\n    x: int = 1\n", "no method `verify`"),
    "verify raises nothing": ("srt/sampling/sampling_params.py",
                              "class SamplingParams:\n    x: int = 1\n    def verify(self):\n        pass\n",
                              "raises no ValueError"),
    "rule outside the language": ("srt/sampling/sampling_params.py",
                                  "class SamplingParams:\n    x: int = 1\n    def verify(self):\n"
                                  "        if self.x.bit_length() > 3:\n            raise ValueError('x')\n",
                                  "evaluator does not know"),
    "message not a string": ("srt/sampling/sampling_params.py",
                             "class SamplingParams:\n    x: int = 1\n    def verify(self):\n"
                             "        if self.x:\n            raise ValueError(MESSAGE)\n", "is not a string"),
    "no LoadSnapshot": ("srt/managers/load_snapshot.py", "X = 1\n", "no class LoadSnapshot"),
    "no section fields": ("srt/managers/load_snapshot.py",
                          "class LoadSnapshot:\n    num_running_reqs: int = 0\n    num_waiting_reqs: int = 0\n",
                          "_SECTION_FIELDS"),
    "no running count": ("srt/managers/load_snapshot.py",
                         "_SECTION_FIELDS = frozenset()\nclass LoadSnapshot:\n    dp_rank: int = 0\n",
                         "num_running_reqs"),
    "loads reply without loads": ("srt/entrypoints/loads.py",
                                  "from fastapi import APIRouter\nrouter = APIRouter()\n"
                                  "@router.get('/loads')\nasync def loads():\n    return None\n",
                                  "returns no dict literal with 'loads'"),
    "no idle assertion": ("srt/managers/scheduler.py",
                          "def release_memory_occupation(tags):\n    if tags is None:\n        tags = []\n"
                          "def resume_memory_occupation(tags):\n    if tags is None:\n        tags = []\n",
                          "requires before a release"),
    "session without its class": ("srt/managers/updater.py", None, "session attribute"),
    "no custom loader call": ("srt/model_executor/weight_updater.py",
                              "class W:\n    def update_weights_from_tensor(self, t, load_format=None):\n"
                              "        if load_format in self.custom_weight_loaders:\n            pass\n",
                              "custom_weight_loaders"),
    "no fused MoE method": ("srt/layers/quantization/unquant.py", "class UnquantizedLinearMethod:\n    pass\n",
                            "UnquantizedFusedMoEMethod"),
    "no fused expert mapping": ("srt/models/qwen3_5.py", "mapping = []\n", "fused_expert_params_mapping"),
    "no config class": ("srt/configs/fam.py", "class Other:\n    model_type = 'qwen3_5'\n",
                        "no class with model_type = 'qwen3_5'"),
    "no text config": ("srt/configs/fam.py", "class FamConfig:\n    model_type = 'qwen3_5'\n"
                                             "    sub_configs = {'vision_config': FamConfig}\n",
                       "has no 'text_config'"),
}


@pytest.mark.parametrize("case", sorted(_BROKEN))
def test_scanner_fails_loudly_when_a_piece_is_missing(tmp_path, case):
    rel, text, message = _BROKEN[case]
    files = {**_FAKE, rel: text}
    if text is None:
        files.pop(rel)
    with pytest.raises(ContractScanError, match=re.escape(message)):
        scan_contract(_fake_package(tmp_path, files))


def test_contract_command_writes_the_file_deterministically(tmp_path, capsys, monkeypatch):
    """The command writes vlmrl/contracts/sglang-<version>.json by default (here a
    temporary folder); with the flag list beside it, the release is known and spoken."""
    from vlmrl.contracts import sglang_flags
    from vlmrl.rollout.sglang import main

    monkeypatch.setattr(sglang_flags, "CONTRACTS_DIR", tmp_path / "contracts")
    (tmp_path / "contracts").mkdir()
    src = _fake_package(tmp_path / "pkg", _FAKE)
    assert main(["contract", "--source", str(src)]) == 0
    out = tmp_path / "contracts" / "sglang-9.9.9.json"
    first = out.read_text()
    assert main(["contract", "--source", str(src), "--out", str(out)]) == 0
    assert out.read_text() == first
    c = json.loads(first)
    assert c["generated_by"].startswith("python -m vlmrl.rollout.sglang contract --source pkg --out ")
    assert c["sglang_version"] == "9.9.9" and "/generate" in c["endpoints"]
    assert "11 endpoints of sglang 9.9.9" in capsys.readouterr().out
    assert known_versions() == ()  # a contract without its flag list is not a release vlmrl speaks
    (tmp_path / "contracts" / "sglang-9.9.9.flags.txt").write_text("# sglang version: 9.9.9\n")
    assert known_versions() == ("9.9.9",) and load_flags().version == "9.9.9"
    p = sglang_protocol()
    assert p.version == "9.9.9" and p.session_required == frozenset({"/update_weights_from_tensor"})
    assert p.release_requires_idle == "release only when idle."
    assert verify_sampling_params({"max_new_tokens": -2}) == "max_new_tokens < 0: -2"
    assert verify_sampling_params({"max_new_tokens": 3}) is None


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
    with pytest.raises(ValueError, match=r"metadata entry 1 \('b'\): bytes \[16, 24\) do not hold shape \[3\]"):
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
    assert _sglang_unpickles(common)("types", "SimpleNamespace")
    assert 'load_format == "flattened_bucket"' in updater and "meta.name" in updater


def _sglang_unpickles(common: str) -> Any:
    """(module, name) -> whether SGLang's SafeUnpickler (srt/utils/common.py) loads that global:
    an allowlist of exact globals (0.5.2x) or of module prefixes less a deny list (0.5.17)."""
    tree = ast.parse(common)
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "SafeUnpickler")
    values = {t.id: ast.literal_eval(n.value) for n in cls.body if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name) and t.id.isupper()}
    if "ALLOWED_GLOBALS" in values:
        return lambda module, name: (module, name) in values["ALLOWED_GLOBALS"]
    prefixes, deny = values["ALLOWED_MODULE_PREFIXES"], values.get("DENY_CLASSES", set())
    return lambda module, name: ((module, name) not in deny
                                 and any((module + ".").startswith(p) for p in prefixes))


def test_flattened_payload_names_only_globals_sglang_unpickles(monkeypatch):
    """The pickle of a flattened bucket (host tensors here, shared through files; on a GPU the
    same structure with CUDA-IPC handles) refers to torch's rebuild functions, torch.Size,
    dtypes and types.SimpleNamespace only: globals SGLang's SafeUnpickler admits (checked
    against the wheel's allowlist when VLMRL_SGLANG_WHEEL is set), read back into the same
    tensors. vlmrl's own reader (`load_ipc`) admits the CUDA rebuild only: host storages
    shared by file name are refused (the CUDA form's globals: test_engine_security.py)."""
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
        # a shared host storage is opened once: a second payload, read by torch's unpickler
        back = dict(unflatten_bucket(pickle.loads(serialize_ipc(flatten_bucket(_bucket())))))
        with pytest.raises(pickle.UnpicklingError, match="may not refer to torch.multiprocessing.reductions"):
            load_ipc(data)
    finally:
        tmp.set_sharing_strategy(old)
    for name, t in _bucket():
        assert torch.equal(back[name], t)
    assert ("types", "SimpleNamespace") in seen
    assert all(m == "torch" or m.startswith("torch.") or (m, n) == ("types", "SimpleNamespace") for m, n in seen), seen
    if os.environ.get("VLMRL_SGLANG_WHEEL"):
        with zipfile.ZipFile(os.environ["VLMRL_SGLANG_WHEEL"]) as whl:
            common = whl.read("sglang/srt/utils/common.py").decode()
        allowed = _sglang_unpickles(common)
        refused = {g for g in seen if not allowed(*g)} - {("torch.storage", "_load_from_bytes")}
        assert not refused, refused

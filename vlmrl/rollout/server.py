"""An aiohttp server speaking the subset of SGLang's native HTTP protocol vlmrl uses, as one
SGLang release speaks it.

It fronts any `Engine` (in practice the embedded one), so the same client code drives an
SGLang server on GPUs and the embedded engine on a laptop. The server emulates one release
(`sglang_version`, config key `rollout.embedded.sglang_version`; None: the newest vlmrl has a
contract for) and takes everything release-specific from that release's contract
(vlmrl/contracts): which routes exist, the sampling checks, the /v1/loads keys, the
weight-update session, the text of the release precondition. Routes (as in SGLang):

  POST /generate                      text | input_ids, image_data, sampling_params,
                                      return_logprob, return_prompt_token_ids, rid
                                      (single or batch form); reply in SGLang's shape:
                                      {"text", "output_ids", "meta_info": {"id",
                                      "prompt_tokens", "completion_tokens", "finish_reason":
                                      {"type": "stop", "matched": ...} | {"type": "length",
                                      "length": n}, "output_token_logprobs":
                                      [[logprob, token_id, null], ...]}, "prompt_token_ids"}
  POST /update_weights_from_tensor    SGLang's fields (serialized_named_tensors, load_format,
                                      flush_cache, weight_version). Each entry of
                                      `serialized_named_tensors` is base64 of SGLang's CUDA-IPC
                                      pickle (GPU engines; only torch objects are unpickled) or,
                                      defined here for CPU engines, of
                                      `torch.save(list[(hf_checkpoint_name, tensor)])` (one
                                      entry per TP rank in SGLang; the embedded engine reads
                                      the first); load_format null or "torch_save".
  POST /init_weights_update_group     master_address, master_port, rank_offset, world_size,
                                      group_name, backend (gloo on CPU): joins the trainer's
                                      broadcast group as rank `rank_offset`
  POST /update_weights_from_distributed  names, dtypes, shapes, group_name, load_format
                                      (null: one broadcast per tensor; "flattened_bucket":
                                      one uint8 broadcast per bucket)
  POST /destroy_weights_update_group
  POST /begin_weight_update, /end_weight_update   only where the release has them (0.5.23):
                                      the calls the contract lists under
                                      weight_update.session_required (tensor and distributed
                                      updates) are refused (400, success false) outside a
                                      session; begin while one is open and end while none is
                                      are refused (400) too. Elsewhere these paths are 404.
  POST|GET /release_memory_occupation, /resume_memory_occupation ({"tags": [...]}), /flush_cache
  POST /abort_request                 {"rid": ...} | {"abort_all": true}: a queued request
                                      finishes unrun, a running one at its next decode step,
                                      with finish_reason {"type": "abort"}; unknown ids: 200
  GET  /health, /health_generate (both run one greedy token, as SGLang's do), /get_model_info,
       /model_info
  GET  /server_info                   {"version": the emulated release, "startup_time", ...}
  GET  /v1/loads                      {"timestamp", "version", "loads": [{the contract's core
                                      keys: num_running_reqs / num_waiting_reqs are the requests
                                      the engine is generating / has queued, ...}], ...}

Update replies are {"success": bool, "message": str} (400 when success is false), like
SGLang's. As in SGLang, a request id already in flight is refused (400, "Duplicate request
ID detected"), and memory tags default to all of weights, kv_cache and cuda_graph. Errors of
/generate are {"error": {"message", "type", "code", "retryable"}} with status 400 (bad
request) or 500/503 (engine failure; the client retries those).

Sampling parameters are checked as SGLang checks them: an unknown key is a 400; so is a value
any check of the release's `SamplingParams.verify` refuses, with SGLang's own message (e.g.
"max_new_tokens must be at least 0, got -1."); then a parameter the embedded engine does not
implement, set off its default, is a 400 too.

Where SGLang fails hard, the server refuses and keeps serving, and counts it (`stats`):
a memory release while any request runs or waits (SGLang asserts the server is idle and its
scheduler dies) is answered 500 with SGLang's assertion text (`release_refused_busy`); a
/generate while memory is released (SGLang 0.5.17 crashed) is refused by the embedded engine
(503) and a weight update while the weights are released too (400), both counted in the
engine's stats (`refused_generate_released`, `refused_update_released`); so is a /health
while released (SGLang's runs a token through the scheduler, which died on it when released:
`refused_health_released`, 503).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from .protocol import (
    EngineError,
    GenerateRequest,
    SamplingParams,
    requests_from_sglang,
    result_to_sglang,
)
from .weights import decode_payload

log = logging.getLogger(__name__)


def _error(message: str, status: int, *, retryable: bool) -> Any:
    from aiohttp import web

    kind = "invalid_request_error" if status < 500 else "engine_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": status, "retryable": retryable}},
                             status=status)


async def _json(request: Any, limit: int | None = None) -> dict[str, Any]:
    """The JSON object of the body; with `limit`, a body longer than `limit` bytes (declared
    or streamed) is refused with 413 without being read whole."""
    import json

    if not request.can_read_body:
        return {}
    if limit is None:
        raw = await request.read()
    else:
        if request.content_length is not None and request.content_length > limit:
            raise EngineError(f"request body of {request.content_length / (1 << 20):.1f} MiB exceeds the "
                              f"server's {limit / (1 << 20):.0f} MiB limit", retryable=False, status=413)
        chunks, size = [], 0
        async for chunk in request.content.iter_any():
            size += len(chunk)
            if size > limit:
                raise EngineError(f"request body exceeds the server's {limit / (1 << 20):.0f} MiB limit",
                                  retryable=False, status=413)
            chunks.append(chunk)
        raw = b"".join(chunks)
    try:
        body = json.loads(raw) if raw else None
    except ValueError as e:
        raise EngineError(f"body is not JSON: {e}", retryable=False, status=400) from e
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise EngineError("body must be a JSON object", retryable=False, status=400)
    return body


def sampling_rules(sglang_version: str | None = None) -> tuple[frozenset[str], dict[str, Any]]:
    """(every sampling parameter SGLang's /generate accepts, the default of each) in release
    `sglang_version`, from its contract: the JSON schema in front of /generate where the
    release has one, else the fields of its SamplingParams."""
    import ast

    from ..contracts.sglang_contract import load_contract, parse_field

    contract = load_contract(sglang_version)
    schema = contract["api_schema"]
    fields = schema["SamplingParams"]["fields"] if schema else contract["sampling_params"]["fields"]
    defaults = {}
    for name, spec in fields.items():
        default = parse_field(spec)[2]
        try:
            defaults[name] = ast.literal_eval(default) if default is not None else None
        except ValueError:
            defaults[name] = default
    return frozenset(fields), defaults


# what the embedded engine implements (the rest of SGLang's parameters only at their defaults)
SUPPORTED_SAMPLING = frozenset({"temperature", "top_p", "top_k", "max_new_tokens", "stop", "stop_token_ids",
                                "sampling_seed", "ignore_eos"})


def check_sampling(params: Any, known: frozenset[str], defaults: dict[str, Any], *,
                   sglang_version: str | None = None, vocab_size: int | None = None) -> None:
    """SGLang refuses sampling parameters its schema does not define (HTTP 400) and values its
    `SamplingParams.verify` refuses (400, its message); the embedded engine also refuses,
    rather than ignores, SGLang's parameters it does not implement when they are set to
    anything but their default."""
    from ..contracts.sglang_contract import verify_sampling_params

    for d in params if isinstance(params, list) else [params]:
        if d is None:
            continue
        if not isinstance(d, dict):
            raise EngineError("'sampling_params' must be an object (or a list of objects)", retryable=False, status=400)
        unknown = sorted(set(d) - known)
        if unknown:
            raise EngineError(f"unknown sampling parameters {unknown}", retryable=False, status=400)
        refused = verify_sampling_params(d, version=sglang_version, vocab_size=vocab_size)
        if refused is not None:
            raise EngineError(refused, retryable=False, status=400)
        unsupported = sorted(k for k, v in d.items() if k not in SUPPORTED_SAMPLING and v != defaults.get(k))
        if unsupported:
            raise EngineError(f"sampling parameters {unsupported} are not implemented by the embedded engine "
                              f"(it implements {sorted(SUPPORTED_SAMPLING)})", retryable=False, status=400)


@dataclass
class _State:
    """What the server itself keeps: requests in its /generate handlers, the weight-update
    session, and the refusals it counted."""

    in_flight: int = 0
    session: bool = False
    started: float = field(default_factory=time.time)
    stats: dict[str, int] = field(default_factory=lambda: {"release_refused_busy": 0,
                                                           "update_refused_no_session": 0,
                                                           "refused_health_released": 0,
                                                           "unauthorized": 0})


# application -> (the SGLangProtocol it speaks, its _State)
_APPS: weakref.WeakKeyDictionary[Any, tuple[Any, _State]] = weakref.WeakKeyDictionary()


async def _torch_work(engine: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """fn off the event loop: on the engine's torch thread where it has one (`EmbeddedEngine.torch_call`)."""
    call = getattr(engine, "torch_call", None)
    if call is not None:
        return await call(fn, *args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


def _engine_load(engine: Any, state: _State) -> tuple[int, int]:
    """(running, waiting) requests: the engine's own counts where it keeps them, else the
    server's requests in flight as running."""
    load = getattr(engine, "load", None)
    if callable(load):
        counts = load()
        return int(counts["running"]), int(counts["waiting"])
    return state.in_flight, 0


def build_app(engine: Any, *, max_generate_mb: float = 64.0, max_weights_mb: float = 16384.0,
              sglang_version: str | None = None, api_key: str | None = None) -> Any:
    """The aiohttp application serving `engine` (an `Engine`, usually EmbeddedEngine) with the
    protocol of SGLang `sglang_version` (None: the newest vlmrl has a contract for; one it has
    none for raises UnknownSGLangVersion, a ValueError).

    A /generate body larger than `max_generate_mb` is refused with 413 before it is read;
    weight-update bodies may be up to `max_weights_mb` (a bucket of base64 tensors).

    With `api_key` (the run's engine key, `vlmrl.rollout.auth`) every request but /health*
    and /metrics needs `Authorization: Bearer <api_key>`, as SGLang with `--api-key` and
    `--admin-api-key` set to it: without it the answer is 401 `{"error": "Unauthorized"}`
    before the body is read, nothing changes, and `unauthorized` counts it."""
    from aiohttp import web

    from ..contracts.sglang_contract import protocol
    from .auth import authorized

    proto = protocol(sglang_version)
    state = _State()

    @web.middleware
    async def require_key(request: web.Request, handler: Any) -> web.StreamResponse:
        if not authorized(request.path, request.headers.get("Authorization"), api_key):
            state.stats["unauthorized"] += 1
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    app = web.Application(client_max_size=int(max_weights_mb * (1 << 20)), middlewares=[require_key])
    _APPS[app] = (proto, state)
    known_sampling, sampling_defaults = sampling_rules(proto.version)
    vocab_size = getattr(engine, "vocab_size", None)
    generate_limit = int(max_generate_mb * (1 << 20))
    groups: dict[str, Any] = {}  # weight update groups this server joined (receiving side)
    in_flight: set[str] = set()  # request ids being served (SGLang refuses a duplicate one)

    async def generate(request: web.Request) -> web.Response:
        rids: list[str] = []
        state.in_flight += 1
        try:
            body = await _json(request, generate_limit)
            check_sampling(body.get("sampling_params"), known_sampling, sampling_defaults,
                           sglang_version=proto.version, vocab_size=vocab_size)
            reqs, is_batch, want_prompt_ids = requests_from_sglang(body)
            for q in reqs:
                if q.rid is None:
                    continue
                if q.rid in in_flight or q.rid in rids:
                    raise EngineError(f"Duplicate request ID detected: {q.rid}", retryable=False, status=400)
                rids.append(q.rid)
            in_flight.update(rids)
            results = await engine.generate(reqs)
        except EngineError as e:
            status = e.status or (503 if e.retryable else 400)
            return _error(str(e), status, retryable=e.retryable)
        except Exception as e:  # noqa: BLE001
            log.exception("generate failed")
            return _error(f"{type(e).__name__}: {e}", 500, retryable=True)
        finally:
            in_flight.difference_update(rids)
            state.in_flight -= 1
        out = [result_to_sglang(r, return_logprob=q.return_logprob, return_prompt_token_ids=want_prompt_ids)
               for q, r in zip(reqs, results)]
        return web.json_response(out if is_batch else out[0])

    def _reply(success: bool, message: str) -> web.Response:
        return web.json_response({"success": success, "message": message}, status=200 if success else 400)

    def _outside_session(path: str) -> web.Response | None:
        """The refusal of a call the release only takes inside a weight-update session."""
        if path not in proto.session_required or state.session:
            return None
        state.stats["update_refused_no_session"] += 1
        return _reply(False, f"SGLang {proto.version} takes {path} only inside a weight-update session: "
                             "call /begin_weight_update first and /end_weight_update after")

    async def begin_weight_update(request: web.Request) -> web.Response:
        await _json(request)
        if state.session:
            return _reply(False, "a weight-update session is open already: /end_weight_update closes it")
        state.session = True
        return _reply(True, "weight-update session opened")

    async def end_weight_update(request: web.Request) -> web.Response:
        await _json(request)
        if not state.session:
            return _reply(False, "no weight-update session is open: /begin_weight_update opens one")
        state.session = False
        return _reply(True, "weight-update session closed")

    async def update_weights_from_tensor(request: web.Request) -> web.Response:
        if (refused := _outside_session(request.path)) is not None:
            return refused
        try:
            body = await _json(request)
            entries = body.get("serialized_named_tensors")
            if not entries:
                return _reply(False, "serialized_named_tensors is required")
            fmt = body.get("load_format")
            if fmt not in (None, "torch_save", "flattened_bucket"):
                return _reply(False, f"load_format {fmt!r} is not supported by the embedded engine "
                                     "(expects SGLang's CUDA-IPC payload, flattened (load_format "
                                     "'flattened_bucket') or not, or base64 of torch.save(list[(name, tensor)]))")
            named = await _torch_work(engine, decode_payload, entries[0], fmt == "flattened_bucket")
            await engine.update_weights_from_tensor(named, flush_cache=bool(body.get("flush_cache", True)),
                                                    weight_version=body.get("weight_version"))
        except Exception as e:  # noqa: BLE001
            log.exception("update_weights_from_tensor failed")
            return _reply(False, f"{type(e).__name__}: {e}")
        return _reply(True, f"updated {len(named)} tensors")

    async def init_weights_update_group(request: web.Request) -> web.Response:
        from .weights import join_update_group

        try:
            body = await _json(request)
            name = body.get("group_name", "weight_update_group")
            group = await asyncio.to_thread(
                join_update_group, body["master_address"], int(body["master_port"]),
                int(body["rank_offset"]), int(body["world_size"]), group_name=name,
                backend=body.get("backend", "nccl"))  # SGLang's default; CPU callers send gloo
            groups[name] = group
        except Exception as e:  # noqa: BLE001
            log.exception("init_weights_update_group failed")
            return _reply(False, f"{type(e).__name__}: {e}")
        return _reply(True, "Succeeded to initialize custom process group.")

    async def update_weights_from_distributed(request: web.Request) -> web.Response:
        from .weights import receive_bucket

        if (refused := _outside_session(request.path)) is not None:
            return refused
        try:
            body = await _json(request)
            name = body.get("group_name", "weight_update_group")
            group = groups.get(name)
            if group is None:
                return _reply(False, f"no weight update group {name!r}; call /init_weights_update_group first")
            named = await _torch_work(engine, receive_bucket, group, body["names"], body["dtypes"], body["shapes"],
                                      flattened=body.get("load_format") == "flattened_bucket")
            await engine.update_weights_from_tensor(named, flush_cache=bool(body.get("flush_cache", True)),
                                                    weight_version=body.get("weight_version"))
        except Exception as e:  # noqa: BLE001
            log.exception("update_weights_from_distributed failed")
            return _reply(False, f"{type(e).__name__}: {e}")
        return _reply(True, "Succeeded to update parameter online.")

    async def destroy_weights_update_group(request: web.Request) -> web.Response:
        body = await _json(request)
        group = groups.pop(body.get("group_name", "weight_update_group"), None)
        if group is None:
            return _reply(False, "no such group")
        from .weights import destroy_update_group

        await asyncio.to_thread(destroy_update_group, group)
        return _reply(True, "destroyed")

    async def _tags(request: web.Request) -> list[str] | None:
        body = await request.json() if request.can_read_body else {}
        return (body or {}).get("tags")

    async def release(request: web.Request) -> web.Response:
        tags = await _tags(request)
        running, waiting = _engine_load(engine, state)
        if running or waiting or state.in_flight:
            # SGLang asserts it is idle here and its scheduler dies; this server refuses instead
            state.stats["release_refused_busy"] += 1
            log.warning("refused /release_memory_occupation with %d requests running, %d waiting, %d in flight",
                        running, waiting, state.in_flight)
            return _error(proto.release_requires_idle, 500, retryable=False)
        try:
            await engine.release_memory_occupation(tags)
        except ValueError as e:  # unknown tags
            return _error(str(e), 400, retryable=False)
        return web.json_response(None)

    async def resume(request: web.Request) -> web.Response:
        try:
            await engine.resume_memory_occupation(await _tags(request))
        except ValueError as e:  # unknown tags, or tags that are not released
            return _error(str(e), 400, retryable=False)
        return web.json_response(None)

    async def flush(request: web.Request) -> web.Response:
        await engine.flush_cache()
        return web.Response(text="Cache flushed.\n")

    async def abort_request(request: web.Request) -> web.Response:
        # SGLang's AbortReq: {"rid": ...} or {"abort_all": true}; an unknown id is no error
        try:
            body = await _json(request, generate_limit)
        except EngineError as e:
            return _error(str(e), e.status or 400, retryable=False)
        rids = sorted(in_flight) if body.get("abort_all") else [str(body["rid"])] if body.get("rid") else []
        if rids:
            await engine.abort_requests(rids)
        return web.Response(status=200)

    async def health_generate(request: web.Request) -> web.Response:
        # SGLang answers /health as /health_generate: one greedy token through the scheduler,
        # which dies when its memory is released (seen with 0.5.17); refused and counted here
        if not await engine.health():
            state.stats["refused_health_released"] += 1
            return web.Response(status=503)
        try:
            await asyncio.wait_for(engine.generate([GenerateRequest(
                input_ids=(0,), sampling=SamplingParams(temperature=0.0, max_new_tokens=1))]), timeout=60)
        except Exception:  # noqa: BLE001
            log.exception("health_generate failed")
            return web.Response(status=503)
        return web.Response(status=200)

    async def model_info(request: web.Request) -> web.Response:
        info = engine.model_info() if hasattr(engine, "model_info") else {"is_generation": True}
        return web.json_response(info)

    async def server_info(request: web.Request) -> web.Response:
        contract_keys = {"version": proto.version, "startup_time": state.started, "internal_states": [{}]}
        info = {k: contract_keys.get(k) for k in proto.server_info_keys}
        info.update(model_path=getattr(engine, "model_path", None), tp_size=1, dp_size=1,
                    max_running_requests=getattr(engine, "max_batch_size", None))
        return web.json_response(info)

    async def loads(request: web.Request) -> web.Response:
        import datetime

        dp_rank = request.query.get("dp_rank")
        running, waiting = _engine_load(engine, state)
        core: dict[str, Any] = {k: 0 for k in proto.loads_core_keys}
        known = {"timestamp": time.time(), "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
                 "max_running_requests": getattr(engine, "max_batch_size", 0), "decode_moments": None}
        core.update({k: v for k, v in known.items() if k in core})
        rows = [core] if dp_rank in (None, "", "0") else []
        reply = {"timestamp": datetime.datetime.now(datetime.UTC).isoformat(), "version": proto.version,
                 "accelerator": None, "num_accelerators": 1, "loads": rows}
        return web.json_response({k: reply.get(k) for k in proto.loads_reply_keys})

    app.router.add_route("POST", "/generate", generate)
    app.router.add_route("PUT", "/generate", generate)
    app.router.add_post("/update_weights_from_tensor", update_weights_from_tensor)
    app.router.add_post("/init_weights_update_group", init_weights_update_group)
    app.router.add_post("/update_weights_from_distributed", update_weights_from_distributed)
    app.router.add_post("/destroy_weights_update_group", destroy_weights_update_group)
    for method in ("GET", "POST"):
        app.router.add_route(method, "/release_memory_occupation", release)
        app.router.add_route(method, "/resume_memory_occupation", resume)
        app.router.add_route(method, "/flush_cache", flush)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_get("/health", health_generate)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/model_info", model_info)
    if proto.server_info:
        app.router.add_get("/server_info", server_info)
    if proto.loads:
        app.router.add_get("/v1/loads", loads)
    if proto.weight_update_session:  # elsewhere a missing route: 404, as in that release
        app.router.add_post("/begin_weight_update", begin_weight_update)
        app.router.add_post("/end_weight_update", end_weight_update)
    return app


@dataclass
class RunningServer:
    """A server started on the current event loop (`start_server`)."""

    runner: Any
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def protocol(self) -> Any:
        """The SGLangProtocol this server speaks."""
        return _APPS[self.runner.app][0]

    @property
    def stats(self) -> dict[str, int]:
        """The refusals the server counted (see the module docstring)."""
        return dict(_APPS[self.runner.app][1].stats)

    async def close(self) -> None:
        await self.runner.cleanup()


async def start_server(engine: Any, host: str = "127.0.0.1", port: int = 0, **app_kwargs: Any) -> RunningServer:
    """Serve `engine` on the running event loop; port 0 picks a free port; `app_kwargs` go
    to `build_app` (body limits, sglang_version)."""
    from aiohttp import web

    runner = web.AppRunner(build_app(engine, **app_kwargs), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1] if port == 0 else port  # type: ignore[union-attr]
    return RunningServer(runner, host, int(bound))


class ThreadedServer:
    """The server on its own event loop in a daemon thread (for tests and in-process use)."""

    def __init__(self, engine: Any, host: str = "127.0.0.1", port: int = 0, **app_kwargs: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: RunningServer | None = None
        self._error: BaseException | None = None
        self._app_kwargs = app_kwargs
        self.thread = threading.Thread(target=self._main, args=(engine, host, port), daemon=True,
                                       name="vlmrl-rollout-server")
        self.thread.start()
        self._ready.wait(60)
        if self._error is not None:
            raise self._error
        if self._server is None:
            raise TimeoutError("rollout server did not start")

    def _main(self, engine: Any, host: str, port: int) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self._server = self.loop.run_until_complete(start_server(engine, host, port, **self._app_kwargs))
        except BaseException as e:  # noqa: BLE001
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()
        pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]  # e.g. an engine's batcher
        for t in pending:
            t.cancel()
        self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.close()

    @property
    def url(self) -> str:
        assert self._server is not None
        return self._server.url

    @property
    def protocol(self) -> Any:
        assert self._server is not None
        return self._server.protocol

    @property
    def stats(self) -> dict[str, int]:
        assert self._server is not None
        return self._server.stats

    def stop(self) -> None:
        if self._server is not None and self.loop.is_running():
            fut = asyncio.run_coroutine_threadsafe(self._server.close(), self.loop)
            try:
                fut.result(30)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self.thread.join(30)
        self._server = None

    def __enter__(self) -> ThreadedServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

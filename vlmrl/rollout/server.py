"""An aiohttp server speaking the subset of SGLang's native HTTP protocol vlmrl uses.

It fronts any `Engine` (in practice the embedded one), so the same client code drives an
SGLang server on GPUs and the embedded engine on a laptop. Routes (as in SGLang):

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
  POST|GET /release_memory_occupation, /resume_memory_occupation ({"tags": [...]}), /flush_cache
  GET  /health, /health_generate (runs one greedy token), /get_model_info, /model_info

Update replies are {"success": bool, "message": str} (400 when success is false), like
SGLang's. As in SGLang, a request id already in flight is refused (400, "Duplicate request
ID detected"), and memory tags default to all of weights, kv_cache and cuda_graph. Errors of /generate are {"error": {"message", "type", "code", "retryable"}}
with status 400 (bad request) or 500/503 (engine failure; the client retries those).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
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


def sampling_rules() -> tuple[frozenset[str], dict[str, Any]]:
    """(every sampling parameter SGLang's /generate schema accepts, the default of each),
    from the contract generated from SGLang's source (sglang_contract.json)."""
    import ast

    from .sglang_contract import load_contract, parse_field

    fields = load_contract()["api_schema"]["SamplingParams"]["fields"]
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


def check_sampling(params: Any, known: frozenset[str], defaults: dict[str, Any]) -> None:
    """SGLang refuses sampling parameters its schema does not define (HTTP 400); the embedded
    engine also refuses, rather than ignores, SGLang's parameters it does not implement when
    they are set to anything but their default."""
    for d in params if isinstance(params, list) else [params]:
        if d is None:
            continue
        if not isinstance(d, dict):
            raise EngineError("'sampling_params' must be an object (or a list of objects)", retryable=False, status=400)
        unknown = sorted(set(d) - known)
        if unknown:
            raise EngineError(f"unknown sampling parameters {unknown}", retryable=False, status=400)
        unsupported = sorted(k for k, v in d.items() if k not in SUPPORTED_SAMPLING and v != defaults.get(k))
        if unsupported:
            raise EngineError(f"sampling parameters {unsupported} are not implemented by the embedded engine "
                              f"(it implements {sorted(SUPPORTED_SAMPLING)})", retryable=False, status=400)


def build_app(engine: Any, *, max_generate_mb: float = 64.0, max_weights_mb: float = 16384.0) -> Any:
    """The aiohttp application serving `engine` (an `Engine`, usually EmbeddedEngine).

    A /generate body larger than `max_generate_mb` is refused with 413 before it is read;
    weight-update bodies may be up to `max_weights_mb` (a bucket of base64 tensors)."""
    from aiohttp import web

    app = web.Application(client_max_size=int(max_weights_mb * (1 << 20)))
    known_sampling, sampling_defaults = sampling_rules()
    generate_limit = int(max_generate_mb * (1 << 20))
    groups: dict[str, Any] = {}  # weight update groups this server joined (receiving side)
    in_flight: set[str] = set()  # request ids being served (SGLang refuses a duplicate one)

    async def generate(request: web.Request) -> web.Response:
        rids: list[str] = []
        try:
            body = await _json(request, generate_limit)
            check_sampling(body.get("sampling_params"), known_sampling, sampling_defaults)
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
        out = [result_to_sglang(r, return_logprob=q.return_logprob, return_prompt_token_ids=want_prompt_ids)
               for q, r in zip(reqs, results)]
        return web.json_response(out if is_batch else out[0])

    def _reply(success: bool, message: str) -> web.Response:
        return web.json_response({"success": success, "message": message}, status=200 if success else 400)

    async def update_weights_from_tensor(request: web.Request) -> web.Response:
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
            named = await asyncio.to_thread(decode_payload, entries[0], fmt == "flattened_bucket")
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

        try:
            body = await _json(request)
            name = body.get("group_name", "weight_update_group")
            group = groups.get(name)
            if group is None:
                return _reply(False, f"no weight update group {name!r}; call /init_weights_update_group first")
            named = await asyncio.to_thread(receive_bucket, group, body["names"], body["dtypes"], body["shapes"],
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
        try:
            await engine.release_memory_occupation(await _tags(request))
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

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200 if await engine.health() else 503)

    async def health_generate(request: web.Request) -> web.Response:
        if not await engine.health():
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
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/model_info", model_info)
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

    async def close(self) -> None:
        await self.runner.cleanup()


async def start_server(engine: Any, host: str = "127.0.0.1", port: int = 0, **app_kwargs: Any) -> RunningServer:
    """Serve `engine` on the running event loop; port 0 picks a free port; `app_kwargs` go
    to `build_app` (body limits)."""
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

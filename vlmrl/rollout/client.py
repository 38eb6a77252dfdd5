"""One async HTTP client for SGLang's native protocol (SGLang servers and the embedded one).

`HTTPEngine` implements the `Engine` protocol over HTTP: bounded concurrency (a semaphore
and a connection pool of the same size), per-call timeouts, and retries with exponential
backoff and jitter for transient failures (connection errors, timeouts, HTTP 429/5xx, and
requests the server aborted). Client errors (HTTP 4xx) fail at once.

Weight payloads depend on the server: `tensor_format="torch_save"` (the embedded server:
base64 of torch.save'd (name, tensor) lists, tensors copied) or `"ipc"` (SGLang colocated
on the same GPUs: each bucket flattened into one uint8 tensor and sent as one CUDA IPC handle
with `load_format="flattened_bucket"`, see `vlmrl.rollout.weights.flatten_bucket`), with one
entry per tensor-parallel rank of the engine, each serialized on the GPU that rank reads
(`update_weights_from_serialized`). With `ipc_loader` (a weight loader the server was started
with, `--custom-weight-loader`: vlmrl's `vlmrl_sglang_loader.load_weights`) an IPC payload is
(name, tensor) pairs, views into the one flattened copy, sent with that loader as load_format.
`None`: the server takes no tensor payload from vlmrl (SGLang on GPUs of its own reads weights
from the NCCL update group only: its safe unpickler refuses torch.save bytes).

The server's protocol is its SGLang release's (`protocol()`: the version `/server_info` reports,
looked up in the contracts generated from SGLang's source; an unknown version is refused). Where
that release has weight-update sessions, `weight_update_session()` opens one around a sync.

Memory: after `release_memory_occupation` the client refuses to generate until every released
tag is resumed (SGLang's scheduler dies on a request while its memory is released), and the
release itself first waits until the server is idle (`drain`: this client's requests ended and
the server's `/v1/loads` shows none running or queued; SGLang asserts idleness and dies
otherwise). `hold` / `unhold` close and open that gate on a client that does not release
(a router in front of the released servers).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from .auth import bearer
from .protocol import (
    EngineError,
    GenerateRequest,
    GenerateResult,
    bucketize,
    memory_tags,
    request_to_sglang,
    result_from_sglang,
)

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# how long one /health call may take: SGLang answers after its scheduler next reports, polled
# once a second, and gives up on a health check itself after 20 s
HEALTH_ANSWER_S = 25.0


class HTTPEngine:
    """An engine behind SGLang's HTTP API (see module docstring)."""

    def __init__(
        self,
        base_url: str,
        *,
        name: str | None = None,
        max_concurrency: int = 256,
        timeout_s: float = 600.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        backoff_max_s: float = 10.0,
        tensor_format: str | None = "torch_save",
        tp_size: int = 1,
        admin_timeout_s: float = 1800.0,
        drain_timeout_s: float = 300.0,
        api_key: str | None = None,
        ipc_loader: str | None = None,
    ) -> None:
        if tensor_format not in ("torch_save", "ipc", None):
            raise ValueError(f"tensor_format must be 'torch_save', 'ipc' or None, not {tensor_format!r}")
        self.base_url = base_url.rstrip("/")
        self.name = name or self.base_url
        self.max_concurrency = int(max_concurrency)
        self.timeout_s = float(timeout_s)
        self.admin_timeout_s = float(admin_timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.backoff_max_s = float(backoff_max_s)
        self.tensor_format = tensor_format
        self.ipc_loader = ipc_loader if tensor_format == "ipc" else None
        self.tp_size = int(tp_size)
        self.drain_timeout_s = float(drain_timeout_s)
        self._headers = bearer(api_key)  # the run's engine key, sent with every request (never logged)
        self._held: set[str] = set()  # released memory tags: no generation while any
        self._inflight = 0  # this client's /generate calls under way
        self._attempt_rid: dict[str, str] = {}  # a request's id -> the id of its attempt under way
        self._protocol: Any = None  # the server's SGLangProtocol, once asked
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session: Any = None
        self._sem: asyncio.Semaphore | None = None
        self._stale: list[Any] = []  # sessions left by `rebase`
        self.stats = {"requests": 0, "retries": 0, "failures": 0}

    def __repr__(self) -> str:
        return f"HTTPEngine({self.base_url!r})"

    def rebase(self, base_url: str) -> None:
        """Point at a restarted server's address (its connections are dropped)."""
        self.base_url = base_url.rstrip("/")
        if self._session is not None and not self._session.closed:
            self._stale.append(self._session)  # closed by the next close() on its loop
        self._session = None
        self._protocol = None  # a restarted server may run another release
        self._held.clear()  # a new server holds all its memory

    # ----------------------------------------------------------------- plumbing
    def _ensure(self) -> tuple[Any, asyncio.Semaphore]:
        import aiohttp

        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop or self._session.closed:
            # a session belongs to one event loop (callers may use asyncio.run per step)
            self._loop = loop
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_concurrency, force_close=False),
                timeout=aiohttp.ClientTimeout(total=None), headers=self._headers,
            )
            self._sem = asyncio.Semaphore(self.max_concurrency)
        assert self._sem is not None
        return self._session, self._sem

    def _backoff(self, attempt: int) -> float:
        return min(self.backoff_max_s, self.backoff_s * (2 ** attempt)) * (0.5 + random.random() / 2)

    async def _call(self, method: str, path: str, body: Any = None, *, timeout_s: float | None = None,
                    retries: int | None = None, expect_json: bool = True) -> Any:
        """One HTTP call with retries; returns the decoded JSON (or text) of a 2xx reply."""
        import aiohttp

        session, sem = self._ensure()
        retries = self.max_retries if retries is None else retries
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        url = self.base_url + path
        last: EngineError | None = None
        for attempt in range(retries + 1):
            if attempt:
                self.stats["retries"] += 1
                await asyncio.sleep(self._backoff(attempt - 1))
            try:
                async with sem, session.request(method, url, json=body, timeout=timeout) as resp:
                    text = await resp.text()
                    if 200 <= resp.status < 300:
                        if not expect_json:
                            return text
                        try:
                            return await resp.json(content_type=None) if text else None
                        except ValueError:
                            return text
                    msg = _error_message(text)
                    err = EngineError(f"{method} {url}: HTTP {resp.status}: {msg}",
                                      retryable=resp.status in RETRY_STATUSES, status=resp.status)
            except (TimeoutError, aiohttp.ClientError, ConnectionError) as e:
                err = EngineError(f"{method} {url}: {type(e).__name__}: {e}", retryable=True)
            last = err
            if not err.retryable:
                break
            log.debug("retrying %s (attempt %d): %s", url, attempt + 1, err)
        self.stats["failures"] += 1
        assert last is not None
        raise last

    # ----------------------------------------------------------------- generation
    async def generate_one(self, req: GenerateRequest) -> GenerateResult:
        if self._held:
            raise EngineError(f"{self.name}: its memory is released ({', '.join(sorted(self._held))}); no request "
                              "is sent until it is resumed", retryable=False)
        self._inflight += 1
        try:
            return await self._generate_one(req)
        finally:
            self._inflight -= 1

    async def _generate_one(self, req: GenerateRequest) -> GenerateResult:
        self.stats["requests"] += 1
        last: EngineError | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.stats["retries"] += 1
                await asyncio.sleep(self._backoff(attempt - 1))
            # a retried request gets a fresh id: SGLang may still hold the aborted attempt's
            # id and would refuse it as a duplicate (HTTP 400)
            attempt_req = req if not attempt or req.rid is None else req.replace(rid=f"{req.rid}-a{attempt}")
            if req.rid is not None:
                self._attempt_rid[req.rid] = attempt_req.rid
            try:
                reply = await self._call("POST", "/generate", request_to_sglang(attempt_req), retries=0)
                if isinstance(reply, list):
                    reply = reply[0]
                if not isinstance(reply, dict):
                    raise EngineError(f"/generate answered {str(reply)[:200]!r}", retryable=False)
                return result_from_sglang(reply, rid=req.rid)
            except EngineError as e:  # transport failures, 429/5xx, aborted requests: retry
                last = e
                if not e.retryable:
                    raise
            finally:
                if req.rid is not None:
                    self._attempt_rid.pop(req.rid, None)
        assert last is not None
        raise last

    async def abort_requests(self, rids: Sequence[str]) -> None:
        """POST /abort_request for each of `rids` (the attempt under way, when one was retried)."""
        for rid in rids:
            body = {"rid": self._attempt_rid.get(rid, rid)}
            await self._call("POST", "/abort_request", body, expect_json=False, retries=0,
                             timeout_s=30.0)

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        return list(await asyncio.gather(*(self.generate_one(r) for r in requests)))

    # ----------------------------------------------------------------- weights
    def serialize(self, bucket: list[tuple[str, Any]], keep: list | None = None) -> str:
        """One entry of `serialized_named_tensors`: what one TP rank of the engine reads
        (`keep`: see `vlmrl.rollout.weights.serialize_payload`)."""
        from .weights import serialize_payload

        return serialize_payload(bucket, self.tensor_format, keep, flattened=self.ipc_loader is None)

    async def _checked(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        reply = await self._call("POST", path, body, timeout_s=self.admin_timeout_s, retries=0)
        if isinstance(reply, dict) and reply.get("success") is False:
            raise EngineError(f"{path} failed on {self.name}: {reply.get('message')}", retryable=False)
        return reply if isinstance(reply, dict) else {}

    async def update_weights_from_serialized(self, payloads: Sequence[str], *, flush_cache: bool = True,
                                             weight_version: str | None = None) -> None:
        """/update_weights_from_tensor with one serialized payload per TP rank of the engine
        (rank i loads `payloads[i]`). CUDA-IPC payloads must each come from the GPU that
        rank reads: one payload shared by several ranks breaks the producer's IPC
        reference counting, so identical IPC payloads are refused."""
        self._check_tensor_format()
        if len(payloads) != self.tp_size:
            raise ValueError(f"{self.name}: {len(payloads)} serialized payloads for an engine of tp_size "
                             f"{self.tp_size}; SGLang's rank i reads entry i")
        if self.tensor_format == "ipc" and len(set(payloads)) != len(payloads):
            raise ValueError(f"{self.name}: the same CUDA-IPC payload for several TP ranks; serialize each "
                             "rank's copy on its own GPU (vlmrl.cluster.trainer_group gathers them)")
        await self._checked("/update_weights_from_tensor", {
            "serialized_named_tensors": list(payloads),
            "load_format": self.load_format,
            "flush_cache": bool(flush_cache),
            "weight_version": weight_version,
        })

    async def update_weights_from_tensor(self, named_tensors: Sequence[tuple[str, Any]], *,
                                         bucket_bytes: int | None = None, flush_cache: bool = True,
                                         weight_version: str | None = None) -> None:
        """Send weights held by this process. Host copies (`torch_save`) are read by every
        rank from one payload; CUDA IPC needs one payload per rank, each from that rank's GPU,
        so an IPC engine wider than one rank takes `update_weights_from_serialized`."""
        self._check_tensor_format()
        if self.tensor_format == "ipc" and self.tp_size > 1:
            raise ValueError(f"{self.name}: CUDA-IPC weights for tp_size {self.tp_size} need one payload per "
                             "rank from that rank's GPU; use update_weights_from_serialized")
        buckets = list(bucketize(named_tensors, bucket_bytes))
        async with self.weight_update_session():
            for i, bucket in enumerate(buckets):
                last = i == len(buckets) - 1
                alive: list[Any] = []  # the flattened copy stays until the engine has read it
                entry = await asyncio.to_thread(self.serialize, bucket, alive)
                await self.update_weights_from_serialized([entry] * self.tp_size,
                                                          flush_cache=flush_cache and last,
                                                          weight_version=weight_version if last else None)
                del alive

    @property
    def load_format(self) -> str | None:
        """The load_format of this client's `/update_weights_from_tensor` payloads: CUDA-IPC
        payloads are flattened buckets (`vlmrl.rollout.weights.flatten_bucket`), or pairs for
        the server's `ipc_loader`; host copies need none."""
        if self.tensor_format != "ipc":
            return None
        return self.ipc_loader or "flattened_bucket"

    def _check_tensor_format(self) -> None:
        if self.tensor_format is None:
            raise ValueError(f"{self.name} takes no tensor payloads from vlmrl: an SGLang server on GPUs of its own "
                             "reads weights from the NCCL update group (update_weights_from_distributed), and its "
                             "safe unpickler refuses torch.save bytes")

    # ----------------------------------------------------------------- protocol
    async def protocol(self) -> Any:
        """The server's SGLang protocol (`vlmrl.contracts.sglang_contract.SGLangProtocol`): the
        version `/server_info` reports, looked up among the contracts vlmrl has; a server
        that reports none, or a release vlmrl has no contract for, is refused."""
        if self._protocol is None:
            from ..contracts.sglang_contract import protocol

            info = await self._call("GET", "/server_info", None, timeout_s=60.0)
            version = info.get("version") if isinstance(info, dict) else None
            if not version:
                raise EngineError(f"{self.name}: /server_info reports no SGLang version", retryable=False)
            try:
                self._protocol = protocol(str(version))
            except ValueError as e:
                raise EngineError(f"{self.name}: {e}", retryable=False) from e
        return self._protocol

    async def server_version(self) -> str:
        return (await self.protocol()).version

    async def begin_weight_update(self) -> bool:
        """Open the server's weight-update session where its release has them (SGLang 0.5.23
        refuses tensor updates outside /begin_weight_update ... /end_weight_update; 0.5.17 has
        neither endpoint). True when one was opened."""
        if not (await self.protocol()).weight_update_session:
            return False
        await self._checked("/begin_weight_update", {})
        return True

    async def end_weight_update(self) -> None:
        if (await self.protocol()).weight_update_session:
            await self._checked("/end_weight_update", {})

    @contextlib.asynccontextmanager
    async def weight_update_session(self) -> AsyncIterator[None]:
        """A weight-update session around the body (none where the release has none), closed
        even when the body fails."""
        opened = await self.begin_weight_update()
        try:
            yield
        finally:
            if opened:
                await self.end_weight_update()

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, *, group_name: str = "weight_update_group",
                                        backend: str = "nccl") -> None:
        await self._checked("/init_weights_update_group", {
            "master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend})

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
                                              group_name: str = "weight_update_group", flush_cache: bool = True,
                                              weight_version: str | None = None,
                                              load_format: str | None = None) -> None:
        await self._checked("/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "flush_cache": flush_cache, "weight_version": weight_version, "load_format": load_format})

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        await self._checked("/destroy_weights_update_group", {"group_name": group_name})

    # ----------------------------------------------------------------- control
    def hold(self, tags: Sequence[str] | None = None) -> None:
        """Refuse to generate until `unhold` (a router's client while its servers are released)."""
        self._held.update(memory_tags(tags))

    def unhold(self, tags: Sequence[str] | None = None) -> None:
        self._held.difference_update(memory_tags(tags))

    @property
    def held(self) -> frozenset[str]:
        return frozenset(self._held)

    async def load(self) -> dict[str, int]:
        """Requests the server is running and has queued (summed over its data-parallel ranks,
        from `/v1/loads`)."""
        reply = await self._call("GET", "/v1/loads?include=core", None, timeout_s=30.0, retries=1)
        loads = reply.get("loads") if isinstance(reply, dict) else None
        if not isinstance(loads, list):
            raise EngineError(f"{self.name}: /v1/loads answered {str(reply)[:200]!r}", retryable=False)
        return {"running": sum(int(x.get("num_running_reqs", 0)) for x in loads),
                "waiting": sum(int(x.get("num_waiting_reqs", 0)) for x in loads)}

    async def drain(self, timeout_s: float | None = None, *, poll_s: float = 0.05) -> None:
        """Wait until this client's requests have ended and the server runs and queues none
        (requests cancelled on the client side may still be running in the server); raise
        EngineError naming what is left after `timeout_s`."""
        timeout_s = self.drain_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while self._inflight:
            if time.monotonic() > deadline:
                raise EngineError(f"{self.name}: {self._inflight} requests of this client still running after "
                                  f"{timeout_s:.0f} s", retryable=False)
            await asyncio.sleep(poll_s)
        if not (await self.protocol()).loads:
            return
        while True:
            load = await self.load()
            if not load["running"] and not load["waiting"]:
                return
            if time.monotonic() > deadline:
                raise EngineError(f"{self.name}: the server still runs {load['running']} and queues "
                                  f"{load['waiting']} requests", retryable=False)
            await asyncio.sleep(max(poll_s, 0.1))

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Stop generating, wait until the server is idle, then release `tags` (None: all)."""
        tags = memory_tags(tags)
        new = set(tags) - self._held
        self._held.update(tags)
        try:
            await self.drain()
            await self._call("POST", "/release_memory_occupation", {"tags": list(tags)},
                             timeout_s=self.admin_timeout_s, retries=0)
        except BaseException:
            self._held.difference_update(new)  # nothing was released: generation may go on
            raise

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        tags = memory_tags(tags)
        await self._call("POST", "/resume_memory_occupation", {"tags": list(tags)},
                         timeout_s=self.admin_timeout_s, retries=0)
        self._held.difference_update(tags)

    async def flush_cache(self) -> None:
        await self._call("POST", "/flush_cache", None, expect_json=False)

    async def health(self, *, timeout_s: float = 5.0) -> bool:
        """Whether the server answers. SGLang's /health runs one token through the scheduler,
        which dies when its memory is released (seen with 0.5.17): while anything is released
        the server's load report is asked instead."""
        path = "/health"
        if self._held:
            path = "/v1/loads?include=core" if (await self.protocol()).loads else "/server_info"
        try:
            await self._call("GET", path, None, timeout_s=timeout_s, retries=0, expect_json=False)
            return True
        except EngineError:
            return False

    async def health_generate(self, *, timeout_s: float = 60.0) -> bool:
        try:
            await self._call("GET", "/health_generate", None, timeout_s=timeout_s, retries=0, expect_json=False)
            return True
        except EngineError:
            return False

    async def get_model_info(self) -> dict[str, Any]:
        """/model_info (SGLang deprecates /get_model_info and warns on every call)."""
        return await self._call("GET", "/model_info", None)

    async def wait_healthy(self, timeout_s: float, *, poll_s: float = 1.0, is_alive: Any = None) -> None:
        """Poll /health until it answers 200; `is_alive()` False (a dead server process) or
        the timeout raise EngineError."""
        deadline = time.monotonic() + timeout_s
        while True:
            # each poll waits for SGLang's own answer, which takes a second at least (its /health
            # polls the scheduler once a second): a poll interval is no bound on an answer
            if await self.health(timeout_s=HEALTH_ANSWER_S):
                return
            if is_alive is not None and not is_alive():
                raise EngineError(f"{self.name}: server process exited before becoming healthy", retryable=False)
            if time.monotonic() > deadline:
                raise EngineError(f"{self.name}: not healthy after {timeout_s:.0f} s", retryable=False)
            await asyncio.sleep(poll_s)

    async def close_session(self) -> None:
        """Close this event loop's connection pool (callers that run each phase under its own
        `asyncio.run` call it before the loop ends); the next call opens a new one."""
        await self.close()

    async def close(self) -> None:
        stale, self._stale = self._stale, []
        for session in stale:
            if not session.closed:
                try:
                    await session.close()
                except RuntimeError:  # another event loop's
                    pass
        if self._session is not None and not self._session.closed:
            try:
                if self._loop is asyncio.get_running_loop():
                    await self._session.close()
            except RuntimeError:
                pass
        self._session = None


def _error_message(text: str) -> str:
    import json

    try:
        d = json.loads(text)
    except ValueError:
        return text[:500]
    if isinstance(d, dict):
        err = d.get("error", d.get("message", d))
        if isinstance(err, dict):
            return str(err.get("message", err))[:500]
        return str(err)[:500]
    return text[:500]


SGLangClient = HTTPEngine  # the same client talks to SGLang and to the embedded server

"""The rollout manager: prompts in, groups of sampled responses out.

`RolloutManager.generate(prompts)` turns every prompt into a group of n requests (one per
sample, each with its own derived seed), keeps at most `max_in_flight` requests in flight
across all engines (each request goes to the least-loaded engine, ties broken round-robin),
and shows a rich progress bar. Partial failures are handled explicitly: a failed request
is retried up to `max_retries` times with exponential backoff, on another engine when
there is one. An engine that stops answering its health check after a failure (its
process died) is restarted through `restart_engine` (once, whatever the number of its
requests that failed) and the lost requests retried, counted in `stats.retries` and
`stats.engine_restarts`. A request that still fails drops its whole group (its other requests are
cancelled) and counted in `stats.dropped_groups` - a dropped group never reaches the
scorer, so nothing is silently scored zero. Records come back in batch order (group,
then sample), complete groups only; a row drawn twice in one batch makes two groups, with
their own seeds and request ids.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .protocol import (
    Engine,
    EngineError,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutPrompt:
    """One prompt: `prompt_text` is the rendered chat prompt with one image placeholder per
    image (what SGLang's `text` expects), or `prompt_ids` its token ids."""

    index: int
    prompt_text: str | None = None
    images: tuple[str, ...] = ()
    answer: Any = None
    prompt_ids: tuple[int, ...] | None = None


@dataclass
class SampleRecord:
    prompt_index: int  # the dataset row
    sample_index: int
    group_index: int  # the prompt's position in the batch (a row drawn twice has two groups)
    prompt_ids: list[int] | None
    response_ids: list[int]
    text: str
    logprobs: list[float] | None
    finish_reason: str
    truncated: bool
    answer: Any = None
    engine: str = ""
    attempts: int = 1
    weight_version: str | None = None
    routed_experts: str | None = None  # the engine's wire form (`protocol.decode_routed_experts`)


@dataclass
class RolloutStats:
    prompts: int = 0
    requests: int = 0
    completed_groups: int = 0
    dropped_groups: int = 0
    dropped_prompt_indices: list[int] = field(default_factory=list)
    failed_attempts: int = 0
    retries: int = 0
    engine_restarts: int = 0
    # with `keep`: complete groups it refused; groups past the `need` kept ones that were
    # no longer needed (finished or cancelled); requests stopped on their engine (abort)
    rejected_groups: int = 0
    surplus_groups: int = 0
    aborted_requests: int = 0
    generated_tokens: int = 0
    truncated: int = 0
    seconds: float = 0.0
    per_engine: dict[str, int] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"prompts": self.prompts, "requests": self.requests, "completed_groups": self.completed_groups,
                "dropped_groups": self.dropped_groups, "failed_attempts": self.failed_attempts,
                "retries": self.retries, "engine_restarts": self.engine_restarts,
                "rejected_groups": self.rejected_groups, "surplus_groups": self.surplus_groups,
                "aborted_requests": self.aborted_requests,
                "generated_tokens": self.generated_tokens, "truncated": self.truncated,
                "seconds": self.seconds, "tokens_per_s": self.tokens_per_s}


@dataclass
class RolloutBatch:
    records: list[SampleRecord]
    stats: RolloutStats
    rejected: list[SampleRecord] = field(default_factory=list)  # complete groups `keep` refused

    def groups(self) -> dict[int, list[SampleRecord]]:
        """Records by group (the prompt's position in the batch)."""
        out: dict[int, list[SampleRecord]] = defaultdict(list)
        for r in self.records:
            out[r.group_index].append(r)
        return dict(out)


def sample_seed(base_seed: int, step: int, prompt_index: int, sample_index: int, occurrence: int = 0) -> int:
    """A stable 31-bit seed per (run seed, step, prompt, sample); `occurrence` counts earlier
    draws of the same row in the batch, so a row drawn twice gets two different groups."""
    key = f"{base_seed}/{step}/{prompt_index}/{sample_index}" + (f"/{occurrence}" if occurrence else "")
    h = hashlib.blake2b(key.encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") & 0x7FFFFFFF


def request_id(prefix: str, step: int, group: int, prompt_index: int, sample_index: int) -> str:
    """A request id unique within a run: SGLang refuses an id that is already in flight
    (HTTP 400, "Duplicate request ID"), and a row can be drawn twice in one batch."""
    return f"{prefix}-s{step}-g{group}-p{prompt_index}-n{sample_index}"


class _Group:
    def __init__(self, prompt: RolloutPrompt, n: int, position: int) -> None:
        self.prompt = prompt
        self.position = position
        self.results: list[tuple[GenerateResult, str, int] | None] = [None] * n
        self.dropped = False
        self.surplus = False  # past the groups a `need` asked for: cancelled or ignored
        self.kept: bool | None = None  # decided once complete (`keep`)
        self.records: list[SampleRecord] | None = None
        self.tasks: list[asyncio.Task] = []


class RolloutManager:
    """See the module docstring. `engines` are `Engine`s (HTTP clients, Ray or local engines)."""

    def __init__(
        self,
        engines: Sequence[Engine],
        *,
        n_samples: int = 1,
        sampling: SamplingParams | None = None,
        max_in_flight: int = 256,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        backoff_max_s: float = 10.0,
        request_timeout_s: float | None = None,
        seed: int = 0,
        progress: bool = True,
        restart_engine: Callable[[int], Awaitable[None]] | None = None,
        return_routed_experts: bool = False,
    ) -> None:
        if not engines:
            raise ValueError("RolloutManager needs at least one engine")
        # called with an engine's index when a request failed on it and it no longer answers
        # its health check (the process died): brings it back with the current weights
        self.restart_engine = restart_engine
        self._incarnation = [0] * len(engines)  # restarts of each engine so far
        self.engines = list(engines)
        self.n_samples = int(n_samples)
        self.sampling = sampling or SamplingParams()
        self.max_in_flight = max(1, int(max_in_flight))
        self.max_retries = max(0, int(max_retries))
        self.backoff_s = float(backoff_s)
        self.backoff_max_s = float(backoff_max_s)
        self.request_timeout_s = request_timeout_s
        self.seed = int(seed)
        self.progress = progress
        # ask the engines for each token's experts (MoE routing replay / mismatch)
        self.return_routed_experts = bool(return_routed_experts)
        self._inflight = [0] * len(self.engines)
        self._rr = 0
        # request ids: unique per manager (train and eval managers share engines) and run
        self.rid_prefix = f"r{uuid.uuid4().hex[:8]}"

    @classmethod
    def from_config(cls, engines: Sequence[Engine], rollout: Any, *, n_samples: int, seed: int = 0,
                    progress: bool = True, eval_mode: bool = False,
                    restart_engine: Callable[[int], Awaitable[None]] | None = None,
                    return_routed_experts: bool = False) -> RolloutManager:
        """From a `RolloutConfig` section (eval: rollout.eval's temperature / n / length)."""
        max_new = rollout.max_new_tokens
        temperature = rollout.temperature
        if eval_mode:
            temperature = rollout.eval.temperature
            max_new = rollout.eval.max_new_tokens or rollout.max_new_tokens
            n_samples = rollout.eval.n_samples_per_prompt
        sampling = SamplingParams(temperature=temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                                  max_new_tokens=max_new, stop=tuple(rollout.stop),
                                  stop_token_ids=tuple(rollout.stop_token_ids))
        return cls(engines, n_samples=n_samples, sampling=sampling, max_in_flight=rollout.max_in_flight,
                   max_retries=rollout.max_retries, request_timeout_s=rollout.request_timeout_s, seed=seed,
                   progress=progress, restart_engine=restart_engine, return_routed_experts=return_routed_experts)

    # ----------------------------------------------------------------- dispatch
    def _pick(self, exclude: set[int]) -> int:
        n = len(self.engines)
        candidates = [i for i in range(n) if i not in exclude] or list(range(n))
        start = self._rr
        self._rr = (self._rr + 1) % n
        return min(candidates, key=lambda i: (self._inflight[i], (i - start) % n))

    def _backoff(self, attempt: int) -> float:
        return min(self.backoff_max_s, self.backoff_s * (2 ** attempt)) * (0.5 + random.random() / 2)

    async def _recover(self, i: int, incarnation: int, stats: RolloutStats, locks: list[asyncio.Lock]) -> bool:
        """After a failure on engine i: if it no longer answers its health check, restart it
        (once, however many of its requests failed: the first to get the lock restarts, the
        others find a newer incarnation). True when the engine is (again) usable."""
        if self.restart_engine is None:
            return False
        if await engine_answers(self.engines[i]):
            return False  # the engine is up: an ordinary failure, retried as such
        async with locks[i]:
            if self._incarnation[i] == incarnation:
                log.warning("engine %s is down: restarting it", self.engines[i].name)
                await self.restart_engine(i)
                self._incarnation[i] += 1
                stats.engine_restarts += 1
        return True

    @staticmethod
    def _abort_later(engine: Engine, rid: str | None, stats: RolloutStats, aborts: list[asyncio.Future]) -> None:
        """Ask `engine` to stop request `rid` (its caller gave up on it), without waiting: the
        call joins `aborts`, which `generate` awaits before it returns."""
        if rid is None or not hasattr(engine, "abort_requests"):
            return
        stats.aborted_requests += 1

        async def abort() -> None:
            try:
                await engine.abort_requests([rid])
            except Exception as e:  # noqa: BLE001 (best effort: the engine may be gone)
                log.debug("abort of %s on %s failed: %s", rid, getattr(engine, "name", engine), e)

        aborts.append(asyncio.ensure_future(abort()))

    async def _one(self, req: GenerateRequest, sem: asyncio.Semaphore, stats: RolloutStats,
                   locks: list[asyncio.Lock], aborts: list[asyncio.Future]) -> tuple[GenerateResult, str, int]:
        failed_on: set[int] = set()
        attempt = 0
        while True:
            async with sem:
                i = self._pick(failed_on)
                engine = self.engines[i]
                incarnation = self._incarnation[i]
                self._inflight[i] += 1
                # a retry gets its own id: the engine may still hold the failed attempt's
                sent = req if not attempt or req.rid is None else req.replace(rid=f"{req.rid}-r{attempt}")
                try:
                    call = engine.generate([sent])
                    if self.request_timeout_s:
                        call = asyncio.wait_for(call, self.request_timeout_s)
                    result = (await call)[0]
                    return result, engine.name, attempt + 1
                except asyncio.CancelledError:
                    self._abort_later(engine, sent.rid, stats, aborts)  # no longer needed: stop it there
                    raise
                except Exception as e:  # noqa: BLE001
                    err = e
                    if isinstance(e, asyncio.TimeoutError):
                        self._abort_later(engine, sent.rid, stats, aborts)
                finally:
                    self._inflight[i] -= 1
            stats.failed_attempts += 1
            retryable = getattr(err, "retryable", True)
            log.warning("request (rid=%s) failed on %s (attempt %d): %s", req.rid, engine.name, attempt + 1, err)
            if not retryable or attempt >= self.max_retries:
                raise err
            if await self._recover(i, incarnation, stats, locks):
                failed_on.discard(i)  # restarted: as good as new
            else:
                failed_on.add(i)
            if len(failed_on) == len(self.engines):
                failed_on.clear()
            stats.retries += 1
            await asyncio.sleep(self._backoff(attempt))
            attempt += 1

    async def generate(self, prompts: Sequence[Any], *, n_samples: int | None = None,
                       sampling: SamplingParams | None = None, step: int = 0,
                       description: str = "rollout",
                       keep: Callable[[list[SampleRecord]], Awaitable[bool]] | None = None,
                       need: int | None = None, first_position: int = 0,
                       seen: dict[int, int] | None = None) -> RolloutBatch:
        """Generate `n` samples for each prompt (see the module docstring).

        `keep` (async, given a complete group's records) decides, as each group completes,
        whether the batch keeps it; refused groups come back in `rejected`. With `need`, the
        batch is the first `need` kept groups in draw order: once every group up to the
        `need`-th kept one is decided, the later groups are no longer needed, their requests
        are cancelled and aborted on their engines (`stats.surplus_groups`,
        `stats.aborted_requests`). `first_position` numbers this call's groups after those of
        earlier calls of the same step, and `seen` (row -> draws so far in the step, updated)
        carries the draws of earlier calls, so that a row drawn again gets new seeds and ids."""
        n = self.n_samples if n_samples is None else int(n_samples)
        base = sampling or self.sampling
        t0 = time.perf_counter()
        stats = RolloutStats(prompts=len(prompts), requests=len(prompts) * n)
        sem = asyncio.Semaphore(self.max_in_flight)
        locks = [asyncio.Lock() for _ in self.engines]  # one restart at a time per engine
        groups: list[_Group] = []
        progress, task_id = self._progress(description, len(prompts) * n)
        aborts: list[asyncio.Future] = []  # abort calls of this batch, awaited before it returns
        enough = asyncio.Event()

        def cut() -> int | None:
            """The list index of the `need`-th kept group when every group up to it is decided."""
            kept = 0
            for k, g in enumerate(groups):
                if g.kept is None and not g.dropped:
                    return None
                kept += bool(g.kept)
                if need is not None and kept >= need:
                    return k
            return None

        def stop_after(k: int) -> None:
            for g in groups[k + 1:]:
                g.surplus = True
                for t in g.tasks:
                    if not t.done():
                        t.cancel()
            enough.set()

        def stop_if_enough() -> None:
            if need is not None and not enough.is_set():
                k = cut()
                if k is not None:
                    stop_after(k)

        async def decide(g: _Group) -> None:
            g.records = self._records(g)
            g.kept = True if keep is None else bool(await keep(g.records))
            stop_if_enough()

        async def run(g: _Group, j: int, req: GenerateRequest) -> None:
            try:
                g.results[j] = await self._one(req, sem, stats, locks, aborts)
                if all(r is not None for r in g.results) and not g.surplus:
                    await decide(g)
            except asyncio.CancelledError:
                return
            except Exception as e:  # noqa: BLE001
                if not g.dropped:
                    g.dropped = True
                    stats.dropped_groups += 1
                    stats.dropped_prompt_indices.append(int(g.prompt.index))
                    log.error("dropping group of prompt %s: %s", g.prompt.index, e)
                    for t in g.tasks:
                        if t is not asyncio.current_task() and not t.done():
                            t.cancel()
                    stop_if_enough()
            finally:
                if progress is not None:
                    progress.advance(task_id)

        seen = seen if seen is not None else defaultdict(int)  # draws of each row so far in this step
        try:
            for offset, p in enumerate(prompts):
                g = _Group(_as_prompt(p), n, first_position + offset)
                groups.append(g)
                index = int(g.prompt.index)
                occurrence = seen.get(index, 0)
                seen[index] = occurrence + 1
                for j in range(n):
                    sp = base
                    if base.seed is None and not base.greedy:
                        sp = _with_seed(base, sample_seed(self.seed, step, index, j, occurrence))
                    req = GenerateRequest(
                        text=g.prompt.prompt_text if g.prompt.prompt_ids is None else None,
                        input_ids=g.prompt.prompt_ids,
                        images=tuple(g.prompt.images),
                        sampling=sp,
                        rid=request_id(self.rid_prefix, step, g.position, index, j),
                        return_routed_experts=self.return_routed_experts,
                    )
                    g.tasks.append(asyncio.ensure_future(run(g, j, req)))
            if need is not None and need <= 0:
                stop_after(-1)
            await asyncio.gather(*(t for g in groups for t in g.tasks), return_exceptions=True)
        finally:
            if progress is not None:
                progress.stop()
            for g in groups:
                for t in g.tasks:
                    if not t.done():
                        t.cancel()
            if aborts:  # the engines stop what nobody waits for any more
                await asyncio.wait(aborts, timeout=30)

        records: list[SampleRecord] = []
        rejected: list[SampleRecord] = []
        per_engine: dict[str, int] = defaultdict(int)
        for g in groups:
            if g.surplus:
                stats.surplus_groups += 1
                continue
            if g.dropped or g.records is None:
                if not g.dropped:  # cancelled from outside: count it too
                    stats.dropped_groups += 1
                    stats.dropped_prompt_indices.append(int(g.prompt.index))
                continue
            for r in g.records:
                per_engine[r.engine] += 1
                stats.generated_tokens += len(r.response_ids)
                stats.truncated += int(r.truncated)
            if g.kept:
                stats.completed_groups += 1
                records.extend(g.records)
            else:
                stats.rejected_groups += 1
                rejected.extend(g.records)
        stats.per_engine = dict(per_engine)
        stats.seconds = time.perf_counter() - t0
        return RolloutBatch(records, stats, rejected)

    @staticmethod
    def _records(g: _Group) -> list[SampleRecord]:
        """A complete group's records, in sample order."""
        out = []
        for j, item in enumerate(g.results):
            assert item is not None
            res, engine_name, attempts = item
            out.append(SampleRecord(
                prompt_index=int(g.prompt.index),
                sample_index=j,
                group_index=g.position,
                prompt_ids=res.prompt_ids if res.prompt_ids is not None else (
                    list(g.prompt.prompt_ids) if g.prompt.prompt_ids is not None else None),
                response_ids=list(res.output_ids),
                text=res.text,
                logprobs=res.logprobs,
                finish_reason=res.finish_reason,
                truncated=res.truncated,
                answer=g.prompt.answer,
                engine=engine_name,
                attempts=attempts,
                weight_version=res.weight_version,
                routed_experts=res.routed_experts,
            ))
        return out

    def run(self, prompts: Sequence[Any], **kwargs: Any) -> RolloutBatch:
        """Synchronous `generate` (its own event loop; HTTP engines' connections are closed
        with it)."""
        async def go() -> RolloutBatch:
            try:
                return await self.generate(prompts, **kwargs)
            finally:
                await close_sessions(self.engines)

        return asyncio.run(go())

    def _progress(self, description: str, total: int) -> tuple[Any, Any]:
        if not self.progress or total == 0:
            return None, None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), transient=True)
        task_id = progress.add_task(description, total=total)
        progress.start()
        return progress, task_id

    # ----------------------------------------------------------------- fan-out helpers
    async def update_weights(self, named_tensors: Sequence[tuple[str, Any]], *, bucket_bytes: int | None,
                             weight_version: str | None = None) -> None:
        """Send the same weights to every engine (concurrently)."""
        await asyncio.gather(*(e.update_weights_from_tensor(named_tensors, bucket_bytes=bucket_bytes,
                                                            weight_version=weight_version) for e in self.engines))

    async def release_memory(self, tags: Sequence[str] | None = None) -> None:
        await asyncio.gather(*(e.release_memory_occupation(tags) for e in self.engines))

    async def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        await asyncio.gather(*(e.resume_memory_occupation(tags) for e in self.engines))


async def engine_answers(engine: Any, *, alive: bool = False, timeout_s: float = 10.0) -> bool:
    """Whether the engine answers its health check; with `alive`, whether its process answers
    at all, where the client can tell (an embedded engine is unhealthy while its memory is
    released, and alive). No answer in `timeout_s` is no."""
    probe = getattr(engine, "alive", None) if alive else None
    try:
        return bool(await asyncio.wait_for((probe or engine.health)(), timeout_s))
    except Exception:  # noqa: BLE001 (no answer is unhealthy)
        return False


async def close_sessions(engines: Sequence[Any]) -> None:
    """Close the per-event-loop connection pools of the engines that keep one."""
    await asyncio.gather(*(e.close_session() for e in engines if hasattr(e, "close_session")),
                         return_exceptions=True)


def _with_seed(sp: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(sp, seed=seed)


def _as_prompt(p: Any) -> RolloutPrompt:
    """Duck-typed prompts: anything with index, prompt_text (or prompt_ids), images, answer."""
    if isinstance(p, RolloutPrompt):
        return p
    if isinstance(p, dict):
        get = p.get
    else:
        def get(k: str, default: Any = None) -> Any:
            return getattr(p, k, default)
    ids = get("prompt_ids", None)
    text = get("prompt_text", None)
    if text is None and ids is None:
        raise EngineError(f"prompt {get('index', '?')} has neither prompt_text nor prompt_ids", retryable=False)
    images = get("images", ()) or ()
    if isinstance(images, str):
        images = (images,)
    return RolloutPrompt(index=int(get("index", 0)), prompt_text=text, images=tuple(images), answer=get("answer", None),
                         prompt_ids=None if ids is None else tuple(int(t) for t in ids))

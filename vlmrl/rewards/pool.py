"""Batch scoring off the training step's critical path, with a hard per-call timeout.

The verifiers are bounded by construction, but a reward is computed for every sample
of every step, and one pathological call must never stall a step. :class:`RewardPool`
runs a scorer in worker processes, one call at a time per worker, and gives each call
``timeout_s`` seconds. A call whose worker overruns (killed) or dies is counted in
:attr:`RewardPool.stats`, the worker is replaced, and the pair is scored once more on
another worker (a crash or a stall of the process need not be the input's fault); if that
fails too the pair scores 0.0. A call that raises scores 0.0 and is counted as an error.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

logger = logging.getLogger(__name__)

Scorer = Callable[[str, str], float]

_READY = "ready"


@dataclass
class PoolStats:
    """Running totals since the pool started."""

    calls: int = 0
    timeouts: int = 0  # calls that overran timeout_s (each attempt)
    errors: int = 0  # calls that raised, or whose worker died on the last attempt
    restarts: int = 0  # workers replaced
    retries: int = 0  # pairs scored again after their worker overran or died


class RewardPool:
    """Score ``(response, answer)`` pairs with ``scorer`` in a process pool.

    Args:
        scorer: a picklable callable ``(response, answer) -> float``, usually a
            :class:`~vlmrl.rewards.base.Verifier`.
        num_workers: worker processes; 0 scores inline in the calling thread, where a
            call cannot be interrupted: an overrun still scores 0.0 and counts as a
            timeout, but only once it returns. Defaults to ``scorer.num_workers``, else 0.
        timeout_s: hard limit on one call. Defaults to ``scorer.timeout_s``, else 1.0.
        start_method: multiprocessing start method; ``spawn`` (default) and
            ``forkserver`` are safe in processes that hold threads or CUDA state.
        startup_timeout_s: how long a new worker may take to become ready.

    Use it as a context manager, or call :meth:`close`. Calls are serialised: concurrent
    :meth:`score`/:meth:`ascore` calls from several threads or tasks queue up.
    """

    def __init__(
        self,
        scorer: Scorer,
        *,
        num_workers: int | None = None,
        timeout_s: float | None = None,
        start_method: str = "spawn",
        startup_timeout_s: float = 60.0,
    ) -> None:
        self.scorer = scorer
        self.num_workers = num_workers if num_workers is not None else getattr(scorer, "num_workers", 0)
        self.timeout_s = timeout_s if timeout_s is not None else getattr(scorer, "timeout_s", 1.0)
        if self.num_workers < 0:
            raise ValueError(f"RewardPool: num_workers must be >= 0, got {self.num_workers}")
        if not self.timeout_s > 0:
            raise ValueError(f"RewardPool: timeout_s must be > 0, got {self.timeout_s}")
        self.stats = PoolStats()
        self._startup_timeout_s = startup_timeout_s
        self._context = multiprocessing.get_context(start_method)
        self._lock = threading.Lock()
        self._closed = False
        self._workers = [_Worker(self._context, scorer) for _ in range(self.num_workers)]
        try:
            self._run([], [], [])  # wait until every worker is ready
        except BaseException:
            self.close()
            raise

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> list[float]:
        """Scores in input order; a call that times out or raises scores 0.0."""
        if len(responses) != len(answers):
            raise ValueError(f"RewardPool.score: {len(responses)} responses but {len(answers)} answers")
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardPool is closed")
            self.stats.calls += len(responses)
            scores = [0.0] * len(responses)
            if self._workers:
                self._run(responses, answers, scores)
            else:
                for index, (response, answer) in enumerate(zip(responses, answers)):
                    scores[index] = self._score_inline(response, answer)
            return scores

    async def ascore(self, responses: Sequence[str], answers: Sequence[str]) -> list[float]:
        """:meth:`score` in a thread, so the event loop keeps running meanwhile."""
        return await asyncio.to_thread(self.score, responses, answers)

    def close(self) -> None:
        """Stop the workers; idempotent. Waits for a call in progress to finish."""
        with self._lock:
            self._closed = True
            workers, self._workers = self._workers, []
        for worker in workers:
            worker.stop()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _score_inline(self, response: str, answer: str) -> float:
        start = time.perf_counter()
        try:
            value = float(self.scorer(response, answer))
        except Exception:
            self.stats.errors += 1
            logger.warning("reward call raised; scoring 0.0", exc_info=True)
            return 0.0
        elapsed = time.perf_counter() - start
        if elapsed > self.timeout_s:
            self.stats.timeouts += 1
            logger.warning("reward call took %.2f s (limit %.2f s); scoring 0.0", elapsed, self.timeout_s)
            return 0.0
        return value

    def _run(self, responses: Sequence[str], answers: Sequence[str], scores: list[float]) -> None:
        """Dispatch every pair to ready workers, enforce deadlines, fill ``scores``.

        Returns once all pairs are scored and every worker (replacements included) is
        ready, so the next call starts with a full pool.
        """
        pending = deque(range(len(responses)))
        running: dict[_Worker, tuple[int, float]] = {}  # worker -> (pair index, deadline)
        retried: set[int] = set()

        def again(index: int) -> bool:
            """Queue the pair once more (first failure of its worker); False: it scores 0."""
            if index in retried:
                return False
            retried.add(index)
            self.stats.retries += 1
            pending.appendleft(index)
            return True

        while True:
            for worker in self._workers:
                if pending and worker.ready and worker not in running:
                    index = pending[0]
                    if worker.submit(responses[index], answers[index]):
                        pending.popleft()
                        running[worker] = (index, time.monotonic() + self.timeout_s)
                    else:  # died while idle; the pair goes to another worker
                        self._replace(worker, "exited while idle")
            starting = [worker for worker in self._workers if not worker.ready]
            if not (pending or running or starting):
                return
            deadlines = [deadline for _, deadline in running.values()]
            deadlines += [worker.started + self._startup_timeout_s for worker in starting]
            by_connection = {worker.connection: worker for worker in (*running, *starting)}
            ready = wait(list(by_connection), timeout=max(0.0, min(deadlines) - time.monotonic()))
            for connection in ready:
                worker = by_connection[connection]
                try:
                    message = connection.recv()
                except (EOFError, OSError):
                    message = None
                if not worker.ready:
                    if message != _READY:
                        raise RuntimeError(f"reward worker failed to start (exit code {worker.exitcode()})")
                    worker.ready = True
                    continue
                index, _ = running.pop(worker)
                if message is None:
                    self._replace(worker, f"died while scoring (exit code {worker.exitcode()})")
                    if not again(index):
                        self.stats.errors += 1
                elif message[0]:
                    scores[index] = message[1]
                else:
                    self.stats.errors += 1
                    logger.warning("reward call raised %s; scoring 0.0", message[1])
            now = time.monotonic()
            for worker in starting:
                if not worker.ready and now >= worker.started + self._startup_timeout_s:
                    raise RuntimeError(f"reward worker not ready after {self._startup_timeout_s} s")
            for worker, (_, deadline) in list(running.items()):
                if now >= deadline:
                    index, _ = running.pop(worker)
                    self.stats.timeouts += 1
                    retry = again(index)
                    self._replace(worker, f"exceeded the {self.timeout_s} s limit; "
                                          + ("scoring the pair again" if retry else "scoring 0.0"))

    def _replace(self, worker: _Worker, reason: str) -> None:
        logger.warning("reward worker %s %s; replacing it", worker.pid, reason)
        worker.kill()
        self._workers[self._workers.index(worker)] = _Worker(self._context, self.scorer)
        self.stats.restarts += 1


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, context: multiprocessing.context.BaseContext, scorer: Scorer) -> None:
        self.connection, child_end = context.Pipe()
        self.process = context.Process(
            target=_serve, args=(child_end, scorer), name="vlmrl-reward-worker", daemon=True
        )
        self.process.start()
        child_end.close()
        self.started = time.monotonic()
        self.ready = False

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def exitcode(self) -> int | None:
        self.process.join(timeout=0.1)
        return self.process.exitcode

    def submit(self, response: str, answer: str) -> bool:
        try:
            self.connection.send((response, answer))
        except OSError:
            return False
        return True

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.connection.close()

    def stop(self, grace_s: float = 1.0) -> None:
        try:
            self.connection.send(None)
        except OSError:
            pass
        self.process.join(grace_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.connection.close()


def _serve(connection: Connection, scorer: Scorer) -> None:
    """Worker loop: answer ``(response, answer)`` requests until ``None`` or EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    connection.send(_READY)
    while True:
        try:
            request = connection.recv()
        except EOFError:
            return
        if request is None:
            return
        try:
            reply = (True, float(scorer(*request)))
        except Exception as error:
            reply = (False, f"{type(error).__name__}: {error}")
        connection.send(reply)

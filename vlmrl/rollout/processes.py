"""The processes a run starts beside its Ray actors (SGLang servers, the router): each in a
session of its own, so that a stop ends it with its children, and, on Linux, tied to the
process that started it, so that a killed job leaves none of them holding a GPU or a port;
and the check that a server's port is free before it starts.

The session alone would keep a server alive past a killed job: on the H200 a job stopped by
its time limit left its SGLang server on port 15000, where it answered the next run's
/health and refused that run's key. Ray stops a worker's children when it stops the worker,
not when the worker's process is killed under it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could listen on `host`:`port` now (a port left in TIME_WAIT counts as free)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, int(port)))
        except OSError:
            return False
    return True


def wait_port_free(host: str, port: int, timeout_s: float = 10.0, poll_s: float = 0.5, *, moved_by: str = "") -> None:
    """Return once `host`:`port` is free; RuntimeError naming it (and `moved_by`, the setting
    that moves it) after `timeout_s`. Another process there, often a server an earlier run or a killed
    job left behind, would answer /health in place of the server about to start, and refuse
    the run's key on everything else."""
    deadline = time.monotonic() + timeout_s
    while not port_is_free(host, port):
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"port {port} on {host} is already in use, so the server cannot listen there: another "
                f"process holds it (a server left by an earlier run or a killed job? `ss -ltnp 'sport = :{port}'` "
                f"names it). Stop it" + (f", or move the server with {moved_by}" if moved_by else "") + ".")
        time.sleep(poll_s)


# Run before the command (by exec, so the command keeps the pid): ask Linux to SIGKILL this
# process when the thread that started it dies, and give up if that parent is gone already.
# Elsewhere prctl does not exist and the command runs unguarded.
_DIE_WITH_PARENT = (
    "import ctypes, os, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL\n"
    "except (AttributeError, OSError):\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('vlmrl: the process that started this one is gone')\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n")
# One long-lived thread starts every process: Linux sends the parent-death signal when the
# starting *thread* ends, and callers (Ray actor methods) may run on short-lived threads.
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlmrl-spawn")


class ManagedProcess:
    """A child process in its own session; `stop` ends that session only (our children).

    The session keeps a server's children together for `stop`, and would also keep it alive
    past a killed job (a server left holding the GPU and its port). So the child dies with
    the process that started it (`die_with_parent`, Linux): a Ray actor killed with its job
    takes its server along."""

    def __init__(self, command: list[str], *, env: dict[str, str] | None = None, log_path: str | Path | None = None,
                 die_with_parent: bool = True):
        self.command = command
        self.env = env
        self.log_path = Path(log_path) if log_path else None
        self.die_with_parent = die_with_parent
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        out: Any = subprocess.DEVNULL
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            out = open(self.log_path, "ab")  # noqa: SIM115 (kept open for the child)
        cmd = list(self.command)
        if self.die_with_parent:  # -I: the guard reads nothing from the command's PYTHONPATH
            cmd = [sys.executable, "-I", "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd]
        self.proc = _SPAWNER.submit(subprocess.Popen, cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True).result()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> None:
        """End the session: SIGTERM to its group, SIGKILL after `timeout_s`. Where the leader
        has died already (a server killed mid-rollout), what it left in its group (SGLang's
        scheduler and detokenizer, holding GPU memory) is killed."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # the session start_new_session created: its group id is the leader's pid
        if self.proc.poll() is not None:
            with contextlib.suppress(ProcessLookupError):  # nothing left in the group
                os.killpg(pgid, signal.SIGKILL)
            return
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

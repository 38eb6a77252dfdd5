"""Fault injection, for tests of what the loop survives.

`VLMRL_FAULT_KILL_ENGINE="<n>:<marker file>"` in the environment of an embedded engine's
process makes it kill itself with SIGKILL (no cleanup, as an out-of-memory kill or a node
failure would) when its n-th generate request arrives, with requests still in flight.
`VLMRL_FAULT_KILL_ENGINE_ON_RELEASE="<n>:<marker file>"` does the same at its n-th
release_memory_occupation call, before releasing anything (SGLang's scheduler has died there:
bench/results/learning-precision.md). `VLMRL_FAULT_KILL_ENGINE_ON_SYNC="<n>:<marker file>"` does it
at its n-th weight update (a bucket of a sync), after taking the bucket in. Each does so once: it
writes the marker file first, and a restarted engine that finds the file lives on. Unset, nothing
happens.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

KILL_ENGINE_ENV = "VLMRL_FAULT_KILL_ENGINE"
KILL_ENGINE_ON_RELEASE_ENV = "VLMRL_FAULT_KILL_ENGINE_ON_RELEASE"
KILL_ENGINE_ON_SYNC_ENV = "VLMRL_FAULT_KILL_ENGINE_ON_SYNC"


class KillSwitch:
    """Counts generate requests and SIGKILLs this process at the configured one."""

    def __init__(self, after: int, marker: Path) -> None:
        self.after, self.marker, self.seen = int(after), Path(marker), 0

    @classmethod
    def from_env(cls, var: str = KILL_ENGINE_ENV) -> KillSwitch | None:
        spec = os.environ.get(var)
        if not spec:
            return None
        after, _, marker = spec.partition(":")
        if not after.isdigit() or not marker:
            raise ValueError(f"{var}={spec!r}: expected '<count>:<marker file>'")
        return None if Path(marker).exists() else cls(int(after), Path(marker))

    def count(self, requests: int) -> None:
        self.seen += requests
        if self.seen >= self.after and not self.marker.exists():
            self.marker.parent.mkdir(parents=True, exist_ok=True)
            self.marker.write_text(f"{os.getpid()}\n")
            os.kill(os.getpid(), signal.SIGKILL)

"""The ranks' rendezvous: the launcher serves the store, no rank binds a port of its own.

A CI run failed when rank 0 bound a port its launcher had found free and released: an
outgoing connection took it in between (EADDRINUSE). `spawn_local` and the Ray trainer group
now serve the store on a port the OS hands them while they listen, and the ranks join it as
clients; a lone process with no MASTER_PORT serves its own the same way.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from vlmrl.training.parallel_state import LAUNCHER_STORE, host_store, spawn_local

ROOT = Path(__file__).resolve().parents[2]


def _ranks_meet(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return {"sum": float(t), "port": os.environ["MASTER_PORT"], "launcher": os.environ.get(LAUNCHER_STORE)}


def test_spawned_ranks_join_the_launchers_store():
    res = spawn_local(_ranks_meet, 3, timeout_s=120)
    assert [r["sum"] for r in res] == [6.0] * 3
    assert len({r["port"] for r in res}) == 1
    assert all(r["launcher"] == "1" for r in res)


_CHILD = """
import os, sys, torch.distributed as dist
from vlmrl.training.parallel_state import init_distributed
init_distributed("gloo", timeout_s=30)
if os.environ.get("VLMRL_LAUNCHER_STORE") == "1":
    dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False).set("child", "up")
print("world", dist.get_world_size(), "port", os.environ["MASTER_PORT"], flush=True)
dist.destroy_process_group()
"""


def _child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", LAUNCHER_STORE)}
    return {**env, **extra}


def test_one_process_serves_its_own_store_on_an_os_port():
    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120,
                          env=_child_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    words = proc.stdout.split()
    assert words[:2] == ["world", "1"] and int(words[3]) > 0


def test_a_rank_joins_the_store_its_launcher_serves():
    store = host_store(timeout_s=60)
    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=_child_env(MASTER_PORT=str(store.port), MASTER_ADDR="127.0.0.1", RANK="0",
                                         WORLD_SIZE="1", **{LAUNCHER_STORE: "1"}))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[3] == str(store.port)
    assert store.get("child") == b"up"  # the child wrote into this process's store

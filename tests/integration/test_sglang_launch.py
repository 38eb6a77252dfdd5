"""Starting SGLang engines under Ray, up to where a GPU and SGLang itself are needed: each
engine actor sits in its placement-group bundle, waits are bounded, a missing or unknown
SGLang release is refused by name, and nothing is left running after a failure. (The real
server: tests/gpu/test_sglang_gpu.py.)"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest

from vlmrl.config.layout import EngineSlot
from vlmrl.rollout.sglang import check_sglang_version, engine_gpu_request, installed_sglang_version


def _cfg(tmp_path, *extra):
    from vlmrl.config import load

    return load([f"run_dir={tmp_path}", "rollout=sglang", "model=tiny_qwen3_5_moe", "cluster.num_cpu_ranks=1",
                 "rollout.sglang.startup_timeout_s=8", *extra], check_rules=False)


@pytest.fixture(scope="module")
def ray_cpu():
    import os

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _placement(ray, bundles):
    from ray.util.placement_group import placement_group

    from vlmrl.cluster.placement import Placement

    group = placement_group(bundles, strategy="PACK")
    ray.get(group.ready(), timeout=60)
    return Placement(group, trainer_bundles=[], engine_bundles=list(range(len(bundles))))


def _take_bundle(ray, placement, cpus: float) -> object:
    """An actor holding `cpus` CPUs of bundle 0, once Ray has placed it."""

    @ray.remote(num_cpus=cpus)
    class Holder:
        def ready(self):
            return True

    holder = Holder.options(scheduling_strategy=placement.strategy(0)).remote()
    assert ray.get(holder.ready.remote(), timeout=30)
    return holder


def test_versions_are_read_without_import_and_checked_against_the_contracts():
    from vlmrl.contracts.sglang_contract import known_versions

    with pytest.raises(RuntimeError, match="sglang is not installed for"):
        installed_sglang_version(sys.executable)
    newest = known_versions()[-1]
    assert check_sglang_version([newest, newest], None) == newest
    assert check_sglang_version([newest], newest) == newest
    with pytest.raises(ValueError, match="different releases"):
        check_sglang_version(list(known_versions()[:2]), None) if len(known_versions()) > 1 else \
            check_sglang_version(["0.0.1", newest], None)
    with pytest.raises(ValueError, match="rollout.sglang.version=0.5.17"):
        check_sglang_version(["0.5.23"], "0.5.17")
    with pytest.raises(ValueError, match=r"sglang 0\.5\.20 is not a release vlmrl has run.*tested: " +
                       ", ".join(v.replace(".", r"\.") for v in known_versions())):
        check_sglang_version(["0.5.20"], None)


def test_servers_start_without_sglangs_image_feature_cache(tmp_path):
    """SGLang keeps each image's vision-tower features across weight updates (seen on the H200);
    the tower trains, so every server vlmrl starts has the cache off, whatever else the run's
    rollout.sglang.env says, and validation refuses turning it back on."""
    from vlmrl.rollout.sglang import VLM_CACHE_ENV, SGLangServerActor

    env = SGLangServerActor([1], log_path=str(tmp_path / "s.log"), env={"PYTHONPATH": "/opt/sg"})._env()
    assert env[VLM_CACHE_ENV] == "0" and env["CUDA_VISIBLE_DEVICES"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == "/opt/sg"  # the run's env first (vlmrl's loader after it)


def test_engine_actors_ask_for_a_share_of_their_bundle(tmp_path):
    cfg = _cfg(tmp_path)
    assert engine_gpu_request(cfg.rollout, colocate=True) == 0.2  # beside a trainer rank's 0.5
    assert engine_gpu_request(cfg.rollout, colocate=False) == 1.0  # its bundle (one GPU) whole


def test_an_actor_ray_cannot_place_fails_within_the_startup_timeout(tmp_path, ray_cpu):
    """The engine's bundle is taken (here by another actor holding its CPU): Ray keeps the
    engine actor pending, and the launch says so after rollout.sglang.startup_timeout_s instead
    of waiting forever."""
    from vlmrl.rollout.sglang import launch_sglang_engines

    cfg = _cfg(tmp_path, "rollout.sglang.startup_timeout_s=3")
    placement = _placement(ray_cpu, [{"CPU": 1}])
    holder = _take_bundle(ray_cpu, placement, 1)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"Ray did not place the 1 SGLang engine actors \(each asks for 0.0 GPU"):
        asyncio.run(launch_sglang_engines(cfg.rollout, cfg.hardware, cfg.model, [EngineSlot(0, 0, ())],
                                          run_dir=tmp_path, placement=placement, colocate=True,
                                          gpu_fraction=0.0, cpus_per_actor=0.5))
    assert time.monotonic() - t0 < 60
    ray_cpu.kill(holder)
    ray_cpu.util.remove_placement_group(placement.group)


def test_an_interpreter_without_sglang_is_refused_by_name_in_its_bundle(tmp_path, ray_cpu):
    """Placed in its bundle (no GPU asked for here), the actor asks `rollout.sglang.python` for
    its sglang release: none is installed on this machine, and the error names the interpreter
    and the setting; the actor is gone afterwards."""
    from vlmrl.rollout.sglang import launch_sglang_engines

    cfg = _cfg(tmp_path, f"rollout.sglang.python={sys.executable}")
    placement = _placement(ray_cpu, [{"CPU": 1}])
    with pytest.raises(RuntimeError, match=r"sglang is not installed for .*rollout\.sglang\.python"):
        asyncio.run(launch_sglang_engines(cfg.rollout, cfg.hardware, cfg.model, [EngineSlot(0, 0, ())],
                                          run_dir=tmp_path, placement=placement, colocate=True,
                                          gpu_fraction=0.0, cpus_per_actor=0.5))
    ray_cpu.kill(_take_bundle(ray_cpu, placement, 1))  # the engine actor is gone: the whole bundle is free
    ray_cpu.util.remove_placement_group(placement.group)


def test_a_port_another_process_holds_is_refused_by_name(tmp_path, monkeypatch):
    """Another process listens on the engine's port (on the H200: a server a killed job left
    running). It would answer /health for the server about to start and refuse the run's key on
    everything else (HTTP 401). The actor refuses to start there, names the port and the setting
    that moves it, and starts nothing. (A restart on a freed port: the GPU test that kills a
    server mid-rollout.)"""
    import socket

    from vlmrl.rollout.processes import port_is_free
    from vlmrl.rollout.sglang import SGLangServerActor

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    assert not port_is_free("127.0.0.1", port)
    actor = SGLangServerActor([0], log_path=str(tmp_path / "s.log"), python=sys.executable)
    monkeypatch.setattr(actor, "port_wait_s", 0.5)
    with pytest.raises(RuntimeError, match=rf"port {port} on 127\.0\.0\.1 is already in use.*rollout\.sglang\.base_port"):
        actor.start({"host": "127.0.0.1", "port": port, "model_path": str(tmp_path)}, None)
    assert actor.process is None
    holder.close()
    assert port_is_free("127.0.0.1", port)  # closed: free again, TIME_WAIT or not


def test_stop_ends_what_a_killed_server_left_in_its_session(tmp_path):
    """A server killed mid-rollout (SIGKILL of its main process) can leave its own children
    running in its session (SGLang's scheduler holds the GPU's memory). The restart's stop
    ends the whole session even though its leader is gone, and a second stop is harmless."""
    import signal

    from vlmrl.rollout.processes import ManagedProcess

    pid_file = tmp_path / "child.pid"
    leader = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
              f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(120)")
    proc = ManagedProcess([sys.executable, "-c", leader], log_path=tmp_path / "p.log")
    proc.start()
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    child = int(pid_file.read_text())
    os.kill(proc.proc.pid, signal.SIGKILL)
    proc.proc.wait(10)
    assert _running(child)  # the child outlived its leader
    proc.stop()
    deadline = time.monotonic() + 10
    while _running(child):
        assert time.monotonic() < deadline, "the leader's child is still running"
        time.sleep(0.1)
    proc.stop()


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's reaper may be slow to collect it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


_PARENT = """
import sys, threading, time
from vlmrl.rollout.processes import ManagedProcess
procs = []
def start():  # as a Ray actor method does: on a thread that ends afterwards
    p = ManagedProcess([sys.executable, "-c", "import time; time.sleep(120)"])
    p.start()
    procs.append(p)
t = threading.Thread(target=start)
t.start()
t.join()
print(procs[0].proc.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_server_dies_with_the_process_that_started_it(tmp_path):
    """On the H200 a job killed by its time limit left its SGLang server running (in its own
    session, holding the GPU and the port). A server now lives as long as the process that
    started it (the engine actor): it outlives the short-lived thread that started it, and is
    gone soon after that process is SIGKILLed."""
    import signal
    import subprocess

    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    child = int(parent.stdout.readline())
    time.sleep(0.5)
    assert _running(child)  # the starting thread has ended; the server runs on
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(10)
    deadline = time.monotonic() + 10
    while _running(child):
        assert time.monotonic() < deadline, "the server outlived the process that started it"
        time.sleep(0.1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_server_started_in_a_threaded_actor_lives_and_dies_with_it(ray_cpu):
    """As an engine actor starts its server: from a method of a threaded Ray actor. The server
    runs on across the actor's later calls, and is gone soon after the actor's process is
    SIGKILLed. (Ray kills a worker's children when it stops the worker itself, as with
    `ray.kill`; not when the process dies under it, as on the H200 when a job's time limit
    ended pytest, its Ray and its actors, and left the server running.)"""
    import signal

    from vlmrl.rollout.processes import ManagedProcess

    @ray_cpu.remote(num_cpus=0, max_concurrency=4)
    class Holder:
        def start(self) -> int:
            self.server = ManagedProcess([sys.executable, "-c", "import time; time.sleep(120)"])
            self.server.start()
            return self.server.proc.pid

        def alive(self) -> bool:
            return self.server.alive()

        def pid(self) -> int:
            return os.getpid()

    holder = Holder.remote()
    pid = ray_cpu.get(holder.start.remote(), timeout=60)
    assert all(ray_cpu.get([holder.alive.remote() for _ in range(16)], timeout=60))
    assert _running(pid)
    os.kill(ray_cpu.get(holder.pid.remote()), signal.SIGKILL)  # the actor's process dies at once
    deadline = time.monotonic() + 20
    while _running(pid):
        assert time.monotonic() < deadline, "the server outlived its actor"
        time.sleep(0.1)

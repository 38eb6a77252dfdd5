"""The weight transport is chosen once per set of engines, from the layout: colocated engines
take payloads by reference from the ranks on their devices, engines on devices of their own a
broadcast from rank 0. (Both run end to end in tests/integration/test_loop.py.)"""

from __future__ import annotations

from vlmrl.cluster.weight_transport import BroadcastTransport, ColocatedTransport, weight_transport
from vlmrl.config import compute_layout, load


def test_the_layout_picks_the_transport_and_its_payloads():
    colocated = load(["cluster.colocate=true", "cluster.num_cpu_ranks=2"], check_rules=False)
    t = weight_transport(colocated, 1, ["http://engine-0"], compute_layout(colocated), api_key=None, host="")
    assert isinstance(t, ColocatedTransport) and t.format == "torch_save"  # CPU: host bytes
    assert t.sources and t.wants_compact(False)  # torch.save payloads need compact tensors
    assert not t.engines  # only rank 0 holds the engines' clients

    separate = load(["cluster.colocate=false"], check_rules=False)
    t = weight_transport(separate, 1, ["http://engine-0"], compute_layout(separate), api_key=None, host="")
    assert isinstance(t, BroadcastTransport) and t.group is None and t.wants_compact(False)


def test_colocated_gpus_send_cuda_ipc_handles_to_views_as_they_are():
    cfg = load(["hardware=h200", "rollout=sglang", "cluster.num_gpus=2", "cluster.colocate=true"], check_rules=False)
    t = weight_transport(cfg, 1, ["http://a", "http://b"], compute_layout(cfg), api_key=None, host="")
    assert isinstance(t, ColocatedTransport) and t.format == "ipc"
    assert not t.wants_compact(False) and t.wants_compact(True)  # `compact_views` asks for copies
    assert 1 in t.senders  # rank 1 shares its GPU with an engine rank: it sends its own copy


def test_sglang_servers_take_fused_experts_through_vlmrls_loader():
    """SGLang servers started with vlmrl's loader (the default) get each layer's routed experts
    as one tensor, in (name, view) pairs named by that loader; with SGLang's own loaders,
    flattened buckets of per-expert tensors. The embedded server: flattened buckets."""
    from vlmrl.rollout.sglang_plugin import LOADER

    base = ["hardware=h200", "cluster.num_gpus=1", "cluster.colocate=true", "model=tiny_qwen3_5_moe"]
    seen = {}
    for name, extra in (("vlmrl", ["rollout=sglang"]), ("sglang", ["rollout=sglang", "rollout.sglang.weight_loader=sglang"]),
                        ("embedded", ["rollout=embedded", "rollout.embedded.serve_http=true"])):
        cfg = load(base + extra, check_rules=False)
        t = weight_transport(cfg, 0, ["http://a"], compute_layout(cfg), api_key=None, host="")
        try:
            seen[name] = (t.fused_experts, t.engines[0].load_format)
        finally:
            t.close()
    assert seen == {"vlmrl": (True, LOADER), "sglang": (False, "flattened_bucket"),
                    "embedded": (False, "flattened_bucket")}


def _sync_to_a_dead_engine(rank: int, world: int, url: str) -> dict:
    import time

    import torch

    from vlmrl.config import compute_layout, load

    cfg = load(["cluster.colocate=true", "cluster.num_cpu_ranks=2"], check_rules=False)
    t = weight_transport(cfg, rank, [url], compute_layout(cfg), api_key=None, host="")
    t0 = time.perf_counter()
    try:
        t.send([[("w", torch.zeros(4))], [("v", torch.ones(4))]], "v1")
    except Exception as e:  # noqa: BLE001 - the test reads what each rank raised
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - t0}
    finally:
        t.close()
    return {"error": None, "seconds": time.perf_counter() - t0}


def test_a_sync_that_fails_on_rank_0_fails_on_every_rank():
    """Rank 0 alone talks to the engines. Its engine is gone (nothing listens at the URL): every
    trainer rank raises rank 0's error within seconds. Before, rank 1 waited in the next
    collective: here until rank 0's process ended (gloo: "Connection closed by peer"), in a run,
    where rank 0 lives on, until the watchdog killed it, so the engine restart could not re-sync."""
    import socket

    from vlmrl.training.parallel_state import spawn_local

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    res = spawn_local(_sync_to_a_dead_engine, 2, url, timeout_s=120)
    assert res[0]["error"] and res[1]["error"], res
    assert res[1]["error"].startswith("RuntimeError: weight sync failed on trainer rank 0: ")
    assert res[1]["error"].endswith(res[0]["error"]), res
    assert all(r["seconds"] < 30 for r in res), res

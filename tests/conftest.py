"""Shared fixtures: the tiny checkpoint (built once per session) and the gpu marker."""

from __future__ import annotations

import os

import pytest

# Tests never talk to a hub or to wandb's servers.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    """Under pytest-xdist (`make test` runs two workers), each worker and every process it
    starts (trainer ranks, engines, Ray) keeps to its own share of the cores. Unpinned, two
    workers' torch thread pools (two threads in each process) fought over two cores and a
    test's wall time grew up to threefold; pinned, each process sizes its threads to its share
    (`vlmrl.cluster.placement.available_cores`)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    from vlmrl.cluster.placement import available_cores

    # the cores this machine lets the suite use: its affinity, cut to a cgroup CPU quota
    cores = sorted(os.sched_getaffinity(0))[:available_cores()]
    if len(cores) < count:
        return
    os.sched_setaffinity(0, cores[int(worker.removeprefix("gw")) % count::count])


# The files that hold a worker longest on two cores (bench/results/suite.md), in that order, run
# first. `make test` hands pytest-xdist's workers a file at a time in collection order
# (`--dist loadfile --no-loadscope-reorder`): a long file taken last runs alone while the other
# worker idles. xdist's own order (most tests first) took the learning run's file, which has
# few tests, near the end.
LONGEST_FIRST = tuple(f"tests/integration/{name}.py" for name in (
    "test_learning", "test_loop", "test_qwen35_parity", "test_trainer", "test_rollout_http", "test_resume",
    "test_megatron_parity"))


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    """A per-session VLMRL_CACHE, so tests never read or write the user's cache."""
    path = tmp_path_factory.mktemp("vlmrl-cache")
    os.environ["VLMRL_CACHE"] = str(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_config(cache_dir):
    """The composed default config (model=tiny, data=synthetic) with the session cache."""
    from vlmrl.config import load

    return load([f"model.cache_dir={cache_dir}"])


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_config) -> str:
    """Path of the tiny HF checkpoint directory (config, safetensors, tokenizer, processor)."""
    from vlmrl.models.tiny import ensure_tiny_checkpoint

    d = tiny_config.data
    return ensure_tiny_checkpoint(tiny_config.model, min_pixels=d.min_pixels, max_pixels=d.max_pixels)


@pytest.fixture(scope="session")
def tiny_moe_config(cache_dir):
    """The default config with the tiny Qwen3.5-MoE (Gated DeltaNet + gated attention + MoE)."""
    from vlmrl.config import load

    return load([f"model.cache_dir={cache_dir}", "model=tiny_qwen3_5_moe"])


@pytest.fixture(scope="session")
def tiny_moe_checkpoint(tiny_moe_config) -> str:
    """Path of the tiny Qwen3.5-MoE HF checkpoint directory."""
    from vlmrl.models.tiny import ensure_tiny_checkpoint

    d = tiny_moe_config.data
    return ensure_tiny_checkpoint(tiny_moe_config.model, min_pixels=d.min_pixels, max_pixels=d.max_pixels)


@pytest.fixture(scope="session", params=["qwen2_5_vl", "qwen3_5_moe"])
def family_checkpoint(request):
    """(config, checkpoint path) of each family's tiny model: tests that take it run for both."""
    if request.param == "qwen2_5_vl":
        return request.getfixturevalue("tiny_config"), request.getfixturevalue("tiny_checkpoint")
    return request.getfixturevalue("tiny_moe_config"), request.getfixturevalue("tiny_moe_checkpoint")

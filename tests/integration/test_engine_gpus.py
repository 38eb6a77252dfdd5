"""SGLang servers run on the GPUs Ray gave their engine's placement bundles. A Ray node started
on some of a host's GPUs (CUDA_VISIBLE_DEVICES=4,5: a shared node, an external cluster) names
them "4" and "5"; the layout's indices 0 and 1 would put the servers on GPUs the job does not
hold. Ray with logical GPUs on the CPU; the servers themselves need a GPU
(tests/gpu/test_sglang_gpu.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ray_on_gpus_4_and_5():
    import os

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = "4,5"  # read by Ray's node at start: its GPUs are named 4 and 5
    try:
        ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES")
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before
    yield ray
    ray.shutdown()


def test_engines_take_the_gpus_ray_gave_their_bundles(ray_on_gpus_4_and_5, tmp_path):
    from ray.util.placement_group import placement_group

    from vlmrl.cluster.placement import Placement, bundle_gpu_ids
    from vlmrl.rollout.sglang import SGLangServerActor

    ray = ray_on_gpus_4_and_5
    group = placement_group([{"GPU": 1.0, "CPU": 1.0}] * 2, strategy="PACK")
    ray.get(group.ready(), timeout=60)
    placement = Placement(group, trainer_bundles=[0, 1], engine_bundles=[1])
    assert bundle_gpu_ids(placement, 2) == ["4", "5"]

    actor_cls = ray.remote(SGLangServerActor)

    def engine(devices):  # an engine actor in bundle 1, as launch_sglang_engines places it
        return actor_cls.options(num_cpus=0, num_gpus=0.2, scheduling_strategy=placement.strategy(1)).remote(
            devices, log_path=str(tmp_path / "sglang.log"))

    good = engine(["5"])
    assert ray.get(good._env.remote())["CUDA_VISIBLE_DEVICES"] == "5"
    ray.get(good.check_devices.remote())
    # the layout's index (1) for that bundle: refused, both lists named
    bad = engine([1])
    with pytest.raises(Exception, match=r"GPUs \['1'\].*gave its actor GPU\(s\) \['5'\]"):
        ray.get(bad.check_devices.remote())
    # a start checks before it launches anything
    with pytest.raises(Exception, match="the server would run on GPUs the job does not hold"):
        ray.get(bad.start.remote({"host": "127.0.0.1", "port": 1}, "0.5.17"))
    for a in (good, bad):
        ray.kill(a)

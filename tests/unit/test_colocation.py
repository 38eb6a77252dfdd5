"""Who holds the GPU's memory in each colocated phase, and the calls between phases."""

from __future__ import annotations

import itertools

import pytest

from vlmrl.cluster.colocation import ALL_TAGS, PHASES, Colocation, Residency, phase, plan


def _apply(now: Residency, steps) -> Residency:
    for kind, tags in steps:
        if kind == "release":
            assert set(tags) <= now.engine, (now, kind, tags)
            now = Residency(now.engine - set(tags), now.trainer)
        elif kind == "resume":
            assert not set(tags) & now.engine, (now, kind, tags)
            now = Residency(now.engine | set(tags), now.trainer)
        elif kind == "offload":
            assert now.trainer
            now = Residency(now.engine, False)
        elif kind in ("trim", "stage"):
            assert now.trainer
        else:
            assert not now.trainer
            now = Residency(now.engine, True)
    return now


@pytest.mark.parametrize("offload", [True, False])
def test_every_transition_reaches_its_phase_and_frees_before_it_takes(offload):
    names = list(PHASES)
    for a, b in itertools.product(names, names):
        now, target = phase(a, offload=offload), phase(b, offload=offload)
        steps = plan(now, target)
        assert _apply(now, steps) == target
        kinds = [k for k, _ in steps]
        frees = [i for i, k in enumerate(kinds) if k in ("release", "offload", "trim")]
        takes = [i for i, k in enumerate(kinds) if k in ("resume", "onload")]
        assert not frees or not takes or max(frees) < min(takes), (a, b, steps)
        # engines never take memory beside a trainer that kept its cached blocks
        stays = now.trainer and target.trainer
        assert ("trim" in kinds) == bool(stays and target.engine - now.engine), (a, b, steps)
        if a == b:
            assert steps == []


def test_the_step_s_moves():
    """A colocated step with offload: rollout -> train -> sync -> next rollout."""
    gen, train, sync = (phase(n, offload=True) for n in ("generate", "train", "sync"))
    assert plan(gen, train) == [("release", ("kv_cache", "weights", "cuda_graph")), ("onload", ())]
    # the trainer stays: its cached activations go back to the device before the weights return
    assert plan(train, sync) == [("trim", ()), ("resume", ("weights",))]
    # the trainer leaves before the KV cache and graphs come back, weights stay put
    assert plan(sync, gen) == [("offload", ()), ("resume", ("cuda_graph", "kv_cache"))]
    # without offload the trainer stays; the engine's moves are the same
    gen, sync = phase("generate", offload=False), phase("sync", offload=False)
    assert plan(sync, gen) == [("trim", ()), ("resume", ("cuda_graph", "kv_cache"))]
    # a trainer that leaves after the sync starts copying its state out once it has trimmed: the
    # trim's cudaFree waits for all the device's work, so after the stage it would wait for the copy
    assert plan(train, phase("sync", offload=True), leaves_next=True) == [
        ("trim", ()), ("stage", ()), ("resume", ("weights",))]
    # nothing to stage where the trainer is not on the GPU yet (it comes back in this move)
    assert plan(phase("generate", offload=True), phase("sync", offload=True), leaves_next=True)[0][0] == "release"


def test_colocation_calls_in_order_and_starts_without_a_trainer():
    calls = []

    class Trainer:
        def offload(self):
            calls.append(("offload",))
            return {"bytes": 10}

        def onload(self):
            calls.append(("onload",))
            return {"bytes": 10}

        def trim(self):
            calls.append(("trim",))
            return {"device_freed_bytes": 5}

        def stage(self):
            calls.append(("stage",))
            return {"bytes": 7}

    colo = Colocation(release=lambda t: calls.append(("release", t)), resume=lambda t: calls.append(("resume", t)),
                      offload=True)
    assert colo.now == Residency(ALL_TAGS, trainer=False)
    colo.to("train")  # before the trainer exists: the engines make room, nothing else
    assert calls == [("release", ("kv_cache", "weights", "cuda_graph"))]
    colo.trainer = Trainer()
    colo.trainer_started()
    colo.synced()  # the run's first sync: the released weights are the trainer's again
    calls.clear()
    colo.to("generate")
    colo.to("generate")
    assert calls == [("offload",), ("resume", ("weights", "cuda_graph", "kv_cache"))]
    calls.clear()
    colo.to("sync")
    assert calls == [("release", ("kv_cache", "cuda_graph")), ("onload",)]
    calls.clear()
    colo.to("train")
    # the trainer stays: it trims before the engines' weights come back, then its copy out starts
    # (it leaves after the sync)
    colo.to("sync")
    assert calls == [("release", ("weights",)), ("trim",), ("stage",), ("resume", ("weights",))]
    assert colo.now == phase("sync", offload=True)
    assert colo.moved_bytes == {"offload": 10.0, "onload": 10.0, "trim": 0.0, "stage": 7.0}
    # by kind, and by the phase each whole move entered
    assert set(colo.take_seconds()) == {"release", "resume", "offload", "onload", "trim", "stage",
                                        "to_generate", "to_train", "to_sync"}
    assert colo.take_seconds() == {}
    with pytest.raises(ValueError, match="unknown phase"):
        colo.to("evaluate")


def test_generating_from_released_weights_is_refused_until_a_sync():
    """Released weights are not kept: after a release of the engines' weights, `generate` is
    refused until `synced`; a checkpoint between a sync and the next rollout goes to `sync`,
    which keeps them."""
    calls = []

    class Trainer:
        def offload(self):
            return {}

        def onload(self):
            return {}

        def trim(self):
            return {}

        def stage(self):
            return {}

    colo = Colocation(release=lambda t: calls.append(("release", t)), resume=lambda t: calls.append(("resume", t)),
                      offload=True, trainer=Trainer())
    colo.trainer_started()
    colo.to("train")
    with pytest.raises(RuntimeError, match="released and not synced"):
        colo.to("generate")
    colo.to("sync")
    colo.synced()
    colo.to("generate")
    calls.clear()
    colo.to("sync")  # e.g. for a checkpoint: the weights stay where they are
    assert ("release", ("kv_cache", "weights", "cuda_graph")) not in calls and not colo.weights_stale
    colo.to("generate")


def test_engines_that_stay_move_nothing_in_a_step():
    """cluster.release_engines=false: every phase is the same residency (engines hold every tag,
    the trainer is on the GPU), so a step's phases call nothing but the trainer's trim when
    training ends, and the engines' weights never go stale; an offload beside them is refused
    (it would free nothing they use)."""
    stay = {n: phase(n, offload=False, stay=True) for n in PHASES}
    assert set(stay.values()) == {Residency(ALL_TAGS, trainer=True)}
    for a, b in itertools.product(PHASES, PHASES):
        assert plan(stay[a], stay[b]) == []
        assert plan(stay[a], stay[b], after_training=True) == [("trim", ())]
    # engines that release: after training the trim comes where it came before, once
    for offload in (True, False):
        train = phase("train", offload=offload)
        for b in PHASES:
            target = phase(b, offload=offload)
            assert plan(train, target, after_training=b != "train") == plan(train, target), (offload, b)
    with pytest.raises(ValueError, match="no room to gain"):
        phase("generate", offload=True, stay=True)

    calls = []

    class Trainer:
        def __getattr__(self, name):  # any move of the trainer would be recorded
            return lambda: calls.append((name,))

    colo = Colocation(release=lambda t: calls.append(("release", t)), resume=lambda t: calls.append(("resume", t)),
                      stay=True)
    colo.to("train")  # the run's start: the engines keep what they took
    assert calls == []
    colo.trainer = Trainer()
    colo.trainer_started()
    for name in ("generate", "train", "train", "sync", "generate", "sync", "train", "generate"):
        colo.to(name)
    # what the trainer's start and each training left cached goes back to the device, nothing else moves
    assert calls == [("trim",)] * 3 and colo.now == Residency(ALL_TAGS, trainer=True) and not colo.weights_stale
    assert set(colo.take_seconds()) == {"trim", "to_sync", "to_generate"}  # the trims after training

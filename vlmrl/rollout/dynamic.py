"""One RL step's rollout: generate, score each group as it completes, keep the groups the
filter keeps, and draw more prompts while too few are kept (dynamic sampling).

With `algo.filter_groups=none` a step is one round: `rollout.batch_size` prompts, every
complete group kept. With a filter (`equal_reward`: DAPO's dynamic sampling, which drops the
groups whose rewards are all equal) the step wants `batch_size` kept groups:

* a round draws ceil(missing x `oversample`) prompts and asks the rollout manager for the
  first `missing` kept groups in draw order. As soon as those are complete, the later groups
  are no longer needed: their requests are cancelled and aborted on the engines, not awaited.
  Draw order, not completion order, decides which groups a step keeps, so a step's batch does
  not depend on which engine was fastest;
* rounds go on until the step has its groups, `max_rounds` rounds have run, or `max_prompts`
  prompts are drawn. A step that hits a bound trains on what it has (`bound_hit`).

Groups are scored as they complete (the reward pool works while the engines generate), and
the scores are kept: the step's advantages and metrics use them, nothing is scored twice. With
`prepare`, what the trainer's samples need of a group (`vlmrl.experience.group_inputs`: its
prompt's encoding, its routed experts) is built then too, beside the scoring. A
round's prompts come from `draw(n)`, so the data stream's position after the step counts every
prompt drawn, used or not: a run resumed from a checkpoint draws the prompts it would have drawn.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .manager import RolloutManager, RolloutStats, SampleRecord, close_sessions


@dataclass(frozen=True)
class SamplingPlan:
    """How a step gathers its groups (`rollout.batch_size`, `oversample`, `max_rounds`,
    `max_prompts`) and whether a filter decides which it keeps."""

    batch_size: int
    filtering: bool = False
    oversample: float = 1.0
    max_rounds: int = 1
    max_prompts: int | None = None

    @classmethod
    def from_config(cls, rollout: Any, filter_groups: str) -> SamplingPlan:
        return cls(batch_size=int(rollout.batch_size), filtering=filter_groups != "none",
                   oversample=float(rollout.oversample), max_rounds=int(rollout.max_rounds),
                   max_prompts=rollout.max_prompts)

    @property
    def prompt_budget(self) -> int:
        """The most prompts a step draws."""
        if self.max_prompts is not None:
            return int(self.max_prompts)
        return math.ceil(self.batch_size * self.oversample) * self.max_rounds

    def round_size(self, missing: int, drawn: int) -> int:
        """Prompts the next round draws when `missing` kept groups are still wanted."""
        return max(0, min(math.ceil(missing * self.oversample), self.prompt_budget - drawn))


@dataclass
class StepRollout:
    """What a step's rollout gathered. `records` are the kept groups' samples (group, then
    sample order) with `rewards` beside them; `rejected` / `rejected_rewards` the complete groups
    the filter dropped; `prompts` every prompt drawn, in draw order."""

    prompts: list[Any]
    records: list[SampleRecord]
    rewards: list[float]
    rejected: list[SampleRecord] = field(default_factory=list)
    rejected_rewards: list[float] = field(default_factory=list)
    stats: RolloutStats = field(default_factory=RolloutStats)
    rounds: int = 0
    bound_hit: bool = False
    prepared: dict[int, Any] = field(default_factory=dict)  # group position -> `prepare`'s result

    @property
    def kept_groups(self) -> int:
        return len({r.group_index for r in self.records})

    def metrics(self) -> dict[str, float]:
        """The step's dynamic-sampling figures (`vlmrl.logging.keys`)."""
        return {"rollout/kept_groups": float(self.kept_groups),
                "rollout/filtered_groups": float(self.stats.rejected_groups),
                "rollout/sampling_rounds": float(self.rounds),
                "rollout/prompts_drawn": float(len(self.prompts)),
                "rollout/surplus_groups": float(self.stats.surplus_groups),
                "rollout/aborted_requests": float(self.stats.aborted_requests),
                "rollout/sampling_bound_hit": float(self.bound_hit)}

    def bound_note(self, step: int, batch_size: int) -> str:
        """What to tell the user the first time a bound leaves a step short."""
        return (f"note: step {step + 1} kept {self.kept_groups} of rollout.batch_size={batch_size} groups after "
                f"{self.rounds} round(s) and {len(self.prompts)} prompts (rollout.max_rounds / max_prompts): it "
                "trains on those (rollout/sampling_bound_hit counts such steps)")


def _add(total: RolloutStats, part: RolloutStats) -> None:
    """`part`'s counts, lists and per-engine counts added into `total` (a step's rounds)."""
    for f in dataclasses.fields(RolloutStats):
        mine, theirs = getattr(total, f.name), getattr(part, f.name)
        if isinstance(mine, dict):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0) + v
        else:
            setattr(total, f.name, mine + theirs)


async def sample_step(manager: RolloutManager, draw: Callable[[int], Sequence[Any]],
                      score: Callable[[list[SampleRecord]], list[float]],
                      keeps: Callable[[list[float]], bool], plan: SamplingPlan, *, step: int,
                      prepare: Callable[[list[SampleRecord]], Any] | None = None) -> StepRollout:
    """Gather a step's groups (see the module docstring). `draw(n)` gives the next n prompts
    (as the rollout manager takes them), `score(records)` one group's rewards, `keeps(rewards)`
    the filter's verdict, `prepare(records)` what the trainer needs of a complete group
    (`StepRollout.prepared`); score and prepare block, and run in worker threads."""
    scores: dict[int, list[float]] = {}  # group position -> rewards
    prepared: dict[int, Any] = {}

    async def keep(records: list[SampleRecord]) -> bool:
        work = [asyncio.to_thread(score, records)] + ([asyncio.to_thread(prepare, records)] if prepare else [])
        done = await asyncio.gather(*work)
        rewards = [float(x) for x in done[0]]
        scores[records[0].group_index] = rewards
        if prepare is not None:
            prepared[records[0].group_index] = done[1]
        return keeps(rewards) if plan.filtering else True

    out = StepRollout(prompts=[], records=[], rewards=[])
    seen: dict[int, int] = {}
    while True:
        missing = plan.batch_size - out.kept_groups
        size = plan.round_size(missing, len(out.prompts))
        if size <= 0:
            break
        prompts = list(draw(size))
        batch = await manager.generate(prompts, step=step, keep=keep, need=missing if plan.filtering else None,
                                       first_position=len(out.prompts), seen=seen)
        out.prompts.extend(prompts)
        out.rounds += 1
        _add(out.stats, batch.stats)
        out.records.extend(batch.records)
        out.rejected.extend(batch.rejected)
        if not plan.filtering or out.kept_groups >= plan.batch_size:
            break
        if out.rounds >= plan.max_rounds or len(out.prompts) >= plan.prompt_budget:
            break
    out.bound_hit = plan.filtering and out.kept_groups < plan.batch_size
    out.rewards = [scores[r.group_index][r.sample_index] for r in out.records]
    out.rejected_rewards = [scores[r.group_index][r.sample_index] for r in out.rejected]
    kept = {r.group_index for r in out.records}
    out.prepared = {g: v for g, v in prepared.items() if g in kept}
    return out


def run_step(manager: RolloutManager, draw: Callable[[int], Sequence[Any]],
             score: Callable[[list[SampleRecord]], list[float]], keeps: Callable[[list[float]], bool],
             plan: SamplingPlan, *, step: int, prepare: Callable[[list[SampleRecord]], Any] | None = None
             ) -> StepRollout:
    """`sample_step` on its own event loop (the engines' HTTP sessions close with it)."""
    async def go() -> StepRollout:
        try:
            return await sample_step(manager, draw, score, keeps, plan, step=step, prepare=prepare)
        finally:
            await close_sessions(manager.engines)

    return asyncio.run(go())

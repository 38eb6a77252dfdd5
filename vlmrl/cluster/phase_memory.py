"""The colocated step's device memory, phase by phase, against the plan: the peak of each phase
on the most loaded trainer GPU (every process on it, the colocated engine too), read when the
phase ends, and compared with `vlmrl.config.memory`'s estimate once per step."""

from __future__ import annotations

from typing import Any

from ..config.memory import GIB, measured_phase_split, phase_estimate_split, phase_memory_metrics
from ..config.schema import VlmrlConfig


class PhaseMemory:
    def __init__(self, cfg: VlmrlConfig) -> None:
        self.cfg = cfg
        self.on_gpu = cfg.hardware.device == "cuda"
        self._measured: dict[str, dict[str, float]] = {}  # this step's phase peaks (bytes: total, trainer, others)
        self.problems: list[str] = []  # the first differences from the plan's estimate

    def ended(self, phase: str, trainer: Any) -> None:
        """`phase` just ended: keep its peak (on GPUs; the trainer group's `memory_stats`)."""
        if self.on_gpu:
            self._measured[phase] = max((measured_phase_split(m) for m in trainer.memory_stats()),
                                        key=lambda m: m["total"])

    def take(self) -> dict[str, float]:
        """The step's measured phase peaks (GiB) beside the plan's, and the plan's problems
        (printed the first time they appear, kept for summary.json)."""
        measured, self._measured = self._measured, {}
        if not measured:
            return {}
        plan = phase_estimate_split(self.cfg)
        out, problems = phase_memory_metrics(plan, measured)
        if problems and not self.problems:
            split = "; ".join(f"{k}: trainer {m['trainer'] / GIB:.1f} GiB (plan {plan[k]['trainer'] / GIB:.1f}), "
                              f"others {m['others'] / GIB:.1f} GiB (plan {plan[k]['others'] / GIB:.1f})"
                              for k, m in measured.items() if k in plan)
            print("note: measured memory differs from the plan (python -m vlmrl.plan) by more than 10%: "
                  + "; ".join(problems) + f" [{split}]")
        self.problems = self.problems or problems
        return out

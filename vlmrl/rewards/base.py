"""The verifier contract shared by every rule-based reward."""

from __future__ import annotations

import abc
from dataclasses import dataclass

from vlmrl.rewards.answer import Answer, parse_answer, parse_label
from vlmrl.rewards.extract import last_boxed


@dataclass(frozen=True, kw_only=True)
class Verifier(abc.ABC):
    """A binary reward: ``verifier(response, answer) -> 1.0 | 0.0``.

    The prediction is the last ``\\boxed{}`` of the response; a response without one
    scores 0. Subclasses decide when a prediction matches the label in :meth:`matches`.
    Verifiers are frozen dataclasses, so they pickle into worker processes and compare
    by value. ``timeout_s`` and ``num_workers`` are not used by the call itself: they
    configure the :class:`~vlmrl.rewards.pool.RewardPool` that runs it.

    Args:
        name: the registry name, for logs.
        timeout_s: hard limit on one call when scored through a pool.
        num_workers: worker processes of that pool; 0 scores inline.
    """

    name: str
    timeout_s: float = 1.0
    num_workers: int = 0

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"{type(self).__name__}: timeout_s must be > 0, got {self.timeout_s}")
        if self.num_workers < 0:
            raise ValueError(f"{type(self).__name__}: num_workers must be >= 0, got {self.num_workers}")

    def __call__(self, response: str, answer: str) -> float:
        boxed = last_boxed(response)
        if boxed is None:
            return 0.0
        prediction = parse_answer(boxed)
        label = parse_label(answer)
        if prediction is None or label is None:
            return 0.0
        return 1.0 if self.matches(prediction, label) else 0.0

    @abc.abstractmethod
    def matches(self, prediction: Answer, label: Answer) -> bool:
        """Whether a normalised prediction counts as the label."""

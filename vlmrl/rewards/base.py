"""The verifier contract shared by every rule-based reward."""

from __future__ import annotations

import abc
import re
from dataclasses import dataclass

from vlmrl.rewards.answer import Answer, parse_answer, parse_label
from vlmrl.rewards.extract import last_boxed


@dataclass(frozen=True, kw_only=True)
class Verifier(abc.ABC):
    """A reward for the final answer: ``verifier(response, answer) -> float``.

    The prediction is the last ``\\boxed{}`` of the response. It scores

    - 1.0 when it matches the label: it offers as many values as the label and each one
      matches the label's value in the same place, as decided by :meth:`matches`;
    - ``format_score`` when it is a well-formed answer that does not match;
    - 0.0 when there is no box, the box does not parse (empty, too long, an equation
      chain that contradicts itself) or the label does not, and when the prediction
      offers more values than the label: ``x = 3, y = 4``, ``3 or 4``, ``\\{3, 4\\}`` or
      ``2 \\pm 1`` for a label of one value. Hedging over candidates never earns more
      than a wrong answer (see :func:`~vlmrl.rewards.answer.answer_values`).

    With ``format_pattern`` set, a response that does not match it as a whole (after its
    leading and trailing whitespace, with ``.`` matching newlines too) scores 0.0 whatever
    its box says: the reward then also asks for the reply's shape, e.g. that the box is all
    the reply says. The pattern is the user's configuration, run against model output as a
    regular expression and nothing else; a pool's ``timeout_s`` bounds a pathological one.

    With the default ``format_score`` of 0 the reward is binary. Verifiers are frozen
    dataclasses, so they pickle into worker processes and compare by value.
    ``timeout_s`` and ``num_workers`` are not used by the call itself: they configure the
    :class:`~vlmrl.rewards.pool.RewardPool` that runs it.

    Args:
        name: the registry name, for logs.
        format_score: reward of a well-formed boxed answer that is wrong, in [0, 1).
        timeout_s: hard limit on one call when scored through a pool.
        num_workers: worker processes of that pool; 0 scores inline.
        format_pattern: a regular expression the whole response must match to score
            anything; None (the default) asks nothing of its shape.
    """

    name: str
    format_score: float = 0.0
    format_pattern: str | None = None
    timeout_s: float = 1.0
    num_workers: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.format_score < 1.0:
            raise ValueError(
                f"{type(self).__name__}: format_score must be >= 0 and < 1, got {self.format_score}"
            )
        if not self.timeout_s > 0:
            raise ValueError(f"{type(self).__name__}: timeout_s must be > 0, got {self.timeout_s}")
        if self.num_workers < 0:
            raise ValueError(f"{type(self).__name__}: num_workers must be >= 0, got {self.num_workers}")
        if self.format_pattern is not None:
            try:
                re.compile(self.format_pattern, re.DOTALL)
            except re.error as error:
                raise ValueError(f"{type(self).__name__}: format_pattern {self.format_pattern!r} is not a "
                                 f"regular expression: {error}") from None

    def well_formed(self, response: str) -> bool:
        """Whether the response has the shape ``format_pattern`` asks for (always, without one)."""
        if self.format_pattern is None:
            return True
        return re.fullmatch(self.format_pattern, response.strip(), re.DOTALL) is not None

    def __call__(self, response: str, answer: str) -> float:
        if not self.well_formed(response):
            return 0.0
        boxed = last_boxed(response)
        if boxed is None:
            return 0.0
        prediction = parse_answer(boxed)
        label = parse_label(answer)
        if prediction is None or label is None:
            return 0.0
        offered, expected = prediction.values, label.values
        if len(offered) > len(expected):
            return 0.0
        if len(offered) == len(expected) and all(map(self.matches, offered, expected)):
            return 1.0
        return float(self.format_score)

    @abc.abstractmethod
    def matches(self, prediction: Answer, label: Answer) -> bool:
        """Whether one normalised value of the prediction counts as the label's value."""

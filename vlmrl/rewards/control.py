"""Control rewards that carry no information about correctness.

`CoinFlipVerifier` scores each call 1 or 0 by a hash of (seed, call number, response): a fair
coin, independent of the answer and of earlier scores of the same text, so there is nothing
for GRPO to learn from it, not even a response that always wins. Calls are numbered in the
order they arrive, so with `reward.num_workers=0` (scoring inline, in a fixed order) a
seeded run is reproducible. Training on it shows what GRPO does to a model when the reward
is noise: a run that "learns" under it is not learning the task. `reward=coin_flip` selects
it, with evaluation by the math verifier (`reward.eval_target`). `format_score` does not
apply: a format bonus would tell responses apart, and the control must not; it must stay 0.

`ConstantVerifier` gives every response the same reward (`format_score`, 0.9 by default:
what a format-scoring verifier gives a group of well-formed wrong answers). Every group is
then all-equal, its advantages are exactly zero, and GRPO must leave the policy where it is:
no policy gradient, weights unchanged. `reward=constant` selects it, with evaluation by the
math verifier.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass

from vlmrl.rewards.answer import Answer
from vlmrl.rewards.base import Verifier


@dataclass(frozen=True, kw_only=True)
class CoinFlipVerifier(Verifier):
    """1.0 or 0.0 with probability 1/2 each, whatever the response and the answer."""

    name: str = "coin_flip"
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.format_score != 0:
            raise ValueError(
                f"CoinFlipVerifier: format_score must be 0 (the control ignores format and correctness), "
                f"got {self.format_score}"
            )
        _refuse_format_pattern(self)
        object.__setattr__(self, "_calls", itertools.count())

    def __call__(self, response: str, answer: str) -> float:
        n = next(self._calls)  # type: ignore[attr-defined]
        digest = hashlib.sha256(f"{self.seed}:{n}:".encode() + response.encode("utf-8", "replace")).digest()
        return float(digest[0] % 2)

    def matches(self, prediction: Answer, label: Answer) -> bool:  # never consulted
        raise NotImplementedError("the coin-flip control does not compare answers")


@dataclass(frozen=True, kw_only=True)
class ConstantVerifier(Verifier):
    """`format_score` for every response, whatever it says."""

    name: str = "constant"
    format_score: float = 0.9

    def __post_init__(self) -> None:
        super().__post_init__()
        _refuse_format_pattern(self)

    def __call__(self, response: str, answer: str) -> float:
        return float(self.format_score)

    def matches(self, prediction: Answer, label: Answer) -> bool:  # never consulted
        raise NotImplementedError("the constant control does not compare answers")


def _refuse_format_pattern(verifier: Verifier) -> None:
    if verifier.format_pattern is not None:
        raise ValueError(f"{type(verifier).__name__}: format_pattern must be unset (a control scores every "
                         f"response alike), got {verifier.format_pattern!r}")

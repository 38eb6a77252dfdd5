"""GEO3K verifier: numeric answers within a tolerance of the label.

GEO3K labels are rounded to one decimal place, so a correct answer computed to more
places (``8.66`` for a label of ``8.7``) differs from its label by up to 0.05.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from vlmrl.rewards.answer import Answer
from vlmrl.rewards.base import Verifier
from vlmrl.rewards.math import math_equal


@dataclass(frozen=True, kw_only=True)
class Geo3kVerifier(Verifier):
    """A value matches when ``|prediction - label| <= tolerance`` or when ``math`` accepts it.

    With ``relative=True`` the bound is ``tolerance * |label|``. Decimal answers are
    compared exactly (``8.65`` is within 0.05 of ``8.7``), irrational ones in floating
    point. Answers that do not evaluate to numbers fall back to
    :func:`~vlmrl.rewards.math.math_equal`, and so does any pair outside the
    tolerance: everything the ``math`` verifier accepts, this one accepts too. Scores
    (1, ``format_score`` or 0) are assigned as :class:`~vlmrl.rewards.base.Verifier` says.
    """

    name: str = "geo3k"
    tolerance: float = 0.05
    relative: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (math.isfinite(self.tolerance) and self.tolerance >= 0):
            raise ValueError(f"Geo3kVerifier: tolerance must be finite and >= 0, got {self.tolerance}")

    def matches(self, prediction: Answer, label: Answer) -> bool:
        if prediction.value is not None and label.value is not None:
            # The decimal the user wrote (0.05), not its binary approximation.
            bound = Fraction(repr(float(self.tolerance)))
            if self.relative:
                bound *= abs(Fraction(label.value))
            if abs(prediction.value - label.value) <= bound:
                return True
        return math_equal(prediction, label)

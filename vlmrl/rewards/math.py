"""The default verifier: exact mathematical equivalence of the boxed answer."""

from __future__ import annotations

from dataclasses import dataclass

from vlmrl.rewards.answer import Answer, values_equal
from vlmrl.rewards.base import Verifier


def math_equal(prediction: Answer, label: Answer) -> bool:
    """Equivalence of two normalised answers.

    When both evaluate to numbers they are compared by value to 1e-6 relative
    (:func:`~vlmrl.rewards.answer.values_equal`), so equivalent exact forms match
    (``2\\sqrt{3}`` and ``\\sqrt{12}``, ``\\frac{3}{4}`` and ``0.75``) while a decimal
    rounded to fewer places does not (``8.66`` is not ``\\frac{26}{3}``). Otherwise the
    normalised texts must be identical up to case (choice letters, words).
    """
    if prediction.value is not None and label.value is not None:
        return values_equal(prediction.value, label.value)
    return prediction.text == label.text


@dataclass(frozen=True, kw_only=True)
class MathVerifier(Verifier):
    """Reward for a boxed answer that is mathematically equal to the label (see :class:`Verifier`)."""

    name: str = "math"

    def matches(self, prediction: Answer, label: Answer) -> bool:
        return math_equal(prediction, label)

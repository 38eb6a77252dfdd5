"""Canonical forms of answers: normalised text plus, where it has one, a numeric value."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from vlmrl.rewards.expr import Number, evaluate
from vlmrl.rewards.extract import MAX_ANSWER_CHARS, last_boxed

RELATIVE_TOLERANCE = 1e-6
"""Two evaluated answers are equal when they agree to this relative tolerance."""
ABSOLUTE_TOLERANCE = 1e-12
"""Floor for values at zero, where a relative tolerance accepts nothing but exact zero."""

_UNICODE = {
    "\u2212": "-",
    "\u00d7": "\\times ",
    "\u00f7": "\\div ",
    "\u00b7": "\\cdot ",
    "\u22c5": "\\cdot ",
    "\u03c0": "\\pi ",
    "\u221a": "\\sqrt ",
    "\u00b2": "^2",
    "\u00b3": "^3",
    "\u00b0": "",
    "\u2248": "=",
    "\u00a0": " ",
}
_SPACING = ("\\!", "\\,", "\\;", "\\:", "\\ ", "\\quad", "\\qquad", "\\displaystyle", "~", "$")
_DELIMITER_SIZING = re.compile(r"\\(?:left|right|big|Big|bigg|Bigg)(?![A-Za-z])")
_FRAC_VARIANTS = re.compile(r"\\[dt]frac(?![A-Za-z])")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ(?![A-Za-z])|\\degree(?![A-Za-z])")
_TEXT_WRAPPER = re.compile(
    r"\\(?:text|textrm|textbf|textit|textnormal|mathrm|mathbf|mathit|mathsf|mbox|operatorname)"
    r"\s*\{([^{}]*)\}"
)
_APPROX = re.compile(r"\\approx(?![A-Za-z])")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_UNIT = re.compile(
    r"(?<![A-Za-z\\])(?:(?:square|sq\.?) ?)?"
    r"(?:units?|cm|mm|km|m|in|inch|inches|ft|foot|feet|yd|yards?|miles?"
    r"|(?:centi|milli|kilo)?met(?:er|re)s?|degrees?|deg)"
    r"(?:\^\{?[23]\}?)?$"
)
_CHOICE = re.compile(r"\(([A-Za-z])\)")


@dataclass(frozen=True)
class Answer:
    """A normalised answer: ``text`` for string comparison, ``value`` when evaluable."""

    text: str
    value: Number | None


def parse_answer(raw: str) -> Answer | None:
    """Normalise and evaluate one extracted answer; None when it is empty or too long."""
    if len(raw) > MAX_ANSWER_CHARS:
        return None
    canonical = normalize_answer(raw)
    if not canonical:
        return None
    return Answer(text=canonical.casefold(), value=evaluate(canonical))


def parse_label(label: object) -> Answer | None:
    """Parse a reference label; a label that contains a box is reduced to its last box."""
    text = label if isinstance(label, str) else str(label)
    if len(text) > MAX_ANSWER_CHARS:
        return None
    boxed = last_boxed(text)
    return parse_answer(text if boxed is None else boxed)


def normalize_answer(text: str) -> str:
    """Canonical text of an answer, with all whitespace removed (case is preserved).

    Removes what does not change the answer: dollar signs and LaTeX spacing, ``\\left``/
    ``\\right``, ``\\text{}``-style wrappers (keeping their content), degree marks
    (``^\\circ``, ``^{\\circ}``, ``°``, "degrees"), trailing units (cm, m, units, square
    units, ``cm^2`` ...), percent signs, a trailing period, thousands separators
    (``1,000`` and ``1{,}000``) and a leading assignment (``x = 5`` and ``AB \\approx 5``
    keep the right-hand side). ``\\dfrac``/``\\tfrac`` become ``\\frac`` and a parenthesised
    choice letter ``(B)`` becomes ``B``.
    """
    for symbol, replacement in _UNICODE.items():
        text = text.replace(symbol, replacement)
    for spacing in _SPACING:
        text = text.replace(spacing, " ")
    text = text.replace("\\%", "").replace("%", "").replace("{,}", ",")
    text = _DELIMITER_SIZING.sub("", text)
    text = _FRAC_VARIANTS.sub(r"\\frac", text)
    text = _DEGREES.sub("", text)
    while True:
        unwrapped = _TEXT_WRAPPER.sub(r" \1 ", text)
        if unwrapped == text:
            break
        text = unwrapped
    text = _APPROX.sub("=", text)
    if "=" in text:
        text = text.rsplit("=", 1)[1]
    text = " ".join(text.split()).replace(" ^", "^").replace("^ ", "^")
    text = _strip_units(text.rstrip(". "))
    text = _THOUSANDS.sub("", text).rstrip(". ")
    if choice := _CHOICE.fullmatch(text):
        text = choice.group(1)
    return text.replace(" ", "")


def _strip_units(text: str) -> str:
    while (unit := _UNIT.search(text)) and text[: unit.start()].strip():
        text = text[: unit.start()].rstrip(". ")
    return text


def values_equal(a: Number, b: Number) -> bool:
    """Equality of evaluated answers: to :data:`RELATIVE_TOLERANCE` relative, with an
    :data:`ABSOLUTE_TOLERANCE` floor so that a float residue still equals zero."""
    if a == b:
        return True
    return math.isclose(float(a), float(b), rel_tol=RELATIVE_TOLERANCE, abs_tol=ABSOLUTE_TOLERANCE)

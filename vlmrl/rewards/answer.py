"""Canonical forms of answers: normalised text plus, where it has one, a numeric value.

An answer offers one value or several (:func:`answer_values`). One value, with or without
a label: ``5``, ``x = 5``, ``AB = 12``, ``m\\angle ABC = 30^\\circ``, ``2\\sqrt{3}``, a
point or interval ``(1, 2)``. Several: a list (``3, 4``, ``3; 4``, ``\\{3, 4\\}``),
alternatives (``3 or 4``, ``x = 2 \\text{ or } x = 3``, ``x = 3, y = 4``) and ``2 \\pm 1``.
An equation chain whose numeric sides disagree (``x = 5 = 6``) is no answer at all.
Verifiers give no credit to a prediction that offers more values than its label.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

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
    "\u00b1": "\\pm ",
    "\u2213": "\\mp ",
    "\u00a0": " ",
}
_LINE_BREAK = "\\\\"
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
# Words and symbols that join alternatives: "3 or 4", "x = 2 \text{ and } x = 3", "3 \lor 4".
# Lower case only: "OR" and "AND" name segments and angles in geometry.
_ALTERNATIVE = re.compile(r"(?<![A-Za-z\\])(?:or|and)(?![A-Za-z])|\\(?:lor|vee)(?![A-Za-z])")
_PLUS_MINUS = re.compile(r"\\(pm|mp)(?![A-Za-z])")
_DECIMAL = re.compile(r"[+-]?(?:\d+(?:\.(\d*))?|\.(\d+))")
# A middle side of an equation chain that is a number and the name of the next equation:
# "2 y" in "x = 2 \quad y = 3"; names are letters and digits (x, AB, x1) or m\angle ABC.
_RUN_ON = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+)) (?:[A-Za-z]+\d*|(?:m ?)?\\angle ?[A-Za-z0-9]+)")


@dataclass(frozen=True)
class Answer:
    """A normalised answer: ``text`` for string comparison, ``value`` when evaluable.

    An answer that offers several values keeps each of them, in order, in ``parts``; its
    ``text`` is theirs joined by ``,`` and it has no ``value``. ``parts`` is empty for an
    answer of one value.
    """

    text: str
    value: Number | None
    parts: tuple[Answer, ...] = ()

    @property
    def values(self) -> tuple[Answer, ...]:
        """The values this answer offers: its parts, or itself when it offers one."""
        return self.parts or (self,)


def parse_answer(raw: str) -> Answer | None:
    """Normalise and evaluate one extracted answer.

    None when it is empty, too long, or an equation chain that contradicts itself
    (:func:`answer_values`).
    """
    if len(raw) > MAX_ANSWER_CHARS:
        return None
    values = answer_values(raw)
    if values is None:
        return None
    parts = tuple(Answer(text=value.casefold(), value=evaluate(value)) for value in values)
    if len(parts) == 1:
        return parts[0]
    return Answer(text=",".join(part.text for part in parts), value=None, parts=parts)


def parse_label(label: object) -> Answer | None:
    """Parse a reference label; a label that contains a box is reduced to its last box."""
    text = label if isinstance(label, str) else str(label)
    if len(text) > MAX_ANSWER_CHARS:
        return None
    boxed = last_boxed(text)
    return parse_answer(text if boxed is None else boxed)


def normalize_answer(text: str) -> str:
    """Canonical text of an answer, with all whitespace removed (case is preserved).

    The canonical texts of the values it offers (:func:`answer_values`) joined by ``,``;
    empty when it has none.
    """
    return ",".join(answer_values(text) or ())


def answer_values(raw: str) -> tuple[str, ...] | None:
    """The canonical text of each value an answer offers, in order; None when it offers
    none (empty) or contradicts itself.

    Normalisation removes what does not change the answer: dollar signs and LaTeX
    spacing, ``\\left``/``\\right``, ``\\text{}``-style wrappers (keeping their content),
    degree marks (``^\\circ``, ``^{\\circ}``, ``°``, "degrees"), trailing units (cm, m,
    units, square units, ``cm^2`` ...), percent signs, a trailing period, thousands
    separators (``1,000`` and ``1{,}000``: a comma followed by exactly three digits) and
    the labels of an assignment (``x = 5``, ``AB \\approx 5`` and ``m\\angle ABC = 30``
    keep the right-hand side). ``\\dfrac``/``\\tfrac`` become ``\\frac`` and a
    parenthesised choice letter ``(B)`` becomes ``B``.

    The values are separated, outside any ``()``, ``[]`` or ``{}`` group, by ``,``, ``;``,
    a LaTeX line break ``\\\\``, ``\\lor``, ``\\vee`` and the words "or" and "and" in
    lower case (also inside ``\\text{}``; ``OR`` names a segment). The elements of a set
    ``\\{3, 4\\}`` are its values, while a parenthesised or bracketed tuple or interval
    (``(1, 2)``, ``[0, 1)``) is one value. ``2 \\pm 1`` offers two values, ``2+1`` and
    ``2-1`` (``\\mp`` the other way round).

    An equation chain (``x = 2\\sqrt{3} \\approx 3.46``) offers its last side. Every side
    that evaluates to a number must agree with the last number of the chain: equal, or
    one of the two a decimal literal that rounds the other (``3.46`` for
    ``2\\sqrt{3}``: within half a unit in its last place). ``x = 5 = 6`` or
    ``3 \\cdot 4 = 13`` contradicts itself, and so do two equations run together,
    ``x = 2 \\quad y = 3``: a middle side made of a number literal, whitespace and a name
    (``2 y``, ``5 AB``, ``30 m\\angle B``) states that number.
    """
    text = _clean(raw)
    values = []
    for part in _split_values(text):
        for variant in _expand_plus_minus(part):
            value = _single_value(variant)
            if not value:
                return None
            values.append(value)
    return tuple(values) or None


def _clean(text: str) -> str:
    """Normalisations that apply to the whole answer, before it is split into values."""
    text = text.replace(_LINE_BREAK, ";")
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
    return _THOUSANDS.sub("", text)


def _split_values(text: str) -> list[str]:
    """Split a cleaned answer at its top-level separators; blank pieces are dropped."""
    text = _ALTERNATIVE.sub(";", text)
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    position = 0
    while position < len(text):
        char = text[position]
        if char == "\\" and text[position + 1 : position + 2] in ("{", "}"):
            if depth:  # an escaped brace inside a group is part of that value
                current.append(text[position : position + 2])
            position += 2  # the braces of a top-level set are dropped: its elements are the values
            continue
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth = max(depth - 1, 0)
        elif depth == 0 and char in ",;":
            parts.append("".join(current))
            current = []
            position += 1
            continue
        current.append(char)
        position += 1
    parts.append("".join(current))
    return [part for part in parts if part.strip()]


def _expand_plus_minus(part: str) -> tuple[str, ...]:
    """``a \\pm b`` as its two values ``a + b`` and ``a - b``; other text as itself."""
    if not _PLUS_MINUS.search(part):
        return (part,)
    plus = _PLUS_MINUS.sub(lambda sign: " + " if sign.group(1) == "pm" else " - ", part)
    minus = _PLUS_MINUS.sub(lambda sign: " - " if sign.group(1) == "pm" else " + ", part)
    return (plus, minus)


def _single_value(part: str) -> str | None:
    """Canonical text of one value (the last side of an equation chain); None when the
    numeric sides of the chain disagree."""
    sides = part.split("=")
    numbers: list[tuple[Number, str]] = []
    for position, side in enumerate(sides):
        text = _canonical(side)
        value = evaluate(text) if text else None
        if value is None and 0 < position < len(sides) - 1:
            value, text = _leading_value(side)
        if value is not None:
            numbers.append((value, text))
    if numbers and not all(_consistent(number, numbers[-1]) for number in numbers[:-1]):
        return None
    return _canonical(sides[-1])


def _canonical(text: str) -> str:
    """Canonical text of one side: units, trailing periods and whitespace removed."""
    text = " ".join(text.split()).replace(" ^", "^").replace("^ ", "^")
    text = _strip_units(text.rstrip(". ")).rstrip(". ")
    if choice := _CHOICE.fullmatch(text):
        text = choice.group(1)
    return text.replace(" ", "")


def _leading_value(side: str) -> tuple[Number | None, str]:
    """The number that starts a middle side of two equations run together: ``2`` in
    ``2 y`` (from ``x = 2 \\quad y = 3``), a number literal, whitespace, then the name of
    the next equation. A side like ``\\pi r^2`` or ``2 \\pi r`` is a formula, not this."""
    run_on = _RUN_ON.fullmatch(" ".join(side.split()))
    if run_on is None:
        return None, ""
    return evaluate(run_on.group(1)), run_on.group(1)


def _consistent(a: tuple[Number, str], b: tuple[Number, str]) -> bool:
    """Whether two sides of a chain state the same number: equal, or one of them a decimal
    literal within half a unit in its last place of the other (a correct rounding)."""
    if values_equal(a[0], b[0]):
        return True
    places = [_decimal_places(match) for _, text in (a, b) if (match := _DECIMAL.fullmatch(text))]
    if not places:
        return False
    return abs(Fraction(a[0]) - Fraction(b[0])) * 2 * 10 ** min(places) <= 1


def _decimal_places(literal: re.Match[str]) -> int:
    return len(literal.group(1) or literal.group(2) or "")


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

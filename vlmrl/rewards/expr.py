"""A bounded evaluator for the arithmetic that appears in final answers.

Model output is untrusted, so it is never handed to ``eval``, ``sympify`` or a LaTeX
front end. This module parses a small grammar by recursive descent and evaluates it
to a :class:`~fractions.Fraction` while the arithmetic stays rational, or to a float
once an irrational operation (a non-square root, ``\\pi``, a fractional power) occurs::

    sum      := product (("+" | "-") product)*
    product  := signed (("*" | "/" | "\\cdot" | "\\times" | "\\div") signed | factor)*
    signed   := ("+" | "-")* power
    power    := factor ("^" signed)?                    right-associative
    factor   := number | "(" sum ")" | "{" sum "}" | "[" sum "]"
              | "\\frac" arg arg | "\\sqrt" ("[" sum "]")? arg | "\\pi" | "pi"
    arg      := "{" sum "}" | digit | "\\" command         (so \\frac12 and \\sqrt2 work)

A factor that follows another without an operator multiplies it (``2\\sqrt{3}``,
``3\\pi``, ``2(1+1)``); two bare numbers never do, so ``1 2`` is rejected.

Every evaluation is bounded regardless of the input: text longer than
:data:`MAX_EXPRESSION_CHARS`, nesting deeper than :data:`MAX_DEPTH`, number literals
longer than :data:`MAX_LITERAL_DIGITS`, exponents beyond :data:`MAX_EXPONENT` in
magnitude and intermediate values beyond ``10**MAX_LOG10_MAGNITUDE`` all make the
expression "not evaluable" (``None``) at once, so ``9^9^9^9`` costs microseconds.
"""

from __future__ import annotations

import math
from fractions import Fraction

Number = Fraction | float

MAX_EXPRESSION_CHARS = 2000
MAX_DEPTH = 50
MAX_LITERAL_DIGITS = 100
MAX_EXPONENT = 64
MAX_LOG10_MAGNITUDE = 100

_MAX_MAGNITUDE = 10**MAX_LOG10_MAGNITUDE
# Rationals whose denominator grows past this many bits continue as floats, which keeps
# big-integer arithmetic cheap; their magnitude is bounded separately.
_MAX_DENOMINATOR_BITS = 512
_DIGITS = "0123456789"
_GROUPS = {"(": ")", "{": "}", "[": "]"}
_MULTIPLY = ("*", "\\cdot", "\\times")
_DIVIDE = ("/", "\\div")
_FACTOR_COMMANDS = ("\\frac", "\\sqrt", "\\pi", "pi")


class NotEvaluable(ValueError):
    """The text is outside the grammar or one of the evaluation bounds."""


def evaluate(text: str) -> Number | None:
    """Value of ``text`` under the grammar above, or None when it is not evaluable."""
    if len(text) > MAX_EXPRESSION_CHARS:
        return None
    try:
        return _Parser(text).parse()
    except NotEvaluable:
        return None


class _Parser:
    """Recursive-descent parser over one string; one instance per evaluation."""

    def __init__(self, text: str) -> None:
        self._text = text
        self._pos = 0
        self._depth = 0

    def parse(self) -> Number:
        value = self._sum()
        if self._peek():
            raise NotEvaluable(f"unexpected {self._peek()!r} at {self._pos}")
        return value

    # -- lexical helpers ---------------------------------------------------------------

    def _peek(self) -> str:
        """The next token without consuming it: a character, a ``\\command`` or a word."""
        text, pos = self._text, self._pos
        while pos < len(text) and text[pos].isspace():
            pos += 1
        self._pos = pos
        if pos == len(text):
            return ""
        end = pos + 1
        if text[pos] == "\\" or _is_ascii_letter(text[pos]):
            while end < len(text) and _is_ascii_letter(text[end]):
                end += 1
        return text[pos:end]

    def _take(self, token: str) -> None:
        if self._peek() != token:
            raise NotEvaluable(f"expected {token!r} at {self._pos}")
        self._pos += len(token)

    def _nested(self) -> None:
        """Enter one level of nesting (a factor or an exponent); the caller leaves it."""
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise NotEvaluable("nested too deeply")

    # -- grammar -----------------------------------------------------------------------

    def _sum(self) -> Number:
        value = self._product()
        while (token := self._peek()) in ("+", "-"):
            self._take(token)
            operand = self._product()
            value = _bounded(value + operand if token == "+" else value - operand)
        return value

    def _product(self) -> Number:
        value = self._signed()
        while True:
            token = self._peek()
            if token in _MULTIPLY:
                self._take(token)
                value = _bounded(value * self._signed())
            elif token in _DIVIDE:
                self._take(token)
                value = _divide(value, self._signed())
            elif token in _GROUPS or token in _FACTOR_COMMANDS:
                value = _bounded(value * self._power())
            else:
                return value

    def _signed(self) -> Number:
        negative = False
        while (token := self._peek()) in ("+", "-"):
            self._take(token)
            negative ^= token == "-"
        value = self._power()
        return -value if negative else value

    def _power(self) -> Number:
        base = self._factor()
        if self._peek() != "^":
            return base
        self._take("^")
        self._nested()
        exponent = self._signed()
        self._depth -= 1
        return _power(base, exponent)

    def _factor(self) -> Number:
        self._nested()
        token = self._peek()
        if token in _GROUPS:
            self._take(token)
            value = self._sum()
            self._take(_GROUPS[token])
        elif token and (token in _DIGITS or token == "."):
            value = self._number()
        elif token == "\\frac":
            self._take(token)
            numerator = self._argument()
            value = _divide(numerator, self._argument())
        elif token == "\\sqrt":
            self._take(token)
            index: Number = Fraction(2)
            if self._peek() == "[":
                self._take("[")
                index = self._sum()
                self._take("]")
            value = _root(self._argument(), index)
        elif token in ("\\pi", "pi"):
            self._take(token)
            value = math.pi
        else:
            raise NotEvaluable(f"unexpected {token or 'end of input'!r} at {self._pos}")
        self._depth -= 1
        return value

    def _argument(self) -> Number:
        """A command argument: a braced group, a single digit, or a command."""
        token = self._peek()
        if token == "{" or token.startswith("\\"):
            return self._factor()
        if token in _DIGITS and token:
            self._pos += 1
            return Fraction(int(token))
        raise NotEvaluable(f"missing argument at {self._pos}")

    def _number(self) -> Fraction:
        text, start = self._text, self._pos
        end = start
        while end < len(text) and text[end] in _DIGITS:
            end += 1
        whole = text[start:end]
        fraction = ""
        if end < len(text) and text[end] == ".":
            fraction_start = end + 1
            end = fraction_start
            while end < len(text) and text[end] in _DIGITS:
                end += 1
            fraction = text[fraction_start:end]
        if not (whole or fraction):
            raise NotEvaluable(f"lone '.' at {start}")
        if len(whole) + len(fraction) > MAX_LITERAL_DIGITS:
            raise NotEvaluable(f"number literal longer than {MAX_LITERAL_DIGITS} digits")
        self._pos = end
        scale = 10 ** len(fraction)
        return Fraction(int(whole or "0") * scale + int(fraction or "0"), scale)


def _is_ascii_letter(char: str) -> bool:
    return "a" <= char <= "z" or "A" <= char <= "Z"


def _bounded(value: Number) -> Number:
    """Check the magnitude bound; demote rationals with runaway denominators to float."""
    if isinstance(value, Fraction):
        if value.denominator.bit_length() <= _MAX_DENOMINATOR_BITS:
            if abs(value.numerator) > _MAX_MAGNITUDE * value.denominator:
                raise NotEvaluable("value out of range")
            return value
        value = float(value)
    if not math.isfinite(value) or abs(value) > _MAX_MAGNITUDE:
        raise NotEvaluable("value out of range")
    return value


def _divide(numerator: Number, denominator: Number) -> Number:
    if denominator == 0:
        raise NotEvaluable("division by zero")
    return _bounded(numerator / denominator)


def _power(base: Number, exponent: Number) -> Number:
    if abs(exponent) > MAX_EXPONENT:
        raise NotEvaluable(f"exponent beyond {MAX_EXPONENT}")
    integral = isinstance(exponent, Fraction) and exponent.denominator == 1
    if base == 0:
        if exponent < 0 or (exponent == 0 and not integral):
            raise NotEvaluable("zero to a non-positive power")
        return Fraction(1) if exponent == 0 else Fraction(0)
    if not integral and base < 0:
        raise NotEvaluable("fractional power of a negative number")
    # Reject before computing: |base ** exponent| = 10 ** (exponent * log10 |base|).
    if abs(float(exponent) * math.log10(abs(base))) > MAX_LOG10_MAGNITUDE:
        raise NotEvaluable("power out of range")
    if integral:
        return _bounded(base ** int(exponent))
    return _bounded(float(base) ** float(exponent))


def _root(radicand: Number, index: Number) -> Number:
    if not (isinstance(index, Fraction) and index.denominator == 1 and 2 <= index <= MAX_EXPONENT):
        raise NotEvaluable("root index must be an integer from 2 to 64")
    n = int(index)
    if radicand < 0:
        if n % 2 == 0:
            raise NotEvaluable("even root of a negative number")
        return -_root(-radicand, index)
    if isinstance(radicand, Fraction):
        numerator = _exact_root(radicand.numerator, n)
        denominator = _exact_root(radicand.denominator, n)
        if numerator is not None and denominator is not None:
            return Fraction(numerator, denominator)
    return _bounded(float(radicand) ** (1.0 / n))


def _exact_root(value: int, n: int) -> int | None:
    """The integer ``n``-th root of a non-negative ``value`` when it is exact, else None."""
    guess = math.isqrt(value) if n == 2 else round(float(value) ** (1.0 / n))
    for candidate in (guess - 1, guess, guess + 1):
        if candidate >= 0 and candidate**n == value:
            return candidate
    return None

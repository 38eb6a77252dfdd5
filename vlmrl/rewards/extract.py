"""Locate the final answer in a model response.

The final answer is the argument of the last ``\\boxed`` or ``\\fbox`` in the response.
Extraction is linear in the length of the response and never reads more than
:data:`MAX_ANSWER_CHARS` characters of the box itself, so a megabyte of text or an
unbalanced box costs one backwards scan.
"""

from __future__ import annotations

MAX_ANSWER_CHARS = 2000
"""Longest box argument that is considered an answer; longer ones are rejected."""

BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> str | None:
    """Return the argument of the last ``\\boxed``/``\\fbox`` in ``text``, or None.

    Three spellings are recognised: ``\\boxed{...}`` (nested and escaped braces are
    balanced), ``\\boxed 5`` and ``\\boxed5`` (the argument runs to the next whitespace or
    ``$``). Only the last box counts: when it is malformed (unbalanced, empty after the
    command, longer than :data:`MAX_ANSWER_CHARS`) the result is None, never an earlier
    box.
    """
    start = argument_start = -1
    for command in BOX_COMMANDS:
        position = _last_command(text, command)
        if position > start:
            start, argument_start = position, position + len(command)
    if start < 0:
        return None
    return _read_argument(text, argument_start)


def _last_command(text: str, command: str) -> int:
    """Index of the last ``command`` that is not the prefix of a longer command name."""
    end = len(text)
    while (position := text.rfind(command, 0, end)) >= 0:
        following = position + len(command)
        if following == len(text) or not text[following].isalpha():
            return position
        end = position
    return -1


def _read_argument(text: str, position: int) -> str | None:
    while position < len(text) and text[position].isspace():
        position += 1
    if position == len(text):
        return None
    if text[position] == "{":
        return _read_braced(text, position)
    end = position
    limit = min(len(text), position + MAX_ANSWER_CHARS + 1)
    while end < limit and not text[end].isspace() and text[end] != "$":
        end += 1
    if end - position > MAX_ANSWER_CHARS:
        return None
    return text[position:end]


def _read_braced(text: str, open_brace: int) -> str | None:
    depth = 0
    position = open_brace
    limit = min(len(text), open_brace + MAX_ANSWER_CHARS + 2)
    while position < limit:
        char = text[position]
        if char == "\\":
            position += 2  # an escaped character, e.g. \{ or \}, never balances a brace
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_brace + 1 : position]
        position += 1
    return None

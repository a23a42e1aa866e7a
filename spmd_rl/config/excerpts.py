"""What an error line shows of a value the user gave: never more than a short excerpt, however large the value."""

from __future__ import annotations

import reprlib
from typing import Any

EXCERPT_CHARS = 80  # the most of a value an error line shows
MESSAGE_CHARS = 400  # the most of another library's error message (which may quote the value) a line shows

_excerpts = reprlib.Repr()
_excerpts.maxstring = _excerpts.maxother = EXCERPT_CHARS
_excerpts.maxlong = 40
_excerpts.maxlevel = 3


def clip(text: str, limit: int = EXCERPT_CHARS) -> str:
    """text, or when longer than limit its head and tail and its length."""
    text = str(text)
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    return f"{text[:head]}...{text[head - limit + 3 :]} ({len(text)} characters)"


def excerpt(value: Any) -> str:
    """repr(value), cut to about EXCERPT_CHARS characters (a string keeps its head and tail and says its length)."""
    if isinstance(value, str):
        if len(value) <= EXCERPT_CHARS:
            return repr(value)
        head = EXCERPT_CHARS * 2 // 3
        tail = EXCERPT_CHARS - 3 - head
        return f"{repr(value[:head])[:-1]}...{repr(value[-tail:])[1:]} ({len(value)} characters)"
    try:
        text = _excerpts.repr(value)
    except ValueError:  # an int too long for repr() (over 4300 digits)
        return f"<an integer of about {int(value.bit_length() * 0.30103)} digits>"
    return text if len(text) <= EXCERPT_CHARS else f"{text[: EXCERPT_CHARS - 3]}..."


def first_line(exc: BaseException) -> str:
    """'Type: the first line of its message', clipped: an exception from the user's code in one short line."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {clip(lines[0], MESSAGE_CHARS)}" if lines else type(exc).__name__


LISTED_NAMES = 4  # names an error line lists before "and N more"


def listed(names: list[str]) -> str:
    """The first few names, then how many more: a long list of keys in one short error line."""
    shown = ", ".join(names[:LISTED_NAMES])
    return shown if len(names) <= LISTED_NAMES else f"{shown} and {len(names) - LISTED_NAMES} more"

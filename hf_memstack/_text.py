"""Received text shown safely: a string read from a file someone else wrote (a config's
``model_type``, an ``architectures`` entry, a path) can hold characters a terminal acts on instead
of showing - U+202E (right-to-left override) turns the rest of the line around, NUL and escape
sequences are not seen at all. :func:`printable` writes each such character as its escape."""

from __future__ import annotations

__all__ = ["printable"]


def printable(text: str, *, keep: str = "\n") -> str:
    """``text`` with every character that is not printable (``str.isprintable``: controls, format
    characters such as U+202E, surrogates, unassigned code points) written as its Python escape
    (``\\u202e``, ``\\x00``); the characters in ``keep`` (newlines) are kept as they are."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else ascii(c)[1:-1] for c in text)

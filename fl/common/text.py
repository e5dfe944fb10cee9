"""Untrusted strings made safe to log: bounded in length, with no terminal escapes.

A client's error reason, a metric key or a string read from a file reaches our logs and
terminals; raw, one can be megabytes long or carry ANSI sequences that rewrite what an
operator sees. `shown` is the one place such a string is made printable.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SHOWN_CHARS", "shown"]

SHOWN_CHARS = 200  # the most characters of an untrusted string that reach a log line


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """`value` as printable text of at most about `limit` characters: every control or
    non-printable character (ESC, CR, newline, bidi overrides) escaped as `\\xNN` /
    `\\uNNNN`, and a longer text cut, saying how long it was."""
    text = value if isinstance(value, str) else str(value)
    head = text[:limit]
    safe = "".join(c if c.isprintable() else _escape(c) for c in head)
    if len(text) > limit:
        safe += f"… ({len(text)} characters)"
    return safe


def _escape(char: str) -> str:
    code = ord(char)
    return (
        f"\\x{code:02x}"
        if code < 0x100
        else f"\\u{code:04x}"
        if code < 0x10000
        else f"\\U{code:08x}"
    )

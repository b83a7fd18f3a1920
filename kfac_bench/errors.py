"""Errors that are the user's to fix.

The CLI catches :class:`UserError`, prints its one-line message (no traceback) and exits with status 2.
Every message names the problem and the fix.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input (config, paths, data), reported as one line with exit code 2."""

    exit_code = 2


class ConfigError(UserError):
    """A config name, key or value that does not exist or does not fit."""


class DatasetError(UserError):
    """A dataset path that is missing or not in the layout the loader reads."""

    def __init__(self, path: object, expected: str, how_to_get: str = "") -> None:
        msg = f"dataset not found or malformed at '{path}': expected {expected}"
        if how_to_get:
            msg += f". {how_to_get}"
        super().__init__(msg)
        self.path = path


def visible(text: str) -> str:
    """``text`` with every character that is not printable (newlines, ANSI escapes, BEL, other control and
    format characters) written as its Python escape (``\\x1b``), so a name read from a file or a path can
    neither drive the terminal nor break a line of a report or an error."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)

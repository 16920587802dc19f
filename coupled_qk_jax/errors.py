"""The one exception type for mistakes a user can fix (a bad flag, config value, corpus or run directory).

The command lines (training/cli.py) print a :class:`UserError` as one line ``error: <message>`` and exit with
status 2, without a traceback. Every other exception is a bug or an environment failure and keeps its traceback.
It subclasses ValueError so that library callers catching ValueError for bad arguments keep working.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class UserError(ValueError):
    """A mistake the user can fix; the message is one line naming the problem and the fix."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """' (did you mean "x"?)' for the closest of ``choices`` to ``name``, or '' when none is close."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f' (did you mean "{close[0]}"?)' if close else ""

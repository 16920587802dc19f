"""Shared command-line plumbing for train.py and eval.py: absl flags, ml_collections config files, one-line errors.

Bad input is reported as ``error: <one line>`` on stderr with exit status 2 (no traceback); a non-finite loss exits
with status 3 after keeping the last good checkpoint; SIGTERM exits 0 after saving.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

from coupled_qk_jax.training.loop import NonFiniteLossError

EXIT_BAD_INPUT = 2
EXIT_NONFINITE = 3


def run_guarded(fn: Callable[[], object]) -> int:
    """Run ``fn``; turn the errors a user can cause into one line on stderr and an exit status."""
    try:
        fn()
    except NonFiniteLossError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_NONFINITE
    except (ValueError, FileNotFoundError, NotADirectoryError, KeyError) as e:
        # ValueError covers CorpusError (data layer) and the config / checkpoint checks; the message is one line.
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: {msg}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    return 0


def exit_process(code: int) -> None:
    """Exit with ``code``. After a bad-input error nothing was trained or is being saved, so skip interpreter
    shutdown: orbax's idle background threads can otherwise print a traceback after the one-line error."""
    if code == EXIT_BAD_INPUT:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)

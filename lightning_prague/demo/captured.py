"""Run a function with its output, and that of any process it forks, captured in a log file.

Training runs whose ranks are forked from the calling process (`start_method="fork"`) import
Lightning once for many runs; this keeps each run's output (its ranks' included, which write to
the same file descriptors) out of the caller's console. Used by `lightning-prague bench`, the
demo's side-by-side comparison and the tests' batch runner.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def output_to(log: Path, cwd: Path | None = None) -> Any:
    """Send file descriptors 1 and 2, and `sys.stdout`/`sys.stderr`, to `log` (and optionally work
    in `cwd`) for the duration."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    streams = sys.stdout, sys.stderr  # not always the file descriptors (pytest, notebooks)
    previous = os.getcwd()
    with open(log, "w", buffering=1) as handle:
        os.dup2(handle.fileno(), 1)
        os.dup2(handle.fileno(), 2)
        sys.stdout = sys.stderr = handle
        try:
            if cwd is not None:
                os.chdir(cwd)
            yield
        finally:
            handle.flush()
            sys.stdout, sys.stderr = streams
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            os.chdir(previous)


def run_captured(target: Callable[[], Any], log: Path, cwd: Path | None = None) -> int:
    """Call `target` with its output in `log`; returns an exit status (0, a `SystemExit` code, or 1
    after an exception, whose traceback goes to the log)."""
    with output_to(log, cwd):
        try:
            target()
            return 0
        except SystemExit as stop:
            return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:
            traceback.print_exc()
            return 1

"""Usage: gated.py FILE... -- MODULE ARG...: wait until every FILE exists (at most 120 s), then run MODULE
as ``python -m MODULE ARG...`` would: a process forked from a test (`helpers.run_forked_together`) that
must start only once others have (a worker that joins a running job)."""

from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path

WAIT_SECONDS = 120.0


def main() -> None:
    split = sys.argv.index("--")
    files, (module, *argv) = [Path(f) for f in sys.argv[1:split]], sys.argv[split + 1 :]
    deadline = time.monotonic() + WAIT_SECONDS
    while not all(f.exists() for f in files):
        if time.monotonic() > deadline:
            sys.exit(f"gated.py: {[str(f) for f in files if not f.exists()]} did not appear within {WAIT_SECONDS:.0f}s")
        time.sleep(0.1)
    sys.argv = [module, *argv]
    sys.modules.pop(module, None)  # imported by the test already: runpy would warn of a module run twice
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

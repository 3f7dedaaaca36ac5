"""Runs several scripts (or one script several times) in one process, each run's ranks forked from it.

One interpreter and one import of Lightning for all the runs. Usage: ``run_many.py SPEC.json``,
where SPEC.json is a list of ``{"script": ..., "dir": ..., "args": [...]}``; each run executes the
script as ``__main__`` with those arguments in its ``dir``, writes its stdout and stderr (its
forked ranks' included) to ``dir/log.txt`` and its exit status (0; a ``SystemExit`` code; 1 after
an exception) to ``dir/exit``.
"""

import json
import os
import runpy
import sys
import traceback
from pathlib import Path


def run(script: str, directory: Path, args: list[str]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(directory / "log.txt", "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        os.chdir(directory)
        sys.argv = [script, *args]
        try:
            runpy.run_path(script, run_name="__main__")
            status = 0
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:
            traceback.print_exc()
            status = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
    return status


if __name__ == "__main__":
    for spec in json.loads(Path(sys.argv[1]).read_text()):
        directory = Path(spec["dir"])
        (directory / "exit").write_text(str(run(spec["script"], directory, spec["args"])))

"""Runs several scripts (or one script several times) in one process, each run's ranks forked from it.

One interpreter and one import of Lightning for all the runs. Usage: ``run_many.py SPEC.json``,
where SPEC.json is a list of ``{"script": ..., "dir": ..., "args": [...]}``; each run executes the
script as ``__main__`` with those arguments in its ``dir``, writes its stdout and stderr (its
forked ranks' included) to ``dir/log.txt`` and its exit status (0; a ``SystemExit`` code; 1 after
an exception) to ``dir/exit``.
"""

import json
import runpy
import sys
from pathlib import Path

from lightning_prague.demo.captured import run_captured


def run(script: str, directory: Path, args: list[str]) -> int:
    def target() -> None:
        sys.argv = [script, *args]
        runpy.run_path(script, run_name="__main__")

    return run_captured(target, directory / "log.txt", cwd=directory)


if __name__ == "__main__":
    for spec in json.loads(Path(sys.argv[1]).read_text()):
        directory = Path(spec["dir"])
        (directory / "exit").write_text(str(run(spec["script"], directory, spec["args"])))

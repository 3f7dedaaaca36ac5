"""Runs ``train.py`` several times in one process, each run's ranks forked from it.

One interpreter and one import of Lightning for all the runs. Usage: ``train_many.py SPEC.json``,
where SPEC.json is a list of ``{"dir": ..., "args": [...]}``; each run works in its ``dir``, writes
its stdout and stderr (its forked ranks' included) to ``dir/log.txt``, rank 0's result to
``dir/result.json`` and its exit status (0, or 1 after an exception) to ``dir/exit``.
"""

import json
import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train  # noqa: E402  (tests/scripts/train.py)


def run(directory: Path, args: list[str]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(directory / "log.txt", "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        os.chdir(directory)
        sys.argv = ["train.py", "--json", str(directory / "result.json"), *args, "--start-method", "fork"]
        try:
            train.main()
            status = 0
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
    torch.set_num_threads(1)
    for spec in json.loads(Path(sys.argv[1]).read_text()):
        directory = Path(spec["dir"])
        (directory / "exit").write_text(str(run(directory, spec["args"])))

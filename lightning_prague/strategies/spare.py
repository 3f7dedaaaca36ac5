"""A warm spare: a process that has imported torch and Lightning and waits to become a lost rank.

Most of the time a restarted rank needs before it can rejoin is its interpreter importing torch and
Lightning (4-5 s on a free CPU core, more next to busy ranks). With `max_restarts` the node's agent
(`lightning_prague.strategies.launcher.RankAgent`) keeps one such process ready, and so does each
rank's keeper under other launchers (`lightning_prague.strategies.keeper`): started as
`python -m lightning_prague.strategies.spare <the rank's command>`, it imports the heavy modules
and then blocks on its standard input. When a rank is lost the agent (or keeper) writes it one line, the
environment of the rank's new process as a JSON object of strings; the spare takes that
environment and runs the rank's command in itself (`runpy`, as `python -m` or `python script.py`
would: the script's `__main__`, its arguments in `sys.argv`). End of input (the agent is gone)
ends the spare. The line comes from the agent that started it, through a pipe no other process
holds; it is still checked (a JSON object of strings, bounded) before anything runs.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import threading

from lightning_prague.strategies.keeper import spare_environment

__all__ = ["MAX_ENVIRONMENT_BYTES", "read_environment", "run_command", "spare_environment"]

#: the longest line the spare reads (the environment of a rank), bytes
MAX_ENVIRONMENT_BYTES = 1 << 20


def read_environment(line: bytes) -> dict[str, str]:
    """The environment the agent sent: a JSON object of strings; `ValueError` for anything else."""
    if len(line) > MAX_ENVIRONMENT_BYTES:
        raise ValueError(f"an environment of {len(line)} bytes (at most {MAX_ENVIRONMENT_BYTES})")
    environment = json.loads(line)
    if not isinstance(environment, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
        for k, v in environment.items()
    ):
        raise ValueError("the environment is not a JSON object of strings")
    return environment


def run_command(command: list[str]) -> None:
    """Run `command` (`[-m module | script] args...`, without the interpreter) in this process."""
    if len(command) >= 2 and command[0] == "-m":
        sys.argv = [command[1], *command[2:]]
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
    elif command:
        script = os.path.abspath(command[0])
        sys.argv = [script, *command[1:]]
        runpy.run_path(script, run_name="__main__")  # its folder is on the path (`spare_environment`)
    else:
        raise ValueError("no command to run")


def _import_heavy_modules() -> None:
    import lightning.pytorch  # noqa: F401  (the imports are what the spare is kept for)
    import torch  # noqa: F401

    import lightning_prague.strategies  # noqa: F401


def main() -> None:
    command = sys.argv[1:]
    # the imports run while the spare waits: one that is told at once that it is not needed ends at once
    imports = threading.Thread(target=_import_heavy_modules, name="prague-spare-imports", daemon=True)
    imports.start()
    line = sys.stdin.buffer.readline(MAX_ENVIRONMENT_BYTES + 1)
    if not line.strip():
        sys.stdout.flush()
        os._exit(0)  # the agent is gone, or needs no spare any more (an import may still be running)
    imports.join()
    try:
        environment = read_environment(line)
    except ValueError as err:
        sys.exit(f"lightning_prague spare: {err}")
    os.environ.clear()
    os.environ.update(environment)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the rank reads no input, as a rank Lightning starts
    sys.stdin = open(os.devnull)  # noqa: SIM115
    run_command(command)


if __name__ == "__main__":
    main()

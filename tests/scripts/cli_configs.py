"""Runs ``lightning-prague fit`` for several argument lists in one process (ranks forked from it).

One interpreter and one import of Lightning for all of them instead of one per config. Usage:
``cli_configs.py OUT.json ARGS_JSON`` where ARGS_JSON is a JSON list of argument lists; OUT.json
gets, per list, ``null`` when the fit succeeded or the error's text.
"""

import json
import sys
import traceback

from lightning_prague.cli import main


def run_all(argument_lists: list[list[str]]) -> list:
    outcomes = []
    for arguments in argument_lists:
        try:
            main(arguments)
            outcomes.append(None)
        except BaseException as error:  # SystemExit from a bad option included
            outcomes.append(f"{type(error).__name__}: {error}\n{traceback.format_exc()[-3000:]}")
    return outcomes


if __name__ == "__main__":
    out, argument_lists = sys.argv[1], json.loads(sys.argv[2])
    with open(out, "w") as f:
        json.dump(run_all(argument_lists), f)

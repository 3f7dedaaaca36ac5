"""The emulated ``sbatch`` and ``srun`` (`lightning_prague.tools.cluster.batch`) on this machine, one
node, no network namespaces: what a batch script's tasks see, ``--kill-on-bad-exit``, and the
options it refuses. The example batch script runs on the emulated cluster in `test_cluster.py`."""

from __future__ import annotations

import os
import time

import pytest

from lightning_prague.tools.cluster.batch import parse_srun_options, run_batch
from lightning_prague.tools.cluster.srun import Layout

pytestmark = pytest.mark.timeout(60)

#: each task writes what it sees; then task 1 fails with status 3, and task 0 would sleep
SCRIPT = """
set -euo pipefail
export FROM_SCRIPT=exported
srun {option} sh -c '
  echo "$SLURM_PROCID $SLURM_LOCALID $SLURM_NTASKS $SLURM_JOB_ID $FROM_SCRIPT" > "$OUT/task.$SLURM_PROCID"
  if [ "$SLURM_PROCID" = 1 ]; then sleep 1; exit 3; fi
  sleep {sleep}'
"""


def run_script(tmp_path, option: str, sleep: float) -> tuple[int, float]:
    script = tmp_path / "job.sbatch"
    script.write_text(SCRIPT.format(option=option, sleep=sleep))
    env = {**os.environ, "OUT": str(tmp_path)}
    start = time.monotonic()
    status = run_batch(script, [], Layout(1, 0, 2, "node1"), "4242", env=env)
    return status, time.monotonic() - start


@pytest.mark.timeout(150)
def test_the_tasks_see_slurms_variables_and_the_scripts_exports_and_a_failure_ends_the_step(tmp_path):
    """One run (each costs the shim's import of the package): with ``--kill-on-bad-exit=1`` task 1's
    failure ends task 0's 100 s sleep, and the step's status, the script's, is task 1's. (Each task
    imports the package first: the run took 21 s once under load, so the bound is far from both.)"""
    status, seconds = run_script(tmp_path, "--kill-on-bad-exit=1", sleep=100)
    assert status == 3 and seconds < 70, (status, seconds)  # task 0 was killed, not waited for
    assert (tmp_path / "task.0").read_text().split() == ["0", "0", "2", "4242", "exported"]
    assert (tmp_path / "task.1").read_text().split() == ["1", "1", "2", "4242", "exported"]


@pytest.mark.parametrize(
    "argv,kill,command",
    [
        (["--kill-on-bad-exit=0", "python", "train.py"], False, ["python", "train.py"]),
        (["--kill-on-bad-exit", "python", "-u"], True, ["python", "-u"]),
        (["-K", "--", "hostname"], True, ["hostname"]),
        (["-K0", "hostname", "-f"], False, ["hostname", "-f"]),
    ],
)
def test_srun_options_it_knows(argv, kill, command):
    assert parse_srun_options(argv) == (kill, command)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--ntasks=4", "python", "train.py"], "'--ntasks=4' is not emulated"),
        (["--kill-on-bad-exit=2", "python"], "takes 0 or 1, not '2'"),
        (["--kill-on-bad-exit=0"], "no command"),
    ],
)
def test_srun_options_it_does_not_know_are_refused_by_name(argv, message):
    with pytest.raises(SystemExit, match=message):
        parse_srun_options(argv)

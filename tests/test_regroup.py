"""A second and a third loss while the survivors rebuild their process group (`Job.regroup`): the
rebuild is abandoned at once and starts again among the new survivors, and every survivor's fit
returns with one model. In real processes: core-only ranks that die inside the rebuild
(`scripts/regroup_worker.py`), and Lightning fits with two ranks killed in quick succession and
two more inside the rebuild (`scripts/rebuild_faults.py`)."""

from __future__ import annotations

import json
import time

import pytest
from helpers import run_core_ranks, run_script_ranks

import lightning_prague.demo.run  # noqa: F401  (imported once here: the ranks are forked from this process)

pytestmark = pytest.mark.timeout(90)

# the job's timeouts in these runs are 60 s (core) and 300 s (Lightning): a rebuild that waited for
# a lost member would take that long
QUICK = 20.0


@pytest.mark.parametrize(
    ("world", "deaths", "attempts"),
    [
        # rank 5 lost before the meeting; in the rebuild, rank 4 dies before it publishes its address,
        # then rank 3 once the others are connecting to it
        (6, {"5": "start", "4": [1, "before-key"], "3": [2, "after-key"]}, 3),
        # rank 0 (the supervisor's parent) lost first; then rank 1 while connecting, rank 3 before its address
        (5, {"0": "start", "1": [1, "after-key"], "3": [2, "before-key"]}, 3),
    ],
)
def test_members_that_die_inside_the_rebuild_cost_an_attempt_each_not_a_timeout(tmp_path, world, deaths, attempts):
    dead = tuple(int(r) for r in deaths)
    start = time.monotonic()
    results = run_core_ranks(tmp_path, world, json.dumps(deaths), script="regroup_worker.py", timeout=60, may_die=dead)
    survivors = [r for r in range(world) if r not in dead]
    mean = sum(survivors) / len(survivors)
    for rank in survivors:
        got = results[rank]
        assert got["members"] == got["worker_members"] == got["release_members"] == survivors, got
        assert got["departed"] == sorted(dead)
        assert got["rebuilds"] == attempts, got  # one attempt per loss inside it, the same on every survivor
        assert got["params"] == [mean] * 5  # the global average over the new group
        assert got["sync_seconds"] < QUICK, got
    assert time.monotonic() - start < 45


def run_ranks(tmp, world: int, script: str, argv: list[str], timeout: float = 90) -> tuple[list, list[str]]:
    """``scripts/<script>`` as ``world`` ranks started as a cluster launcher would (`run_script_ranks`)."""
    return run_script_ranks(tmp, world, script, argv, timeout)


#: 6 workers, one short epoch of 20 ms steps (about 15 batches each)
WORKLOAD = ["--epochs", "1", "--step-time", "0.02", "--batch-size", "16", "--group-size", "2", "--devices", "6"]


@pytest.mark.parametrize(
    ("strategy", "faults", "lost"),
    [
        # `prague`'s faults strike at a rank's first batch, the one its work queue sets aside for it: under
        # load the queue lets a slow rank train as few as 2 batches, and a fault at its 8th never struck
        ("prague", ["--fault", "2:1:kill", "--fault", "4:1:kill"], [2, 4]),
        ("decent_adam", ["--fault", "2:8:kill", "--fault", "4:9:kill"], [2, 4]),
        # rank 2 killed in training; at the epoch's end, inside the rebuild, rank 4 and then rank 5
        ("prague", ["--fault", "2:1:kill", "--die-in-rebuild", "4:1:before-key", "--die-in-rebuild", "5:2:after-key"],
         [2, 4, 5]),
    ],
)  # fmt: skip
def test_quick_successive_losses_the_survivors_finish_the_fit_with_one_model(tmp_path, strategy, faults, lost):
    argv = ["--strategy", strategy, *WORKLOAD, "--hang-timeout", "3", "--json", str(tmp_path / "result.json"), *faults]
    start = time.monotonic()
    codes, logs = run_ranks(tmp_path, 6, "rebuild_faults.py", argv, timeout=60)
    survivors = [r for r in range(6) if r not in lost]
    assert [codes[r] for r in lost] == [-9] * len(lost), (codes, logs[survivors[0]][-3000:])
    assert [codes[r] for r in survivors] == [0] * len(survivors), (codes, [logs[r][-3000:] for r in survivors])
    found = [json.loads(p.read_text()) for p in tmp_path.glob("result*.json")]
    ranks = {r["rank"]: r for r in found if "params_checksum" in r}
    assert sorted(ranks) == survivors
    assert len({r["params_checksum"] for r in ranks.values()}) == 1, "one model"
    assert len({r["global_step"] for r in ranks.values()}) == 1
    for result in ranks.values():
        assert sorted(int(r) for r in result["lost_workers"]) == lost, result["lost_workers"]
    assert time.monotonic() - start < 40

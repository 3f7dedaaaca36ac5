"""A long step is slow, not dead: a step that computes for far longer than the hang bound, and one
that blocks for a while, cost no worker (real processes, the bounds scaled down: `hang_timeout` 4 s).

The full-scale case (a 30 s computing step and a 15 s blocked one with the default bounds, every
strategy) is measured in docs/fault_tolerance.md; a step that never returns is still fenced
(`test_survivors.py`).
"""

from __future__ import annotations

import json

import pytest
from helpers import run_external_ranks

import lightning_prague.demo.run  # noqa: F401  (imported once here: the ranks are forked from this process)

pytestmark = pytest.mark.timeout(200)

HANG_TIMEOUT = 4.0


@pytest.mark.parametrize("strategy", ["prague", "decent_adam"])
def test_a_step_that_computes_past_the_hang_bound_and_one_that_blocks_cost_no_worker(tmp_path, strategy):
    args = ["--strategy", strategy, "--epochs", "1", "--step-time", "0.05", "--hang-timeout", str(HANG_TIMEOUT)]
    args += ["--fault", f"2:3:compute={2 * HANG_TIMEOUT}", "--fault", f"1:4:block={0.75 * HANG_TIMEOUT}"]
    codes, logs = run_external_ranks(tmp_path, 4, *args, timeout=150)
    assert codes == [0, 0, 0, 0], (codes, logs[2][-3000:])
    results = [json.loads((tmp_path / name).read_text()) for name in ("result.json", "result.rank1.json")]
    results += [json.loads((tmp_path / f"result.rank{r}.json").read_text()) for r in (2, 3)]
    for result in results:
        assert result["lost_workers"] == {}, result["lost_workers"]
    batches = results[0]["batches_per_worker"]
    assert batches[2] > 3 and batches[1] > 4, batches  # both trained on after their long step

"""ConsensusMonitor, StragglerMonitor and SlowdownInjector: known values on constructed cases."""

from __future__ import annotations

import csv
import math
import statistics
import time
from types import SimpleNamespace

import lightning as L
import pytest
from helpers import run_core_ranks, run_training
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_prague.callbacks import SlowdownInjector, flag_slow
from lightning_prague.core.errors import ConfigurationError


def test_flag_slow_uses_a_multiple_of_the_median():
    assert flag_slow([0.03, 0.031, 0.09, 0.029], 2.0) == [2]
    assert flag_slow([0.03, 0.031, 0.05, 0.029], 2.0) == []
    assert flag_slow([], 2.0) == []


def _factors(injector, rank, n):
    out = []
    for _ in range(n):
        out.append(injector.factor(rank))
        injector.steps += 1
    return out


def test_straggler_and_homogeneous_profiles_give_exact_factors():
    straggler = SlowdownInjector(profile="straggler", slow_ranks=[2], slow_factor=3.0)
    assert _factors(straggler, 2, 5) == [3.0] * 5 and _factors(straggler, 0, 5) == [1.0] * 5
    assert _factors(SlowdownInjector(profile="homogeneous"), 1, 3) == [1.0] * 3


def test_jitter_profile_is_lognormal_with_the_given_sigma_and_reproducible():
    draws = _factors(SlowdownInjector(profile="jitter", sigma=0.5, seed=3), 1, 4000)
    logs = [math.log(f) for f in draws]
    assert abs(statistics.fmean(logs)) < 0.03 and statistics.stdev(logs) == pytest.approx(0.5, abs=0.02)
    assert draws[:20] == _factors(SlowdownInjector(profile="jitter", sigma=0.5, seed=3), 1, 20)
    assert draws[:20] != _factors(SlowdownInjector(profile="jitter", sigma=0.5, seed=3), 2, 20), "ranks differ"


def test_periodic_profile_is_slow_for_duty_of_every_period():
    injector = SlowdownInjector(profile="periodic", slow_ranks=[0], slow_factor=4.0, period=10, duty=0.3, seed=1)
    factors = _factors(injector, 0, 100)
    assert set(factors) == {1.0, 4.0} and factors.count(4.0) == 30
    for cycle in range(10):  # one slow stretch of 3 consecutive steps per cycle (cyclically)
        window = factors[cycle * 10 : cycle * 10 + 10]
        assert window.count(4.0) == 3
    assert _factors(SlowdownInjector(profile="periodic", slow_ranks=[0]), 1, 50) == [1.0] * 50


def test_padding_stretches_a_step_to_the_promised_time():
    injector = SlowdownInjector(step_time=0.02, profile="straggler", slow_ranks=[0], slow_factor=2.0)
    trainer = SimpleNamespace(global_rank=0)
    for _ in range(3):
        start = time.perf_counter()
        injector.on_train_batch_start(trainer, None, None, 0)
        time.sleep(0.005)  # "compute" shorter than the target: the injector sleeps the rest
        injector.on_before_backward(trainer, None, None)
        assert time.perf_counter() - start >= 0.04
    assert 0 < injector.slept <= 3 * 0.035 + 1e-9, "it sleeps only what the step's own work left of the target"


class _GradientClock(L.Callback):
    """Seconds from the start of each batch until its gradient exists (after the backward pass)."""

    def __init__(self) -> None:
        self.start, self.gradient_after = 0.0, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.start = time.perf_counter()

    def on_after_backward(self, trainer, pl_module):
        self.gradient_after.append(time.perf_counter() - self.start)


def test_the_gradient_exists_only_after_the_simulated_compute_time(tmp_path):
    """Padding ends the forward pass: DDP cannot all-reduce a gradient before its compute time is over."""
    clock = _GradientClock()
    injector = SlowdownInjector(step_time=0.02, profile="straggler", slow_ranks=[0], slow_factor=3.0)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=4, limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[injector, clock], default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(BoringModel())
    assert len(clock.gradient_after) == 4 and injector.steps == 4
    assert min(clock.gradient_after) >= 0.06, clock.gradient_after


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"profile": "bursty"}, "profile='bursty' is unknown"),
        ({"profile": "periodic", "period": 0}, "period=0"),
        ({"profile": "periodic", "duty": 1.5}, "duty=1.5"),
        ({"sigma": -1.0}, "sigma=-1.0"),
        ({"link_seconds_per_byte": -1.0}, "link_seconds_per_byte=-1.0"),
    ],
)
def test_bad_profiles_are_rejected(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        SlowdownInjector(**kwargs)


@pytest.mark.timeout(300)
def test_monitors_flag_a_worker_slowed_3x_and_log_consensus_to_csv(tmp_path):
    args = ["--strategy", "prague", "--devices", "4", "--epochs", "2", "--profile", "straggler", "--slow-factor", "3"]
    proc, result = run_training(
        tmp_path, *args, "--step-time", "0.03", "--monitors", "--csv-dir", str(tmp_path / "logs")
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result["stragglers"] == [0], result["worker_timings"]
    timings = result["worker_timings"]
    assert timings[0]["compute_per_step"] > 2 * max(t["compute_per_step"] for t in timings[1:])
    assert [t["batches"] for t in timings] == result["batches_per_worker"]
    assert len(result["consensus_error"]) == 2 and all(0 < e < 1 for e in result["consensus_error"])
    assert "compute ms/step" in proc.stdout and "slow (> 2x median)" in proc.stdout
    rows = list(csv.DictReader((tmp_path / "logs" / "metrics.csv").open()))
    logged = {key for row in rows for key, value in row.items() if value}
    assert {"consensus/error", "consensus/group_error", "straggler/flagged", "straggler/rank0/compute_ms"} <= logged
    group_errors = [float(r["consensus/group_error"]) for r in rows if r.get("consensus/group_error")]
    assert group_errors and all(e >= 0 for e in group_errors)


def test_monitors_write_to_tensorboard(tmp_path):
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_prague.callbacks import ConsensusMonitor, StragglerMonitor
    from lightning_prague.demo import DigitsClassifier, DigitsDataModule

    straggler = StragglerMonitor(verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=TensorBoardLogger(tmp_path, name="tb"),
        callbacks=[ConsensusMonitor(), straggler],
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_train_batches=5,
        limit_val_batches=1,
    )
    trainer.fit(DigitsClassifier(), datamodule=DigitsDataModule())
    (events,) = (tmp_path / "tb").rglob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    assert {"consensus/error", "straggler/flagged", "straggler/rank0/compute_ms", "straggler/rank0/batches"} <= tags
    assert [e.value for e in accumulator.Scalars("consensus/error")] == [0.0, 0.0], "one replica: no drift"
    assert [e.value for e in accumulator.Scalars("straggler/rank0/batches")] == [5.0, 10.0]
    assert straggler.flagged == [] and straggler.timings[0].batches == 10


def test_slow_links_delay_collectives_that_involve_them_and_overlap_hides_it(tmp_path):
    for r in run_core_ranks(tmp_path, 2, script="links_worker.py"):
        assert r["blocking"] >= 0.3, "a blocking group sum waits for the slow link"
        assert 0.3 <= r["overlapped"] < 0.55, "an overlapped exchange hides the delay behind computation"
        assert r["elsewhere"] < 0.5, "a slow worker outside the group delays nothing"


@pytest.mark.timeout(300)
def test_a_slow_link_slows_ddps_gradient_all_reduce(tmp_path):
    # the digits MLP's 36.4 KB of gradients at 5 s/MB: at least 0.17 s per step on top of the step
    args = ["--strategy", "ddp", "--devices", "3", "--epochs", "1", "--profile", "homogeneous", "--step-time", "0"]
    proc, result = run_training(tmp_path, *args, "--slow-link-rank", "1", "--link-seconds-per-mb", "5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = result["batches_per_worker"][0]
    assert result["train_seconds"] >= steps * 5 * 36392 / 2**20, result

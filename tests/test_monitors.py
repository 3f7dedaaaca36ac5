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

from lightning_prague.callbacks import SlowdownInjector, flag_slow, slowdown
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


class _FakeClock:
    """Stands in for the `time` module of `lightning_prague.callbacks.slowdown`: time moves only when
    someone sleeps (or a test says work took so long), so durations are exact on any machine."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> _FakeClock:
    fake = _FakeClock()
    monkeypatch.setattr(slowdown, "time", fake)
    return fake


def test_padding_stretches_a_step_to_the_promised_time(clock):
    injector = SlowdownInjector(step_time=0.02, profile="straggler", slow_ranks=[0], slow_factor=2.0)
    for rank, work, target in [(0, 0.005, 0.04), (0, 0.0, 0.04), (0, 0.05, 0.05), (1, 0.005, 0.02)]:
        start = clock.now
        injector.on_train_batch_start(SimpleNamespace(global_rank=rank), None, None, 0)
        clock.now += work  # the step's own forward pass
        injector.on_before_backward(SimpleNamespace(global_rank=rank), None, None)
        assert clock.now - start == pytest.approx(target), (rank, work)
    # it sleeps only what the step's own work left of the target; a step longer than it is not padded
    assert clock.sleeps == pytest.approx([0.035, 0.04, 0.015]) and injector.slept == pytest.approx(0.09)
    assert injector.steps == 4


class _GradientClock(L.Callback):
    """Fake-clock seconds from the start of each batch until its first gradient is computed (in the backward pass)."""

    def __init__(self, clock: _FakeClock) -> None:
        self.clock, self.start, self.gradient_after = clock, 0.0, []
        self._seen = True

    def on_train_start(self, trainer, pl_module):
        for p in pl_module.parameters():
            p.register_hook(self._gradient)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.start, self._seen = self.clock.perf_counter(), False

    def _gradient(self, grad):
        if not self._seen:
            self._seen = True
            self.gradient_after.append(self.clock.perf_counter() - self.start)


def test_the_gradient_exists_only_after_the_simulated_compute_time(tmp_path, clock):
    """Padding ends the forward pass: DDP cannot all-reduce a gradient before its compute time is over."""
    gradients = _GradientClock(clock)
    injector = SlowdownInjector(step_time=0.02, profile="straggler", slow_ranks=[0], slow_factor=3.0)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=4, limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[injector, gradients],
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(BoringModel())
    assert injector.steps == 4 and clock.sleeps == pytest.approx([0.06] * 4), "each step padded once, by all of it"
    # the fake clock moves only in the padding: each batch's gradient came after all of it (padding
    # after the backward pass would show 0 here)
    assert gradients.gradient_after == pytest.approx([0.06] * 4), gradients.gradient_after


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
    # a group average of replicas that each stepped on their own data: they differed, by much less than their norm
    assert group_errors and all(0 < e < 1 for e in group_errors), group_errors


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
    """What the slow link decided and where it waited, not how long a run took (see `_links_rank` below)."""
    for rank, r in enumerate(run_core_ranks(tmp_path, 2, script=__file__)):
        gossip = f"gossip round 0 of rank {rank} with ranks [0, 1]"
        # one group sum per operation, each with one decision of the slow link (none added by waiting)
        assert [e["operation"] for e in r["sums"]] == ["blocking", gossip, "elsewhere"], r["sums"]
        assert [e["operation"] for e in r["links"]] == ["blocking", gossip, "elsewhere"], r["links"]
        (blocking, overlapped, elsewhere), sums = r["links"], {e["operation"]: e for e in r["sums"]}
        # a blocking group sum with the slow worker in it waits for the slow link, in the training thread
        assert (blocking["members"], blocking["bytes"], blocking["delay"]) == ([0, 1], 4000, pytest.approx(0.25))
        assert blocking["thread"] == sums["blocking"]["thread"] == "MainThread"
        assert _took(sums["blocking"]) >= blocking["delay"], "the sum ended only after the delay"
        # an overlapped exchange pays the same delay in its communication thread, from the moment it
        # is in flight: a computation longer than the delay (0.3 s), started then, covers it; the
        # training thread waits for the round (mixes it in) only after the computation
        assert (overlapped["members"], overlapped["delay"]) == ([0, 1], pytest.approx(0.25))
        assert overlapped["thread"].startswith(f"prague-gossip-{rank}"), overlapped
        assert overlapped["after_issue"] is True, "issue() returns without waiting for the round's sum"
        assert sums[gossip]["thread"] == overlapped["thread"]
        assert _took(sums[gossip]) >= overlapped["delay"], "the delay was imposed there"
        marks = r["marks"]
        assert overlapped["at"] <= marks["computing"], (overlapped, marks)
        assert overlapped["at"] + overlapped["delay"] <= marks["computed"] <= marks["mixed"], (overlapped, marks)
        assert sums[gossip]["end"] <= marks["mixed"], "mix() waited for the round"
        assert r["gossip"] == {"round": 1, "exchanges": 1}, "the one round issued was mixed in"
        # a slow worker outside the group delays nothing
        assert (elsewhere["members"], elsewhere["delay"]) == ([0, 1], 0.0)
        assert elsewhere["thread"] == sums["elsewhere"]["thread"] == "MainThread"


def _took(call: dict) -> float:
    """Seconds a recorded call took, plus a microsecond of slack for the rounding of float clock readings."""
    return call["end"] - call["start"] + 1e-6


def _links_rank() -> None:
    """One rank of `test_slow_links_...` (this file is its script): 2 ranks on gloo, rank 1 behind a
    simulated slow link of 0.25 s for the 4000-byte tensor.

    Records every group sum (operation, thread, start and end, `time.monotonic`) and every delay the
    slow link decided (operation, thread, members, bytes, seconds, when): a blocking group sum with
    the slow link; an overlapped one (a gossip round issued, then a "computation" of 0.3 s, from when
    the round's sum has started in its thread, then mixed in); a blocking one with the slow
    worker outside the group. Writes them as JSON.
    """
    import json
    import os
    import sys
    import threading

    import torch
    import torch.distributed as dist

    from lightning_prague.callbacks.slowdown import SlowLinks, simulate_slow_links
    from lightning_prague.core import BucketedTensors, SessionConfig, init_job, make_policy, make_topology
    from lightning_prague.core.exchange.gossip import LaggedGossip
    from lightning_prague.core.exchange.worker import GroupWorker

    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sums, links, current = [], [], threading.local()
    issued = threading.Event()  # the training thread is back from issuing the overlapped round
    in_flight = threading.Event()  # the overlapped round's sum has started (in its thread)

    class RecordingLinks(SlowLinks):
        def delay(self, members, nbytes):
            seconds = super().delay(members, nbytes)
            thread = threading.current_thread()
            # in a communication thread: the training thread must get back from issue() without
            # waiting for this sum (it would time out here if issue() waited)
            after_issue = issued.wait(10) if thread is not threading.main_thread() else None
            links.append({
                "operation": current.operation, "thread": thread.name, "members": list(members), "bytes": nbytes,
                "delay": seconds, "at": time.monotonic(), "after_issue": after_issue,
            })  # fmt: skip
            if thread is not threading.main_thread():
                in_flight.set()
            return seconds

    job = init_job(rank, world, "gloo", timeout=30)
    session = job.open_session(SessionConfig(world, make_policy("random", world, 2).spec()))
    tensor = torch.ones(1000)  # 4000 bytes
    worker = GroupWorker(session, BucketedTensors([tensor]), timeout=30, job=job)
    comm = worker.comm
    group_sum = comm.sum_

    def recorded_sum(summed, members, operation="group sum"):
        current.operation = operation
        start = time.monotonic()
        complete = group_sum(summed, members, operation)
        sums.append(
            {"operation": operation, "thread": threading.current_thread().name, "start": start, "end": time.monotonic()}
        )
        return complete

    comm.sum_ = recorded_sum
    simulate_slow_links(RecordingLinks(frozenset({1}), 0.25 / 4000))  # 0.25 s for this tensor
    comm.sum_(tensor, (0, 1), "blocking")
    gossip = LaggedGossip(worker, worker.tensors, make_topology("complete", world), timeout=30, name="links")
    marks = {}
    gossip.issue()
    issued.set()
    marks["issued"] = time.monotonic()
    assert in_flight.wait(30), "the overlapped round never started its sum"
    marks["computing"] = time.monotonic()
    time.sleep(0.3)  # computation while the exchange is in flight
    marks["computed"] = time.monotonic()
    gossip.mix()
    marks["mixed"] = time.monotonic()
    result = {"marks": marks, "gossip": {"round": gossip.round, "exchanges": gossip.exchanges}}
    gossip.close()
    simulate_slow_links(RecordingLinks(frozenset({5}), 1.0))  # a slow worker outside the group
    comm.sum_(tensor, (0, 1), "elsewhere")
    simulate_slow_links(None)
    with open(out, "w") as f:
        json.dump({**result, "sums": sums, "links": links}, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_a_slow_link_slows_ddps_gradient_all_reduce(tmp_path):
    # the digits MLP's 36.4 KB of gradients at 5 s/MB: at least 0.17 s per step on top of the step
    args = ["--strategy", "ddp", "--devices", "3", "--epochs", "1", "--profile", "homogeneous", "--step-time", "0"]
    proc, result = run_training(tmp_path, *args, "--slow-link-rank", "1", "--link-seconds-per-mb", "5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = result["batches_per_worker"][0]
    assert result["train_seconds"] >= steps * 5 * 36392 / 2**20, result


if __name__ == "__main__":  # a rank of test_slow_links_... (run_core_ranks runs this file as its script)
    _links_rank()

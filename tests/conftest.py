"""Fixtures shared by the end-to-end training tests, and the rule that runs some tests alone.

The suite runs on two pytest-xdist workers (`-n 2 --dist loadfile`): most multi-process tests
wait as much as they compute, so two modules at once cut the wall time on two cores by a third. A
test that asserts how much more work fast workers did than a straggler (`serial`) measures this
machine's speed, and a second module's processes on the same cores change it: such a test, and the
fixture whose jobs it measures, run with the other worker paused (`SerialLock`).
"""

from __future__ import annotations

import fcntl
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import pytest
from helpers import CREDENTIALS, TrainingRun, run_many

from lightning_prague.core import ControlPlane
from lightning_prague.core.client.control import Session
from lightning_prague.core.plane.server import MessageServer

#: the signals whose handlers a test may change in this process (a keeper or an agent run in it)
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


@pytest.fixture(autouse=True)
def _no_watch_outlives_its_test(monkeypatch):
    """A session a test leaves open keeps its watch thread (`Session.start_watch`), which ends this
    process (`os._exit`) once the control plane it lost stays lost past its bound: minutes later, in
    whichever test runs then (a test of the plane dying left one, and the suite died with status 75
    five minutes on, once it had grown that long). Each test's watches stop at its end."""
    started: list[Session] = []
    start_watch = Session.start_watch

    def recorded(self: Session, name: str) -> None:
        started.append(self)
        start_watch(self, name)

    monkeypatch.setattr(Session, "start_watch", recorded)
    yield
    for session in started:
        session._watching.set()


@pytest.fixture(autouse=True)
def _environment_restored():
    """The environment and the signal handlers as they were before each test: a test that runs the
    package in this process (the launcher sets `LIGHTNING_PRAGUE_LAUNCH_ID`, the agent
    `LIGHTNING_PRAGUE_KEEPER`, a keeper forwards signals) must leave nothing to a later test's ranks,
    which are forked from this process (an inherited SIGUSR1 handler keeps Lightning from installing
    SLURM's requeue handler, say)."""
    saved = dict(os.environ)
    handlers = {signum: signal.getsignal(signum) for signum in _SIGNALS}
    yield
    os.environ.clear()
    os.environ.update(saved)
    for signum, handler in handlers.items():
        if signal.getsignal(signum) is not handler:
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


#: 4 CPU workers, 40 ms steps, rank 0 slowed 5x, 4 epochs of digits
STRAGGLER = ["--devices", "4", "--epochs", "4", "--profile", "straggler", "--slow-factor", "5", "--step-time", "0.04"]
STRAGGLER += ["--count-host-syncs"]  # scripts/train.py: this package's host reads of device values, per batch
#: the straggler workload's runs, with each strategy's options (after `STRAGGLER`'s: they may override them)
STRAGGLER_RUNS = {
    # DDP's result does not depend on the simulated step times: every step waits for every rank and sums
    # the same gradients in the same order, so its model is bitwise the same with or without them (the
    # same params_sha256, val_acc and val_loss); without them its run takes under a second, not ten
    "ddp": ["--step-time", "0"],
    "prague": ["--sync-dist-train-loss"],  # a per-step collective: the strategy warns and logs locally
    "partial_reduce": ["--weighting", "staleness"],
    "adpsgd": [],
    # lock-step: it runs at the straggler's pace, which none of its checks measures (10 ms steps, not 40)
    "decent_adam": ["--step-time", "0.01"],
}


@pytest.fixture(scope="session")
def straggler_runs(tmp_path_factory) -> dict[str, TrainingRun]:
    """Every strategy and Lightning's DDP on the straggler workload, in one process (ranks forked from it)."""
    root = tmp_path_factory.mktemp("straggler")
    runs = {
        name: ("train.py", ["--json", str(root / name / "result.json"), "--strategy", name, *STRAGGLER, *extra]
               + ["--start-method", "fork"])
        for name, extra in STRAGGLER_RUNS.items()
    }  # fmt: skip
    return run_many(root, runs)


@pytest.fixture(scope="session")
def ddp_reference(straggler_runs):
    """Lightning's DDP on the straggler workload: the accuracy the asynchronous strategies must match
    (run without the simulated step times, which change its duration and nothing of its result)."""
    run = straggler_runs["ddp"]
    assert run.status == 0, run.log[-3000:]
    return run.result


#: the lowest final val_acc a straggler run may reach; see `assert_learned`
MIN_VAL_ACC = 0.85
#: the most a straggler run's val_acc may fall short of DDP's; see `assert_learned`
MAX_ACC_GAP_TO_DDP = 0.08
#: the least factor by which a straggler run must cut the untrained model's val_loss; see `assert_learned`
MIN_LOSS_FACTOR = 8.0


@pytest.fixture(scope="session")
def untrained() -> dict[str, float]:
    """val_acc and val_loss of the demo's model before any step (its default seed, 0), on the same
    validation images (359 of the digits)."""
    import torch

    from lightning_prague.demo import DigitsClassifier, DigitsDataModule

    with torch.random.fork_rng():  # this process's own random state, and environment, stay as they were
        torch.manual_seed(0)
        model = DigitsClassifier().eval()
    data = DigitsDataModule()
    data.setup("fit")
    x, y = data.val_set.tensors
    with torch.no_grad():
        logits = model(x)
    return {
        "val_acc": float((logits.argmax(-1) == y).float().mean()),
        "val_loss": float(torch.nn.functional.cross_entropy(logits, y)),
    }


@pytest.fixture(scope="session")
def assert_learned(ddp_reference, untrained):
    """Checks that a run of the straggler workload learned the task about as well as DDP did.

    The asynchronous strategies' groups, and so their exact accuracy, depend on timing; on 359
    validation images one image is 0.3 points. The margins are wide enough that no run passes or
    fails by luck, and narrow enough that one that did not learn fails:

    - val_acc at least `MIN_VAL_ACC` (0.85): chance on 10 classes is 0.10, the untrained model's
      0.12, DDP's and every strategy's 0.96-0.97 on this workload; 0.85 is 40 images below;
    - val_acc at most `MAX_ACC_GAP_TO_DDP` (0.08, 29 images) below DDP's in the same session:
      several times the point or two the asynchronous runs scatter by from run to run;
    - val_loss at most the untrained model's (2.30, as uniform guessing's ln 10) / `MIN_LOSS_FACTOR`
      (8), 0.29: the trained runs end near 0.11-0.13, about half of it.
    """
    assert untrained["val_acc"] < 0.3 and untrained["val_loss"] > 2.0, untrained  # the reference is untrained

    def check(result: dict) -> None:
        acc, loss = result["val_acc"], result["val_loss"]
        facts = {"val_acc": acc, "val_loss": loss, "ddp": ddp_reference["val_acc"], "untrained": untrained}
        assert acc >= MIN_VAL_ACC, facts
        assert acc >= ddp_reference["val_acc"] - MAX_ACC_GAP_TO_DDP, facts
        assert loss <= untrained["val_loss"] / MIN_LOSS_FACTOR, facts

    return check


@pytest.fixture
def plane():
    """A control plane served from a thread of this process (in a job: the supervisor process)."""
    control = ControlPlane()
    server = MessageServer(
        control.handle, "127.0.0.1", CREDENTIALS, on_connect=control.on_connect, on_disconnect=control.on_disconnect
    )
    server.start()
    yield control, server
    server.close()


#: fixtures whose jobs' relative speeds the tests that use them assert: such tests run alone (`serial`)
SPEED_MEASURING_FIXTURES = {"straggler_runs", "step_runs"}  # (step_runs: a 5x slower rank trains least)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "serial: the test measures relative speeds; under pytest-xdist it runs with the other worker paused",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SPEED_MEASURING_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.serial)


class SerialLock:
    """Tests of every xdist worker hold a shared lock while they run; a `serial` test holds it alone.

    A `serial` test first closes a gate that no test may pass, then waits for the tests in progress
    to end: so it never waits behind a queue of the other worker's tests (writer preference). Both
    are `flock`s on files named by the test run, which the kernel releases if a worker dies."""

    def __init__(self, base: Path) -> None:
        self._gate: IO[str] = open(base.with_suffix(".gate"), "a+")  # (held for the session)
        self._lock: IO[str] = open(base.with_suffix(".lock"), "a+")

    @contextmanager
    def hold(self, alone: bool) -> Iterator[None]:
        if alone:
            fcntl.flock(self._gate, fcntl.LOCK_EX)
            fcntl.flock(self._lock, fcntl.LOCK_EX)
        else:
            fcntl.flock(self._gate, fcntl.LOCK_SH)
            fcntl.flock(self._lock, fcntl.LOCK_SH)
            fcntl.flock(self._gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(self._gate, fcntl.LOCK_UN)

    def close(self) -> None:
        for held in (self._gate, self._lock):
            held.close()
            Path(held.name).unlink(missing_ok=True)


_serial_lock: SerialLock | None = None


def pytest_unconfigure(config: pytest.Config) -> None:
    if _serial_lock is not None:
        _serial_lock.close()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # (outside pytest-timeout: the wait is no test's time)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Under pytest-xdist, each test's setup, call and teardown under the `SerialLock`."""
    global _serial_lock
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:  # one process: nothing runs beside a test
        yield
        return
    if _serial_lock is None:
        _serial_lock = SerialLock(Path(os.environ.get("TMPDIR", "/tmp")) / f"lightning-prague-tests-{run}")
    with _serial_lock.hold(item.get_closest_marker("serial") is not None):
        yield

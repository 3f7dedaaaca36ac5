"""The control plane as a service of its own (`lightning-prague plane`): rank 0's node is then like any other.

A real job of four forked workers whose store and control plane are a plane service started
beforehand (`LIGHTNING_PRAGUE_PLANE`): no rank starts a supervisor, rank 0 is killed at its 20th
batch and forked again (`max_restarts=1`); the others go on and take its duties, and its new process
rejoins through the service. Then rank 1 SIGKILLs the service at its 100th batch, and the service is
started again with the same command, as a service manager does (systemd's `Restart=always`): it takes
the job back from its journal and renews the admission's membership epoch in its new store. Plus the
address's parsing, and the secret the service and the ranks must have.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import env, free_port, run_training

from lightning_prague.core.auth import SECRET_FILE_VARIABLE, SECRET_VARIABLE
from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.plane.service import JOURNAL_NAME, PLANE_VARIABLE, plane_address

pytestmark = pytest.mark.timeout(180)

SECRET = "a-secret-of-this-test-job-0123456789"


class ManagedService:
    """A plane service run as a service manager runs one: started again, with the same command, whenever
    it ends (until `stop`)."""

    def __init__(self, command: list[str], environment: dict[str, str], log: Path) -> None:
        self.command, self.environment, self.log = command, environment, log
        self.starts = 0
        self.process = self._start()
        self._stopping = threading.Event()
        self._watch = threading.Thread(target=self._restart_when_it_ends, daemon=True)
        self._watch.start()

    def _start(self) -> subprocess.Popen:
        self.starts += 1
        with open(self.log, "a") as out:
            return subprocess.Popen(self.command, env=self.environment, stdout=out, stderr=subprocess.STDOUT)

    def _restart_when_it_ends(self) -> None:
        while not self._stopping.wait(0.2):
            if self.process.poll() is not None:
                self.process = self._start()

    def stop(self) -> None:
        self._stopping.set()
        self._watch.join(5)
        self.process.terminate()
        self.process.wait(20)


@pytest.fixture
def plane_service(tmp_path):
    """A plane service on 127.0.0.1 with the job's secret, under a service manager: yields `(the
    manager, HOST:PORT)`."""
    port, control = free_port(), free_port()
    command = [sys.executable, "-m", "lightning_prague.cli", "plane", "--host", "127.0.0.1"]  # as a user runs it
    command += ["--port", str(port), "--control-port", str(control), "--log-dir", str(tmp_path / "plane")]
    log = tmp_path / "service.log"
    manager = ManagedService(command, {**env(), SECRET_VARIABLE: SECRET}, log)
    try:
        deadline = time.monotonic() + 60
        while f"{PLANE_VARIABLE}=127.0.0.1:{port}" not in (log.read_text() if log.exists() else ""):
            if time.monotonic() > deadline or manager.starts > 1:
                pytest.fail(f"the plane service did not start:\n{log.read_text()}")
            time.sleep(0.1)
        yield manager, f"127.0.0.1:{port}"
    finally:
        manager.stop()


def test_a_job_on_a_plane_service_goes_on_without_rank_0_and_its_new_process_rejoins_there(tmp_path, plane_service):
    service, address = plane_service
    args = ["--strategy", "prague", "--devices", "4", "--epochs", "1", "--batch-size", "2", "--step-time", "0.03"]
    args += ["--profile", "homogeneous", "--fault", "0:20:kill", "--max-restarts", "1", "--hang-timeout", "10"]
    args += ["--start-method", "fork", "--fault", "1:100:kill-plane"]
    proc, result = run_training(tmp_path, *args, timeout=150, **{PLANE_VARIABLE: address, SECRET_VARIABLE: SECRET})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "the supervisor (pid" not in proc.stderr  # no rank started one: the service is the job's plane
    assert not list(tmp_path.glob("lightning_prague_logs/supervisor-*.log"))
    ranks = {r["rank"]: r for r in (json.loads(p.read_text()) for p in tmp_path.glob("result*.json"))}
    assert sorted(ranks) == [0, 1, 2, 3], proc.stderr[-4000:]
    assert service.starts == 2  # killed by rank 1, and started again by its manager
    assert all(r["supervisor_pid"] == service.process.pid for r in ranks.values())  # every rank's plane: the service
    assert ranks[0]["restarts"] == 1 and ranks[0]["batches_this_process"] > 0  # it rejoined through the service
    assert "rejoined the job inside the epoch" in proc.stderr
    assert proc.stderr.count("reconnected to the control plane") == 4, proc.stderr[-4000:]  # every rank came back
    assert "in the new store" in proc.stderr  # the admission's membership epoch, renewed
    # every batch trained once: the 19 of the killed process, and the rest by the others and its successor
    assert sum(r["batches_this_process"] for r in ranks.values()) + 19 == 719, {
        r: ranks[r]["batches_this_process"] for r in ranks
    }
    assert len({r["params_sha256"] for r in ranks.values()}) == 1
    assert service.process.poll() is None  # it serves on, for the job's next fit
    assert (tmp_path / "plane" / JOURNAL_NAME).exists()


def test_a_rank_without_the_secret_is_told_that_the_plane_service_needs_it(monkeypatch):
    from lightning_prague.core.job import init_job

    monkeypatch.delenv(SECRET_VARIABLE, raising=False)
    monkeypatch.delenv(SECRET_FILE_VARIABLE, raising=False)
    with pytest.raises(ConfigurationError, match="the plane service at planehost:29400 needs the job's secret"):
        init_job(1, 4, "gloo", 10.0, plane=("planehost", 29400), rejoin=False)


def test_the_plane_service_refuses_to_start_without_a_secret_of_the_users(monkeypatch):
    from lightning_prague.core.plane import service

    monkeypatch.delenv(SECRET_VARIABLE, raising=False)
    monkeypatch.delenv(SECRET_FILE_VARIABLE, raising=False)
    with pytest.raises(SystemExit, match="a plane service never hands out a secret of its own"):
        service.main(["--port", str(free_port())])


@pytest.mark.parametrize(
    "option,variable,expected",
    [
        (None, None, None),
        ("planehost:29400", None, ("planehost", 29400)),
        (None, "10.0.0.5:29400", ("10.0.0.5", 29400)),
        (None, "[fd00::5]:29400", ("fd00::5", 29400)),
        ("planehost:29400", "planehost:29400", ("planehost", 29400)),
    ],
)
def test_the_plane_service_address_comes_from_the_option_or_the_environment(monkeypatch, option, variable, expected):
    if variable is None:
        monkeypatch.delenv(PLANE_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(PLANE_VARIABLE, variable)
    assert plane_address(option) == expected


@pytest.mark.parametrize(
    "option,variable,match",
    [
        ("planehost", None, "must be HOST:PORT"),
        ("planehost:0", None, "must be HOST:PORT"),
        (None, ":29400", "LIGHTNING_PRAGUE_PLANE=':29400'"),
        ("a:1", "b:1", "name different plane services"),
    ],
)
def test_a_plane_service_address_that_is_none_is_refused_by_name(monkeypatch, option, variable, match):
    if variable is None:
        monkeypatch.delenv(PLANE_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(PLANE_VARIABLE, variable)
    with pytest.raises(ConfigurationError, match=match):
        plane_address(option)

"""The control plane as a service of its own (`lightning-prague plane`): rank 0's node is then like any other.

A real job of four forked workers whose store and control plane are a plane service started
beforehand (`LIGHTNING_PRAGUE_PLANE`): no rank starts a supervisor, rank 0 is killed at its 20th
batch and forked again (`max_restarts=1`); the others go on and take its duties, and its new process
rejoins through the service. Plus the address's parsing, and the secret the service and the ranks
must have.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import env, free_port, run_training

from lightning_prague.core.auth import SECRET_FILE_VARIABLE, SECRET_VARIABLE
from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.plane.service import PLANE_VARIABLE, plane_address

pytestmark = pytest.mark.timeout(180)

SECRET = "a-secret-of-this-test-job-0123456789"


@pytest.fixture
def plane_service(tmp_path):
    """A plane service on 127.0.0.1 with the job's secret: yields `(its process, HOST:PORT)`."""
    port, control = free_port(), free_port()
    command = [sys.executable, "-m", "lightning_prague.cli", "plane", "--host", "127.0.0.1"]  # as a user runs it
    command += ["--port", str(port), "--control-port", str(control), "--log-dir", str(tmp_path / "plane")]
    environment = {**env(), SECRET_VARIABLE: SECRET}
    service = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        for line in service.stdout:  # its log, then the line that says where it serves
            seen.append(line)
            if f"{PLANE_VARIABLE}=127.0.0.1:{port}" in line:
                break
        else:
            pytest.fail(f"the plane service ended with status {service.wait(10)}:\n{''.join(seen)}")
        yield service, f"127.0.0.1:{port}"
    finally:
        service.terminate()
        service.wait(20)


def test_a_job_on_a_plane_service_goes_on_without_rank_0_and_its_new_process_rejoins_there(tmp_path, plane_service):
    service, address = plane_service
    args = ["--strategy", "prague", "--devices", "4", "--epochs", "1", "--batch-size", "4", "--step-time", "0.05"]
    args += ["--profile", "homogeneous", "--fault", "0:20:kill", "--max-restarts", "1", "--hang-timeout", "10"]
    args += ["--start-method", "fork"]
    proc, result = run_training(tmp_path, *args, timeout=150, **{PLANE_VARIABLE: address, SECRET_VARIABLE: SECRET})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "the supervisor (pid" not in proc.stderr  # no rank started one: the service is the job's plane
    assert not list(tmp_path.glob("lightning_prague_logs/supervisor-*.log"))
    ranks = {r["rank"]: r for r in (json.loads(p.read_text()) for p in tmp_path.glob("result*.json"))}
    assert sorted(ranks) == [0, 1, 2, 3], proc.stderr[-4000:]
    assert all(r["supervisor_pid"] == service.pid for r in ranks.values())  # every rank's plane: the service
    assert ranks[0]["restarts"] == 1 and ranks[0]["batches_this_process"] > 0  # it rejoined through the service
    assert "rejoined the job inside the epoch" in proc.stderr
    # every batch trained once: the 19 of the killed process, and the rest by the others and its successor
    assert sum(r["batches_this_process"] for r in ranks.values()) + 19 == 360, {
        r: ranks[r]["batches_this_process"] for r in ranks
    }
    assert len({r["params_sha256"] for r in ranks.values()}) == 1
    assert service.poll() is None  # it serves on, for the job's next fit


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
